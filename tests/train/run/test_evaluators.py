"""The built-in evaluators on real components: the generation evaluator scores what the snapshot
generates, through an embedded engine it starts (and stops) on the snapshot for the point, an
engine it keeps from point to point (pointed at each full-weight snapshot, or serving the base of
adapter snapshots that it loads by name; replaced when it died or serves another model; stopped by
close(); after close a point stops what it starts) or a running server it points at the snapshot
over HTTP; an engine that cannot start skips the point with the reason; the held-out loss equals
the slotted executor's own loss on the same tokens."""

from __future__ import annotations

import json
import os
import pickle
import signal
from pathlib import Path

import pytest
import torch

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=85, labels=["train", "engine"])


REWARD = """
import zlib


def fingerprint(sample):
    return zlib.crc32(sample.response_text.encode()) % 9973 / 9973
"""


def _fingerprint(text: str) -> float:
    import zlib

    return zlib.crc32(text.encode()) % 9973 / 9973


def _models(tmp: str) -> dict:
    """Two tiny Llamas, two PEFT LoRA adapters of "a" (saved by the real peft package), and what
    greedy decoding answers on the first eval prompts with each."""
    import peft
    import transformers

    from mizzen_train.data import SftTokenizer, load_sft_dataset
    from mizzen_train.hf import write_tiny_llama

    tokenizer = SftTokenizer.load("byte")
    examples = load_sft_dataset(
        "example:colours_eval", tokenizer, field="eval", seq_len=200, limit=3
    ).examples

    def answers(model) -> list[float]:
        scores = []
        for example in examples:
            ids = tokenizer.prompt_ids(example.record)
            generated = model.generate(
                torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=2,
                pad_token_id=0,
            )  # fmt: skip
            text = tokenizer.hf.decode(generated[0, len(ids) :], skip_special_tokens=True)
            scores.append(_fingerprint(text))
        return scores

    out = {}
    for name, seed in (("a", 1), ("b", 2)):
        directory = write_tiny_llama(Path(tmp) / name, seed=seed, initializer_range=0.2)
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        scores = answers(model)
        out[name] = {"path": str(directory), "score": sum(scores) / len(scores), "texts": scores}
    for name, seed in (("x", 5), ("y", 6)):
        torch.manual_seed(seed)
        base = transformers.AutoModelForCausalLM.from_pretrained(
            out["a"]["path"], dtype=torch.float32
        )
        lora = peft.get_peft_model(
            base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        )
        lora.save_pretrained(Path(tmp) / f"lora-{name}")
        scores = answers(lora)
        out[name] = {"path": str(Path(tmp) / f"lora-{name}"), "score": sum(scores) / len(scores)}
    return out


def _generation_evaluator(reward: str, **kwargs):
    from mizzen_train.data import SftTokenizer, load_sft_dataset
    from mizzen_train.evaluators import GenerationEvaluator, generation_prompts

    tokenizer = SftTokenizer.load("byte")
    examples = load_sft_dataset(
        "example:colours_eval", tokenizer, field="eval", seq_len=200, limit=3
    ).examples
    return GenerationEvaluator(
        name="answers",
        prompts=generation_prompts(tokenizer, examples),
        reward=reward,
        max_new_tokens=8,
        **kwargs,
    )


