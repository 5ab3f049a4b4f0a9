"""Test files share helpers only through conftest fixtures (DESIGN.md, "How we write code").

Every ``tests/**/test_*.py`` of the registry's walk (``registry.discover`` with the registry's
excludes, so ``tests/ci/fixtures`` is not read) is parsed with :mod:`ast`; none may

- change the import path: ``sys.path.insert`` / ``.append`` / ``.extend`` (also through
  ``import sys as s`` or ``from sys import path``);
- load a module by path: ``importlib.util.spec_from_file_location``, however it is reached;
- import another test module: ``import test_x``, ``from test_x import y``, ``from tests.ci import
  test_x``, ``from .test_x import y``, ``importlib.import_module("test_x")``, ``__import__``.

No ``benchmarks/*.py`` changes the import path either (each runs under ``uv run``).

Such a dependency is invisible to the planner, which follows conftests and the helpers they load;
``conftest.py`` files and helper modules are not test files and may load by path.  Each finding
names ``file:line``, what was done and the fix.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.registry import discover, registry_excludes

register_cpu_ci(est_time=5, labels=["ci"])

FIX = (
    "Fix: share it as a fixture of a conftest.py (or a helper module that a conftest loads) "
    "above both files"
)


BENCHMARK_FIX = (
    "Fix: import the installed workspace (run it as `uv run python benchmarks/NAME.py`, or with "
    "PYTHONPATH set where no venv is) and document the run line in its docstring"
)


def _is_test_module(dotted: str) -> bool:
    return any(part.startswith("test_") for part in dotted.split("."))


def _string_arg(call: ast.Call) -> str | None:
    if call.args and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str):
        return call.args[0].value
    return None


def layout_findings(source: str, rel: str) -> list[str]:
    """What ``source`` (the test file ``rel``) does that only a conftest may; one line each."""
    tree = ast.parse(source, rel)
    sys_names = {"sys"}  # names bound to the sys module
    path_names: set[str] = set()  # names bound to sys.path
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            sys_names |= {a.asname for a in node.names if a.name == "sys" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "sys" and node.level == 0:
            path_names |= {a.asname or a.name for a in node.names if a.name == "path"}

    def is_sys_path(expr: ast.expr) -> bool:
        if isinstance(expr, ast.Name):
            return expr.id in path_names
        return (
            isinstance(expr, ast.Attribute)
            and expr.attr == "path"
            and isinstance(expr.value, ast.Name)
            and expr.value.id in sys_names
        )

    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_test_module(alias.name):
                    found.append((node.lineno, f"imports the test module {alias.name}"))
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            if node.module and _is_test_module(node.module):
                found.append((node.lineno, f"imports from the test module {module}"))
            for alias in node.names:
                if alias.name == "spec_from_file_location":
                    found.append((node.lineno, "imports spec_from_file_location (loads by path)"))
                elif _is_test_module(alias.name):
                    found.append((node.lineno, f"imports the test module {alias.name}"))
        elif isinstance(node, ast.Attribute) and node.attr == "spec_from_file_location":
            found.append((node.lineno, "loads a module by path (spec_from_file_location)"))
        elif isinstance(node, ast.Call):
            func = node.func
            if (
                isinstance(func, ast.Attribute)
                and func.attr in ("insert", "append", "extend")
                and is_sys_path(func.value)
            ):
                found.append((node.lineno, f"changes the import path (sys.path.{func.attr})"))
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            target = _string_arg(node)
            if name in ("import_module", "__import__") and target and _is_test_module(target):
                found.append((node.lineno, f"imports the test module {target} ({name})"))
    return [f"{rel}:{line}: {what}. {FIX}" for line, what in sorted(found)]


def test_no_test_file_reaches_another_test_file_or_the_import_path(repo_root: Path):
    tests = discover(repo_root, registry_excludes(repo_root)).tree.tests
    assert "tests/ci/test_test_layout.py" in tests and len(tests) > 50, tests
    assert not any(t.startswith("tests/ci/fixtures/") for t in tests)
    findings = [
        finding
        for rel in tests
        for finding in layout_findings((repo_root / rel).read_text(encoding="utf-8"), rel)
    ]
    assert findings == [], "\n".join(findings)


def test_no_benchmark_changes_the_import_path(repo_root: Path):
    """A benchmark runs under ``uv run`` (or with ``PYTHONPATH`` set, in an image's own
    environment); ``synthetic_monorepo`` is beside it, on a script's own ``sys.path[0]``."""
    scripts = sorted((repo_root / "benchmarks").glob("*.py"))
    assert len(scripts) > 5, scripts
    findings = [
        finding.replace(FIX, BENCHMARK_FIX)
        for path in scripts
        for finding in layout_findings(path.read_text(encoding="utf-8"), f"benchmarks/{path.name}")
        if "changes the import path" in finding
    ]
    assert findings == [], "\n".join(findings)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        pytest.param(
            "import sys\nsys.path.insert(0, 'x')\n", [(2, "sys.path.insert")], id="sys.path.insert"
        ),
        pytest.param(
            "import sys as s\n\ns.path.append('x')\n", [(3, "sys.path.append")], id="sys-aliased"
        ),
        pytest.param(
            "from sys import path as p\np.extend(['x'])\n",
            [(2, "sys.path.extend")],
            id="from-sys-import-path",
        ),
        pytest.param(
            "import importlib.util\nspec = importlib.util.spec_from_file_location('m', 'f.py')\n",
            [(2, "spec_from_file_location")],
            id="importlib.util.spec",
        ),
        pytest.param(
            "from importlib.util import spec_from_file_location\n",
            [(1, "imports spec_from_file_location")],
            id="from-importlib.util-import-spec",
        ),
        pytest.param(
            "from importlib import util\nutil.spec_from_file_location('m', 'f')\n",
            [(2, "by path")],
            id="util.spec",
        ),
        pytest.param(
            "import test_plan_cache\n", [(1, "the test module test_plan_cache")], id="import-test"
        ),
        pytest.param(
            "from test_plan_cache import age_all\n",
            [(1, "from the test module test_plan_cache")],
            id="from-test-import",
        ),
        pytest.param(
            "from tests.ci import test_cli\n",
            [(1, "the test module test_cli")],
            id="from-package-import-test",
        ),
        pytest.param(
            "import tests.ci.test_cli as c\n",
            [(1, "the test module tests.ci.test_cli")],
            id="import-dotted-test",
        ),
        pytest.param(
            "from .test_cli import x\n",
            [(1, "from the test module .test_cli")],
            id="from-relative-test",
        ),
        pytest.param(
            "from . import test_cli\n", [(1, "the test module test_cli")], id="from-dot-import-test"
        ),
        pytest.param(
            "def f():\n    import test_x\n", [(2, "the test module test_x")], id="lazy-import-test"
        ),
        pytest.param(
            "import importlib\nimportlib.import_module('test_x')\n",
            [(2, "test_x (import_module)")],
            id="import_module",
        ),
        pytest.param(
            "m = __import__('tests.test_x')\n", [(1, "tests.test_x (__import__)")], id="__import__"
        ),
    ],
)
def test_each_way_is_found_at_its_line(source, expected):
    findings = layout_findings(source, "tests/x/test_y.py")
    assert len(findings) == len(expected), findings
    for finding, (line, what) in zip(findings, expected, strict=True):
        assert finding.startswith(f"tests/x/test_y.py:{line}: "), finding
        assert what in finding and finding.endswith(FIX), finding


def test_near_misses_are_not_findings():
    source = textwrap.dedent(
        """
        import os
        import sys
        from pathlib import Path
        import pytest
        from mizzen_ci.registry import testing_helpers
        from hypothesis import strategies

        print(sys.path, sys.path[0])            # reading the path is fine
        paths = []
        paths.append(Path("x"))                 # another list
        os.path.join("a", "b")
        env = {"PYTHONPATH": "ci/src"}          # a subprocess's path, not this process's
        doc = "sys.path.insert and spec_from_file_location in a string"
        # import test_other  (a comment)
        __import__("json")
        """
    )
    assert layout_findings(source, "tests/x/test_y.py") == []
