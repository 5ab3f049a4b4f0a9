"""Parsing JSON text that nobody vouches for (worker variables, files an agent wrote).

    value, problem = loads_bounded(text, max_chars=..., max_depth=...)

Invariants:
- Never raises (for a `str`): any text gives either `(value, "")` or `(None, problem)`, where
  `problem` says what was wrong (size, nesting, syntax with line and column) and never repeats
  the text, which may hold a secret.
- The size and the nesting are checked before the text is decoded, so no input reaches the
  decoder's recursion limit or holds more than `max_chars` characters. Nesting counts the
  brackets outside strings: `{}` is 1 level, `{"a": [1]}` is 2.
"""

from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

#: a JSON string, or an unterminated one to the end of the text: the closing quote is optional
#: so that every match succeeds where it starts (linear; a required quote is quadratic on `"\\"...`)
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_DELTA = {"[": 1, "{": 1, "]": -1, "}": -1}


def nesting_depth(text: str) -> int:
    """The deepest bracket nesting of `text`, strings left out (an estimate for invalid JSON,
    never below what a decoder would recurse through); linear in `len(text)`."""
    skeleton = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(0, max(accumulate(map(_DELTA.__getitem__, skeleton)), default=0))


def loads_bounded(text: str, *, max_chars: int, max_depth: int) -> tuple[Any, str]:
    """`json.loads(text)` if `text` is at most `max_chars` long and `max_depth` deep, as
    `(value, "")`; otherwise `(None, problem)` (see the module docstring)."""
    if len(text) > max_chars:
        return None, f"is {len(text)} characters long, over the limit of {max_chars}"
    depth = nesting_depth(text)
    if depth > max_depth:
        return None, f"has brackets nested {depth} deep, over the limit of {max_depth}"
    try:
        return json.loads(text), ""
    except json.JSONDecodeError as exc:  # exc.doc is the whole text: only msg and place leave
        problem = f"is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
    except (ValueError, RecursionError, MemoryError) as exc:  # e.g. a 5000-digit integer
        problem = f"is not valid JSON ({type(exc).__name__})"
    return None, problem
