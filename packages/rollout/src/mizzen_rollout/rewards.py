"""Reward functions: math exact match, token F1, and custom ones by import path.

A reward function takes a :class:`~mizzen_rollout.samples.Sample` (``response_text``, ``label``,
``metadata``...) and returns a number, or an awaitable of one.  :func:`load_reward` resolves a
spec: ``math``, ``f1``, ``none``, ``package.module:function`` or ``path/to/file.py:function``.

Invariants:
- :func:`score_sample` never raises for a reward's fault: an exception, a non-number or a
  non-finite number turns the sample ``FAILED`` with the message in ``error``, so one bad sample
  never crashes a batch.  Only ``COMPLETED`` / ``TRUNCATED`` samples are scored.
- Custom synchronous functions run in a worker thread (they may be slow); the built-ins run
  inline.  Async functions are awaited.
- Extraction is deterministic and pure: ``extract_boxed`` takes the last ``\\boxed{...}`` (braces
  nested), ``extract_final_number`` prefers ``#### n``, then ``answer is n``, then the last number.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import re
import string
from collections import Counter
from collections.abc import Awaitable, Callable
from fractions import Fraction
from typing import Any

from .loading import ObjectSpecError, load_object
from .samples import Sample, SampleStatus

__all__ = [
    "RewardFn",
    "RewardSpecError",
    "extract_boxed",
    "extract_final_number",
    "extract_math_answer",
    "load_reward",
    "math_answers_equal",
    "math_exact_match",
    "normalize_math_answer",
    "score_sample",
    "score_samples",
    "token_f1",
    "token_f1_reward",
]

RewardFn = Callable[[Sample], float | Awaitable[float]]


class RewardSpecError(ObjectSpecError):
    """A reward spec (``module:function``) cannot be resolved; the message says why and how."""


# ============================================================================= extraction
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_NUMBER = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?|[-+]?\.\d+"
_GSM8K = re.compile(r"####\s*(" + _NUMBER + r")")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)\s*\$?\s*(" + _NUMBER + r")", re.IGNORECASE)
_ANY_NUMBER = re.compile(_NUMBER)


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces kept; None if
    there is none or its braces never close."""
    matches = list(_BOXED.finditer(text))
    for match in reversed(matches):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
    return None


def extract_final_number(text: str) -> str | None:
    """The final numeric answer: ``#### n`` (GSM8K), else the last ``answer is n``, else the last
    number in the text; None when there is no number."""
    for pattern in (_GSM8K, _ANSWER_IS):
        found = pattern.findall(text)
        if found:
            return found[-1].strip()
    found = _ANY_NUMBER.findall(text)
    return found[-1].strip() if found else None


def extract_math_answer(text: str) -> str | None:
    """``\\boxed{}`` content if present, else the final number."""
    boxed = extract_boxed(text)
    return boxed if boxed is not None else extract_final_number(text)


_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_FRAC = re.compile(r"\\frac\{([^{}]+)\}\{([^{}]+)\}")
_LHS = re.compile(r"^[a-zA-Z]\w*\s*=\s*(.+)$")


def normalize_math_answer(answer: str) -> str:
    """Canonical string form: no ``$``/spaces/``\\left``/``\\right``/``%``, ``\\dfrac``->``\\frac``,
    ``\\text{x}``->``x``, thousands separators and a trailing period dropped, ``x = 5`` -> ``5``."""
    s = answer.strip()
    s = _TEXT_WRAPPER.sub(r"\1", s)
    for old, new in (("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\left", ""), ("\\right", "")):
        s = s.replace(old, new)
    for junk in ("\\$", "$", "\\%", "%", "\\!", "\\,", "\\;", "^\\circ", "^{\\circ}"):
        s = s.replace(junk, "")
    s = s.strip().rstrip(".").strip()
    lhs = _LHS.match(s)
    if lhs:
        s = lhs.group(1)
    s = re.sub(r"(?<=\d),(?=\d{3}\b)", "", s)
    s = re.sub(r"\s+", "", s)
    return s.lower()


