"""The SQL both store backends run: one implementation of :class:`~.store.MetricStore` over
three primitives a backend provides (a query, a statement, a transaction).

Invariants:
- Statements are written once, with ``?`` placeholders (a backend with another parameter style
  rewrites them; no statement holds a literal ``?``), and use only what SQLite ≥ 3.35 and
  PostgreSQL ≥ 12 both run (``ON CONFLICT … DO NOTHING``, ``RETURNING``, partial indexes).
- Values are always bound as parameters, never formatted into SQL text.
- Every value row read goes through :func:`~.store.checked_value` (history, the steps of
  :meth:`SqlStore.last_steps`, the environments of :meth:`SqlStore.environments`: one check for
  every read); every other row through an equivalent bound check.
- Every "newest first" read is a walk (:func:`~.store.walk_newest`, :meth:`SqlStore._pages`)
  over a statement ending in :data:`NEWEST_FIRST`: the same SQL on both backends filters
  ``created`` to its bounds (SQLite compares the text, PostgreSQL the ``TIMESTAMPTZ``: one order,
  the time's) and pages by ``(created, id)``, so no row outside the bounds sorts first and no
  row is read twice.  :meth:`SqlStore.environments` first groups the series by environment
  (:data:`ENVIRONMENT_GROUPS`, within the same bounds), then walks each environment down to its
  newest valid row only.
"""

from __future__ import annotations

import contextlib
from abc import abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence

from . import store as _store
from .artefacts import MAX_STEP, utc_iso
from .environment import UNKNOWN
from .environment import checked as checked_environment
from .store import (
    MAX_ENVIRONMENTS,
    MAX_STEPS_READ,
    PAGE_ROWS,
    SCHEMA_VERSION,
    MetricStore,
    RunInfo,
    StoreError,
    check_run,
    checked_created,
    checked_value,
    created_bounds,
    kind_of,
    walk_newest,
)

