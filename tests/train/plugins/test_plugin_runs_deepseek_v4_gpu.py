"""GPU: the tiny deepseek_v4 plugin model trains 20 SFT steps in bf16 through megatron's
forward-backward schedule with falling loss and exports an adapter and a merged model (the check:
``sft_on_gpu`` in conftest.py; ``test_plugin_runs_nemotron_h_gpu.py`` is the other plugin's file,
apart so that the lane compiles the two side by side).

Run it on a Hopper host (the image's Python, megatron-core carried):
``PYTHONPATH=ci/src:packages/plugins/src:packages/rollout/src:packages/train/src
python3 -m pytest tests/train/plugins/test_plugin_runs_deepseek_v4_gpu.py``."""

from __future__ import annotations

from mizzen_ci import register_cuda_ci

register_cuda_ci(
    est_time=25,
    hardware=["hopper", "blackwell"],
    num_gpus=1,
    labels=["train", "lora", "plugins"],
    shares_gpu=True,
)


def test_sft_trains_the_tiny_deepseek_v4_model_in_bf16_on_the_gpu(sft_on_gpu):
    sft_on_gpu("deepseek_v4")
