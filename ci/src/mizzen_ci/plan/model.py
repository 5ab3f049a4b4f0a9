"""The plan's records: what the planner writes and the lanes, the reports and ``noxfile.py`` read.

The plan JSON (``version`` 1; fields may be added, never renamed)::

    {"version": 1, "event": "pull_request", "cadence": null, "base": SHA, "head": SHA,
     "worktree": false, "trusted": true, "budget_seconds": 3600,
     "selection": {"everything": false, "because": [...], "changed_paths": 3},
     "jobs": [{"id": "hopper-h200-2gpu-1", "lane": "gpu-hopper", "arch": "hopper",
               "pool": "h200-2gpu", "runs_on": ["self-hosted", ...], "gpus": 2,
               "timeout_minutes": 75, "over_budget": false, "est_seconds": 1234.0,
               "tests": [{"file": "tests/...", "num_gpus": 1, "est_seconds": 60.0,
                          "estimate": "history" | "est_time", "start_seconds": 0.0,
                          "why": "reaches mizzen_train.lora (…changed)"}]}],
     "pools": [{"pool": ..., "lane": ..., "jobs": n, "runners": n, "gpus_per_runner": n,
                "tests": n, "gpu_seconds": ..., "makespan_seconds": ...,
                "lower_bound_seconds": ..., "strategy": ...}],
     "not_scheduled": [{"file": ..., "arch": ..., "code": ..., "reason": ...}],
     "warnings": [...], "errors": [...]}

A job's ``lane`` is also the nox session that runs it (``cpu`` or ``gpu-<arch>``).  A job's tests
are listed in their planned start order (longest first): the lanes run them so.  CPU jobs have
``arch: null``, ``lane: "cpu"`` and ``gpus: 1``.

Invariants:
- ``Plan.from_json(plan.to_json()) == plan``; every record's ``to_json`` writes its fields in the
  order above, so the JSON of a plan is a pure function of the plan.
- :meth:`Plan.from_json` checks every field (type, range) and raises :class:`PlanError` naming the
  field's path (``jobs[2].tests[0].num_gpus``), what was found and the fix; a plan file from
  elsewhere is never believed half-read.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

PLAN_VERSION = 1


class PlanError(ValueError):
    """A plan cannot be used; the message names the file or field and the fix."""


@dataclass(frozen=True)
class NotScheduled:
    """A (test file, arch) the plan does not run, with a reason code and the reason."""

    file: str
    arch: str | None
    code: str
    reason: str

    def to_json(self) -> dict:
        return {"file": self.file, "arch": self.arch, "code": self.code, "reason": self.reason}

    @classmethod
    def from_json(cls, data: object, where: str) -> NotScheduled:
        r = _Reader(data, where)
        return cls(r.text("file"), r.opt_text("arch"), r.text("code"), r.text("reason"))


@dataclass(frozen=True)
class PlannedTest:
    """One test file of a job: its GPUs, its estimate and where it came from, its planned start
    (seconds after the job starts) and why it runs."""

    file: str
    num_gpus: int
    est_seconds: float
    estimate: str  # "history" | "est_time"
    start_seconds: float
    why: str

    def to_json(self) -> dict:
        return {
            "file": self.file,
            "num_gpus": self.num_gpus,
            "est_seconds": self.est_seconds,
            "estimate": self.estimate,
            "start_seconds": self.start_seconds,
            "why": self.why,
        }

    @classmethod
    def from_json(cls, data: object, where: str) -> PlannedTest:
        r = _Reader(data, where)
        return cls(
            r.text("file"),
            r.integer("num_gpus", minimum=0),
            r.seconds("est_seconds"),
            r.text("estimate"),
            r.seconds("start_seconds"),
            r.text("why"),
        )


@dataclass(frozen=True)
class Job:
    """One runner job: a lane on a pool's runner, with its tests in start order."""

    id: str
    lane: str
    arch: str | None
    pool: str
    runs_on: tuple[str, ...]
    gpus: int
    timeout_minutes: int
    over_budget: bool
    est_seconds: float
    tests: tuple[PlannedTest, ...]

    @property
    def files(self) -> list[str]:
        return [t.file for t in self.tests]

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "lane": self.lane,
            "arch": self.arch,
            "pool": self.pool,
            "runs_on": list(self.runs_on),
            "gpus": self.gpus,
            "timeout_minutes": self.timeout_minutes,
            "over_budget": self.over_budget,
            "est_seconds": self.est_seconds,
            "tests": [t.to_json() for t in self.tests],
        }

    @classmethod
    def from_json(cls, data: object, where: str) -> Job:
        r = _Reader(data, where)
        return cls(
            r.text("id"),
            r.text("lane"),
            r.opt_text("arch"),
            r.text("pool"),
            tuple(r.texts("runs_on")),
            r.integer("gpus", minimum=1),
            r.integer("timeout_minutes", minimum=1),
            r.flag("over_budget"),
            r.seconds("est_seconds"),
            tuple(r.records("tests", PlannedTest)),
        )


