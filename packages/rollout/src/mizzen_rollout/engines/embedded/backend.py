"""Generation backends of the embedded server.

- :class:`TransformersBackend` (the default): Hugging Face ``generate`` on a causal LM, either
  the tiny model built from the packaged config ``tiny_llama.json`` with seeded random weights (no
  hub, no files to download) or a local model directory (``model_path``).
- :class:`EchoBackend`: answers instantly without a model (it echoes the prompt's tail); it
  exists to measure router/client overhead and to run the protocol on a base install.

Invariants:
- torch and transformers are imported inside :class:`TransformersBackend` only.
- A backend generates a *batch* of requests at once (:meth:`generate_batch`; ``generate`` is a
  batch of one): the transformers backend runs one left-padded ``generate`` over the batch, so a
  batch costs about what one request costs on a launch-bound device.  The batch is the one the
  client sent (SGLang's batched ``/generate``), never a mix of requests that happened to queue
  together, so what a request computes depends only on its batch, which the client fixes.
- One batch runs at a time (a lock); batches queue.  Each request's ``should_abort`` is polled
  before the batch starts and after every token, so an abort ends a queued or running request
  promptly, keeping the tokens generated so far; the other requests of its batch go on.
- Sampling is reproducible and per request: each request draws from its own generator, seeded
  with its ``seed`` (SGLang's ``sampling_seed``) or, when absent, with a hash of (server seed,
  request id), so re-issuing a request id yields the same sample and a request's draws never
  depend on the other requests of its batch.  Each request has its own sampling parameters
  (temperature, top-k, top-p, min-p, stops, ``max_new_tokens``) and adapter.
- Log-probs are ``log_softmax(logits / temperature)`` of the sampled token (``logits`` when
  greedy), before top-k/top-p truncation.
- Unsupported sampling parameters with non-default values are rejected, never ignored.
- :meth:`TransformersBackend.reload` swaps in another model directory between two generations
  (a generation never mixes weights); the echo backend has no weights to update.
- LoRA adapters (PEFT directories, :mod:`mizzen_rollout.adapters`) are loaded by name and applied
  per request: a forward hook on each target ``nn.Linear`` adds ``scale * B (A x)`` to the rows
  of the requests whose adapter it is, exactly PEFT's LoRA forward (dropout off); the base
  weights are never modified, so requests without an adapter are the base model bit for bit.
  Loading, unloading and generating hold the one generation lock: a request sees one adapter
  version from its first token to its last, and an unload waits for the batch using it.
"""

from __future__ import annotations

import json
import threading
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, Protocol

from ..base import FinishReason, SamplingParams
from .tokenizer import ByteTokenizer, HFTokenizerAdapter

__all__ = [
    "Backend",
    "BackendUnavailableError",
    "EchoBackend",
    "Generation",
    "GenerationItem",
    "TransformersBackend",
    "UnsupportedParameterError",
    "load_tiny_config",
    "request_seed",
]

TINY_CONFIG = "tiny_llama.json"

# Documented SGLang sampling keys this server accepts only at their default (no-op) value.
_NOOP_DEFAULTS: dict[str, Any] = {
    "n": 1,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "custom_params": None,
}


class BackendUnavailableError(RuntimeError):
    """The backend's libraries are not installed (the message says which extra to install)."""


class UnsupportedParameterError(ValueError):
    """A sampling parameter this backend does not implement was set (answered as HTTP 400)."""


def check_supported(sampling: SamplingParams) -> None:
    for key, value in sampling.extra.items():
        if key not in _NOOP_DEFAULTS or value != _NOOP_DEFAULTS[key]:
            raise UnsupportedParameterError(
                f"sampling_params.{key}={value!r} is not implemented by the embedded engine "
                f"(accepted only at its default {_NOOP_DEFAULTS.get(key)!r}); drop it or use an "
                "SGLang server (--engine-url)"
            )


def request_seed(server_seed: int, request_id: str, sampling: SamplingParams) -> int:
    if sampling.seed is not None:
        return int(sampling.seed)
    return zlib.crc32(f"{server_seed}:{request_id}".encode())


