"""The content fingerprint of a base model directory, recorded in ``run.json`` and compared on
``--resume`` and ``mizzen-train export`` (:mod:`mizzen_train.run.state`).

A fingerprint maps each file the run reads from the directory (a top-level regular file ending in
one of :data:`FINGERPRINTED`) to ``{"bytes": size, "sha256": first 16 hex digits}``, the shape of
a data file's cursor fingerprint (:mod:`mizzen_rollout.data`).  What the digest covers:

- a ``.safetensors`` file: its header (every tensor's name, dtype, shape and offsets) and, of each
  tensor's data, the first and the last :data:`SAMPLE_BYTES` bytes -- a few KiB a tensor, never
  the gigabytes of the weights.  A model of the same shape with other weights (another seed, a
  fine-tune, a merged adapter) changes every tensor it touches from its first bytes on; an edit of
  single elements in a tensor's middle is not seen;
- any other file (``config.json``, the tokenizer's files, the chat template): all its bytes, read
  as a regular file of at most :data:`MAX_FILE_BYTES`.

Modification times are never part of it: a copy of the same model elsewhere, or the same files
written again, has the same fingerprint.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mizzen_train.input_files import parse_json, read_regular_file

#: The files of a model directory a run reads (weights, config, tokenizer, chat template).
FINGERPRINTED = (".safetensors", ".json", ".jinja", ".model", ".txt", ".tiktoken")
SAMPLE_BYTES = 4096
MAX_FILE_BYTES = 256 * 1024 * 1024
#: The safetensors library's own bound on a header.
MAX_HEADER_BYTES = 100 * 1024 * 1024


class FingerprintError(ValueError):
    """A file of the directory could not be fingerprinted (the message names it and why)."""


def model_fingerprint(directory: Path) -> dict[str, dict[str, Any]]:
    """``{file name: {"bytes", "sha256"}}`` of ``directory`` (see the module docstring)."""
    files = {}
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError as exc:
        raise FingerprintError(f"{directory}: {exc.strerror}") from None
    for entry in entries:
        if entry.name.startswith(".") or not entry.name.endswith(FINGERPRINTED):
            continue
        if entry.is_dir():
            continue
        files[entry.name] = _file_fingerprint(Path(entry.path))
    return files


def fingerprint_changes(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """What differs from ``before`` to ``after``, one phrase a file (empty: the same)."""
    changes = []
    for name in sorted(set(before) | set(after)):
        old, new = before.get(name), after.get(name)
        if old == new:
            continue
        if old is None or new is None:
            changes.append(f"{name} is {'new' if old is None else 'missing'}")
        elif isinstance(old, dict) and old.get("bytes") != new.get("bytes"):
            changes.append(f"{name} is {new.get('bytes')} bytes, was {old.get('bytes')}")
        else:
            changes.append(f"{name} has other content")
    return changes


def _file_fingerprint(path: Path) -> dict[str, Any]:
    if not path.name.endswith(".safetensors"):
        try:
            data = read_regular_file(path, MAX_FILE_BYTES)
        except (OSError, ValueError) as exc:
            raise FingerprintError(f"{path}: {exc}") from None
        return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()[:16]}
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO is refused, never waited on
    except OSError as exc:
        raise FingerprintError(f"{path}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        size = info.st_size
        if not stat.S_ISREG(info.st_mode):
            raise FingerprintError(f"{path}: is not a regular file (a directory, FIFO or device)")
        digest = _safetensors_digest(fd, size, path)
    finally:
        os.close(fd)
    return {"bytes": size, "sha256": digest}


def _safetensors_digest(fd: int, size: int, path: Path) -> str:
    """The digest of a safetensors file's header and each tensor's first and last bytes."""
    head = os.pread(fd, 8, 0)
    length = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
        raise FingerprintError(f"{path}: not a safetensors file (header length {length})")
    header = os.pread(fd, length, 8)
    digest = hashlib.sha256(head + header)
    for start, end in _data_spans(header, path):
        if not 0 <= start <= end <= size - 8 - length:
            raise FingerprintError(f"{path}: a tensor's data_offsets lie outside the file")
        first = min(end - start, SAMPLE_BYTES)
        digest.update(os.pread(fd, first, 8 + length + start))
        digest.update(os.pread(fd, first, 8 + length + end - first))
    return digest.hexdigest()[:16]


def _data_spans(header: bytes, path: Path) -> list[tuple[int, int]]:
    """Each tensor's ``data_offsets`` in the header, in name order."""
    try:
        table = parse_json(header)
    except (UnicodeDecodeError, ValueError) as exc:
        raise FingerprintError(f"{path}: unreadable safetensors header ({exc})") from None
    if not isinstance(table, dict):
        raise FingerprintError(f"{path}: the safetensors header is not a table")
    spans = []
    for name in sorted(table):
        if name == "__metadata__":
            continue
        offsets = table[name].get("data_offsets") if isinstance(table[name], dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(type(v) is int for v in offsets)):  # fmt: skip
            raise FingerprintError(f"{path}: tensor {name!r} has data_offsets={offsets!r}")
        spans.append((offsets[0], offsets[1]))
    return spans
