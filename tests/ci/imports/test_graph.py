"""The import graph: facts read from syntax trees, resolution, queries and the facts cache."""

from __future__ import annotations

import itertools
import json
import os
import textwrap
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.imports import (
    ImportGraph,
    RawImport,
    locate_packages,
    parse_facts,
    workspace_source_dirs,
)
from mizzen_ci.plan.index.facts_cache import FactsCache

register_cpu_ci(est_time=6, labels=["ci"])


@pytest.fixture(scope="module")
def static_tree(ci_fixtures: Path) -> Path:
    return ci_fixtures / "lazy_imports" / "static"


def facts(src: str) -> list[tuple]:
    """(module, level, names, line, scope, guarded, kind) of every import in ``src``."""
    return [tuple(i) for i in parse_facts(textwrap.dedent(src).encode()).imports]


def write_tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))


# ---- facts of one file


def test_module_scope_covers_blocks_and_class_bodies():
    got = facts(
        """\
        import a
        if x:
            import b
        else:
            from c import d
        with open("f"):
            import e
        for i in y:
            import f
        while z:
            import g
        class K:
            import h
        match v:
            case 1:
                import i
        """
    )
    assert [(m, ln, s) for m, _, _, ln, s, _, _ in got] == [
        ("a", 1, "module"),
        ("b", 3, "module"),
        ("c", 5, "module"),
        ("e", 7, "module"),
        ("f", 9, "module"),
        ("g", 11, "module"),
        ("h", 13, "module"),
        ("i", 16, "module"),
    ]


def test_lazy_scopes_function_type_checking_and_pep562_getattr():
    got = facts(
        """\
        import typing
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            import tc1
            def f():
                import tc2
        else:
            import runtime_branch
        if typing.TYPE_CHECKING and flag:
            import tc3
        def g():
            import fn1
            class Inner:
                import fn2
        async def h():
            import fn3
        class C:
            def __getattr__(self, name):
                import method_getattr
        def __getattr__(name):
            import lazy_attr
            def inner():
                import lazy_attr2
        """
    )
    scopes = {m: s for m, _, _, _, s, _, _ in got}
    assert scopes == {
        "typing": "module",
        "tc1": "type-checking",
        "tc2": "type-checking",
        "runtime_branch": "module",
        "tc3": "type-checking",
        "fn1": "function",
        "fn2": "function",
        "fn3": "function",
        "method_getattr": "function",
        "lazy_attr": "getattr",
        "lazy_attr2": "getattr",
    }


def test_guards_that_catch_import_error_and_those_that_do_not():
    got = facts(
        """\
        import contextlib
        try:
            import g1
        except ImportError:
            import fallback
        try:
            import g2
        except (ValueError, ModuleNotFoundError):
            pass
        try:
            import g3
        except:
            pass
        try:
            import not_guarded
        except KeyError:
            pass
        with contextlib.suppress(ImportError):
            import g4
        try:
            def f():
                import in_function
        except ImportError:
            pass
        """
    )
    guarded = {m: g for m, _, _, _, _, g, _ in got}
    assert guarded == {
        "contextlib": False,
        "g1": True,
        "fallback": False,
        "g2": True,
        "g3": True,
        "not_guarded": False,
        "g4": True,
        "in_function": False,
    }


def test_importlib_and_dunder_import_literals_only():
    got = facts(
        """\
        import importlib
        from importlib import import_module
        a = importlib.import_module("lit.a")
        b = import_module("lit.b")
        c = __import__("lit.c")
        d = importlib.import_module(NAME)
        e = getattr(importlib.import_module("lit.e"), "x")
        f = importlib.import_module(".rel", __package__)
        g = importlib.import_module(".rel2", package=__spec__.parent)
        h = importlib.import_module(".unknown_anchor", package=other)
        def lazy():
            return importlib.import_module("lit.lazy")
        """
    )
    dyn = [(m, lv, ln, s, k) for m, lv, _, ln, s, _, k in got if k != "import" and k != "from"]
    assert dyn == [
        ("lit.a", 0, 3, "module", "importlib"),
        ("lit.b", 0, 4, "module", "importlib"),
        ("lit.c", 0, 5, "module", "__import__"),
        ("lit.e", 0, 7, "module", "importlib"),
        ("rel", 1, 8, "module", "importlib"),
        ("rel2", 1, 9, "module", "importlib"),
        ("lit.lazy", 0, 12, "function", "importlib"),
    ]


