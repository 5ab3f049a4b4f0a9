"""The CI's history stores: what each test file took on each lane (and the planner's estimate
from it), and which runs were retried for infrastructure failures (the flake record).

Both stores are JSON lines (one JSON object per line, UTF-8), append-only, written by one
function (:func:`append_jsonl`).  One duration record is one run of one test *file* on one lane::

    {"file": "tests/train/test_lora.py", "arch": "hopper", "seconds": 123.4, "outcome": "passed",
     "when": "2026-11-30T06:12:00+00:00", "lane": "gpu-hopper", "job": "gpu-hopper-h200-2gpu-1"}

- ``file``: repository-relative POSIX path of the test file.
- ``arch``: the GPU generation it ran on (a name from ``ci/fleet.toml``), ``null`` for the CPU lane.
- ``seconds``: wall seconds of the file, the sum of its junit testcases (setup + call + teardown).
- ``outcome``: ``passed`` | ``failed`` | ``skipped`` | ``error``; for a file, the worst of its
  testcases in the order passed < skipped < failed < error.
- ``when``: ISO-8601 UTC timestamp of the recording.
- ``lane``: ``cpu`` or ``gpu-<arch>``; ``job``: the planned job id, or ``null`` for a local run.

Unknown keys are kept out of :class:`Record` but tolerated on read, so the format can grow.

One flake record line is one retried attempt, keyed by (test file, arch)::

    {"file", "arch", "class", "evidence", "final", "when", "job"}

Other concerns keep their own records in the history store as *kinded* lines: a JSON object with
a string ``kind`` (the health page's ``pool``, ``queue`` and ``audit`` records,
:mod:`mizzen_ci.report.records`).  The duration and flake readers leave them to their own
readers (:func:`is_kinded_line`, :func:`read_kinded`): a kinded line is never a bad duration line.

Command line (stdlib only, for workflow steps; ``PYTHONPATH=ci/src python3 -S -m mizzen_ci history``):

- ``history record --junit FILE --lane cpu|gpu-ARCH [--arch ARCH] [--job ID] --out STORE``:
  append the per-file records of a junit report;
- ``history merge --out STORE [--flakes-out FLAKES] [--keep N] INPUT…``: the records of every
  input (files or directories), compacted to the newest ``N`` per (file, arch, passed or not),
  written atomically to ``STORE``; the flake records among them (told apart by their shape:
  :func:`is_flake_line`) to ``FLAKES`` (default: ``flakes.jsonl`` beside ``STORE``), the newest
  ``N`` per (file, arch); each bad line of an input is dropped with a line on stderr naming
  ``path:line``.  A record given twice (a re-uploaded artifact) is kept once.
- ``history flakes [--top N] [INPUT…]``: the flakiest (file, arch) pairs: retried attempts (flake
  records) per run (duration records) of each, highest rate first (default inputs: the tree's
  ``.ci-artifacts/history`` and ``.ci-artifacts/flakes.jsonl``).

Invariants:
- Stdlib only (``python3 -S``): junit is read by :mod:`mizzen_ci.junit`, the stores with
  ``json``.  :func:`now_utc` is the one clock of every record.
- The two writers of JSON lines (:func:`append_jsonl`, :func:`write_lines`; metric artefacts
  too) mask the registered secrets (:mod:`mizzen_ci.masking`) in every line they write.
- :func:`append_jsonl` writes all its lines with one ``write`` on a file opened for appending, so
  a crash never leaves half a batch behind a complete line.
- A store is read from disk it did not write (a downloaded artifact, or a checkout's
  ``.ci-artifacts/history``), so every value is validated and bounded on read: a store is a
  regular file of at most :data:`MAX_STORE_BYTES` (read with :func:`mizzen_ci.sources.read_bytes`:
  never a link, a FIFO or a device; a directory of stores is walked without following links); a
  line is at most :data:`MAX_LINE_CHARS` characters of JSON; ``seconds`` is a finite number from 0
  to the registry's ``est_time`` ceiling (:data:`MAX_SECONDS`, compared before any conversion: an
  integer of any size is an error, never an ``OverflowError``); the text fields are strings of
  bounded length that UTF-8 can encode (:func:`utf8_problem`: a JSON escape such as ``\\ud800``
  decodes to a lone surrogate, which no page, log or store could write, so such a line is dropped
  like any other bad value and no reader's caller ever sees one); ``when`` (of a duration or a
  flake record) is an ISO-8601 time (UTC when it names no offset) from :data:`EARLIEST` to now +
  :data:`MAX_CLOCK_SKEW`: a record dated ``9999-99-99``, next year or 1970 is dropped like any bad
  line (it would be the "newest" forever and never compacted away). :func:`read_stores` drops each
  bad line (and each unreadable store) with a problem naming ``path:line``, the rule and what was
  found, and keeps the good ones (the planner and the estimator use those, and warn); :func:`load`
  is the strict form that raises :class:`HistoryError` for the first problem. The flake record is
  read the same way (:func:`read_flakes`, :func:`read_flake_records`). Each parsed line belongs to
  exactly one reader (:func:`line_kind`: kinded, flake or duration), and a caller that needs
  several kinds reads the stores once (:func:`read_history`), so each unreadable store and each
  bad line is one problem, never one per reader. No reader skips a line silently: a flake record
  inside a folder of duration stores (the merged history keeps both) is the other kind of record,
  not a bad line, and only the flake readers read it.
- Times from junit are checked the same way before they become a record.
- The estimate of a (file, arch) is the p90 (nearest rank) of its most recent ``RECENT`` *passing*
  durations; with no passing record it is the registration's ``est_time``.  Failed, errored and
  skipped runs never feed an estimate (a crash at second 3 says nothing about a full run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import stat
import sys
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from .junit import JunitError, read_testcases, testcase_outcome
from .masking import mask
from .output import plain, text_table
from .registry.rules import MAX_EST_TIME_SECONDS, shown
from .sources import read_bytes

OUTCOMES = ("passed", "skipped", "failed", "error")  # in order of severity
_SEVERITY = {o: i for i, o in enumerate(OUTCOMES)}
RECENT = 20  # passing runs per (file, arch) that feed an estimate
QUANTILE = 0.9
MAX_SECONDS = MAX_EST_TIME_SECONDS  # one run of one file: no more than a registration may declare
MAX_STORE_BYTES = 256 * 1024 * 1024
MAX_LINE_CHARS = 16 * 1024  # a record is ~200 characters
MAX_PATH_CHARS = 1024  # file, job
MAX_NAME_CHARS = 64  # arch, lane, when, outcome
MAX_STORE_DEPTH = 16  # directories below a store directory
MAX_PROBLEMS_SHOWN = 5  # dropped lines named in one warning (the rest are counted)
EARLIEST = datetime(2020, 1, 1, tzinfo=UTC)  # a record's time: not before this epoch,
MAX_CLOCK_SKEW = timedelta(minutes=10)  # nor later than now + this skew between machines


class HistoryError(ValueError):
    """A history file or junit report cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class Record:
    """One run of one test file on one lane."""

    file: str
    arch: str | None
    seconds: float
    outcome: str
    when: str
    lane: str
    job: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


