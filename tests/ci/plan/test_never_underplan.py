"""Never under-plan: changes the import graph alone does not connect to the tests they break.

Each test plans one change (through :func:`mizzen_ci.plan.pipeline.build_plan`, as ``mizzen-ci
plan`` does) and asserts that the tests whose run observes the changed file are selected, with a
reason that names the change.  Every one of them selected nothing, or missed those tests, before
the planner knew these dependencies:

- a non-Python file under ``tests/`` (``**/*.md`` was documentation even there) and a file a test
  names by a path literal from another directory;
- a package's ``__main__.py`` (``python -m pkg`` in a subprocess) and its entry-point modules;
- dependencies only a registration can declare (``watches``: the lazy-import policy tests);
- dynamic imports through aliases, ``pytest.importorskip``, relative names with a literal
  package, and computed names (fail open);
- helpers loaded by path (``spec_from_file_location``), a worker script importing its sibling,
  a test file imported by another one through ``sys.path``;
- and, found on the way, a README a test reads and a package module naming another package's
  data file.

The same attacks on this repository itself close the file.
"""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.fleet import load_fleet
from mizzen_ci.plan.change import Change, Entry
from mizzen_ci.plan.pipeline import PlanOptions, build_plan
from mizzen_ci.plan.request import Inputs

register_cpu_ci(est_time=15, labels=["ci"])

REPO = Path(__file__).resolve().parents[3]
CPU = (
    "\nfrom mizzen_ci import register_cpu_ci\n\nregister_cpu_ci(est_time=5, labels=['ci']{extra})\n"
)

