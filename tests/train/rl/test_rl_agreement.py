"""RL's writer-only steps are agreed by every rank: two real gloo ranks (subprocesses) run the
real :meth:`RlTrainer._publish` with its export or its engine load failing on one rank; every
rank fails (the failing one with its own error, the other with ``RankFailed``) and both are still
in step afterwards (one more collective pairs up), instead of the other rank dying in a
collective the failed one never reached."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=30, labels=["train", "distributed", "rollout"])

RANK_SCRIPT = r"""
import asyncio, datetime, json, os, sys
from pathlib import Path
import torch
from mizzen_train.rl.trainer import RlTrainer
from mizzen_train.run.parallel import RankWorld, WorldPlan

rank, scenario, root = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
torch.distributed.init_process_group("gloo", rank=rank, world_size=2,
                                     timeout=datetime.timedelta(seconds=60))
trainer = RlTrainer.__new__(RlTrainer)
trainer.world = RankWorld(WorldPlan(rank, rank, 2, 1, 1, 60.0, True), "cpu")
trainer.run_dir, trainer.versions, trainer.published = root, {"t": 3}, {}
loaded = []

def export_snapshot(version, tenant, directory):
    torch.distributed.barrier()  # the export's collectives, on every rank
    if scenario == f"export fails on rank {rank}":
        raise OSError(28, "No space left on device")
    if rank == 0:
        directory.mkdir(parents=True)

async def load_published(tenant, ref):
    if scenario == "engine refuses":
        raise RuntimeError("the engine refused the adapter")
    if scenario == "engine load cancelled":
        raise asyncio.CancelledError()  # e.g. the engine manager shutting down mid-load
    loaded.append(ref.name)

trainer.export_snapshot, trainer._load_published = export_snapshot, load_published
try:
    asyncio.run(trainer._publish("t"))
    outcome = "published"
except BaseException as exc:  # a cancellation too: it must be agreed like any failure
    outcome = f"{type(exc).__name__}: {exc}"
after = [None, None]
torch.distributed.all_gather_object(after, rank)  # both ranks still in step
torch.distributed.destroy_process_group()
print(json.dumps({"outcome": outcome, "after": after, "loaded": loaded}))
"""


def _run_two_ranks(tmp_path, scenario: str) -> list[dict]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    argv = [sys.executable, "-c", RANK_SCRIPT, "RANK", scenario, str(tmp_path / "run")]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "env": env, "text": True}
    ranks = [subprocess.Popen([a.replace("RANK", str(r)) for a in argv], **pipes) for r in (0, 1)]
    results = []
    try:
        for process in ranks:
            out, err = process.communicate(timeout=120)
            assert process.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for process in ranks:
            process.kill()
    assert all(r["after"] == [0, 1] for r in results), results
    return results


@pytest.mark.parametrize(
    ("scenario", "failing", "error"),
    [
        ("engine refuses", 0, "RuntimeError: the engine refused the adapter"),
        ("engine load cancelled", 0, "CancelledError: "),
        ("export fails on rank 0", 0, "OSError: [Errno 28] No space left on device"),
        ("export fails on rank 1", 1, "OSError: [Errno 28] No space left on device"),
    ],
)
def test_a_step_that_fails_on_one_rank_fails_every_rank_in_step(tmp_path, scenario, failing, error):
    results = _run_two_ranks(tmp_path, scenario)
    assert results[failing]["outcome"] == error, results
    other = results[1 - failing]["outcome"]
    assert other.startswith(f"RankFailed: rank {failing} failed: {error}"), results
    assert results[0]["loaded"] == [], results  # nothing loaded into the engines


def test_a_publish_that_succeeds_loads_on_the_writer_alone(tmp_path):
    results = _run_two_ranks(tmp_path, "no failure")
    assert [r["outcome"] for r in results] == ["published", "published"], results
    assert [r["loaded"] for r in results] == [["t@v3"], []], results


def test_a_cancelled_rollout_is_a_failure_to_agree_on_a_cancelled_step_is_not():
    """The step awaits its rollout through ``_outcome``: a rollout cancelled on its own (an
    engine shut down under it) comes back as a value, which every rank then agrees on; when the
    step itself is cancelled, the cancellation propagates."""
    import asyncio

    from mizzen_train.rl.trainer import _outcome

    async def scenario():
        rollout = asyncio.ensure_future(asyncio.sleep(10))
        await asyncio.sleep(0)
        rollout.cancel()
        assert isinstance(await _outcome(rollout), asyncio.CancelledError)
        step = asyncio.ensure_future(_outcome(asyncio.ensure_future(asyncio.sleep(10))))
        await asyncio.sleep(0)
        step.cancel()
        with pytest.raises(asyncio.CancelledError):
            await step

    asyncio.run(scenario())
