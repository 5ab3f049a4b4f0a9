"""Shared fixtures of the train tests: megatron-core on CPU ranks, and small GPT kits.

CPU tests run each scenario on forked gloo ranks started by the root launcher (the
``run_ranks`` fixture of ``tests/conftest.py``: ``file://`` rendezvous, one intra-op thread per
rank, every rank's traceback on failure, the other ranks killed), here with a megatron set-up in
each rank: the ``torch.cuda`` shim of :mod:`mizzen_train.megatron_on_cpu`, then
``parallel_state`` with the scenario's TP size.  megatron-core (and ``slot_kit.py``) is imported
by the ``kit`` fixture, before any fork, so a rank inherits it and starts in well under a second;
the parent pytest process itself never touches CUDA.  Nothing here imports megatron at collection:
the e2e files, whose runs are subprocesses, do not pay its ~16 s import in the pytest process.  The builders live in ``slot_kit.py`` (shared with the 2-GPU worker script);
GPU test files use them through ``kit`` but never the fork launcher.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest


@functools.cache
def _load_slot_kit():
    """``slot_kit.py`` as a module, megatron-core imported with it (the pre-fork import)."""
    import megatron.core.distributed
    import megatron.core.models.gpt  # noqa: F401

    path = Path(__file__).with_name("slot_kit.py")
    spec = importlib.util.spec_from_file_location("mizzen_tests_train_slot_kit", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _megatron_rank_setup(tp: int) -> None:
    """Per-rank set-up after the process group exists: the CPU shim, then TP ``tp``."""
    from megatron.core import parallel_state

    from mizzen_train.megatron_on_cpu import install_megatron_cpu_shim

    install_megatron_cpu_shim()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)


@pytest.fixture
def kit(run_ranks) -> SimpleNamespace:
    """The launcher and builders, for scenarios that run inside worker ranks.

    ``kit.run_ranks(fn, world_size=1, tp=1, args=(), timeout=150.0)`` runs ``fn(*args)`` on
    forked gloo ranks (TP ``tp``, DP the rest) through the root ``run_ranks`` launcher; each
    rank's result in rank order, or AssertionError with every failed rank's traceback."""

    def megatron_ranks(
        fn: Callable[..., Any],
        *,
        world_size: int = 1,
        tp: int = 1,
        args: Sequence[Any] = (),
        timeout: float = 150.0,
    ) -> list[Any]:
        return run_ranks(
            fn,
            world_size=world_size,
            args=args,
            setup=functools.partial(_megatron_rank_setup, tp),
            timeout=timeout,
        )

    slot_kit = _load_slot_kit()
    return SimpleNamespace(
        run_ranks=megatron_ranks,
        tiny_batch=slot_kit.tiny_batch,
        tiny_executor=slot_kit.tiny_executor,
        random_adapter=slot_kit.random_adapter,
        split_dims=slot_kit.split_dims,
        join_tp_shards=slot_kit.join_tp_shards,
        TINY_GPT=slot_kit.TINY_GPT,
    )


# -- SFT runs as real subprocesses (the e2e tests) ----------------------------------------------

#: Keys every record kind of a finished SFT run's metrics.jsonl carries (the e2e tests compare an
#: interrupted-and-resumed run against the same schema as an uninterrupted one).
SFT_RECORD_KEYS = {
    "train": {
        "kind", "time", "step", "tenant", "loss", "lr", "grad_norm", "stepped", "tokens",
        "loss_tokens", "tokens_per_s", "step_s",
    },
    "eval": {"kind", "time", "step", "tenant", "evaluator", "status", "metrics", "reason", "wall_s"},
    "eval_point": {"kind", "time", "step", "status", "final", "reason", "wall_s"},
    "summary": {
        "kind", "time", "run_id", "steps", "eval_points", "final_eval", "final_train_loss",
        "wall_s", "tokens_per_s", "engines_needed",
    },
}  # fmt: skip


def _toml_value(value: Any) -> str:
    import json

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


def _write_sft_config(path: Path, sections: dict[str, Any]) -> Path:
    """A TOML file from ``{"run": {...}, "tenants": [{...}], "eval.evaluators": [{...}]}``."""
    lines = []
    for section, body in sections.items():
        tables = body if isinstance(body, list) else [body]
        for table in tables:
            lines.append(f"[[{section}]]" if isinstance(body, list) else f"[{section}]")
            lines += [f"{key} = {_toml_value(value)}" for key, value in table.items()]
            lines.append("")
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def _sft_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.setdefault("RAY_AUTH_MODE", "disabled")
    return env


def _launch_sft(config: Path, log: Path, *extra: str, command: str = "sft", env=None):
    import subprocess
    import sys

    argv = [sys.executable, "-m", "mizzen_train", command, "--config", str(config), *extra]
    handle = open(log, "ab")  # noqa: SIM115 (the child owns it; closed on wait)
    try:
        return subprocess.Popen(
            argv, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**_sft_env(), **(env or {})},
        )  # fmt: skip
    finally:
        handle.close()


def _read_sft_metrics(path: Path) -> list[dict[str, Any]]:
    import contextlib
    import json

    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line being written right now
            records.append(json.loads(line))
    return records


def _engine_descendants(pid: int) -> list[int]:
    """Pids of ``mizzen_rollout serve`` processes whose parent is ``pid`` (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and b"mizzen_rollout" in cmdline and b"serve" in cmdline:
            found.append(int(entry.name))
    return found


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` after the command name (field 3 on), or None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _identities(pids: Sequence[int]) -> list[tuple[int, int]]:
    """``(pid, start time)`` of each process: which process a pid names, even after it is
    reused (the start time, in clock ticks since boot, is field 22 of its stat)."""
    found = []
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is not None:
            found.append((pid, int(fields[19])))
    return found


def _process_alive(process: int | tuple[int, int]) -> bool:
    """True while the process runs: a pid, or a ``(pid, start time)`` identity (a pid given to
    another process since is not it); a zombie waiting for a reaper counts as gone."""
    pid, started = process if isinstance(process, tuple) else (process, None)
    fields = _stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return False
    return started is None or int(fields[19]) == started


def _orphans(engines: Sequence[tuple[int, int]], timeout_s: float = 15.0) -> list[int]:
    """Pids of the killed run's engines (identities taken before the kill) still alive after
    ``timeout_s``: an engine exits on its own once its parent is gone (the resumed run starts
    meanwhile; a reused pid is another process, not an orphan)."""
    import time

    deadline = time.monotonic() + timeout_s
    while any(_process_alive(e) for e in engines) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid, started in engines if _process_alive((pid, started))]


def _max_train_step(records: Sequence[dict[str, Any]]) -> int:
    return max((r["step"] for r in records if r.get("kind") == "train"), default=0)


def _colours_sections(
    run_dir: Path, *, steps: int = 60, interval: int = 20, checkpoint_interval: int = 10
) -> dict[str, Any]:
    """The e2e run: the tiny Llama learning the shipped colours task, evaluated every
    ``interval`` steps by generation (an embedded engine on the snapshot) and held-out loss."""
    return {
        "run": {
            "dir": str(run_dir), "steps": steps, "checkpoint_interval": checkpoint_interval,
            "device": "cpu",
            "micro_batch_size": 4, "threads": 1, "seed": 0,
        },
        "model": {"path": "tiny", "tokenizer": "model"},
        "model.tiny": {"seed": 0, "initializer_range": 0.12},
        "data": {"seq_len": 144},  # two examples per row
        "tenants": [
            {"name": "colours", "data": "example:colours_train", "rows": 4, "lr": 1e-2,
             "lora_rank": 16, "lora_alpha": 32.0},
        ],
        "eval": {
            "interval": interval, "snapshot_dir": "snapshots", "max_in_flight": 1,
            "overflow": "wait", "keep_snapshots": 1,
        },
        "eval.evaluators": [
            {"kind": "generate", "name": "answers", "data": "example:colours_eval",
             "reward": "f1", "max_new_tokens": 16, "limit": 16},
            {"kind": "loss", "name": "heldout", "data": "example:colours_eval"},
        ],
    }  # fmt: skip


def _run_to_completion(
    config: Path,
    log: Path,
    run_dir: Path,
    *,
    first_point: int,
    stop: threading.Event | None = None,
) -> dict:
    """Run ``mizzen-train sft`` to its end, watching for engine processes before the first
    eval point; returns the records, the output, the wall time and what it saw.  Setting
    ``stop`` (from another thread) kills the run and fails the call."""
    import time

    stop = stop if stop is not None else threading.Event()
    started = time.monotonic()
    process = _launch_sft(config, log)
    early_engines = []
    try:
        while process.poll() is None and not stop.is_set():
            step = _max_train_step(_read_sft_metrics(run_dir / "metrics.jsonl"))
            engines = _engine_descendants(process.pid)
            if engines and step < first_point:
                early_engines.append((step, engines))
            stop.wait(0.05)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(60)
    output = log.read_text()
    assert not stop.is_set(), "stopped before its end: the run beside it failed"
    assert process.returncode == 0, output[-6000:]
    return {
        "records": _read_sft_metrics(run_dir / "metrics.jsonl"),
        "output": output,
        "wall": time.monotonic() - started,
        "early_engines": early_engines,
    }


def _check_protocol(records: list[dict[str, Any]], *, steps: int, points: Sequence[int]) -> dict:
    """The SFT e2e protocol on a finished run's metrics: every record has its schema; the run
    needed engines for eval only; each step trained once; exactly ``points`` were evaluated (the
    last one forced, flagged final), every evaluation succeeded, and the eval score and held-out
    loss improved from the first point to the last; every engine was started for an eval point
    after its step trained, and stopped.  Returns the final score and held-out loss."""
    for record in records:
        if record["kind"] in SFT_RECORD_KEYS:
            assert set(record) == SFT_RECORD_KEYS[record["kind"]], record
    first = next(r for r in records if r.get("event") in ("run_started", "resumed"))
    assert first["engines_needed"] == "eval-only"
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, steps + 1))
    got = [(r["step"], r["status"], r["final"]) for r in records if r["kind"] == "eval_point"]
    assert got == [(p, "ok", p == points[-1]) for p in points]
    evals = {(r["step"], r["evaluator"]): r for r in records if r["kind"] == "eval"}
    assert sorted(evals) == [(p, e) for p in points for e in ("answers", "heldout")]
    assert all(r["status"] == "ok" for r in evals.values()), evals
    score = {p: evals[(p, "answers")]["metrics"]["score"] for p in points}
    heldout = {p: evals[(p, "heldout")]["metrics"]["loss"] for p in points}
    assert score[points[-1]] > score[points[0]], score
    assert heldout[points[-1]] < heldout[points[0]], heldout
    trained_at = {r["step"]: r["time"] for r in records if r["kind"] == "train"}
    starts = [r for r in records if r.get("event") == "engine_started"]
    assert sorted(e["step"] for e in starts) == list(points)
    for event in starts:
        assert event["purpose"] == "eval" and event["time"] >= trained_at[event["step"]]
    stopped = {e["pid"] for e in records if e.get("event") == "engine_stopped"}
    assert stopped == {e["pid"] for e in starts}
    summary = records[-1]
    assert summary["kind"] == "summary" and summary["eval_points"] == list(points)
    final = summary["final_eval"]["colours"]
    assert (final["answers"]["score"], final["heldout"]["loss"]) == (
        score[points[-1]],
        heldout[points[-1]],
    )
    return {"score": score, "heldout": heldout, "summary": summary}


def _kill_and_resume(config: Path, log: Path, run_dir: Path, *, kill_after: int, point: int):
    """Start a run, SIGKILL it once it trained ``kill_after`` steps and eval ``point`` settled,
    then ``--resume`` it to the end.  Returns what the test checks."""
    import json
    import signal
    import time

    metrics = run_dir / "metrics.jsonl"
    first = _launch_sft(config, log)
    engines: list[tuple[int, int]] = []
    try:
        deadline = time.monotonic() + 600
        while True:
            assert first.poll() is None, f"exited early ({first.returncode}):\n{log.read_text()}"
            assert time.monotonic() < deadline, "timed out waiting for the kill point"
            records = _read_sft_metrics(metrics)
            settled = any(r["kind"] == "eval_point" and r["step"] == point for r in records)
            if settled and _max_train_step(records) >= kill_after:
                break
            time.sleep(0.02)
        engines = _identities(_engine_descendants(first.pid))
        os.kill(first.pid, signal.SIGKILL)
        first.wait(60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(60)
    assert first.returncode == -signal.SIGKILL
    before = _read_sft_metrics(metrics)
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
    resumed_at = time.time()
    second = _launch_sft(config, log, "--resume")
    orphans = _orphans(engines)
    assert second.wait(900) == 0, log.read_text()[-6000:]
    return {
        "killed_at": _max_train_step(before),
        "checkpoints_at_kill": checkpoints,
        "run_id": run_id,
        "orphans": orphans,
        "resumed_at": resumed_at,
        "records": _read_sft_metrics(metrics),
        "output": log.read_text(),
    }


def _side_by_side(
    run: tuple[Path, Path, Path],
    killed: tuple[Path, Path, Path],
    *,
    first_point: int,
    kill_after: int,
    point: int,
) -> tuple[dict, dict]:
    """``_run_to_completion(*run, first_point=...)`` and ``_kill_and_resume(*killed,
    kill_after=..., point=...)`` at once, each ``(config, log, run_dir)`` its own run: the
    uninterrupted run (early-engine watch included) in a thread, the kill-and-resume protocol in
    this one.  Waits for both and returns their two dicts, in that order.  If the protocol fails,
    the uninterrupted run is killed and the protocol's error raised; if the uninterrupted run
    fails, its error is raised once the protocol has finished.  For GPU tests, whose runs leave
    the device idle most of the time; CPU runners (2 cores) run the two helpers one after the
    other."""
    from concurrent.futures import ThreadPoolExecutor

    stop = threading.Event()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="sft-uninterrupted") as pool:
        uninterrupted = pool.submit(_run_to_completion, *run, first_point=first_point, stop=stop)
        try:
            resumed = _kill_and_resume(*killed, kill_after=kill_after, point=point)
        except BaseException:
            stop.set()
            raise
        return uninterrupted.result(), resumed


@pytest.fixture
def sft() -> SimpleNamespace:
    """Write SFT configurations, launch ``python -m mizzen_train sft`` subprocesses, read their
    metrics and find the engine processes they start; run the e2e protocols (an uninterrupted
    run, a killed-and-resumed one, or both at once with ``side_by_side``)."""
    return SimpleNamespace(
        RECORD_KEYS=SFT_RECORD_KEYS,
        write_config=_write_sft_config,
        launch=_launch_sft,
        read_metrics=_read_sft_metrics,
        engine_descendants=_engine_descendants,
        max_train_step=_max_train_step,
        alive=_process_alive,
        env=_sft_env,
        colours_sections=_colours_sections,
        run_to_completion=_run_to_completion,
        check_protocol=_check_protocol,
        kill_and_resume=_kill_and_resume,
        side_by_side=_side_by_side,
    )


# -- RL runs as real subprocesses (the RL e2e tests) --------------------------------------------

#: Keys of an RL run's train records (the SFT train keys and the RL metrics).
RL_TRAIN_KEYS = SFT_RECORD_KEYS["train"] | {
    "reward_mean", "reward_std", "response_length", "kl", "clip_fraction", "importance_ratio",
    "adapter_version", "published_version", "samples", "failed_samples", "samples_per_s",
    "rollout_s", "logprob_mismatch", "old_logprobs",
}  # fmt: skip
RL_TENANTS = ("fixed", "format")


def _rl_sections(run_dir: Path, *, steps: int = 30, checkpoint_interval: int = 10) -> dict:
    """The two-tenant toy RL run of the README (``example:rl_tiny``) at e2e size: every adapter
    version kept (the tests compare their bytes), one eval point at the end on both tasks."""
    toy = "mizzen_train.rl.toy"
    tenant = {"prompts_per_step": 4, "n_samples": 8, "lr": 2e-2, "lora_rank": 8,
              "lora_alpha": 16.0}  # fmt: skip
    return {
        "run": {
            "dir": str(run_dir), "steps": steps, "checkpoint_interval": checkpoint_interval,
            "device": "cpu", "micro_batch_size": 8, "threads": 1, "seed": 0, "plot": True,
        },
        "model": {"path": "tiny", "tokenizer": "model"},
        "model.tiny": {"seed": 0, "initializer_range": 0.12},
        "rollout": {"engines": "embedded", "num_engines": 1, "max_new_tokens": 3,
                    "temperature": 1.0, "top_k": 50, "keep_adapters": 0},
        "algo": {"advantage": "grpo"},
        "tenants": [
            {"name": "fixed", "data": "example:rl_fixed", "reward": f"{toy}:fixed_token",
             "max_new_tokens": 1, **tenant},
            {"name": "format", "data": "example:rl_format", "reward": f"{toy}:lowercase_format",
             "data_seed": 1, **tenant},
        ],
        "eval": {"interval": steps, "snapshot_dir": "snapshots", "max_in_flight": 1,
                 "overflow": "wait", "keep_snapshots": 1},
        "eval.evaluators": [
            {"kind": "generate", "name": "task_fixed", "data": "example:rl_fixed",
             "reward": f"{toy}:fixed_token", "max_new_tokens": 1, "limit": 8},
            {"kind": "generate", "name": "task_format", "data": "example:rl_format",
             "reward": f"{toy}:lowercase_format", "max_new_tokens": 3, "limit": 8},
        ],
    }  # fmt: skip


def _wait_all(processes: Sequence[Any], logs: Sequence[Path], timeout_s: float) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    for process, log in zip(processes, logs, strict=True):
        try:
            process.wait(max(1.0, deadline - time.monotonic()))
        except Exception:
            process.kill()
            process.wait(60)
        assert process.returncode == 0, log.read_text()[-6000:]


def _adapter_bytes(run_dir: Path, tenant: str, version: int) -> bytes:
    return (
        run_dir / "adapters" / tenant / f"v{version:08d}" / "adapter_model.safetensors"
    ).read_bytes()


def _rl_protocol(
    tmp_path: Path,
    sections_of,
    *,
    steps: int,
    nan_step: int,
    kill_after: int,
    checkpoint_interval: int,
    timeout_s: float = 900.0,
) -> dict:
    """The RL e2e protocol (CPU and GPU tests run it): a reference run R and, beside it, a run F
    whose tenant "format" gets NaN advantages at ``nan_step`` and which is SIGKILLed once it has
    logged ``kill_after`` steps, then resumed with ``--resume``.  Returns both runs' records
    and paths for the checks."""
    import json
    import signal
    import time

    ref_dir, faulty_dir = tmp_path / "reference", tmp_path / "faulty"
    ref_config = _write_sft_config(tmp_path / "reference.toml", sections_of(ref_dir))
    faulty_config = _write_sft_config(tmp_path / "faulty.toml", sections_of(faulty_dir))
    ref_log, faulty_log = tmp_path / "reference.log", tmp_path / "faulty.log"
    nan_env = {"MIZZEN_RL_INJECT_NAN": f"format@{nan_step}"}
    started = time.monotonic()
    reference = _launch_sft(ref_config, ref_log, command="rl")
    faulty = _launch_sft(faulty_config, faulty_log, command="rl", env=nan_env)
    engines: list[tuple[int, int]] = []
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            assert faulty.poll() is None, f"exited early:\n{faulty_log.read_text()[-6000:]}"
            assert time.monotonic() < deadline, "timed out waiting for the kill point"
            records = _read_sft_metrics(faulty_dir / "metrics.jsonl")
            if _max_train_step(records) >= kill_after:
                break
            time.sleep(0.02)
        engines = _identities(_engine_descendants(faulty.pid))
        os.kill(faulty.pid, signal.SIGKILL)
        faulty.wait(60)
    finally:
        if faulty.poll() is None:
            faulty.kill()
            faulty.wait(60)
    assert faulty.returncode == -signal.SIGKILL
    killed_records = _read_sft_metrics(faulty_dir / "metrics.jsonl")
    checkpoints = sorted(p.name for p in (faulty_dir / "checkpoints").iterdir())
    resumed_at = time.time()
    resumed = _launch_sft(faulty_config, faulty_log, "--resume", command="rl", env=nan_env)
    orphans = _orphans(engines)
    _wait_all([reference, resumed], [ref_log, faulty_log], timeout_s)
    return {
        "wall": time.monotonic() - started,
        "reference": {"dir": ref_dir, "records": _read_sft_metrics(ref_dir / "metrics.jsonl"),
                      "output": ref_log.read_text()},
        "faulty": {"dir": faulty_dir, "records": _read_sft_metrics(faulty_dir / "metrics.jsonl"),
                   "output": faulty_log.read_text(), "killed_records": killed_records,
                   "checkpoints_at_kill": checkpoints, "orphans": orphans,
                   "resumed_at": resumed_at,
                   "run_id": json.loads((faulty_dir / "run.json").read_text())["run_id"]},
    }  # fmt: skip


def _check_rl_run(records: list[dict[str, Any]], *, steps: int) -> dict[str, dict[int, dict]]:
    """Per-run rules: every train record has the RL schema, each (step, tenant) is logged once,
    every sample of a step comes from the version published by the step before (synchronous
    rollouts), the engines were needed for training.  Returns train records by tenant, step."""
    first = next(r for r in records if r.get("event") in ("run_started", "resumed"))
    assert first["engines_needed"] == "train+eval"
    train = [r for r in records if r["kind"] == "train"]
    for record in train:
        assert set(record) == RL_TRAIN_KEYS, sorted(set(record) ^ RL_TRAIN_KEYS)
    by: dict[str, dict[int, dict]] = {t: {} for t in RL_TENANTS}
    for record in train:
        assert record["step"] not in by[record["tenant"]], ("logged twice", record)
        by[record["tenant"]][record["step"]] = record
    for tenant in RL_TENANTS:
        assert sorted(by[tenant]) == list(range(1, steps + 1)), tenant
        assert by[tenant][1]["adapter_version"] == 0
        for step in range(2, steps + 1):
            assert by[tenant][step]["adapter_version"] == by[tenant][step - 1]["published_version"]
    return by


@pytest.fixture
def rl() -> SimpleNamespace:
    """The RL e2e protocol: the toy two-tenant configuration, the reference-and-faulty run pair
    (NaN injection, SIGKILL, --resume) and the per-run checks."""
    return SimpleNamespace(
        TENANTS=RL_TENANTS,
        TRAIN_KEYS=RL_TRAIN_KEYS,
        sections=_rl_sections,
        protocol=_rl_protocol,
        check_run=_check_rl_run,
        adapter_bytes=_adapter_bytes,
    )
