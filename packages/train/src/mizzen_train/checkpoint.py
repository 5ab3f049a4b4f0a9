"""Slot checkpoints: one slot's adapter, optimizer state and step, sharded by (tp, pp, ep).

Layout of a slot's checkpoint directory::

    <dir>/manifest.json                          the commit record, written last
    <dir>/step-00000012-<token>/shard-tp00-pp00-ep00.pt
    <dir>/step-00000012-<token>/shard-tp01-pp00-ep00.pt

Saving (every rank calls it; three collectives):

1. *Election* — one ``all_gather_object`` of every rank's coordinates (and rank 0's version
   token): the writer of a shard is the lowest global rank holding its coordinates, so
   data-parallel replicas write nothing.
2. *Write* — each writer saves its shard under a temporary name, fsyncs it and renames it into a
   fresh version directory; then one ``all_gather_object`` of every rank's outcome.  If any rank
   failed, every rank raises :class:`SlotCheckpointError` and nothing is committed.
3. *Commit* — global rank 0 writes ``manifest.json`` (temp name, fsync, rename) naming the
   version and its shards, removes older versions, and broadcasts the outcome.

Invariants:
- ``manifest.json`` only ever names a version whose shards were all written and renamed; a crash
  or error at any point before the rename of the manifest leaves the previous checkpoint the
  committed, loadable one.
- Loading never trusts the directory: the manifest and the shards are read only as regular
  files of bounded size (:func:`~mizzen_train.run.config.read_regular_file`: a FIFO is refused,
  never waited on); the manifest's every field, the parallel layout, max rank, the shard for
  this rank's coordinates, its size, its tensor names, shapes and dtype (fp32) and that every
  value is finite (the rule :mod:`mizzen_train.hf.convert` applies to a base model's weights) are
  checked, with the file and field named, before anything is applied.
- A save may name its ``owner`` (a run's id and the step of the run's checkpoint that holds it,
  recorded in the manifest); :func:`check_owner` refuses a slot checkpoint of another owner, so a
  slot directory copied in from another run or step is never restored as this one's.
- A slot checkpoint is restored at the tensor-parallel size that saved it; for another size,
  :func:`reshard_slot_checkpoint` first writes it anew (one process, files only, committed like a
  save): every saved TP shard is read, each split factor joined along its ``split_dim``, put
  into the new size's fused layout by the caller's ``relayout`` (megatron's SwiGLU ``fc1``
  concatenates each rank's ``[gate_r; up_r]``, so its joined layout depends on the size) and cut
  into contiguous chunks, replicated factors taken from ``tp00``.  Masters and both Adam moments
  are elementwise, so the resharded state is exactly the saved one, moved.
- Export trims the max-rank padding along the rank axis *counted from the end* (so a leading
  expert axis is never cut) and asserts the trimmed padding is zero.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from mizzen_train.errors import SlotCheckpointError
from mizzen_train.input_files import read_json_file, read_regular_file
from mizzen_train.specs import LoraSlotSpec

FORMAT = "mizzen-slot-checkpoint/1"
MANIFEST = "manifest.json"
#: Optimizer-state entries saved per factor (fp32).  The bf16/fp32 weight is the master cast
#: to the model dtype, so it is derived on load rather than stored twice.
STATE_ENTRIES = ("master", "exp_avg", "exp_avg_sq")
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
AXES = ("tp", "pp", "ep")
SHARD_TAG = re.compile(r"tp[0-9]{2,4}-pp[0-9]{2,4}-ep[0-9]{2,4}")


@dataclass(frozen=True, order=True)
class ShardCoordinates:
    tp: int
    pp: int
    ep: int

    @property
    def tag(self) -> str:
        return f"tp{self.tp:02d}-pp{self.pp:02d}-ep{self.ep:02d}"


def current_coordinates() -> ShardCoordinates:
    from megatron.core import parallel_state as ps

    return ShardCoordinates(
        ps.get_tensor_model_parallel_rank(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_expert_model_parallel_rank(),
    )


def parallel_sizes() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
    }


def elect_shard_writers(
    coordinates: ShardCoordinates, *, proposal: Any = None, group=None
) -> tuple[dict[ShardCoordinates, int], list[Any]]:
    """Writer per coordinates (lowest global rank holding them) and every rank's ``proposal``.

    One ``all_gather_object`` over ``group`` (default: the world); proposals come back in
    group-rank order.
    """
    me = (torch.distributed.get_rank(), coordinates, proposal)
    gathered: list[Any] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(gathered, me, group=group)
    writers: dict[ShardCoordinates, int] = {}
    for rank, coords, _ in gathered:
        writers[coords] = min(rank, writers.get(coords, rank))
    return writers, [item[2] for item in gathered]


def agree(error: str | None, *, what: str, group=None) -> None:
    """Raise :class:`SlotCheckpointError` on every rank if any rank reports an error."""
    gathered: list[Any] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(
        gathered, (torch.distributed.get_rank(), error), group=group
    )
    failures = [(rank, err) for rank, err in gathered if err is not None]
    if failures:
        detail = "; ".join(f"rank {rank}: {err}" for rank, err in failures)
        raise SlotCheckpointError(f"{what} failed ({detail})")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, write) -> int:
    """Write through ``write(file)`` to a temporary name, fsync, rename; returns the size."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        size = tmp.stat().st_size
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)
    return size


