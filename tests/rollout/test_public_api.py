"""The public API of mizzen-rollout (:mod:`mizzen_rollout.api`) is the only way in.

- Every other workspace package (``packages/*/src`` but rollout's own: ``mizzen_train``,
  ``mizzen_plugins``) imports ``mizzen_rollout.api`` and no other ``mizzen_rollout`` module, at
  module scope or inside functions (read from the syntax tree, ``importlib.import_module`` with a
  literal name included).
- Every name in ``mizzen_rollout.api.__all__`` resolves, once.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=3, labels=["rollout"])

ROOT = Path(__file__).resolve().parents[2]
API = "mizzen_rollout.api"
RULE = "rollout-public-api"


def _imported_modules(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, module) for every import in ``tree``, at any depth."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "mizzen_rollout":  # from mizzen_rollout import api, ...
                yield from ((node.lineno, f"mizzen_rollout.{a.name}") for a in node.names)
            else:
                yield node.lineno, node.module
        elif isinstance(node, ast.Call) and _is_import_call(node.func) and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                yield node.lineno, first.value


def _is_import_call(func: ast.expr) -> bool:
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return name in ("import_module", "__import__")


def _violations(source_root: Path) -> list[str]:
    found = []
    for path in sorted(source_root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for line, module in sorted(_imported_modules(tree)):
            if module.split(".")[0] == "mizzen_rollout" and module != API:
                found.append(
                    f"{path.relative_to(ROOT)}:{line}: [{RULE}] imports {module}, a module of "
                    f"mizzen_rollout other than its public API {API}. Fix: import the name from "
                    f"{API} (add it there, with its docstring entry, if it is missing)"
                )
    return found


def _other_packages() -> list[Path]:
    roots = [p for p in sorted((ROOT / "packages").glob("*/src")) if p.parent.name != "rollout"]
    assert any(p.parent.name == "train" for p in roots), f"no packages/train/src under {ROOT}"
    return roots


def test_other_packages_import_only_the_rollout_api():
    violations = [v for root in _other_packages() for v in _violations(root)]
    assert not violations, "\n".join(violations)


def test_the_checker_sees_lazy_and_dynamic_imports(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text(
        "from mizzen_rollout.api import Sample\n"
        "from mizzen_rollout import api\n"
        "def f():\n"
        "    from mizzen_rollout.data import DataError\n"
        "    import importlib\n"
        "    importlib.import_module('mizzen_rollout.rewards')\n"
        "    from mizzen_rollout import samples\n"
    )
    modules = [m for _, m in _imported_modules(ast.parse(source.read_text()))]
    bad = sorted(m for m in modules if m.startswith("mizzen_rollout") and m != API)
    assert bad == ["mizzen_rollout.data", "mizzen_rollout.rewards", "mizzen_rollout.samples"]


def test_every_name_of_the_api_resolves_once():
    import mizzen_rollout.api as api

    names = list(api.__all__)
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    missing = [name for name in names if not hasattr(api, name)]
    assert not missing, f"{API}.__all__ names {missing}, which the module does not bind"
    documented = set(re.findall(r":(?:class|func|data):`(\w+)`", api.__doc__ or ""))
    assert set(names) == documented, (
        f"{API}: exported, not in its docstring: {sorted(set(names) - documented)}; in its "
        f"docstring, not exported: {sorted(documented - set(names))}. Fix: keep the two equal"
    )
