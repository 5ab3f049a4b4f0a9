"""The byte-level rule of :mod:`mizzen_ci.plan.index.spelled_names` and the lazy impact search built on it.

- Soundness of the rule (hypothesis): for generated modules full of imports (absolute, relative
  at every level, ``from`` lists, aliases, parentheses, continuations, comments and strings that
  spell names, lazy and guarded ones), every name a parsed module names, and every prefix of it,
  finds the module among ``candidates``.
- The lazy search equals the full one: on this repository and on generated workspaces (cold and
  through a cache across edits), the impact of many changes through the planner's index (files
  left unparsed until a query may need them) equals the impact over the fully built graph.
"""

from __future__ import annotations

import ast
import random
import shutil
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mizzen_ci import register_cpu_ci
from mizzen_ci.fleet import Fleet, load_fleet
from mizzen_ci.imports import direct_names, package_of, parse_facts
from mizzen_ci.imports.facts import imports_of_tree
from mizzen_ci.imports.path_literals import (
    MAX_LITERALS,
    OVERFLOW,
    literals_of_tree,
    names,
    path_literals,
    simple,
)
from mizzen_ci.plan.change import Change, Entry
from mizzen_ci.plan.impact import Analyser, build_graph
from mizzen_ci.plan.index import CACHE_FILE, build_index
from mizzen_ci.plan.index.spelled_names import PendingNodes, spelled_words
from mizzen_ci.registry import discover, registry_excludes

register_cpu_ci(est_time=40, labels=["ci"])


# --------------------------------------------------------------------------------------------
# The rule itself.


def test_sources_the_rule_does_not_cover_are_parsed():
    assert spelled_words("import caf\u00e9\n".encode()) is None  # non-ASCII
    assert spelled_words(b"# -*- coding: latin-1 -*-\nimport a\n") is None
    assert spelled_words(b"#!/usr/bin/env python\n# coding=utf-7\nimport a\n") is None
    assert spelled_words(b"import importlib\nimportlib.import_module('a.b')\n") is None
    assert spelled_words(b"m = __import__('a')\n") is None
    # "coding" after the first two lines is an ordinary word
    assert spelled_words(b"import a\n\n\nopen(f, encoding='utf-8')\n") is not None


def test_words_are_identifiers_without_keywords():
    words = spelled_words(b"from .x.y import (z as w)  # comment_word\nif 1: s = 'str_word'\n")
    assert words == ("comment_word", "s", "str_word", "w", "x", "y", "z")


PARTS = ["a", "b", "c", "core", "x1", "_p", "Mod"]
name_part = st.sampled_from(PARTS)
dotted = st.lists(name_part, min_size=1, max_size=3).map(".".join)


def _spell_dotted(name: str, rng: random.Random) -> str:
    seps = [".", " . ", ".\\\n    ", ". "]
    parts = name.split(".")
    out = parts[0]
    for p in parts[1:]:
        out += rng.choice(seps) + p
    return out


@st.composite
def import_statement(draw) -> str:
    rng = random.Random(draw(st.integers(0, 10**6)))
    kind = draw(st.sampled_from(["import", "from", "relative", "relative-bare", "star"]))
    if kind == "import":
        names = draw(st.lists(dotted, min_size=1, max_size=3))
        alias = " as q" if draw(st.booleans()) else ""
        return "import " + ", ".join(_spell_dotted(n, rng) + alias for n in names)
    listed = draw(st.lists(name_part, min_size=1, max_size=3))
    items = ", ".join(n + (" as zz" if draw(st.booleans()) else "") for n in listed)
    if draw(st.booleans()):
        items = "(\n    " + items.replace(", ", ",\n    ") + ",\n)"
    if kind == "from":
        return f"from {_spell_dotted(draw(dotted), rng)} import {items}"
    dots = "." * draw(st.integers(1, 4))
    if kind == "relative":
        return f"from {dots}{_spell_dotted(draw(dotted), rng)} import {items}"
    if kind == "relative-bare":
        return f"from {dots} import {items}"
    return f"from {draw(dotted)} import *"


