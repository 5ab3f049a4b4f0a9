"""Prompt rendering: what an engine generates from for a prompt.  One rule, shared by the
trainer's generation evaluation (``mizzen_train``) and ``mizzen-rollout generate``.

- With the chat template (the default): the prompt as chat messages, a text prompt being one
  ``user`` message.  They go to ``/v1/chat/completions``, where the engine renders them with its
  tokenizer's chat template and the generation prompt (SGLang and the embedded engine alike), so
  the same record gives the same prompt tokens whoever sends it.
- Without it: the prompt as given; text is tokenised plainly by the engine (``/tokenize``: the
  tokenizer's special tokens, then the text) and may go in batches (``batch_size``).

Invariants:
- :func:`render_prompt` is pure: it copies, never mutates, and reads no tokenizer (the engine
  renders); standard library only.
- A chat prompt is never flattened to text: without the template it goes as chat messages (an
  engine without a chat template refuses it, saying so).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["Prompt", "render_prompt"]

#: A prompt: text, or chat messages (``{"role": ..., "content": ...}``).
Prompt = str | Sequence[Mapping[str, Any]]


def render_prompt(prompt: Prompt, *, chat_template: bool = True) -> str | list[dict[str, Any]]:
    """What an engine generates from for ``prompt`` (the rule of the module docstring)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}] if chat_template else prompt
    return [dict(message) for message in prompt]
