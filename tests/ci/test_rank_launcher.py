"""The one multi-rank launcher (the ``run_ranks`` fixture of ``tests/conftest.py``), on gloo.

Both ways to start ranks run here on the CPU: forked ranks (what the CPU tests use) and spawned
ranks (what the NCCL tests use on GPUs; here with gloo, so the path a GPU lane takes is checked
before it reaches one).  Checked: results by value in rank order, one intra-op thread per rank
even after this process started an OpenMP pool, the per-rank ``setup``, every failed rank's
traceback, killing a rank that is still running once another failed, the timeout, and the
errors for what cannot be done.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=30, labels=["ci", "distributed"])

SET_UP: list[str] = []  # what `setup` did in this process (a rank's own copy)


def _mark_set_up() -> None:
    SET_UP.append(f"rank {torch.distributed.get_rank()} set up")


def _report(scale: float) -> dict:
    """A rank's view: who it is, its threads, its set-up, an all-reduce and a tensor by value."""
    import torch.distributed as dist

    rank = dist.get_rank()
    summed = torch.tensor([float(rank + 1)])
    dist.all_reduce(summed)
    product = torch.randn(200, 200, generator=torch.Generator().manual_seed(rank))
    return {
        "rank": rank,
        "world": dist.get_world_size(),
        "threads": torch.get_num_threads(),
        "set_up": list(SET_UP),
        "sum": float(summed),
        "tensor": (product @ product).sum() * scale,  # a kernel: hangs if the fork broke OpenMP
        "module": __name__,
        "pid": os.getpid(),
    }


def _every_rank_fails() -> None:
    raise ValueError(f"planted failure on rank {torch.distributed.get_rank()}")


def _rank_one_fails_rank_zero_never_ends() -> None:
    if torch.distributed.get_rank() == 1:
        raise ValueError("planted failure on rank 1")
    _hang()


def _hang() -> None:
    import time

    time.sleep(600)


def _expected_tensor(rank: int, scale: float) -> torch.Tensor:
    product = torch.randn(200, 200, generator=torch.Generator().manual_seed(rank))
    return (product @ product).sum() * scale


def test_forked_ranks_after_this_process_ran_parallel_kernels(run_ranks):
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        big = torch.randn(600, 600)
        (big @ big).sum()  # this process now has an OpenMP pool that forked ranks inherit
    finally:
        torch.set_num_threads(threads)
    local = "closure"  # forked ranks take closures and anything else, by inheritance

    def setup() -> None:
        _mark_set_up()
        SET_UP.append(local)

    results = run_ranks(_report, world_size=2, args=(2.0,), setup=setup, timeout=60)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["world"] == 2 and r["threads"] == 1 and r["sum"] == 3.0
        assert r["set_up"] == [f"rank {r['rank']} set up", "closure"]
        assert r["pid"] != os.getpid() and r["module"] == __name__
        torch.testing.assert_close(r["tensor"], _expected_tensor(r["rank"], 2.0))
    assert SET_UP == []  # the set-up ran in the ranks, not here
    assert not torch.distributed.is_initialized()


def test_spawned_ranks_load_the_function_by_path_and_run_the_same_protocol(run_ranks):
    results = run_ranks(
        _report, world_size=2, args=(0.5,), setup=_mark_set_up, start="spawn", timeout=120
    )
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["world"] == 2 and r["threads"] == 1 and r["sum"] == 3.0
        assert r["set_up"] == [f"rank {r['rank']} set up"]
        assert r["module"].startswith("mizzen_rank_target_")  # this file, loaded by path
        torch.testing.assert_close(r["tensor"], _expected_tensor(r["rank"], 0.5))


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_every_failed_rank_is_reported_with_its_traceback(run_ranks, start):
    with pytest.raises(AssertionError) as failed:
        run_ranks(_every_rank_fails, world_size=2, start=start, timeout=120)
    message = str(failed.value)
    assert message.startswith("distributed scenario failed:\n--- rank 0 ---\n")
    rank0, rank1 = message.split("--- rank 1 ---")
    for rank, text in enumerate((rank0, rank1)):
        assert "Traceback (most recent call last)" in text
        assert 'raise ValueError(f"planted failure on rank' in text
        assert f"ValueError: planted failure on rank {rank}" in text


