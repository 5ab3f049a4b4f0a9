"""``mizzen-train serve`` driven by the official Tinker SDK (``tinker`` 0.38, unmodified) over real
HTTP on 127.0.0.1: the training loops a client owns, and the service's semantics.

One server for the module (the tiny Llama on CPU, 8 slots, the embedded engine); the last tests
restart it on the same state directory (saved state survives) and with a one-operation queue
(admission control).  Raw HTTP (httpx) is used only where the SDK hides the wire: retries with
the same request id, 429 headers, hostile bodies, unknown endpoints.
"""

from __future__ import annotations

import itertools
import threading

import httpx
import numpy as np
import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=90, labels=["train", "rollout", "e2e"])
pytestmark = pytest.mark.in_child  # its body's threads/world end with it

BASE = "tiny-llama"


def _types():
    from tinker import types

    return types


def sft_datum(tokens):
    types = _types()
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def sft_steps(training, data, steps, lr=1e-2):
    """``steps`` SFT steps, submitted without waiting (the SDK pipelines them); the losses."""
    types = _types()
    futures = []
    for _ in range(steps):
        futures.append(training.forward_backward(data, "cross_entropy"))
        training.optim_step(types.AdamParams(learning_rate=lr))
    return [f.result().metrics["loss:sum"] for f in futures]


def forward_logprobs(training, data):
    out = training.forward(data, "cross_entropy").result()
    return [np.asarray(o["logprobs"].to_numpy()) for o in out.loss_fn_outputs]


def post(kit, path, tenant="alice", headers=None, **kwargs):
    headers = {**kit.headers(tenant), **(headers or {})}
    return httpx.post(f"{kit.url}{path}", headers=headers, timeout=60, **kwargs)


SEQUENCE = [ord(c) + 3 for c in "the cat sat on the mat!"]  # byte-tokenizer ids


def test_supervised_loop_loss_falls_and_sampling_uses_published_weights(serve_kit):
    types = _types()
    service = serve_kit.client("alice")
    training = service.create_lora_training_client(base_model=BASE, rank=8, seed=1).result()
    base_sampler = service.create_sampling_client(base_model=BASE)
    losses = sft_steps(training, [sft_datum(SEQUENCE)], 30)
    assert losses[-1] < 0.2 * losses[0], losses
    assert all(b < a for a, b in itertools.pairwise(losses[:6])), losses

    prompt = types.ModelInput.from_ints(SEQUENCE[:4])
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0)
    sampler = training.save_weights_and_get_sampling_client().result()
    tuned = sampler.sample(prompt, 1, greedy).result().sequences[0].tokens
    base = base_sampler.sample(prompt, 1, greedy).result().sequences[0].tokens
    assert tuned == SEQUENCE[4:12], (tuned, SEQUENCE[4:12])
    assert base != SEQUENCE[4:12]
    # a named publication is listed with the model's checkpoints
    path = training.save_weights_for_sampler("memorised").result().path
    listed = service.create_rest_client().list_checkpoints(training.model_id).result()
    assert path in [c.tinker_path for c in listed.checkpoints]
    serve_kit.unload("alice", training)


def test_rl_importance_sampling_raises_reward(serve_kit):
    """Toy task: reward = fraction of sampled tokens below 100 (about 0.4 for the random model)."""
    types = _types()
    service = serve_kit.client("bob")
    training = service.create_lora_training_client(base_model=BASE, rank=8, seed=2).result()
    prompt = [5, 6, 7, 8]
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=0)
    rewards = []
    for _ in range(10):
        sampler = training.save_weights_and_get_sampling_client().result()
        result = sampler.sample(types.ModelInput.from_ints(prompt), 16, params).result()
        scores = np.array([np.mean(np.array(s.tokens) < 100) for s in result.sequences])
        rewards.append(float(scores.mean()))
        advantages = scores - scores.mean()
        data = []
        for seq, adv in zip(result.sequences, advantages, strict=True):
            tokens = prompt + list(seq.tokens)
            n_prompt = len(prompt) - 1
            data.append(types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": tokens[1:],
                    "logprobs": [0.0] * n_prompt + list(seq.logprobs),
                    "advantages": [0.0] * n_prompt + [float(adv)] * len(seq.tokens),
                },
            ))  # fmt: skip
        training.forward_backward(data, "importance_sampling").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.15, rewards
    serve_kit.unload("bob", training)


