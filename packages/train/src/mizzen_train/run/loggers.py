"""Optional metric loggers beside ``metrics.jsonl``: ``[run] loggers = ["jsonl", "tensorboard",
"wandb"]``.

Invariants:
- JSONL (``metrics.jsonl``, :mod:`mizzen_train.run.metrics`) is always written; the names here
  add sinks that receive every record :class:`~mizzen_train.run.metrics.MetricsLog` writes, in
  the same order, under its lock (one writer at a time).
- One table, :data:`LOGGERS`: a name, the module it needs and the extra of mizzen-train that
  installs it.  :func:`check_loggers` reads it while the configuration is checked (before any
  heavy import): an unknown name or a missing package is a ConfigError naming ``run.loggers``
  and the ``pip install 'mizzen-train[EXTRA]'`` that fixes it (found with
  ``importlib.util.find_spec``, nothing imported).
- The packages are imported lazily, in :func:`open_loggers`; a logger writes under the run's
  directory only: TensorBoard event files in ``<run.dir>/tensorboard``, W&B's run in
  ``<run.dir>/wandb`` (``WANDB_MODE=offline`` keeps it there, with no network).
- What is logged: a ``train`` record's numbers as ``train/<tenant>/<name>`` at its step; an
  ``eval`` record's metrics as ``eval/<evaluator>/<tenant>/<metric>`` at its snapshot's step
  (W&B: against its own ``eval_step`` axis, since results arrive after later training steps);
  the other kinds (events, eval points, summary) stay in the JSONL.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from mizzen_train.run.config import ConfigError
from mizzen_train.run.layout import TENSORBOARD_DIR

__all__ = ["LOGGERS", "LoggerSpec", "MetricSink", "check_loggers", "open_loggers"]


@dataclass(frozen=True)
class LoggerSpec:
    """A logger: the module it imports (None: none) and the extra that installs it."""

    module: str | None
    extra: str | None
    help: str


#: every logger a run may name in ``[run] loggers``
LOGGERS: dict[str, LoggerSpec] = {
    "jsonl": LoggerSpec(None, None, "metrics.jsonl in run.dir (always written)"),
    "tensorboard": LoggerSpec("tensorboard", "tensorboard", "event files in run.dir/tensorboard"),
    "wandb": LoggerSpec("wandb", "wandb", "a Weights & Biases run (files in run.dir/wandb)"),
}

#: the numbers of a train record that are not metrics to draw
_NOT_METRICS = frozenset({"step", "time", "stepped"})


class MetricSink(Protocol):
    """What :class:`~mizzen_train.run.metrics.MetricsLog` hands each record to."""

    def record(self, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def check_loggers(names: Sequence[str], source: str) -> None:
    """Each name is in :data:`LOGGERS` and its package is installed; else a ConfigError."""
    for name in names:
        spec = LOGGERS.get(name)
        if spec is None:
            raise ConfigError("run.loggers", list(names), f"{name!r} is not a logger",
                              f"use some of {sorted(LOGGERS)}", source=source)  # fmt: skip
        if spec.module and importlib.util.find_spec(spec.module) is None:
            raise ConfigError(
                "run.loggers", list(names), f"{name!r} needs the {spec.module} package",
                f"pip install 'mizzen-train[{spec.extra}]' (or drop {name!r})", source=source,
            )  # fmt: skip


def _numbers(values: Mapping[str, Any]) -> dict[str, float]:
    return {
        key: float(value)
        for key, value in values.items()
        if isinstance(value, int | float)
        and not isinstance(value, bool)
        and key not in _NOT_METRICS
        and math.isfinite(value)
    }


def scalars(record: Mapping[str, Any]) -> tuple[str, int, dict[str, float]] | None:
    """(axis, step, {tag: value}) of a train or eval record; None for the other kinds."""
    kind, step = record.get("kind"), record.get("step")
    if not isinstance(step, int):
        return None
    if kind == "train":
        tenant = record.get("tenant", "?")
        return "step", step, {f"train/{tenant}/{k}": v for k, v in _numbers(record).items()}
    if kind == "eval" and record.get("status") == "ok":
        where = f"eval/{record.get('evaluator', '?')}/{record.get('tenant', '?')}"
        metrics = _numbers(record.get("metrics") or {})
        return "eval_step", step, {f"{where}/{k}": v for k, v in metrics.items()}
    return None


class TensorBoardLogger:
    """Scalars into TensorBoard event files (torch's SummaryWriter, the tensorboard package)."""

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR))

    def record(self, record: Mapping[str, Any]) -> None:
        found = scalars(record)
        if found:
            _, step, values = found
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, global_step=step)
            self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A W&B run; train metrics against ``step``, eval metrics against ``eval_step``."""

    def __init__(self, run_dir: Path, *, name: str, command: str) -> None:
        import wandb

        self.run = wandb.init(
            project="mizzen",
            name=name,
            dir=str(run_dir),
            config={"command": command, "run_dir": str(run_dir)},
            reinit="create_new",
            settings=wandb.Settings(silent=True, console="off"),  # our streams stay ours
        )
        self.run.define_metric("step")
        self.run.define_metric("eval_step")
        self.run.define_metric("train/*", step_metric="step")
        self.run.define_metric("eval/*", step_metric="eval_step")

    def record(self, record: Mapping[str, Any]) -> None:
        found = scalars(record)
        if found:
            axis, step, values = found
            self.run.log({axis: step, **values})

    def close(self) -> None:
        self.run.finish()


def open_loggers(
    names: Sequence[str], run_dir: Path, *, name: str, command: str
) -> tuple[MetricSink, ...]:
    """The sinks of ``names`` (JSONL needs none: MetricsLog writes it)."""
    sinks: list[MetricSink] = []
    if "tensorboard" in names:
        sinks.append(TensorBoardLogger(run_dir))
    if "wandb" in names:
        sinks.append(WandbLogger(run_dir, name=name, command=command))
    return tuple(sinks)
