"""What the embedded engine accepts: pydantic request models, the ONE place the request shapes are
written (the server validates with them; the contract test pins their fields to SGLang's own).

Models (SGLang's names, ``sglang/srt/managers/io_struct.py`` and ``entrypoints/openai/protocol.py``):
``SamplingParamsInput`` (``sampling_params``), ``GenerateReqInput`` (one prompt of ``/generate``),
``ChatCompletionRequest``, ``AbortReq``, ``TokenizeReqInput``, ``UpdateWeightFromDiskReqInput``,
``LoadLoRAAdapterReqInput``, ``UnloadLoRAAdapterReqInput``.  A batched ``/generate`` is split into
single requests by :func:`split_generate_batch` (SGLang's list form) and each is validated alone.

Invariants:
- Strict types, no coercion: an int field takes a JSON integer (not ``2.5``, not ``true``), a bool
  takes ``true``/``false``, a string a string; every float is finite; unknown fields are refused.
- Ranges: ``max_new_tokens`` and token ids in ``[0, 2**31)``, ``temperature >= 0``, ``top_p`` in
  ``(0, 1]``, ``min_p`` in ``[0, 1]``, ``top_k`` ``-1`` (off) or ``>= 1``, ``sampling_seed`` and
  ``seed`` 64-bit (``[-2**63, 2**64)``, what ``torch.Generator.manual_seed`` takes).
- ``stop`` is a string or a list of strings; ``stop_token_ids`` a list of token ids.
- Every refusal is a :class:`RequestRefused` whose message names the field (``a.b[2]``).
- pydantic is the ``embedded`` extra's: the models are built on first use (module
  ``__getattr__``), so this module imports on a base install.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from ..base import MAX_TOKEN_ID, SEED_MAX, SEED_MIN

__all__ = [
    "BATCH_FIELDS",
    "MAX_TOKEN_ID",
    "MODEL_NAMES",
    "RequestRefused",
    "split_generate_batch",
    "validate",
]

#: The ``/generate`` fields a batch may give per prompt (a list) or once for every prompt.
BATCH_FIELDS = (
    "rid", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "lora_path",
)  # fmt: skip
MODEL_NAMES = (
    "SamplingParamsInput",
    "GenerateReqInput",
    "ChatCompletionRequest",
    "ChatMessage",
    "AbortReq",
    "TokenizeReqInput",
    "UpdateWeightFromDiskReqInput",
    "LoadLoRAAdapterReqInput",
    "UnloadLoRAAdapterReqInput",
)


class RequestRefused(ValueError):
    """A request the server answers with a 4xx: ``status`` and a message naming the field."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def __getattr__(name: str) -> Any:
    if name in MODEL_NAMES:
        return _models()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def validate(model_name: str, body: Any, where: str) -> Any:
    """``body`` as an instance of the model ``model_name``, or :class:`RequestRefused` naming the
    first wrong field (``where`` prefixes the message: the endpoint, a batch index)."""
    from pydantic import ValidationError

    model = _models()[model_name]
    if not isinstance(body, Mapping):
        raise RequestRefused(f"{where}: the body must be a JSON object, not {_kind(body)}")
    try:
        return model.model_validate(body, strict=True)
    except ValidationError as exc:
        raise RequestRefused(f"{where}: {_describe(exc)}") from None


def _describe(exc: Any) -> str:
    errors = exc.errors(include_url=False, include_input=False)
    first = errors[0]
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"]).lstrip(".")
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return f"field '{path or '(body)'}': {first['msg']}{more}"


def _kind(value: Any) -> str:
    return {list: "a list", str: "a string", type(None): "null", bool: "a boolean"}.get(
        type(value), type(value).__name__
    )


