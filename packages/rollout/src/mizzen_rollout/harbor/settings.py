"""The Harbor run settings and the one table of worker environment variables that carries them.

The launcher (`launcher.harbor_env_vars`) builds a `HarborSettings`, validates it and turns it into
environment variables for the rollout workers; the agent function (`agent.run`) reads them back
with `HarborSettings.from_env`. Both sides run the same `validate`, so a worker never starts a
trial from settings the launcher would have refused.

Invariants:
- `ENV_VARS` is the only place a variable name is spelled; `to_env` and `from_env` derive from it.
- Optional knobs are written only when set; `max_iterations=0` is set (zero, not "unset").
- No secret is ever a setting: provider keys travel as key-file paths (see `credentials`), the
  engine key as the NAME of the variable that holds it (`engine_api_key_var`). Credentials in
  `agent_kwargs` / `environment_kwargs` are refused (`kwargs_credential_problems`), by `validate`
  and again by `to_env`, so they reach neither the worker variables nor Harbor's config.json: any
  string at any depth (lists included; mapping keys too) under a password-like key
  (`redaction.is_sensitive_name`),
  `${VAR}` templates included (Harbor resolves those only in `AgentConfig.env`, so in kwargs they
  would reach the agent as literal text); anywhere, a string of a credential shape
  (`redaction.credential_shape`: `Bearer ...`, `API_KEY=...`, a URL with a userinfo or a
  password-like or unnamed query/`;params`/fragment item); a key name that is not ASCII after
  NFKC (a look-alike would hide a password-like name). A value is under a password-like name
  also when the name is beside it rather than above it: a mapping whose `name`/`key`/`header`/
  `var`/`flag`/... field is a password-like name (`env=[{"name": "OPENAI_API_KEY", "value": S}]`),
  a two-item list whose first item is one (a header pair `["X-Api-Key", S]`), and the item after
  a password-like `--flag` in a list (`["--api-key", S]`). Every text refused as a credential is
  registered in the mask set (`mizzen_rollout.masking`), so nothing later shows it either.
  Numbers, booleans and null under
  password-like names are fine (`max_tokens`, `max_thinking_tokens`). Kwargs must be JSON: a
  JSON object of at most `MAX_KWARGS_CHARS` characters (the most one variable can carry to a
  process Linux starts) nested at most `_MAX_KWARGS_DEPTH` levels below the top object, checked
  before the text is decoded (`bounded_json`); `to_env` refuses longer ones on the launcher.
- `engine_api_key_var` is an environment variable NAME: UPPER_CASE words of letters and digits
  (each at most 16 characters, at most 3 digits), not the value of a password-like variable or a
  registered secret; anything else looks like a key pasted in its place and is refused (and
  registered) without being repeated.
- `repr()` shows every field through `redaction.redact_value` and the mask set; no error message repeats a raw
  value (they go through `redaction.shown`), and none is chained to the exception that held it.
- Importing this module imports no Harbor; `validate` imports `harbor` lazily to check the
  environment type against Harbor's own `EnvironmentType` and the harness against `AgentName`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from mizzen_rollout.harbor.bounded_json import loads_bounded
from mizzen_rollout.harbor.errors import HarborConfigError, ProviderCredentialError
from mizzen_rollout.harbor.redaction import (
    credential_shape,
    is_sensitive_name,
    is_template,
    normalize,
    redact_value,
    shown,
)
from mizzen_rollout.masking import environment_secrets, mask, masked_repr, register_candidate

RESPONSE_TOO_LONG_POLICIES = ("abort", "recover")
DEFAULT_REWARD_KEY = "reward"
_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_]\w*$")
_KWARGS = ("environment_kwargs", "agent_kwargs")
_MAX_KWARGS_DEPTH = 32
#: Linux's MAX_ARG_STRLEN (one `NAME=value` string handed to exec) is 128 KiB
MAX_KWARGS_CHARS = 128 * 1024 - 64
#: fields of a mapping that NAME its other fields (`{"name": "OPENAI_API_KEY", "value": ...}`)
_NAMING_FIELDS = frozenset(
    {"name", "key", "header", "field", "var", "variable", "env", "flag", "option", "param",
     "parameter", "id", "label"}
)  # fmt: skip
_NAME_ITEM = re.compile(r"-{0,2}[A-Za-z_][\w.-]*")
#: an environment variable name, and what a key pasted in its place looks like
_VARIABLE_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")
_MAX_NAME_WORD = 16
_MAX_NAME_DIGITS = 3

#: setting name -> worker environment variable
ENV_VARS: dict[str, str] = {
    "tasks_dir": "MIZZEN_HARBOR_TASKS_DIR",
    "trials_dir": "MIZZEN_HARBOR_TRIALS_DIR",
    "model_name": "MIZZEN_HARBOR_MODEL",
    "agent": "MIZZEN_HARBOR_AGENT",
    "environment_type": "MIZZEN_HARBOR_ENVIRONMENT_TYPE",
    "environment_import_path": "MIZZEN_HARBOR_ENVIRONMENT_IMPORT_PATH",
    "trial_timeout_s": "MIZZEN_HARBOR_TRIAL_TIMEOUT_S",
    "agent_timeout_s": "MIZZEN_HARBOR_AGENT_TIMEOUT_S",
    "verifier_timeout_s": "MIZZEN_HARBOR_VERIFIER_TIMEOUT_S",
    "max_iterations": "MIZZEN_HARBOR_MAX_ITERATIONS",
    "response_too_long": "MIZZEN_HARBOR_RESPONSE_TOO_LONG",
    "reward_key": "MIZZEN_HARBOR_REWARD_KEY",
    "engine_api_key_var": "MIZZEN_HARBOR_ENGINE_API_KEY_VAR",
    "environment_kwargs": "MIZZEN_HARBOR_ENVIRONMENT_KWARGS",
    "agent_kwargs": "MIZZEN_HARBOR_AGENT_KWARGS",
    "keep_sandbox": "MIZZEN_HARBOR_KEEP_SANDBOX",
}


@masked_repr
@dataclass(repr=False)
class HarborSettings:
    """How every trial of a run is configured (see `ENV_VARS` for the variables).

    Fields:
        tasks_dir: root of the Harbor tasks; a sample's instance id names a directory in it.
        trials_dir: where trial directories (logs, results) are written.
        model_name: the model name the engine serves (what agents put in their requests).
        agent: the harness (`harnesses.HARNESSES`), default terminus-2.
        environment_type / environment_import_path: exactly one; a Harbor `EnvironmentType`
            value, or `module:Class` of a custom `BaseEnvironment` (e.g. the local sandbox).
        trial_timeout_s: wall-clock limit of one whole trial (setup + agent + verifier).
        agent_timeout_s / verifier_timeout_s: override the task's own limits (optional).
        max_iterations: agent turn limit; 0 means zero turns (optional).
        response_too_long: `abort` (default) or `recover`; see `harnesses` for why abort.
        reward_key: the verifier reward to use (default `reward`, else the first one).
        engine_api_key_var: NAME of the worker variable holding the engine's API key (optional).
        environment_kwargs / agent_kwargs: extra kwargs for Harbor's environment / agent.
        keep_sandbox: keep the sandbox after the trial (debugging); default delete.
    """

    tasks_dir: Path
    trials_dir: Path
    model_name: str
    agent: str = "terminus-2"
    environment_type: str | None = None
    environment_import_path: str | None = None
    trial_timeout_s: float = 3600.0
    agent_timeout_s: float | None = None
    verifier_timeout_s: float | None = None
    max_iterations: int | None = None
    response_too_long: str = "abort"
    reward_key: str = DEFAULT_REWARD_KEY
    engine_api_key_var: str | None = None
    environment_kwargs: dict[str, Any] = field(default_factory=dict)
    agent_kwargs: dict[str, Any] = field(default_factory=dict)
    keep_sandbox: bool = False

    def __repr__(self) -> str:
        shown_fields = ", ".join(
            f"{item.name}={redact_value(getattr(self, item.name))!r}" for item in fields(self)
        )
        return f"HarborSettings({shown_fields})"

    # --------------------------------------------------------------------------- validation

    def validate(self, *, create_trials_dir: bool = False) -> HarborSettings:
        """Normalise and check every field; raise HarborConfigError naming the variable."""
        self.tasks_dir = Path(self.tasks_dir).expanduser().resolve()
        if not self.tasks_dir.is_dir():
            raise _error(
                "tasks_dir",
                f"{self.tasks_dir} is not a directory",
                "point it at the directory holding one sub-directory per Harbor task",
            )
        self.trials_dir = Path(self.trials_dir).expanduser().resolve()
        self._check_trials_dir(create_trials_dir)
        if not isinstance(self.model_name, str) or not self.model_name.strip():
            raise _error("model_name", "is empty", "set the model name the engine serves")
        self.model_name = self.model_name.strip()
        self._validate_environment()
        self.response_too_long = str(self.response_too_long).strip().lower()
        if self.response_too_long not in RESPONSE_TOO_LONG_POLICIES:
            raise _error(
                "response_too_long",
                f"is {self.response_too_long!r}",
                f"use one of {list(RESPONSE_TOO_LONG_POLICIES)}",
            )
        self._validate_agent()
        self.trial_timeout_s = _positive("trial_timeout_s", self.trial_timeout_s)
        for name in ("agent_timeout_s", "verifier_timeout_s"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, _positive(name, value))
        if self.max_iterations is not None:
            if isinstance(self.max_iterations, bool) or not isinstance(self.max_iterations, int):
                raise _error("max_iterations", f"is {shown(self.max_iterations)}", "use an integer")
            if self.max_iterations < 0:
                raise _error(
                    "max_iterations",
                    f"is {self.max_iterations}",
                    "use 0 (no turns) or a positive limit; leave unset for none",
                )
        if not self.reward_key or not isinstance(self.reward_key, str):
            raise _error("reward_key", "is empty", f"use a reward name, e.g. {DEFAULT_REWARD_KEY}")
        if self.engine_api_key_var is not None:
            check_key_variable_name(self.engine_api_key_var)
        self.check_no_credentials()
        return self

    def check_no_credentials(self) -> None:
        """Raise ProviderCredentialError if `agent_kwargs` / `environment_kwargs` are not JSON
        objects free of credentials, or any text or path setting (`model_name`, `reward_key`,
        `tasks_dir`, ...) has a credential shape (see the module docstring); the message shows
        where, never the value."""
        for name in _KWARGS:
            value = getattr(self, name)
            if not isinstance(value, dict):
                raise _error(name, "is not a mapping", "use a JSON object")
            refuse_kwargs_credentials(name, value)
        for item in fields(self):
            value = getattr(self, item.name)
            shape = credential_shape(str(value)) if isinstance(value, str | Path) else None
            if shape:
                raise ProviderCredentialError(
                    f"{ENV_VARS[item.name]} ({item.name}) carries credentials ({shape}); fix: "
                    "settings reach the workers in plain text: give only the "
                    f"{item.name.replace('_', ' ')} there, and keys through their own paths "
                    "(engine_api_key_var, provider key variables or key files)"
                )

    def _check_trials_dir(self, create: bool) -> None:
        if self.trials_dir.exists() and not self.trials_dir.is_dir():
            raise _error(
                "trials_dir",
                f"{self.trials_dir} exists and is not a directory",
                "point it at a directory (it is created when missing)",
            )
        if create:
            try:
                self.trials_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise _error(
                    "trials_dir",
                    f"cannot create {self.trials_dir} ({exc.strerror})",
                    "choose a writable location",
                ) from None
        else:
            probe = self.trials_dir
            while not probe.exists():
                probe = probe.parent
            if not os.access(probe, os.W_OK):
                raise _error(
                    "trials_dir",
                    f"{self.trials_dir} cannot be created under {probe} (not writable)",
                    "choose a writable location",
                )

    def _validate_environment(self) -> None:
        if self.environment_type is not None:
            self.environment_type = normalize_environment_type(self.environment_type)
        if self.environment_import_path is not None:
            self.environment_import_path = self.environment_import_path.strip()
            if not _IMPORT_PATH.fullmatch(self.environment_import_path):
                raise _error(
                    "environment_import_path",
                    f"is {shown(self.environment_import_path)}",
                    "use 'package.module:ClassName' of a Harbor BaseEnvironment",
                )
        if (self.environment_type is None) == (self.environment_import_path is None):
            raise HarborConfigError(
                f"set exactly one of {ENV_VARS['environment_type']} (a Harbor environment type, "
                f"e.g. docker, daytona) and {ENV_VARS['environment_import_path']} (module:Class "
                "of a custom environment, e.g. the local sandbox "
                "mizzen_rollout.harbor.local_environment:LocalSandboxEnvironment)"
            )

    def _validate_agent(self) -> None:
        from mizzen_rollout.harbor.harnesses import harness

        self.agent = str(self.agent).strip().lower()
        spec = harness(self.agent)  # raises with the list of harnesses
        if self.response_too_long not in spec.too_long_policies:
            raise _error(
                "response_too_long",
                f"{self.response_too_long!r} is not supported by {spec.name} "
                f"(supported: {sorted(spec.too_long_policies)})",
                spec.too_long_note,
            )

    @property
    def provider(self) -> str | None:
        """The sandbox provider whose credentials the workers need (None for custom imports)."""
        return self.environment_type

    # ----------------------------------------------------------------------- (de)serialising

    def to_env(self) -> dict[str, str]:
        """The worker variables; optional knobs only when set (0 counts as set). Refuses
        credentials (`check_no_credentials`) even if `validate` was skipped."""
        self.check_no_credentials()
        env: dict[str, str] = {}
        for item in fields(self):
            value = getattr(self, item.name)
            if value is None or (isinstance(value, dict) and not value):
                continue
            if item.name == "keep_sandbox" and not value:
                continue
            if isinstance(value, dict):
                text = _kwargs_text(item.name, value)
            elif isinstance(value, bool):
                text = "1" if value else "0"
            else:
                text = str(value)
            env[ENV_VARS[item.name]] = text
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> HarborSettings:
        """Read and validate the settings from the worker environment."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, variable in ENV_VARS.items():
            raw = env.get(variable)
            if raw is None or raw == "":
                continue
            values[name] = _parse(name, variable, raw)
        missing = [
            ENV_VARS[n] for n in ("tasks_dir", "trials_dir", "model_name") if n not in values
        ]
        if missing:
            raise HarborConfigError(
                f"the Harbor agent function needs {missing} in the worker environment; start "
                "the run with the variables from mizzen_rollout.harbor.harbor_env_vars(...)"
            )
        return cls(**values).validate()


