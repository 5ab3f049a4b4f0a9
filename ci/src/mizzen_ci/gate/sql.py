"""The SQL both store backends run: one implementation of :class:`~.store.MetricStore` over
three primitives a backend provides (a query, a statement, a transaction).

Invariants:
- Statements are written once, with ``?`` placeholders (a backend with another parameter style
  rewrites them; no statement holds a literal ``?``), and use only what SQLite ≥ 3.35 and
  PostgreSQL ≥ 12 both run (``ON CONFLICT … DO NOTHING``, ``RETURNING``, partial indexes).
- Values are always bound as parameters, never formatted into SQL text.
- Every row read goes through :func:`~.store.checked_value` or an equivalent bound check.
"""

from __future__ import annotations

import contextlib
from abc import abstractmethod
from collections.abc import Iterator, Mapping

from .store import (
    MAX_STEPS_READ,
    MAX_WINDOW,
    SCHEMA_VERSION,
    MetricStore,
    RunInfo,
    StoredValue,
    StoreError,
    check_run,
    checked_value,
    kind_of,
)

INSERT_RUN = (
    "INSERT INTO runs (test, arch, pool, commit_sha, pr, event, trusted, attempt, created, source)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (source, test, arch, attempt) DO NOTHING RETURNING id"
)
INSERT_VALUE = "INSERT INTO metric_values (run, metric, step, value, kind) VALUES (?, ?, ?, ?, ?)"
HISTORY = (
    "SELECT v.value, v.kind, r.created, r.commit_sha, r.source, r.id"
    " FROM runs r JOIN metric_values v ON v.run = r.id"
    " WHERE r.trusted AND r.test = ? AND r.arch = ? AND v.metric = ? AND v.step = ?"
    " AND r.source <> ?"
    " ORDER BY r.created DESC, r.id DESC LIMIT ?"
)
NEWEST_RUN_WITH = (
    "SELECT r.id FROM runs r WHERE r.trusted AND r.test = ? AND r.arch = ?"
    " AND EXISTS (SELECT 1 FROM metric_values v WHERE v.run = r.id AND v.metric = ?)"
    " ORDER BY r.created DESC, r.id DESC LIMIT 1"
)
STEPS_OF = "SELECT step FROM metric_values WHERE run = ? AND metric = ? ORDER BY step LIMIT ?"


class SqlStore(MetricStore):
    """:class:`MetricStore` in SQL; a backend implements the primitives below."""

    readonly: bool

    @abstractmethod
    def _query(self, sql: str, params: tuple = ()) -> list[tuple]: ...

    @abstractmethod
    def _execute(self, sql: str, params: tuple = ()) -> int:
        """Run a statement; the number of rows it changed."""

    @abstractmethod
    def _transaction(self) -> contextlib.AbstractContextManager: ...

    @abstractmethod
    def _created_param(self, created: str) -> object: ...

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
                    self._created_param(run.created),
                    run.source,
                ),
            )
            if not rows:
                return False  # already stored: the natural key exists (nothing written)
            run_id = rows[0][0]
            for (metric, step), value in sorted(values.items()):
                kind = kind_of(value)
                self._execute(
                    INSERT_VALUE, (run_id, metric, step, value if kind == "finite" else None, kind)
                )
        return True

    def history(
        self,
        test: str,
        arch: str,
        metric: str,
        step: int,
        *,
        limit: int,
        exclude_source: str | None = None,
    ) -> tuple[list[StoredValue], list[str]]:
        limit = max(1, min(int(limit), MAX_WINDOW))
        rows = self._query(HISTORY, (test, arch, metric, step, exclude_source or "", limit))
        good, problems = [], []
        for row in rows[:limit]:
            try:
                good.append(checked_value(tuple(row), row[5] if len(row) > 5 else "?"))
            except (ValueError, TypeError) as e:
                problems.append(f"{self.shown}: dropped a stored value of {metric}@{step}: {e}")
        return good, problems

    def last_steps(self, test: str, arch: str, metric: str) -> tuple[int, ...]:
        rows = self._query(NEWEST_RUN_WITH, (test, arch, metric))
        if not rows:
            return ()
        steps = self._query(STEPS_OF, (rows[0][0], metric, MAX_STEPS_READ))
        return tuple(s for (s,) in steps[:MAX_STEPS_READ] if type(s) is int and 0 <= s <= 10**9)

    def mark_untrusted(
        self,
        *,
        commit: str | None = None,
        source: str | None = None,
        test: str | None = None,
        arch: str | None = None,
    ) -> int:
        self._writable()
        given = [(c, v) for c, v in (("commit_sha", commit), ("source", source)) if v]
        if not given:
            raise StoreError("mark_untrusted needs a commit or a run key (source)")
        given += [(c, v) for c, v in (("test", test), ("arch", arch)) if v]
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