def test_from_import_records_level_and_names():
    assert facts("from ..pkg.mod import a, b as c\nfrom . import *\n") == [
        ("pkg.mod", 2, ("a", "b"), 1, "module", False, "from"),
        ("", 1, ("*",), 2, "module", False, "from"),
    ]


def test_syntax_error_is_a_fact_not_an_exception():
    f = parse_facts(b"import ok\ndef broken(:\n")
    assert f.imports == ()
    assert f.error_line == 2
    assert f.error.startswith("line 2: ")
    assert parse_facts(b"x = 1\0").error is not None


# ---- graph over a tree


def test_resolution_relative_levels_submodules_and_parents(static_tree):
    g = ImportGraph.build(static_tree, [static_tree / "src"])
    deep = [(e.target, e.line, e.kind) for e in g.edges("relative.x.y.deep")]
    assert deep == [
        ("relative.helpers", 1, "from"),  # from ...helpers import os   (3 levels up)
        ("relative.x", 2, "from"),  # from .. import sibling     (2 levels up)
        ("relative.x.sibling", 2, "submodule"),
        ("relative.x.sibling", 3, "from"),  # from ..sibling import sglang
    ]
    init = [(e.target, e.kind) for e in g.edges("relative.x.y")]
    assert init == [("relative.x.y.deep", "from")]  # from .deep import NAME, in an __init__
    assert [str(p) for p in g.problems] == [
        "src/relative/broken.py:1: relative import `from .... import nowhere` reaches beyond "
        "package relative"
    ]
    hops = [(h.target, h.parent_of) for h in g.successors("parentinit.user")]
    assert hops == [
        ("parentinit", "parentinit.sub.leaf"),
        ("parentinit.sub", "parentinit.sub.leaf"),
        ("parentinit.sub.leaf", None),
    ]
    assert g.with_parents("parentinit.sub.leaf") == [
        "parentinit",
        "parentinit.sub",
        "parentinit.sub.leaf",
    ]


def test_module_scope_versus_all_scope(static_tree):
    g = ImportGraph.build(static_tree, [static_tree / "src"])
    assert "sglang" not in g.closure("lazyok.funcs", "module")
    assert {"sglang", "megatron.bridge", "flash_attn"} <= g.closure("lazyok.funcs", "all")
    assert g.closure("lazyok", "module") == {"typing", "json"}


def test_chain_is_shortest_and_terminates_on_cycles(static_tree):
    g = ImportGraph.build(static_tree, [static_tree / "src"])
    chain = g.chain("deep.a", lambda n: n.startswith("sglang"))
    assert [str(h) for h in chain] == [
        "src/deep/a.py:3 imports deep.b (module scope)",
        "src/deep/b.py:3 imports deep.c (module scope)",
        "src/deep/c.py:3 imports sglang.srt (module scope)",
    ]
    assert g.chain("cyclean.a", lambda n: n == "never") is None
    assert g.closure("cyclean.a") == {"cyclean", "cyclean.a", "cyclean.b"}
    cyc = g.chain("cycle.a", lambda n: n == "sglang")
    assert [str(h) for h in cyc] == [
        "src/cycle/a.py:1 imports cycle.b (module scope)",
        "src/cycle/b.py:2 imports sglang (module scope)",
    ]


def test_from_external_package_offers_the_name_as_a_submodule(static_tree):
    g = ImportGraph.build(static_tree, [static_tree / "src"])
    chain = g.chain("prefix.bad", lambda n: n == "megatron.bridge")
    assert [str(h) for h in chain] == ["src/prefix/bad.py:1 imports megatron.bridge (module scope)"]


