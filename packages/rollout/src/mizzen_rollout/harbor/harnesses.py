"""The agent harnesses a rollout can run, and how each one is pointed at our engine.

`HARNESSES` is the one table: for each Harbor agent name, whether it calls a model, the inference
protocol it speaks, the sampling parameters it can forward and how, how it limits iterations, and
which response-too-long policies it can honour. `agent_setup` reads it to produce the Harbor
`AgentConfig` fields; nothing else knows per-harness details.

Invariants:
- Sampling parameters are normalised to one vocabulary (`SAMPLING_KEYS`; `max_new_tokens` is
  accepted for `max_tokens`). A parameter the harness cannot forward is a configuration error,
  never silently dropped (the policy would sample from a distribution nobody asked for). `None`,
  neutral values that mean "off" (top_k=-1, min_p=0, empty stop lists, ...) and the engine-side
  output knobs in `ENGINE_SIDE_KEYS` are ignored. A `SamplingParams` dataclass of
  `mizzen_rollout.engines.base` is accepted as is (its `extra` is merged in).
- `max_iterations=0` means zero model turns for every harness. Where the harness's own limit
  reads 0 as "unlimited" or leaves it undefined (mini-swe-agent's step_limit, claude-code's
  --max-turns, opencode's steps), the trial runs Harbor's `nop` agent instead: zero model calls,
  and the verifier scores the untouched sandbox. The outcome records the substitution.

Response too long (`response_too_long`):
- `abort` (default): when the conversation outgrows the context window, the trial ends with exit
  status `sequence_length_exceeded` and reward 0. Why abort is the default: RL trains on the
  exact token sequence the policy produced. Recovery (summarising or dropping history and going
  on) makes the agent continue from a context the policy never generated, so the trajectory is no
  longer one on-policy sequence; its reward would credit tokens the trainer cannot attribute, and
  truncated half-actions get reinforced. An aborted sample is honest and easy to mask.
- `recover`: let the harness summarise and continue (fine for evaluation, where only the final
  reward matters). claude-code and opencode compact their context on their own and cannot be
  made to abort, so they require `recover` explicitly; mini-swe-agent cannot recover.
- Two ways to be too long: the conversation outgrows the context window, or one reply hits
  `max_tokens` (finish_reason `length`). Stock terminus-2 answers the second by re-asking the
  model, recursively and without bound (an engine that truncates every reply loops until the
  agent timeout); under `abort` the table loads `terminus_abort.AbortingTerminus2`, which ends the
  trial instead. Under `recover` stock terminus-2 runs, summarisation on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mizzen_rollout.harbor.errors import HarborConfigError
from mizzen_rollout.harbor.redaction import redact_value, shown
from mizzen_rollout.harbor.terminus_abort import ABORTING_TERMINUS_IMPORT_PATH

#: the normalised sampling vocabulary
SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "seed",
)
_ALIASES = {"max_new_tokens": "max_tokens"}
#: values that mean "off" (the engine default), dropped so that harnesses are not asked to
#: forward them: SamplingParams() of `mizzen_rollout.engines.base` carries several
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "top_k": (-1,),
    "min_p": (0.0,),
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
    "repetition_penalty": (1.0,),
    "stop": ((), []),
    "stop_token_ids": ((), []),
    "ignore_eos": (False,),
}
#: output-formatting knobs of the engine's native API; agents receive text over the OpenAI API
ENGINE_SIDE_KEYS = frozenset(
    {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"}
)
#: OpenAI-API parameters (sent top level); the rest go in `extra_body` (sglang/vLLM extensions)
_OPENAI_TOP_LEVEL = frozenset(
    {"temperature", "top_p", "max_tokens", "presence_penalty", "frequency_penalty", "stop", "seed"}
)

OPENAI_CHAT = "openai_chat_completions"
ANTHROPIC_MESSAGES = "anthropic_messages"


@dataclass(repr=False)
class AgentSetup:
    """What a harness contributes to Harbor's `AgentConfig` (`repr()` through
    `redaction.redact_value`: `kwargs` also hold the user's `agent_kwargs`)."""

    name: str | None
    import_path: str | None = None  # a Harbor agent class loaded instead of the named one
    model_name: str | None = None
    model_api_format: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    substituted_for: str | None = None  # set when max_iterations=0 swapped in the nop agent
    harness: str = ""  # the harness asked for (the row of HARNESSES)

    def __repr__(self) -> str:
        shown_fields = ", ".join(
            f"{item.name}={redact_value(getattr(self, item.name))!r}"
            for item in dataclasses.fields(self)
        )
        return f"AgentSetup({shown_fields})"


