"""Import a Hugging Face Llama directory into megatron-core, export merged snapshots back.

- :func:`import_hf_llama`: ``config.json`` + ``*.safetensors`` -> a megatron ``GPTModel``
  (local spec, :meth:`GPTSpec.llama` shape) holding exactly those weights, on this rank's TP shard.
- :func:`export_hf_snapshot`: the megatron model -- the base alone, or the base with one slot's
  LoRA deltas merged (``W + alpha/rank * B @ A``, in fp32) -- as a Hugging Face directory
  (``model.safetensors``, ``config.json``, the tokenizer, ``generation_config.json``) that
  ``transformers`` and the embedded engine load.

Invariants:
- Names and fused layouts come from :mod:`mizzen_train.hf.mapping` only.
- Import validates the whole directory (config, every tensor's name, shape, dtype and
  finiteness) before it copies the first weight; errors are :class:`HFModelError` naming the file.
- Tensor parallelism: import slices each full tensor along the parameter's megatron partition
  axis; export all-gathers the shards over the TP group and global rank 0 writes.
- An export is atomic: it is written into a temporary sibling directory and renamed into place,
  so a reader (or a killed run) never sees a half-written snapshot.  The target must not exist.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mizzen_train.errors import HFModelError
from mizzen_train.gpt import DTYPES, GPTSpec, build_gpt
from mizzen_train.hf.config import HFLlamaConfig, export_config, read_llama_config
from mizzen_train.hf.mapping import LlamaLayout, hf_param_names, megatron_param_name
from mizzen_train.input_files import MAX_MODEL_CONFIG_BYTES, read_json_file

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: Files copied from the source directory into every snapshot when present.
CARRIED_FILES = ("generation_config.json",)
#: Buffers some older checkpoints store that carry no learned state.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class ImportedModel:
    model: torch.nn.Module
    source: HFLlamaConfig

    @property
    def spec(self) -> GPTSpec:
        return self.source.spec


def layout_of(spec: GPTSpec, tp_size: int = 1) -> LlamaLayout:
    return LlamaLayout(
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.query_groups,
        head_dim=spec.head_dim,
        ffn_hidden_size=spec.ffn_size,
        tp_size=tp_size,
    )


def hf_expected_shapes(spec: GPTSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama checkpoint of ``spec`` holds (``lm_head`` only when untied)."""
    hidden, head = spec.hidden_size, spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (spec.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not spec.tie_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, hidden)
    for i in range(spec.num_layers):
        prefix = f"model.layers.{i}"
        shapes[f"{prefix}.input_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}.post_attention_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}.self_attn.q_proj.weight"] = (spec.num_attention_heads * head, hidden)
        shapes[f"{prefix}.self_attn.k_proj.weight"] = (spec.query_groups * head, hidden)
        shapes[f"{prefix}.self_attn.v_proj.weight"] = (spec.query_groups * head, hidden)
        shapes[f"{prefix}.self_attn.o_proj.weight"] = (hidden, spec.num_attention_heads * head)
        shapes[f"{prefix}.mlp.gate_proj.weight"] = (spec.ffn_size, hidden)
        shapes[f"{prefix}.mlp.up_proj.weight"] = (spec.ffn_size, hidden)
        shapes[f"{prefix}.mlp.down_proj.weight"] = (hidden, spec.ffn_size)
    return shapes


