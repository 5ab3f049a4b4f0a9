"""Resolving imports as written into absolute dotted names.

Invariants: pure functions of their arguments; a relative import beyond the top-level package
(or from a file outside any package) resolves to nothing, as Python refuses it.
"""

from __future__ import annotations

from collections.abc import Iterable


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
