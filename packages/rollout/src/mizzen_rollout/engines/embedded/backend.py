"""Generation backends of the embedded server.

- :class:`TransformersBackend` (the default): Hugging Face ``generate`` on a causal LM, either
  the tiny model built from the packaged config ``tiny_llama.json`` with seeded random weights (no
  hub, no files to download) or a local model directory (``model_path``).
- :class:`EchoBackend`: answers instantly without a model (it echoes the prompt's tail); it
  exists to measure router/client overhead and to run the protocol on a base install.

Invariants:
- torch and transformers are imported inside :class:`TransformersBackend` only.
- One generation runs at a time (a lock); requests queue.  ``should_abort`` is polled before the
  generation starts and after every token, so an abort ends a queued or running request promptly,
  keeping the tokens generated so far.
- Sampling is reproducible: each request seeds torch with its ``seed`` (SGLang's
  ``sampling_seed``) or, when absent, with a hash of (server seed, request id), so re-issuing a
  request id yields the same sample.
- Log-probs are ``log_softmax(logits / temperature)`` of the sampled token (``logits`` when
  greedy), before top-k/top-p truncation.
- Unsupported sampling parameters with non-default values are rejected, never ignored.
- :meth:`TransformersBackend.reload` swaps in another model directory between two generations
  (a generation never mixes weights); the echo backend has no weights to update.
- LoRA adapters (PEFT directories, :mod:`mizzen_rollout.adapters`) are loaded by name and applied
  per request: a forward hook on each target ``nn.Linear`` adds ``scale * B (A x)`` while that
  request's adapter is active, exactly PEFT's LoRA forward (dropout off); the base weights are
  never modified, so requests without an adapter are the base model bit for bit.  Loading,
  unloading and generating hold the one generation lock: a request sees one adapter version
  from its first token to its last, and an unload waits for the request using it.
"""

from __future__ import annotations

import json
import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
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


class Backend(Protocol):
    description: str
    max_model_len: int
    tokenizer: Any

    def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        request_id: str,
        return_logprob: bool,
        should_abort: Callable[[], bool],
        lora_name: str | None = None,
    ) -> Generation: ...


