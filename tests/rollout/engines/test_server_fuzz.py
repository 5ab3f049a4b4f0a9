"""Schema fuzzing of every endpoint of the embedded engine (hypothesis), over real HTTP on
127.0.0.1 against the tiny-model server (``limited_server``).

Property: whatever the body -- random JSON values at any field of a valid request (wrong types,
huge and non-finite numbers, deep nesting), random objects, random bytes -- the server answers
with a 2xx or a 4xx, never a 5xx, never a dropped connection, never a hang (each exchange within
30 s); and a good ``/generate`` is answered 200 afterwards.  Example counts are small (the
generating endpoints run the tiny model): see ``EXAMPLES``.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=30, labels=["engine", "rollout"])

EXAMPLES = {"mutated": 120, "objects": 60, "bytes": 40, "nesting": 15}
#: a valid body per endpoint, mutated one field at a time
VALID = {
    "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 2, "temperature": 0.5}},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/abort_request": {"rid": "nobody", "abort_all": False},
    "/tokenize": {"prompt": "hi", "add_special_tokens": True},
    "/update_weights_from_disk": {"model_path": "/nowhere"},
    "/load_lora_adapter": {"lora_name": "a", "lora_path": "/nowhere"},
    "/unload_lora_adapter": {"lora_name": "a"},
}
FIELDS = {
    "/generate": ["text", "input_ids", "rid", "return_logprob", "logprob_start_len",
                  "top_logprobs_num", "stream", "lora_path", "sampling_params"],
    "/v1/chat/completions": ["messages", "model", "max_tokens", "temperature", "top_p", "top_k",
                             "min_p", "stop", "stop_token_ids", "seed", "n", "logprobs", "rid"],
}  # fmt: skip
SAMPLING_FIELDS = [
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids",
    "ignore_eos", "sampling_seed", "n", "custom_params", "json_schema", "repetition_penalty",
]  # fmt: skip

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2**31, 2**63, 2**64, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def mutated_requests(draw):
    path = draw(st.sampled_from(sorted(VALID)))
    body = json.loads(json.dumps(VALID[path]))
    if path == "/generate" and draw(st.booleans()):
        field = draw(st.sampled_from(SAMPLING_FIELDS))
        body["sampling_params"][field] = draw(json_values)
    else:
        field = draw(st.sampled_from([*FIELDS.get(path, sorted(body)), "unknown_field"]))
        body[field] = draw(json_values)
    if path == "/generate" and isinstance(body.get("text"), str) and draw(st.booleans()):
        body["text"] = [body["text"], "x"]  # the batch form
    return path, body


def _encode(body) -> bytes:
    return json.dumps(body, allow_nan=True).encode()  # NaN / Infinity as Python's json writes


def _check(client: httpx.Client, path: str, content: bytes) -> None:
    answer = client.post(path, content=content)
    assert 200 <= answer.status_code < 300 or 400 <= answer.status_code < 500, (
        path, content[:300], answer.status_code, answer.text[:500],
    )  # fmt: skip
    if answer.status_code >= 400:
        assert "message" in json.dumps(answer.json())  # a JSON error that says what


@pytest.fixture(scope="module")
def client(limited_server):
    with httpx.Client(base_url=limited_server.url, timeout=30) as client:
        yield client
    good = {"text": "after", "sampling_params": {"max_new_tokens": 2}, "rid": "after-fuzz"}
    answer = httpx.post(f"{limited_server.url}/generate", json=good, timeout=30)
    assert answer.status_code == 200 and answer.json()["meta_info"]["id"] == "after-fuzz"


def _settings(name: str):
    return settings(
        max_examples=EXAMPLES[name], deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )  # fmt: skip


@given(request=mutated_requests())
@_settings("mutated")
def test_any_value_at_any_field_is_a_2xx_or_a_4xx(client, request):
    path, body = request
    if path in ("/generate", "/v1/chat/completions"):
        # a valid-but-long generation is not what this property is about: cap it when it is an int
        params = body.get("sampling_params") if path == "/generate" else body
        for key in ("max_new_tokens", "max_tokens"):
            if isinstance(params, dict) and type(params.get(key)) is int and params[key] > 8:
                params[key] = 8
    _check(client, path, _encode(body))


@given(path=st.sampled_from(sorted(VALID)), body=json_values)
@_settings("objects")
def test_any_json_body_is_a_2xx_or_a_4xx(client, path, body):
    _check(client, path, _encode(body))


@given(path=st.sampled_from(sorted(VALID)), content=st.binary(max_size=64))
@_settings("bytes")
def test_any_bytes_are_a_4xx(client, path, content):
    answer = client.post(path, content=content)
    try:
        json.loads(content)
        decodable = True
    except ValueError:
        decodable = False
    assert 400 <= answer.status_code < 500 or (decodable and answer.status_code < 300)


@given(
    path=st.sampled_from(sorted(VALID)),
    depth=st.integers(min_value=1, max_value=200_000),
    opener=st.sampled_from(["[", '{"a":']),
)
@_settings("nesting")
def test_any_nesting_depth_is_a_2xx_or_a_4xx(client, path, depth, opener):
    closer = "]" if opener == "[" else "}"
    _check(client, path, (opener * depth + "1" + closer * depth).encode())
