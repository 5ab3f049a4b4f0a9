"""The planner's caches give exactly the uncached answers: the registry read through its cache
(fresh, warm, after an edit, two files with the same bytes) and the fast discovery walk."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from mizzen_ci import register_cpu_ci
from mizzen_ci.fleet import load_fleet
from mizzen_ci.registry import discover, read_registry, registry_excludes
from mizzen_ci.registry_cache import _read_many, discover_fast, read_registry_cached

register_cpu_ci(est_time=6, labels=["ci"])

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "ci" / "fixtures" / "registry"


def same(a, b) -> bool:
    return a.registrations == b.registrations and [str(e) for e in a.errors] == [
        str(e) for e in b.errors
    ]


def test_fast_discovery_finds_what_the_registry_discovers():
    for root in (REPO, FIXTURES / "bad", FIXTURES / "good"):
        assert discover_fast(root, registry_excludes(root)) == list(
            discover(root, registry_excludes(root))
        )


def test_cached_registry_equals_the_registry_through_edits(tmp_path):
    root = tmp_path / "tree"
    shutil.copytree(FIXTURES / "bad", root)
    fleet = load_fleet(FIXTURES / "fleet.toml")
    cache = tmp_path / "cache" / "registry.json"
    # two files with the same bytes at different paths: answers must not be shared
    twin = root / "tests" / "twin"
    twin.mkdir()
    shutil.copy(root / "tests" / "test_comment_only.py", twin / "test_comment_only.py")

    first = read_registry_cached(root, fleet, cache)
    assert cache.is_file()
    assert same(first, read_registry(root, fleet))
    assert same(read_registry_cached(root, fleet, cache), first)  # warm

    edited = root / "tests" / "test_comment_only.py"
    edited.write_text(
        "from mizzen_ci import register_cpu_ci\nregister_cpu_ci(est_time=3, labels=['ci'])\n"
    )
    future = time.time() + 10  # a different mtime even on coarse clocks
    os.utime(edited, (future, future))
    after = read_registry_cached(root, fleet, cache)
    assert same(after, read_registry(root, fleet))
    assert any(r.path == "tests/test_comment_only.py" for r in after.registrations)
    assert not any(r.path == "tests/test_comment_only.py" for r in first.registrations)


def test_parallel_read_equals_serial():
    root, fleet = FIXTURES / "bad", load_fleet(FIXTURES / "fleet.toml")
    rels = list(discover(root, registry_excludes(root))) * 12  # over PARALLEL_MIN: a pool
    assert len(rels) >= 400
    assert same(_read_many(root, fleet, rels, workers=2), read_registry(root, fleet, rels))
