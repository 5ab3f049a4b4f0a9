"""Merging per-file junit reports (written by real pytest runs) into one lane report."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.junit import FileReport, JunitError, first_problem, merge, read_counts, write

register_cpu_ci(est_time=6, labels=["ci", "gpu-lane"])


def junit_of(pytester: pytest.Pytester, name: str, source: str) -> Path:
    """Run ``source`` as one pytest file; the junit XML it wrote."""
    path = pytester.makepyfile(**{name: source})
    xml = pytester.path / f"{name}.xml"
    pytester.runpytest(str(path), f"--junitxml={xml}", "-p", "no:cacheprovider")
    return xml


def test_merge_keeps_every_file_recomputes_totals_and_reports_files_without_junit(
    pytester: pytest.Pytester, tmp_path: Path
):
    a = junit_of(
        pytester,
        "test_a",
        "def test_one():\n    pass\ndef test_two():\n    assert 1 == 2\n",
    )
    b = junit_of(
        pytester,
        "test_b",
        "import pytest\ndef test_three():\n    pass\n"
        "@pytest.mark.skip(reason='x')\ndef test_four():\n    pass\n",
    )
    assert (read_counts(a).tests, read_counts(a).failures) == (2, 1)
    assert first_problem(a).startswith("test_two: assert 1 == 2")
    assert first_problem(b) is None

    tree = merge(
        [
            FileReport("tests/gpu/test_a.py", a, {"arch": "hopper", "gpus": "GPU-x"}),
            FileReport("tests/gpu/test_b.py", b, {"arch": "hopper", "attempts": "2"}),
            FileReport(
                "tests/gpu/test_hang.py",
                None,
                {"arch": "hopper"},
                error="TIMEOUT: timed out after 360 s",
                output_tail="... last lines ...",
                seconds=360.0,
            ),
            # the process exited non-zero although its report shows no failure (crash at exit)
            FileReport("tests/gpu/test_crash.py", b, error="pytest exited -11 (SIGSEGV)"),
        ],
        name="mizzen gpu-hopper",
    )
    out = tmp_path / "merged" / "junit.xml"
    write(tree, out)
    root = ET.parse(out).getroot()
    assert root.tag == "testsuites" and root.get("name") == "mizzen gpu-hopper"
    suites = {s.get("name"): s for s in root.findall("testsuite")}
    assert list(suites) == [
        "tests/gpu/test_a.py",
        "tests/gpu/test_b.py",
        "tests/gpu/test_hang.py",
        "tests/gpu/test_crash.py",
    ]
    # totals: a (2 tests, 1 failure) + b (2, 1 skipped) + hang (1 error) + crash (2 + 1 error)
    assert {k: root.get(k) for k in ("tests", "failures", "errors", "skipped")} == {
        "tests": "8",
        "failures": "1",
        "errors": "2",
        "skipped": "2",
    }
    hang = suites["tests/gpu/test_hang.py"]
    assert hang.get("errors") == "1" and hang.get("time") == "360.000"
    err = hang.find("testcase/error")
    assert err.get("message") == "TIMEOUT: timed out after 360 s" and "last lines" in err.text
    props = {p.get("name"): p.get("value") for p in suites["tests/gpu/test_a.py"].iter("property")}
    assert props == {"arch": "hopper", "gpus": "GPU-x"}
    assert suites["tests/gpu/test_crash.py"].get("errors") == "1"
    assert not out.with_name("junit.xml.tmp").exists()


def test_an_unreadable_report_is_named_and_becomes_an_error_case(tmp_path: Path):
    bad = tmp_path / "bad.xml"
    bad.write_text("<testsuites><testsuite>")  # cut off mid-write
    with pytest.raises(JunitError, match=r"bad\.xml: cannot read junit XML"):
        read_counts(bad)
    tree = merge([FileReport("tests/gpu/test_x.py", bad)], name="lane")
    case = tree.getroot().find("testsuite/testcase/error")
    assert "cannot read junit XML" in case.get("message")
    tree = merge([FileReport("tests/gpu/test_y.py", tmp_path / "missing.xml")], name="lane")
    assert tree.getroot().get("errors") == "1"
