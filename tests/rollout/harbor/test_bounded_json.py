"""`bounded_json`: JSON text nobody vouches for is measured before it is decoded."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mizzen_ci import register_cpu_ci
from mizzen_rollout.harbor.bounded_json import loads_bounded, nesting_depth

register_cpu_ci(est_time=5, labels=["rollout", "harbor"])

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=30,
)  # fmt: skip


def depth_of(value: object) -> int:
    if isinstance(value, list):
        return 1 + max(map(depth_of, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(depth_of, value.values()), default=0)
    return 0


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        ("", 0),
        ("1", 0),
        ('{"a": [1, "]]]", {"b": "\\\\"}]}', 3),  # brackets in strings, an escaped backslash
        ('["\\"[[", [[]]]', 3),  # an escaped quote does not end the string
        ('["[[[', 1),  # an unterminated string runs to the end
        ("]]][", 0),  # a decoder stops at the first `]`
    ],
)
def test_nesting_depth_leaves_strings_out(text: str, depth: int) -> None:
    assert nesting_depth(text) == depth


@settings(max_examples=200, deadline=None, database=None)
@given(value=JSON_VALUES)
def test_nesting_depth_of_json_is_its_depth(value: object) -> None:
    assert nesting_depth(json.dumps(value)) == depth_of(value)
    assert loads_bounded(json.dumps(value), max_chars=10**6, max_depth=100) == (value, "")


def test_measuring_is_linear_on_many_escaped_quotes() -> None:
    # with a required closing quote the string pattern retries from every `"`: minutes, not ms
    started = time.monotonic()
    assert nesting_depth('"' + '\\"' * 200_000) == 0
    assert time.monotonic() - started < 2.0


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[" * 100_000 + "]" * 100_000, "has brackets nested 100000 deep, over the limit of 50"),
        ("[" * 99_000, "has brackets nested 99000 deep, over the limit of 50"),
        ("x" * 300_001, "is 300001 characters long, over the limit of 300000"),
        ('{"a": 1', "is not valid JSON (Expecting ',' delimiter at line 1 column 8)"),
        ("9" * 5000, "is not valid JSON (ValueError)"),  # over int()'s digit limit
    ],
)
def test_what_is_refused_and_why(text: str, problem: str) -> None:
    assert loads_bounded(text, max_chars=300_000, max_depth=50) == (None, problem)