def check_key_variable_name(name: object) -> None:
    """Raise ProviderCredentialError unless `name` reads as an environment variable name rather
    than a key (see the module docstring); the value is registered and never repeated."""
    problem = ""
    if not isinstance(name, str) or not _VARIABLE_NAME.fullmatch(name):
        problem = "is not an UPPER_CASE variable name"
    elif any(
        len(word) > _MAX_NAME_WORD or sum(c.isdigit() for c in word) > _MAX_NAME_DIGITS
        for word in name.split("_")
    ):
        problem = "looks like a key (a long or digit-heavy word), not a variable name"
    elif mask(name) != name or name in {v.strip() for v in environment_secrets().values()}:
        problem = "is the value of a key, not the name of the variable holding it"
    if problem:
        if isinstance(name, str):
            register_candidate(name, "engine_api_key_var")
        raise ProviderCredentialError(
            f"{ENV_VARS['engine_api_key_var']} (engine_api_key_var): {problem} (its value is not "
            "repeated); fix: give the NAME of the variable holding the engine key on the "
            "workers, e.g. MIZZEN_ENGINE_KEY, never the key"
        )


def normalize_environment_type(raw: str) -> str:
    """Strip and lower-case `raw` and check it against Harbor's own `EnvironmentType`."""
    try:
        from harbor.models.environment_type import EnvironmentType
    except ImportError:
        raise HarborConfigError(
            "checking the environment type needs harbor: install mizzen-rollout[harbor]"
        ) from None
    value = str(raw).strip().lower()
    valid = [member.value for member in EnvironmentType]
    if value not in valid:
        raise _error(
            "environment_type",
            f"{shown(raw)} is not a Harbor environment type",
            f"use one of {valid}, or an environment import path",
        )
    return value


