"""Protocol shapes, pinned to SGLang's documented request/response fields.

The literal tables below are transcribed from SGLang's documentation
(``docs/basic_usage/sampling_params.md``: the ``/generate`` argument table and the sampling
parameter tables) and from the answer shape its tokenizer manager builds (``text``,
``output_ids``, ``meta_info`` with ``id``, ``finish_reason``, ``prompt_tokens``,
``completion_tokens``, ``cached_tokens``, ``output_token_logprobs`` as
``[logprob, token_id, text]``).  If :mod:`mizzen_rollout.engines.protocol` ever sends or expects a
field outside them, these tests fail.
"""

from __future__ import annotations

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_rollout.engines import protocol
from mizzen_rollout.engines.base import (
    ChatRequest,
    EngineProtocolError,
    FinishReason,
    GenerateRequest,
    SamplingParams,
)
from mizzen_rollout.engines.embedded import schema
from mizzen_rollout.engines.embedded.app import generate_requests

register_cpu_ci(est_time=3, labels=["engine", "rollout"])

# /generate arguments documented by SGLang (GenerateReqInput).
SGLANG_GENERATE_ARGS = {
    "text",
    "input_ids",
    "input_embeds",
    "image_data",
    "audio_data",
    "sampling_params",
    "rid",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "token_ids_logprob",
    "return_text_in_logprobs",
    "stream",
    "lora_path",
    "custom_logit_processor",
    "return_hidden_states",
}
# sampling_params documented by SGLang (SamplingParams), plus sampling_seed (OpenAI ``seed``).
SGLANG_SAMPLING_PARAMS = {
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "n",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "custom_params",
    "sampling_seed",
}
# A /generate answer in the shape SGLang's tokenizer manager builds (return_logprob=True).
SGLANG_GENERATE_ANSWER = {
    "text": " Paris.",
    "output_ids": [12366, 13, 151645],
    "meta_info": {
        "id": "req-7",
        "finish_reason": {"type": "stop", "matched": 151645},
        "prompt_tokens": 6,
        "weight_version": "default",
        "input_token_logprobs": [],
        "output_token_logprobs": [[-0.25, 12366, None], [-0.5, 13, None], [-0.01, 151645, None]],
        "completion_tokens": 3,
        "cached_tokens": 0,
        "e2e_latency": 0.0123,
    },
}
# An OpenAI-compatible chat answer as SGLang returns it (logprobs and token ids requested).
SGLANG_CHAT_ANSWER = {
    "id": "c-1",
    "object": "chat.completion",
    "created": 1,
    "model": "default",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hi", "reasoning_content": None},
            "logprobs": {
                "content": [
                    {"token": "Hi", "logprob": -0.3, "bytes": [72, 105], "top_logprobs": []}
                ]
            },
            "finish_reason": "length",
            "matched_stop": None,
            "prompt_token_ids": [1, 2, 3],
            "token_ids": [9],
        }
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}


def test_every_field_mizzen_uses_is_documented():
    # what the embedded server accepts (test_sglang_contract.py checks it against SGLang's wheel)
    assert set(schema.GenerateReqInput.model_fields) <= SGLANG_GENERATE_ARGS
    assert set(schema.SamplingParamsInput.model_fields) == SGLANG_SAMPLING_PARAMS
    assert {
        "id",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
    } <= protocol.META_INFO_FIELDS
    assert {"stop", "length", "abort"} == protocol.FINISH_REASON_TYPES
    assert {"rid", "abort_all"} == set(schema.AbortReq.model_fields)
    assert (protocol.GENERATE_PATH, protocol.CHAT_PATH, protocol.ABORT_PATH) == (
        "/generate",
        "/v1/chat/completions",
        "/abort_request",
    )
    assert (protocol.HEALTH_PATH, protocol.TOKENIZE_PATH) == ("/health", "/tokenize")


def test_generate_payload_uses_documented_fields_only():
    sampling = SamplingParams(
        max_new_tokens=16, temperature=0.7, stop=["\n"], stop_token_ids=[2], ignore_eos=True, seed=3
    )
    for request in (
        GenerateRequest("r1", text="hi", sampling=sampling, return_logprob=True),
        GenerateRequest("r2", input_ids=[1, 2], sampling=sampling, lora_path="slot-a"),
    ):
        payload = protocol.build_generate_payload(request)
        assert set(payload) <= SGLANG_GENERATE_ARGS
        assert set(payload["sampling_params"]) <= SGLANG_SAMPLING_PARAMS
        assert payload["rid"] == request.request_id
    payload = protocol.build_generate_payload(
        GenerateRequest("r1", text="hi", sampling=sampling, return_logprob=True)
    )
    assert payload["text"] == "hi" and "input_ids" not in payload
    assert payload["sampling_params"] == {
        "max_new_tokens": 16,
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "stop": ["\n"],
        "stop_token_ids": [2],
        "ignore_eos": True,
        "sampling_seed": 3,
    }
    assert payload["return_logprob"] is True


def test_parse_documented_generate_answer():
    result = protocol.parse_generate_response(
        SGLANG_GENERATE_ANSWER, request_id="req-7", engine="http://e", latency_s=0.5
    )
    assert result.text == " Paris."
    assert result.output_ids == (12366, 13, 151645)
    assert result.output_logprobs == (-0.25, -0.5, -0.01)
    assert result.finish == FinishReason("stop", matched=151645)
    assert (result.prompt_tokens, result.completion_tokens) == (6, 3)
    assert (result.engine, result.latency_s) == ("http://e", 0.5)


