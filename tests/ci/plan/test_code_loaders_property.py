"""Never under-plan, as a property: in generated workspaces a test loads a module through a random
one of the mechanisms the planner reads (an import, an entry point of a plugin group or of
``pytest11``, ``python -c`` / ``python -m`` in a list or a shell string, a console script, a
``sys.path`` helper folder, a module over the size cap on the way), from a random place (the test,
a helper beside it, its folder's conftest); every change to the loaded module, or to what it
imports, selects the test.  Each mechanism is mutation-checked: with it switched off, the
property fails on the same workspaces.
"""

from __future__ import annotations

import shutil
import tempfile
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mizzen_ci import register_cpu_ci
from mizzen_ci.fleet import load_fleet
from mizzen_ci.plan.change import Change, Entry
from mizzen_ci.plan.impact import Analyser
from mizzen_ci.plan.index import build_index

register_cpu_ci(est_time=60, labels=["ci"])

REPO = Path(__file__).resolve().parents[3]
REG = "\nfrom mizzen_ci import register_cpu_ci\n\nregister_cpu_ci(est_time=5, labels=['ci'])\n"
CAP = 8 * 1024 * 1024

MECHANISMS = (
    "import",
    "group",
    "pytest11",
    "python-c",
    "python-m",
    "shell-m",
    "script",
    "syspath",
    "oversized",
)


def loader_code(mechanism: str, target: str) -> str:
    """Python code that loads ``target`` through ``mechanism``."""
    return {
        "import": f"import {target}\n",
        "group": "import p.loader\n",
        "pytest11": "",
        "python-c": (
            "import subprocess\nimport sys\n\n\ndef run():\n"
            f"    subprocess.run([sys.executable, '-c', 'import {target}'], check=True)\n"
        ),
        "python-m": (
            "import subprocess as sp\nimport sys\n\nCMD = [sys.executable, '-u', '-m', "
            f"'{target}']\n\n\ndef run():\n    sp.check_call(CMD)\n"
        ),
        "shell-m": f"import os\n\n\ndef run():\n    os.system('python3 -m {target} --x')\n",
        "script": "from subprocess import run as go\n\n\ndef run():\n    go(['p-tool', 'x'])\n",
        "syspath": (
            "import sys\nfrom pathlib import Path\n\n"
            "sys.path.insert(0, str(Path(__file__).resolve().parents[1] / 'shared'))\n"
            "import hmod\n"
        ),
        "oversized": "import p.big\n",
    }[mechanism]


