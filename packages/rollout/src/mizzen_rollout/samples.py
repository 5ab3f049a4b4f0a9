"""The sample contract: what rollout produces and training reads.

A :class:`Sample` is one response to one prompt; a :class:`SampleGroup` holds the ``n`` samples
drawn for one prompt (the unit GRPO-style advantages are computed over).  Samples travel as JSON
lines (:func:`write_samples` / :func:`read_samples`).

Invariants:
- Plain dataclasses and the standard library only: importing this module is cheap and pulls in no
  torch, ray, harbor or transformers (``mizzen_train`` imports it for the contract alone).
- :meth:`Sample.validate` is the one place the rules live; ``from_dict`` and ``read_samples`` run
  it, and every violation raises :class:`SampleValidationError` naming the sample, the field, the
  rule and the fix.
- ``response_tokens``, ``loss_mask`` and ``rollout_logprobs`` (when present) have one entry per
  response token; ``loss_mask`` entries are 0 or 1.
- A ``FAILED`` sample carries its error message in ``error``; other statuses carry none.
- ``write_samples`` is atomic: the file at ``path`` is either the old one or the complete new one.
- ``write_samples`` writes through the process-wide mask set (:mod:`.masking`): a line holding a
  registered secret (an engine URL's password in ``metadata.engine``, a key echoed in an error)
  is written with every string masked, so no samples file holds a secret.
- ``from_dict`` rejects unknown keys (extensions go into ``metadata``), so a renamed field fails
  loudly instead of being dropped.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .masking import mask, mask_json

__all__ = [
    "SCHEMA_VERSION",
    "Sample",
    "SampleGroup",
    "SampleStatus",
    "SampleValidationError",
    "group_samples",
    "iter_samples",
    "read_samples",
    "write_samples",
]

#: Version of the JSON-lines layout; bumped when a field changes meaning.
SCHEMA_VERSION = 1


class SampleStatus(enum.StrEnum):
    """Where a sample is in its life.

    ``PENDING``: not generated yet.  ``COMPLETED``: the engine stopped on EOS or a stop string.
    ``TRUNCATED``: the engine hit ``max_new_tokens``.  ``ABORTED``: the request was aborted
    (partial tokens may be present).  ``FAILED``: the engine or the reward raised; see ``error``.
    """

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


class SampleValidationError(ValueError):
    """A sample broke a rule of the contract; the message names the field, the rule and the fix."""


# A chat prompt is a list of {"role": ..., "content": ...} messages.
Prompt = str | list[dict[str, Any]]


@dataclass
class Sample:
    """One response to one prompt.

    Fields:
        prompt: the prompt text, or a chat prompt (list of ``{"role", "content"}`` messages).
        prompt_tokens: token ids of the prompt as the engine saw it (may be empty when the engine
            was given text and did not report ids).
        response_tokens: token ids of the response.
        response_text: the decoded response.
        loss_mask: one 0/1 per response token; 1 = trained on (tool outputs in multi-turn
            trajectories get 0).
        reward: the scalar reward, ``None`` until scored.
        status: see :class:`SampleStatus`.
        rollout_logprobs: per response token, the engine's log-probability of that token at
            sampling time; ``None`` when not requested.
        group_index: index of the prompt's group within its batch.
        index_in_group: index of this sample within its group (0..n-1).
        tenant_id: the tenant / LoRA slot this sample belongs to (``None`` = the base model).
        adapter_version: the version of the tenant's LoRA adapter that generated it (``None``:
            the base model, or no adapter versioning), so off-policy samples are visible.
        label: the reference answer the reward compares against (any JSON value).
        request_id: the engine request id that produced it (unique within a batch).
        error: the error message of a ``FAILED`` sample.
        metadata: free-form JSON-serialisable extras (dataset fields, engine, finish reason...).
    """

    prompt: Prompt
    prompt_tokens: list[int] = field(default_factory=list)
    response_tokens: list[int] = field(default_factory=list)
    response_text: str = ""
    loss_mask: list[int] = field(default_factory=list)
    reward: float | None = None
    status: SampleStatus = SampleStatus.PENDING
    rollout_logprobs: list[float] | None = None
    group_index: int = 0
    index_in_group: int = 0
    tenant_id: str | None = None
    adapter_version: int | None = None
    label: Any = None
    request_id: str = ""
    error: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ validation
    def _where(self) -> str:
        ident = self.request_id or f"group {self.group_index}, index {self.index_in_group}"
        return f"Sample({ident})"

    def _fail(self, field_name: str, problem: str, fix: str) -> SampleValidationError:
        return SampleValidationError(f"{self._where()}.{field_name}: {problem}; fix: {fix}")

    def validate(self) -> Sample:
        """Check every rule of the contract; return ``self`` or raise SampleValidationError."""
        self._validate_prompt()
        for name in ("prompt_tokens", "response_tokens"):
            self._validate_token_list(name)
        if not isinstance(self.response_text, str):
            raise self._fail(
                "response_text",
                f"is {type(self.response_text).__name__}, not str",
                "store the decoded text",
            )
        self._validate_loss_mask()
        self._validate_logprobs()
        if not isinstance(self.status, SampleStatus):
            raise self._fail(
                "status",
                f"is {self.status!r}, not a SampleStatus",
                f"use one of {[s.value for s in SampleStatus]}",
            )
        if self.reward is not None:
            if isinstance(self.reward, bool) or not isinstance(self.reward, int | float):
                raise self._fail(
                    "reward",
                    f"is {type(self.reward).__name__}, not a number",
                    "return a float from the reward function",
                )
            if not math.isfinite(self.reward):
                raise self._fail("reward", f"is {self.reward}", "rewards must be finite numbers")
        for name in ("group_index", "index_in_group"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise self._fail(name, f"is {value!r}", "use a non-negative integer")
        if self.adapter_version is not None and (
            isinstance(self.adapter_version, bool)
            or not isinstance(self.adapter_version, int)
            or self.adapter_version < 0
        ):
            raise self._fail(
                "adapter_version", f"is {self.adapter_version!r}", "use an integer >= 0 or None"
            )
        if self.tenant_id is not None and not isinstance(self.tenant_id, str):
            raise self._fail(
                "tenant_id", f"is {type(self.tenant_id).__name__}", "use a string or None"
            )
        if not isinstance(self.request_id, str):
            raise self._fail("request_id", f"is {self.request_id!r}", "use a string")
        if self.status is SampleStatus.FAILED and not self.error:
            raise self._fail(
                "error",
                "is empty on a failed sample",
                "set error to the message of what failed",
            )
        if self.status is not SampleStatus.FAILED and self.error is not None:
            raise self._fail(
                "error",
                f"is set ({self.error!r}) but status is {self.status.value}",
                "only failed samples carry an error; clear it or set status=failed",
            )
        if not isinstance(self.metadata, dict) or not all(
            isinstance(k, str) for k in self.metadata
        ):
            raise self._fail("metadata", "is not a dict with str keys", "use a JSON object")
        return self

    def _validate_prompt(self) -> None:
        if isinstance(self.prompt, str):
            return
        if isinstance(self.prompt, list):
            for i, message in enumerate(self.prompt):
                if not isinstance(message, dict) or "role" not in message:
                    raise self._fail(
                        f"prompt[{i}]",
                        f"is {message!r}, not a chat message",
                        'use {"role": ..., "content": ...} dicts',
                    )
            return
        raise self._fail(
            "prompt",
            f"is {type(self.prompt).__name__}",
            "use a string or a list of chat messages",
        )

    def _validate_token_list(self, name: str) -> None:
        tokens = getattr(self, name)
        if not isinstance(tokens, list):
            raise self._fail(name, f"is {type(tokens).__name__}, not a list", "use a list of ints")
        for i, token in enumerate(tokens):
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise self._fail(
                    f"{name}[{i}]", f"is {token!r}", "token ids are non-negative integers"
                )

    def _validate_loss_mask(self) -> None:
        mask = self.loss_mask
        if not isinstance(mask, list):
            raise self._fail("loss_mask", f"is {type(mask).__name__}", "use a list of 0/1")
        if len(mask) != len(self.response_tokens):
            raise self._fail(
                "loss_mask",
                f"has {len(mask)} entries but response_tokens has {len(self.response_tokens)}",
                "give one 0/1 entry per response token (1 = trained on)",
            )
        for i, value in enumerate(mask):
            if isinstance(value, bool | float) or value not in (0, 1):
                raise self._fail(f"loss_mask[{i}]", f"is {value!r}", "entries are 0 or 1")

    def _validate_logprobs(self) -> None:
        logprobs = self.rollout_logprobs
        if logprobs is None:
            return
        if not isinstance(logprobs, list):
            raise self._fail(
                "rollout_logprobs", f"is {type(logprobs).__name__}", "use a list or None"
            )
        if len(logprobs) != len(self.response_tokens):
            raise self._fail(
                "rollout_logprobs",
                f"has {len(logprobs)} entries but response_tokens has {len(self.response_tokens)}",
                "give one log-prob per response token, or None when not requested",
            )
        for i, value in enumerate(logprobs):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise self._fail(f"rollout_logprobs[{i}]", f"is {value!r}", "use floats")
            if not math.isfinite(value) or value > 1e-6:
                raise self._fail(
                    f"rollout_logprobs[{i}]",
                    f"is {value}",
                    "a log-probability is finite and <= 0",
                )

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``status`` as its string value)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["status"] = self.status.value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, where: str = "") -> Sample:
        """Build and validate a sample; ``where`` (e.g. ``file:line``) prefixes every error."""
        prefix = f"{where}: " if where else ""
        if not isinstance(data, dict):
            raise SampleValidationError(
                f"{prefix}a sample is a JSON object, got {type(data).__name__}"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SampleValidationError(
                f"{prefix}unknown sample field(s) {unknown}; fix: put extensions into "
                f"'metadata' (known fields: {sorted(known)})"
            )
        if "prompt" not in data:
            raise SampleValidationError(
                f"{prefix}missing field 'prompt'; fix: every sample has one"
            )
        values = dict(data)
        if "status" in values:
            try:
                values["status"] = SampleStatus(values["status"])
            except ValueError:
                raise SampleValidationError(
                    f"{prefix}status: {values['status']!r} is not a status; fix: use one of "
                    f"{[s.value for s in SampleStatus]}"
                ) from None
        sample = cls(**values)
        try:
            return sample.validate()
        except SampleValidationError as exc:
            raise SampleValidationError(f"{prefix}{exc}") from None

    def to_json(self) -> str:
        """One JSON line (no trailing newline)."""
        try:
            return json.dumps(self.to_dict(), ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise self._fail(
                "metadata/label", f"is not JSON-serialisable ({exc})", "store plain JSON values"
            ) from None

    @classmethod
    def from_json(cls, line: str, *, where: str = "") -> Sample:
        prefix = f"{where}: " if where else ""
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SampleValidationError(f"{prefix}not valid JSON ({exc})") from None
        return cls.from_dict(data, where=where)


@dataclass
class SampleGroup:
    """The samples drawn for one prompt; ``samples[i].index_in_group == i``."""

    group_index: int
    samples: list[Sample]

    @property
    def rewards(self) -> list[float | None]:
        return [s.reward for s in self.samples]

    def has_status(self, status: SampleStatus) -> bool:
        return any(s.status is status for s in self.samples)


def group_samples(samples: Iterable[Sample]) -> list[SampleGroup]:
    """Group samples by ``group_index`` (ascending), each group ordered by ``index_in_group``.

    Raises SampleValidationError on a duplicated (group_index, index_in_group) pair.
    """
    by_group: dict[int, dict[int, Sample]] = {}
    for sample in samples:
        slot = by_group.setdefault(sample.group_index, {})
        if sample.index_in_group in slot:
            raise SampleValidationError(
                f"{sample._where()}: duplicate (group_index={sample.group_index}, "
                f"index_in_group={sample.index_in_group}); fix: each sample of a group has its "
                "own index"
            )
        slot[sample.index_in_group] = sample
    return [
        SampleGroup(g, [members[i] for i in sorted(members)])
        for g, members in sorted(by_group.items())
    ]


#: the mode of a samples file: readable by all (its lines pass through the mask set)
SAMPLES_FILE_MODE = 0o644


def write_samples(path: str | os.PathLike[str], samples: Iterable[Sample]) -> int:
    """Validate and write samples as JSON lines, atomically; return the number written."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    count = 0
    try:
        os.fchmod(fd, SAMPLES_FILE_MODE)  # mkstemp makes 0600; samples are masked, for others
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            for sample in samples:
                sample.validate()
                line = sample.to_json()  # refuses values that are not JSON, naming the sample
                if mask(line) != line:
                    line = mask_json(sample.to_dict(), ensure_ascii=False, allow_nan=False)
                handle.write(line)
                handle.write("\n")
                count += 1
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return count


def iter_samples(path: str | os.PathLike[str]) -> Iterator[Sample]:
    """Yield validated samples from a JSON-lines file; errors name ``file:line``."""
    with open(path, encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
            if line.strip():
                yield Sample.from_json(line, where=f"{path}:{lineno}")


def read_samples(path: str | os.PathLike[str]) -> list[Sample]:
    """All samples of a JSON-lines file (see :func:`iter_samples`)."""
    return list(iter_samples(path))