def load_tiny_config() -> dict[str, Any]:
    text = resources.files(__package__).joinpath(TINY_CONFIG).read_text(encoding="utf-8")
    return json.loads(text)


@dataclass(frozen=True)
class Generation:
    output_ids: tuple[int, ...]
    text: str
    finish: FinishReason
    logprobs: tuple[float, ...] | None


@dataclass(frozen=True)
class GenerationItem:
    """One request of a batch, as the server hands it to a backend."""

    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    request_id: str
    return_logprob: bool
    should_abort: Callable[[], bool]
    lora_name: str | None = None


_ABORTED = FinishReason("abort", message="Aborted by request")


class Backend(Protocol):
    description: str
    max_model_len: int
    tokenizer: Any

    def generate_batch(self, items: Sequence[GenerationItem]) -> list[Generation]:
        """One generation per item, in order (see the module docstring)."""
        ...


class _OneAtATime:
    """``generate``: one request as a batch of one (both backends)."""

    def generate_batch(self, items: Sequence[GenerationItem]) -> list[Generation]:
        raise NotImplementedError

    def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        request_id: str,
        return_logprob: bool,
        should_abort: Callable[[], bool],
        lora_name: str | None = None,
    ) -> Generation:
        item = GenerationItem(
            tuple(prompt_ids), sampling, request_id, return_logprob, should_abort, lora_name
        )
        return self.generate_batch([item])[0]


