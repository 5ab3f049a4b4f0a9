"""Tokenizers of the embedded engine: a byte-level one for the tiny model, and an adapter that
gives a local Hugging Face tokenizer the same small interface.

Invariants:
- :class:`ByteTokenizer` needs nothing (no files, no hub): ids 0/1/2 are pad/bos/eos and byte
  ``b`` is id ``b + 3``, so every string round-trips through ``encode``/``decode``.
- The byte chat format is ``<|role|>\\ncontent\\n`` per message, an assistant message's content
  followed by EOS (so a model trained on it learns to stop), then ``<|assistant|>\\n`` as the
  generation prompt.
- :func:`hf_byte_tokenizer` is the same tokenizer as a Hugging Face ``PreTrainedTokenizerFast``
  (same ids, same chat format as a Jinja template), so a model trained on byte tokens can be saved
  as an ordinary HF directory that ``AutoTokenizer`` (and SGLang) load.
- Both tokenizers expose ``encode``, ``decode``, ``token_text``, ``apply_chat_template``,
  ``eos_token_ids``, ``pad_token_id`` and ``vocab_size``; the backend uses nothing else.
- No module-scope import of transformers or tokenizers (imported inside the functions).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "BYTE_CHAT_TEMPLATE",
    "ByteTokenizer",
    "HFTokenizerAdapter",
    "TokenizerError",
    "hf_byte_tokenizer",
]

#: The byte chat format as a Jinja chat template (Hugging Face ``apply_chat_template``).
BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>\\n' + (m['content'] or '') }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


class TokenizerError(ValueError):
    """The prompt cannot be tokenised (e.g. a chat prompt for a model without a chat template)."""


class ByteTokenizer:
    """UTF-8 bytes as tokens, with three special ids in front."""

    PAD, BOS, EOS = 0, 1, 2
    OFFSET = 3
    vocab_size = 256 + OFFSET

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.EOS,)

    @property
    def pad_token_id(self) -> int:
        return self.PAD

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [b + self.OFFSET for b in text.encode("utf-8")]
        return [self.BOS, *ids] if add_special_tokens else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        data = bytes(i - self.OFFSET for i in ids if i >= self.OFFSET)
        return data.decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        if token_id < self.OFFSET:
            return ("<pad>", "<bos>", "<eos>")[token_id]
        return bytes([token_id - self.OFFSET]).decode("latin-1")

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """``<|role|>\\ncontent\\n`` per message (EOS after an assistant's content), then
        ``<|assistant|>\\n`` (the generation prompt)."""
        ids = [self.BOS]
        for m in messages:
            ids += self.encode(f"<|{m['role']}|>\n{m.get('content') or ''}", False)
            if m["role"] == "assistant":
                ids.append(self.EOS)
            ids += self.encode("\n", False)
        return ids + self.encode("<|assistant|>\n", False)


class HFTokenizerAdapter:
    """A loaded Hugging Face tokenizer behind the :class:`ByteTokenizer` interface."""

    def __init__(self, tokenizer: Any, eos_token_ids: Sequence[int]):
        self._tok = tokenizer
        self._eos = tuple(eos_token_ids)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def pad_token_id(self) -> int:
        pad = self._tok.pad_token_id
        return pad if pad is not None else (self._eos[0] if self._eos else 0)

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self._tok.decode([token_id])

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        if not getattr(self._tok, "chat_template", None):
            raise TokenizerError(
                "this model's tokenizer has no chat template; send text prompts to /generate "
                "instead of chat messages"
            )
        out = self._tok.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=True, tokenize=True
        )
        if isinstance(out, Mapping) or hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel pre-tokenisation uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}


def hf_byte_tokenizer() -> Any:
    """:class:`ByteTokenizer` as a ``transformers.PreTrainedTokenizerFast`` (same ids and chat
    format); ``save_pretrained`` writes it as an ordinary tokenizer directory."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    specials = ("<pad>", "<bos>", "<eos>")
    vocab = {token: index for index, token in enumerate(specials)}
    for byte, char in _bytes_to_unicode().items():
        vocab[char] = byte + ByteTokenizer.OFFSET
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", ByteTokenizer.BOS)]
    )
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )
    tokenizer.chat_template = BYTE_CHAT_TEMPLATE
    return tokenizer
