"""``mizzen-train sft`` under real ``torchrun`` on two GPUs (NCCL): DP=2 and TP=2 against one
GPU on the same global batch, 10 fp32 steps, per-step loss within 1e-4 relative and the final
adapters within 1e-4; the TP=2 checkpoint resumes on one GPU at TP=1 with the same losses."""

from __future__ import annotations

import shutil
import time
from typing import Any

import pytest

from mizzen_ci import register_cuda_ci

register_cuda_ci(
    est_time=180, hardware=["hopper"], num_gpus=2, labels=["train", "distributed", "e2e"]
)

STEPS = 10
PARITY_RTOL = 1e-4
WEIGHTS_ATOL = 1e-4


@pytest.fixture(scope="module")
def runs(parallel_runs, tmp_path_factory) -> dict[str, Any]:
    pr = parallel_runs
    root = tmp_path_factory.mktemp("parallel-sft-gpu")
    sections = pr.sections(root / "unused", steps=STEPS, device="cuda")
    sections.pop("eval")
    sections.pop("eval.evaluators")
    config = pr.write_config(root / "run.toml", sections)
    out: dict[str, Any] = {"codes": {}}
    started = time.monotonic()
    for name, ranks, extra in (
        ("single", 1, ()),
        ("dp2", 2, ()),
        ("tp2", 2, ("--parallel.tensor", "2")),
    ):  # one after the other: each takes every GPU it is given
        out[name] = root / name
        out["codes"][name] = pr.run(
            ranks, root / f"{name}.log", "sft", "--config", str(config),
            "--run.dir", str(root / name), *extra, timeout=600,
        )  # fmt: skip
    shutil.copytree(out["tp2"], root / "tp2_to_tp1", symlinks=True)
    shutil.rmtree(root / "tp2_to_tp1" / "export")
    shutil.rmtree(root / "tp2_to_tp1" / "checkpoints" / f"step-{STEPS:08d}")
    out["tp2_to_tp1"] = root / "tp2_to_tp1"
    out["codes"]["tp2_to_tp1"] = pr.run(
        1, root / "tp2_to_tp1.log", "sft", "--config", str(config), "--run.dir",
        str(root / "tp2_to_tp1"), "--resume", "--parallel.tensor", "1", timeout=600,
    )  # fmt: skip
    out["records"] = {n: pr.read_metrics(out[n]) for n in ("single", "dp2", "tp2", "tp2_to_tp1")}
    out["logs"] = {p.stem: p.read_text(errors="replace") for p in root.glob("*.log")}
    print(f"parallel GPU runs: {time.monotonic() - started:.1f} s wall")
    return out


def _ok(runs: dict[str, Any], *names: str) -> None:
    for name in names:
        assert runs["codes"][name] == 0, runs["logs"].get(name, "")[-3000:]


@pytest.mark.parametrize("layout", ["dp2", "tp2", "tp2_to_tp1"])
def test_two_gpus_match_one_step_for_step(parallel_runs, runs, layout):
    _ok(runs, "single", layout)
    reference = parallel_runs.losses(runs["records"]["single"])
    losses = parallel_runs.losses(runs["records"][layout])
    assert sorted(losses) == sorted(reference) and len(reference) == STEPS * 2
    worst = max(abs(losses[k] - reference[k]) / abs(reference[k]) for k in reference)
    print(f"{layout}: worst per-step relative loss difference {worst:.3g}")
    assert worst <= PARITY_RTOL


@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_two_gpus_end_with_the_same_adapters(runs, layout):
    from safetensors.torch import load_file

    _ok(runs, "single", layout)
    for tenant in ("alpha", "beta"):
        name = f"export/step-{STEPS:08d}/{tenant}/adapter/adapter_model.safetensors"
        reference = load_file(runs["single"] / name)
        mine = load_file(runs[layout] / name)
        worst = max((mine[k] - reference[k]).abs().max().item() for k in reference)
        print(f"{layout}/{tenant}: worst adapter difference {worst:.3g}")
        assert worst <= WEIGHTS_ATOL
