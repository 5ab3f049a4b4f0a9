"""What every mizzen command line shares: one-line usage errors, complete help, the version from
the installed package's metadata, and third-party noise kept to one summary line.

Invariants:
- :class:`OneLineParser` reports a usage error (unknown flag, missing argument, bad choice) as
  one line, ``PROG: error: PROBLEM; fix: see PROG --help``, exit 2: never argparse's usage block.
  Its subparsers are of the same class (argparse makes them with the parent's class).
- :class:`HelpFormatter` appends ``(default: X)`` to an option's help only when the help does
  not already say its default and the default tells something (not None, False or an empty list).
- :func:`package_version` reads the version of the *installed* distribution
  (``importlib.metadata``), so ``--version`` is the one the wheel or the editable install says.
- :func:`quiet_third_party` must run before the heavy imports (torch, megatron, transformers):
  it hides the warnings that code outside mizzen raises (UserWarning, DeprecationWarning,
  SyntaxWarning, ... whose file is in site-packages or the standard library, not in a
  ``mizzen_*`` package), the below-ERROR log records of the third-party loggers of
  :data:`THIRD_PARTY_LOGGERS` and the Hugging Face progress bars, and counts them; the function it
  returns prints one summary line (nothing when nothing was hidden).  With ``verbose`` it changes
  nothing.  Errors of third-party loggers (ERROR and above) are always shown.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import sysconfig
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

__all__ = [
    "THIRD_PARTY_LOGGERS",
    "HelpFormatter",
    "OneLineParser",
    "package_version",
    "quiet_third_party",
]

#: loggers of libraries whose warnings are noise to a mizzen user (their children included)
THIRD_PARTY_LOGGERS = (
    "megatron",
    "transformer_engine",
    "apex",
    "torch.utils.cpp_extension",
    "torch.distributed",
    "torch._subclasses",
    "absl",
)

#: environment defaults that silence libraries configured by variables (a user's value wins)
_QUIET_ENVIRONMENT = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line naming the problem and the fix."""

    def error(self, message: str) -> NoReturn:
        text = " ".join(message.split())
        self.exit(2, f"{self.prog}: error: {text}; fix: see {self.prog} --help\n")


class HelpFormatter(argparse.HelpFormatter):
    """Help with each option's default shown once, and only when it tells something."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default in (None, False, [], argparse.SUPPRESS)
            or action.option_strings == []
        ):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


def package_version(distribution: str) -> str:
    """The installed version of ``distribution`` ("unknown" when it is not installed, e.g. a
    source tree on PYTHONPATH)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "unknown (not installed: running from a source tree)"


def _library_roots() -> tuple[str, ...]:
    """Where installed libraries and the standard library live, the deepest first: a venv's
    site-packages lies inside its lib/python3.X (its platstdlib), and the library a warning
    comes from is the folder right below the deepest root that holds the file."""
    names = ("purelib", "platlib", "stdlib", "platstdlib")
    found = {str(Path(p).resolve()) for n in names if (p := sysconfig.get_paths().get(n))}
    return tuple(sorted(found, key=len, reverse=True))


def is_third_party_file(filename: str, roots: tuple[str, ...]) -> bool:
    """Whether `filename` is code of an installed library or the standard library, not
    mizzen's (a ``mizzen_*`` package) nor the user's own."""
    path = str(Path(filename).resolve()) if filename and not filename.startswith("<") else ""
    if not path or any(part.startswith("mizzen_") for part in Path(path).parts):
        return False
    return any(path == root or path.startswith(root + os.sep) for root in roots)


class _Hidden:
    """What was hidden: counts by library (the first path part after the library root)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def add(self, library: str) -> None:
        self.counts[library.split(".")[0] or "?"] += 1

    def summary(self, prog: str) -> str | None:
        total = sum(self.counts.values())
        if not total:
            return None
        libraries = ", ".join(f"{name} {n}" for name, n in sorted(self.counts.items()))
        return f"{prog}: {total} third-party warning(s) hidden ({libraries}); --verbose shows them"


class _CountingHandler(logging.Handler):
    """Counts a library's records below ERROR; shows ERROR and above on stderr."""

    def __init__(self, hidden: _Hidden) -> None:
        super().__init__(logging.NOTSET)
        self.hidden = hidden
        self.setFormatter(logging.Formatter("%(name)s: %(levelname)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno < logging.ERROR:
            self.hidden.add(record.name)
            return
        try:
            print(self.format(record), file=sys.stderr)
        except Exception:  # logging must never end the run
            self.handleError(record)


def library_of(filename: str, roots: tuple[str, ...]) -> str:
    """The library ``filename`` belongs to: the folder (or module) right below the deepest of
    ``roots`` that holds it, whatever their order ("?" when none does)."""
    path = str(Path(filename).resolve())
    holding = [root for root in roots if path.startswith(root + os.sep)]
    if not holding:
        return "?"
    root = max(holding, key=len)
    return Path(path[len(root) + 1 :]).parts[0].removesuffix(".py")


def quiet_third_party(prog: str, *, verbose: bool) -> Callable[..., None]:
    """Hide and count third-party warnings and log records from now on (module docstring);
    returns ``finish(show_summary=True)``, which undoes the changes and prints the one summary
    line (a CLI leaves it out when it ends on an error line)."""
    if verbose:
        return lambda show_summary=True: None
    for name, value in _QUIET_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    hidden, roots = _Hidden(), _library_roots()
    previous_show = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if is_third_party_file(filename, roots):
            hidden.add(library_of(filename, roots))
            return
        previous_show(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    handler, saved = _CountingHandler(hidden), []
    for name in THIRD_PARTY_LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.propagate))
        logger.addHandler(handler)
        logger.propagate = False

    def finish(show_summary: bool = True) -> None:
        if warnings.showwarning is not show:  # finished already (or replaced by someone else)
            return
        warnings.showwarning = previous_show
        for logger, propagate in saved:
            logger.removeHandler(handler)
            logger.propagate = propagate
        line = hidden.summary(prog)
        if line and show_summary:
            print(line, file=sys.stderr, flush=True)

    return finish
