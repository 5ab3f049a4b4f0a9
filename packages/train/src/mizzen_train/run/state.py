"""The run directory: its identity (``run.json``) and trainer checkpoints.

Layout::

    <run.dir>/run.json                      run id, creation time, the config it started with,
                                            the base model's content fingerprint
    <run.dir>/checkpoints/step-00000030/    one complete checkpoint:
        trainer_state.json                  step, run id, each tenant's data stream state, and
                                            the trainer's extra state (RL: adapter versions)
        rng.pt                              python, torch CPU (and CUDA) generator states
        slots/<tenant>/                     the tenant's slot checkpoint (executor.save_slot)
    <run.dir>/metrics.jsonl                 see :mod:`mizzen_train.run.metrics`

Invariants:
- A checkpoint directory is written under a temporary name (``.tmp-step-...``), fsynced and
  renamed: a ``step-*`` directory is complete by construction, so a killed run leaves at worst a
  temporary directory, which the next start removes.  Resume takes the newest ``step-*``.
- Names are matched exactly (:data:`CHECKPOINT_NAME`, :data:`PARTIAL_NAME`): anything else under
  ``checkpoints`` (a user's ``step-00000002.keep``) is never read, pruned or removed.
- Every record of the run directory (``run.json``, ``trainer_state.json``, ``rng.pt``) is read
  through :func:`~mizzen_train.run.config.read_regular_file` only, as a regular file of at most
  :data:`MAX_RECORD_BYTES` (a FIFO, a device or a huge file is refused, never waited on or read
  whole), then checked field by field: a malformed one is a :class:`RunStateError` naming the
  file and the field.  A checkpoint always has a ``slots`` directory (empty when no tenant had
  a slot to save).
- ``--resume`` refuses a ``step-*`` entry of ``checkpoints`` that is not a directory before it
  trains (a step's checkpoint could not be committed over it).
- With several ranks (:mod:`mizzen_train.run.parallel`), the writer rank alone creates, commits
  and prunes checkpoint directories; every rank writes only the slot shards the slot checkpoint
  elects it for.  A checkpoint records no parallel layout of its own: the slot checkpoints are
  resharded on restore (:mod:`mizzen_train.checkpoint`), and the data streams and RNG are the
  same on every rank.
- A resumed run keeps its run id (``run.json`` is written once, when the run is created); it
  refuses a configuration that changes what was trained (model, data, tenants' LoRA shapes),
  naming the field, and a base model whose files are not those it started on
  (:mod:`mizzen_train.run.fingerprint`), naming the files.  A ``run.json`` written before runs
  recorded the fingerprint resumes with a warning that the base could not be checked.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from mizzen_train.input_files import parse_json, read_regular_file
from mizzen_train.run.fingerprint import FingerprintError, fingerprint_changes, model_fingerprint
from mizzen_train.run.layout import CHECKPOINTS_DIR, METRICS_FILE, RUN_FILE

STATE_FILE = "trainer_state.json"
RNG_FILE = "rng.pt"
SLOTS_DIR = "slots"
#: Where slot checkpoints saved at another tensor-parallel size are resharded on restore (a
#: ``.tmp-`` entry of ``checkpoints/``: a killed start's is removed like a partial checkpoint).
RESHARD_DIR = ".tmp-reshard"
FORMAT = "mizzen-sft-run/1"
#: A complete checkpoint's directory name, and a partial one's (what a killed save leaves).
CHECKPOINT_NAME = re.compile(r"step-([0-9]{8,})")
PARTIAL_NAME = re.compile(r"\.tmp-step-[0-9]{8,}-[0-9a-f]{8}")
MAX_RECORD_BYTES = 16 * 1024 * 1024
CHECKPOINT_FORMAT = "mizzen-sft-checkpoint/1"

#: Config fields a resumed run may not change (they define what the checkpoint holds).
IDENTITY_FIELDS = ("model", "data")
IDENTITY_TENANT_FIELDS = ("name", "data", "rows", "lora_rank", "lora_alpha", "data_seed")


class RunStateError(RuntimeError):
    """The run directory cannot be started or resumed as asked; says why and what to do."""


@dataclass(frozen=True)
class RunIdentity:
    run_id: str
    created: float
    resumed: bool


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json_atomic(path: Path, value: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    from mizzen_rollout.api import mask_value

    with open(tmp, "w", encoding="utf-8") as handle:  # no registered secret (an engine password)
        json.dump(mask_value(value), handle, indent=1, sort_keys=True)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def check_run_dir(run_dir: Path, config: Mapping[str, Any], *, resume: bool) -> None:
    """What :func:`open_run` would refuse, without creating anything."""
    path = run_dir / RUN_FILE
    if path.exists() or resume:
        _read_run(run_dir, config, resume=resume)
    if resume:  # what the run reads and rewrites is of the kind it wrote
        for name, is_kind, kind in ((METRICS_FILE, os.path.isfile, "a regular file"),
                                    (CHECKPOINTS_DIR, os.path.isdir, "a directory")):  # fmt: skip
            entry = run_dir / name  # a link to one is fine (checkpoints on another volume)
            if os.path.lexists(entry) and not is_kind(entry):
                raise RunStateError(
                    f"{entry}: not {kind} (the run wrote it as one); restore it, or move it "
                    "away and resume without it"
                )
        _check_checkpoint_entries(run_dir / CHECKPOINTS_DIR)


def _check_checkpoint_entries(root: Path) -> None:
    """Every entry of ``checkpoints`` named like a checkpoint is a directory (a run commits a
    step's checkpoint by renaming a directory to that name)."""
    if not root.is_dir():
        return
    for entry in sorted(root.iterdir()):
        if checkpoint_step(entry) is not None and not entry.is_dir():
            raise RunStateError(
                f"{entry}: not a directory, but named like the checkpoint of step "
                f"{checkpoint_step(entry)} (the run writes checkpoints as directories); move it "
                "away and resume"
            )


def _read_run(run_dir: Path, config: Mapping[str, Any], *, resume: bool) -> RunIdentity:
    path = run_dir / RUN_FILE
    if not path.exists():
        raise RunStateError(
            f"--resume: {run_dir} holds no run ({RUN_FILE} is missing); drop --resume to start one"
        )
    if not resume:
        raise RunStateError(
            f"{run_dir} already holds a run ({path}); continue it with --resume, or choose "
            "another run.dir"
        )
    try:
        record = parse_json(read_record_text(path))
        run_id = record["run_id"]
        created = float(record["created"])
        stored = record["config"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RunStateError(f"{path}: unreadable run record ({exc}); restore it") from None
    if record.get("format") != FORMAT:
        raise RunStateError(f"{path}: format {record.get('format')!r}, expected {FORMAT!r}")
    if not isinstance(run_id, str) or not isinstance(stored, dict):
        raise RunStateError(f"{path}: malformed run record; restore it")
    tenants = stored.get("tenants", [])
    if not isinstance(tenants, list) or not all(isinstance(t, dict) for t in tenants):
        raise RunStateError(f"{path}: malformed run record (config.tenants is not a list of "
                            "tables); restore it")  # fmt: skip
    _check_same_run(stored, config, path)
    return RunIdentity(run_id, created, True)


def base_model_record(directory: Path) -> dict[str, Any]:
    """What ``run.json`` records of the base model in ``directory``: its content fingerprint
    (:func:`~mizzen_train.run.fingerprint.model_fingerprint`)."""
    try:
        return {"files": model_fingerprint(directory)}
    except FingerprintError as exc:
        raise RunStateError(f"the base model: {exc}; restore it") from None


def check_base_model(run_dir: Path, record: Mapping[str, Any], directory: Path) -> str | None:
    """Refuse ``directory`` (the base model now, recorded as ``record``) unless its files are
    those the run started on; a warning (None: none) for a run that recorded no fingerprint."""
    path = run_dir / RUN_FILE
    try:
        stored = parse_json(read_record_text(path))
    except (OSError, ValueError) as exc:
        raise RunStateError(f"{path}: unreadable run record ({exc}); restore it") from None
    base = stored.get("base_model") if isinstance(stored, dict) else None
    if base is None:
        return (f"warning: {path} records no fingerprint of the base model (the run was started "
                f"by an older mizzen-train): {directory} is taken as the base it trained on "
                "unchecked")  # fmt: skip
    files = base.get("files") if isinstance(base, dict) else None
    if not isinstance(files, dict):
        raise RunStateError(f"{path}: base_model.files={str(files)[:80]} is not a table; "
                            "restore it")  # fmt: skip
    changes = fingerprint_changes(files, record["files"])
    if changes:
        shown = "; ".join(changes[:4]) + (f"; and {len(changes) - 4} more" if changes[4:] else "")
        raise RunStateError(
            f"the base model at {directory} is not the one the run trained on ({path}): "
            f"{shown}. The checkpoints' adapters belong to that base: restore it at that path, "
            "or start a new run.dir"
        )
    return None


def read_run_config(run_dir: Path) -> tuple[dict[str, Any], str]:
    """The configuration table ``run_dir``'s run started with (its ``run.json``), and the
    file's name for messages; RunStateError when it holds no readable run."""
    path = run_dir / RUN_FILE
    try:
        record = parse_json(read_record_text(path))
    except FileNotFoundError:
        raise RunStateError(
            f"{run_dir} holds no run ({RUN_FILE} is missing); give a run.dir"
        ) from None
    except (OSError, ValueError) as exc:
        raise RunStateError(f"{path}: unreadable run record ({exc}); restore it") from None
    if not isinstance(record, dict):
        record = {}
    stored = record.get("config")
    if record.get("format") != FORMAT or not isinstance(stored, dict):
        raise RunStateError(f"{path}: not a run record of format {FORMAT!r}")
    if not isinstance(stored.get("run"), dict):
        raise RunStateError(f"{path}: its configuration has no [run] table; restore it")
    return stored, str(path)


def open_run(
    run_dir: Path,
    config: Mapping[str, Any],
    *,
    resume: bool,
    base_model: Mapping[str, Any] | None = None,
) -> RunIdentity:
    """Create the run (fresh id, recording ``base_model``: :func:`base_model_record`) or, with
    ``resume``, read its id and check the config."""
    path = run_dir / RUN_FILE
    if path.exists() or resume:
        return _read_run(run_dir, config, resume=resume)
    run_dir.mkdir(parents=True, exist_ok=True)
    identity = RunIdentity(uuid.uuid4().hex[:12], time.time(), False)
    _write_json_atomic(
        path,
        {
            "format": FORMAT,
            "run_id": identity.run_id,
            "created": identity.created,
            "config": config,
            **({"base_model": dict(base_model)} if base_model is not None else {}),
        },
    )
    return identity


def _check_same_run(stored: Mapping[str, Any], config: Mapping[str, Any], path: Path) -> None:
    for section in IDENTITY_FIELDS:
        if stored.get(section) != config.get(section):
            raise RunStateError(
                f"--resume: [{section}] differs from the run's ({path}: {stored.get(section)} "
                f"vs now {config.get(section)}); a checkpoint holds what that configuration "
                "trained. Resume with the original settings, or start a new run.dir"
            )
    old, new = stored.get("tenants", []), config.get("tenants", [])
    if [t.get("name") for t in old] != [t.get("name") for t in new]:
        raise RunStateError(
            f"--resume: the tenants {[t.get('name') for t in new]} differ from the run's "
            f"{[t.get('name') for t in old]} ({path}); resume with the same tenants"
        )
    for i, (before, after) in enumerate(zip(old, new, strict=True)):
        for key in IDENTITY_TENANT_FIELDS:
            if before.get(key) != after.get(key):
                raise RunStateError(
                    f"--resume: tenants[{i}].{key} is {after.get(key)!r}, the run trained with "
                    f"{before.get(key)!r} ({path}); resume with the original value"
                )


# -- checkpoints ----------------------------------------------------------------------------


def read_record_text(path: Path) -> str:
    """A record file's text (:func:`~mizzen_train.run.config.read_regular_file`, at most
    :data:`MAX_RECORD_BYTES`, UTF-8); OSError / ValueError otherwise (callers name the file)."""
    return read_regular_file(path, MAX_RECORD_BYTES).decode("utf-8")


def checkpoint_step(path: Path) -> int | None:
    """The step of a complete checkpoint directory's name, or None for any other name."""
    match = CHECKPOINT_NAME.fullmatch(path.name)
    if match is None or checkpoint_name(int(match.group(1))) != path.name:  # one name a step
        return None
    return int(match.group(1))


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / CHECKPOINTS_DIR


def remove_partial_checkpoints(run_dir: Path) -> list[str]:
    root = checkpoints_dir(run_dir)
    removed = []
    if root.is_dir():
        for entry in sorted(root.iterdir()):
            if PARTIAL_NAME.fullmatch(entry.name) or entry.name == RESHARD_DIR:
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry.name)
    return removed


def complete_checkpoints(run_dir: Path) -> list[Path]:
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and checkpoint_step(p) is not None]
    return sorted(found, key=checkpoint_step)


