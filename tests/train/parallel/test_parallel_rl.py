"""``mizzen-train rl`` under real ``torchrun`` on gloo ranks (CPU): the writer rolls out on its
engine and shares the step's rows, every rank trains its data-parallel share, and the run is
one rank's run.

One module-scoped set of runs serves every test (launches are the cost), each a real
``python -m mizzen_train rl`` (or ``torchrun ... -m mizzen_train rl``) with one embedded engine:

- ``single``: one process, 4 steps (the reference);
- ``dp2``: 2 ranks of data parallel; ``tp2``: ``[parallel] tensor = 2`` on 2 ranks (every rank
  takes part in each adapter export's collectives);
- ``dp2_resumed``: a copy of ``dp2`` without its step-4 checkpoint and export, resumed on 2
  ranks from step 2;
- ``odd_rows``: 2 ranks whose step of 8 + 4 rows does not split into DP=2 x 4-row micro-batches:
  refused before the model is built, the field named once, nothing trained;
- ``engine_refuses``: 2 ranks on ``engines = "urls"`` whose one server (an embedded engine
  started without a load directory) refuses every adapter load, its two ranks started without
  torchrun (no launcher stops one when the other exits): the writer fails with the server's
  reason and the other rank fails with it, quietly, instead of dying in a collective the writer
  never reached.

Tolerances (fp32, measured on this CPU: DP=2 gave the single rank's losses and gradient norms
bit for bit, TP=2 within 2e-7 relative): per-step loss within 1e-6 absolute (the clipped
policy-gradient loss is ~1e-8 on policy, plus 0.05 x KL: up to 0.08 here), gradient norm within
1e-4 relative; a resume at the same world size continues bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=130, labels=["train", "distributed", "rollout", "e2e"])

STEPS = 4
TENANTS = ("fixed", "format")
LOSS_ATOL = 1e-6
GRAD_NORM_RTOL = 1e-4
REFUSAL = "runs as one rank"


REFUSAL_REASON = "is not under a directory this server loads from"


@contextlib.contextmanager
def _refusing_engine() -> Iterator[str]:
    """A real embedded engine started without a model or load directory: it refuses every
    adapter load (403, "not under a directory this server loads from")."""
    from mizzen_rollout.api import launch_embedded

    server = launch_embedded(num_threads=1)
    try:
        yield server.url
    finally:
        server.stop()
        server.cleanup_logs()


def _bare_ranks(pr, rl, config: Path, name: str, *extra: str) -> dict[str, subprocess.Popen]:
    """Two ranks of one run started without torchrun (the environment it would set), so that no
    launcher stops a rank when the other exits: each rank's own ending is what is seen."""
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    run_dir = rl.out[name] = rl.root / name
    argv = [sys.executable, "-m", "mizzen_train", "rl", "--config", str(config),
            "--run.dir", str(run_dir), *extra]  # fmt: skip
    processes = {}
    for rank in (0, 1):
        env = pr.env() | {
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        }  # fmt: skip
        with open(rl.root / f"{name}.rank{rank}.log", "ab") as log:
            process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True,
            )  # fmt: skip
        processes[f"{name}.rank{rank}"] = rl.track(process)
        rl.out[f"{name}.rank{rank}"] = run_dir
    return processes


