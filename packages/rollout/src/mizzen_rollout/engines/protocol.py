"""SGLang's HTTP protocol, the subset mizzen speaks: the ONE place its shapes are written down.

Both sides use this module: the client (:mod:`.client`) builds requests and parses responses with
it, and the embedded server (:mod:`.embedded.server`) parses requests and builds responses with
it, so the two cannot drift apart.  ``tests/rollout/engines/test_protocol.py`` pins the shapes to
SGLang's documented fields.

Facts taken from SGLang's documentation and source (read, not copied):

- ``POST /generate`` takes ``text`` or ``input_ids`` (one of them), ``sampling_params`` (object),
  ``rid`` (request id), ``return_logprob``, ``logprob_start_len`` (default -1: output tokens only),
  ``top_logprobs_num``, ``return_text_in_logprobs``, ``stream``, ``lora_path``
  (``docs/basic_usage/sampling_params.md``, ``io_struct.py::GenerateReqInput``).
- A batch is the same request with lists: ``text`` a list of strings or ``input_ids`` a list of
  token lists, and ``rid`` (a list), ``sampling_params``, ``return_logprob``,
  ``logprob_start_len``, ``top_logprobs_num`` and ``lora_path`` each either one value for every
  prompt or a list with one per prompt; the answer is a list of the single answers, in the order
  of the prompts.
- ``sampling_params`` keys: ``max_new_tokens``, ``stop``, ``stop_token_ids``, ``temperature``,
  ``top_p``, ``top_k`` (-1 = off), ``min_p``, penalties, ``min_new_tokens``, constrained-decoding
  keys, ``n``, ``ignore_eos``, ``skip_special_tokens``, ``spaces_between_special_tokens``,
  ``no_stop_trim``, ``custom_params``, and ``sampling_seed`` (what the OpenAI ``seed`` maps to).
- The ``/generate`` answer is ``{"text", "output_ids", "meta_info"}``; ``meta_info`` holds ``id``
  (the rid), ``finish_reason``, ``prompt_tokens``, ``completion_tokens``, ``cached_tokens``,
  ``e2e_latency`` and, with ``return_logprob``, ``input_token_logprobs`` /
  ``output_token_logprobs`` as lists of ``[logprob, token_id, token_text_or_null]``.
- ``finish_reason`` is ``{"type": "stop", "matched": <id or str>}``,
  ``{"type": "length", "length": n}`` or
  ``{"type": "abort", "message", "status_code", "err_type"}``.  Depending on the SGLang version an
  aborted request answers 200 with an ``abort`` finish reason or an HTTP error.
- ``POST /abort_request`` takes ``{"rid": str, "abort_all": bool}``; ``GET /health`` answers 200
  when the server is up; ``POST /tokenize`` takes ``{"prompt", "add_special_tokens"}`` and answers
  ``{"tokens", "count", "max_model_len"}``.
- ``POST /v1/chat/completions`` (OpenAI-compatible) takes ``messages``, ``model``, ``max_tokens``
  (or ``max_completion_tokens``), ``temperature``, ``top_p``, ``stop``, ``seed``, ``logprobs``,
  ``top_logprobs``, ``n`` and SGLang extensions ``top_k``, ``min_p``, ``stop_token_ids``,
  ``ignore_eos``, ``rid``, ``return_prompt_token_ids``, ``return_token_ids``.  A choice is
  ``{"index", "message": {"role", "content"}, "logprobs": {"content": [{"token", "logprob",
  ...}]}, "finish_reason", "matched_stop", "prompt_token_ids", "token_ids"}``; ``usage`` holds
  ``prompt_tokens``, ``completion_tokens``, ``total_tokens``.
- ``POST /update_weights_from_disk`` takes ``{"model_path", "load_format", "abort_all_requests",
  "weight_version", ...}`` (``io_struct.py::UpdateWeightFromDiskReqInput``) and answers
  ``{"success": bool, "message": str, "num_paused_requests": int}``; the server reloads the
  weights of a model directory of the same architecture in place.
- LoRA serving (``docs/advanced_features/lora.md``, ``io_struct.py::LoadLoRAAdapterReqInput`` /
  ``UnloadLoRAAdapterReqInput`` / ``LoRAUpdateOutput``, ``http_server.py``):
  ``POST /load_lora_adapter`` takes ``{"lora_name", "lora_path", "pinned"}`` and
  ``POST /unload_lora_adapter`` takes ``{"lora_name"}``; both answer ``{"success": bool,
  "error_message": str | null, "loaded_adapters": {name: path or LoRARef}}`` (plus ``rid`` and
  ``http_worker_ipc`` in some versions), HTTP 200 on success and 400 on failure (a name that is
  already loaded, an unknown name, an incompatible adapter).  A request reaches a loaded adapter
  through ``lora_path`` on ``/generate`` (the adapter's *name*) or, on the OpenAI endpoints, the
  ``model`` field written ``base-model:adapter-name`` (split on the first colon; the adapter in
  ``model`` wins over an explicit ``lora_path``, which chat requests also accept).

Invariants:
- Standard library only.  Parsing errors raise :class:`EngineProtocolError` (client side) or
  :class:`ProtocolRequestError` (server side, answered as HTTP 400), naming the field path.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from .base import (
    ChatRequest,
    ChatResult,
    EngineProtocolError,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
)

# ----------------------------------------------------------------------------- endpoints
GENERATE_PATH = "/generate"
CHAT_PATH = "/v1/chat/completions"
ABORT_PATH = "/abort_request"
HEALTH_PATH = "/health"
TOKENIZE_PATH = "/tokenize"
MODEL_INFO_PATH = "/get_model_info"
UPDATE_WEIGHTS_PATH = "/update_weights_from_disk"
LOAD_LORA_PATH = "/load_lora_adapter"
UNLOAD_LORA_PATH = "/unload_lora_adapter"

# ----------------------------------------------------------------------------- documented fields
#: Top-level fields of SGLang's ``/generate`` request that mizzen may send or the embedded server
#: accepts (a subset of ``GenerateReqInput``).
GENERATE_REQUEST_FIELDS = frozenset(
    {
        "text",
        "input_ids",
        "sampling_params",
        "rid",
        "return_logprob",
        "logprob_start_len",
        "top_logprobs_num",
        "return_text_in_logprobs",
        "stream",
        "lora_path",
    }
)
#: ``sampling_params`` keys mizzen models in :class:`SamplingParams` (name on the wire).
SAMPLING_PARAM_WIRE_NAMES = {
    "max_new_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "seed": "sampling_seed",
}
#: Every documented ``sampling_params`` key (what SGLang knows; the embedded server implements
#: only :data:`SAMPLING_PARAM_WIRE_NAMES` plus the no-op-at-default ones below).
DOCUMENTED_SAMPLING_PARAMS = frozenset(
    {
        *SAMPLING_PARAM_WIRE_NAMES.values(),
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "n",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "custom_params",
    }
)
#: Keys of ``meta_info`` in a ``/generate`` answer that mizzen reads or writes.
META_INFO_FIELDS = frozenset(
    {
        "id",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "e2e_latency",
        "output_token_logprobs",
    }
)
FINISH_REASON_TYPES = frozenset({"stop", "length", "abort"})
ABORT_REQUEST_FIELDS = frozenset({"rid", "abort_all"})
TOKENIZE_REQUEST_FIELDS = frozenset({"prompt", "add_special_tokens"})
UPDATE_WEIGHTS_REQUEST_FIELDS = frozenset(
    {"model_path", "load_format", "abort_all_requests", "weight_version"}
)
LOAD_LORA_REQUEST_FIELDS = frozenset({"lora_name", "lora_path", "pinned"})
UNLOAD_LORA_REQUEST_FIELDS = frozenset({"lora_name"})
LORA_UPDATE_RESPONSE_FIELDS = frozenset({"success", "error_message", "loaded_adapters"})
CHAT_REQUEST_FIELDS = frozenset(
    {
        "model",
        "lora_path",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "seed",
        "n",
        "logprobs",
        "top_logprobs",
        "stream",
        "rid",
        "return_prompt_token_ids",
        "return_token_ids",
    }
)


class ProtocolRequestError(ValueError):
    """A request body broke the protocol (the embedded server answers it with HTTP 400)."""


# ============================================================================= helpers
def _require(body: Mapping[str, Any], key: str, where: str, engine: str) -> Any:
    if not isinstance(body, Mapping) or key not in body:
        raise EngineProtocolError(
            f"{engine}: response has no '{where}{key}' (SGLang documents it); got keys "
            f"{sorted(body) if isinstance(body, Mapping) else type(body).__name__}",
            engine=engine,
        )
    return body[key]


def _as_int(value: Any, path: str, engine: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise EngineProtocolError(
            f"{engine}: response field '{path}' is {value!r}, not an integer", engine=engine
        )
    return value


def _logprob(value: Any, path: str, engine: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise EngineProtocolError(
            f"{engine}: response field '{path}' is {value!r}, not a log-probability",
            engine=engine,
        )
    # -inf (a token the distribution excluded) is clamped so samples stay JSON-serialisable.
    return max(float(value), -1e30)


def sampling_to_wire(sampling: SamplingParams) -> dict[str, Any]:
    """``SamplingParams`` -> SGLang ``sampling_params`` (defaults that SGLang shares are sent too,
    so a server launched with model-provided defaults cannot silently change the sampling)."""
    wire: dict[str, Any] = {
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "min_p": sampling.min_p,
    }
    if sampling.stop:
        wire["stop"] = list(sampling.stop)
    if sampling.stop_token_ids:
        wire["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.ignore_eos:
        wire["ignore_eos"] = True
    if sampling.seed is not None:
        wire["sampling_seed"] = sampling.seed
    wire.update(sampling.extra)
    return wire


def sampling_from_wire(params: Any) -> SamplingParams:
    """SGLang ``sampling_params`` -> ``SamplingParams`` (server side; unknown keys -> extra)."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, Mapping):
        raise ProtocolRequestError(f"sampling_params is {type(params).__name__}, not an object")
    unknown = sorted(set(params) - DOCUMENTED_SAMPLING_PARAMS)
    if unknown:
        raise ProtocolRequestError(
            f"sampling_params has unknown key(s) {unknown}; documented keys: "
            f"{sorted(DOCUMENTED_SAMPLING_PARAMS)}"
        )
    kwargs: dict[str, Any] = {}
    for attr, wire_name in SAMPLING_PARAM_WIRE_NAMES.items():
        if wire_name in params and params[wire_name] is not None:
            kwargs[attr] = params[wire_name]
    if isinstance(kwargs.get("stop"), str):
        kwargs["stop"] = (kwargs["stop"],)
    extra = {k: v for k, v in params.items() if k not in SAMPLING_PARAM_WIRE_NAMES.values()}
    try:
        return SamplingParams(**kwargs, extra=extra)
    except (TypeError, ValueError) as exc:
        raise ProtocolRequestError(f"sampling_params: {exc}") from None