@st.composite
def module_source(draw) -> str:
    lines = ['"""A module that mentions core.Mod in its docstring."""', "# import x1.c"]
    for stmt in draw(st.lists(import_statement(), min_size=1, max_size=6)):
        where = draw(st.sampled_from(["top", "function", "try", "type-checking", "class"]))
        body = stmt.replace("\n", "\n    ")
        if where == "top":
            lines.append(stmt)
        elif where == "function":
            lines.append(f"def f():\n    {body}\n    return 'a.b'")
        elif where == "try":
            lines.append(f"try:\n    {body}\nexcept ImportError:\n    pass")
        elif where == "type-checking":
            lines.append(f"if TYPE_CHECKING:\n    {body}")
        else:
            lines.append(f"class K:\n    {body}")
    return "\n".join(lines) + "\n"


@settings(max_examples=300, deadline=None)
@given(
    source=module_source(),
    module=st.lists(name_part, min_size=1, max_size=4).map(".".join),
    is_package=st.booleans(),
)
def test_every_name_a_module_names_finds_it_among_the_candidates(source, module, is_package):
    data = source.encode()
    words = spelled_words(data)
    assert words is not None
    try:
        tree = ast.parse(data)
    except SyntaxError:
        return  # names nothing: any answer is right
    imports, *_ = imports_of_tree(tree, data)
    names = direct_names(imports, package_of(module, is_package))
    pending = PendingNodes()
    pending.add(module, words)
    pending.add("zz_other.unrelated", ("nothing",))
    for name in names:
        parts = name.split(".")
        for k in range(1, len(parts) + 1):
            prefix = ".".join(parts[:k])
            assert module in pending.candidates(prefix), (name, prefix, source)


# Statements that import dynamically (or mention the machinery), in every spelling the facts
# read and a few they cannot (a computed name: the fail-open mark).
DYNAMIC_FORMS = [
    "import importlib\nimportlib.import_module('a.b')",
    "import importlib as il\nx = il.import_module('core.Mod')",
    "from importlib import import_module as load\nload('x1.c')",
    "from importlib import import_module\nimport_module('.c', 'a.b')",
    "import importlib\nimportlib.import_module('.c', __package__)",
    "import pytest\nmod = pytest.importorskip('a.c')",
    "import pytest as pt\nskip = pt.importorskip\nskip('Mod')",
    "from pytest import importorskip\nimportorskip('b')",
    "m = __import__('a', fromlist=['b'])",
    "import runpy\nrunpy.run_module('core')",
    "import sys\ncmd = [sys.executable, '-m', 'x1']",
    "import importlib\nimportlib.import_module(NAME)",
    "import importlib\nfor n in map(importlib.import_module, NAMES):\n    pass",
    "import importlib\nf = getattr(importlib, 'import_module')",
]


@st.composite
def source_with_dynamic_imports(draw) -> str:
    lines = [draw(module_source())]
    for stmt in draw(st.lists(st.sampled_from(DYNAMIC_FORMS), max_size=3)):
        if draw(st.booleans()):
            lines.append(stmt)
        else:
            lines.append("def g():\n    " + stmt.replace("\n", "\n    "))
    return "\n".join(lines) + "\n"


@settings(max_examples=200, deadline=None)
@given(source=source_with_dynamic_imports())
def test_a_file_left_unparsed_has_no_dynamic_import(source):
    """The byte rule never leaves a file unparsed whose facts hold a dynamic import (literal
    or computed, through any alias) or a fail-open mark: the planner would miss them."""
    data = source.encode()
    facts = parse_facts(data)
    dynamic = [i for i in facts.imports if i.kind not in ("import", "from")]
    if spelled_words(data) is not None:
        assert facts.dynamic == 0 and dynamic == [], source
    elif facts.error is None and any(f in source for f in DYNAMIC_FORMS):
        assert facts.dynamic or dynamic  # (the forms are read, so the check above means it)


PATHISH = ["data/x.json", "fake_engine.py", "../up/a.txt", "./b.cfg", "tests/t/run.sh",
           "c.tar.gz", "dir/", "/abs/p.yaml", "plain", "x.y.z", "sub/dir/name"]  # fmt: skip


