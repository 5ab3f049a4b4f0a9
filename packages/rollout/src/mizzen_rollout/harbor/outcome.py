"""Turning a finished (or abandoned) Harbor trial into sample metadata.

Invariants:
- Every outcome has a float `reward` and an `exit_status` from `ExitStatus`. Only a `submitted`
  trial keeps its verifier reward; time limits, sequence-length aborts and errors give 0.0 (the
  verifier's own number, if any, stays visible as `verifier_reward`).
- Reward selection: the named reward key, else the first reward the verifier wrote, else 0.0.
- Exit status is derived from Harbor's recorded exception type names (`SEQUENCE_LENGTH_ERRORS`,
  `TIME_LIMIT_ERRORS`; contract-tested against Harbor's own error-policy table) or from our
  wall-clock timeout; anything else that went wrong is `agent_error`.
- Only `TrialResult` fields listed in `TRIAL_RESULT_FIELDS_READ` are read (contract-tested, so a
  rename in Harbor fails a test instead of silently dropping data). Missing data is `None`, never
  a made-up number.
- Text that leaves here (error messages) is scrubbed of secret values.
"""

from __future__ import annotations

import enum
import json
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mizzen_rollout.harbor.redaction import redact_text
from mizzen_rollout.harbor.terminus_abort import RESPONSE_LENGTH_ERROR

if TYPE_CHECKING:
    from harbor.models.trial.result import TimingInfo, TrialResult

_MAX_ERROR_CHARS = 2000


class ExitStatus(enum.StrEnum):
    SUBMITTED = "submitted"
    TIME_LIMIT_EXCEEDED = "time_limit_exceeded"
    SEQUENCE_LENGTH_EXCEEDED = "sequence_length_exceeded"
    AGENT_ERROR = "agent_error"


#: Harbor's names, plus ours for a truncated reply aborted under response_too_long=abort
SEQUENCE_LENGTH_ERRORS = frozenset(
    {
        "ContextLengthExceededError",
        "ContextWindowExceededError",
        "OutputLengthExceededError",
        "OutputTokenExceededError",
        RESPONSE_LENGTH_ERROR,
    }
)
TIME_LIMIT_ERRORS = frozenset({"AgentTimeoutError", "VerifierTimeoutError"})

#: every TrialResult attribute this module reads (contract-tested against Harbor)
TRIAL_RESULT_FIELDS_READ = (
    "trial_name",
    "agent_result",
    "verifier_result",
    "exception_info",
    "started_at",
    "finished_at",
    "environment_setup",
    "agent_setup",
    "agent_execution",
    "verifier",
    "compute_token_cost_totals",
    "failure_cause",
)
PHASES = ("environment_setup", "agent_setup", "agent_execution", "verifier")


def select_reward(rewards: dict[str, float | int] | None, key: str) -> float:
    """The named reward, else the first one, else 0.0."""
    if not rewards:
        return 0.0
    if key in rewards:
        return float(rewards[key])
    return float(next(iter(rewards.values())))


def exit_status_for(exception_type: str | None, *, timed_out: bool) -> ExitStatus:
    if timed_out or exception_type in TIME_LIMIT_ERRORS:
        return ExitStatus.TIME_LIMIT_EXCEEDED
    if exception_type in SEQUENCE_LENGTH_ERRORS:
        return ExitStatus.SEQUENCE_LENGTH_EXCEEDED
    if exception_type is not None:
        return ExitStatus.AGENT_ERROR
    return ExitStatus.SUBMITTED


def _seconds(timing: TimingInfo | None) -> float | None:
    if timing is None or timing.started_at is None or timing.finished_at is None:
        return None
    return (timing.finished_at - timing.started_at).total_seconds()


