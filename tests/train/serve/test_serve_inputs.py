"""``mizzen-train serve``'s untrusted inputs that need no server: the API-key file, the
configuration, checkpoint names and the wire decoder.  Each refusal is one line naming the file
(and line) or the field, the rule and the fix -- and never contains a key."""

from __future__ import annotations

import re

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_train.run.config import ConfigError
from mizzen_train.serve.auth import KeyFileError, read_key_file
from mizzen_train.serve.config import parse_serve_config
from mizzen_train.serve.state import check_name
from mizzen_train.serve.wire import WireError, decode_forward_backward

register_cpu_ci(est_time=8, labels=["train"])

KEY = "tml-" + "a" * 30


@pytest.mark.parametrize(
    ("text", "line", "rule"),
    [
        (f"alice {KEY}\nbob\n", 2, "[key-line]"),
        (f"al/ice {KEY}\n", 1, "[tenant-name]"),
        ("alice sk-" + "a" * 30 + "\n", 1, "[key-format]"),
        (f"# comment\nalice {KEY}\nbob {KEY}\n", 3, "[key-unique]"),
    ],
)
def test_key_file_refusals_name_the_line_and_never_the_key(tmp_path, text, line, rule):
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(KeyFileError) as caught:
        read_key_file(path)
    message = str(caught.value)
    assert message.startswith(f"{path}:{line}: {rule}") and "Fix:" in message
    assert "a" * 30 not in message


def test_keys_map_to_their_tenant_only(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"alice {KEY}\nbob tml-{'b' * 30}\n")
    table = read_key_file(path)
    assert table.tenant_of(KEY) == "alice"
    assert table.tenant_of(f"tml-{'b' * 30}") == "bob"
    assert table.tenant_of(KEY[:-1]) is None and table.tenant_of(None) is None
    assert KEY not in repr(table) and "alice" in repr(table)


def test_config_refusals_name_the_field(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"alice {KEY}\n")
    server = {"state_dir": str(tmp_path / "s"), "api_keys_file": str(keys)}
    for model, field in [
        ({"path": "tiny", "slots": 0}, "model.slots"),
        ({"path": "tiny", "tiny": {"no_such_field": 1}}, "model.tiny"),
        ({"path": str(tmp_path / "missing")}, "model.path"),
        ({"path": "tiny", "api_key": KEY}, "model.api_key"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(field)):
            parse_serve_config({"server": server, "model": model})
    missing = dict(server, api_keys_file=str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match=re.escape("server.api_keys_file")):
        parse_serve_config({"server": missing, "model": {"path": "tiny"}})
    config = parse_serve_config({"server": server, "model": {"path": "tiny", "name": "m"}})
    assert config.base_model_name == "m" and config.sampling.engine == "embedded"


@pytest.mark.parametrize("name", ["../x", ".hidden", "a/b", "", "x" * 65, 7, "tinker://m/w/x"])
def test_checkpoint_names_are_names_not_paths(name):
    with pytest.raises(WireError, match="not a checkpoint name"):
        check_name(name, "path")


def test_wire_decoder_refuses_garbage_and_image_chunks():
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    with pytest.raises(WireError, match="not a ForwardBackwardRequest"):
        decode_forward_backward(b"\xff\x00" * 8, limit=1 << 20)
    with pytest.raises(WireError, match="Content-Encoding 'gzip' is not served"):
        decode_forward_backward(b"", content_encoding="gzip", limit=1 << 20)
    image = types.ImageChunk(data=b"\x89PNG", format="png", expected_tokens=4)
    datum = types.Datum(model_input=types.ModelInput(chunks=[image]), loss_fn_inputs={})
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"),
        model_id="m",
        seq_id=1,
    )
    body = forward_backward_request_to_proto(request).SerializeToString()
    with pytest.raises(WireError, match="image chunks are not served"):
        decode_forward_backward(body, limit=1 << 20)


