"""Tokenizers of the embedded engine: a byte-level one for the tiny model, and an adapter that
gives a local Hugging Face tokenizer the same small interface.

Invariants:
- :class:`ByteTokenizer` needs nothing (no files, no hub): ids 0/1/2 are pad/bos/eos and byte
  ``b`` is id ``b + 3``, so every string round-trips through ``encode``/``decode``.
- Both tokenizers expose ``encode``, ``decode``, ``token_text``, ``apply_chat_template``,
  ``eos_token_ids``, ``pad_token_id`` and ``vocab_size``; the backend uses nothing else.
- No module-scope import of transformers (the adapter receives an already loaded tokenizer).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ByteTokenizer", "HFTokenizerAdapter", "TokenizerError"]


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
        """``<|role|>\\ncontent\\n`` per message, then ``<|assistant|>\\n`` (the generation prompt)."""
        text = "".join(f"<|{m['role']}|>\n{m.get('content') or ''}\n" for m in messages)
        return self.encode(text + "<|assistant|>\n")


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
