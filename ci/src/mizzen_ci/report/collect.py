"""Everything the health page shows, computed from the history store and the checkout.

Sections and their sources:
- pools: ``pool`` records (:mod:`.records`), per pool oldest first: jobs, makespan against its
  lower bound, utilisation;
- durations: duration records of passing runs per (test file, arch) against the file's
  ``est_time`` (the registry of the checkout): the median of the last :data:`RECENT` passing
  runs over ``est_time`` is the drift, largest (either way) first;
- flakes: :mod:`mizzen_ci.flakes` evidence per (test, arch) with a bad run or a retry, its flake
  rate ((bad runs + retried attempts) / runs) and its quarantine state (``ci/flaky.toml`` of the
  checkout, and what ``flakes propose`` would propose now);
- gate: for every declared gate and every arch with trusted history, the newest trusted value of
  each step judged as ``gate check`` judges (environments included) against the trusted values
  before it, with its history;
- audit and queue: the ``audit`` and ``queue`` records, when there are any.

Invariants: nothing here raises for bad input; each problem (a dropped line, an unreadable store,
a broken registry) is kept in :attr:`Health.problems`, once (the stores are read in one pass,
:func:`mizzen_ci.history.read_history`), and the page lists it.
"""

from __future__ import annotations

import datetime as dt
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from ..history import Record, read_history
from .records import PARSERS, AuditRun, PoolRun, QueueWait, RecordError

RECENT = 20
MAX_ROWS = 200


@dataclass(frozen=True)
class DriftRow:
    file: str
    arch: str
    est_time: float | None
    runs: int
    median: float
    series: tuple[float, ...]

    @property
    def ratio(self) -> float | None:
        return self.median / self.est_time if self.est_time else None


@dataclass(frozen=True)
class FlakeRow:
    file: str
    arch: str
    runs: int
    bad: int
    retried: int
    flips: int
    window: tuple[str, ...]
    state: str

    @property
    def rate(self) -> float:
        return (self.bad + self.retried) / self.runs if self.runs else float(self.retried > 0)


@dataclass(frozen=True)
class GateRow:
    test: str
    arch: str
    metric: str
    step: int | None
    value: float | None
    verdict: str
    why: str
    history: tuple[float, ...]
    band: tuple[float, float] | None


@dataclass
class Health:
    generated: str
    inputs: list[str]
    pools: dict[str, list[PoolRun]] = field(default_factory=dict)
    drift: list[DriftRow] = field(default_factory=list)
    drift_total: int = 0
    flakes: list[FlakeRow] = field(default_factory=list)
    gate: list[GateRow] = field(default_factory=list)
    gate_note: str = ""
    gate_notes: list[str] = field(default_factory=list)  # "new environment: X -> Y", …
    audits: list[AuditRun] = field(default_factory=list)
    queues: dict[str, list[QueueWait]] = field(default_factory=dict)
    runs: int = 0
    problems: list[str] = field(default_factory=list)


def collect(root: Path, inputs: list[Path], store_url: str | None, *, now: dt.datetime) -> Health:
    health = Health(now.astimezone(dt.UTC).isoformat(timespec="seconds"), [str(p) for p in inputs])
    read = read_history(inputs, PARSERS, RecordError)  # each store read once: one problem each
    records, flakes, kinded = read.records, read.flakes, read.kinded
    health.problems += read.problems
    health.runs = len(records)
    for p in sorted(kinded["pool"], key=lambda p: p.when):
        health.pools.setdefault(p.pool, []).append(p)
    for q in sorted(kinded["queue"], key=lambda q: q.when):
        health.queues.setdefault(q.pool, []).append(q)
    health.audits = sorted(kinded["audit"], key=lambda a: a.when)
    _drift(health, root, records)
    _flakes(health, root, records, flakes, now.date())
    _gate(health, root, store_url)
    return health


def _est_times(health: Health, root: Path) -> dict[str, float]:
    from ..fleet import FLEET_RELATIVE_PATH, FleetError, load_fleet
    from ..registry import read_registry
    from ..sources import ConfigError

    try:
        registry = read_registry(root, load_fleet(root / FLEET_RELATIVE_PATH))
    except (FleetError, ConfigError, OSError) as e:
        health.problems.append(f"the registry cannot be read ({e}); est_time not shown")
        return {}
    return {r.path: r.est_time for r in registry.registrations}


def _drift(health: Health, root: Path, records: list[Record]) -> None:
    est = _est_times(health, root)
    passing: dict[tuple[str, str], list[Record]] = {}
    for r in dict.fromkeys(records):
        if r.outcome == "passed":
            passing.setdefault((r.file, r.arch or "cpu"), []).append(r)
    rows = []
    for (file, arch), rs in passing.items():
        last = [r.seconds for r in sorted(rs, key=lambda r: r.when)[-RECENT:]]
        rows.append(
            DriftRow(file, arch, est.get(file), len(rs), statistics.median(last), tuple(last))
        )
    key = lambda r: (r.ratio is None, -abs(math.log(r.ratio)) if r.ratio else 0.0, r.file, r.arch)  # noqa: E731
    health.drift_total = len(rows)
    health.drift = sorted(rows, key=key)[:MAX_ROWS]


