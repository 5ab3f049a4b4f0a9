"""The metric history store: one interface, two backends (SQLite, PostgreSQL), one schema.

Schema (the same tables in both; ``metric_values`` because ``values`` is an SQL keyword)::

    runs(id, test, arch, pool, commit_sha, pr, event, trusted, attempt, created, source)
        UNIQUE (source, test, arch, attempt)          -- the natural key of a run
        INDEX runs_recent_trusted (test, arch, created) WHERE trusted
    metric_values(run -> runs.id, metric, step, value, kind)
        PRIMARY KEY (run, metric, step)
    run_environments(run -> runs.id PRIMARY KEY, environment)
    mizzen_meta(key, value)                           -- schema = SCHEMA_VERSION

``run_environments`` holds the environment each run was produced in (:mod:`.environment`); a run
stored before it existed has no row and is of the environment ``unknown``, and a store without
the table (written by an older mizzen-ci, opened read-only) reads as all ``unknown``: the table
is additive, the schema version unchanged, and an older mizzen-ci reads a newer store.

"Recent trusted values of (test, arch, metric, step)" is one walk of ``runs_recent_trusted``
newest first, probing ``metric_values``' primary key for (metric, step).  ``kind`` is ``finite``
(``value`` holds it) or ``nan``/``inf``/``-inf`` (``value`` is NULL): a non-finite value is kept as
what it was, in both backends alike.

Invariants:
- Writes are idempotent: a run is stored with all its values in one transaction, or not at all
  when its natural key (the run key of the artefact, test, arch, attempt) is already there, so a
  re-uploaded or re-merged artefact never counts twice (:meth:`MetricStore.add_run` says which).
- Only trusted runs feed a reference (:meth:`MetricStore.history`); :meth:`MetricStore.mark_untrusted`
  takes runs out of every later reference without deleting them.
- ``created`` has one format, the one the store writes (:func:`~.artefacts.utc_iso`): UTC with
  microseconds, ``2026-12-01T10:00:00.000000+00:00`` (so text order is time order; PostgreSQL
  keeps a ``TIMESTAMPTZ``, read back in the same form), from :data:`~mizzen_ci.history.EARLIEST`
  to now + :data:`~mizzen_ci.history.MAX_CLOCK_SKEW`.  A run is written with it or refused
  (:func:`check_run`), and a row read with anything else is a bad row (:func:`checked_created`).
- Everything read back is untrusted input (a store file from a cache, a shared database): every
  row is checked and bounded (:func:`checked_value`, :func:`checked_created`); a bad row is
  dropped with a problem naming its run id, never used and never a traceback.  Each backend
  bounds a query's time.
- Bad rows never shrink the evidence.  Every "newest first" read (:meth:`MetricStore.history`,
  :meth:`~MetricStore.last_steps`, :meth:`~MetricStore.environments`) is made of walks,
  :func:`walk_newest`: rows are read in pages newest first, only those whose ``created`` lies
  within the bounds above (filtered in SQL, so a ``created`` of ``'9999'`` or ``'infinity'``
  never sorts first; :meth:`MetricStore.history` names the runs left out so, of the environment
  asked for), each is checked in Python, and the walk goes on past every dropped row until it
  has the valid rows asked for or the rows run out.  So the window of N trusted values is the
  newest N *valid* rows, whatever bad rows sit among them.  A value row is valid for every read
  alike (one check, :func:`checked_value`): :meth:`~MetricStore.last_steps` passes over a run
  whose values of the metric are all bad, and :meth:`~MetricStore.environments` lists an
  environment by its newest valid value (it groups the series by environment in SQL, then walks
  each environment only down to its newest valid row, so an honest store of any size costs one
  short walk per environment).  A walk reads at most :data:`MAX_ROWS_SCANNED` rows (one read of
  :meth:`~MetricStore.environments` at most that many in all its walks): past that it is a
  :class:`StoreError` (the gate errors), never a shorter window.  The upper bound is this
  machine's now + :data:`~mizzen_ci.history.MAX_CLOCK_SKEW`: a run written by a machine whose
  clock runs further ahead is left out (and named) until this clock passes its time.
- Every error is a :class:`StoreError` whose message shows the store only through
  :func:`~mizzen_ci.gate.redact.redact_url` (a password never appears in a message, a ``repr()``
  or a log line); the store's secrets are registered in the process-wide mask set when the URL
  is chosen (:func:`store_url`, :func:`~mizzen_ci.gate.backends.open_store`), and a
  :class:`StoreError` message and a store's ``repr()`` are masked with it.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from ..masking import mask, register_connection
from ..registry.rules import shown
from .artefacts import MAX_ABS_VALUE, MAX_KEY_CHARS, NONFINITE, utc_iso, valid_test_path, valid_when
from .environment import UNKNOWN
from .environment import checked as checked_environment

SCHEMA_VERSION = "1"
STORE_ENV = "MIZZEN_METRICS_STORE"
DEFAULT_STORE = Path(".ci-artifacts") / "history" / "metrics.sqlite"
MAX_WINDOW = 1000
MAX_STEPS_READ = 10_000
MAX_ENVIRONMENTS = 50
EVENTS = ("push", "schedule", "workflow_dispatch", "pull_request", "merge_group", "local")
TRUSTED_EVENTS = ("push", "schedule", "workflow_dispatch", "local")
KINDS = ("finite", "nan", "inf", "-inf")
CREATED = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{6}\+00:00")
CREATED_EXAMPLE = "2026-12-01T10:00:00.000000+00:00"
MAX_ROWS_SCANNED = 100_000  # rows one walk reads (valid or not) before it refuses the store
PAGE_ROWS = 1000  # the most rows one page of a walk reads
MAX_PROBLEMS = 20  # dropped rows named one by one in one read (the rest are counted)


class StoreError(RuntimeError):
    """The store cannot be opened, read or written; the message says which store (redacted),
    what failed and the fix, with every registered secret masked (:mod:`mizzen_ci.masking`)."""

    def __init__(self, message: object):
        super().__init__(mask(message))


@dataclass(frozen=True)
class RunInfo:
    """One run of one test file on one arch, as the store keeps it."""

    test: str
    arch: str
    pool: str
    commit: str
    pr: int | None
    event: str
    trusted: bool
    attempt: int
    created: str  # ISO-8601 with its offset; stored in the store's one format (UTC, microseconds)
    source: str  # the run key of the artefact
    environment: str = UNKNOWN  # :mod:`.environment`


@dataclass(frozen=True)
class StoredValue:
    """One value of a (test, arch, metric, step) series, with the run it came from."""

    value: float
    created: str
    commit: str
    source: str
    run_id: int


def kind_of(value: float) -> str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return "finite"


def created_bounds() -> tuple[str, str]:
    """The earliest and the latest ``created`` a row may have, in the store's format."""
    from ..history import EARLIEST, MAX_CLOCK_SKEW

    latest = datetime.now(UTC) + MAX_CLOCK_SKEW
    return utc_iso(EARLIEST.isoformat()), utc_iso(latest.isoformat())


