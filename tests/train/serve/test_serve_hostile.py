"""``mizzen-train serve`` against requests nobody lists, over raw HTTP on 127.0.0.1.

Each case was a defect a probe found: one request must never fail the shared executor (every
tenant's), exhaust the server's memory, let a key hold more than its share of slots, answer a
request with another one's result, or answer 500 / log a traceback for what is the client's
doing.  Every refusal is a 4xx naming the field and the fix; after each, the server serves.
"""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=60, labels=["train"])

BASE = "tiny-llama"
SEQUENCE = [ord(c) + 3 for c in "the cat sat on the mat, and the dog sat on the log!"]


SERVE_OVERRIDES = ("server.max_models_per_key=2", "server.body_timeout_s=1.5")


@pytest.fixture(scope="module")
def kit(serve_kit):
    return serve_kit


def post(kit, path, tenant="alice", **kwargs):
    headers = {**kit.headers(tenant), **kwargs.pop("headers", {})}
    return httpx.post(f"{kit.url}{path}", headers=headers, timeout=60, **kwargs)


def result(kit, tenant, request_id) -> dict:
    """The future's outcome: its JSON, or ``{"protobuf": ...}`` (a forward_backward's)."""
    while True:
        response = post(kit, "/api/v1/retrieve_future", tenant, json={"request_id": request_id})
        if "json" not in response.headers["content-type"]:
            return {"protobuf": response.content}
        body = response.json()
        if body.get("type") != "try_again":
            return body


def session(kit, tenant) -> str:
    response = post(
        kit,
        "/api/v1/create_session",
        tenant,
        json={"tags": [], "user_metadata": None, "sdk_version": "x"},
    )
    assert response.status_code == 200, response.text
    return response.json()["session_id"]


def create(kit, tenant, session_id, seq, *, wait=True, **lora):
    body = {"session_id": session_id, "model_seq_id": seq, "base_model": BASE,
            "lora_config": {"rank": 2, **lora}}  # fmt: skip
    response = post(kit, "/api/v1/create_model", tenant, json=body)
    if wait and response.status_code == 200:
        done = result(kit, tenant, response.json()["request_id"])
        assert done.get("type") == "create_model", done
    return response


def fb_body(model_id, seq_id, rows=1, targets=None, shape=None) -> bytes:
    """The SDK's protobuf body; ``shape`` is written into the message as it is (the SDK's own
    types would refuse it)."""
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    targets = SEQUENCE[1:] if targets is None else targets
    dtype = "float32" if isinstance(targets[0], float) else "int64"
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(SEQUENCE[:-1]),
        loss_fn_inputs={"target_tokens": types.TensorData(data=targets, dtype=dtype)},
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum] * rows,
                                                          loss_fn="cross_entropy"),
        model_id=model_id, seq_id=seq_id,
    )  # fmt: skip
    message = forward_backward_request_to_proto(request)
    if shape is not None:
        tensor = message.data[0].loss_fn_inputs["target_tokens"]
        del tensor.shape[:]
        tensor.shape.extend(shape)
    return message.SerializeToString()


def forward_backward(kit, tenant, model_id, seq_id, rows=1, **kwargs):
    return post(kit, "/api/v1/forward_backward", tenant, content=fb_body(model_id, seq_id, rows,
                **kwargs), headers={"Content-Type": "application/x-protobuf"})  # fmt: skip


def unload(kit, tenant, model_id, **kwargs):
    return post(kit, "/api/v1/unload_model", tenant, json={"model_id": model_id}, **kwargs)


def still_serves(kit, tenant="carol") -> None:
    """A fresh model of ``tenant`` trains one step: the executor (every tenant's) is usable."""
    sid = session(kit, tenant)
    model_id = create(kit, tenant, sid, 0).json()["model_id"]
    done = result(kit, tenant, forward_backward(kit, tenant, model_id, 1).json()["request_id"])
    assert "error" not in done, done
    assert result(kit, tenant, unload(kit, tenant, model_id).json()["request_id"])["type"] == (
        "unload_model"
    )


