"""The run's metrics as JSON lines, and the progress line.

Every line of ``metrics.jsonl`` is one JSON object with a ``kind``:

- ``train``: ``step``, ``tenant``, ``loss``, ``lr``, ``grad_norm``, ``tokens`` (the tenant's
  non-padding positions), ``loss_tokens``, ``tokens_per_s`` (the whole step's throughput),
  ``step_s``, ``stepped`` (False when a non-finite gradient skipped the update), ``time``;
- ``eval``: ``step`` (the snapshot's), ``tenant``, ``evaluator``, ``status`` (``ok`` |
  ``skipped``), ``metrics`` (``{name: number}``), ``reason``, ``wall_s``, ``time``;
- ``eval_point``: ``step``, ``status`` (``ok`` | ``partial`` | ``skipped``), ``final``,
  ``reason``, ``wall_s``;
- ``event``: ``event`` (``run_started``, ``resumed``, ``checkpoint``, ``engine_started``, ...)
  and its fields;
- ``summary``: the last line of a finished run: ``final`` eval metrics by tenant and evaluator,
  the final training loss, wall time and tokens/s.

Invariants:
- Only the run's writer rank writes ``metrics.jsonl`` and prints progress lines; the values it
  writes are the whole world's (losses are reduced over data-parallel ranks by the executor).
- One ``write`` per line under a lock, flushed: lines are whole and never interleaved (worker
  threads log eval results).  A line cut by a kill is dropped, and counted, when the file is read.
- :func:`rewrite_for_resume` keeps eval results (they are keyed by step and never redone) and
  drops training lines after the checkpoint the run resumes from (those steps run again).
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from mizzen_train.run.loggers import MetricSink


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no nan/inf; keep it visible rather than dropping it
    if isinstance(value, Mapping):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], int]:
    """Every whole record of a metrics file, and how many broken lines were dropped."""
    if not path.is_file():
        return [], 0
    records, broken = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # not JSON, a huge integer, nesting too deep
            broken += 1
            continue
        if _well_formed(record):
            records.append(record)
        else:
            broken += 1
    return records, broken


_NUMBER = (int, float)
_NULLABLE = frozenset({"loss", "reward_mean", "metrics", "reason"})  # may be written as null
_NON_FINITE = frozenset({"nan", "inf", "-inf"})  # a number as _clean writes a non-finite one
#: the kinds of record the run reads back (resume, eval bookkeeping, summary, plot) -> each
#: field it reads -> (its type, whether every record of the kind holds it); other kinds (events)
#: are kept as they are, whatever they hold
_READ_BACK: dict[str, dict[str, tuple[type | tuple[type, ...], bool]]] = {
    "train": {"step": (int, True), "tenant": (str, True), "loss": (_NUMBER, True),
              "reward_mean": (_NUMBER, False)},
    "eval": {"step": (int, True), "tenant": (str, True), "evaluator": (str, True),
             "status": (str, True), "metrics": (dict, False), "reason": (str, False)},
    "eval_point": {"step": (int, True), "status": (str, True)},
}  # fmt: skip


def _well_formed(record: Any) -> bool:
    """A record the readers can use: a table with a ``kind``; of a kind the run reads back,
    every field they read present where required and of its type (a bool is no step; the
    fields the trainers write as null may be null); an ``ok`` eval record holds its metrics."""
    if not isinstance(record, dict) or not isinstance(record.get("kind"), str):
        return False
    for name, (kind, required) in _READ_BACK.get(record["kind"], {}).items():
        if name not in record:
            if required:
                return False
            continue
        value = record[name]
        if value is None and name in _NULLABLE:
            continue
        if kind is _NUMBER and isinstance(value, str) and value in _NON_FINITE:
            continue
        if not isinstance(value, kind) or isinstance(value, bool):
            return False
    if record["kind"] == "eval" and record["status"] == "ok":
        return isinstance(record.get("metrics"), dict)
    return True


def rewrite_for_resume(path: Path, resume_step: int) -> tuple[list[dict[str, Any]], int]:
    """Keep the records a resumed run builds on; returns them and the broken-line count."""
    records, broken = read_metrics(path)
    kept = [
        r
        for r in records
        if not (r["kind"] == "train" and r["step"] > resume_step) and r["kind"] != "summary"
    ]
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    with open(tmp, "w", encoding="utf-8") as handle:
        for record in kept:
            handle.write(json.dumps(record, sort_keys=True) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return kept, broken


def settled_eval_keys(records: Iterable[Mapping[str, Any]]) -> set[tuple[int, str, str]]:
    return {
        (int(r["step"]), str(r["tenant"]), str(r["evaluator"]))
        for r in records
        if r.get("kind") == "eval"
    }


class MetricsLog:
    """Append-only JSON lines, thread-safe; each record also goes to the optional ``sinks``
    (:mod:`mizzen_train.run.loggers`: TensorBoard, W&B), in order, under the same lock."""

    def __init__(self, path: Path, sinks: Sequence[MetricSink] = ()) -> None:
        self.path = path
        self.sinks = tuple(sinks)
        self._lock = threading.Lock()
        self._handle: TextIO = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close)

    def write(self, kind: str, **fields: Any) -> dict[str, Any]:
        record = _clean({"kind": kind, "time": round(time.time(), 3), **fields})
        line = json.dumps(record, sort_keys=True) + "\n"
        with self._lock:
            self._handle.write(line)
            self._handle.flush()
            for sink in self.sinks:
                sink.record(record)
        return record

    def event(self, event: str, **fields: Any) -> dict[str, Any]:
        return self.write("event", event=event, **fields)

    def close(self) -> None:
        with self._lock:
            self._handle.close()
            for sink in self.sinks:
                sink.close()


class UnwrittenMetrics:
    """The metrics log of a rank that is not the run's writer (:mod:`mizzen_train.run.parallel`):
    records are formed as :class:`MetricsLog` forms them, and written nowhere."""

    def write(self, kind: str, **fields: Any) -> dict[str, Any]:
        return _clean({"kind": kind, "time": round(time.time(), 3), **fields})

    def event(self, event: str, **fields: Any) -> dict[str, Any]:
        return self.write("event", event=event, **fields)

    def close(self) -> None:
        pass


def format_duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


class Progress:
    """One line per logged step on stderr: step, loss per tenant, tokens/s, ETA.  The ETA is the
    wall time per step over the last logged steps (evaluation points, checkpoints and waits
    included), not the compute time of a step alone; the first line has only ``step_s``."""

    def __init__(
        self,
        total_steps: int,
        *,
        stream: TextIO | None = None,
        command: str = "sft",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = total_steps
        self.stream = stream or sys.stderr
        self.command = command
        self.clock = clock
        self._seen: list[tuple[int, float]] = []  # (step, clock) of the last logged steps
        #: A rank other than the run's writer prints nothing.
        self.quiet = False

    def step(
        self,
        step: int,
        losses: Mapping[str, float],
        tokens_per_s: float,
        step_s: float,
        *,
        label: str = "loss",
    ):
        self._seen = [*self._seen[-19:], (step, self.clock())]
        (first, since), (_, now) = self._seen[0], self._seen[-1]
        per_step = (now - since) / (step - first) if step > first else step_s
        eta = (self.total - step) * per_step
        loss_text = " ".join(f"{name}={value:.4f}" for name, value in losses.items())
        rate = f"{tokens_per_s / 1000:.1f}k" if tokens_per_s >= 1000 else f"{tokens_per_s:.0f}"
        self.print(
            f"step {step}/{self.total} | {label} {loss_text} | {rate} tok/s | "
            f"eta {format_duration(eta)}"
        )

    def print(self, text: str) -> None:
        """One progress line, through the CLI's one rule for what it prints (rollout's
        ``shown_line``: masked, escaped to one terminal line; it may name files from disk)."""
        if self.quiet:
            return
        from mizzen_rollout.api import shown_line

        print(shown_line(f"[mizzen-train {self.command}] {text}"), file=self.stream, flush=True)