def finish_to_wire(finish: FinishReason, *, length: int) -> dict[str, Any]:
    if finish.kind == "stop":
        return {"type": "stop", "matched": finish.matched}
    if finish.kind == "length":
        return {"type": "length", "length": length}
    return {
        "type": "abort",
        "message": finish.message or "Aborted",
        "status_code": None,
        "err_type": None,
    }


def finish_from_wire(value: Any, engine: str) -> FinishReason:
    if not isinstance(value, Mapping) or value.get("type") not in FINISH_REASON_TYPES:
        raise EngineProtocolError(
            f"{engine}: 'meta_info.finish_reason' is {value!r}; SGLang documents an object whose "
            f"'type' is one of {sorted(FINISH_REASON_TYPES)}",
            engine=engine,
        )
    kind = value["type"]
    if kind == "abort":
        return FinishReason("abort", message=str(value.get("message") or "Aborted"))
    return FinishReason(kind, matched=value.get("matched"))


# ============================================================================= /generate
def build_generate_payload(request: GenerateRequest) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "rid": request.request_id,
        "sampling_params": sampling_to_wire(request.sampling),
        "return_logprob": request.return_logprob,
    }
    if request.input_ids is not None:
        payload["input_ids"] = list(request.input_ids)
    else:
        payload["text"] = request.text
    if request.lora_path is not None:
        payload["lora_path"] = request.lora_path
    return payload