FILES = {
    "pyproject.toml": (
        '[project]\nname = "ws"\nversion = "0"\n\n'
        '[tool.uv.workspace]\nmembers = ["packages/alpha", "packages/beta"]\n'
    ),
    "README.md": "# workspace\n",
    "docs/guide.md": "a guide\n",
    "packages/alpha/pyproject.toml": """\
        [project]
        name = "alpha"
        version = "0"

        [project.scripts]
        alpha-cli = "alpha.cli:main"

        [project.entry-points."alpha.plugins"]
        first = "alpha.plugin:PLUGIN"
        """,
    "packages/alpha/src/alpha/__init__.py": "",
    "packages/alpha/src/alpha/__main__.py": "from alpha.cli import main\n\nmain()\n",
    "packages/alpha/src/alpha/cli.py": "def main():\n    return 0\n",
    "packages/alpha/src/alpha/plugin.py": "PLUGIN = object()\n",
    "packages/alpha/src/alpha/core.py": "def f():\n    return 1\n",
    "packages/alpha/src/alpha/reader.py": """\
        from pathlib import Path

        SCHEMA = Path(__file__).parents[3] / "beta/src/beta/data/schema.json"
        """,
    "packages/beta/pyproject.toml": '[project]\nname = "beta"\nversion = "0"\n',
    "packages/beta/src/beta/__init__.py": "",
    "packages/beta/src/beta/heavy.py": "def g():\n    return 2\n",
    "packages/beta/src/beta/other.py": "X = 1\n",
    "packages/beta/src/beta/plugins.py": """\
        import importlib


        def load(name):
            return importlib.import_module(f"beta.{name}")
        """,
    "packages/beta/src/beta/data/schema.json": "{}\n",
    "packages/beta/src/beta/loader.py": """\
        from pathlib import Path

        HEAVY = Path(__file__).with_name("heavy.py")  # run by path, never imported
        """,
    # -- tests
    "tests/alpha/test_core.py": "import alpha.core\n",
    "tests/alpha/test_reader.py": "import alpha.reader\n",
    "tests/alpha/test_cli_run.py": """\
        import subprocess
        import sys

        import alpha.core


        def test_cli():
            subprocess.run([sys.executable, "-m", "alpha"], check=True)
        """,
    "tests/runs/test_only_subprocess.py": """\
        import subprocess
        import sys


        def test_cli():
            subprocess.run([sys.executable, "-m", "alpha", "--help"], check=True)
        """,
    "tests/harbor/conftest.py": """\
        import importlib.util
        from pathlib import Path

        HERE = Path(__file__).resolve().parent


        def load_fake_engine():
            spec = importlib.util.spec_from_file_location("fake", HERE.parent / "shared" / "fake_engine.py")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        """,
    "tests/harbor/test_trials.py": """\
        from pathlib import Path

        TASKS = Path(__file__).parent / "tasks"
        """,
    "tests/harbor/tasks/greet/instruction.md": "Write a greeting.\n",
    "tests/shared/fake_engine.py": "import alpha.core\n",
    "tests/docs/test_task_text.py": """\
        from pathlib import Path

        TEXT = Path(__file__).parents[2] / "tests/harbor/tasks/greet/instruction.md"
        """,
    "tests/docs/test_readme.py": """\
        from pathlib import Path

        README = Path(__file__).parents[2] / "README.md"
        """,
    "tests/dyn/test_alias_module.py": """\
        import importlib as il


        def test_it():
            il.import_module("beta.other")
        """,
    "tests/dyn/test_alias_function.py": """\
        from importlib import import_module as load

        OTHER = load("beta.other")
        """,
    "tests/dyn/test_importorskip.py": """\
        import pytest

        other = pytest.importorskip("beta.other")
        """,
    "tests/dyn/test_relative_package.py": """\
        import importlib


        def test_it():
            importlib.import_module(".other", "beta")
        """,
    "tests/dyn/test_computed.py": """\
        import importlib

        import beta

        NAMES = ["other", "heavy"]


        def test_each():
            for n in NAMES:
                importlib.import_module(f"beta.{n}")
        """,
    "tests/dyn/test_computed_unnamed.py": """\
        import importlib
        import sys


        def test_it():
            importlib.import_module(sys.argv[-1])
        """,
    "tests/dyn/test_plugins.py": "import beta.plugins\n",
    "tests/multi/workers/kit.py": "import alpha.core\n",
    "tests/multi/workers/worker.py": "import kit\n\nkit.run = True\n",
    "tests/e2e/test_launch.py": """\
        import subprocess
        import sys
        from pathlib import Path

        WORKER = Path(__file__).parents[1] / "multi/workers/worker.py"


        def test_worker():
            subprocess.run([sys.executable, str(WORKER)], check=True)
        """,
    "tests/pair/test_base.py": "def shared_case():\n    return 1\n",
    "tests/pair/test_uses_base.py": """\
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).parent))
        from test_base import shared_case
        """,
    "tests/tools/test_loader.py": "import beta.loader\n",
    "tests/tools/test_writes_trees.py": """\
        def test_tree(tmp_path):
            (tmp_path / "pkg").mkdir()
            (tmp_path / "pkg" / "__init__.py").write_text("")
        """,
    "tests/tools/test_names_a_module_file.py": 'TARGET = "src/alpha/core.py"\n',
    "tests/policy/test_every_module.py": """\
        import subprocess
        import sys

        SCRIPT = "import pkgutil, importlib; ..."


        def test_every_module_imports():
            subprocess.run([sys.executable, "-c", SCRIPT], check=True)
        """,
}
REGISTER_EXTRA = {"tests/policy/test_every_module.py": ', watches=["packages/*/src/**/*.py"]'}


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("never-underplan") / "ws"
    for rel, text in FILES.items():
        text = textwrap.dedent(text)
        if rel.rpartition("/")[2].startswith("test_"):
            text += CPU.format(extra=REGISTER_EXTRA.get(rel, ""))
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (root / "ci").mkdir()
    shutil.copy(REPO / "ci" / "fleet.toml", root / "ci" / "fleet.toml")
    return root


def test_the_workspace_registers_without_errors(ws):
    change = Change.from_entries("a" * 40, "b" * 40, [Entry("M", "docs/guide.md")])
    plan = build_plan(ws, load_fleet(ws / "ci" / "fleet.toml"), change, Inputs(), PlanOptions())
    assert plan.errors == []  # `watches` is a registration field


# ---- 1. a non-Python file under tests/, and a file named by a path literal


def test_a_markdown_file_under_tests_is_test_data_not_documentation(ws, selected):
    got = selected(ws, "tests/harbor/tasks/greet/instruction.md")
    # the folder rule: the tests of the task's folder and of the folders above it
    assert got["tests/harbor/test_trials.py"] == "tests/harbor/tasks/greet/instruction.md changed"
    # and the test of another folder that names the file
    why = got["tests/docs/test_task_text.py"]
    assert why == "names tests/harbor/tasks/greet/instruction.md, which changed"