def _error(name: str, problem: str, fix: str) -> HarborConfigError:
    return HarborConfigError(f"{ENV_VARS[name]} ({name}): {problem}; fix: {fix}")


def _positive(name: str, value: Any) -> float:
    number: float | None
    try:
        number = float(value)
    except (TypeError, ValueError):  # the error text repeats the value: raised outside
        number = None
    if number is None:
        raise _error(name, f"is {shown(value)}, not a number", "use a positive number of seconds")
    if not number > 0 or number == float("inf"):
        raise _error(name, f"is {shown(value)}", "use a positive, finite number of seconds")
    return number


def _parse(name: str, variable: str, raw: str) -> Any:
    if name in _KWARGS:
        return _parse_kwargs(name, variable, raw)
    problem = ""
    try:
        if name in ("tasks_dir", "trials_dir"):
            return Path(raw)
        if name in ("trial_timeout_s", "agent_timeout_s", "verifier_timeout_s"):
            return float(raw)
        if name == "max_iterations":
            return int(raw)
        if name == "keep_sandbox":
            return raw.strip().lower() in ("1", "true", "yes")
    except ValueError:
        problem = f"cannot parse {shown(raw)}"
    if problem:  # raised outside the except, so no exception holding `raw` is chained
        raise HarborConfigError(
            f"{variable} ({name}): {problem}; fix: write it as "
            f"mizzen_rollout.harbor.harbor_env_vars(...) does"
        )
    return raw