def parse_generate_response(
    body: Any, *, request_id: str, engine: str, latency_s: float = 0.0
) -> GenerateResult:
    if not isinstance(body, Mapping):
        raise EngineProtocolError(
            f"{engine}: /generate answered {type(body).__name__}, not an object (a list answers "
            "a batch, and this request was one prompt)",
            engine=engine,
            request_id=request_id,
        )
    meta = _require(body, "meta_info", "", engine)
    finish = finish_from_wire(_require(meta, "finish_reason", "meta_info.", engine), engine)
    prompt_tokens = _as_int(
        _require(meta, "prompt_tokens", "meta_info.", engine), "meta_info.prompt_tokens", engine
    )
    completion_tokens = _as_int(
        _require(meta, "completion_tokens", "meta_info.", engine),
        "meta_info.completion_tokens",
        engine,
    )
    logprob_entries = meta.get("output_token_logprobs")
    logprobs: tuple[float, ...] | None = None
    ids_from_logprobs: list[int] | None = None
    if logprob_entries is not None:
        if not isinstance(logprob_entries, list):
            raise EngineProtocolError(
                f"{engine}: 'meta_info.output_token_logprobs' is not a list", engine=engine
            )
        values, ids_from_logprobs = [], []
        for i, entry in enumerate(logprob_entries):
            path = f"meta_info.output_token_logprobs[{i}]"
            if not isinstance(entry, list | tuple) or len(entry) < 2:
                raise EngineProtocolError(
                    f"{engine}: '{path}' is {entry!r}; SGLang documents [logprob, token_id, text]",
                    engine=engine,
                )
            values.append(_logprob(entry[0], f"{path}[0]", engine))
            ids_from_logprobs.append(_as_int(entry[1], f"{path}[1]", engine))
        logprobs = tuple(values)
    raw_ids = body.get("output_ids")
    if raw_ids is None:
        # Older SGLang answers carry no output_ids; the log-prob entries name the tokens.
        output_ids = tuple(ids_from_logprobs or ())
    else:
        if not isinstance(raw_ids, list):
            raise EngineProtocolError(f"{engine}: 'output_ids' is not a list", engine=engine)
        output_ids = tuple(_as_int(t, f"output_ids[{i}]", engine) for i, t in enumerate(raw_ids))
    if logprobs is not None and output_ids and len(logprobs) != len(output_ids):
        raise EngineProtocolError(
            f"{engine}: 'meta_info.output_token_logprobs' has {len(logprobs)} entries but "
            f"'output_ids' has {len(output_ids)}",
            engine=engine,
        )
    text = body.get("text", "")
    if not isinstance(text, str):
        raise EngineProtocolError(f"{engine}: 'text' is not a string", engine=engine)
    return GenerateResult(
        request_id=request_id,
        text=text,
        output_ids=output_ids,
        finish=finish,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        output_logprobs=logprobs,
        latency_s=latency_s,
        engine=engine,
    )