def rng_state() -> dict[str, Any]:
    import torch

    state = {"python": random.getstate(), "torch": torch.random.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    import torch

    random.setstate(state["python"])
    torch.random.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointWorld(Protocol):
    """What :func:`save_checkpoint` needs of the run's ranks (a
    :class:`~mizzen_train.run.parallel.RankWorld`)."""

    is_writer: bool

    def share(self, value: Any) -> Any: ...

    def agreed(self, step: Callable[[], Any]) -> Any: ...


class _OneRank:
    is_writer = True

    def share(self, value: Any) -> Any:
        return value

    def agreed(self, step: Callable[[], Any]) -> Any:
        return step()


def save_checkpoint(
    run_dir: Path,
    *,
    step: int,
    run_id: str,
    streams: Mapping[str, Mapping[str, Any]],
    save_slots: Callable[[Path], None],
    keep: int,
    extra: Mapping[str, Any] | None = None,
    world: CheckpointWorld | None = None,
) -> Path:
    """Write checkpoint ``step`` atomically; keep the newest ``keep``; returns its path.

    With several ranks every rank calls it: the writer names the temporary directory, every
    rank saves its slot shards into it (``save_slots``, collective), then the writer alone adds
    the RNG and trainer state, fsyncs and renames it (the outcome is agreed by all ranks)."""
    world = world or _OneRank()
    root = checkpoints_dir(run_dir)
    final = root / checkpoint_name(step)
    tmp = root / world.share(f".tmp-{checkpoint_name(step)}-{uuid.uuid4().hex[:8]}")
    if world.is_writer:
        root.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        (tmp / SLOTS_DIR).mkdir()  # present even when no tenant has a slot to save
    world.agreed(lambda: None)  # the directory exists before any rank writes into it
    try:
        save_slots(tmp / SLOTS_DIR)
        world.agreed(lambda: _commit_checkpoint(tmp, final, step, run_id, streams, extra)
                     if world.is_writer else None)  # fmt: skip
    finally:
        if world.is_writer and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if world.is_writer:
        for old in complete_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _commit_checkpoint(
    tmp: Path,
    final: Path,
    step: int,
    run_id: str,
    streams: Mapping[str, Mapping[str, Any]],
    extra: Mapping[str, Any] | None,
) -> None:
    """The writer's part: RNG and trainer state beside the slots, fsync, rename."""
    import torch

    torch.save(rng_state(), tmp / RNG_FILE)
    state = {
        "format": CHECKPOINT_FORMAT,
        "step": step,
        "run_id": run_id,
        "streams": dict(streams),
        "extra": dict(extra or {}),
        "saved": time.time(),
    }
    with open(tmp / STATE_FILE, "w", encoding="utf-8") as handle:
        json.dump(state, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    for path in tmp.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(tmp)
    if final.is_dir() and not final.is_symlink():  # a re-run of a step after an older resume
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(final.parent)


@dataclass(frozen=True)
class LoadedCheckpoint:
    path: Path
    step: int
    streams: dict[str, Any]
    rng: dict[str, Any]
    #: What a trainer saved beside the streams (RL: adapter versions, active tenants).
    extra: dict[str, Any] = field(default_factory=dict)


def load_checkpoint(path: Path, *, run_id: str) -> LoadedCheckpoint:
    """The complete checkpoint ``path`` of run ``run_id``, every record read bounded and checked
    field by field (RunStateError naming the file and field otherwise)."""
    state = _read_state(path / STATE_FILE, run_id)
    if not (path / SLOTS_DIR).is_dir():
        raise RunStateError(
            f"{path / SLOTS_DIR}: missing or not a directory, so the checkpoint holds no slots; "
            "restore it, or move the checkpoint away to use an older one"
        )
    return LoadedCheckpoint(
        path, state["step"], state["streams"], _read_rng(path / RNG_FILE), state["extra"]
    )


def _read_state(where: Path, run_id: str) -> dict[str, Any]:
    """``trainer_state.json``'s table, its format, run, step, streams and extra checked."""
    try:
        state = parse_json(read_record_text(where))
    except (OSError, ValueError) as exc:
        raise RunStateError(f"{where}: unreadable ({exc}); restore it") from None
    if not isinstance(state, dict):
        raise RunStateError(f"{where}: a JSON {type(state).__name__}, not a table; restore it")
    if state.get("format") != CHECKPOINT_FORMAT:
        raise RunStateError(f"{where}: format {state.get('format')!r}, not {CHECKPOINT_FORMAT!r}")
    if state.get("run_id") != run_id:
        raise RunStateError(
            f"{where}: belongs to run {str(state.get('run_id'))[:40]!r}, this is run {run_id!r}; "
            "the run directory was mixed up"
        )
    step = state.get("step")
    if type(step) is not int or step < 1 or checkpoint_name(step) != where.parent.name:
        raise RunStateError(f"{where}: step={str(step)[:40]} is not the step of its directory "
                            f"{where.parent.name}; restore it")  # fmt: skip
    streams, extra = state.get("streams"), state.setdefault("extra", {})
    if not isinstance(streams, dict) or not all(isinstance(v, dict) for v in streams.values()):
        raise RunStateError(f"{where}: streams={str(streams)[:80]} is not a table of tables "
                            "(one a tenant); restore it")  # fmt: skip
    if not isinstance(extra, dict):
        raise RunStateError(f"{where}: extra={str(extra)[:80]} is not a table; restore it")
    return state


def _is_byte_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor) and value.dtype == torch.uint8


def _read_rng(where: Path) -> dict[str, Any]:
    """``rng.pt``'s generator states, each one tried on a scratch generator (so a malformed
    state is refused here, before anything is restored)."""
    import io

    import torch

    try:
        data = read_regular_file(where, MAX_RECORD_BYTES)
        rng = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)  # no code
    except Exception as exc:
        raise RunStateError(f"{where}: unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(rng, dict):
        raise RunStateError(f"{where}: holds a {type(rng).__name__}, not a table of RNG states")
    cuda = rng.get("cuda", [])

    def byte_tensors(value: Any) -> None:
        if not isinstance(value, list) or not all(_is_byte_tensor(v) for v in value):
            raise TypeError("not a list of uint8 tensors")

    for key, check in (("python", lambda v: random.Random().setstate(v)),
                       ("torch", lambda v: torch.Generator().set_state(v)),
                       ("cuda", byte_tensors)):  # fmt: skip
        try:
            check(rng.get(key) if key != "cuda" else cuda)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise RunStateError(
                f"{where}: {key} is not the RNG state a checkpoint saves ({type(exc).__name__}: "
                f"{str(exc)[:120]}); restore it"
            ) from None
    return rng
