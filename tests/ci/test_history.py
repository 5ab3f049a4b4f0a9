"""The duration history: junit XML from a real pytest run -> per-file records -> JSON-lines store
-> p90 estimates, with malformed stores reported by file:line."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.history import (
    Estimator,
    HistoryError,
    Record,
    append,
    compact,
    file_of_testcase,
    load,
    quantile,
    records_from_junit,
    worst,
)

register_cpu_ci(est_time=8, labels=["ci"])


def run_pytest_junit(tmp_path: Path) -> Path:
    """A real pytest run over two test files (one inside a class) writing junit XML."""
    tests = tmp_path / "tests" / "pkg"
    tests.mkdir(parents=True)
    (tests / "test_ok.py").write_text(
        textwrap.dedent(
            """
            import time
            def test_a(): time.sleep(0.05)
            class TestGroup:
                def test_b(self): pass
            """
        )
    )
    (tests / "test_mixed.py").write_text(
        textwrap.dedent(
            """
            import pytest
            def test_pass(): pass
            def test_fail(): assert 1 == 2
            def test_skip(): pytest.skip("no")
            """
        )
    )
    xml = tmp_path / "junit.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:mizzen_ci",
         "--rootdir", str(tmp_path), f"--junitxml={xml}", "tests"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    return xml


def test_records_from_a_real_pytest_junit_report_are_per_file_with_worst_outcome(tmp_path):
    xml = run_pytest_junit(tmp_path)
    records = records_from_junit(xml, arch="hopper", lane="gpu-hopper", job="j1", when="T")
    by_file = {r.file: r for r in records}
    assert set(by_file) == {"tests/pkg/test_ok.py", "tests/pkg/test_mixed.py"}
    ok, mixed = by_file["tests/pkg/test_ok.py"], by_file["tests/pkg/test_mixed.py"]
    assert ok.outcome == "passed" and ok.seconds >= 0.05
    assert mixed.outcome == "failed"  # failed is worse than skipped and passed
    assert (ok.arch, ok.lane, ok.job, ok.when) == ("hopper", "gpu-hopper", "j1", "T")


def test_a_report_for_one_named_file_with_no_testcase_is_an_error_record(tmp_path):
    xml = tmp_path / "empty.xml"
    xml.write_text('<testsuites><testsuite name="pytest" tests="0"/></testsuites>')
    (record,) = records_from_junit(xml, arch=None, lane="cpu", file="tests/x/test_y.py")
    assert (record.file, record.outcome, record.seconds) == ("tests/x/test_y.py", "error", 0.0)


def test_unreadable_junit_names_the_file(tmp_path):
    bad = tmp_path / "bad.xml"
    bad.write_text("<testsuites><testcase")
    with pytest.raises(HistoryError, match=r"bad\.xml: cannot read junit XML"):
        records_from_junit(bad, arch=None, lane="cpu")


def test_file_of_testcase_from_classname_and_collection_errors():
    assert (
        file_of_testcase("tests.ci.registry.test_registry_cli", "test_x")
        == "tests/ci/registry/test_registry_cli.py"
    )
    assert (
        file_of_testcase("tests.ci.registry.test_registry_cli.TestGroup", "test_x")
        == "tests/ci/registry/test_registry_cli.py"
    )
    assert (
        file_of_testcase("", "tests.ci.registry.test_registry_cli")
        == "tests/ci/registry/test_registry_cli.py"
    )
    assert file_of_testcase("conftest", "x") is None
    assert worst(["passed", "skipped"]) == "skipped"
    assert worst(["skipped", "error", "failed"]) == "error"


def test_store_round_trip_and_append_is_additive(tmp_path):
    store = tmp_path / "h" / "durations.jsonl"
    a = Record(
        "tests/a/test_x.py",
        "hopper",
        10.0,
        "passed",
        "2026-11-01T00:00:00+00:00",
        "gpu-hopper",
        "j",
    )
    b = Record("tests/a/test_y.py", None, 2.5, "failed", "2026-11-02T00:00:00+00:00", "cpu")
    assert append(store, [a]) == 1
    assert append(store, [b]) == 1
    assert append(store, []) == 0
    assert load(store) == [a, b]
    assert load(tmp_path / "h") == [a, b]  # a directory of *.jsonl (a downloaded artifact)
    assert json.loads(store.read_text().splitlines()[1])["arch"] is None


def test_malformed_store_lines_name_path_and_line(tmp_path):
    store = tmp_path / "d.jsonl"
    good = Record(
        "tests/test_a.py", None, 1.0, "passed", "2026-11-01T00:00:00+00:00", "cpu"
    ).to_json()
    store.write_text(good + "\n{not json\n")
    with pytest.raises(HistoryError, match=r"d\.jsonl:2: not JSON"):
        load(store)
    store.write_text(good + "\n" + json.dumps({**json.loads(good), "outcome": "ok"}) + "\n")
    with pytest.raises(HistoryError, match=r"d\.jsonl:2: outcome 'ok'"):
        load(store)
    store.write_text(json.dumps({"file": "tests/test_a.py"}) + "\n")
    with pytest.raises(HistoryError, match=r"d\.jsonl:1: record lacks `arch`"):
        load(store)
    with pytest.raises(HistoryError, match="no such history file"):
        load(tmp_path / "missing.jsonl")
    assert load(tmp_path / "missing.jsonl", missing_ok=True) == []


def test_estimate_is_p90_of_recent_passing_runs_else_est_time():
    def rec(i: int, s: float, outcome: str = "passed", arch: str | None = "hopper") -> Record:
        return Record("tests/test_a.py", arch, s, outcome, f"2026-11-{i:02d}T00:00:00+00:00", "x")

    old = [rec(1, 1000.0)]  # older than the 20 most recent: ignored
    recent = [rec(2 + i, float(10 + i)) for i in range(20)]  # 10..29
    noise = [rec(25, 5000.0, "failed"), rec(26, 1.0, "skipped"), rec(27, 99.0, arch="blackwell")]
    est = Estimator(old + recent + noise)
    e = est.estimate("tests/test_a.py", "hopper", est_time=7)
    assert (e.source, e.samples, e.seconds) == ("history", 20, quantile(list(range(10, 30))))
    assert e.seconds == 27.0  # nearest rank: ceil(0.9 * 20) = 18th of 10..29
    assert est.seconds("tests/test_a.py", "blackwell", 7) == 99.0
    assert est.estimate("tests/test_a.py", None, 7).source == "est_time"
    assert est.seconds("tests/test_other.py", "hopper", 7) == 7.0


def test_compact_keeps_the_newest_per_key():
    rs = [Record("tests/test_a.py", None, float(i), "passed", f"{i:03d}", "cpu") for i in range(10)]
    kept = compact([*rs, Record("tests/test_a.py", None, 9.0, "failed", "999", "cpu")], keep=3)
    assert [r.seconds for r in kept if r.outcome == "passed"] == [7.0, 8.0, 9.0]
    assert sum(r.outcome == "failed" for r in kept) == 1


def test_command_line_records_and_merges_under_python_S(tmp_path, mizzen_ci):
    xml = run_pytest_junit(tmp_path)

    def history_cli(*args: str) -> subprocess.CompletedProcess:
        return mizzen_ci("history", *args)

    a, b, merged = tmp_path / "in" / "a.jsonl", tmp_path / "in" / "b.jsonl", tmp_path / "m.jsonl"
    out = history_cli(
        "record", "--junit", str(xml), "--lane", "cpu", "--job", "cpu-1", "--out", str(a)
    )
    assert out.returncode == 0, out.stderr
    history_cli(
        "record", "--junit", str(xml), "--lane", "gpu-hopper", "--arch", "hopper", "--out", str(b)
    )
    out = history_cli("merge", "--out", str(merged), "--keep", "1", str(tmp_path / "in"))
    assert out.returncode == 0, out.stderr
    records = load(merged)
    assert {(r.file, r.arch, r.lane, r.job) for r in records} == {
        ("tests/pkg/test_ok.py", None, "cpu", "cpu-1"),
        ("tests/pkg/test_mixed.py", None, "cpu", "cpu-1"),
        ("tests/pkg/test_ok.py", "hopper", "gpu-hopper", None),
        ("tests/pkg/test_mixed.py", "hopper", "gpu-hopper", None),
    }
    bad = history_cli(
        "record", "--junit", str(tmp_path / "nope.xml"), "--lane", "cpu", "--out", str(a)
    )
    assert bad.returncode == 1 and "cannot read junit XML" in bad.stderr
