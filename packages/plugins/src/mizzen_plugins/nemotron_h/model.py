"""The Nemotron-H-style hybrid language model, built from the config's layer pattern.

``embedding -> [block for each pattern character] -> final_norm -> lm_head``, where each block is
``x + layer(rms_norm(x))`` and ``layer`` is a :class:`~mizzen_plugins.nemotron_h.mixer.Mamba2Mixer`
(``M``), a :class:`~mizzen_plugins.nemotron_h.self_attention.CausalSelfAttention` (``*``) or a
squared-ReLU :class:`MLP` (``-``).

Invariants:
- The model works on packed (THD) batches: ``input_ids [T]`` with ``cu_seqlens [num_seqs + 1]``;
  each sequence's logits equal those of running it alone.  A ``[B, L]`` batch is the special case of
  ``B`` sequences of ``L`` tokens.  The batch structure is one
  :class:`~mizzen_plugins.thd.PackedLayout` (the workspace's THD helper), built once per forward.
- A block's layer attribute is named by its kind (``ssm``, ``attention`` or ``mlp``), so state-dict
  names say what they hold; :mod:`mizzen_plugins.nemotron_h.weights` maps them to Hugging Face.
- Norm arithmetic runs in at least float32; activations and the residual stream stay in the parameter dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mizzen_plugins.nemotron_h.config import NemotronHConfig
from mizzen_plugins.nemotron_h.mixer import Mamba2Mixer
from mizzen_plugins.nemotron_h.numerics import upcast
from mizzen_plugins.nemotron_h.pattern import LayerKind
from mizzen_plugins.nemotron_h.self_attention import CausalSelfAttention
from mizzen_plugins.thd import PackedLayout

__all__ = ["MLP", "HybridBlock", "HybridCausalLM", "RMSNorm", "build_model"]


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, computed in at least float32, returned in ``x``'s dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = upcast(x)
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(xf.dtype) * normed).to(x.dtype)


class MLP(nn.Module):
    """``down_proj(relu(up_proj(x)) ** 2)``."""

    def __init__(self, config: NemotronHConfig) -> None:
        super().__init__()
        self.config = config
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(
            config.intermediate_size, config.hidden_size, bias=config.mlp_bias
        )
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for linear in (self.up_proj, self.down_proj):
            nn.init.normal_(linear.weight, std=self.config.initializer_range)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)

    def forward(self, x: torch.Tensor, layout: PackedLayout | None = None) -> torch.Tensor:
        return self.down_proj(F.relu(self.up_proj(x)).square())


# kind -> (block attribute name, layer class).  The one table of what a pattern character builds.
LAYER_MODULES: dict[LayerKind, tuple[str, type[nn.Module]]] = {
    LayerKind.SSM: ("ssm", Mamba2Mixer),
    LayerKind.ATTENTION: ("attention", CausalSelfAttention),
    LayerKind.MLP: ("mlp", MLP),
}


class HybridBlock(nn.Module):
    """``x + layer(norm(x))`` for one pattern character."""

    def __init__(self, config: NemotronHConfig, kind: LayerKind) -> None:
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        attribute, layer_class = LAYER_MODULES[kind]
        self.layer_name = attribute
        self.add_module(attribute, layer_class(config))

    @property
    def layer(self) -> nn.Module:
        return getattr(self, self.layer_name)

    def forward(self, x: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
        return x + self.layer(self.norm(x), layout)


class HybridCausalLM(nn.Module):
    """The whole model: token ids of a packed batch -> next-token logits."""

    def __init__(self, config: NemotronHConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(HybridBlock(config, kind) for kind in config.layers)
        self.final_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Fresh random weights (layers re-initialise themselves at construction)."""
        c = self.config
        nn.init.normal_(self.embedding.weight, std=c.initializer_range)
        if self.lm_head is not None:
            nn.init.normal_(self.lm_head.weight, std=c.initializer_range)
        if c.rescale_prenorm_residual:
            # GPT-2 scheme: shrink each projection that writes into the residual stream by
            # 1/sqrt(depth), so the stream's variance does not grow with the number of layers.
            for block in self.layers:
                layer = block.layer
                out = layer.down_proj if isinstance(layer, MLP) else layer.out_proj
                out.weight.div_(math.sqrt(c.num_layers))

    def forward(
        self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | PackedLayout | None = None
    ) -> torch.Tensor:
        """Logits for ``input_ids``: ``[T]`` packed -> ``[T, vocab]``, or ``[B, L]`` -> ``[B, L, vocab]``.

        ``cu_seqlens`` (``[0, L0, L0+L1, ...]``, or a :class:`~mizzen_plugins.thd.PackedLayout` to
        skip the host sync) describes a packed ``[T]`` batch; None means one sequence.  A ``[B, L]``
        batch is ``B`` sequences of ``L`` tokens (``cu_seqlens`` must then be None).
        """
        hidden = self.hidden_states(input_ids, cu_seqlens)
        weight = self.embedding.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight)

    def hidden_states(
        self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | PackedLayout | None = None
    ) -> torch.Tensor:
        """The final-normed hidden states (shapes as in :meth:`forward`, width ``hidden_size``)."""
        batch_shape = input_ids.shape
        layout = PackedLayout.of_input_ids(input_ids, cu_seqlens)
        x = self.embedding(input_ids.reshape(-1))
        for block in self.layers:
            x = block(x, layout)
        x = self.final_norm(x)
        return x.reshape(*batch_shape, -1)


def build_model(config: NemotronHConfig) -> HybridCausalLM:
    """The plugin's builder: a randomly initialised model for ``config`` (on the default device)."""
    return HybridCausalLM(config)
