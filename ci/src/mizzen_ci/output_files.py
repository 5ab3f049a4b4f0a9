"""Files and folders a command writes (a plan, a summary, ``$GITHUB_OUTPUT``, a reply, a report
folder): checked before the command writes or prints anything, written whole or not at all.

Invariants:
- :func:`check_file` and :func:`check_dir` only look: a path that cannot be written (a folder
  where a file is wanted, a file where a folder is wanted, a FIFO or device, a missing folder
  under a file, a read-only folder) is an :class:`OutputPathError` naming the option, the path,
  the problem and the fix.  A command checks every output path first, so bad paths exit 2 with
  nothing written and nothing printed.
- :class:`Outputs` stages whole texts and :meth:`Outputs.commit` writes each replaced output to a
  temporary file beside its target, then appends each appended output (``$GITHUB_OUTPUT``,
  ``$GITHUB_STEP_SUMMARY``) in place, and only then renames the temporary files over their
  targets (``os.replace``): a failure leaves every target as it was (an appended file is cut
  back to its old length) and no temporary file behind.  An appended file keeps its inode, owner
  and mode (the runner's file stays the runner's); a replaced file keeps its mode; a new one
  gets what the umask gives.  Missing parent folders are created by the commit (never by a
  check), and removed again when the commit fails.
- A symbolic link is followed to the file it names: the file is replaced, not the link.
- Stdlib only.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from .sources import kind_of


class OutputPathError(ValueError):
    """An output path that cannot be written; the message names the option, the path, the
    problem and the fix."""


def _error(option: str, path: Path | str, problem: str, fix: str) -> OutputPathError:
    return OutputPathError(f"{option} {path}: {problem}. Fix: {fix}")


def _mode(option: str, path: Path | str, where: Path) -> int | None:
    """The ``st_mode`` of ``where`` (None: nothing there)."""
    try:
        return os.stat(where).st_mode
    except (FileNotFoundError, NotADirectoryError):  # a file above it: the walk up names it
        return None
    except OSError as e:
        raise _error(
            option, path, f"cannot be checked ({e.strerror})", "give another path"
        ) from None


def _existing_ancestor(option: str, path: Path | str, target: Path) -> Path:
    """The nearest folder at or above ``target``'s parent that exists (a file there: an error)."""
    for folder in target.parents:
        mode = _mode(option, path, folder)
        if mode is None:
            continue
        if not stat.S_ISDIR(mode):
            raise _error(
                option, path, f"{folder} is {kind_of(mode)}, not a folder",
                "give a path whose folders are folders (or remove that file)",
            )  # fmt: skip
        if not os.access(folder, os.W_OK | os.X_OK):
            raise _error(option, path, f"the folder {folder} is not writable",
                         "give a path in a folder you can write")  # fmt: skip
        return folder
    raise _error(option, path, "has no existing folder above it", "give another path")


def _target(path: Path | str) -> Path:
    return Path(os.path.realpath(os.fspath(path)))


def check_file(option: str, path: Path | str) -> Path:
    """The file ``path`` (a link followed) after checking that ``option`` can write it."""
    target = _target(path)
    mode = _mode(option, path, target)
    if mode is not None and stat.S_ISDIR(mode):
        raise _error(option, path, "is a folder", "give the path of a file, not of a folder")
    if mode is not None and not stat.S_ISREG(mode):
        raise _error(option, path, f"is {kind_of(mode)}, not a regular file",
                     "give the path of a regular file")  # fmt: skip
    if mode is not None and not os.access(target, os.W_OK):
        raise _error(option, path, "is read-only", "give a file you can write")
    _existing_ancestor(option, path, target)
    return target


def check_dir(option: str, path: Path | str) -> Path:
    """The folder ``path`` (a link followed) after checking that ``option`` can create it or
    write in it."""
    target = _target(path)
    mode = _mode(option, path, target)
    if mode is None:
        _existing_ancestor(option, path, target)
    elif not stat.S_ISDIR(mode):
        raise _error(option, path, f"is {kind_of(mode)}, not a folder",
                     "give the path of a folder (it is created when missing)")  # fmt: skip
    elif not os.access(target, os.W_OK | os.X_OK):
        raise _error(option, path, "is a folder you cannot write", "give a folder you can write")
    return target


@dataclass(frozen=True)
class _Staged:
    option: str
    path: Path  # as given
    target: Path  # the file written
    text: str
    append: bool


class Outputs:
    """The files one command writes: each checked when added, all written by :meth:`commit`."""

    def __init__(self) -> None:
        self._staged: list[_Staged] = []
        self._options: dict[Path, str] = {}

    def check(self, option: str, path: Path | str | None) -> None:
        """Check ``path`` (None: the option was not given) before anything is written."""
        if path is None:
            return
        target = check_file(option, path)
        other = self._options.setdefault(target, option)
        if other != option:
            raise _error(option, path, f"is also the file of {other}",
                         "give each output its own file")  # fmt: skip

    def add(self, option: str, path: Path | str | None, text: str, *, append: bool = False):
        """Stage ``text`` for ``path`` (checked now; None: nothing to write)."""
        if path is None:
            return
        self.check(option, path)
        self._staged.append(_Staged(option, Path(path), _target(path), text, append))

    def commit(self) -> None:
        """Write every staged file, all or none (see the module docstring)."""
        created: list[Path] = []
        temps: list[Path] = []
        appended: list[tuple[Path, int]] = []
        replaced = [staged for staged in self._staged if not staged.append]
        current = self._staged[0] if self._staged else None
        try:
            for current in replaced:
                _make_parents(current.target.parent, created)
                temps.append(_write_temp(current))
            for current in self._staged:
                if current.append:
                    _make_parents(current.target.parent, created)
                    appended.append(_append(current))
            for current, tmp in zip(replaced, temps, strict=True):
                os.replace(tmp, current.target)
        except OSError as e:
            for tmp in temps:
                tmp.unlink(missing_ok=True)
            for target, size in appended:
                with contextlib.suppress(OSError):
                    os.truncate(target, size)
            for folder in reversed(created):
                _remove_empty(folder)
            raise _error(current.option, current.path, f"cannot be written ({e.strerror or e})",
                         "give a path you can write; nothing was written") from None  # fmt: skip
        self._staged.clear()


def _make_parents(folder: Path, created: list[Path]) -> None:
    """Create ``folder`` and its missing parents, top first, each added to ``created``."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for each in reversed(missing):
        each.mkdir()
        created.append(each)


def _remove_empty(folder: Path) -> None:
    with contextlib.suppress(OSError):
        folder.rmdir()


def _append(staged: _Staged) -> tuple[Path, int]:
    """Append ``staged.text`` to its target in place (created when missing; the file keeps its
    inode, owner and mode): ``(target, its length before)``; cut back to that length when the
    write fails."""
    data = staged.text.encode("utf-8", "backslashreplace")
    fd = os.open(staged.target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        size = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)
    return staged.target, size


def _write_temp(staged: _Staged) -> Path:
    """A temporary file beside the target holding what the target is to hold (the target's mode
    when it exists, else what the umask gives a new file)."""
    target = staged.target
    try:
        old = target.stat()
    except FileNotFoundError:
        old = None
    tmp = target.parent / f".{target.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(staged.text.encode("utf-8", "backslashreplace"))
        if old is not None:
            os.chmod(tmp, stat.S_IMODE(old.st_mode))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp
