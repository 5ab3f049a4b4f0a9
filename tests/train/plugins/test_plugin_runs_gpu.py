"""GPU: both tiny plugin models train 20 SFT steps in bf16 through megatron's forward-backward
schedule (the executor's CUDA path calls PluginGPT as it calls GPTModel) with falling loss, and
export an adapter and a merged model.

Run it on a Hopper host (the image's Python, megatron-core carried):
``PYTHONPATH=ci/src:packages/plugins/src:packages/rollout/src:packages/train/src
python3 -m pytest tests/train/plugins/test_plugin_runs_gpu.py``."""

from __future__ import annotations

import json

import pytest

from mizzen_ci import register_cuda_ci

register_cuda_ci(
    est_time=300,
    hardware=["hopper", "blackwell"],
    num_gpus=1,
    labels=["train", "lora", "plugins"],
    shares_gpu=True,
)


@pytest.mark.parametrize("plugin", ["nemotron_h", "deepseek_v4"])
def test_sft_trains_a_tiny_plugin_model_in_bf16_on_the_gpu(plugin, tmp_path):
    from mizzen_train.sft.config import SftConfig
    from mizzen_train.sft.trainer import run_sft

    run_dir = tmp_path / plugin
    config = SftConfig.parse(
        {
            "run": {
                "dir": str(run_dir), "steps": 20, "checkpoint_interval": 20, "device": "cuda",
                "dtype": "bf16", "micro_batch_size": 4, "plot": False, "export_merged": True,
            },
            "model": {"path": "tiny", "plugin": plugin},
            "data": {"seq_len": 144},
            "tenants": [
                {"name": "colours", "data": "example:colours_train", "rows": 4, "lr": 1e-2,
                 "lora_rank": 8, "lora_alpha": 16.0},
            ],
        },
        source="test.toml",
    )  # fmt: skip
    run_sft(config)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    started = next(r for r in records if r.get("event") == "run_started")
    assert (started["device"], started["dtype"]) == ("cuda", "bf16")
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert len(losses) == 20 and sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
    export = run_dir / "export" / "step-00000020" / "colours"
    assert (export / "adapter" / "adapter_model.safetensors").is_file()
    assert (export / "merged" / "model.safetensors").is_file()
