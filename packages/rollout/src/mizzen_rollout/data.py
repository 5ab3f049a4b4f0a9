"""Prompt datasets from JSON lines, with a seeded per-epoch shuffle and a resumable cursor.

Invariants:
- Every record is validated when the file is loaded; errors name ``file:line``, the key and the
  fix (e.g. ``--input-key``).  The input is a string or a list of chat messages.
- The order of epoch ``e`` is a pure function of (seed, e, dataset size): a resumed cursor walks
  exactly the order the original would have.
- ``DataCursor.state_dict()`` is plain JSON; ``load_state_dict`` refuses a state taken on a
  different dataset (size or content fingerprint), naming what differs.
- Batches cross epoch boundaries seamlessly; every record appears exactly once per epoch.
- Loading is total: every line is a UTF-8 JSON object of at most ``MAX_JSON_DEPTH`` levels,
  whose numbers are finite and at most ``MAX_NUMBER_DIGITS`` digits long and whose strings are
  valid Unicode (no lone surrogates), or a DataError naming ``file:line`` — never a decode,
  recursion or conversion error; lines end at ``\n`` only (U+2028 and friends inside a JSON
  string are text).  What is loaded can therefore be sent to an engine and written back.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from .masking import mask

__all__ = [
    "DataCursor",
    "DataError",
    "DatasetKeys",
    "PromptDataset",
    "PromptRecord",
    "example_datasets",
    "resolve_data_path",
]

EXAMPLE_PREFIX = "example:"
#: the deepest nesting of a dataset record, and the longest number in one
MAX_JSON_DEPTH = 64
MAX_NUMBER_DIGITS = 100


class DataError(ValueError):
    """A dataset or cursor problem; the message names the file:line or field and the fix."""


@dataclass(frozen=True)
class DatasetKeys:
    """Which JSON keys hold what.  ``metadata_keys=None`` keeps every other key as metadata."""

    input_key: str = "prompt"
    label_key: str | None = "label"
    metadata_keys: tuple[str, ...] | None = None
    tenant_key: str | None = None


@dataclass(frozen=True)
class PromptRecord:
    """One prompt: ``index`` is its 0-based position in the file."""

    index: int
    input: str | list[dict[str, Any]]
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    tenant_id: str | None = None


def example_datasets() -> dict[str, Path]:
    """Datasets shipped in the package: ``name -> path`` (use as ``example:name``)."""
    root = resources.files("mizzen_rollout").joinpath("examples")
    return {
        Path(entry.name).stem: Path(str(entry))
        for entry in root.iterdir()
        if entry.name.endswith(".jsonl")
    }


def resolve_data_path(spec: str | os.PathLike[str]) -> Path:
    """A file path, or ``example:NAME`` for a dataset shipped in the package."""
    text = os.fspath(spec)
    if text.startswith(EXAMPLE_PREFIX):
        name = text[len(EXAMPLE_PREFIX) :]
        examples = example_datasets()
        if name not in examples:
            raise DataError(f"no example dataset {name!r}; shipped: {sorted(examples)}")
        return examples[name]
    path = Path(text)
    if not path.is_file():
        raise DataError(f"dataset {path} does not exist (or is not a file)")
    return path


def _validate_input(value: Any, where: str, key: str) -> str | list[dict[str, Any]]:
    if isinstance(value, str):
        if not value:
            raise DataError(f"{where}: '{key}' is an empty string; fix: give every prompt text")
        return value
    if isinstance(value, list) and value:
        for i, message in enumerate(value):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise DataError(
                    f"{where}: '{key}[{i}]' is {message!r}; fix: chat prompts are lists of "
                    '{"role": ..., "content": ...}'
                )
        return value
    raise DataError(
        f"{where}: '{key}' is {type(value).__name__}; fix: use a string or a list of chat messages"
    )


class PromptDataset:
    """The validated records of one JSON-lines file."""

    def __init__(self, records: Sequence[PromptRecord], *, source: str, fingerprint: str):
        if not records:
            raise DataError(f"{source}: the dataset is empty; fix: add at least one record")
        self.records = list(records)
        self.source = source
        self.fingerprint = fingerprint

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> PromptRecord:
        return self.records[index]

    @staticmethod
    def _parse_line(data: bytes, where: str) -> Any:
        try:
            line = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(
                f"{where}: not UTF-8 (undecodable byte at column {exc.start + 1}); fix: save the "
                "dataset as UTF-8"
            ) from None
        problem = fix = ""
        try:
            return json.loads(line, parse_int=_bounded_int, parse_constant=_no_constant)
        except json.JSONDecodeError as exc:
            problem = f"not valid JSON ({exc.msg} at column {exc.colno})"
            fix = "write one JSON object per line"
        except RecursionError:
            problem, fix = f"nested deeper than {MAX_JSON_DEPTH} levels", "flatten the record"
        except ValueError as exc:
            problem, fix = str(exc), "write such a number as a string"
        raise DataError(f"{where}: {problem}; fix: {fix}")

    @classmethod
    def from_jsonl(
        cls, path: str | os.PathLike[str], keys: DatasetKeys | None = None
    ) -> PromptDataset:
        keys = keys or DatasetKeys()
        file = resolve_data_path(path)
        raw = file.read_bytes()
        records: list[PromptRecord] = []
        for lineno, data in enumerate(raw.removeprefix(b"\xef\xbb\xbf").split(b"\n"), start=1):
            if not data.strip():
                continue
            where = f"{file}:{lineno}"
            obj = cls._parse_line(data, where)
            _check_json(obj, where)
            if not isinstance(obj, dict):
                raise DataError(f"{where}: a record is a JSON object, got {type(obj).__name__}")
            if keys.input_key not in obj:
                raise DataError(
                    f"{where}: no '{keys.input_key}' key (keys present: {sorted(obj)}); fix: "
                    "pass the input key (--input-key)"
                )
            prompt = _validate_input(obj[keys.input_key], where, keys.input_key)
            label = obj.get(keys.label_key) if keys.label_key else None
            if keys.metadata_keys is None:
                used = {keys.input_key, keys.label_key, keys.tenant_key}
                metadata = {k: v for k, v in obj.items() if k not in used}
            else:
                missing = [k for k in keys.metadata_keys if k not in obj]
                if missing:
                    raise DataError(
                        f"{where}: metadata key(s) {missing} missing (keys present: "
                        f"{sorted(obj)}); fix: adjust --metadata-keys"
                    )
                metadata = {k: obj[k] for k in keys.metadata_keys}
            tenant = None
            if keys.tenant_key is not None:
                tenant = obj.get(keys.tenant_key)
                if tenant is not None and not isinstance(tenant, str):
                    tenant = str(tenant)
            records.append(
                PromptRecord(
                    index=len(records),
                    input=prompt,
                    label=label,
                    metadata=metadata,
                    tenant_id=tenant,
                )
            )
        fingerprint = hashlib.sha256(raw).hexdigest()[:16]
        return cls(records, source=str(file), fingerprint=fingerprint)


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_NUMBER_DIGITS:
        raise ValueError(f"a number of {len(text)} digits (at most {MAX_NUMBER_DIGITS})")
    return int(text)


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number (records hold finite numbers)")


def _check_json(value: Any, where: str) -> None:
    """Depth, finite numbers and valid strings (see the module docstring), iteratively."""
    todo: list[tuple[Any, int]] = [(value, 0)]
    while todo:
        item, depth = todo.pop()
        if depth > MAX_JSON_DEPTH:
            raise DataError(f"{where}: nested deeper than {MAX_JSON_DEPTH} levels; fix: flatten "
                            "the record")  # fmt: skip
        if isinstance(item, dict):
            todo += [(k, depth + 1) for k in item] + [(v, depth + 1) for v in item.values()]
        elif isinstance(item, list):
            todo += [(v, depth + 1) for v in item]
        elif isinstance(item, float) and not math.isfinite(item):
            raise DataError(f"{where}: a number too large to be finite; fix: write a finite one")
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise DataError(f"{where}: a string holds a lone surrogate (\\ud800-\\udfff); "
                                "fix: write valid Unicode text") from None  # fmt: skip


class DataCursor:
    """Walks a dataset in seeded per-epoch order; its position can be saved and restored."""

    STATE_VERSION = 1

    def __init__(self, dataset: PromptDataset, *, seed: int = 0, shuffle: bool = True):
        self.dataset = dataset
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order_cache: tuple[int, list[int]] | None = None

    def order(self, epoch: int) -> list[int]:
        """The record indices of ``epoch`` in visiting order."""
        if self._order_cache is not None and self._order_cache[0] == epoch:
            return self._order_cache[1]
        indices = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(f"mizzen-data:{self.seed}:{epoch}").shuffle(indices)
        self._order_cache = (epoch, indices)
        return indices

    def next_batch(self, batch_size: int) -> list[PromptRecord]:
        """The next ``batch_size`` records, crossing into the next epoch when needed."""
        if batch_size < 1:
            raise DataError(f"batch_size is {batch_size}; use >= 1")
        batch: list[PromptRecord] = []
        while len(batch) < batch_size:
            order = self.order(self.epoch)
            take = min(batch_size - len(batch), len(order) - self.position)
            batch.extend(self.dataset[i] for i in order[self.position : self.position + take])
            self.position += take
            if self.position == len(order):
                self.epoch += 1
                self.position = 0
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": self.STATE_VERSION,
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "dataset_size": len(self.dataset),
            "fingerprint": self.dataset.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        expected = {
            "version": self.STATE_VERSION,
            "dataset_size": len(self.dataset),
            "fingerprint": self.dataset.fingerprint,
        }
        for key, value in expected.items():
            if state.get(key) != value:
                raise DataError(
                    f"cursor state {key} is {state.get(key)!r} but this dataset has {value!r} "
                    f"({self.dataset.source}); fix: resume on the dataset the state was taken on"
                )
        position, epoch = state.get("position"), state.get("epoch")
        if not isinstance(epoch, int) or epoch < 0:
            raise DataError(f"cursor state epoch is {epoch!r}; it must be an integer >= 0")
        if not isinstance(position, int) or not 0 <= position < len(self.dataset):
            raise DataError(
                f"cursor state position is {position!r}; it must be in [0, {len(self.dataset)})"
            )
        seed, shuffle = state.get("seed"), state.get("shuffle")
        if isinstance(seed, bool) or not isinstance(seed, int) or not isinstance(shuffle, bool):
            raise DataError(f"cursor state seed={seed!r} shuffle={shuffle!r}: an integer and a "
                            "boolean; fix: resume from an intact checkpoint")  # fmt: skip
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = epoch
        self.position = position
        self._order_cache = None

    def save(self, path: str | os.PathLike[str]) -> None:
        target = Path(path)
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_text(mask(json.dumps(self.state_dict())), encoding="utf-8")
        os.replace(tmp, target)

    def restore(self, path: str | os.PathLike[str]) -> None:
        try:
            state = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise DataError(f"cannot read cursor state {path}: {exc}") from None
        self.load_state_dict(state)
