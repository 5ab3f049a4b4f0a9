"""Never under-plan code that is loaded without an import statement (issue 31, mechanism 3).

Each case is a workspace (a real git repository in a temporary folder, planned through
:func:`mizzen_ci.plan.pipeline.build_plan` as ``mizzen-ci plan`` does) in which a test loads a
module through one of the mechanisms :mod:`mizzen_ci.imports.loaders` reads, and a change to that
module must select the test, with a reason that names the change (or, for what cannot be
resolved, ``runs code the planner cannot resolve: file:line``):

- entry points: a ``pytest11`` target (and a ``-p`` plugin of pytest's ``addopts``) is loaded by
  every pytest session: a change it reaches plans every test; a plugin group's targets are
  dependencies of the code that calls ``entry_points(group=...)``;
- subprocesses: ``python -c 'import ...'``, ``python -m`` in a shell string, a console script
  mapped through ``[project.scripts]``, a command built by a helper of the same file, ``-c`` code
  a helper takes from its callers; a command the planner cannot evaluate fails open for its file;
- a module named by a loader spec string (``"pkg.mod:func"``; a bare dotted string is none);
- ``sys.path`` edits with ``__file__``-relative folders (also one made by a conftest, which holds
  for the whole session); an edit it cannot evaluate fails open; pytest's ``tmp_path`` holds no
  file of the repository;
- a module over the size cap: its dependents fail open, its edges are never dropped;
- ``pytest_plugins`` of a conftest, and a dynamic import through an alias chain of any length.

Every case but the last two of the precision checks selected nothing, or missed the test, on
10bec9e (``PYTHONPATH=/tmp/baseline/ci/src``).
"""

from __future__ import annotations

import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.fleet import load_fleet
from mizzen_ci.plan.change import Change, Entry
from mizzen_ci.plan.pipeline import PlanOptions, build_plan
from mizzen_ci.plan.request import Inputs

register_cpu_ci(est_time=20, labels=["ci"])

REPO = Path(__file__).resolve().parents[3]
REG = "\nfrom mizzen_ci import register_cpu_ci\n\nregister_cpu_ci(est_time=5, labels=['ci'])\n"
CAP = 8 * 1024 * 1024  # mizzen_ci.sources.MAX_SOURCE_BYTES