def _truncate_at_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """Cut ``text`` before the earliest stop string; return (text, matched stop or None)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        pos = text.find(stop)
        if stop and pos >= 0 and (best is None or pos < best[0]):
            best = (pos, stop)
    return (text, None) if best is None else (text[: best[0]], best[1])


class EchoBackend:
    """Instant answers, no model: the last ``max_new_tokens`` prompt tokens, echoed."""

    max_model_len = 1 << 20

    def __init__(self, seed: int = 0):
        self.tokenizer = ByteTokenizer()
        self.description = "echo (instant answers, no model)"
        self._seed = seed

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
        check_supported(sampling)
        if lora_name is not None:
            raise UnsupportedParameterError(
                f"lora_path={lora_name!r}: the echo backend serves no LoRA adapters"
            )
        if should_abort():
            return Generation((), "", FinishReason("abort", message="Aborted by request"), None)
        body = [t for t in prompt_ids if t >= ByteTokenizer.OFFSET]
        n = sampling.max_new_tokens
        out = tuple(body[-n:]) if n else ()
        text, matched = _truncate_at_stop(self.tokenizer.decode(out), sampling.stop)
        if matched is not None:
            finish = FinishReason("stop", matched=matched)
        elif len(out) == n:
            finish = FinishReason("length")
        else:
            finish = FinishReason("stop", matched=ByteTokenizer.EOS)
        logprobs = tuple(-1.0 for _ in out) if return_logprob else None
        return Generation(out, text, finish, logprobs)


class TransformersBackend:
    """Hugging Face ``generate`` on CPU (or whatever torch's default device is)."""

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

    def _stopping_criteria(
        self, prompt_len: int, stops: Sequence[str], should_abort: Callable[[], bool]
    ) -> tuple[Any, dict[str, Any]]:
        torch, transformers = self._torch, self._transformers
        tokenizer = self.tokenizer
        state: dict[str, Any] = {"aborted": False, "stop": None}

        class _AbortOrStop(transformers.StoppingCriteria):
            def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
                done = False
                if should_abort():
                    state["aborted"] = done = True
                elif stops:
                    text = tokenizer.decode(input_ids[0, prompt_len:].tolist())
                    _, matched = _truncate_at_stop(text, stops)
                    if matched is not None:
                        state["stop"] = matched
                        done = True
                return torch.full(
                    (input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device
                )

        return transformers.StoppingCriteriaList([_AbortOrStop()]), state

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
        check_supported(sampling)
        torch, transformers = self._torch, self._transformers
        if len(prompt_ids) + sampling.max_new_tokens > self.max_model_len:
            raise UnsupportedParameterError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens "
                f"({sampling.max_new_tokens}) exceeds the model's {self.max_model_len} positions"
            )
        if not prompt_ids:
            raise UnsupportedParameterError("the prompt is empty (0 tokens)")
        with self._lock:
            if should_abort():
                return Generation((), "", FinishReason("abort", message="Aborted by request"), None)
            if sampling.max_new_tokens == 0:
                return Generation((), "", FinishReason("length"), () if return_logprob else None)
            torch.manual_seed(request_seed(self._seed, request_id, sampling))
            eos_ids = [] if sampling.ignore_eos else list(self.tokenizer.eos_token_ids)
            stop_ids = list(sampling.stop_token_ids)
            greedy = sampling.temperature == 0
            config = transformers.GenerationConfig(
                max_new_tokens=sampling.max_new_tokens,
                do_sample=not greedy,
                temperature=None if greedy else sampling.temperature,
                top_k=None if greedy or sampling.top_k == -1 else sampling.top_k,
                top_p=None if greedy else sampling.top_p,
                min_p=None if greedy or not sampling.min_p else sampling.min_p,
                eos_token_id=eos_ids + stop_ids,
                pad_token_id=self.tokenizer.pad_token_id,
                output_logits=return_logprob,
                return_dict_in_generate=True,
            )
            criteria, state = self._stopping_criteria(len(prompt_ids), sampling.stop, should_abort)
            ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.device)
            with torch.no_grad(), self.adapters.active(lora_name):
                out = self.model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    generation_config=config,
                    stopping_criteria=criteria,
                )
        new_ids = tuple(int(t) for t in out.sequences[0, len(prompt_ids) :].cpu().tolist())
        logprobs = None
        if return_logprob:
            steps = torch.cat([step[:1] for step in out.logits], dim=0).float().cpu()
            if not greedy:
                steps = steps / sampling.temperature
            chosen = torch.tensor(new_ids, dtype=torch.long).unsqueeze(1)
            values = torch.log_softmax(steps, dim=-1).gather(1, chosen).squeeze(1)
            logprobs = tuple(float(v) for v in values.tolist())
        text = self.tokenizer.decode(new_ids)
        if state["aborted"]:
            finish = FinishReason("abort", message="Aborted by request")
        elif state["stop"] is not None:
            text, _ = _truncate_at_stop(text, (state["stop"],))
            finish = FinishReason("stop", matched=state["stop"])
        elif new_ids and new_ids[-1] in set(eos_ids + stop_ids):
            finish = FinishReason("stop", matched=new_ids[-1])
        else:
            finish = FinishReason("length")
        return Generation(new_ids, text, finish, logprobs)


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
        self._active: str | None = None

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

    def active(self, name: str | None):
        """Context: ``name``'s adapter applies to every forward inside (None: the base)."""
        import contextlib

        if name is not None and name not in self._adapters:
            raise UnsupportedParameterError(
                f"lora_path={name!r} names no loaded LoRA adapter (loaded: "
                f"{sorted(self._adapters)}); load it with /load_lora_adapter first"
            )

        @contextlib.contextmanager
        def scope():
            previous, self._active = self._active, name
            try:
                yield
            finally:
                self._active = previous

        return scope()

    def _hook(self, module_path: str) -> None:
        if module_path in self._hooked:
            return

        def hook(module: Any, inputs: Any, output: Any) -> Any:
            active = self._active
            if active is None:
                return None
            _, scale, factors = self._adapters[active]
            pair = factors.get(module_path)
            if pair is None:
                return None
            lora_a, lora_b = pair
            x = inputs[0].to(lora_a.dtype)
            delta = (x @ lora_a.t()) @ lora_b.t()
            return output + (scale * delta).to(output.dtype)

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
