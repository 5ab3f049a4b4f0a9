"""Hostile junit reports in the GPU lane's report merge (a report is written by the code under
test): DTDs and entities are refused before parsing, a FIFO or a link is refused without
blocking, nesting and size are bounded, huge captured output is cut, a non-finite time counts as
0 — and the merged report is always written and always valid XML."""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from mizzen_ci import masking, register_cpu_ci
from mizzen_ci.junit import (
    MAX_DEPTH,
    MAX_JUNIT_BYTES,
    MAX_TEXT_CHARS,
    FileReport,
    JunitError,
    merge,
    read_counts,
    read_testcases,
    write,
)

register_cpu_ci(est_time=10, labels=["ci", "gpu-lane"])

CASE = '<testcase classname="tests.gpu.test_a" name="t" time="1.5"/>'


def report(tmp_path: Path, body: str, head: str = "") -> Path:
    path = tmp_path / "junit.xml"
    path.write_text(
        f'<?xml version="1.0"?>{head}<testsuites><testsuite>{body}</testsuite></testsuites>'
    )
    return path


def merged_error(tmp_path: Path, junit_path: Path) -> str:
    """The error message of the one case the merged report has for ``junit_path``; the merged
    report is written and parses."""
    out = tmp_path / "merged" / "junit.xml"
    write(merge([FileReport("tests/gpu/test_a.py", junit_path)], name="lane"), out)
    (case,) = ET.parse(out).getroot().iter("testcase")
    return case.find("error").get("message")


@pytest.mark.parametrize(
    "head, body",
    [
        ('<!DOCTYPE l [<!ENTITY a "aaaaaaaaaa">]>', '<testcase name="&a;"/>'),
        ('<!DOCTYPE l [<!ENTITY x SYSTEM "file:///etc/passwd">]>', '<testcase name="&x;"/>'),
        (
            "<!DOCTYPE l [" + "".join(f'<!ENTITY e{i} "{"&e" + str(i - 1) + ";" * 10 if i else "x" * 10}">' for i in range(8)) + "]>",
            '<testcase name="&e7;"/>',
        ),
        ('<!DOCTYPE testsuites SYSTEM "http://evil.example/x.dtd">', CASE),
    ],
)  # fmt: skip
def test_a_report_with_a_dtd_or_entities_is_refused_before_parsing(tmp_path, head, body):
    path = report(tmp_path, body, head)
    with pytest.raises(JunitError, match="declares a DTD or entities"):
        read_testcases(path)
    assert "DTD" in merged_error(tmp_path, path)


def test_a_utf16_report_is_refused_since_its_dtd_would_be_invisible(tmp_path: Path):
    path = tmp_path / "junit.xml"
    path.write_bytes(
        '<?xml version="1.0" encoding="UTF-16"?><!DOCTYPE l [<!ENTITY a "b">]><testsuites/>'.encode(
            "utf-16"
        )
    )
    with pytest.raises(JunitError, match="NUL bytes"):
        read_testcases(path)


@pytest.mark.parametrize("shape", ["fifo", "link", "directory"])
def test_a_report_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path, shape, deadline):
    path = tmp_path / "junit.xml"
    if shape == "fifo":
        os.mkfifo(path)
    elif shape == "link":
        secret = tmp_path / "secret.xml"
        secret.write_text(f"<testsuites><testsuite>{CASE}</testsuite></testsuites>")
        path.symlink_to(secret)
    else:
        path.mkdir()
    with deadline(), pytest.raises(JunitError, match=r"not a regular file|symbolic link"):
        read_counts(path)
    with deadline():
        assert "cannot read junit XML" in merged_error(tmp_path, path)


def test_nesting_deeper_than_the_limit_is_refused_and_the_merge_still_writes(tmp_path: Path):
    deep = "<x>" * 100_000 + "</x>" * 100_000
    path = report(tmp_path, f'<testcase name="t">{deep}</testcase>')
    with pytest.raises(JunitError, match=f"nest over {MAX_DEPTH} deep"):
        read_testcases(path)
    assert "nest over" in merged_error(tmp_path, path)


def test_a_report_over_the_size_cap_is_refused(tmp_path: Path):
    path = tmp_path / "junit.xml"
    with path.open("w") as f:
        f.write(f"<testsuites><testsuite>{CASE}</testsuite></testsuites>")
        f.write(" " * (MAX_JUNIT_BYTES + 1))  # valid XML: trailing whitespace
    with pytest.raises(JunitError, match=r"over the 64\.0 MiB"):
        read_testcases(path)


def test_huge_captured_output_is_cut_in_the_merged_report(tmp_path: Path):
    out = "y" * (MAX_TEXT_CHARS * 4)
    path = report(
        tmp_path, f'<testcase name="t" time="1"><system-out>{out}</system-out></testcase>'
    )
    merged = tmp_path / "merged.xml"
    write(merge([FileReport("tests/gpu/test_a.py", path)], name="lane"), merged)
    text = ET.parse(merged).getroot().find(".//system-out").text
    assert len(text) < MAX_TEXT_CHARS + 100 and text.endswith("characters cut]")


@pytest.mark.parametrize("time", ["1e999", "nan", "-inf", "-3", "bogus"])
def test_a_time_that_is_not_a_finite_number_counts_as_zero(tmp_path: Path, time: str):
    path = report(
        tmp_path, CASE + f'<testcase classname="tests.gpu.test_a" name="u" time="{time}"/>'
    )
    counts = read_counts(path)
    assert (counts.tests, counts.time) == (2, 1.5)
    merged = tmp_path / "merged.xml"
    write(merge([FileReport("tests/gpu/test_a.py", path)], name="lane"), merged)
    assert ET.parse(merged).getroot().get("time") == "1.500"


def test_a_registered_secret_in_a_copied_testcase_never_reaches_the_merged_report(tmp_path):
    """A test's own report is copied into the lane's: every text, tail and attribute of it is
    masked (a failure message, its body, captured output, a name; a tag or attribute named by
    the secret; a secret straddling the cut of a huge text), and the result is still junit."""
    token = "ghs_" + "T0KEN" * 4
    straddle = "z" * (MAX_TEXT_CHARS - 6) + token
    body = (
        f'<testcase classname="tests.gpu.test_a" name="test_{token}" time="0.1">'
        f'<failure message="AssertionError: 401 for token {token}" type="{token}">'
        f"Authorization: Bearer {token}</failure>"
        f"<system-out>GITHUB_TOKEN={token}</system-out><system-err>{straddle}</system-err>"
        f'<properties><property name="auth" value="{token}" {token}="x"/></properties>'
        f"<{token}>{token}</{token}>tail {token}</testcase>"
    )
    path = report(tmp_path, body)
    merged = tmp_path / "merged" / "junit.xml"
    with masking.scope():
        masking.register_environment({"GITHUB_TOKEN": token})
        write(merge([FileReport("tests/gpu/test_a.py", path)], name="lane"), merged)
    text = merged.read_text(encoding="utf-8")
    assert token not in text and token[:6] not in text  # no piece left by the cut either
    (case,) = ET.parse(merged).getroot().iter("testcase")
    assert case.get("name") == "test_***"
    assert case.find("failure").get("message") == "AssertionError: 401 for token ***"
    assert case.find("failure").text == "Authorization: Bearer ***"
    assert case.find("system-out").text == "GITHUB_TOKEN=***"
    assert read_counts(merged).failures == 1