def _truncate_at_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """Cut ``text`` before the earliest stop string; return (text, matched stop or None)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        pos = text.find(stop)
        if stop and pos >= 0 and (best is None or pos < best[0]):
            best = (pos, stop)
    return (text, None) if best is None else (text[: best[0]], best[1])


class EchoBackend(_OneAtATime):
    """Instant answers, no model: the last ``max_new_tokens`` prompt tokens, echoed."""

    max_model_len = 1 << 20

    def __init__(self, seed: int = 0):
        self.tokenizer = ByteTokenizer()
        self.description = "echo (instant answers, no model)"
        self._seed = seed

    def generate_batch(self, items: Sequence[GenerationItem]) -> list[Generation]:
        for item in items:
            check_supported(item.sampling)
            if item.lora_name is not None:
                raise UnsupportedParameterError(
                    f"lora_path={item.lora_name!r}: the echo backend serves no LoRA adapters"
                )
        return [self._echo(item) for item in items]

    def _echo(self, item: GenerationItem) -> Generation:
        if item.should_abort():
            return Generation((), "", _ABORTED, None)
        body = [t for t in item.prompt_ids if t >= ByteTokenizer.OFFSET]
        n = item.sampling.max_new_tokens
        out = tuple(body[-n:]) if n else ()
        text, matched = _truncate_at_stop(self.tokenizer.decode(out), item.sampling.stop)
        if matched is not None:
            finish = FinishReason("stop", matched=matched)
        elif len(out) == n:
            finish = FinishReason("length")
        else:
            finish = FinishReason("stop", matched=ByteTokenizer.EOS)
        logprobs = tuple(-1.0 for _ in out) if item.return_logprob else None
        return Generation(out, text, finish, logprobs)


class TransformersBackend(_OneAtATime):
    """Hugging Face ``generate`` on CPU or CUDA, one left-padded batch at a time."""

    def __init__(
        self,
        *,
        model_path: str | None = None,
        seed: int = 0,
        num_threads: int = 1,
        device: str = "cpu",
    ):
        try:
            import torch
            import transformers
        except ImportError as exc:
            raise BackendUnavailableError(
                f"the transformers backend needs torch and transformers ({exc}); install them "
                "with: pip install 'mizzen-rollout[embedded]' -- or use --backend echo, or point "
                "generate at a running server with --engine-url"
            ) from None

        torch.set_num_threads(max(1, num_threads))
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device={device!r}: use 'cpu' or 'cuda'")
        if device == "cuda" and not torch.cuda.is_available():
            raise BackendUnavailableError("device='cuda' but no CUDA device is visible")
        self.device = torch.device(device)
        self._torch = torch
        self._transformers = transformers
        self._seed = seed
        self._lock = threading.Lock()
        if model_path is None:
            config_dict = load_tiny_config()
            model_type = config_dict.pop("model_type")
            config = transformers.AutoConfig.for_model(model_type, **config_dict)
            torch.manual_seed(seed)
            self.model = transformers.AutoModelForCausalLM.from_config(config)
            self.tokenizer: Any = ByteTokenizer()
            self.description = (
                f"tiny {model_type} from {TINY_CONFIG} (hidden {config.hidden_size}, "
                f"{config.num_hidden_layers} layers, vocab {config.vocab_size}), random weights "
                f"seeded {seed}"
            )
        else:
            self.model, self.tokenizer = self._load_local(model_path)
            self.description = f"local model {model_path}"
        self.model.to(self.device)
        self.model.eval()
        self.max_model_len = int(getattr(self.model.config, "max_position_embeddings", 4096))
        self.adapters = LoraAdapters(self.model, device=self.device)

    # ------------------------------------------------------------------ LoRA adapters
    def load_lora(self, name: str, path: str) -> dict[str, str]:
        """Load the PEFT adapter at ``path`` as ``name`` (between two generations)."""
        with self._lock:
            self.adapters.load(name, path)
            return self.adapters.loaded()

    def unload_lora(self, name: str) -> dict[str, str]:
        with self._lock:
            self.adapters.unload(name)
            return self.adapters.loaded()

    def loaded_loras(self) -> dict[str, str]:
        return self.adapters.loaded()

    def _load_local(self, model_path: str) -> tuple[Any, HFTokenizerAdapter]:
        transformers = self._transformers
        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_path, local_files_only=True, dtype=self._torch.float32
        )
        hf_tok = transformers.AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        eos = model.generation_config.eos_token_id
        if eos is None:
            eos = hf_tok.eos_token_id
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return model, HFTokenizerAdapter(hf_tok, eos_ids)

    def reload(self, model_path: str) -> str:
        """Serve the model directory ``model_path`` from now on (SGLang's
        ``update_weights_from_disk``): loaded first, swapped in between two generations."""
        model, tokenizer = self._load_local(model_path)
        if type(model.config) is not type(self.model.config):
            raise UnsupportedParameterError(
                f"{model_path} holds a {type(model.config).__name__} model but this server "
                f"serves {type(self.model.config).__name__}; start a server for it instead"
            )
        model.to(self.device)
        model.eval()
        with self._lock:
            self.adapters = self.adapters.moved_to(model)  # the loaded adapters follow the model
            self.model, self.tokenizer = model, tokenizer
            self.description = f"local model {model_path}"
            self.max_model_len = int(getattr(model.config, "max_position_embeddings", 4096))
        return f"serving {model_path}"

    def generate_batch(self, items: Sequence[GenerationItem]) -> list[Generation]:
        vocab = int(self.model.config.vocab_size)
        for index, item in enumerate(items):
            where = f"request {item.request_id!r}" if len(items) == 1 else f"batch item {index}"
            check_supported(item.sampling)
            if len(item.prompt_ids) + item.sampling.max_new_tokens > self.max_model_len:
                raise UnsupportedParameterError(
                    f"{where}: prompt ({len(item.prompt_ids)} tokens) + max_new_tokens "
                    f"({item.sampling.max_new_tokens}) exceeds the model's {self.max_model_len} "
                    "positions"
                )
            if not item.prompt_ids:
                raise UnsupportedParameterError(f"{where}: the prompt is empty (0 tokens)")
            if max(item.prompt_ids) >= vocab:
                raise UnsupportedParameterError(
                    f"{where}: token id {max(item.prompt_ids)} is not in the model's vocabulary "
                    f"(ids 0..{vocab - 1})"
                )
        # Zero-token requests are answered without the model; every other row, aborted ones
        # included, is in the batch, so its padding never depends on when an abort came.
        rows = [i for i, item in enumerate(items) if item.sampling.max_new_tokens > 0]
        if rows:
            width = max(len(items[i].prompt_ids) for i in rows)
            longest = max(items[i].sampling.max_new_tokens for i in rows)
            if width + longest > self.max_model_len:
                raise UnsupportedParameterError(
                    f"the batch pads to its longest prompt ({width} tokens) and runs to its "
                    f"largest max_new_tokens ({longest}): {width + longest} positions exceed the "
                    f"model's {self.max_model_len}; send the long-prompt and the long-answer "
                    "requests in separate batches"
                )
        results: list[Generation | None] = [None] * len(items)
        for index, item in enumerate(items):
            if item.sampling.max_new_tokens == 0:
                logprobs = () if item.return_logprob else None
                results[index] = Generation((), "", FinishReason("length"), logprobs)
        with self._lock:
            self.adapters.check_loaded(item.lora_name for item in items)
            if not rows:
                return [r for r in results if r is not None]
            batch = _Batch(
                [items[i] for i in rows], self.tokenizer, self.device, server_seed=self._seed
            )
            if len(batch.finished) < len(rows):  # some row is not aborted before its start
                transformers = self._transformers
                with self._torch.no_grad(), self.adapters.active(batch.lora_names):
                    out = self.model.generate(
                        batch.input_ids,
                        attention_mask=batch.attention_mask,
                        generation_config=batch.generation_config(transformers),
                        logits_processor=transformers.LogitsProcessorList(
                            [_RowSampler(batch, transformers)]
                        ),
                        stopping_criteria=transformers.StoppingCriteriaList([_RowStopper(batch)]),
                    )
                sequences = out.sequences[:, batch.width :].cpu().tolist()
            else:
                sequences = [[] for _ in rows]
            for index, generation in zip(rows, batch.generations(sequences), strict=True):
                results[index] = generation
        return [r for r in results if r is not None]


class _Batch:
    """One ``generate`` call's rows: the left-padded prompts, each row's generator, stops and
    end-of-sequence ids, and how each row finished (filled while generating)."""

    def __init__(
        self, items: Sequence[GenerationItem], tokenizer: Any, device: Any, *, server_seed: int
    ) -> None:
        import torch

        self.items = list(items)
        self.tokenizer = tokenizer
        self.width = max(len(item.prompt_ids) for item in items)
        pad = tokenizer.pad_token_id
        self.pad_token_id = pad
        ids = torch.full((len(items), self.width), pad, dtype=torch.long)
        mask = torch.zeros((len(items), self.width), dtype=torch.long)
        for row, item in enumerate(items):
            ids[row, self.width - len(item.prompt_ids) :] = torch.tensor(item.prompt_ids)
            mask[row, self.width - len(item.prompt_ids) :] = 1
        self.input_ids, self.attention_mask = ids.to(device), mask.to(device)
        self.generators = []
        for item in items:
            generator = torch.Generator(device=device)
            generator.manual_seed(request_seed(server_seed, item.request_id, item.sampling))
            self.generators.append(generator)
        self.end_ids = [
            set(item.sampling.stop_token_ids)
            | (set() if item.sampling.ignore_eos else set(tokenizer.eos_token_ids))
            for item in items
        ]
        self.lora_names = tuple(item.lora_name for item in items)
        #: row -> (new tokens kept, finish reason), once the row is done
        self.finished: dict[int, tuple[int, FinishReason]] = {
            row: (0, _ABORTED) for row, item in enumerate(items) if item.should_abort()
        }
        #: the rows that return log-probs, and per step their chosen tokens' log-probs
        self.logprob_rows = [row for row, item in enumerate(items) if item.return_logprob]
        self.step_logprobs: list[Any] = []
        if self.logprob_rows:
            temperatures = [items[row].sampling.temperature or 1.0 for row in self.logprob_rows]
            self.logprob_index = torch.tensor(self.logprob_rows, dtype=torch.long, device=device)
            self.logprob_scale = torch.tensor(temperatures, device=device).unsqueeze(1)

    def generation_config(self, transformers: Any) -> Any:
        return transformers.GenerationConfig(
            max_new_tokens=max(item.sampling.max_new_tokens for item in self.items),
            do_sample=False,  # the rows are sampled by _RowSampler; greedy keeps its choice
            eos_token_id=[],  # each row's end ids are _RowStopper's
            pad_token_id=self.pad_token_id,
            return_dict_in_generate=True,
        )

    def record_logprobs(self, scores: Any, chosen: Any) -> None:
        """One step: ``log_softmax(logits / temperature)`` (the raw logits when greedy) of each
        log-prob row's chosen token, before any truncation (kept on the device)."""
        import torch

        index = self.logprob_index
        rows = scores.index_select(0, index) / self.logprob_scale
        picked = chosen.index_select(0, index).unsqueeze(1)
        self.step_logprobs.append(torch.log_softmax(rows, dim=-1).gather(1, picked).squeeze(1))

    def generations(self, sequences: list[list[int]]) -> list[Generation]:
        import torch

        by_row: dict[int, list[float]] = {}
        if self.step_logprobs:
            table = torch.stack(self.step_logprobs, dim=1).cpu().tolist()  # [rows, steps]
            by_row = dict(zip(self.logprob_rows, table, strict=True))
        results = []
        for row, item in enumerate(self.items):
            kept, finish = self.finished.get(row, (len(sequences[row]), FinishReason("length")))
            new_ids = tuple(int(t) for t in sequences[row][:kept])
            logprobs = None
            if item.return_logprob:
                logprobs = tuple(float(v) for v in by_row.get(row, [])[:kept])
            text = self.tokenizer.decode(new_ids)
            if finish.kind == "stop" and isinstance(finish.matched, str):
                text, _ = _truncate_at_stop(text, (finish.matched,))
            results.append(Generation(new_ids, text, finish, logprobs))
        return results


