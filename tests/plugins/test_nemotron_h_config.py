"""Nemotron-H layer patterns and configs: parsing, Hugging Face dict round trip, clear errors."""

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mizzen_ci import register_cpu_ci
from mizzen_plugins.nemotron_h.config import ModelConfigError, NemotronHConfig
from mizzen_plugins.nemotron_h.pattern import (
    LayerKind,
    PatternError,
    format_pattern,
    kinds_from_block_types,
    kinds_to_block_types,
    parse_pattern,
)

register_cpu_ci(est_time=8, labels=["ssm", "plugins"])

SMALL = {
    "model_type": "nemotron_h",
    "vocab_size": 97,
    "hidden_size": 32,
    "hybrid_override_pattern": "M-M*-M-",
    "ssm_state_size": 8,
    "mamba_num_heads": 4,
    "mamba_head_dim": 8,
    "n_groups": 2,
    "conv_kernel": 4,
    "chunk_size": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 48,
}


# ------------------------------------------------------------------------------------ patterns
def test_pattern_parses_each_character_to_its_layer_kind():
    kinds = parse_pattern("M-M*-M-")
    assert kinds == (
        LayerKind.SSM,
        LayerKind.MLP,
        LayerKind.SSM,
        LayerKind.ATTENTION,
        LayerKind.MLP,
        LayerKind.SSM,
        LayerKind.MLP,
    )
    assert format_pattern(kinds) == "M-M*-M-"
    assert kinds_to_block_types(kinds)[:4] == [
        "linear_attention",
        "mlp",
        "linear_attention",
        "full_attention",
    ]
    assert kinds_from_block_types(kinds_to_block_types(kinds)) == kinds


@given(
    prefix=st.text(alphabet="M*-", max_size=12),
    bad=st.characters(exclude_characters="M*-E", exclude_categories=("Cs",)),
    suffix=st.text(max_size=6),
)
def test_pattern_rejects_the_first_bad_character_with_its_position(prefix, bad, suffix):
    pattern = prefix + bad + suffix
    with pytest.raises(PatternError) as info:
        parse_pattern(pattern)
    message = str(info.value)
    assert f"position {len(prefix)} is {bad!r}" in message
    assert "'M'" in message and "'*'" in message and "'-'" in message  # what is allowed


def test_pattern_rejects_moe_as_unsupported_not_unknown():
    with pytest.raises(PatternError, match=r"position 2 is 'E' \(moe layer\).*out of scope"):
        parse_pattern("M-E*")
    with pytest.raises(PatternError, match=r"layers_block_type\[1\] is 'moe'"):
        kinds_from_block_types(["linear_attention", "moe"])


def test_pattern_length_must_match_num_layers_and_says_where():
    with pytest.raises(
        PatternError,
        match=r"has 3 layers but num_hidden_layers = 5; layer 3 .*"
        r"missing: hybrid_override_pattern ends at position 3",
    ):
        parse_pattern("M-*", num_layers=5)
    with pytest.raises(
        PatternError,
        match=r"has 4 layers but num_hidden_layers = 2; position 2 "
        r"onwards \(2 extra\)",
    ):
        parse_pattern("M-*-", num_layers=2)
    with pytest.raises(PatternError, match="empty"):
        parse_pattern("")
    with pytest.raises(
        PatternError, match=r"layers_block_type\[0\] is 'attention', not a block type"
    ):
        kinds_from_block_types(["attention"])


# ------------------------------------------------------------------------------------- configs
def test_config_reads_hf_keys_and_derives_sizes():
    config = NemotronHConfig.from_hf_dict(SMALL)
    assert config.pattern == "M-M*-M-" and config.num_layers == 7
    assert config.ssm_inner_size == 32  # mamba_num_heads * mamba_head_dim
    assert config.conv_channels == 32 + 2 * 2 * 8
    assert config.in_proj_size == 32 + config.conv_channels + 4
    assert config.dt_limit == (0.0, math.inf)  # HF default


