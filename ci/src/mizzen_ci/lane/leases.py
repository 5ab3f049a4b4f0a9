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
  lock, not the content, is the truth.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import socket
import time
from collections.abc import Sequence
from pathlib import Path

LEASE_DIR_ENV = "MIZZEN_GPU_LEASE_DIR"
DEFAULT_LEASE_DIR = Path("/tmp/mizzen-gpu-leases")


class LeaseTimeout(TimeoutError):
    """The GPUs stayed leased by someone else for longer than the allowed wait."""


def default_lease_dir() -> Path:
    return Path(os.environ.get(LEASE_DIR_ENV) or DEFAULT_LEASE_DIR)


class Lease:
    """GPUs held by this process (and whoever it passes :attr:`fds` to) until :meth:`release`."""

    def __init__(self, keys: tuple[str, ...], fds: tuple[int, ...]):
        self.keys = keys
        self.fds = fds
        self._released = False

    def release(self) -> None:
        if self._released:
            return
        self._released = True
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

    def _open(self, key: str) -> int:
        if not self.path.is_dir():
            self.path.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):  # shared by every user's lanes on the host
                self.path.chmod(0o1777)
        fd = os.open(self.lock_path(key), os.O_RDWR | os.O_CREAT, 0o666)
        with contextlib.suppress(OSError):
            os.fchmod(fd, 0o666)
        return fd

    def try_acquire(self, keys: Sequence[str], n: int, holder: str = "") -> Lease | None:
        """Lease ``n`` of ``keys`` (first lockable ones, in order) without waiting, or ``None``."""
        held: list[tuple[str, int]] = []
        for key in keys:
            if len(held) == n:
                break
            fd = self._open(key)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            except OSError:
                os.close(fd)
                for _, f in held:
                    os.close(f)
                raise
            held.append((key, fd))
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
            path = self.lock_path(key)
            try:
                note = path.read_text().strip()
            except OSError:
                continue
            if note:
                out.append(f"{key}: {note}")
        return "; ".join(out) or "unknown"
