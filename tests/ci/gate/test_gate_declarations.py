"""register_ci_gate(...) declarations, read from the syntax tree like registrations: every rule
has a failing fixture with its exact file:line (tests/ci/fixtures/gate), the good fixtures come
back with their defaults, `mizzen-ci validate` reports them (and the quarantine list's rules),
and the repository's own gates are valid."""

from __future__ import annotations

import datetime as dt
import shutil
from pathlib import Path

from mizzen_ci import register_cpu_ci
from mizzen_ci.fleet import load_fleet
from mizzen_ci.gate.declarations import Gate, file_gates, read_declarations
from mizzen_ci.gate.validation import gate_violations
from mizzen_ci.gate.vocabulary import load_vocabulary

register_cpu_ci(est_time=5, labels=["ci"])


def expected(root: Path) -> set[tuple[str, int, str]]:
    rows = set()
    for ln in (root / "expected-errors.txt").read_text().splitlines():
        if ln and not ln.startswith("#"):
            where, rule = ln.rsplit(": ", 1)
            path, line = where.rsplit(":", 1)
            rows.add((path, int(line), rule))
    return rows


def test_every_bad_fixture_fails_with_its_rule_at_its_line(gate_fixtures):
    found = read_declarations(gate_fixtures, load_vocabulary(gate_fixtures))
    assert {(v.path, v.line, v.rule) for v in found.violations} == expected(gate_fixtures)
    assert not any(p.startswith("tests/bad/") for p in found.gates)  # an error: no gate at all
    for v in found.violations:
        assert str(v).startswith(f"{v.path}:{v.line}: [{v.rule}] ") and v.fix


def test_good_fixtures_come_back_with_their_defaults(gate_fixtures):
    gates = read_declarations(gate_fixtures, load_vocabulary(gate_fixtures)).gates
    assert sorted(gates) == ["tests/good/test_full.py", "tests/good/test_minimal.py"]
    full = gates["tests/good/test_full.py"]
    assert full == [
        Gate("tests/good/test_full.py", 4, "eval/score", "higher", 0.1, (20, 40), 0.05),
        Gate("tests/good/test_full.py", 5, "eval/loss", "lower", 0.0, "all", 0.01),
        Gate("tests/good/test_full.py", 12, "perf/tokens_per_s", "both", 0.25, "last", 0.0,
             False, "noisy on shared hosts"),
    ]  # fmt: skip
    (minimal,) = gates["tests/good/test_minimal.py"]
    assert (minimal.steps, minimal.floor, minimal.enforce, minimal.reason) == (
        "last",
        0.0,
        True,
        None,
    )


def test_a_file_is_parsed_only_when_it_spells_the_gate(gate_fixtures):
    vocabulary = load_vocabulary(gate_fixtures)
    assert file_gates(b"register_cpu_ci(est_time=1)\n", "tests/t/test_x.py", vocabulary) == ([], [])
    assert file_gates(b"\x00 not python register_ci_gate(", "tests/t/test_x.py", vocabulary) == (
        [],
        [],
    )  # a syntax error is the registry's to report
    nested = b"def f():\n    register_ci_gate(metric='eval/loss', direction='lower', tolerance=1)\n"
    gates, errors = file_gates(nested, "tests/t/test_x.py", vocabulary)
    assert gates == [] and [(e.line, e.rule) for e in errors] == [(2, "gate-nested")]


def test_validate_reports_gate_and_quarantine_errors(gate_fixtures, mizzen_ci, tmp_path):
    out = mizzen_ci("validate", "--root", str(gate_fixtures))
    assert out.returncode == 1
    for path, line, rule in expected(gate_fixtures):
        assert f"{path}:{line}: [{rule}]" in out.stderr
    # the fixture's quarantine entry names a gated file on a known arch: only its expiry, when
    # judged from far enough after it, can make it wrong — its rules run on the working tree
    tree = tmp_path / "tree"
    shutil.copytree(gate_fixtures, tree)
    shutil.rmtree(tree / "tests" / "bad")
    (tree / "ci" / "quarantine.toml").write_text(
        '[[quarantine]]\nfile = "tests/good/test_no_gate.py"\narch = "cpu"\nreason = "r"\n'
        "expires = 2026-12-02\n\n"
        '[[quarantine]]\nfile = "tests/good/test_full.py"\narch = "tpu"\nreason = "r"\n'
        "expires = 2099-01-01\n\n"
        '[[quarantine]]\nfile = "tests/good/test_full.py"\narch = "cpu"\nreason = ""\n'
        "expires = 2026-12-02\n"
    )
    out = mizzen_ci("validate", "--root", str(tree))
    assert out.returncode == 1, out.stderr
    assert (
        "ci/quarantine.toml:1: [quarantine] tests/good/test_no_gate.py declares no metric gate"
        in out.stderr
    )
    assert "ci/quarantine.toml:7: [quarantine] unknown arch 'tpu'" in out.stderr
    assert (
        "ci/quarantine.toml:7: [quarantine] expires 2099-01-01, more than 90 days ahead"
        in out.stderr
    )
    assert "ci/quarantine.toml:13: [quarantine] `reason`" in out.stderr
    (tree / "ci" / "quarantine.toml").write_text("")
    assert mizzen_ci("validate", "--root", str(tree)).returncode == 0


def test_a_broken_vocabulary_is_one_line_and_exit_2(gate_fixtures, mizzen_ci, tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(gate_fixtures, tree)
    (tree / "ci" / "metrics.toml").write_text('[metrics."Bad Name"]\ndescription = "x"\n')
    out = mizzen_ci("validate", "--root", str(tree))
    assert out.returncode == 2 and "metrics.toml: metric name 'Bad Name'" in out.stderr
    assert "Traceback" not in out.stderr


def test_the_repositorys_gates_are_valid(repo_root):
    fleet = load_fleet(repo_root / "ci" / "fleet.toml")
    found = read_declarations(repo_root, load_vocabulary(repo_root))
    assert found.violations == []
    assert {g.metric for g in found.gates["tests/train/sft/test_sft_e2e.py"]} == {
        "eval/score",
        "eval/heldout_loss",
    }
    assert "tests/train/sft/test_sft_e2e_gpu.py" in found.gates
    assert gate_violations(repo_root, fleet, found.gates, today=dt.date(2026, 12, 1)) == []
