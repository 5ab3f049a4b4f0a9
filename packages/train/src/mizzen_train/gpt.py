"""Build a megatron-core GPT with the local layer spec, for the slot executor.

One builder for tests, benchmarks and jobs, so every caller gets the configuration the executor
supports: dropout-free (the CPU RNG stand-in never draws), no fused bias-dropout (which would
cost a 17 s ``torch.compile`` on the CPU), bf16 or fp32 weights, tensor parallelism taken from
the already-initialised ``megatron.core.parallel_state``.

:class:`GPTSpec` covers two families through megatron's own ``TransformerConfig`` options:

- the GPT-2 shape (the defaults): LayerNorm, GELU MLP, learned absolute positions, biases,
  untied output layer;
- the Llama shape of modern checkpoints (:meth:`GPTSpec.llama`): RMSNorm, SwiGLU
  (``gated_linear_unit`` with SiLU), rotary position embeddings, grouped-query attention
  (``num_query_groups``), no biases, tied or untied embeddings.  :mod:`mizzen_train.hf` maps
  this shape to and from Hugging Face's ``LlamaForCausalLM``.

Invariants:
- With ``cpu_initialization=True`` the weights are drawn in full on the host from ``seed`` and
  then sliced (megatron's CPU init), so the model is the same function at every TP size.
- The model is cast to its dtype as a whole (norms included), as megatron's ``Float16Module``
  would, and moved to ``device``.
- Every field is checked before megatron sees it (:meth:`GPTSpec.check`); a bad value raises
  ``ValueError`` naming the field and the fix.
- Attention is :class:`~mizzen_train.packed_attention.PackedCoreAttention` (THD streams with
  ``cu_seqlens``, no dense mask; rotary embeddings applied there at per-segment positions, so
  megatron's model has ``position_embedding_type="none"`` for the rope shape).  Callers pass
  ``attention_mask=None`` and, for packed rows, ``packed_seq_params``.  ``attention="dense"``
  builds megatron's own local spec instead (unfused softmax over a ``[b, 1, s, s]`` mask): the
  baseline of ``benchmarks/bench_train_step.py`` and of the parity tests, never the trainers'.
- On CUDA the SwiGLU MLP runs megatron's fused bias-SwiGLU (``torch.compile``d by megatron's
  ``jit_fuser`` on first use); on the CPU everything stays eager (no compile cost in tests).
  RMSNorm is ``torch.nn.RMSNorm`` (torch's fused kernel on CUDA); megatron's fused rope needs
  Transformer Engine, so rope is the packed attention's own few elementwise ops.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
ACTIVATIONS = ("gelu", "swiglu")
POSITION_EMBEDDINGS = ("learned_absolute", "rope")
#: "packed": the trainers' THD attention; "dense": megatron's local spec (baseline only).
ATTENTIONS = ("packed", "dense")


@dataclass(frozen=True)
class GPTSpec:
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None
    vocab_size: int = 128
    max_sequence_length: int = 64
    dtype: str = "fp32"
    #: "LayerNorm" (GPT-2) or "RMSNorm" (Llama).
    normalization: str = "LayerNorm"
    #: "gelu" (one fc1 output) or "swiglu" (fc1 = [gate; up], silu(gate) * up).
    activation: str = "gelu"
    #: "learned_absolute" (GPT-2) or "rope" (rotary, non-interleaved: Hugging Face's rotate_half).
    position_embedding: str = "learned_absolute"
    rotary_base: float = 10000.0
    #: Key/value heads (grouped-query attention); None = one per attention head.
    num_query_groups: int | None = None
    #: Head dimension; None = hidden_size / num_attention_heads.
    kv_channels: int | None = None
    norm_epsilon: float = 1e-5
    add_bias_linear: bool = True
    tie_embeddings: bool = False

    @classmethod
    def llama(cls, **fields) -> GPTSpec:
        """The Llama family's shape (RMSNorm, SwiGLU, RoPE, no biases); ``fields`` override."""
        defaults = dict(
            normalization="RMSNorm",
            activation="swiglu",
            position_embedding="rope",
            add_bias_linear=False,
            norm_epsilon=1e-6,
        )
        return replace(cls(), **{**defaults, **fields})

    # -- derived shape --------------------------------------------------------------------------

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    def check(self) -> None:
        """Raise ``ValueError`` (field, rule, fix) for a spec megatron would refuse or misread."""
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTSpec.{name}={value!r}: must be a positive integer")
        if self.max_sequence_length < 1:
            raise ValueError(f"GPTSpec.max_sequence_length={self.max_sequence_length!r}: use >= 1")
        if self.dtype not in DTYPES:
            raise ValueError(f"GPTSpec.dtype={self.dtype!r}: use one of {sorted(DTYPES)}")
        for name, allowed in (
            ("normalization", NORMALIZATIONS),
            ("activation", ACTIVATIONS),
            ("position_embedding", POSITION_EMBEDDINGS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"GPTSpec.{name}={getattr(self, name)!r}: use one of {allowed}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"GPTSpec.hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}; set kv_channels (head_dim)"
            )
        if self.num_attention_heads % self.query_groups:
            raise ValueError(
                f"GPTSpec.num_query_groups={self.num_query_groups}: must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.position_embedding == "rope" and self.head_dim % 2:
            raise ValueError(f"GPTSpec head_dim={self.head_dim}: rotary embeddings need it even")

    def parameter_count(self) -> int:
        """Parameters of the full (unsharded) model, counted from the shape the builder makes."""
        hidden, ffn, head = self.hidden_size, self.ffn_size, self.head_dim
        bias = self.add_bias_linear
        norm = hidden * (1 if self.normalization == "RMSNorm" else 2)
        q_out = self.num_attention_heads * head
        qkv_out = q_out + 2 * self.query_groups * head
        fc1_out = 2 * ffn if self.activation == "swiglu" else ffn
        per_layer = (
            norm
            + hidden * qkv_out
            + q_out * hidden
            + norm
            + hidden * fc1_out
            + ffn * hidden
            + (qkv_out + hidden + fc1_out + hidden if bias else 0)
        )
        embeddings = self.vocab_size * hidden
        if self.position_embedding == "learned_absolute":
            embeddings += self.max_sequence_length * hidden
        output = 0 if self.tie_embeddings else self.vocab_size * hidden
        return self.num_layers * per_layer + embeddings + norm + output


def build_gpt(
    spec: GPTSpec,
    *,
    device: str | torch.device,
    seed: int = 1234,
    cpu_initialization: bool | None = None,
    attention: str = "packed",
) -> torch.nn.Module:
    """A ``GPTModel`` for the current megatron parallel state, on ``device`` (see the module
    docstring for ``attention``)."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    spec.check()
    if attention not in ATTENTIONS:
        raise ValueError(f"build_gpt attention={attention!r}: use one of {ATTENTIONS}")
    device = torch.device(device)
    if cpu_initialization is None:
        cpu_initialization = device.type == "cpu"
    dtype = DTYPES[spec.dtype]
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    swiglu = spec.activation == "swiglu"
    config = TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.kv_channels,
        ffn_hidden_size=spec.ffn_hidden_size,
        normalization=spec.normalization,
        layernorm_epsilon=spec.norm_epsilon,
        gated_linear_unit=swiglu,
        activation_func=torch.nn.functional.silu if swiglu else torch.nn.functional.gelu,
        add_bias_linear=spec.add_bias_linear,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        use_cpu_initialization=cpu_initialization,
        bias_dropout_fusion=False,
        bias_activation_fusion=swiglu and device.type == "cuda",
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype is torch.bfloat16,
    )
    layer_spec = get_gpt_layer_local_spec(normalization=spec.normalization)
    position_embedding = spec.position_embedding
    if attention == "packed":
        layer_spec = _packed_layer_spec(layer_spec, spec)
        if position_embedding == "rope":  # applied per segment by the packed attention
            position_embedding = "none"
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_sequence_length,
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_embeddings,
        position_embedding_type=position_embedding,
        rotary_base=spec.rotary_base,
    )
    return model.to(device=device, dtype=dtype)


def _packed_layer_spec(layer_spec, spec: GPTSpec):
    """megatron's local layer spec with :class:`PackedCoreAttention` as its core attention."""
    import copy
    import functools

    from mizzen_train.packed_attention import PackedCoreAttention

    layer_spec = copy.deepcopy(layer_spec)
    rotary_base = spec.rotary_base if spec.position_embedding == "rope" else None
    attention = layer_spec.submodules.self_attention.submodules
    attention.core_attention = functools.partial(PackedCoreAttention, rotary_base=rotary_base)
    return layer_spec
