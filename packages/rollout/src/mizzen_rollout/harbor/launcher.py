"""Launcher side: the environment variables the rollout workers need to run Harbor trials.

    env = harbor_env_vars(tasks_dir=..., trials_dir=..., model_name=..., environment_type="daytona")
    # -> pass `env` to the workers (e.g. Ray runtime_env={"env_vars": env})

Invariants:
- Everything is checked here, before any worker starts: the environment type (stripped,
  lower-cased, one of Harbor's own `EnvironmentType` values) or a custom environment import path
  (importable, a Harbor `BaseEnvironment`); the tasks directory exists; the trials directory is
  created; the model name is non-empty; timeouts are positive; the harness and the
  response-too-long policy go together.
- Known providers (`credentials.PROVIDER_SPECS`) are provisioned: the result carries their key
  FILE path and checked, credential-free address variables, never a key; `agent_kwargs` and
  `environment_kwargs` carry no credential (`HarborSettings.check_no_credentials`). Unknown environment types are
  passed through with a printed notice (their credentials are the operator's business).
- Optional knobs appear in the result only when set (`max_iterations=0` is set).
- The result carries no registered secret (`masking.check_worker_env`, by variable name), and
  every printed line goes through `masking.mask`.
- Importable and usable without torch or ray; Harbor is imported lazily (environment checks).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from mizzen_rollout.harbor.credentials import PROVIDER_SPECS, provision_provider
from mizzen_rollout.harbor.errors import HarborConfigError, ProviderCredentialError
from mizzen_rollout.harbor.redaction import redact_text
from mizzen_rollout.harbor.settings import HarborSettings
from mizzen_rollout.masking import SecretError, check_worker_env, mask


def check_environment_import_path(import_path: str) -> None:
    """Import `module:Class` and check it is a Harbor `BaseEnvironment` subclass."""
    from harbor.environments.base import BaseEnvironment

    module_name, _, class_name = import_path.partition(":")
    environment_class: Any = None
    failure = ""
    try:
        module = importlib.import_module(module_name)
        environment_class = getattr(module, class_name)
    except (ImportError, AttributeError) as exc:
        failure = redact_text(str(exc))
    if failure:  # raised outside the except: no chained exception
        raise HarborConfigError(
            f"MIZZEN_HARBOR_ENVIRONMENT_IMPORT_PATH: cannot import {import_path!r} ({failure}); "
            "fix: use 'package.module:ClassName' importable on the launcher and the workers"
        )
    if not (isinstance(environment_class, type) and issubclass(environment_class, BaseEnvironment)):
        raise HarborConfigError(
            f"MIZZEN_HARBOR_ENVIRONMENT_IMPORT_PATH: {import_path!r} is not a Harbor "
            "BaseEnvironment subclass; fix: point it at an environment class"
        )


def harbor_env_vars(
    *,
    tasks_dir: str | Path,
    trials_dir: str | Path,
    model_name: str,
    environment_type: str | None = None,
    environment_import_path: str | None = None,
    agent: str = "terminus-2",
    trial_timeout_s: float = 3600.0,
    agent_timeout_s: float | None = None,
    verifier_timeout_s: float | None = None,
    max_iterations: int | None = None,
    response_too_long: str = "abort",
    reward_key: str | None = None,
    engine_api_key_var: str | None = None,
    environment_kwargs: Mapping[str, Any] | None = None,
    agent_kwargs: Mapping[str, Any] | None = None,
    keep_sandbox: bool = False,
    environ: Mapping[str, str] | None = None,
    echo: Callable[[str], None] = print,
) -> dict[str, str]:
    """Validate a Harbor run's configuration and return the workers' environment variables."""
    shown_echo = echo

    def echo(line: str) -> None:
        shown_echo(mask(line))

    settings = HarborSettings(
        tasks_dir=Path(tasks_dir),
        trials_dir=Path(trials_dir),
        model_name=model_name,
        agent=agent,
        environment_type=environment_type,
        environment_import_path=environment_import_path,
        trial_timeout_s=trial_timeout_s,
        agent_timeout_s=agent_timeout_s,
        verifier_timeout_s=verifier_timeout_s,
        max_iterations=max_iterations,
        response_too_long=response_too_long,
        engine_api_key_var=engine_api_key_var,
        environment_kwargs=dict(environment_kwargs or {}),
        agent_kwargs=dict(agent_kwargs or {}),
        keep_sandbox=keep_sandbox,
    )
    if reward_key is not None:
        settings.reward_key = reward_key
    settings.validate(create_trials_dir=True)

    env = settings.to_env()
    if settings.environment_import_path is not None:
        check_environment_import_path(settings.environment_import_path)
        echo(f"[mizzen-harbor] environment: custom {settings.environment_import_path}")
    elif settings.environment_type in PROVIDER_SPECS:
        env.update(provision_provider(settings.environment_type, environ, echo=echo))
    else:
        echo(
            f"[mizzen-harbor] environment: {settings.environment_type} has no credential spec "
            "in mizzen; passing it through unchanged. Make sure every worker has whatever it "
            "needs (daemon access, cloud credentials)."
        )
    problem = ""
    try:
        check_worker_env(env, where="harbor_env_vars")
    except SecretError as exc:
        problem = str(exc)
    if problem:
        raise ProviderCredentialError(problem)
    return env