INSERT_RUN = (
    "INSERT INTO runs (test, arch, pool, commit_sha, pr, event, trusted, attempt, created, source)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (source, test, arch, attempt) DO NOTHING RETURNING id"
)
INSERT_VALUE = "INSERT INTO metric_values (run, metric, step, value, kind) VALUES (?, ?, ?, ?, ?)"
# Every "newest first" read is a walk (:func:`~.store.walk_newest`): its rows end with
# ``r.created, r.id``, and this tail keeps the rows within the bounds of ``created`` and older
# than the previous page's last row (bound: earliest, then the cursor created, created, id, limit).
NEWEST_FIRST = (
    " AND r.created >= ? AND (r.created < ? OR (r.created = ? AND r.id < ?))"
    " ORDER BY r.created DESC, r.id DESC LIMIT ?"
)
HISTORY = (
    "SELECT v.value, v.kind, r.commit_sha, r.source, r.created, r.id"
    " FROM runs r JOIN metric_values v ON v.run = r.id"
    " WHERE r.trusted AND r.test = ? AND r.arch = ? AND v.metric = ? AND v.step = ?"
    " AND r.source <> ?" + NEWEST_FIRST
)
INSERT_ENVIRONMENT = "INSERT INTO run_environments (run, environment) VALUES (?, ?)"
_SERIES_IN_ENVIRONMENTS = (
    " FROM runs r JOIN metric_values v ON v.run = r.id"
    " LEFT JOIN run_environments e ON e.run = r.id"
    " WHERE r.trusted AND r.test = ? AND r.arch = ? AND v.metric = ? AND v.step = ?"
)
HISTORY_IN_ENVIRONMENT = (
    "SELECT v.value, v.kind, r.commit_sha, r.source, r.created, r.id"
    + _SERIES_IN_ENVIRONMENTS
    + " AND r.source <> ? AND COALESCE(e.environment, 'unknown') = ?"
    + NEWEST_FIRST
)
# The environments of a series with the newest ``created`` of each, within the bounds (bound:
# earliest, latest), newest first; paged by ``LIMIT ? OFFSET ?`` (a page per few environments).
ENVIRONMENT_GROUPS = (
    "SELECT COALESCE(e.environment, 'unknown'), MAX(r.created)"
    + _SERIES_IN_ENVIRONMENTS
    + " AND r.created >= ? AND r.created <= ?"
    " GROUP BY COALESCE(e.environment, 'unknown')"
    " ORDER BY MAX(r.created) DESC, COALESCE(e.environment, 'unknown') LIMIT ? OFFSET ?"
)
NEWEST_RUNS_WITH = (
    "SELECT r.created, r.id FROM runs r WHERE r.trusted AND r.test = ? AND r.arch = ?"
    " AND EXISTS (SELECT 1 FROM metric_values v WHERE v.run = r.id AND v.metric = ?)" + NEWEST_FIRST
)
_OUTSIDE_THE_BOUNDS = (
    " AND (r.created IS NULL OR NOT (r.created >= ? AND r.created <= ?)) ORDER BY r.id LIMIT ?"
)
OUT_OF_BOUNDS = (
    "SELECT r.id FROM runs r JOIN metric_values v ON v.run = r.id"
    " WHERE r.trusted AND r.test = ? AND r.arch = ? AND v.metric = ? AND v.step = ?"
    " AND r.source <> ?" + _OUTSIDE_THE_BOUNDS
)
OUT_OF_BOUNDS_IN_ENVIRONMENT = (
    "SELECT r.id"
    + _SERIES_IN_ENVIRONMENTS
    + " AND r.source <> ? AND COALESCE(e.environment, 'unknown') = ?"
    + _OUTSIDE_THE_BOUNDS
)
MAX_ID = 2**63 - 1  # above every run id (both backends' ids are 64-bit)
# A run's rows of one metric, as :func:`~.store.checked_value` reads them, after their step.
VALUES_OF_RUN = (
    "SELECT v.step, v.value, v.kind, r.commit_sha, r.source, r.created, r.id"
    " FROM metric_values v JOIN runs r ON r.id = v.run"
    " WHERE v.run = ? AND v.metric = ? ORDER BY v.step LIMIT ?"
)
SET_SCHEMA_VERSION = (
    "INSERT INTO mizzen_meta (key, value) VALUES ('schema', ?) ON CONFLICT (key) DO NOTHING"
)
COLUMNS = {"commit": "commit_sha", "source": "source", "test": "test", "arch": "arch"}


