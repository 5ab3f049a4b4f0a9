"""SFT data: records are validated with file:line, the loss covers exactly the response tokens
(chat template, multi-turn, or no template), an unstable template is refused, rows pack several
examples with their own segments, and a restored stream yields exactly the rows the original would
have."""

from __future__ import annotations

import json

import pytest
import torch

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=10, labels=["train"])


def _write(path, records):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


@pytest.fixture(scope="module")
def byte_tokenizer():
    from mizzen_train.data import SftTokenizer

    return SftTokenizer.load("byte")


def test_prompt_response_loss_is_the_answer_and_its_end_of_turn(tmp_path, byte_tokenizer):
    from mizzen_rollout.engines.embedded.tokenizer import ByteTokenizer
    from mizzen_train.data import load_sft_dataset

    path = _write(tmp_path / "d.jsonl", [{"prompt": "Colour of lime?", "response": "green"}])
    (example,) = load_sft_dataset(path, byte_tokenizer, field="f", seq_len=128).examples
    messages = [{"role": "user", "content": "Colour of lime?"}]
    prompt_ids = ByteTokenizer().apply_chat_template(messages)  # ends with the generation prompt
    assert list(example.input_ids[: len(prompt_ids)]) == prompt_ids
    learned = [t for t, m in zip(example.input_ids, example.loss_mask, strict=True) if m]
    assert learned == [*ByteTokenizer().encode("green", False), ByteTokenizer.EOS, 13]
    assert example.loss_mask[: len(prompt_ids)] == (False,) * len(prompt_ids)
    assert byte_tokenizer.prompt_ids(example.record) == prompt_ids


def test_multi_turn_conversations_learn_every_assistant_turn(tmp_path, byte_tokenizer):
    from mizzen_train.data import load_sft_dataset

    record = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "again"},
            {"role": "assistant", "content": "ok"},
        ],
        "source": "chat-42",
    }
    path = _write(tmp_path / "d.jsonl", [record])
    (example,) = load_sft_dataset(path, byte_tokenizer, field="f", seq_len=256).examples
    text = byte_tokenizer.hf.decode(
        [t for t, m in zip(example.input_ids, example.loss_mask, strict=True) if m]
    )
    assert text == "yo<eos>\nok<eos>\n"  # both answers, each with its end of turn
    assert example.record.metadata == {"source": "chat-42"}
    assert example.record.label == "ok"
    assert byte_tokenizer.generation_prompt(example.record) == record["messages"][:-1]


def test_without_a_chat_template_prompt_and_response_are_concatenated(tmp_path):
    from mizzen_rollout.engines.embedded.tokenizer import ByteTokenizer, hf_byte_tokenizer
    from mizzen_train.data import SftDataError, SftTokenizer, load_sft_dataset

    hf = hf_byte_tokenizer()
    hf.chat_template = None
    tokenizer = SftTokenizer(hf, source="plain")
    path = _write(tmp_path / "d.jsonl", [{"prompt": "2+2=", "response": "4"}])
    (example,) = load_sft_dataset(path, tokenizer, field="f", seq_len=64).examples
    byte = ByteTokenizer()
    assert list(example.input_ids) == byte.encode("2+2=") + byte.encode("4", False) + [2]
    assert example.loss_mask == (False,) * 5 + (True, True)
    assert tokenizer.generation_prompt(example.record) == "2+2="
    chat = _write(tmp_path / "c.jsonl", [{"messages": [{"role": "assistant", "content": "x"}]}])
    with pytest.raises(SftDataError, match=r"c.jsonl:1: a 'messages' record needs a chat template"):
        load_sft_dataset(chat, tokenizer, field="f", seq_len=64)


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    from mizzen_rollout.engines.embedded.tokenizer import hf_byte_tokenizer
    from mizzen_train.data import SftDataError, SftTokenizer, load_sft_dataset

    hf = hf_byte_tokenizer()
    # marks the last message, so rendering a prefix differs from the start of the whole
    hf.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% if loop.last %}{{ '!' }}{% endif %}"
        "{% endfor %}"
    )
    path = _write(
        tmp_path / "d.jsonl",
        [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}],
    )
    with pytest.raises(SftDataError, match="not prefix-stable at message 1"):
        load_sft_dataset(path, SftTokenizer(hf, source="odd"), field="f", seq_len=64)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ('["a"]', "a record is a JSON object"),
        ('{"text": "x"}', "either 'messages' or 'prompt' and 'response'"),
        ('{"prompt": "x", "messages": []}', "either 'messages' or 'prompt' and 'response'"),
        ('{"prompt": "x", "response": ""}', "'response' is ''"),
        ('{"messages": [{"role": "user", "content": "x"}]}', "last message must be a non-empty"),
        ('{"messages": [{"role": "user"}]}', "messages[0] is"),
        ("[" * 100_000 + "]" * 100_000, "not a readable JSON record (nested too deep)"),
        ('{"prompt": ' + "9" * 5000 + "}", "not a readable JSON record (Exceeds the limit"),
    ],
)
def test_bad_records_name_the_field_file_and_line(tmp_path, byte_tokenizer, line, message):
    from mizzen_train.data import SftDataError, load_sft_dataset

    path = _write(tmp_path / "d.jsonl", [{"prompt": "ok", "response": "fine"}, "", line])
    with pytest.raises(SftDataError) as info:
        load_sft_dataset(path, byte_tokenizer, field="tenants[0].data", seq_len=64)
    assert str(info.value).startswith(f"tenants[0].data: {path}:3: ")
    assert message in str(info.value)


