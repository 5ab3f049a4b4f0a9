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
  naming the field path and the rule, never another exception, whatever the JSON holds.
- What an answer parses into keeps the sample rules (:meth:`mizzen_rollout.samples.Sample.validate`)
  so a result can always become a sample: token ids (``output_ids``, log-prob entries, chat
  ``token_ids`` / ``prompt_token_ids``, ``/tokenize`` ``tokens``) are integers in
  ``[0, MAX_TOKEN_ID)``; token counts are integers >= 0; a log-prob is a number <= 0 that is not
  NaN or +Infinity (-Infinity, a token the distribution excluded, is read as ``-1e30`` so samples
  stay JSON; a value above 0 by at most :data:`LOGPROB_ROUNDING`, float rounding of a probability
  of 1, is read as ``0.0``); texts (``text``, chat ``content``, which may be null) are strings.
- A hostile value is shown in an error as a cut ``repr`` (escaped, at most ~80 characters).
"""

from __future__ import annotations

import math
import reprlib
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


#: Token ids are below this (a vocabulary of 2**31 ids is more than any model has; SGLang's and
#: torch's token tensors are int32 / int64).
MAX_TOKEN_ID = 2**31
#: A log-prob above 0 by at most this much is float rounding of a probability of 1: read as 0.0.
LOGPROB_ROUNDING = 1e-6
#: -Infinity (a token the distribution excluded) is read as this, so samples stay JSON.
LOGPROB_FLOOR = -1e30
_SHOWN_CHARS = 80
_SHOWN = reprlib.Repr(maxlevel=3, maxlist=6, maxtuple=6, maxdict=6, maxstring=60, maxlong=40,
                      maxother=60)  # fmt: skip


# ============================================================================= helpers
def shown(value: Any) -> str:
    """``value`` as an error shows it: a ``repr`` (control characters escaped) cut in depth,
    entries and length (at most about 80 characters), whatever a hostile server sent."""
    text = _SHOWN.repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def _require(body: Mapping[str, Any], key: str, where: str, engine: str) -> Any:
    if not isinstance(body, Mapping) or key not in body:
        got = (
            f"keys {shown(sorted(str(k) for k in body)[:10])}"
            if isinstance(body, Mapping)
            else type(body).__name__
        )
        raise EngineProtocolError(
            f"{engine}: response has no '{where}{key}' (SGLang documents it); got {got}",
            engine=engine,
        )
    return body[key]


def _as_int(value: Any, path: str, engine: str, *, low: int = 0, high: int | None = None) -> int:
    """An integer in ``[low, high)`` (``high`` None: no upper bound)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise EngineProtocolError(
            f"{engine}: response field '{path}' is {shown(value)}, not an integer", engine=engine
        )
    if value < low or (high is not None and value >= high):
        bound = f">= {low}" if high is None else f"in [{low}, {high})"
        raise EngineProtocolError(
            f"{engine}: response field '{path}' is {shown(value)}; it must be an integer {bound}",
            engine=engine,
        )
    return value


def _token_id(value: Any, path: str, engine: str) -> int:
    return _as_int(value, path, engine, low=0, high=MAX_TOKEN_ID)


def _token_ids(raw: Any, path: str, engine: str) -> tuple[int, ...]:
    if not isinstance(raw, list):
        raise EngineProtocolError(
            f"{engine}: response field '{path}' is {shown(raw)}, not a list of token ids",
            engine=engine,
        )
    return tuple(_token_id(t, f"{path}[{i}]", engine) for i, t in enumerate(raw))


def _logprob(value: Any, path: str, engine: str) -> float:
    """A log-probability: a number <= 0 (the module's rule); -inf and rounding noise read as
    the module docstring says."""
    number: float | None = None
    if not isinstance(value, bool) and isinstance(value, int | float):
        try:
            number = float(value)
        except OverflowError:  # an integer beyond float range
            number = None
    if number is None or math.isnan(number) or number > LOGPROB_ROUNDING:
        raise EngineProtocolError(
            f"{engine}: response field '{path}' is {shown(value)}, not a log-probability; it "
            f"must be a number <= 0 (or -Infinity)",
            engine=engine,
        )
    return min(max(number, LOGPROB_FLOOR), 0.0)