def test_generation_evaluator_scores_the_snapshot_it_is_given(kit, tmp_path):
    import asyncio

    import httpx

    from mizzen_rollout.engines.launcher import embedded_server
    from mizzen_train.eval_dispatch import EvalSkip, Snapshot

    (tmp_path / "rewards.py").write_text(REWARD)
    reward = f"{tmp_path / 'rewards.py'}:fingerprint"  # a user reward that tells answers apart
    (made,) = kit.run_ranks(_models, args=(str(tmp_path),))
    assert made["a"]["texts"] != made["b"]["texts"], "the two models must answer differently"

    # a fleet of embedded engines (sized by the evaluator's own num_engines) started on the
    # snapshot for this point and stopped afterwards
    evaluator = _generation_evaluator(reward, num_engines=2, engine_lifetime="point")
    evaluator = pickle.loads(pickle.dumps(evaluator))  # the Ray runner ships evaluators
    snapshot = Snapshot(20, "t", Path(made["b"]["path"]))
    metrics = evaluator.evaluate(snapshot)
    assert metrics["score"] == pytest.approx(made["b"]["score"])
    assert metrics["samples"] == 3 and metrics["failed"] == 0
    started = [e["pid"] for e in snapshot.events if e["event"] == "engine_started"]
    stopped = [e["pid"] for e in snapshot.events if e["event"] == "engine_stopped"]
    assert len(set(started)) == 2 and sorted(stopped) == sorted(started)
    assert not any(_running(pid) for pid in started)

    # a running server (as SGLang would be), pointed at each snapshot over HTTP
    with embedded_server(model_path=made["a"]["path"]) as server:
        by_url = _generation_evaluator(reward, engine_urls=(server.url,))
        for name in ("b", "a"):
            snap = Snapshot(40, "t", Path(made[name]["path"]))
            assert by_url.evaluate(snap)["score"] == pytest.approx(made[name]["score"])
            assert [e["event"] for e in snap.events] == ["engine_weights_updated"]
        info = httpx.get(server.url + "/get_model_info").json()
        assert info["model_path"] == f"local model {made['a']['path']}"
        broken = tmp_path / "broken"
        broken.mkdir()
        (broken / "config.json").write_text(json.dumps({"model_type": "llama"}))
        with pytest.raises(EvalSkip, match="did not load the snapshot"):
            by_url.evaluate(Snapshot(60, "t", broken))
        assert asyncio.run(_healthy(server.url))

    with pytest.raises(EvalSkip, match="the eval engine did not start"):
        _generation_evaluator(reward, startup_timeout_s=60).evaluate(Snapshot(60, "t", broken))

    # ``device`` places the engines it starts: "cuda" on this CPU-only host is refused by the
    # engine, and the point is skipped with the engine's reason
    on_gpu = _generation_evaluator(reward, device="cuda", startup_timeout_s=60)
    with pytest.raises(EvalSkip, match=r"(?s)the eval engine did not start.*no CUDA device"):
        on_gpu.evaluate(Snapshot(80, "t", Path(made["b"]["path"])))


def test_a_kept_engine_serves_every_point_until_close_and_a_dead_one_is_replaced(kit, tmp_path):
    from mizzen_train.eval_dispatch import Snapshot

    (tmp_path / "rewards.py").write_text(REWARD)
    reward = f"{tmp_path / 'rewards.py'}:fingerprint"
    (made,) = kit.run_ranks(_models, args=(str(tmp_path),))
    evaluator = pickle.loads(pickle.dumps(_generation_evaluator(reward)))  # lifetime "run"

    # three points, one engine: started at the first on its snapshot, then pointed at each next
    # snapshot; every score is the one a fresh engine on that snapshot gives (the reference)
    points = [(20, "b"), (40, "a"), (60, "b")]
    snapshots = [Snapshot(s, "t", Path(made[m]["path"]), root=tmp_path) for s, m in points]
    for snapshot, (_, model) in zip(snapshots, points, strict=True):
        assert evaluator.evaluate(snapshot)["score"] == pytest.approx(made[model]["score"])
    first, *later = ([e["event"] for e in s.events] for s in snapshots)
    assert first == ["engine_started"]
    assert later == [["engine_weights_updated"]] * 2
    (pid,) = [e["pid"] for e in snapshots[0].events]
    assert _running(pid), "kept between points"
    assert pickle.loads(pickle.dumps(evaluator)).close() == [], "a copy holds no engine"

    # killed between points (the next point comes at once: the engine may still be dying):
    # that point stops what is left of it and starts a fresh engine
    os.kill(pid, signal.SIGKILL)
    snapshot = Snapshot(80, "t", Path(made["a"]["path"]), root=tmp_path)
    assert evaluator.evaluate(snapshot)["score"] == pytest.approx(made["a"]["score"])
    events = [(e["event"], e["pid"]) for e in snapshot.events]
    (replacement,) = [p for event, p in events if event == "engine_started"]
    assert events == [
        ("engine_dead", pid),
        ("engine_stopped", pid),
        ("engine_started", replacement),
    ]
    assert snapshot.events[0]["returncode"] == -signal.SIGKILL

    # adapter snapshots (of "a"): the engine serving full weights is replaced by one serving
    # their base model, kept for both; each adapter is loaded under its own name, then unloaded
    assert made["x"]["score"] != made["y"]["score"], "the two adapters must answer differently"
    lora = [
        Snapshot(s, "t", Path(made[n]["path"]), root=tmp_path) for s, n in ((90, "x"), (95, "y"))
    ]
    for snapshot, name in zip(lora, ("x", "y"), strict=True):
        assert evaluator.evaluate(snapshot)["score"] == pytest.approx(made[name]["score"])
    events = [(e["event"], e.get("reason")) for e in lora[0].events]
    assert events == [
        ("engine_stopped", "the point serves another model"),
        ("engine_started", None),
        ("engine_adapter_loaded", None),
    ]
    assert [e["event"] for e in lora[1].events] == ["engine_adapter_loaded"]
    assert not _running(replacement)
    on_base = lora[0].events[1]["pid"]

    # close() stops it once, naming the last point it served; then a point stops what it starts
    closed = evaluator.close()
    assert [(e["event"], e["pid"], e["step"]) for e in closed] == [("engine_stopped", on_base, 95)]
    assert not _running(on_base) and evaluator.close() == []
    after = Snapshot(100, "t", Path(made["b"]["path"]), root=tmp_path)
    assert evaluator.evaluate(after)["score"] == pytest.approx(made["b"]["score"])
    assert [e["event"] for e in after.events] == ["engine_started", "engine_stopped"]
    assert not _running(after.events[0]["pid"]) and evaluator.close() == []