def test_a_rank_still_running_after_another_failed_is_killed(run_ranks):
    with pytest.raises(AssertionError) as failed:
        run_ranks(_rank_one_fails_rank_zero_never_ends, world_size=2, timeout=120)
    rank0, rank1 = str(failed.value).split("--- rank 1 ---")
    assert rank0.endswith("--- rank 0 ---\nstill running 10 s after another rank failed; killed\n")
    assert "ValueError: planted failure on rank 1" in rank1


def test_ranks_still_running_at_the_timeout_are_killed_and_reported(run_ranks):
    with pytest.raises(AssertionError) as failed:
        run_ranks(_hang, world_size=2, timeout=3)
    message = str(failed.value)
    for rank in (0, 1):
        assert f"--- rank {rank} ---\nno result within 3 s; killed" in message


def test_what_cannot_be_done_is_refused_before_any_rank_starts(run_ranks):
    with pytest.raises(ValueError, match="nccl needs start='spawn'"):
        run_ranks(_report, world_size=2, backend="nccl", start="fork")
    with pytest.raises(ValueError, match="expected a backend of"):
        run_ranks(_report, world_size=2, backend="mpi")
    with pytest.raises(ValueError, match="world_size >= 1"):
        run_ranks(_report, world_size=0)
    with pytest.raises(TypeError, match="is not a module-level function"):
        run_ranks(lambda: None, world_size=1, start="spawn")
    with pytest.raises(TypeError, match=r"setup .* is not a module-level function"):
        run_ranks(_report, world_size=1, setup=lambda: None, start="spawn")


PLANTED_LOCK = __import__("threading").Lock()


def _take_the_planted_lock() -> None:
    with PLANTED_LOCK:
        pass


def test_a_rank_hung_on_a_lock_a_thread_held_at_the_fork_names_that_thread(run_ranks):
    import threading

    stop = threading.Event()

    def hold() -> None:
        with PLANTED_LOCK:
            stop.wait()

    thread = threading.Thread(target=hold, name="planted-lock-holder", daemon=True)
    thread.start()
    try:
        with pytest.raises(AssertionError) as hung:
            run_ranks(_take_the_planted_lock, world_size=1, timeout=3)
    finally:
        stop.set()
        thread.join()
    message = str(hung.value)
    assert "no result within 3 s; killed" in message
    held = message[message.index("this pytest process had threads") :]
    assert "'planted-lock-holder'" in held and "when it forked the ranks" in held, message
    assert "pytest.mark.in_child" in message
    assert run_ranks(_take_the_planted_lock, world_size=1) == [None]  # the thread is gone


@pytest.mark.in_child  # the group lives and dies in a child: this process forks ranks later
def test_forking_ranks_beside_a_live_process_group_is_refused_at_once(run_ranks, tmp_path):
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1
    )
    try:
        with pytest.raises(RuntimeError, match=r"holds a default process group.*in_child"):
            run_ranks(_report, world_size=1, args=(1.0,))
    finally:
        torch.distributed.destroy_process_group()


IN_CHILD_TESTS = """
import threading, time
import pytest

@pytest.mark.in_child
def test_a_body_that_leaves_a_thread_running():
    threading.Thread(target=time.sleep, args=(600,), name="left-running", daemon=True).start()

def test_the_pytest_process_has_no_thread_left_and_forks_ranks(run_ranks):
    assert [t.name for t in threading.enumerate()] == ["MainThread"]
    assert run_ranks(_one, world_size=1) == [1]

def _one():
    return 1

@pytest.mark.in_child
def test_a_failing_body_reports_its_traceback():
    assert 1 + 1 == 3, "planted failure in the child"
"""


def test_an_in_child_body_leaves_no_thread_and_its_failure_comes_back(pytester):
    """The ``in_child`` marker of tests/conftest.py, run by a real pytest on that conftest."""
    pytester.makeconftest((Path(__file__).parents[1] / "conftest.py").read_text())
    pytester.makepyfile(test_in_child=IN_CHILD_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:randomly", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(
        ["*in the test's child process:*", "*planted failure in the child*"]
    )