class _RowSampler:
    """A logits processor that samples every unfinished row with its own generator and
    parameters, then leaves only the chosen token finite, so the greedy search keeps it.
    Temperature, then top-k, top-p and min-p, as SGLang applies them; greedy rows take the
    arg-max of the raw logits."""

    def __init__(self, batch: _Batch, transformers: Any) -> None:
        self.batch = batch
        self.warpers = []
        for item in batch.items:
            s = item.sampling
            warpers = []
            if s.temperature != 0:
                if s.top_k not in (-1, 0):
                    warpers.append(transformers.TopKLogitsWarper(top_k=s.top_k))
                if s.top_p < 1.0:
                    warpers.append(transformers.TopPLogitsWarper(top_p=s.top_p))
                if s.min_p:
                    warpers.append(transformers.MinPLogitsWarper(min_p=s.min_p))
            self.warpers.append(warpers)

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        batch = self.batch
        chosen = scores.argmax(dim=-1)
        for row, item in enumerate(batch.items):
            temperature = item.sampling.temperature
            if temperature == 0 or row in batch.finished:
                continue
            row_scores = scores[row : row + 1] / temperature
            for warper in self.warpers[row]:
                row_scores = warper(input_ids[row : row + 1], row_scores)
            probs = torch.softmax(row_scores, dim=-1)
            chosen[row] = torch.multinomial(probs[0], 1, generator=batch.generators[row])[0]
        if batch.logprob_rows:
            batch.record_logprobs(scores, chosen)
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter_(1, chosen.unsqueeze(1), 0.0)


