"""The sample contract: JSON-lines round trip, validation errors that name the field, groups."""

from __future__ import annotations

import json

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_rollout.samples import (
    Sample,
    SampleGroup,
    SampleStatus,
    SampleValidationError,
    group_samples,
    read_samples,
    write_samples,
)

register_cpu_ci(est_time=3, labels=["rollout"])


def _sample(**overrides) -> Sample:
    base = dict(
        prompt="What is 2+2?",
        prompt_tokens=[1, 5, 6],
        response_tokens=[7, 8, 2],
        response_text="4",
        loss_mask=[1, 1, 1],
        reward=1.0,
        status=SampleStatus.COMPLETED,
        rollout_logprobs=[-0.1, -0.5, -2.0],
        group_index=3,
        index_in_group=1,
        tenant_id="slot-a",
        label="4",
        request_id="b-g3-s1",
        metadata={"prompt_index": 17, "finish_reason": "stop"},
    )
    base.update(overrides)
    return Sample(**base)


def test_jsonl_round_trip_keeps_every_field(tmp_path):
    samples = [
        _sample(),
        _sample(
            prompt=[{"role": "user", "content": "hi"}],
            rollout_logprobs=None,
            status=SampleStatus.FAILED,
            error="reward boom raised ValueError: x",
            reward=None,
            request_id="b-g0-s0",
        ),
        Sample(prompt="p"),  # all defaults (pending, empty)
    ]
    path = tmp_path / "s.jsonl"
    assert write_samples(path, samples) == 3
    lines = path.read_text().splitlines()
    assert len(lines) == 3
    assert json.loads(lines[0])["status"] == "completed"
    back = read_samples(path)
    assert back == samples
    assert back[0].status is SampleStatus.COMPLETED


@pytest.mark.parametrize(
    ("overrides", "field", "rule"),
    [
        ({"loss_mask": [1, 1]}, "loss_mask", "has 2 entries but response_tokens has 3"),
        ({"loss_mask": [1, 2, 1]}, "loss_mask[1]", "entries are 0 or 1"),
        ({"loss_mask": [1, True, 1]}, "loss_mask[1]", "entries are 0 or 1"),
        ({"rollout_logprobs": [-0.1]}, "rollout_logprobs", "has 1 entries"),
        ({"rollout_logprobs": [-0.1, 0.5, -1.0]}, "rollout_logprobs[1]", "<= 0"),
        ({"rollout_logprobs": [-0.1, float("nan"), -1]}, "rollout_logprobs[1]", "finite"),
        ({"response_tokens": [7, -1, 2]}, "response_tokens[1]", "non-negative"),
        ({"prompt_tokens": [1, "x"]}, "prompt_tokens[1]", "non-negative"),
        ({"reward": float("inf")}, "reward", "finite"),
        ({"reward": "high"}, "reward", "not a number"),
        ({"group_index": -1}, "group_index", "non-negative"),
        ({"status": "done"}, "status", "SampleStatus"),
        ({"status": SampleStatus.FAILED, "error": None}, "error", "failed sample"),
        ({"error": "stray"}, "error", "only failed samples"),
        ({"prompt": 42}, "prompt", "string or a list of chat messages"),
        ({"prompt": [{"content": "no role"}]}, "prompt[0]", "chat message"),
        ({"metadata": {1: "x"}}, "metadata", "str keys"),
    ],
)
def test_validation_names_the_sample_the_field_and_the_fix(overrides, field, rule):
    with pytest.raises(SampleValidationError) as info:
        _sample(**overrides).validate()
    message = str(info.value)
    assert message.startswith(f"Sample(b-g3-s1).{field}: ")
    assert rule in message
    assert "fix:" in message


def test_from_dict_rejects_unknown_fields_and_bad_status():
    data = _sample().to_dict()
    with pytest.raises(SampleValidationError, match=r"unknown sample field\(s\) \['advantage'\]"):
        Sample.from_dict({**data, "advantage": 0.3})
    with pytest.raises(SampleValidationError, match=r"status: 'ok' is not a status"):
        Sample.from_dict({**data, "status": "ok"})
    with pytest.raises(SampleValidationError, match="missing field 'prompt'"):
        Sample.from_dict({k: v for k, v in data.items() if k != "prompt"})


def test_read_errors_name_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = _sample().to_json()
    bad = json.loads(good)
    bad["loss_mask"] = [1]
    path.write_text(good + "\n\n" + json.dumps(bad) + "\n")
    with pytest.raises(SampleValidationError) as info:
        read_samples(path)
    assert str(info.value).startswith(f"{path}:3: Sample(b-g3-s1).loss_mask:")
    path.write_text("{not json\n")
    with pytest.raises(SampleValidationError, match=f"{path}:1: not valid JSON"):
        read_samples(path)


def test_write_is_atomic_when_a_sample_is_invalid(tmp_path):
    path = tmp_path / "s.jsonl"
    write_samples(path, [_sample()])
    before = path.read_text()
    with pytest.raises(SampleValidationError):
        write_samples(path, [_sample(request_id="ok"), _sample(loss_mask=[])])
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.jsonl"]


def test_non_json_metadata_is_reported():
    with pytest.raises(SampleValidationError, match="not JSON-serialisable"):
        _sample(metadata={"x": object()}).to_json()


def test_group_samples_orders_groups_and_members_and_rejects_duplicates():
    samples = [
        _sample(group_index=g, index_in_group=i, request_id=f"g{g}s{i}")
        for g, i in [(1, 1), (0, 0), (1, 0), (0, 1)]
    ]
    groups = group_samples(samples)
    assert [g.group_index for g in groups] == [0, 1]
    assert [[s.request_id for s in g.samples] for g in groups] == [
        ["g0s0", "g0s1"],
        ["g1s0", "g1s1"],
    ]
    assert isinstance(groups[0], SampleGroup) and groups[0].rewards == [1.0, 1.0]
    with pytest.raises(SampleValidationError, match="duplicate"):
        group_samples([*samples, _sample(group_index=0, index_in_group=1)])


def test_a_samples_file_is_readable_by_others(tmp_path):
    """``mizzen-rollout generate --out`` writes through write_samples: 0644, not mkstemp's 0600
    (samples hold no secret: every line passes through the mask set)."""
    path = tmp_path / "samples.jsonl"
    write_samples(path, [_sample()])
    assert path.stat().st_mode & 0o777 == 0o644
