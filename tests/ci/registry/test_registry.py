"""The registry reader: every rule has a failing fixture (with its exact file:line) and a passing one;
discovery; a property test that random source never makes the reader raise anything but its own
errors."""

from __future__ import annotations

import ast
import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mizzen_ci import register_cpu_ci
from mizzen_ci.fleet import load_fleet
from mizzen_ci.registry import Registration, Violation, discover, read_registry, read_source
from mizzen_ci.registry import rules as registry_rules
from mizzen_ci.registry import syntax as registry_syntax
from mizzen_ci.registry.syntax import SIGNATURES

register_cpu_ci(est_time=15, labels=["ci"])

FIXTURES = Path(__file__).parents[1] / "fixtures" / "registry"
FLEET = load_fleet(FIXTURES / "fleet.toml")


def expected_bad_errors() -> set[tuple[str, int, str]]:
    """(file, line, rule) of every error the bad tree must produce, from its expected-errors.txt."""
    rows = set()
    for ln in (FIXTURES / "bad" / "expected-errors.txt").read_text().splitlines():
        if ln and not ln.startswith("#"):
            where, rule = ln.rsplit(": ", 1)
            path, line = where.rsplit(":", 1)
            rows.add((path, int(line), rule))
    return rows


EXPECTED_BAD = expected_bad_errors()
assert len(EXPECTED_BAD) == 38, "one row per bad fixture file (two rules share none)"


def test_every_bad_fixture_fails_with_its_rule_at_its_line():
    registry = read_registry(FIXTURES / "bad", FLEET)
    got = {(e.path, e.line, e.rule) for e in registry.violations}
    assert got == EXPECTED_BAD
    assert registry.registrations == []  # a file with an error yields no registration


def test_every_bad_file_is_reported_in_one_run():
    bad_files = {p for p, _, _ in EXPECTED_BAD}
    registry = read_registry(FIXTURES / "bad", FLEET)
    assert {e.path for e in registry.violations} == bad_files
    for e in registry.violations:
        assert str(e).startswith(f"{e.path}:{e.line}: [{e.rule}] ")
        assert "Fix: " in str(e) and e.fix


def test_good_fixtures_pass_with_defaults_filled_in():
    registry = read_registry(FIXTURES / "good", FLEET)
    assert registry.violations == []
    regs = registry.by_path()
    assert sorted(regs) == [
        "tests/deep/nested/folder/test_gpu_two.py",
        "tests/test_ampere_and_hopper.py",
        "tests/test_cpu_full.py",
        "tests/test_cpu_minimal.py",
        "tests/test_disabled.py",
        "tests/test_gpu_attribute.py",
        "tests/test_gpu_rdma.py",
        "tests/test_gpu_shares.py",
    ]
    assert regs["tests/test_cpu_minimal.py"] == Registration(
        path="tests/test_cpu_minimal.py", line=3, backend="cpu", est_time=5.0
    )
    two = regs["tests/deep/nested/folder/test_gpu_two.py"]
    assert (two.backend, two.hardware, two.num_gpus, two.labels, two.line) == (
        "cuda",
        ("hopper", "blackwell"),
        2,
        ("lora",),
        3,
    )
    assert regs["tests/test_gpu_attribute.py"].num_gpus == 1  # default from the signature
    assert regs["tests/test_gpu_shares.py"].shares_gpu is True
    assert not any(r.shares_gpu for p, r in regs.items() if p != "tests/test_gpu_shares.py")
    assert regs["tests/test_gpu_rdma.py"].needs == ("rdma",)
    assert regs["tests/test_disabled.py"].disabled == "waiting on upstream fix"
    assert not regs["tests/test_disabled.py"].enabled
    assert regs["tests/test_cpu_full.py"].nightly is True


def test_rules_are_derived_from_the_register_signatures():
    cpu_positional, cpu = SIGNATURES["register_cpu_ci"]
    cuda_positional, cuda = SIGNATURES["register_cuda_ci"]
    assert cpu_positional == cuda_positional == ["est_time"]
    assert set(cpu) == {"est_time", "labels", "nightly", "disabled", "watches"}
    assert set(cuda) == {
        "est_time",
        "hardware",
        "num_gpus",
        "labels",
        "needs",
        "nightly",
        "disabled",
        "watches",
        "shares_gpu",
    }


def test_discovery_finds_nested_files_and_skips_venvs_hidden_and_excluded(tmp_path: Path):
    for rel in [
        "tests/a/b/c/test_deep.py",
        "tests/test_top.py",
        "tests/conftest.py",
        "tests/helper.py",
        "tests/data/test_excluded.py",
        "tools/test_outside.py",
        ".venv/lib/test_in_venv.py",
        "venv2/lib/test_in_unmarked_venv.py",
        "node_modules/x/test_js.py",
        ".git/test_hidden.py",
    ]:
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("")
    (tmp_path / "venv2" / "pyvenv.cfg").write_text("home = /usr\n")
    assert discover(tmp_path, ["tests/data"]).test_files == [
        "tests/a/b/c/test_deep.py",
        "tests/test_top.py",
        "tools/test_outside.py",
    ]


