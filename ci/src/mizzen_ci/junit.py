"""Reading junit XML reports, and merging the per-file reports of a lane into one report.

A root module: the GPU lane (:mod:`mizzen_ci.lane`) writes and merges reports, the history
store (:mod:`mizzen_ci.history`) reads them, and the lane's report records history; neither
folder imports the other for junit.

Invariants:
- The merged report has one ``<testsuite>`` per test file, named by the file's repository path,
  holding that file's testcases from its *final* attempt and ``<properties>`` saying where it ran
  (arch, GPUs, attempts, retry class); ``<testsuites>`` totals are recomputed from the testcases,
  never copied from the inputs.
- A file whose process wrote no usable report (timed out, crashed, refused) still appears, as a
  suite with one ``<error>`` testcase carrying the reason and the tail of its output: a file
  never vanishes from the report.
- Reading a report never guesses: an unreadable file is a :class:`JunitError` naming it.
- A report is written by the test process, i.e. by the code under test, so it is read as hostile
  input: a regular file (never through a link, never a FIFO: :func:`mizzen_ci.sources.read_bytes`)
  of at most :data:`MAX_JUNIT_BYTES`; a document with a DTD or entity declarations (pytest writes
  none; they are how entity-expansion attacks work) or with NUL bytes (UTF-16/32: the byte scan
  could not see a DTD) is refused before it is parsed; elements nest at most :data:`MAX_DEPTH`
  deep (the writer and ``ET.indent`` recurse); a copied testcase keeps at most
  :data:`MAX_TEXT_CHARS` of each text; a ``time`` that is not a finite number ≥ 0 counts as 0.
- Every text of the merged report goes through :func:`mizzen_ci.output.xml_text`, which masks
  the registered secrets (:mod:`mizzen_ci.masking`) and escapes what XML 1.0 cannot hold: the
  text the lane itself puts there (reasons, output tails, properties), and every text, tail and
  attribute value of a copied testcase (:func:`_copied`, the one place a test's own report
  enters it: a secret a test printed in a failure message or its captured output is masked).
"""

from __future__ import annotations

import math
import os
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from . import masking
from .output import xml_text
from .sources import read_bytes

MAX_JUNIT_BYTES = 64 * 1024 * 1024
MAX_DEPTH = 64  # pytest writes 4 levels
MAX_TEXT_CHARS = 256 * 1024  # of each text of a copied testcase (captured output can be huge)
_FEED_BYTES = 1024 * 1024


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


def _parse(path: Path | str) -> ET.Element:
    """The root element of a junit report, read as hostile input (see the module docstring)."""
    try:
        data, _ = read_bytes(path, MAX_JUNIT_BYTES)
    except OSError as e:
        raise JunitError(f"{path}: cannot read junit XML: {e}") from None
    if b"<!DOCTYPE" in data or b"<!ENTITY" in data:
        raise JunitError(
            f"{path}: cannot read junit XML: it declares a DTD or entities, which a junit report "
            "never has (refused: entity expansion)"
        )
    if b"\x00" in data:
        raise JunitError(f"{path}: cannot read junit XML: it holds NUL bytes (write it as UTF-8)")
    parser = ET.XMLPullParser(events=("start", "end"))
    root, depth = None, 0
    try:
        for start in range(0, max(len(data), 1), _FEED_BYTES):
            parser.feed(data[start : start + _FEED_BYTES])
            for event, element in parser.read_events():
                if event == "end":
                    depth -= 1
                    continue
                depth += 1
                root = element if root is None else root
                if depth > MAX_DEPTH:
                    raise JunitError(
                        f"{path}: cannot read junit XML: elements nest over {MAX_DEPTH} deep "
                        "(a junit report nests 4)"
                    )
        parser.close()
    except ET.ParseError as e:
        raise JunitError(f"{path}: cannot read junit XML: {e}") from None
    if root is None:
        raise JunitError(f"{path}: cannot read junit XML: no element")
    return root


def read_testcases(path: Path | str) -> list[ET.Element]:
    """Every ``<testcase>`` of a junit report (pytest writes ``<testsuites><testsuite>…``)."""
    root = _parse(path)
    if root.tag not in ("testsuites", "testsuite"):
        raise JunitError(
            f"{path}: root element is <{xml_text(root.tag)[:40]}>, not <testsuites>/<testsuite>"
        )
    return list(root.iter("testcase"))


def testcase_seconds(case: ET.Element) -> float:
    """The ``time`` of a testcase; 0 when it is not a finite number ≥ 0."""
    try:
        t = float(case.get("time") or 0.0)
    except ValueError:
        return 0.0
    return t if math.isfinite(t) and t >= 0 else 0.0


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
        time += testcase_seconds(case)
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
        "testcase",
        classname=xml_text(file.removesuffix(".py").replace("/", ".")),
        name="[test file run]",
    )
    case.set("time", f"{seconds:.3f}")
    err = ET.SubElement(case, "error", message=xml_text(message))
    err.text = xml_text(text)
    return case


def _copied(case: ET.Element) -> ET.Element:
    """``case`` as the merged report holds it (in place): every text, tail and attribute value
    through :func:`_copied_text`; a tag or attribute name that holds a registered secret is
    replaced (``masked``) or dropped, as a masked name would not be XML."""
    for element in case.iter():
        if masking.mask(element.tag) != element.tag:
            element.tag = "masked"
        for attr in ("text", "tail"):
            value = getattr(element, attr)
            if value is not None:
                setattr(element, attr, _copied_text(value))
        copied = {
            name: _copied_text(value)
            for name, value in element.attrib.items()
            if masking.mask(name) == name
        }
        element.attrib.clear()
        element.attrib.update(copied)
    return case


def _copied_text(value: str) -> str:
    """A text of a copied testcase: masked (before the cut, so no piece of a secret is left),
    then cut to :data:`MAX_TEXT_CHARS`."""
    value = xml_text(value)
    if len(value) <= MAX_TEXT_CHARS:
        return value
    return value[:MAX_TEXT_CHARS] + f"\n[… {len(value) - MAX_TEXT_CHARS} characters cut]"


def _set_counts(element: ET.Element, counts: Counts) -> None:
    element.set("tests", str(counts.tests))
    element.set("failures", str(counts.failures))
    element.set("errors", str(counts.errors))
    element.set("skipped", str(counts.skipped))
    element.set("time", f"{counts.time:.3f}")


def merge(reports: Iterable[FileReport], *, name: str) -> ET.ElementTree:
    """One report for the lane: a suite per file, totals recomputed."""
    top = ET.Element("testsuites", name=xml_text(name))
    all_cases: list[ET.Element] = []
    for report in reports:
        suite = ET.SubElement(top, "testsuite", name=xml_text(report.file))
        if report.properties:
            props = ET.SubElement(suite, "properties")
            for key, value in report.properties.items():
                ET.SubElement(props, "property", name=xml_text(key), value=xml_text(value))
        cases: list[ET.Element] = []
        if report.junit is not None and os.path.lexists(report.junit):  # what is there, said
            try:
                cases = [_copied(c) for c in read_testcases(report.junit)]
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
