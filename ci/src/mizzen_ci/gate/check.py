"""One gate run: for each (test file, arch) to judge, the newest run of its artefacts, every
coordinate its gates declare, the trusted history of each, and the verdict rows.

Invariants:
- What is judged comes from the caller (:func:`targets_from_plan`: the tests a plan's jobs ran;
  :func:`targets_from_points`: the tests with artefacts); a judged test that recorded nothing
  fails every gate it declares ("not recorded: did it run?").
- Of several runs of one (test, arch) in the artefacts the newest is judged (the others are
  named in a note); a run being judged is left out of its own history (``exclude_source``).
- Coordinates: ``steps="last"``: the run's largest step of the metric; a list: each listed step;
  ``"all"``: every step the run recorded and every step the newest trusted run recorded (one the
  run lacks fails).  A missing metric or step, and a step recorded twice with different values,
  fail (:mod:`.judge`).
- No store: no history, every gate inactive, and the summary says why.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass, field

from .artefacts import CPU_ARCH, Point, encode_value
from .declarations import Declarations, Gate
from .judge import DEFAULT_K, DEFAULT_MIN_HISTORY, DEFAULT_WINDOW, Decision, decide, missing, settle
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


def _newest_run(points: list[Point]) -> tuple[str | None, list[Point], int]:
    runs: dict[str, list[Point]] = {}
    for p in points:
        runs.setdefault(p.run, []).append(p)
    if not runs:
        return None, [], 0
    key = max(runs, key=lambda r: (max(p.when for p in runs[r]), r))
    return key, runs[key], len(runs)


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
        run, run_points, n_runs = _newest_run(by_target.get((test, arch), []))
        if n_runs > 1:
            result.notes.append(
                f"{test} on {arch}: {n_runs} runs in the artefacts; judged the newest ({run})"
            )
        values: dict[tuple[str, int], list[float]] = {}
        for p in run_points:
            values.setdefault((p.metric, p.step), []).append(p.value)
        for gate in declarations.gates.get(test, []):
            for step, decision, value, history in _coordinates(
                gate, arch, run, values, store, settings, result
            ):
                settled = settle(
                    decision,
                    enforce=gate.enforce,
                    reason=gate.reason,
                    quarantine=quarantined.get((test, arch)),
                )
                why = decision.why + (f"; {settled.note}" if settled.note else "")
                result.rows.append(
                    Row(
                        test, arch, gate.metric, step, value, decision.reference, decision.band,
                        history, settled.verdict, settled.fails, why, gate.enforce,
                    )
                )  # fmt: skip
    return result


def _coordinates(gate: Gate, arch: str, run, values, store, settings: Settings, result: GateRun):
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
    if gate.steps == "last":
        if not recorded:
            yield None, missing(f"{metric} not recorded by this run"), None, ()
            return
        steps = [recorded[-1]]
    elif gate.steps == "all":
        newest = set(store.last_steps(test, arch, metric)) if store is not None else set()
        steps = sorted(set(recorded) | newest)
        if not steps:
            yield None, missing(f"{metric} not recorded by this run"), None, ()
            return
    else:
        steps = list(gate.steps)
    for step in steps:
        history: tuple[float, ...] = ()
        if store is not None:
            stored, problems = store.history(
                test, arch, metric, step, limit=settings.window, exclude_source=run
            )
            result.problems.extend(problems)
            history = tuple(v.value for v in reversed(stored))
        if (metric, step) not in values:
            why = (
                "the newest trusted run recorded it"
                if gate.steps == "all"
                else f"declared steps {gate.steps_text()}"
            )
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
        )
        yield step, decision, got[0], history