@st.composite
def string_expression(draw) -> str:
    value = draw(st.sampled_from(PATHISH))
    prefix = draw(st.sampled_from(["", "", "r", "f", "b"]))
    quote = draw(st.sampled_from(['"', "'", '"' * 3, "'" * 3]))
    how = draw(st.sampled_from(["plain", "split", "format", "fstring", "sentence", "escape"]))
    if how == "split" and len(value) > 1:  # implicit concatenation
        cut = draw(st.integers(1, len(value) - 1))
        gap = draw(st.sampled_from([" ", "", "\n    ", "  # c\n    "]))
        return f"({quote}{value[:cut]}{quote}{gap}{quote}{value[cut:]}{quote})"
    if how == "format":
        value = "{root}/" + value
    elif how == "fstring":
        return f'f"{{x}}/{value}"'
    elif how == "sentence":
        value = "run " + value + draw(st.sampled_from(["", " now", "."]))
    elif how == "escape":
        value = value.replace("/", "\\x2f").replace(".", "\\u002e")
    if prefix == "f":
        value = value.replace("{", "{{").replace("}", "}}")
    return f"{prefix}{quote}{value}{quote}"


@st.composite
def source_with_strings(draw) -> str:
    lines = ['"""Docstring naming docs/in_docstring.md."""', "import os"]
    for _ in range(draw(st.integers(1, 6))):
        expr = draw(string_expression())
        where = draw(st.sampled_from(["assign", "call", "docstring", "comment", "field"]))
        if where == "assign":
            lines.append(f"X = {expr}")
        elif where == "call":
            lines.append(f"def h():\n    return os.path.join(HERE, {expr})")
        elif where == "docstring":
            lines.append(f"def d():\n    {expr}\n    return 1")
        elif where == "comment":
            lines.append(f"# {expr}")
        else:
            lines.append(f"Y = f'{{open({expr})}}'")
    return "\n".join(lines) + "\n"


@settings(max_examples=300, deadline=None)
@given(source=source_with_strings())
def test_path_literals_read_from_the_bytes_hold_those_of_the_tree(source):
    """For a source whose bytes spell its strings verbatim, the literals read without parsing
    include every literal of its syntax tree, so an unparsed file names what its tree names."""
    data = source.encode()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)  # "\u" in a bytes literal
            tree = ast.parse(data)
    except SyntaxError:
        return
    from_tree = set(literals_of_tree(tree))
    got = path_literals(data)
    if not simple(data):
        assert got is None  # the planner parses it: the tree is then the answer
        assert set(path_literals(data, tree)) in (from_tree, {OVERFLOW})
        return
    assert got == (OVERFLOW,) or from_tree <= set(got), (source, from_tree, got)


def test_path_literals_cases():
    assert path_literals(b'X = HERE / "fake_engine.py"\n') == ("fake_engine.py",)
    assert path_literals(b'X = f"{root}/data/x.json"\n') == ("data/x.json",)
    assert path_literals(b'X = "{name}.json"\n') == ()
    assert path_literals(b'X = "python tests/run.py"\n') == ("tests/run.py",)
    assert path_literals(b'X = "../up/a.txt", "/abs/p.yaml", "./b.cfg", "plain"\n') == (
        "up/a.txt",
        "abs/p.yaml",
        "b.cfg",
    )
    # not simple: read from the tree (an escape, an implicit concatenation, non-ASCII)
    split = b'X = ("da" "ta/x.json")\n'
    for source in (b'X = "a\\x2fb.json"\n', split, 'X = "d\u00e9/x.json"\n'.encode()):
        assert not simple(source) and path_literals(source) is None
    assert path_literals(split, ast.parse(split)) == ("data/x.json",)
    many = "".join(f'A{i} = "d/f{i}.json"\n' for i in range(MAX_LITERALS + 1)).encode()
    assert path_literals(many) == (OVERFLOW,)  # a bounded record names every path instead
    assert names(OVERFLOW, "any/path", "") and names("x.json", "tests/x.json", "elsewhere")
    assert not names("x.json", "tests/ax.json", "tests")
    # a conventional name alone names only the file beside the literal
    assert names("conftest.py", "tests/a/conftest.py", "tests/a")
    assert not names("conftest.py", "tests/b/conftest.py", "tests/a")
    assert names("b/conftest.py", "tests/b/conftest.py", "tests/a")


def test_pending_nodes_answer_namers_without_parsing():
    pending = PendingNodes()
    pending.add("tests/a/conftest.py", ("HERE",), ("fake_engine.py", "data/x.json"))
    pending.add("pkg.mod", ("x",), ())
    assert pending.namers("tests/shared/fake_engine.py") == ["tests/a/conftest.py"]
    assert pending.namers("tests/a/data/x.json") == ["tests/a/conftest.py"]
    assert pending.namers("tests/a/other.json") == []
    pending.remove("tests/a/conftest.py")
    assert pending.namers("tests/shared/fake_engine.py") == []
    pending.add("tests/b/conftest.py", ("y",), ("fake_engine.py",))
    restored = PendingNodes.from_data(pending.to_data())
    assert restored.namers("fake_engine.py") == ["tests/b/conftest.py"]