def test_a_seed_beyond_32_bits_is_refused_and_the_executor_keeps_serving(kit):
    sid = session(kit, "alice")
    response = create(kit, "alice", sid, 0, seed=2**50)
    assert response.status_code == 400, response.text
    assert "lora_config.seed" in response.json()["detail"] and "Fix:" in response.json()["detail"]
    still_serves(kit)


def test_a_key_holds_at_most_its_models_even_while_creates_are_queued(kit):
    sid = session(kit, "bob")
    busy = create(kit, "bob", sid, 0).json()["model_id"]
    # the executor is busy with a large step: the creates below are queued, not yet run
    pending = forward_backward(kit, "bob", busy, 1, rows=48)
    second = create(kit, "bob", sid, 1, wait=False)
    third = create(kit, "bob", sid, 2, wait=False)
    assert second.status_code == 200, second.text
    assert third.status_code == 422 and "holds 2 live models" in third.json()["detail"], third.text
    result(kit, "bob", pending.json()["request_id"])
    for model_id in (busy, second.json()["model_id"]):
        result(kit, "bob", unload(kit, "bob", model_id).json()["request_id"])


def test_a_model_whose_unload_is_queued_takes_no_more_operations(kit):
    sid = session(kit, "dave")
    model_id = create(kit, "dave", sid, 0).json()["model_id"]
    pending = forward_backward(kit, "dave", model_id, 1, rows=48)  # the unload waits behind it
    first = unload(kit, "dave", model_id)
    step = {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 1e-3}}
    refused = post(kit, "/api/v1/optim_step", "dave", json=step)
    assert refused.status_code == 404 and "being unloaded" in refused.json()["detail"], refused.text
    save = post(kit, "/api/v1/save_weights", "dave", json={"model_id": model_id, "path": "x"})
    assert save.status_code == 404, save.text
    second = unload(kit, "dave", model_id)  # the session's end, or the client's retry
    assert second.json()["request_id"] == first.json()["request_id"]
    assert "error" not in result(kit, "dave", pending.json()["request_id"])
    assert result(kit, "dave", first.json()["request_id"])["type"] == "unload_model"
    # the same model_seq_id again: the model is gone, not "created" again by an old answer
    again = create(kit, "dave", sid, 0, wait=False)
    assert again.status_code == 409 and "model_seq_id 0" in again.json()["detail"], again.text
    assert "Traceback" not in kit.log()


def test_an_idempotency_key_reused_for_another_kind_is_another_request(kit):
    sid = session(kit, "alice")
    model_id = create(kit, "alice", sid, 5).json()["model_id"]
    headers = {"X-Idempotency-Key": "k-1"}
    save = post(kit, "/api/v1/save_weights", "alice", headers=headers,
                json={"model_id": model_id, "path": "idem"})  # fmt: skip
    gone = unload(kit, "alice", model_id, headers=headers)
    assert gone.json()["request_id"] != save.json()["request_id"]
    assert result(kit, "alice", gone.json()["request_id"])["type"] == "unload_model"
    after = forward_backward(kit, "alice", model_id, 9)
    assert after.status_code == 404, after.text  # unloaded for real


@pytest.mark.parametrize(
    ("case", "field"),
    [
        ({"shape": [-1, -5]}, "negative size"),
        ({"shape": [2**32, 2**32]}, "holds"),
        ({"targets": [3.7] * (len(SEQUENCE) - 1)}, "not whole numbers"),
    ],
    ids=["negative-shape", "wrapping-shape", "fractional-token"],
)
def test_malformed_tensors_are_400_naming_the_input(kit, case, field):
    sid = session(kit, "alice")
    model_id = create(kit, "alice", sid, 7).json()["model_id"]
    response = forward_backward(kit, "alice", model_id, 1, **case)
    assert response.status_code == 400, response.text
    assert "target_tokens" in response.json()["detail"] and field in response.json()["detail"]
    result(kit, "alice", unload(kit, "alice", model_id).json()["request_id"])


