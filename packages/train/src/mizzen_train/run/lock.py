"""One command per run directory at a time: an exclusive ``fcntl`` lock on ``<run.dir>/.lock``.

:func:`hold_run_dir` is entered before anything is written into the run directory (the tiny base
model, ``run.json``, checkpoints) and held until the command ends, for a fresh run and for
``--resume`` alike.  A second command on the same directory gets one line: the directory is in
use by pid N.

Invariants:
- The lock is the kernel's (``flock`` on an open file): it ends when the holding process ends,
  however it ends (SIGKILL included), so a killed run never leaves a stale lock behind.
- A directory a fresh run starts in is empty, or holds only what a start that never became a run
  leaves (the lock file, the tiny base model); any other content is refused with the fix, never
  written into -- the refusal comes before the lock file is created, so a refused start leaves
  nothing behind.  ``--resume`` creates nothing: its directory must hold a run.
- The lock file is never followed through a link (``O_NOFOLLOW``), must be a regular file, and
  holds only the holder's pid.  A directory that cannot be created or opened is one line naming
  it, never a traceback.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from mizzen_train.run.layout import LOCK_FILE, RUN_FILE, TINY_MODEL_PREFIX
from mizzen_train.run.state import RunStateError

__all__ = ["hold_run_dir"]

#: What a start that never became a run may leave in its directory (all written by mizzen).
_LEFTOVER_PREFIXES = (
    TINY_MODEL_PREFIX,
    f".tmp-{TINY_MODEL_PREFIX}",  # the tiny model being written (hf.tiny's temporary sibling)
    f".{RUN_FILE}.tmp-",  # run.json being written (state's atomic write)
)
_LEFTOVER_NAMES = frozenset({LOCK_FILE})


@contextlib.contextmanager
def hold_run_dir(run_dir: Path, *, resume: bool) -> Iterator[None]:
    """Hold ``run_dir`` exclusively for this process (created when missing, for a fresh run)
    until the block ends; RunStateError when another process holds it, when a fresh run would
    write into a directory holding something else, or when ``--resume`` names no run."""
    if resume and not os.path.lexists(run_dir / RUN_FILE):
        _refuse_if_held(run_dir)  # a fresh run that has not written its run.json yet
        raise RunStateError(
            f"--resume: {run_dir} holds no run ({RUN_FILE} is missing); drop --resume to start one"
        )
    if not resume and run_dir.is_dir():
        _refuse_if_held(run_dir)  # a run starting there now: "in use", not "not empty"
        _check_fresh(run_dir)  # before the lock file exists: a refusal writes nothing
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(
            run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644
        )
    except OSError as exc:
        raise RunStateError(
            f"{run_dir}: cannot create or open the run directory and its lock "
            f"({exc.strerror or exc}); check that it is a directory you may write, or choose "
            "another run.dir"
        ) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise RunStateError(
                f"{run_dir / LOCK_FILE}: not a regular file; remove it, or choose another run.dir"
            )
        _acquire(fd, run_dir)
        if not resume:
            _check_fresh(run_dir)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)  # releases the lock


def _refuse_if_held(run_dir: Path) -> None:
    """RunStateError naming the holder when ``run_dir``'s existing lock is held; creates
    nothing."""
    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return  # no lock file (or none we could use): nobody holds it
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            _acquire(fd, run_dir)
    finally:
        os.close(fd)


def _acquire(fd: int, run_dir: Path) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        raise RunStateError(
            f"{run_dir} is in use by pid {holder} (another mizzen-train run or --resume); "
            "wait for it to end, or choose another run.dir"
        ) from None


def _check_fresh(run_dir: Path) -> None:
    """A fresh run writes only into an empty directory, a run's (run.json refuses it later with
    the --resume hint), or what a start that never became a run left."""
    if (run_dir / RUN_FILE).exists():
        return
    foreign = sorted(
        entry.name
        for entry in run_dir.iterdir()
        if entry.name not in _LEFTOVER_NAMES and not entry.name.startswith(_LEFTOVER_PREFIXES)
    )
    if foreign:
        shown = ", ".join(foreign[:3]) + (
            f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        )
        raise RunStateError(
            f"{run_dir} is not empty and holds no run ({shown}); a run writes only into an "
            "empty or new directory: choose another run.dir"
        )
