"""Train runs as real subprocesses, for the e2e tests: the ``sft`` and ``rl`` fixtures' classes.

- :class:`RunProcesses`: write a run's TOML, launch ``python -m mizzen_train <command>`` (or run
  a command to completion, its output captured: :meth:`~RunProcesses.cli`), read its
  ``metrics.jsonl`` (a line being written is skipped), find the engine processes it started
  (``/proc``) and tell whether a process is still the one it was (pid and start time).
- :class:`SftRuns`: the SFT e2e protocol on those (the colours configuration, an uninterrupted
  run, a SIGKILLed-and-resumed one, both side by side, and the checks of a finished run), and
  the small run of the CLI and run-directory tests (:meth:`~SftRuns.small_sections`).
- :class:`RlRuns`: the RL e2e protocol (the toy two-tenant configuration, the reference-and-faulty
  run pair with NaN injection, SIGKILL and ``--resume``, the per-run checks).

Loaded by path by ``tests/train/conftest.py`` (test files never import it).  Standard library
only, at module scope and in every method: the e2e test processes never import torch or
megatron (their runs do, in subprocesses).  Nothing here keeps state between calls.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

Sections = dict[str, Any]  # {"run": {...}, "tenants": [{...}], "eval.evaluators": [{...}]}
Record = dict[str, Any]  # one line of metrics.jsonl
Identity = tuple[int, int]  # (pid, start time in clock ticks since boot)

#: Keys every record kind of a finished SFT run's metrics.jsonl carries (the e2e tests compare an
#: interrupted-and-resumed run against the same schema as an uninterrupted one).
SFT_RECORD_KEYS = {
    "train": {
        "kind", "time", "step", "tenant", "loss", "lr", "grad_norm", "stepped", "tokens",
        "loss_tokens", "packing_efficiency", "tokens_per_s", "step_s",
    },
    "eval": {"kind", "time", "step", "tenant", "evaluator", "status", "metrics", "reason", "wall_s"},
    "eval_point": {"kind", "time", "step", "status", "final", "reason", "wall_s"},
    "summary": {
        "kind", "time", "run_id", "steps", "eval_points", "final_eval", "final_train_loss",
        "wall_s", "tokens_per_s", "engines_needed",
    },
}  # fmt: skip

#: Keys of an RL run's train records (the SFT train keys and the RL metrics).
RL_TRAIN_KEYS = SFT_RECORD_KEYS["train"] | {
    "reward_mean", "reward_std", "response_length", "kl", "clip_fraction", "importance_ratio",
    "adapter_version", "published_version", "samples", "failed_samples", "samples_per_s",
    "rollout_s", "logprob_mismatch", "old_logprobs",
}  # fmt: skip
RL_TENANTS = ("fixed", "format")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` after the command name (field 3 on), or None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


class RunProcesses:
    """Train runs as subprocesses: their configuration, their launch, their metrics, and the
    engine processes they start."""

    def write_config(self, path: Path, sections: Sections) -> Path:
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

    def env(self) -> dict[str, str]:
        """The environment of a run: this one, offline, without tokenizer threads."""
        env = dict(os.environ)
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        env.setdefault("RAY_AUTH_MODE", "disabled")
        return env

    def cli(
        self,
        *argv: str,
        cwd: Path | str | None = None,
        timeout: float = 240.0,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """``python -m mizzen_train <argv>`` to completion (``timeout`` seconds at most) in
        ``cwd``, its stdout and stderr captured as text; no GPU (``CUDA_VISIBLE_DEVICES=""``),
        ``env`` on top of :meth:`env`."""
        return subprocess.run(
            [sys.executable, "-m", "mizzen_train", *argv],
            capture_output=True, text=True, timeout=timeout, cwd=cwd,
            env={**self.env(), "CUDA_VISIBLE_DEVICES": "", **(env or {})},
        )  # fmt: skip

    def launch(
        self,
        config: Path,
        log: Path,
        *extra: str,
        command: str = "sft",
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """``python -m mizzen_train <command> --config <config> <extra>``, its output appended
        to ``log``, ``env`` on top of :meth:`env`."""
        argv = [sys.executable, "-m", "mizzen_train", command, "--config", str(config), *extra]
        handle = open(log, "ab")  # noqa: SIM115 (the child owns it; closed on wait)
        try:
            return subprocess.Popen(
                argv, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**self.env(), **(env or {})},
            )  # fmt: skip
        finally:
            handle.close()

    def read_metrics(self, path: Path) -> list[Record]:
        """The records of a ``metrics.jsonl`` so far ([] before it exists)."""
        if not path.is_file():
            return []
        records = []
        for line in path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(json.JSONDecodeError):  # a line being written right now
                records.append(json.loads(line))
        return records

    def max_train_step(self, records: Sequence[Record]) -> int:
        """The last step a train record was logged for (0 before the first)."""
        return max((r["step"] for r in records if r.get("kind") == "train"), default=0)

    def engine_descendants(self, pid: int) -> list[int]:
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

    def identities(self, pids: Sequence[int]) -> list[Identity]:
        """``(pid, start time)`` of each process: which process a pid names, even after it is
        reused (the start time, in clock ticks since boot, is field 22 of its stat)."""
        found = []
        for pid in pids:
            fields = _stat_fields(pid)
            if fields is not None:
                found.append((pid, int(fields[19])))
        return found

    def alive(self, process: int | Identity) -> bool:
        """True while the process runs: a pid, or a ``(pid, start time)`` identity (a pid given
        to another process since is not it); a zombie waiting for a reaper counts as gone."""
        pid, started = process if isinstance(process, tuple) else (process, None)
        fields = _stat_fields(pid)
        if fields is None or fields[0] in ("Z", "X"):
            return False
        return started is None or int(fields[19]) == started

    def orphans(self, engines: Sequence[Identity], timeout_s: float = 15.0) -> list[int]:
        """Pids of a killed run's engines (identities taken before the kill) still alive after
        ``timeout_s``: an engine exits on its own once its parent is gone (the resumed run starts
        meanwhile; a reused pid is another process, not an orphan)."""
        deadline = time.monotonic() + timeout_s
        while any(self.alive(e) for e in engines) and time.monotonic() < deadline:
            time.sleep(0.1)
        return [pid for pid, started in engines if self.alive((pid, started))]

    def kill_when(
        self,
        process: subprocess.Popen[bytes],
        log: Path,
        reached: Callable[[], bool],
        *,
        timeout_s: float = 600.0,
    ) -> list[Identity]:
        """SIGKILL ``process`` once ``reached()`` (polled every 20 ms, ``timeout_s`` at most; the
        process may not exit before); returns the identities of the engines it had started."""
        engines: list[Identity] = []
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                assert process.poll() is None, (
                    f"exited early ({process.returncode}):\n{log.read_text()[-6000:]}"
                )
                assert time.monotonic() < deadline, "timed out waiting for the kill point"
                if reached():
                    break
                time.sleep(0.02)
            engines = self.identities(self.engine_descendants(process.pid))
            os.kill(process.pid, signal.SIGKILL)
            process.wait(60)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(60)
        assert process.returncode == -signal.SIGKILL
        return engines


class SftRuns(RunProcesses):
    """The SFT e2e protocol: an uninterrupted run, a killed-and-resumed one, or both at once
    (:meth:`side_by_side`), and the checks of a finished run's metrics."""

    RECORD_KEYS: ClassVar[dict[str, set[str]]] = SFT_RECORD_KEYS

    def colours_sections(
        self, run_dir: Path, *, steps: int = 60, interval: int = 20, checkpoint_interval: int = 10
    ) -> Sections:
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

    def small_sections(
        self,
        run_dir: Path | str,
        *,
        steps: int = 4,
        checkpoint_interval: int = 2,
        lr: float = 1e-3,
        data: str = "example:colours_train",
        **run: Any,
    ) -> Sections:
        """The small run of the CLI and run-directory tests: the tiny Llama (its defaults), one
        tenant ``a`` on ``data`` (4 rows, ``lr``), no eval; ``run`` adds ``[run]`` keys
        (``threads=1``).  ``run_dir`` is written as given (a relative one is read from the
        run's working directory)."""
        return {
            "run": {"dir": str(run_dir), "steps": steps,
                    "checkpoint_interval": checkpoint_interval, **run},
            "model": {"path": "tiny"},
            "data": {"seq_len": 144},
            "tenants": [{"name": "a", "data": data, "rows": 4, "lr": lr}],
        }  # fmt: skip

    def run_to_completion(
        self,
        config: Path,
        log: Path,
        run_dir: Path,
        *,
        first_point: int,
        stop: threading.Event | None = None,
    ) -> dict[str, Any]:
        """Run ``mizzen-train sft`` to its end, watching for engine processes before the first
        eval point; returns the records, the output, the wall time and what it saw.  Setting
        ``stop`` (from another thread) kills the run and fails the call."""
        stop = stop if stop is not None else threading.Event()
        started = time.monotonic()
        process = self.launch(config, log)
        early_engines = []
        try:
            while process.poll() is None and not stop.is_set():
                step = self.max_train_step(self.read_metrics(run_dir / "metrics.jsonl"))
                engines = self.engine_descendants(process.pid)
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
            "records": self.read_metrics(run_dir / "metrics.jsonl"),
            "output": output,
            "wall": time.monotonic() - started,
            "early_engines": early_engines,
        }

    def by_process(self, records: Sequence[Record]) -> list[list[Record]]:
        """The records in file order, split at each ``run_started`` / ``resumed`` event: those
        of each process of the run (an interrupted run and its resumption: two)."""
        processes: list[list[Record]] = []
        for record in records:
            if record.get("event") in ("run_started", "resumed") or not processes:
                processes.append([])
            processes[-1].append(record)
        return processes

    def check_protocol(
        self, records: list[Record], *, steps: int, points: Sequence[int]
    ) -> dict[str, Any]:
        """The SFT e2e protocol on a finished run's metrics: every record has its schema; the run
        needed engines for eval only; each step trained once; exactly ``points`` were evaluated
        (the last one forced, flagged final), every evaluation succeeded, and the eval score and
        held-out loss improved from the first point to the last; each process of the run started
        one eval engine (``engine_lifetime = "run"``), at the first point it evaluated and after
        that step trained, and pointed it at each later point's snapshot; the process that
        finished stopped its engine once, after its last point (a SIGKILLed one cannot say so:
        the orphan checks see its engine exit).  Returns the score and held-out loss of each
        point and the summary."""
        for record in records:
            if record["kind"] in self.RECORD_KEYS:
                assert set(record) == self.RECORD_KEYS[record["kind"]], record
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
        processes = self.by_process(records)
        for process in processes:
            evaluated = sorted({r["step"] for r in process if r["kind"] == "eval"})
            starts = [r for r in process if r.get("event") == "engine_started"]
            assert [e["step"] for e in starts] == evaluated[:1], ("one engine", evaluated, starts)
            for event in starts:
                assert event["purpose"] == "eval" and event["time"] >= trained_at[event["step"]]
            updated = [r["step"] for r in process if r.get("event") == "engine_weights_updated"]
            assert updated == evaluated[1:], ("kept and pointed at each snapshot", updated)
        last = processes[-1]
        started = [e["pid"] for e in last if e.get("event") == "engine_started"]
        stops = [e for e in last if e.get("event") == "engine_stopped"]
        assert sorted(e["pid"] for e in stops) == sorted(started), stops
        last_eval = max(r["time"] for r in last if r["kind"] == "eval")
        assert all(e["time"] >= last_eval for e in stops), "stopped after the last point"
        summary = records[-1]
        assert summary["kind"] == "summary" and summary["eval_points"] == list(points)
        final = summary["final_eval"]["colours"]
        assert (final["answers"]["score"], final["heldout"]["loss"]) == (
            score[points[-1]],
            heldout[points[-1]],
        )
        return {"score": score, "heldout": heldout, "summary": summary}

    def kill_and_resume(
        self, config: Path, log: Path, run_dir: Path, *, kill_after: int, point: int
    ) -> dict[str, Any]:
        """Start a run, SIGKILL it once it trained ``kill_after`` steps and eval ``point``
        settled, then ``--resume`` it to the end.  Returns what the test checks."""
        metrics = run_dir / "metrics.jsonl"

        def reached() -> bool:
            records = self.read_metrics(metrics)
            settled = any(r["kind"] == "eval_point" and r["step"] == point for r in records)
            return settled and self.max_train_step(records) >= kill_after

        engines = self.kill_when(self.launch(config, log), log, reached)
        before = self.read_metrics(metrics)
        checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
        run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
        resumed_at = time.time()
        second = self.launch(config, log, "--resume")
        orphans = self.orphans(engines)
        assert second.wait(900) == 0, log.read_text()[-6000:]
        return {
            "killed_at": self.max_train_step(before),
            "checkpoints_at_kill": checkpoints,
            "run_id": run_id,
            "orphans": orphans,
            "resumed_at": resumed_at,
            "records": self.read_metrics(metrics),
            "output": log.read_text(),
        }

    def side_by_side(
        self,
        run: tuple[Path, Path, Path],
        killed: tuple[Path, Path, Path],
        *,
        first_point: int,
        kill_after: int,
        point: int,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """``run_to_completion(*run, first_point=...)`` and ``kill_and_resume(*killed,
        kill_after=..., point=...)`` at once, each ``(config, log, run_dir)`` its own run: the
        uninterrupted run (early-engine watch included) in a thread, the kill-and-resume protocol
        in this one.  Waits for both and returns their two dicts, in that order.  If the protocol
        fails, the uninterrupted run is killed and the protocol's error raised; if the
        uninterrupted run fails, its error is raised once the protocol has finished.  For GPU
        tests, whose runs leave the device idle most of the time; CPU runners (2 cores) run the
        two one after the other."""
        stop = threading.Event()
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="sft-uninterrupted") as pool:
            uninterrupted = pool.submit(
                self.run_to_completion, *run, first_point=first_point, stop=stop
            )
            try:
                resumed = self.kill_and_resume(*killed, kill_after=kill_after, point=point)
            except BaseException:
                stop.set()
                raise
            return uninterrupted.result(), resumed


