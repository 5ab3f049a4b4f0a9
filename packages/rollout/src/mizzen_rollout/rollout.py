"""Prompts in, scored groups of samples out: the rollout pipeline shared by the CLI (local
router over HTTP clients) and the Ray rollout manager.

Invariants:
- For ``B`` prompts and ``n`` samples per prompt there are exactly ``B * n`` request ids
  ``{batch_id}-g{group}-s{index}`` and exactly one sample comes back per id, whatever the engines
  do (a dispatcher may re-issue an id to another engine; the call still returns once).  Groups come back in prompt order, samples in index order.
- An engine error becomes a ``FAILED`` sample with the message; a reward error likewise (see
  :mod:`.rewards`); the batch itself never raises for either.
- With ``SamplingParams.seed`` set, sample ``i`` of a group is seeded with a hash of (seed,
  request id), so samples differ within a group yet the batch is reproducible.
- Text prompts are tokenised once per prompt by the engine (``/tokenize``) and sent as
  ``input_ids``, so ``prompt_tokens`` are exactly what the engine saw; with
  ``server_tokenize=False`` the text is sent and ``prompt_tokens`` stays empty.
- Chat prompts go to ``/v1/chat/completions`` (token ids are filled when the server returns them).
- With ``adapter`` (an :class:`~mizzen_rollout.adapters.AdapterRef` loaded on the engines) every
  request is routed to that adapter (``lora_path`` / the chat ``model`` field) and every sample
  carries its tenant and ``adapter_version``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .adapters import AdapterRef
from .data import PromptRecord
from .engines.base import (
    ChatRequest,
    ChatResult,
    EngineError,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
)
from .metrics import RolloutMetrics
from .rewards import RewardFn, score_sample
from .samples import Sample, SampleGroup, SampleStatus

__all__ = [
    "Dispatcher",
    "GroupFilter",
    "RolloutBatch",
    "RolloutConfig",
    "drop_groups_with_aborted",
    "drop_groups_with_failed",
    "request_id_for",
    "run_rollout",
]

_STATUS_OF_FINISH = {
    "stop": SampleStatus.COMPLETED,
    "length": SampleStatus.TRUNCATED,
    "abort": SampleStatus.ABORTED,
}


class Dispatcher(Protocol):
    """Where requests go: an engine, a local router, or the Ray rollout manager."""

    async def generate(self, request: GenerateRequest) -> GenerateResult: ...

    async def chat(self, request: ChatRequest) -> ChatResult: ...

    async def tokenize(self, text: str) -> list[int]: ...


GroupFilter = Callable[[SampleGroup], bool]
"""A group filter returns True to keep the group."""


def drop_groups_with_aborted(group: SampleGroup) -> bool:
    """Keep only groups without aborted samples."""
    return not group.has_status(SampleStatus.ABORTED)


def drop_groups_with_failed(group: SampleGroup) -> bool:
    """Keep only groups without failed samples."""
    return not group.has_status(SampleStatus.FAILED)


@dataclass(frozen=True)
class RolloutConfig:
    n_samples: int = 4
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(max_new_tokens=128))
    return_logprob: bool = True
    server_tokenize: bool = True
    max_concurrency: int = 256
    filters: tuple[GroupFilter, ...] = ()

    def __post_init__(self) -> None:
        if self.n_samples < 1:
            raise ValueError(f"RolloutConfig.n_samples is {self.n_samples}; use >= 1")
        if self.max_concurrency < 1:
            raise ValueError(f"RolloutConfig.max_concurrency is {self.max_concurrency}; use >= 1")


@dataclass
class RolloutBatch:
    """Kept groups (after filters), dropped groups, and the batch's metrics."""

    batch_id: str
    groups: list[SampleGroup]
    dropped: list[SampleGroup]
    metrics: RolloutMetrics

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g.samples]

    @property
    def all_samples(self) -> list[Sample]:
        """Kept and dropped samples, in group order."""
        groups = sorted(self.groups + self.dropped, key=lambda g: g.group_index)
        return [s for g in groups for s in g.samples]


def request_id_for(batch_id: str, group_index: int, index_in_group: int) -> str:
    return f"{batch_id}-g{group_index}-s{index_in_group}"


def _sample_seed(seed: int, request_id: str) -> int:
    return zlib.crc32(f"{seed}:{request_id}".encode()) & 0x7FFFFFFF