def split_generate_batch(body: Mapping[str, Any], *, max_size: int) -> list[dict[str, Any]] | None:
    """The single ``/generate`` bodies of a batched one (``text`` a list, or ``input_ids`` a list
    of lists), in order; ``None`` when ``body`` is one prompt.  A per-prompt field is a list with
    one entry per prompt or one value for all; ``rid`` of a batch is a list of distinct ids."""
    text, input_ids = body.get("text"), body.get("input_ids")
    batched = isinstance(text, list) or (
        isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
    )
    if not batched:
        return None
    if text is not None and input_ids is not None:
        raise RequestRefused("/generate: give exactly one of 'text' or 'input_ids'")
    key = "text" if text is not None else "input_ids"
    prompts: list[Any] = body[key]
    if not prompts:
        raise RequestRefused(f"/generate: '{key}' is an empty batch; send at least one prompt")
    if len(prompts) > max_size:
        raise RequestRefused(
            f"/generate: '{key}' holds {len(prompts)} prompts; this server takes at most "
            f"{max_size} per request: split the batch"
        )
    per_prompt = {}
    for field in BATCH_FIELDS:
        value = body.get(field)
        if isinstance(value, list):
            if len(value) != len(prompts):
                raise RequestRefused(
                    f"/generate: '{field}' has {len(value)} entries for {len(prompts)} prompts; "
                    "give one per prompt or a single value"
                )
            per_prompt[field] = value
    if body.get("rid") is not None and "rid" not in per_prompt:
        raise RequestRefused("/generate: 'rid' of a batch must be a list with one id per prompt")
    _refuse_repeated_rids(per_prompt.get("rid", ()))
    singles = []
    for index, prompt in enumerate(prompts):
        single = {k: v for k, v in body.items() if k not in ("text", "input_ids")}
        single[key] = prompt
        for field, values in per_prompt.items():
            single[field] = values[index]
        singles.append(single)
    return singles


def _refuse_repeated_rids(rids: Sequence[Any]) -> None:
    first_at: dict[str, int] = {}
    for index, rid in enumerate(rids):
        if not isinstance(rid, str):
            continue  # refused as the prompt's own 'rid'
        if rid in first_at:
            raise RequestRefused(
                f"/generate: 'rid' [{index}] repeats 'rid' [{first_at[rid]}] ({rid!r}); every "
                "prompt of a batch needs its own request id"
            )
        first_at[rid] = index


