"""The eval dispatcher: evaluate exported snapshots on the side, without holding training up.

One dispatcher serves train-only runs (SFT) and RL runs alike.  At each eval point the trainer
calls :meth:`EvalDispatcher.submit` with the step; the dispatcher

1. exports one Hugging Face snapshot per tenant (``<snapshot_root>/step-XXXXXXXX/<tenant>/``,
   through the trainer's ``export`` callback, in the calling thread: the weights must be the
   step's), then
2. hands the snapshots to the evaluators in a worker thread -- inline there, or as a Ray task when
   the run uses Ray (``runner="ray"``) -- and returns, so the next training step starts at once;
3. when every evaluation of the point has finished, logs each result at the snapshot's step (never
   at the step training has reached by then) and settles the point.

Evaluators are a small protocol (:class:`Evaluator`): ``name``, ``needs_engine``,
``evaluate(snapshot) -> {metric: number}`` and optionally ``tenants`` (the tenants it applies to;
all when absent or empty) and ``close() -> [event]`` (releases what it keeps from one point to the
next, e.g. engines, and returns the events to log: dicts with ``event``, ``time`` and fields, as
:meth:`Snapshot.note` makes them); :func:`load_evaluator` builds a user's from an import path.  An
evaluator may raise :class:`EvalSkip` to skip a snapshot with a reason.

Invariants:
- At most ``max_in_flight`` points are exported and unsettled at once.  A point that arrives when
  the limit is reached is skipped (``overflow="skip"``, with the reason logged) or waits for a
  free place (``overflow="wait"``).  The final point (``final=True``) is never skipped: it waits.
- A failed export, an evaluator that raises, or a runner that dies degrades the point (or that
  one evaluation) to ``skipped`` with the reason in the metrics; nothing raises into training.
- Every point settles exactly once; its snapshot directory is deleted exactly once after it
  settles, whatever the outcome: at once with ``keep_snapshots=0``, else when it is no longer among
  the ``keep_snapshots`` newest settled points (so the final snapshots stay for the user).
- Results are keyed by ``(step, tenant, evaluator)``: a key in ``settled`` (a resumed run's
  results) is never evaluated again, and a point whose keys are all settled is not even exported.
- :meth:`drain` returns once every submitted point has settled.
- :meth:`close` closes every evaluator (each one's ``close``, once per call; an evaluator's
  ``close`` is idempotent), whatever the others' do, reporting their events through ``on_event``;
  the trainer calls it however the run ends.  A point still in flight when :meth:`close` starts
  is left unsettled (no record, its snapshot kept): what it would record may be the teardown's
  doing (its engines stopped under it), and a resumed run evaluates it again.  Under the Ray runner each task closes its own copy
  of the evaluator when its evaluation ends (its events come back with the result): nothing is
  kept from one point to the next there.
"""

from __future__ import annotations

import math
import shutil
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "OVERFLOW_POLICIES",
    "RUNNERS",
    "EvalDispatcher",
    "EvalRecord",
    "EvalSkip",
    "EvalSpecError",
    "Evaluator",
    "PointOutcome",
    "Snapshot",
    "load_evaluator",
    "point_dir_name",
]

OVERFLOW_POLICIES = ("skip", "wait")
RUNNERS = ("thread", "ray")


class EvalSkip(Exception):
    """Raised by an evaluator: this snapshot is not evaluated, for ``reason``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class EvalSpecError(ValueError):
    """A user evaluator's import path or options cannot be resolved (names the spec and fix)."""


@dataclass
class Snapshot:
    """One tenant's exported model at one step: a Hugging Face directory."""

    step: int
    tenant: str
    path: Path
    #: Events an evaluator notes (e.g. an engine it started), logged with its result.
    events: list[dict[str, Any]] = field(default_factory=list)
    #: The directory every snapshot of the run lies under (the dispatcher's snapshot root; None
    #: for a snapshot given alone).
    root: Path | None = None

    def note(self, event: str, **fields: Any) -> None:
        self.events.append({"event": event, "time": time.time(), **fields})


@runtime_checkable
class Evaluator(Protocol):
    """What the dispatcher runs on a snapshot."""

    #: Unique within a run; the key of its results in the metrics.
    name: str
    #: True when it needs a rollout engine (feeds the run's ``engines_needed``).
    needs_engine: bool

    def evaluate(self, snapshot: Snapshot) -> Mapping[str, float]:
        """Metrics of ``snapshot`` (finite numbers), or raise :class:`EvalSkip`."""
        ...