def test_save_and_load_round_trip_keeps_the_optimizer(serve_kit):
    service = serve_kit.client("carol")
    data = [sft_datum(SEQUENCE[:12]), sft_datum(SEQUENCE[8:])]
    training = service.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    sft_steps(training, data, 3, lr=1e-2)
    saved = training.save_state("after-3").result().path
    assert saved == f"tinker://{training.model_id}/weights/after-3"
    continued = sft_steps(training, data, 2, lr=1e-2)

    restored = service.create_training_client_from_state_with_optimizer(saved).result()
    assert restored.model_id != training.model_id
    assert sft_steps(restored, data, 2, lr=1e-2) == continued  # bitwise: Adam moments restored
    weights_only = service.create_training_client_from_state(saved).result()
    fresh_adam = sft_steps(weights_only, data, 2, lr=1e-2)
    assert fresh_adam[0] == continued[0] and fresh_adam[1] != continued[1]
    # another tenant can neither load nor inspect the checkpoint: for its key it does not exist
    for path, body in [
        ("/api/v1/load_weights", {"session_id": "x", "model_seq_id": 0, "path": saved,
                                  "optimizer": True}),
        ("/api/v1/weights_info", {"tinker_path": saved}),
    ]:  # fmt: skip
        refused = post(serve_kit, path, "bob", json=body)
        assert refused.status_code == 404 and "not found for this key" in refused.text, refused.text
    info = service.create_rest_client().get_weights_info_by_tinker_path(saved).result()
    assert (info.base_model, info.lora_rank) == (BASE, 4)
    serve_kit.unload("carol", training, restored, weights_only)


def _tenant_run(kit, tenant, seed, results, key, start=None):
    """One tenant's 4 SFT steps and a forward; with ``start`` (a barrier) its operations are
    submitted only once every tenant holds a model, so they wait in the queues together (a
    tenant whose client came up late could otherwise run all its steps alone)."""
    service = kit.client(tenant)
    training = service.create_lora_training_client(base_model=BASE, rank=8, seed=seed).result()
    if start is not None:
        start.wait(120)
    offset = 3 * seed
    data = [sft_datum([t + offset for t in SEQUENCE]), sft_datum(SEQUENCE[::-1])]
    results[key] = [*sft_steps(training, data, 4), forward_logprobs(training, data)]
    kit.unload(tenant, training)


def _executor_counts(kit):
    text = httpx.get(f"{kit.url}/metrics", timeout=10).text
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    return int(values["mizzen_serve_executor_steps_total"]), int(
        values["mizzen_serve_executor_operations_total"]
    )


def test_three_concurrent_tenants_equal_their_runs_one_at_a_time(serve_kit):
    tenants = [("alice", 11), ("bob", 12), ("carol", 13)]
    alone: dict = {}
    for tenant, seed in tenants:
        _tenant_run(serve_kit, tenant, seed, alone, tenant)
    steps_before, ops_before = _executor_counts(serve_kit)
    together: dict = {}
    start = threading.Barrier(len(tenants))
    threads = [threading.Thread(target=_tenant_run, args=(serve_kit, t, s, together, t, start))
               for t, s in tenants]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    steps_after, ops_after = _executor_counts(serve_kit)
    assert sorted(together) == sorted(alone)
    for tenant, _ in tenants:
        *losses, logprobs = together[tenant]
        *losses_alone, logprobs_alone = alone[tenant]
        assert losses == losses_alone, tenant  # bitwise equal
        for a, b in zip(logprobs, logprobs_alone, strict=True):
            np.testing.assert_array_equal(a, b)
    # several tenants' operations shared executor steps
    assert ops_after - ops_before > steps_after - steps_before


