"""DeepSeek-V4-style attention plugin: sliding window + compressed KV + top-k indexer + sink.

Importing this package builds no model; see :mod:`.attention` for the layer and its invariants.
"""

from mizzen_plugins.deepseek_v4.attention import (
    AttentionOutput,
    DeepSeekV4Attention,
    DeepSeekV4AttentionStack,
    apply_rope,
)
from mizzen_plugins.deepseek_v4.config import DeepSeekV4AttentionConfig, DeepSeekV4StackConfig

__all__ = [
    "AttentionOutput",
    "DeepSeekV4Attention",
    "DeepSeekV4AttentionConfig",
    "DeepSeekV4AttentionStack",
    "DeepSeekV4StackConfig",
    "apply_rope",
]