@dataclass(frozen=True)
class PoolSummary:
    """How one pool's jobs are packed: counts, work, makespan against its lower bound."""

    pool: str
    lane: str
    jobs: int
    runners: int
    gpus_per_runner: int
    tests: int
    gpu_seconds: float
    makespan_seconds: float
    lower_bound_seconds: float
    strategy: str

    def to_json(self) -> dict:
        return {
            "pool": self.pool,
            "lane": self.lane,
            "jobs": self.jobs,
            "runners": self.runners,
            "gpus_per_runner": self.gpus_per_runner,
            "tests": self.tests,
            "gpu_seconds": self.gpu_seconds,
            "makespan_seconds": self.makespan_seconds,
            "lower_bound_seconds": self.lower_bound_seconds,
            "strategy": self.strategy,
        }

    @classmethod
    def from_json(cls, data: object, where: str) -> PoolSummary:
        r = _Reader(data, where)
        return cls(
            r.text("pool"),
            r.text("lane"),
            r.integer("jobs", minimum=0),
            r.integer("runners", minimum=1),
            r.integer("gpus_per_runner", minimum=1),
            r.integer("tests", minimum=0),
            r.seconds("gpu_seconds"),
            r.seconds("makespan_seconds"),
            r.seconds("lower_bound_seconds"),
            r.text("strategy"),
        )


@dataclass(frozen=True)
class SelectionSummary:
    """Whether the change selected everything (and why), and how many paths it changed."""

    everything: bool
    because: tuple[str, ...]
    changed_paths: int

    def to_json(self) -> dict:
        return {
            "everything": self.everything,
            "because": list(self.because),
            "changed_paths": self.changed_paths,
        }

    @classmethod
    def from_json(cls, data: object, where: str) -> SelectionSummary:
        r = _Reader(data, where)
        return cls(r.flag("everything"), tuple(r.texts("because")), r.integer("changed_paths"))