def _to_number(s: str) -> Fraction | None:
    frac = _FRAC.fullmatch(s)
    if frac:
        num, den = _to_number(frac.group(1)), _to_number(frac.group(2))
        if num is None or den is None or den == 0:
            return None
        return num / den
    if "/" in s:
        num_s, _, den_s = s.partition("/")
        num, den = _to_number(num_s), _to_number(den_s)
        if num is None or den is None or den == 0:
            return None
        return num / den
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def math_answers_equal(prediction: str | None, reference: str | None) -> bool:
    """Equal after normalisation, numerically (fractions, decimals) or as strings."""
    if prediction is None or reference is None:
        return False
    p, r = normalize_math_answer(prediction), normalize_math_answer(reference)
    if not p or not r:
        return False
    pn, rn = _to_number(p), _to_number(r)
    if pn is not None and rn is not None:
        return abs(pn - rn) <= Fraction(1, 10**6) * max(1, abs(rn))
    return p == r


def _reference_answer(label: Any) -> str | None:
    if label is None:
        return None
    if isinstance(label, int | float) and not isinstance(label, bool):
        return str(label)
    text = str(label)
    # A full worked solution as the label (GSM8K "... #### 42", MATH "\\boxed{..}"): extract.
    if extract_boxed(text) is not None or _GSM8K.search(text):
        return extract_math_answer(text)
    return text


def math_exact_match(sample: Sample) -> float:
    """1.0 when the response's final answer equals the label's, else 0.0."""
    return float(
        math_answers_equal(
            extract_math_answer(sample.response_text), _reference_answer(sample.label)
        )
    )


# ============================================================================= token F1
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def _f1_tokens(text: str) -> list[str]:
    text = text.lower().translate(_PUNCT)
    return _ARTICLES.sub(" ", text).split()


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD-style bag-of-tokens F1 (lower-cased, punctuation and articles removed)."""
    pred, ref = _f1_tokens(prediction), _f1_tokens(reference)
    if not pred and not ref:
        return 1.0
    if not pred or not ref:
        return 0.0
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def token_f1_reward(sample: Sample) -> float:
    """Token F1 of the response against the label (a string, or the best of a list)."""
    label = sample.label
    references = label if isinstance(label, list) else [label]
    references = [str(r) for r in references if r is not None]
    if not references:
        return 0.0
    return max(token_f1(sample.response_text, r) for r in references)


math_exact_match._mizzen_inline = True  # type: ignore[attr-defined]
token_f1_reward._mizzen_inline = True  # type: ignore[attr-defined]

BUILTIN_REWARDS: dict[str, RewardFn] = {
    "math": math_exact_match,
    "math_exact_match": math_exact_match,
    "f1": token_f1_reward,
    "token_f1": token_f1_reward,
}


# ============================================================================= loading
def load_reward(spec: str | None) -> RewardFn | None:
    """Resolve a reward spec; ``None``/``"none"`` mean no reward.

    ``math`` | ``f1`` | ``package.module:function`` | ``path/to/file.py:function`` (the rule of
    :func:`mizzen_rollout.loading.load_object`).
    """
    if spec is None or spec == "none":
        return None
    try:
        return load_object(spec, what="reward", builtins=BUILTIN_REWARDS)
    except ObjectSpecError as exc:
        raise RewardSpecError(str(exc)) from None


def _reward_name(fn: RewardFn) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def _fail(sample: Sample, message: str) -> Sample:
    sample.status = SampleStatus.FAILED
    sample.reward = None
    sample.error = message
    return sample


async def score_sample(sample: Sample, fn: RewardFn | None) -> Sample:
    """Set ``sample.reward`` from ``fn``; on any reward error mark the sample FAILED."""
    if fn is None or sample.status not in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED):
        return sample
    name = _reward_name(fn)
    try:
        if inspect.iscoroutinefunction(fn) or getattr(fn, "_mizzen_inline", False):
            value = fn(sample)
        else:
            value = await asyncio.to_thread(fn, sample)
        if inspect.isawaitable(value):
            value = await value
    except Exception as exc:
        return _fail(sample, f"reward {name} raised {type(exc).__name__}: {exc}")
    if isinstance(value, bool):
        value = float(value)
    if not isinstance(value, int | float):
        return _fail(sample, f"reward {name} returned {value!r}, not a number")
    if not math.isfinite(value):
        return _fail(sample, f"reward {name} returned {value}, not a finite number")
    sample.reward = float(value)
    return sample


async def score_samples(samples: list[Sample], fn: RewardFn | None) -> list[Sample]:
    """Score samples concurrently (see :func:`score_sample`)."""
    await asyncio.gather(*(score_sample(s, fn) for s in samples))
    return samples
