"""Turning a finished (or abandoned) Harbor trial into sample metadata.

Invariants:
- Every outcome has a float `reward` and an `exit_status` from `ExitStatus`. Only a `submitted`
  trial keeps its verifier reward; time limits, sequence-length aborts and errors give 0.0 (the
  verifier's own number, if any, stays visible as `verifier_reward`).
- Reward selection: the named reward key, else the first reward the verifier wrote, else 0.0.
  The selected reward must be a finite number (an `int` or `float`, not a bool; Harbor accepts
  integers too large for a float): anything else gives reward 0.0, `verifier_reward` None, and,
  on an otherwise submitted trial, `agent_error` with an `InvalidReward` error naming the reward,
  the rule and the fix. `verifier_rewards` holds each reward as a float, or None where it is not
  a finite number, so the metadata is always strict JSON.
- Exit status is derived from Harbor's recorded exception type names (`SEQUENCE_LENGTH_ERRORS`,
  `TIME_LIMIT_ERRORS`; contract-tested against Harbor's own error-policy table) or from our
  wall-clock timeout; anything else that went wrong is `agent_error`.
- Only `TrialResult` fields listed in `TRIAL_RESULT_FIELDS_READ` are read (contract-tested, so a
  rename in Harbor fails a test instead of silently dropping data). Missing data is `None`, never
  a made-up number.
- Nothing raises on what the agent or the verifier left behind. `turns` falls back to the agent
  steps of the ATIF trajectory (`agent/trajectory.json`), read as a regular file of at most
  `MAX_TRAJECTORY_BYTES` bytes nested at most `MAX_TRAJECTORY_DEPTH` levels, size and nesting
  checked before decoding (`bounded_json`); a trajectory that is unreadable or malformed gives
  `turns` None. Each such piece of unusable data (trajectory, reward) is recorded in the
  outcome's `warnings` list (what, the rule, the fix); the list is empty when everything was read.
- Text that leaves here (error messages) is scrubbed of secret values.
"""

from __future__ import annotations

import enum
import math
import os
import stat
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mizzen_rollout.harbor.bounded_json import loads_bounded
from mizzen_rollout.harbor.redaction import redact_text, shown
from mizzen_rollout.harbor.terminus_abort import RESPONSE_LENGTH_ERROR

if TYPE_CHECKING:
    from harbor.models.trial.result import TimingInfo, TrialResult

_MAX_ERROR_CHARS = 2000
#: the largest agent/trajectory.json read for `turns` (a long terminus-2 run writes a few MiB)
MAX_TRAJECTORY_BYTES = 64 * 1024 * 1024
#: the deepest nesting read there (ATIF itself is under 10 levels; tool arguments add some)
MAX_TRAJECTORY_DEPTH = 200
TRAJECTORY = Path("agent") / "trajectory.json"


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


def finite_number(value: object) -> float | None:
    """`value` as a float if it is a finite `int` or `float` (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int beyond float range: Harbor's models accept 10**400
        return None
    return number if math.isfinite(number) else None


def _chosen_reward(rewards: Mapping[str, Any], key: str) -> tuple[str, Any]:
    name = key if key in rewards else next(iter(rewards))
    return name, rewards[name]


def select_reward(rewards: Mapping[str, Any] | None, key: str) -> float | None:
    """The named reward, else the first one, else 0.0; None if the one chosen is not a finite
    number (see `finite_number`)."""
    if not rewards:
        return 0.0
    return finite_number(_chosen_reward(rewards, key)[1])


def _described(value: object) -> str:
    """What a reward value is, in a few characters (a huge int is never turned into text)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return f"an integer of {value.bit_length()} bits, beyond a float"
    if isinstance(value, float):
        return repr(value)
    return f"of type {type(value).__name__[:40]}"


def _reward_problem(rewards: Mapping[str, Any], key: str) -> str:
    name, value = _chosen_reward(rewards, key)
    return (
        f"verifier_result.rewards[{shown(name, limit=60)}] is {_described(value)}; rule: the "
        "reward must be a finite number (int or float), so the sample gets reward 0.0; fix: make "
        "the task's verifier write a finite number (e.g. 0 or 1) to reward.txt or reward.json"
    )


def _raw_rewards(result: TrialResult | None) -> Mapping[str, Any] | None:
    verifier = result.verifier_result if result is not None else None
    rewards = verifier.rewards if verifier is not None else None
    return rewards if isinstance(rewards, Mapping) and rewards else None


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


def _turns(agent_metadata: Mapping[str, Any], trial_dir: Path | None) -> tuple[int | None, str]:
    """Model turns: the harness's own count (terminus-2), else agent steps of the ATIF trajectory;
    with the problem that left them unknown ("" if none)."""
    episodes = agent_metadata.get("n_episodes")
    if isinstance(episodes, int) and not isinstance(episodes, bool) and episodes >= 0:
        return episodes, ""
    if trial_dir is None:
        return None, ""
    turns, problem = _trajectory_turns(trial_dir / TRAJECTORY)
    if not problem:
        return turns, ""
    return None, (
        f"{TRAJECTORY} {problem}, so turns is None; rule: an ATIF trajectory, a JSON object of at "
        f"most {MAX_TRAJECTORY_BYTES} bytes, brackets nested at most {MAX_TRAJECTORY_DEPTH} deep, whose "
        "`steps` is a list; fix: nothing for this sample; if it recurs, check the harness's "
        "trajectory writer (the agent can overwrite its own log directory)"
    )


