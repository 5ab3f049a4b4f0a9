"""What the planner reads of the dependencies no plain import shows, one part at a time.

- The import facts: dynamic imports through aliases (module or function scope), ``importorskip``,
  relative names with a literal package, ``__import__`` with a level or a ``fromlist``,
  ``runpy`` and ``python -m`` commands; computed names mark the file (fail open) at their line.
- The graph: sibling imports between files under ``tests/`` resolve as at run time, and the
  reverse lookup (``sibling_names``) finds every importer the forward resolution makes.
- The index: path literals, fail-open marks and sibling imports stay exact through a cache across
  edits (the index equals the one of the fully built graph), and no older cache is served.
- The workspace: entry points from the members' ``pyproject.toml``.
- The registry: ``watches`` is validated like every field, with ``file:line`` errors.
"""

from __future__ import annotations

import os
import random
import textwrap
import time
from pathlib import Path

import pytest

import mizzen_ci.plan.index.facts_cache as facts_cache
from mizzen_ci import register_cpu_ci
from mizzen_ci.fleet import load_fleet
from mizzen_ci.imports import (
    ImportGraph,
    entry_point_modules,
    parse_facts,
    reach_of_graph,
    workspace_source_dirs,
)
from mizzen_ci.imports import path_literals as path_literals_module
from mizzen_ci.imports.facts import DYNAMIC_SPELLINGS, spells_dynamic
from mizzen_ci.imports.path_literals import names
from mizzen_ci.imports.resolve import sibling_names
from mizzen_ci.plan.change import Change, Entry
from mizzen_ci.plan.impact import Analyser
from mizzen_ci.plan.index import CACHE_FILE, build_index
from mizzen_ci.plan.index.build import cache_context
from mizzen_ci.plan.index.lazy_reach import LazyReach
from mizzen_ci.registry import discover, read_source, registry_excludes

register_cpu_ci(est_time=10, labels=["ci"])

REPO = Path(__file__).resolve().parents[3]


def records(src: str) -> tuple[list[tuple], int]:
    """((module, level, names, line, scope, guarded, kind) of the non-static imports, dynamic)."""
    facts = parse_facts(textwrap.dedent(src).encode())
    dyn = [tuple(i) for i in facts.imports if i.kind not in ("import", "from") or i.line > 90]
    return dyn, facts.dynamic


# ---- the facts


def test_dynamic_imports_through_aliases_at_module_and_function_scope():
    got, dynamic = records(
        """\
        import importlib as il
        from importlib import import_module as load
        import pytest as pt
        from pytest import importorskip
        import runpy
        a = il.import_module("lit.a")
        b = load("lit.b")
        c = pt.importorskip("lit.c")
        d = importorskip("lit.d", minversion="1")
        def f():
            import importlib as lazy_il
            again = lazy_il.import_module
            return again("lit.e")
        g = importlib.import_module(".g", "pkg.sub")
        h = importlib.import_module("..h", package="pkg.sub")
        i = importlib.import_module("...i", "pkg.sub")
        j = __import__("lit.j", level=0)
        k = __import__("k", globals(), locals(), ["sub"], 1)
        runpy.run_module("lit.m")
        """
    )
    assert got == [
        ("lit.a", 0, (), 6, "module", False, "importlib"),
        ("lit.b", 0, (), 7, "module", False, "importlib"),
        ("lit.c", 0, (), 8, "module", True, "importorskip"),
        ("lit.d", 0, (), 9, "module", True, "importorskip"),
        ("lit.e", 0, (), 13, "function", False, "importlib"),
        ("pkg.sub.g", 0, (), 14, "module", False, "importlib"),
        ("pkg.h", 0, (), 15, "module", False, "importlib"),
        # "...i" from "pkg.sub" reaches above the top: an import that always fails, none here
        ("lit.j", 0, (), 17, "module", False, "__import__"),
        ("k", 1, (), 18, "module", False, "__import__"),
        ("lit.m", 0, (), 19, "module", False, "run"),
        ("lit.m.__main__", 0, (), 19, "module", False, "run"),
    ]
    assert dynamic == 0
    frm = [tuple(i) for i in parse_facts(b"k = __import__('k', fromlist=['a', 'b'])\n").imports]
    assert frm == [
        ("k", 0, (), 1, "module", False, "__import__"),
        ("k", 0, ("a", "b"), 1, "module", False, "from"),
    ]