class _RowStopper:
    """A stopping criterion per row: abort, a stop string, an end id, the row's own
    ``max_new_tokens``; records how the row finished in the batch."""

    def __init__(self, batch: _Batch) -> None:
        self.batch = batch
        self.any_stops = any(item.sampling.stop for item in batch.items)

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch

        batch = self.batch
        new = input_ids[:, batch.width :]
        count = new.shape[1]
        last = new[:, -1].tolist()
        texts = new.tolist() if self.any_stops else None
        for row, item in enumerate(batch.items):
            if row in batch.finished:
                continue
            finish = None
            if item.should_abort():
                finish = _ABORTED
            elif last[row] in batch.end_ids[row]:
                finish = FinishReason("stop", matched=last[row])
            elif item.sampling.stop and texts is not None:
                text = batch.tokenizer.decode(texts[row])
                _, matched = _truncate_at_stop(text, item.sampling.stop)
                if matched is not None:
                    finish = FinishReason("stop", matched=matched)
            if finish is None and count >= item.sampling.max_new_tokens:
                finish = FinishReason("length")
            if finish is not None:
                batch.finished[row] = (count, finish)
        done = [row in batch.finished for row in range(len(batch.items))]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def make_backend(
    kind: str, *, model_path: str | None, seed: int, num_threads: int = 1, device: str = "cpu"
) -> Backend:
    if kind == "transformers":
        return TransformersBackend(
            model_path=model_path, seed=seed, num_threads=num_threads, device=device
        )
    if device != "cpu":
        raise ValueError("--device applies to the transformers backend only")
    if kind == "echo":
        if model_path is not None:
            raise ValueError("--model does not apply to the echo backend; drop one of them")
        return EchoBackend(seed=seed)
    raise ValueError(f"unknown backend {kind!r}; use 'transformers' or 'echo'")