@dataclass(frozen=True)
class Estimate:
    """Seconds expected for one (file, arch), and where the figure came from."""

    seconds: float
    source: str  # "history" | "est_time"
    samples: int = 0


def now_utc() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def worst(outcomes: Iterable[str]) -> str:
    """The most severe outcome (passed < skipped < failed < error); ``passed`` for none."""
    return max(outcomes, key=_SEVERITY.__getitem__, default="passed")


# --------------------------------------------------------------------------------------------
# junit XML -> records


def file_of_testcase(classname: str, name: str) -> str | None:
    """The test file of a pytest junit testcase, from its dotted ``classname``.

    pytest writes ``classname="tests.ci.test_cli"`` (or ``tests.ci.test_cli.TestX`` inside a
    class); registered test files are named ``test_*.py``, so the file is the dotted path up to
    its last ``test_*`` component.  A collection error has an empty classname and the module in
    ``name``.
    """
    dotted = classname or name
    parts = dotted.split(".")
    for i in range(len(parts) - 1, -1, -1):
        if parts[i].startswith("test_"):
            return "/".join(parts[: i + 1]) + ".py"
    if "/" in name and name.endswith(".py"):  # some collection errors carry the path itself
        return name
    return None


def records_from_junit(
    xml_path: Path | str,
    *,
    arch: str | None,
    lane: str,
    job: str | None = None,
    file: str | None = None,
    when: str | None = None,
) -> list[Record]:
    """One :class:`Record` per test file in a junit XML report, summing its testcases' times.

    ``file`` attributes every testcase to that file (a lane that runs one pytest process per
    file knows it); otherwise the file comes from each testcase's ``file`` attribute (junit
    ``xunit1``) or its ``classname`` (see :func:`file_of_testcase`).
    """
    xml_path = Path(xml_path)
    try:
        cases = read_testcases(xml_path)
    except JunitError as e:
        raise HistoryError(str(e)) from None
    when = when or now_utc()
    seconds: dict[str, float] = {}
    outcomes: dict[str, list[str]] = {}
    for case in cases:
        path = (
            file
            or case.get("file")
            or file_of_testcase(case.get("classname", ""), case.get("name", ""))
        )
        if path is None:
            raise HistoryError(
                f"{xml_path}: testcase {shown(case.get('classname'))}::{shown(case.get('name'))} "
                "names no test_*.py file; pass file= when the report holds one file"
            )
        raw = case.get("time") or "0"
        try:
            t = float(raw)
        except ValueError:
            t = math.nan
        if not (math.isfinite(t) and 0 <= t <= MAX_SECONDS):
            raise HistoryError(
                f"{xml_path}: testcase {shown(path)}::{shown(case.get('name'))} has "
                f"time={shown(raw)}; a time is a finite number of seconds from 0 to {MAX_SECONDS}"
            )
        seconds[path] = seconds.get(path, 0.0) + t
        if seconds[path] > MAX_SECONDS:
            raise HistoryError(
                f"{xml_path}: the testcases of {shown(path)} add up to over {MAX_SECONDS} s; "
                "no run of one file takes that long"
            )
        outcomes.setdefault(path, []).append(testcase_outcome(case))
    if file is not None and file not in seconds:
        # No testcase at all: pytest ran nothing.  That is an error of the file, not a pass.
        seconds[file], outcomes[file] = 0.0, ["error"]
    return [
        Record(
            file=path,
            arch=arch,
            seconds=round(seconds[path], 3),
            outcome=worst(outcomes[path]),
            when=when,
            lane=lane,
            job=job,
        )
        for path in sorted(seconds)
    ]