SamplingBuilder = Callable[[dict[str, Any], AgentSetup], None]
IterationBuilder = Callable[[int, AgentSetup], None]
PolicyBuilder = Callable[[str, AgentSetup], None]


@dataclass(frozen=True)
class Harness:
    """One row of the harness table (see the module docstring)."""

    name: str
    uses_model: bool
    api_format: str | None
    model_prefix: str
    forwards: frozenset[str]
    put_sampling: SamplingBuilder | None
    put_iterations: IterationBuilder | None
    zero_iterations_native: bool
    too_long_policies: frozenset[str]
    put_policy: PolicyBuilder | None
    too_long_note: str = ""


# ----------------------------------------------------------------------------- per harness


def _split_openai(sampling: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    top = {k: v for k, v in sampling.items() if k in _OPENAI_TOP_LEVEL}
    extra = {k: v for k, v in sampling.items() if k not in _OPENAI_TOP_LEVEL}
    return top, extra


def _terminus_sampling(sampling: dict[str, Any], setup: AgentSetup) -> None:
    top, extra = _split_openai(sampling)
    if "temperature" in top:
        setup.kwargs["temperature"] = top.pop("temperature")
    call_kwargs = dict(top)
    if extra:
        call_kwargs["extra_body"] = extra
    if call_kwargs:
        setup.kwargs["llm_call_kwargs"] = call_kwargs


def _terminus_iterations(limit: int, setup: AgentSetup) -> None:
    setup.kwargs["max_turns"] = limit  # terminus-2 runs range(max_turns): 0 is zero turns
    setup.kwargs["suppress_max_turns_warning"] = True


def _terminus_policy(policy: str, setup: AgentSetup) -> None:
    if policy == "abort":
        setup.name, setup.import_path = None, ABORTING_TERMINUS_IMPORT_PATH
        setup.kwargs["enable_summarize"] = False
        setup.kwargs["proactive_summarization_threshold"] = 0
    else:
        setup.kwargs["enable_summarize"] = True


def _mini_config(setup: AgentSetup) -> dict[str, Any]:
    return setup.kwargs.setdefault("config", {})


def _mini_sampling(sampling: dict[str, Any], setup: AgentSetup) -> None:
    top, extra = _split_openai(sampling)
    model_kwargs = _mini_config(setup).setdefault("model", {}).setdefault("model_kwargs", {})
    model_kwargs.update(top)
    if extra:
        model_kwargs["extra_body"] = extra


def _mini_iterations(limit: int, setup: AgentSetup) -> None:
    _mini_config(setup).setdefault("agent", {})["step_limit"] = limit


def _claude_sampling(sampling: dict[str, Any], setup: AgentSetup) -> None:
    setup.env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(sampling["max_tokens"])


def _claude_iterations(limit: int, setup: AgentSetup) -> None:
    setup.kwargs["max_turns"] = limit


def _opencode_agent(setup: AgentSetup) -> dict[str, Any]:
    config = setup.kwargs.setdefault("opencode_config", {})
    return config.setdefault("agent", {}).setdefault("build", {})


def _opencode_sampling(sampling: dict[str, Any], setup: AgentSetup) -> None:
    _opencode_agent(setup).update(sampling)


def _opencode_iterations(limit: int, setup: AgentSetup) -> None:
    _opencode_agent(setup)["steps"] = limit


_ALL_POLICIES = frozenset({"abort", "recover"})

HARNESSES: dict[str, Harness] = {
    h.name: h
    for h in (
        Harness(
            name="terminus-2",
            uses_model=True,
            api_format=None,  # LiteLLM client; the model name carries the provider
            model_prefix="openai/",
            forwards=frozenset(SAMPLING_KEYS),
            put_sampling=_terminus_sampling,
            put_iterations=_terminus_iterations,
            zero_iterations_native=True,
            too_long_policies=_ALL_POLICIES,
            put_policy=_terminus_policy,
        ),
        Harness(
            name="mini-swe-agent",
            uses_model=True,
            api_format=None,  # LiteLLM client
            model_prefix="openai/",
            forwards=frozenset(SAMPLING_KEYS),
            put_sampling=_mini_sampling,
            put_iterations=_mini_iterations,
            zero_iterations_native=False,  # step_limit=0 means unlimited in mini-swe-agent
            too_long_policies=frozenset({"abort"}),
            put_policy=None,
            too_long_note="mini-swe-agent has no context recovery (no summarisation); use abort",
        ),
        Harness(
            name="claude-code",
            uses_model=True,
            api_format=ANTHROPIC_MESSAGES,  # the engine must serve /v1/messages for it
            model_prefix="",
            forwards=frozenset({"max_tokens"}),
            put_sampling=_claude_sampling,
            put_iterations=_claude_iterations,
            zero_iterations_native=False,
            too_long_policies=frozenset({"recover"}),
            put_policy=None,
            too_long_note="claude-code compacts its context itself and cannot abort; set "
            "response_too_long=recover to accept that",
        ),
        Harness(
            name="opencode",
            uses_model=True,
            api_format=OPENAI_CHAT,
            model_prefix="openai/",
            forwards=frozenset({"temperature", "top_p"}),
            put_sampling=_opencode_sampling,
            put_iterations=_opencode_iterations,
            zero_iterations_native=False,
            too_long_policies=frozenset({"recover"}),
            put_policy=None,
            too_long_note="opencode compacts its context itself and cannot abort; set "
            "response_too_long=recover to accept that",
        ),
        Harness(
            name="oracle",
            uses_model=False,
            api_format=None,
            model_prefix="",
            forwards=frozenset(),
            put_sampling=None,
            put_iterations=None,
            zero_iterations_native=True,
            too_long_policies=_ALL_POLICIES,
            put_policy=None,
        ),
        Harness(
            name="nop",
            uses_model=False,
            api_format=None,
            model_prefix="",
            forwards=frozenset(),
            put_sampling=None,
            put_iterations=None,
            zero_iterations_native=True,
            too_long_policies=_ALL_POLICIES,
            put_policy=None,
        ),
    )
}


def harness(name: str) -> Harness:
    try:
        return HARNESSES[name]
    except KeyError:
        raise HarborConfigError(
            f"MIZZEN_HARBOR_AGENT (agent): {shown(name)} is not a supported harness; fix: use one of "
            f"{sorted(HARNESSES)}"
        ) from None


def _is_neutral(key: str, value: Any) -> bool:
    for off in _NEUTRAL.get(key, ()):
        if isinstance(off, bool) or isinstance(value, bool):
            if isinstance(off, bool) and isinstance(value, bool) and value == off:
                return True
        elif isinstance(off, tuple | list):
            if isinstance(value, tuple | list) and not value:
                return True
        elif isinstance(value, int | float) and value == off:
            return True
    return False


def normalize_sampling_params(params: Mapping[str, Any] | Any | None) -> dict[str, Any]:
    """Map `params` onto `SAMPLING_KEYS`; raise on unknown keys or a conflicting alias.

    Accepts a mapping or a dataclass such as `mizzen_rollout.engines.base.SamplingParams` (its
    `extra` mapping is merged in). `None` and neutral ("off") values are dropped.
    """
    if params is not None and dataclasses.is_dataclass(params) and not isinstance(params, type):
        params = dataclasses.asdict(params)
    items = dict(params or {})
    extra = items.pop("extra", None) or {}
    if not isinstance(extra, Mapping):
        raise HarborConfigError("sampling_params: 'extra' must be a mapping")
    clash = sorted(set(extra) & set(items))
    if clash:
        raise HarborConfigError(
            f"sampling_params: {shown(clash)} given both directly and in 'extra'"
        )
    items.update(extra)
    normalized: dict[str, Any] = {}
    for raw_key, value in items.items():
        if value is None or raw_key in ENGINE_SIDE_KEYS:
            continue
        if _is_neutral(_ALIASES.get(raw_key, raw_key), value):
            continue
        key = _ALIASES.get(raw_key, raw_key)
        if key not in SAMPLING_KEYS:
            raise HarborConfigError(
                f"sampling_params: unknown parameter {shown(raw_key)}; fix: use "
                f"{list(SAMPLING_KEYS)} (max_new_tokens is accepted for max_tokens)"
            )
        if key in normalized and normalized[key] != value:
            raise HarborConfigError(
                f"sampling_params: {shown(raw_key)} conflicts with another spelling of {key!r}; "
                "fix: give it once"
            )
        normalized[key] = value
    return normalized


def agent_setup(
    name: str,
    *,
    model_name: str,
    sampling_params: Mapping[str, Any] | None,
    max_iterations: int | None,
    response_too_long: str,
) -> AgentSetup:
    """The Harbor agent fields for harness `name` (see the module docstring for the rules)."""
    spec = harness(name)
    if response_too_long not in spec.too_long_policies:
        raise HarborConfigError(
            f"MIZZEN_HARBOR_RESPONSE_TOO_LONG: {response_too_long!r} is not supported by "
            f"{spec.name}; fix: {spec.too_long_note}"
        )
    if not spec.uses_model:
        return AgentSetup(name=spec.name, harness=spec.name)
    if max_iterations == 0 and not spec.zero_iterations_native:
        return AgentSetup(name="nop", substituted_for=spec.name, harness=spec.name)

    sampling = normalize_sampling_params(sampling_params)
    refused = sorted(set(sampling) - spec.forwards)
    if refused:
        raise HarborConfigError(
            f"sampling_params: {spec.name} cannot forward {refused} to the engine (it forwards "
            f"{sorted(spec.forwards) or 'none'}); fix: drop them from the sampling params or "
            "use a harness that forwards them (terminus-2, mini-swe-agent)"
        )
    setup = AgentSetup(
        name=spec.name,
        harness=spec.name,
        model_name=f"{spec.model_prefix}{model_name}",
        model_api_format=spec.api_format,
    )
    if spec.name == "terminus-2":
        setup.kwargs["record_terminal_session"] = False  # asciinema recordings: not for RL
    if sampling and spec.put_sampling is not None:
        spec.put_sampling(sampling, setup)
    if max_iterations is not None and spec.put_iterations is not None:
        spec.put_iterations(max_iterations, setup)
    if spec.put_policy is not None:
        spec.put_policy(response_too_long, setup)
    return setup


def merge_agent_kwargs(setup: AgentSetup, extra: Mapping[str, Any]) -> None:
    """Add user `agent_kwargs`; a key we already derived from settings is a conflict (error)."""
    clash = sorted(set(extra) & set(setup.kwargs))
    if clash:
        raise HarborConfigError(
            f"MIZZEN_HARBOR_AGENT_KWARGS (agent_kwargs): {shown(clash)} are derived from the sampling "
            "params / max_iterations / response_too_long settings; fix: set them there instead"
        )
    setup.kwargs.update(extra)