def save_slot_checkpoint(
    directory: str | os.PathLike,
    *,
    step: int,
    spec: LoraSlotSpec,
    max_rank: int,
    factors: Mapping[str, Mapping[str, Any]],
    group=None,
    owner: Mapping[str, Any] | None = None,
) -> Path:
    """Save this rank's part of one slot (collective; see the module docstring); ``owner``
    (``{"run_id": str, "step": int}``, see :func:`check_owner`) is recorded in the manifest.

    ``factors`` maps a factor name to ``{"split_dim", "rank_axis_from_end", "master",
    "exp_avg", "exp_avg_sq"}`` (tensors of this rank's local shard).  Returns the version dir.
    """
    root = Path(directory)
    coordinates = current_coordinates()
    writers, proposals = elect_shard_writers(
        coordinates, proposal=uuid.uuid4().hex[:12], group=group
    )
    version = f"step-{step:08d}-{proposals[0]}"
    shard_name = f"{version}/shard-{coordinates.tag}.pt"
    rank = torch.distributed.get_rank()

    error, info = None, None
    if writers[coordinates] == rank:
        try:
            (root / version).mkdir(parents=True, exist_ok=True)
            payload = {
                "format": FORMAT,
                "coordinates": coordinates.tag,
                "step": step,
                "tensors": {
                    f"{name}/{entry}": entries[entry].detach().to("cpu", torch.float32).clone()
                    for name, entries in factors.items()
                    for entry in STATE_ENTRIES
                },
            }
            size = _atomic_write(root / shard_name, lambda handle: torch.save(payload, handle))
            info = {
                "file": shard_name,
                "bytes": size,
                "writer": rank,
                "factors": {
                    name: {
                        "shape": list(entries["master"].shape),
                        "split_dim": entries["split_dim"],
                        "rank_axis_from_end": entries["rank_axis_from_end"],
                    }
                    for name, entries in factors.items()
                },
            }
        except Exception as exc:  # reported to every rank below, then raised everywhere
            error = f"writing {root / shard_name}: {type(exc).__name__}: {exc}"
    gathered: list[Any] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(gathered, (rank, coordinates.tag, info, error), group=group)
    failures = [f"rank {r}: {e}" for r, _, _, e in gathered if e is not None]
    if failures:
        raise SlotCheckpointError(
            f"saving the slot checkpoint in {root} failed ({'; '.join(failures)}); nothing was "
            f"committed, {root / MANIFEST} still names the previous checkpoint"
        )

    commit_error = None
    if rank == 0:
        try:
            manifest = {
                "format": FORMAT,
                "version": version,
                "step": step,
                "slot_spec": asdict(spec),
                "max_rank": max_rank,
                "parallel": parallel_sizes(),
                "shards": {tag: shard for _, tag, shard, _ in gathered if shard is not None},
                **({"owner": dict(owner)} if owner is not None else {}),
            }
            encoded = json.dumps(manifest, indent=1, sort_keys=True).encode()
            _atomic_write(root / MANIFEST, lambda handle: handle.write(encoded))
            for stale in root.glob("step-*"):
                if stale.is_dir() and stale.name != version:
                    shutil.rmtree(stale, ignore_errors=True)
        except Exception as exc:
            commit_error = f"committing {root / MANIFEST}: {type(exc).__name__}: {exc}"
    outcome = [commit_error]
    torch.distributed.broadcast_object_list(outcome, src=0, group=group)
    if outcome[0] is not None:
        raise SlotCheckpointError(f"{outcome[0]}; the previous checkpoint stays committed")
    return root / version


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """The committed manifest of ``directory``, every field checked (SlotCheckpointError naming
    the file and the field otherwise)."""
    path = Path(directory) / MANIFEST
    if not os.path.lexists(path):
        raise SlotCheckpointError(
            f"{path}: no manifest, so no checkpoint was ever committed here (a save that failed "
            "before its commit leaves none); point at a directory a save completed in"
        )
    try:
        manifest = read_json_file(path, MAX_MANIFEST_BYTES)
    except (OSError, ValueError) as exc:
        raise SlotCheckpointError(f"{path}: unreadable manifest ({exc}); restore it") from None
    if not isinstance(manifest, dict):
        raise SlotCheckpointError(f"{path}: a JSON {type(manifest).__name__}, not a manifest "
                                  "table; restore it")  # fmt: skip
    if manifest.get("format") != FORMAT:
        raise SlotCheckpointError(
            f"{path}: format={str(manifest.get('format'))[:40]!r}, expected {FORMAT!r}; this "
            "reader only loads its own format"
        )
    for problem in _manifest_problems(manifest):
        raise SlotCheckpointError(f"{path}: {problem}; the manifest is damaged, restore it")
    return manifest