# --------------------------------------------------------------------------------------------
# The store


def append(path: Path | str, records: Iterable[Record]) -> int:
    """Append duration ``records`` to the store at ``path``; the number of records written."""
    return append_jsonl(path, (r.to_json() for r in records))


def append_jsonl(path: Path | str, lines: Iterable[str]) -> int:
    """Append JSON ``lines`` (one object each, no newline) to the store at ``path`` (created with
    its parents) in one write; the number of lines written."""
    lines = "".join(mask(line) + "\n" for line in lines)
    if not lines:
        return 0
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        data = lines.encode()
        written = os.write(fd, data)
        while written < len(data):  # O_APPEND keeps the rest contiguous for a single writer
            written += os.write(fd, data[written:])
    finally:
        os.close(fd)
    return lines.count("\n")


def _record_from(obj: object, where: str) -> Record:
    if not isinstance(obj, dict):
        raise HistoryError(f"{where}: a record must be a JSON object, got {type(obj).__name__}")

    def text(name: str, limit: int, nullable: bool = False, numeric: bool = False) -> str | None:
        if name not in obj:
            raise HistoryError(f"{where}: record lacks `{name}`; every record has {_FIELDS}")
        value = obj[name]
        if value is None and nullable:
            return None
        if numeric and isinstance(value, int) and not isinstance(value, bool):
            value = str(value) if value.bit_length() < 64 else value  # a job id may be a number
        if not isinstance(value, str):
            raise HistoryError(f"{where}: `{name}` has the wrong type: {shown(value)}")
        if len(value) > limit:
            raise HistoryError(f"{where}: `{name}` is {len(value)} characters, over {limit}")
        return checked_utf8(value, where, f"`{name}`")

    file = text("file", MAX_PATH_CHARS)
    arch = text("arch", MAX_NAME_CHARS, nullable=True)
    if "seconds" not in obj:
        raise HistoryError(f"{where}: record lacks `seconds`; every record has {_FIELDS}")
    value = obj["seconds"]
    # Range first, conversion after: an integer of any size is compared, never made a float.
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (isinstance(value, float) and not math.isfinite(value))
        or not 0 <= value <= MAX_SECONDS
    ):
        raise HistoryError(
            f"{where}: seconds must be a finite number from 0 to {MAX_SECONDS}, got {shown(value)}"
        )
    outcome = text("outcome", MAX_NAME_CHARS)
    if outcome not in _SEVERITY:
        raise HistoryError(f"{where}: outcome {shown(outcome)} is not one of {', '.join(OUTCOMES)}")
    return Record(
        file=file,
        arch=arch,
        seconds=float(value),
        outcome=outcome,
        when=checked_when(text("when", MAX_NAME_CHARS), where),
        lane=text("lane", MAX_NAME_CHARS),
        job=text("job", MAX_PATH_CHARS, nullable=True, numeric=True) if "job" in obj else None,
    )