def parse_generate_payload(body: Any) -> GenerateRequest:
    """Server side: a single ``/generate`` body (one prompt) -> GenerateRequest."""
    if not isinstance(body, Mapping):
        raise ProtocolRequestError("the /generate body must be a JSON object")
    unknown = sorted(set(body) - GENERATE_REQUEST_FIELDS)
    if unknown:
        raise ProtocolRequestError(
            f"/generate has unknown field(s) {unknown}; accepted: {sorted(GENERATE_REQUEST_FIELDS)}"
        )
    if body.get("stream"):
        raise ProtocolRequestError("stream=true is not supported by this server; send stream=false")
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise ProtocolRequestError("/generate needs exactly one of 'text' or 'input_ids'")
    if text is not None and not isinstance(text, str):
        raise ProtocolRequestError("'text' must be a string (a batch: a list of strings)")
    if input_ids is not None and (
        not isinstance(input_ids, list)
        or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in input_ids)
    ):
        raise ProtocolRequestError(
            "'input_ids' must be a list of non-negative integers (a batch: a list of such lists)"
        )
    rid = body.get("rid") or uuid.uuid4().hex
    if not isinstance(rid, str):
        raise ProtocolRequestError("'rid' must be a string")
    start = body.get("logprob_start_len", -1)
    if start not in (-1, None):
        raise ProtocolRequestError("only logprob_start_len=-1 (output tokens) is supported")
    if body.get("top_logprobs_num"):
        raise ProtocolRequestError("top_logprobs_num is not supported by this server")
    sampling = sampling_from_wire(body.get("sampling_params"))
    return GenerateRequest(
        request_id=rid,
        text=text,
        input_ids=tuple(input_ids) if input_ids is not None else None,
        sampling=sampling,
        return_logprob=bool(body.get("return_logprob", False)),
        lora_path=body.get("lora_path"),
    )


def build_generate_response(
    *,
    request_id: str,
    text: str,
    output_ids: Sequence[int],
    finish: FinishReason,
    prompt_tokens: int,
    output_logprobs: Sequence[float] | None,
    e2e_latency: float,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": request_id,
        "finish_reason": finish_to_wire(finish, length=len(output_ids)),
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(output_ids),
        "cached_tokens": 0,
        "e2e_latency": e2e_latency,
    }
    if output_logprobs is not None:
        meta["output_token_logprobs"] = [
            [float(lp), int(tok), None] for lp, tok in zip(output_logprobs, output_ids, strict=True)
        ]
    return {"text": text, "output_ids": [int(t) for t in output_ids], "meta_info": meta}


#: The ``/generate`` fields that a batch may give per prompt (a list) or once for all.
GENERATE_PER_PROMPT_FIELDS = (
    "rid", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "lora_path",
)  # fmt: skip


def build_generate_batch_payload(requests: Sequence[GenerateRequest]) -> dict[str, Any]:
    """One batched ``/generate`` for ``requests`` (all by ``input_ids``, or all by ``text``)."""
    if not requests:
        raise ValueError("a batch needs at least one request")
    by_ids = [r.input_ids is not None for r in requests]
    if any(by_ids) and not all(by_ids):
        raise ValueError("a batch sends every prompt as input_ids or every prompt as text")
    payload: dict[str, Any] = {
        "rid": [r.request_id for r in requests],
        "sampling_params": [sampling_to_wire(r.sampling) for r in requests],
        "return_logprob": [r.return_logprob for r in requests],
    }
    if all(by_ids):
        payload["input_ids"] = [list(r.input_ids or ()) for r in requests]
    else:
        payload["text"] = [r.text for r in requests]
    if any(r.lora_path is not None for r in requests):
        payload["lora_path"] = [r.lora_path for r in requests]
    return payload


