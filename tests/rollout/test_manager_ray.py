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

register_cpu_ci(est_time=95, labels=["ray", "rollout", "engine"])


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
def adapter_root(tmp_path_factory):
    """The one directory the module's engines may load adapters from (their --load-dir)."""
    return tmp_path_factory.mktemp("adapters")


@pytest.fixture(scope="module")
def manager(adapter_root):
    os.environ["RAY_AUTH_MODE"] = "disabled"
    spec = EngineSpec(num_cpus=0.5, load_dirs=(str(adapter_root),))
    specs = [spec, spec]
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


def _tiny_peft_adapter(target):
    """A LoRA adapter for the embedded engine's tiny model, saved by the real peft package."""
    import peft
    import torch
    import transformers

    from mizzen_rollout.engines.embedded.backend import load_tiny_config

    config = load_tiny_config()
    model_type = config.pop("model_type")
    torch.manual_seed(4)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(model_type, **config)
    )
    lora = peft.get_peft_model(
        model, peft.LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)
    )
    lora.save_pretrained(str(target))
    return str(target)


def test_replacement_engine_loads_every_adapter_before_it_serves(manager, adapter_root):
    """Adapters loaded through the manager reach every engine; an engine killed mid-batch is
    replaced by one that loads them -- including one loaded while it was starting -- before it
    rejoins routing, so no request routed to an adapter fails."""
    import ray

    from mizzen_rollout.adapters import AdapterRef
    from mizzen_rollout.engines import GenerateRequest, SGLangClient
    from mizzen_rollout.rollout import run_rollout

    manager.wait_for_restarts(timeout_s=240)
    first = AdapterRef("t", 1, _tiny_peft_adapter(adapter_root / "v1"))
    second = AdapterRef("t", 2, _tiny_peft_adapter(adapter_root / "v2"))
    prompts = [PromptRecord(i, f"adapter prompt {i}") for i in range(4)]
    config = RolloutConfig(
        n_samples=2, sampling=SamplingParams(max_new_tokens=8, ignore_eos=True, seed=1)
    )
    deaths = sum(e.kind == "died" for e in manager.events)

    async def scenario():
        await manager.load_lora_adapter(first.name, first.path)
        ray.kill(manager.engine_handle(1))
        batch = await run_rollout(prompts, manager, config, batch_id="lora1", adapter=first)
        pending = manager.alive  # engine 1 is restarting now
        await manager.load_lora_adapter(second.name, second.path)
        return batch, pending

    batch, pending = asyncio.run(scenario())
    assert pending == (True, False)
    assert sum(e.kind == "died" for e in manager.events) == deaths + 1
    assert all(s.status is SampleStatus.TRUNCATED for s in batch.samples), [
        s.error for s in batch.samples
    ]
    assert {s.adapter_version for s in batch.samples} == {1} and batch.samples[0].tenant_id == "t"
    manager.wait_for_restarts(timeout_s=240)
    assert manager.alive == (True, True)
    assert manager.adapters == {first.name: first.path, second.name: second.path}

    async def on_fresh_engine(url):
        async with SGLangClient(url) as client:
            ids = await client.tokenize("adapter prompt 0")
            outputs = []
            for i, name in enumerate((first.name, second.name)):
                result = await client.generate(
                    GenerateRequest(
                        f"direct-{i}", input_ids=ids, sampling=config.sampling, lora_path=name
                    )
                )
                outputs.append(result.finish.kind)
            return outputs

    fresh = manager.engine_info(1)
    assert fresh["name"].endswith(".3") or fresh["name"].endswith(".2")
    assert asyncio.run(on_fresh_engine(fresh["url"])) == ["length", "length"]