_FIELDS = "file, arch, seconds, outcome, when, lane"


def utf8_problem(value: str) -> str | None:
    """Why ``value`` cannot be written as UTF-8 (the code point of its first lone surrogate,
    which a JSON ``\\ud800`` escape decodes to), or ``None``."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"holds U+{ord(value[e.start]):04X}, a lone surrogate that UTF-8 cannot encode"
    return None


def checked_utf8(value: str, where: str, what: str) -> str:
    """``value`` when UTF-8 can encode it; :class:`HistoryError` naming ``where`` and ``what``."""
    problem = utf8_problem(value)
    if problem is not None:
        raise HistoryError(
            f"{where}: {what} {problem} (a JSON escape such as \\ud800 with no pair); a "
            "record's text is UTF-8"
        )
    return value


def time_problem(value: object) -> str | None:
    """Why ``value`` is not a time a record may carry (see the module docstring), or ``None``."""
    if not isinstance(value, str) or len(value) > MAX_NAME_CHARS:
        return "is not an ISO-8601 time"
    try:
        parsed = datetime.fromisoformat(value)
        parsed = (parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)).astimezone(UTC)
    except (ValueError, OverflowError):
        return "is not an ISO-8601 time"
    if parsed < EARLIEST:
        return f"is before {EARLIEST.date()} (no CI record is older)"
    if parsed > datetime.now(UTC) + MAX_CLOCK_SKEW:
        return (
            f"is in the future (more than {MAX_CLOCK_SKEW.seconds // 60} min ahead of this clock)"
        )
    return None


def checked_when(value: str, where: str, what: str = "when") -> str:
    """``value`` when it is a time a record may carry; :class:`HistoryError` naming ``where``."""
    problem = time_problem(value)
    if problem is not None:
        raise HistoryError(
            f"{where}: `{what}` {shown(value)} {problem}; a record's time is the ISO-8601 UTC time "
            "it was recorded at (mizzen-ci writes it)"
        )
    return value


def history_files(path: Path | str) -> list[Path]:
    """``path`` itself, or every regular ``*.jsonl`` file below it when it is a directory
    (sorted; links are not followed, at most :data:`MAX_STORE_DEPTH` levels down)."""
    path = Path(path)
    try:
        is_dir = stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        is_dir = False
    if not is_dir:
        return [path]  # read_bytes says what it is if it is no store
    found: list[Path] = []
    stack = [(os.fspath(path), 0)]
    while stack:
        d, depth = stack.pop()
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    if depth < MAX_STORE_DEPTH:
                        stack.append((e.path, depth + 1))
                elif e.name.endswith(".jsonl") and e.is_file(follow_symlinks=False):
                    found.append(Path(e.path))
            except OSError:
                continue
    return sorted(found)


def _lines(path: Path, missing_ok: bool) -> tuple[list[str] | None, str | None]:
    """``(lines, None)`` of a store, ``(None, problem)`` when it cannot be read, ``([], None)``
    for a missing one when ``missing_ok``."""
    try:
        data, _ = read_bytes(path, MAX_STORE_BYTES)
    except FileNotFoundError:
        return ([], None) if missing_ok else (None, f"{path}: no such history file")
    except OSError as e:
        return None, f"{path}: cannot read: {e}"
    try:
        return data.decode("utf-8").splitlines(), None
    except UnicodeDecodeError as e:
        return (
            None,
            f"{path}: not UTF-8 ({e.reason} at byte {e.start}); a store is UTF-8 JSON lines",
        )


def read_lines(
    paths: Iterable[Path | str] | Path | str, *, missing_ok: bool = False
) -> tuple[list[tuple[str, object]], list[str]]:
    """``([(where, parsed JSON value)], problems)`` of every non-blank line of the stores (files,
    or directories of ``*.jsonl``): a line that is too long or not JSON is a problem naming
    ``path:line``, as is a store that cannot be read."""
    if isinstance(paths, str | Path):
        paths = [paths]
    values: list[tuple[str, object]] = []
    problems: list[str] = []
    for given in paths:
        for path in history_files(given):
            lines, problem = _lines(path, missing_ok)
            if problem is not None:
                problems.append(problem)
                continue
            for lineno, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                if len(line) > MAX_LINE_CHARS:
                    problems.append(
                        f"{where}: the line is {len(line)} characters, over {MAX_LINE_CHARS}"
                    )
                    continue
                try:
                    values.append((where, json.loads(line)))
                except json.JSONDecodeError as e:
                    problems.append(f"{where}: not JSON: {e.msg}")
                except (ValueError, RecursionError) as e:  # a 5000-digit integer, deep nesting
                    problems.append(f"{where}: not usable JSON: {e.__class__.__name__}")
    return values, problems


def read_stores(
    paths: Iterable[Path | str] | Path | str, *, missing_ok: bool = False
) -> tuple[list[Record], list[str]]:
    """``(records, problems)``: every good record of the stores, in file order, and one problem
    per dropped line or unreadable store (see the module docstring)."""
    return read_parsed(  # a flake line is the flake record's kind (see the module docstring)
        paths,
        _record_from,
        HistoryError,
        missing_ok=missing_ok,
        keep=lambda obj: line_kind(obj) == "duration",
    )


def read_parsed[T](
    paths: Iterable[Path | str] | Path | str,
    parse: Callable[[object, str], T],
    refused: type[Exception] | tuple[type[Exception], ...],
    *,
    missing_ok: bool = False,
    keep: Callable[[object], bool] = lambda obj: True,
) -> tuple[list[T], list[str]]:
    """``(items, problems)``: ``parse(value, where)`` of every line of the stores
    (:func:`read_lines`) that ``keep`` takes, in file order; a line that cannot be read, or that
    ``parse`` refuses by raising ``refused``, is a problem (its message), the problems in path and
    line order."""
    items: list[T] = []
    values, problems = read_lines(paths, missing_ok=missing_ok)
    for where, obj in values:
        if not keep(obj):
            continue
        try:
            items.append(parse(obj, where))
        except refused as e:
            problems.append(str(e))
    problems.sort(key=_where_order)
    return items, problems


def is_flake_line(obj: object) -> bool:
    """Whether a parsed line has the shape of a flake record (``class`` and ``final``, no
    ``seconds``) rather than of a duration record."""
    return isinstance(obj, dict) and "class" in obj and "final" in obj and "seconds" not in obj


def is_kinded_line(obj: object) -> bool:
    """Whether a parsed line is a kinded record (an object with a string ``kind``), another
    concern's record that the duration and flake readers leave alone."""
    return isinstance(obj, dict) and isinstance(obj.get("kind"), str)