def _flakes(health: Health, root: Path, records, flakes, today: dt.date) -> None:
    from ..flakes.evidence import BAD, gather
    from ..flakes.proposal import propose
    from ..flakes.quarantine import read_tree
    from ..flakes.settings import load_settings
    from ..sources import ConfigError

    try:
        settings = load_settings(root)
    except ConfigError as e:
        health.problems.append(str(e))
        return
    listed, problems = read_tree(root)
    health.problems += [str(p) for p in problems]
    evidence = gather(records, flakes, window=settings.window)
    proposal = propose(evidence, listed, settings, today)
    state = {e.key: f"quarantined since {e.since}" for e, _ in proposal.keep}
    state |= {e.key: f"quarantined since {e.since}; proposed: re-enable" for e, _ in proposal.lift}
    state |= {e.key: "proposed: quarantine" for e, _ in proposal.add}
    bad = {}
    for r in dict.fromkeys(records):
        if r.outcome in BAD:
            key = (r.file, r.arch or "cpu")
            bad[key] = bad.get(key, 0) + 1
    rows = [
        FlakeRow(
            ev.file,
            ev.arch,
            ev.runs,
            bad.get(key, 0),
            ev.retried,
            ev.flips,
            ev.window,
            state.get(key, "-"),
        )
        for key, ev in evidence.items()
        if bad.get(key) or ev.retried or key in state
    ]
    health.flakes = sorted(rows, key=lambda r: (-r.rate, r.file, r.arch))[:MAX_ROWS]


def _gate(health: Health, root: Path, store_url: str | None) -> None:
    if store_url is None:
        health.gate_note = "no metric store in the history (no gated value recorded yet)"
        return
    from ..gate.backends import open_store
    from ..gate.store import StoreError

    try:
        store = open_store(store_url, readonly=True)
    except StoreError as e:
        health.problems.append(str(e))
        health.gate_note = "the metric store cannot be read (see the problems)"
        return
    if store is None:
        health.gate_note = "no metric store in the history (no gated value recorded yet)"
        return
    try:
        _gate_rows(health, root, store)
    except StoreError as e:
        health.problems.append(str(e))
    finally:
        store.close()


def _gate_rows(health: Health, root: Path, store) -> None:
    from ..fleet import FLEET_RELATIVE_PATH, FleetError, load_fleet
    from ..gate.check import run_gate
    from ..gate.declarations import Declarations, read_declarations
    from ..gate.vocabulary import load_vocabulary
    from ..sources import ConfigError

    try:
        declarations = read_declarations(root, load_vocabulary(root))
        arches = [
            "cpu",
            *sorted(g.name for g in load_fleet(root / FLEET_RELATIVE_PATH).generations),
        ]
    except (FleetError, ConfigError, ValueError, OSError) as e:
        health.problems.append(f"the gate declarations cannot be read ({e})")
        return
    health.problems += [
        f"{v.path}:{v.line}: [{v.rule}] {v.message}. Fix: {v.fix}" for v in declarations.violations
    ]
    for test, gates in sorted(declarations.gates.items()):
        for arch in arches:
            for gate in gates:
                points = _newest_points(store, test, arch, gate.metric, health)
                if not points:
                    continue
                result = run_gate(Declarations(gates={test: [gate]}), points, store, [(test, arch)], [],
                                  today=dt.date.today())  # fmt: skip
                health.problems += result.problems
                health.gate_notes += [n for n in result.notes if n not in health.gate_notes]
                for row in result.rows:
                    band = (
                        (row.reference - row.band, row.reference + row.band)
                        if row.band is not None
                        else None
                    )
                    health.gate.append(GateRow(test, arch, row.metric, row.step, row.value, row.verdict,
                                               row.why, row.history, band))  # fmt: skip
    if not health.gate:
        health.gate_note = "no trusted value of a declared gate in the metric store yet"


def _newest_points(store, test: str, arch: str, metric: str, health: Health) -> list:
    """The newest trusted run's values of ``metric`` as artefact points (in its environment)."""
    from ..gate.artefacts import Point

    points = []
    envs = None
    for step in store.last_steps(test, arch, metric):
        stored, problems = store.history(test, arch, metric, step, limit=1)
        health.problems += problems
        if stored:
            envs = envs if envs is not None else store.environments(test, arch, metric, step)
            v = stored[0]
            points.append(
                Point(
                    test,
                    arch,
                    metric,
                    step,
                    v.value,
                    v.source,
                    None,
                    v.created,
                    envs[0] if envs else "unknown",
                )
            )
    return points