def parse_generate_batch_response(
    body: Any, *, requests: Sequence[GenerateRequest], engine: str, latency_s: float = 0.0
) -> list[GenerateResult]:
    """The list answer of a batched ``/generate``: one result per request, in order (an answer
    whose ``meta_info.id`` names another request is refused)."""
    if not isinstance(body, list) or len(body) != len(requests):
        got = f"a list of {len(body)}" if isinstance(body, list) else type(body).__name__
        raise EngineProtocolError(
            f"{engine}: a batch of {len(requests)} prompts to /generate was answered with {got}",
            engine=engine,
            request_id=requests[0].request_id if requests else None,
        )
    results = []
    for index, (answer, request) in enumerate(zip(body, requests, strict=True)):
        meta_info = answer.get("meta_info") if isinstance(answer, Mapping) else None
        answered_id = meta_info.get("id") if isinstance(meta_info, Mapping) else None
        if isinstance(answered_id, str) and answered_id != request.request_id:
            raise EngineProtocolError(
                f"{engine}: batch answer [{index}] is for request {answered_id!r}, not "
                f"{request.request_id!r} (answers must come in the order of the prompts)",
                engine=engine,
                request_id=request.request_id,
            )
        try:
            results.append(
                parse_generate_response(
                    answer, request_id=request.request_id, engine=engine, latency_s=latency_s
                )
            )
        except EngineProtocolError as exc:
            raise EngineProtocolError(
                f"{engine}: batch answer [{index}]: {exc}", engine=engine,
                request_id=request.request_id,
            ) from None  # fmt: skip
    return results


def is_generate_batch(body: Any) -> bool:
    """Server side: is this ``/generate`` body a batch (a list of prompts)?"""
    if not isinstance(body, Mapping):
        return False
    text, input_ids = body.get("text"), body.get("input_ids")
    return isinstance(text, list) or (
        isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
    )


def parse_generate_batch_payload(body: Any, *, max_size: int) -> list[GenerateRequest]:
    """Server side: a batched ``/generate`` body -> one GenerateRequest per prompt, each checked
    as a single request would be (errors name the prompt's index)."""
    if not isinstance(body, Mapping):
        raise ProtocolRequestError("the /generate body must be a JSON object")
    key = "text" if isinstance(body.get("text"), list) else "input_ids"
    if body.get("text") is not None and body.get("input_ids") is not None:
        raise ProtocolRequestError("/generate needs exactly one of 'text' or 'input_ids'")
    prompts = body[key]
    if not prompts:
        raise ProtocolRequestError(f"'{key}' is an empty batch; send at least one prompt")
    if len(prompts) > max_size:
        raise ProtocolRequestError(
            f"'{key}' holds {len(prompts)} prompts; this server takes at most {max_size} per "
            "request: split the batch"
        )
    per_prompt = {}
    for field in GENERATE_PER_PROMPT_FIELDS:
        value = body.get(field)
        if isinstance(value, list):
            if len(value) != len(prompts):
                raise ProtocolRequestError(
                    f"'{field}' has {len(value)} entries for {len(prompts)} prompts; give one "
                    "per prompt or a single value"
                )
            per_prompt[field] = value
    if body.get("rid") is not None and "rid" not in per_prompt:
        raise ProtocolRequestError("'rid' of a batch must be a list with one id per prompt")
    first_at: dict[str, int] = {}
    for index, rid in enumerate(per_prompt.get("rid", ())):
        if not isinstance(rid, str):
            continue  # refused as the prompt's own 'rid' below
        if rid in first_at:
            raise ProtocolRequestError(
                f"'rid' [{index}] repeats 'rid' [{first_at[rid]}] ({rid!r}); every prompt of a "
                "batch needs its own request id"
            )
        first_at[rid] = index
    requests = []
    for index, prompt in enumerate(prompts):
        single = {k: v for k, v in body.items() if k not in ("text", "input_ids")}
        single[key] = prompt
        for field, values in per_prompt.items():
            single[field] = values[index]
        try:
            requests.append(parse_generate_payload(single))
        except ProtocolRequestError as exc:
            raise ProtocolRequestError(f"prompt [{index}] of the batch: {exc}") from None
    return requests