FILES = {
    "pyproject.toml": """\
        [project]
        name = "ws"
        version = "0"

        [tool.uv.workspace]
        members = ["packages/alpha", "packages/beta", "packages/hub"]

        [tool.pytest.ini_options]
        addopts = ["-ra", "-p", "beta.session_plugin"]
        """,
    "packages/alpha/pyproject.toml": """\
        [project]
        name = "alpha"
        version = "0"

        [project.scripts]
        alpha-cli = "alpha.cli:main"

        [project.entry-points.pytest11]
        alpha = "alpha.pytest_plugin"

        [project.entry-points."ws.models"]
        first = "alpha.models.first:MODEL"
        """,
    "packages/alpha/src/alpha/__init__.py": "",
    "packages/alpha/src/alpha/cli.py": "from alpha import engine\n\ndef main():\n    engine.go()\n",
    "packages/alpha/src/alpha/engine.py": "def go():\n    return 1\n",
    "packages/alpha/src/alpha/pytest_plugin.py": "from alpha import fixtures_impl\n",
    "packages/alpha/src/alpha/fixtures_impl.py": "X = 1\n",
    "packages/alpha/src/alpha/models/__init__.py": "",
    "packages/alpha/src/alpha/models/first.py": "from alpha.models import layers\nMODEL = 1\n",
    "packages/alpha/src/alpha/models/layers.py": "Y = 2\n",
    "packages/alpha/src/alpha/by_c.py": "Z = 3\n",
    "packages/alpha/src/alpha/by_shell.py": "",
    "packages/alpha/src/alpha/deep.py": "W = 4\n",
    "packages/alpha/src/alpha/behind_big.py": "V = 5\n",
    "packages/alpha/src/alpha/fixtures.py": "import pytest\n",
    "packages/alpha/src/alpha/aliased.py": "",
    "packages/beta/pyproject.toml": '[project]\nname = "beta"\nversion = "0"\n',
    "packages/beta/src/beta/__init__.py": "",
    "packages/beta/src/beta/other.py": "A = 1\n",
    "packages/beta/src/beta/session_plugin.py": "from beta import session_impl\n",
    "packages/beta/src/beta/session_impl.py": "",
    "packages/hub/pyproject.toml": '[project]\nname = "hub"\nversion = "0"\n',
    "packages/hub/src/hub/__init__.py": "",
    "packages/hub/src/hub/discovery.py": """\
        import importlib.metadata

        GROUP = "ws.models"


        def models():
            return [ep.load() for ep in importlib.metadata.entry_points(group=GROUP)]
        """,
    # -- tests
    "tests/beta/test_plain.py": "import beta.other\n",
    "tests/hub/test_discovery.py": "import hub.discovery\n",
    "tests/runs/test_python_c.py": """\
        import subprocess
        import sys


        def test_it():
            subprocess.run([sys.executable, "-c", "import alpha.by_c"], check=True)
        """,
    "tests/runs/test_shell_m.py": """\
        import os


        def test_it():
            assert os.system("cd /tmp && python3 -m alpha.by_shell --help") == 0
        """,
    "tests/runs/test_console_script.py": """\
        import subprocess


        def test_it():
            subprocess.run(["alpha-cli", "--verbose"], check=True)
        """,
    "tests/runs/test_built_command.py": """\
        import subprocess
        import sys


        def command(*argv, isolated=False):
            return [sys.executable, *(("-I",) if isolated else ()), *argv]


        def run(*argv):
            return subprocess.run(command(*argv), check=True)


        def test_it():
            run("-m", "alpha.deep")
        """,
    "tests/runs/test_code_helper.py": """\
        import subprocess
        import sys
        import textwrap

        PROBE = '''
        import json
        import alpha.by_helper_c
        '''


        def run_python(code, *, flags=()):
            return subprocess.run([sys.executable, *flags, "-c", textwrap.dedent(code)])


        def test_it():
            run_python(PROBE + "print(json.dumps(1))", flags=("-I",))
        """,
    "tests/runs/test_module_spec.py": """\
        CONFIG = {"reward": "alpha.rewards:score", "data": "data.jsonl"}
        """,
    "packages/alpha/src/alpha/by_helper_c.py": "",
    "packages/alpha/src/alpha/rewards.py": "def score():\n    return 1\n",
    "tests/runs/test_opaque_command.py": """\
        import subprocess


        def test_it(program_from_somewhere):
            subprocess.run(program_from_somewhere(), check=True)
        """,
    "tests/paths/test_sys_path.py": """\
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).parents[1] / "shared_helpers"))

        import helper_mod
        """,
    "tests/shared_helpers/helper_mod.py": "import alpha.deep\n",
    "tests/session/conftest.py": """\
        import os
        import sys

        HERE = os.path.dirname(os.path.abspath(__file__))
        sys.path.append(os.path.join(HERE, "..", "vendored"))
        """,
    "tests/late/test_uses_session_path.py": "import vendored_mod\n",
    "tests/vendored/vendored_mod.py": "import beta.other\n",
    "tests/paths/test_opaque_sys_path.py": """\
        import os
        import sys

        sys.path.insert(0, os.environ["SOMEWHERE"])
        """,
    "tests/paths/test_tmp_sys_path.py": """\
        def test_it(tmp_path, monkeypatch):
            (tmp_path / "scratch.py").write_text("")
            monkeypatch.syspath_prepend(str(tmp_path))
        """,
    "tests/big/test_big.py": "import alpha.big\n",
    "tests/fixt/conftest.py": 'pytest_plugins = ["alpha.fixtures"]\n',
    "tests/fixt/test_uses_fixture.py": "def test_it():\n    pass\n",
    "tests/dyn/test_alias_chain.py": """\
        import importlib

        load = d.import_module  # (bound below, deeper: a chain read in the wrong order)


        def one():
            d = c

            def two():
                c = b

                def three():
                    b = a

                    def four():
                        a = importlib


        load("alpha.aliased")
        """,
}


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("code-loaders") / "ws"
    for rel, text in FILES.items():
        text = textwrap.dedent(text)
        if rel.rpartition("/")[2].startswith("test_"):
            text += REG
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    big = "import alpha.behind_big\n" + "#" * 80 + "\n"
    (root / "packages/alpha/src/alpha/big.py").write_text(big * (CAP // len(big) + 2))
    (root / "ci").mkdir()
    shutil.copy(REPO / "ci" / "fleet.toml", root / "ci" / "fleet.toml")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(root)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "workspace"], check=True)
    return root