def test_a_zstd_frame_is_unpacked_only_up_to_the_limit():
    """A 64 MiB frame of zeros compresses to kilobytes and declares its size: the decoder reads
    one byte past the limit and refuses (413), it does not unpack what the frame declares."""
    import tracemalloc

    import zstandard

    bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 * 1024 * 1024))
    assert len(bomb) < 64 * 1024
    tracemalloc.start()
    try:
        with pytest.raises(WireError, match="more than 1048576 bytes once decompressed") as caught:
            decode_forward_backward(bomb, content_encoding="zstd", limit=1 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert caught.value.status == 413
    assert peak < 8 * 1024 * 1024, f"peak {peak} bytes while decoding"


def test_finished_operations_keep_their_result_only_within_the_byte_budget():
    from mizzen_train.serve.operations import OperationBook

    book = OperationBook(max_queue=4, keep=1000, keep_bytes=10_000)
    ops = []
    for index in range(8):
        op, _ = book.submit("alice", "m", "forward", b"rows" * 100_000, key=("seq", index))
        op.succeed("application/x-protobuf", b"r" * 3_000)
        book.pop([op])
        assert op.payload is None, "a finished operation keeps its rows"
        ops.append(op)
    kept = [op for op in ops if book.future("alice", op.request_id) is not None]
    assert kept == ops[-3:], "not the newest results within 10,000 bytes"
    assert book.future("alice", ops[0].request_id) is None
    assert "m" not in book.queues  # an empty queue is not kept either


def test_every_finished_operation_counts_against_the_byte_budget_queued_or_not():
    from mizzen_train.serve.operations import OperationBook

    book = OperationBook(max_queue=4, keep=1000, keep_bytes=10_000)
    ops = []
    for _ in range(8):  # samples: never queued, never popped
        op, _ = book.submit("alice", "sampler:s", "sample", None, queued=False)
        op.succeed("application/x-protobuf", b"s" * 3_000)
        ops.append(op)
    kept = [op for op in ops if book.future("alice", op.request_id) is not None]
    assert kept == ops[-3:], "sample results are not held within 10,000 bytes"


def test_a_key_names_one_request_body():
    from mizzen_train.serve.operations import KeyReused, OperationBook

    book = OperationBook(max_queue=4)
    first, fresh = book.submit("alice", "m", "optim_step", None, key=("seq", "optim_step", 3),
                               digest=b"one")  # fmt: skip
    retry, again = book.submit("alice", "m", "optim_step", None, key=("seq", "optim_step", 3),
                               digest=b"one")  # fmt: skip
    assert fresh and not again and retry is first
    with pytest.raises(KeyReused, match="seq_id 3: names an earlier request") as caught:
        book.submit("alice", "m", "optim_step", None, key=("seq", "optim_step", 3), digest=b"two")
    assert caught.value.status == 409


def test_an_internal_failure_tells_the_client_an_incident_id_not_the_exception(caplog):
    from mizzen_train.serve.operations import internal_error

    try:
        raise OSError(36, "File name too long", "/srv/state/checkpoints/" + "9" * 300)
    except OSError:
        message = internal_error("operation save_weights")
    assert "/srv/state" not in message and "File name too long" not in message
    incident = message.split("incident ")[1].split(",")[0]
    logged = [r for r in caplog.records if incident in r.getMessage()]
    assert logged and "/srv/state" in str(logged[0].exc_info[1])


def test_results_are_forgotten_in_the_order_they_finished_never_the_last_one():
    from mizzen_train.serve.operations import OperationBook

    book = OperationBook(max_queue=4, keep=1000, keep_bytes=1_024)
    slow, _ = book.submit("alice", "sampler:s", "sample", None, queued=False)
    quick = []
    for _ in range(3):
        op, _ = book.submit("alice", "sampler:s", "sample", None, queued=False)
        op.succeed("application/x-protobuf", b"q" * 400)
        quick.append(op)
    slow.succeed("application/x-protobuf", b"s" * 400)  # finishes last: its client reads it
    kept = [op for op in [slow, *quick] if book.future("alice", op.request_id) is not None]
    assert kept == [slow, quick[2]], "not the results that finished last within 1,024 bytes"
    huge, _ = book.submit("alice", "sampler:s", "sample", None, queued=False)
    huge.succeed("application/x-protobuf", b"h" * 5_000)  # alone beyond the budget: still read
    assert book.future("alice", huge.request_id) is huge