def _manifest_problems(manifest: Mapping[str, Any]) -> list[str]:
    """What is malformed in a manifest's fields, one phrase each (the first is reported)."""
    problems = []

    def counts(value: Any, low: int) -> bool:
        return type(value) is int and value >= low

    if not isinstance(manifest.get("version"), str):
        problems.append(f"version={str(manifest.get('version'))[:40]} is not a name")
    if not counts(manifest.get("step"), 0):
        problems.append(f"step={str(manifest.get('step'))[:40]} is not an integer >= 0")
    if not counts(manifest.get("max_rank"), 1):
        problems.append(f"max_rank={str(manifest.get('max_rank'))[:40]} is not an integer >= 1")
    parallel = manifest.get("parallel")
    if not isinstance(parallel, dict) or not all(counts(parallel.get(a), 1) for a in AXES):
        problems.append(f"parallel={str(parallel)[:80]} is not a table of sizes {list(AXES)}")

    def factor(meta: Any) -> bool:  # {"shape", "split_dim", "rank_axis_from_end"}
        shape = meta.get("shape") if isinstance(meta, dict) else None
        if not (isinstance(shape, list) and 1 <= len(shape) <= 8):
            return False
        split = meta.get("split_dim")
        return (
            all(counts(size, 0) for size in shape)
            and (split is None or (type(split) is int and 0 <= split < len(shape)))
            and type(meta.get("rank_axis_from_end")) is int
            and 1 <= meta["rank_axis_from_end"] <= len(shape)
        )

    spec = manifest.get("slot_spec")
    try:
        LoraSlotSpec(**spec)
        alpha = spec["alpha"]
        bad_spec = not (
            counts(spec["rank"], 1) and type(alpha) in (int, float) and 0 < alpha < math.inf
            and isinstance(spec.get("init", ""), str) and type(spec.get("seed", 0)) is int
        )  # fmt: skip
    except (TypeError, KeyError):
        bad_spec = True
    if bad_spec:
        problems.append(f"slot_spec={str(spec)[:80]} is not a slot's rank, alpha, init, seed")
    shards = manifest.get("shards")
    if not isinstance(shards, dict) or not all(SHARD_TAG.fullmatch(str(tag)) for tag in shards):
        problems.append(f"shards={str(shards)[:80]} is not a table by tp..-pp..-ep.. tag")
    elif not all(
        isinstance(s, dict) and isinstance(s.get("file"), str) and counts(s.get("bytes"), 0)
        and isinstance(s.get("factors"), dict) and all(map(factor, s["factors"].values()))
        for s in shards.values()
    ):  # fmt: skip
        problems.append(f"shards={str(shards)[:80]} is not a table of shards (file, bytes, "
                        "factors of a shape, split_dim and rank_axis_from_end)")  # fmt: skip
    owner = manifest.get("owner")
    if owner is not None and not (isinstance(owner, dict) and isinstance(owner.get("run_id"), str)
                                  and counts(owner.get("step"), 1)):  # fmt: skip
        problems.append(f"owner={str(owner)[:80]} is not a run_id and a step")
    return problems