def _parse_kwargs(name: str, variable: str, raw: str) -> Any:
    """The kwargs JSON of `raw`, bounded before decoding (a 100k-deep `[[[...` would otherwise
    exhaust the decoder's recursion); the error never repeats `raw`."""
    value, problem = loads_bounded(raw, max_chars=MAX_KWARGS_CHARS, max_depth=_MAX_KWARGS_DEPTH + 1)
    if problem:
        raise HarborConfigError(
            f"{variable} ({name}): {problem} (its value is not repeated); rule: a JSON object of "
            f"at most {MAX_KWARGS_CHARS} characters, brackets nested at most "
            f"{_MAX_KWARGS_DEPTH + 1} deep (the object and {_MAX_KWARGS_DEPTH} levels below it); "
            "fix: write it as mizzen_rollout.harbor.harbor_env_vars(...) does, "
            "and pass bulky agent or environment inputs as files in the task, not in kwargs"
        )
    return value


def _kwargs_text(name: str, value: dict[str, Any]) -> str:
    text = json.dumps(value, sort_keys=True)
    if len(text) > MAX_KWARGS_CHARS:
        raise _error(
            name,
            f"is {len(text)} characters as JSON, over the limit of {MAX_KWARGS_CHARS} (the "
            "most one worker variable can carry)",
            "pass bulky agent or environment inputs as files in the task rather than in kwargs",
        )
    return text