@dataclass(frozen=True)
class EvalRecord:
    """One evaluation's outcome, logged at the snapshot's step."""

    step: int
    tenant: str
    evaluator: str
    status: str  # "ok" | "skipped"
    metrics: dict[str, float] = field(default_factory=dict)
    reason: str | None = None
    wall_s: float = 0.0
    events: tuple[dict[str, Any], ...] = ()

    @property
    def key(self) -> tuple[int, str, str]:
        return (self.step, self.tenant, self.evaluator)


@dataclass(frozen=True)
class PointOutcome:
    """How one eval point ended (``skipped``: no evaluation ran; ``partial``: some skipped)."""

    step: int
    status: str  # "ok" | "partial" | "skipped" | "already"
    reason: str | None = None
    wall_s: float = 0.0
    final: bool = False


def point_dir_name(step: int) -> str:
    return f"step-{step:08d}"


@dataclass
class _Point:
    step: int
    final: bool
    directory: Path
    snapshots: list[Snapshot] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    deleted: bool = False


class EvalDispatcher:
    """See the module docstring.  Thread-safe; ``submit`` and ``drain`` from the training thread.

    ``export(step, tenant, directory)`` writes one tenant's snapshot (atomically) or raises;
    ``on_record`` / ``on_point`` receive every :class:`EvalRecord` and :class:`PointOutcome`
    (from worker threads, one call at a time); ``on_event(evaluator, event)`` every event an
    evaluator's ``close`` returns.
    """

    def __init__(
        self,
        *,
        evaluators: Sequence[Evaluator],
        tenants: Sequence[str],
        export: Callable[[int, str, Path], None],
        snapshot_root: str | Path,
        max_in_flight: int = 1,
        overflow: str = "skip",
        keep_snapshots: int = 1,
        runner: str = "thread",
        on_record: Callable[[EvalRecord], None] | None = None,
        on_point: Callable[[PointOutcome], None] | None = None,
        on_event: Callable[[str, dict[str, Any]], None] | None = None,
        settled: Collection[tuple[int, str, str]] = (),
        retained: Iterable[tuple[int, Path]] = (),
        ray_options: Mapping[str, Any] | None = None,
        snapshot_marker: str = "config.json",
    ) -> None:
        names = [e.name for e in evaluators]
        if len(set(names)) != len(names):
            raise ValueError(f"evaluator names must be unique, got {names}")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight={max_in_flight}: use >= 1")
        if overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"overflow={overflow!r}: use one of {OVERFLOW_POLICIES}")
        if keep_snapshots < 0:
            raise ValueError(f"keep_snapshots={keep_snapshots}: use >= 0")
        if runner not in RUNNERS:
            raise ValueError(f"runner={runner!r}: use one of {RUNNERS}")
        self.evaluators = list(evaluators)
        #: The tenants the next point exports and evaluates (a trainer whose tenants join and
        #: leave sets it before each submit).
        self.tenants = list(tenants)
        #: The file a complete snapshot directory holds (merged model: config.json; a PEFT
        #: adapter: adapter_config.json).
        self.snapshot_marker = snapshot_marker
        self._export = export
        self.snapshot_root = Path(snapshot_root)
        self.max_in_flight = max_in_flight
        self.overflow = overflow
        self.keep_snapshots = keep_snapshots
        self.runner = runner
        self._ray_options = dict(ray_options or {})
        self._on_record = on_record or (lambda record: None)
        self._on_point = on_point or (lambda outcome: None)
        self._on_event = on_event or (lambda evaluator, event: None)
        self._settled_keys = set(settled)
        self._lock = threading.Condition()
        self._report_lock = threading.Lock()
        self._in_flight: dict[int, _Point] = {}
        self._threads: list[threading.Thread] = []
        self._retained: deque[tuple[int, Path]] = deque(sorted(retained))
        self.outcomes: dict[int, PointOutcome] = {}
        self.records: list[EvalRecord] = []
        #: Every snapshot directory deleted, in order (each appears once).
        self.deleted: list[Path] = []
        self._ray_owned = False
        self._closing = False  # close() started: points in flight are left unsettled
        self._ray_task: Any = None
        self._trim_retained()

    # -- keys ---------------------------------------------------------------------------------

    def _evaluates(self, evaluator: Evaluator, tenant: str) -> bool:
        only = getattr(evaluator, "tenants", None)  # optional: the tenants it applies to
        return not only or tenant in only

    def keys(self, step: int) -> list[tuple[int, str, str]]:
        return [
            (step, t, e.name)
            for t in self.tenants
            for e in self.evaluators
            if self._evaluates(e, t)
        ]

    def pending_keys(self, step: int) -> list[tuple[int, str, str]]:
        return [key for key in self.keys(step) if key not in self._settled_keys]

    @property
    def in_flight(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(sorted(self._in_flight))

    # -- submit -------------------------------------------------------------------------------

    def submit(self, step: int, *, final: bool = False) -> str:
        """Start eval point ``step``; returns ``dispatched``, ``skipped`` or ``already``.

        Blocks only for the export, and (``overflow="wait"`` or ``final``) while the in-flight
        limit is reached."""
        pending = self.pending_keys(step)
        if not pending:
            self._report_point(PointOutcome(step, "already", final=final))
            return "already"
        with self._lock:
            if step in self._in_flight or step in self.outcomes:
                raise ValueError(f"eval point {step} was submitted twice")
            if len(self._in_flight) >= self.max_in_flight:
                if self.overflow == "skip" and not final:
                    busy = sorted(self._in_flight)
                    reason = (
                        f"max_in_flight={self.max_in_flight} points were still being evaluated "
                        f"(steps {busy}) and overflow='skip'"
                    )
                    skip = True
                else:
                    skip = False
                    while len(self._in_flight) >= self.max_in_flight:
                        self._lock.wait()
            else:
                skip = False
            if not skip:
                point = _Point(step, final, self.snapshot_root / point_dir_name(step))
                self._in_flight[step] = point
        if skip:
            self._skip_point(step, pending, reason, final)
            return "skipped"
        try:
            self._export_point(point)
        except Exception as exc:
            self._abandon(point, pending, f"export failed: {type(exc).__name__}: {exc}")
            return "skipped"
        try:
            self._start_ray()
        except Exception as exc:
            self._abandon(point, pending, f"the ray runner did not start: {exc}")
            return "skipped"
        thread = threading.Thread(
            target=self._run_point,
            args=(point, pending),
            name=f"eval-step-{step}",
            daemon=True,
        )
        self._threads.append(thread)
        thread.start()
        return "dispatched"

    def _abandon(
        self, point: _Point, pending: list[tuple[int, str, str]], reason: str, *, delete=True
    ) -> None:
        """Settle an in-flight point that will not run: skipped, its directory deleted."""
        with self._lock:
            self._in_flight.pop(point.step, None)
            self._lock.notify_all()
        if delete:
            self._delete(point)
        else:  # a surviving snapshot of a previous run: it settles now, under the keep rule
            with self._lock:
                self._retained.append((point.step, point.directory))
            self._trim_retained()
        self._skip_point(point.step, pending, reason, point.final, started=point.started)

    def _export_point(self, point: _Point) -> None:
        if point.directory.exists():  # a stale directory of a killed run: not this state's
            shutil.rmtree(point.directory)
        point.directory.mkdir(parents=True)
        for tenant in self.tenants:
            path = point.directory / tenant
            self._export(point.step, tenant, path)
            if not path.is_dir():
                raise RuntimeError(f"the export wrote no directory at {path}")
            point.snapshots.append(Snapshot(point.step, tenant, path, root=self.snapshot_root))

    def recover(self, step: int, *, final: bool = False) -> str:
        """Dispatch a point whose snapshots a previous (killed) run already exported."""
        pending = self.pending_keys(step)
        directory = self.snapshot_root / point_dir_name(step)
        if not pending:
            return "already"
        missing = [t for t in self.tenants if not (directory / t / self.snapshot_marker).is_file()]
        if missing:
            reason = (
                f"the run stopped before this point settled and its snapshots of {missing} are "
                "not on disk (the state of that step is gone)"
            )
            point = _Point(step, final, directory)
            self._delete(point)
            self._skip_point(step, pending, reason, final)
            return "skipped"
        with self._lock:
            while len(self._in_flight) >= self.max_in_flight:
                self._lock.wait()
            point = _Point(step, final, directory)
            point.snapshots = [
                Snapshot(step, t, directory / t, root=self.snapshot_root) for t in self.tenants
            ]
            self._in_flight[step] = point
        try:
            self._start_ray()
        except Exception as exc:
            self._abandon(point, pending, f"the ray runner did not start: {exc}", delete=False)
            return "skipped"
        thread = threading.Thread(
            target=self._run_point, args=(point, pending), name=f"eval-step-{step}", daemon=True
        )
        self._threads.append(thread)
        thread.start()
        return "dispatched"

    # -- running ------------------------------------------------------------------------------

    def _run_point(self, point: _Point, pending: list[tuple[int, str, str]]) -> None:
        wanted = set(pending)
        records: list[EvalRecord] = []
        try:
            for snapshot in point.snapshots:
                for evaluator in self.evaluators:
                    if (point.step, snapshot.tenant, evaluator.name) not in wanted:
                        continue
                    records.append(self._evaluate(evaluator, snapshot))
        except BaseException as exc:  # the worker itself broke: every missing result is skipped
            reason = f"the eval worker failed: {type(exc).__name__}: {exc}"
            done = {r.key for r in records}
            records += [
                EvalRecord(step, tenant, name, "skipped", reason=reason)
                for step, tenant, name in pending
                if (step, tenant, name) not in done
            ]
        self._settle(point, records)

    def _evaluate(self, evaluator: Evaluator, snapshot: Snapshot) -> EvalRecord:
        started = time.monotonic()
        fresh = Snapshot(snapshot.step, snapshot.tenant, snapshot.path, root=snapshot.root)
        status, metrics, reason = "ok", {}, None
        try:
            if self.runner == "ray":
                raw, events = self._run_on_ray(evaluator, fresh)
                fresh.events.extend(events)
            else:
                raw = evaluator.evaluate(fresh)
            metrics = _check_metrics(raw, evaluator.name)
        except EvalSkip as exc:
            status, reason = "skipped", f"{evaluator.name}: {exc.reason}"
        except Exception as exc:
            status = "skipped"
            where = traceback.extract_tb(exc.__traceback__)[-1:]
            at = f" at {where[0].filename}:{where[0].lineno}" if where else ""
            reason = f"{evaluator.name} raised {type(exc).__name__}: {exc}{at}"
        return EvalRecord(
            snapshot.step,
            snapshot.tenant,
            evaluator.name,
            status,
            metrics,
            reason,
            round(time.monotonic() - started, 3),
            tuple(fresh.events),
        )

    # -- settling -----------------------------------------------------------------------------

    def _settle(self, point: _Point, records: list[EvalRecord]) -> None:
        with self._lock:
            if self._closing:  # see the module docstring: unsettled, so a resume redoes it
                self._in_flight.pop(point.step, None)
                self._lock.notify_all()
                return
        wall = round(time.monotonic() - point.started, 3)
        skipped = [r for r in records if r.status != "ok"]
        if not records or len(skipped) == len(records):
            status = "skipped"
        elif skipped:
            status = "partial"
        else:
            status = "ok"
        reason = "; ".join(r.reason for r in skipped if r.reason) or None
        outcome = PointOutcome(point.step, status, reason, wall, point.final)
        for record in records:
            self._report_record(record)
        self._report_point(outcome)
        with self._lock:
            self._in_flight.pop(point.step, None)
            self._retained.append((point.step, point.directory))
            self._lock.notify_all()
        self._trim_retained()

    def _trim_retained(self) -> None:
        while True:
            with self._lock:
                if len(self._retained) <= self.keep_snapshots:
                    return
                step, directory = self._retained.popleft()
            self._delete(_Point(step, False, directory))

    def _delete(self, point: _Point) -> None:
        with self._lock:
            if point.directory in self.deleted:
                return
            self.deleted.append(point.directory)
        shutil.rmtree(point.directory, ignore_errors=True)

    def _skip_point(
        self,
        step: int,
        pending: Sequence[tuple[int, str, str]],
        reason: str,
        final: bool,
        *,
        started: float | None = None,
    ) -> None:
        wall = round(time.monotonic() - started, 3) if started is not None else 0.0
        for _, tenant, name in pending:
            self._report_record(EvalRecord(step, tenant, name, "skipped", reason=reason))
        self._report_point(PointOutcome(step, "skipped", reason, wall, final))

    def _report_record(self, record: EvalRecord) -> None:
        with self._report_lock:
            self._settled_keys.add(record.key)
            self.records.append(record)
            try:
                self._on_record(record)
            except Exception:  # a broken sink must not kill the worker; say so on stderr
                traceback.print_exc()

    def _report_point(self, outcome: PointOutcome) -> None:
        with self._report_lock:
            self.outcomes[outcome.step] = outcome
            try:
                self._on_point(outcome)
            except Exception:
                traceback.print_exc()

    def start(self) -> None:
        """Connect the runner (Ray: ``ray.init``) now, from the calling thread, so a runner that
        cannot start fails before training does.  Submitting does it otherwise."""
        self._start_ray()

    def _start_ray(self) -> None:
        """Connect to (or start) Ray from the calling thread -- the training thread: Ray installs
        its signal handlers in the main thread -- before the first point runs on it."""
        if self.runner != "ray" or self._ray_task is not None:
            return
        import ray

        if not ray.is_initialized():
            ray.init(
                address=self._ray_options.get("address"),
                include_dashboard=False,
                log_to_driver=False,
            )
            self._ray_owned = True
        self._ray_task = ray.remote(num_cpus=self._ray_options.get("num_cpus", 1), max_retries=0)(
            _ray_evaluate
        )

    def _run_on_ray(self, evaluator: Evaluator, snapshot: Snapshot):
        """One evaluation as a Ray task."""
        import ray

        return ray.get(self._ray_task.remote(evaluator, snapshot))

    # -- end ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Close every evaluator (see the module docstring), then release what the runner holds
        (shuts Ray down if this dispatcher started it).  Waits for no point in flight; those
        are left unsettled (see the module docstring)."""
        with self._lock:
            self._closing = True
        try:
            for evaluator in self.evaluators:
                self._close_evaluator(evaluator)
        finally:
            if self._ray_owned:
                import ray

                ray.shutdown()
                self._ray_owned = False

    def _close_evaluator(self, evaluator: Evaluator) -> None:
        close = getattr(evaluator, "close", None)
        if close is None:
            return
        try:
            events = list(close() or ())
        except Exception:  # one evaluator's failure must not leave the others' engines running
            print(f"closing evaluator {evaluator.name!r} failed:", file=sys.stderr)
            traceback.print_exc()
            return
        with self._report_lock:
            for event in events:
                try:
                    self._on_event(evaluator.name, dict(event))
                except Exception:
                    traceback.print_exc()

    def drain(self, timeout_s: float | None = None) -> list[PointOutcome]:
        """Wait until every submitted point has settled; outcomes in step order."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for thread in list(self._threads):
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            thread.join(remaining)
        with self._lock:
            if self._in_flight:
                raise TimeoutError(
                    f"eval points {sorted(self._in_flight)} did not settle within {timeout_s} s"
                )
        return [self.outcomes[step] for step in sorted(self.outcomes)]


def _check_metrics(raw: Any, name: str) -> dict[str, float]:
    if not isinstance(raw, Mapping) or not raw:
        raise TypeError(f"{name}.evaluate returned {type(raw).__name__}, not a non-empty mapping")
    metrics = {}
    for key, value in raw.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"{name}.evaluate returned a metric named {key!r}")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"{name}.evaluate returned {key}={value!r}, not a number")
        if not math.isfinite(value):
            raise ValueError(f"{name}.evaluate returned {key}={value}, not finite")
        metrics[key] = float(value)
    return metrics