def check_owner(directory: str | os.PathLike, *, run_id: str, step: int) -> str | None:
    """Refuse the slot checkpoint in ``directory`` unless its manifest's ``owner`` is run
    ``run_id``'s checkpoint of ``step``; a warning (None: none) when it records no owner (saved
    before manifests recorded one: what holds it is taken on trust)."""
    path = Path(directory) / MANIFEST
    owner = read_manifest(directory).get("owner")
    if owner is None:
        return (f"warning: {path} records no owner (saved by an older mizzen-train): it is taken "
                f"as run {run_id}'s slot of step {step} unchecked")  # fmt: skip
    if (owner["run_id"], owner["step"]) != (run_id, step):
        raise SlotCheckpointError(
            f"{path}: the slot checkpoint of run {owner['run_id']!r} step {owner['step']}, found "
            f"in run {run_id!r}'s checkpoint of step {step}: it was copied in from elsewhere; "
            "restore the checkpoint's own slot directory, or move the checkpoint away"
        )
    return None


@dataclass(frozen=True)
class LoadedShard:
    spec: LoraSlotSpec
    step: int
    #: entry ("master"/"exp_avg"/"exp_avg_sq") -> factor name -> fp32 host tensor.
    state: dict[str, dict[str, torch.Tensor]]


def read_slot_shard(
    directory: str | os.PathLike,
    *,
    expected_shapes: Mapping[str, tuple[int, ...]],
    max_rank: int,
) -> LoadedShard:
    """This rank's shard of a committed slot checkpoint, fully validated (no collectives)."""
    root = Path(directory)
    manifest = read_manifest(root)
    where = root / MANIFEST
    sizes = parallel_sizes()
    saved_parallel = manifest.get("parallel")
    if not isinstance(saved_parallel, dict):
        raise SlotCheckpointError(f"{where}: parallel={saved_parallel!r} is not a table")
    for axis, size in sizes.items():
        saved = saved_parallel.get(axis)
        if saved != size:
            raise SlotCheckpointError(
                f"{where}: parallel.{axis}={saved} but this job runs {axis}={size}; restore "
                "with the parallel layout that saved it, or reshard it first "
                "(reshard_slot_checkpoint: a trainer's --resume does)"
            )
    if manifest["max_rank"] != max_rank:
        raise SlotCheckpointError(
            f"{where}: max_rank={manifest['max_rank']} but the executor's max_rank={max_rank}; "
            "build the executor with the same max_rank (or export/import the adapter)"
        )
    spec = LoraSlotSpec(**manifest["slot_spec"])
    if not 1 <= spec.rank <= max_rank:
        raise SlotCheckpointError(f"{where}: slot_spec.rank={spec.rank} not in [1, {max_rank}]")
    tensors = _read_shard(root, manifest, current_coordinates())
    path = where
    names = {key.rsplit("/", 1)[0] for key in tensors}
    if names != set(expected_shapes):
        missing = sorted(set(expected_shapes) - names)[:3]
        unknown = sorted(names - set(expected_shapes))[:3]
        raise SlotCheckpointError(
            f"{path}: factors do not match this model's slotted layers (missing {missing}, "
            f"unknown {unknown}); restore into an executor with the same target_modules"
        )
    state: dict[str, dict[str, torch.Tensor]] = {entry: {} for entry in STATE_ENTRIES}
    for name, shape in expected_shapes.items():
        for entry in STATE_ENTRIES:
            tensor = tensors[f"{name}/{entry}"]
            if tuple(tensor.shape) != tuple(shape):
                raise SlotCheckpointError(
                    f"{path}: {name}/{entry} has shape {tuple(tensor.shape)}, the model expects "
                    f"{tuple(shape)}; the checkpoint belongs to a different model or layout"
                )
            state[entry][name] = tensor
    return LoadedShard(spec, int(manifest["step"]), state)