def test_older_answers_without_output_ids_take_ids_from_logprobs():
    answer = {k: v for k, v in SGLANG_GENERATE_ANSWER.items() if k != "output_ids"}
    result = protocol.parse_generate_response(answer, request_id="r", engine="e")
    assert result.output_ids == (12366, 13, 151645)


@pytest.mark.parametrize(
    ("finish_reason", "expected"),
    [
        ({"type": "length", "length": 3}, FinishReason("length")),
        ({"type": "stop", "matched": "\n"}, FinishReason("stop", matched="\n")),
        (
            {"type": "abort", "message": "Abort request", "status_code": None, "err_type": None},
            FinishReason("abort", message="Abort request"),
        ),
    ],
)
def test_finish_reasons(finish_reason, expected):
    answer = {**SGLANG_GENERATE_ANSWER, "meta_info": {**SGLANG_GENERATE_ANSWER["meta_info"]}}
    answer["meta_info"]["finish_reason"] = finish_reason
    assert protocol.parse_generate_response(answer, request_id="r", engine="e").finish == expected


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda a: a.pop("meta_info"), "'meta_info'"),
        (lambda a: a["meta_info"].pop("completion_tokens"), "'meta_info.completion_tokens'"),
        (lambda a: a["meta_info"].update(finish_reason="stop"), "'meta_info.finish_reason'"),
        (lambda a: a["meta_info"].update(prompt_tokens="6"), "'meta_info.prompt_tokens'"),
        (
            lambda a: a["meta_info"]["output_token_logprobs"].__setitem__(1, [None, 13, None]),
            "'meta_info.output_token_logprobs[1][0]'",
        ),
        (lambda a: a.update(output_ids=[1]), "'output_ids' has 1"),
    ],
)
def test_malformed_answers_name_the_field(mutate, field):
    import copy

    answer = copy.deepcopy(SGLANG_GENERATE_ANSWER)
    mutate(answer)
    with pytest.raises(EngineProtocolError) as info:
        protocol.parse_generate_response(answer, request_id="r", engine="http://e")
    assert field in str(info.value)


def test_chat_payload_and_documented_answer():
    request = ChatRequest(
        "c-1",
        messages=[{"role": "user", "content": "hello"}],
        sampling=SamplingParams(max_new_tokens=4, seed=9),
        return_logprob=True,
    )
    payload = protocol.build_chat_payload(request)
    assert set(payload) <= set(schema.ChatCompletionRequest.model_fields)
    assert payload["rid"] == "c-1" and payload["max_tokens"] == 4 and payload["seed"] == 9
    assert payload["logprobs"] is True and payload["return_token_ids"] is True
    result = protocol.parse_chat_response(SGLANG_CHAT_ANSWER, request_id="c-1", engine="e")
    assert result.text == "Hi"
    assert result.finish.kind == "length"
    assert (result.prompt_token_ids, result.output_ids) == ((1, 2, 3), (9,))
    assert result.output_logprobs == (-0.3,)
    assert (result.prompt_tokens, result.completion_tokens) == (3, 1)


def test_server_side_round_trip_and_rejections():
    request = GenerateRequest(
        "r9", input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=5, seed=4)
    )
    parsed, batched = generate_requests(protocol.build_generate_payload(request), max_size=1)
    assert parsed == [request] and not batched
    body = protocol.build_generate_response(
        request_id="r9",
        text="ab",
        output_ids=[5, 6],
        finish=FinishReason("length"),
        prompt_tokens=3,
        output_logprobs=[-1.0, -2.0],
        e2e_latency=0.1,
    )
    assert set(body) == {"text", "output_ids", "meta_info"}
    assert set(body["meta_info"]) <= protocol.META_INFO_FIELDS
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
    back = protocol.parse_generate_response(body, request_id="r9", engine="e")
    assert back.output_ids == (5, 6) and back.output_logprobs == (-1.0, -2.0)
    for body, message in (
        ({"prompt": "x"}, "field 'prompt': Extra inputs are not permitted"),
        ({"text": "x", "input_ids": [1]}, "exactly one of 'text' or 'input_ids'"),
        ({"text": "x", "sampling_params": {"temp": 1}}, "field 'sampling_params.temp': Extra"),
    ):
        with pytest.raises(schema.RequestRefused, match=message):
            generate_requests(body, max_size=1)
    abort = schema.validate("AbortReq", protocol.build_abort_payload("r9"), "abort")
    assert (abort.rid, abort.abort_all) == ("r9", False)


@pytest.mark.parametrize(
    "changes",
    [
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"min_p": 1.5},
        {"top_k": 2**40},
        {"seed": 2**80},
        {"stop_token_ids": (-3,)},
        {"max_new_tokens": 2**31},
    ],
    ids=["nan-temperature", "inf-temperature", "min-p", "top-k", "seed", "stop-id", "max-new"],
)
def test_sampling_params_refuse_what_the_engine_schema_refuses(changes):
    """One set of ranges (engines.base): what a client builds, the embedded server accepts."""
    from mizzen_rollout.engines.base import SamplingParams

    with pytest.raises(ValueError, match=next(iter(changes))):
        SamplingParams(**changes)