def all_tests(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in (root / "tests").rglob("test_*.py")}


# ---- 1. entry points


def test_a_module_a_pytest11_target_reaches_plans_every_test(ws, selected):
    got = selected(ws, "packages/alpha/src/alpha/fixtures_impl.py")
    assert set(got) == all_tests(ws)
    why = got["tests/beta/test_plain.py"]
    assert "reaches alpha.fixtures_impl" in why and "pytest loads it in every session" in why
    assert "entry point alpha of [project.entry-points.pytest11]" in why


def test_a_plugin_of_pytest_addopts_plans_every_test(ws, selected):
    got = selected(ws, "packages/beta/src/beta/session_impl.py")
    assert set(got) == all_tests(ws)
    assert (
        "-p beta.session_plugin in [tool.pytest.ini_options] addopts"
        in got["tests/hub/test_discovery.py"]
    )


def test_a_plugin_groups_targets_are_dependencies_of_its_loader(ws, selected):
    got = selected(ws, "packages/alpha/src/alpha/models/layers.py")
    assert got["tests/hub/test_discovery.py"] == (
        "reaches alpha.models.layers (packages/alpha/src/alpha/models/layers.py changed)"
    )
    assert "tests/beta/test_plain.py" not in got  # exact: not every test


def test_a_change_to_an_entry_point_table_plans_everything(ws):
    change = Change.from_entries("a" * 40, "b" * 40, [Entry("M", "packages/alpha/pyproject.toml")])
    plan = build_plan(ws, load_fleet(ws / "ci" / "fleet.toml"), change, Inputs(), PlanOptions())
    assert plan.to_json()["selection"]["everything"]


# ---- 2. subprocesses


def test_python_c_code_is_an_import_of_its_runner(ws, selected):
    got = selected(ws, "packages/alpha/src/alpha/by_c.py")
    assert got["tests/runs/test_python_c.py"] == (
        "reaches alpha.by_c (packages/alpha/src/alpha/by_c.py changed)"
    )


def test_python_m_in_a_shell_string(ws, selected):
    got = selected(ws, "packages/alpha/src/alpha/by_shell.py")
    assert "tests/runs/test_shell_m.py" in got


def test_a_console_script_runs_its_module_and_what_it_imports(ws, selected):
    got = selected(ws, "packages/alpha/src/alpha/engine.py")
    assert got["tests/runs/test_console_script.py"] == (
        "reaches alpha.engine (packages/alpha/src/alpha/engine.py changed)"
    )


def test_a_command_built_by_a_helper_of_the_same_file(ws, selected):
    got = selected(ws, "packages/alpha/src/alpha/deep.py")
    assert "tests/runs/test_built_command.py" in got


def test_python_c_code_a_helper_takes_from_its_callers(ws, selected):
    """``run_python(code)`` runs ``[sys.executable, *flags, "-c", textwrap.dedent(code)]``: the
    callers pass the code alone (tests/plugins/test_discovery.py; missed before: the options
    splice ended the command's reading, and a parameter's code was never looked for)."""
    got = selected(ws, "packages/alpha/src/alpha/by_helper_c.py")
    assert got["tests/runs/test_code_helper.py"] == (
        "reaches alpha.by_helper_c (packages/alpha/src/alpha/by_helper_c.py changed)"
    )