def _apply_result(sample: Sample, result: GenerateResult | ChatResult) -> None:
    sample.status = _STATUS_OF_FINISH[result.finish.kind]
    sample.response_text = result.text
    ids = result.output_ids
    if ids is not None:
        sample.response_tokens = list(ids)
        sample.loss_mask = [1] * len(ids)
        logprobs = result.output_logprobs
        sample.rollout_logprobs = (
            list(logprobs) if logprobs is not None and len(logprobs) == len(ids) else None
        )
    if isinstance(result, ChatResult) and result.prompt_token_ids is not None:
        sample.prompt_tokens = list(result.prompt_token_ids)
    meta = sample.metadata
    meta["finish_reason"] = result.finish.kind
    if result.finish.message:
        meta["finish_message"] = result.finish.message
    meta["engine"] = result.engine
    meta["latency_s"] = round(result.latency_s, 6)
    meta["prompt_token_count"] = result.prompt_tokens
    meta["completion_token_count"] = result.completion_tokens


async def run_rollout(
    prompts: Sequence[PromptRecord],
    dispatcher: Dispatcher,
    config: RolloutConfig,
    *,
    reward: RewardFn | None = None,
    batch_id: str | None = None,
    on_sample: Callable[[Sample], None] | None = None,
    adapter: AdapterRef | None = None,
) -> RolloutBatch:
    """Generate ``config.n_samples`` samples per prompt, score them, group and filter them."""
    lora_name = adapter.name if adapter is not None else None
    batch_id = batch_id or uuid.uuid4().hex[:12]
    semaphore = asyncio.Semaphore(config.max_concurrency)
    started = time.perf_counter()

    async def one_sample(sample: Sample, record: PromptRecord) -> Sample:
        sampling = config.sampling
        if sampling.seed is not None:
            sampling = dataclasses.replace(
                sampling, seed=_sample_seed(sampling.seed, sample.request_id)
            )
        try:
            async with semaphore:
                if isinstance(record.input, str):
                    if sample.prompt_tokens:
                        request = GenerateRequest(
                            request_id=sample.request_id,
                            input_ids=tuple(sample.prompt_tokens),
                            sampling=sampling,
                            return_logprob=config.return_logprob,
                            lora_path=lora_name,
                        )
                    else:
                        request = GenerateRequest(
                            request_id=sample.request_id,
                            text=record.input,
                            sampling=sampling,
                            return_logprob=config.return_logprob,
                            lora_path=lora_name,
                        )
                    result: GenerateResult | ChatResult = await dispatcher.generate(request)
                else:
                    result = await dispatcher.chat(
                        ChatRequest(
                            request_id=sample.request_id,
                            messages=tuple(record.input),
                            sampling=sampling,
                            return_logprob=config.return_logprob,
                            lora_name=lora_name,
                        )
                    )
            _apply_result(sample, result)
        except EngineError as exc:
            sample.status = SampleStatus.FAILED
            sample.error = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # a bug somewhere below must not take the batch down
            sample.status = SampleStatus.FAILED
            sample.error = f"unexpected {type(exc).__name__}: {exc}"
        await score_sample(sample, reward)
        if on_sample is not None:
            on_sample(sample)
        return sample

    async def one_group(group_index: int, record: PromptRecord) -> SampleGroup:
        prompt_tokens: list[int] = []
        tokenize_error: str | None = None
        if isinstance(record.input, str) and config.server_tokenize:
            try:
                prompt_tokens = await dispatcher.tokenize(record.input)
            except EngineError as exc:
                tokenize_error = f"tokenize failed: {type(exc).__name__}: {exc}"
        samples = []
        for i in range(config.n_samples):
            sample = Sample(
                prompt=record.input,
                prompt_tokens=list(prompt_tokens),
                label=record.label,
                group_index=group_index,
                index_in_group=i,
                tenant_id=adapter.tenant if adapter is not None else record.tenant_id,
                adapter_version=adapter.version if adapter is not None else None,
                request_id=request_id_for(batch_id, group_index, i),
                metadata={**record.metadata, "prompt_index": record.index},
            )
            samples.append(sample)
        if tokenize_error is not None:
            for sample in samples:
                sample.status = SampleStatus.FAILED
                sample.error = tokenize_error
                if on_sample is not None:
                    on_sample(sample)
            return SampleGroup(group_index, samples)
        done = await asyncio.gather(*(one_sample(s, record) for s in samples))
        return SampleGroup(group_index, list(done))

    groups = await asyncio.gather(*(one_group(g, r) for g, r in enumerate(prompts)))
    wall = time.perf_counter() - started
    kept, dropped = [], []
    for group in groups:
        for sample in group.samples:
            sample.validate()
        (kept if all(f(group) for f in config.filters) else dropped).append(group)
    metrics = RolloutMetrics.from_samples(
        [s for g in groups for s in g.samples],
        num_groups=len(groups),
        wall_s=wall,
        dropped_groups=len(dropped),
    )
    return RolloutBatch(batch_id=batch_id, groups=kept, dropped=dropped, metrics=metrics)
