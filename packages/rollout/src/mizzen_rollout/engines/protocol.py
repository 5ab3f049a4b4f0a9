"""SGLang's HTTP protocol, the subset mizzen speaks: the ONE place its shapes are written down.

The client (:mod:`.client`) builds requests and parses answers with it; the embedded server
(:mod:`.embedded.app`) builds its answers with it, so the two cannot drift apart.  What the
embedded server *accepts* is written once, as pydantic models, in :mod:`.embedded.schema`.
``tests/rollout/engines/test_sglang_contract.py`` pins both the fields the client sends and the
fields the server accepts to the request definitions of a pinned SGLang release (read from its
wheel); ``tests/rollout/engines/test_protocol.py`` pins the answer shapes.

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
- Standard library only.  An answer that breaks the protocol raises :class:`EngineProtocolError`
  naming the field path.
"""

from __future__ import annotations

import math
import time
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
HEALTH_GENERATE_PATH = "/health_generate"
TOKENIZE_PATH = "/tokenize"
MODEL_INFO_PATH = "/get_model_info"
UPDATE_WEIGHTS_PATH = "/update_weights_from_disk"
LOAD_LORA_PATH = "/load_lora_adapter"
UNLOAD_LORA_PATH = "/unload_lora_adapter"

# ----------------------------------------------------------------------------- answer fields
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
LORA_UPDATE_RESPONSE_FIELDS = frozenset({"success", "error_message", "loaded_adapters"})


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


def split_model_field(model: str) -> tuple[str, str | None]:
    """SGLang's ``base-model:adapter-name``: split on the first colon (no colon: no adapter)."""
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


def build_tokenize_payload(text: str) -> dict[str, Any]:
    return {"prompt": text, "add_special_tokens": True}


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


def build_unload_lora_payload(name: str) -> dict[str, Any]:
    return {"lora_name": name}


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
