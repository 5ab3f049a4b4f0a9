"""SFT data: JSON-lines conversations, tokenised with the loss on the responses, packed into rows.

Records (one JSON object a line; blank lines skipped)::

    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}
    {"prompt": "...", "response": "..."}

A ``prompt``/``response`` record is the conversation ``[user: prompt, assistant: response]``.  Any
other keys are kept as metadata.

Tokenisation (:class:`SftTokenizer`), with a local Hugging Face tokenizer directory or the
embedded engine's byte tokenizer (as its HF twin, so snapshots carry an ordinary tokenizer):

- with a chat template: the conversation is rendered by the template; the tokens each assistant
  message adds (its content and end-of-turn tokens) are the loss tokens.  They are found by
  rendering the prefix up to that message with the generation prompt, so the template must be
  prefix-stable; one that is not is refused, naming the record.
- without one: ``prompt`` / ``response`` records only: ``encode(prompt)`` then
  ``encode(response)`` and EOS, the loss on the response and EOS.

Packing (:class:`PackedStream`): each step takes ``rows`` rows of ``seq_len`` positions; an
example of ``n`` tokens fills ``n - 1`` positions (inputs ``ids[:-1]``, targets ``ids[1:]``) of the
first row with room, with its own segment id (so it attends only to itself: see
:mod:`mizzen_train.batch`); the first example that fits in no row waits for the next step.

Invariants:
- Every record is validated and tokenised when the dataset is loaded, before any training step;
  errors are :class:`SftDataError` naming ``file:line`` (and the config field), the rule and the
  fix.  An empty dataset is an error.
- The walk order comes from :class:`mizzen_rollout.api.DataCursor` (seeded, per epoch, resumable).
  :meth:`PackedStream.state_dict` is the cursor's state plus the indices of the examples drawn but
  not yet packed, so a resumed stream yields exactly the rows the original would have.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from mizzen_rollout.api import (
    DataCursor,
    DataError,
    PromptDataset,
    PromptRecord,
    render_prompt,
)

__all__ = [
    "PackedRows",
    "PackedStream",
    "SftDataError",
    "SftDataset",
    "SftExample",
    "SftTokenizer",
    "example_paths",
    "load_sft_dataset",
    "resolve_sft_path",
]

EXAMPLE_PREFIX = "example:"


class SftDataError(DataError):
    """An SFT data set, record or tokenizer problem; names the file:line or field and the fix."""


def example_paths(suffix: str = ".jsonl") -> dict[str, Path]:
    """Files shipped with mizzen-train (``example:NAME``): data sets, or ``.toml`` configs."""
    root = resources.files("mizzen_train").joinpath("examples")
    return {
        Path(entry.name).stem: Path(str(entry))
        for entry in root.iterdir()
        if entry.name.endswith(suffix)
    }


def resolve_sft_path(spec: str | os.PathLike[str], *, field: str) -> Path:
    text = os.fspath(spec)
    if text.startswith(EXAMPLE_PREFIX):
        name = text[len(EXAMPLE_PREFIX) :]
        examples = example_paths()
        if name not in examples:
            raise SftDataError(
                f"{field}={text!r}: no shipped data set {name!r}. Fix: use one of "
                f"{sorted(EXAMPLE_PREFIX + n for n in examples)} or a file path"
            )
        return examples[name]
    path = Path(text)
    if not path.is_file():
        raise SftDataError(f"{field}={text!r}: no such file. Fix: give a JSON-lines file")
    return path


# -- tokenizer -------------------------------------------------------------------------------


class SftTokenizer:
    """A Hugging Face tokenizer and the rules above.  ``source``: a directory or ``"byte"``."""

    def __init__(self, tokenizer: Any, *, source: str) -> None:
        self.hf = tokenizer
        self.source = source
        eos = tokenizer.eos_token_id
        if eos is None:
            raise SftDataError(
                f"tokenizer {source}: has no eos_token; the model could never learn to stop. "
                "Fix: use a tokenizer with an EOS token"
            )
        self.eos_token_id = int(eos)
        pad = tokenizer.pad_token_id
        self.pad_token_id = int(pad) if pad is not None else self.eos_token_id
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))

    @classmethod
    def load(cls, source: str | os.PathLike[str], *, field: str = "model.tokenizer"):
        if os.fspath(source) == "byte":
            from mizzen_rollout.api import hf_byte_tokenizer

            return cls(hf_byte_tokenizer(), source="byte")
        import transformers

        path = Path(source)
        if not path.is_dir():
            raise SftDataError(
                f"{field}={os.fspath(source)!r}: not a directory. Fix: give a local Hugging Face "
                "tokenizer directory, or 'byte' for the embedded engine's byte tokenizer"
            )
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as exc:
            raise SftDataError(
                f"{field}={os.fspath(source)!r}: transformers cannot load a tokenizer from it "
                f"({type(exc).__name__}: {exc}). Fix: point at a directory with tokenizer files"
            ) from None
        return cls(tokenizer, source=str(path))

    def __len__(self) -> int:
        return len(self.hf)

    def save_pretrained(self, directory: str) -> None:
        self.hf.save_pretrained(directory)

    def render(
        self, messages: Sequence[Mapping[str, Any]], *, generation_prompt: bool, where: str = ""
    ) -> list[int]:
        """Token ids of ``messages`` through the chat template (with the generation prompt if
        asked); a template failure is an :class:`SftDataError` naming ``where``."""
        try:
            out = self.hf.apply_chat_template(
                [dict(m) for m in messages],
                add_generation_prompt=generation_prompt,
                tokenize=True,
                return_dict=False,
            )
        except Exception as exc:
            raise SftDataError(
                f"{where or 'a conversation'}: the chat template of {self.source} failed "
                f"({type(exc).__name__}: {exc}). Fix: check the roles the template accepts"
            ) from None
        if isinstance(out, Mapping) or hasattr(out, "keys"):
            out = out["input_ids"]
        return [int(t) for t in out]

    def encode(self, record: PromptRecord, where: str) -> tuple[list[int], list[bool]]:
        """Token ids of the whole conversation and the loss mask (True on response tokens)."""
        messages = record.input
        if self.has_chat_template:
            ids = self.render(messages, generation_prompt=False, where=where)
            mask = [False] * len(ids)
            for index, message in enumerate(messages):
                if message["role"] != "assistant":
                    continue
                prefix = self.render(messages[:index], generation_prompt=True, where=where)
                upto = self.render(messages[: index + 1], generation_prompt=False, where=where)
                if ids[: len(upto)] != upto or upto[: len(prefix)] != prefix:
                    raise SftDataError(
                        f"{where}: the chat template of {self.source} is not prefix-stable at "
                        f"message {index} (rendering the conversation so far does not begin "
                        "the rendering of the whole); the response tokens cannot be located. "
                        "Fix: use a tokenizer whose template renders earlier turns unchanged"
                    )
                if len(upto) == len(prefix):
                    raise SftDataError(f"{where}: message {index} renders to no tokens")
                for position in range(len(prefix), len(upto)):
                    mask[position] = True
            return ids, mask
        prompt, response = record.metadata.get("_prompt"), record.label
        if prompt is None:
            raise SftDataError(
                f"{where}: a 'messages' record needs a chat template, and the tokenizer "
                f"{self.source} has none. Fix: use prompt/response records, or a tokenizer with "
                "a chat template"
            )
        prompt_ids = [int(t) for t in self.hf(prompt, add_special_tokens=True)["input_ids"]]
        response_ids = [int(t) for t in self.hf(response, add_special_tokens=False)["input_ids"]]
        response_ids.append(self.eos_token_id)
        return prompt_ids + response_ids, [False] * len(prompt_ids) + [True] * len(response_ids)

    def generation_prompt(self, record: PromptRecord) -> str | list[dict[str, Any]]:
        """What an engine generates from for ``record``: its prompt (the text of a
        prompt/response record, else the conversation before the last assistant message)
        rendered by :func:`mizzen_rollout.api.render_prompt`, the rule ``mizzen-rollout generate``
        uses, with the chat template when the tokenizer has one."""
        prompt = record.metadata.get("_prompt", record.input[:-1])
        return render_prompt(prompt, chat_template=self.has_chat_template)

    def prompt_ids(self, record: PromptRecord) -> list[int]:
        prompt = self.generation_prompt(record)
        if isinstance(prompt, list):
            return self.render(prompt, generation_prompt=True)
        return [int(t) for t in self.hf(prompt, add_special_tokens=True)["input_ids"]]


# -- records -------------------------------------------------------------------------------


def _record(obj: Any, index: int, where: str) -> PromptRecord:
    if not isinstance(obj, dict):
        raise SftDataError(f"{where}: a record is a JSON object, got {type(obj).__name__}")
    has_messages = "messages" in obj
    has_pair = "prompt" in obj or "response" in obj
    if has_messages == has_pair:
        raise SftDataError(
            f"{where}: a record holds either 'messages' or 'prompt' and 'response' (keys "
            f"present: {sorted(obj)[:8]}). Fix: use one of the two formats"
        )
    if has_messages:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise SftDataError(f"{where}: 'messages' must be a non-empty list of messages")
        for i, message in enumerate(messages):
            if (
                not isinstance(message, dict)
                or not isinstance(message.get("role"), str)
                or not message["role"]
                or not isinstance(message.get("content"), str)
            ):
                raise SftDataError(
                    f"{where}: messages[{i}] is {str(message)[:80]}; fix: each message is "
                    '{"role": "<non-empty string>", "content": "<string>"}'
                )
        if messages[-1]["role"] != "assistant" or not messages[-1]["content"]:
            raise SftDataError(
                f"{where}: the last message must be a non-empty 'assistant' message (the "
                "response to learn). Fix: end each conversation with the answer"
            )
        metadata = {k: v for k, v in obj.items() if k != "messages"}
        clean = [{"role": m["role"], "content": m["content"]} for m in messages]
        return PromptRecord(index, clean, label=clean[-1]["content"], metadata=metadata)
    prompt, response = obj.get("prompt"), obj.get("response")
    for key, value in (("prompt", prompt), ("response", response)):
        if not isinstance(value, str) or not value:
            raise SftDataError(
                f"{where}: '{key}' is {value!r}; fix: give both 'prompt' and 'response' as "
                "non-empty strings"
            )
    metadata = {k: v for k, v in obj.items() if k not in ("prompt", "response")}
    metadata["_prompt"] = prompt
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    return PromptRecord(index, messages, label=response, metadata=metadata)


@dataclass(frozen=True)
class SftExample:
    record: PromptRecord
    input_ids: tuple[int, ...]
    loss_mask: tuple[bool, ...]
    where: str

    @property
    def positions(self) -> int:
        """Row positions the example fills when packed (inputs ``ids[:-1]``)."""
        return len(self.input_ids) - 1


@dataclass
class SftDataset:
    """Validated, tokenised examples of one file, with the rollout dataset the cursor walks."""

    path: Path
    field: str
    examples: list[SftExample]
    prompts: PromptDataset
    dropped: int = 0

    def __len__(self) -> int:
        return len(self.examples)


def load_sft_dataset(
    spec: str | os.PathLike[str],
    tokenizer: SftTokenizer,
    *,
    field: str,
    seq_len: int,
    on_overlong: str = "error",
    limit: int | None = None,
) -> SftDataset:
    """Read, validate and tokenise every record (see the module docstring).

    ``on_overlong``: an example longer than ``seq_len + 1`` tokens is an error (``"error"``) or is
    dropped and counted (``"drop"``).  ``limit`` keeps the first records only."""
    if on_overlong not in ("error", "drop"):
        raise SftDataError(f"on_overlong={on_overlong!r}: use 'error' or 'drop'")
    path = resolve_sft_path(spec, field=field)
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        lineno = raw[: exc.start].count(b"\n") + 1
        raise SftDataError(
            f"{field}: {path}:{lineno}: not UTF-8 (byte {raw[exc.start]:#04x}). Fix: re-encode "
            "the file"
        ) from None
    examples: list[SftExample] = []
    dropped = 0
    longest: tuple[int, str] | None = None
    # JSON Lines end lines at "\n" only: str.splitlines would also cut at U+2028, U+0085, ...,
    # which a JSON string may hold raw
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        if limit is not None and len(examples) >= limit:
            break
        where = f"{field}: {path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SftDataError(f"{where}: not valid JSON ({exc.msg})") from None
        except (ValueError, RecursionError) as exc:  # a huge integer, nesting too deep
            reason = "nested too deep" if isinstance(exc, RecursionError) else str(exc)[:120]
            raise SftDataError(f"{where}: not a readable JSON record ({reason})") from None
        record = _record(obj, len(examples), where)
        ids, mask = tokenizer.encode(record, where)
        if len(ids) - 1 > seq_len:
            if on_overlong == "error":
                raise SftDataError(
                    f"{where}: the example is {len(ids)} tokens, more than seq_len + 1 = "
                    f"{seq_len + 1}. Fix: raise data.seq_len, shorten the record, or set "
                    "data.on_overlong = 'drop'"
                )
            dropped += 1
            if longest is None or len(ids) > longest[0]:
                longest = (len(ids), where)
            continue
        if not any(mask[1:]):
            raise SftDataError(f"{where}: the example has no response token to learn from")
        examples.append(SftExample(record, tuple(ids), tuple(mask), where))
    if not examples:
        detail = f" ({dropped} dropped as longer than seq_len)" if dropped else ""
        raise SftDataError(
            f"{field}={os.fspath(spec)!r}: the data set {path} has no usable record{detail}. "
            "Fix: add records (see mizzen_train.data for the formats)"
        )
    fingerprint = hashlib.sha256(raw).hexdigest()[:16]
    prompts = PromptDataset(
        [example.record for example in examples], source=str(path), fingerprint=fingerprint
    )
    return SftDataset(path, field, examples, prompts, dropped)


# -- packing -------------------------------------------------------------------------------


@dataclass
class PackedRows:
    """``rows`` packed rows (host tensors ``[rows, seq_len]``) and what they hold."""

    input_ids: torch.Tensor
    target_ids: torch.Tensor
    loss_mask: torch.Tensor
    segment_ids: torch.Tensor
    #: Record indices packed, in order.
    examples: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        """Non-padding positions."""
        return int((self.segment_ids >= 0).sum())

    @property
    def loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


class PackedStream:
    """Rows for one tenant, step after step, from a seeded resumable walk of its data set."""

    STATE_VERSION = 1

    def __init__(
        self, dataset: SftDataset, *, rows: int, seq_len: int, pad_id: int, seed: int
    ) -> None:
        self.dataset = dataset
        self.rows = rows
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.cursor = DataCursor(dataset.prompts, seed=seed, shuffle=True)
        self.carry: list[int] = []

    def _next_example(self) -> int:
        if self.carry:
            return self.carry.pop(0)
        return self.cursor.next_batch(1)[0].index

    def next_rows(self) -> PackedRows:
        shape = (self.rows, self.seq_len)
        input_ids = torch.full(shape, self.pad_id, dtype=torch.long)
        target_ids = torch.full(shape, self.pad_id, dtype=torch.long)
        loss_mask = torch.zeros(shape, dtype=torch.bool)
        segment_ids = torch.full(shape, -1, dtype=torch.long)
        fill = [0] * self.rows
        segments = [0] * self.rows
        packed: list[int] = []
        while True:
            index = self._next_example()
            example = self.dataset.examples[index]
            need = example.positions
            row = next((r for r in range(self.rows) if self.seq_len - fill[r] >= need), None)
            if row is None:
                self.carry.insert(0, index)
                break
            start, stop = fill[row], fill[row] + need
            ids = torch.tensor(example.input_ids, dtype=torch.long)
            input_ids[row, start:stop] = ids[:-1]
            target_ids[row, start:stop] = ids[1:]
            loss_mask[row, start:stop] = torch.tensor(example.loss_mask[1:], dtype=torch.bool)
            segment_ids[row, start:stop] = segments[row]
            segments[row] += 1
            fill[row] = stop
            packed.append(index)
        # padding: a segment of its own per row (attends to nothing real, counts for nothing)
        for row in range(self.rows):
            segment_ids[row, fill[row] :] = -1
        return PackedRows(input_ids, target_ids, loss_mask, segment_ids, packed)

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": self.STATE_VERSION,
            "cursor": self.cursor.state_dict(),
            "carry": list(self.carry),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping) or state.get("version") != self.STATE_VERSION:
            raise SftDataError(
                f"data stream state {str(state)[:80]} is not a version-{self.STATE_VERSION} "
                "state; resume with the mizzen-train that wrote the checkpoint"
            )
        cursor = state.get("cursor")
        if not isinstance(cursor, Mapping):
            raise SftDataError(f"data stream state cursor={str(cursor)[:80]}: not a table; "
                               "resume from an intact checkpoint")  # fmt: skip
        self.cursor.load_state_dict(dict(cursor))
        carry = state.get("carry")
        if not isinstance(carry, list) or not all(
            isinstance(i, int) and 0 <= i < len(self.dataset) for i in carry
        ):
            raise SftDataError(f"data stream state carry={carry!r}: not indices of this data set")
        self.carry = list(carry)