@functools.cache
def _models() -> dict[str, type]:
    """Define the models (pydantic imported here, on first use)."""
    from typing import Annotated, Literal

    from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

    from ..base import SamplingParams

    class Strict(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)

    TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
    Count = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
    Seed = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)]
    TopK = Annotated[int, Field(ge=-1, le=MAX_TOKEN_ID)]
    Temperature = Annotated[float, Field(ge=0)]
    TopP = Annotated[float, Field(gt=0, le=1)]
    Probability = Annotated[float, Field(ge=0, le=1)]
    Name = Annotated[str, Field(min_length=1)]

    MODELLED_SAMPLING = frozenset(
        {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids",
         "ignore_eos", "sampling_seed"}
    )  # fmt: skip

    def one_or_list(value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    def no_zero_top_k(value: int | None) -> int | None:
        if value == 0:
            raise ValueError("top_k 0 is not a choice: use -1 (off) or a positive k")
        return value

    class SamplingParamsInput(Strict):
        """``sampling_params`` (SGLang's ``SamplingParams`` keys)."""

        max_new_tokens: Count | None = None
        temperature: Temperature | None = None
        top_p: TopP | None = None
        top_k: TopK | None = None
        min_p: Probability | None = None
        stop: list[str] | None = None
        stop_token_ids: list[TokenId] | None = None
        ignore_eos: bool | None = None
        sampling_seed: Seed | None = None
        # Accepted at their no-op defaults only (the backend refuses any other value by name).
        frequency_penalty: float | None = None
        presence_penalty: float | None = None
        repetition_penalty: float | None = None
        min_new_tokens: Count | None = None
        json_schema: str | None = None
        regex: str | None = None
        ebnf: str | None = None
        structural_tag: str | None = None
        n: int | None = None
        skip_special_tokens: bool | None = None
        spaces_between_special_tokens: bool | None = None
        no_stop_trim: bool | None = None
        custom_params: dict[str, Any] | None = None

        _stop = field_validator("stop", mode="before")(one_or_list)
        _top_k = field_validator("top_k")(no_zero_top_k)

        def to_sampling(self) -> SamplingParams:
            modelled = {
                "max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                "stop": self.stop, "stop_token_ids": self.stop_token_ids,
                "ignore_eos": self.ignore_eos, "seed": self.sampling_seed,
            }  # fmt: skip
            extra = {
                name: getattr(self, name)
                for name in self.model_fields_set - MODELLED_SAMPLING
                if getattr(self, name) is not None
            }
            kwargs = {k: v for k, v in modelled.items() if v is not None}
            return SamplingParams(**kwargs, extra=extra)

    class GenerateReqInput(Strict):
        """One prompt of ``/generate`` (a batch is split into these first)."""

        text: str | None = None
        input_ids: list[TokenId] | None = None
        sampling_params: SamplingParamsInput | None = None
        rid: Name | None = None
        return_logprob: bool | None = None
        logprob_start_len: Literal[-1] | None = None
        top_logprobs_num: Literal[0] | None = None
        return_text_in_logprobs: bool | None = None
        stream: Literal[False] | None = None
        lora_path: Name | None = None

        @model_validator(mode="after")
        def _one_prompt(self) -> GenerateReqInput:
            if (self.text is None) == (self.input_ids is None):
                raise ValueError("give exactly one of 'text' or 'input_ids'")
            return self

    class ChatMessage(BaseModel):
        """One chat message: ``role`` and ``content`` checked; other keys (``name``, …) go to
        the chat template as they are."""

        model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False, frozen=True)
        role: Name
        content: str | None = None

    class ChatCompletionRequest(Strict):
        """``/v1/chat/completions`` (OpenAI's fields and SGLang's extensions that mizzen uses)."""

        messages: Annotated[list[ChatMessage], Field(min_length=1)]
        model: str = "default"
        lora_path: Name | None = None
        max_tokens: Count | None = None
        max_completion_tokens: Count | None = None
        temperature: Temperature | None = None
        top_p: TopP | None = None
        top_k: TopK | None = None
        min_p: Probability | None = None
        stop: list[str] | None = None
        stop_token_ids: list[TokenId] | None = None
        ignore_eos: bool | None = None
        seed: Seed | None = None
        n: Literal[1] | None = None
        logprobs: bool | None = None
        top_logprobs: Literal[0] | None = None
        stream: Literal[False] | None = None
        rid: Name | None = None
        return_prompt_token_ids: bool | None = None
        return_token_ids: bool | None = None

        _stop = field_validator("stop", mode="before")(one_or_list)
        _top_k = field_validator("top_k")(no_zero_top_k)

        def to_sampling(self) -> SamplingParams:
            values = {
                "max_new_tokens": self.max_completion_tokens or self.max_tokens,
                "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "min_p": self.min_p, "stop": self.stop, "stop_token_ids": self.stop_token_ids,
                "ignore_eos": self.ignore_eos, "seed": self.seed,
            }  # fmt: skip
            return SamplingParams(**{k: v for k, v in values.items() if v is not None})

    class AbortReq(Strict):
        rid: str = ""
        abort_all: bool = False

    class TokenizeReqInput(Strict):
        prompt: str
        add_special_tokens: bool = True

    class UpdateWeightFromDiskReqInput(Strict):
        model_path: Name
        load_format: Literal["auto"] | None = None
        abort_all_requests: bool | None = None
        weight_version: str | None = None

    class LoadLoRAAdapterReqInput(Strict):
        lora_name: Name
        lora_path: Name
        pinned: bool = False  # nothing is ever evicted here: accepted, no effect

    class UnloadLoRAAdapterReqInput(Strict):
        lora_name: Name

    models = {
        "SamplingParamsInput": SamplingParamsInput,
        "GenerateReqInput": GenerateReqInput,
        "ChatMessage": ChatMessage,
        "ChatCompletionRequest": ChatCompletionRequest,
        "AbortReq": AbortReq,
        "TokenizeReqInput": TokenizeReqInput,
        "UpdateWeightFromDiskReqInput": UpdateWeightFromDiskReqInput,
        "LoadLoRAAdapterReqInput": LoadLoRAAdapterReqInput,
        "UnloadLoRAAdapterReqInput": UnloadLoRAAdapterReqInput,
    }
    assert set(models) == set(MODEL_NAMES)
    return models
