"""The PostgreSQL backend of the metric store, for teams: the URL (``postgresql://…`` or a libpq
key/value string) comes from
``--store`` or ``$MIZZEN_METRICS_STORE``; the driver is ``psycopg`` (3.x), the optional extra
``mizzen-ci[postgres]``, imported inside this module's functions only.

Invariants:
- The store is a ``postgresql://`` URL or a libpq key/value string (``host=… password=…``); a
  key/value string that does not parse is refused before the driver sees it (libpq's own error
  would quote a piece of it).
- The URL is never shown: messages, ``repr()`` and errors use
  :func:`~mizzen_ci.gate.redact.redact_url`, and a driver's message goes through
  :func:`~mizzen_ci.gate.redact.redact_text` with the URL's password and query masked, and every
  value of the mask set (:mod:`mizzen_ci.masking`).
- A read-only store runs every transaction read-only (``default_transaction_read_only``);
  statements are bounded by ``statement_timeout`` (:data:`STATEMENT_MS`), connecting by
  :data:`CONNECT_SECONDS`.
- The schema is created once, under an advisory lock (two writers starting together do not
  race), and its version checked on every open; the tables are those of :mod:`.store`.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from datetime import datetime
from urllib.parse import unquote, urlsplit

from ..masking import conninfo_pairs, is_conninfo, register
from .redact import redact_text, redact_url, url_secrets
from .sql import SqlStore
from .store import StoreError

CONNECT_SECONDS = 10
STATEMENT_MS = 60_000
_LOCK_KEY = 0x6D697A7A656E  # "mizzen": the advisory lock of schema creation

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS mizzen_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS runs ("
    " id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
    " test TEXT NOT NULL, arch TEXT NOT NULL, pool TEXT NOT NULL, commit_sha TEXT NOT NULL,"
    " pr BIGINT, event TEXT NOT NULL, trusted BOOLEAN NOT NULL,"
    " attempt INTEGER NOT NULL, created TIMESTAMPTZ NOT NULL, source TEXT NOT NULL,"
    " UNIQUE (source, test, arch, attempt))",
    "CREATE TABLE IF NOT EXISTS metric_values ("
    " run BIGINT NOT NULL REFERENCES runs(id) ON DELETE CASCADE,"
    " metric TEXT NOT NULL, step BIGINT NOT NULL, value DOUBLE PRECISION,"
    " kind TEXT NOT NULL CHECK (kind IN ('finite', 'nan', 'inf', '-inf')),"
    " PRIMARY KEY (run, metric, step))",
    "CREATE INDEX IF NOT EXISTS runs_recent_trusted ON runs (test, arch, created) WHERE trusted",
    "CREATE TABLE IF NOT EXISTS run_environments ("
    " run BIGINT PRIMARY KEY REFERENCES runs(id) ON DELETE CASCADE, environment TEXT NOT NULL)",
)


_QUOTED = re.compile(r""""([^"]*)"|'([^']*)'""")
_SHOWABLE = re.compile(r"[A-Za-z0-9_.:\[\]-]{1,255}")
_KEYWORDS = frozenset(
    [
        "host",
        "hostaddr",
        "port",
        "dbname",
        "user",
        "password",
        "passfile",
        "channel_binding",
        "connect_timeout",
        "client_encoding",
        "options",
        "application_name",
        "fallback_application_name",
        "keepalives",
        "keepalives_idle",
        "keepalives_interval",
        "keepalives_count",
        "tcp_user_timeout",
        "replication",
        "gssencmode",
        "sslmode",
        "requiressl",
        "sslcompression",
        "sslcert",
        "sslkey",
        "sslpassword",
        "sslcertmode",
        "sslrootcert",
        "sslcrl",
        "sslcrldir",
        "sslsni",
        "requirepeer",
        "ssl_min_protocol_version",
        "ssl_max_protocol_version",
        "krbsrvname",
        "gsslib",
        "gssdelegation",
        "service",
        "target_session_attrs",
        "load_balance_hosts",
        "sslnegotiation",
        "require_auth",
    ]
)
_SCHEMA_NAMES = frozenset(
    [
        "mizzen_meta",
        "runs",
        "metric_values",
        "runs_recent_trusted",
        "id",
        "test",
        "arch",
        "pool",
        "commit_sha",
        "pr",
        "event",
        "trusted",
        "attempt",
        "created",
        "source",
        "run",
        "metric",
        "step",
        "value",
        "kind",
        "key",
        "run_environments",
        "environment",
    ]
)


