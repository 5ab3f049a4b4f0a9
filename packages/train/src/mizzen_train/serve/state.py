"""The server's state on disk: which models exist (owner, LoRA shape) and their checkpoints.

Layout under ``state_dir``::

    models.json                                   {model_id: ModelRecord fields}
    checkpoints/<model_id>/weights/<name>/        a slot checkpoint (adapter, Adam, step)
    checkpoints/<model_id>/sampler_weights/<name>/ a PEFT adapter the engine serves

and the Tinker path of a checkpoint is ``tinker://<model_id>/<kind>/<name>``.

Invariants:
- Every write is atomic: a file is written to a temporary name, flushed and renamed; a
  checkpoint directory is complete under a temporary name before it is renamed into place, so a
  reader (the engine loading an adapter, a restarted server) never sees half of one.
- Names in requests are names, never paths: :func:`check_name` admits ``[A-Za-z0-9._-]``, 1..64
  characters, not starting with ``.``; a Tinker path is parsed by the SDK's own parser and its
  model must belong to the asking tenant (:meth:`ServerState.owned_checkpoint`), else it does not
  exist for that tenant.
- A restart keeps every saved checkpoint and every model's owner; a model's live (unsaved)
  weights live only in its slot and end with the process, and so do unnamed sampler weights
  (named ``unnamed-*``, a prefix no client may use) and half-written directories: deleted at
  startup, however the last server ended.
- ``models.json`` is read as untrusted input: a regular file of at most
  :data:`MAX_MODELS_BYTES`, a JSON object of records with exactly :class:`ModelRecord`'s fields
  and types, each under its own ``model_id``; anything else is a :class:`StateError` naming the
  file (and the record), before anything is built.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from mizzen_train.input_files import read_json_file
from mizzen_train.serve.wire import WireError

__all__ = [
    "KINDS",
    "UNNAMED_PREFIX",
    "ModelRecord",
    "ServerState",
    "StateError",
    "check_name",
    "model_id_of",
    "session_of_model",
]

MAX_MODELS_BYTES = 64 * 1024 * 1024

NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")
#: Tinker path segment -> SDK checkpoint type
KINDS = {"weights": "training", "sampler_weights": "sampler"}


def model_id_of(session_id: str, model_seq_id: int) -> str:
    """The SDK's id of a session's model (the SDK derives it too): ``<session>:train:<seq>``."""
    return f"{session_id}{_MODEL_OF_SESSION}{model_seq_id}"


def session_of_model(model_id: str) -> str:
    """The session a model id of :func:`model_id_of` belongs to."""
    return model_id.partition(_MODEL_OF_SESSION)[0]


_MODEL_OF_SESSION = ":train:"


#: The names of unnamed sampler weights (``save_weights_and_get_sampling_client``): the
#: server's, never a client's, so a restart can tell them apart and delete them.
UNNAMED_PREFIX = "unnamed-"


def check_name(value: object, field: str) -> str:
    """A client's checkpoint name: ``NAME``, and not one of the server's unnamed ones."""
    if not isinstance(value, str) or not NAME.fullmatch(value):
        raise WireError(
            400,
            f"{field}: {str(value)[:80]!r} is not a checkpoint name. Fix: use 1-64 of "
            "[A-Za-z0-9._-], not starting with '.'; names, never paths",
        )
    if value.startswith(UNNAMED_PREFIX):
        raise WireError(
            400, f"{field}: {value[:80]!r} starts with {UNNAMED_PREFIX!r}, the server's names of "
            "unnamed sampler weights. Fix: choose another name",
        )  # fmt: skip
    return value


class StateError(ValueError):
    """A file of the state directory breaks its schema; names the file, the record and the fix."""


@dataclass(frozen=True)
class ModelRecord:
    model_id: str
    tenant: str
    base_model: str
    rank: int
    seed: int
    created: float


#: the JSON values each annotation of ModelRecord admits (``created`` may be written as an int)
RECORD_TYPES = {"str": (str,), "int": (int,), "float": (int, float)}
RESTORE = "Fix: restore it from a backup, or move it away (the server then knows no models)"


def _read_models(path: Path) -> dict[str, ModelRecord]:
    """The records of ``models.json`` at ``path`` (none when it is missing)."""
    try:
        raw = read_json_file(path, MAX_MODELS_BYTES)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise StateError(f"{path}: cannot be read ({exc.strerror}). {RESTORE}") from None
    except ValueError as exc:  # not regular, too large, not UTF-8 or JSON, too deep
        raise StateError(f"{path}: {str(exc)[:200]}. {RESTORE}") from None
    if not isinstance(raw, dict):
        raise StateError(f"{path}: is not a JSON object of model records. {RESTORE}")
    return {key: _record(value, f"{path}: record {key[:80]!r}", key) for key, value in raw.items()}


def _record(value: object, where: str, key: str) -> ModelRecord:
    fields = {f.name: f.type for f in dataclasses.fields(ModelRecord)}
    if not isinstance(value, dict) or set(value) != set(fields):
        names = sorted(value) if isinstance(value, dict) else type(value).__name__
        raise StateError(
            f"{where}: has {str(names)[:200]}, not the fields {list(fields)}. {RESTORE}"
        )
    for name, type_name in fields.items():
        item = value[name]
        if isinstance(item, bool) or not isinstance(item, RECORD_TYPES[type_name]):
            raise StateError(f"{where}: {name} is not a JSON {type_name}. {RESTORE}")
    if value["model_id"] != key or Path(key).name != key or key.startswith("."):
        raise StateError(f"{where}: model_id is not its key, or not a plain name. {RESTORE}")
    return ModelRecord(**{**value, "created": float(value["created"])})


def _write_json_atomic(path: Path, payload: object) -> None:
    tmp = path.with_name(f".tmp-{path.name}-{uuid.uuid4().hex[:8]}")
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


class ServerState:
    """Models and checkpoints under ``root`` (thread-safe)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.checkpoints = root / "checkpoints"
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.models: dict[str, ModelRecord] = _read_models(root / "models.json")
        self.swept = self._sweep()

    def _sweep(self) -> int:
        """Delete what no live server owns at startup: unnamed sampler weights (their sampling
        sessions ended with the last server, however it ended) and half-written or half-deleted
        checkpoint directories (``.tmp-*``, ``.discarded-*``); how many."""
        leftovers = [
            entry
            for kind_dir in self.checkpoints.glob("*/*")
            if kind_dir.is_dir() and not kind_dir.is_symlink()
            for entry in kind_dir.iterdir()
            if entry.name.startswith((".tmp-", ".discarded-"))
            or (kind_dir.name == "sampler_weights" and entry.name.startswith(UNNAMED_PREFIX))
        ]
        for entry in leftovers:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        return len(leftovers)

    def add_model(self, record: ModelRecord) -> None:
        with self._lock:
            self.models[record.model_id] = record
            _write_json_atomic(
                self.root / "models.json", {k: asdict(v) for k, v in self.models.items()}
            )

    def model_of(self, tenant: str, model_id: object) -> ModelRecord | None:
        record = self.models.get(model_id) if isinstance(model_id, str) else None
        return record if record is not None and record.tenant == tenant else None

    def checkpoint_dir(self, model_id: str, kind: str, name: str) -> Path:
        return self.checkpoints / model_id / kind / name

    def write_checkpoint(
        self, model_id: str, kind: str, name: str, write: Callable[[Path], None]
    ) -> Path:
        """Run ``write(tmp_dir)`` and rename it into place; refuses an existing name."""
        target = self.checkpoint_dir(model_id, kind, name)
        if target.exists():
            raise WireError(409, f"path: {name!r} exists for this model. Fix: choose a new name")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".tmp-{name}-{uuid.uuid4().hex[:8]}")
        try:
            write(tmp)
            os.rename(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return target

    def owned_checkpoint(self, tenant: str, tinker_path: object, kind: str) -> tuple[str, Path]:
        """``(model_id, directory)`` of a tenant's checkpoint path; 404 otherwise (also when it
        is another tenant's: its existence is not revealed)."""
        from tinker.types import ParsedCheckpointTinkerPath

        try:
            parsed = ParsedCheckpointTinkerPath.from_tinker_path(str(tinker_path))
        except (ValueError, TypeError):
            raise WireError(
                400, f"path: {str(tinker_path)[:120]!r} is not tinker://<model_id>/{kind}/<name>"
            ) from None
        segment, _, name = parsed.checkpoint_id.partition("/")
        record = self.model_of(tenant, parsed.training_run_id)
        directory = self.checkpoint_dir(parsed.training_run_id, segment, name)
        if (
            segment != kind
            or NAME.fullmatch(name) is None
            or record is None
            or not directory.is_dir()
        ):
            raise WireError(404, f"checkpoint {str(tinker_path)[:120]!r} not found for this key")
        return parsed.training_run_id, directory

    def list_checkpoints(self, model_id: str) -> list[dict]:
        found = []
        for kind, kind_type in KINDS.items():
            base = self.checkpoints / model_id / kind
            for entry in sorted(base.iterdir()) if base.is_dir() else []:
                if entry.name.startswith(".") or not entry.is_dir():
                    continue
                try:
                    size = sum(f.stat().st_size for f in entry.rglob("*") if f.is_file())
                    modified = entry.stat().st_mtime
                except FileNotFoundError:  # discarded while listed (unnamed sampler weights)
                    continue
                found.append({
                    "checkpoint_id": f"{kind}/{entry.name}",
                    "checkpoint_type": kind_type,
                    "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(modified)),
                    "tinker_path": f"tinker://{model_id}/{kind}/{entry.name}",
                    "size_bytes": size,
                })  # fmt: skip
        return found