def test_the_repository_itself_registers_every_test_file(repo_root):
    registry = read_registry(repo_root, load_fleet(repo_root / "ci" / "fleet.toml"))
    assert [str(e) for e in registry.violations] == []
    assert "tests/ci/registry/test_registry.py" in registry.by_path()
    assert not any(p.startswith("tests/ci/fixtures/") for p in registry.by_path())


# ----------------------------------------------------------------------------------------------
# Property: the reader accepts or raises its own error with file:line — never anything else.

_values = st.recursive(
    st.one_of(
        st.integers(-5, 10**6).map(str),
        st.floats(allow_nan=True, allow_infinity=True).map(repr),
        st.sampled_from(
            [
                "True",
                "False",
                "None",
                "x",
                "f'{x}'",
                "'hopper'",
                "'lora'",
                "'rdma'",
                "''",
                "b'x'",
                "1j",
                "...",
                "lambda: 0",
                "-0.0",
                "1e999",
                "'x' * 3",
                "9" * 400,  # huge literals: an error, never an OverflowError
                "1.6e308",
                "1e308",
                "604801",
                "'\\u200b'",
            ]
        ),
        st.text(string.ascii_letters + " _-", max_size=8).map(repr),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4).map(lambda xs: "[" + ", ".join(xs) + "]"),
        st.lists(inner, max_size=3).map(lambda xs: "(" + "".join(x + ", " for x in xs) + ")"),
        st.lists(inner, max_size=2).map(lambda xs: "{" + ", ".join(f"{x}: {x}" for x in xs) + "}"),
    ),
    max_leaves=6,
)
_names = st.sampled_from(
    [
        "est_time",
        "hardware",
        "num_gpus",
        "labels",
        "needs",
        "nightly",
        "disabled",
        "gpus",
        "timeout",
    ]
)
_argument = st.one_of(
    st.tuples(_names, _values).map(lambda kv: f"{kv[0]}={kv[1]}"),
    _values,
    st.sampled_from(["*args", "**kw"]),
)
_call = st.tuples(
    st.sampled_from(
        ["register_cpu_ci", "register_cuda_ci", "mizzen_ci.register_cuda_ci", "reg", "other"]
    ),
    st.lists(_argument, max_size=6),
).map(lambda t: f"{t[0]}({', '.join(t[1])})")
_statement = st.one_of(
    _call,
    _call.map(lambda c: f"def f():\n    {c}"),
    _call.map(lambda c: f"if x:\n    {c}"),
    _call.map(lambda c: f"class C:\n    {c}"),
    st.sampled_from(
        [
            "from mizzen_ci import register_cpu_ci, register_cuda_ci",
            "from mizzen_ci import register_cpu_ci as reg",
            "import mizzen_ci",
            "x = register_cpu_ci",
            "def test_x():\n    pass",
            "# register_cuda_ci(est_time=1)",
            "def broken(:",
            "\x00",
            "(((((((((((((((((((((((((((((((",
        ]
    ),
    st.text(max_size=20),
)
_source = st.lists(_statement, max_size=5).map("\n".join)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(source=_source)
def test_random_source_is_accepted_or_rejected_with_file_and_line(source: str):
    n_lines = source.count("\n") + 1
    registration, errors = read_source(source, "tests/test_fuzz.py", FLEET)
    if errors:
        assert registration is None
        for e in errors:
            assert isinstance(e, Violation)
            assert e.path == "tests/test_fuzz.py"
            assert isinstance(e.line, int) and 1 <= e.line <= n_lines + 1
            assert e.rule and e.message and e.fix
    else:
        assert isinstance(registration, Registration)
        assert registration.backend in ("cpu", "cuda")
        assert 0 < registration.est_time <= registry_rules.MAX_EST_TIME_SECONDS
        assert registration.num_gpus <= registry_rules.MAX_NUM_GPUS


@pytest.mark.parametrize(
    "source",
    [
        b"\xff\xfe not utf-8 register_cpu_ci(1)",
        "register_cpu_ci(est_time=1e999)",
        "register_cpu_ci(est_time=" + "[" * 200 + "]" * 200 + ")",
        "register_cpu_ci(est_time=" + "9" * 5000 + ")",
    ],
)
def test_hostile_inputs_become_registry_errors(source):
    registration, errors = read_source(source, "tests/test_x.py", FLEET)
    assert registration is None and errors and all(isinstance(e, Violation) for e in errors)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(source=_source)
def test_the_use_scan_skips_the_tree_walk_only_when_a_walk_finds_nothing_more(source: str):
    """The registry walks the whole tree for nested or aliased uses only when the source spells a
    register name more often than its top-level statements explain; the answer is the same."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    for text in (source, source.encode()):
        assert registry_syntax._tree_syntax(tree, text) == registry_syntax._tree_syntax(
            tree, text, walk=True
        )


def test_validate_of_plain_syntax_equals_read_source():
    """What a cache keeps (``RegistrationSyntax.plain()``) validates to the same answer."""
    for path in sorted((FIXTURES / "bad" / "tests").rglob("test_*.py")):
        source = path.read_bytes()
        rel = path.relative_to(FIXTURES / "bad").as_posix()
        plain = registry_syntax.registration_syntax(source).plain()
        got = registry_rules.validate(plain, rel, FLEET)
        want = read_source(source, rel, FLEET)
        assert got[0] == want[0] and [str(e) for e in got[1]] == [str(e) for e in want[1]]
