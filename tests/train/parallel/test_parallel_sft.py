"""``mizzen-train sft`` under real ``torchrun`` on gloo ranks (CPU): parity of every layout with
one rank, checkpoints that reshard, a rank SIGKILLed mid-run, and what rank 0 alone writes.

One module-scoped set of runs serves every test (launches are the cost):

- ``single``: one process, 10 steps (the reference);
- ``tp2``: ``[parallel] tensor = 2`` on 2 ranks; ``dp2tp2``: tensor 2 on 4 ranks; ``cp2``:
  ``[parallel] context = 2`` on 2 ranks (each packed stream split load-balanced over them);
- ``dp2``: 2 ranks of data parallel, launched for 200 steps and SIGKILLed (rank 1) once step 6
  is logged, then resumed (same world) with ``--run.steps 10``;
- ``tp2_to_tp1``: a copy of ``tp2`` without its step-10 checkpoint, resumed on one rank at
  tensor 1; ``dp2_to_dp1``: a copy of the killed ``dp2`` resumed on one rank;
- ``export_tp1``: ``mizzen-train export --merged`` of a copy of ``tp2`` on one rank.

Tolerances (fp32): per-step loss within 1e-4 relative of the single rank's, final adapter factors
within 1e-4 absolute; a resume at the same world size is bit for bit; exports of one checkpoint
are the same bytes at TP=2 and TP=1.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=240, labels=["train", "distributed", "e2e"])

STEPS = 10
PARITY_RTOL = 1e-4
WEIGHTS_ATOL = 1e-4
KILL_AFTER_STEP = 6


def _copy_run(source: Path, target: Path, *, drop: tuple[str, ...] = ()) -> Path:
    shutil.copytree(source, target, symlinks=True)
    for name in drop:
        shutil.rmtree(target / name)
    return target


@pytest.fixture(scope="module")
def runs(parallel_runs, tmp_path_factory) -> dict[str, Any]:
    pr = parallel_runs
    root = tmp_path_factory.mktemp("parallel-sft")
    config = pr.write_config(root / "run.toml", pr.sections(root / "unused", steps=STEPS))
    out: dict[str, Any] = {"root": root}
    with pr.launches(root, "sft", config, out) as sft:
        return _launch_all(pr, root, out, sft)


def _launch_all(pr, root: Path, out: dict[str, Any], sft) -> dict[str, Any]:
    started = time.monotonic()
    single = sft("single", 1)
    tp2 = sft("tp2", 2, "--parallel.tensor", "2")
    killed = sft("dp2", 2, "--run.steps", "200")

    # SIGKILL rank 1 of the data-parallel run once it has logged step KILL_AFTER_STEP
    pr.wait_for(
        lambda: max((r["step"] for r in pr.read_metrics(out["dp2"]) if r["kind"] == "train"),
                    default=0) >= KILL_AFTER_STEP or killed.poll() is not None,
        timeout=400, what=f"step {KILL_AFTER_STEP} of the dp2 run",
    )  # fmt: skip
    victim = pr.rank_pid(killed.pid, 1)
    assert victim is not None and killed.poll() is None, "the dp2 run ended before the kill"
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    out["killed_code"] = pr.finish(killed, timeout=120)
    out["killed_exit_s"] = time.monotonic() - killed_at
    out["killed_records"] = pr.read_metrics(out["dp2"])
    out["killed_checkpoints"] = sorted(p.name for p in (out["dp2"] / "checkpoints").iterdir())
    _copy_run(out["dp2"], root / "dp2_to_dp1")
    out["dp2_to_dp1"] = root / "dp2_to_dp1"

    resumes = [
        sft("dp2", 2, "--resume", "--run.steps", str(STEPS)),
        sft("dp2_to_dp1", 1, "--resume", "--run.steps", str(STEPS)),
        sft("dp2tp2", 4, "--parallel.tensor", "2"),
        sft("cp2", 2, "--parallel.context", "2"),
    ]
    out["codes"] = {"single": pr.finish(single, 600), "tp2": pr.finish(tp2, 600)}
    _copy_run(out["tp2"], root / "tp2_to_tp1", drop=("export", "checkpoints/step-00000010"))
    _copy_run(out["tp2"], root / "export_tp1", drop=("export",))
    out["export_tp1"] = root / "export_tp1"
    resumes.append(sft("tp2_to_tp1", 1, "--resume", "--parallel.tensor", "1"))
    export = pr.start(1, root / "export_tp1.log", "export", str(out["export_tp1"]), "--merged")
    sft.track(export)
    with ThreadPoolExecutor(len(resumes) + 1) as pool:
        codes = list(pool.map(lambda p: pr.finish(p, 600), [*resumes, export]))
    names = ["dp2", "dp2_to_dp1", "dp2tp2", "cp2", "tp2_to_tp1", "export_tp1"]
    out["codes"].update(zip(names, codes, strict=True))
    out["wall_s"] = time.monotonic() - started
    out["records"] = {name: pr.read_metrics(out[name]) for name in [*names[:5], "single", "tp2"]}
    out["logs"] = {p.stem: p.read_text(errors="replace") for p in root.glob("*.log")}
    print(f"parallel runs: {out['wall_s']:.1f} s wall")
    return out


def _check_exit(runs: dict[str, Any], *names: str) -> None:
    for name in names:
        assert runs["codes"][name] == 0, (
            f"{name} exited {runs['codes'][name]}:\n" + runs["logs"].get(name, "")[-3000:]
        )


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize("layout", ["dp2", "tp2", "dp2tp2", "cp2"])
def test_every_layout_matches_one_rank_step_for_step(parallel_runs, runs, layout):
    _check_exit(runs, "single", layout)
    reference = parallel_runs.losses(runs["records"]["single"])
    losses = parallel_runs.losses(runs["records"][layout])
    assert sorted(losses) == sorted(reference)
    assert len(reference) == STEPS * len(parallel_runs.TENANTS)
    worst = max(_relative(losses[key], reference[key]) for key in reference)
    print(f"{layout}: worst per-step relative loss difference {worst:.3g}")
    assert worst <= PARITY_RTOL
    assert reference[(STEPS, "alpha")] < reference[(1, "alpha")]  # it trains
    norms = {
        name: {
            (r["step"], r["tenant"]): r["grad_norm"]
            for r in runs["records"][name]
            if r["kind"] == "train"
        }
        for name in ("single", layout)
    }  # fmt: skip  (the gradient norm is the whole world's too)
    assert max(_relative(norms[layout][k], norms["single"][k]) for k in reference) <= PARITY_RTOL


@pytest.mark.parametrize("layout", ["dp2", "tp2", "dp2tp2", "cp2"])
def test_every_layout_ends_with_the_same_adapters(runs, layout):
    from safetensors.torch import load_file

    _check_exit(runs, "single", layout)
    for tenant in ("alpha", "beta"):
        name = f"export/step-{STEPS:08d}/{tenant}/adapter/adapter_model.safetensors"
        reference = load_file(runs["single"] / name)
        mine = load_file(runs[layout] / name)
        assert sorted(mine) == sorted(reference)
        worst = max((mine[k] - reference[k]).abs().max().item() for k in reference)
        print(f"{layout}/{tenant}: worst adapter difference {worst:.3g}")
        assert worst <= WEIGHTS_ATOL
        assert any(reference[k].abs().max().item() > 0 for k in reference if "lora_B" in k)


@pytest.mark.parametrize("layout,world", [("tp2", 2), ("dp2tp2", 4)])
def test_rank_zero_alone_logs_evaluates_checkpoints_and_exports(parallel_runs, runs, layout, world):
    _check_exit(runs, layout)
    records = runs["records"][layout]
    train = [(r["step"], r["tenant"]) for r in records if r["kind"] == "train"]
    assert len(train) == len(set(train)) == STEPS * 2
    started = [r for r in records if r.get("event") == "run_started"]
    assert len(started) == 1
    assert started[0]["parallel"] == {"world": world, "tensor": 2, "context": 1,
                                      "data": world // 2}  # fmt: skip
    evals = [(r["step"], r["tenant"], r["evaluator"]) for r in records if r["kind"] == "eval"]
    assert sorted(evals) == sorted((s, t, "heldout") for s in (5, 10) for t in ("alpha", "beta"))
    assert all(r["status"] == "ok" for r in records if r["kind"] == "eval")
    assert [r["step"] for r in records if r.get("event") == "checkpoint"] == [5, 10]
    assert sum(r["kind"] == "summary" for r in records) == 1
    log = runs["logs"][layout]
    assert log.count(f"step 1/{STEPS} |") == 1 and log.count("] done:") == 1
    run_dir = runs[layout]
    assert sorted(p.name for p in (run_dir / "snapshots").iterdir()) == [
        "step-00000005", "step-00000010"
    ]  # fmt: skip
    assert sorted(p.name for p in (run_dir / f"export/step-{STEPS:08d}").iterdir()) == [
        "alpha", "beta"
    ]  # fmt: skip
    manifest = json.loads(
        (run_dir / f"checkpoints/step-{STEPS:08d}/slots/alpha/manifest.json").read_text()
    )
    assert manifest["parallel"]["tp"] == 2 and sorted(manifest["shards"]) == [
        "tp00-pp00-ep00", "tp01-pp00-ep00"
    ]  # fmt: skip
    single = [r for r in runs["records"]["single"] if r.get("event") == "run_started"]
    assert "parallel" not in single[0]  # one rank's records are as before


@pytest.mark.parametrize("resumed,saved", [("tp2_to_tp1", "tp2"), ("dp2_to_dp1", "dp2")])
def test_a_checkpoint_resumes_at_another_layout(parallel_runs, runs, resumed, saved):
    _check_exit(runs, resumed, saved)
    records = runs["records"][resumed]
    resumes = [r for r in records if r.get("event") == "resumed"]
    assert len(resumes) == 1 and resumes[0]["from_step"] == 5 and "parallel" not in resumes[0]
    mine = parallel_runs.losses(records)
    theirs = parallel_runs.losses(runs["records"][saved])
    after = sorted(key for key in theirs if key[0] > 5)
    assert after and all(key in mine for key in after)
    worst = max(_relative(mine[key], theirs[key]) for key in after)
    print(f"{saved} -> {resumed}: worst relative loss difference after the resume {worst:.3g}")
    assert worst <= PARITY_RTOL


def test_exports_are_the_same_files_at_tp2_and_tp1(parallel_runs, runs):
    _check_exit(runs, "tp2", "export_tp1")
    step = f"export/step-{STEPS:08d}"
    at_tp2 = parallel_runs.export_files(runs["tp2"] / step)
    at_tp1 = parallel_runs.export_files(runs["export_tp1"] / step)
    assert any(name.endswith("merged/model.safetensors") for name in at_tp2), sorted(at_tp2)
    assert sorted(at_tp1) == sorted(at_tp2)
    different = [name for name in at_tp2 if at_tp1[name] != at_tp2[name]]
    assert different == []


def test_a_killed_rank_fails_the_run_cleanly_and_resume_continues_bit_for_bit(parallel_runs, runs):
    print(
        f"killed run: exit code {runs['killed_code']} {runs['killed_exit_s']:.1f} s after the kill"
    )
    assert runs["killed_code"] != 0
    assert runs["killed_exit_s"] < 60, "the other rank hung after its peer died"
    checkpoints = runs["killed_checkpoints"]
    complete = [name for name in checkpoints if name.startswith("step-")]
    assert "step-00000005" in complete
    assert all(name.startswith((".tmp-step-", "step-")) for name in checkpoints)
    _check_exit(runs, "dp2")
    run_dir = runs["dp2"]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    for checkpoint in (run_dir / "checkpoints").iterdir():  # every kept one is whole
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        assert state["step"] == int(checkpoint.name.split("-")[1])
        for tenant in ("alpha", "beta"):
            assert (checkpoint / "slots" / tenant / "manifest.json").is_file()
    before = parallel_runs.losses(runs["killed_records"])
    after = parallel_runs.losses(runs["records"]["dp2"])
    redone = sorted(key for key in before if 5 < key[0] <= STEPS)
    assert redone, "the killed run logged no step after its checkpoint"
    assert [after[key] for key in redone] == [before[key] for key in redone]  # bit for bit
    train = [(r["step"], r["tenant"]) for r in runs["records"]["dp2"] if r["kind"] == "train"]
    assert len(train) == len(set(train)) == STEPS * 2