def test_config_round_trips_through_an_hf_dict_and_json():
    config = NemotronHConfig.from_hf_dict(
        {**SMALL, "use_conv_bias": False, "mlp_bias": True, "tie_word_embeddings": True}
    )
    hf = config.to_hf_dict()
    assert hf["hybrid_override_pattern"] == "M-M*-M-" and hf["num_hidden_layers"] == 7
    assert hf["architectures"] == ["NemotronHForCausalLM"]
    assert NemotronHConfig.from_hf_dict(hf) == config
    assert NemotronHConfig.from_hf_dict(json.loads(json.dumps(hf))) == config


def test_config_accepts_the_transformers5_spelling():
    # transformers >= 5 writes layers_block_type and encodes infinity as {"__float__": ...}.
    hf = {k: v for k, v in SMALL.items() if k != "hybrid_override_pattern"}
    hf["layers_block_type"] = ["linear_attention", "mlp", "full_attention"]
    hf["time_step_limit"] = [0.0, {"__float__": "Infinity"}]
    hf["mamba_d_conv"] = 4  # legacy alias agreeing with conv_kernel
    config = NemotronHConfig.from_hf_dict(hf)
    assert config.pattern == "M-*" and config.dt_limit == (0.0, math.inf)


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"n_groups": 3}, r"'n_groups' = 3 must divide 'mamba_num_heads' = 4 \(remainder 1\)"),
        (
            {"num_key_value_heads": 3},
            r"'num_key_value_heads' = 3 must divide 'num_attention_heads' = 4",
        ),
        ({"num_hidden_layers": 8}, r"has 7 layers but num_hidden_layers = 8"),
        ({"hybrid_override_pattern": "M-x"}, r"position 2 is 'x'"),
        ({"layers_block_type": ["linear_attention"]}, r"disagree from position 1"),
        ({"hybrid_override_pattern": None}, r"layer pattern is missing"),
        ({"hidden_size": 0}, r"'hidden_size' = 0 must be a positive integer"),
        ({"mamba_head_dim": 8.0}, r"'mamba_head_dim' = 8.0 must be a positive integer"),
        ({"use_conv_bias": "yes"}, r"'use_conv_bias' = 'yes' must be true or false"),
        ({"time_step_min": 0.5, "time_step_max": 0.1}, r"0 < min <= max"),
        ({"time_step_limit": [0.2, 0.1]}, r"'time_step_limit' = \[0.2, 0.1\]"),
        ({"mlp_hidden_act": "gelu"}, r"'mlp_hidden_act' = 'gelu' is not supported"),
        ({"mamba_hidden_act": "relu"}, r"'mamba_hidden_act' = 'relu' is not supported"),
        ({"attention_bias": True}, r"'attention_bias' = True is not supported"),
        ({"num_nextn_predict_layers": 1}, r"multi-token-prediction"),
        ({"model_type": "llama"}, r"'model_type' = 'llama'"),
        (
            {"conv_kernel": 4, "mamba_d_conv": 3},
            r"'conv_kernel' = 4, 'mamba_d_conv' = 3 name the same",
        ),
    ],
)
def test_config_errors_name_the_field_and_rule(changes, expected):
    hf = {**SMALL, **changes}
    with pytest.raises(ModelConfigError, match=expected):
        NemotronHConfig.from_hf_dict(hf)


def test_config_reports_every_problem_at_once():
    hf = {**SMALL, "n_groups": 3, "num_key_value_heads": 3}
    del hf["vocab_size"]
    with pytest.raises(ModelConfigError) as info:
        NemotronHConfig.from_hf_dict(hf)
    message = str(info.value)
    assert "'vocab_size' is required but missing" in message
    # Missing required keys stop before the relations are checked; fix that and both show.
    hf["vocab_size"] = 97
    with pytest.raises(ModelConfigError) as info:
        NemotronHConfig.from_hf_dict(hf)
    assert "'n_groups' = 3" in str(info.value) and "'num_key_value_heads' = 3" in str(info.value)


def test_config_checks_relations_only_for_layers_that_exist():
    # No attention layer: the attention head counts are irrelevant and not checked.
    config = NemotronHConfig.from_hf_dict(
        {**SMALL, "hybrid_override_pattern": "M-M-", "num_key_value_heads": 3}
    )
    assert LayerKind.ATTENTION not in config.layers