def _ray_evaluate(evaluator: Evaluator, snapshot: Snapshot):
    """One evaluation in a Ray task, on the task's own copy of the evaluator: closed when the
    evaluation ends (nothing it keeps outlives the task), its events noted on the snapshot."""
    try:
        result = evaluator.evaluate(snapshot)
    finally:
        close = getattr(evaluator, "close", None)
        if close is not None:
            snapshot.events.extend(dict(event) for event in close() or ())
    return dict(result) if isinstance(result, Mapping) else result, snapshot.events


# -- user evaluators ---------------------------------------------------------------------------


def load_evaluator(spec: str, options: Mapping[str, Any] | None = None) -> Evaluator:
    """Build a user evaluator: ``spec`` names a factory (``package.module:factory`` or
    ``path/to/file.py:factory``) called with ``options``; it returns an :class:`Evaluator`."""
    from mizzen_rollout.api import ObjectSpecError, load_object

    try:
        factory = load_object(spec, what="evaluator", kind="factory")
    except ObjectSpecError as exc:
        raise EvalSpecError(str(exc)) from None
    attr = spec.rpartition(":")[2]
    try:
        evaluator = factory(**dict(options or {}))
    except Exception as exc:
        raise EvalSpecError(
            f"evaluator {spec!r}: {attr}(**options) raised {type(exc).__name__}: {exc}; fix: "
            "check the evaluator's options"
        ) from None
    for attribute in ("name", "needs_engine", "evaluate"):
        if not hasattr(evaluator, attribute):
            raise EvalSpecError(
                f"evaluator {spec!r}: {attr}() returned {type(evaluator).__name__} without "
                f"'{attribute}'; an evaluator has name, needs_engine and evaluate(snapshot)"
            )
    if not isinstance(evaluator.name, str) or not evaluator.name:
        raise EvalSpecError(f"evaluator {spec!r}: name={evaluator.name!r} is not a string")
    return evaluator