def test_candidates_survive_removal_and_re_adding():
    pending = PendingNodes()
    pending.add("p.m", ("a", "b"))
    pending.add("p.n", ("b",))
    pending.remove("p.m")
    pending.add("p.m", ("c",))
    assert pending.candidates("x.b") == ["p.n"]
    assert pending.candidates("x.c") == ["p.m"]
    assert sorted(pending.candidates("p")) == ["p.m", "p.n"]  # modules inside the package
    restored = PendingNodes.from_data(pending.to_data())
    assert restored.candidates("x.b") == ["p.n"] and restored.words["c"] == ["p.m"]


# --------------------------------------------------------------------------------------------
# The lazy search equals the full one.


def _changes(modules: list[str], tests: list[str], rng: random.Random, n: int) -> list[list[str]]:
    out = [[m] for m in modules[:: max(1, len(modules) // n)]]
    for _ in range(n):
        picked = rng.sample(modules, min(3, len(modules))) + rng.sample(tests, min(1, len(tests)))
        out.append(picked)
    return out


def _full_analyser(root: Path) -> Analyser:
    tree = discover(root, registry_excludes(root)).tree  # the planner's tree (fixtures are data)
    graph, source_dirs = build_graph(root, tree)
    return Analyser.of_graph(graph, source_dirs, tree)


def _compare(
    fleet: Fleet, root: Path, cache: Path | None, changes: list[list[str]], fresh_each: bool
) -> None:
    full = _full_analyser(root)
    index = None
    for paths in changes:
        if index is None or fresh_each:
            index = build_index(root, fleet, cache, workers=1, save=False)
        lazy = Analyser(index.tree, index.modules, index.source_dirs, index.reach, index.excludes)
        change = Change.from_entries("a" * 40, "b" * 40, [Entry("M", p) for p in paths])
        want, got = full.analyse(change), lazy.analyse(change)
        assert (got.everything, got.tests) == (want.everything, want.tests), paths
        if fresh_each:
            index.save()


@pytest.fixture(scope="module")
def fleet(repo_root: Path) -> Fleet:
    """This repository's fleet table (the planner's, for every workspace compared here)."""
    return load_fleet(repo_root / "ci" / "fleet.toml")


def test_lazy_impact_equals_the_full_one_on_this_repository(repo_root, fleet):
    index = build_index(repo_root, fleet, None, workers=1, save=False)
    assert index.stats["scanned"] > 0, "the repository's modules are scanned, not parsed"
    module_paths = sorted(
        f for m, f in index.modules.items() if not f.startswith("/") and f.endswith(".py")
    )
    changes = _changes(module_paths, index.tree.tests, random.Random(0), 25)
    changes.append(["packages/gone/src/mizzen_gone/x.py"])
    _compare(fleet, repo_root, None, changes, fresh_each=False)


@pytest.mark.parametrize("seed", [0, 1, 4])
def test_lazy_impact_equals_the_full_one_through_a_cache_and_edits(
    tmp_path, seed, fleet, make_workspace, age_all
):
    root, cache = tmp_path / "ws", tmp_path / "cache" / CACHE_FILE
    make_workspace(root, seed=seed, modules=40, tests=30)
    age_all(root)
    rng = random.Random(seed)
    modules = sorted(str(p.relative_to(root)) for p in root.glob("packages/*/src/**/*.py"))
    tests = sorted(str(p.relative_to(root)) for p in root.glob("tests/**/*.py"))
    for step in range(3):
        _compare(fleet, root, cache, _changes(modules, tests, rng, 6), fresh_each=True)
        # edits between runs: a module gains an import of another, one is replaced
        victim = root / rng.choice(modules)
        target = rng.choice(modules).split("/src/", 1)[1][:-3].replace("/", ".")
        target = target.removesuffix(".__init__")
        victim.write_text(victim.read_text() + f"\nimport {target}\n")
        if step == 1:
            shutil.copy(root / modules[3], root / modules[4])
        age_all(root)
