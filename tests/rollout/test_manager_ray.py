"""The rollout manager on a local Ray cluster: two embedded engine workers, one killed mid-batch.

Every sample comes back exactly once, the requests of the dead engine are re-issued with the same
ids, the death is reported, the dead engine's server does not outlive it, and the engine is
restarted and serves again.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_rollout.data import PromptRecord
from mizzen_rollout.engines import SamplingParams
from mizzen_rollout.manager import EngineSpec, RolloutManager
from mizzen_rollout.rollout import RolloutConfig
from mizzen_rollout.samples import SampleStatus

register_cpu_ci(est_time=75, labels=["ray", "rollout", "engine"])


def _gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def manager():
    os.environ["RAY_AUTH_MODE"] = "disabled"
    specs = [EngineSpec(num_cpus=0.5), EngineSpec(num_cpus=0.5)]
    with RolloutManager(specs, num_cpus=2) as m:
        yield m


def test_engine_killed_mid_batch_loses_and_duplicates_nothing(manager):
    import ray

    prompts = [PromptRecord(i, f"prompt number {i}") for i in range(6)]
    config = RolloutConfig(
        n_samples=4, sampling=SamplingParams(max_new_tokens=48, ignore_eos=True, seed=3)
    )
    victim = manager.engine_info(0)
    done = []

    async def batch_with_a_kill():
        task = asyncio.create_task(
            manager.agenerate_groups(prompts, config, batch_id="ray1", on_sample=done.append)
        )
        while not (len(done) >= 2 and manager.outstanding[0] > 0):
            if task.done():
                pytest.fail("the batch finished before engine 0 could be killed mid-batch")
            await asyncio.sleep(0.005)
        in_flight_on_victim = manager.outstanding[0]
        ray.kill(manager.engine_handle(0))
        return in_flight_on_victim, await task

    in_flight, batch = asyncio.run(batch_with_a_kill())
    assert in_flight > 0

    samples = batch.samples
    ids = [s.request_id for s in samples]
    assert len(samples) == 24 and len(set(ids)) == 24
    assert sorted((s.group_index, s.index_in_group) for s in samples) == [
        (g, i) for g in range(6) for i in range(4)
    ]
    assert all(s.status is SampleStatus.TRUNCATED for s in samples), [s.error for s in samples]
    assert all(len(s.response_tokens) == 48 == len(s.rollout_logprobs) for s in samples)

    deaths = [e for e in manager.events if e.kind == "died"]
    assert len(deaths) == 1 and deaths[0].engine_index == 0
    reissued = set(deaths[0].reissued_request_ids)
    assert reissued and reissued <= set(ids)
    assert set(manager.reissued) == reissued
    survivor_url = manager.engine_info(1)["url"]
    by_id = {s.request_id: s for s in samples}
    assert all(by_id[r].metadata["engine"] == survivor_url for r in reissued)
    assert batch.metrics.engine_deaths == 1 and batch.metrics.reissued_requests == len(reissued)

    # The killed worker's embedded server does not outlive it.
    assert _gone(victim["server_pid"], timeout_s=15)

    # The engine is restarted as a fresh actor with its own server and serves again.
    manager.wait_for_restarts(timeout_s=240)
    assert [e.kind for e in manager.events] == ["died", "restarted"]
    assert manager.alive == (True, True)
    fresh = manager.engine_info(0)
    assert fresh["server_pid"] != victim["server_pid"] and fresh["name"] == "engine-0.2"
    again = manager.generate_groups(
        prompts[:2], RolloutConfig(n_samples=2, sampling=config.sampling)
    )
    assert len(again.samples) == 4
    assert fresh["url"] in again.metrics.requests_per_engine


def test_cli_generate_through_ray_on_the_running_cluster(manager, echo_servers, tmp_path):
    """``--ray --engine-url``: url-kind workers joining the cluster this process already runs."""
    import ray

    from mizzen_rollout.cli import main
    from mizzen_rollout.samples import read_samples

    out = tmp_path / "s.jsonl"
    code = main(
        [
            "generate",
            "--data", "example:math",
            "--limit", "3",
            "--n", "2",
            "--out", str(out),
            "--ray",
            "--engine-url", echo_servers[0].url,
            "--reward", "math",
            "--no-progress",
        ]
    )  # fmt: skip
    assert code == 0
    samples = read_samples(out)
    assert len(samples) == 6 and {s.metadata["engine"] for s in samples} == {echo_servers[0].url}
    assert ray.is_initialized()  # the CLI's manager did not own, so did not stop, this cluster