def make(root: Path, mechanism: str, place: str, depth: int, noise: int) -> tuple[str, list[str]]:
    """A workspace under ``root``; ``(the test that loads the module, the paths to change)``."""
    chain = [f"p.m{i}" for i in range(depth)]  # target imports m0, m0 imports m1, ...
    files = {
        "pyproject.toml": '[tool.uv.workspace]\nmembers = ["packages/*"]\n',
        "packages/p/src/p/__init__.py": "",
        "packages/p/src/p/target.py": (f"import {chain[0]}\n" if chain else "")
        + "\n\ndef main():\n    return 0\n",
        "packages/p/src/p/loader.py": (
            "import importlib.metadata as md\n\nGROUP = 'ws.models'\n\n\n"
            "def load():\n    return [e.load() for e in md.entry_points(group=GROUP)]\n"
        ),
        "tests/shared/hmod.py": "import p.target\n",
    }
    for i, m in enumerate(chain):
        nxt = f"import {chain[i + 1]}\n" if i + 1 < len(chain) else ""
        files[f"packages/p/src/{m.replace('.', '/')}.py"] = nxt
    pyproject = '[project]\nname = "p"\nversion = "0"\n'
    if mechanism == "script":
        pyproject += '\n[project.scripts]\np-tool = "p.target:main"\n'
    if mechanism == "group":
        pyproject += '\n[project.entry-points."ws.models"]\nfirst = "p.target:main"\n'
    if mechanism == "pytest11":
        pyproject += '\n[project.entry-points.pytest11]\np = "p.target"\n'
    files["packages/p/pyproject.toml"] = pyproject
    for k in range(noise):  # other modules and tests that load nothing of the target
        files[f"packages/p/src/p/n{k}.py"] = ""
        files[f"tests/noise/test_n{k}.py"] = f"import p.n{k}\n" + REG
    test = "tests/case/test_case.py"
    code = loader_code(mechanism, "p.target")
    if place == "test":
        files[test] = code + REG
    elif place == "helper":
        files["tests/case/helper_case.py"] = code
        files[test] = "import helper_case\n" + REG
    else:  # the folder's conftest
        files["tests/case/conftest.py"] = code
        files[test] = "def test_it():\n    pass\n" + REG
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    if mechanism == "oversized":
        line = "import p.target\n" + "#" * 100 + "\n"
        (root / "packages/p/src/p/big.py").write_text(line * (CAP // len(line) + 2))
    (root / "ci").mkdir(exist_ok=True)
    shutil.copy(REPO / "ci" / "fleet.toml", root / "ci" / "fleet.toml")
    changes = ["packages/p/src/p/target.py"] + [
        f"packages/p/src/{m.replace('.', '/')}.py" for m in chain
    ]
    return test, changes


def missed(root: Path, test: str, changes: list[str]) -> list[str]:
    """The changes that do not select ``test``."""
    index = build_index(root, load_fleet(root / "ci" / "fleet.toml"), None, save=False)
    analyser = Analyser.of_index(index)
    out = []
    for path in changes:
        impact = analyser.analyse(Change.from_entries("a" * 40, "b" * 40, [Entry("M", path)]))
        if not impact.everything and test not in impact.tests:
            out.append(path)
    return out


WORKSPACES = st.tuples(
    st.sampled_from(MECHANISMS),
    st.sampled_from(["test", "helper", "conftest"]),
    st.integers(0, 3),
    st.integers(0, 3),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(WORKSPACES)
def test_any_change_to_a_loaded_module_plans_the_test(case):
    mechanism, place, depth, noise = case
    with tempfile.TemporaryDirectory() as d:
        test, changes = make(Path(d), mechanism, place, depth, noise)
        assert missed(Path(d), test, changes) == [], case


# ---- mutation checks: each mechanism switched off, the same workspaces miss


def _no_virtual(self, module):
    return []


def _no_syspath(self, file):
    return []


def _no_opaque(self):
    return {}


def _off(self, *args, **kwargs):
    return None


MUTATIONS = ("group", "script", "pytest11", "python-c", "python-m", "shell-m", "syspath",
             "oversized")  # fmt: skip


def mutations(loaders) -> dict[str, list[tuple]]:
    """Per mechanism, what switches it off (``loaders``: :mod:`mizzen_ci.imports.loaders`)."""
    return {
        "group": [(Analyser, "virtual_importers", _no_virtual)],
        "script": [(Analyser, "virtual_importers", _no_virtual)],
        "pytest11": [(Analyser, "virtual_importers", _no_virtual)],
        "python-c": [(loaders._Commands, "code", _off)],
        "python-m": [(loaders._Commands, "module", _off)],
        "shell-m": [(loaders._Commands, "shell", _off)],
        "syspath": [(Analyser, "through_syspath", _no_syspath)],
        "oversized": [(Analyser, "opaque_nodes", _no_opaque)],
    }


@pytest.mark.parametrize("mechanism", sorted(MUTATIONS))
def test_switching_a_mechanism_off_breaks_the_property(mechanism, monkeypatch, tmp_path):
    from mizzen_ci.imports import loaders

    for owner, name, replacement in mutations(loaders)[mechanism]:
        monkeypatch.setattr(owner, name, replacement)
    if mechanism == "python-m":  # (the import facts read `-m` in lists themselves too)
        from mizzen_ci.imports import facts

        monkeypatch.setattr(facts._Dynamic, "_python_m", lambda self, *a: None)
    test, changes = make(tmp_path, mechanism, "test", 1, 1)
    assert missed(tmp_path, test, changes) != []
