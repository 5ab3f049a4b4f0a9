"""One gate run: for each (test file, arch) to judge, every run of its artefacts, every step of
each gated metric, the trusted history of each, and the verdict rows.

Invariants:
- What is judged comes from the caller (:func:`targets_from_plan`: the tests a plan's jobs ran;
  :func:`targets_from_points`: the tests with artefacts); a judged test that recorded nothing
  fails every gate it declares ("not recorded: did it run?").
- Every run of one (test, arch) in the artefacts is judged, never only the newest: with several,
  each row names its run (``run KEY: …``) and a note says how many; a run being judged is left
  out of its own history (``exclude_source``).
- Every step a run recorded of a gated metric is judged (a step with too little history is
  inactive, as any cold start), and the declaration adds the steps that must be there:
  ``steps="last"``: the run's largest step and the newest trusted run's largest step (a run
  cannot dodge its regressed last step by recording a later one); a list: each listed step;
  ``"all"``: every step the newest trusted run recorded.  A required step the run lacks, a
  missing metric, and a step recorded twice with different values fail (:mod:`.judge`).
- No store: no history, every gate inactive, and the summary says why.
- A problem of the store (a bad row, a run left out) is reported once (:meth:`GateRun.report`),
  however many coordinates or runs read the history holding it.
- A value is judged against the trusted history of its own environment (:mod:`.environment`);
  while that has fewer than ``min_history`` values, against the newest other environment's with
  the band widened by :data:`~.judge.NEW_ENVIRONMENT_WIDEN`, the row saying so and the notes
  saying "new environment: X -> Y" once per (test, arch); the trusted runs of the new
  environment then build its own baseline.  A run whose values name several environments is
  judged in the environment of its newest value, with a note.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from .artefacts import CPU_ARCH, Point, encode_value
from .declarations import Declarations, Gate
from .environment import describe_change
from .judge import (
    DEFAULT_K,
    DEFAULT_MIN_HISTORY,
    DEFAULT_WINDOW,
    NEW_ENVIRONMENT_WIDEN,
    Decision,
    decide,
    missing,
    settle,
)
from .quarantine import Entry
from .store import MetricStore


@dataclass(frozen=True)
class Row:
    """One verdict: a coordinate, its value, reference, band and history, and what it means."""

    test: str
    arch: str
    metric: str
    step: int | None
    value: float | None
    reference: float | None
    band: float | None
    history: tuple[float, ...]  # oldest first
    verdict: str  # pass | improved | inactive | FAIL | warning
    fails: bool
    why: str
    enforce: bool


@dataclass
class GateRun:
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    active: list[Entry] = field(default_factory=list)
    expired: list[Entry] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return bool(self.errors) or any(r.fails for r in self.rows)

    def report(self, problems: Iterable[str]) -> None:
        """Add each of ``problems`` once: the same history is read for several coordinates and
        runs, and a bad row is one problem however often it is met."""
        self.problems.extend(p for p in dict.fromkeys(problems) if p not in self.problems)


@dataclass(frozen=True)
class Settings:
    window: int = DEFAULT_WINDOW
    min_history: int = DEFAULT_MIN_HISTORY
    k: float = DEFAULT_K


def targets_from_points(
    points: Iterable[Point], declarations: Declarations
) -> list[tuple[str, str]]:
    return sorted({(p.test, p.arch) for p in points if p.test in declarations.gates})


def targets_from_plan(plan, lanes: str, declarations: Declarations) -> list[tuple[str, str]]:
    """The gated (test, arch) pairs of the plan's jobs of ``lanes`` (cpu, gpu or all)."""
    out = set()
    for job in plan.jobs:
        is_cpu = job.arch is None
        if (lanes == "cpu" and not is_cpu) or (lanes == "gpu" and is_cpu):
            continue
        for test in job.tests:
            if test.file in declarations.gates:
                out.add((test.file, job.arch or CPU_ARCH))
    return sorted(out)


def _runs(points: list[Point]) -> list[tuple[str | None, list[Point]]]:
    """Every run of the points, oldest first (``[(None, [])]`` for none: nothing recorded)."""
    runs: dict[str, list[Point]] = {}
    for p in points:
        runs.setdefault(p.run, []).append(p)
    order = sorted(runs, key=lambda r: (max(p.when for p in runs[r]), r))
    return [(key, runs[key]) for key in order] or [(None, [])]


def run_gate(
    declarations: Declarations,
    points: list[Point],
    store: MetricStore | None,
    targets: Iterable[tuple[str, str]],
    quarantine: list[Entry],
    *,
    today: dt.date,
    settings: Settings = Settings(),
) -> GateRun:
    result = GateRun()
    result.active = [e for e in quarantine if e.active(today)]
    result.expired = [e for e in quarantine if not e.active(today)]
    quarantined = {(e.file, e.arch): e.reason for e in result.active}
    by_target: dict[tuple[str, str], list[Point]] = {}
    for p in points:
        by_target.setdefault((p.test, p.arch), []).append(p)
    for test, arch in targets:
        runs = _runs(by_target.get((test, arch), []))
        if len(runs) > 1:
            result.notes.append(
                f"{test} on {arch}: {len(runs)} runs in the artefacts; each is judged "
                f"({', '.join(str(r) for r, _ in runs)})"
            )
        for run, run_points in runs:
            label = f"run {run}: " if len(runs) > 1 else ""
            _judge_run(declarations, test, arch, run, run_points, label, store, settings,
                       quarantined, result)  # fmt: skip
    return result