def test_importers_is_the_reverse_closure(tmp_path):
    write_tree(
        tmp_path,
        {
            "src/app/__init__.py": "",
            "src/app/core.py": "import os\n",
            "src/app/api.py": "from app import core\n",
            "src/app/cli.py": "def main():\n    from app import api\n",
            "src/app/other.py": "import json\n",
            "tests/test_api.py": "from app.api import x\n",
            "tests/test_other.py": "import app.other\n",
        },
    )
    g = ImportGraph.build(
        tmp_path, [tmp_path / "src"], extra_files=sorted(tmp_path.glob("tests/*.py"))
    )
    assert g.files["tests/test_api.py"] == "tests/test_api.py"
    assert g.importers("app.core", "module") == {"app.api", "tests/test_api.py"}
    assert g.importers("app.core", "all") == {"app.api", "app.cli", "tests/test_api.py"}
    # every module of a package runs its __init__: a change there reaches all importers
    assert g.importers("app", "module") >= {"tests/test_api.py", "tests/test_other.py"}


def test_duplicate_module_across_source_dirs_is_a_problem(tmp_path):
    write_tree(tmp_path, {"a/dup.py": "", "b/dup.py": "", "b/notmod-ule.py": ""})
    g = ImportGraph.build(tmp_path, [tmp_path / "a", tmp_path / "b"])
    assert g.modules == {"dup": "a/dup.py"}
    assert [str(p) for p in g.problems] == [
        "b/dup.py:1: module dup is also defined by a/dup.py; kept that one"
    ]


def test_locate_packages_and_workspace_source_dirs(repo_root):
    found = locate_packages(repo_root, ["mizzen_ci", "no_such_package"])
    assert found == {"mizzen_ci": [repo_root / "ci" / "src" / "mizzen_ci"], "no_such_package": []}
    dirs = workspace_source_dirs(repo_root)
    assert repo_root / "ci" / "src" in dirs and repo_root / "packages" / "train" / "src" in dirs


# ---- the facts cache


def test_cache_parses_once_and_survives_a_round_trip(tmp_path):
    write_tree(tmp_path, {"src/p/__init__.py": "import os\n", "src/p/m.py": "from . import x\n"})
    path = tmp_path / ".mizzen-cache" / "import-facts.json"
    cold = FactsCache(path)
    g1 = ImportGraph.build(tmp_path, [tmp_path / "src"], cache=cold)
    assert (cold.parsed, cold.hits) == (2, 0)
    cold.save()
    assert (path.parent / ".gitignore").read_text().splitlines()[-1] == "*"
    # make every stat entry older than the racy window so the fast path applies
    old = 1_000_000_000_000_000_000
    for f in (tmp_path / "src" / "p").iterdir():
        os.utime(f, ns=(old, old))
    refresh = FactsCache(path)
    ImportGraph.build(tmp_path, [tmp_path / "src"], cache=refresh)
    refresh.save()
    warm = FactsCache(path)
    g2 = ImportGraph.build(tmp_path, [tmp_path / "src"], cache=warm)
    assert (warm.parsed, warm.hits) == (0, 2)
    assert g1.edges("p.m") == g2.edges("p.m")
    assert g2.facts["p.m"].imports == (RawImport("", 1, ("x",), 1, "module", False, "from"),)


def test_cache_sees_a_changed_file_even_with_the_same_size_and_mtime(tmp_path):
    write_tree(tmp_path, {"src/m.py": "import aaa\n"})
    path = tmp_path / "cache.json"
    c = FactsCache(path)
    ImportGraph.build(tmp_path, [tmp_path / "src"], cache=c)
    c.save()
    st = (tmp_path / "src" / "m.py").stat()
    (tmp_path / "src" / "m.py").write_text("import bbb\n")  # same size
    os.utime(tmp_path / "src" / "m.py", ns=(st.st_atime_ns, st.st_mtime_ns))
    # the entry is inside the racy window of the save, so it is re-hashed, not trusted
    c2 = FactsCache(path)
    g = ImportGraph.build(tmp_path, [tmp_path / "src"], cache=c2)
    assert [e.target for e in g.edges("m")] == ["bbb"]
    assert c2.parsed == 1


def test_cache_keys_on_content_so_a_copy_is_a_hit(tmp_path):
    write_tree(tmp_path, {"src/a.py": "import heavy\n"})
    c = FactsCache(None)
    ImportGraph.build(tmp_path, [tmp_path / "src"], cache=c)
    write_tree(tmp_path, {"src/b.py": "import heavy\n"})
    ImportGraph.build(tmp_path, [tmp_path / "src"], cache=c)
    assert (c.parsed, c.hits) == (1, 2)