def _trajectory_turns(path: Path) -> tuple[int | None, str]:
    """The agent steps of the trajectory at `path`, or the problem ("" and None if absent)."""
    data, problem = _read_bounded(path, MAX_TRAJECTORY_BYTES)
    if data is None or problem:
        return None, problem
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None, "is not UTF-8 text"
    document, problem = loads_bounded(
        text, max_chars=MAX_TRAJECTORY_BYTES, max_depth=MAX_TRAJECTORY_DEPTH
    )
    if problem or not isinstance(document, dict):
        return None, problem or "is not a JSON object"
    steps = document.get("steps")
    if steps is None:
        return 0, ""
    if not isinstance(steps, list):
        return None, f"has `steps` of type {type(steps).__name__}, not a list"
    return sum(1 for step in steps if isinstance(step, dict) and step.get("source") == "agent"), ""


def _read_bounded(path: Path, limit: int) -> tuple[bytes | None, str]:
    """At most `limit` bytes of the regular file `path` (never a symlink, FIFO or device): (None,
    "") if it does not exist, (None, problem) if it cannot be read or is larger."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, ""
    except OSError as exc:  # ELOOP: a symlink, never followed
        return None, f"cannot be opened ({exc.strerror or type(exc).__name__})"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None, "is not a regular file"
        with os.fdopen(fd, "rb", closefd=False) as handle:
            data = handle.read(limit + 1)
    except OSError as exc:
        return None, f"cannot be read ({exc.strerror or type(exc).__name__})"
    finally:
        os.close(fd)
    return (None, f"is larger than {limit} bytes") if len(data) > limit else (data, "")


def _tool_time(agent_metadata: Mapping[str, Any], agent_execution_s: float | None) -> float | None:
    """Time the agent spent outside model calls, when the harness reports every model-call time
    (terminus-2: one per turn; a turn whose call failed has none, and then this is unknown; so is
    it when a reported time is not a finite number)."""
    times = agent_metadata.get("api_request_times_msec")
    turns = agent_metadata.get("n_episodes")
    if agent_execution_s is None or not isinstance(times, list):
        return None
    if isinstance(turns, int) and len(times) < turns:
        return None
    numbers = [finite_number(t) for t in times]
    if None in numbers:
        return None
    model_s = math.fsum(numbers) / 1000.0  # type: ignore[arg-type]
    return max(agent_execution_s - model_s, 0.0) if math.isfinite(model_s) else None


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
    raw_rewards = _raw_rewards(result)
    status = exit_status_for(exception_type, timed_out=timed_out)
    error: dict[str, str] | None = None
    if timed_out:
        error = {"type": "TrialTimeout", "message": "the trial exceeded its wall-clock limit"}
    elif exception is not None:
        message = redact_text(exception.exception_message)[:_MAX_ERROR_CHARS]
        error = {"type": exception.exception_type, "message": message}
    elif raw_rewards is None:
        status = ExitStatus.AGENT_ERROR
        error = {"type": "NoReward", "message": "the verifier produced no reward"}

    warnings: list[str] = []
    verifier_reward = select_reward(raw_rewards, reward_key) if raw_rewards else None
    if raw_rewards and verifier_reward is None:
        warnings.append(_reward_problem(raw_rewards, reward_key))
        if status is ExitStatus.SUBMITTED:
            status = ExitStatus.AGENT_ERROR
            error = {"type": "InvalidReward", "message": warnings[-1]}
    reward = (
        verifier_reward if status is ExitStatus.SUBMITTED and verifier_reward is not None else 0.0
    )

    timings: dict[str, float | None] = {phase: None for phase in PHASES}
    n_input = n_cache = n_output = None
    cost = None
    agent_metadata: Mapping[str, Any] = {}
    failure_cause = None
    if result is not None:
        timings = {phase: _seconds(getattr(result, phase)) for phase in PHASES}
        timings["total"] = _span(result.started_at, result.finished_at)
        n_input, n_cache, n_output, cost = result.compute_token_cost_totals()
        metadata = result.agent_result.metadata if result.agent_result is not None else None
        if isinstance(metadata, Mapping):
            agent_metadata = metadata
        cause = result.failure_cause
        failure_cause = cause.value if cause is not None else None
        if exception_type == RESPONSE_LENGTH_ERROR:  # ours; Harbor files it as unclassified
            failure_cause = "agent_exhausted_budget"
    turns, turns_problem = _turns(agent_metadata, trial_dir)
    if turns_problem:
        warnings.append(turns_problem)

    outcome: dict[str, Any] = {
        "reward": float(reward),
        "exit_status": status.value,
        "verifier_reward": verifier_reward,
        "verifier_rewards": (
            {str(name): finite_number(value) for name, value in raw_rewards.items()}
            if raw_rewards
            else None
        ),
        "input_tokens": n_input,
        "cache_tokens": n_cache,
        "output_tokens": n_output,
        "cost_usd": cost,
        "turns": turns,
        "timings_s": timings,
        "tool_time_s": _tool_time(agent_metadata, timings.get("agent_execution")),
        "error": error,
        "warnings": warnings,
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