@pytest.mark.parametrize(
    ("src", "line"),
    [
        ("import importlib\nname = 'x'\nimportlib.import_module(name)\n", 3),
        ("import importlib\n\ndef f(p):\n    return importlib.import_module('.x', p)\n", 4),
        ("from importlib import import_module as load\nmods = map(load, NAMES)\n", 2),
        ("import importlib\nf = getattr(importlib, 'import_module')\n", 2),
        ("import pytest\npytest.importorskip(*ARGS)\n", 2),
        ("m = __import__(NAME)\n", 1),
        ("m = __import__('a', fromlist=NAMES)\n", 1),
        ("import sys\n\ndef run(mod):\n    return [sys.executable, '-m', mod]\n", 4),
    ],
)
def test_a_computed_name_marks_the_file_at_its_line(src, line):
    assert parse_facts(src.encode()).dynamic == line


def test_python_m_commands_run_a_module_and_its_main_in_a_subprocess():
    got, dynamic = records(
        """\
        import subprocess
        import sys
        CMD = [sys.executable, "-S", "-m", "mizzen_ci", "plan"]
        def test_cli():
            subprocess.run(["/usr/bin/python3", "-m", "pkg.tool"])
            subprocess.run(["git", "commit", "-m", "a message"])  # not Python: not a module
        """
    )
    assert got == [
        ("mizzen_ci", 0, (), 3, "subprocess", False, "run"),
        ("mizzen_ci.__main__", 0, (), 3, "subprocess", False, "run"),
        ("pkg.tool", 0, (), 5, "subprocess", False, "run"),
        ("pkg.tool.__main__", 0, (), 5, "subprocess", False, "run"),
        # any other program: a console script of the workspace, if it declares one of that name
        ("script:git", 0, (), 6, "subprocess", False, "script"),
    ]
    assert dynamic == 0


def test_the_spellings_that_make_a_file_searched_are_the_documented_ones():
    for spelling in DYNAMIC_SPELLINGS:
        assert spells_dynamic(b"x = 1\n" + spelling + b"\n")
    assert not spells_dynamic(b"import importlib.util\nimportlib.util.find_spec('x')\n")


def test_a_file_that_spells_no_dynamic_import_is_not_searched_for_one():
    facts = parse_facts(b"import os\nX = os.path.join('a', 'b')\n")
    assert [i.kind for i in facts.imports] == ["import"] and facts.dynamic == 0


# ---- the graph's sibling imports


def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))


SIBLINGS = {
    "tests/a/worker.py": "import kit\nfrom pkg import sub\nimport pkg.deep.leaf\n",
    "tests/a/kit.py": "import json\n",
    "tests/a/pkg/__init__.py": "",
    "tests/a/pkg/sub.py": "",
    "tests/a/pkg/deep/__init__.py": "",
    "tests/a/pkg/deep/leaf.py": "",
    "tests/a/pkg/inner.py": "import sub\n",  # beside pkg/sub.py
    "tests/b/test_other.py": "import kit\n",  # no kit.py beside it: nothing
}


def test_sibling_imports_resolve_to_the_files_beside_the_importer(tmp_path):
    write(tmp_path, SIBLINGS)
    graph = ImportGraph.build(tmp_path, [], list(SIBLINGS))
    closure = graph.closure("tests/a/worker.py", "all")
    assert {
        "tests/a/kit.py",
        "tests/a/pkg/__init__.py",
        "tests/a/pkg/sub.py",
        "tests/a/pkg/deep/__init__.py",
        "tests/a/pkg/deep/leaf.py",
    } <= closure
    assert "tests/a/pkg/sub.py" in graph.closure("tests/a/pkg/inner.py", "all")
    assert not {n for n in graph.closure("tests/b/test_other.py", "all") if "/" in n}
    hop = graph.chain("tests/a/worker.py", lambda n: n == "tests/a/kit.py", "all")
    assert str(hop[0]).endswith("(module scope, a file beside the importer, found on sys.path)")