def _text(value: Any, path: str, engine: str, *, nullable: bool = False) -> str:
    """A string (``None`` reads as ``""`` where ``nullable``)."""
    if value is None and nullable:
        return ""
    if not isinstance(value, str):
        raise EngineProtocolError(
            f"{engine}: response field '{path}' is {shown(value)}, not a string"
            f"{' or null' if nullable else ''}",
            engine=engine,
        )
    return value


def _matched(value: Any, path: str, engine: str) -> int | str | tuple[int, ...] | None:
    """The stop token id, token-id sequence (SGLang types it ``int | list[int]``) or string that
    ended a ``stop`` (None: EOS)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        return tuple(_token_id(item, f"{path}[{i}]", engine) for i, item in enumerate(value))
    return _token_id(value, path, engine)


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
    kind = value.get("type") if isinstance(value, Mapping) else None
    if not isinstance(kind, str) or kind not in FINISH_REASON_TYPES:
        raise EngineProtocolError(
            f"{engine}: 'meta_info.finish_reason' is {shown(value)}; SGLang documents an object "
            f"whose 'type' is one of {sorted(FINISH_REASON_TYPES)}",
            engine=engine,
        )
    if kind == "abort":
        message = _text(value.get("message"), "meta_info.finish_reason.message", engine,
                        nullable=True)  # fmt: skip
        return FinishReason("abort", message=message or "Aborted")
    return FinishReason(
        kind, matched=_matched(value.get("matched"), "meta_info.finish_reason.matched", engine)
    )


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
                    f"{engine}: '{path}' is {shown(entry)}; SGLang documents "
                    "[logprob, token_id, text]",
                    engine=engine,
                )
            values.append(_logprob(entry[0], f"{path}[0]", engine))
            ids_from_logprobs.append(_token_id(entry[1], f"{path}[1]", engine))
        logprobs = tuple(values)
    raw_ids = body.get("output_ids")
    if raw_ids is None:
        # Older SGLang answers carry no output_ids; the log-prob entries name the tokens.
        output_ids = tuple(ids_from_logprobs or ())
    else:
        output_ids = _token_ids(raw_ids, "output_ids", engine)
    if logprobs is not None and output_ids and len(logprobs) != len(output_ids):
        raise EngineProtocolError(
            f"{engine}: 'meta_info.output_token_logprobs' has {len(logprobs)} entries but "
            f"'output_ids' has {len(output_ids)}",
            engine=engine,
        )
    text = _text(body.get("text", ""), "text", engine)
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
                f"{engine}: batch answer [{index}] is for request {shown(answered_id)}, not "
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
    if not isinstance(message, Mapping):
        raise EngineProtocolError(
            f"{engine}: response field 'choices[0].message' is {shown(message)}, not an object",
            engine=engine,
        )
    content = _text(message.get("content"), "choices[0].message.content", engine, nullable=True)
    raw_finish = choice.get("finish_reason")
    if not isinstance(raw_finish, str) or raw_finish not in _CHAT_FINISH:
        raise EngineProtocolError(
            f"{engine}: 'choices[0].finish_reason' is {shown(raw_finish)}; expected one of "
            f"{sorted(_CHAT_FINISH)}",
            engine=engine,
        )
    kind = _CHAT_FINISH[raw_finish]
    finish = (
        FinishReason("abort", message="Aborted")
        if kind == "abort"
        else FinishReason(
            kind, matched=_matched(choice.get("matched_stop"), "choices[0].matched_stop", engine)
        )
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
        return None if raw is None else _token_ids(raw, f"choices[0].{key}", engine)

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
        text=content,
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
    return list(_token_ids(_require(body, "tokens", "", engine), "/tokenize tokens", engine))


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
