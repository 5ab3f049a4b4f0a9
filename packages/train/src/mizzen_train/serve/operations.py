"""Operations and their futures: per-model submission order, idempotent retries, admission.

Every training call of the SDK is an *operation*: the POST answers at once with a request id
(``UntypedAPIFuture``) and the client polls ``/retrieve_future`` for the outcome.

Invariants:
- Operations of one model run in submission order (one FIFO queue per model; the scheduler only
  ever takes a queue's head).
- A retried request returns the original future: the SDK numbers every request of a training
  client (``seq_id``), so ``(model_id, kind, seq_id)`` identifies it; requests without one use
  the ``X-Idempotency-Key`` header, also per kind (a key reused for another kind of request is
  another request); a request with neither is always a new one.  A retry is the same request:
  the book keeps a digest of the request's body with its key, and the same key with another
  body is refused (:class:`KeyReused`, 409) -- never answered with another request's result.
  A retry of a finished request returns its stored outcome.
- A model whose ``unload_model`` is queued is *closing*: any other operation on it is refused
  (:class:`Closing`, 404) until the unload has run, and then the model is gone; a second unload
  returns the first one's future.
- Admission control: a model whose queue holds ``max_queue`` pending operations gets
  :class:`Overloaded` (HTTP 429 with ``Retry-After``); nothing is queued.
- An operation that fails for a reason that is not the client's gets :func:`internal_error`: an
  incident id, the exception logged under it; the exception's text (a server path, an engine's
  URL) never reaches the client.
- A future is visible only to the tenant that submitted it; finished futures are kept for the
  last ``keep`` operations and within ``keep_bytes`` of results, then forgotten in the order
  they finished (the earliest finished first; an unfinished operation is never forgotten, and
  the one that finished last is kept even alone beyond ``keep_bytes``: a client can always read
  the result it waited for).  Every operation's result is counted when it finishes, queued or
  not (a sample's too).
  An operation's payload (its rows) is dropped once it has run: a finished future holds only
  its outcome.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from mizzen_train.serve.wire import WireError

__all__ = ["Closing", "KeyReused", "Operation", "OperationBook", "Overloaded", "internal_error"]

log = logging.getLogger("mizzen_train.serve")


def internal_error(what: str) -> str:
    """Log the exception being handled under a new incident id; the message for the client (the
    id only: the exception's text may name server paths or internal URLs)."""
    incident = uuid.uuid4().hex[:12]
    log.exception("%s failed (incident %s)", what, incident)
    return (f"internal error (incident {incident}, logged on the server). Fix: retry; if it "
            "persists, give the incident id to the server's operator")  # fmt: skip


class Overloaded(WireError):
    """The model's queue is full: 429 with a Retry-After in seconds."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(429, message)
        self.retry_after_s = retry_after_s


class Closing(WireError):
    """The model's unload is queued: nothing else is accepted for it (404)."""

    def __init__(self, model_id: str) -> None:
        super().__init__(
            404, f"model_id {model_id[:80]!r}: being unloaded (an unload_model is queued). Fix: "
            "create_model, or load a saved checkpoint into a new one",
        )  # fmt: skip


class KeyReused(WireError):
    """A request's idempotency key (``seq_id`` or ``X-Idempotency-Key``) names an earlier
    request with another body (409)."""

    def __init__(self, key: tuple) -> None:
        kind = key[0]
        what = {"seq": f"seq_id {key[-1]}", "create": "model_seq_id"}.get(kind, "X-Idempotency-Key")
        super().__init__(
            409, f"{what}: names an earlier request with another body (a retry must resend the "
            "same request). Fix: number each new request anew (the SDK does)",
        )  # fmt: skip


@dataclass(eq=False)
class Operation:
    request_id: str
    tenant: str
    model_id: str
    kind: str
    payload: Any
    #: digest of the request body (what a retry under the same key must match)
    digest: bytes | None = None
    submitted: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    #: (content type, body) when it succeeded; (message, category) when it failed
    outcome: tuple[str, bytes] | None = None
    failure: tuple[str, str] | None = None
    started: float | None = None
    #: result bytes the book counted when the operation finished
    counted_bytes: int = 0
    #: what the book does when the operation finishes (count its result)
    on_finish: Any = None

    waiters: list = field(default_factory=list)  # (loop, asyncio.Event) of long polls
    lock: threading.Lock = field(default_factory=threading.Lock)

    def succeed(self, content_type: str, body: bytes) -> None:
        self.outcome = (content_type, body)
        self._finish()

    def fail(self, message: str, category: str = "user") -> None:
        self.failure = (message, category)
        self._finish()

    @property
    def result_bytes(self) -> int:
        """What the finished operation keeps for ``retrieve_future``, in bytes."""
        if self.outcome is not None:
            return len(self.outcome[1])
        return len(self.failure[0]) if self.failure is not None else 0

    def _finish(self) -> None:
        with self.lock:
            self.done.set()
            waiters, self.waiters = self.waiters, []
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)
        if self.on_finish is not None:
            self.on_finish(self)

    async def wait(self, timeout_s: float) -> bool:
        """Wait (without polling) until the operation is done or ``timeout_s`` passed."""
        import asyncio

        event = asyncio.Event()
        with self.lock:
            if self.done.is_set():
                return True
            self.waiters.append((asyncio.get_running_loop(), event))
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except TimeoutError:
            with self.lock:
                self.waiters = [w for w in self.waiters if w[1] is not event]
        return self.done.is_set()


