"""The execution record of the history store: which workspace files each test executed, keyed by
the revision it ran at (the selection audit's observations, :mod:`mizzen_ci.audit`).

One row is one (revision, test id, executed file)::

    executed(revision, test, file, path, kind)
      revision  the commit the run was observed at (40 hex digits)
      test      the pytest node id (``tests/ci/test_x.py::test_y[param]``)
      file      its test file (``tests/ci/test_x.py``: the node id up to its first ``::``)
      path      a repository-relative POSIX path the test executed (kind ``source``: a line ran
                under coverage, subprocesses included) or opened (kind ``data``)

The store is one SQLite file, ``.ci-artifacts/history/execution.sqlite`` by default: beside the
duration and flake stores (``*.jsonl``, which :mod:`mizzen_ci.history` reads; this file is not
one of them, so neither reader sees the other's records), carried in the same cache.

Invariants:
- Stdlib only (``sqlite3``).  Writes are atomic: a revision's rows replace the old ones in one
  transaction of a copy that is renamed over the store, so a crash leaves the old store whole.
- A store is untrusted (a downloaded cache): a regular file (never a link, FIFO or device) of at
  most :data:`MAX_STORE_BYTES`, opened read-only with ``trusted_schema`` off, its ``executed``
  a table; every row is validated on read (:func:`checked_row`: a revision of 40 hex digits, a
  test id of at most :data:`MAX_TEST_CHARS` naming a ``tests/**/test_*.py`` file, a path of at
  most :data:`MAX_PATH_CHARS` that is relative, POSIX and never leaves the tree) and a bad row is
  a problem naming ``path:rowid``, never a crash; at most :data:`MAX_ROWS` rows are read.
- Every failure is an :class:`ExecutionStoreError` naming the file, the rule and the fix.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sqlite3
import stat
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import quote

from .sources import kind_of

DEFAULT_STORE = Path(".ci-artifacts") / "history" / "execution.sqlite"
MAX_STORE_BYTES = 1024**3
MAX_ROWS = 5_000_000
MAX_TEST_CHARS = 1024
MAX_PATH_CHARS = 1024
KINDS = ("source", "data")
QUERY_SECONDS = 60.0
_REVISION = re.compile(r"[0-9a-f]{40}")
_TEST_FILE = re.compile(r"tests/(?:[^/\x00-\x1f]+/)*test_[^/\x00-\x1f]*\.py")

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS executed ("
    " revision TEXT NOT NULL, test TEXT NOT NULL, file TEXT NOT NULL, path TEXT NOT NULL,"
    " kind TEXT NOT NULL CHECK (kind IN ('source', 'data')),"
    " PRIMARY KEY (revision, test, path))",
    "CREATE INDEX IF NOT EXISTS executed_path ON executed (revision, path)",
)


class ExecutionStoreError(ValueError):
    """The execution store cannot be read or written; the message names the file and the fix."""


@dataclass(frozen=True, order=True)
class Executed:
    """One observation: at ``revision``, the test ``test`` (of ``file``) executed ``path``."""

    revision: str
    test: str
    path: str
    kind: str = "source"

    @property
    def file(self) -> str:
        return self.test.split("::", 1)[0]


def checked_row(revision: object, test: object, path: object, kind: object) -> str | None:
    """The problem of one row (the rule it breaks and what was found), ``None`` when it is good."""
    if not (isinstance(revision, str) and _REVISION.fullmatch(revision)):
        return f"revision must be 40 lowercase hex digits, got {_shown(revision)}"
    if not (isinstance(test, str) and 0 < len(test) <= MAX_TEST_CHARS):
        return f"test must be a node id of 1 to {MAX_TEST_CHARS} characters, got {_shown(test)}"
    if not _TEST_FILE.fullmatch(test.split("::", 1)[0]):
        return f"test must name a tests/**/test_*.py file, got {_shown(test)}"
    if kind not in KINDS:
        return f"kind must be one of {', '.join(KINDS)}, got {_shown(kind)}"
    return path_problem(path)


def path_problem(path: object) -> str | None:
    """Why ``path`` is not a repository-relative POSIX path inside the tree (``None``: it is)."""
    if not (isinstance(path, str) and 0 < len(path) <= MAX_PATH_CHARS):
        return f"path must be 1 to {MAX_PATH_CHARS} characters, got {_shown(path)}"
    parts = PurePosixPath(path).parts
    if path.startswith("/") or "\\" in path or ".." in parts or any(ord(c) < 32 for c in path):
        return f"path must be relative, POSIX and inside the tree, got {_shown(path)}"
    return None


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# --------------------------------------------------------------------------------------------
# reading


def read(store: Path | str, revision: str | None = None) -> tuple[list[Executed], list[str]]:
    """The good rows of ``store`` (of ``revision`` only, when given) and a problem per bad row
    (``path:rowid: rule``); a missing store has no rows.  :class:`ExecutionStoreError` when the
    file itself cannot be used."""
    path = Path(store)
    if not _exists(path):
        return [], []
    rows, problems = [], []
    with _connect(path, readonly=True) as db:
        query = "SELECT rowid, revision, test, path, kind FROM executed"
        args: tuple = ()
        if revision is not None:
            query, args = query + " WHERE revision = ?", (revision,)
        for rowid, rev, test, file, kind in _execute(db, path, query + f" LIMIT {MAX_ROWS}", args):
            problem = checked_row(rev, test, file, kind)
            if problem:
                problems.append(f"{path}:{rowid}: {problem}")
            else:
                rows.append(Executed(rev, test, file, kind))
    return rows, problems


def revisions(store: Path | str) -> list[str]:
    """The revisions the store holds observations of (valid ones only), sorted."""
    path = Path(store)
    if not _exists(path):
        return []
    with _connect(path, readonly=True) as db:
        found = _execute(db, path, "SELECT DISTINCT revision FROM executed LIMIT 100000", ())
        return sorted(r for (r,) in found if isinstance(r, str) and _REVISION.fullmatch(r))


def by_path(rows: Iterable[Executed], kind: str | None = None) -> dict[str, set[str]]:
    """``{executed path: {test file, …}}`` of ``rows`` (of one ``kind`` when given)."""
    out: dict[str, set[str]] = {}
    for r in rows:
        if kind is None or r.kind == kind:
            out.setdefault(r.path, set()).add(r.file)
    return out


# --------------------------------------------------------------------------------------------
# writing


def replace_revision(store: Path | str, revision: str, rows: Iterable[Executed]) -> int:
    """Store ``rows`` as the observations of ``revision`` (replacing the ones it had; those of
    the tests not in ``rows`` are kept, so partial runs add up), atomically; the number of rows
    written.  :class:`ExecutionStoreError` for a bad row (nothing is written then)."""
    path = Path(store)
    rows = sorted(set(rows))
    for r in rows:
        problem = checked_row(r.revision, r.test, r.path, r.kind)
        if problem or r.revision != revision:
            raise ExecutionStoreError(
                f"{path}: refusing to write a bad execution row ({problem or 'another revision'})"
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".execution-", suffix=".sqlite", dir=path.parent)
    os.close(fd)
    try:
        if _exists(path):
            shutil.copyfile(path, tmp)
        with _connect(Path(tmp), readonly=False) as db:
            _write(db, Path(tmp), revision, rows)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return len(rows)


def merge(out: Path | str, inputs: Iterable[Path | str]) -> tuple[int, list[str]]:
    """Every good row of ``inputs`` (and of ``out``) into ``out``, atomically: the newest input
    naming a (revision, test) wins; the number of rows and the problems of the bad ones."""
    problems: list[str] = []
    tests: dict[tuple[str, str], list[Executed]] = {}
    for source in [out, *inputs]:
        rows, bad = read(source)
        problems += bad
        fresh: dict[tuple[str, str], list[Executed]] = {}
        for r in rows:
            fresh.setdefault((r.revision, r.test), []).append(r)
        tests |= fresh
    by_revision: dict[str, list[Executed]] = {}
    for (rev, _), rows in tests.items():
        by_revision.setdefault(rev, []).extend(rows)
    if not by_revision:
        return 0, problems
    return sum(replace_revision(out, rev, rows) for rev, rows in sorted(by_revision.items())), (
        problems
    )


def _write(db: sqlite3.Connection, path: Path, revision: str, rows: list[Executed]) -> None:
    for statement in SCHEMA:
        _execute(db, path, statement, ())
    tests = sorted({r.test for r in rows})
    with db:
        db.executemany(
            "DELETE FROM executed WHERE revision = ? AND test = ?", [(revision, t) for t in tests]
        )
        db.executemany(
            "INSERT OR REPLACE INTO executed (revision, test, file, path, kind) VALUES (?,?,?,?,?)",
            [(r.revision, r.test, r.file, r.path, r.kind) for r in rows],
        )


# --------------------------------------------------------------------------------------------
# the file


def _exists(path: Path) -> bool:
    """Whether ``path`` is there: a regular file of at most :data:`MAX_STORE_BYTES` (``False``
    when absent; :class:`ExecutionStoreError` for anything else)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise ExecutionStoreError(
            f"{path}: cannot be read ({e.strerror}); fix its permissions"
        ) from None
    if not stat.S_ISREG(st.st_mode):
        raise ExecutionStoreError(
            f"{path}: the execution store must be a regular file, found {kind_of(st.st_mode)}; "
            "remove it (the next audit writes a new one)"
        )
    if st.st_size > MAX_STORE_BYTES:
        raise ExecutionStoreError(
            f"{path}: the execution store is {st.st_size} bytes, over the {MAX_STORE_BYTES} "
            "the audit reads; remove old revisions or start a new store"
        )
    return True


