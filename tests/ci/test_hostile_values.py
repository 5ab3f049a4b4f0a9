"""Hostile values: numbers and strings that a test file, a history store or a plan file can spell
are bounded before anything computes with them — an error naming file:line (or path:line, or the
field) and the fix, never an OverflowError, a traceback, a 307-digit timeout or a dropped store."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mizzen_ci import history, register_cpu_ci
from mizzen_ci.fleet import load_fleet
from mizzen_ci.plan import Plan
from mizzen_ci.plan.change import Change
from mizzen_ci.plan.model import PlanError
from mizzen_ci.plan.pipeline import PlanOptions, build_plan
from mizzen_ci.plan.request import Inputs, RequestError
from mizzen_ci.registry import read_registry, read_source
from mizzen_ci.registry.rules import MAX_EST_TIME_SECONDS, MAX_NUM_GPUS, MAX_REASON_CHARS

register_cpu_ci(est_time=20, labels=["ci"])

REPO = Path(__file__).resolve().parents[2]
CI_SRC = REPO / "ci" / "src"
FLEET_FILE = Path(__file__).parent / "fixtures" / "registry" / "fleet.toml"
FLEET = load_fleet(FLEET_FILE)
CPU = "from mizzen_ci import register_cpu_ci\nregister_cpu_ci({args})\n"
CUDA = "from mizzen_ci import register_cuda_ci\nregister_cuda_ci({args})\n"
NIGHTLY = Inputs(event="schedule", cadence="nightly")


def registration(source: str):
    return read_source(source, "tests/test_x.py", FLEET)


# ----------------------------------------------------------------------------------------------
# est_time and num_gpus: bounded, errors for people, never an overflow


@pytest.mark.parametrize(
    "literal",
    ["9" * 400, "1.6e308", "1e308", "1e999", str(MAX_EST_TIME_SECONDS + 1), "604800.5", "0", "-1"],
)
def test_est_time_out_of_range_is_a_registry_error_not_a_crash(literal: str):
    reg, errors = registration(CPU.format(args=f"est_time={literal}, labels=['ci']"))
    assert reg is None
    (e,) = errors
    assert (e.path, e.line, e.rule) == ("tests/test_x.py", 2, "est-time")
    assert len(str(e)) < 400  # a 400-digit literal is described, not echoed
    assert "Fix: " in str(e)


def test_est_time_up_to_the_ceiling_is_accepted():
    reg, errors = registration(CPU.format(args=f"est_time={MAX_EST_TIME_SECONDS}, labels=['ci']"))
    assert errors == [] and reg.est_time == MAX_EST_TIME_SECONDS


@pytest.mark.parametrize("literal", [str(MAX_NUM_GPUS + 1), "10" * 200, "0"])
def test_num_gpus_is_bounded_and_a_huge_one_is_not_echoed(literal: str):
    args = f"est_time=1, hardware=['hopper'], num_gpus={literal}, labels=['lora']"
    reg, errors = registration(CUDA.format(args=args))
    assert reg is None and [e.rule for e in errors] == ["num-gpus"]
    assert f"from 1 to {MAX_NUM_GPUS}" in errors[0].message and len(errors[0].message) < 200


def test_a_label_list_of_a_hundred_thousand_names_is_checked_in_linear_time():
    labels = ", ".join(f"'l{i}'" for i in range(100_000))
    reg, errors = registration(CPU.format(args=f"est_time=1, labels=[{labels}]"))
    assert reg is None and [e.rule for e in errors] == ["label-unknown"]
    assert len(errors[0].message) < 1200 and "more" in errors[0].message


def write_tree(root: Path, files: dict[str, str]) -> None:
    (root / "ci").mkdir(parents=True, exist_ok=True)
    (root / "ci" / "fleet.toml").write_text(FLEET_FILE.read_text())
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def nightly_plan(root: Path, **options) -> Plan:
    change = Change.unusable("no git in this test", None, None)
    return build_plan(root, FLEET, change, NIGHTLY, PlanOptions(**options))


@pytest.mark.parametrize("literal", ["1e308", "1.6e308", "9" * 400])
def test_the_plan_of_a_huge_est_time_lists_the_error_and_every_timeout_is_small(tmp_path, literal):
    write_tree(
        tmp_path,
        {
            "tests/test_huge.py": CPU.format(args=f"est_time={literal}, labels=['ci']"),
            "tests/test_ok.py": CPU.format(args="est_time=30, labels=['ci']"),
        },
    )
    plan = nightly_plan(tmp_path)
    assert any("tests/test_huge.py:2: [est-time]" in e for e in plan.errors)
    assert [t.file for j in plan.jobs for t in j.tests] == ["tests/test_ok.py"]
    assert all(j.timeout_minutes < 10**4 for j in plan.jobs)
    assert Plan.from_json(json.loads(plan.dumps())) == plan  # what the lanes read back


@pytest.mark.parametrize("budget", [math.inf, math.nan, -1.0, 1e300])
def test_a_budget_that_is_not_a_bounded_number_is_a_request_error(tmp_path, budget):
    write_tree(tmp_path, {"tests/test_ok.py": CPU.format(args="est_time=30, labels=['ci']")})
    with pytest.raises(RequestError, match="job budget must be a finite number"):
        nightly_plan(tmp_path, budget_seconds=budget)


# ----------------------------------------------------------------------------------------------
# disabled=: a visible, short, printable reason


@pytest.mark.parametrize(
    "reason, shows",
    [
        ("'\\u200b'", "only invisible characters"),
        ("' \\u2060\\ufeff '", "only invisible characters"),
        ("'   '", "visible reason"),
        (repr("x" * (MAX_REASON_CHARS + 1)), f"over {MAX_REASON_CHARS}"),
        ("'flaky\\n::error::pwned'", "U+000A"),
        ("'issue 7 \\u202egnp.exe'", "U+202E"),
        ("'tab\\there'", "U+0009"),
    ],
)
def test_an_invisible_or_unprintable_disabled_reason_is_refused(reason: str, shows: str):
    reg, errors = registration(CPU.format(args=f"est_time=1, labels=['ci'], disabled={reason}"))
    assert reg is None and [e.rule for e in errors] == ["disabled-reason"]
    assert shows in errors[0].message


@pytest.mark.parametrize(
    "reason", ["flaky on NCCL 2.27, issue #123", "不安定 (issue 9)", "x" * 300]
)
def test_a_printable_disabled_reason_is_kept(reason: str):
    reg, errors = registration(CPU.format(args=f"est_time=1, labels=['ci'], disabled={reason!r}"))
    assert errors == [] and reg.disabled == reason


# ----------------------------------------------------------------------------------------------
# History stores: bad rows dropped with path:line, good rows kept, never a crash

GOOD_ROW = {
    "file": "tests/test_ok.py",
    "arch": None,
    "seconds": 42.0,
    "outcome": "passed",
    "when": "2026-11-01T00:00:00+00:00",
    "lane": "cpu",
}


def row(**changes) -> str:
    return json.dumps({**GOOD_ROW, **changes})


BAD_ROWS = [
    ('{"file": "tests/test_ok.py", "arch": null, "seconds": 1' + "0" * 400 + ', "outcome": '
     '"passed", "when": "t", "lane": "cpu"}', "seconds must be a finite number"),
    (row(seconds=1e300), "seconds must be a finite number"),
    (row().replace("42.0", "NaN"), "seconds must be a finite number"),
    (row().replace("42.0", "Infinity"), "seconds must be a finite number"),
    (row(seconds=-1), "seconds must be a finite number"),
    (row(seconds=MAX_EST_TIME_SECONDS + 1), "seconds must be a finite number"),
    (row(seconds="42"), "seconds must be a finite number"),
    (row(seconds=True), "seconds must be a finite number"),
    (row(file="x" * 1_000_000), "over 16384"),
    (row(file="x" * 20_000)[:16_000] + "...", "not JSON"),
    (row(file=["tests/test_ok.py"]), "wrong type"),
    (row(arch="h" * 100), "over 64"),
    ('{"file": ' + "[" * 5000 + "]" * 5000 + "}", "not usable JSON"),
    ('{"seconds": ' + "9" * 5000 + "}", "not usable JSON"),
    ("[1, 2]", "must be a JSON object"),
    (row(outcome="ok"), "outcome 'ok'"),
]  # fmt: skip


def test_bad_history_rows_are_dropped_with_path_and_line_and_good_rows_kept(tmp_path: Path):
    store = tmp_path / "h" / "cpu.jsonl"
    store.parent.mkdir()
    store.write_text("\n".join([row()] + [line for line, _ in BAD_ROWS] + [row(seconds=7)]) + "\n")
    records, problems = history.read_stores(tmp_path / "h")
    assert [r.seconds for r in records] == [42.0, 7.0]
    assert len(problems) == len(BAD_ROWS)
    for lineno, ((_, expected), problem) in enumerate(zip(BAD_ROWS, problems, strict=True), 2):
        assert problem.startswith(f"{store}:{lineno}: ") and expected in problem, problem
        assert len(problem) < 400
    with pytest.raises(history.HistoryError, match=r"cpu\.jsonl:2: "):
        history.load(store)  # the strict reader names the first bad line


def test_the_plan_and_its_estimator_keep_the_good_rows_and_warn_with_path_and_line(tmp_path):
    write_tree(tmp_path, {"tests/test_ok.py": CPU.format(args="est_time=30, labels=['ci']")})
    store = tmp_path / "h.jsonl"
    store.write_text(BAD_ROWS[0][0] + "\n" + row(seconds=600) + "\n" + row().replace("42.0", "NaN"))
    plan = nightly_plan(tmp_path, history=(store,))
    (t,) = [t for j in plan.jobs for t in j.tests]
    assert (t.estimate, t.est_seconds) == ("history", 600.0)
    (warning,) = [w for w in plan.warnings if "duration history" in w]
    assert f"{store}:1: " in warning and f"{store}:3: " in warning and "2 bad line(s)" in warning


def test_history_merge_drops_bad_rows_on_stderr_and_keeps_the_rest(tmp_path: Path):
    store = tmp_path / "in.jsonl"
    store.write_text(BAD_ROWS[0][0] + "\n" + row() + "\n")
    out = tmp_path / "merged.jsonl"
    proc = subprocess.run(
        [sys.executable, "-S", "-m", "mizzen_ci", "history", "merge", "--out", str(out), str(store)],
        env={"PATH": os.environ["PATH"], "PYTHONPATH": str(CI_SRC)},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and f"dropped {store}:1: seconds" in proc.stderr
    assert [r.seconds for r in history.load(out)] == [42.0]


def test_flake_record_lines_that_are_not_records_are_dropped_with_path_and_line(tmp_path: Path):
    record = tmp_path / "flakes.jsonl"
    good = json.dumps({"file": "tests/test_a.py", "arch": "hopper", "class": "nccl-timeout"})
    record.write_text("\n".join([good, "[]", '{"file": 1, "arch": "hopper"}', "{", good]) + "\n")
    counts, problems = history.read_flakes(record)
    assert counts == {("tests/test_a.py", "hopper"): 2}
    assert [p.split(": ", 1)[0] for p in problems] == [f"{record}:{n}" for n in (2, 3, 4)]


@pytest.mark.parametrize("time", ["1e999", "nan", "-5", "inf", str(10 * MAX_EST_TIME_SECONDS)])
def test_a_junit_time_that_is_not_a_bounded_number_never_becomes_a_record(tmp_path, time):
    xml = tmp_path / "junit.xml"
    xml.write_text(
        f'<testsuites><testsuite><testcase classname="tests.test_a" name="t" time="{time}"/>'
        "</testsuite></testsuites>"
    )
    with pytest.raises(history.HistoryError, match="time="):
        history.records_from_junit(xml, arch=None, lane="cpu")


# ----------------------------------------------------------------------------------------------
# Plan files read by the lanes


def plan_json(tmp_path: Path) -> dict:
    write_tree(tmp_path, {"tests/test_ok.py": CPU.format(args="est_time=30, labels=['ci']")})
    return json.loads(nightly_plan(tmp_path).dumps())


@pytest.mark.parametrize(
    "text, expected",
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deep"),
        ('{"version": 1, "budget_seconds": ' + "9" * 5000 + "}", "cannot read the plan"),
        (b"\xff\xfe{}", "cannot read the plan"),
    ],
)
def test_a_hostile_plan_file_is_a_plan_error(tmp_path: Path, text, expected):
    path = tmp_path / "plan.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(PlanError, match=expected):
        Plan.load(path)


@pytest.mark.parametrize("value", [10**400, 1e400, -1, "1"])
def test_a_plan_with_a_huge_or_bad_number_names_the_field(tmp_path: Path, value):
    data = plan_json(tmp_path)
    data["jobs"][0]["tests"][0]["est_seconds"] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=r"jobs\[0\]\.tests\[0\]\.est_seconds: expected a number"):
        Plan.load(path)


def test_read_registry_is_unchanged_for_the_repository():
    """The ceilings reject nothing the repository declares."""
    registry = read_registry(REPO, load_fleet(REPO / "ci" / "fleet.toml"))
    assert registry.violations == []
