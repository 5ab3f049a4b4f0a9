"""Host directories a lane trusts (the GPU lease directory, the compile cache): opened and checked
without following a link, so that nobody else can steer what a lane locks or what its children
execute.

Invariants:
- A directory is opened with ``O_NOFOLLOW | O_DIRECTORY`` (by name relative to an already checked
  parent's descriptor when one is given) and checked on the open descriptor, never by a second
  lookup of its path.
- It is refused (``rule.error``: the path, what is wrong, the fix) when it is a symbolic link or
  no directory, when its owner is not the current user (or root, where ``rule.root_may_own``), or
  when it is group- or world-writable (unless ``rule.sticky_shares`` and the sticky bit is set).
- A missing directory is created (its missing parents as ``mkdir -p`` makes them) and its new
  descriptor is ``fchmod`` ed to ``rule.create_mode`` whatever the umask; one that another process
  creates in between is checked like any other.  An existing directory's mode is never changed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ..output import plain
from ..sources import kind_of
from .refusal import LaneRefusal

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class DirRule:
    """Who may own and write a trusted directory, and how a refusal reads."""

    what: str  # "GPU lease directory"
    error: type[LaneRefusal]
    fix: str  # the general fix: where to point the lane instead
    stake: str  # what someone else could do with it: "replace the lock files"
    create_mode: int  # of a directory the lane creates
    root_may_own: bool = False
    sticky_shares: bool = False  # group/world-writable is fine with the sticky bit

    def refuse(self, path: Path | str, problem: str, fix: str | None = None) -> LaneRefusal:
        return self.error(plain(f"{self.what}: {path} {problem}. Fix: {fix or self.fix}"))


def _kind(path: Path | str, parent_fd: int | None) -> str:
    try:
        return kind_of(os.stat(path, dir_fd=parent_fd, follow_symlinks=False).st_mode)
    except OSError:
        return "missing"


def open_dir(path: Path, rule: DirRule, *, parent_fd: int | None = None) -> int:
    """A descriptor of the checked directory ``path`` (created when missing); with ``parent_fd``,
    ``path.name`` is looked up in that directory and ``path`` is only what messages show.  Raises
    ``rule.error`` when it is unsafe (see the module docstring)."""
    name: Path | str = path.name if parent_fd is not None else path
    created = False
    try:
        os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        try:
            if parent_fd is None:
                path.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):  # someone made it first: check theirs
                os.mkdir(name, 0o700, dir_fd=parent_fd)
                created = True
        except OSError as e:
            raise rule.refuse(path, f"cannot be created ({e.strerror})") from None
    except OSError as e:
        raise rule.refuse(path, f"cannot be examined ({e.strerror})") from None
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise rule.refuse(path, f"is {_kind(name, parent_fd)}, not a directory") from None
        raise rule.refuse(path, f"cannot be opened ({e.strerror})") from None
    try:
        if created:  # ours, just made: exactly the rule's mode, whatever the umask
            os.fchmod(fd, rule.create_mode)
        st = os.fstat(fd)
        me = os.geteuid()
        if st.st_uid != me and not (rule.root_may_own and st.st_uid == 0):
            whom = (
                f"neither this user ({me}) nor root"
                if rule.root_may_own
                else f"not this user ({me})"
            )
            raise rule.refuse(
                path,
                f"is owned by uid {st.st_uid}, {whom}: its owner could {rule.stake}",
            )
        if st.st_mode & 0o022 and not (rule.sticky_shares and st.st_mode & stat.S_ISVTX):
            mode = stat.S_IMODE(st.st_mode)
            if rule.sticky_shares:
                problem = f"is group- or world-writable (mode {mode:o}) without the sticky bit"
                fix = f"`chmod +t {path}` (or {rule.fix})"
            else:
                problem = f"is group- or world-writable (mode {mode:o})"
                fix = f"`chmod go-w {path}` (or {rule.fix})"
            raise rule.refuse(path, f"{problem}: anyone who can write it could {rule.stake}", fix)
    except BaseException:
        os.close(fd)
        raise
    return fd