def test_the_reverse_sibling_lookup_finds_every_forward_edge(tmp_path):
    write(tmp_path, SIBLINGS)
    graph = ImportGraph.build(tmp_path, [], list(SIBLINGS))
    files = set(SIBLINGS)
    reach = reach_of_graph(graph)
    for node in graph.files:
        for e in graph.edges(node):
            if e.kind != "sibling":
                continue
            found = {
                n
                for directory, dotted in sibling_names(e.target, files)
                for n in reach.naming(dotted, True)
                if n.rpartition("/")[0] == directory
            }
            assert node in found, (node, e.target)


# ---- the index through a cache


def make_hidden_workspace(root: Path, seed: int) -> None:
    rng = random.Random(seed)
    files = {
        "pyproject.toml": '[tool.uv.workspace]\nmembers = ["packages/*"]\n',
        "ci/fleet.toml": (REPO / "tests/ci/fixtures/registry/fleet.toml").read_text(),
        "packages/p/pyproject.toml": '[project]\nname = "p"\n',
        "packages/p/src/p/__init__.py": "",
        "packages/p/src/p/data/t.json": "{}\n",
    }
    for k in range(12):
        kind = rng.randrange(4)
        if kind == 0:
            text = f'from pathlib import Path\nT = Path(__file__).parent / "data" / "t{k}.json"\n'
        elif kind == 1:
            text = "import importlib\n\ndef load(n):\n    return importlib.import_module(n)\n"
        elif kind == 2:
            text = f"import p.m{rng.randrange(12)}\n"
        else:
            text = 'X = "a\\x2fb.json"  # not simple: parsed\n'
        files[f"packages/p/src/p/m{k}.py"] = text
    reg = "from mizzen_ci import register_cpu_ci\nregister_cpu_ci(est_time=1, labels=['ci'])\n"
    for t in range(8):
        body = rng.choice(
            [
                f"import helper{t % 2}\n",
                f'DATA = "data/case{t}.json"\n',
                f"import importlib\nimportlib.import_module(NAME{t})\n",
                f"import p.m{rng.randrange(12)}\n",
            ]
        )
        files[f"tests/t/test_{t}.py"] = body + reg
    files["tests/t/helper0.py"] = 'ENGINE = "shared/engine.py"\n'
    files["tests/t/helper1.py"] = "import p.m3\n"
    files["tests/shared/engine.py"] = "import p.m1\n"
    write(root, files)


def age_all(root: Path) -> None:
    past = time.time() - 10
    for d, _, fs in os.walk(root):
        for f in fs:
            os.utime(os.path.join(d, f), (past, past))


def check_index(root: Path, cache: Path | None):
    fleet = load_fleet(root / "ci" / "fleet.toml")
    index = build_index(root, fleet, cache, workers=1)
    tree = discover(root, registry_excludes(root)).tree
    graph = ImportGraph.build(root, workspace_source_dirs(root), tree.all)
    assert index.reach.completed().same_as(reach_of_graph(graph))
    return index


@pytest.mark.parametrize("seed", [0, 1])
def test_the_index_keeps_literals_and_fail_open_marks_exact_through_edits(tmp_path, seed):
    root, cache = tmp_path / "ws", tmp_path / "cache" / CACHE_FILE
    make_hidden_workspace(root, seed)
    age_all(root)
    cold = check_index(root, cache)
    assert cold.stats["scanned"] > 0  # some modules are answered from their bytes
    assert cold.reach.namers("tests/shared/engine.py") == ["tests/t/helper0.py"]
    pending_literals = dict(cold.reach.pending.literals)
    assert pending_literals, "literals of unparsed files are kept"
    check_index(root, cache)  # warm
    pkg = root / "packages/p/src/p"
    (pkg / "m0.py").write_text('NAME = "data/other.json"\n')  # a literal appears
    (pkg / "m1.py").write_text("import importlib\nimportlib.import_module(N)\n")  # fail open
    (pkg / "m2.py").unlink()
    (root / "tests/t/helper0.py").write_text("import p.m4\n")  # a literal disappears
    (root / "tests/t/kit.py").write_text("import p.m5\n")  # a new sibling
    check_index(root, cache)
    age_all(root)
    check_index(root, cache)