def _weight_files(directory: Path) -> list[Path]:
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = read_json_file(index, MAX_MODEL_CONFIG_BYTES)["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise HFModelError(f"{index}: unreadable index ({exc}). Fix: restore it") from None
        files = []
        for name in names:
            path = directory / str(name)
            if Path(str(name)).name != str(name) or not path.is_file():
                raise HFModelError(
                    f"{index}: names shard {name!r}, which is not a file of {directory}. "
                    "Fix: restore the missing shard"
                )
            files.append(path)
        return files
    single = directory / WEIGHTS_FILE
    if single.is_file():
        return [single]
    found = sorted(p.name for p in directory.glob("*.safetensors"))
    if found:
        return [directory / name for name in found]
    legacy = sorted(p.name for p in directory.glob("*.bin"))
    hint = (
        f" (found {legacy}: PyTorch pickles are not loaded; re-save the model with "
        "save_pretrained(safe_serialization=True))"
        if legacy
        else ""
    )
    raise HFModelError(f"{directory}: no *.safetensors weights{hint}. Fix: add the weights")


def read_hf_weights(directory: str | Path, spec: GPTSpec) -> dict[str, torch.Tensor]:
    """Every tensor of a Llama checkpoint, validated against ``spec`` (fp32 host tensors)."""
    from safetensors import SafetensorError, safe_open

    directory = Path(directory)
    expected = hf_expected_shapes(spec)
    tensors: dict[str, torch.Tensor] = {}
    for file in _weight_files(directory):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    if name == "lm_head.weight" and spec.tie_embeddings:
                        continue  # tied: the embedding is the output layer
                    if name not in expected:
                        raise HFModelError(
                            f"{file}: tensor {name!r} is not part of a Llama model of this "
                            f"config ({len(expected)} tensors expected). Fix: check that "
                            "config.json matches the weights"
                        )
                    if name in tensors:
                        raise HFModelError(f"{file}: tensor {name!r} appears in two files")
                    tensors[name] = handle.get_tensor(name)
        except SafetensorError as exc:
            raise HFModelError(f"{file}: not a readable safetensors file ({exc})") from None
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise HFModelError(
            f"{directory}: {len(missing)} tensor(s) missing, e.g. {missing[:3]}. Fix: the "
            "checkpoint is incomplete or belongs to another config"
        )
    for name, shape in expected.items():
        tensor = tensors[name]
        if tuple(tensor.shape) != shape:
            raise HFModelError(
                f"{directory}: {name} has shape {tuple(tensor.shape)}, config.json implies "
                f"{shape}. Fix: check that config.json matches the weights"
            )
        if not tensor.dtype.is_floating_point:
            raise HFModelError(f"{directory}: {name} has dtype {tensor.dtype}, not floating point")
        tensor = tensor.to(torch.float32)
        if not bool(torch.isfinite(tensor).all()):
            raise HFModelError(f"{directory}: {name} holds non-finite values")
        tensors[name] = tensor
    return tensors


def _tp() -> tuple[int, int, Any]:
    from megatron.core import parallel_state

    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_group(),
    )


def _partition_dim(param: torch.Tensor) -> int | None:
    if getattr(param, "tensor_model_parallel", False):
        return int(param.partition_dim)
    return None


def _named_base_parameters(model: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """(megatron name without ``.base``, parameter) of the base model.  Slot adapters are not
    parameters of the model (slotted layers hold them outside the module tree); a tied output
    layer has no weight of its own."""
    for name, param in model.named_parameters():
        yield megatron_param_name(name), param


@torch.no_grad()
def load_hf_weights_into(model: torch.nn.Module, spec: GPTSpec, hf: Mapping[str, torch.Tensor]):
    """Copy a validated HF state (:func:`read_hf_weights`) into megatron ``model``'s shards."""
    tp_rank, tp_size, _ = _tp()
    layout = layout_of(spec, tp_size)
    seen = set()
    for name, param in _named_base_parameters(model):
        hf_names = hf_param_names(name)
        parts = [hf[n] for n in hf_names]
        full = layout.from_hf(name, parts) if len(parts) > 1 else parts[0]
        dim = _partition_dim(param)
        if dim is not None and tp_size > 1:
            full = full.chunk(tp_size, dim=dim)[tp_rank]
        if tuple(full.shape) != tuple(param.shape):
            raise HFModelError(
                f"megatron parameter {name} has shape {tuple(param.shape)} but the checkpoint "
                f"gives {tuple(full.shape)}; the model was built from another config"
            )
        param.copy_(full.to(device=param.device, dtype=param.dtype))
        seen.update(hf_names)
    unused = sorted(set(hf) - seen)
    if unused:
        raise HFModelError(f"checkpoint tensors {unused[:3]} have no megatron parameter")


def import_hf_llama(
    directory: str | Path,
    *,
    device: str | torch.device,
    dtype: str = "fp32",
    max_sequence_length: int | None = None,
) -> ImportedModel:
    """A megatron GPT holding the weights of the HF Llama directory (current parallel state)."""
    source = read_llama_config(directory, dtype=dtype)
    spec = source.spec
    if max_sequence_length is not None:
        from dataclasses import replace

        spec = replace(spec, max_sequence_length=max_sequence_length)
        source = HFLlamaConfig(source.path, spec, source.raw)
    tensors = read_hf_weights(directory, spec)
    _, tp_size, _ = _tp()
    if spec.vocab_size % tp_size:
        raise HFModelError(
            f"{source.path}: vocab_size={spec.vocab_size} does not divide over tensor "
            f"parallelism {tp_size} (megatron splits the vocabulary evenly). Fix: run with a "
            "TP size that divides it"
        )
    model = build_gpt(spec, device=device, cpu_initialization=True)
    load_hf_weights_into(model, spec, tensors)
    return ImportedModel(model=model, source=source)


# -- export -----------------------------------------------------------------------------------


def _gather_full(param: torch.Tensor, tp_size: int, group: Any) -> torch.Tensor:
    dim = _partition_dim(param)
    local = param.detach()
    if dim is None or tp_size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(tp_size)]
    torch.distributed.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