def test_odd_bodies_get_4xx_and_no_traceback(kit):
    deep = b"[" * 100_000 + b"]" * 100_000
    response = post(kit, "/api/v1/weights_info", content=deep)
    assert response.status_code == 400, response.text
    step = {"model_id": "m", "adam_params": {"learning_rate": 1e-3, "beta1": 1.0}}
    response = post(kit, "/api/v1/optim_step", json=step)
    assert response.status_code == 400 and "beta1" in response.json()["detail"], response.text
    # a client that hangs up mid-body, and one that never finishes its body
    address = urlsplit(kit.url)
    head = (f"POST /api/v1/create_session HTTP/1.1\r\nHost: x\r\nX-API-Key: "
            f"{kit.headers('alice')['X-API-Key']}\r\nContent-Type: application/json\r\n"
            "Content-Length: 1000\r\n\r\n{").encode()  # fmt: skip
    with socket.create_connection((address.hostname, address.port)) as hung_up:
        hung_up.sendall(head)
    with socket.create_connection((address.hostname, address.port), timeout=30) as slow:
        slow.sendall(head)
        started = time.monotonic()
        answer = b""
        while b"}" not in answer and (chunk := slow.recv(4096)):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert time.monotonic() - started < 20
        assert b"server.body_timeout_s" in answer
    time.sleep(0.5)
    log = kit.log()
    assert "Traceback" not in log and "the client closed the connection mid-body" in log
    still_serves(kit)


def test_get_info_names_no_server_path(kit):
    sid = session(kit, "alice")
    model_id = create(kit, "alice", sid, 8).json()["model_id"]
    info = post(kit, "/api/v1/get_info", json={"model_id": model_id}).json()
    assert str(kit.state_dir) not in str(info) and info["model_data"]["tokenizer_id"] == BASE
    result(kit, "alice", unload(kit, "alice", model_id).json()["request_id"])


def sampler(kit, tenant) -> str:
    sid = session(kit, tenant)
    body = {"session_id": sid, "sampling_session_seq_id": 0, "base_model": BASE}
    response = post(kit, "/api/v1/create_sampling_session", tenant, json=body)
    assert response.status_code == 200, response.text
    return response.json()["sampling_session_id"]


def sample_body(sampler_id, prompt=None, **changes) -> dict:
    from tinker import types

    request = types.SampleRequest(
        sampling_session_id=sampler_id, prompt=types.ModelInput.from_ints(prompt or SEQUENCE[:8]),
        sampling_params=types.SamplingParams(max_tokens=3, temperature=1.0, seed=1),
    )  # fmt: skip
    body = request.model_dump(mode="json")
    for name, value in changes.items():
        target = body["sampling_params"] if name in body["sampling_params"] else body
        target[name] = value
    return body


def asample(kit, body, tenant="alice", **kwargs):
    import json

    return post(kit, "/api/v1/asample", tenant, content=json.dumps(body),
                headers={"Content-Type": "application/json"}, **kwargs)  # fmt: skip


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"num_samples": 2_000_000}, "num_samples"),
        ({"prompt": [10**6]}, "outside the vocabulary"),
        ({"prompt": [5] * 5000}, "context"),
        ({"temperature": float("nan")}, "temperature"),
        ({"seed": 2**80}, "seed"),
        ({"stop": [-3]}, "sampling_params.stop"),
    ],
    ids=["many-samples", "out-of-vocabulary", "beyond-context", "nan", "huge-seed", "bad-stop"],
)
def test_a_sample_request_is_checked_whole_before_it_is_answered(kit, changes, field):
    sampler_id = sampler(kit, "alice")
    response = asample(kit, sample_body(sampler_id, **changes))
    assert response.status_code == 400, response.text[:300]
    detail = response.json()["detail"]
    assert field in detail, detail
    assert "127.0.0.1" not in detail and str(kit.state_dir) not in detail
    assert "Traceback" not in kit.log()