class SqlStore(MetricStore):
    """:class:`MetricStore` in SQL; a backend implements the primitives below."""

    readonly: bool
    has_environments: bool = True  # False: a store written before run_environments existed

    @abstractmethod
    def _query(self, sql: str, params: tuple = ()) -> list[tuple]: ...

    @abstractmethod
    def _execute(self, sql: str, params: tuple = ()) -> int:
        """Run a statement; the number of rows it changed."""

    @abstractmethod
    def _transaction(self) -> contextlib.AbstractContextManager: ...

    @abstractmethod
    def _created_param(self, created: str) -> object: ...

    @abstractmethod
    def _check_schema(self) -> None:
        """Refuse what is not a mizzen metric store (its tables), then :meth:`_require_schema`."""

    def _open(self, settings: tuple[str, ...], schema: tuple[str, ...]) -> None:
        """Run the connection's ``settings``, create ``schema`` unless the store is read-only,
        and check the store's schema; the store is closed when any of it fails."""
        try:
            for statement in settings:
                self._execute(statement)
            if not self.readonly:
                self._create_schema(schema)
            self._check_schema()
        except BaseException:
            self.close()
            raise

    def _create_schema(self, schema: tuple[str, ...]) -> None:
        """Run the ``CREATE … IF NOT EXISTS`` statements ``schema`` and record
        :data:`~.store.SCHEMA_VERSION` (kept where one is recorded), in one transaction that first
        takes :meth:`_lock_schema`."""
        with self._transaction():
            self._lock_schema()
            for statement in schema:
                self._execute(statement)
            self._execute(SET_SCHEMA_VERSION, (SCHEMA_VERSION,))

    def _lock_schema(self) -> None:
        """Keep two writers that open the store together from creating the schema at once; none
        is needed where the transaction itself excludes other writers (SQLite's ``BEGIN
        IMMEDIATE``)."""

    def _require_schema(self) -> None:
        """Refuse a store whose schema version is not the one this mizzen-ci reads."""
        version = self._query("SELECT value FROM mizzen_meta WHERE key = 'schema'")
        if [tuple(r) for r in version] != [(SCHEMA_VERSION,)]:
            raise StoreError(
                f"{self.shown}: metric store schema {str(version[:1])[:40]}, this mizzen-ci "
                f"reads schema {SCHEMA_VERSION}; use the mizzen-ci that wrote it"
            )

    def _writable(self) -> None:
        if self.readonly:
            raise StoreError(f"{self.shown} is open read-only (a pull request never writes it)")

    def add_run(self, run: RunInfo, values: Mapping[tuple[str, int], float]) -> bool:
        self._writable()
        check_run(run)
        with self._transaction():
            rows = self._query(
                INSERT_RUN,
                (
                    run.test,
                    run.arch,
                    run.pool,
                    run.commit,
                    run.pr,
                    run.event,
                    run.trusted,
                    run.attempt,
                    self._created_param(utc_iso(run.created)),
                    run.source,
                ),
            )
            if not rows:
                return False  # already stored: the natural key exists (nothing written)
            run_id = rows[0][0]
            if run.environment != UNKNOWN:
                self._execute(INSERT_ENVIRONMENT, (run_id, run.environment))
            for (metric, step), value in sorted(values.items()):
                kind = kind_of(value)
                self._execute(
                    INSERT_VALUE, (run_id, metric, step, value if kind == "finite" else None, kind)
                )
        return True

    def _pages(self, sql: str, params: tuple) -> Callable[[Sequence | None, int], list[Sequence]]:
        """The ``read_page`` of :func:`~.store.walk_newest` over ``sql`` (a statement ending in
        :data:`NEWEST_FIRST`, its rows ending in ``created, id``) with ``params`` before the
        tail's: from the latest ``created`` allowed, then older than the last row read."""
        earliest, latest = (self._created_param(b) for b in created_bounds())

        def read_page(after: Sequence | None, n: int) -> list[Sequence]:
            created, run_id = (latest, MAX_ID) if after is None else (after[-2], after[-1])
            return self._query(sql, (*params, earliest, created, created, run_id, n))

        return read_page

    def _history_pages(
        self,
        series: tuple[str, str, str, int],
        exclude_source: str,
        environment: str | None = None,
    ) -> Callable[[Sequence | None, int], list[Sequence]]:
        if environment is None or (not self.has_environments and environment == UNKNOWN):
            return self._pages(HISTORY, (*series, exclude_source))
        if not self.has_environments:
            return lambda after, n: []  # every run of such a store is of the environment "unknown"
        return self._pages(HISTORY_IN_ENVIRONMENT, (*series, exclude_source, environment))

    def _out_of_bounds(
        self,
        series: tuple[str, str, str, int],
        exclude_source: str,
        most: int,
        environment: str | None = None,
    ) -> list[object]:
        earliest, latest = (self._created_param(b) for b in created_bounds())
        if environment is None or (not self.has_environments and environment == UNKNOWN):
            sql, params = OUT_OF_BOUNDS, (*series, exclude_source)
        elif not self.has_environments:
            return []  # every run of such a store is of the environment "unknown"
        else:
            sql, params = OUT_OF_BOUNDS_IN_ENVIRONMENT, (*series, exclude_source, environment)
        rows = self._query(sql, (*params, earliest, latest, most))
        return [row[0] for row in rows[:most]]

    def environments(self, test: str, arch: str, metric: str, step: int) -> list[str]:
        if not self.has_environments:
            return [UNKNOWN]
        series = (test, arch, metric, step)
        found: list[tuple[object, object, str]] = []  # (created, id, environment), newest first
        read = 0
        for environment, newest in self._environment_groups(series):
            if len(found) >= MAX_ENVIRONMENTS and newest < found[MAX_ENVIRONMENTS - 1][0]:
                break  # no row of this environment or a later one is newer than those found
            try:
                environment = checked_environment(environment)
            except (ValueError, TypeError):
                read += 1
                continue  # every row of it is bad: left out
            valid, scanned = self._newest_valid(series, environment)
            read += 1 + scanned
            if read > _store.MAX_ROWS_SCANNED:
                raise StoreError(
                    f"{self.shown}: {read} rows and environments read without finding the "
                    f"environments of {metric}@{step}; the store is damaged or crafted: rebuild "
                    "it from artefacts"
                )
            if valid is not None:
                found.append((*valid, environment))
                found.sort(key=lambda f: (f[0], f[1]), reverse=True)
        return [environment for _, _, environment in found[:MAX_ENVIRONMENTS]]

    def _environment_groups(self, series: tuple[str, str, str, int]) -> Iterator[Sequence]:
        """``(environment, newest created)`` of the series within the bounds, newest first."""
        earliest, latest = (self._created_param(b) for b in created_bounds())
        offset, n = 0, MAX_ENVIRONMENTS + 1
        while True:
            rows = self._query(ENVIRONMENT_GROUPS, (*series, earliest, latest, n, offset))[:n]
            yield from rows
            if len(rows) < n:
                return
            offset, n = offset + n, min(PAGE_ROWS, 2 * n)

    def _newest_valid(
        self, series: tuple[str, str, str, int], environment: str
    ) -> tuple[tuple[object, object] | None, int]:
        """``((created, id) as stored, rows read)`` of the newest row of ``environment`` that
        :meth:`history` would use (``None``: none), walking past bad ones."""
        pages = self._pages(HISTORY_IN_ENVIRONMENT, (*series, "", environment))

        def check(row: Sequence) -> tuple[object, object]:
            checked_value(tuple(row), row[-1])
            return row[-2], row[-1]

        scanned = 0
        for valid, _ in walk_newest(pages, check, 1, self.shown):
            scanned += 1
            if valid is not None:
                return valid, scanned
        return None, scanned

    def last_steps(self, test: str, arch: str, metric: str) -> tuple[int, ...]:
        def valid_steps(row: Sequence) -> tuple[int, ...]:
            checked_created(row[0], row[1])
            rows = self._query(VALUES_OF_RUN, (row[1], metric, MAX_STEPS_READ))
            steps = tuple(r[0] for r in rows[:MAX_STEPS_READ] if _valid_step(r))
            if not steps:
                raise ValueError(f"run {row[1]}: no valid value of the metric")
            return steps

        pages = self._pages(NEWEST_RUNS_WITH, (test, arch, metric))
        walk = walk_newest(pages, valid_steps, 1, self.shown)
        return next((steps for steps, _ in walk if steps is not None), ())  # bad: passed over

    def _mark_untrusted(self, match: Mapping[str, str]) -> int:
        self._writable()
        if "commit" not in match and "source" not in match:
            raise StoreError("mark_untrusted needs a commit or a run key (source)")
        given = [(COLUMNS[field], value) for field, value in match.items()]
        where = " AND ".join(f"{column} = ?" for column, _ in given)
        with self._transaction():
            return self._execute(
                f"UPDATE runs SET trusted = FALSE WHERE trusted AND {where}",
                tuple(v for _, v in given),
            )

    def count_runs(self, *, trusted: bool | None = None) -> int:
        if trusted is None:
            rows = self._query("SELECT COUNT(*) FROM runs")
        else:
            rows = self._query(
                f"SELECT COUNT(*) FROM runs WHERE {'' if trusted else 'NOT '}trusted"
            )
        return int(rows[0][0])

    @contextlib.contextmanager
    def _nothing(self) -> Iterator[None]:
        yield


def _valid_step(row: Sequence) -> bool:
    """Whether a :data:`VALUES_OF_RUN` row is a step :func:`~.store.checked_value` takes."""
    if not (type(row[0]) is int and 0 <= row[0] <= MAX_STEP):
        return False
    try:
        checked_value(tuple(row[1:]), row[-1])
    except (ValueError, TypeError):
        return False
    return True