def test_cache_from_another_format_is_ignored(tmp_path):
    write_tree(tmp_path, {"src/a.py": "import x\n"})
    path = tmp_path / "cache.json"
    path.write_text(json.dumps({"format": -1, "files": {"src/a.py": [0, 0, "f"]}, "facts": {}}))
    c = FactsCache(path)
    g = ImportGraph.build(tmp_path, [tmp_path / "src"], cache=c)
    assert [e.target for e in g.edges("a")] == ["x"] and c.parsed == 1
    path.write_text("not json")
    assert FactsCache(path).facts_for(tmp_path / "src" / "a.py", "src/a.py").imports == (
        ("x", 0, (), 1, "module", False, "import"),
    )


def test_chains_to_agrees_with_chain_on_random_graphs_with_cycles(tmp_path):
    import random

    for seed in range(4):
        rng = random.Random(seed)
        root = tmp_path / f"g{seed}"
        files = {"src/g/__init__.py": ""}
        names = [f"m{i}" for i in range(40)]
        for name in names:
            lines = [f"from g import {rng.choice(names)}" for _ in range(rng.randint(0, 3))]
            if rng.random() < 0.1:
                lines.append("import forbidden.thing")
            if rng.random() < 0.2:
                lines.append(f"def f():\n    from g import {rng.choice(names)}")
            files[f"src/g/{name}.py"] = "\n".join(lines) + "\n"
        write_tree(root, files)
        g = ImportGraph.build(root, [root / "src"])

        def bad(n):
            return n.startswith("forbidden")

        for scope in ("module", "all"):
            every = g.chains_to(bad, scope)
            for node in g.modules:
                one = g.chain(node, bad, scope)
                got = every.get(node)
                assert (one is None) == (got is None), (seed, scope, node)
                if got is None:
                    continue
                assert len(got) == len(one)
                assert got[0].source == node and bad(got[-1].target)
                assert all(a.target == b.source for a, b in itertools.pairwise(got))


def test_parallel_parse_gives_the_same_graph(tmp_path, monkeypatch):
    import mizzen_ci.plan.index.facts_cache as sf

    files = {"src/p/__init__.py": "from . import m0\n"}
    for i in range(12):
        files[f"src/p/m{i}.py"] = (
            f"import os\nfrom p import m{(i + 1) % 12}\n\ndef f():\n    import x{i}\n"
        )
    write_tree(tmp_path, files)
    serial = ImportGraph.build(tmp_path, [tmp_path / "src"], workers=1)
    monkeypatch.setattr(sf, "PARALLEL_MIN", 2)
    cache = FactsCache(None)
    parallel = ImportGraph.build(tmp_path, [tmp_path / "src"], cache=cache, workers=2)
    assert cache.parsed == 13
    assert {n: parallel.edges(n) for n in parallel.files} == {
        n: serial.edges(n) for n in serial.files
    }


def test_import_word_lines_match_the_regex_they_replace(ci_src):
    """``_keyword_lines`` (a ``bytes.find`` loop) gives what ``re`` ``\\bimport\\b`` gives."""
    import random
    import re

    from mizzen_ci.imports.facts import _keyword_lines

    word = re.compile(rb"\bimport\b")

    def reference(source: bytes) -> list[int]:
        lines, line, pos = [], 1, 0
        for m in word.finditer(source):
            line += source.count(b"\n", pos, m.start())
            pos = m.start()
            if not lines or lines[-1] != line:
                lines.append(line)
        return lines

    rng = random.Random(0)
    parts = [b"import", b" ", b"\n", b"x", b"_", b"importimport", b"1", b"\xc3\xa9", b".", b"#"]
    for _ in range(5000):
        source = b"".join(rng.choice(parts) for _ in range(rng.randint(0, 12)))
        assert _keyword_lines(source) == reference(source), source
    for path in sorted((ci_src / "mizzen_ci").glob("*.py")):
        assert _keyword_lines(path.read_bytes()) == reference(path.read_bytes()), path