def test_a_request_is_recognised_as_a_retry_only_when_it_is_the_same_request(kit):
    sampler_id = sampler(kit, "alice")
    # no seq_id: two requests, two futures, each its own answer
    short, long = (asample(kit, sample_body(sampler_id, max_tokens=n)) for n in (3, 9))
    assert short.json()["request_id"] != long.json()["request_id"]
    for answer in (short, long):
        assert "protobuf" in result(kit, "alice", answer.json()["request_id"])
    # one seq_id: the same body is a retry, another body is refused
    first = asample(kit, sample_body(sampler_id, seq_id=5))
    again = asample(kit, sample_body(sampler_id, seq_id=5))
    other = asample(kit, sample_body(sampler_id, seq_id=5, max_tokens=9))
    assert again.json()["request_id"] == first.json()["request_id"]
    assert other.status_code == 409 and "seq_id 5" in other.json()["detail"], other.text
    negative = asample(kit, sample_body(sampler_id, seq_id=-5))
    assert negative.status_code == 400 and "seq_id" in negative.json()["detail"], negative.text
    # a training request's seq_id 0 is the protobuf's unset value: refused, never shared
    sid = session(kit, "alice")
    model_id = create(kit, "alice", sid, 11).json()["model_id"]
    unset = forward_backward(kit, "alice", model_id, 0)
    assert unset.status_code == 400 and "seq_id" in unset.json()["detail"], unset.text
    result(kit, "alice", unload(kit, "alice", model_id).json()["request_id"])
    huge = create(kit, "alice", sid, 10**230, wait=False)
    assert huge.status_code == 400 and "model_seq_id" in huge.json()["detail"], huge.text
    assert "Traceback" not in kit.log()


def test_a_damaged_checkpoint_on_the_server_answers_an_incident_not_its_path(kit):
    sid = session(kit, "alice")
    model_id = create(kit, "alice", sid, 12).json()["model_id"]
    save = post(kit, "/api/v1/save_weights", json={"model_id": model_id, "path": "damaged",
                                                   "seq_id": 1})  # fmt: skip
    path = result(kit, "alice", save.json()["request_id"])["path"]
    manifests = [p for p in kit.state_dir.rglob("manifest.json") if "damaged" in str(p)]
    assert manifests, "the saved checkpoint has no manifest"
    for manifest in manifests:
        manifest.write_text("[]")  # the server's own file, damaged under it
    load = post(kit, "/api/v1/load_weights", json={"model_id": model_id, "path": path, "optimizer": True,
                                                   "seq_id": 2})  # fmt: skip
    assert load.status_code == 200, load.text
    failed = result(kit, "alice", load.json()["request_id"])
    assert failed.get("category") == "server", failed
    assert "incident" in failed["error"] and str(kit.state_dir) not in failed["error"], failed
    result(kit, "alice", unload(kit, "alice", model_id).json()["request_id"])