def line_kind(obj: object) -> str:
    """The one reader a parsed line belongs to: ``kinded`` (:func:`is_kinded_line`, first: a
    kinded line is no other reader's), ``flake`` (:func:`is_flake_line`) or ``duration``."""
    if is_kinded_line(obj):
        return "kinded"
    return "flake" if is_flake_line(obj) else "duration"


@dataclass(frozen=True)
class History:
    """Everything of a history store read in one pass (:func:`read_history`)."""

    records: list[Record]
    flakes: list[FlakeRecord]
    kinded: dict[str, list]
    problems: list[str]  # one per unreadable store or dropped line, in path and line order


def read_history(
    paths: Iterable[Path | str] | Path | str,
    kinds: dict[str, Callable[[object, str], object]] | None = None,
    refused: type[Exception] = HistoryError,
) -> History:
    """The duration records, the flake records and the kinded records of ``kinds`` (parsers
    refusing a line with ``refused``) of the stores at ``paths`` (missing ones are empty), each
    store read once: an unreadable store or a bad line is one problem, whichever reader it
    concerns (other kinds are left to their readers, as :func:`read_kinded` leaves them)."""
    kinds = kinds or {}

    def parse(obj: object, where: str) -> tuple[str, str | None, object]:
        kind = line_kind(obj)
        if kind == "kinded":
            return kind, obj["kind"], kinds[obj["kind"]](obj, where)
        return kind, None, (_record_from if kind == "duration" else _flake_from)(obj, where)

    items, problems = read_parsed(paths, parse, (HistoryError, refused), missing_ok=True,
                                  keep=lambda obj: line_kind(obj) != "kinded" or obj["kind"] in kinds)  # fmt: skip
    of = lambda kind: [item for k, _, item in items if k == kind]  # noqa: E731
    kinded = {name: [item for _, n, item in items if n == name] for name in kinds}
    return History(of("duration"), of("flake"), kinded, problems)


