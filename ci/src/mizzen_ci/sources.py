"""Reading files the CI did not write (Python sources, history stores, junit reports, plans):
the parse errors every reader handles, and the one safe way to open such a file.

Invariants:
- :data:`PARSE_ERRORS` is every exception ``ast.parse`` raises for bad input (``ValueError``:
  null bytes; ``MemoryError``/``RecursionError``: pathological nesting); a reader turns each into
  a recorded problem, never a traceback.
- :func:`read_bytes` is the one reader of such files (the registry, the import graph, the plan
  index, history stores, junit reports, plans).  It opens with ``O_NOFOLLOW | O_NONBLOCK`` and
  checks ``S_ISREG`` on the open descriptor before reading a byte, so a symbolic link (which could
  point out of the repository, or loop), a FIFO (whose read would block forever), a socket, a
  device or a directory is refused without a blocking open or read; it reads at most ``limit``
  bytes (:data:`MAX_SOURCE_BYTES` for sources).  Every refusal is a :class:`RefusedFile` naming
  the file, what it is and the fix; every other error is an ``OSError`` naming the file.
- The bytes come with the ``stat`` of the descriptor, taken before reading.
- :func:`folder_entries` is the walks' listing of a folder: in name order (so a walk's result does
  not depend on the file system's order), a folder that cannot be listed passed over.
- :class:`ConfigError` is the one error for an unusable ``pyproject.toml`` table (the registry's
  excludes, the workspace members): every command prints it as one line, never a traceback.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

PARSE_ERRORS = (SyntaxError, ValueError, MemoryError, RecursionError)
MAX_SOURCE_BYTES = 8 * 1024 * 1024  # a Python source over 8 MiB is data, not code
_MiB = 1024 * 1024

_OPEN_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_NOCTTY", 0)
    | getattr(os, "O_CLOEXEC", 0)
)


class ConfigError(ValueError):
    """A configuration file of the repository (``pyproject.toml``) cannot be used; the message
    names the file, the key and the fix.  The command line prints it as one line and exits 2."""


class RefusedFile(OSError):
    """A file the CI will not read: not a regular file, a symbolic link, or over its size cap.
    ``str()`` names the file, what it is and the fix; :attr:`fix` is the fix alone."""

    def __init__(self, path: Path | str, problem: str, fix: str, code: int = errno.EINVAL):
        super().__init__(code, problem, os.fspath(path))
        self.fix = fix

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}; fix: {self.fix}"


def folder_entries(path: str | os.PathLike[str]) -> list[os.DirEntry[str]]:
    """The entries of the folder ``path`` in name order (every walk's one order); none when it
    cannot be listed (vanished, unreadable): the walks that use this pass such a folder over."""
    try:
        return sorted(os.scandir(path), key=lambda e: e.name)
    except OSError:
        return []


def kind_of(mode: int) -> str:
    """What a file of this ``st_mode`` is, in words ("a FIFO", "a directory", …)."""
    for test, what in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return what
    return "not a regular file"


def _size(n: int) -> str:
    return f"{n / _MiB:.1f} MiB" if n >= _MiB else f"{n} bytes"


def _refusal(mode: int) -> tuple[str, str]:
    """(problem, fix) for a file of this ``st_mode`` that is not a regular file."""
    if stat.S_ISLNK(mode):
        return (
            "is a symbolic link; the CI reads only regular files, never through a link that "
            "could point out of the repository or loop",
            "replace the link with the file itself, or remove it",
        )
    return f"is {kind_of(mode)}, not a regular file", "remove it or replace it with a regular file"


def _open_regular(path: Path | str) -> tuple[int, os.stat_result]:
    """A descriptor of the regular file ``path`` and its ``fstat``; :class:`RefusedFile` for
    anything else, without a blocking open (see the module docstring)."""
    try:
        # lstat first: a device, FIFO or socket is refused without being opened at all (opening
        # some devices has effects); the descriptor is checked again below (the path may change).
        mode = os.lstat(path).st_mode
        if not stat.S_ISREG(mode):
            raise RefusedFile(path, *_refusal(mode))
        fd = os.open(path, _OPEN_FLAGS)
    except RefusedFile:
        raise
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO):  # became a link or a socket since the lstat
            mode = stat.S_IFLNK if e.errno == errno.ELOOP else stat.S_IFSOCK
            raise RefusedFile(path, *_refusal(mode)) from None
        raise OSError(e.errno, e.strerror, os.fspath(path)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RefusedFile(path, *_refusal(st.st_mode))
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_bytes(path: Path | str, limit: int = MAX_SOURCE_BYTES) -> tuple[bytes, os.stat_result]:
    """The bytes of the regular file ``path`` (at most ``limit``) and its stat, taken before
    reading; :class:`RefusedFile` for anything else (see the module docstring)."""
    fd, st = _open_regular(path)
    try:
        if st.st_size > limit:
            raise RefusedFile(
                path,
                f"is {_size(st.st_size)}, over the {_size(limit)} the CI reads from such a file",
                "keep it smaller (split it, or move data out of it)",
                errno.EFBIG,
            )
        chunks = []
        total = 0
        while data := os.read(fd, min(max(st.st_size + 1, 65536), limit + 1 - total)):
            chunks.append(data)
            total += len(data)
            if total > limit:
                raise RefusedFile(
                    path,
                    f"grew past the {_size(limit)} the CI reads from such a file while it was read",
                    "keep it smaller, and do not write it while the CI reads it",
                    errno.EFBIG,
                )
    except OSError as e:
        if isinstance(e, RefusedFile):
            raise
        raise OSError(e.errno, e.strerror, os.fspath(path)) from None
    finally:
        os.close(fd)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks), st


def read_tail(path: Path | str, limit: int) -> bytes:
    """The last ``limit`` bytes of the regular file ``path`` (a log of any size); refused like
    :func:`read_bytes`."""
    fd, st = _open_regular(path)
    try:
        start = max(0, st.st_size - limit)
        chunks, total = [], 0
        while total < limit and (data := os.pread(fd, limit - total, start + total)):
            chunks.append(data)
            total += len(data)
    except OSError as e:
        raise OSError(e.errno, e.strerror, os.fspath(path)) from None
    finally:
        os.close(fd)
    return b"".join(chunks)
