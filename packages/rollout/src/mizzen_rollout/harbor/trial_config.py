"""Building one trial's Harbor `TrialConfig` from the run settings and one sample.

Invariants:
- The result is a real, validated `harbor.models.trial.config.TrialConfig` (Harbor is imported
  here, lazily); any Harbor validation error becomes a HarborConfigError naming the field.
- The task comes only from `task_ids.resolve_task_dir` (strict id, inside the tasks root).
- The agent points at the engine endpoint `base_url` with the sample's sampling parameters, as
  `harnesses.agent_setup` derives them. `base_url` passes `addresses.check_address` (kind `url`)
  first: a userinfo, `;params`, query or fragment is refused (ProviderCredentialError, showing
  only the redacted URL), as is a malformed host or port. The engine key, if any, is referenced
  as `${VAR}` in `AgentConfig.env` (Harbor resolves it in-process), so no secret is ever part of
  a config Harbor writes to disk (config.json) or of its `repr()`.
- The agent kwargs as merged (derived + `agent_kwargs`) and the environment kwargs are checked
  once more with `settings.refuse_kwargs_credentials`, whatever the settings object went
  through before.
- A Harbor validation error is reported by field location and message only (pydantic's own text
  repeats the input values), and raised outside the `except` block.
- Optional limits (agent/verifier timeouts, max_iterations) are applied only when set.
- Before anything else, the credentials `base_url` carries and the engine key (the value of
  `engine_api_key_var` in this worker's environment) are registered in the process-wide mask set
  (`mizzen_rollout.masking`), so no output of this process shows them; one that cannot be
  (shorter than `masking.MIN_SECRET_LENGTH`) is a ProviderCredentialError.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from mizzen_rollout.harbor.addresses import check_address
from mizzen_rollout.harbor.errors import HarborConfigError, ProviderCredentialError
from mizzen_rollout.harbor.harnesses import AgentSetup, agent_setup, merge_agent_kwargs
from mizzen_rollout.harbor.settings import ENV_VARS, HarborSettings, refuse_kwargs_credentials
from mizzen_rollout.harbor.task_ids import resolve_task_dir
from mizzen_rollout.masking import SecretError, register_secret, register_url

if TYPE_CHECKING:
    from harbor.models.trial.config import TrialConfig

#: the placeholder key sent when the engine needs none (OpenAI clients refuse an empty key)
NO_ENGINE_KEY = "mizzen-no-key"
ENGINE_KEY_VAR = "MIZZEN_ENGINE_API_KEY"
BASE_URL_FIX = (
    "base_url is written into Harbor's config.json and its logs, so pass the engine's "
    "OpenAI-compatible endpoint alone, http(s)://host[:port][/path] (e.g. "
    "http://127.0.0.1:30000/v1), and its key by variable name through "
    f"{ENV_VARS['engine_api_key_var']} (engine_api_key_var)"
)


def check_base_url(base_url: object) -> str:
    """`base_url` if it is a credential-free http(s) endpoint; else ProviderCredentialError."""
    return check_address(
        base_url,
        kind="url",
        field="base_url (the engine endpoint given to the agent function)",
        fix=BASE_URL_FIX,
    )


def register_engine_secrets(settings: HarborSettings, base_url: object) -> None:
    """Register the credentials of `base_url` and the engine key (see the module docstring)."""
    problem = ""
    try:
        if base_url is not None:
            register_url(str(base_url), source="base_url")
        key_var = settings.engine_api_key_var
        if key_var and os.environ.get(key_var, "").strip():
            register_secret(os.environ[key_var].strip(), source=f"the engine key ({key_var})")
    except SecretError as exc:
        problem = str(exc)
    if problem:  # raised outside the except: nothing chained
        raise ProviderCredentialError(problem)


def build_trial_config(
    settings: HarborSettings,
    *,
    instance_id: str,
    base_url: str,
    sampling_params: Any,
) -> tuple[TrialConfig, AgentSetup]:
    """The `TrialConfig` for one sample, and the agent setup it was derived from."""
    from harbor.models.trial.config import (
        AgentConfig,
        EnvironmentConfig,
        TaskConfig,
        TrialConfig,
        VerifierConfig,
    )
    from pydantic import ValidationError

    register_engine_secrets(settings, base_url)
    task_dir = resolve_task_dir(settings.tasks_dir, instance_id)
    setup = agent_setup(
        settings.agent,
        model_name=settings.model_name,
        sampling_params=sampling_params,
        max_iterations=settings.max_iterations,
        response_too_long=settings.response_too_long,
    )
    if base_url is not None or setup.model_name is not None:
        base_url = check_base_url(base_url)
    if setup.substituted_for is None:
        merge_agent_kwargs(setup, settings.agent_kwargs)
    refuse_kwargs_credentials("agent_kwargs", setup.kwargs)
    refuse_kwargs_credentials("environment_kwargs", settings.environment_kwargs)

    agent_fields: dict[str, Any] = {
        "name": setup.name,
        "import_path": setup.import_path,
        "kwargs": setup.kwargs,
    }
    env = dict(setup.env)
    if setup.model_name is not None:
        key_var = settings.engine_api_key_var
        env[ENGINE_KEY_VAR] = f"${{{key_var}}}" if key_var else NO_ENGINE_KEY
        agent_fields.update(
            model_name=setup.model_name,
            base_url=base_url,
            model_api_key_name=ENGINE_KEY_VAR,
            model_api_format=setup.model_api_format,
        )
    if env:
        agent_fields["env"] = env
    if settings.agent_timeout_s is not None:
        agent_fields["override_timeout_sec"] = settings.agent_timeout_s

    environment_fields: dict[str, Any] = {
        "kwargs": dict(settings.environment_kwargs),
        "delete": not settings.keep_sandbox,
    }
    if settings.environment_import_path is not None:
        environment_fields["import_path"] = settings.environment_import_path
    else:
        environment_fields["type"] = settings.environment_type

    verifier_fields: dict[str, Any] = {}
    if settings.verifier_timeout_s is not None:
        verifier_fields["override_timeout_sec"] = settings.verifier_timeout_s

    problems: list[str] = []
    try:
        config = TrialConfig(
            task=TaskConfig(path=task_dir),
            trials_dir=settings.trials_dir,
            agent=AgentConfig(**agent_fields),
            environment=EnvironmentConfig(**environment_fields),
            verifier=VerifierConfig(**verifier_fields),
        )
    except ValidationError as exc:  # its text repeats the input values: locations and rules only
        problems = [
            f"{'.'.join(str(part) for part in error['loc']) or '(top level)'}: {error['msg']}"
            for error in exc.errors(include_input=False, include_url=False, include_context=False)
        ]
    if problems:
        raise HarborConfigError(
            f"the trial configuration for {instance_id!r} does not validate as a Harbor "
            f"TrialConfig: {'; '.join(problems)}; fix: correct the settings named there"
        )
    return config, setup