def test_nan_batch_of_one_tenant_leaves_another_bitwise_unchanged(serve_kit):
    types = _types()
    data = [sft_datum(SEQUENCE)]
    clean = serve_kit.client("alice").create_lora_training_client(
        base_model=BASE, rank=8, seed=7).result()  # fmt: skip
    twin = serve_kit.client("bob").create_lora_training_client(
        base_model=BASE, rank=8, seed=7).result()  # fmt: skip
    poisoner = serve_kit.client("carol").create_lora_training_client(
        base_model=BASE, rank=8, seed=9).result()  # fmt: skip
    nan = types.Datum(
        model_input=types.ModelInput.from_ints(SEQUENCE[:-1]),
        loss_fn_inputs={
            "target_tokens": SEQUENCE[1:],
            "logprobs": [0.0] * (len(SEQUENCE) - 1),
            "advantages": [float("nan")] * (len(SEQUENCE) - 1),
        },
    )
    reference = sft_steps(clean, data, 3)
    poisoned_steps = []
    for _ in range(3):  # the twin steps while the poisoner pushes NaN into the same executor
        bad = poisoner.forward_backward([nan], "importance_sampling")
        good = twin.forward_backward(data, "cross_entropy")
        bad_step = poisoner.optim_step(types.AdamParams(learning_rate=1e-2))
        twin.optim_step(types.AdamParams(learning_rate=1e-2))
        poisoned_steps.append((good.result().metrics["loss:sum"], bad.result(), bad_step.result()))
    assert [s[0] for s in poisoned_steps] == reference
    assert all(s[2].metrics["stepped"] == 0.0 for s in poisoned_steps)  # its own step skipped
    for a, b in zip(forward_logprobs(twin, data), forward_logprobs(clean, data), strict=True):
        np.testing.assert_array_equal(a, b)
    # the poisoner's adapter is untouched (skipped steps) and it can still train
    assert np.isfinite(sft_steps(poisoner, data, 1)[0])
    serve_kit.unload("alice", clean)
    serve_kit.unload("bob", twin)
    serve_kit.unload("carol", poisoner)


def test_retry_with_the_same_request_id_returns_the_original_future(serve_kit):
    from tinker.proto.request_conv import forward_backward_request_to_proto

    types = _types()
    training = serve_kit.client("dave").create_lora_training_client(
        base_model=BASE, rank=2).result()  # fmt: skip
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[sft_datum(SEQUENCE)], loss_fn="cross_entropy"),
        model_id=training.model_id, seq_id=1000,
    )  # fmt: skip
    body = forward_backward_request_to_proto(request).SerializeToString()
    headers = {"Content-Type": "application/x-protobuf"}
    first = post(serve_kit, "/api/v1/forward_backward", "dave", content=body, headers=headers)
    again = post(serve_kit, "/api/v1/forward_backward", "dave", content=body, headers=headers)
    assert first.status_code == again.status_code == 200, first.text
    assert first.json()["request_id"] == again.json()["request_id"]
    step = {"model_id": training.model_id, "seq_id": 1001, "adam_params": {"learning_rate": 0.01}}
    ids = {post(serve_kit, "/api/v1/optim_step", "dave", json=step).json()["request_id"]
           for _ in range(3)}  # fmt: skip
    assert len(ids) == 1
    (request_id,) = ids
    result = post(serve_kit, "/api/v1/retrieve_future", "dave", json={"request_id": request_id})
    while result.json().get("type") == "try_again":
        result = post(serve_kit, "/api/v1/retrieve_future", "dave", json={"request_id": request_id})
    assert result.json()["metrics"]["step"] == 1.0  # stepped once, not three times
    # another tenant cannot see the future
    other = post(serve_kit, "/api/v1/retrieve_future", "alice", json={"request_id": request_id})
    assert other.status_code == 404
    serve_kit.unload("dave", training)


def test_operations_of_one_model_run_in_submission_order(serve_kit):
    types = _types()
    training = serve_kit.client("dave").create_lora_training_client(
        base_model=BASE, rank=4, seed=5).result()  # fmt: skip
    data = [sft_datum(SEQUENCE)]
    futures = []
    for _ in range(4):  # all submitted before any result is read
        futures.append(training.forward_backward(data, "cross_entropy"))
        futures.append(training.optim_step(types.AdamParams(learning_rate=2e-2)))
    results = [f.result() for f in futures]
    assert [r.metrics["step"] for r in results[1::2]] == [1.0, 2.0, 3.0, 4.0]
    losses = [r.metrics["loss:sum"] for r in results[0::2]]
    assert losses == sorted(losses, reverse=True) and len(set(losses)) == 4
    serve_kit.unload("dave", training)


