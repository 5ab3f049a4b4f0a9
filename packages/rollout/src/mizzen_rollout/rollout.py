"""Prompts in, scored groups of samples out: the rollout pipeline shared by the CLI (local
router over HTTP clients) and the Ray rollout manager.

Invariants:
- For ``B`` prompts and ``n`` samples per prompt there are exactly ``B * n`` request ids
  ``{batch_id}-g{group}-s{index}`` and exactly one sample comes back per id, whatever the engines
  do (a dispatcher may re-issue an id to another engine; the call still returns once).  Groups
  come back in prompt order, samples in index order.
- With ``batch_size > 1`` the samples of text prompts go to the engines ``batch_size`` at a time,
  each as one batched ``/generate``: batch ``k`` holds the samples at places ``k * batch_size``
  to ``(k + 1) * batch_size - 1`` of the (group, index) order, split where the prompt's kind
  (token ids or text) changes; a sample that failed before generation (its prompt did not
  tokenise) leaves a gap in its own batch and moves no other.  Which samples share a batch is
  a function of the prompts and the configuration, never of timing, so on the embedded engine
  (which generates a batch as sent) a rollout computes the same bits every time it is
  repeated; a server that schedules requests itself (SGLang) may batch them otherwise.  A batch
  the engine refuses fails its samples alike; each sample's ``latency_s`` is its call's.
- An engine error becomes a ``FAILED`` sample with the message; a reward error likewise (see
  :mod:`.rewards`); the batch itself never raises for either.  Every sample is validated
  (:meth:`~mizzen_rollout.samples.Sample.validate`) as soon as its result is in and once more at
  the end: one that breaks the sample rules becomes ``FAILED`` with the rule in its error and its
  engine-filled fields (prompt and response tokens, text, mask, log-probs) emptied, so the
  batch and the samples it returns are always valid.
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
from typing import Any, Protocol

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
from .samples import Sample, SampleGroup, SampleStatus, SampleValidationError

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

    async def generate_batch(
        self, requests: Sequence[GenerateRequest]
    ) -> Sequence[GenerateResult]: ...

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
    #: engine calls in flight at once (a batch is one call)
    max_concurrency: int = 256
    filters: tuple[GroupFilter, ...] = ()
    #: samples per engine call (one batched ``/generate``); chat prompts always go one by one
    batch_size: int = 1

    def __post_init__(self) -> None:
        if self.n_samples < 1:
            raise ValueError(f"RolloutConfig.n_samples is {self.n_samples}; use >= 1")
        if self.batch_size < 1:
            raise ValueError(f"RolloutConfig.batch_size is {self.batch_size}; use >= 1")
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


def _joins(last: Any, request: Any) -> bool:
    """May ``request`` share an engine call with ``last``, the request before it in its batch
    (the batching rule of the module docstring)?"""
    return (
        isinstance(request, GenerateRequest)
        and isinstance(last, GenerateRequest)
        and (request.input_ids is None) == (last.input_ids is None)
    )


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


def _checked(sample: Sample) -> None:
    """Validate ``sample``; one that breaks the rules becomes ``FAILED`` with what the engine
    filled in emptied (the module's invariant)."""
    try:
        sample.validate()
    except SampleValidationError as exc:
        sample.status = SampleStatus.FAILED
        sample.error = f"the answer breaks the sample rules: {exc}"
        sample.prompt_tokens, sample.response_text, sample.response_tokens = [], "", []
        sample.loss_mask, sample.rollout_logprobs, sample.reward = [], None, None


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

    def request_of(sample: Sample, record: PromptRecord) -> GenerateRequest | ChatRequest:
        sampling = config.sampling
        if sampling.seed is not None:
            sampling = dataclasses.replace(
                sampling, seed=_sample_seed(sampling.seed, sample.request_id)
            )
        if not isinstance(record.input, str):
            return ChatRequest(
                request_id=sample.request_id,
                messages=tuple(record.input),
                sampling=sampling,
                return_logprob=config.return_logprob,
                lora_name=lora_name,
            )
        by_ids = bool(sample.prompt_tokens)
        return GenerateRequest(
            request_id=sample.request_id,
            text=None if by_ids else record.input,
            input_ids=tuple(sample.prompt_tokens) if by_ids else None,
            sampling=sampling,
            return_logprob=config.return_logprob,
            lora_path=lora_name,
        )

    async def one_call(samples: list[Sample], requests: list[Any]) -> None:
        """One engine call for ``samples`` (one, or a batch); fills, scores and reports them."""
        try:
            async with semaphore:
                if isinstance(requests[0], ChatRequest):
                    results: list[GenerateResult | ChatResult] = [
                        await dispatcher.chat(requests[0])
                    ]
                elif len(requests) == 1:
                    results = [await dispatcher.generate(requests[0])]
                elif hasattr(dispatcher, "generate_batch"):
                    results = list(await dispatcher.generate_batch(requests))
                else:  # a dispatcher of its own without batches: one request each
                    results = list(await asyncio.gather(*map(dispatcher.generate, requests)))
            for sample, result in zip(samples, results, strict=True):
                _apply_result(sample, result)
                _checked(sample)
        except EngineError as exc:
            for sample in samples:
                sample.status = SampleStatus.FAILED
                sample.error = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # a bug somewhere below must not take the batch down
            for sample in samples:
                sample.status = SampleStatus.FAILED
                sample.error = f"unexpected {type(exc).__name__}: {exc}"
        await asyncio.gather(*(score_sample(sample, reward) for sample in samples))
        if on_sample is not None:
            for sample in samples:
                on_sample(sample)

    async def one_group(group_index: int, record: PromptRecord) -> SampleGroup:
        """The group's samples, their prompt tokenised (not generated yet)."""
        prompt_tokens: list[int] = []
        tokenize_error: str | None = None
        if isinstance(record.input, str) and config.server_tokenize:
            try:
                prompt_tokens = await dispatcher.tokenize(record.input)
            except EngineError as exc:
                tokenize_error = f"tokenize failed: {type(exc).__name__}: {exc}"
            except Exception as exc:  # a bug somewhere below must not take the batch down
                tokenize_error = f"tokenize failed: unexpected {type(exc).__name__}: {exc}"
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

    groups = await asyncio.gather(*(one_group(g, r) for g, r in enumerate(prompts)))
    calls: list[tuple[int, list[Sample], list[Any]]] = []  # (batch, samples, requests)
    slot = 0  # the sample's place in (group, index) order: batch k holds slots k*batch_size...
    for group, record in zip(groups, prompts, strict=True):
        for sample in group.samples:
            chunk, slot = slot // config.batch_size, slot + 1
            if sample.status == SampleStatus.FAILED:
                continue  # its prompt did not tokenise: a gap in its batch, no shift after it
            try:
                request = request_of(sample, record)
            except ValueError as exc:  # a prompt the request types refuse
                sample.status = SampleStatus.FAILED
                sample.error = f"bad request: {exc}"
                await score_sample(sample, reward)
                if on_sample is not None:
                    on_sample(sample)
                continue
            if calls and calls[-1][0] == chunk and _joins(calls[-1][2][-1], request):
                calls[-1][1].append(sample)
                calls[-1][2].append(request)
            else:
                calls.append((chunk, [sample], [request]))
    await asyncio.gather(*(one_call(samples, requests) for _, samples, requests in calls))
    wall = time.perf_counter() - started
    kept, dropped = [], []
    for group in groups:
        for sample in group.samples:
            _checked(sample)
        (kept if all(f(group) for f in config.filters) else dropped).append(group)
    metrics = RolloutMetrics.from_samples(
        [s for g in groups for s in g.samples],
        num_groups=len(groups),
        wall_s=wall,
        dropped_groups=len(dropped),
    )
    return RolloutBatch(batch_id=batch_id, groups=kept, dropped=dropped, metrics=metrics)
