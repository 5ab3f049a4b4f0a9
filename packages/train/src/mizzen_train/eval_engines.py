"""The embedded engines a generate evaluator starts, for one eval point or for the whole run.

:class:`EvalEngines` is the engine group of one generate evaluator
(:class:`~mizzen_train.evaluators.GenerationEvaluator`): ``num_engines`` embedded engines
(``mizzen-rollout serve``, :func:`mizzen_rollout.api.launch_embedded`) on ``device``.  A point
takes the group with :meth:`EvalEngines.lease` for what it serves -- a model directory (a
full-weight snapshot) or an adapter's base model -- and generates on its URLs.

``lifetime`` (:data:`ENGINE_LIFETIMES`):

- ``"point"``: the lease starts the engines and stops them before it ends (model load, torch
  import and device initialisation at every point);
- ``"run"``: the first lease starts them and the group is kept: a later lease for the same
  ``key`` reuses it (the evaluator then points the engines at its snapshot, by
  ``/update_weights_from_disk`` or ``/load_lora_adapter``), and :meth:`EvalEngines.close` -- the
  end of the run, however it ends -- stops it.  Between points the engines hold their memory (on a
  GPU: their weights and the allocator's cache beside training), and an embedded engine loading a
  full-weight snapshot holds the old and the new weights for a moment.

Invariants:
- Nothing is started before the first lease: a group built before step 0 holds no process.
- Every engine started is stopped exactly once, and both are noted with its pid
  (``engine_started`` / ``engine_stopped``, ``purpose = "eval"``; ``engine_stop_failed`` with
  the error for one that outlived its SIGKILL's wait): on the snapshot of the point that started
  or stopped it, or in the events :meth:`EvalEngines.close` returns.  A kept group
  is stopped at the next lease instead of reused when one of its engines is dead -- exited, or
  not answering ``/health`` (``engine_dead``, with the reason) -- (the point starts a fresh
  group: a dead engine never fails the run, at most the point it died in) or when the lease
  serves another ``key`` (another base model, or full weights after adapters); and right away
  when a point on it fails or reports failed generations (``EngineLease.spoiled``), the point
  that started it included (an engine can answer ``/health`` and still not serve).
- One lease at a time on a kept group: it serves one point after the other (points of the same
  evaluator in flight at once queue for it); ``"point"`` leases take no turn (each owns the
  engines it starts), and a group that did not start whole -- a launch or a health check
  failed -- is stopped whole and never kept.
- After :meth:`EvalEngines.close` a lease behaves as ``"point"``: whatever it starts it stops
  when it ends (a process that exits under a running point -- its eval threads are daemons --
  leaves that point's engines to their parent watch, which stops them).  ``close`` waits for no
  lease: an engine it stops under a running point fails that point's requests.
- Picklable: a copy holds no engines and is open (the Ray runner ships evaluators to tasks; each
  task closes its copy when its evaluation ends).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from mizzen_rollout.api import LaunchError, ServerProcess, launch_embedded
from mizzen_train.eval_dispatch import EvalSkip, Snapshot

__all__ = ["ENGINE_LIFETIMES", "EngineLease", "EvalEngines"]

#: How long an eval engine group lives: one point, or from the first point to the run's end.
ENGINE_LIFETIMES = ("run", "point")
#: The longest a kept engine may take to answer ``/health`` before a point reuses it.
HEALTH_PROBE_S = 30.0


@dataclass
class EngineLease:
    """What a point gets from :meth:`EvalEngines.lease`: the engines' URLs, and whether they were
    started for this point on its own model directory (``fresh``: nothing to point them at).
    The point sets ``spoiled`` when some of its generations failed: the group is then not kept."""

    urls: list[str]
    fresh: bool
    spoiled: bool = False


class EvalEngines:
    """See the module docstring."""

    def __init__(
        self,
        *,
        num_engines: int,
        threads: int,
        device: str,
        startup_timeout_s: float,
        lifetime: str,
    ) -> None:
        if lifetime not in ENGINE_LIFETIMES:
            raise ValueError(f"engine_lifetime={lifetime!r}: use one of {ENGINE_LIFETIMES}")
        if num_engines < 1:
            raise ValueError(f"num_engines={num_engines}: use >= 1")
        self.num_engines = num_engines
        self.threads = threads
        self.device = device
        self.startup_timeout_s = startup_timeout_s
        self.lifetime = lifetime
        self._open()

    def _open(self) -> None:
        self._use = threading.Lock()  # one lease at a time
        self._guard = threading.Lock()  # the kept group and the closed flag
        self._kept: list[ServerProcess] = []
        self._key: Hashable = None
        self._last_step: int | None = None
        self._closed = False

    def __getstate__(self) -> dict[str, Any]:
        keep = ("num_engines", "threads", "device", "startup_timeout_s", "lifetime")
        return {name: self.__dict__[name] for name in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._open()

    @contextlib.contextmanager
    def lease(
        self, snapshot: Snapshot, *, key: Hashable, model_path: str, load_dirs: Sequence[str]
    ) -> Iterator[EngineLease]:
        """The engines for ``snapshot``'s point: the kept group when it serves ``key`` and runs,
        else a group started on ``model_path`` (reading weights and adapters only from
        ``load_dirs``).  Raises :class:`EvalSkip` when an engine does not start."""
        # a kept group serves one point at a time; "point" leases own all they start: no queue
        with self._use if self.lifetime == "run" else contextlib.nullcontext():
            reused = self._reuse(snapshot, key)
            if reused is not None:
                with self._serving(reused, snapshot, fresh=False) as lease:
                    yield lease
                return
            owned: list[ServerProcess] = []  # started by this lease and not kept: it stops them
            try:
                servers = self._start(snapshot, key, model_path, load_dirs, owned)
                with self._serving(servers, snapshot, fresh=True) as lease:
                    yield lease
            finally:
                self._stop(owned, snapshot.note, reason="point ended")

    @contextlib.contextmanager
    def _serving(
        self, servers: list[ServerProcess], snapshot: Snapshot, *, fresh: bool
    ) -> Iterator[EngineLease]:
        """A point on ``servers``; if it fails, or some of its generations failed, the group is
        not kept for the next point (fresh or reused alike)."""
        lease = EngineLease([s.url for s in servers], fresh=fresh)
        try:
            yield lease
        except BaseException:
            self._discard(servers, snapshot.note, reason="a point on it failed")
            raise
        if lease.spoiled:
            self._discard(servers, snapshot.note, reason="a point on it had failed generations")

    def _reuse(self, snapshot: Snapshot, key: Hashable) -> list[ServerProcess] | None:
        """The kept group if it serves ``key`` and every engine in it answers ``/health``; else
        None, after stopping whatever was kept (noted on ``snapshot``)."""
        with self._guard:
            kept, same = list(self._kept), self._key == key
        if not kept:
            return None
        dead = self._dead(kept) if same else []
        with self._guard:
            if self._kept != kept:  # close() took the group meanwhile (and stopped it)
                return None
            if same and not dead:
                self._last_step = snapshot.step
                return kept
            self._kept, self._key = [], None
        for server, reason in dead:
            code = server.process.returncode
            snapshot.note("engine_dead", purpose="eval", pid=server.pid, returncode=code,
                          reason=reason)  # fmt: skip
        why = "an engine of the group is dead" if same else "the point serves another model"
        self._stop(kept, snapshot.note, reason=why)
        return None

    def _discard(self, servers: list[ServerProcess], note, *, reason: str) -> None:
        """A point on the kept group failed: stop the group (unless close() took it, or it is
        not kept) rather than hand a maybe-wedged engine -- one that answers ``/health`` but
        cannot serve -- to every later point."""
        with self._guard:
            if self._kept != servers:
                return
            self._kept, self._key = [], None
        self._stop(servers, note, reason=reason)

    def _dead(self, servers: Sequence[ServerProcess]) -> list[tuple[ServerProcess, str]]:
        """The engines that exited or do not answer ``/health`` (within 30 s at most), each with
        what is wrong with it."""
        dead = []
        for server in servers:
            try:
                server.wait_healthy(min(self.startup_timeout_s, HEALTH_PROBE_S))
            except LaunchError as exc:
                dead.append((server, str(exc).splitlines()[0]))
        return dead

    def _start(
        self,
        snapshot: Snapshot,
        key: Hashable,
        model_path: str,
        load_dirs: Sequence[str],
        owned: list[ServerProcess],
    ) -> list[ServerProcess]:
        """Start the group, keep it (``"run"``, while open) or leave it in ``owned``, and wait
        until every engine answers ``/health``."""
        servers: list[ServerProcess] = []
        try:
            for _ in range(self.num_engines):
                server = launch_embedded(
                    model_path=model_path,
                    num_threads=self.threads,
                    deadline_s=self.startup_timeout_s,
                    device=self.device,
                    load_dirs=list(load_dirs),
                    wait=False,
                )
                snapshot.note("engine_started", purpose="eval", pid=server.pid, engine="embedded")
                servers.append(server)
                with self._guard:
                    if self.lifetime == "run" and not self._closed:
                        self._kept.append(server)  # close() stops it from now on
                        self._key, self._last_step = key, snapshot.step
                    else:
                        owned.append(server)
            for server in servers:
                server.wait_healthy(self.startup_timeout_s)
        except LaunchError as exc:
            self._drop(snapshot, servers, owned)
            raise EvalSkip(f"the eval engine did not start: {str(exc)[:600]}") from None
        except BaseException:
            self._drop(snapshot, servers, owned)
            raise
        return servers

    def _drop(
        self, snapshot: Snapshot, servers: list[ServerProcess], owned: list[ServerProcess]
    ) -> None:
        """A group that did not start is stopped whole and not kept (except the engines close()
        took meanwhile: it stopped them)."""
        with self._guard:
            mine = [s for s in servers if s in self._kept or s in owned]
            self._kept = [s for s in self._kept if s not in servers]
            if not self._kept:
                self._key = None
        owned[:] = [s for s in owned if s not in servers]
        self._stop(mine, snapshot.note, reason="the group did not start")

    def _stop(self, servers: Sequence[ServerProcess], note, *, reason: str) -> None:
        """Stop each engine and note it; one that cannot be stopped is noted as such and the
        others are still stopped."""
        for server in servers:
            try:
                server.stop()
            except Exception as exc:  # e.g. a process that outlives SIGKILL's wait
                error = f"{type(exc).__name__}: {exc}"
                note("engine_stop_failed", purpose="eval", pid=server.pid, error=error)
                continue
            server.cleanup_logs()
            note("engine_stopped", purpose="eval", pid=server.pid, reason=reason)

    def close(self) -> list[dict[str, Any]]:
        """Stop the kept group (idempotent); from now on leases stop what they start.  Returns the
        ``engine_stopped`` events, each with ``step``: the last point the engine served."""
        with self._guard:
            self._closed = True
            kept, self._kept, self._key = self._kept, [], None
            step = self._last_step
        events: list[dict[str, Any]] = []

        def note(event: str, **fields: Any) -> None:
            events.append({"event": event, "time": time.time(), "step": step, **fields})

        self._stop(kept, note, reason="evaluator closed")
        return events