def test_no_older_cache_is_served(tmp_path):
    # the facts' code key and the derived values' context both cover the new readers
    assert path_literals_module.__file__ in facts_cache.CODE_MODULES
    fleet = load_fleet(REPO / "ci" / "fleet.toml")
    context = cache_context(fleet)
    original = Path(path_literals_module.__file__).read_bytes()
    try:  # a different path-literal reader gives a different context (so re-derives)
        copy = tmp_path / "path_literals.py"
        copy.write_bytes(original + b"\n# changed\n")
        path_literals_module.__file__, saved = str(copy), path_literals_module.__file__
        assert cache_context(fleet) != context
    finally:
        path_literals_module.__file__ = saved
    # a reach section of the older shape (two tables, two pending tables) is not read
    assert LazyReach.from_data(({}, {}, {}, {})) is None


def test_the_planners_namers_are_the_definition_of_naming(tmp_path):
    reg = "from mizzen_ci import register_cpu_ci\nregister_cpu_ci(est_time=1, labels=['ci'])\n"
    literals = ["conftest.py", "a/conftest.py", "__init__.py", "x.json", "b/x.json", "run.py"]
    files = {
        "pyproject.toml": '[tool.uv.workspace]\nmembers = ["packages/*"]\n',
        "ci/fleet.toml": (REPO / "tests/ci/fixtures/registry/fleet.toml").read_text(),
        "packages/p/pyproject.toml": '[project]\nname = "p"\n',
        "packages/p/src/p/__init__.py": "",
        "packages/p/src/p/run.py": "",
        "packages/p/src/p/x.json": "",
    }
    for d in ("tests/a", "tests/b", "tests/a/c"):
        files[f"{d}/conftest.py"] = ""
        files[f"{d}/__init__.py"] = ""
        files[f"{d}/x.json"] = ""
    rng = random.Random(5)
    for k, d in enumerate(["tests/a", "tests/b", "tests/a/c", "tests/a", "tests/b"]):
        chosen = rng.sample(literals, 3)
        files[f"{d}/test_n{k}.py"] = "".join(f"L{i} = {v!r}\n" for i, v in enumerate(chosen)) + reg
    files["packages/p/src/p/namer.py"] = "A = '__init__.py'\nB = 'x.json'\n"
    write(tmp_path, files)
    index = build_index(tmp_path, load_fleet(tmp_path / "ci" / "fleet.toml"), None, save=False)
    analyser = Analyser.of_index(index)
    graph = ImportGraph.build(tmp_path, workspace_source_dirs(tmp_path), index.tree.all)
    for path in files:
        want = {
            node
            for node, facts in graph.facts.items()
            if any(names(v, path, graph.files[node].rpartition("/")[0]) for v in facts.paths)
        }
        assert set(analyser.namers(path)) == want, path


# ---- the workspace's entry points


def test_entry_points_of_every_member(tmp_path):
    write(
        tmp_path,
        {
            "pyproject.toml": '[tool.uv.workspace]\nmembers = ["packages/*"]\n',
            "packages/a/pyproject.toml": """\
                [project]
                name = "a"
                [project.scripts]
                a-cli = "a.cli:main"
                [project.gui-scripts]
                a-gui = "a.gui:run [extra]"
                [project.entry-points."a.plugins"]
                one = "a.plugins.one"
                bad = "not a module:x"
                """,
            "packages/b/pyproject.toml": '[project]\nname = "b"\n',
        },
    )
    assert entry_point_modules(tmp_path) == {
        "a.cli": ["entry point a-cli of [project.scripts] in packages/a/pyproject.toml"],
        "a.gui": ["entry point a-gui of [project.gui-scripts] in packages/a/pyproject.toml"],
        "a.plugins.one": [
            "entry point one of [project.entry-points.a.plugins] in packages/a/pyproject.toml"
        ],
    }
    # unknown entry points: every module of the member counts as one (fail open)
    (tmp_path / "packages/b/pyproject.toml").write_text("[project\n")
    (why,) = entry_point_modules(tmp_path)["packages/b/"]
    assert why.startswith("packages/b/pyproject.toml cannot be read (")
    assert why.endswith("its entry points are unknown")