def _read_shard(
    root: Path, manifest: Mapping[str, Any], coordinates: ShardCoordinates
) -> dict[str, torch.Tensor]:
    """The tensors of the committed shard at ``coordinates``, its size and header checked."""
    where = root / MANIFEST
    shards = manifest.get("shards")
    shard = shards.get(coordinates.tag) if isinstance(shards, dict) else None
    if not isinstance(shard, dict) or not isinstance(shard.get("file"), str):
        have = sorted(shards) if isinstance(shards, dict) else shards
        raise SlotCheckpointError(
            f"{where}: no shard for coordinates {coordinates.tag} (have {have}); the "
            "checkpoint is incomplete"
        )
    path = root / shard["file"]
    if root.resolve() not in path.resolve().parents:
        raise SlotCheckpointError(f"{where}: shard file {shard['file']!r} is outside {root}")
    if not path.is_file() or path.stat().st_size != shard.get("bytes"):
        found = path.stat().st_size if path.is_file() else "missing"
        raise SlotCheckpointError(
            f"{path}: size {found}, manifest says {shard.get('bytes')} bytes; the shard was "
            "changed or lost after its commit"
        )
    payload = _load_payload(path, shard["bytes"])
    if payload.get("coordinates") != coordinates.tag or payload.get("step") != manifest["step"]:
        raise SlotCheckpointError(
            f"{path}: holds coordinates={str(payload.get('coordinates'))[:40]} "
            f"step={str(payload.get('step'))[:40]}, manifest expects {coordinates.tag} "
            f"step={manifest['step']}"
        )
    return _checked_tensors(path, payload.get("tensors"))


def _load_payload(path: Path, size: int) -> dict[str, Any]:
    """A shard file's table: a regular file of the ``size`` its manifest committed, loaded
    without running code."""
    import io

    try:
        data = read_regular_file(path, size)
        payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # OSError, a size over the committed one, a corrupt archive
        raise SlotCheckpointError(
            f"{path}: unreadable shard ({type(exc).__name__}: {str(exc)[:200]}); restore it"
        ) from None
    if not isinstance(payload, dict):
        raise SlotCheckpointError(f"{path}: holds a {type(payload).__name__}, not a shard table")
    return payload