def _span(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return (end - start).total_seconds()


def _turns(agent_metadata: dict[str, Any], trial_dir: Path | None) -> int | None:
    """Model turns: the harness's own count (terminus-2), else agent steps of the ATIF trajectory."""
    if isinstance(agent_metadata.get("n_episodes"), int):
        return agent_metadata["n_episodes"]
    if trial_dir is None:
        return None
    trajectory = trial_dir / "agent" / "trajectory.json"
    try:
        steps = json.loads(trajectory.read_text()).get("steps") or []
    except (OSError, ValueError, AttributeError):
        return None
    return sum(1 for step in steps if isinstance(step, dict) and step.get("source") == "agent")


def _tool_time(agent_metadata: dict[str, Any], agent_execution_s: float | None) -> float | None:
    """Time the agent spent outside model calls, when the harness reports every model-call time
    (terminus-2: one per turn; a turn whose call failed has none, and then this is unknown)."""
    times = agent_metadata.get("api_request_times_msec")
    turns = agent_metadata.get("n_episodes")
    if agent_execution_s is None or not isinstance(times, list):
        return None
    if isinstance(turns, int) and len(times) < turns:
        return None
    model_s = sum(t for t in times if isinstance(t, int | float)) / 1000.0
    return max(agent_execution_s - model_s, 0.0)


def trial_outcome(
    result: TrialResult | None,
    *,
    reward_key: str,
    timed_out: bool = False,
    trial_dir: Path | None = None,
    harness: str | None = None,
    substituted_for: str | None = None,
) -> dict[str, Any]:
    """The sample metadata for a trial (see the module docstring for the rules)."""
    exception = result.exception_info if result is not None else None
    exception_type = None if timed_out else (exception.exception_type if exception else None)
    verifier_rewards = (
        dict(result.verifier_result.rewards)
        if result is not None and result.verifier_result and result.verifier_result.rewards
        else None
    )
    status = exit_status_for(exception_type, timed_out=timed_out)
    error: dict[str, str] | None = None
    if timed_out:
        error = {"type": "TrialTimeout", "message": "the trial exceeded its wall-clock limit"}
    elif exception is not None:
        message = redact_text(exception.exception_message)[:_MAX_ERROR_CHARS]
        error = {"type": exception.exception_type, "message": message}
    elif verifier_rewards is None:
        status = ExitStatus.AGENT_ERROR
        error = {"type": "NoReward", "message": "the verifier produced no reward"}

    verifier_reward = select_reward(verifier_rewards, reward_key) if verifier_rewards else None
    reward = (
        verifier_reward if status is ExitStatus.SUBMITTED and verifier_reward is not None else 0.0
    )

    timings: dict[str, float | None] = {phase: None for phase in PHASES}
    n_input = n_cache = n_output = None
    cost = None
    agent_metadata: dict[str, Any] = {}
    failure_cause = None
    if result is not None:
        timings = {phase: _seconds(getattr(result, phase)) for phase in PHASES}
        timings["total"] = _span(result.started_at, result.finished_at)
        n_input, n_cache, n_output, cost = result.compute_token_cost_totals()
        if result.agent_result is not None and result.agent_result.metadata:
            agent_metadata = result.agent_result.metadata
        cause = result.failure_cause
        failure_cause = cause.value if cause is not None else None
        if exception_type == RESPONSE_LENGTH_ERROR:  # ours; Harbor files it as unclassified
            failure_cause = "agent_exhausted_budget"

    outcome: dict[str, Any] = {
        "reward": float(reward),
        "exit_status": status.value,
        "verifier_reward": verifier_reward,
        "verifier_rewards": verifier_rewards,
        "input_tokens": n_input,
        "cache_tokens": n_cache,
        "output_tokens": n_output,
        "cost_usd": cost,
        "turns": _turns(agent_metadata, trial_dir),
        "timings_s": timings,
        "tool_time_s": _tool_time(agent_metadata, timings.get("agent_execution")),
        "error": error,
        "failure_cause": "timeout" if timed_out else failure_cause,
        "harness": harness,
        "trial_name": result.trial_name if result is not None else None,
        "trial_dir": str(trial_dir) if trial_dir is not None else None,
    }
    if substituted_for is not None:
        # max_iterations=0 on a harness that cannot express it: Harbor's nop agent ran instead
        outcome["agent_run"] = "nop"
        outcome["turns"] = 0
    return outcome