def test_a_sampler_is_never_opened_in_a_session_that_ended_while_its_save_was_queued(kit):
    """``save_weights_and_get_sampling_client`` queued behind slow steps, then the session is
    finished: the save still runs (the weights are kept), but opens no sampler in the ended
    session -- its future fails naming the saved path (before: a sampler outlived its session)."""
    logged = len(kit.log())
    sid = session(kit, "dave")
    model_id = create(kit, "dave", sid, 0).json()["model_id"]
    steps = [forward_backward(kit, "dave", model_id, seq, rows=48) for seq in (1, 2, 3)]
    assert all(s.status_code == 200 for s in steps), [s.text for s in steps]
    save = post(kit, "/api/v1/save_weights_for_sampler", "dave",
                json={"model_id": model_id, "seq_id": 4, "sampling_session_seq_id": 0})  # fmt: skip
    assert save.status_code == 200, save.text
    finished = post(kit, f"/api/v1/sessions/{sid}/finish", "dave", json={})
    assert finished.status_code == 200, finished.text
    failed = result(kit, "dave", save.json()["request_id"])
    assert failed.get("category") == "user", failed
    assert "no sampler was opened" in failed["error"], failed
    assert f"tinker://{model_id}/sampler_weights/" in failed["error"], failed
    assert "discarded" in failed["error"], failed
    assert _sampler_weights(kit, model_id) == []  # unnamed weights no session samples: gone
    assert "Traceback" not in kit.log()[logged:]


def _sampler_weights(kit, model_id) -> list[str]:
    found = kit.state_dir / "checkpoints" / model_id / "sampler_weights"
    return sorted(p.name for p in found.iterdir()) if found.is_dir() else []


def test_unnamed_sampler_weights_live_as_long_as_a_session_samples_them(kit):
    """``save_weights_and_get_sampling_client`` (no name) writes weights only its sampling
    session uses: when that session ends (here with its session) they are deleted, so a
    training loop that publishes every step does not fill the disk; named ones stay."""
    sid = session(kit, "dave")
    model_id = create(kit, "dave", sid, 1).json()["model_id"]
    unnamed = post(kit, "/api/v1/save_weights_for_sampler", "dave",
                   json={"model_id": model_id, "seq_id": 1, "sampling_session_seq_id": 0})  # fmt: skip
    published = result(kit, "dave", unnamed.json()["request_id"])
    assert "sampling_session_id" in published, published
    named = post(kit, "/api/v1/save_weights_for_sampler", "dave",
                 json={"model_id": model_id, "seq_id": 2, "path": "keep"})  # fmt: skip
    assert result(kit, "dave", named.json()["request_id"])["path"].endswith("/keep")
    unnamed_name = published["path"].rsplit("/", 1)[1]
    assert _sampler_weights(kit, model_id) == sorted(["keep", unnamed_name])
    sampler = f"{kit.url}/api/v1/samplers/{published['sampling_session_id']}"
    assert httpx.get(sampler, headers=kit.headers("dave"), timeout=60).status_code == 200

    finished = post(kit, f"/api/v1/sessions/{sid}/finish", "dave", json={})
    assert finished.status_code == 200, finished.text
    assert httpx.get(sampler, headers=kit.headers("dave"), timeout=60).status_code == 404
    assert _sampler_weights(kit, model_id) == ["keep"]


def test_concurrent_samplers_on_one_checkpoint_load_it_once(kit):
    """Four sampling clients opened at once on a saved (not yet loaded) sampler checkpoint: one
    engine load, four sessions (before: each asked the engine, which refused every load after
    the first -- three 500s with tracebacks)."""
    import concurrent.futures

    logged = len(kit.log())
    sid = session(kit, "carol")
    model_id = create(kit, "carol", sid, 7).json()["model_id"]
    saved = post(kit, "/api/v1/save_weights_for_sampler", "carol",
                 json={"model_id": model_id, "seq_id": 1, "path": "shared"})  # fmt: skip
    path = result(kit, "carol", saved.json()["request_id"])["path"]
    body = {"session_id": sid, "sampling_session_seq_id": 0, "model_path": path}

    def open_sampler(_):
        return post(kit, "/api/v1/create_sampling_session", "carol", json=body)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        opened = list(pool.map(open_sampler, range(4)))
    assert [r.status_code for r in opened] == [200] * 4, [r.text[:200] for r in opened]
    assert len({r.json()["sampling_session_id"] for r in opened}) == 4
    assert "Traceback" not in kit.log()[logged:]
    result(kit, "carol", unload(kit, "carol", model_id).json()["request_id"])
