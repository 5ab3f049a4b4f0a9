"""Harbor agents in the rollout: each sample runs as an in-process Harbor trial.

Modules (one concern each):
- `redaction`: what may be shown — the one redaction of URL-like values (`redact_url`), of free
  text, of kwargs-like structures, and the password-like name rule; every message, `repr()`, log
  line and serialised value that may hold a secret goes through it.
- `addresses`: endpoint values we forward (provider address variables, the engine `base_url`):
  `scheme://host[:port][/path]` only, checked before anything is forwarded.
- `errors`: `HarborConfigError` and `ProviderCredentialError` (the one type of credential error).
- `credentials`: sandbox-provider keys — provisioned on the launcher (file paths forwarded, never
  values), resolved on the workers.
- `settings`: the run settings and the one table of worker environment variables carrying them.
- `launcher`: `harbor_env_vars(...)`, the checked worker environment for a run.
- `task_ids`: instance id -> task directory, strictly inside the tasks root.
- `harnesses`: the harness table (terminus-2, claude-code, opencode, mini-swe-agent, oracle, nop):
  sampling parameters, iteration limits, response-too-long policy.
- `trial_config`: one sample -> a validated Harbor `TrialConfig`.
- `outcome`: a `TrialResult` -> sample metadata (reward, exit status, tokens, timings).
- `agent`: `run(base_url, prompt, sampling_params, metadata) -> dict`, the agent function.
- `namespace_sandbox` / `local_environment`: a root-only local sandbox (overlay + namespaces)
  loadable by Harbor through `LOCAL_ENVIRONMENT_IMPORT_PATH`.
- `__main__`: `python -m mizzen_rollout.harbor run-trial ...`, one trial from the command line.

Invariants: importing any of these modules imports no harbor, torch, ray or transformers; Harbor
is imported inside the functions that need it (and the local environment class is built on first
access). No secret (provider key, engine key, password in a URL) reaches a log line, an error, a
`repr()`, a worker variable or a config Harbor writes: keys travel by file path or variable name,
credentials anywhere else are refused, and what is shown goes through `redaction`.
"""

from mizzen_rollout.harbor.agent import run, run_sync
from mizzen_rollout.harbor.credentials import (
    PROVIDER_SPECS,
    ProviderSpec,
    provision_provider,
    resolve_provider_credentials,
)
from mizzen_rollout.harbor.errors import HarborConfigError, ProviderCredentialError
from mizzen_rollout.harbor.launcher import harbor_env_vars
from mizzen_rollout.harbor.local_environment import LOCAL_ENVIRONMENT_IMPORT_PATH
from mizzen_rollout.harbor.outcome import ExitStatus
from mizzen_rollout.harbor.settings import HarborSettings

__all__ = [
    "LOCAL_ENVIRONMENT_IMPORT_PATH",
    "PROVIDER_SPECS",
    "ExitStatus",
    "HarborConfigError",
    "HarborSettings",
    "ProviderCredentialError",
    "ProviderSpec",
    "harbor_env_vars",
    "provision_provider",
    "resolve_provider_credentials",
    "run",
    "run_sync",
]
