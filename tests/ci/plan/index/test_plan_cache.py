"""The planner's index (:mod:`mizzen_ci.plan.index`) gives exactly the uncached answers.

On a generated workspace (modules with absolute, relative, lazy, guarded, ``TYPE_CHECKING``,
``importlib`` and PEP 562 imports, a file that does not parse, valid and invalid registrations, a
test file outside ``tests/``, conftests and helpers), through a sequence of runs sharing one cache
(cold, warm, edits, additions, deletions, a rename, a fleet change, a touched file, a broken
cache), the index must equal the references built without any cache:

- the registry: :func:`mizzen_ci.registry.read_registry` (registrations, violations, order);
- the reach index, completed (the files left unparsed parsed): :func:`mizzen_ci.plan.impact.
  reach_of_graph` over ``ImportGraph.build``;

and the impact search over it (which parses only the files that may name what it asks for) must
find what ``ImportGraph.importers`` finds.  A warm run with nothing changed reads no file.  The
workspaces come from the ``make_workspace`` fixture (``tests/ci/generated_workspace.py``).
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest

import mizzen_ci.plan.index.facts_cache as facts_cache
from mizzen_ci import register_cpu_ci
from mizzen_ci.fleet import load_fleet
from mizzen_ci.imports import reach_of_graph
from mizzen_ci.plan.impact import Analyser, build_graph
from mizzen_ci.plan.index import CACHE_FILE, build_index
from mizzen_ci.plan.index.build import cache_context
from mizzen_ci.plan.index.facts_cache import FactsCache
from mizzen_ci.registry import discover, read_registry

register_cpu_ci(est_time=20, labels=["ci"])


def references(root: Path):
    fleet = load_fleet(root / "ci" / "fleet.toml")
    tree = discover(root).tree
    graph, source_dirs = build_graph(root, tree)
    return read_registry(root, fleet), reach_of_graph(graph), graph, source_dirs, tree


READS = [0]  # files the facts cache read (not only stat-ed), while the `reads` fixture is on


def check(root: Path, cache: Path | None, workers: int | None = 1):
    """The index of ``root`` (through ``cache``), checked against the references; READS[0] is
    what building the index read."""
    fleet = load_fleet(root / "ci" / "fleet.toml")
    before = READS[0]
    index = build_index(root, fleet, cache, workers=workers)
    reads = READS[0] - before
    registry, reach, *_ = references(root)
    pending = dict(index.reach.pending.nodes)
    counts = index.cache.parsed, index.cache.hits
    assert index.reach.completed().same_as(reach)
    assert index.reach.pending.nodes == pending, "completed() leaves the index as it was"
    index.cache.parsed, index.cache.hits = counts  # (what completed() parsed is not the build's)
    READS[0] = before + reads
    assert index.registry.registrations == registry.registrations
    assert [str(e) for e in index.registry.violations] == [str(e) for e in registry.violations]
    return index


@pytest.fixture
def reads(monkeypatch):
    """How many files were read (not only stat-ed) by the facts cache."""
    real = facts_cache._read_one

    def counting(*args):
        READS[0] += 1
        return real(*args)

    monkeypatch.setattr(facts_cache, "_read_one", counting)
    READS[0] = 0
    return READS


def test_index_equals_the_uncached_answers_through_edits(
    tmp_path, reads, make_workspace, age_all, workspace_kit
):
    root, cache = tmp_path / "ws", tmp_path / "cache" / CACHE_FILE
    make_workspace(root)
    age_all(root)
    cold = check(root, cache)
    assert cache.is_file() and (cache.parent / ".gitignore").read_text().endswith("*\n")
    # cached: files with a twin's bytes; scanned: files read for their words, not parsed
    files = cold.stats["parsed"] + cold.stats["scanned"] + cold.stats["cached"]
    assert cold.stats["parsed"] > 25 and cold.stats["scanned"] > 10
    assert cold.stats["derived"] == files

    reads[0] = 0
    warm = check(root, cache)
    assert reads[0] == 0, "a warm run with nothing changed must not read any file"
    assert warm.stats == {"parsed": 0, "scanned": 0, "cached": files, "derived": 0}

    # A module changes its imports, a module appears, one disappears, a test is renamed and
    # another re-registered, a helper changes.
    alpha = root / "packages" / "alpha" / "src" / "alpha"
    (alpha / "m1.py").write_text("import beta.m2\nfrom .sub import m3\n")
    (alpha / "sub" / "m_new.py").write_text("from .. import m1\n")
    (alpha / "m5.py").unlink()
    (root / "tests/area0/test_t0.py").rename(root / "tests/area0/test_renamed.py")
    edit = workspace_kit.HEADER + workspace_kit.REGISTRATIONS[2] + "\nimport alpha.m1\n"
    (root / "tests/area1/test_t1.py").write_text(edit)
    (root / "tests/area1/helper.py").write_text("import alpha.sub.m_new\n")
    reads[0] = 0
    edited = check(root, cache)
    assert reads[0] == 5  # the changed and the new files; nothing else
    # the renamed test's bytes are known; a module is parsed or only scanned for its words
    assert edited.stats["parsed"] + edited.stats["scanned"] == 4

    # A touched file with the same bytes is re-hashed, not re-parsed.
    age_all(root)
    check(root, cache)
    os.utime(root / "tests/area2/test_t2.py")
    touched = check(root, cache)
    assert touched.stats["parsed"] == 0

    # A fleet change re-validates every registration but parses nothing.
    fleet = root / "ci" / "fleet.toml"
    fleet.write_text(fleet.read_text().replace('"lora",', '"lora", "extra",'))
    refleet = check(root, cache)
    assert refleet.stats["parsed"] == 0 and refleet.stats["derived"] > 0

    # A cache that cannot be read is ignored.
    cache.write_bytes(b"not a cache")
    again = check(root, cache)
    assert again.stats["parsed"] > 25  # parsed afresh, and still the same answers


def test_same_size_and_mtime_edit_inside_the_racy_window_is_seen(tmp_path, make_workspace):
    root, cache = tmp_path / "ws", tmp_path / "cache" / CACHE_FILE
    make_workspace(root)
    check(root, cache)  # every file is younger than the save: inside the racy window
    target = root / "tests/area0/test_t3.py"
    st = target.stat()
    text = target.read_text()
    flipped = text.replace("est_time=", "est_time=9", 1).replace("\n", "", 1)
    assert len(flipped) == len(text)
    target.write_text(flipped)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    check(root, cache)


def test_parallel_cold_build_equals_serial(tmp_path, monkeypatch, make_workspace):
    root = tmp_path / "ws"
    make_workspace(root, seed=1, modules=40, tests=30)
    monkeypatch.setattr(facts_cache, "PARALLEL_MIN", 8)
    parallel = check(root, tmp_path / "c" / CACHE_FILE, workers=2)
    assert parallel.stats["parsed"] > 8
    serial = check(root, None, workers=1)
    assert parallel.reach.completed().same_as(serial.reach.completed())
    # the parallel run's cache serves a warm run
    assert check(root, tmp_path / "c" / CACHE_FILE).stats["parsed"] == 0


@pytest.mark.parametrize("seed", [0, 2, 3])
def test_impact_search_finds_what_the_graph_finds(tmp_path, seed, make_workspace):
    root = tmp_path / "ws"
    make_workspace(root, seed=seed, modules=40, tests=30)
    index = check(root, None)
    _, _, graph, source_dirs, tree = references(root)
    analyser = Analyser(index.tree, index.modules, index.source_dirs, index.reach)
    assert index.source_dirs == source_dirs and index.tree == tree
    rng = random.Random(seed)
    for _ in range(25):
        changed = rng.sample(sorted(graph.modules), rng.randint(1, 3))
        if rng.random() < 0.3:
            changed.append("alpha.gone")  # a module that no longer exists
        found = set(analyser.importers_with_origin({m: m for m in changed}))
        assert found == graph.importers(changed, "all") - set(changed)


def test_index_without_reach_reads_only_the_registry(tmp_path, reads, make_workspace):
    root = tmp_path / "ws"
    make_workspace(root)
    fleet = load_fleet(root / "ci" / "fleet.toml")
    index = build_index(root, fleet, None, workers=1, with_reach=False)
    n_reads = reads[0]
    registry = read_registry(root, fleet)
    assert index.registry.registrations == registry.registrations
    assert [str(e) for e in index.registry.violations] == [str(e) for e in registry.violations]
    assert n_reads == len(registry.registrations) + len({e.path for e in registry.violations}) - 1
    assert index.reach.index.named == {} and not index.reach.pending and index.modules == {}


def test_copied_tree_with_the_same_cache_gives_its_own_answers(tmp_path, make_workspace):
    """Answers are keyed by path and content: the same cache on a copy with different paths
    gives that copy's answers (errors name the copy's own files)."""
    root, cache = tmp_path / "ws", tmp_path / "cache" / CACHE_FILE
    make_workspace(root)
    check(root, cache)
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    (copy / "tests/area0/test_t0.py").rename(copy / "tests/area0/test_moved.py")
    check(copy, cache)


def test_a_registry_only_run_keeps_the_graphs_cache(tmp_path, reads, make_workspace, age_all):
    """A run that selects everything reads only the registry's test files; it must not drop the
    cached facts of the modules (the next pull-request plan stays warm)."""
    root, cache = tmp_path / "ws", tmp_path / "cache" / CACHE_FILE
    make_workspace(root)
    age_all(root)
    fleet = load_fleet(root / "ci" / "fleet.toml")
    check(root, cache)
    nightly = build_index(root, fleet, cache, workers=1, with_reach=False)
    assert nightly.stats["parsed"] == 0 and nightly.stats["derived"] == 0
    assert FactsCache(cache, context=cache_context(fleet)).section("reach") is not None
    reads[0] = 0
    again = check(root, cache)
    assert reads[0] == 0 and again.stats == {
        "parsed": 0,
        "scanned": 0,
        "cached": again.stats["cached"],
        "derived": 0,
    }
