"""The GPU lane's compile cache and cost summary, for real on CPU: ``--fake-gpus`` lanes over
``tests/ci/fixtures/gpu_lane/compile_cache`` whose children record what they were given or leave
compile-cache counts, and the summary's GPU-seconds from known attempts.

The counts come from a child that adds known hits and misses to ``torch._dynamo.utils.counters``
itself: a real ``torch.compile`` on this CPU box takes ~30 s to miss and ~15 s more to hit
(inductor's C++ compile), too slow for the CPU lane.  The plumbing it exercises (the plugin's
session hook, ``$MIZZEN_COMPILE_STATS``, the lane's reader, the summary) is the same.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.lane.compile_cache import (
    CACHE_VARIABLES,
    MAX_REASON_CHARS,
    MAX_RECOMPILED,
    MAX_STATS_BYTES,
    CompileCacheError,
    CompileStats,
    Recompile,
    TorchBuild,
    _recompiles,
    cache_key,
    child_stats,
    configure,
    read_stats,
)
from mizzen_ci.lane.hardware import Gpu
from mizzen_ci.lane.report import LaneOutcome, SummaryRow, summary_tables, write_reports
from mizzen_ci.lane.runner import Attempt, FileResult, LaneFile

register_cpu_ci(est_time=40, labels=["ci", "gpu-lane"])

OTHER_UID = 54321  # neither this user nor root
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to own files as another user")
KEY = cache_key(TorchBuild("2.13.0", cuda="13.0"), ["9.0"], (3, 12))
NAMES = [name for name, _, _ in CACHE_VARIABLES]


@pytest.fixture(scope="module")
def tree(ci_fixtures: Path) -> Path:
    return ci_fixtures / "gpu_lane" / "compile_cache"


@pytest.fixture(scope="module")
def cache_lane(lane, tree: Path, repo_root: Path):
    """``cache_lane(base, *files, env=None, fake_gpus=1)``: the lane over ``tree`` (only ``files``
    when given), its reports, trace, leases and compile cache under ``base``."""

    def run(base: Path, *files: str, env: dict[str, str] | None = None, fake_gpus: int = 1):
        (base / "trace").mkdir(parents=True, exist_ok=True)
        return lane(
            base, "--root", str(tree), "--report-dir", str(base / "r"), "--no-history",
            "--flake-record", str(base / "flakes.jsonl"),
            *(str(tree / "tests" / f) for f in files),
            env=env, fake_gpus=fake_gpus, cwd=repo_root,
        )  # fmt: skip

    return run


def recorded_env(base: Path) -> dict[str, str | None]:
    return json.loads((base / "trace" / "cache-env.json").read_text())


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, cache_lane):
    """Every file of the tree on two pretend GPUs, with a cache of its own."""
    base = tmp_path_factory.mktemp("compile")
    out = cache_lane(base, fake_gpus=2)
    summary = json.loads((base / "r" / "summary.json").read_text())
    return base, out, summary


def test_children_get_the_keyed_cache_variables_and_the_dirs_are_private(full_run):
    base, out, _ = full_run
    assert out.returncode == 0, out.stdout + out.stderr
    key = base / "compile-cache" / KEY
    assert f"compile cache: {key}" in out.stdout
    env = recorded_env(base)
    assert {n: env[n] for n in NAMES} == {
        "TORCHINDUCTOR_CACHE_DIR": str(key / "inductor"),
        "TRITON_CACHE_DIR": str(key / "triton"),
        "CUDA_CACHE_PATH": str(key / "cuda"),
        "PYTHONPYCACHEPREFIX": str(key / "bytecode"),
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
    }
    # the bytecode cache is on in the child's interpreter, and its bytecode went there
    assert env["PYTHONDONTWRITEBYTECODE"] == ""
    assert (env["sys.pycache_prefix"], env["sys.dont_write_bytecode"]) == (
        str(key / "bytecode"),
        False,
    )
    assert any((key / "bytecode").rglob("*.cpython-*.pyc"))
    assert "lifted" not in out.stdout
    for d in (key.parent, key, key / "inductor", key / "triton", key / "cuda", key / "bytecode"):
        st = d.lstat()
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700, d
    assert env["MIZZEN_COMPILE_STATS"].endswith("test_sees_cache_env.py.attempt1.compile.json")


def test_counts_come_back_from_the_children_that_imported_torch(full_run):
    base, _, summary = full_run
    by_file = {Path(f["file"]).name: f for f in summary["files"]}
    stats = by_file["test_fills_counters.py"]["compile_stats"]
    assert {k: v for k, v in stats.items() if k != "recompiles"} == {
        "inductor": {"fxgraph_cache_hit": 2, "fxgraph_cache_miss": 1, "fxgraph_cache_bypass": 0},
        "aot_autograd": {
            "autograd_cache_hit": 1,
            "autograd_cache_miss": 1,
            "autograd_cache_bypass": 1,
        },
    }
    zeros = by_file["test_imports_torch_only.py"]["compile_stats"]
    assert zeros.pop("recompiles") == []
    assert all(v == 0 for group in zeros.values() for v in group.values())
    assert by_file["test_sees_cache_env.py"]["compile_stats"] is None  # never imported torch
    text = (base / "r" / "summary.txt").read_text()
    # file, GPUs (2 words), seconds, GPU-s, share, fx, aot, recompiles, outcome
    rows = {r.split()[0]: r.split() for r in text.splitlines() if r.startswith("tests/test_")}
    assert rows["tests/test_fills_counters.py"][6:9] == ["2/1", "1/1", "2"]
    assert rows["tests/test_imports_torch_only.py"][6:9] == ["0/0", "0/0", "0"]
    assert rows["tests/test_sees_cache_env.py"][6:9] == ["-", "-", "-"]
    # the function recompiled, where, how often and why, from dynamo's own record
    # (three guard failures -- float vs double, then both entries vs int64 -- are two recompiles)
    (recompiled,) = by_file["test_fills_counters.py"]["compile_stats"]["recompiles"]
    assert recompiled["function"] == "doubled" and recompiled["count"] == 2, recompiled
    assert recompiled["where"].startswith("test_fills_counters.py:")
    assert sorted(recompiled["reasons"]) == [
        "tensor 'x' dtype mismatch. expected Double, actual Long",
        "tensor 'x' dtype mismatch. expected Float, actual Double",
        "tensor 'x' dtype mismatch. expected Float, actual Long",
    ]
    assert (
        "Recompiled by torch.compile (each a compile more; dynamo's guard failures):\n"
        f"- tests/test_fills_counters.py: doubled ({recompiled['where']}) recompiled 2 time(s): "
        + " | ".join(recompiled["reasons"])
    ) in text
    assert (
        "compile cache fx 2 hit(s) / 1 miss(es), aot 1 hit(s) / 1 miss(es) in the 2 file(s) "
        "that imported torch" in text
    )
    suites = {
        s.get("name"): {p.get("name"): p.get("value") for p in s.iter("property")}
        for s in ET.parse(base / "r" / "junit.xml").getroot().iter("testsuite")
    }
    props = suites["tests/test_fills_counters.py"]
    assert (props["inductor.fxgraph_cache_hit"], props["aot_autograd.autograd_cache_miss"]) == (
        "2",
        "1",
    )
    assert props["recompiles"] == "2"
    assert "inductor.fxgraph_cache_hit" not in suites["tests/test_sees_cache_env.py"]


def test_a_fifo_left_for_the_counts_is_a_warning_not_a_hang(full_run):
    base, out, summary = full_run
    assert out.returncode == 0, out.stdout + out.stderr
    planted = next(f for f in summary["files"] if f["file"].endswith("fifo_counts.py"))
    assert planted["compile_stats"] is None and planted["outcome"] == "passed"
    warning = planted["attempts"][0]["compile_warning"]
    assert "is a FIFO (named pipe), not a regular file" in warning
    for text in (out.stdout, (base / "r" / "summary.md").read_text()):
        assert "warning" in text and "fifo" in text.lower()
    assert "Traceback" not in out.stdout + out.stderr


def test_the_summary_gpu_seconds_add_up_and_files_are_listed_by_share(full_run):
    base, _, summary = full_run
    files = summary["files"]
    for f in files:
        held = sum(a["seconds"] * len(a["gpus"]) for a in f["attempts"])
        assert f["gpu_seconds"] == pytest.approx(held, abs=0.01)
    assert sum(f["gpu_seconds"] for f in files) == pytest.approx(summary["gpu_seconds"], abs=0.01)
    assert sum(f["share"] for f in files) == pytest.approx(1.0, abs=1e-4)
    text = (base / "r" / "summary.txt").read_text()
    shares = [float(r.split()[5].rstrip("%")) for r in text.splitlines() if r.startswith("tests/")]
    assert shares == sorted(shares, reverse=True) and len(shares) == 4
    assert f"total: {summary['gpu_seconds']:.1f} GPU-seconds over 4 file(s) run" in text


def test_off_gives_the_children_no_cache_variable(tmp_path, cache_lane):
    out = cache_lane(tmp_path, "test_sees_cache_env.py", env={"MIZZEN_COMPILE_CACHE_DIR": "off"})
    assert out.returncode == 0, out.stdout + out.stderr
    env = recorded_env(tmp_path)
    assert all(env[n] is None for n in NAMES), env
    assert "compile cache: off ($MIZZEN_COMPILE_CACHE_DIR=off" in out.stdout
    assert "compile cache: off" in (tmp_path / "r" / "summary.md").read_text().replace("\\", "")
    assert not (tmp_path / "compile-cache").exists()


def test_variables_the_user_set_are_kept_and_named_in_the_summary(tmp_path, cache_lane):
    mine = str(tmp_path / "my-triton")
    out = cache_lane(
        tmp_path,
        "test_sees_cache_env.py",
        env={"TRITON_CACHE_DIR": mine, "TORCHINDUCTOR_FX_GRAPH_CACHE": "0"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    env = recorded_env(tmp_path)
    key = tmp_path / "compile-cache" / KEY
    assert (env["TRITON_CACHE_DIR"], env["TORCHINDUCTOR_FX_GRAPH_CACHE"]) == (mine, "0")
    assert (env["TORCHINDUCTOR_CACHE_DIR"], env["TORCHINDUCTOR_AUTOGRAD_CACHE"]) == (
        str(key / "inductor"),
        "1",
    )
    kept = (
        f"kept from the lane's environment: TRITON_CACHE_DIR={mine}, TORCHINDUCTOR_FX_GRAPH_CACHE=0"
    )
    assert kept in out.stdout and kept in (tmp_path / "r" / "summary.txt").read_text()


def test_an_image_that_stops_bytecode_writes_gets_them_into_the_cache(tmp_path, cache_lane):
    # GPU images often set PYTHONDONTWRITEBYTECODE=1 (and ship no .pyc): the lane lifts it for
    # its children, whose bytecode then goes only to its cache, and says so
    out = cache_lane(tmp_path, "test_sees_cache_env.py", env={"PYTHONDONTWRITEBYTECODE": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    env = recorded_env(tmp_path)
    key = tmp_path / "compile-cache" / KEY
    assert (env["PYTHONDONTWRITEBYTECODE"], env["sys.dont_write_bytecode"]) == ("", False)
    assert env["sys.pycache_prefix"] == str(key / "bytecode")
    assert any((key / "bytecode").rglob("*.cpython-*.pyc"))
    lifted = (
        "lifted for the children (their bytecode goes to the cache only): PYTHONDONTWRITEBYTECODE=1"
    )
    assert lifted in out.stdout and lifted in (tmp_path / "r" / "summary.txt").read_text()
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["compile_cache"]["lifted"] == {"PYTHONDONTWRITEBYTECODE": "1"}


def test_a_bytecode_prefix_the_user_set_keeps_their_switch_too(tmp_path, cache_lane):
    mine = str(tmp_path / "my-pyc")
    out = cache_lane(
        tmp_path,
        "test_sees_cache_env.py",
        env={"PYTHONPYCACHEPREFIX": mine, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    env = recorded_env(tmp_path)
    assert (env["PYTHONPYCACHEPREFIX"], env["PYTHONDONTWRITEBYTECODE"]) == (mine, "1")
    assert (env["sys.pycache_prefix"], env["sys.dont_write_bytecode"]) == (mine, True)
    assert f"kept from the lane's environment: PYTHONPYCACHEPREFIX={mine}" in out.stdout
    assert "lifted" not in out.stdout


def _symlinked_root(base: Path) -> tuple[Path, str]:
    real = base / "real"
    real.mkdir(mode=0o700)
    (base / "link").symlink_to(real, target_is_directory=True)
    return base / "link", "is a symbolic link, not a directory"


def _symlinked_key(base: Path) -> tuple[Path, str]:
    root = base / "cache"
    root.mkdir(mode=0o700)
    elsewhere = base / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (root / KEY).symlink_to(elsewhere, target_is_directory=True)
    return root, "is a symbolic link, not a directory"


def _foreign_root(base: Path) -> tuple[Path, str]:
    root = base / "cache"
    root.mkdir(mode=0o700)
    os.chown(root, OTHER_UID, OTHER_UID)
    return root, f"is owned by uid {OTHER_UID}, not this user ({os.geteuid()})"


def _foreign_key(base: Path) -> tuple[Path, str]:
    root = base / "cache"
    root.mkdir(mode=0o700)
    (root / KEY).mkdir(mode=0o700)
    os.chown(root / KEY, OTHER_UID, OTHER_UID)
    return root, f"is owned by uid {OTHER_UID}, not this user ({os.geteuid()})"


def _symlinked_bytecode(base: Path) -> tuple[Path, str]:
    """A link planted as a cache directory of the key (e.g. one a copy of the cache carried)."""
    root = base / "cache"
    (root / KEY).mkdir(mode=0o700, parents=True)
    root.chmod(0o700)
    elsewhere = base / "shared-bytecode"
    elsewhere.mkdir(mode=0o700)
    (root / KEY / "bytecode").symlink_to(elsewhere, target_is_directory=True)
    return root, "is a symbolic link, not a directory"


def _world_writable_root(base: Path) -> tuple[Path, str]:
    root = base / "cache"
    root.mkdir()
    root.chmod(0o1777)  # the sticky bit does not make a code cache shareable
    return root, "is group- or world-writable (mode 1777)"


def _group_writable_key(base: Path) -> tuple[Path, str]:
    root = base / "cache"
    root.mkdir(mode=0o700)
    (root / KEY).mkdir()
    (root / KEY).chmod(0o770)
    return root, "is group- or world-writable (mode 770)"


@pytest.mark.parametrize(
    "plant",
    [
        _symlinked_root,
        _symlinked_key,
        _symlinked_bytecode,
        pytest.param(_foreign_root, marks=as_root),
        pytest.param(_foreign_key, marks=as_root),
        _world_writable_root,
        _group_writable_key,
    ],
    ids=lambda f: f.__name__.strip("_"),
)
def test_an_unsafe_cache_dir_refuses_the_lane_in_one_line_before_anything_runs(
    tmp_path, cache_lane, plant
):
    root, problem = plant(tmp_path)
    refused = {"key": root / KEY, "bytecode": root / KEY / "bytecode"}.get(
        plant.__name__.rsplit("_", 1)[-1], root
    )
    out = cache_lane(
        tmp_path, "test_sees_cache_env.py", env={"MIZZEN_COMPILE_CACHE_DIR": str(root)}
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"mizzen-ci gpu-lane hopper: compile cache: {refused} {problem}")
    assert "Fix: " in lines[0] and "MIZZEN_COMPILE_CACHE_DIR=off" in lines[0]
    assert not (tmp_path / "trace" / "cache-env.json").exists()


def test_without_torch_there_is_no_cache_and_the_summary_says_why(tmp_path):
    cache = configure(
        {"MIZZEN_COMPILE_CACHE_DIR": str(tmp_path / "c")}, ["9.0"], torch=lambda: None
    )
    assert (cache.directory, dict(cache.env)) == (None, {})
    assert cache.describe().startswith("compile cache: none (torch is not installed for ")
    assert not (tmp_path / "c").exists()


def test_the_default_root_follows_xdg_cache_home_and_the_key_names_the_build(tmp_path):
    build = TorchBuild("2.11.0+cu130", cuda="13.0")
    cache = configure({"XDG_CACHE_HOME": str(tmp_path)}, ["9.0"], torch=lambda: build)
    py = f"py{sys.version_info[0]}{sys.version_info[1]}"
    assert cache.directory == tmp_path / "mizzen-ci" / "compile" / f"torch-2.11.0+cu130-sm90-{py}"
    assert cache_key(TorchBuild("2.13.0", cuda="12.8"), ["10.3", "10.0"], (3, 12)) == (
        "torch-2.13.0+cu128-sm100_103-py312"
    )
    assert cache_key(TorchBuild("2.5.0", hip="6.2.41133-dd7f95766"), ["9.0"], (3, 12)) == (
        "torch-2.5.0+rocm6.2-sm90-py312"
    )
    odd = cache_key(TorchBuild("../../etc/x\n"), ["9.0"], (3, 12))  # one path component
    assert odd.startswith("torch-") and odd.endswith("etc_x_-sm90-py312")
    assert "/" not in odd and ".." not in odd


def test_a_refusal_is_a_lane_refusal(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c").chmod(0o777)
    with pytest.raises(CompileCacheError, match="chmod go-w"):
        configure(
            {"MIZZEN_COMPILE_CACHE_DIR": str(tmp_path / "c")},
            ["9.0"],
            torch=lambda: TorchBuild("2.13.0"),
        )


# --------------------------------------------------------------------------------------------
# Counts files as a hostile child leaves them


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _link(path: Path) -> None:
    target = path.with_name("target.json")
    target.write_text('{"inductor": {"fxgraph_cache_hit": 1}}')
    path.symlink_to(target)


HOSTILE = {
    "huge": (b'{"inductor": {"fxgraph_cache_hit": 1}}' + b" " * MAX_STATS_BYTES, "over the"),
    "fifo": (_fifo, "is a FIFO (named pipe)"),
    "symlink": (_link, "is a symbolic link"),
    "a list": (b"[1, 2]", "is a JSON list, not an object"),
    "unknown group": (b'{"dynamo": {}}', "has 'dynamo'"),
    "group not an object": (b'{"inductor": 3}', "has 'inductor'"),
    "unknown counter": (b'{"inductor": {"ok": 1}}', "which torch does not count"),
    "string count": (b'{"inductor": {"fxgraph_cache_hit": "1"}}', "not a whole number"),
    "bool count": (b'{"inductor": {"fxgraph_cache_hit": true}}', "not a whole number"),
    "negative": (b'{"inductor": {"fxgraph_cache_hit": -1}}', "not a whole number"),
    "too big": (b'{"inductor": {"fxgraph_cache_hit": 10000000000}}', "not a whole number"),
    "float": (b'{"inductor": {"fxgraph_cache_hit": 1.5}}', "not a whole number"),
    "NaN": (b'{"inductor": {"fxgraph_cache_hit": NaN}}', "holds NaN"),
    "Infinity": (b'{"aot_autograd": {"autograd_cache_miss": -Infinity}}', "holds -Infinity"),
    "1e999": (b'{"inductor": {"fxgraph_cache_hit": 1e999}}', "= inf, not a whole number"),
    "9 * 5000": (b'{"inductor": {"fxgraph_cache_hit": ' + b"9" * 5000 + b"}}", "not valid JSON"),
    "deep": (b"[" * 60000, "not valid JSON"),
    "not UTF-8": (b'{"inductor": {"\xff": 1}}', "not valid JSON"),
    "not JSON": (b"hits=3", "not valid JSON"),
    "recompiles not a list": (b'{"recompiles": {"f": 1}}', "not a list of at most 16"),
    "too many recompiles": (
        b'{"recompiles": ['
        + b",".join([b'{"function": "f", "where": "a:1", "count": 1, "reasons": []}'] * 17)
        + b"]}",
        "not a list of at most 16",
    ),
    "recompile missing a key": (
        b'{"recompiles": [{"function": "f", "where": "a:1", "count": 1}]}',
        "recompiles[0] that is not an object of function, where, count, reasons",
    ),
    "recompile extra key": (
        b'{"recompiles": [{"function": "f", "where": "a:1", "count": 1, "reasons": [], "x": 1}]}',
        "recompiles[0] that is not an object",
    ),
    "recompile name too long": (
        b'{"recompiles": [{"function": "'
        + b"f" * 201
        + b'", "where": "a:1", "count": 1, "reasons": []}]}',
        "recompiles[0].function or .where not a string",
    ),
    "recompile count a string": (
        b'{"recompiles": [{"function": "f", "where": "a:1", "count": "2", "reasons": []}]}',
        "recompiles[0].count = 2, not a whole number",
    ),
    "recompile reason too long": (
        b'{"recompiles": [{"function": "f", "where": "a:1", "count": 1, "reasons": ["'
        + b"r" * 241
        + b'"]}]}',
        "recompiles[0].reasons not a list of at most 3 one-line strings",
    ),
    "recompile reason of two lines": (
        b'{"recompiles": [{"function": "f", "where": "a:1", "count": 1, "reasons": ["a\\nb"]}]}',
        "recompiles[0].reasons not a list of at most 3 one-line strings",
    ),
    "recompile count -1": (
        b'{"recompiles": [{"function": "f", "where": "a:1", "count": -1, "reasons": []}]}',
        "recompiles[0].count = -1, not a whole number in [0,",
    ),
    "repeated key": (b'{"recompiles": 5, "recompiles": []}', "repeats a key"),
    "repeated counter": (
        b'{"inductor": {"fxgraph_cache_hit": 1, "fxgraph_cache_hit": 2}}',
        "repeats a key",
    ),
    "recompile reasons not strings": (
        b'{"recompiles": [{"function": "f", "where": "a:1", "count": 1, "reasons": [1]}]}',
        "recompiles[0].reasons not a list",
    ),
}


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_a_hostile_counts_file_is_a_warning(tmp_path, deadline, kind):
    content, expected = HOSTILE[kind]
    path = tmp_path / "x.compile.json"
    if callable(content):
        content(path)
    else:
        path.write_bytes(content)
    with deadline(5):
        stats, warning = read_stats(path)
    assert stats is None
    assert warning is not None and expected in warning and str(path) in warning, warning


def test_a_good_counts_file_and_a_missing_one(tmp_path):
    path = tmp_path / "x.compile.json"
    assert read_stats(path) == (None, None)  # the child never imported torch
    path.write_text('{"inductor": {"fxgraph_cache_hit": 3}, "aot_autograd": {}}')
    stats, warning = read_stats(path)
    assert warning is None
    assert stats.as_json()["inductor"] == {
        "fxgraph_cache_hit": 3,
        "fxgraph_cache_miss": 0,
        "fxgraph_cache_bypass": 0,
    }
    assert stats.recompiles == () and stats.as_json()["recompiles"] == []
    # recompiles as a child writes them; a reason with markup or control characters is kept as
    # text here and escaped by each medium of the summary
    entry = {"function": "ssd", "where": "ssd.py:105", "count": 3, "reasons": ["a\x1b[31m", "b"]}
    path.write_text(json.dumps({"inductor": {}, "recompiles": [entry]}))
    stats, warning = read_stats(path)
    assert warning is None and stats.recompiled == 3
    assert stats.as_json()["recompiles"] == [entry]


# --------------------------------------------------------------------------------------------
# GPU-seconds from known attempts


def _attempt(number: int, gpus: int, seconds: float, outcome: str = "passed") -> Attempt:
    held = tuple(Gpu(i, "9.0", "fake", f"FAKE-{i}") for i in range(gpus))
    return Attempt(number, held, seconds, outcome, "", None, None)


def test_gpu_seconds_count_every_attempt_and_the_shares_add_up(tmp_path):
    wide = FileResult(LaneFile("tests/a_wide.py", "tests/a_wide.py", 2, 10), [_attempt(1, 2, 10.0)])
    retried = FileResult(
        LaneFile("tests/b_retried.py", "tests/b_retried.py", 1, 5),
        [_attempt(1, 1, 3.0, "failed"), _attempt(2, 1, 2.0)],
    )
    small = FileResult(
        LaneFile("tests/c_small.py", "tests/c_small.py", 1, 5), [_attempt(1, 1, 15.0)]
    )
    outcome = LaneOutcome("hopper", None, [wide, retried, small], [], [], [], False)
    assert write_reports(outcome, tmp_path, tmp_path / "flakes.jsonl", None) == 0
    text = (tmp_path / "summary.txt").read_text()
    rows = [line.split() for line in text.splitlines() if line.startswith("tests/")]
    # file, GPUs (2 words), seconds, GPU-s, share, fx, aot, outcome
    assert [(r[0], r[3], r[4], r[5]) for r in rows] == [
        ("tests/a_wide.py", "10.0", "20.0", "50.0%"),
        ("tests/c_small.py", "15.0", "15.0", "37.5%"),
        ("tests/b_retried.py", "2.0", "5.0", "12.5%"),  # both attempts held the GPU
    ]
    assert "total: 40.0 GPU-seconds over 3 file(s) run" in text
    md = (tmp_path / "summary.md").read_text()
    assert "| GPU\\-s | share |" in md and "| 20\\.0 | 50\\.0\\% |" in md
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [f["share"] for f in summary["files"]] == [0.5, 0.375, 0.125]
    assert summary["gpu_seconds"] == 40.0
    suites = {
        s.get("name"): {p.get("name"): p.get("value") for p in s.iter("property")}
        for s in ET.parse(tmp_path / "junit.xml").getroot().iter("testsuite")
    }
    assert suites["tests/b_retried.py"]["gpu_seconds"] == "5.000"
    assert suites["tests/b_retried.py"]["gpu_seconds_share"] == "0.1250"


def test_a_sharing_file_that_ran_alone_is_charged_and_shown_as_alone(tmp_path):
    """Three files that may share GPU 0: a (0-10 s) and b (5-15 s) overlap for 5 s; c runs alone
    later (20-30 s).  a and b split the overlap; c pays its own 10 s and is not called shared."""

    def sharing(key: str, start: float) -> FileResult:
        attempt = _attempt(1, 1, 10.0)
        attempt.started, attempt.sharing = start, True
        return FileResult(LaneFile(key, key, 1, 10, shares_gpu=True), [attempt])

    results = [sharing("tests/a.py", 0.0), sharing("tests/b.py", 5.0), sharing("tests/c.py", 20.0)]
    outcome = LaneOutcome("hopper", None, results, [], [], [], False)
    assert write_reports(outcome, tmp_path, tmp_path / "flakes.jsonl", None) == 0
    text = (tmp_path / "summary.txt").read_text()
    rows = {line.split()[0]: line for line in text.splitlines() if line.startswith("tests/")}
    assert "(0, shared)" in rows["tests/a.py"] and "(0, shared)" in rows["tests/b.py"]
    assert "(0)" in rows["tests/c.py"] and "shared" not in rows["tests/c.py"]
    assert [outcome.gpu_seconds_of(r) for r in results] == [7.5, 7.5, 10.0]
    assert "total: 25.0 GPU-seconds over 3 file(s) run" in text
    assert "2 file(s) shared a GPU" in text


# --------------------------------------------------------------------------------------------
# Recompiles from dynamo's record of failed guards (synthetic records: the shapes torch keeps)


def _code(name: str, line: int = 7):
    """A stand-in for the code object dynamo keys its record by (hashable, as code objects are)."""
    attributes = {"co_name": name, "co_filename": f"/src/{name}.py", "co_firstlineno": line}
    return type("Code", (), attributes)()


def test_recompiles_are_the_distinct_entries_that_failed_and_the_limit_is_named():
    scan, loss = _code("scan"), _code("loss")
    failures = {
        # entry 0 failed, then 0 and 1 (two recompiles); the second line is dynamo's user stack
        scan: ["0/0: tensor 'A' requires_grad mismatch\nUser stack trace:\n  ...",
               "0/0: size guard s0 >= 4096", "0/1: size guard s0 >= 4096"],
        # at the limit (3) every entry failed: two recompiles, then calls ran uncompiled
        loss: ["1/0: dtype mismatch", "1/0: dtype mismatch", "1/1: dtype mismatch",
               "1/0: dtype mismatch", "1/1: dtype mismatch", "1/2: dtype mismatch"],
    }  # fmt: skip
    assert _recompiles(failures, 3) == [
        {"function": "loss", "where": "loss.py:7", "count": 2,
         "reasons": ["hit torch._dynamo.config.recompile_limit (3): later calls ran uncompiled",
                     "dtype mismatch"]},
        {"function": "scan", "where": "scan.py:7", "count": 2,
         "reasons": ["tensor 'A' requires_grad mismatch", "size guard s0 >= 4096"]},
    ]  # fmt: skip
    below = _recompiles(failures, 8)  # under a higher limit: three recompiles, no limit named
    assert below[0]["count"] == 3 and below[0]["reasons"] == ["dtype mismatch"]
    # recompile_limit = 1: no recompile allowed, the first failure already ran uncompiled
    (none,) = _recompiles({_code("k"): ["0/0: size mismatch"]}, 1)
    assert none["count"] == 0 and none["reasons"][0].startswith("hit torch._dynamo.config")


def test_recompile_records_are_bounded_and_odd_shapes_are_skipped():
    many = {_code(f"f{i}", i): [f"0/{j}: r{j}" for j in range(i % 5 + 1)] for i in range(40)}
    got = _recompiles(many, 8)
    assert len(got) == MAX_RECOMPILED and [r["count"] for r in got][:3] == [5, 5, 5]
    assert all(len(r["reasons"]) <= 3 for r in got)
    long = _recompiles({_code("g"): ["0/0: " + "x" * 1000]}, 8)
    assert long[0]["reasons"] == ["x" * MAX_REASON_CHARS]
    # torch's private record in another shape: nothing, never an exception
    assert _recompiles(None, 8) == [] and _recompiles(["0/0: r"], 8) == []
    assert _recompiles({_code("h"): "0/0: a string, not a list"}, 8) == []
    assert _recompiles({_code("h"): [None, "no id here"]}, 8) == []


def test_a_guard_record_that_breaks_costs_the_recompiles_not_the_counts():
    import types

    class Broken(dict):
        def items(self):
            raise RuntimeError("torch changed")

    counters = {"inductor": {"fxgraph_cache_hit": 4}}
    utils = types.SimpleNamespace(counters=counters, guard_failures=Broken(x=1))
    stats = child_stats({"torch": object(), "torch._dynamo.utils": utils})
    assert stats["inductor"]["fxgraph_cache_hit"] == 4 and stats["recompiles"] == []


def test_a_hostile_recompile_is_escaped_in_every_summary_medium():
    hostile = Recompile(
        "::error::fn", "x.py:1\x1b]0;title\x07", 3,
        ("a\u202eb ##[group]x [l](http://e) @team", "::warning file=a::b", "<script>"),
    )  # fmt: skip
    row = SummaryRow("tests/test_x.py", "1 (0)", 1.0, "passed", True, 1.0, 1.0,
                     CompileStats({}, (hostile,)))  # fmt: skip
    for markdown in (False, True):
        text = summary_tables([row], [], {}, markdown=markdown)
        assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text
        assert not any(line.lstrip("- ").startswith("::") for line in text.splitlines())
        assert "##[group]" not in text
        assert "recompiled 3 time" in text
    markdown = summary_tables([row], [], {}, markdown=True)
    assert "<script>" not in markdown and "\\<script\\>" in markdown


# --------------------------------------------------------------------------------------------
# Properties: any counts file, any guard record


def _json_values():
    from hypothesis import strategies as st

    leaves = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=300)
    return st.recursive(
        leaves,
        lambda inner: st.lists(inner, max_size=20) | st.dictionaries(st.text(max_size=30), inner),
        max_leaves=60,
    )


def _recompile_entries():
    from hypothesis import strategies as st

    text = st.text(max_size=260)
    entry = st.fixed_dictionaries(
        {"function": text, "where": text, "count": st.integers(-2, 2 * 10**9),
         "reasons": st.lists(text, max_size=5)}
    )  # fmt: skip
    return st.lists(entry, max_size=20)


def _check_read_back(stats, warning, path) -> None:
    assert (stats is None) != (warning is None), (stats, warning)
    if warning is not None:
        assert str(path) in warning
    if stats is not None:
        assert len(stats.recompiles) <= MAX_RECOMPILED
        for rc in stats.recompiles:
            assert 0 <= rc.count <= 10**9 and len(rc.reasons) <= 3
            assert len(rc.function) <= 200 and len(rc.where) <= 200
            assert all(len(r) <= MAX_REASON_CHARS and "\n" not in r for r in rc.reasons)


def test_any_counts_file_is_read_back_bounded_or_refused(tmp_path_factory):
    """Whatever JSON a child leaves (arbitrary values, or a recompiles list of any entries), the
    reader returns bounded counts or one warning naming the file; it never raises."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    base = tmp_path_factory.mktemp("any-counts")
    anything = _json_values() | st.fixed_dictionaries(
        {"inductor": st.just({"fxgraph_cache_hit": 1}), "recompiles": _recompile_entries()}
    )

    @settings(max_examples=300, deadline=None)
    @given(anything)
    def check(value):
        path = base / "x.compile.json"
        path.write_text(json.dumps(value))
        stats, warning = read_stats(path)
        _check_read_back(stats, warning, path)

    check()


def test_any_guard_record_gives_records_the_reader_accepts(tmp_path_factory):
    """Whatever dynamo's record holds (any reason texts, any number of entries and failures, any
    limit), what a child writes from it is accepted by the lane's reader and bounded."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    base = tmp_path_factory.mktemp("any-record")
    failure = st.tuples(st.integers(0, 12), st.text(max_size=400)).map(
        lambda t: f"0/{t[0]}: {t[1]}"
    )
    record = st.dictionaries(
        st.sampled_from([_code(f"f{i}", i) for i in range(30)]),
        st.lists(failure | st.text(max_size=20), max_size=30),
        max_size=30,
    )

    @settings(max_examples=200, deadline=None)
    @given(record, st.none() | st.integers(-1, 12))
    def check(guard_failures, limit):
        written = _recompiles(guard_failures, limit)
        path = base / "x.compile.json"
        path.write_text(json.dumps({"inductor": {}, "recompiles": written}))
        stats, warning = read_stats(path)
        assert warning is None, warning
        _check_read_back(stats, warning, path)

    check()