# ============================================================================= /v1/chat/completions
def build_chat_payload(request: ChatRequest) -> dict[str, Any]:
    s = request.sampling
    model = request.model
    if request.lora_name is not None:
        model = f"{request.model}:{request.lora_name}"  # SGLang's base-model:adapter-name
    payload: dict[str, Any] = {
        "model": model,
        "messages": [dict(m) for m in request.messages],
        "max_tokens": s.max_new_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "min_p": s.min_p,
        "rid": request.request_id,
        "logprobs": request.return_logprob,
    }
    if s.stop:
        payload["stop"] = list(s.stop)
    if s.stop_token_ids:
        payload["stop_token_ids"] = list(s.stop_token_ids)
    if s.ignore_eos:
        payload["ignore_eos"] = True
    if s.seed is not None:
        payload["seed"] = s.seed
    if request.return_token_ids:
        payload["return_prompt_token_ids"] = True
        payload["return_token_ids"] = True
    return payload


_CHAT_FINISH = {"stop": "stop", "length": "length", "abort": "abort", "tool_calls": "stop"}


def parse_chat_response(
    body: Any, *, request_id: str, engine: str, latency_s: float = 0.0
) -> ChatResult:
    choices = _require(body, "choices", "", engine)
    if not isinstance(choices, list) or not choices:
        raise EngineProtocolError(f"{engine}: 'choices' is empty or not a list", engine=engine)
    choice = choices[0]
    message = _require(choice, "message", "choices[0].", engine)
    content = message.get("content") if isinstance(message, Mapping) else None
    raw_finish = choice.get("finish_reason") if isinstance(choice, Mapping) else None
    if raw_finish not in _CHAT_FINISH:
        raise EngineProtocolError(
            f"{engine}: 'choices[0].finish_reason' is {raw_finish!r}; expected one of "
            f"{sorted(_CHAT_FINISH)}",
            engine=engine,
        )
    kind = _CHAT_FINISH[raw_finish]
    finish = (
        FinishReason("abort", message="Aborted")
        if kind == "abort"
        else FinishReason(kind, matched=choice.get("matched_stop"))
    )
    usage = _require(body, "usage", "", engine)
    prompt_tokens = _as_int(
        _require(usage, "prompt_tokens", "usage.", engine), "usage.prompt_tokens", engine
    )
    completion_tokens = _as_int(
        _require(usage, "completion_tokens", "usage.", engine), "usage.completion_tokens", engine
    )

    def ids(key: str) -> tuple[int, ...] | None:
        raw = choice.get(key)
        if raw is None:
            return None
        if not isinstance(raw, list):
            raise EngineProtocolError(f"{engine}: 'choices[0].{key}' is not a list", engine=engine)
        return tuple(_as_int(t, f"choices[0].{key}[{i}]", engine) for i, t in enumerate(raw))

    logprobs: tuple[float, ...] | None = None
    raw_logprobs = choice.get("logprobs")
    if raw_logprobs is not None:
        entries = raw_logprobs.get("content") if isinstance(raw_logprobs, Mapping) else None
        if not isinstance(entries, list):
            raise EngineProtocolError(
                f"{engine}: 'choices[0].logprobs.content' is not a list", engine=engine
            )
        logprobs = tuple(
            _logprob(
                e.get("logprob") if isinstance(e, Mapping) else e,
                f"choices[0].logprobs.content[{i}].logprob",
                engine,
            )
            for i, e in enumerate(entries)
        )
    return ChatResult(
        request_id=request_id,
        text=content or "",
        finish=finish,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        prompt_token_ids=ids("prompt_token_ids"),
        output_ids=ids("token_ids"),
        output_logprobs=logprobs,
        latency_s=latency_s,
        engine=engine,
    )


