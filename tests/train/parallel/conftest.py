"""Fixtures of the parallel-run tests: real ``mizzen-train sft`` and ``rl`` runs under real
``torchrun``.

:class:`ParallelRuns` writes a run's TOML (:meth:`ParallelRuns.sections` for SFT,
:meth:`ParallelRuns.rl_sections` for RL), launches it (one process, or ``torchrun --standalone
--nproc-per-node N``), finds a launched rank's pid, reads ``metrics.jsonl`` and the exports.
Standard library only (the test process never imports torch for these; the runs do).

Invariants: every launch is bounded by a timeout and its process group is killed on the way out
(nothing outlives a test); every run has its own directory; ranks use one torch thread each.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

Record = dict[str, Any]


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


@dataclass
class Launcher:
    """``launcher(name, ranks, *extra)`` starts one run (see :meth:`ParallelRuns.launches`)."""

    runs: ParallelRuns
    root: Path
    command: str
    config: Path
    out: dict[str, Any]
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def __call__(self, name: str, ranks: int, *extra: str) -> subprocess.Popen[bytes]:
        self.out[name] = self.root / name
        return self.track(
            self.runs.start(
                ranks, self.root / f"{name}.log", self.command, "--config", str(self.config),
                "--run.dir", str(self.root / name), *extra,
            )
        )  # fmt: skip

    def track(self, process: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
        """Kill ``process`` too when the block ends."""
        self.processes.append(process)
        return process


class ParallelRuns:
    """Launch, watch and read parallel SFT and RL runs (see the module docstring)."""

    #: A tiny two-tenant run whose every layout (DP=2, TP=2, DP=2 x TP=2) divides: 4 heads,
    #: 2 query groups, vocabulary 260, FFN 128; 4 rows a step, one row per micro-batch.
    TENANTS = ("alpha", "beta")

    def sections(self, run_dir: Path, *, steps: int = 10, device: str = "cpu") -> dict[str, Any]:
        tenants = [
            {
                "name": name, "data": "example:colours_train", "rows": 2, "lr": 1e-2,
                "lora_rank": 8, "lora_alpha": 16, "data_seed": seed, "lora_seed": seed,
            }
            for seed, name in enumerate(self.TENANTS)
        ]  # fmt: skip
        return {
            "run": {
                "dir": str(run_dir), "steps": steps, "checkpoint_interval": 5, "device": device,
                "dtype": "fp32", "micro_batch_size": 1, "threads": 1, "plot": False,
                "export_merged": True, "keep_checkpoints": 4,
            },
            "model": {"path": "tiny", "tokenizer": "model"},
            "model.tiny": {"seed": 0, "initializer_range": 0.12, "vocab_size": 260},
            "data": {"seq_len": 96, "on_overlong": "drop"},
            "tenants": tenants,
            "eval": {"interval": 5, "snapshot_dir": "snapshots", "max_in_flight": 1,
                     "overflow": "wait", "keep_snapshots": 2},
            "eval.evaluators": [
                {"kind": "loss", "name": "heldout", "data": "example:colours_eval", "limit": 4,
                 "device": device},
            ],
        }  # fmt: skip

    def rl_sections(self, run_dir: Path, *, steps: int = 4) -> dict[str, Any]:
        """A tiny two-tenant RL run (the toy tasks of ``example:rl_tiny``) whose every layout
        (DP=2, TP=2) divides: 16 rows a step (2 prompts x 4 samples per tenant), 4 rows per
        micro-batch, vocabulary 260; one embedded engine, the KL term on (the policy loss alone
        is ~0 on policy), a checkpoint every 2 steps, one generate evaluator at the end."""
        tenant = {"prompts_per_step": 2, "n_samples": 4, "lr": 2e-2, "lora_rank": 8,
                  "lora_alpha": 16.0}  # fmt: skip
        return {
            "run": {
                "dir": str(run_dir), "steps": steps, "checkpoint_interval": 2, "device": "cpu",
                "dtype": "fp32", "micro_batch_size": 4, "threads": 1, "seed": 0, "plot": False,
                "keep_checkpoints": 4,
            },
            "model": {"path": "tiny", "tokenizer": "model"},
            "model.tiny": {"seed": 0, "initializer_range": 0.12, "vocab_size": 260},
            "rollout": {"engines": "embedded", "num_engines": 1, "max_new_tokens": 3,
                        "temperature": 1.0, "top_k": 50, "keep_adapters": 0},
            "algo": {"advantage": "grpo", "kl_coef": 0.05},
            "tenants": [
                {"name": "fixed", "data": "example:rl_fixed",
                 "reward": "mizzen_train.rl.toy:fixed_token", "max_new_tokens": 1, **tenant},
                {"name": "format", "data": "example:rl_format",
                 "reward": "mizzen_train.rl.toy:lowercase_format", "data_seed": 1, **tenant},
            ],
            "eval": {"interval": steps, "snapshot_dir": "snapshots", "max_in_flight": 1,
                     "overflow": "wait", "keep_snapshots": 1},
            "eval.evaluators": [
                {"kind": "generate", "name": "task_format", "data": "example:rl_format",
                 "reward": "mizzen_train.rl.toy:lowercase_format", "max_new_tokens": 3,
                 "limit": 4},
            ],
        }  # fmt: skip

    def write_config(self, path: Path, sections: dict[str, Any]) -> Path:
        lines = []
        for section, body in sections.items():
            for table in body if isinstance(body, list) else [body]:
                lines.append(f"[[{section}]]" if isinstance(body, list) else f"[{section}]")
                lines += [f"{key} = {_toml_value(value)}" for key, value in table.items()]
                lines.append("")
        path.write_text("\n".join(lines), encoding="utf-8")
        return path

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
            OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
        )  # fmt: skip
        env.setdefault("RAY_AUTH_MODE", "disabled")
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)  # a run starts its own world
        return env

    def argv(self, ranks: int, *args: str) -> list[str]:
        """``python -m mizzen_train ARGS`` (one rank) or the same under ``torchrun``."""
        if ranks == 1:
            return [sys.executable, "-m", "mizzen_train", *args]
        return [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={ranks}", "-m", "mizzen_train", *args,
        ]  # fmt: skip

    def start(self, ranks: int, log: Path, *args: str) -> subprocess.Popen[bytes]:
        handle = open(log, "ab")  # noqa: SIM115 (the child owns it)
        try:
            return subprocess.Popen(
                self.argv(ranks, *args), stdout=handle, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=self.env(), start_new_session=True,
            )  # fmt: skip
        finally:
            handle.close()

    def finish(self, process: subprocess.Popen[bytes], timeout: float) -> int:
        """Wait for ``process``; at ``timeout`` kill its whole session (and fail)."""
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise AssertionError(f"{process.args} ran past {timeout} s") from None

    @contextlib.contextmanager
    def launches(
        self, root: Path, command: str, config: Path, out: dict[str, Any]
    ) -> Iterator[Launcher]:
        """A :class:`Launcher` of ``mizzen-train <command> --config <config>`` runs, each in
        ``root / name`` (recorded as ``out[name]``); every process it started (or was told of)
        that still runs when the block ends has its session killed, whatever happened."""
        launcher = Launcher(self, root, command, config, out)
        try:
            yield launcher
        finally:
            for process in launcher.processes:
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()

    def run(self, ranks: int, log: Path, *args: str, timeout: float = 300.0) -> int:
        return self.finish(self.start(ranks, log, *args), timeout)

    def read_metrics(self, run_dir: Path) -> list[Record]:
        records = []
        path = run_dir / "metrics.jsonl"
        if not path.is_file():
            return records
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line being written
        return records

    def losses(self, records: list[Record]) -> dict[tuple[int, str], float]:
        return {(r["step"], r["tenant"]): r["loss"] for r in records if r["kind"] == "train"}

    def rank_pid(self, launcher: int, rank: int) -> int | None:
        """The pid of the process with ``RANK=rank`` in its environment among ``launcher``'s
        children (torchrun's workers)."""
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid != launcher:
                    continue
                environ = (entry / "environ").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue
            if f"RANK={rank}".encode() in environ:
                return int(entry.name)
        return None

    def wait_for(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}")
            time.sleep(0.05)

    def export_files(self, export: Path) -> dict[str, bytes]:
        """Every file of an export directory by relative path (``adapter_config.json`` without
        its ``base_model_name_or_path``, which names the run's own directory)."""
        files = {}
        for path in sorted(export.rglob("*")):
            if not path.is_file():
                continue
            data = path.read_bytes()
            if path.name == "adapter_config.json":
                config = json.loads(data)
                config.pop("base_model_name_or_path", None)
                data = json.dumps(config, sort_keys=True).encode()
            files[str(path.relative_to(export))] = data
        return files


@pytest.fixture(scope="session")
def parallel_runs() -> ParallelRuns:
    """Write, launch (``torchrun`` or one process) and read parallel SFT and RL runs."""
    return ParallelRuns()