def test_documentation_still_selects_nothing_unless_a_test_reads_it(ws, selected):
    assert selected(ws, "docs/guide.md") == {}
    # (found on the way) a README a test reads by path
    assert set(selected(ws, "README.md")) == {"tests/docs/test_readme.py"}


def test_a_package_module_naming_another_packages_data_file(ws, selected):
    got = selected(ws, "packages/beta/src/beta/data/schema.json")
    # alpha.reader names beta's schema: its tests see the change (beta's own tests do anyway)
    assert "tests/alpha/test_reader.py" in got
    assert "tests/alpha/test_core.py" not in got  # alpha.core names nothing


def test_files_are_named_by_a_path_or_a_name_and_conventional_ones_only_beside(ws, selected):
    got = selected(ws, "packages/alpha/src/alpha/core.py")
    assert got["tests/tools/test_names_a_module_file.py"] == (
        "names packages/alpha/src/alpha/core.py, which changed"
    )
    got = selected(ws, "packages/beta/src/beta/heavy.py")
    assert got["tests/tools/test_loader.py"] == (
        "names packages/beta/src/beta/heavy.py, which changed"  # beta.loader, its neighbour
    )
    # code that writes other trees spells "__init__.py": it names no package of this one
    assert "tests/tools/test_writes_trees.py" not in selected(
        ws, "packages/alpha/src/alpha/__init__.py"
    )


# ---- 2. __main__ and entry points


def test_a_packages_main_selects_the_packages_tests(ws, selected):
    got = selected(ws, "packages/alpha/src/alpha/__main__.py")
    for test in ("tests/alpha/test_core.py", "tests/alpha/test_reader.py"):
        assert "`python -m alpha` runs it" in got[test], got[test]
    assert "tests/alpha/test_cli_run.py" in got
    # a test running `python -m alpha` without importing alpha imports its __main__ all the same
    assert "tests/runs/test_only_subprocess.py" in got
    assert "tests/dyn/test_plugins.py" not in got  # beta's tests do not run alpha


@pytest.mark.parametrize(
    ("path", "entry"),
    [
        ("packages/alpha/src/alpha/cli.py", "entry point alpha-cli of [project.scripts]"),
        (
            "packages/alpha/src/alpha/plugin.py",
            "entry point first of [project.entry-points.alpha.plugins]",
        ),
    ],
)
def test_an_entry_point_module_selects_the_packages_tests(ws, path, entry, selected):
    got = selected(ws, path)
    why = got["tests/alpha/test_core.py"]
    assert entry in why and "packages/alpha/pyproject.toml" in why, why
    assert {"tests/alpha/test_reader.py", "tests/alpha/test_cli_run.py"} <= set(got)


def test_a_plain_module_of_the_package_does_not_select_all_of_it(ws, selected):
    assert set(selected(ws, "packages/alpha/src/alpha/reader.py")) == {
        "tests/alpha/test_reader.py",
        "tests/policy/test_every_module.py",  # it watches every module
        "tests/dyn/test_computed_unnamed.py",  # it imports a computed name of any package
    }


# ---- 3. watches: what only the test can declare


def test_a_watched_glob_selects_the_policy_test_for_any_module_change(ws, selected):
    for path in ("packages/beta/src/beta/heavy.py", "packages/alpha/src/alpha/core.py"):
        got = selected(ws, path)
        assert got["tests/policy/test_every_module.py"] == (
            f"{path} changed (the test watches packages/*/src/**/*.py)"
        )
    assert "tests/policy/test_every_module.py" not in selected(ws, "tests/harbor/test_trials.py")


# ---- 4. dynamic imports


@pytest.mark.parametrize(
    "test",
    [
        "tests/dyn/test_alias_module.py",  # import importlib as il; il.import_module("beta.other")
        "tests/dyn/test_alias_function.py",  # from importlib import import_module as load
        "tests/dyn/test_importorskip.py",  # pytest.importorskip("beta.other")
        "tests/dyn/test_relative_package.py",  # import_module(".other", "beta")
    ],
)
def test_literal_dynamic_imports_are_imports(ws, test, selected):
    got = selected(ws, "packages/beta/src/beta/other.py")
    assert got[test] == "reaches beta.other (packages/beta/src/beta/other.py changed)"