def read_kinded(
    paths: Iterable[Path | str] | Path | str,
    kinds: dict[str, Callable[[object, str], object]],
    refused: type[Exception],
) -> tuple[dict[str, list], list[str]]:
    """``({kind: [parse(line, where)…]}, problems)`` of the kinded lines of ``kinds`` in the
    stores at ``paths`` (other kinds are left to their readers); a line a parser refuses with
    ``refused`` is a problem naming ``path:line``."""
    found: dict[str, list] = {kind: [] for kind in kinds}

    def parse(obj: object, where: str):
        found[obj["kind"]].append(kinds[obj["kind"]](obj, where))

    _, problems = read_parsed(paths, parse, refused, missing_ok=True,
                              keep=lambda obj: line_kind(obj) == "kinded" and obj["kind"] in kinds)  # fmt: skip
    return found, problems


def _where_order(problem: str) -> tuple[str, int]:
    path, _, rest = problem.partition(":")
    line = rest.split(":", 1)[0]
    return path, int(line) if line.isdigit() else 0


def load(paths: Iterable[Path | str] | Path | str, *, missing_ok: bool = False) -> list[Record]:
    """Every record of the given stores (files, or directories of ``*.jsonl``), in file order;
    :class:`HistoryError` for the first bad line or store (:func:`read_stores` keeps the good)."""
    records, problems = read_stores(paths, missing_ok=missing_ok)
    if problems:
        raise HistoryError(problems[0])
    return records


def dropped_warning(problems: list[str], what: str = "history") -> str:
    """One warning for the lines a reader dropped: the first few, and how many in all."""
    head = "; ".join(problems[:MAX_PROBLEMS_SHOWN])
    more = len(problems) - MAX_PROBLEMS_SHOWN
    return f"{what}: {len(problems)} bad line(s) or store(s) dropped, the rest used: {head}" + (
        f"; and {more} more" if more > 0 else ""
    )


def compact(records: Iterable[Record], *, keep: int = 50) -> list[Record]:
    """The newest ``keep`` records of each (file, arch, outcome class), oldest first: a bounded
    store that still holds every estimate's inputs."""
    groups: dict[tuple[str, str | None, bool], list[Record]] = {}
    for r in dict.fromkeys(records):  # a record given twice (a re-uploaded artifact) counts once
        groups.setdefault((r.file, r.arch, r.outcome == "passed"), []).append(r)
    kept = [r for rs in groups.values() for r in sorted(rs, key=lambda r: r.when)[-keep:]]
    return sorted(kept, key=lambda r: (r.when, r.file, r.arch or ""))


# --------------------------------------------------------------------------------------------
# Estimates


def quantile(values: list[float], q: float = QUANTILE) -> float:
    """Nearest-rank quantile of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class Estimator:
    """Seconds per (file, arch): the p90 of recent passing runs, else the registration's est_time."""

    def __init__(
        self, records: Iterable[Record] = (), *, recent: int = RECENT, q: float = QUANTILE
    ):
        passing: dict[tuple[str, str | None], list[Record]] = {}
        for r in records:
            if r.outcome == "passed":
                passing.setdefault((r.file, r.arch), []).append(r)
        self._p: dict[tuple[str, str | None], tuple[float, int]] = {}
        for key, rs in passing.items():
            last = [r.seconds for r in sorted(rs, key=lambda r: r.when)[-recent:]]
            self._p[key] = (quantile(last, q), len(last))

    def __len__(self) -> int:
        return len(self._p)

    def estimate(self, file: str, arch: str | None, est_time: float) -> Estimate:
        found = self._p.get((file, arch))
        if found is None:
            return Estimate(float(est_time), "est_time", 0)
        seconds, n = found
        return Estimate(max(seconds, 0.001), "history", n)

    def seconds(self, file: str, arch: str | None, est_time: float) -> float:
        return self.estimate(file, arch, est_time).seconds


# --------------------------------------------------------------------------------------------
# The flake record


@dataclass(frozen=True)
class FlakeRecord:
    """One retried attempt of a test file: its class, the evidence and how the file ended."""

    file: str
    arch: str
    klass: str
    evidence: str
    final: str  # outcome of the file after its retry
    when: str
    job: str | None = None

    def to_json(self) -> str:
        d = asdict(self)
        d["class"] = d.pop("klass")
        return json.dumps(d, sort_keys=True)


def append_flakes(path: Path | str, records: Iterable[FlakeRecord]) -> int:
    return append_jsonl(path, (r.to_json() for r in records))


_FLAKE_TEXT = {"file": MAX_PATH_CHARS, "arch": MAX_NAME_CHARS, "class": MAX_NAME_CHARS,
               "evidence": MAX_LINE_CHARS, "final": MAX_NAME_CHARS, "when": MAX_NAME_CHARS}  # fmt: skip