def test_refusals_are_clear_4xx_and_the_server_keeps_serving(serve_kit):
    import tinker

    types = _types()
    service = serve_kit.client("alice")
    training = service.create_lora_training_client(base_model=BASE, rank=2).result()
    with pytest.raises(Exception, match=r"loss_fn 'dro' is not served.*cross_entropy"):
        training.forward_backward([sft_datum(SEQUENCE)], "dro").result()
    with pytest.raises(tinker.BadRequestError, match=r"not served; served:.*tiny-llama"):
        service.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=2).result()
    model = training.model_id
    cases = [
        ("/api/v1/no_such_thing", {"json": {}}, 404, "POST /api/v1/no_such_thing is not served"),
        ("/api/v1/optim_step", {"json": {"model_id": model, "adam_params": {"learning_rate": "x"}}},
         400, "learning_rate"),
        ("/api/v1/optim_step", {"json": {"model_id": model, "adam_params": {"learning_rate": 1e-3},
                                         "surprise": 1}}, 400, "surprise"),
        ("/api/v1/create_model", {"content": b"{not json"}, 400, "create_model"),
        ("/api/v1/forward_backward", {"content": b"\xff" * 64,
                                      "headers": {"Content-Type": "application/x-protobuf"}},
         400, "not a ForwardBackwardRequest"),
        ("/api/v1/save_weights", {"json": {"model_id": model, "path": "../../etc"}}, 400,
         "not a checkpoint name"),
        ("/api/v1/load_weights", {"json": {"model_id": model, "optimizer": True,
                                           "path": "tinker://m-x/weights/../../etc"}}, 400,
         "is not tinker://<model_id>/weights/<name>"),
        ("/api/v1/load_weights", {"json": {"model_id": model, "optimizer": True,
                                           "path": "tinker://m-x/weights/nothing"}}, 404,
         "not found for this key"),
        ("/api/v1/create_model", {"content": b"x" * (17 * 1024 * 1024)}, 413, "larger than"),
    ]  # fmt: skip
    for path, kwargs, status, message in cases:
        response = post(serve_kit, path, **kwargs)
        assert response.status_code == status, (path, response.text)
        assert message in response.json()["detail"], (path, response.text)
    # token ids beyond the vocabulary, through the SDK
    with pytest.raises(Exception, match=r"token id \d+ is outside the vocabulary \[0, "):
        training.forward_backward([sft_datum([1, 2, 99999])], "cross_entropy").result()
    # keys: none, unknown, another tenant's model
    assert (
        httpx.post(f"{serve_kit.url}/api/v1/get_info", json={"model_id": model}).status_code == 401
    )
    assert post(serve_kit, "/api/v1/get_info", "bob", json={"model_id": model}).status_code == 404
    assert "tml-" not in serve_kit.log()  # no key in the server's log
    # still serving
    assert httpx.get(f"{serve_kit.url}/api/v1/healthz").json() == {"status": "ok"}
    assert np.isfinite(sft_steps(training, [sft_datum(SEQUENCE)], 1)[0])
    serve_kit.unload("alice", training)
    del types


def test_restart_keeps_saved_state_and_a_full_queue_answers_429(serve_kit):
    types = _types()
    service = serve_kit.client("alice")
    training = service.create_lora_training_client(base_model=BASE, rank=4, seed=21).result()
    data = [sft_datum(SEQUENCE)]
    sft_steps(training, data, 2)
    saved = training.save_state("before-restart").result().path
    before = forward_logprobs(training, data)

    serve_kit.restart("server.max_queue=1")
    service = serve_kit.client("alice")
    restored = service.create_training_client_from_state_with_optimizer(saved).result()
    for a, b in zip(forward_logprobs(restored, data), before, strict=True):
        np.testing.assert_array_equal(a, b)
    stale = post(serve_kit, "/api/v1/get_info", "bob", json={"model_id": training.model_id})
    assert stale.status_code == 404  # another tenant still cannot see it after the restart

    from tinker.proto.request_conv import forward_backward_request_to_proto

    big = [sft_datum(list(range(3, 250))) for _ in range(48)]  # a slow operation at the head
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=big, loss_fn="cross_entropy"),
        model_id=restored.model_id, seq_id=5000,
    )  # fmt: skip
    headers = {"Content-Type": "application/x-protobuf"}
    body = forward_backward_request_to_proto(request).SerializeToString()
    assert (
        post(serve_kit, "/api/v1/forward_backward", content=body, headers=headers).status_code
        == 200
    )
    step = {"model_id": restored.model_id, "seq_id": 5001, "adam_params": {"learning_rate": 0.01}}
    refused = post(serve_kit, "/api/v1/optim_step", json=step)
    assert refused.status_code == 429, refused.text
    assert refused.headers["Retry-After"] == "1"
    # the SDK honours Retry-After: a pipelined client still gets every result
    assert len(sft_steps(restored, data, 3)) == 3


