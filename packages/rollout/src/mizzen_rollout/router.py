"""Routing requests to engines: least outstanding requests first.

- :class:`LeastOutstandingRouter`: the pure policy (indices, counters, liveness); used by the
  local :class:`EngineRouter` and by the Ray rollout manager.
- :class:`EngineRouter`: a dispatcher over in-process :class:`~mizzen_rollout.engines.Engine`
  objects (HTTP clients), used by the CLI and the overhead benchmark.

Invariants:
- ``acquire`` picks, among live engines not excluded, one with the fewest outstanding calls (a
  batch counts as one); ties rotate (so equal engines share load round-robin).  Every ``acquire`` is paired with exactly
  one ``release`` (callers use ``try/finally``); counters never go negative.
- ``EngineRouter`` re-issues a request whose engine is unavailable (connection failure / 5xx
  after the client's retries) to another engine with the same request id; each call returns at
  most one result, so no sample is produced twice.  A batch (``generate_batch``) is routed, and
  re-issued, as one unit: one engine, one outstanding call.  Engine errors of other kinds
  propagate.
- Standard library only (plus the engine types); no Ray here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Sequence
from typing import Any

from .engines.base import (
    ChatRequest,
    ChatResult,
    Engine,
    EngineUnavailableError,
    GenerateRequest,
    GenerateResult,
)

__all__ = ["EngineRouter", "LeastOutstandingRouter", "NoEngineAvailableError"]


class NoEngineAvailableError(EngineUnavailableError):
    """Every engine is dead or excluded."""


class LeastOutstandingRouter:
    """Least-outstanding-requests selection over ``len(names)`` engines."""

    def __init__(self, names: Sequence[str]):
        if not names:
            raise ValueError("a router needs at least one engine")
        self.names = list(names)
        self._outstanding = [0] * len(names)
        self._alive = [True] * len(names)
        self._next = 0

    def __len__(self) -> int:
        return len(self.names)

    @property
    def outstanding(self) -> tuple[int, ...]:
        return tuple(self._outstanding)

    @property
    def alive(self) -> tuple[bool, ...]:
        return tuple(self._alive)

    def acquire(self, exclude: Collection[int] = ()) -> int:
        """Pick an engine and count one more outstanding request on it."""
        n = len(self._outstanding)
        best = -1
        best_load = 0
        start = self._next
        for k in range(n):
            i = (start + k) % n
            if not self._alive[i] or i in exclude:
                continue
            load = self._outstanding[i]
            if best < 0 or load < best_load:
                best, best_load = i, load
                if load == 0:
                    break
        if best < 0:
            raise NoEngineAvailableError(
                f"no live engine to route to (alive: {self._alive}, excluded: {sorted(exclude)})"
            )
        self._outstanding[best] += 1
        self._next = (best + 1) % n
        return best

    def release(self, index: int) -> None:
        if self._outstanding[index] <= 0:
            raise RuntimeError(f"release of engine {index} without a matching acquire")
        self._outstanding[index] -= 1

    def mark_dead(self, index: int) -> None:
        self._alive[index] = False

    def mark_alive(self, index: int) -> None:
        self._alive[index] = True

    def is_alive(self, index: int) -> bool:
        return self._alive[index]


class EngineRouter:
    """A dispatcher over in-process engines (e.g. several :class:`SGLangClient`)."""

    def __init__(self, engines: Sequence[Engine]):
        self.engines = list(engines)
        self.router = LeastOutstandingRouter([e.name for e in self.engines])
        self._where: dict[str, int] = {}
        self.reissued: list[str] = []

    @property
    def name(self) -> str:
        return ",".join(self.router.names)

    async def _call(self, method: str, request: Any, request_ids: Sequence[str] = ()) -> Any:
        tried: set[int] = set()
        while True:
            index = self.router.acquire(exclude=tried)
            for request_id in request_ids:
                self._where[request_id] = index
            try:
                return await getattr(self.engines[index], method)(request)
            except EngineUnavailableError as exc:
                tried.add(index)
                if len(tried) == len(self.engines):
                    which = f" of request {request_ids[0]!r}" if request_ids else ""
                    if len(request_ids) > 1:
                        which = f" of the batch of {len(request_ids)} from {request_ids[0]!r}"
                    raise NoEngineAvailableError(
                        f"every engine failed ({method}{which}); last: {exc}",
                        engine=exc.engine,
                        request_id=request_ids[0] if request_ids else None,
                    ) from exc
                self.reissued.extend(request_ids)
            finally:
                self.router.release(index)
                for request_id in request_ids:
                    self._where.pop(request_id, None)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        return await self._call("generate", request, (request.request_id,))

    async def generate_batch(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        return await self._call(
            "generate_batch", list(requests), tuple(r.request_id for r in requests)
        )

    async def chat(self, request: ChatRequest) -> ChatResult:
        return await self._call("chat", request, (request.request_id,))

    async def tokenize(self, text: str) -> list[int]:
        return await self._call("tokenize", text)

    async def abort(self, request_id: str) -> None:
        index = self._where.get(request_id)
        targets = [self.engines[index]] if index is not None else self.engines
        for engine in targets:
            await engine.abort(request_id)

    async def health(self) -> bool:
        return any([await e.health() for e in self.engines])

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Load the adapter into every engine (all of them serve every request)."""
        await asyncio.gather(*(e.load_lora_adapter(name, path) for e in self.engines))

    async def unload_lora_adapter(self, name: str) -> None:
        await asyncio.gather(*(e.unload_lora_adapter(name) for e in self.engines))

    async def aclose(self) -> None:
        for engine in self.engines:
            await engine.aclose()
