"""Fixtures of the plugin-model tests: tiny plugin bases.

The test files that drive the slot executor, ``run_sft`` or ``run_rl`` in-process carry
``pytest.mark.in_child`` (tests/conftest.py): each body runs in a forked child of the pytest
process, inside the one-rank gloo world with megatron's parallel state that ``one_rank_in_child``
sets up for it (the run framework's own :func:`mizzen_train.run.parallel.single_rank`), so
neither the world nor an embedded engine's threads outlive the test in the pytest process.
- ``tiny_base(plugin)`` (session scope): the directory of plugin ``plugin``'s tiny base model
  (:func:`mizzen_train.plugin_models.base.write_tiny_base`, seed 0), written once per session.
- ``plugin_sft_config(run_dir, plugin, ...)``: the plugin runs' SFT config (CPU and GPU files).
- ``sft_on_gpu(plugin)``: the GPU files' check, one per plugin file so that the lane runs the two
  plugins' cold compilations side by side: 20 SFT steps of the tiny plugin model in bf16 through
  megatron's forward-backward schedule (the executor's CUDA path calls PluginGPT as it calls
  GPTModel) with falling loss, an adapter and a merged model exported.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

PLUGINS = ("nemotron_h", "deepseek_v4")


@pytest.fixture(autouse=True)
def one_rank_in_child(request) -> None:
    """The body of an ``in_child`` test here runs inside a one-rank world (entered in the child)."""

    def one_rank():
        from mizzen_train.run.parallel import single_rank

        return single_rank("cpu")

    request.node.in_child_setup = one_rank


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory) -> Callable[[str], Path]:
    from mizzen_train.plugin_models.base import write_tiny_base

    root = tmp_path_factory.mktemp("plugin-bases")

    def base(plugin: str) -> Path:
        # Memoised on disk, not in memory: the first caller may be an ``in_child`` body, whose
        # memory dies with it.  Written beside, then renamed: a base is there whole or not at all.
        target = root / plugin
        if not target.exists():
            scratch = Path(tempfile.mkdtemp(dir=root, prefix=f".{plugin}-"))
            written = write_tiny_base(scratch / plugin, plugin, seed=0)
            written.rename(target)
        return target

    return base


@pytest.fixture
def plugin_sft_config() -> Callable[..., object]:
    """``plugin_sft_config(run_dir, plugin, *, steps=20, run=None, **model)``: the plugin runs'
    SFT config (one tenant, ``example:colours_train``, rank 8, seq_len 144, merged export), its
    ``run`` table updated by ``run`` and its ``model`` table by ``model``."""

    def build(run_dir: Path, plugin: str, *, steps: int = 20, run=None, **model):
        from mizzen_train.sft.config import SftConfig

        return SftConfig.parse(
            {
                "run": {
                    "dir": str(run_dir), "steps": steps, "checkpoint_interval": steps,
                    "micro_batch_size": 4, "plot": False, "export_merged": True, **(run or {}),
                },
                "model": {"path": "tiny", "plugin": plugin, **model},
                "data": {"seq_len": 144},
                "tenants": [
                    {"name": "colours", "data": "example:colours_train", "rows": 4, "lr": 1e-2,
                     "lora_rank": 8, "lora_alpha": 16.0},
                ],
            },
            source="test.toml",
        )  # fmt: skip

    return build


@pytest.fixture
def sft_on_gpu(tmp_path, plugin_sft_config) -> Callable[[str], None]:
    def check(plugin: str) -> None:
        from mizzen_train.sft.trainer import run_sft

        run_dir = tmp_path / plugin
        run_sft(plugin_sft_config(run_dir, plugin, run={"device": "cuda", "dtype": "bf16"}))
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        started = next(r for r in records if r.get("event") == "run_started")
        assert (started["device"], started["dtype"]) == ("cuda", "bf16")
        losses = [r["loss"] for r in records if r["kind"] == "train"]
        assert len(losses) == 20 and sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
        export = run_dir / "export" / "step-00000020" / "colours"
        assert (export / "adapter" / "adapter_model.safetensors").is_file()
        assert (export / "merged" / "model.safetensors").is_file()

    return check
