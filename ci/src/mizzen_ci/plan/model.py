"""The plan's records: what the planner writes and the lanes, the reports and ``noxfile.py`` read.

The plan JSON (``version`` 1; fields may be added, never renamed)::

    {"version": 1, "event": "pull_request", "cadence": null, "base": SHA, "head": SHA,
     "worktree": false, "trusted": true, "approval": null, "fleet": "BASE:ci/fleet.toml",
     "budget_seconds": 3600,
     "selection": {"everything": false, "because": [...], "changed_paths": 3},
     "jobs": [{"id": "hopper-h200-2gpu-1", "lane": "gpu-hopper", "arch": "hopper",
               "pool": "h200-2gpu", "runs_on": ["self-hosted", ...],
               "runner_group": "mizzen-h200-2gpu", "gpus": 2,
               "timeout_minutes": 75, "over_budget": false, "est_seconds": 1234.0,
               "tests": [{"file": "tests/...", "num_gpus": 1, "est_seconds": 60.0,
                          "estimate": "history" | "est_time", "start_seconds": 0.0,
                          "why": "reaches mizzen_train.lora (…changed)"}],
               "vendor": "nvidia"}],
     "pools": [{"pool": ..., "lane": ..., "jobs": n, "runners": n, "gpus_per_runner": n,
                "tests": n, "gpu_seconds": ..., "makespan_seconds": ...,
                "lower_bound_seconds": ..., "strategy": ..., "setup_seconds": ...,
                "vendor": "amd"}],
     "capacity": [{"arch": "hopper", "lane": "gpu-hopper", "pools": [...], "tests": n,
                   "makespan_seconds": ..., "bound_seconds": ..., "vendor": "nvidia"}],
     "not_scheduled": [{"file": ..., "arch": ..., "code": ..., "reason": ...}],
     "warnings": [...], "errors": [...],
     "fast_fail": true, "fast_fail_reason": "pull request: GPU jobs wait for ...",
     "overrides": [{"file": ..., "arch": ..., "base_file": ..., "reason": "runs as the base
                    declares it: the head set disabled='...'"}]}

A job's ``lane`` is also the nox session that runs it (``cpu`` or ``gpu-<arch>``); its
``est_seconds`` include its pool's set-up, and its tests' ``start_seconds`` count from the job's
start (the first test starts after the set-up).  ``capacity`` has one entry per arch (``null``:
the CPU pool): when its last pool is done, against a bound that pools every pool able to host
each test.  ``head`` is the
commit the plan is for: the lanes check out exactly that commit (an approval holds for it only).
``vendor`` (jobs, pools, capacity) is the GPU vendor of the arch (``nvidia``, ``amd``; ``null``
for the CPU pool), a field added after version 1: a plan written without it reads as ``null``.
``fleet`` names the table the pools and ``runs_on`` labels came from (for a pull request: the base
revision's, never the change's); ``approval`` says what approved an untrusted author's head.
``fast_fail`` (added after version 1; a plan without it reads as ``false``) says whether the GPU
jobs wait for the cheap checks and the CPU lane of the head to pass, ``fast_fail_reason`` why or
why not (:func:`mizzen_ci.plan.request.fast_fail`).  ``overrides`` (added after version 1,
written only when not empty; absent reads as ``[]``) lists each (file, arch) that runs because the
base revision runs it for this change though the head's registration would not, with what the
head changed (:mod:`mizzen_ci.plan.base_runs`).  A job's tests
are listed in their planned start order (longest first): the lanes run them so.  CPU jobs have
``arch: null``, ``lane: "cpu"`` and ``gpus: 1``.

Invariants:
- Each record is a dataclass whose fields are the JSON's keys, in order; its ``to_json`` and
  ``from_json`` are derived from the fields (each says how it is checked), never written twice.
  ``Plan.from_json(plan.to_json()) == plan``; the JSON of a plan is a pure function of the plan.
- :meth:`Plan.from_json` checks every field (type, range) and raises :class:`PlanError` naming the
  field's path (``jobs[2].tests[0].num_gpus``), what was found and the fix; a plan file from
  elsewhere is never believed half-read.  :meth:`Plan.load` reads a regular file of at most
  :data:`MAX_PLAN_BYTES` (:func:`mizzen_ci.sources.read_bytes`); JSON that is not UTF-8, nests
  too deep or spells a number Python will not convert is a :class:`PlanError`, never a traceback.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..sources import read_bytes

PLAN_VERSION = 1
# Seconds a plan may state: finite, non-negative and below a century (a planner never writes more).
MAX_SECONDS = 100 * 365 * 86400.0
MAX_PLAN_BYTES = 64 * 1024 * 1024


class PlanError(ValueError):
    """A plan cannot be used; the message names the file or field and the fix."""


def _read(how: str, *args: object) -> dict[str, Any]:
    """Field metadata: the field is read back by ``_Reader.<how>(key, *args)``."""
    return {"read": (how, args)}


class _Record:
    """JSON of a dataclass record: its fields, in order; nested records and sequences as JSON."""

    def to_json(self) -> dict:
        return {
            f.name: _plain(getattr(self, f.name))
            for f in fields(self)
            if not (f.metadata.get("omit_empty") and not getattr(self, f.name))
        }

    @classmethod
    def from_json(cls, data: object, where: str):
        r = _Reader(data, where)
        return cls(
            *(
                getattr(r, f.metadata["read"][0])(f.name, *f.metadata["read"][1])
                for f in fields(cls)
            )
        )


def _plain(value: object) -> object:
    if isinstance(value, _Record):
        return value.to_json()
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


@dataclass(frozen=True)
class NotScheduled(_Record):
    """A (test file, arch) the plan does not run, with a reason code and the reason."""

    file: str = field(metadata=_read("text"))
    arch: str | None = field(metadata=_read("opt_text"))
    code: str = field(metadata=_read("text"))
    reason: str = field(metadata=_read("text"))


@dataclass(frozen=True)
class Override(_Record):
    """A (test file, arch) the plan runs because the base revision runs it for this change, though
    the head's registration would not: ``base_file`` is its path at the base (``file`` its path
    at the head, or the base path when the head has none), ``reason`` what the head changed."""

    file: str = field(metadata=_read("text"))
    arch: str | None = field(metadata=_read("opt_text"))
    base_file: str = field(metadata=_read("text"))
    reason: str = field(metadata=_read("text"))


@dataclass(frozen=True)
class PlannedTest(_Record):
    """One test file of a job: its GPUs, its estimate and where it came from, its planned start
    (seconds after the job starts) and why it runs."""

    file: str = field(metadata=_read("text"))
    num_gpus: int = field(metadata=_read("integer", 0))
    est_seconds: float = field(metadata=_read("seconds"))
    estimate: str = field(metadata=_read("text"))  # "history" | "est_time"
    start_seconds: float = field(metadata=_read("seconds"))
    why: str = field(metadata=_read("text"))


@dataclass(frozen=True)
class Job(_Record):
    """One runner job: a lane on a pool's runner, with its tests in start order."""

    id: str = field(metadata=_read("text"))
    lane: str = field(metadata=_read("text"))
    arch: str | None = field(metadata=_read("opt_text"))
    pool: str = field(metadata=_read("text"))
    runs_on: tuple[str, ...] = field(metadata=_read("texts", tuple))
    runner_group: str | None = field(metadata=_read("opt_text"))
    gpus: int = field(metadata=_read("integer", 1))
    timeout_minutes: int = field(metadata=_read("integer", 1))
    over_budget: bool = field(metadata=_read("flag"))
    est_seconds: float = field(metadata=_read("seconds"))
    tests: tuple[PlannedTest, ...] = field(metadata=_read("records", PlannedTest, tuple))
    vendor: str | None = field(default=None, metadata=_read("added_text"))

    @property
    def files(self) -> list[str]:
        return [t.file for t in self.tests]

    @property
    def self_hosted(self) -> bool:
        """Whether the job needs a self-hosted runner (a runner group holds its machines)."""
        return self.runner_group is not None

    def runs_on_value(self) -> list[str] | dict:
        """The job's ``runs-on``: its labels, inside its runner group when it has one."""
        if self.runner_group is None:
            return list(self.runs_on)
        return {"group": self.runner_group, "labels": list(self.runs_on)}


