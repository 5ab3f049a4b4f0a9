"""The SQLite backend of the metric store (stdlib ``sqlite3``): the embedded default, one file
that the nightly job carries in the Actions cache and only trusted runs on main write.

Invariants:
- The file is a regular file (never a symbolic link, a FIFO or a device: refused before SQLite
  opens it) of at most :data:`MAX_STORE_BYTES`; read-only stores are opened with
  ``mode=ro`` (SQLite itself refuses every write).
- A store file is untrusted input: ``trusted_schema`` is off, ``runs`` and ``metric_values`` must
  be tables (not views), the schema version must be :data:`~.store.SCHEMA_VERSION`, and every
  statement is aborted after :data:`QUERY_SECONDS` (a crafted file cannot hang the gate).
- Every ``sqlite3`` error becomes a :class:`~.store.StoreError` naming the file and the fix.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

from ..sources import kind_of
from .redact import redact_url
from .sql import SqlStore
from .store import StoreError

MAX_STORE_BYTES = 4 * 1024**3
QUERY_SECONDS = 60.0

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS mizzen_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS runs ("
    " id INTEGER PRIMARY KEY,"
    " test TEXT NOT NULL, arch TEXT NOT NULL, pool TEXT NOT NULL, commit_sha TEXT NOT NULL,"
    " pr INTEGER, event TEXT NOT NULL,"
    " trusted INTEGER NOT NULL CHECK (trusted IN (0, 1)),"
    " attempt INTEGER NOT NULL, created TEXT NOT NULL, source TEXT NOT NULL,"
    " UNIQUE (source, test, arch, attempt))",
    "CREATE TABLE IF NOT EXISTS metric_values ("
    " run INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,"
    " metric TEXT NOT NULL, step INTEGER NOT NULL, value REAL,"
    " kind TEXT NOT NULL CHECK (kind IN ('finite', 'nan', 'inf', '-inf')),"
    " PRIMARY KEY (run, metric, step))",
    "CREATE INDEX IF NOT EXISTS runs_recent_trusted ON runs (test, arch, created) WHERE trusted",
    "CREATE TABLE IF NOT EXISTS run_environments ("
    " run INTEGER PRIMARY KEY REFERENCES runs(id) ON DELETE CASCADE, environment TEXT NOT NULL)",
)


def sqlite_path(url: str) -> Path:
    """The file of ``sqlite:///abs``, ``sqlite:rel`` or a plain path."""
    if url.startswith("sqlite://"):
        return Path(url[len("sqlite://") :])
    if url.startswith("sqlite:"):
        return Path(url[len("sqlite:") :])
    return Path(url)


class SqliteStore(SqlStore):
    def __init__(self, path: Path | str, *, readonly: bool = False):
        self.path = Path(path)
        self.readonly = readonly
        self.shown = redact_url(str(self.path))
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            st = None
        except OSError as e:
            raise StoreError(f"{self.shown}: cannot read the metric store: {e.strerror}") from None
        if st is not None:
            if not stat.S_ISREG(st.st_mode):
                raise StoreError(
                    f"{self.shown}: the metric store is {kind_of(st.st_mode)}, not a regular "
                    "file; replace it with the store file itself (the CI never follows a link)"
                )
            if st.st_size > MAX_STORE_BYTES:
                raise StoreError(
                    f"{self.shown}: the metric store is {st.st_size >> 20} MiB, over "
                    f"{MAX_STORE_BYTES >> 20} MiB; start a new one or prune old runs"
                )
        elif not readonly:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise StoreError(
                    f"{self.shown}: cannot create the metric store's folder: {e.strerror}; give a "
                    "--store path in a folder you can write"
                ) from None
        mode = "ro" if readonly else "rwc"
        self._deadline = 0.0
        try:
            self.conn = sqlite3.connect(
                f"file:{quote(str(self.path.resolve()))}?mode={mode}",
                uri=True,
                timeout=30,
                isolation_level=None,
                check_same_thread=False,
            )
        except sqlite3.Error as e:
            raise StoreError(f"{self.shown}: cannot open the metric store: {e}") from None
        self.conn.set_progress_handler(self._over_time, 10_000)
        self._open(("PRAGMA trusted_schema = OFF", "PRAGMA foreign_keys = ON"), SCHEMA)

    def _over_time(self) -> int:
        return 1 if self._deadline and time.monotonic() > self._deadline else 0

    def _check_schema(self) -> None:
        kinds = dict(
            self._query(
                "SELECT name, type FROM sqlite_master WHERE name IN "
                "('mizzen_meta', 'runs', 'metric_values', 'run_environments')"
            )
        )
        if any(kinds.get(t) != "table" for t in ("mizzen_meta", "runs", "metric_values")):
            raise StoreError(
                f"{self.shown}: not a mizzen metric store (tables mizzen_meta, runs and "
                "metric_values missing or not tables); point --store at the store file"
            )
        self.has_environments = kinds.get("run_environments") == "table"  # else: written before
        self._require_schema()

    def _run(self, sql: str, params: tuple):
        self._deadline = time.monotonic() + QUERY_SECONDS
        try:
            return self.conn.execute(sql, params)
        except sqlite3.OperationalError as e:
            if "interrupted" in str(e):
                raise StoreError(
                    f"{self.shown}: a query ran over {QUERY_SECONDS:.0f} s and was stopped; the "
                    "store is damaged or crafted: rebuild it from artefacts"
                ) from None
            raise StoreError(f"{self.shown}: {e}") from None
        except sqlite3.Error as e:
            raise StoreError(
                f"{self.shown}: the metric store cannot be used ({e}); rebuild it from artefacts"
            ) from None

    def _query(self, sql: str, params: tuple = ()) -> list[tuple]:
        try:
            return self._run(sql, params).fetchall()
        except sqlite3.Error as e:
            raise StoreError(f"{self.shown}: {e}") from None
        finally:
            self._deadline = 0.0

    def _execute(self, sql: str, params: tuple = ()) -> int:
        try:
            return self._run(sql, params).rowcount
        finally:
            self._deadline = 0.0

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        if self.conn.in_transaction:
            yield
            return
        self._execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.conn.rollback()
            raise
        self._execute("COMMIT")

    def _created_param(self, created: str) -> object:
        return created

    def close(self) -> None:
        self.conn.close()