@pytest.fixture(scope="module")
def runs(parallel_runs, tmp_path_factory) -> dict[str, Any]:
    pr = parallel_runs
    root = tmp_path_factory.mktemp("parallel-rl")
    config = pr.write_config(root / "rl.toml", pr.rl_sections(root / "unused", steps=STEPS))
    out: dict[str, Any] = {"root": root, "codes": {}}

    def finish(**processes: subprocess.Popen[bytes]) -> None:
        with ThreadPoolExecutor(len(processes)) as pool:
            codes = list(pool.map(lambda p: pr.finish(p, 600), processes.values()))
        out["codes"].update(zip(processes, codes, strict=True))

    started = time.monotonic()
    with pr.launches(root, "rl", config, out) as rl, _refusing_engine() as refusing_url:
        on_refusing_engine = ("--rollout.engines", "urls", "--parallel.timeout_s", "120",
                              "--rollout.engine_urls", json.dumps([refusing_url]))  # fmt: skip
        finish(
            single=rl("single", 1),
            dp2=rl("dp2", 2),
            odd_rows=rl("odd_rows", 2, "--set", "tenants.1.prompts_per_step=1"),
        )
        if out["codes"]["dp2"] == 0:
            resumed = root / "dp2_resumed"
            shutil.copytree(out["dp2"], resumed, symlinks=True)
            shutil.rmtree(resumed / "checkpoints" / f"step-{STEPS:08d}")
            shutil.rmtree(resumed / "export")
            finish(
                dp2_resumed=rl("dp2_resumed", 2, "--resume"),
                tp2=rl("tp2", 2, "--parallel.tensor", "2"),
                **_bare_ranks(pr, rl, config, "engine_refuses", *on_refusing_engine),
            )
        else:
            finish(
                tp2=rl("tp2", 2, "--parallel.tensor", "2"),
                **_bare_ranks(pr, rl, config, "engine_refuses", *on_refusing_engine),
            )
    out["wall_s"] = time.monotonic() - started
    out["records"] = {name: pr.read_metrics(out[name]) for name in out["codes"]}
    out["logs"] = {p.stem: p.read_text(errors="replace") for p in root.glob("*.log")}
    print(f"parallel RL runs: {out['wall_s']:.1f} s wall")
    return out


def _check_exit(runs: dict[str, Any], *names: str) -> None:
    for name in names:
        assert runs["codes"].get(name) == 0, (
            f"{name} exited {runs['codes'].get(name)}:\n" + runs["logs"].get(name, "")[-4000:]
        )


def _train(records: list[dict[str, Any]]) -> dict[tuple[int, str], dict[str, Any]]:
    return {(r["step"], r["tenant"]): r for r in records if r["kind"] == "train"}


@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_rl_on_two_ranks_trains_the_single_ranks_steps(runs, layout):
    _check_exit(runs, "single", layout)
    assert REFUSAL not in runs["logs"][layout]
    reference, mine = _train(runs["records"]["single"]), _train(runs["records"][layout])
    assert sorted(mine) == sorted(reference)
    assert len(reference) == STEPS * len(TENANTS)
    for key in reference:  # the same global batch: the writer's rollout of the same adapters
        for field in ("reward_mean", "samples", "tokens", "loss_tokens", "adapter_version"):
            assert mine[key][field] == reference[key][field], (key, field)
    loss = max(abs(mine[k]["loss"] - reference[k]["loss"]) for k in reference)
    norm = max(
        abs(mine[k]["grad_norm"] - reference[k]["grad_norm"]) / reference[k]["grad_norm"]
        for k in reference
        if reference[k]["grad_norm"] > 0
    )
    print(f"{layout}: worst loss difference {loss:.3g}, grad norm relative {norm:.3g}")
    assert loss <= LOSS_ATOL and norm <= GRAD_NORM_RTOL
    assert max(abs(r["loss"]) for r in reference.values()) > 10 * LOSS_ATOL  # not vacuous
    assert all(0 < r["packing_efficiency"] < 1 for r in mine.values())  # padding not counted
    assert [mine[(s, "fixed")]["stepped"] for s in range(1, STEPS + 1)] == [True] * STEPS


