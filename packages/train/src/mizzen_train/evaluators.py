"""The built-in evaluators of :mod:`mizzen_train.eval_dispatch`.

- :class:`GenerationEvaluator` (``kind = "generate"``, needs an engine): generates on the eval
  set with a rollout engine serving the snapshot and scores the answers with a reward function
  (:func:`mizzen_rollout.api.load_reward`).  The engines are either embedded engines it starts
  itself (:class:`~mizzen_train.eval_engines.EvalEngines`: ``num_engines`` of them, on
  ``device``: the eval fleet is sized and placed here, from the eval configuration, never from a
  training rollout fleet), or running SGLang (or embedded) servers given by URL.  Its own engines
  are started at the first point on the snapshot directory and, with ``engine_lifetime = "run"``
  (the default), kept until :meth:`GenerationEvaluator.close` -- the end of the run -- each later
  point pointing them at its snapshot as it would servers given by URL; with ``"point"`` they are
  started for each point and stopped after it.  Servers given by URL are pointed at the snapshot
  with ``/update_weights_from_disk`` (the servers must be able to read the snapshot directory).
  An *adapter snapshot* (a PEFT directory, an RL run's) is served as an adapter instead: loaded
  into the servers under a name of its own (``/load_lora_adapter``), generated with it, unloaded
  afterwards -- the servers keep their base weights and whatever else they serve; its own engines
  serve the adapter's base model for it.  Its own engines read snapshots only from under the
  snapshot's ``root`` (the dispatcher's snapshot root: every point's snapshot).
- :class:`LossEvaluator` (``kind = "loss"``, no engine): the held-out loss and perplexity of the
  snapshot on the eval set's response tokens, computed with ``transformers`` on the snapshot
  directory (so it also checks that the snapshot loads).

Invariants:
- Evaluators are built (eval set loaded, tokenised and checked non-empty, reward resolved) before
  step 0; ``evaluate`` only reads the snapshot.  They are picklable (the Ray runner ships them).
- Greedy decoding by default (``temperature = 0``), so a point's score is a function of the
  snapshot alone.
- Every engine it starts is stopped, whatever happens, and both are noted with the process id
  (``engine_started`` / ``engine_stopped`` events): before ``evaluate`` returns
  (``engine_lifetime = "point"``), or at the latest by :meth:`GenerationEvaluator.close`, whose
  events say so (``"run"``; the run's teardown calls it however the run ends).  A kept engine
  found dead at a point (exited, or not answering ``/health``) is replaced for that point; a
  group on which a point failed or had failed generations is not kept for the next one.  See
  :mod:`mizzen_train.eval_engines`.
- Scores do not depend on the lifetime: a kept engine loads each snapshot as a fresh one would.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mizzen_rollout.api import PromptRecord
from mizzen_train.data import SftExample, SftTokenizer
from mizzen_train.eval_dispatch import EvalSkip, Snapshot
from mizzen_train.eval_engines import EvalEngines

__all__ = ["GenerationEvaluator", "LossEvaluator"]

# One lock per set of engine URLs: a server serves one snapshot at a time.
_URL_LOCKS: dict[tuple[str, ...], threading.Lock] = {}
_URL_LOCKS_GUARD = threading.Lock()


def _url_lock(urls: Sequence[str]) -> threading.Lock:
    key = tuple(sorted(urls))
    with _URL_LOCKS_GUARD:
        return _URL_LOCKS.setdefault(key, threading.Lock())


@dataclass
class GenerationEvaluator:
    """Generate on ``prompts`` with engines serving the snapshot; score with ``reward``."""

    name: str
    prompts: list[PromptRecord]
    reward: str
    max_new_tokens: int = 64
    temperature: float = 0.0
    engine_urls: tuple[str, ...] = ()
    num_engines: int = 1
    engine_threads: int = 1
    device: str = "cpu"  # where the embedded engines it starts run ("cpu" or "cuda")
    startup_timeout_s: float = 300.0
    request_timeout_s: float = 300.0
    concurrency: int = 64
    batch_size: int = 8  # prompts per engine call (one batched /generate)
    engine_lifetime: str = "run"  # its own engines: kept from the first point ("run") or not
    needs_engine: bool = field(default=True, init=False)

    def __post_init__(self) -> None:
        from mizzen_rollout.api import load_reward

        self._reward_fn = load_reward(self.reward)  # raises RewardSpecError before step 0
        if self._reward_fn is None:
            raise ValueError(f"evaluator {self.name!r}: reward='none' leaves nothing to score")
        self._engines = EvalEngines(
            num_engines=self.num_engines,
            threads=self.engine_threads,
            device=self.device,
            startup_timeout_s=self.startup_timeout_s,
            lifetime=self.engine_lifetime,
        )  # starts nothing before the first point

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_reward_fn", None)  # rebuilt from the spec where it is unpickled
        state.pop("_engines", None)  # a copy holds no engines
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__post_init__()

    def evaluate(self, snapshot: Snapshot) -> dict[str, float]:
        adapter = _adapter_of(snapshot)
        if self.engine_urls:
            if adapter is not None:  # served beside what the engines serve: no lock needed
                return asyncio.run(self._on_urls(snapshot, list(self.engine_urls), adapter))
            with _url_lock(self.engine_urls):
                return asyncio.run(self._on_urls(snapshot, list(self.engine_urls)))
        return self._on_embedded(snapshot, adapter)

    def close(self) -> list[dict[str, Any]]:
        """Stop the engines it keeps (idempotent; the run's teardown calls it, through
        :meth:`EvalDispatcher.close`); returns their ``engine_stopped`` events."""
        return self._engines.close()

    def _on_embedded(self, snapshot: Snapshot, adapter=None) -> dict[str, float]:
        from mizzen_rollout.api import read_adapter_config

        # every point's snapshot lies under the root: the engines may read all of them
        load_dirs = [str(snapshot.root if snapshot.root is not None else snapshot.path.parent)]
        if adapter is not None:
            base = read_adapter_config(snapshot.path).base_model_name_or_path
            lease = self._engines.lease(
                snapshot, key=("adapter", base), model_path=base, load_dirs=load_dirs
            )
        else:
            lease = self._engines.lease(
                snapshot, key=("weights",), model_path=str(snapshot.path), load_dirs=load_dirs
            )
        with lease as engines:
            if adapter is not None:
                scores = asyncio.run(self._on_urls(snapshot, engines.urls, adapter))
            elif engines.fresh:  # started on this snapshot
                scores = asyncio.run(self._generate(snapshot, engines.urls))
            else:
                scores = asyncio.run(self._on_urls(snapshot, engines.urls))  # pointed at it first
            engines.spoiled = scores["failed"] > 0  # maybe a wedged engine: not kept
            return scores

    async def _on_urls(self, snapshot: Snapshot, urls: list[str], adapter=None) -> dict[str, float]:
        from mizzen_rollout.api import EngineError, SGLangClient

        if adapter is not None:
            loaded = []
            try:
                for url in urls:
                    async with SGLangClient(url, timeout_s=self.startup_timeout_s) as client:
                        try:
                            await client.load_lora_adapter(adapter.name, adapter.path)
                        except EngineError as exc:
                            raise EvalSkip(f"{url} did not load the adapter: {exc}") from None
                    loaded.append(url)
                snapshot.note("engine_adapter_loaded", purpose="eval", adapter=adapter.name)
                return await self._generate(snapshot, urls, adapter)
            finally:
                for url in loaded:
                    async with SGLangClient(url, timeout_s=self.startup_timeout_s) as client:
                        try:
                            await client.unload_lora_adapter(adapter.name)
                        except EngineError as exc:
                            snapshot.note(
                                "engine_adapter_unload_failed", engine=url, error=str(exc)
                            )
        for url in urls:
            async with SGLangClient(url, timeout_s=self.startup_timeout_s) as client:
                try:
                    await client.update_weights_from_disk(str(snapshot.path))
                except EngineError as exc:
                    raise EvalSkip(f"{url} did not load the snapshot: {exc}") from None
            snapshot.note("engine_weights_updated", purpose="eval", engine=url)
        return await self._generate(snapshot, urls)

    async def _generate(
        self, snapshot: Snapshot, urls: list[str], adapter=None
    ) -> dict[str, float]:
        from mizzen_rollout.api import (
            EngineRouter,
            RolloutConfig,
            SampleStatus,
            SamplingParams,
            SGLangClient,
            run_rollout,
        )

        config = RolloutConfig(
            n_samples=1,
            sampling=SamplingParams(
                max_new_tokens=self.max_new_tokens, temperature=self.temperature, seed=0
            ),
            return_logprob=False,
            max_concurrency=self.concurrency,
            batch_size=self.batch_size,
        )
        router = EngineRouter([SGLangClient(u, timeout_s=self.request_timeout_s) for u in urls])
        try:
            batch = await run_rollout(
                self.prompts,
                router,
                config,
                reward=self._reward_fn,
                batch_id=f"eval-{self.name}-{snapshot.step}-{snapshot.tenant}",
                adapter=adapter,
            )
        finally:
            await router.aclose()
        samples = batch.all_samples
        failed = [s for s in samples if s.status == SampleStatus.FAILED]
        if len(failed) == len(samples):
            raise EvalSkip(f"all {len(samples)} generations failed; first: {failed[0].error}")
        rewards = [s.reward if s.reward is not None else 0.0 for s in samples]
        lengths = [len(s.response_tokens) for s in samples]
        return {
            "score": sum(rewards) / len(samples),
            "truncated": sum(s.status == SampleStatus.TRUNCATED for s in samples) / len(samples),
            "failed": float(len(failed)),
            "response_tokens": sum(lengths) / len(samples),
            "samples": float(len(samples)),
        }


@dataclass
class LossEvaluator:
    """Held-out loss of a snapshot on the eval set's response tokens (no engine)."""

    name: str
    examples: list[SftExample]
    batch_size: int = 8
    device: str = "cpu"
    needs_engine: bool = field(default=False, init=False)

    def evaluate(self, snapshot: Snapshot) -> dict[str, float]:
        import torch
        import transformers

        transformers.utils.logging.disable_progress_bar()
        device = torch.device(self.device)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(snapshot.path), dtype=torch.float32, local_files_only=True
        ).to(device)
        model.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for start in range(0, len(self.examples), self.batch_size):
                chunk = self.examples[start : start + self.batch_size]
                width = max(len(e.input_ids) for e in chunk)
                ids = torch.zeros(len(chunk), width, dtype=torch.long)
                attention = torch.zeros(len(chunk), width, dtype=torch.long)
                mask = torch.zeros(len(chunk), width, dtype=torch.bool)
                for row, example in enumerate(chunk):
                    n = len(example.input_ids)
                    ids[row, :n] = torch.tensor(example.input_ids)
                    attention[row, :n] = 1
                    mask[row, :n] = torch.tensor(example.loss_mask)
                logits = model(
                    input_ids=ids.to(device), attention_mask=attention.to(device)
                ).logits.float()
                logprobs = torch.log_softmax(logits[:, :-1], dim=-1)
                targets = ids[:, 1:].to(device)
                nll = -logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
                counted = mask[:, 1:].to(device)
                total += float(nll[counted].sum())
                count += int(counted.sum())
        del model
        loss = total / count
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": float(count)}


def _adapter_of(snapshot: Snapshot):
    """The snapshot as an adapter to load (a PEFT directory), or None (a merged model)."""
    from mizzen_rollout.api import ADAPTER_CONFIG_FILE, AdapterRef

    if not (snapshot.path / ADAPTER_CONFIG_FILE).is_file():
        return None
    # a name of its own per point and evaluator: never one the trainer publishes
    return AdapterRef(f"eval-{snapshot.tenant}-step{snapshot.step}", 0, str(snapshot.path))


def generation_prompts(tokenizer: SftTokenizer, examples: Sequence[SftExample]):
    """Eval prompts for the generation evaluator: what the engine generates from, and the
    reference answer (the example's last assistant message) as the label."""
    return [
        PromptRecord(
            index=i,
            input=tokenizer.generation_prompt(example.record),
            label=example.record.label,
            metadata={"line": example.where},
        )
        for i, example in enumerate(examples)
    ]