def _flake_from(obj: object, where: str) -> FlakeRecord:
    if not isinstance(obj, dict):
        raise HistoryError(f"{where}: a flake record must be a JSON object")
    values = {}
    for name, limit in _FLAKE_TEXT.items():
        value = obj.get(name)
        if not isinstance(value, str) or len(value) > limit:
            raise HistoryError(
                f"{where}: flake record `{name}` must be a string of at most {limit} characters, "
                f"got {shown(value)}"
            )
        values[name] = checked_utf8(value, where, f"flake record `{name}`")
    checked_when(values["when"], where)
    job = obj.get("job")
    if job is not None and not (isinstance(job, str) and len(job) <= MAX_PATH_CHARS):
        raise HistoryError(f"{where}: flake record `job` must be a string or null")
    if job is not None:
        checked_utf8(job, where, "flake record `job`")
    return FlakeRecord(
        file=values["file"], arch=values["arch"], klass=values["class"],
        evidence=values["evidence"], final=values["final"], when=values["when"], job=job,
    )  # fmt: skip


def read_flake_records(
    paths: Iterable[Path | str] | Path | str,
) -> tuple[list[FlakeRecord], list[str]]:
    """``(flake records, problems)`` of the flake-shaped lines of the stores at ``paths``
    (duration lines are the other kind and are left to :func:`read_stores`)."""
    return read_parsed(
        paths, _flake_from, HistoryError, missing_ok=True, keep=lambda o: line_kind(o) == "flake"
    )


def compact_flakes(records: Iterable[FlakeRecord], *, keep: int = 50) -> list[FlakeRecord]:
    """The newest ``keep`` flake records of each (file, arch), oldest first; one of each."""
    groups: dict[tuple[str, str], list[FlakeRecord]] = {}
    for r in dict.fromkeys(records):
        groups.setdefault((r.file, r.arch), []).append(r)
    kept = [r for rs in groups.values() for r in sorted(rs, key=lambda r: r.when)[-keep:]]
    return sorted(kept, key=lambda r: (r.when, r.file, r.arch))


@dataclass(frozen=True)
class FlakeRate:
    """How often runs of one (file, arch) needed a retry."""

    file: str
    arch: str
    runs: int  # duration records of the pair (every run of the file leaves one)
    retried: int  # flake records of the pair (one per retried attempt)

    @property
    def rate(self) -> float | None:
        return self.retried / self.runs if self.runs else None


def flake_rates(records: Iterable[Record], flakes: Iterable[FlakeRecord]) -> list[FlakeRate]:
    """The flake rate of every (file, arch) with a flake record, highest first (a pair with no
    recorded run sorts by its retries, after those with a rate)."""
    runs: dict[tuple[str, str | None], int] = {}
    for r in dict.fromkeys(records):
        runs[(r.file, r.arch)] = runs.get((r.file, r.arch), 0) + 1
    retried: dict[tuple[str, str], int] = {}
    for f in dict.fromkeys(flakes):
        retried[(f.file, f.arch)] = retried.get((f.file, f.arch), 0) + 1
    rates = [
        FlakeRate(file, arch, runs.get((file, arch), 0), n) for (file, arch), n in retried.items()
    ]
    return sorted(
        rates,
        key=lambda x: (x.rate is None, -(x.rate or 0.0), -x.retried, x.file, x.arch),
    )


def read_flakes(path: Path) -> tuple[dict[tuple[str, str], int], list[str]]:
    """``(retried attempts per (file, arch), problems)`` of the flake record: a line that is not
    a flake record is dropped with a problem naming ``path:line`` (see the module docstring)."""
    counts: dict[tuple[str, str], int] = {}
    values, problems = read_lines(path, missing_ok=True)
    for where, obj in values:
        file = obj.get("file") if isinstance(obj, dict) else None
        arch = obj.get("arch") if isinstance(obj, dict) else None
        if not (
            isinstance(file, str)
            and isinstance(arch, str)
            and len(file) <= MAX_PATH_CHARS
            and len(arch) <= MAX_NAME_CHARS
            and utf8_problem(file) is None
            and utf8_problem(arch) is None
        ):
            problems.append(
                f"{where}: not a flake record line (an object with `file` and `arch` strings of "
                f"at most {MAX_PATH_CHARS} and {MAX_NAME_CHARS} characters that UTF-8 can encode)"
            )
            continue
        counts[(file, arch)] = counts.get((file, arch), 0) + 1
    problems.sort(key=_where_order)
    return counts, problems


# --------------------------------------------------------------------------------------------
# Command line: ``mizzen-ci history record|merge``


