"""Reward functions: extraction tables, equality, token F1, custom rewards, errors as failures."""

from __future__ import annotations

import asyncio
import sys
import textwrap

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_rollout.rewards import (
    RewardSpecError,
    extract_boxed,
    extract_final_number,
    extract_math_answer,
    load_reward,
    math_answers_equal,
    math_exact_match,
    score_sample,
    score_samples,
    token_f1,
    token_f1_reward,
)
from mizzen_rollout.samples import Sample, SampleStatus

register_cpu_ci(est_time=3, labels=["rollout"])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so the answer is \boxed{42}.", "42"),
        (r"\boxed{1} then \boxed{2}", "2"),
        (r"\boxed{\frac{3}{4}}", r"\frac{3}{4}"),
        (r"\boxed{x^{2} + \sqrt{y}}", r"x^{2} + \sqrt{y}"),
        (r"\fbox{7}", "7"),
        (r"\boxed {5}", "5"),
        (r"\boxed{unclosed", None),
        ("no box here 12", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72"),
        ("The answer is 1,234 apples, not 5.", "1,234"),
        ("answer: -3.5", "-3.5"),
        ("I think 3 then 4 then 12", "12"),
        ("half is 1/2", "1/2"),
        ("value .5", ".5"),
        ("no digits at all", None),
    ],
)
def test_extract_final_number(text, expected):
    assert extract_final_number(text) == expected


def test_boxed_wins_over_final_number():
    assert extract_math_answer(r"\boxed{7} and later 9") == "7"
    assert extract_math_answer("later 9") == "9"


@pytest.mark.parametrize(
    ("prediction", "reference", "equal"),
    [
        ("12", "12", True),
        ("12.0", "12", True),
        ("1,234", "1234", True),
        (r"\frac{3}{4}", "0.75", True),
        (r"\dfrac{3}{4}", "3/4", True),
        ("$5$", "5", True),
        (r"50\%", "50", True),
        ("x = 4", "4", True),
        (r"\text{ 9 }", "9", True),
        ("12.", "12", True),
        ("13", "12", False),
        ("0.3333", "1/3", False),
        ("a+b", "a + b", True),
        ("", "0", False),
        (None, "0", False),
    ],
)
def test_math_answers_equal(prediction, reference, equal):
    assert math_answers_equal(prediction, reference) is equal


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        (r"... so \boxed{12}", "12", 1.0),
        ("3 rows of 4 gives 12", 12, 1.0),
        ("it is 13", "12", 0.0),
        ("It is 72.", "Natalia sold 48/2 = 24 clips ... 48+24 = 72\n#### 72", 1.0),
        ("nothing", None, 0.0),
    ],
)
def test_math_exact_match(response, label, reward):
    sample = Sample(prompt="q", response_text=response, label=label, status=SampleStatus.COMPLETED)
    assert math_exact_match(sample) == reward


@pytest.mark.parametrize(
    ("prediction", "reference", "f1"),
    [
        ("the cat sat", "a cat sat", 1.0),
        ("Paris", "paris!", 1.0),
        ("cat dog", "cat", 2 / 3),
        ("x", "y", 0.0),
        ("", "", 1.0),
        ("", "y", 0.0),
        ("red red blue", "red blue blue", 2 / 3),
    ],
)
def test_token_f1(prediction, reference, f1):
    assert token_f1(prediction, reference) == pytest.approx(f1)


def test_token_f1_reward_takes_the_best_reference():
    sample = Sample(prompt="q", response_text="Marie Curie", label=["Curie", "Marie Curie"])
    assert token_f1_reward(sample) == 1.0


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    source = textwrap.dedent(
        """
        import asyncio

        def length(sample):
            return len(sample.response_text)

        async def async_len(sample):
            await asyncio.sleep(0)
            return len(sample.response_text) / 10

        def boom(sample):
            raise ValueError("label missing")

        def not_a_number(sample):
            return "high"

        def nan(sample):
            return float("nan")

        def passed(sample):
            return sample.response_text == "ok"

        NOT_CALLABLE = 3
        """
    )
    (tmp_path / "my_rewards.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("my_rewards", None)


def test_load_reward_specs(reward_module):
    assert load_reward("math") is math_exact_match
    assert load_reward("f1") is token_f1_reward
    assert load_reward("none") is None and load_reward(None) is None
    assert load_reward("my_rewards:length").__name__ == "length"
    assert load_reward(f"{reward_module / 'my_rewards.py'}:async_len").__name__ == "async_len"
    for spec, message in [
        ("nonsense", "neither built in"),
        ("my_rewards:missing", "has no attribute 'missing'"),
        ("my_rewards:NOT_CALLABLE", "not callable"),
        ("no_such_module_xyz:f", "importing 'no_such_module_xyz' failed"),
        ("/nowhere/r.py:f", "does not exist"),
    ]:
        with pytest.raises(RewardSpecError, match=message):
            load_reward(spec)


def _done(text="ok") -> Sample:
    return Sample(prompt="q", response_text=text, status=SampleStatus.COMPLETED, request_id="r")


def test_score_sync_async_and_bool(reward_module):
    s = asyncio.run(score_sample(_done("abcd"), load_reward("my_rewards:length")))
    assert (s.reward, s.status) == (4.0, SampleStatus.COMPLETED)
    s = asyncio.run(score_sample(_done("abcd"), load_reward("my_rewards:async_len")))
    assert s.reward == pytest.approx(0.4)
    s = asyncio.run(score_sample(_done("ok"), load_reward("my_rewards:passed")))
    assert s.reward == 1.0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("my_rewards:boom", "reward boom raised ValueError: label missing"),
        ("my_rewards:not_a_number", "reward not_a_number returned 'high', not a number"),
        ("my_rewards:nan", "reward nan returned nan, not a finite number"),
    ],
)
def test_reward_errors_fail_the_sample_not_the_batch(reward_module, spec, message):
    samples = [_done("a"), _done("bb")]
    scored = asyncio.run(score_samples(samples, load_reward(spec)))
    for sample in scored:
        assert sample.status is SampleStatus.FAILED
        assert sample.error == message
        assert sample.reward is None
        sample.validate()


def test_only_finished_samples_are_scored():
    aborted = Sample(prompt="q", response_text="12", label="12", status=SampleStatus.ABORTED)
    truncated = Sample(prompt="q", response_text="12", label="12", status=SampleStatus.TRUNCATED)
    asyncio.run(score_samples([aborted, truncated], math_exact_match))
    assert aborted.reward is None and truncated.reward == 1.0