def test_a_member_whose_entry_points_are_unknown_fails_open(tmp_path):
    reg = "from mizzen_ci import register_cpu_ci\nregister_cpu_ci(est_time=1, labels=['ci'])\n"
    write(
        tmp_path,
        {
            "pyproject.toml": '[tool.uv.workspace]\nmembers = ["packages/*"]\n',
            "ci/fleet.toml": (REPO / "tests/ci/fixtures/registry/fleet.toml").read_text(),
            "packages/b/pyproject.toml": "[project\n",
            "packages/b/src/b/__init__.py": "",
            "packages/b/src/b/one.py": "",
            "packages/b/src/b/two.py": "",
            "tests/test_two.py": "import b.two\n" + reg,
        },
    )
    index = build_index(tmp_path, load_fleet(tmp_path / "ci" / "fleet.toml"), None, save=False)
    change = Change.from_entries("a" * 40, "b" * 40, [Entry("M", "packages/b/src/b/one.py")])
    why = Analyser.of_index(index).analyse(change).tests["tests/test_two.py"]
    assert why.startswith("reaches packages/b (packages/b/src/b/one.py changed: ")
    assert "its entry points are unknown" in why


# ---- the registry's `watches`


@pytest.fixture(scope="module")
def fleet():
    return load_fleet(REPO / "ci" / "fleet.toml")


def test_watches_is_a_registration_field(fleet):
    src = (
        "from mizzen_ci import register_cpu_ci\n"
        "register_cpu_ci(est_time=5, labels=['ci'], watches=['packages/*/src/**/*.py'])\n"
    )
    reg, errors = read_source(src, "tests/x/test_w.py", fleet)
    assert errors == [] and reg.watches == ("packages/*/src/**/*.py",)
    reg, errors = read_source(src.replace(", watches=['packages/*/src/**/*.py']", ""), "t", fleet)
    assert errors == [] and reg.watches == ()


@pytest.mark.parametrize(
    ("value", "rule", "what"),
    [
        ("'packages/**'", "watches-type", "must be a list of strings"),
        ("['']", "watches-glob", "an empty glob"),
        ("['/etc/passwd']", "watches-glob", "an absolute path"),
        ("['C:/x']", "watches-glob", "an absolute path"),
        ("['../outside/**']", "watches-glob", "`..` segment"),
        ("['packages//x']", "watches-glob", "an empty, `.` or `..` segment"),
        ("['packages\\\\x']", "watches-glob", "a backslash"),
        ("['packages/[ab]/**']", "watches-glob", "the glob dialect has"),
        ("[' packages/**']", "watches-glob", "spaces at its ends"),
        (f"['{'a/' * 101}x']", "watches-glob", "longer than 200 characters"),
        (repr([f"p{i}/**" for i in range(33)]), "watches-count", "33 globs (at most 32)"),
        ("['a/**', 'a/**']", "watches-duplicate", "more than once"),
    ],
)
def test_bad_watches_are_errors_with_file_line_rule_and_fix(fleet, value, rule, what):
    src = (
        "from mizzen_ci import register_cpu_ci\n\n"
        f"register_cpu_ci(est_time=5, labels=['ci'],\n    watches={value})\n"
    )
    reg, errors = read_source(src, "tests/x/test_w.py", fleet)
    assert reg is None
    (error,) = errors
    assert (error.path, error.line, error.rule) == ("tests/x/test_w.py", 4, rule)
    assert what in error.message and error.fix
    assert str(error).startswith(f"tests/x/test_w.py:4: [{rule}]")
