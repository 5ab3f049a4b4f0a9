"""The HTTP routes of ``mizzen-train serve`` (Starlette on uvicorn, like the embedded engine).

One table, :data:`ROUTES` (method, path, handler, whether it needs an API key), is the whole
surface; anything else answers 404 naming the method and path and listing what is served.

Invariants:
- Every route but ``/api/v1/healthz`` and ``/metrics`` needs a key from the key file in
  ``X-API-Key``; a key sees only its tenant's sessions, models, futures, checkpoints and samplers
  (another tenant's id answers 404, as an unknown one does).
- A request error is a 4xx JSON ``{"detail": ...}`` naming the field, the rule and the fix; a body
  beyond ``server.max_body_bytes`` is refused (413) before it is read whole; an unexpected
  exception is logged and answered 500 without internals -- the server keeps serving.
- Training calls are queued operations (see :mod:`.operations`) answered with the SDK's
  ``UntypedAPIFuture``; ``/retrieve_future`` long-polls up to ``server.long_poll_s`` and then
  answers ``try_again``.
- One log line per operation (tenant, model, request id, outcome); never a key or a body.
- A session lives from ``create_session`` until the SDK finishes it
  (``/api/v1/sessions/{id}/finish``, what ``ServiceClient.close`` sends) or until no heartbeat or
  request names it for ``server.session_timeout_s``; then its live models are unloaded (their
  slots freed, queued operations first), the sampling sessions opened in it end, and the id
  answers 404 like an unknown one.  Saved checkpoints (named sampler weights too: a new
  sampling client loads them) outlive it; unnamed sampler weights go with the last sampling
  session that samples them (:mod:`.sampling`).
- What one key holds is bounded: ``server.max_sessions_per_key`` live sessions (one more is
  422), ``server.max_models_per_key`` models (likewise), ``server.max_sampling_sessions_per_key``
  sampling sessions (one more ends the key's least recently used).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from mizzen_train.serve.operations import Closing, Overloaded, internal_error
from mizzen_train.serve.state import ModelRecord, check_name, model_id_of, session_of_model
from mizzen_train.serve.wire import PROTOBUF, WireError, decode_forward_backward, parse_json
from mizzen_train.specs import MAX_LORA_SEED

__all__ = ["build_app", "sweep_sessions"]

#: threads that decode forward_backward bodies (each holds at most server.max_body_bytes)
DECODE_THREADS = 4
log = logging.getLogger("mizzen_train.serve")


class Service:
    """What the handlers share: config, keys, state, operations, scheduler, sampling, metrics."""

    def __init__(self, config, keys, state, book, scheduler, sampling, metrics) -> None:
        self.config = config
        self.keys = keys
        self.state = state
        self.book = book
        self.scheduler = scheduler
        self.sampling = sampling
        self.metrics = metrics
        self.sessions: dict[str, SessionRecord] = {}
        #: decoding request bodies, apart from the default pool (where threads may wait minutes
        #: on the engine's adapter loads): one tenant's loads never hold another's decoding
        self.decode_pool = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="serve-decode")


@dataclass
class SessionRecord:
    """A live session: its tenant, and when a heartbeat or a request last named it."""

    tenant: str
    last_seen: float  # time.monotonic()


def _session(service: Service, tenant: str, session_id: Any) -> SessionRecord:
    """The live session ``session_id`` of ``tenant``, marked as seen now; 404 otherwise."""
    record = service.sessions.get(session_id) if isinstance(session_id, str) else None
    if record is None or record.tenant != tenant:
        raise WireError(404, "session_id: no live session of this key (ended, or expired after "
                             "server.session_timeout_s without a heartbeat). Fix: create_session")  # fmt: skip
    record.last_seen = time.monotonic()
    return record


def end_session(service: Service, session_id: str, why: str) -> int:
    """End ``session_id``: forget it and queue an unload of each of its live models (after
    whatever they have queued); the number of models unloaded."""
    record = service.sessions.pop(session_id, None)
    if record is None:
        return 0
    models = [m for m in list(service.scheduler.slot_of) if session_of_model(m) == session_id]
    try:  # a retry resubmits nothing twice: the unload of a model is keyed by the session's end
        for model_id in models:
            service.book.submit(record.tenant, model_id, "unload_model", None, key=("end",))
    except Overloaded:  # a full queue: the session stays, ended again by the next try
        record.last_seen = float("-inf")
        service.sessions[session_id] = record
        raise
    samplers = service.sampling.end_sessions_of(session_id)
    log.info("session %s tenant=%s ended (%s); %d model(s) unloaded, %d sampling session(s) "
             "ended", session_id, record.tenant, why, len(models), samplers)  # fmt: skip
    return len(models)


async def sweep_sessions(service: Service) -> None:
    """End expired sessions while the server runs (a quarter of the timeout apart, at most every
    30 s); returns at once when sessions never expire."""
    timeout = service.config.server.session_timeout_s
    while timeout > 0:
        await asyncio.sleep(min(30.0, max(timeout / 4, 0.05)))
        expire_sessions(service, time.monotonic())


def expire_sessions(service: Service, now: float) -> list[str]:
    """End every session not seen for ``server.session_timeout_s`` (0: none); their ids."""
    timeout = service.config.server.session_timeout_s
    if timeout <= 0:
        return []
    stale = [sid for sid, r in list(service.sessions.items()) if now - r.last_seen > timeout]
    ended = []
    for session_id in stale:
        try:
            end_session(service, session_id, "expired")
            ended.append(session_id)
        except Overloaded:
            log.info("session %s expired; its models' queues are full: unloaded later", session_id)
    return ended


def _json(payload: Any, status: int = 200, headers: dict | None = None):
    from starlette.responses import Response

    return Response(json.dumps(payload), status, headers=headers, media_type="application/json")


class ClientGone(Exception):
    """The client closed the connection before its body arrived: nobody to answer."""


async def _body(request, service: Service) -> bytes:
    """The request body: at most ``server.max_body_bytes`` (413), whole within
    ``server.body_timeout_s`` (408); a client that hangs up mid-body raises :class:`ClientGone`."""
    from starlette.requests import ClientDisconnect

    server = service.config.server
    limit = server.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise WireError(413, f"body: larger than {limit} bytes. Fix: send fewer datums a call")

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise WireError(
                    413, f"body: larger than {limit} bytes. Fix: send fewer datums a call"
                )
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), server.body_timeout_s)
    except TimeoutError:
        raise WireError(408, f"body: not received whole within {server.body_timeout_s:g} s "
                             "(server.body_timeout_s). Fix: send the body at once") from None  # fmt: skip
    except ClientDisconnect:
        raise ClientGone() from None


def _future(op) -> Any:
    return _json({"request_id": op.request_id, "model_id": op.model_id})


def _owned_model(service: Service, tenant: str, model_id: Any, *, unload: bool = False) -> int:
    """The slot of ``tenant``'s live model ``model_id``; 404 for anything else, and for a model
    whose unload is queued unless this is an ``unload`` (which gets the queued one's future)."""
    if (
        service.state.model_of(tenant, model_id) is None
        or model_id not in service.scheduler.slot_of
    ):
        raise WireError(
            404, f"model_id {str(model_id)[:80]!r}: no live model of this key. Fix: create_model, "
            "or load a saved checkpoint into a new one (live weights end with a server restart)",
        )  # fmt: skip
    if not unload and service.book.closing(model_id):
        raise Closing(model_id)
    # a request on a model is a request of its session: it keeps the session alive
    session = service.sessions.get(session_of_model(model_id))
    if session is not None and session.tenant == tenant:
        session.last_seen = time.monotonic()
    return service.scheduler.slot_of[model_id]


#: the largest ``seq_id`` / ``model_seq_id`` a request may carry (the SDK's are int64)
MAX_SEQ_ID = 2**63 - 1
MAX_IDEMPOTENCY_KEY_CHARS = 256


def _sequence_number(value: Any, field: str) -> int:
    """``value`` as a client's sequence number (``seq_id``, ``model_seq_id``): an int in
    ``[0, MAX_SEQ_ID]``; 400 naming ``field`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEQ_ID:
        raise WireError(400, f"{field}: {str(value)[:40]}; must be an integer in "
                             f"[0, {MAX_SEQ_ID}]. Fix: let the SDK number them")  # fmt: skip
    return value


def _idempotency_key(kind: str, seq_id: Any, request) -> tuple | None:
    """The key a retry of this request is recognised by: its ``seq_id`` (an int in
    ``[0, MAX_SEQ_ID]``), else its ``X-Idempotency-Key`` header, else None (a new request)."""
    if seq_id is not None:
        return ("seq", kind, _sequence_number(seq_id, "seq_id"))
    header = request.headers.get("x-idempotency-key")
    if header is None:
        return None
    if not 1 <= len(header) <= MAX_IDEMPOTENCY_KEY_CHARS:
        raise WireError(400, f"X-Idempotency-Key: 1..{MAX_IDEMPOTENCY_KEY_CHARS} characters")
    return ("header", kind, header)


def _digest(body: bytes) -> bytes:
    import hashlib

    return hashlib.sha256(body).digest()


def _submit(service, tenant, model_id, kind, payload, seq_id, request, body: bytes):
    """Queue ``kind`` on ``model_id`` (a retry under the same key gets the original future)."""
    key = _idempotency_key(kind, seq_id, request)
    op, fresh = service.book.submit(tenant, model_id, kind, payload, key=key, digest=_digest(body))
    if not fresh:
        log.info("op %s %s tenant=%s model=%s retried", kind, op.request_id, tenant, model_id)
    return _future(op)


# -- handlers: service ------------------------------------------------------------------------


async def healthz(service, tenant, request):
    return _json({"status": "ok"})


async def client_config(service, tenant, request):
    from tinker import types

    server = service.config.server
    config = types.ClientConfigResponse(
        pjwt_auth_enabled=False, use_pyqwest_transport=False, parallel_fwdbwd_chunks=False,
        proto_compress_fwdbwd=False, fwdbwd_max_chunk_len=server.max_datums,
        fwdbwd_max_chunk_bytes_count=server.max_body_bytes // 2,
        sample_use_retrieve_futures=False, custom_loss_server_side=False,
        sample_join_sampling_session=False,
    )  # fmt: skip
    return _json(config.model_dump(mode="json"))


async def dynamic_config(service, tenant, request):
    from tinker import types

    return _json(types.ClientDynamicConfigResponse().model_dump(mode="json"))


async def capabilities(service, tenant, request):
    model = {"model_name": service.config.base_model_name, "trainable": True,
             "sampleable": service.sampling.enabled}  # fmt: skip
    return _json({"supported_models": [model]})


async def create_session(service, tenant, request):
    from tinker import types

    parse_json(types.CreateSessionRequest, await _body(request, service), "create_session")
    server = service.config.server
    if sum(record.tenant == tenant for record in service.sessions.values()) >= (
        server.max_sessions_per_key
    ):
        wait = (
            f", or wait until one without a heartbeat expires ({server.session_timeout_s:g} s)"
            if server.session_timeout_s > 0
            else " (sessions never expire on this server: server.session_timeout_s = 0)"
        )
        raise WireError(
            422, f"this key holds {server.max_sessions_per_key} live sessions "
            "(server.max_sessions_per_key). Fix: close a ServiceClient you no longer use "
            f"(ServiceClient.close){wait}",
        )  # fmt: skip
    session_id = f"sess-{uuid.uuid4().hex}"
    service.sessions[session_id] = SessionRecord(tenant, time.monotonic())
    service.sampling.open_parent(session_id)
    log.info("session %s tenant=%s", session_id, tenant)
    return _json({"type": "create_session", "session_id": session_id})


async def session_heartbeat(service, tenant, request):
    from tinker import types

    body = parse_json(types.SessionHeartbeatRequest, await _body(request, service), "heartbeat")
    _session(service, tenant, body.session_id)
    return _json({"type": "session_heartbeat"})


async def finish_session(service, tenant, request):
    """``ServiceClient.close``: the session ends, its live models are unloaded."""
    await _body(request, service)  # the finish reason: logged as "finished", otherwise unused
    session_id = request.path_params["session_id"]
    _session(service, tenant, session_id)
    end_session(service, session_id, "finished")
    return _json(None)


async def telemetry(service, tenant, request):
    await _body(request, service)  # accepted and dropped: the SDK reports its own events
    return _json({"status": "accepted"})


# -- handlers: models -------------------------------------------------------------------------


async def create_model(service, tenant, request):
    from tinker import types

    raw = await _body(request, service)
    body = parse_json(types.CreateModelRequest, raw, "create_model")
    config = service.config
    if body.base_model != config.base_model_name:
        raise WireError(400, f"base_model {body.base_model[:80]!r} is not served; served: "
                             f"[{config.base_model_name!r}]")  # fmt: skip
    lora = body.lora_config or types.LoraConfig(rank=8)
    if not 1 <= lora.rank <= config.model.max_rank:
        raise WireError(400, f"lora_config.rank: {lora.rank}; served 1..{config.model.max_rank}")
    if lora.seed is not None and not 0 <= lora.seed <= MAX_LORA_SEED:
        raise WireError(400, f"lora_config.seed: {lora.seed}; must be in [0, {MAX_LORA_SEED}]. "
                             "Fix: pass a 32-bit seed")  # fmt: skip
    if not (lora.train_mlp and lora.train_attn):
        raise WireError(400, "lora_config: train_mlp and train_attn must stay true (the slots "
                             "adapt every attention and MLP linear)")  # fmt: skip
    if body.optimizer_config.type != "adamw":
        raise WireError(400, "optimizer_config: only adamw is served")
    return _new_model(
        service, tenant, body.session_id, body.model_seq_id, lora.rank, lora.seed or 0,
        "create_model", raw,
    )  # fmt: skip


def _new_model(service, tenant, session_id, model_seq_id, rank, seed, kind, raw, payload=None):
    """A model of the SDK's id ``<session_id>:train:<model_seq_id>`` (the SDK derives it too),
    its slot reserved now; a retry (the same body) returns the original future."""
    _session(service, tenant, session_id)
    model_id = model_id_of(session_id, _sequence_number(model_seq_id, "model_seq_id"))
    known = service.book.find(tenant, model_id, ("create",), _digest(raw))
    if known is not None:
        if model_id in service.scheduler.slot_of and not service.book.closing(model_id):
            return _future(known)  # a retry of a create of a live (or still queued) model
        raise WireError(409, f"model_seq_id {model_seq_id}: model {model_id[:80]!r} was created "
                             "and has been unloaded. Fix: use a new model_seq_id")  # fmt: skip
    held = service.scheduler.models_of(tenant)  # reserved at submit, created or not yet
    if held >= service.config.server.max_models_per_key:
        raise WireError(422, f"this key holds {held} live models (the limit). Fix: unload one")
    record = ModelRecord(model_id, tenant, service.config.base_model_name, rank, seed, time.time())
    with service.book.cond:
        service.scheduler.reserve_slot(model_id, tenant)
    if kind == "create_model":
        payload = record
    else:
        service.state.add_model(record)
    op, _ = service.book.submit(
        tenant, model_id, kind, payload, key=("create",), digest=_digest(raw)
    )
    log.info("op %s %s tenant=%s model=%s submitted", kind, op.request_id, tenant, model_id)
    return _future(op)


async def unload_model(service, tenant, request):
    from tinker import types

    raw = await _body(request, service)
    body = parse_json(types.UnloadModelRequest, raw, "unload_model")
    _owned_model(service, tenant, body.model_id, unload=True)
    return _submit(service, tenant, body.model_id, "unload_model", None, None, request, raw)


async def get_info(service, tenant, request):
    from tinker import types

    body = parse_json(types.GetInfoRequest, await _body(request, service), "get_info")
    record = service.state.model_of(tenant, body.model_id)
    if record is None:
        raise WireError(404, "model_id: no model of this key")
    return _json({
        "type": "get_info", "model_id": record.model_id, "is_lora": True,
        "lora_rank": record.rank, "model_name": record.base_model,
        "model_data": {"arch": "llama", "model_name": record.base_model,
                       "tokenizer_id": record.base_model},
    })  # fmt: skip


# -- handlers: training -----------------------------------------------------------------------


async def _decoded(service: Service, function, *args, **kwargs):
    """``function(*args, **kwargs)`` on the service's decoding threads."""
    call = functools.partial(function, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(service.decode_pool, call)


async def forward_backward(service, tenant, request):
    from mizzen_train.serve.batching import build_rows

    body = await _body(request, service)
    if PROTOBUF not in request.headers.get("content-type", ""):
        raise WireError(415, f"forward_backward: send {PROTOBUF} (the SDK's encoding)")
    # decoding (zstd, protobuf, the SDK's types) and building the rows of a body of up to
    # server.max_body_bytes take their time: in a thread, so the event loop keeps answering
    parsed, forward_only = await _decoded(
        service, decode_forward_backward, body,
        content_encoding=request.headers.get("content-encoding", ""),
        limit=service.config.server.max_body_bytes,
    )  # fmt: skip
    if parsed.seq_id == 0:  # the protobuf's unset value: the SDK numbers these from 1
        raise WireError(400, "seq_id: 0 (unset); training requests are numbered from 1. Fix: "
                             "pass seq_id >= 1 (the SDK's TrainingClient does)")  # fmt: skip
    fb = parsed.forward_backward_input
    if len(fb.data) > service.config.server.max_datums:
        raise WireError(
            413, f"data: {len(fb.data)} datums; at most {service.config.server.max_datums}"
        )
    slot = _owned_model(service, tenant, parsed.model_id)
    scheduler = service.scheduler
    rows = await _decoded(
        service, build_rows, fb.data, fb.loss_fn, fb.loss_fn_config, slot=slot,
        vocab_size=scheduler.vocab_size, max_seq_len=scheduler.max_seq_len,
        seq_bucket=service.config.model.seq_bucket, forward_only=forward_only,
    )  # fmt: skip
    if len(rows.inputs) > service.config.server.max_batch_rows:
        raise WireError(413, f"data: {len(rows.inputs)} rows; at most "
                             f"{service.config.server.max_batch_rows} a call")  # fmt: skip
    kind = "forward" if forward_only else "forward_backward"
    return _submit(service, tenant, parsed.model_id, kind, rows, parsed.seq_id, request, body)


async def optim_step(service, tenant, request):
    import math

    from tinker import types

    raw = await _body(request, service)
    body = parse_json(types.OptimStepRequest, raw, "optim_step")
    params = body.optim_params
    if not isinstance(params, types.AdamParams):
        raise WireError(400, "optim_params: only Adam parameters are served")
    values = (params.learning_rate, params.beta1, params.beta2, params.eps, params.weight_decay,
              params.grad_clip_norm)  # fmt: skip
    if not all(math.isfinite(v) for v in values) or params.learning_rate < 0:
        raise WireError(400, "adam_params: every value must be finite and learning_rate >= 0")
    if not (0 <= params.beta1 < 1 and 0 <= params.beta2 < 1 and params.eps > 0
            and params.weight_decay >= 0 and params.grad_clip_norm >= 0):  # fmt: skip
        raise WireError(400, "adam_params: need 0 <= beta1, beta2 < 1, eps > 0, weight_decay >= 0 "
                             "and grad_clip_norm >= 0 (0: no clipping). Fix: e.g. "
                             "AdamParams(learning_rate=1e-4)")  # fmt: skip
    _owned_model(service, tenant, body.model_id)
    return _submit(service, tenant, body.model_id, "optim_step", params, body.seq_id, request, raw)


async def save_weights(service, tenant, request):
    from tinker import types

    raw = await _body(request, service)
    body = parse_json(types.SaveWeightsRequest, raw, "save_weights")
    name = None if body.path is None else check_name(body.path, "path")
    _owned_model(service, tenant, body.model_id)
    return _submit(service, tenant, body.model_id, "save_weights", name, body.seq_id, request, raw)


async def save_weights_for_sampler(service, tenant, request):
    from tinker import types

    raw = await _body(request, service)
    body = parse_json(types.SaveWeightsForSamplerRequest, raw, "save_weights_for_sampler")
    name = None if body.path is None else check_name(body.path, "path")
    if not service.sampling.enabled:
        raise WireError(501, "save_weights_for_sampler: sampling is off on this server")
    _owned_model(service, tenant, body.model_id)
    payload = (name, body.path is None)
    return _submit(service, tenant, body.model_id, "save_weights_for_sampler", payload,
                   body.seq_id, request, raw)  # fmt: skip


async def load_weights(service, tenant, request):
    from tinker import types

    raw = await _body(request, service)
    body = parse_json(types.LoadWeightsRequest, raw, "load_weights")
    _, directory = service.state.owned_checkpoint(tenant, body.path, "weights")
    payload = (directory, body.optimizer, body.path)
    if body.model_id is None:  # create-via-load: a new model from the checkpoint
        return _new_model(
            service, tenant, body.session_id, body.model_seq_id, 0, 0, "load_weights", raw,
            payload,
        )  # fmt: skip
    _owned_model(service, tenant, body.model_id)
    return _submit(
        service, tenant, body.model_id, "load_weights", payload, body.seq_id, request, raw
    )


async def retrieve_future(service, tenant, request):
    from tinker import types

    body = parse_json(types.FutureRetrieveRequest, await _body(request, service), "retrieve_future")
    op = service.book.future(tenant, body.request_id)
    if op is None:
        raise WireError(404, "request_id: no future of this key (unknown or expired)")
    if not await op.wait(service.config.server.long_poll_s):
        state = "active" if op.started is not None else "paused_capacity"
        return _json({"type": "try_again", "request_id": op.request_id, "queue_state": state})
    if op.failure is not None:
        return _json({"error": op.failure[0], "category": op.failure[1]})
    from starlette.responses import Response

    content_type, payload = op.outcome
    return Response(payload, 200, media_type=content_type)


# -- handlers: checkpoints and sampling -------------------------------------------------------


async def list_checkpoints(service, tenant, request):
    model_id = request.path_params["model_id"]
    if service.state.model_of(tenant, model_id) is None:
        raise WireError(404, "training run: no model of this key")
    return _json({"checkpoints": service.state.list_checkpoints(model_id)})


async def weights_info(service, tenant, request):
    try:
        path = json.loads(await _body(request, service)).get("tinker_path")
    except (ValueError, AttributeError, RecursionError):
        raise WireError(400, 'weights_info: body must be {"tinker_path": ...}') from None
    kind = "sampler_weights" if "/sampler_weights/" in str(path) else "weights"
    model_id, _ = service.state.owned_checkpoint(tenant, path, kind)
    record = service.state.models[model_id]
    return _json({"base_model": record.base_model, "is_lora": True, "lora_rank": record.rank,
                  "train_unembed": False, "train_mlp": True, "train_attn": True})  # fmt: skip


_NO_SAMPLER = (
    "no live sampling session of this key (it ends with the session it was opened in, or as "
    "the key's least recently used beyond server.max_sampling_sessions_per_key). Fix: create "
    "a sampling client again"
)


async def create_sampling_session(service, tenant, request):
    from tinker import types

    body = parse_json(
        types.CreateSamplingSessionRequest, await _body(request, service), "create_sampling_session"
    )
    _session(service, tenant, body.session_id)
    session_id = await asyncio.to_thread(
        service.sampling.create_session, tenant, body.model_path, body.base_model,
        body.session_id,
    )  # fmt: skip
    return _json({"type": "create_sampling_session", "sampling_session_id": session_id})


async def get_sampler(service, tenant, request):
    session_id = request.path_params["sampler_id"]
    session = service.sampling.session_of(tenant, session_id)
    if session is None:
        raise WireError(404, f"sampler: {_NO_SAMPLER}")
    return _json({"sampler_id": session_id, "base_model": session.base_model,
                  "model_path": session.model_path})  # fmt: skip


async def asample(service, tenant, request):
    """Every field is checked (and the engine's requests built) before anything is queued or
    answered: what the answer holds is sized by checked fields only."""
    from tinker import types

    raw = await _body(request, service)
    body = parse_json(types.SampleRequest, raw, "asample")
    session = service.sampling.session_of(tenant, body.sampling_session_id)
    if session is None:
        raise WireError(404, f"sampling_session_id: {_NO_SAMPLER}")
    scheduler = service.scheduler
    requests = service.sampling.prepare(
        session, body, vocab_size=scheduler.vocab_size, max_seq_len=scheduler.max_seq_len
    )
    op, fresh = service.book.submit(
        tenant, f"sampler:{body.sampling_session_id}", "sample", None,
        key=_idempotency_key("sample", body.seq_id, request), digest=_digest(raw), queued=False,
    )  # fmt: skip
    if fresh:
        asyncio.get_running_loop().create_task(_run_sample(service, op, requests))
    return _json({"request_id": op.request_id, "sample_sequence_ids": [
        f"{op.request_id}-{i}" for i in range(len(requests))]})  # fmt: skip


async def _run_sample(service, op, requests) -> None:
    started = time.monotonic()
    try:
        op.succeed(PROTOBUF, await service.sampling.sample(requests))
    except WireError as exc:
        op.fail(str(exc), "user")
    except Exception:
        op.fail(internal_error(f"sample {op.request_id}"), "server")
    service.metrics.executed([op], time.monotonic() - started)
    log.info(
        "op sample %s tenant=%s %s", op.request_id, op.tenant, "failed" if op.failure else "ok"
    )


async def metrics(service, tenant, request):
    from starlette.responses import PlainTextResponse

    depths: dict[str, int] = {}
    for model_id in list(service.scheduler.slot_of):
        record = service.state.models.get(model_id)
        owner = record.tenant if record else "?"
        depths[owner] = depths.get(owner, 0) + service.book.depth(model_id)
    text = service.metrics.render(
        depths=depths, slots_used=len(service.scheduler.slot_of),
        slots_total=service.config.model.slots,
    )  # fmt: skip
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


#: (method, path, handler, needs a key) -- the whole served surface
ROUTES = (
    ("GET", "/api/v1/healthz", healthz, False),
    ("GET", "/metrics", metrics, False),
    ("POST", "/api/v1/client/config", client_config, True),
    ("POST", "/api/v1/client/dynamic_config", dynamic_config, True),
    ("GET", "/api/v1/get_server_capabilities", capabilities, True),
    ("POST", "/api/v1/create_session", create_session, True),
    ("POST", "/api/v1/session_heartbeat", session_heartbeat, True),
    ("POST", "/api/v1/sessions/{session_id}/finish", finish_session, True),
    ("POST", "/api/v1/telemetry", telemetry, True),
    ("POST", "/api/v1/create_model", create_model, True),
    ("POST", "/api/v1/unload_model", unload_model, True),
    ("POST", "/api/v1/get_info", get_info, True),
    ("POST", "/api/v1/forward_backward", forward_backward, True),
    ("POST", "/api/v1/optim_step", optim_step, True),
    ("POST", "/api/v1/save_weights", save_weights, True),
    ("POST", "/api/v1/load_weights", load_weights, True),
    ("POST", "/api/v1/save_weights_for_sampler", save_weights_for_sampler, True),
    ("POST", "/api/v1/retrieve_future", retrieve_future, True),
    ("GET", "/api/v1/training_runs/{model_id}/checkpoints", list_checkpoints, True),
    ("POST", "/api/v1/weights_info", weights_info, True),
    ("POST", "/api/v1/create_sampling_session", create_sampling_session, True),
    ("GET", "/api/v1/samplers/{sampler_id}", get_sampler, True),
    ("POST", "/api/v1/asample", asample, True),
)


def _endpoint(service: Service, handler, needs_key: bool):
    async def endpoint(request):
        tenant = None
        try:
            if needs_key:
                tenant = service.keys.tenant_of(request.headers.get("x-api-key"))
                if tenant is None:
                    raise WireError(401, "X-API-Key: missing or unknown. Fix: set TINKER_API_KEY "
                                         "to a key of the server's key file")  # fmt: skip
            return await handler(service, tenant, request)
        except ClientGone:  # nobody to answer; not an error of the server
            log.info("%s %s: the client closed the connection mid-body", request.method,
                     request.url.path)  # fmt: skip
            return _json({"detail": "the client closed the connection"}, 400)
        except Overloaded as exc:
            return _json({"detail": str(exc)}, 429, {"Retry-After": str(exc.retry_after_s)})
        except WireError as exc:
            return _json({"detail": str(exc)}, exc.status)
        except Exception:
            message = internal_error(f"{request.method} {request.url.path}")
            return _json({"detail": f"{request.method} {request.url.path}: {message}"}, 500)

    return endpoint


def build_app(service: Service):
    from starlette.applications import Starlette
    from starlette.routing import Route

    served = sorted(f"{method} {path}" for method, path, _, _ in ROUTES)

    async def not_served(request, exc=None):
        return _json({"detail": f"{request.method} {request.url.path} is not served by mizzen-train "
                                f"serve. Served endpoints: {served}"}, 404)  # fmt: skip

    routes = [Route(path, _endpoint(service, handler, key), methods=[method])
              for method, path, handler, key in ROUTES]  # fmt: skip
    app = Starlette(routes=routes, exception_handlers={404: not_served, 405: not_served})
    app.state.service = service
    return app
