"""Selection may use what it saw (issue 34, opt-in): with ``[tool.mizzen.plan]
observed-selection = true`` the plan adds the tests that executed a changed file at the base
revision (the execution store of its history folder), a union with the import graph's selection,
never an intersection; off by default; a bad setting is one error naming the key."""

from __future__ import annotations

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.history_execution import Executed, replace_revision
from mizzen_ci.plan.pipeline import PlanOptions
from mizzen_ci.sources import ConfigError

register_cpu_ci(est_time=8, labels=["ci"])

REG = "from mizzen_ci import register_cpu_ci\n\nregister_cpu_ci(est_time=5, labels=['ci'])\n"
PYPROJECT = (
    '[project]\nname = "ws"\nversion = "0"\n\n[tool.uv.workspace]\nmembers = ["packages/alpha"]\n'
)
FILES = {
    "packages/alpha/pyproject.toml": '[project]\nname = "alpha"\nversion = "0"\n',
    "packages/alpha/src/alpha/__init__.py": "",
    "packages/alpha/src/alpha/core.py": "X = 1\n",
    "packages/alpha/src/alpha/hidden.py": "def answer():\n    return 42\n",
    # reaches alpha.hidden only through a pickle (no import, string or path names it)
    "tests/alpha/test_pickled.py": "import pickle\n"
    + REG
    + "\ndef test_x():\n    pickle.loads(b'')\n",
    "tests/alpha/test_core.py": "from alpha.core import X\n"
    + REG
    + "\ndef test_x():\n    assert X\n",
}


def _plan_tests(ws, history) -> dict[str, str]:
    plan = ws.plan(options=PlanOptions(history=(history,)))
    return {t["file"]: t["why"] for j in plan["jobs"] for t in j["tests"]}


@pytest.mark.parametrize("setting", ["", "observed-selection = false\n"])
def test_off_by_default_the_observed_test_is_not_added(workspace, tmp_path, setting):
    ws = workspace({"pyproject.toml": PYPROJECT + "\n[tool.mizzen.plan]\n" + setting, **FILES})
    _observed(ws, tmp_path, "packages/alpha/src/alpha/hidden.py")
    ws.write({"packages/alpha/src/alpha/hidden.py": "def answer():\n    return 41\n"})
    ws.commit()
    assert "tests/alpha/test_pickled.py" not in _plan_tests(ws, tmp_path)


def test_opted_in_the_union_adds_what_ran_at_the_base_and_keeps_the_graph(workspace, tmp_path):
    pyproject = PYPROJECT + "\n[tool.mizzen.plan]\nobserved-selection = true\n"
    ws = workspace({"pyproject.toml": pyproject, **FILES})
    _observed(ws, tmp_path, "packages/alpha/src/alpha/hidden.py")
    ws.write({"packages/alpha/src/alpha/hidden.py": "def answer():\n    return 41\n",
              "packages/alpha/src/alpha/core.py": "X = 2\n"})  # fmt: skip
    ws.commit()
    tests = _plan_tests(ws, tmp_path)
    base = ws.git("rev-parse", "main")
    assert tests["tests/alpha/test_pickled.py"] == (
        f"executed packages/alpha/src/alpha/hidden.py at the base revision {base[:12]} "
        "(observed selection, execution.sqlite)"
    )
    # the graph's selection stays: no test was observed executing core.py (never an intersection)
    assert "tests/alpha/test_core.py" in tests
    assert "observed selection" not in tests["tests/alpha/test_core.py"]


def test_rows_of_another_revision_add_nothing(workspace, tmp_path):
    pyproject = PYPROJECT + "\n[tool.mizzen.plan]\nobserved-selection = true\n"
    ws = workspace({"pyproject.toml": pyproject, **FILES})
    _observed(ws, tmp_path, "packages/alpha/src/alpha/hidden.py", revision="b" * 40)
    ws.write({"packages/alpha/src/alpha/hidden.py": "def answer():\n    return 41\n"})
    ws.commit()
    assert "tests/alpha/test_pickled.py" not in _plan_tests(ws, tmp_path)


def test_a_setting_that_is_no_boolean_is_one_error_naming_the_key(workspace, tmp_path):
    ws = workspace({"pyproject.toml": PYPROJECT + '\n[tool.mizzen.plan]\nobserved-selection = "yes"\n',
                    **FILES})  # fmt: skip
    ws.write({"packages/alpha/src/alpha/hidden.py": "def answer():\n    return 41\n"})
    ws.commit()
    with pytest.raises(ConfigError, match=r"observed-selection must be true or false, got 'yes'"):
        _plan_tests(ws, tmp_path)


def _observed(ws, history, path: str, revision: str | None = None) -> None:
    revision = revision or ws.git("rev-parse", "main")
    row = Executed(revision, "tests/alpha/test_pickled.py::test_x", path)
    replace_revision(history / "execution.sqlite", revision, [row])
