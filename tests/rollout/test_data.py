"""Prompt datasets: configurable keys, errors with file:line, seeded shuffle, cursor resume."""

from __future__ import annotations

import json

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_rollout.data import (
    DataCursor,
    DataError,
    DatasetKeys,
    PromptDataset,
    example_datasets,
    resolve_data_path,
)

register_cpu_ci(est_time=3, labels=["rollout"])


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def dataset_path(tmp_path):
    rows = [{"question": f"q{i}", "answer": str(i), "src": "t", "tenant": i % 2} for i in range(10)]
    return _write(tmp_path / "d.jsonl", rows)


def test_keys_are_configurable(dataset_path):
    keys = DatasetKeys(
        input_key="question", label_key="answer", metadata_keys=("src",), tenant_key="tenant"
    )
    ds = PromptDataset.from_jsonl(dataset_path, keys)
    assert len(ds) == 10
    rec = ds[3]
    assert (rec.index, rec.input, rec.label, rec.metadata, rec.tenant_id) == (
        3,
        "q3",
        "3",
        {"src": "t"},
        "1",
    )
    # metadata_keys=None keeps every other key.
    ds = PromptDataset.from_jsonl(
        dataset_path, DatasetKeys(input_key="question", label_key="answer")
    )
    assert ds[0].metadata == {"src": "t", "tenant": 0}


def test_chat_inputs_are_accepted(tmp_path):
    path = _write(tmp_path / "c.jsonl", [{"prompt": [{"role": "user", "content": "hi"}]}])
    assert PromptDataset.from_jsonl(path)[0].input == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"question": "x"}'], ":1: no 'prompt' key (keys present: ['question']); fix: pass"),
        (['{"prompt": "a"}', "{oops"], ":2: not valid JSON"),
        (['{"prompt": 3}'], ":1: 'prompt' is int"),
        (['{"prompt": ""}'], ":1: 'prompt' is an empty string"),
        (['{"prompt": [{"content": "x"}]}'], ":1: 'prompt[0]'"),
        (["[1, 2]"], ":1: a record is a JSON object"),
        ([""], "the dataset is empty"),
    ],
)
def test_errors_name_file_and_line(tmp_path, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as info:
        PromptDataset.from_jsonl(path)
    assert message in str(info.value)
    assert str(path) in str(info.value)


def test_missing_metadata_key_is_reported(dataset_path):
    keys = DatasetKeys(input_key="question", metadata_keys=("nope",))
    with pytest.raises(DataError, match=r":1: metadata key\(s\) \['nope'\] missing"):
        PromptDataset.from_jsonl(dataset_path, keys)


def test_shuffle_is_seeded_per_epoch_and_covers_every_record(dataset_path):
    ds = PromptDataset.from_jsonl(dataset_path, DatasetKeys(input_key="question"))
    cursor = DataCursor(ds, seed=7)
    epoch0, epoch1 = cursor.order(0), cursor.order(1)
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0 != epoch1
    assert DataCursor(ds, seed=7).order(1) == epoch1
    assert DataCursor(ds, seed=8).order(0) != epoch0
    assert DataCursor(ds, shuffle=False).order(3) == list(range(10))
    # Batches cross the epoch boundary: 4+4+4 = one full epoch and 2 of the next.
    batches = [[r.index for r in cursor.next_batch(4)] for _ in range(3)]
    assert batches[0] + batches[1] + batches[2][:2] == epoch0
    assert batches[2][2:] == epoch1[:2]
    assert (cursor.epoch, cursor.position) == (1, 2)


def test_cursor_resumes_exactly(dataset_path, tmp_path):
    ds = PromptDataset.from_jsonl(dataset_path, DatasetKeys(input_key="question"))
    original = DataCursor(ds, seed=3)
    original.next_batch(3)
    original.next_batch(3)
    state_file = tmp_path / "cursor.json"
    original.save(state_file)
    expected = [[r.index for r in original.next_batch(3)] for _ in range(5)]

    resumed = DataCursor(PromptDataset.from_jsonl(dataset_path, DatasetKeys(input_key="question")))
    resumed.restore(state_file)
    assert resumed.state_dict()["seed"] == 3
    assert [[r.index for r in resumed.next_batch(3)] for _ in range(5)] == expected


def test_cursor_refuses_a_state_from_another_dataset(dataset_path, tmp_path):
    ds = PromptDataset.from_jsonl(dataset_path, DatasetKeys(input_key="question"))
    state = DataCursor(ds).state_dict()
    other = _write(tmp_path / "o.jsonl", [{"question": "z"}] * 10)
    cursor = DataCursor(PromptDataset.from_jsonl(other, DatasetKeys(input_key="question")))
    with pytest.raises(DataError, match="cursor state fingerprint"):
        cursor.load_state_dict(state)
    with pytest.raises(DataError, match="position is 99"):
        DataCursor(ds).load_state_dict({**state, "position": 99})


def test_shipped_example_dataset():
    assert "math" in example_datasets()
    ds = PromptDataset.from_jsonl("example:math")
    assert len(ds) >= 4 and all(isinstance(r.label, str) for r in ds.records)
    assert resolve_data_path("example:math").name == "math.jsonl"
    with pytest.raises(DataError, match="no example dataset 'nope'"):
        resolve_data_path("example:nope")
