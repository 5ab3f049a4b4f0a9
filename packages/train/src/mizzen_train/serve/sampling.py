"""Sampling: published adapters on the embedded engine, sampling sessions, ``asample``.

``save_weights_for_sampler`` exports a slot as a PEFT adapter (complete on disk before its
rename, see :mod:`.state`); the engine loads it under a name derived from its Tinker path, and a
sampling session names the adapter (or the base model) it samples from.

Invariants:
- The engine only ever loads a complete adapter directory (loading happens after the rename), and
  a published name is never rewritten, so a sample never sees a half-written adapter.
- A session belongs to the tenant that created it; its adapter is one of that tenant's
  checkpoints (checked through :meth:`ServerState.owned_checkpoint`).
- Adapters are loaded lazily after a restart: a session on a saved sampler checkpoint loads it.
- Sampling sessions are bounded: they end with the session they were opened in, and a key
  holds at most ``server.max_sampling_sessions_per_key`` (one more ends its least recently
  used).  Unnamed sampler weights (``save_weights_and_get_sampling_client``) are deleted from
  disk once no live sampling session samples them, so they are bounded too; named ones stay
  (the engine keeps every adapter it loaded in memory until the server stops).
- A sample request is checked whole (:meth:`Sampling.prepare`: counts against the limits, token
  ids inside the vocabulary, prompt plus ``max_tokens`` inside the context, sampling values
  through :class:`~mizzen_rollout.api.SamplingParams`' ranges) before it is queued: the engine
  is never the one that finds a client's mistake.
- ``train`` imports only :mod:`mizzen_rollout.api` (the engine, its client and request types).
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from mizzen_train.serve.state import ServerState
from mizzen_train.serve.wire import WireError, check_token_ids, encode_sample_response

__all__ = ["Sampling"]


@dataclass(frozen=True)
class SamplingSession:
    tenant: str
    parent: str  # the session (ServiceClient) it was opened in: it ends with that one
    base_model: str
    model_path: str | None
    adapter: str | None


def _discard(directories: list[Path]) -> None:
    """Remove each directory: renamed aside first (the path is gone at once, whole), then
    deleted."""
    for directory in directories:
        aside = directory.with_name(f".discarded-{directory.name}-{uuid.uuid4().hex[:8]}")
        try:
            directory.rename(aside)
        except FileNotFoundError:
            continue
        shutil.rmtree(aside, ignore_errors=True)


class Sampling:
    def __init__(self, config, state: ServerState) -> None:
        self.config = config
        self.state = state
        self.sessions: dict[str, SamplingSession] = {}
        #: each key's live sampling session ids, least recently used first
        self.recency: dict[str, OrderedDict[str, None]] = {}
        #: the live sessions (ServiceClients) a sampling session may be opened in
        self.parents: set[str] = set()
        #: Tinker path -> directory of the unnamed sampler weights a session samples
        self.unnamed: dict[str, Path] = {}
        self.loaded: set[str] = set()
        self._loading: dict[str, threading.Lock] = {}  # adapter -> the lock of its load
        self._lock = threading.Lock()
        self.engine = None
        self.client = None
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def enabled(self) -> bool:
        return self.config.sampling.engine == "embedded"

    def start(self, model_dir: Path, device: str) -> None:
        """Launch the embedded engine (blocking; call before serving)."""
        if not self.enabled:
            return
        from mizzen_rollout.api import launch_embedded

        self.engine = launch_embedded(
            model_path=str(model_dir), device=device,
            load_dirs=(str(model_dir), str(self.state.checkpoints)),
        )  # fmt: skip

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        from mizzen_rollout.api import SGLangClient

        self.loop = loop
        if self.engine is not None:
            self.client = SGLangClient(self.engine.url, timeout_s=300.0)

    def stop(self) -> None:
        """Stop the engine; every sampling session ends with the server, so the unnamed sampler
        weights they sampled go too."""
        if self.engine is not None:
            self.engine.stop()
        with self._lock:
            unused, self.unnamed = list(self.unnamed.values()), {}
        _discard(unused)

    # -- sessions -------------------------------------------------------------------------------

    def create_session(
        self, tenant: str, model_path: str | None, base_model: str | None, parent: str
    ) -> str:
        """A sampling session of ``tenant`` in session ``parent``; when the key already holds
        ``server.max_sampling_sessions_per_key``, its least recently used one ends."""
        if not self.enabled:
            raise WireError(501, "sampling is off on this server (sampling.engine = 'none')")
        adapter = None
        if model_path is not None:
            _model_id, directory = self.state.owned_checkpoint(
                tenant, model_path, "sampler_weights"
            )
            adapter = self._adapter_name(model_path)
            self._load_threadsafe(adapter, directory)
        elif base_model != self.config.base_model_name:
            raise WireError(
                400, f"base_model {str(base_model)[:80]!r} is not served. Fix: use "
                f"{self.config.base_model_name!r}",
            )  # fmt: skip
        session_id = f"samp-{uuid.uuid4().hex}"
        with self._lock:
            if parent not in self.parents:  # it ended while the adapter loaded, or before
                raise WireError(
                    404, "session_id: the session ended before the sampling session opened in "
                    "it. Fix: open sampling clients from a live ServiceClient",
                )  # fmt: skip
            recent = self.recency.setdefault(tenant, OrderedDict())
            evicted = []
            while len(recent) >= self.config.server.max_sampling_sessions_per_key:
                oldest, _ = recent.popitem(last=False)
                evicted.append(self.sessions.pop(oldest))
            self.sessions[session_id] = SamplingSession(
                tenant, parent, self.config.base_model_name, model_path, adapter
            )
            recent[session_id] = None
            unused = self._unused_unnamed(evicted)
        _discard(unused)
        return session_id

    def session_of(self, tenant: str, session_id: object) -> SamplingSession | None:
        """``tenant``'s live sampling session ``session_id`` (now its most recently used), or
        ``None``."""
        with self._lock:
            session = self.sessions.get(session_id) if isinstance(session_id, str) else None
            if session is None or session.tenant != tenant:
                return None
            self.recency[tenant].move_to_end(session_id)
            return session

    def open_parent(self, parent: str) -> None:
        """Session ``parent`` is live: sampling sessions may be opened in it."""
        with self._lock:
            self.parents.add(parent)

    def end_sessions_of(self, parent: str) -> int:
        """Session ``parent`` ended: end every sampling session opened in it, and open no more
        in it; how many ended."""
        with self._lock:
            self.parents.discard(parent)
            ended = [sid for sid, s in self.sessions.items() if s.parent == parent]
            sessions = []
            for session_id in ended:
                session = self.sessions.pop(session_id)
                sessions.append(session)
                recent = self.recency[session.tenant]
                recent.pop(session_id, None)
                if not recent:
                    del self.recency[session.tenant]
            unused = self._unused_unnamed(sessions)
        _discard(unused)
        return len(ended)

    def _unused_unnamed(self, ended: list[SamplingSession]) -> list[Path]:
        """The directories of unnamed sampler weights no live session samples any more, now
        forgotten (call under ``_lock``, after ``ended`` left ``sessions``)."""
        paths = {s.model_path for s in ended if s.model_path in self.unnamed}
        paths -= {s.model_path for s in self.sessions.values()}
        return [self.unnamed.pop(path) for path in sorted(paths)]

    def publish(self, tenant: str, model_path: str, directory: Path, parent: str) -> str:
        """Load just-saved unnamed sampler weights (``save_weights_and_get_sampling_client``)
        and open a session on them in session ``parent`` (from any thread).  They live as long
        as a session samples them: discarded when none does any more (also at once, when
        ``parent`` has ended)."""
        with self._lock:
            self.unnamed[model_path] = directory
        try:
            return self.create_session(tenant, model_path, None, parent)
        except BaseException:
            with self._lock:
                self.unnamed.pop(model_path, None)  # stop() may have taken it already
            _discard([directory])
            raise

    @staticmethod
    def _adapter_name(model_path: str) -> str:
        return "lora-" + hashlib.sha256(model_path.encode()).hexdigest()[:20]

    def _load_threadsafe(self, adapter: str, directory: Path) -> None:
        """Load ``adapter`` on the engine once, however many threads ask at the same time
        (each adapter's load under its own lock; the engine refuses a second load)."""
        with self._lock:
            loading = self._loading.setdefault(adapter, threading.Lock())
        with loading:
            self._load_once(adapter, directory)

    def _load_once(self, adapter: str, directory: Path) -> None:
        if adapter in self.loaded:
            return
        assert self.loop is not None and self.client is not None
        coroutine = self.client.load_lora_adapter(adapter, str(directory))
        try:
            asyncio.get_running_loop()
            running = True
        except RuntimeError:
            running = False
        if running:
            raise RuntimeError("_load_threadsafe called on the event loop")
        asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=300)
        self.loaded.add(adapter)

    # -- sampling -------------------------------------------------------------------------------

    def prepare(self, session: SamplingSession, request, *, vocab_size: int, max_seq_len: int):
        """The engine requests of the SDK ``SampleRequest``: every field checked here, before
        anything is queued (a 400 naming the field otherwise)."""
        from mizzen_rollout.api import GenerateRequest, SamplingParams

        limits = self.config.sampling
        params = request.sampling_params
        unserved = [name for name in ("prompt_logprobs", "topk_prompt_logprobs",
                                      "topk_sample_logprobs", "prompt_alt_tokens_k",
                                      "target_prompt_logprobs") if getattr(request, name)]  # fmt: skip
        if unserved:
            raise WireError(400, f"{unserved[0]}: not served by this server. Fix: leave it unset")
        if not 1 <= request.num_samples <= limits.max_samples:
            raise WireError(
                400, f"num_samples: {request.num_samples}; served 1..{limits.max_samples}"
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else 64
        if not 1 <= max_tokens <= limits.max_new_tokens:
            raise WireError(400, f"sampling_params.max_tokens: served 1..{limits.max_new_tokens}")
        try:
            prompt = request.prompt.to_ints()
        except ValueError:
            raise WireError(400, "prompt: only token chunks are served. Fix: send "
                                 "ModelInput.from_ints(tokens)") from None  # fmt: skip
        if not prompt:
            raise WireError(400, "prompt: empty. Fix: send at least one token")
        if len(prompt) + max_tokens > max_seq_len:
            raise WireError(400, f"prompt: {len(prompt)} tokens + max_tokens {max_tokens} exceed "
                                 f"the model's context of {max_seq_len}. Fix: shorten the "
                                 "prompt or lower max_tokens")  # fmt: skip
        stop = params.stop
        stop_strings = (stop,) if isinstance(stop, str) else tuple(
            s for s in (stop or ()) if isinstance(s, str))  # fmt: skip
        stop_ids = () if isinstance(stop, str) else tuple(
            s for s in (stop or ()) if isinstance(s, int))  # fmt: skip
        for field, ids in (("prompt", prompt), ("sampling_params.stop", stop_ids)):
            check_token_ids(field, ids, vocab_size)
        try:
            return [
                GenerateRequest(
                    request_id=f"{uuid.uuid4().hex}",
                    input_ids=tuple(prompt),
                    sampling=SamplingParams(
                        max_new_tokens=max_tokens,
                        temperature=params.temperature,
                        top_p=params.top_p,
                        top_k=params.top_k,
                        seed=None if params.seed is None else params.seed + index,
                        stop=stop_strings,
                        stop_token_ids=stop_ids,
                    ),
                    return_logprob=True,
                    lora_path=session.adapter,
                )
                for index in range(request.num_samples)
            ]
        except (ValueError, TypeError) as exc:
            raise WireError(400, f"sampling_params: {exc}") from None

    async def sample(self, requests) -> bytes:
        """The engine's answers to ``requests`` (from :meth:`prepare`), as the SDK's protobuf."""
        results = await self.client.generate_batch(requests)
        sequences = []
        for result in results:
            kind = result.finish.kind
            if kind == "abort":
                raise RuntimeError(f"the engine aborted a sample: {result.finish.message}")
            sequences.append((
                "length" if kind == "length" else "stop", list(result.output_ids),
                list(result.output_logprobs or [0.0] * len(result.output_ids)),
            ))  # fmt: skip
        return encode_sample_response(sequences)
