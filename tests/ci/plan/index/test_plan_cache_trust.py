"""A cache can make a plan faster, never different: a cache planted in the tree, forged, sealed
with another key, or holding rows of the wrong shape changes nothing, and a cache directory that
the change's files could occupy is refused.  Real ``mizzen-ci plan`` subprocesses over a real git
repository; every cached plan is compared with ``--no-cache``."""

from __future__ import annotations

import json
import marshal
import os
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.fleet import load_fleet
from mizzen_ci.plan.index import CACHE_FILE
from mizzen_ci.plan.index.build import build_index
from mizzen_ci.plan.index.cache_home import MAGIC, TAG_BYTES, seal, unseal
from mizzen_ci.plan.index.facts_cache import FactsCache

register_cpu_ci(est_time=20, labels=["ci"])

GPU_TEST = "tests/t/test_gpu.py"


@pytest.fixture
def tree(tmp_path: Path, repo_root: Path) -> Path:
    """A repository with a CPU and a GPU test, committed on main, on a branch `change`."""
    root = tmp_path / "repo"
    files = {
        "ci/fleet.toml": (repo_root / "ci" / "fleet.toml").read_text(),
        "pyproject.toml": '[project]\nname = "t"\nversion = "0"\n',
        ".gitignore": "/.ci-artifacts/\n",
        "tests/t/test_cpu.py": "from mizzen_ci import register_cpu_ci\nregister_cpu_ci(est_time=5)\n",
        GPU_TEST: "from mizzen_ci import register_cuda_ci\n"
        "register_cuda_ci(est_time=5, hardware=['hopper'], labels=['lora'])\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    git = _git(root)
    git("init", "-q", "-b", "main")
    git("add", "-A")
    git("commit", "-qm", "base")
    git("checkout", "-qb", "change")
    return root


def _git(root: Path):
    import subprocess

    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t"}
    env |= {"GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}

    def git(*args: str) -> str:
        out = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, env=env
        )
        assert out.returncode == 0, out.stderr
        return out.stdout

    return git


@pytest.fixture
def plan(mizzen_ci, tmp_path: Path):
    """``plan(tree, *ARGS)``: (exit code, plan JSON or None, stderr) of a pull-request plan with
    this test's own cache home (``XDG_CACHE_HOME``)."""
    home = tmp_path / "cache-home"

    def run(tree: Path, *args: str):
        done = mizzen_ci(
            "plan", "--root", str(tree), "--base", "main", "--same-repo", "--label",
            "run-ci-all", "--json", *args, cwd=tree, env={"XDG_CACHE_HOME": str(home)},
        )  # fmt: skip
        return (
            done.returncode,
            json.loads(done.stdout) if done.returncode == 0 else None,
            done.stderr,
        )

    run.home = home
    return run


def poisoned_cache(tree: Path, key: bytes) -> bytes:
    """A cache in the current format whose kept row says the GPU test is disabled: what an
    attacker writes, sealed with ``key``."""
    fleet = load_fleet(tree / "ci" / "fleet.toml")
    path = tree.parent / "scratch" / CACHE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    index = build_index(tree, fleet, path, save=False)
    cache = index.cache
    for key_name, (sha, arg, kept) in list(cache._new_derived.items()):
        if key_name == GPU_TEST:
            row = list(kept[0])
            row[6] = "poisoned"  # disabled=
            cache._new_derived[key_name] = (sha, arg, (tuple(row), ()))
    cache._key = key
    cache._dirty = True
    cache.save()
    return path.read_bytes()


def test_a_cache_committed_in_the_tree_is_never_read(tree: Path, plan):
    planted = tree / ".ci-artifacts" / "cache" / CACHE_FILE
    planted.parent.mkdir(parents=True)
    planted.write_bytes(poisoned_cache(tree, b"k" * 32))
    _git(tree)("add", "-f", str(planted))
    _git(tree)("commit", "-qm", "plant a cache")
    code, want, err = plan(tree, "--no-cache")
    assert code == 0, err
    assert (GPU_TEST, "hopper") in {
        (t["file"], j["arch"]) for j in want["jobs"] for t in j["tests"]
    }
    before = planted.read_bytes()
    for _ in range(2):  # cold, then warm
        assert plan(tree)[1] == want
    assert planted.read_bytes() == before
    code, _, err = plan(tree, "--cache-dir", str(planted.parent))
    assert code == 2 and f"git tracks .ci-artifacts/cache/{CACHE_FILE} there" in err


def test_forged_and_foreign_caches_are_ignored(tree: Path, plan):
    cache_dir = tree / ".ci-artifacts" / "cache"  # ignored, untracked: allowed
    cache_dir.mkdir(parents=True)
    code, want, err = plan(tree, "--no-cache")
    assert code == 0, err
    forged = poisoned_cache(tree, b"k" * 32)
    blob = forged[len(MAGIC) + TAG_BYTES :]
    for planted in (
        forged,  # sealed with another key
        blob,  # the marshal alone (the old format)
        MAGIC + b"\0" * TAG_BYTES + blob,  # a made-up tag
        forged[:100],  # truncated
        b"",
    ):
        (cache_dir / CACHE_FILE).write_bytes(planted)
        assert plan(tree, "--cache-dir", str(cache_dir))[1] == want


def test_rows_of_the_wrong_shape_in_a_genuine_cache_are_misses(tree: Path, plan):
    cache_dir = tree / ".ci-artifacts" / "cache"
    code, want, _ = plan(tree, "--cache-dir", str(cache_dir))
    assert code == 0
    key = (plan.home / "mizzen-ci" / "key").read_bytes()
    path = cache_dir / CACHE_FILE
    data = marshal.loads(unseal(key, path.read_bytes()))
    derived = marshal.loads(data["derived"])
    sha, arg, _ = derived[GPU_TEST]
    for kept in ((("x",) * 10, ()), (None, ((1, 2, 3, 4),)), "junk", ((GPU_TEST, 1, "gpu"), ())):
        derived[GPU_TEST] = (sha, arg, kept)
        data["derived"] = marshal.dumps(derived)
        data["files"] = {k: (v[0], v[1], v[2]) for k, v in data["files"].items()}
        path.write_bytes(seal(key, marshal.dumps(data)))
        assert plan(tree, "--cache-dir", str(cache_dir))[1] == want, kept
    data["files"] = {GPU_TEST: ("big", 0, "x")}  # a stat entry of the wrong shape
    path.write_bytes(seal(key, marshal.dumps(data)))
    assert plan(tree, "--cache-dir", str(cache_dir))[1] == want


def test_an_unsafe_key_file_means_no_cache_at_all(tree: Path, plan):
    code, want, _ = plan(tree, "--no-cache")
    assert code == 0
    key = plan.home / "mizzen-ci" / "key"
    key.parent.mkdir(parents=True)
    key.write_bytes(b"k" * 32)
    key.chmod(0o644)  # readable by others: not a secret
    assert plan(tree)[1] == want
    assert not list((plan.home / "mizzen-ci").glob("plan/*/*")), "no cache written"


def test_the_default_cache_lives_outside_the_tree_and_works(tree: Path, plan):
    code, want, _ = plan(tree, "--no-cache")
    assert code == 0
    assert plan(tree)[1] == want
    (cache,) = (plan.home / "mizzen-ci" / "plan").glob(f"*/{CACHE_FILE}")
    assert tree not in cache.parents
    assert cache.read_bytes().startswith(MAGIC)
    assert plan(tree)[1] == want  # warm
    fleet = load_fleet(tree / "ci" / "fleet.toml")
    assert FactsCache(cache, key=b"k" * 32)._stat == {}  # another key reads nothing
    assert build_index(tree, fleet, None).registry.registrations  # (the tree itself is fine)