def _checked_tensors(path: Path, tensors: Any) -> dict[str, torch.Tensor]:
    """A shard's tensors: each a finite fp32 tensor (how a save writes them)."""
    if not isinstance(tensors, dict):
        raise SlotCheckpointError(f"{path}: tensors={str(tensors)[:80]} is not a table")
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.float32:
            kind = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise SlotCheckpointError(f"{path}: {str(name)[:120]} is {kind}, not an fp32 tensor "
                                      "(a save writes fp32); restore the shard")  # fmt: skip
        if not bool(torch.isfinite(tensor).all()):
            raise SlotCheckpointError(
                f"{path}: {name} holds non-finite values (NaN or inf); an adapter trained on "
                "would stay NaN. Restore the shard, or resume from an older checkpoint"
            )
    return tensors


#: ``relayout(factor name, joined tensor, saved TP size, new TP size) -> tensor``: the joined
#: factor in the new size's fused layout (see the module docstring).
Relayout = Callable[[str, torch.Tensor, int, int], torch.Tensor]


def saved_tp_size(directory: str | os.PathLike) -> int:
    """The tensor-parallel size a committed slot checkpoint was saved at."""
    manifest = read_manifest(directory)
    parallel = manifest.get("parallel")
    size = parallel.get("tp") if isinstance(parallel, dict) else None
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise SlotCheckpointError(
            f"{Path(directory) / MANIFEST}: parallel.tp={size!r} is not a positive integer"
        )
    return size


def reshard_slot_checkpoint(
    source: str | os.PathLike,
    target: str | os.PathLike,
    *,
    tp_size: int,
    relayout: Relayout | None = None,
) -> Path:
    """Write the committed slot checkpoint ``source`` anew at tensor-parallel size ``tp_size``
    into the fresh directory ``target`` (files only, no process group); returns ``target``."""
    root, out = Path(source), Path(target)
    manifest = read_manifest(root)
    saved_tp = saved_tp_size(root)
    parallel = manifest["parallel"]
    if parallel.get("pp") != 1 or parallel.get("ep") != 1:
        raise SlotCheckpointError(
            f"{root / MANIFEST}: parallel={parallel}; only pipeline = expert = 1 reshards"
        )
    parts = [_read_shard(root, manifest, ShardCoordinates(tp, 0, 0)) for tp in range(saved_tp)]
    factors = manifest["shards"][ShardCoordinates(0, 0, 0).tag].get("factors", {})
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(tp_size)]
    for key in parts[0]:
        name = key.rsplit("/", 1)[0]
        meta = factors.get(name)
        if not isinstance(meta, dict) or any(key not in part for part in parts):
            raise SlotCheckpointError(
                f"{root / MANIFEST}: factor {name!r} is not in every shard; it is incomplete"
            )
        split_dim = meta.get("split_dim")
        if split_dim is None:
            for shard in shards:
                shard[key] = parts[0][key]
            continue
        full = torch.cat([part[key] for part in parts], dim=split_dim)
        if relayout is not None:
            full = relayout(name, full, saved_tp, tp_size)
        if full.shape[split_dim] % tp_size:
            raise SlotCheckpointError(
                f"{root / MANIFEST}: {key} has {full.shape[split_dim]} entries on its split "
                f"axis, which do not divide over tensor-parallel size {tp_size}"
            )
        for shard, chunk in zip(shards, full.chunk(tp_size, dim=split_dim), strict=True):
            shard[key] = chunk.contiguous()
    return _write_resharded(out, manifest, factors, shards)