def _running(pid: int) -> bool:
    """Whether any thread of the process runs (the process is not gone, nor a zombie waiting
    for its parent: a killed process's main thread is a zombie before its others end)."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return False
    for task in tasks:
        try:
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # that thread ended meanwhile
            continue
        if state not in ("Z", "X"):
            return True
    return False


async def _healthy(url: str) -> bool:
    from mizzen_rollout.engines import SGLangClient

    async with SGLangClient(url) as client:
        return await client.health()


def _loss_parity(tmp: str) -> dict:
    from mizzen_train.batch import SlotBatch
    from mizzen_train.data import SftTokenizer, load_sft_dataset
    from mizzen_train.eval_dispatch import Snapshot
    from mizzen_train.evaluators import LossEvaluator
    from mizzen_train.executor import SlotExecutor
    from mizzen_train.hf import export_hf_snapshot, import_hf_llama, write_tiny_llama
    from mizzen_train.specs import ExecutorConfig

    tokenizer = SftTokenizer.load("byte")
    examples = load_sft_dataset(
        "example:colours_eval", tokenizer, field="eval", seq_len=200, limit=5
    ).examples
    imported = import_hf_llama(write_tiny_llama(Path(tmp) / "base", seed=4), device="cpu")
    executor = SlotExecutor(imported.model, ExecutorConfig(num_slots=1, max_rank=4))
    generator = torch.Generator().manual_seed(0)
    executor.load_slot(
        0,
        4,
        8.0,
        weights={
            n: torch.randn(s, generator=generator) * 0.2
            for n, s in executor.adapter_shapes(4).items()
        },
    )
    snapshot = export_hf_snapshot(
        Path(tmp) / "snap", model=imported.model, source=imported.source, executor=executor, slot=0
    )
    ours = LossEvaluator(name="heldout", examples=examples, batch_size=2).evaluate(
        Snapshot(1, "t", snapshot)
    )
    width = max(len(e.input_ids) for e in examples) - 1
    ids = torch.zeros(len(examples), width + 1, dtype=torch.long)
    mask = torch.zeros(len(examples), width + 1, dtype=torch.bool)
    for row, example in enumerate(examples):
        ids[row, : len(example.input_ids)] = torch.tensor(example.input_ids)
        mask[row, : len(example.input_ids)] = torch.tensor(example.loss_mask)
    batch = SlotBatch(
        input_ids=ids[:, :-1],
        target_ids=ids[:, 1:],
        loss_mask=mask[:, 1:],
        slot_ids=torch.zeros(len(examples), width, dtype=torch.long),
    )
    logprobs = executor.forward_logprobs(batch)
    reference = float(-(logprobs * batch.loss_mask).sum() / batch.loss_mask.sum())
    return {"ours": ours, "reference": reference, "tokens": int(batch.loss_mask.sum())}


def test_held_out_loss_matches_the_executor(kit, tmp_path):
    (result,) = kit.run_ranks(_loss_parity, args=(str(tmp_path),))
    assert result["ours"]["loss"] == pytest.approx(result["reference"], abs=1e-5)
    assert result["ours"]["tokens"] == result["tokens"]
    assert result["ours"]["perplexity"] == pytest.approx(2.718281828 ** result["reference"])