def created_range() -> str:
    """The bounds of :func:`created_bounds` in words, derived from the same constants."""
    from ..history import EARLIEST

    return f"from {EARLIEST.date()} to {clock_skew_minutes()} min after now by this machine's clock"


def clock_skew_minutes() -> str:
    """:data:`~mizzen_ci.history.MAX_CLOCK_SKEW` in minutes, as shown in messages."""
    from ..history import MAX_CLOCK_SKEW

    return f"{MAX_CLOCK_SKEW.total_seconds() / 60:g}"


def checked_created(created: object, run_id: object) -> str:
    """A stored ``created`` in the store's one format (a PostgreSQL ``TIMESTAMPTZ`` is put in
    it); :class:`ValueError` naming the run otherwise (see the module docstring)."""
    if isinstance(created, datetime) and created.tzinfo is not None:
        with contextlib.suppress(OverflowError, ValueError):  # else refused below: not text
            created = created.astimezone(UTC).isoformat(timespec="microseconds")
    if not (
        isinstance(created, str)
        and CREATED.fullmatch(created)
        and valid_when(created)
        and utc_iso(created) == created
    ):
        raise ValueError(
            f"run {run_id}: `created` {shown(created)} is not a time in the store's format "
            f"(UTC with microseconds, e.g. {CREATED_EXAMPLE}, {created_range()})"
        )
    return created


def walk_newest(
    read_page: Callable[[Sequence | None, int], list[Sequence]],
    check: Callable[[Sequence], object],
    first: int,
    shown_store: str,
) -> Iterator[tuple[object, str | None]]:
    """The rows of one "newest first" read, checked: ``(check(row), None)`` for a valid row,
    ``(None, problem)`` for a dropped one, newest first, until the caller stops or the rows run
    out.  ``read_page(after, n)``: at most ``n`` rows older than the row ``after`` (``None``:
    from the newest), newest first; the first page reads ``first`` rows, later ones more.
    :class:`StoreError` once :data:`MAX_ROWS_SCANNED` rows are read (see the module docstring)."""
    after, n, scanned = None, max(1, min(first, PAGE_ROWS)), 0
    while True:
        rows = read_page(after, n)[:n]
        for row in rows:
            try:
                checked = check(row)
            except (ValueError, TypeError) as e:
                yield None, str(e)
                continue
            yield checked, None
        scanned += len(rows)
        if len(rows) < n:
            return
        if scanned >= MAX_ROWS_SCANNED:
            raise StoreError(
                f"{shown_store}: {scanned} rows read newest first without finding the valid ones "
                "asked for; the store is damaged or crafted: rebuild it from artefacts"
            )
        after, n = rows[-1], min(PAGE_ROWS, 2 * n)


