"""GPU leases: one ``fcntl.flock`` lock file per physical GPU in a directory shared by every lane
on the host, so two lanes never hand the same GPU to two tests.

Invariants:
- A lease is an exclusive ``flock`` on ``<dir>/gpu-<key>.lock``; the kernel drops it when the last
  descriptor of that open file closes, so a holder killed with SIGKILL frees its GPUs at once:
  no stale lock files, no pid checks, no cleanup.
- The runner passes the lease descriptors to the test process (``pass_fds``), so the GPUs stay
  leased while that process lives even if the runner dies, and are free as soon as both are gone.
- Acquisition is all-or-nothing: either every requested GPU is leased, or none is held on return.
- The lock file's content names the holder (pid, host, what it runs) for diagnostics only; the
  lock, not the content, is the truth.  It is read as hostile text (a regular file, at most
  :data:`NOTE_BYTES`, shown through :func:`mizzen_ci.output.plain`).

Safety (a lane may run as root in a directory other users can write to):
- The lease directory is opened with ``O_NOFOLLOW | O_DIRECTORY`` and checked on the open
  descriptor (:func:`.host_dirs.open_dir` with :data:`LEASE_DIR_RULE`): it is refused (:class:`LeaseDirError`, naming the path and the fix) when it is a
  symbolic link or no directory, when it is owned by neither the current user nor root, or when
  it is group- or world-writable without the sticky bit.  A directory this process creates gets
  mode ``1777`` (sticky: every user's lanes share it; no one removes or renames another's files);
  to share leases between users, create it as root.
- Lock files are opened relative to that descriptor with ``O_NOFOLLOW | O_NONBLOCK`` and checked
  after opening: a regular file with one link (a planted symbolic link, hard link or FIFO is
  refused, so a lane never truncates or writes anything but a lock file); a new one is created
  with ``O_EXCL`` and only that new file is ``fchmod`` ed to ``0666``: an existing file's mode is
  never changed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import socket
import stat
import time
from collections.abc import Sequence
from pathlib import Path

from ..output import plain
from ..sources import kind_of, read_bytes
from .host_dirs import DirRule, open_dir
from .refusal import LaneRefusal

LEASE_DIR_ENV = "MIZZEN_GPU_LEASE_DIR"
DEFAULT_LEASE_DIR = Path("/tmp/mizzen-gpu-leases")
NOTE_BYTES = 4096
_FILE_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class LeaseTimeout(TimeoutError):
    """The GPUs stayed leased by someone else for longer than the allowed wait."""


class LeaseDirError(LaneRefusal):
    """The lease directory or a lock file in it is unsafe to use; the message names the path,
    what is wrong and the fix."""


_FIX_DIR = (
    f"use a directory of your own (`{LEASE_DIR_ENV}=/path` or `--lease-dir`), or have root "
    "create a shared one with mode 1777"
)
LEASE_DIR_RULE = DirRule(
    what="GPU lease directory",
    error=LeaseDirError,
    fix=_FIX_DIR,
    stake="replace the lock files",
    create_mode=0o1777,  # shared, sticky: every user's lanes lock in it, no one removes another's
    root_may_own=True,
    sticky_shares=True,
)


def default_lease_dir() -> Path:
    return Path(os.environ.get(LEASE_DIR_ENV) or DEFAULT_LEASE_DIR)


class Lease:
    """GPUs held by this process (and whoever it passes :attr:`fds` to) until :meth:`release`.

    :meth:`share` makes another handle of the same lease (for a file sharing the GPU): each
    handle is released once (again is a no-op), and the descriptors close when the last is."""

    def __init__(self, keys: tuple[str, ...], fds: tuple[int, ...]):
        self.keys = keys
        self.fds = fds
        self._released = False
        self._handles = [1]  # live handles of these descriptors, shared with every share()

    def share(self) -> Lease:
        if self._released:
            raise ValueError(f"{self!r} is released; a released lease cannot be shared")
        other = Lease(self.keys, self.fds)
        other._handles = self._handles
        self._handles[0] += 1
        return other

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._handles[0] -= 1
        if self._handles[0]:
            return
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"Lease({', '.join(self.keys)})"


class LeaseDir:
    """The shared directory of per-GPU lock files."""

    def __init__(self, path: Path | str | None = None):
        self.path = Path(path) if path is not None else default_lease_dir()

    def lock_path(self, key: str) -> Path:
        return self.path / f"gpu-{re.sub(r'[^A-Za-z0-9_.-]', '_', key)}.lock"

    def _refuse(self, path: Path | str, problem: str, fix: str) -> LaneRefusal:
        return LEASE_DIR_RULE.refuse(path, problem, fix)

    def _dir_fd(self) -> int:
        """A descriptor of the checked lease directory (created when missing; see the module
        docstring); :class:`LeaseDirError` when it is unsafe."""
        return open_dir(self.path, LEASE_DIR_RULE)

    def check(self) -> None:
        """Create the lease directory if needed and check that it is safe to use (see the module
        docstring); :class:`LeaseDirError` says why not."""
        os.close(self._dir_fd())

    def _open(self, key: str) -> int:
        """A descriptor of ``key``'s lock file (created when missing), checked to be a regular
        file with one link; never follows a link, never changes an existing file's mode."""
        name = self.lock_path(key).name
        dir_fd = self._dir_fd()
        try:
            created = False
            try:
                fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
            except FileNotFoundError:
                try:
                    fd = os.open(name, _FILE_FLAGS | os.O_CREAT | os.O_EXCL, 0o666, dir_fd=dir_fd)
                    created = True
                except FileExistsError:  # another lane created it in between
                    fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
        except OSError as e:
            path = self.lock_path(key)
            if e.errno in (errno.ELOOP, errno.ENXIO):
                what = "a symbolic link" if e.errno == errno.ELOOP else "a socket"
                raise self._refuse(
                    path, f"is {what}, not a lock file", f"remove it (`rm {path}`)"
                ) from None
            raise self._refuse(path, f"cannot be opened ({e.strerror})", "remove it") from None
        finally:
            os.close(dir_fd)
        try:
            st = os.fstat(fd)
            path = self.lock_path(key)
            if not stat.S_ISREG(st.st_mode):
                raise self._refuse(
                    path, f"is {kind_of(st.st_mode)}, not a lock file", f"remove it (`rm {path}`)"
                )
            if st.st_nlink != 1:
                raise self._refuse(
                    path,
                    f"has {st.st_nlink} hard links: it may be another file's name",
                    f"remove it (`rm {path}`)",
                )
            if created:  # our own new file: readable and lockable by every user's lanes
                os.fchmod(fd, 0o666)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def try_acquire(self, keys: Sequence[str], n: int, holder: str = "") -> Lease | None:
        """Lease ``n`` of ``keys`` (first lockable ones, in order) without waiting, or ``None``."""
        held: list[tuple[str, int]] = []
        try:
            for key in keys:
                if len(held) == n:
                    break
                fd = self._open(key)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                except BaseException:
                    os.close(fd)
                    raise
                held.append((key, fd))
        except BaseException:  # a refused lock file, an I/O error: hold nothing
            for _, f in held:
                os.close(f)
            raise
        if len(held) < n:
            for _, fd in held:
                os.close(fd)
            return None
        note = f"pid {os.getpid()} on {socket.gethostname()}: {holder}\n".encode()
        for _, fd in held:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
                os.pwrite(fd, note, 0)
        return Lease(tuple(k for k, _ in held), tuple(fd for _, fd in held))

    def acquire(
        self,
        keys: Sequence[str],
        n: int,
        *,
        timeout: float,
        holder: str = "",
        poll_s: float = 0.05,
    ) -> Lease:
        """Lease ``n`` of ``keys``, waiting up to ``timeout`` seconds; :class:`LeaseTimeout` after."""
        deadline = time.monotonic() + timeout
        while True:
            lease = self.try_acquire(keys, n, holder)
            if lease is not None:
                return lease
            if time.monotonic() >= deadline:
                raise LeaseTimeout(
                    f"GPU lease timeout: {n} of {', '.join(keys)} not free after {timeout:g} s "
                    f"(held: {self.describe_holders(keys)})"
                )
            time.sleep(poll_s)

    def describe_holders(self, keys: Sequence[str]) -> str:
        """Who holds which of ``keys`` (from the lock files' notes), for error messages."""
        out = []
        for key in keys:
            try:
                data, _ = read_bytes(self.lock_path(key), NOTE_BYTES)
            except OSError:  # missing, too long, or no regular file: nothing to believe
                continue
            note = data.decode("utf-8", errors="replace").strip()
            if note:
                out.append(plain(f"{key}: {note[:200]}"))
        return "; ".join(out) or "unknown"
