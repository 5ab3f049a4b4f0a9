"""Import every module of installed packages, found by walking them (never a hand-kept list).

Invariants:
- Stdlib only, and runnable as a plain script (``python walk.py PKG …``) inside any
  environment, including a fresh venv where only the package under test is installed.
- ``__main__`` modules are entry points, not importable library code: they are never imported.
- Every module is attempted even after a failure; the run fails (exit 1) if any import failed,
  naming each module and the last line of its error.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import traceback


def walk_modules(package: str) -> tuple[list[str], list[tuple[str, str]]]:
    """(modules imported, [(module, error)]) for ``package`` and everything below it."""
    imported: list[str] = []
    failed: list[tuple[str, str]] = []
    try:
        root = importlib.import_module(package)
    except BaseException as e:  # a failing import may raise anything, SystemExit included
        return [], [(package, _last_line(e))]
    imported.append(package)
    paths = getattr(root, "__path__", None)
    if paths is None:
        return imported, failed

    def on_error(name: str) -> None:
        failed.append((name, _last_line(sys.exc_info()[1])))

    for info in pkgutil.walk_packages(paths, prefix=package + ".", onerror=on_error):
        if info.name.rsplit(".", 1)[-1] == "__main__":
            continue
        if info.name in sys.modules:
            imported.append(info.name)
            continue
        try:
            importlib.import_module(info.name)
            imported.append(info.name)
        except BaseException as e:
            failed.append((info.name, _last_line(e)))
    return imported, failed


def _last_line(exc: BaseException | None) -> str:
    if exc is None:
        return "unknown error"
    return traceback.format_exception_only(exc)[-1].strip()


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: walk.py PACKAGE [PACKAGE ...]", file=sys.stderr)
        return 2
    status = 0
    for package in argv:
        imported, failed = walk_modules(package)
        for name, error in failed:
            print(f"FAILED import {name}: {error}", file=sys.stderr)
        print(f"{package}: imported {len(imported)} module(s), {len(failed)} failed")
        status |= bool(failed)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