_KWARGS_FIX = (
    "credentials never travel in kwargs (worker variables and Harbor's config.json are plain "
    "text, and Harbor does not resolve ${VAR} there): give the engine key by variable name "
    "through MIZZEN_HARBOR_ENGINE_API_KEY_VAR (engine_api_key_var), provider keys through their "
    "key variables or key files (see mizzen_rollout.harbor.credentials); numbers and booleans "
    "under such names (max_tokens) are fine"
)


def _key_shown(name: str) -> str:
    return "***" if credential_shape(name) else shown(name, limit=60).strip("'\"")


def refuse_kwargs_credentials(name: str, values: Mapping[str, Any]) -> None:
    """Raise ProviderCredentialError naming `ENV_VARS[name]` if `values` hold a credential."""
    problems = kwargs_credential_problems(values)
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ProviderCredentialError(
            f"{ENV_VARS[name]} ({name}) carries credentials: {'; '.join(problems[:5])}{more}. "
            f"fix: {_KWARGS_FIX}"
        )


def kwargs_credential_problems(values: Mapping[str, Any]) -> list[str]:
    """Where `values` (kwargs, at any depth) hold a credential or something not JSON, one line
    each (the path and the rule, never the value); empty when they may be forwarded."""
    problems: list[str] = []
    _walk(values, "", None, problems, 0)
    return problems