def checked_value(row: tuple, run_id: object) -> StoredValue:
    """A ``(value, kind, commit_sha, source, created, run id)`` row as a :class:`StoredValue`;
    :class:`ValueError` naming what is wrong (see the module docstring)."""
    value, kind, commit, source, created, rid = row
    if kind not in KINDS:
        raise ValueError(f"run {run_id}: kind {str(kind)[:20]!r} is not one of {', '.join(KINDS)}")
    if kind == "finite":
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"run {run_id}: a finite value that is not a number")
        if not (isinstance(value, float) and math.isfinite(value)) and not (
            isinstance(value, int) and abs(value) <= 2**63
        ):
            raise ValueError(f"run {run_id}: a finite value that is not finite")
        number = float(value)
        if not -MAX_ABS_VALUE <= number <= MAX_ABS_VALUE:  # what an artefact may hold
            raise ValueError(f"run {run_id}: a finite value not within ±{MAX_ABS_VALUE:g}")
    elif value is not None:
        raise ValueError(f"run {run_id}: a {kind} value with a number beside it")
    else:
        number = NONFINITE[kind]
    created = checked_created(created, run_id)
    if not (isinstance(commit, str) and len(commit) <= 64):
        raise ValueError(f"run {run_id}: `commit_sha` is not a commit")
    if not (isinstance(source, str) and len(source) <= MAX_KEY_CHARS):
        raise ValueError(f"run {run_id}: `source` is not a run key")
    if isinstance(rid, bool) or not isinstance(rid, int):
        raise ValueError(f"run {run_id}: the id is not an integer")
    return StoredValue(number, created, commit, source, rid)


def check_run(run: RunInfo) -> None:
    """Refuse a run that the schema could not hold faithfully (bounded text, known event)."""
    problems = []
    if not valid_test_path(run.test):
        problems.append(f"test {run.test[:80]!r} is not a test file path")
    for name in ("arch", "pool", "commit", "source"):
        value = getattr(run, name)
        if not (isinstance(value, str) and 0 < len(value) <= MAX_KEY_CHARS and value.isprintable()):
            problems.append(
                f"{name} {str(value)[:80]!r} is not 1-{MAX_KEY_CHARS} printable characters"
            )
    try:
        checked_environment(run.environment)
    except ValueError as e:
        problems.append(str(e))
    if run.event not in EVENTS:
        problems.append(f"event {run.event[:40]!r} is not one of {', '.join(EVENTS)}")
    if run.trusted and run.event not in TRUSTED_EVENTS:
        problems.append(f"a {run.event} run is never trusted")
    if not valid_when(run.created):
        problems.append(
            f"created {shown(run.created)} is not an ISO-8601 time with its UTC offset "
            f"{created_range()} (e.g. {CREATED_EXAMPLE})"
        )
    if not (type(run.attempt) is int and 1 <= run.attempt <= 1000):
        problems.append("attempt is not an integer from 1 to 1000")
    if run.pr is not None and not (type(run.pr) is int and 1 <= run.pr <= 10**9):
        problems.append("pr is not a pull-request number")
    if problems:
        raise StoreError("refused run: " + "; ".join(problems))


