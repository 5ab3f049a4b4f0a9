"""GPU e2e: the SFT protocol of the CPU e2e tests on a ~100M-parameter Llama in bf16 on one GPU.

A 101M-parameter Llama (hidden 768, 16 layers, 12 heads, 4 key/value heads, byte vocabulary) is
created by code; ``mizzen-train sft`` trains one LoRA tenant on the shipped colours task through
megatron's forward-backward schedule for 60 steps, evaluating every 20: exactly three eval points
(20, 40, 60 -- the last one forced), the eval score and the held-out loss improve, no engine runs
before the first point.  Beside it, at the same time on the same GPU (``sft.side_by_side``: each
run is mostly process and engine start-up, the GPU idle most of the time), a second run is
SIGKILLed after step 30 and resumed: it continues from the step-30 checkpoint and evaluates 40 and
60 only.  Both evaluators run on the GPU: the loss evaluator in the eval thread, the generate
evaluator's embedded engine with ``device = "cuda"``, generating the 16 eval prompts as one
batched ``/generate``: each process starts one engine, at the first point it evaluates, and keeps
it for its later points (each loads its snapshot by ``/update_weights_from_disk``; the engine
holds its GPU memory between points) until the run ends (``sft.check_protocol`` counts the
``engine_started`` events of each process and the finished one's ``engine_stopped``).  The
uninterrupted run's wall time and tokens/s are printed (and recorded as junit
properties); both are measured while the other run shares the GPU, so the tokens/s may be lower
and the wall time longer than for a run alone on it.  Needs no matplotlib, ray or console scripts.

For the metric gate it records the final eval score and held-out loss (gated, enforced) and the
median tokens/s of the uninterrupted run (gated, warning only: GPU hosts are shared, and the
killed-and-resumed run shares the GPU with it).

Run it on a Hopper host (the image's Python, nothing installed) with the lane:
``python3 -m nox -s gpu-hopper -- tests/train/sft/test_sft_e2e_gpu.py``, or without nox:
``PYTHONPATH=ci/src:packages/plugins/src:packages/rollout/src:packages/train/src
python3 -m mizzen_ci gpu-lane hopper tests/train/sft/test_sft_e2e_gpu.py``.
"""

from __future__ import annotations

from collections import Counter

import pytest

from mizzen_ci import register_ci_gate, register_cuda_ci
from mizzen_ci.metrics import record

register_cuda_ci(
    est_time=130,
    hardware=["hopper", "blackwell"],
    num_gpus=1,
    labels=["e2e", "train"],
    shares_gpu=True,
)
register_ci_gate(metric="eval/score", direction="higher", tolerance=0.1, floor=0.05)
register_ci_gate(metric="eval/heldout_loss", direction="lower", tolerance=0.1, floor=0.02)
register_ci_gate(
    metric="perf/tokens_per_s",
    direction="higher",
    tolerance=0.25,
    enforce=False,
    reason="GPU hosts are shared: throughput is watched, not enforced",
)

MIN_FINAL_SCORE = 0.6
MAX_FINAL_HELDOUT_LOSS = 0.7


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    from mizzen_train.gpt import GPTSpec
    from mizzen_train.hf import LLAMA_100M, read_llama_config, write_tiny_llama

    directory = write_tiny_llama(
        tmp_path_factory.mktemp("gpu-sft") / "llama-100m", seed=0, **LLAMA_100M
    )
    spec: GPTSpec = read_llama_config(directory).spec
    assert 95e6 < spec.parameter_count() < 110e6, spec.parameter_count()
    return directory


def _sections(sft, run_dir, base_model, **kwargs):
    sections = sft.colours_sections(run_dir, **kwargs)
    sections["run"].update(device="cuda", dtype="bf16", threads=4, micro_batch_size=8, plot=False)
    sections["model"] = {"path": str(base_model), "tokenizer": "model"}
    del sections["model.tiny"]
    sections["tenants"][0].update(rows=16, lr=2e-3)
    generate, loss = sections["eval.evaluators"]
    generate.update(engine_threads=4, device="cuda", batch_size=16)  # the eval set in one call
    loss.update(device="cuda")
    return sections


def test_sft_protocol_on_a_100m_llama_in_bf16(sft, tmp_path, base_model, record_property):
    import torch

    assert torch.cuda.device_count() == 1, "the lane gives this test exactly one GPU"

    # -- both runs at once: uninterrupted, and killed after step 30 then resumed ----------------
    run_dir = tmp_path / "run"
    config = sft.write_config(tmp_path / "run.toml", _sections(sft, run_dir, base_model))
    killed_dir = tmp_path / "killed"
    sections = _sections(sft, killed_dir, base_model, checkpoint_interval=15)
    killed_config = sft.write_config(tmp_path / "killed.toml", sections)
    run, killed = sft.side_by_side(
        (config, tmp_path / "sft.log", run_dir),
        (killed_config, tmp_path / "killed.log", killed_dir),
        first_point=20,
        kill_after=30,
        point=20,
    )

    # -- uninterrupted: three points, improving, no engine before the first ---------------------
    assert run["early_engines"] == []
    result = sft.check_protocol(run["records"], steps=60, points=(20, 40, 60))
    started = next(r for r in run["records"] if r.get("event") == "run_started")
    assert started["device"] == "cuda" and started["dtype"] == "bf16"
    train = [r for r in run["records"] if r["kind"] == "train"]
    steady = [r["tokens_per_s"] for r in train[5:]]
    tokens_per_s = sorted(steady)[len(steady) // 2]
    summary = result["summary"]
    final_score, final_loss = result["score"][60], result["heldout"][60]
    note = (
        f"GPU SFT e2e ({torch.cuda.get_device_name(0)}, {started['base_parameters']:,} "
        f"parameters, bf16, beside the killed-and-resumed run): wall {run['wall']:.1f} s, "
        f"training {summary['wall_s']:.1f} s, median {tokens_per_s:,.0f} tokens/s; "
        f"final eval score={final_score:.4f} heldout_loss={final_loss:.4f}"
    )
    print(note)
    record_property("wall_s", round(run["wall"], 1))
    record_property("tokens_per_s", round(tokens_per_s))
    record_property("final_score", final_score)
    record_property("final_heldout_loss", final_loss)
    record("eval/score", final_score, step=60)
    record("eval/heldout_loss", final_loss, step=60)
    record("perf/tokens_per_s", tokens_per_s, step=60)
    assert final_score >= MIN_FINAL_SCORE, note
    assert final_loss <= MAX_FINAL_HELDOUT_LOSS, note

    # -- killed after step 30, resumed: from the checkpoint, evaluates 40 and 60 only -------------
    assert 30 <= killed["killed_at"] < 60
    assert [n for n in killed["checkpoints_at_kill"] if n.startswith("step-")][-1] == (
        "step-00000030"
    )
    assert killed["orphans"] == []
    records = killed["records"]
    resumed = [r for r in records if r.get("event") == "resumed"]
    assert len(resumed) == 1 and resumed[0]["from_step"] == 30
    assert resumed[0]["run_id"] == killed["run_id"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert Counter((r["step"], r["evaluator"]) for r in evals) == {
        (s, e): 1 for s in (20, 40, 60) for e in ("answers", "heldout")
    }
    by_process = {r["step"]: r["time"] >= killed["resumed_at"] for r in evals}
    assert by_process == {20: False, 40: True, 60: True}
    resumed_result = sft.check_protocol(records, steps=60, points=(20, 40, 60))
    print(
        f"GPU resumed run: final eval score={resumed_result['score'][60]:.4f} "
        f"heldout_loss={resumed_result['heldout'][60]:.4f}"
    )
