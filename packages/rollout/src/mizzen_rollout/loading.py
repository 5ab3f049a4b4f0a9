"""The one "module:function" loader of mizzen: rewards, user evaluators and advantage estimators
name their code with the same spec and resolve it with :func:`load_object`.

The rule (one for every caller):

- a spec is a built-in name (when the caller has built-ins), or ``package.module:attr`` (the
  module is imported), or ``path/to/file.py:attr`` (the file is executed as a fresh module that
  is not put in ``sys.modules``);
- the text after the last ``:`` is an attribute of that module and must be callable.

Invariants:
- Every refusal is an :class:`ObjectSpecError` naming what was being loaded, the spec, the rule
  broken and the fix; no spec is silently read another way.  Callers with an error type of their
  own subclass :class:`ObjectSpecError` and re-raise with the same message.
- Pure standard library; nothing is imported until a spec names it.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["ObjectSpecError", "check_spec_form", "load_object"]


class ObjectSpecError(ValueError):
    """A ``module:function`` spec that does not name a callable; the message says why and how."""


def load_object(
    spec: str,
    *,
    what: str,
    builtins: Mapping[str, Any] | None = None,
    kind: str = "function",
) -> Any:
    """The callable ``spec`` names (the rule of the module docstring).

    ``what`` names the thing in errors ("reward", "evaluator"); ``builtins`` are the names that
    resolve without an import; ``kind`` is what the attribute is ("function", "factory").
    """
    check_spec_form(spec, what=what, builtins=builtins, kind=kind)
    if builtins and spec in builtins:
        return builtins[spec]
    module_name, _, attr = spec.rpartition(":")
    obj = getattr(_module(module_name, spec, what), attr, None)
    if obj is None:
        raise ObjectSpecError(
            f"{what} {spec!r}: module {module_name!r} has no attribute {attr!r}. Fix: name a "
            f"{kind} the module defines"
        )
    if not callable(obj):
        raise ObjectSpecError(
            f"{what} {spec!r}: {attr!r} is {type(obj).__name__}, not callable. Fix: name a {kind}"
        )
    return obj


def check_spec_form(
    spec: str,
    *,
    what: str,
    builtins: Mapping[str, Any] | None = None,
    kind: str = "function",
) -> None:
    """``spec`` has the rule's form (a built-in name, or text before and after its last ``:``);
    nothing is imported.  For a configuration read without running its code (an export of a
    stored run)."""
    if builtins and spec in builtins:
        return
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ObjectSpecError(f"{what} {spec!r} {_not_a_spec(builtins, kind)}")


def _not_a_spec(builtins: Mapping[str, Any] | None, kind: str) -> str:
    fix = f"Fix: write e.g. 'my_pkg.module:{kind}' or 'path/to/file.py:{kind}'"
    if builtins:
        return f"is neither built in ({sorted(builtins)}) nor 'module:{kind}'. {fix}"
    return f"is not 'module:{kind}'. {fix}"


def _module(module_name: str, spec: str, what: str) -> ModuleType:
    if module_name.endswith(".py"):
        return _module_from_file(Path(module_name), spec, what)
    try:
        return importlib.import_module(module_name)
    except Exception as exc:
        raise ObjectSpecError(
            f"{what} {spec!r}: importing {module_name!r} failed ({type(exc).__name__}: {exc}). "
            "Fix: make the module importable (installed, or on PYTHONPATH)"
        ) from None


def _module_from_file(path: Path, spec: str, what: str) -> ModuleType:
    if not path.is_file():
        raise ObjectSpecError(
            f"{what} {spec!r}: file {path} does not exist. Fix: give the path of a Python file"
        )
    name = "_mizzen_loaded_" + re.sub(r"\W", "_", path.stem)
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ObjectSpecError(f"{what} {spec!r}: {path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        raise ObjectSpecError(
            f"{what} {spec!r}: importing {str(path)!r} failed ({type(exc).__name__}: {exc}). "
            "Fix: make the file run on its own"
        ) from None
    return module
