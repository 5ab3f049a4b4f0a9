"""The ``deepseek_v4`` entry of the ``mizzen.plugins`` entry-point group.

Invariant: this module only assembles the :class:`~mizzen_plugins.ModelPlugin`; everything it names
imports on a CPU machine (FlexAttention loads lazily inside the flex path).
"""

from __future__ import annotations

from mizzen_plugins.deepseek_v4.attention import DeepSeekV4AttentionStack
from mizzen_plugins.deepseek_v4.config import MODEL_TYPE, DeepSeekV4StackConfig
from mizzen_plugins.deepseek_v4.model import LM_MODEL_TYPE, build_causal_lm
from mizzen_plugins.discovery import ModelPlugin

__all__ = ["PLUGIN", "TINY_CONFIG", "build_stack"]

#: A DeepSeek-V4-style language model small enough to fine-tune on a CPU in seconds (byte
#: vocabulary): a window-only layer and a compressed one, hidden 32.
TINY_CONFIG = {
    "model_type": LM_MODEL_TYPE,
    "vocab_size": 259,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "q_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "sliding_window": 16,
    "index_n_heads": 1,
    "index_head_dim": 8,
    "index_topk": 2,
    "compress_ratios": [0, 4],
    "initializer_range": 0.1,
    "max_position_embeddings": 512,
}


def build_stack(config: DeepSeekV4StackConfig) -> DeepSeekV4AttentionStack:
    return DeepSeekV4AttentionStack(config.attention, config.compress_ratios)


PLUGIN = ModelPlugin(
    name="deepseek_v4",
    family=MODEL_TYPE,
    config_class=DeepSeekV4StackConfig,
    build=build_stack,
    description="DeepSeek-V4-style attention stack: window + compressed KV + top-k indexer + sink",
    causal_lm=build_causal_lm,
    # the attention's query, key/value and output projections and the MLP; the pooling gate
    # and the indexer stay frozen (the indexer's choice is discrete and gets no gradient)
    lora_targets=("wq_a", "wq_b", "wkv", "wo", "gate_proj", "up_proj", "down_proj"),
    tiny_config=TINY_CONFIG,
)