def test_a_module_named_by_a_loader_spec_string(ws, selected):
    """``"alpha.rewards:score"`` in a run's configuration (the RL toy rewards of the train
    tests: missed before, no import names the module)."""
    got = selected(ws, "packages/alpha/src/alpha/rewards.py")
    assert "tests/runs/test_module_spec.py" in got
    assert "tests/beta/test_plain.py" not in got  # exact: not every test


def test_a_command_the_planner_cannot_evaluate_fails_open_for_its_file(ws, selected):
    got = selected(ws, "packages/beta/src/beta/other.py")
    assert got["tests/runs/test_opaque_command.py"] == (
        "runs code the planner cannot resolve: tests/runs/test_opaque_command.py:5 "
        "(runs a program the planner cannot resolve)"
    )
    # and not on a change that is no source: documentation selects nothing
    (ws / "docs").mkdir(exist_ok=True)
    assert "tests/runs/test_opaque_command.py" not in selected(ws, "docs/guide.md")


# ---- 3. sys.path


def test_an_import_through_a_sys_path_folder(ws, selected):
    got = selected(ws, "tests/shared_helpers/helper_mod.py")
    assert got["tests/paths/test_sys_path.py"] == (
        "reaches tests/shared_helpers/helper_mod.py (tests/shared_helpers/helper_mod.py changed)"
    )
    assert "tests/paths/test_sys_path.py" in selected(ws, "packages/alpha/src/alpha/deep.py")


def test_a_conftests_sys_path_folder_holds_for_the_whole_session(ws, selected):
    got = selected(ws, "tests/vendored/vendored_mod.py")
    assert "tests/late/test_uses_session_path.py" in got


def test_a_sys_path_edit_the_planner_cannot_evaluate_fails_open(ws, selected):
    got = selected(ws, "packages/beta/src/beta/other.py")
    assert got["tests/paths/test_opaque_sys_path.py"] == (
        "runs code the planner cannot resolve: tests/paths/test_opaque_sys_path.py:4 "
        "(adds to sys.path a folder the planner cannot resolve)"
    )


def test_pytests_temporary_folder_on_sys_path_is_no_dependency(ws, selected):
    assert "tests/paths/test_tmp_sys_path.py" not in selected(ws, "packages/beta/src/beta/other.py")


# ---- 4. size caps, pytest_plugins, alias chains


def test_a_module_over_the_size_cap_makes_its_dependents_fail_open(ws, selected):
    got = selected(ws, "packages/alpha/src/alpha/behind_big.py")
    why = got["tests/big/test_big.py"]
    assert why.startswith(
        "runs code the planner cannot resolve: packages/alpha/src/alpha/big.py:1 (cannot be read ("
    ), why
    assert "over the 8.0 MiB" in why


def test_pytest_plugins_of_a_conftest_are_imports(ws, selected):
    got = selected(ws, "packages/alpha/src/alpha/fixtures.py")
    assert got["tests/fixt/test_uses_fixture.py"] == (
        "tests/fixt/conftest.py reaches alpha.fixtures (packages/alpha/src/alpha/fixtures.py changed)"
    )


def test_a_dynamic_import_through_an_alias_chain_of_any_length(ws, selected):
    got = selected(ws, "packages/alpha/src/alpha/aliased.py")
    assert "tests/dyn/test_alias_chain.py" in got


# ---- precision: the new edges stay exact where they can


def test_a_plain_module_selects_only_its_own_importers_and_the_fail_open_files(ws, selected):
    got = selected(ws, "packages/alpha/src/alpha/by_c.py")
    assert set(got) == {
        "tests/runs/test_python_c.py",
        "tests/runs/test_opaque_command.py",  # fails open: any source change
        "tests/paths/test_opaque_sys_path.py",
        "tests/big/test_big.py",  # behind a module over the size cap: fails open too
    }
