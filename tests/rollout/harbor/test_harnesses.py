"""The harness table: sampling parameters, iteration limits, response-too-long policies."""

from __future__ import annotations

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_rollout.harbor.errors import HarborConfigError
from mizzen_rollout.harbor.harnesses import (
    HARNESSES,
    SAMPLING_KEYS,
    agent_setup,
    merge_agent_kwargs,
    normalize_sampling_params,
)
from mizzen_rollout.harbor.terminus_abort import ABORTING_TERMINUS_IMPORT_PATH

register_cpu_ci(est_time=2, labels=["rollout", "harbor"])


def setup_for(name: str, sampling=None, max_iterations=None, policy="abort"):
    return agent_setup(
        name,
        model_name="m",
        sampling_params=sampling,
        max_iterations=max_iterations,
        response_too_long=policy,
    )


def test_normalisation() -> None:
    assert normalize_sampling_params(
        {"max_new_tokens": 10, "temperature": 1.0, "top_k": None, "skip_special_tokens": True}
    ) == {"max_tokens": 10, "temperature": 1.0}
    with pytest.raises(HarborConfigError, match="unknown parameter 'beam_width'"):
        normalize_sampling_params({"beam_width": 4})
    with pytest.raises(HarborConfigError, match="conflicts"):
        normalize_sampling_params({"max_new_tokens": 10, "max_tokens": 20})


def test_rollout_sampling_params_dataclass_is_accepted() -> None:
    from mizzen_rollout.engines.base import SamplingParams

    defaults = normalize_sampling_params(SamplingParams())
    assert defaults == {"max_tokens": 128, "temperature": 1.0, "top_p": 1.0}  # "off" values dropped
    custom = normalize_sampling_params(
        SamplingParams(
            max_new_tokens=64,
            temperature=0.6,
            top_k=20,
            min_p=0.05,
            stop=["</s>"],
            seed=3,
            extra={"repetition_penalty": 1.1},
        )
    )
    assert custom == {
        "max_tokens": 64,
        "temperature": 0.6,
        "top_p": 1.0,
        "top_k": 20,
        "min_p": 0.05,
        "stop": ("</s>",),
        "seed": 3,
        "repetition_penalty": 1.1,
    }
    setup = setup_for("terminus-2", SamplingParams(temperature=0.6, ignore_eos=True))
    assert setup.kwargs["llm_call_kwargs"]["extra_body"] == {"ignore_eos": True}
    with pytest.raises(HarborConfigError, match="both directly and in 'extra'"):
        normalize_sampling_params({"top_k": 2, "extra": {"top_k": 3}})


def test_terminus_forwards_everything() -> None:
    setup = setup_for(
        "terminus-2",
        {
            "temperature": 0.6,
            "top_p": 0.9,
            "top_k": 40,
            "min_p": 0.0,
            "max_new_tokens": 99,
            "repetition_penalty": 1.1,
            "seed": 3,
            "stop": ["x"],
        },
        max_iterations=7,
    )
    assert setup.model_name == "openai/m"
    assert setup.kwargs["temperature"] == 0.6
    assert setup.kwargs["llm_call_kwargs"] == {
        "top_p": 0.9,
        "max_tokens": 99,
        "seed": 3,
        "stop": ["x"],
        "extra_body": {"top_k": 40, "repetition_penalty": 1.1},  # min_p=0 is "off"
    }
    assert setup.kwargs["max_turns"] == 7
    assert setup.kwargs["enable_summarize"] is False  # abort
    assert setup.kwargs["proactive_summarization_threshold"] == 0
    assert setup.name is None and setup.import_path == ABORTING_TERMINUS_IMPORT_PATH


def test_terminus_recover_policy() -> None:
    setup = setup_for("terminus-2", policy="recover")
    assert setup.kwargs["enable_summarize"] is True
    assert setup.name == "terminus-2" and setup.import_path is None


def test_zero_iterations() -> None:
    native = setup_for("terminus-2", max_iterations=0)
    assert native.harness == "terminus-2" and native.kwargs["max_turns"] == 0
    for name in ("mini-swe-agent", "claude-code", "opencode"):
        policy = "abort" if "abort" in HARNESSES[name].too_long_policies else "recover"
        swapped = setup_for(name, {"temperature": 0.5}, max_iterations=0, policy=policy)
        assert swapped.name == "nop" and swapped.substituted_for == name
        assert swapped.model_name is None and not swapped.kwargs


def test_unset_iterations_leave_the_harness_default() -> None:
    assert "max_turns" not in setup_for("terminus-2").kwargs
    assert "agent" not in setup_for("mini-swe-agent").kwargs.get("config", {})


def test_unforwardable_sampling_is_an_error() -> None:
    with pytest.raises(HarborConfigError, match=r"claude-code cannot forward \['temperature'\]"):
        setup_for("claude-code", {"temperature": 1.0}, policy="recover")
    with pytest.raises(HarborConfigError, match=r"opencode cannot forward \['max_tokens'\]"):
        setup_for("opencode", {"max_new_tokens": 5}, policy="recover")


def test_policy_support_per_harness() -> None:
    with pytest.raises(HarborConfigError, match="cannot abort"):
        setup_for("claude-code")
    with pytest.raises(HarborConfigError, match="use abort"):
        setup_for("mini-swe-agent", policy="recover")


def test_model_free_harnesses_ignore_model_settings() -> None:
    for name in ("oracle", "nop"):
        setup = setup_for(name, {"temperature": 0.3, "bogus": 1}, max_iterations=0)
        assert setup.name == name and setup.model_name is None and not setup.kwargs


def test_every_model_harness_forwards_known_keys_only() -> None:
    for spec in HARNESSES.values():
        assert spec.forwards <= set(SAMPLING_KEYS)
        assert spec.too_long_policies and spec.too_long_policies <= {"abort", "recover"}


def test_agent_kwargs_cannot_override_derived_ones() -> None:
    setup = setup_for("terminus-2", {"temperature": 0.5})
    merge_agent_kwargs(setup, {"parser_name": "xml"})
    assert setup.kwargs["parser_name"] == "xml"
    with pytest.raises(HarborConfigError, match="temperature"):
        merge_agent_kwargs(setup, {"temperature": 0.9})