def _shown_values(url: str) -> frozenset[str]:
    """The host, port, database and user of a store, where they have a showable shape."""
    values: list[str] = []
    if is_conninfo(url):
        pairs = conninfo_pairs(url) or []
        values = [v for k, v in pairs if k in ("host", "hostaddr", "port", "dbname", "user")]
    else:
        with contextlib.suppress(Exception):
            parts = urlsplit(url)
            values = [parts.hostname or "", str(parts.port or ""), parts.path.lstrip("/"),
                      unquote(parts.username or "")]  # fmt: skip
    return frozenset(v for v in values if _SHOWABLE.fullmatch(v)) - set(url_secrets(url))


class PostgresStore(SqlStore):
    def __init__(self, url: str, *, readonly: bool = False):
        self.readonly = readonly
        self.shown = redact_url(url)
        register(*url_secrets(url))  # the mask set holds them: never an attribute of the store
        self._quotable = _KEYWORDS | _SCHEMA_NAMES | _shown_values(url)
        try:
            import psycopg
        except ImportError:
            raise StoreError(
                f"{self.shown}: the PostgreSQL metric store needs psycopg; install "
                "`mizzen-ci[postgres]` (psycopg[binary])"
            ) from None
        self._errors = psycopg.Error
        if is_conninfo(url) and conninfo_pairs(url) is None:  # never handed to the driver
            raise StoreError(
                f"{self.shown}: not a usable libpq connection string; write "
                "host=HOST port=PORT dbname=DATABASE user=USER password=PASSWORD (quote a value "
                "with spaces: password='…')"
            )
        try:
            self.conn = psycopg.connect(url, connect_timeout=CONNECT_SECONDS, autocommit=True)
        except psycopg.Error as e:
            raise StoreError(
                f"{self.shown}: cannot connect to the metric store: {self._said(e)}"
            ) from None
        except Exception as e:  # a malformed URL: psycopg raises ProgrammingError or ValueError
            raise StoreError(
                f"{self.shown}: not a usable PostgreSQL URL ({type(e).__name__}); write "
                "postgresql://USER:PASSWORD@HOST:PORT/DATABASE or host=… dbname=… user=…"
            ) from None
        settings = (f"SET statement_timeout = {int(STATEMENT_MS)}",)
        if readonly:
            settings += ("SET default_transaction_read_only = on",)
        self._open(settings, SCHEMA)

    def _lock_schema(self) -> None:
        self._execute("SELECT pg_advisory_xact_lock(?)", (_LOCK_KEY,))

    def _said(self, error: BaseException) -> str:
        """A driver's message as it may be shown: every quoted value in it that is not a
        libpq keyword, a name of the schema or a shown part of the store (host, port, database,
        user) is ``***`` (libpq quotes what it could not use: a piece of a mistyped password
        too), then :func:`~mizzen_ci.gate.redact.redact_text` (the mask set)."""
        text = str(error).strip() or type(error).__name__
        text = _QUOTED.sub(
            lambda m: m[0] if (m[1] if m[1] is not None else m[2]) in self._quotable else "***",
            text,
        )
        return redact_text(text)

    def _check_schema(self) -> None:
        tables = {
            r[0]
            for r in self._query(
                "SELECT table_name FROM information_schema.tables WHERE table_schema ="
                " current_schema() AND table_type = 'BASE TABLE'"
            )
        }
        if not {"mizzen_meta", "runs", "metric_values"} <= tables:
            raise StoreError(
                f"{self.shown}: no mizzen metric store here (tables mizzen_meta, runs and "
                "metric_values missing); a writer (`mizzen-ci gate ingest`) creates them"
            )
        self.has_environments = "run_environments" in tables  # a store written before: unknown
        self._require_schema()

    def _run(self, sql: str, params: tuple):
        try:
            return self.conn.execute(sql.replace("?", "%s"), params)
        except self._errors as e:
            raise StoreError(f"{self.shown}: {self._said(e)}") from None

    def _query(self, sql: str, params: tuple = ()) -> list[tuple]:
        cursor = self._run(sql, params)
        try:
            return cursor.fetchall() if cursor.description is not None else []
        except self._errors as e:
            raise StoreError(f"{self.shown}: {self._said(e)}") from None

    def _execute(self, sql: str, params: tuple = ()) -> int:
        return self._run(sql, params).rowcount

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        if self.conn.info.transaction_status != 0:  # already inside one (IDLE == 0)
            yield
            return
        try:
            with self.conn.transaction():
                yield
        except self._errors as e:
            raise StoreError(f"{self.shown}: {self._said(e)}") from None

    def _created_param(self, created: str) -> object:
        return datetime.fromisoformat(created)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()