def test_a_key_holds_bounded_sessions_and_its_samplers_end_with_their_session(serve_kit):
    """With two sessions and two sampling sessions per key: a third session is refused (422)
    until one is finished; a third sampling session ends the key's least recently used one;
    finishing a session ends the sampling sessions opened in it (before: both grew without
    bound, and samplers outlived their session)."""
    serve_kit.restart("server.max_sessions_per_key=2", "server.max_sampling_sessions_per_key=2")
    types = _types()
    hello = types.CreateSessionRequest(tags=[], user_metadata={}, sdk_version="0.38.0")

    def new_session():
        return post(serve_kit, "/api/v1/create_session", "bob", json=hello.model_dump(mode="json"))

    first, second = (new_session().json()["session_id"] for _ in range(2))
    refused = new_session()
    assert refused.status_code == 422, refused.text
    assert "server.max_sessions_per_key" in refused.json()["detail"], refused.text

    def sampler(session_id):
        body = {"session_id": session_id, "sampling_session_seq_id": 0, "base_model": BASE}
        opened = post(serve_kit, "/api/v1/create_sampling_session", "bob", json=body)
        assert opened.status_code == 200, opened.text
        return opened.json()["sampling_session_id"]

    def sampler_status(sampler_id):
        headers = serve_kit.headers("bob")
        url = f"{serve_kit.url}/api/v1/samplers/{sampler_id}"
        return httpx.get(url, headers=headers, timeout=60).status_code

    a, b = sampler(first), sampler(second)
    assert sampler_status(a) == 200  # a is now used more recently than b
    c = sampler(first)
    assert [sampler_status(x) for x in (a, b, c)] == [200, 404, 200]
    gone = httpx.get(f"{serve_kit.url}/api/v1/samplers/{b}", headers=serve_kit.headers("bob"),
                     timeout=60)  # fmt: skip
    assert "server.max_sampling_sessions_per_key" in gone.json()["detail"], gone.text

    finished = post(serve_kit, f"/api/v1/sessions/{first}/finish", "bob", json={})
    assert finished.status_code == 200, finished.text
    assert [sampler_status(x) for x in (a, c)] == [404, 404]  # opened in the finished session
    assert new_session().status_code == 200  # the finished one no longer counts
    assert post(serve_kit, f"/api/v1/sessions/{second}/finish", "bob", json={}).status_code == 200


def _slots_used(kit) -> int:
    text = httpx.get(f"{kit.url}/metrics", timeout=30).text
    (line,) = [x for x in text.splitlines() if x.startswith("mizzen_serve_slots_used ")]
    return int(line.split()[1])


def _wait_for_slots(kit, used: int, within_s: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + within_s
    while _slots_used(kit) != used:
        assert time.monotonic() < deadline, f"slots used {_slots_used(kit)}, expected {used}"
        time.sleep(0.1)


def test_a_closed_or_silent_session_ends_and_frees_its_models_slots(serve_kit):
    """``ServiceClient.close`` (the SDK's session finish) unloads the session's models; a session
    with no heartbeat for ``server.session_timeout_s`` ends the same way (before: sessions never
    ended, and their slots stayed taken until a restart)."""
    import time

    types = _types()
    before = _slots_used(serve_kit)
    service = serve_kit.client("carol")
    training = service.create_lora_training_client(base_model=BASE, rank=4).result()
    assert _slots_used(serve_kit) == before + 1
    service.close("success").result()
    _wait_for_slots(serve_kit, before)
    step = {"model_id": training.model_id, "seq_id": 99, "adam_params": {"learning_rate": 0.01}}
    gone = post(serve_kit, "/api/v1/optim_step", "carol", json=step)
    assert gone.status_code == 404 and "no live model" in gone.text, gone.text

    # a client that stops heartbeating: raw requests, a one-second timeout
    serve_kit.restart("server.session_timeout_s=1")
    hello = types.CreateSessionRequest(tags=[], user_metadata={}, sdk_version="0.38.0")
    session = post(serve_kit, "/api/v1/create_session", "dave", json=hello.model_dump(mode="json"))
    session_id = session.json()["session_id"]
    model = types.CreateModelRequest(session_id=session_id, model_seq_id=0, base_model=BASE,
                                     lora_config=types.LoraConfig(rank=2))  # fmt: skip
    created = post(serve_kit, "/api/v1/create_model", "dave", json=model.model_dump(mode="json"))
    assert created.status_code == 200 and _slots_used(serve_kit) == 1, created.text
    time.sleep(1.5)
    _wait_for_slots(serve_kit, 0, within_s=10)
    beat = post(serve_kit, "/api/v1/session_heartbeat", "dave", json={"session_id": session_id})
    assert beat.status_code == 404 and "expired" in beat.json()["detail"], beat.text
