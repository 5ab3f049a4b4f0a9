"""GPU e2e: the RL protocol of the CPU e2e test on a ~100M-parameter Llama in bf16 on one GPU.

The 101M-parameter Llama of the SFT GPU e2e test (hidden 768, 16 layers, 12 heads, 4 key/value
heads, byte vocabulary) is created by code; ``mizzen-train rl`` trains the two toy tenants
("fixed": answer "Y"; "format": answer in lowercase) through megatron's forward-backward schedule
in bf16, with four embedded engines generating on the same GPU (each step's 64 requests go out
as four batched ``/generate`` calls of 16, one per engine: a forward of the 100M model is
launch-bound at ~30 ms on the H200 whatever its batch, so one batch costs what one request
did) and micro-batches of 32 rows (one tenant's samples each).  The same two runs as on the CPU,
at 12 steps instead of 30 (on the H200 both tenants' mean rewards pass 0.9 by step 4): a
reference run whose tenants' mean rewards rise from < 0.4 to >= 0.8 (mean of the last five steps)
and whose "fixed" adapter scores low on "format"'s task, and a run with NaN advantages for
"format" at step 5, SIGKILLed after step 9 and resumed from its step-8 checkpoint (one every 4
steps): "format" is skipped at 5 and keeps its published adapter, every adapter "fixed" publishes
is byte for byte the reference's, and the resume continues with the checkpoint's adapter versions
(8 for "fixed", 7 for "format").  Prints (and records as junit properties) the wall time,
samples/s and train tokens/s.  cuBLAS runs with a fixed workspace (``CUBLAS_WORKSPACE_CONFIG``)
so the two runs compute the same bits.

Run it on a Hopper host (the image's Python, nothing installed) with the lane:
``python3 -m nox -s gpu-hopper -- tests/train/rl/test_rl_e2e_gpu.py``.
"""

from __future__ import annotations

import os

import pytest

from mizzen_ci import register_cuda_ci

register_cuda_ci(
    est_time=115,
    hardware=["hopper"],
    num_gpus=1,
    labels=["e2e", "train", "rollout"],
    shares_gpu=True,
)

STEPS, NAN_STEP, KILL_AFTER, CHECKPOINT_INTERVAL = 12, 5, 9, 4
NUM_ENGINES = 4
#: Samples per engine call: a tenant's 32 samples of a step in two batches.
BATCH_SIZE = 16
#: The faulty run resumes from its last checkpoint at or before the kill point, with the adapter
#: versions of that checkpoint: one per step stepped, so "format" is one behind if it skipped
#: ``NAN_STEP`` by then.
RESUME_STEP = KILL_AFTER // CHECKPOINT_INTERVAL * CHECKPOINT_INTERVAL
RESUMED_VERSIONS = {"fixed": RESUME_STEP, "format": RESUME_STEP - int(NAN_STEP <= RESUME_STEP)}


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    from mizzen_train.gpt import GPTSpec
    from mizzen_train.hf import LLAMA_100M, read_llama_config, write_tiny_llama

    directory = write_tiny_llama(
        tmp_path_factory.mktemp("gpu-rl") / "llama-100m",
        seed=0,
        initializer_range=0.05,
        **LLAMA_100M,
    )
    spec: GPTSpec = read_llama_config(directory).spec
    assert 95e6 < spec.parameter_count() < 110e6, spec.parameter_count()
    return directory


def _sections(rl, run_dir, base_model):
    sections = rl.sections(run_dir, steps=STEPS, checkpoint_interval=CHECKPOINT_INTERVAL)
    sections["run"].update(device="cuda", dtype="bf16", threads=4, micro_batch_size=32, plot=False)
    sections["model"] = {"path": str(base_model), "tokenizer": "model"}
    del sections["model.tiny"]
    sections["rollout"].update(
        engine_device="cuda", engine_threads=1, num_engines=NUM_ENGINES, batch_size=BATCH_SIZE
    )
    for tenant in sections["tenants"]:
        tenant.update(lr=5e-3, lora_rank=16, lora_alpha=32.0)
    return sections


def test_rl_protocol_on_a_100m_llama_in_bf16(rl, tmp_path, base_model, record_property):
    import torch

    assert torch.cuda.device_count() == 1, "the lane gives this test exactly one GPU"
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # inherited by both runs
    run = rl.protocol(
        tmp_path,
        lambda run_dir: _sections(rl, run_dir, base_model),
        steps=STEPS,
        nan_step=NAN_STEP,
        kill_after=KILL_AFTER,
        checkpoint_interval=CHECKPOINT_INTERVAL,
        timeout_s=1500,
    )
    reference, faulty = run["reference"], run["faulty"]
    started = next(r for r in reference["records"] if r.get("event") == "run_started")
    assert started["device"] == "cuda" and started["dtype"] == "bf16"
    engines = [r for r in reference["records"] if r.get("event") == "engine_started"]
    assert len(engines) == NUM_ENGINES, engines  # every engine served the run
    summary = reference["records"][-1]
    assert summary["kind"] == "summary"
    by = rl.check_run(reference["records"], steps=STEPS)
    curves = {
        t: (
            by[t][1]["reward_mean"],
            sum(by[t][s]["reward_mean"] for s in range(STEPS - 4, STEPS + 1)) / 5,
        )
        for t in rl.TENANTS
    }
    note = (
        f"GPU RL e2e ({torch.cuda.get_device_name(0)}, {started['base_parameters']:,} "
        f"parameters, bf16, embedded engine on the GPU): wall {run['wall']:.1f} s for both runs, "
        f"reference training {summary['wall_s']:.1f} s, {summary['samples_per_s']:.1f} samples/s, "
        f"{summary['train_tokens_per_s']:,.0f} train tokens/s; reward start -> end {curves}"
    )
    print(note)
    record_property("wall_s", round(run["wall"], 1))
    record_property("samples_per_s", round(summary["samples_per_s"], 2))
    record_property("train_tokens_per_s", round(summary["train_tokens_per_s"]))
    for start, end in curves.values():
        assert start < 0.4 and end >= 0.8, note
    final = summary["final_eval"]
    assert final["fixed"]["task_fixed"]["score"] >= 0.8, final
    assert final["format"]["task_format"]["score"] >= 0.8, final
    assert final["fixed"]["task_format"]["score"] <= 0.3, final

    fby = rl.check_run(faulty["records"], steps=STEPS)
    assert fby["format"][NAN_STEP]["stepped"] is False
    assert fby["format"][NAN_STEP + 1]["adapter_version"] == NAN_STEP - 1
    assert all(fby["fixed"][s]["stepped"] for s in range(1, STEPS + 1))
    for version in (NAN_STEP, STEPS):
        assert rl.adapter_bytes(faulty["dir"], "fixed", version) == rl.adapter_bytes(
            reference["dir"], "fixed", version
        ), f"fixed's adapter v{version} differs from the reference run's"
    assert faulty["orphans"] == []
    resumed = [r for r in faulty["records"] if r.get("event") == "resumed"]
    assert len(resumed) == 1 and resumed[0]["from_step"] == RESUME_STEP
    assert resumed[0]["adapter_versions"] == RESUMED_VERSIONS
    after_resume = {t: fby[t][RESUME_STEP + 1]["adapter_version"] for t in rl.TENANTS}
    assert after_resume == RESUMED_VERSIONS