@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_the_writer_alone_rolls_out_logs_and_evaluates(runs, layout):
    _check_exit(runs, layout)
    records = runs["records"][layout]
    train = [(r["step"], r["tenant"]) for r in records if r["kind"] == "train"]
    assert len(train) == len(set(train)) == STEPS * len(TENANTS)  # one record a step, not two
    started = [r for r in records if r.get("event") == "run_started"]
    assert len(started) == 1
    tensor = 2 if layout == "tp2" else 1
    assert started[0]["parallel"] == {"world": 2, "tensor": tensor, "context": 1,
                                      "data": 2 // tensor}  # fmt: skip
    engines = [r for r in records if r.get("event") == "engine_started"]
    assert len(engines) == 1  # the writer's one engine; no rank started its own
    joined = [r["tenant"] for r in records if r.get("event") == "tenant_joined"]
    assert joined == list(TENANTS)
    evals = [(r["step"], r["tenant"], r["evaluator"]) for r in records if r["kind"] == "eval"]
    assert sorted(evals) == [(STEPS, t, "task_format") for t in TENANTS]
    assert all(r["status"] == "ok" for r in records if r["kind"] == "eval")
    assert [r["step"] for r in records if r.get("event") == "checkpoint"] == [2, 4]
    summaries = [r for r in records if r["kind"] == "summary"]
    assert len(summaries) == 1
    assert summaries[0]["adapter_versions"] == dict.fromkeys(TENANTS, STEPS)
    log = runs["logs"][layout]
    assert log.count(f"step 1/{STEPS} |") == 1 and log.count("] done:") == 1
    run_dir: Path = runs[layout]
    for tenant in TENANTS:  # every published version, written once by the writer
        versions = sorted(p.name for p in (run_dir / "adapters" / tenant).iterdir())
        assert versions == [f"v{v:08d}" for v in range(STEPS + 1)]
    assert sorted(p.name for p in (run_dir / f"export/step-{STEPS:08d}").iterdir()) == list(TENANTS)


def test_a_resume_at_the_same_world_size_continues_bit_for_bit(runs):
    _check_exit(runs, "dp2", "dp2_resumed")
    records = runs["records"]["dp2_resumed"]
    resumes = [r for r in records if r.get("event") == "resumed"]
    assert len(resumes) == 1 and resumes[0]["from_step"] == 2
    assert resumes[0]["adapter_versions"] == dict.fromkeys(TENANTS, 2)
    before, after = _train(runs["records"]["dp2"]), _train(records)
    assert sorted(after) == sorted(before)
    redone = sorted(key for key in before if key[0] > 2)
    fields = ("loss", "grad_norm", "reward_mean", "kl", "tokens")
    for key in redone:
        assert [after[key][f] for f in fields] == [before[key][f] for f in fields], key
    for tenant in TENANTS:  # the adapters it publishes after the resume: the same bytes
        name = f"adapters/{tenant}/v{STEPS:08d}/adapter_model.safetensors"
        assert (runs["dp2_resumed"] / name).read_bytes() == (runs["dp2"] / name).read_bytes()


def test_rows_that_do_not_split_over_the_ranks_are_refused_naming_the_field(runs):
    code, log = runs["codes"]["odd_rows"], runs["logs"]["odd_rows"]
    assert code != 0, log[-4000:]  # torchrun's exit: a rank failed
    refusals = [line for line in log.splitlines() if line.startswith("mizzen-train rl: error:")]
    assert len(refusals) == 1, log[-4000:]  # the writer says why; rank 1 fails quietly
    assert "tenants[1].prompts_per_step=1: step 1 trains 12 rows" in refusals[0]
    assert "data-parallel size 2 x run.micro_batch_size 4" in refusals[0]
    assert "[rank0]: Traceback" not in log and "[rank1]: Traceback" not in log  # no rank crashed
    assert runs["records"]["odd_rows"] == []  # no run: nothing logged


def test_an_adapter_the_writers_engine_refuses_fails_every_rank_agreed(runs):
    codes, logs = runs["codes"], runs["logs"]
    writer, other = logs["engine_refuses.rank0"], logs["engine_refuses.rank1"]
    assert codes["engine_refuses.rank0"] == 1, writer[-4000:]  # the run failed while training
    assert REFUSAL_REASON in writer, writer[-4000:]  # the writer names the server's reason
    assert "refused to load adapter 'fixed@v0'" in writer, writer[-4000:]
    # the other rank failed with it (RankFailed: exit 2, nothing printed), not in a collective
    # the writer had left (a "Connection closed by peer" traceback, or the group's timeout)
    assert codes["engine_refuses.rank1"] == 2, other[-4000:]
    assert "Traceback" not in other, other[-4000:]
    assert not [r for r in runs["records"]["engine_refuses.rank0"] if r["kind"] == "train"]
