"""Merging the per-file junit XML reports of a lane into one report.

Invariants:
- The merged report has one ``<testsuite>`` per test file, named by the file's repository path,
  holding that file's testcases from its *final* attempt and ``<properties>`` saying where it ran
  (arch, GPUs, attempts, retry class); ``<testsuites>`` totals are recomputed from the testcases,
  never copied from the inputs.
- A file whose process wrote no usable report (timed out, crashed, refused) still appears, as a
  suite with one ``<error>`` testcase carrying the reason and the tail of its output: a file
  never vanishes from the report.
- Reading a report never guesses: an unreadable file is a :class:`JunitError` naming it.
"""

from __future__ import annotations

import contextlib
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path


class JunitError(ValueError):
    """A junit report cannot be read."""


@dataclass(frozen=True)
class Counts:
    tests: int = 0
    failures: int = 0
    errors: int = 0
    skipped: int = 0
    time: float = 0.0

    @property
    def ok(self) -> bool:
        return self.tests > 0 and self.failures == 0 and self.errors == 0


@dataclass(frozen=True)
class FileReport:
    """What one test file's final attempt left behind."""

    file: str
    junit: Path | None
    properties: Mapping[str, str] = field(default_factory=dict)
    error: str | None = None  # why the run is an error beyond its testcases (timeout, crash, ...)
    output_tail: str = ""
    seconds: float = 0.0


def read_testcases(path: Path | str) -> list[ET.Element]:
    """Every ``<testcase>`` of a junit report (pytest writes ``<testsuites><testsuite>…``)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        raise JunitError(f"{path}: cannot read junit XML: {e}") from None
    if root.tag not in ("testsuites", "testsuite"):
        raise JunitError(f"{path}: root element is <{root.tag}>, not <testsuites>/<testsuite>")
    return list(root.iter("testcase"))


def testcase_outcome(case: ET.Element) -> str:
    """``error``, ``failed``, ``skipped`` or ``passed``: what one ``<testcase>`` says (an error
    outranks a failure, which outranks a skip)."""
    tags = {child.tag for child in case}
    if "error" in tags:
        return "error"
    if "failure" in tags:
        return "failed"
    if "skipped" in tags:
        return "skipped"
    return "passed"


def counts_of(cases: Iterable[ET.Element]) -> Counts:
    tests = failures = errors = skipped = 0
    time = 0.0
    for case in cases:
        tests += 1
        outcome = testcase_outcome(case)
        if outcome == "error":
            errors += 1
        elif outcome == "failed":
            failures += 1
        elif outcome == "skipped":
            skipped += 1
        with contextlib.suppress(ValueError):
            time += float(case.get("time") or 0.0)
    return Counts(tests, failures, errors, skipped, round(time, 3))


def read_counts(path: Path | str) -> Counts:
    return counts_of(read_testcases(path))


def first_problem(path: Path | str, limit: int = 160) -> str | None:
    """``test name: message`` of the first failed or errored testcase, for one-line summaries."""
    for case in read_testcases(path):
        for child in case:
            if child.tag in ("failure", "error"):
                message = (child.get("message") or (child.text or "")).strip().splitlines()
                text = f"{case.get('name')}: {message[0] if message else child.tag}"
                return text if len(text) <= limit else text[: limit - 1] + "…"
    return None


def _error_case(file: str, message: str, text: str, seconds: float) -> ET.Element:
    case = ET.Element(
        "testcase", classname=file.removesuffix(".py").replace("/", "."), name="[test file run]"
    )
    case.set("time", f"{seconds:.3f}")
    err = ET.SubElement(case, "error", message=message)
    err.text = text
    return case


def _set_counts(element: ET.Element, counts: Counts) -> None:
    element.set("tests", str(counts.tests))
    element.set("failures", str(counts.failures))
    element.set("errors", str(counts.errors))
    element.set("skipped", str(counts.skipped))
    element.set("time", f"{counts.time:.3f}")


def merge(reports: Iterable[FileReport], *, name: str) -> ET.ElementTree:
    """One report for the lane: a suite per file, totals recomputed."""
    top = ET.Element("testsuites", name=name)
    all_cases: list[ET.Element] = []
    for report in reports:
        suite = ET.SubElement(top, "testsuite", name=report.file)
        if report.properties:
            props = ET.SubElement(suite, "properties")
            for key, value in report.properties.items():
                ET.SubElement(props, "property", name=key, value=str(value))
        cases: list[ET.Element] = []
        if report.junit is not None and report.junit.is_file():
            try:
                cases = read_testcases(report.junit)
            except JunitError as e:
                cases = [_error_case(report.file, str(e), report.output_tail, report.seconds)]
        elif report.error is None:
            cases = [
                _error_case(
                    report.file,
                    "the test process wrote no junit report",
                    report.output_tail,
                    report.seconds,
                )
            ]
        if report.error is not None:
            cases.append(_error_case(report.file, report.error, report.output_tail, report.seconds))
        suite.extend(cases)
        _set_counts(suite, counts_of(cases))
        all_cases.extend(cases)
    _set_counts(top, counts_of(all_cases))
    ET.indent(top)
    return ET.ElementTree(top)


def write(tree: ET.ElementTree, path: Path | str) -> None:
    """Write atomically (temp file + rename): a reader never sees half a report."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tree.write(tmp, encoding="utf-8", xml_declaration=True)
    tmp.replace(path)
