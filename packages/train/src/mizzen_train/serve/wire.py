"""The Tinker wire format of the pinned SDK: its pydantic request types and protobuf schema in,
its response shapes out.  Nothing here is re-described: requests are validated by the SDK's own
``tinker.types`` models and ``tinker.proto.tinker_public_pb2`` messages; responses are built
from the same types (JSON) or messages (protobuf, for the two types the SDK reads as protobuf:
``ForwardBackwardOutput`` and ``SampleResponse``).

Invariants:
- Every body is untrusted: a body that does not parse, a wrong type, an unknown field (the SDK's
  request models are strict), a chunk kind the server does not serve or a tensor whose bytes do
  not match its shape raises :class:`WireError` (HTTP 400) naming the field and the fix -- never
  another exception.
- Sizes are bounded before decoding (the app caps the body; zstd output is capped here).
- Importing this module imports numpy only: tinker (the ``serve`` extra), pydantic and protobuf
  load inside the functions, so ``mizzen_train`` imports without the extra.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "PROTOBUF",
    "WireError",
    "check_token_ids",
    "decode_forward_backward",
    "encode_forward_backward_output",
    "encode_sample_response",
    "parse_json",
]

PROTOBUF = "application/x-protobuf"


def _pb():
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


def _proto_dtypes() -> dict[int, tuple[str, type]]:
    pb = _pb()
    return {pb.DTYPE_FLOAT32: ("float32", np.float32), pb.DTYPE_INT64: ("int64", np.int64)}


class WireError(ValueError):
    """A request the server refuses: ``status`` (4xx) and a message naming field, rule, fix."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def check_token_ids(field: str, ids: Sequence[int] | np.ndarray, vocab_size: int) -> None:
    """The one rule of the token ids a request carries (a training row's inputs and targets, a
    sampling prompt, stop tokens): each in ``[0, vocab_size)``; else WireError(400) naming
    ``field`` and the first id outside."""
    if isinstance(ids, np.ndarray):
        outside_at = np.flatnonzero((ids < 0) | (ids >= vocab_size))
        outside = int(ids[outside_at[0]]) if outside_at.size else None
    else:
        outside = next((t for t in ids if not 0 <= t < vocab_size), None)
    if outside is not None:
        raise WireError(
            400, f"{field}: token id {outside} is outside the vocabulary [0, {vocab_size}). "
            "Fix: tokenize with the served model's tokenizer",
        )  # fmt: skip


def parse_json[T](model: type[T], body: bytes, what: str) -> T:
    """``body`` as the SDK's request type ``model``; WireError(400) naming the first bad field."""
    import pydantic

    try:
        return model.model_validate_json(body)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise WireError(
            400, f"{what}: field {where!r}: {first['msg']}. Fix: send a {model.__name__} body"
        ) from None


def _decompress(body: bytes, encoding: str, limit: int) -> bytes:
    if encoding in ("", "identity"):
        return body
    if encoding != "zstd":
        raise WireError(415, f"Content-Encoding {encoding!r} is not served. Fix: send zstd or none")
    import io

    import zstandard

    # read at most limit + 1 bytes of output, whatever size the frame declares (a small frame may
    # declare, and hold, gigabytes)
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body)) as reader:
            data = reader.read(limit + 1)
    except zstandard.ZstdError:
        raise WireError(400, "body: not a zstd frame") from None
    if len(data) > limit:
        raise WireError(413, f"body: more than {limit} bytes once decompressed. Fix: send fewer "
                             "datums a call")  # fmt: skip
    return data


