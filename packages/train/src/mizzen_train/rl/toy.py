"""The two-tenant toy RL tasks (README demo, CPU and GPU e2e tests): rewards a tiny random Llama
can learn in tens of steps, and that are disjoint, so one tenant's adapter scores low on the
other's task.

- ``fixed_token`` (tenant A, "answer with one fixed token"): the first character of the response
  should be ``Y``; shaped by distance in byte value, ``max(0, 1 - |c - 'Y'| / 32)``, so a random
  policy already gets a gradient (an exact-match reward would be zero for every sample of a
  random byte policy).
- ``lowercase_format`` (tenant B, "a different format"): the fraction of the response's
  characters that are lowercase ASCII letters.

The prompts (``example:rl_fixed``, ``example:rl_format``) are short requests; the rewards read
the response only.
"""

from __future__ import annotations

from mizzen_rollout.api import Sample

TARGET = "Y"
WIDTH = 32.0


def fixed_token(sample: Sample) -> float:
    text = sample.response_text
    if not text:
        return 0.0
    return max(0.0, 1.0 - abs(ord(text[0]) - ord(TARGET)) / WIDTH)


def lowercase_format(sample: Sample) -> float:
    text = sample.response_text
    if not text:
        return 0.0
    return sum("a" <= c <= "z" for c in text) / len(text)


fixed_token._mizzen_inline = True  # type: ignore[attr-defined]
lowercase_format._mizzen_inline = True  # type: ignore[attr-defined]