def parse_chat_payload(body: Any) -> ChatRequest:
    """Server side: a chat body -> ChatRequest."""
    if not isinstance(body, Mapping):
        raise ProtocolRequestError("the chat body must be a JSON object")
    unknown = sorted(set(body) - CHAT_REQUEST_FIELDS)
    if unknown:
        raise ProtocolRequestError(
            f"/v1/chat/completions has unknown field(s) {unknown}; accepted: "
            f"{sorted(CHAT_REQUEST_FIELDS)}"
        )
    if body.get("stream"):
        raise ProtocolRequestError("stream=true is not supported by this server")
    if body.get("n", 1) != 1:
        raise ProtocolRequestError("only n=1 is supported; send n requests instead")
    if body.get("top_logprobs"):
        raise ProtocolRequestError("top_logprobs is not supported by this server")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ProtocolRequestError("'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ProtocolRequestError(f"messages[{i}] needs a string 'role'")
        if not isinstance(m.get("content", ""), str):
            raise ProtocolRequestError(f"messages[{i}].content must be a string here")
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    wire: dict[str, Any] = {
        key: body[key]
        for key in ("temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids")
        if body.get(key) is not None
    }
    if max_tokens is not None:
        wire["max_new_tokens"] = max_tokens
    if body.get("ignore_eos"):
        wire["ignore_eos"] = True
    if body.get("seed") is not None:
        wire["sampling_seed"] = body["seed"]
    rid = body.get("rid") or f"chatcmpl-{uuid.uuid4().hex}"
    model, adapter = split_model_field(body.get("model", "default"))
    explicit = body.get("lora_path")
    if explicit is not None and not isinstance(explicit, str):
        raise ProtocolRequestError("'lora_path' must be one adapter name (a string) here")
    return ChatRequest(
        request_id=str(rid),
        messages=tuple(messages),
        sampling=sampling_from_wire(wire),
        return_logprob=bool(body.get("logprobs", False)),
        return_token_ids=bool(body.get("return_token_ids", False)),
        model=model,
        lora_name=adapter if adapter is not None else explicit,
    )


def split_model_field(model: Any) -> tuple[str, str | None]:
    """SGLang's ``base-model:adapter-name``: split on the first colon (no colon: no adapter)."""
    if not isinstance(model, str):
        raise ProtocolRequestError("'model' must be a string")
    if ":" not in model:
        return model, None
    base, _, adapter = model.partition(":")
    return base.strip(), adapter.strip() or None


def build_chat_response(
    *,
    request: ChatRequest,
    text: str,
    finish: FinishReason,
    prompt_token_ids: Sequence[int],
    output_ids: Sequence[int],
    output_logprobs: Sequence[float] | None,
    token_texts: Sequence[str] | None = None,
    return_prompt_token_ids: bool = False,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "logprobs": None,
        "finish_reason": finish.kind,
        "matched_stop": finish.matched if finish.kind == "stop" else None,
    }
    if output_logprobs is not None:
        texts = token_texts or [""] * len(output_ids)
        choice["logprobs"] = {
            "content": [
                {"token": t, "logprob": float(lp), "bytes": None, "top_logprobs": []}
                for t, lp in zip(texts, output_logprobs, strict=True)
            ]
        }
    if request.return_token_ids:
        choice["token_ids"] = [int(t) for t in output_ids]
    if return_prompt_token_ids:
        choice["prompt_token_ids"] = [int(t) for t in prompt_token_ids]
    return {
        "id": request.request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(prompt_token_ids),
            "completion_tokens": len(output_ids),
            "total_tokens": len(prompt_token_ids) + len(output_ids),
        },
    }


# ============================================================================= abort / tokenize
def build_abort_payload(request_id: str) -> dict[str, Any]:
    return {"rid": request_id, "abort_all": False}


def parse_abort_payload(body: Any) -> tuple[str, bool]:
    if not isinstance(body, Mapping) or set(body) - ABORT_REQUEST_FIELDS:
        raise ProtocolRequestError(f"/abort_request takes {sorted(ABORT_REQUEST_FIELDS)}")
    return str(body.get("rid", "")), bool(body.get("abort_all", False))


def build_tokenize_payload(text: str) -> dict[str, Any]:
    return {"prompt": text, "add_special_tokens": True}


def parse_tokenize_payload(body: Any) -> tuple[str, bool]:
    if not isinstance(body, Mapping) or not isinstance(body.get("prompt"), str):
        raise ProtocolRequestError("/tokenize takes {'prompt': str, 'add_special_tokens': bool}")
    if set(body) - TOKENIZE_REQUEST_FIELDS:
        raise ProtocolRequestError(f"/tokenize takes {sorted(TOKENIZE_REQUEST_FIELDS)}")
    return body["prompt"], bool(body.get("add_special_tokens", True))


def build_tokenize_response(tokens: Sequence[int], *, max_model_len: int) -> dict[str, Any]:
    return {
        "tokens": [int(t) for t in tokens],
        "count": len(tokens),
        "max_model_len": max_model_len,
    }


def parse_tokenize_response(body: Any, *, engine: str) -> list[int]:
    tokens = _require(body, "tokens", "", engine)
    if not isinstance(tokens, list):
        raise EngineProtocolError(f"{engine}: '/tokenize' 'tokens' is not a list", engine=engine)
    return [_as_int(t, f"tokens[{i}]", engine) for i, t in enumerate(tokens)]


# ============================================================================= weight updates
def build_update_weights_payload(model_path: str) -> dict[str, Any]:
    return {"model_path": model_path}