@dataclass
class Plan:
    """A whole plan (see the module docstring)."""

    event: str
    cadence: str | None
    base: str | None
    head: str | None
    worktree: bool
    trusted: bool
    budget_seconds: float
    selection: SelectionSummary
    jobs: list[Job] = field(default_factory=list)
    pools: list[PoolSummary] = field(default_factory=list)
    not_scheduled: list[NotScheduled] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "version": PLAN_VERSION,
            "event": self.event,
            "cadence": self.cadence,
            "base": self.base,
            "head": self.head,
            "worktree": self.worktree,
            "trusted": self.trusted,
            "budget_seconds": self.budget_seconds,
            "selection": self.selection.to_json(),
            "jobs": [j.to_json() for j in self.jobs],
            "pools": [p.to_json() for p in self.pools],
            "not_scheduled": [n.to_json() for n in self.not_scheduled],
            "warnings": list(self.warnings),
            "errors": list(self.errors),
        }

    def dumps(self) -> str:
        """The plan file's text (what ``--output`` writes)."""
        return json.dumps(self.to_json(), indent=2) + "\n"

    @classmethod
    def from_json(cls, data: object, source: str = "the plan") -> Plan:
        """The plan ``data`` describes (``source`` names it in errors)."""
        if not isinstance(data, dict) or data.get("version") != PLAN_VERSION:
            raise PlanError(
                f"{source}: not a version-{PLAN_VERSION} plan; write one with "
                "`mizzen-ci plan --output`"
            )
        try:
            return cls._read(_Reader(data, ""))
        except PlanError as e:
            raise PlanError(f"{source}: {e}") from None

    @classmethod
    def _read(cls, r: _Reader) -> Plan:
        return cls(
            r.text("event"),
            r.opt_text("cadence"),
            r.opt_text("base"),
            r.opt_text("head"),
            r.flag("worktree"),
            r.flag("trusted"),
            r.seconds("budget_seconds"),
            r.record("selection", SelectionSummary),
            r.records("jobs", Job),
            r.records("pools", PoolSummary),
            r.records("not_scheduled", NotScheduled),
            r.texts("warnings"),
            r.texts("errors"),
        )

    @classmethod
    def load(cls, path: Path | str) -> Plan:
        """A plan written by ``mizzen-ci plan --output``; :class:`PlanError` when it is not one."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise PlanError(f"{path}: cannot read the plan: {e}") from None
        return cls.from_json(data, str(path))

    def job(self, job_id: str) -> Job:
        """The job ``job_id``; :class:`PlanError` naming the jobs the plan has."""
        for j in self.jobs:
            if j.id == job_id:
                return j
        ids = ", ".join(j.id for j in self.jobs)
        raise PlanError(f"the plan has no job {job_id!r}; its jobs: {ids or 'none'}")


# Seconds a plan may state: finite, non-negative and below a century (a planner never writes more).
_MAX_SECONDS = 100 * 365 * 86400.0


class _Reader:
    """Typed access to one JSON object's fields, with errors naming the field's path."""

    def __init__(self, data: object, where: str):
        if not isinstance(data, dict):
            raise PlanError(f"{where or 'the plan'}: expected a JSON object, got {_kind(data)}")
        self.data, self.where = data, where

    def _field(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def _get(self, key: str) -> object:
        if key not in self.data:
            raise PlanError(f"{self._field(key)}: missing; write the plan with `mizzen-ci plan`")
        return self.data[key]

    def _bad(self, key: str, wanted: str, value: object) -> PlanError:
        return PlanError(f"{self._field(key)}: expected {wanted}, got {_kind(value)}")

    def text(self, key: str) -> str:
        value = self._get(key)
        if not isinstance(value, str):
            raise self._bad(key, "a string", value)
        return value

    def opt_text(self, key: str) -> str | None:
        value = self._get(key)
        if value is not None and not isinstance(value, str):
            raise self._bad(key, "a string or null", value)
        return value

    def flag(self, key: str) -> bool:
        value = self._get(key)
        if not isinstance(value, bool):
            raise self._bad(key, "true or false", value)
        return value

    def integer(self, key: str, minimum: int = 0) -> int:
        value = self._get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value < 2**31:
            raise self._bad(key, f"an integer from {minimum} to {2**31 - 1}", value)
        return value

    def seconds(self, key: str) -> float:
        value = self._get(key)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not (math.isfinite(value) and 0 <= value <= _MAX_SECONDS)
        ):
            raise self._bad(key, "a number of seconds (finite, ≥ 0, under a century)", value)
        return value

    def texts(self, key: str) -> list[str]:
        value = self._get(key)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self._bad(key, "a list of strings", value)
        return list(value)

    def record(self, key: str, kind: type):
        return kind.from_json(self._get(key), self._field(key))

    def records(self, key: str, kind: type) -> list:
        value = self._get(key)
        if not isinstance(value, list):
            raise self._bad(key, "a list", value)
        return [kind.from_json(v, f"{self._field(key)}[{i}]") for i, v in enumerate(value)]


def _kind(value: object) -> str:
    text = json.dumps(value) if isinstance(value, str | int | float | bool | None) else ""
    shown = f" {text[:40]}" if text else ""
    return f"{type(value).__name__}{shown}"