def backend_choices() -> Mapping[str, str]:
    return {
        "transformers": "Hugging Face generate (tiny random model, or --model PATH)",
        "echo": "instant answers without a model (overhead benchmarks, base installs)",
    }


class LoraAdapters:
    """Named PEFT LoRA adapters on one transformers model, applied by forward hooks (see the
    module docstring).  Not thread-safe by itself: the backend's lock serialises its use."""

    def __init__(self, model: Any, *, device: Any) -> None:
        self.model = model
        self.device = device
        self._modules = dict(model.named_modules())
        #: name -> (path, scale, {module path: (A [r, in], B [out, r])})
        self._adapters: dict[str, tuple[str, float, dict[str, tuple[Any, Any]]]] = {}
        self._hooked: dict[str, Any] = {}
        #: (adapter, its rows or None for all) of the forward running now
        self._active: list[tuple[str, Any]] = []

    def loaded(self) -> dict[str, str]:
        return {name: entry[0] for name, entry in self._adapters.items()}

    def load(self, name: str, path: str) -> None:
        from ...adapters import check_adapter_name

        try:
            check_adapter_name(name)
        except ValueError as exc:
            raise UnsupportedParameterError(str(exc)) from None
        if name in self._adapters:
            raise UnsupportedParameterError(
                f"Failed to load LoRA adapter {name} because it is already loaded (unload it "
                "first, or load the new version under a new name)"
            )
        scale, factors = self._read(path)
        self._adapters[name] = (path, scale, factors)
        for module_path in factors:
            self._hook(module_path)

    def unload(self, name: str) -> None:
        if name not in self._adapters:
            raise UnsupportedParameterError(
                f"LoRA adapter {name!r} is not loaded (loaded: {sorted(self._adapters)})"
            )
        del self._adapters[name]

    def moved_to(self, model: Any) -> LoraAdapters:
        """The same adapters on another model of the same architecture (after a reload)."""
        moved = LoraAdapters(model, device=self.device)
        for name, (path, _, _) in self._adapters.items():
            moved.load(name, path)
        return moved

    def check_loaded(self, names: Iterable[str | None]) -> None:
        """Refuse a request routed to an adapter that is not loaded."""
        for name in names:
            if name is not None and name not in self._adapters:
                raise UnsupportedParameterError(
                    f"lora_path={name!r} names no loaded LoRA adapter (loaded: "
                    f"{sorted(self._adapters)}); load it with /load_lora_adapter first"
                )

    def active(self, names: str | Sequence[str | None] | None):
        """Context: row ``i`` of every forward inside gets adapter ``names[i]`` (None: the
        base model); one name (or None) applies to every row."""
        import contextlib

        import torch

        if names is None or isinstance(names, str):
            names = (names,)  # one adapter (or the base) for every row
        self.check_loaded(names)
        if all(name is None for name in names):
            plan: list[tuple[str, Any]] = []
        elif len(set(names)) == 1:
            plan = [(names[0], None)]  # every row: no indexing
        else:
            plan = []
            for name in sorted({n for n in names if n is not None}):
                rows = [i for i, n in enumerate(names) if n == name]
                plan.append((name, torch.tensor(rows, dtype=torch.long, device=self.device)))

        @contextlib.contextmanager
        def scope():
            previous, self._active = self._active, plan
            try:
                yield
            finally:
                self._active = previous

        return scope()

    def _hook(self, module_path: str) -> None:
        if module_path in self._hooked:
            return

        def hook(module: Any, inputs: Any, output: Any) -> Any:
            for name, rows in self._active:
                _, scale, factors = self._adapters[name]
                pair = factors.get(module_path)
                if pair is None:
                    continue
                lora_a, lora_b = pair
                x = inputs[0] if rows is None else inputs[0].index_select(0, rows)
                delta = (scale * ((x.to(lora_a.dtype) @ lora_a.t()) @ lora_b.t())).to(output.dtype)
                output = output + delta if rows is None else output.index_add(0, rows, delta)
            return output

        self._hooked[module_path] = self._modules[module_path].register_forward_hook(hook)

    def _read(self, path: str) -> tuple[float, dict[str, tuple[Any, Any]]]:
        """Validate and read a PEFT adapter directory against this model."""
        import torch
        from safetensors import SafetensorError, safe_open

        from ...adapters import ADAPTER_WEIGHTS_FILE, read_adapter_config, split_peft_weight_key

        try:
            config = read_adapter_config(path)
        except ValueError as exc:
            raise UnsupportedParameterError(str(exc)) from None
        file = f"{path}/{ADAPTER_WEIGHTS_FILE}"
        tensors: dict[str, dict[str, Any]] = {}
        try:
            with safe_open(file, framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    module_path, factor = split_peft_weight_key(key)
                    tensors.setdefault(module_path, {})[factor] = handle.get_tensor(key)
        except SafetensorError as exc:
            raise UnsupportedParameterError(f"{file}: unreadable safetensors ({exc})") from None
        except ValueError as exc:
            raise UnsupportedParameterError(f"{file}: {exc}") from None
        if not tensors:
            raise UnsupportedParameterError(f"{file}: holds no LoRA factor")
        dtype = next(self.model.parameters()).dtype
        factors = {}
        for module_path, pair in sorted(tensors.items()):
            module = self._modules.get(module_path)
            where = f"{file}: {module_path}"
            if not isinstance(module, torch.nn.Linear):
                raise UnsupportedParameterError(
                    f"{where}: the served model has no linear layer of that name; the adapter "
                    "belongs to another architecture"
                )
            if module_path.rsplit(".", 1)[-1] not in config.target_modules:
                raise UnsupportedParameterError(
                    f"{where}: not among target_modules {list(config.target_modules)}"
                )
            if set(pair) != {"lora_A", "lora_B"}:
                raise UnsupportedParameterError(f"{where}: needs both lora_A and lora_B")
            lora_a, lora_b = pair["lora_A"], pair["lora_B"]
            expected_a = (config.rank, module.in_features)
            expected_b = (module.out_features, config.rank)
            if tuple(lora_a.shape) != expected_a or tuple(lora_b.shape) != expected_b:
                raise UnsupportedParameterError(
                    f"{where}: factor shapes {tuple(lora_a.shape)}/{tuple(lora_b.shape)}, the "
                    f"layer needs {expected_a}/{expected_b} (r={config.rank})"
                )
            for tensor in (lora_a, lora_b):
                if not tensor.dtype.is_floating_point or not bool(torch.isfinite(tensor).all()):
                    raise UnsupportedParameterError(f"{where}: factors must be finite floats")
            factors[module_path] = (
                lora_a.to(device=self.device, dtype=dtype),
                lora_b.to(device=self.device, dtype=dtype),
            )
        return config.scale, factors
