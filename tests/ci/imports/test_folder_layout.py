"""Inside every workspace package, folders never import each other in a circle and no private
name crosses a folder (DESIGN.md, "Dependency direction"), lazy imports included: the rules of
:mod:`mizzen_ci.imports.folders` over the repository, and the checker itself on a planted tree.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.imports import ImportGraph, workspace_source_dirs
from mizzen_ci.imports.folders import check_package, package_roots

register_cpu_ci(est_time=10, labels=["ci"])

REPO = Path(__file__).resolve().parents[3]
PACKAGES = {"mizzen_ci", "mizzen_train", "mizzen_rollout", "mizzen_plugins"}
ROOTS = package_roots(workspace_source_dirs(REPO))


def test_every_workspace_package_is_checked():
    assert {package for _, package in ROOTS} >= PACKAGES


@pytest.mark.parametrize(("source_dir", "package"), ROOTS, ids=[p for _, p in ROOTS])
def test_no_folder_cycle_and_no_private_crossing(source_dir: Path, package: str):
    findings = check_package(ImportGraph.build(REPO, [source_dir]), package)
    assert not findings, "\n" + "\n".join(str(f) for f in findings)


PLANTED = {
    "__init__.py": "",
    "cli.py": "from .a import run\nfrom .b import go\n",  # a root module over every folder
    "shared.py": "VALUE = 1\n",
    "a/__init__.py": "from .run import run\n",
    "a/run.py": (
        "from ..shared import VALUE\n"
        "from .helper import _inner\n"  # a private name inside its own folder: fine
        "\n\ndef run():\n    from ..b.go import go  # lazy\n    return go() + VALUE + _inner\n"
    ),
    "a/helper.py": "_inner = 1\n",
    "b/__init__.py": "",
    "b/go.py": (
        "from typing import TYPE_CHECKING\n\n"
        "from pkg.a.helper import _inner\n"
        "from pkg.b import __all__ as names\n"  # a dunder: no private name
        "\nif TYPE_CHECKING:\n    from pkg.a.run import run\n\n\ndef go():\n    return _inner\n"
    ),
    "c/__init__.py": "",
    "c/d/__init__.py": "",
    "c/e.py": "import pkg.c.d._hidden\n",
    "c/d/_hidden.py": "",
}


def planted(tmp_path: Path, files: dict[str, str]) -> list[str]:
    for rel, text in files.items():
        path = tmp_path / "src" / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    graph = ImportGraph.build(tmp_path, [tmp_path / "src"])
    return [str(f) for f in check_package(graph, "pkg")]


def test_the_checker_flags_a_cycle_with_its_imports_and_private_crossings(tmp_path):
    found = planted(tmp_path, PLANTED)
    run, go, e = "src/pkg/a/run.py", "src/pkg/b/go.py", "src/pkg/c/e.py"
    assert found[0] == (
        f"{run}:6: [folder-cycle] folders of pkg import each other in a circle: a -> b -> a "
        f"({run}:6 imports pkg.b.go; {go}:3 imports pkg.a.helper); the circle's component is "
        "{a, b}. Fix: move what the folders share into a module or folder that both import (it "
        "imports neither), or dispatch from a root module above them, so that the imports go "
        "one way"
    )
    assert found[1:] == [
        f"{go}:3: [private-crossing] folder b imports _inner from pkg.a.helper (folder a): a "
        "private name crosses a folder. Fix: make the name public API of its folder (no "
        "underscore, documented), or move it to a module both folders import",
        f"{e}:1: [private-crossing] folder c imports module _hidden from pkg.c.d._hidden "
        "(folder c/d): a private name crosses a folder. Fix: make the name public API of its "
        "folder (no underscore, documented), or move it to a module both folders import",
    ]
    assert not any(f.startswith("src/pkg/cli.py") for f in found)  # a root module is its node


def test_lazy_and_type_checking_imports_alone_make_a_cycle(tmp_path):
    files = dict(PLANTED, **{"b/go.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                             "    from pkg.a.run import run\n"})  # fmt: skip
    del files["c/e.py"]
    (cycle,) = planted(tmp_path, files)
    assert "a -> b -> a" in cycle and "src/pkg/b/go.py:4 imports pkg.a.run" in cycle


def test_one_way_imports_pass(tmp_path):
    files = dict(PLANTED, **{"b/go.py": "def go():\n    return 1\n"})
    files["c/e.py"] = "import pkg.c.d\n"
    assert planted(tmp_path, files) == []