def _write_resharded(
    out: Path,
    manifest: Mapping[str, Any],
    factors: Mapping[str, Any],
    shards: list[dict[str, torch.Tensor]],
) -> Path:
    """``shards`` as a committed checkpoint in ``out``: the shards, then the manifest."""
    out.mkdir(parents=True)
    step = int(manifest["step"])
    version = f"step-{step:08d}-{uuid.uuid4().hex[:12]}"
    (out / version).mkdir()
    written = {}
    for tp, tensors in enumerate(shards):
        coordinates = ShardCoordinates(tp, 0, 0)
        name = f"{version}/shard-{coordinates.tag}.pt"
        payload = {"format": FORMAT, "coordinates": coordinates.tag, "step": step,
                   "tensors": tensors}  # fmt: skip
        size = _atomic_write(out / name, lambda handle, p=payload: torch.save(p, handle))
        written[coordinates.tag] = {
            "file": name,
            "bytes": size,
            "writer": 0,
            "factors": {
                factor: {
                    **{k: v for k, v in meta.items() if k != "shape"},
                    "shape": list(tensors[f"{factor}/master"].shape),
                }
                for factor, meta in factors.items()
            },
        }
    committed = {**manifest, "version": version, "shards": written,
                 "parallel": {"tp": len(shards), "pp": 1, "ep": 1}}  # fmt: skip
    encoded = json.dumps(committed, indent=1, sort_keys=True).encode()
    _atomic_write(out / MANIFEST, lambda handle: handle.write(encoded))
    return out


def trim_rank_padding(
    tensor: torch.Tensor, *, rank: int, rank_axis_from_end: int, name: str = "tensor"
) -> torch.Tensor:
    """``tensor`` cut to its true ``rank`` along the rank axis counted from the end.

    Leading axes (an expert axis ``[experts, ...]``) are never touched.  The trimmed part is the
    storage padding of a slot below the max rank and must be exactly zero.
    """
    if not 1 <= rank_axis_from_end <= tensor.dim():
        raise ValueError(f"{name}: rank_axis_from_end={rank_axis_from_end} for a {tensor.dim()}-D")
    axis = tensor.dim() - rank_axis_from_end
    stored = tensor.shape[axis]
    if not 1 <= rank <= stored:
        raise ValueError(f"{name}: rank={rank} outside the stored rank axis of size {stored}")
    padding = tensor.narrow(axis, rank, stored - rank)
    if padding.numel() and bool((padding != 0).any()):
        raise SlotCheckpointError(
            f"{name}: the padding beyond rank {rank} on axis {axis} holds non-zero values "
            f"(max |x| = {padding.abs().max().item():.3g}); the adapter is not rank-{rank}"
        )
    return tensor.narrow(axis, 0, rank).contiguous()


@dataclass(frozen=True)
class ExportedAdapter:
    spec: LoraSlotSpec
    step: int
    #: Factor name -> full (all TP shards joined) tensor at the true rank, fp32.
    tensors: dict[str, torch.Tensor]


def export_adapter(directory: str | os.PathLike) -> ExportedAdapter:
    """Join a committed checkpoint's TP shards and trim each factor to the slot's true rank.

    Reads files only (no process group needed).  Non-expert factors are identical on every
    expert-parallel coordinate, so they are taken from ``ep00``.
    """
    root = Path(directory)
    manifest = read_manifest(root)
    spec = LoraSlotSpec(**manifest["slot_spec"])
    shards_by_stage: dict[int, list[tuple[int, dict[str, Any]]]] = {}
    for tag, shard in manifest["shards"].items():
        tp, pp, ep = (int(part[2:]) for part in tag.split("-"))
        if ep == 0:
            shards_by_stage.setdefault(pp, []).append((tp, shard))
    exported: dict[str, torch.Tensor] = {}
    for pp, shards in sorted(shards_by_stage.items()):
        shards.sort(key=lambda item: item[0])
        payloads = [_read_shard(root, manifest, ShardCoordinates(tp, pp, 0)) for tp, _ in shards]
        for name, meta in shards[0][1]["factors"].items():
            parts = [payload[f"{name}/master"] for payload in payloads]
            if meta["split_dim"] is None:
                full = parts[0]
            else:
                full = torch.cat(parts, dim=meta["split_dim"])
            exported[name] = trim_rank_padding(
                full, rank=spec.rank, rank_axis_from_end=meta["rank_axis_from_end"], name=name
            )
    return ExportedAdapter(spec, int(manifest["step"]), exported)
