"""The ``deepseek_v4`` entry of the ``mizzen.plugins`` entry-point group.

Invariant: this module only assembles the :class:`~mizzen_plugins.ModelPlugin`; everything it names
imports on a CPU machine (FlexAttention loads lazily inside the flex path).
"""

from __future__ import annotations

from mizzen_plugins.deepseek_v4.attention import DeepSeekV4AttentionStack
from mizzen_plugins.deepseek_v4.config import MODEL_TYPE, DeepSeekV4StackConfig
from mizzen_plugins.discovery import ModelPlugin

__all__ = ["PLUGIN", "build_stack"]


def build_stack(config: DeepSeekV4StackConfig) -> DeepSeekV4AttentionStack:
    return DeepSeekV4AttentionStack(config.attention, config.compress_ratios)


PLUGIN = ModelPlugin(
    name="deepseek_v4",
    family=MODEL_TYPE,
    config_class=DeepSeekV4StackConfig,
    build=build_stack,
    description="DeepSeek-V4-style attention stack: window + compressed KV + top-k indexer + sink",
)
