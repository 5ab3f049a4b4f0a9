"""The kinded records of the history store that the health page reads (one JSON object per line
in any ``*.jsonl`` of the store; :func:`mizzen_ci.history.is_kinded_line`).

``pool``: one pool of one planned run, written by ``mizzen-ci report --record-plan`` from the
plan's ``pools`` (nightly.yml's history job, for each trusted run it merges)::

    {"kind": "pool", "v": 1, "when": ISO, "run": KEY, "event": "schedule", "pool": "h200-2gpu",
     "lane": "gpu-hopper", "jobs": 3, "runners": 3, "gpus_per_runner": 2, "tests": 14,
     "gpu_seconds": 5400.0, "makespan_seconds": 1020.0, "lower_bound_seconds": 900.0}

``queue``: how long one job waited for a runner (a workflow step may write it)::

    {"kind": "queue", "v": 1, "when": ISO, "pool": "h200-2gpu", "job": "hopper-h200-2gpu-1",
     "queued_seconds": 84.0}

``audit``: one run of the selection audit (what the planner left out that would have failed)::

    {"kind": "audit", "v": 1, "when": ISO, "recall": 0.97, "caught": 33, "failing": 34,
     "window": "2026-11-01..2026-12-01"}

``recall`` is ``caught / failing`` (failing test runs the selection would have run, over all
failing test runs the audit saw), from 0 to 1; ``window`` is free text (optional).
``mizzen-ci audit --record STORE`` writes it: a test that executed a source file is one that
fails when that file breaks, so ``failing`` counts the (source file, test) pairs the observed run
executed, ``caught`` those whose test the planner selects for a change to the file, and
``window`` names the audited revision.

Invariants:
- Every field is checked and bounded on read (:func:`parse`); a bad line raises
  :class:`RecordError` naming ``path:line`` and the field, and the page lists it as dropped.
- A field may be added to a kind, never renamed; ``v`` says which shape (1 today).
- Utilisation of a pool run is ``gpu_seconds / (makespan_seconds × runners × gpus_per_runner)``
  (for a CPU pool a "GPU" is a runner slot): the share of the reserved capacity the tests used.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

from ..history import MAX_NAME_CHARS, MAX_PATH_CHARS, MAX_SECONDS, checked_when

VERSION = 1
MAX_COUNT = 10**6


class RecordError(ValueError):
    """A kinded record that cannot be used; the message names ``path:line`` and the field."""


@dataclass(frozen=True)
class PoolRun:
    when: str
    run: str
    event: str
    pool: str
    lane: str
    jobs: int
    runners: int
    gpus_per_runner: int
    tests: int
    gpu_seconds: float
    makespan_seconds: float
    lower_bound_seconds: float

    @property
    def ratio(self) -> float | None:
        return (
            self.makespan_seconds / self.lower_bound_seconds if self.lower_bound_seconds else None
        )

    @property
    def utilisation(self) -> float | None:
        capacity = self.makespan_seconds * self.runners * self.gpus_per_runner
        return self.gpu_seconds / capacity if capacity else None

    def to_json(self) -> str:
        return json.dumps({"kind": "pool", "v": VERSION, **asdict(self)}, sort_keys=True)


@dataclass(frozen=True)
class QueueWait:
    when: str
    pool: str
    job: str
    queued_seconds: float


@dataclass(frozen=True)
class AuditRun:
    when: str
    recall: float
    caught: int
    failing: int
    window: str | None = None

    def to_json(self) -> str:
        fields = {k: v for k, v in asdict(self).items() if v is not None}
        return json.dumps({"kind": "audit", "v": VERSION, **fields}, sort_keys=True)


def _field(obj: dict, where: str, name: str, kind: str, *, optional: bool = False):
    if name not in obj:
        if optional:
            return None
        raise RecordError(f"{where}: {obj.get('kind')} record lacks `{name}`")
    value = obj[name]
    ok = {
        "text": lambda v: isinstance(v, str) and 0 < len(v) <= MAX_NAME_CHARS and v.isprintable(),
        "long": lambda v: isinstance(v, str) and 0 < len(v) <= MAX_PATH_CHARS and v.isprintable(),
        "count": lambda v: type(v) is int and 0 <= v <= MAX_COUNT,
        "seconds": lambda v: (
            type(v) in (int, float) and math.isfinite(v) and 0 <= v <= 100 * MAX_SECONDS
        ),
        "share": lambda v: type(v) in (int, float) and math.isfinite(v) and 0 <= v <= 1,
    }[kind]
    if not ok(value):
        raise RecordError(
            f"{where}: {obj.get('kind')} record `{name}` is not a valid {kind}: {str(value)[:60]!r}"
        )
    return float(value) if kind in ("seconds", "share") else value


def _common(obj: object, where: str) -> tuple[dict, str]:
    if not isinstance(obj, dict) or obj.get("v") != VERSION:
        raise RecordError(f"{where}: not a version-{VERSION} kinded record (`v` must be {VERSION})")
    try:
        when = checked_when(obj.get("when"), where)
    except ValueError as e:
        raise RecordError(str(e)) from None
    return obj, when


def parse_pool(obj: object, where: str) -> PoolRun:
    obj, when = _common(obj, where)
    f = lambda name, kind: _field(obj, where, name, kind)  # noqa: E731
    return PoolRun(when, f("run", "long"), f("event", "text"), f("pool", "text"), f("lane", "text"),
                   f("jobs", "count"), f("runners", "count"), f("gpus_per_runner", "count"),
                   f("tests", "count"), f("gpu_seconds", "seconds"), f("makespan_seconds", "seconds"),
                   f("lower_bound_seconds", "seconds"))  # fmt: skip


def parse_queue(obj: object, where: str) -> QueueWait:
    obj, when = _common(obj, where)
    return QueueWait(when, _field(obj, where, "pool", "text"), _field(obj, where, "job", "long"),
                     _field(obj, where, "queued_seconds", "seconds"))  # fmt: skip


def parse_audit(obj: object, where: str) -> AuditRun:
    obj, when = _common(obj, where)
    caught, failing = _field(obj, where, "caught", "count"), _field(obj, where, "failing", "count")
    if caught > failing:
        raise RecordError(
            f"{where}: audit record `caught` {caught} is more than `failing` {failing}"
        )
    return AuditRun(when, _field(obj, where, "recall", "share"), caught, failing,
                    _field(obj, where, "window", "long", optional=True))  # fmt: skip


PARSERS = {"pool": parse_pool, "queue": parse_queue, "audit": parse_audit}


def pool_runs_of_plan(plan, *, when: str, run: str) -> list[PoolRun]:
    """The ``pool`` records of a :class:`mizzen_ci.plan.Plan` (one per pool it packed)."""
    return [
        PoolRun(when, run, plan.event, p.pool, p.lane, p.jobs, p.runners, p.gpus_per_runner,
                p.tests, p.gpu_seconds, p.makespan_seconds, p.lower_bound_seconds)
        for p in plan.pools
    ]  # fmt: skip