@contextlib.contextmanager
def _connect(path: Path, readonly: bool) -> Iterator[sqlite3.Connection]:
    uri = f"file:{quote(str(path.resolve()))}?mode={'ro' if readonly else 'rwc'}"
    try:
        db = sqlite3.connect(uri, uri=True, timeout=5.0)
    except sqlite3.Error as e:
        raise ExecutionStoreError(f"{path}: not a usable SQLite file ({e}); remove it") from None
    try:
        deadline = _Deadline()
        db.set_progress_handler(deadline, 10_000)
        _execute(db, path, "PRAGMA trusted_schema = OFF", ())
        if readonly:
            _check_schema(db, path)
        yield db
    finally:
        db.close()


class _Deadline:
    """A progress handler that aborts any statement after :data:`QUERY_SECONDS`."""

    def __init__(self) -> None:
        import time

        self._clock = time.monotonic
        self._end = self._clock() + QUERY_SECONDS

    def __call__(self) -> int:
        return 1 if self._clock() > self._end else 0


def _check_schema(db: sqlite3.Connection, path: Path) -> None:
    found = _execute(db, path, "SELECT type FROM sqlite_master WHERE name = 'executed'", ())
    if found != [("table",)]:
        raise ExecutionStoreError(
            f"{path}: not an execution store (no table 'executed'); remove it or pass the "
            "right --store"
        )


def _execute(db: sqlite3.Connection, path: Path, query: str, args: tuple) -> list[tuple]:
    try:
        return db.execute(query, args).fetchall()
    except sqlite3.Error as e:
        raise ExecutionStoreError(
            f"{path}: the execution store cannot be read ({type(e).__name__}: {e}); remove it "
            "(the next audit writes a new one)"
        ) from None