class RlRuns(RunProcesses):
    """The RL e2e protocol: the toy two-tenant configuration, the reference-and-faulty run pair
    (NaN injection, SIGKILL, ``--resume``) and the per-run checks."""

    TENANTS: ClassVar[tuple[str, ...]] = RL_TENANTS
    TRAIN_KEYS: ClassVar[set[str]] = RL_TRAIN_KEYS

    def sections(
        self, run_dir: Path, *, steps: int = 30, checkpoint_interval: int = 10
    ) -> Sections:
        """The two-tenant toy RL run of the README (``example:rl_tiny``) at e2e size: every
        adapter version kept (the tests compare their bytes), one eval point at the end on both
        tasks."""
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
                {"name": "fixed", "data": "example:rl_fixed", "reward": "mizzen_train.rl.toy:fixed_token",
                 "max_new_tokens": 1, **tenant},
                {"name": "format", "data": "example:rl_format",
                 "reward": "mizzen_train.rl.toy:lowercase_format", "data_seed": 1, **tenant},
            ],
            "eval": {"interval": steps, "snapshot_dir": "snapshots", "max_in_flight": 1,
                     "overflow": "wait", "keep_snapshots": 1},
            "eval.evaluators": [
                {"kind": "generate", "name": "task_fixed", "data": "example:rl_fixed",
                 "reward": "mizzen_train.rl.toy:fixed_token", "max_new_tokens": 1, "limit": 8},
                {"kind": "generate", "name": "task_format", "data": "example:rl_format",
                 "reward": "mizzen_train.rl.toy:lowercase_format", "max_new_tokens": 3, "limit": 8},
            ],
        }  # fmt: skip

    def wait_all(
        self, processes: Sequence[subprocess.Popen[bytes]], logs: Sequence[Path], timeout_s: float
    ) -> None:
        """Wait for every process (``timeout_s`` for all of them), each must exit with 0."""
        deadline = time.monotonic() + timeout_s
        for process, log in zip(processes, logs, strict=True):
            try:
                process.wait(max(1.0, deadline - time.monotonic()))
            except Exception:
                process.kill()
                process.wait(60)
            assert process.returncode == 0, log.read_text()[-6000:]

    def adapter_bytes(self, run_dir: Path, tenant: str, version: int) -> bytes:
        """The safetensors bytes of a published adapter version."""
        return (
            run_dir / "adapters" / tenant / f"v{version:08d}" / "adapter_model.safetensors"
        ).read_bytes()

    def protocol(
        self,
        tmp_path: Path,
        sections_of: Callable[[Path], Sections],
        *,
        steps: int,
        nan_step: int,
        kill_after: int,
        checkpoint_interval: int,
        timeout_s: float = 900.0,
    ) -> dict[str, Any]:
        """The RL e2e protocol (CPU and GPU tests run it): a reference run R and, beside it, a
        run F whose tenant "format" gets NaN advantages at ``nan_step`` and which is SIGKILLed
        once it has logged ``kill_after`` steps, then resumed with ``--resume``.  Returns both
        runs' records and paths for the checks."""
        ref_dir, faulty_dir = tmp_path / "reference", tmp_path / "faulty"
        ref_config = self.write_config(tmp_path / "reference.toml", sections_of(ref_dir))
        faulty_config = self.write_config(tmp_path / "faulty.toml", sections_of(faulty_dir))
        ref_log, faulty_log = tmp_path / "reference.log", tmp_path / "faulty.log"
        nan_env = {"MIZZEN_RL_INJECT_NAN": f"format@{nan_step}"}
        started = time.monotonic()
        reference = self.launch(ref_config, ref_log, command="rl")
        faulty = self.launch(faulty_config, faulty_log, command="rl", env=nan_env)

        def reached() -> bool:
            records = self.read_metrics(faulty_dir / "metrics.jsonl")
            return self.max_train_step(records) >= kill_after

        engines = self.kill_when(faulty, faulty_log, reached, timeout_s=timeout_s)
        killed_records = self.read_metrics(faulty_dir / "metrics.jsonl")
        checkpoints = sorted(p.name for p in (faulty_dir / "checkpoints").iterdir())
        resumed_at = time.time()
        resumed = self.launch(faulty_config, faulty_log, "--resume", command="rl", env=nan_env)
        orphans = self.orphans(engines)
        self.wait_all([reference, resumed], [ref_log, faulty_log], timeout_s)
        return {
            "wall": time.monotonic() - started,
            "reference": {"dir": ref_dir, "records": self.read_metrics(ref_dir / "metrics.jsonl"),
                          "output": ref_log.read_text()},
            "faulty": {"dir": faulty_dir,
                       "records": self.read_metrics(faulty_dir / "metrics.jsonl"),
                       "output": faulty_log.read_text(), "killed_records": killed_records,
                       "checkpoints_at_kill": checkpoints, "orphans": orphans,
                       "resumed_at": resumed_at,
                       "run_id": json.loads((faulty_dir / "run.json").read_text())["run_id"]},
        }  # fmt: skip

    def check_run(self, records: list[Record], *, steps: int) -> dict[str, dict[int, Record]]:
        """Per-run rules: every train record has the RL schema, each (step, tenant) is logged
        once, every sample of a step comes from the version published by the step before
        (synchronous rollouts), the engines were needed for training.  Returns train records by
        tenant, step."""
        first = next(r for r in records if r.get("event") in ("run_started", "resumed"))
        assert first["engines_needed"] == "train+eval"
        train = [r for r in records if r["kind"] == "train"]
        for record in train:
            assert set(record) == self.TRAIN_KEYS, sorted(set(record) ^ self.TRAIN_KEYS)
        by: dict[str, dict[int, Record]] = {t: {} for t in self.TENANTS}
        for record in train:
            assert record["step"] not in by[record["tenant"]], ("logged twice", record)
            by[record["tenant"]][record["step"]] = record
        for tenant in self.TENANTS:
            assert sorted(by[tenant]) == list(range(1, steps + 1)), tenant
            assert by[tenant][1]["adapter_version"] == 0
            for step in range(2, steps + 1):
                previous = by[tenant][step - 1]["published_version"]
                assert by[tenant][step]["adapter_version"] == previous
        return by