@dataclass(frozen=True)
class PoolSummary(_Record):
    """How one pool's jobs are packed: counts, work, makespan against its lower bound."""

    pool: str = field(metadata=_read("text"))
    lane: str = field(metadata=_read("text"))
    jobs: int = field(metadata=_read("integer", 0))
    runners: int = field(metadata=_read("integer", 1))
    gpus_per_runner: int = field(metadata=_read("integer", 1))
    tests: int = field(metadata=_read("integer", 0))
    gpu_seconds: float = field(metadata=_read("seconds"))
    makespan_seconds: float = field(metadata=_read("seconds"))
    lower_bound_seconds: float = field(metadata=_read("seconds"))
    strategy: str = field(metadata=_read("text"))
    setup_seconds: float = field(metadata=_read("seconds"))
    vendor: str | None = field(default=None, metadata=_read("added_text"))


@dataclass(frozen=True)
class ArchSummary(_Record):
    """When an arch's work ends (its last pool done) against the bound of its pooled capacity."""

    arch: str | None = field(metadata=_read("opt_text"))
    lane: str = field(metadata=_read("text"))
    pools: tuple[str, ...] = field(metadata=_read("texts", tuple))
    tests: int = field(metadata=_read("integer", 0))
    makespan_seconds: float = field(metadata=_read("seconds"))
    bound_seconds: float = field(metadata=_read("seconds"))
    vendor: str | None = field(default=None, metadata=_read("added_text"))


