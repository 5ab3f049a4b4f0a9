"""The rollout manager on Ray: engine workers as actors, least-outstanding routing, fault handling.

    with RolloutManager([EngineSpec(), EngineSpec()]) as manager:      # two embedded engines
        batch = manager.generate_groups(prompts, RolloutConfig(n_samples=4), reward=math_exact_match)

Each :class:`EngineWorker` actor owns one engine: it launches the embedded server (or SGLang) as
its child process, or connects to a URL, and forwards requests to it with :class:`SGLangClient`.
The manager is a :class:`~mizzen_rollout.rollout.Dispatcher`, so the same rollout pipeline runs
locally and on Ray.

Invariants:
- ``ray`` is imported inside functions only.  ``ray.init`` is local by default; with ``address``
  it connects to an existing cluster.  The manager shuts Ray down only if it started it.
- Each call returns exactly one result per request id.  When an engine dies mid-batch (its actor
  dies, or its server stops answering), every request in flight on it is re-issued to another
  live engine *with the same request id* (a batched call whole); the dead actor's answers can
  never arrive, so no sample is lost or duplicated.  The death is recorded as an
  :class:`EngineEvent` (with the re-issued ids), and the engine is restarted as a fresh actor;
  it rejoins routing once healthy.
- Application errors from an engine (4xx, timeouts, protocol errors) propagate unchanged; only
  unavailability triggers a re-issue.
- LoRA adapters loaded through the manager (:meth:`RolloutManager.load_lora_adapter`) are on every
  engine that serves: a replacement engine loads every adapter the manager holds *before* it
  rejoins routing (and catches up with loads and unloads that happened while it started), so a
  request routed to an adapter never lands on an engine without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from .data import PromptRecord
from .engines.base import (
    ChatRequest,
    ChatResult,
    EngineError,
    EngineUnavailableError,
    GenerateRequest,
    GenerateResult,
)
from .masking import masked_repr
from .rewards import RewardFn
from .rollout import RolloutBatch, RolloutConfig, run_rollout
from .router import LeastOutstandingRouter, NoEngineAvailableError
from .samples import Sample

__all__ = ["EngineEvent", "EngineSpec", "EngineWorker", "RolloutManager"]


@masked_repr  # its url and model path may hold credentials registered with the mask set
@dataclass(frozen=True)
class EngineSpec:
    """How an engine worker gets its engine.

    ``kind="embedded"``: launch ``mizzen-rollout serve`` (``backend``, ``model_path``, ``seed``).
    ``kind="sglang"``: launch ``python -m sglang.launch_server --model-path model_path
    *sglang_args`` (GPU images).  ``kind="url"``: use the server at ``url`` (restart = reconnect).
    """

    kind: Literal["embedded", "sglang", "url"] = "embedded"
    url: str | None = None
    model_path: str | None = None
    backend: str = "transformers"
    seed: int = 0
    sglang_args: tuple[str, ...] = ()
    launch_deadline_s: float = 300.0
    timeout_s: float = 600.0
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    #: ``kind="embedded"``: where the embedded engine generates ("cpu" or "cuda").
    device: str = "cpu"
    #: ``kind="embedded"``: the directories it may load weights and adapters from (default: the
    #: one holding ``model_path``).
    load_dirs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind == "url" and not self.url:
            raise ValueError("EngineSpec(kind='url') needs url=")
        if self.kind == "sglang" and not self.model_path:
            raise ValueError("EngineSpec(kind='sglang') needs model_path=")
        if self.kind not in ("embedded", "sglang", "url"):
            raise ValueError(f"EngineSpec.kind is {self.kind!r}; use embedded, sglang or url")


@dataclass(frozen=True)
class EngineEvent:
    """Something that happened to an engine: ``died``, ``restarted`` or ``restart_failed``."""

    time: float
    engine_index: int
    kind: Literal["died", "restarted", "restart_failed"]
    detail: str
    reissued_request_ids: tuple[str, ...] = ()


class EngineWorker:
    """The body of an engine actor (wrapped with ``ray.remote`` by the manager).

    Async methods: Ray runs them concurrently on the actor's event loop.
    """

    def __init__(self, spec: EngineSpec, name: str):
        self.spec = spec
        self.name = name
        self.server: Any = None
        self.client: Any = None

    async def start(self, adapters: dict[str, str] | None = None) -> str:
        """Launch or connect to the engine, wait until it is healthy and load ``adapters``
        (``{name: PEFT directory}``); return its URL."""
        from .engines.client import SGLangClient
        from .engines.launcher import launch_embedded, launch_sglang

        spec = self.spec
        if spec.kind == "embedded":
            self.server = await asyncio.to_thread(
                launch_embedded,
                model_path=spec.model_path,
                seed=spec.seed,
                backend=spec.backend,
                deadline_s=spec.launch_deadline_s,
                device=spec.device,
                load_dirs=spec.load_dirs,
            )
            url = self.server.url
        elif spec.kind == "sglang":
            self.server = await asyncio.to_thread(
                launch_sglang,
                spec.model_path,
                extra_args=spec.sglang_args,
                deadline_s=spec.launch_deadline_s,
            )
            url = self.server.url
        else:
            url = spec.url
        self.client = SGLangClient(url, timeout_s=spec.timeout_s)
        if not await self.client.health():
            raise EngineUnavailableError(f"{self.name}: {url} does not answer /health", engine=url)
        self.adapters: dict[str, str] = {}
        await self.sync_adapters(adapters or {})
        return url

    async def sync_adapters(self, wanted: dict[str, str]) -> str:
        """Load and unload adapters until exactly ``wanted`` is loaded; return the URL."""
        for name in [n for n in self.adapters if n not in wanted]:
            await self.unload_lora_adapter(name)
        for name, path in wanted.items():
            if name not in self.adapters:
                await self.load_lora_adapter(name, path)
        return self.client.base_url

    async def load_lora_adapter(self, name: str, path: str) -> None:
        await self.client.load_lora_adapter(name, path)
        self.adapters[name] = path

    async def unload_lora_adapter(self, name: str) -> None:
        await self.client.unload_lora_adapter(name)
        self.adapters.pop(name, None)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        return await self.client.generate(request)

    async def generate_batch(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        return await self.client.generate_batch(requests)

    async def chat(self, request: ChatRequest) -> ChatResult:
        return await self.client.chat(request)

    async def tokenize(self, text: str) -> list[int]:
        return await self.client.tokenize(text)

    async def abort(self, request_id: str) -> None:
        await self.client.abort(request_id)

    async def health(self) -> bool:
        return self.client is not None and await self.client.health()

    def info(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "actor_pid": os.getpid(),
            "url": self.client.base_url if self.client else None,
            "server_pid": self.server.pid if self.server is not None else None,
        }

    async def shutdown(self) -> None:
        if self.client is not None:
            await self.client.aclose()
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)
            self.server.cleanup_logs()


@dataclass
class _Slot:
    index: int
    spec: EngineSpec
    handle: Any = None
    generation: int = 0
    start_ref: Any = None  # pending start() of the current actor
    url: str | None = None
    inflight: dict[str, None] = field(default_factory=dict)
    #: The adapters the pending start()/sync_adapters() call was asked to load.
    start_adapters: dict[str, str] = field(default_factory=dict)


class RolloutManager:
    """Engine workers on Ray behind a least-outstanding router (a rollout Dispatcher)."""

    def __init__(
        self,
        engines: Sequence[EngineSpec] | int = 2,
        *,
        address: str | None = None,
        num_cpus: int | None = None,
        restart: bool = True,
        start_deadline_s: float = 600.0,
        ray_init_kwargs: dict[str, Any] | None = None,
    ):
        specs = (
            [EngineSpec() for _ in range(engines)] if isinstance(engines, int) else list(engines)
        )
        if not specs:
            raise ValueError("RolloutManager needs at least one EngineSpec")
        self._slots = [_Slot(i, s) for i, s in enumerate(specs)]
        self._router = LeastOutstandingRouter([f"engine-{i}" for i in range(len(specs))])
        self._address = address
        self._num_cpus = num_cpus
        self._restart = restart
        self._start_deadline_s = start_deadline_s
        self._ray_init_kwargs = dict(ray_init_kwargs or {})
        self._owns_ray = False
        self._started = False
        self._worker_class: Any = None
        self.events: list[EngineEvent] = []
        self.reissued: list[str] = []
        #: Adapters every serving engine holds: ``{name: PEFT directory}``, in load order.
        self.adapters: dict[str, str] = {}

    # ------------------------------------------------------------------ lifecycle
    def _actor_class(self):
        import ray

        if self._worker_class is None:
            self._worker_class = ray.remote(EngineWorker)
        return self._worker_class

    def _spawn(self, slot: _Slot) -> None:
        spec = slot.spec
        slot.generation += 1
        slot.handle = (
            self._actor_class()
            .options(
                num_cpus=spec.num_cpus,
                num_gpus=spec.num_gpus,
                max_restarts=0,
                max_concurrency=1000,
            )
            .remote(spec, f"engine-{slot.index}.{slot.generation}")
        )
        slot.start_adapters = dict(self.adapters)
        slot.start_ref = slot.handle.start.remote(dict(slot.start_adapters))

    def start(self) -> RolloutManager:
        """Initialise Ray (if needed), start every engine worker and wait until all are healthy."""
        import ray

        if self._started:
            return self
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
            if self._address is None and self._num_cpus is not None:
                kwargs["num_cpus"] = self._num_cpus
            kwargs.update(self._ray_init_kwargs)
            ray.init(address=self._address, **kwargs)
            self._owns_ray = True
        for slot in self._slots:
            self._spawn(slot)
        try:
            urls = ray.get([s.start_ref for s in self._slots], timeout=self._start_deadline_s)
        except Exception:
            self.shutdown()
            raise
        for slot, url in zip(self._slots, urls, strict=True):
            slot.url, slot.start_ref = url, None
        self._started = True
        return self

    def shutdown(self) -> None:
        """Stop every engine worker (and Ray, if this manager started it)."""
        import ray

        for slot in self._slots:
            if slot.handle is None:
                continue
            with contextlib.suppress(Exception):
                ray.get(slot.handle.shutdown.remote(), timeout=30)
            ray.kill(slot.handle, no_restart=True)
            slot.handle = None
        self._started = False
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False

    def __enter__(self) -> RolloutManager:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ introspection
    @property
    def num_engines(self) -> int:
        return len(self._slots)

    @property
    def outstanding(self) -> tuple[int, ...]:
        return self._router.outstanding

    @property
    def alive(self) -> tuple[bool, ...]:
        return self._router.alive

    def engine_handle(self, index: int) -> Any:
        """The Ray actor handle of engine ``index`` (e.g. to kill it in a fault drill)."""
        return self._slots[index].handle

    def engine_info(self, index: int) -> dict[str, Any]:
        import ray

        return ray.get(self._slots[index].handle.info.remote(), timeout=30)

    # ------------------------------------------------------------------ fault handling
    def _engine_died(self, slot: _Slot, generation: int, reason: str) -> None:
        """Record the death of ``slot``'s actor ``generation`` once, and restart it."""
        import ray

        if slot.generation != generation or not self._router.is_alive(slot.index):
            return  # already handled (another request saw the same death first)
        self._router.mark_dead(slot.index)
        reissued = tuple(slot.inflight)
        self.events.append(EngineEvent(time.time(), slot.index, "died", reason, reissued))
        old = slot.handle
        with contextlib.suppress(Exception):
            ray.kill(old, no_restart=True)
        if self._restart:
            self._spawn(slot)

    def _poll_restarts(self, block_s: float = 0.0) -> None:
        """Bring restarted engines whose start() finished back into routing."""
        import ray

        pending = [s for s in self._slots if s.start_ref is not None]
        if not pending:
            return
        ready, _ = ray.wait(
            [s.start_ref for s in pending], num_returns=len(pending), timeout=block_s
        )
        for slot in pending:
            if slot.start_ref not in ready:
                continue
            ref, slot.start_ref = slot.start_ref, None
            try:
                slot.url = ray.get(ref)
            except Exception as exc:
                self.events.append(EngineEvent(time.time(), slot.index, "restart_failed", f"{exc}"))
                continue
            if slot.start_adapters != self.adapters:
                # adapters changed while it started: catch up before it serves
                slot.start_adapters = dict(self.adapters)
                slot.start_ref = slot.handle.sync_adapters.remote(dict(slot.start_adapters))
                continue
            self._router.mark_alive(slot.index)
            self.events.append(
                EngineEvent(time.time(), slot.index, "restarted", f"serving at {slot.url}")
            )

    def wait_for_restarts(self, timeout_s: float = 300.0) -> None:
        """Block until every pending restart finished (or the timeout passed)."""
        end = time.monotonic() + timeout_s
        while any(s.start_ref is not None for s in self._slots) and time.monotonic() < end:
            self._poll_restarts(block_s=min(1.0, max(0.0, end - time.monotonic())))

    async def _acquire(self) -> int:
        deadline = time.monotonic() + self._start_deadline_s
        while True:
            self._poll_restarts()
            try:
                return self._router.acquire()
            except NoEngineAvailableError:
                if not any(s.start_ref is not None for s in self._slots):
                    raise
                if time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.1)

    async def _call(self, method: str, arg: Any, request_ids: Sequence[str] = ()) -> Any:
        from ray.exceptions import RayActorError, RayTaskError

        if not self._started:
            raise RuntimeError("RolloutManager is not started; use start() or a with block")
        while True:
            index = await self._acquire()
            slot = self._slots[index]
            generation, handle = slot.generation, slot.handle
            for request_id in request_ids:
                slot.inflight[request_id] = None
            try:
                return await getattr(handle, method).remote(arg)
            except RayActorError as exc:
                reason = f"actor died: {type(exc).__name__}"
            except RayTaskError as exc:
                cause = exc.cause
                if isinstance(cause, EngineUnavailableError):
                    reason = f"engine unavailable: {cause}"
                elif isinstance(cause, EngineError):
                    raise cause from None
                else:
                    raise
            finally:
                self._router.release(index)
                for request_id in request_ids:
                    slot.inflight.pop(request_id, None)
            # The engine is gone: record it (once), restart it, and re-issue this request.
            for request_id in request_ids:
                slot.inflight[request_id] = None  # so the death event lists it
            self._engine_died(slot, generation, reason)
            for request_id in request_ids:
                slot.inflight.pop(request_id, None)
            self.reissued.extend(request_ids)

    # ------------------------------------------------------------------ LoRA adapters
    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Load a PEFT adapter into every serving engine (and every future replacement)."""
        self.adapters[name] = path
        await self._on_serving_engines("load_lora_adapter", name, path)

    async def unload_lora_adapter(self, name: str) -> None:
        self.adapters.pop(name, None)
        await self._on_serving_engines("unload_lora_adapter", name)

    async def _on_serving_engines(self, method: str, *args: Any) -> None:
        from ray.exceptions import RayActorError, RayTaskError

        serving = [s for s in self._slots if s.start_ref is None and self._router.is_alive(s.index)]

        async def one(slot: _Slot) -> None:
            generation = slot.generation
            try:
                await getattr(slot.handle, method).remote(*args)
            except RayActorError as exc:  # its replacement loads every adapter before serving
                self._engine_died(slot, generation, f"actor died: {type(exc).__name__}")
            except RayTaskError as exc:
                if isinstance(exc.cause, EngineUnavailableError):
                    self._engine_died(slot, generation, f"engine unavailable: {exc.cause}")
                elif isinstance(exc.cause, EngineError):
                    raise exc.cause from None
                else:
                    raise

        await asyncio.gather(*(one(slot) for slot in serving))

    # ------------------------------------------------------------------ Dispatcher API
    async def generate(self, request: GenerateRequest) -> GenerateResult:
        return await self._call("generate", request, (request.request_id,))

    async def generate_batch(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        """One batch on one engine; re-issued whole (same request ids) if that engine dies."""
        return await self._call(
            "generate_batch", list(requests), tuple(r.request_id for r in requests)
        )

    async def chat(self, request: ChatRequest) -> ChatResult:
        return await self._call("chat", request, (request.request_id,))

    async def tokenize(self, text: str) -> list[int]:
        return await self._call("tokenize", text)

    async def abort(self, request_id: str) -> None:
        for slot in self._slots:
            if request_id in slot.inflight and slot.handle is not None:
                await slot.handle.abort.remote(request_id)

    # ------------------------------------------------------------------ batch API
    async def agenerate_groups(
        self,
        prompts: Sequence[PromptRecord],
        config: RolloutConfig,
        *,
        reward: RewardFn | None = None,
        batch_id: str | None = None,
        on_sample: Callable[[Sample], None] | None = None,
    ) -> RolloutBatch:
        """Generate ``config.n_samples`` per prompt; returns groups (see :func:`run_rollout`)."""
        deaths_before = sum(1 for e in self.events if e.kind == "died")
        reissued_before = len(self.reissued)
        batch = await run_rollout(
            prompts, self, config, reward=reward, batch_id=batch_id, on_sample=on_sample
        )
        batch.metrics.engine_deaths = (
            sum(1 for e in self.events if e.kind == "died") - deaths_before
        )
        batch.metrics.reissued_requests = len(self.reissued) - reissued_before
        return batch

    def generate_groups(
        self,
        prompts: Sequence[PromptRecord],
        config: RolloutConfig,
        *,
        reward: RewardFn | None = None,
        batch_id: str | None = None,
        on_sample: Callable[[Sample], None] | None = None,
    ) -> RolloutBatch:
        """Synchronous :meth:`agenerate_groups` (runs its own event loop)."""
        return asyncio.run(
            self.agenerate_groups(
                prompts, config, reward=reward, batch_id=batch_id, on_sample=on_sample
            )
        )