def test_a_computed_import_fails_open_over_the_packages_it_names(ws, selected):
    got = selected(ws, "packages/beta/src/beta/heavy.py")
    assert "tests/dyn/test_computed.py" in got  # it imports beta.{n}: any module of beta
    assert "tests/dyn/test_computed_unnamed.py" in got  # it names no package: any of them
    assert "tests/dyn/test_alias_module.py" not in got  # a literal import stays exact
    got = selected(ws, "packages/alpha/src/alpha/core.py")
    assert "tests/dyn/test_computed_unnamed.py" in got
    assert "tests/dyn/test_computed.py" not in got  # it names beta only


def test_a_module_with_a_computed_import_is_impacted_by_its_whole_package(ws, selected):
    got = selected(ws, "packages/beta/src/beta/other.py")
    assert got["tests/dyn/test_plugins.py"] == (
        "reaches beta.other (packages/beta/src/beta/other.py changed)"
    )


# ---- 5. helpers shared by path and by sys.path


def test_a_helper_loaded_by_path_from_another_folder(ws, selected):
    got = selected(ws, "tests/shared/fake_engine.py")
    assert got["tests/harbor/test_trials.py"] == (
        "tests/harbor/conftest.py names tests/shared/fake_engine.py, which changed"
    )
    # and what the helper imports reaches the tests its loader serves
    got = selected(ws, "packages/alpha/src/alpha/core.py")
    assert "tests/harbor/test_trials.py" in got


def test_a_worker_script_importing_its_sibling(ws, selected):
    got = selected(ws, "tests/multi/workers/kit.py")
    # kit <- worker.py (`import kit`, its own directory) <- test_launch (runs the worker by path)
    assert (
        got["tests/e2e/test_launch.py"]
        == "reaches tests/multi/workers/kit.py (tests/multi/workers/kit.py changed)"
    )
    assert "tests/e2e/test_launch.py" in selected(ws, "packages/alpha/src/alpha/core.py")


def test_a_test_file_imported_by_another_through_sys_path(ws, selected):
    got = selected(ws, "tests/pair/test_base.py")
    assert got["tests/pair/test_base.py"] == "tests/pair/test_base.py changed"
    assert got["tests/pair/test_uses_base.py"] == (
        "reaches tests/pair/test_base.py (tests/pair/test_base.py changed)"
    )


# ---- the same attacks on this repository


@pytest.fixture(scope="module")
def repo_plan():
    fleet = load_fleet(REPO / "ci" / "fleet.toml")

    def plan(path: str) -> dict[str, str]:
        change = Change.from_entries("a" * 40, "b" * 40, [Entry("M", path)])
        data = build_plan(REPO, fleet, change, Inputs(), PlanOptions()).to_json()
        assert not data["selection"]["everything"]
        return {t["file"]: t["why"] for j in data["jobs"] for t in j["tests"]}

    return plan


def test_this_repository_harbor_task_data(repo_plan):
    got = repo_plan("tests/rollout/harbor/tasks/write-greeting/instruction.md")
    assert {
        "tests/rollout/harbor/test_e2e_trials.py",
        "tests/rollout/harbor/test_outcome.py",
        "tests/rollout/harbor/test_harbor_contract.py",
    } <= set(got)


def test_this_repository_rollout_main_selects_the_cli_test(repo_plan):
    got = repo_plan("packages/rollout/src/mizzen_rollout/__main__.py")
    # test_cli.py runs `python -m mizzen_rollout` (and imports only mizzen_rollout.samples)
    assert got["tests/rollout/test_cli.py"] == (
        "reaches mizzen_rollout.__main__ (packages/rollout/src/mizzen_rollout/__main__.py changed)"
    )
    assert "`python -m mizzen_rollout` runs it" in got["tests/rollout/test_samples.py"]


def test_this_repository_lazy_import_policy_tests_watch_every_module(repo_plan):
    got = repo_plan("packages/train/src/mizzen_train/lora.py")
    assert {
        "tests/rollout/test_lazy_imports.py",
        "tests/plugins/test_nemotron_h_lazy_imports.py",
        "tests/ci/lazy_imports/test_static.py",
        "tests/ci/lazy_imports/test_runtime.py",
    } <= set(got)