def write(path: Path | str, records: Iterable[Record]) -> int:
    """Replace the store at ``path`` with ``records`` (atomically: temporary file + rename)."""
    return write_lines(path, (r.to_json() for r in records))


def write_lines(path: Path | str, lines: Iterable[str]) -> int:
    """Replace the JSON-lines file at ``path`` with ``lines`` (temporary file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    lines = list(lines)
    try:
        tmp.write_text("".join(mask(line) + "\n" for line in lines), encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return len(lines)


def _flakes(args: argparse.Namespace) -> int:
    if not 1 <= args.top <= 10_000:
        print("history flakes: --top must be 1-10000", file=sys.stderr)
        return 2
    inputs = args.inputs
    if not inputs:
        from .fleet import find_repo_root

        root = find_repo_root()
        inputs = [root / ".ci-artifacts" / "history", root / ".ci-artifacts" / "flakes.jsonl"]
    read = read_history(inputs)
    records = read.records
    for problem in read.problems:
        print(plain(f"history: dropped {problem}"), file=sys.stderr)
    rates = flake_rates(records, read.flakes)[: args.top]
    if args.json:
        rows = [
            {"file": r.file, "arch": r.arch, "runs": r.runs, "retried": r.retried, "rate": r.rate}
            for r in rates
        ]
        print(json.dumps({"flakes": rows}, indent=2))
        return 0
    if not rates:
        print(f"history flakes: no flake record in {len(records)} run(s)")
        return 0
    table = [
        (r.file, r.arch, r.runs or "-", r.retried, "-" if r.rate is None else f"{r.rate:.0%}")
        for r in rates
    ]
    print(text_table(("file", "arch", "runs", "retried", "rate"), table))
    print(f"\n{len(rates)} flaky (file, arch) pair(s) over {len(records)} recorded run(s)")
    return 0


def add_arguments(command: str, parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="history_command", required=True, metavar="ACTION")
    rec = sub.add_parser("record", help="append the per-file records of a junit XML report")
    rec.add_argument("--junit", type=Path, required=True)
    rec.add_argument("--lane", required=True, help="cpu or gpu-ARCH")
    rec.add_argument("--arch", help="the GPU generation (none for the CPU lane)")
    rec.add_argument("--job", help="the planned job id")
    rec.add_argument("--out", type=Path, required=True, help="the JSON-lines store to append to")
    merge = sub.add_parser("merge", help="merge stores into one, newest records kept")
    merge.add_argument("--out", type=Path, required=True)
    merge.add_argument(
        "--flakes-out",
        type=Path,
        help="where the flake records go (default: OUT's folder/flakes.jsonl)",
    )
    merge.add_argument("--keep", type=int, default=50)
    merge.add_argument("inputs", nargs="+", type=Path, help="stores: files or directories")
    flakes = sub.add_parser("flakes", help="the flakiest (file, arch) pairs, with their rates")
    flakes.add_argument("--top", type=int, default=20, help="pairs to list (default %(default)s)")
    flakes.add_argument("--json", action="store_true", help="print JSON instead of a table")
    flakes.add_argument(
        "inputs",
        nargs="*",
        type=Path,
        help="stores: files or directories (default: .ci-artifacts/history and "
        ".ci-artifacts/flakes.jsonl of the tree)",
    )


def run(command: str, args: argparse.Namespace) -> int:
    try:
        if args.history_command == "record":
            records = records_from_junit(args.junit, arch=args.arch, lane=args.lane, job=args.job)
            n = append(args.out, records)
            print(f"history: {n} record(s) from {args.junit} appended to {args.out}")
        elif args.history_command == "flakes":
            return _flakes(args)
        else:
            read = read_history(args.inputs)
            for problem in read.problems:
                print(plain(f"history: dropped {problem}"), file=sys.stderr)
            n = write(args.out, compact(read.records, keep=args.keep))
            flakes_out = args.flakes_out or args.out.with_name("flakes.jsonl")
            m = write_lines(
                flakes_out, (f.to_json() for f in compact_flakes(read.flakes, keep=args.keep))
            )
            print(
                f"history: {n} record(s) from {len(args.inputs)} input(s) written to {args.out}, "
                f"{m} flake record(s) to {flakes_out}"
            )
    except HistoryError as e:
        print(plain(f"history: {e}"), file=sys.stderr)
        return 1
    except OSError as e:  # an --out that is a folder, or in one that cannot be written
        print(plain(f"history: {e.filename or ''}: {e.strerror or e}; give --out (and "
                    "--flakes-out) a file path in a folder you can write"), file=sys.stderr)  # fmt: skip
        return 2
    return 0
