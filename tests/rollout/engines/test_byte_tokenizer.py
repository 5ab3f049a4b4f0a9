"""The byte tokenizer and its Hugging Face twin: same ids, same chat format (an assistant turn
ends with EOS), and the twin survives save_pretrained / AutoTokenizer.from_pretrained."""

from __future__ import annotations

from mizzen_ci import register_cpu_ci
from mizzen_rollout.engines.embedded.tokenizer import ByteTokenizer, hf_byte_tokenizer

register_cpu_ci(est_time=5, labels=["rollout", "engine"])

TEXTS = ["hello world", "  two  spaces\n\ttab", "ünï©ødé 🚀", "", "<|user|> literal"]
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "#### 4"},
        {"role": "user", "content": "and 3+3?"},
    ],
    [{"role": "user", "content": None}],
]


def _same_as_bytes(tokenizer) -> None:
    reference = ByteTokenizer()
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert ids == reference.encode(text), text
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == reference.encode(
            text, add_special_tokens=False
        )
    for messages in CONVERSATIONS:
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert list(ids) == reference.apply_chat_template(messages), messages
    assert len(tokenizer) == reference.vocab_size
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)


def test_hf_twin_matches_byte_tokenizer_and_round_trips_through_disk(tmp_path):
    import transformers

    twin = hf_byte_tokenizer()
    _same_as_bytes(twin)
    twin.save_pretrained(str(tmp_path))
    _same_as_bytes(transformers.AutoTokenizer.from_pretrained(str(tmp_path)))


def test_assistant_turn_ends_with_eos():
    ids = ByteTokenizer().apply_chat_template(CONVERSATIONS[1])
    text = ByteTokenizer().encode("#### 4", add_special_tokens=False)
    at = next(i for i in range(len(ids)) if ids[i : i + len(text)] == text)
    assert ids[at + len(text)] == ByteTokenizer.EOS
    assert ids.count(ByteTokenizer.EOS) == 1 and ids[0] == ByteTokenizer.BOS