class OperationBook:
    """The futures of every tenant and the per-model queues (thread-safe)."""

    def __init__(
        self, *, max_queue: int, keep: int = 10_000, keep_bytes: int = 256 * 1024 * 1024
    ) -> None:
        self.max_queue = max_queue
        self.keep = keep
        self.keep_bytes = keep_bytes
        self.cond = threading.Condition()
        self.queues: dict[str, deque[Operation]] = {}
        self._futures: OrderedDict[str, Operation] = OrderedDict()
        #: the finished ones, in the order they finished (what is forgotten first)
        self._finished: OrderedDict[str, Operation] = OrderedDict()
        self._by_key: dict[tuple[str, str, object], str] = {}
        #: model id -> its queued unload (until that has run)
        self._closing: dict[str, Operation] = {}
        self._kept_bytes = 0  # result bytes of the finished operations (counted on finish)

    def submit(
        self,
        tenant: str,
        model_id: str,
        kind: str,
        payload: Any,
        *,
        key: object = None,
        digest: bytes | None = None,
        queued: bool = True,
    ) -> tuple[Operation, bool]:
        """``(operation, fresh)``: the original one on a retry (``fresh`` False).  Raises
        :class:`KeyReused` for a known ``key`` whose request had another ``digest``,
        :class:`Closing` for a model whose unload is queued (a second unload gets the first),
        :class:`Overloaded` for a full queue."""
        with self.cond:
            if key is not None:
                known = self.find(tenant, model_id, key, digest)
                if known is not None:
                    return known, False
            closing = self._closing.get(model_id)
            if closing is not None:
                if kind == "unload_model":
                    return closing, False
                raise Closing(model_id)
            queue = self.queues.setdefault(model_id, deque()) if queued else deque()
            if queued and len(queue) >= self.max_queue:
                raise Overloaded(
                    f"model {model_id}: {len(queue)} operations pending (the limit). Fix: wait "
                    "for results before submitting more", retry_after_s=1,
                )  # fmt: skip
            op = Operation(f"op-{uuid.uuid4().hex}", tenant, model_id, kind, payload, digest)
            op.on_finish = self._count_result
            self._futures[op.request_id] = op
            if key is not None:
                self._by_key[(tenant, model_id, key)] = op.request_id
            if queued:
                queue.append(op)
                if kind == "unload_model":
                    self._closing[model_id] = op
                self.cond.notify_all()
            self._forget_old()
            return op, True

    def closing(self, model_id: str) -> bool:
        """Whether ``model_id``'s unload is queued and has not run yet."""
        with self.cond:
            return model_id in self._closing

    def _forget_old(self) -> None:
        """Forget the earliest-finished futures until within ``keep`` and ``keep_bytes``, never
        the last one to finish (call under ``cond``)."""
        while len(self._finished) > 1 and (
            len(self._futures) > self.keep or self._kept_bytes > self.keep_bytes
        ):
            request_id, op = self._finished.popitem(last=False)
            del self._futures[request_id]
            self._kept_bytes -= op.counted_bytes
        if len(self._by_key) > 2 * self.keep:
            self._by_key = {k: v for k, v in self._by_key.items() if v in self._futures}

    def find(
        self, tenant: str, model_id: str, key: object, digest: bytes | None = None
    ) -> Operation | None:
        """The operation submitted before under ``key``, if it is still known; raises
        :class:`KeyReused` when its request's digest differs from ``digest``."""
        with self.cond:
            known = self._by_key.get((tenant, model_id, key))
            op = self._futures.get(known) if known is not None else None
            if op is not None and op.digest != digest:
                raise KeyReused(key)
            return op

    def _count_result(self, op: Operation) -> None:
        """Count a finished operation's result against ``keep_bytes`` (once)."""
        with self.cond:
            if op.request_id in self._finished or op.request_id not in self._futures:
                return
            self._finished[op.request_id] = op
            op.counted_bytes = op.result_bytes
            self._kept_bytes += op.counted_bytes
            self._forget_old()

    def future(self, tenant: str, request_id: object) -> Operation | None:
        op = self._futures.get(request_id) if isinstance(request_id, str) else None
        return op if op is not None and op.tenant == tenant else None

    def depth(self, model_id: str) -> int:
        queue = self.queues.get(model_id)
        return len(queue) if queue else 0

    def heads(self) -> list[Operation]:
        """The head of every non-empty queue, oldest submission first (call under ``cond``)."""
        return sorted((q[0] for q in self.queues.values() if q), key=lambda op: op.submitted)

    def pop(self, ops: list[Operation]) -> None:
        """Take the run ``ops`` off their queues: their payloads are dropped (a finished future
        keeps only its outcome)."""
        with self.cond:
            for op in ops:
                queue = self.queues[op.model_id]
                assert queue[0] is op
                queue.popleft()
                if not queue:
                    del self.queues[op.model_id]
                if self._closing.get(op.model_id) is op:
                    del self._closing[op.model_id]
                op.payload = None
            self._forget_old()
            self.cond.notify_all()