class MetricStore(ABC):
    """The interface every backend implements (see the module docstring)."""

    #: the store as it may be shown (:func:`~mizzen_ci.gate.redact.redact_url`)
    shown: str

    def __repr__(self) -> str:
        return mask(f"<{type(self).__name__} {self.shown}>")

    @abstractmethod
    def add_run(self, run: RunInfo, values: Mapping[tuple[str, int], float]) -> bool:
        """Store ``run`` with its ``{(metric, step): value}`` in one transaction; False when its
        natural key is already stored (nothing is written then)."""

    def history(
        self,
        test: str,
        arch: str,
        metric: str,
        step: int,
        *,
        limit: int,
        exclude_source: str | None = None,
        environment: str | None = None,
    ) -> tuple[list[StoredValue], list[str]]:
        """The newest ``limit`` valid trusted values of the series, newest first, leaving out the
        run ``exclude_source`` (the run being judged), of ``environment`` only when it is given;
        and the problems of the rows dropped on the way (:func:`walk_newest`)."""
        limit = max(1, min(int(limit), MAX_WINDOW))
        series = (test, arch, metric, step)
        pages = self._history_pages(series, exclude_source or "", environment)
        good, problems, dropped = [], [], 0
        outside = self._out_of_bounds(series, exclude_source or "", MAX_PROBLEMS + 1, environment)
        if outside:
            named = ", ".join(str(i)[:20] for i in outside[:MAX_PROBLEMS])
            problems.append(
                f"{self.shown}: left out the stored values of {metric}@{step} of run(s) {named}"
                f"{' and more' if len(outside) > MAX_PROBLEMS else ''}"
                f"{f' (environment {shown(environment)})' if environment is not None else ''}: "
                f"`created` is not a time {created_range()} (the store writes UTC with "
                f"microseconds, e.g. {CREATED_EXAMPLE}). Either a writer's clock runs more than "
                f"{clock_skew_minutes()} min ahead of this machine's (fix its clock, e.g. NTP; "
                "the runs count once this clock passes their time), or the store is damaged or "
                "crafted: rebuild it from artefacts"
            )
        walk = walk_newest(pages, lambda row: checked_value(tuple(row), row[-1]), limit, self.shown)
        for value, problem in walk:
            if problem is None:
                good.append(value)
                if len(good) == limit:
                    break
            elif (dropped := dropped + 1) <= MAX_PROBLEMS:
                problems.append(
                    f"{self.shown}: dropped a stored value of {metric}@{step}: {problem}"
                )
        if dropped > MAX_PROBLEMS:
            problems.append(
                f"{self.shown}: dropped {dropped - MAX_PROBLEMS} more stored value(s) of "
                f"{metric}@{step}; the store is damaged or crafted: rebuild it from artefacts"
            )
        return good, problems

    @abstractmethod
    def _history_pages(
        self,
        series: tuple[str, str, str, int],
        exclude_source: str,
        environment: str | None = None,
    ) -> Callable[[Sequence | None, int], list[Sequence]]:
        """The ``read_page`` of :func:`walk_newest` for :meth:`history`: rows ``(value, kind,
        commit, source, created, run id)`` as stored (:meth:`history` checks them), none of the
        run ``exclude_source`` (``""``: none left out), of ``environment`` when given."""

    @abstractmethod
    def _out_of_bounds(
        self,
        series: tuple[str, str, str, int],
        exclude_source: str,
        most: int,
        environment: str | None = None,
    ) -> list[object]:
        """The ids of at most ``most`` trusted runs of the series (of ``environment`` when it is
        given) whose ``created`` is outside its bounds (never read by a walk: named in
        :meth:`history`'s problems)."""

    @abstractmethod
    def environments(self, test: str, arch: str, metric: str, step: int) -> list[str]:
        """The environments of the series' valid trusted values, newest first by the newest
        valid value of each (at most :data:`MAX_ENVIRONMENTS`): an environment is listed by its
        newest row that :func:`checked_value` takes, one with none is left out.  Its cost grows
        with the number of environments, not of rows (see the module docstring)."""

    @abstractmethod
    def last_steps(self, test: str, arch: str, metric: str) -> tuple[int, ...]:
        """The steps of the valid values of ``metric`` (rows :func:`checked_value` takes) of the
        newest trusted run that has one; a run with none is passed over (:func:`walk_newest`)."""

    def mark_untrusted(
        self,
        *,
        commit: str | None = None,
        source: str | None = None,
        test: str | None = None,
        arch: str | None = None,
    ) -> int:
        """Mark the runs matching every given field untrusted; the number of runs changed."""
        fields = {"commit": commit, "source": source, "test": test, "arch": arch}
        return self._mark_untrusted({f: v for f, v in fields.items() if v})

    @abstractmethod
    def _mark_untrusted(self, match: Mapping[str, str]) -> int:
        """:meth:`mark_untrusted` of the fields given (``commit``, ``source``, ``test``,
        ``arch``, in that order); refused without a commit or a source."""

    @abstractmethod
    def count_runs(self, *, trusted: bool | None = None) -> int: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def store_url(given: str | None, root: Path) -> str:
    """The store to use: ``--store``, else ``$MIZZEN_METRICS_STORE``, else the SQLite file of the
    tree's history folder (:data:`DEFAULT_STORE`); its secrets registered in the mask set."""
    url = given or os.environ.get(STORE_ENV) or str(Path(root) / DEFAULT_STORE)
    register_connection(url)
    return url