def _judge_run(declarations, test, arch, run, run_points, label, store, settings, quarantined,
               result: GateRun) -> None:  # fmt: skip
    """The rows of every gate of ``test`` for one run of it."""
    values: dict[tuple[str, int], list[float]] = {}
    for p in run_points:
        values.setdefault((p.metric, p.step), []).append(p.value)
    envs = {p.env for p in run_points}
    env = max(run_points, key=lambda p: p.when).env if run_points else None
    if len(envs) > 1:
        result.notes.append(
            f"{test} on {arch}: {label}values of {len(envs)} environments; judged in the newest's ({env})"
        )
    for gate in declarations.gates.get(test, []):
        for step, decision, value, history in _coordinates(
            gate, arch, run, values, store, settings, result, env
        ):
            settled = settle(
                decision,
                enforce=gate.enforce,
                reason=gate.reason,
                quarantine=quarantined.get((test, arch)),
            )
            why = label + decision.why + (f"; {settled.note}" if settled.note else "")
            result.rows.append(
                Row(
                    test, arch, gate.metric, step, value, decision.reference, decision.band,
                    history, settled.verdict, settled.fails, why, gate.enforce,
                )
            )  # fmt: skip


_REQUIRED_BECAUSE = {
    "all": "the newest trusted run recorded it",
    "last": "the newest trusted run's last step; a changed step count is judged by the base "
    "until it lands",
}


def _reference(gate: Gate, arch: str, step: int, run, env: str | None, store, settings: Settings,
               result: GateRun) -> tuple[tuple[float, ...], str | None]:  # fmt: skip
    """``(history, previous environment)``: the trusted history of ``env``, or, while it is
    shorter than ``min_history``, the newest other environment's (named) when that one is not."""

    def values_of(environment):
        stored, problems = store.history(gate.test, arch, gate.metric, step, limit=settings.window,
                                         exclude_source=run, environment=environment)  # fmt: skip
        result.report(problems)
        return tuple(v.value for v in reversed(stored))

    def enough(history) -> bool:
        return sum(math.isfinite(x) for x in history) >= settings.min_history

    own = values_of(env)
    if env is None or enough(own):
        return own, None
    previous = next(
        (e for e in store.environments(gate.test, arch, gate.metric, step) if e != env), None
    )
    if previous is not None:
        theirs = values_of(previous)
        if enough(theirs):
            change = f"{gate.test} on {arch}: new environment: {describe_change(previous, env)}"
            if change not in result.notes:
                result.notes.append(change)
            return theirs, previous
    return own, None


def _coordinates(gate: Gate, arch: str, run, values, store, settings: Settings, result: GateRun,
                 env: str | None = None):  # fmt: skip
    """``(step, decision, value, history)`` for each coordinate of ``gate``."""
    test, metric = gate.test, gate.metric
    recorded = sorted(s for (m, s) in values if m == metric)
    if run is None:
        yield (
            None,
            missing(f"not recorded: {test} recorded no metric on {arch} (did it run?)"),
            None,
            (),
        )
        return
    newest = set(store.last_steps(test, arch, metric)) if store is not None else set()
    if gate.steps == "last":
        required = set(recorded[-1:]) | ({max(newest)} if newest else set())
        if not recorded:
            yield None, missing(f"{metric} not recorded by this run"), None, ()
            return
    elif gate.steps == "all":
        required = newest
    else:
        required = set(gate.steps)
    steps = sorted(set(recorded) | required)
    if not steps:
        yield None, missing(f"{metric} not recorded by this run"), None, ()
        return
    for step in steps:
        history: tuple[float, ...] = ()
        previous = None
        if store is not None:
            history, previous = _reference(gate, arch, step, run, env, store, settings, result)
        if (metric, step) not in values:
            why = _REQUIRED_BECAUSE.get(gate.steps if isinstance(gate.steps, str) else "list")
            why = why or f"declared steps {gate.steps_text()}"
            shown = ", ".join(map(str, recorded)) or "none"
            yield (
                step,
                missing(f"step {step} not recorded ({why}; recorded: {shown})"),
                None,
                history,
            )
            continue
        got = values[(metric, step)]
        if len({repr(encode_value(v)) for v in got}) > 1:
            decision = missing(f"recorded {len(got)} different values at this step in one run")
            yield step, decision, got[-1], history
            continue
        decision: Decision = decide(
            got[0],
            history,
            direction=gate.direction,
            tolerance=gate.tolerance,
            floor=gate.floor,
            min_history=settings.min_history,
            k=settings.k,
            widen=NEW_ENVIRONMENT_WIDEN if previous is not None else 1.0,
        )
        if previous is not None:
            decision = replace(
                decision,
                why=f"new environment (under {settings.min_history} trusted values of its own): "
                f"against the previous environment's band × {NEW_ENVIRONMENT_WIDEN:g}: {decision.why}",
            )
        yield step, decision, got[0], history