@dataclass(frozen=True)
class SelectionSummary(_Record):
    """Whether the change selected everything (and why), and how many paths it changed."""

    everything: bool = field(metadata=_read("flag"))
    because: tuple[str, ...] = field(metadata=_read("texts", tuple))
    changed_paths: int = field(metadata=_read("integer", 0))


@dataclass
class Plan(_Record):
    """A whole plan (see the module docstring)."""

    event: str = field(metadata=_read("text"))
    cadence: str | None = field(metadata=_read("opt_text"))
    base: str | None = field(metadata=_read("opt_text"))
    head: str | None = field(metadata=_read("opt_text"))
    worktree: bool = field(metadata=_read("flag"))
    trusted: bool = field(metadata=_read("flag"))
    approval: str | None = field(metadata=_read("opt_text"))
    fleet: str = field(metadata=_read("text"))
    budget_seconds: float = field(metadata=_read("seconds"))
    selection: SelectionSummary = field(metadata=_read("record", SelectionSummary))
    jobs: list[Job] = field(default_factory=list, metadata=_read("records", Job, list))
    pools: list[PoolSummary] = field(
        default_factory=list, metadata=_read("records", PoolSummary, list)
    )
    capacity: list[ArchSummary] = field(
        default_factory=list, metadata=_read("records", ArchSummary, list)
    )
    not_scheduled: list[NotScheduled] = field(
        default_factory=list, metadata=_read("records", NotScheduled, list)
    )
    warnings: list[str] = field(default_factory=list, metadata=_read("texts", list))
    errors: list[str] = field(default_factory=list, metadata=_read("texts", list))
    fast_fail: bool = field(default=False, metadata=_read("added_flag"))
    fast_fail_reason: str | None = field(default=None, metadata=_read("added_text"))
    overrides: list[Override] = field(
        default_factory=list,
        metadata={**_read("added_records", Override), "omit_empty": True},
    )

    def to_json(self) -> dict:
        return {"version": PLAN_VERSION, **super().to_json()}

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
        fields_only = {k: v for k, v in data.items() if k != "version"}
        try:
            return super().from_json(fields_only, "")
        except PlanError as e:
            raise PlanError(f"{source}: {e}") from None

    @classmethod
    def load(cls, path: Path | str) -> Plan:
        """A plan written by ``mizzen-ci plan --output``; :class:`PlanError` when it is not one."""
        path = Path(path)
        try:
            data = json.loads(read_bytes(path, MAX_PLAN_BYTES)[0].decode("utf-8"))
        except (OSError, ValueError) as e:  # ValueError: not UTF-8, not JSON, a 5000-digit number
            raise PlanError(f"{path}: cannot read the plan: {e}") from None
        except RecursionError:
            raise PlanError(
                f"{path}: cannot read the plan: JSON nested too deep; write it with "
                "`mizzen-ci plan --output`"
            ) from None
        return cls.from_json(data, str(path))

    def job(self, job_id: str) -> Job:
        """The job ``job_id``; :class:`PlanError` naming the jobs the plan has."""
        for j in self.jobs:
            if j.id == job_id:
                return j
        ids = ", ".join(j.id for j in self.jobs)
        raise PlanError(f"the plan has no job {job_id!r}; its jobs: {ids or 'none'}")


