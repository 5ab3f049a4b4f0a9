"""Resolving imports as written into absolute dotted names, and into the files beside a script.

A file outside every source directory (a test, a conftest, a helper, a script: named by its
root-relative path) imports its *siblings* as Python does at run time, where a script runs with
its own directory on ``sys.path`` (and pytest's ``--import-mode=importlib`` adds none):
``import X.Y`` in ``d/f.py`` runs ``d/X/__init__.py`` then ``d/X/Y.py`` (or ``d/X/Y/__init__.py``);
``import X`` runs ``d/X.py`` or ``d/X/__init__.py``.  :func:`sibling_files` resolves a name so
(forward), :func:`sibling_names` lists the names that reach a file so (reverse); the two agree.

Invariants: pure functions of their arguments; a relative import beyond the top-level package
(or from a file outside any package) resolves to nothing, as Python refuses it.
"""

from __future__ import annotations

from collections.abc import Container, Iterable


def package_of(module: str, is_package: bool) -> str:
    """The package a module's relative imports start from: itself for a package's
    ``__init__``, else its parent ("" for a top-level module)."""
    return module if is_package else module.rpartition(".")[0]


def relative_base(package: str, level: int) -> str | None:
    """The absolute package that ``level`` leading dots name from ``package`` (None: beyond the
    top-level package, or outside any package)."""
    if not package:
        return None
    parts = package.split(".")
    if level > len(parts):
        return None
    return ".".join(parts[: len(parts) - level + 1])


def direct_names(imports: Iterable[tuple], package: str) -> tuple[str, ...]:
    """Every name a file's imports (all scopes) name directly, in source order without
    repeats: each import's absolute target and, for ``from X import n``, ``X.n`` (``n`` may be a
    submodule, or one that is gone).  Relative imports resolve from ``package`` (see
    :func:`package_of`; "" for a file outside any package, whose relative imports are skipped as
    :class:`ImportGraph` skips them).  ``imports``: :class:`RawImport` s or plain tuples of the
    same fields.  Importing one of these names also runs its parent packages first."""
    out: dict[str, None] = {}
    for module, level, names, _line, _scope, _guarded, kind in imports:
        if level:
            base = relative_base(package, level)
            if base is None:
                continue
            target = f"{base}.{module}" if module else base
        else:
            target = module
        out[target] = None
        if kind == "from":
            for n in names:
                if n != "*":
                    out[f"{target}.{n}"] = None
    return tuple(out)


def sibling_files(node: str, target: str, names: Iterable[str], files: Container[str]) -> list[str]:
    """The files among ``files`` that ``import target`` (``from target import names``) runs in
    the file ``node`` (a root-relative path) through its own directory, parents first."""
    directory = node.rpartition("/")[0]
    parts = target.split(".") if target else []
    out: list[str] = []
    base = directory
    for part in parts:
        package = f"{base}/{part}/__init__.py" if base else f"{part}/__init__.py"
        module = f"{base}/{part}.py" if base else f"{part}.py"
        if module in files:
            out.append(module)
        if package not in files:
            return out  # no package: nothing below it runs (from-imports name attributes)
        out.append(package)
        base = package[: -len("/__init__.py")]
    for n in names:
        if n == "*":
            continue
        for f in (f"{base}/{n}.py", f"{base}/{n}/__init__.py"):
            if f in files:
                out.append(f)
    return out


def sibling_names(node: str, files: Container[str]) -> list[tuple[str, str]]:
    """``[(directory, dotted name)]``: a file in ``directory`` that names ``dotted name`` or a name
    below it (``X`` for ``X.py``; ``X.Y`` or ``X`` … for a file inside package ``X``) runs ``node``
    through its directory, as :func:`sibling_files` resolves it.  ``node`` is a ``.py`` path."""
    parts = node.split("/")
    if parts[-1] == "__init__.py":
        parts.pop()
    elif parts[-1].endswith(".py"):
        parts[-1] = parts[-1][:-3]
    else:
        return []
    out: list[tuple[str, str]] = []
    # the importing directory is parts[:j]; every directory between it and node is a package
    for j in range(len(parts) - 1, -1, -1):
        if not parts[j].isidentifier():
            break
        out.append(("/".join(parts[:j]), ".".join(parts[j:])))
        if j == 0 or "/".join(parts[:j]) + "/__init__.py" not in files:
            break
    return out
