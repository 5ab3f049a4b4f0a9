"""The SQL both store backends run: one implementation of :class:`~.store.MetricStore` over
three primitives a backend provides (a query, a statement, a transaction).

Invariants:
- Statements are written once, with ``?`` placeholders (a backend with another parameter style
  rewrites them; no statement holds a literal ``?``), and use only what SQLite ≥ 3.35 and
  PostgreSQL ≥ 12 both run (``ON CONFLICT … DO NOTHING``, ``RETURNING``, partial indexes).
- Values are always bound as parameters, never formatted into SQL text.
- Every row read goes through :func:`~.store.checked_value` or an equivalent bound check.
- Every "newest first" read is a walk (:func:`~.store.walk_newest`, :meth:`SqlStore._pages`)
  over a statement ending in :data:`NEWEST_FIRST`: the same SQL on both backends filters
  ``created`` to its bounds (SQLite compares the text, PostgreSQL the ``TIMESTAMPTZ``: one order,
  the time's) and pages by ``(created, id)``, so no row outside the bounds sorts first and no
  row is read twice.
"""

from __future__ import annotations

import contextlib
from abc import abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence

from .artefacts import utc_iso
from .environment import UNKNOWN
from .environment import checked as checked_environment
from .store import (
    MAX_ENVIRONMENTS,
    MAX_STEPS_READ,
    SCHEMA_VERSION,
    MetricStore,
    RunInfo,
    StoreError,
    check_run,
    checked_created,
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
ENVIRONMENTS_OF = (
    "SELECT COALESCE(e.environment, 'unknown'), r.created, r.id"
    + _SERIES_IN_ENVIRONMENTS
    + NEWEST_FIRST
)
NEWEST_RUNS_WITH = (
    "SELECT r.created, r.id FROM runs r WHERE r.trusted AND r.test = ? AND r.arch = ?"
    " AND EXISTS (SELECT 1 FROM metric_values v WHERE v.run = r.id AND v.metric = ?)" + NEWEST_FIRST
)
OUT_OF_BOUNDS = (
    "SELECT r.id FROM runs r JOIN metric_values v ON v.run = r.id"
    " WHERE r.trusted AND r.test = ? AND r.arch = ? AND v.metric = ? AND v.step = ?"
    " AND r.source <> ? AND (r.created IS NULL OR NOT (r.created >= ? AND r.created <= ?))"
    " ORDER BY r.id LIMIT ?"
)
MAX_ID = 2**63 - 1  # above every run id (both backends' ids are 64-bit)
STEPS_OF = "SELECT step FROM metric_values WHERE run = ? AND metric = ? ORDER BY step LIMIT ?"
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
        self, series: tuple[str, str, str, int], exclude_source: str, most: int
    ) -> list[object]:
        earliest, latest = (self._created_param(b) for b in created_bounds())
        rows = self._query(OUT_OF_BOUNDS, (*series, exclude_source, earliest, latest, most))
        return [row[0] for row in rows[:most]]

    def environments(self, test: str, arch: str, metric: str, step: int) -> list[str]:
        if not self.has_environments:
            return [UNKNOWN]

        def check(row: Sequence) -> str:
            checked_created(row[1], row[2])
            return checked_environment(row[0])

        pages = self._pages(ENVIRONMENTS_OF, (test, arch, metric, step))
        out: list[str] = []
        for environment, _ in walk_newest(pages, check, MAX_ENVIRONMENTS, self.shown):
            if environment is not None and environment not in out:  # a bad row: left out
                out.append(environment)
                if len(out) == MAX_ENVIRONMENTS:
                    break
        return out

    def last_steps(self, test: str, arch: str, metric: str) -> tuple[int, ...]:
        def run_id(row: Sequence) -> object:
            checked_created(row[0], row[1])
            return row[1]

        pages = self._pages(NEWEST_RUNS_WITH, (test, arch, metric))
        walk = walk_newest(pages, run_id, 1, self.shown)
        newest = next((found for found, _ in walk if found is not None), None)  # bad: passed over
        if newest is None:
            return ()
        steps = self._query(STEPS_OF, (newest, metric, MAX_STEPS_READ))
        return tuple(s for (s,) in steps[:MAX_STEPS_READ] if type(s) is int and 0 <= s <= 10**9)

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
