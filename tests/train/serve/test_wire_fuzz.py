"""Property test of the training service's protobuf decoder (``serve.wire``), hypothesis-driven.

Property: whatever the ``/forward_backward`` body -- random bytes, or a well-formed
``ForwardBackwardRequest`` whose every field holds a random value of its protobuf type (token
bytes of any length, any dtype number, any int64 shape, any dense bytes, any loss name and config,
chunks of every kind, empty or absent fields) -- :func:`decode_forward_backward` returns a request
or raises :class:`WireError` with a 4xx status; no other exception (the app would answer 500).
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tinker.proto import tinker_public_pb2 as pb

from mizzen_ci import register_cpu_ci
from mizzen_train.serve.wire import WireError, decode_forward_backward

register_cpu_ci(est_time=10, labels=["train"])

LIMIT = 1 << 20
int64s = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.sampled_from([0, 1, -1, 2**31, 2**62, -(2**63)]),
)
int32s = st.one_of(st.integers(-(2**31), 2**31 - 1), st.sampled_from([0, -1, 2**31 - 1]))
floats = st.floats(allow_nan=True, allow_infinity=True, width=64)
short_bytes = st.binary(max_size=64)


def _fill_tensor(draw, message) -> None:
    message.dtype = draw(st.one_of(st.sampled_from([0, 1, 2, 3]), int32s))
    message.shape.extend(draw(st.lists(int64s, max_size=4)))
    message.dense = draw(short_bytes)
    if draw(st.integers(0, 3)) == 0:
        message.sparse_csr.SetInParent()


@st.composite
def requests(draw):
    message = pb.ForwardBackwardRequest(
        model_id=draw(st.text(max_size=12)),
        seq_id=draw(int32s),
        loss_fn=draw(st.one_of(st.sampled_from(["cross_entropy", "importance_sampling", "ppo"]),
                               st.text(max_size=12))),
        forward_only=draw(st.booleans()),
    )  # fmt: skip
    for key, value in draw(st.dictionaries(st.text(max_size=6), floats, max_size=3)).items():
        message.loss_fn_config[key] = value
    for key in draw(st.lists(st.text(max_size=6), max_size=3)):
        entry = message.loss_fn_config_v2[key]
        choice = draw(st.sampled_from(["text", "number", "none"]))
        if choice == "text":
            entry.text = draw(st.text(max_size=8))
        elif choice == "number":
            entry.number = draw(floats)
    for _ in range(draw(st.integers(0, 3))):
        datum = message.data.add()
        for _ in range(draw(st.integers(0, 3))):
            chunk = datum.model_input.add()
            kind = draw(st.sampled_from(["encoded_text", "image", "dmel", "none"]))
            if kind == "encoded_text":
                chunk.encoded_text.tokens = draw(short_bytes)
            elif kind != "none":
                getattr(chunk, kind).SetInParent()
        names = st.one_of(st.sampled_from(["target_tokens", "weights", "logprobs", "advantages"]),
                          st.text(max_size=8))  # fmt: skip
        for name in draw(st.lists(names, max_size=3)):
            _fill_tensor(draw, datum.loss_fn_inputs[name])
    return message.SerializeToString()


def _decodes_or_refuses(body: bytes, encoding: str = "") -> None:
    try:
        decode_forward_backward(body, content_encoding=encoding, limit=LIMIT)
    except WireError as exc:
        assert 400 <= exc.status < 500, exc


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_any_well_formed_message_decodes_or_is_refused(body):
    _decodes_or_refuses(body)


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=256), st.sampled_from(["", "identity", "zstd", "br"]))
def test_any_bytes_decode_or_are_refused(body, encoding):
    _decodes_or_refuses(body, encoding)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests(), st.data())
def test_a_corrupted_message_decodes_or_is_refused(body, data):
    if body:
        at = data.draw(st.integers(0, len(body) - 1))
        body = body[:at] + data.draw(st.binary(min_size=1, max_size=4)) + body[at + 1 :]
    _decodes_or_refuses(body)