def decode_forward_backward(
    body: bytes, *, content_encoding: str = "", limit: int
) -> tuple[Any, bool]:
    """The SDK's protobuf ``/forward_backward`` body as its pydantic request and forward_only."""
    import pydantic
    from google.protobuf.message import DecodeError
    from tinker import types

    message = _pb().ForwardBackwardRequest()
    try:
        message.ParseFromString(_decompress(body, content_encoding, limit))
    except DecodeError:
        raise WireError(400, "forward_backward: body is not a ForwardBackwardRequest") from None
    config: dict[str, float | str] = {k: float(v) for k, v in message.loss_fn_config.items()}
    for key, value in message.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else float(value.number)
    data = [_datum(index, datum) for index, datum in enumerate(message.data)]
    try:
        request = types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(
                data=data, loss_fn=message.loss_fn, loss_fn_config=config or None
            ),
            model_id=message.model_id,
            seq_id=message.seq_id,
        )
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise WireError(400, f"forward_backward: field {where!r}: {first['msg']}") from None
    return request, bool(message.forward_only)


def _datum(index: int, datum: Any):
    from tinker import types

    tokens: list[int] = []
    for chunk in datum.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise WireError(
                400,
                f"forward_backward: data[{index}].model_input: {kind or 'empty'} chunks are not "
                "served. Fix: send token chunks (ModelInput.from_ints)",
            )
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise WireError(400, f"forward_backward: data[{index}]: token bytes not int32")
        tokens.extend(np.frombuffer(raw, dtype=np.int32).tolist())
    inputs = {
        name: _tensor(f"data[{index}].loss_fn_inputs.{name}", tensor)
        for name, tensor in datum.loss_fn_inputs.items()
    }
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def _tensor(where: str, message: Any):
    from tinker import types

    dtypes = _proto_dtypes()
    if message.dtype not in dtypes:
        raise WireError(400, f"forward_backward: {where}: dtype must be float32 or int64")
    dtype_name, np_dtype = dtypes[message.dtype]
    shape = [int(n) for n in message.shape]
    if any(n < 0 for n in shape):
        raise WireError(400, f"forward_backward: {where}: shape {shape[:8]} has a negative size")
    if message.HasField("sparse_csr"):
        raise WireError(400, f"forward_backward: {where}: sparse tensors are not served")
    if len(message.dense) % np.dtype(np_dtype).itemsize:
        raise WireError(400, f"forward_backward: {where}: bytes are not whole {dtype_name}s")
    array = np.frombuffer(message.dense, dtype=np_dtype).copy()
    if shape and math.prod(shape) != array.size:  # Python ints: no wrap-around
        raise WireError(400, f"forward_backward: {where}: shape {shape} holds {array.size} values")
    return types.TensorData(data=array, dtype=dtype_name, shape=shape or [array.size])


def encode_forward_backward_output(
    outputs: Sequence[Mapping[str, np.ndarray]], metrics: Mapping[str, float]
) -> bytes:
    """``ForwardBackwardOutput`` as the SDK's protobuf: one ArrayRecord of per-datum 1-D fields."""
    pb = _pb()
    to_proto = {np.dtype(np.float32): pb.DTYPE_FLOAT32, np.dtype(np.int64): pb.DTYPE_INT64}
    message = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in metrics.items():
        message.metrics[key] = float(value)
    record = message.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(outputs))
    names = sorted(outputs[0]) if outputs else []
    for name in names:
        arrays = [np.ascontiguousarray(out[name]).reshape(-1) for out in outputs]
        dtype = arrays[0].dtype
        sizes = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        batched = record.fields[name]
        batched.data = b"".join(a.tobytes() for a in arrays)
        batched.offsets = sizes.tobytes()
        batched.dtype = to_proto[dtype]
    return message.SerializeToString()


def encode_sample_response(
    sequences: Sequence[tuple[str, Sequence[int], Sequence[float]]],
) -> bytes:
    """``SampleResponse`` as the SDK's protobuf from ``(stop_reason, tokens, logprobs)``."""
    pb = _pb()
    stops = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
    message = pb.SampleResponse()
    for stop, tokens, logprobs in sequences:
        message.sequences.add(
            stop_reason=stops[stop],
            tokens=np.asarray(tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(logprobs, dtype=np.float32).tobytes(),
        )
    return message.SerializeToString()
