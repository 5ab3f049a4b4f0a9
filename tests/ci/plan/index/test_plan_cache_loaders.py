"""The plan cache with the facts of code loaders (``sys.path`` folders, opaque marks, console
scripts and entry-point groups run, ``python -c`` imports): through edits that add, change and
remove each, and a module growing over the size cap and back, the warm index equals the index of
the fully built graph, and a cached plan equals the plan made without the cache.
"""

from __future__ import annotations

import os
import shutil
import textwrap
import time
from pathlib import Path

from mizzen_ci import register_cpu_ci
from mizzen_ci.fleet import load_fleet
from mizzen_ci.imports import ImportGraph, reach_of_graph, workspace_source_dirs
from mizzen_ci.plan.change import Change, Entry
from mizzen_ci.plan.impact import Analyser
from mizzen_ci.plan.index import CACHE_FILE, build_index
from mizzen_ci.registry import discover, registry_excludes

register_cpu_ci(est_time=20, labels=["ci"])

REPO = Path(__file__).resolve().parents[4]
REG = "\nfrom mizzen_ci import register_cpu_ci\n\nregister_cpu_ci(est_time=5, labels=['ci'])\n"
CAP = 8 * 1024 * 1024

FILES = {
    "pyproject.toml": '[tool.uv.workspace]\nmembers = ["packages/*"]\n',
    "packages/p/pyproject.toml": (
        '[project]\nname = "p"\nversion = "0"\n\n[project.scripts]\np-tool = "p.tool:main"\n'
        '\n[project.entry-points."ws.g"]\none = "p.plug"\n'
    ),
    "packages/p/src/p/__init__.py": "",
    "packages/p/src/p/tool.py": "import p.a\n",
    "packages/p/src/p/plug.py": "import p.b\n",
    "packages/p/src/p/a.py": "",
    "packages/p/src/p/b.py": "",
    "packages/p/src/p/c.py": "",
    "packages/p/src/p/loader.py": (
        "from importlib.metadata import entry_points\n\n\ndef load():\n"
        "    return entry_points(group='ws.g')\n"
    ),
    "packages/p/src/p/runner.py": "import subprocess\n\n\ndef go():\n    subprocess.run(['p-tool'])\n",
    "tests/helpers/hmod.py": "import p.c\n",
    "tests/t/test_path.py": (
        "import sys\nfrom pathlib import Path\n\n"
        "sys.path.insert(0, str(Path(__file__).parents[1] / 'helpers'))\nimport hmod\n"
    )
    + REG,
    "tests/t/test_runner.py": "import p.runner\n" + REG,
    "tests/t/test_loader.py": "import p.loader\n" + REG,
    "tests/t/test_c.py": "import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'import p.a'])\n"
    + REG,
    "tests/t/test_plain.py": "import p.c\n" + REG,
}


def age(root: Path) -> None:
    past = time.time() - 10
    for d, _, fs in os.walk(root):
        for f in fs:
            os.utime(os.path.join(d, f), (past, past))


def plans(analyser: Analyser, paths: list[str]) -> list[tuple]:
    out = []
    for p in paths:
        impact = analyser.analyse(Change.from_entries("a" * 40, "b" * 40, [Entry("M", p)]))
        out.append((impact.everything, sorted(impact.tests.items())))
    return out


def check(root: Path, cache: Path) -> None:
    fleet = load_fleet(root / "ci" / "fleet.toml")
    index = build_index(root, fleet, cache, workers=1)
    tree = discover(root, registry_excludes(root)).tree
    graph = ImportGraph.build(root, workspace_source_dirs(root), tree.all)
    assert index.reach.completed().same_as(reach_of_graph(graph))
    modules = [f"packages/p/src/p/{m}.py" for m in ("a", "b", "c", "tool", "plug", "runner")]
    changes = [*modules, "tests/helpers/hmod.py", "tests/t/test_plain.py"]
    uncached = build_index(root, fleet, None, workers=1, save=False)
    assert plans(Analyser.of_index(index), changes) == plans(Analyser.of_index(uncached), changes)


def test_the_cache_keeps_loader_facts_exact_through_edits(tmp_path):
    root, cache = tmp_path / "ws", tmp_path / "cache" / CACHE_FILE
    for rel, text in FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    (root / "ci").mkdir()
    shutil.copy(REPO / "ci" / "fleet.toml", root / "ci" / "fleet.toml")
    age(root)
    check(root, cache)  # cold
    check(root, cache)  # warm
    pkg = root / "packages/p/src/p"
    (pkg / "c.py").write_text("import subprocess\nsubprocess.run(CMD)\n")  # becomes opaque
    (root / "tests/t/test_path.py").write_text("import hmod\n" + REG)  # its folder goes
    (pkg / "runner.py").write_text("import os\nos.system('python -m p.b')\n")  # script -> -m
    check(root, cache)
    age(root)
    check(root, cache)
    line = "import p.a\n" + "#" * 100 + "\n"
    (pkg / "b.py").write_text(line * (CAP // len(line) + 2))  # over the cap: opaque
    (pkg / "c.py").write_text("")  # no longer opaque
    check(root, cache)
    (pkg / "b.py").write_text("import p.a\n")  # back under the cap
    age(root)
    check(root, cache)
    check(root, cache)