def _walk(value: Any, path: str, under: str | None, problems: list[str], depth: int) -> None:
    where = path or "(top level)"
    if depth > _MAX_KWARGS_DEPTH:
        problems.append(f"{where}: nested deeper than {_MAX_KWARGS_DEPTH} levels")
        return
    if isinstance(value, Mapping):
        if under is not None and value:
            problems.append(
                f"{where} holds a mapping under the password-like name {_key_shown(under)!r} "
                "(its keys are text)"
            )
            _register_texts(value)
            return
        beside = _name_beside(value)
        for key, item in value.items():
            if not isinstance(key, str):
                problems.append(f"{where}: a key of type {type(key).__name__} (JSON keys are text)")
                continue
            here = f"{path}.{_key_shown(key)}" if path else _key_shown(key)
            if not normalize(key).isascii():
                problems.append(
                    f"{here}: the key is not ASCII after NFKC (a look-alike could hide a "
                    "password-like name); spell it in ASCII"
                )
            elif credential_shape(key):
                problems.append(f"{here}: the key itself is {credential_shape(key)}")
            sensitive = under or (key if is_sensitive_name(key) else None)
            if sensitive is None and beside is not None and key not in _NAMING_FIELDS:
                sensitive = beside
            _walk(item, here, sensitive, problems, depth + 1)
    elif isinstance(value, list | tuple):
        named: str | None = None
        for index, item in enumerate(value):
            _walk(item, f"{path}[{index}]", under or named, problems, depth + 1)
            named = _name_before(value, index)
    elif isinstance(value, str):
        if under is not None and value:
            register_candidate(value, "a kwargs value under a password-like name")
            kind = "a ${VAR} template" if is_template(value) else "a literal credential"
            problems.append(
                f"{where} holds {kind} (text under the password-like name {_key_shown(under)!r})"
            )
        elif credential_shape(value):
            problems.append(f"{where} holds {credential_shape(value)}")
            register_candidate(value, "a credential-shaped kwargs value")
    elif not (value is None or isinstance(value, bool | int | float)):
        problems.append(f"{where}: a {type(value).__name__} is not a JSON value")


def _is_name_item(value: object) -> bool:
    return (
        isinstance(value, str)
        and bool(_NAME_ITEM.fullmatch(normalize(value)))
        and is_sensitive_name(value)
    )


def _name_beside(mapping: Mapping[Any, Any]) -> str | None:
    """The password-like name a mapping's naming field gives its other fields, or None."""
    for key in _NAMING_FIELDS & {k for k in mapping if isinstance(k, str)}:
        if _is_name_item(mapping[key]):
            return str(mapping[key])
    return None


def _name_before(items: list[Any] | tuple[Any, ...], index: int) -> str | None:
    """The password-like name item `index` gives item `index + 1`: a `--flag`, or the first
    item of a pair."""
    item = items[index]
    if not _is_name_item(item):
        return None
    if str(item).startswith("-") or (len(items) == 2 and index == 0):
        return str(item)
    return None


def _register_texts(value: Any) -> None:
    """Register every text (mapping keys too) below a password-like name."""
    if isinstance(value, str):
        register_candidate(value, "a kwargs value under a password-like name")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _register_texts(key)
            _register_texts(item)
    elif isinstance(value, list | tuple):
        for item in value:
            _register_texts(item)