@torch.no_grad()
def megatron_to_hf_state(
    model: torch.nn.Module,
    spec: GPTSpec,
    *,
    deltas: Mapping[str, torch.Tensor] | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """The HF state of the megatron model (every rank gathers it; collective under TP).

    ``deltas`` maps a linear's layer key (``decoder.layers.0.self_attention.linear_qkv``) to the
    full fp32 ``[out, in]`` delta added to its weight before the split (a merged LoRA)."""
    _, tp_size, group = _tp()
    layout = layout_of(spec, tp_size)
    deltas = dict(deltas or {})
    state: dict[str, torch.Tensor] = {}
    for name, param in _named_base_parameters(model):
        full = _gather_full(param, tp_size, group).to(torch.float32)
        key = name[: -len(".weight")] if name.endswith(".weight") else name
        delta = deltas.pop(key, None)
        if delta is not None:
            full = full + delta.to(device=full.device, dtype=torch.float32)
        hf_names = hf_param_names(name)
        parts = layout.to_hf(name, full) if len(hf_names) > 1 else [full]
        for hf_name, part in zip(hf_names, parts, strict=True):
            state[hf_name] = part.to(device="cpu", dtype=dtype).contiguous()
    if deltas:
        raise ValueError(f"deltas for layers the model does not have: {sorted(deltas)[:3]}")
    return state


def merged_slot_deltas(executor: Any, slot: int) -> dict[str, torch.Tensor]:
    """``alpha/rank * B @ A`` of every slotted layer of ``slot`` (full, fp32), by layer key."""
    weights = executor.adapter_weights(slot)
    scale = executor.slot_spec(slot).scale
    deltas = {}
    for key in executor.layers:
        a, b = weights[f"{key}.lora_A"], weights[f"{key}.lora_B"]
        deltas[key] = scale * (b.to(torch.float32) @ a.to(torch.float32))
    return deltas


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_readable(directory: Path) -> None:
    """Exported files are 0644 and directories 0755 whatever wrote them (some writers create
    0600 files): an export is for others to load, and holds no secret."""
    for path in [directory, *directory.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)


def export_hf_snapshot(
    directory: str | Path,
    *,
    model: torch.nn.Module,
    source: HFLlamaConfig,
    executor: Any = None,
    slot: int | None = None,
    dtype: str | None = None,
    tokenizer: Any = None,
) -> Path:
    """Write the base model (``slot=None``) or ``slot``'s merged model as an HF directory.

    Collective under tensor parallelism (every rank calls it; global rank 0 writes).  ``dtype``
    defaults to the model's; ``tokenizer`` (anything with ``save_pretrained``) is saved with it,
    else the source directory's tokenizer files are copied.  A plugin model's source
    (:class:`mizzen_train.plugin_models.export.PluginExportSource`) writes its own merged model, through
    its ``export_hf_snapshot``."""
    if hasattr(source, "export_hf_snapshot"):
        return source.export_hf_snapshot(
            directory, model=model, executor=executor, slot=slot, dtype=dtype or "fp32",
            tokenizer=tokenizer,
        )  # fmt: skip
    target = Path(directory)
    spec = source.spec
    dtype = dtype or spec.dtype
    if dtype not in DTYPES:
        raise ValueError(f"export dtype={dtype!r}: use one of {sorted(DTYPES)}")
    if slot is not None and executor is None:
        raise ValueError("export_hf_snapshot(slot=...) needs the executor holding the slot")
    deltas = merged_slot_deltas(executor, slot) if slot is not None else None
    state = megatron_to_hf_state(model, spec, deltas=deltas, dtype=DTYPES[dtype])
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank != 0:
        return target
    if target.exists():
        raise FileExistsError(f"{target} exists; snapshots are written once, to a fresh path")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".tmp-{target.name}-{uuid.uuid4().hex[:8]}")
    try:
        tmp.mkdir()
        from safetensors.torch import save_file

        if spec.tie_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        config = export_config(source, dtype=dtype)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        source_dir = source.path.parent
        for name in CARRIED_FILES:
            if (source_dir / name).is_file():
                shutil.copy2(source_dir / name, tmp / name)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        else:
            copy_tokenizer_files(source_dir, tmp)
        _fsync_tree(tmp)
        make_readable(tmp)
        os.rename(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


#: Tokenizer files of a Hugging Face model directory.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)


def copy_tokenizer_files(source: Path, target: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
            copied.append(name)
    return copied
