"""The rollout agent function: one sample = one Harbor trial, run in-process in the worker.

    outcome = await run(base_url, prompt, sampling_params, metadata)   # or run_sync(...)

`base_url` is the engine's OpenAI-compatible endpoint (e.g. `mizzen-rollout serve`'s
`http://127.0.0.1:PORT/v1`); `sampling_params` a mapping or the rollout's `SamplingParams`
(see `harnesses.normalize_sampling_params`); `metadata["instance_id"]` names the task
directory under `MIZZEN_HARBOR_TASKS_DIR`. The run settings come from the worker environment written by
`launcher.harbor_env_vars`. The returned dict is the sample metadata described in `outcome`
(`reward`, `exit_status`, tokens, cost, turns, phase timings, `tool_time_s`, ...).

Invariants:
- Configuration errors raise `HarborConfigError` (missing or invalid settings, bad instance id,
  sampling parameters the harness cannot forward, missing provider key, a trial Harbor refuses to
  create): a loud stop beats training on silent zero rewards.
- Once the trial exists, nothing raises: a failed trial or one past its wall-clock limit
  (`MIZZEN_HARBOR_TRIAL_TIMEOUT_S`) gives reward 0.0 with its exit status. On timeout the trial is
  cancelled (Harbor records it and tears the sandbox down) within `CANCEL_GRACE_S`.
  What the trial wrote is read bounded (`outcome.trial_outcome`): a malformed trajectory or a
  reward that is not a finite number becomes `warnings` / an `InvalidReward` error, never a raise.
- `prompt` is not sent anywhere: Harbor agents build their own prompt from the task's
  instruction.md and what they observe in the sandbox; the sample's prompt is that instruction.
- Provider keys are resolved on the worker into this process's environment only (never into the
  trial config, logs or metadata); the worker's provider address variables and the sample's
  `base_url` are checked like the launcher's (`addresses.check_address`). Harbor's error texts
  reach our errors and the metadata only through `redaction.redact_text`. LiteLLM's model-cost map is read from its bundled copy
  (`LITELLM_LOCAL_MODEL_COST_MAP`, unless already set) so no worker fetches it from the network.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mizzen_rollout.harbor.credentials import PROVIDER_SPECS, export_provider_credentials
from mizzen_rollout.harbor.errors import HarborConfigError
from mizzen_rollout.harbor.outcome import trial_outcome
from mizzen_rollout.harbor.redaction import redact_text
from mizzen_rollout.harbor.settings import HarborSettings
from mizzen_rollout.harbor.task_ids import instance_id_from_metadata
from mizzen_rollout.harbor.trial_config import build_trial_config

#: how long a timed-out trial gets to record its result and stop its sandbox
CANCEL_GRACE_S = 60.0


async def run(
    base_url: str,
    prompt: Any,
    sampling_params: Mapping[str, Any] | Any | None,
    metadata: Mapping[str, Any] | None,
    *,
    settings: HarborSettings | None = None,
) -> dict[str, Any]:
    """Run one Harbor trial for a sample and return its metadata (see the module docstring)."""
    del prompt  # the task's instruction is the prompt; see the module docstring
    settings = settings.validate() if settings is not None else HarborSettings.from_env()
    instance_id = instance_id_from_metadata(metadata)
    if settings.provider in PROVIDER_SPECS:
        export_provider_credentials(settings.provider)
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

    config, setup = build_trial_config(
        settings,
        instance_id=instance_id,
        base_url=base_url,
        sampling_params=sampling_params,
    )
    from harbor.trial.trial import Trial

    refusal = ""
    try:
        trial = await Trial.create(config)
    except Exception as exc:  # Harbor refused the configuration (task, agent or environment)
        refusal = f"{type(exc).__name__}: {redact_text(str(exc))}"
    if refusal:  # raised outside the except: Harbor's exception (its text, its chain) stays here
        raise HarborConfigError(
            f"Harbor could not create the trial for {instance_id!r} ({refusal}); fix: correct the "
            "task, agent or environment settings it names"
        )

    trial_dir = Path(config.trials_dir) / config.trial_name
    task = asyncio.ensure_future(trial.run())
    done, _ = await asyncio.wait({task}, timeout=settings.trial_timeout_s)
    timed_out = not done
    if timed_out:
        task.cancel()
        await asyncio.wait({task}, timeout=CANCEL_GRACE_S)
    if task.done() and not task.cancelled() and task.exception() is not None:
        # Trial.run records failures itself; an escape here is a Harbor bug, not a reward of 0.
        raise task.exception()  # type: ignore[misc]
    return trial_outcome(
        trial.result,
        reward_key=settings.reward_key,
        timed_out=timed_out,
        trial_dir=trial_dir,
        harness=setup.harness,
        substituted_for=setup.substituted_for,
    )


def run_sync(
    base_url: str,
    prompt: Any,
    sampling_params: Mapping[str, Any] | Any | None,
    metadata: Mapping[str, Any] | None,
    *,
    settings: HarborSettings | None = None,
) -> dict[str, Any]:
    """`run` for callers without an event loop (scripts, thread pools)."""
    return asyncio.run(run(base_url, prompt, sampling_params, metadata, settings=settings))