def test_empty_and_overlong_data_sets(tmp_path, byte_tokenizer):
    from mizzen_train.data import SftDataError, load_sft_dataset

    empty = _write(tmp_path / "e.jsonl", ["", "   "])
    with pytest.raises(SftDataError, match=r"eval.evaluators\[0\].data=.*has no usable record"):
        load_sft_dataset(empty, byte_tokenizer, field="eval.evaluators[0].data", seq_len=64)
    records = [{"prompt": "p" * n, "response": "r"} for n in (5, 80, 6)]
    path = _write(tmp_path / "d.jsonl", records)
    with pytest.raises(SftDataError, match=r"d.jsonl:2: the example is .* more than seq_len"):
        load_sft_dataset(path, byte_tokenizer, field="f", seq_len=64)
    dataset = load_sft_dataset(path, byte_tokenizer, field="f", seq_len=64, on_overlong="drop")
    assert len(dataset) == 2 and dataset.dropped == 1
    with pytest.raises(SftDataError, match="example:nothing"):
        load_sft_dataset("example:nothing", byte_tokenizer, field="f", seq_len=64)


def test_packing_fills_rows_with_separate_segments_and_resumes_exactly(byte_tokenizer):
    from mizzen_train.data import PackedStream, load_sft_dataset

    dataset = load_sft_dataset("example:colours_train", byte_tokenizer, field="f", seq_len=192)
    stream = PackedStream(dataset, rows=4, seq_len=192, pad_id=0, seed=3)
    rows = stream.next_rows()
    assert rows.input_ids.shape == (4, 192)
    lengths = {i: dataset.examples[i].positions for i in rows.examples}
    assert rows.tokens == sum(dataset.examples[i].positions for i in rows.examples)
    assert len(rows.examples) > 4, "several examples share a row"
    for row in range(4):
        segments = rows.segment_ids[row]
        real = segments[segments >= 0]
        assert torch.equal(real, torch.sort(real).values), "segments are contiguous"
        for segment in torch.unique(real).tolist():
            span = (segments == segment).nonzero().flatten()
            assert span.numel() in lengths.values()
            start = int(span[0])
            inputs = rows.input_ids[row, start : start + span.numel()]
            targets = rows.target_ids[row, start : start + span.numel()]
            assert torch.equal(inputs[1:], targets[:-1]), "targets are the next tokens"
        assert not rows.loss_mask[row][segments < 0].any(), "padding is never learned"
    for _ in range(5):
        stream.next_rows()
    saved = json.loads(json.dumps(stream.state_dict()))
    expected = [stream.next_rows() for _ in range(4)]
    resumed = PackedStream(dataset, rows=4, seq_len=192, pad_id=0, seed=3)
    resumed.load_state_dict(saved)
    for want in expected:
        got = resumed.next_rows()
        assert got.examples == want.examples
        assert torch.equal(got.input_ids, want.input_ids)
        assert torch.equal(got.loss_mask, want.loss_mask)
    other = load_sft_dataset("example:colours_eval", byte_tokenizer, field="f", seq_len=192)
    with pytest.raises(Exception, match="resume on the dataset the state was taken on"):
        PackedStream(other, rows=4, seq_len=192, pad_id=0, seed=3).load_state_dict(saved)


def test_lines_end_at_newlines_only_and_bad_bytes_name_their_line(tmp_path, byte_tokenizer):
    """JSON strings may hold U+2028 and U+0085 raw: they do not end a JSON Lines line; a byte
    that is not UTF-8 is named by its line."""
    from mizzen_train.data import SftDataError, load_sft_dataset

    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a\u2028b", "response": "c\u0085d"}\n{"prompt": "x", '
                    '"response": "y"}\n', encoding="utf-8")  # fmt: skip
    assert "\u2028" in path.read_text(encoding="utf-8")  # raw, not escaped
    assert len(load_sft_dataset(path, byte_tokenizer, field="f", seq_len=64)) == 2
    path.write_bytes(b'{"prompt": "a", "response": "b"}\n{"prompt": "\xff", "response": "b"}\n')
    with pytest.raises(SftDataError, match=r"^f: .*d.jsonl:2: not UTF-8 \(byte 0xff\)"):
        load_sft_dataset(path, byte_tokenizer, field="f", seq_len=64)