def parse_update_weights_payload(body: Any) -> str:
    """The model directory of an update request (the server side)."""
    if not isinstance(body, Mapping) or not isinstance(body.get("model_path"), str):
        raise ProtocolRequestError(
            f"{UPDATE_WEIGHTS_PATH} takes {{'model_path': str, ...}} "
            f"({sorted(UPDATE_WEIGHTS_REQUEST_FIELDS)})"
        )
    unknown = set(body) - UPDATE_WEIGHTS_REQUEST_FIELDS
    if unknown:
        raise ProtocolRequestError(
            f"{UPDATE_WEIGHTS_PATH}: unknown field(s) {sorted(unknown)}; this server takes "
            f"{sorted(UPDATE_WEIGHTS_REQUEST_FIELDS)}"
        )
    if body.get("load_format") not in (None, "auto"):
        raise ProtocolRequestError(
            f"{UPDATE_WEIGHTS_PATH}: load_format={body['load_format']!r} is not implemented by "
            "this server (only the model directory's own format); drop it"
        )
    if not body["model_path"]:
        raise ProtocolRequestError(f"{UPDATE_WEIGHTS_PATH}: model_path is empty")
    return body["model_path"]


def build_update_weights_response(success: bool, message: str) -> dict[str, Any]:
    return {"success": bool(success), "message": message, "num_paused_requests": 0}


def parse_update_weights_response(body: Any, *, engine: str) -> tuple[bool, str]:
    success = _require(body, "success", "", engine)
    if not isinstance(success, bool):
        raise EngineProtocolError(
            f"{engine}: '{UPDATE_WEIGHTS_PATH}' 'success' is not a boolean", engine=engine
        )
    message = body.get("message", "")
    return success, message if isinstance(message, str) else str(message)


# ============================================================================= LoRA adapters
def build_load_lora_payload(name: str, path: str, *, pinned: bool = False) -> dict[str, Any]:
    return {"lora_name": name, "lora_path": path, "pinned": bool(pinned)}


def parse_load_lora_payload(body: Any) -> tuple[str, str, bool]:
    """Server side: ``(lora_name, lora_path, pinned)`` of a load request."""
    if not isinstance(body, Mapping):
        raise ProtocolRequestError(f"{LOAD_LORA_PATH} takes {sorted(LOAD_LORA_REQUEST_FIELDS)}")
    unknown = set(body) - LOAD_LORA_REQUEST_FIELDS
    if unknown:
        raise ProtocolRequestError(
            f"{LOAD_LORA_PATH}: unknown field(s) {sorted(unknown)}; SGLang takes "
            f"{sorted(LOAD_LORA_REQUEST_FIELDS)}"
        )
    name, path = body.get("lora_name"), body.get("lora_path")
    for key, value in (("lora_name", name), ("lora_path", path)):
        if not isinstance(value, str) or not value:
            raise ProtocolRequestError(f"{LOAD_LORA_PATH}: '{key}' must be a non-empty string")
    pinned = body.get("pinned", False)
    if not isinstance(pinned, bool):
        raise ProtocolRequestError(f"{LOAD_LORA_PATH}: 'pinned' must be true or false")
    return name, path, pinned


def build_unload_lora_payload(name: str) -> dict[str, Any]:
    return {"lora_name": name}


def parse_unload_lora_payload(body: Any) -> str:
    if not isinstance(body, Mapping) or set(body) - UNLOAD_LORA_REQUEST_FIELDS:
        raise ProtocolRequestError(f"{UNLOAD_LORA_PATH} takes {sorted(UNLOAD_LORA_REQUEST_FIELDS)}")
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise ProtocolRequestError(f"{UNLOAD_LORA_PATH}: 'lora_name' must be a non-empty string")
    return name


def build_lora_update_response(
    success: bool, error_message: str | None, loaded_adapters: Mapping[str, str]
) -> dict[str, Any]:
    return {
        "success": bool(success),
        "error_message": error_message,
        "loaded_adapters": dict(loaded_adapters),
    }


def parse_lora_update_response(body: Any, *, engine: str) -> tuple[bool, str, dict[str, str]]:
    """``(success, error_message, {name: path})`` of a load/unload answer.  SGLang versions
    serialise a loaded adapter as its path or as a ``LoRARef`` object (``lora_path`` inside)."""
    success = _require(body, "success", "", engine)
    if not isinstance(success, bool):
        raise EngineProtocolError(
            f"{engine}: LoRA update 'success' is not a boolean", engine=engine
        )
    message = body.get("error_message") or ""
    loaded_raw = body.get("loaded_adapters") or {}
    if not isinstance(loaded_raw, Mapping):
        raise EngineProtocolError(
            f"{engine}: LoRA update 'loaded_adapters' is not an object", engine=engine
        )
    loaded: dict[str, str] = {}
    for name, ref in loaded_raw.items():
        if isinstance(ref, Mapping):
            ref = ref.get("lora_path", "")
        loaded[str(name)] = str(ref)
    return success, str(message), loaded