class _Reader:
    """Typed access to one JSON object's fields, with errors naming the field's path."""

    def __init__(self, data: object, where: str):
        if not isinstance(data, dict):
            raise PlanError(f"{where or 'the plan'}: expected a JSON object, got {_shown(data)}")
        self.data, self.where = data, where

    def _field(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def _get(self, key: str) -> object:
        if key not in self.data:
            raise PlanError(f"{self._field(key)}: missing; write the plan with `mizzen-ci plan`")
        return self.data[key]

    def _bad(self, key: str, wanted: str, value: object) -> PlanError:
        return PlanError(f"{self._field(key)}: expected {wanted}, got {_shown(value)}")

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

    def added_text(self, key: str) -> str | None:
        """A string field added after version 1: absent in older plans (``None``), else a string or
        null."""
        if key not in self.data:
            return None
        return self.opt_text(key)

    def added_flag(self, key: str) -> bool:
        """A flag added after version 1: absent in older plans (``False``), else true or false."""
        if key not in self.data:
            return False
        return self.flag(key)

    def added_records(self, key: str, kind: type[_Record]) -> list:
        """Records added after version 1, written only when there are some: absent is ``[]``."""
        if key not in self.data:
            return []
        return self.records(key, kind, list)

    def flag(self, key: str) -> bool:
        value = self._get(key)
        if not isinstance(value, bool):
            raise self._bad(key, "true or false", value)
        return value

    def integer(self, key: str, minimum: int) -> int:
        value = self._get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value < 2**31:
            raise self._bad(key, f"an integer from {minimum} to {2**31 - 1}", value)
        return value

    def seconds(self, key: str) -> float:
        value = self._get(key)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or (isinstance(value, float) and not math.isfinite(value))
            or not 0 <= value <= MAX_SECONDS  # an int of any size compares; never converted
        ):
            raise self._bad(key, "a number of seconds (finite, ≥ 0, under a century)", value)
        return value

    def texts(self, key: str, container: type) -> list[str] | tuple[str, ...]:
        value = self._get(key)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self._bad(key, "a list of strings", value)
        return container(value)

    def record(self, key: str, kind: type[_Record]) -> _Record:
        return kind.from_json(self._get(key), self._field(key))

    def records(self, key: str, kind: type[_Record], container: type) -> list | tuple:
        value = self._get(key)
        if not isinstance(value, list):
            raise self._bad(key, "a list", value)
        return container(kind.from_json(v, f"{self._field(key)}[{i}]") for i, v in enumerate(value))


def _shown(value: object) -> str:
    text = json.dumps(value) if isinstance(value, str | int | float | bool | None) else ""
    return f"{type(value).__name__}{f' {text[:40]}' if text else ''}"
