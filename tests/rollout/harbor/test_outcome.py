"""Mapping real Harbor `TrialResult` objects to sample metadata."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_rollout.harbor.outcome import ExitStatus, select_reward, trial_outcome

register_cpu_ci(est_time=5, labels=["rollout", "harbor"])

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def make_result(
    tasks_dir: Path,
    *,
    rewards: dict | None = None,
    exception: str | None = None,
    message: str = "boom",
    agent_metadata: dict | None = None,
    tokens: tuple[int, int] | None = (1200, 300),
):
    from harbor.models.agent.context import AgentContext
    from harbor.models.task.id import LocalTaskId
    from harbor.models.trial.config import TaskConfig, TrialConfig
    from harbor.models.trial.result import AgentInfo, ExceptionInfo, TimingInfo, TrialResult
    from harbor.models.verifier.result import VerifierResult

    task = tasks_dir / "write-greeting"

    def timing(start: float, end: float) -> TimingInfo:
        return TimingInfo(
            started_at=T0 + timedelta(seconds=start), finished_at=T0 + timedelta(seconds=end)
        )

    return TrialResult(
        task_name="write-greeting",
        trial_name="write-greeting__abc",
        trial_uri="file:///tmp/x",
        task_id=LocalTaskId(path=task),
        task_checksum="0",
        config=TrialConfig(task=TaskConfig(path=task)),
        agent_info=AgentInfo(name="terminus-2", version="2"),
        agent_result=AgentContext(
            n_input_tokens=tokens[0] if tokens else None,
            n_output_tokens=tokens[1] if tokens else None,
            cost_usd=0.25 if tokens else None,
            metadata=agent_metadata,
        ),
        verifier_result=VerifierResult(rewards=rewards) if rewards is not None else None,
        exception_info=ExceptionInfo(
            exception_type=exception,
            exception_message=message,
            exception_traceback="",
            occurred_at=T0,
        )
        if exception
        else None,
        started_at=T0,
        finished_at=T0 + timedelta(seconds=20),
        environment_setup=timing(0, 1),
        agent_setup=timing(1, 2),
        agent_execution=timing(2, 12),
        verifier=timing(12, 19),
    )


def test_reward_selection() -> None:
    assert select_reward({"reward": 0.5, "other": 1}, "reward") == 0.5
    assert select_reward({"pass": 1, "style": 0.2}, "reward") == 1.0  # first
    assert select_reward({"pass": 1, "style": 0.2}, "style") == 0.2  # named
    assert select_reward({}, "reward") == 0.0
    assert select_reward(None, "reward") == 0.0


def test_submitted_trial(tasks_dir: Path) -> None:
    result = make_result(
        tasks_dir,
        rewards={"reward": 1.0},
        agent_metadata={"n_episodes": 3, "api_request_times_msec": [2000.0, 1500.0, 500.0]},
    )
    out = trial_outcome(result, reward_key="reward", harness="terminus-2")
    assert out["reward"] == 1.0 and out["exit_status"] == ExitStatus.SUBMITTED
    assert out["input_tokens"] == 1200 and out["output_tokens"] == 300 and out["cost_usd"] == 0.25
    assert out["turns"] == 3
    assert out["timings_s"] == {
        "environment_setup": 1.0,
        "agent_setup": 1.0,
        "agent_execution": 10.0,
        "verifier": 7.0,
        "total": 20.0,
    }
    assert out["tool_time_s"] == pytest.approx(6.0)  # 10 s of agent time, 4 s in model calls
    assert out["error"] is None and out["failure_cause"] is None
    json.dumps(out)  # sample metadata must be JSON


@pytest.mark.parametrize(
    ("exception", "status"),
    [
        ("AgentTimeoutError", ExitStatus.TIME_LIMIT_EXCEEDED),
        ("VerifierTimeoutError", ExitStatus.TIME_LIMIT_EXCEEDED),
        ("ContextLengthExceededError", ExitStatus.SEQUENCE_LENGTH_EXCEEDED),
        ("OutputLengthExceededError", ExitStatus.SEQUENCE_LENGTH_EXCEEDED),
        ("NonZeroAgentExitCodeError", ExitStatus.AGENT_ERROR),
        ("RewardFileNotFoundError", ExitStatus.AGENT_ERROR),
        ("EnvironmentStartTimeoutError", ExitStatus.AGENT_ERROR),
    ],
)
def test_failures_get_reward_zero_with_their_status(
    tasks_dir: Path, exception: str, status: ExitStatus
) -> None:
    # the verifier may still have scored the sandbox (Harbor verifies after an agent timeout)
    result = make_result(tasks_dir, rewards={"reward": 1.0}, exception=exception)
    out = trial_outcome(result, reward_key="reward")
    assert out["exit_status"] == status
    assert out["reward"] == 0.0
    assert out["verifier_reward"] == 1.0
    assert out["error"]["type"] == exception


def test_wall_clock_timeout(tasks_dir: Path) -> None:
    result = make_result(tasks_dir, rewards=None, exception="CancelledError")
    out = trial_outcome(result, reward_key="reward", timed_out=True)
    assert out["exit_status"] == ExitStatus.TIME_LIMIT_EXCEEDED and out["reward"] == 0.0
    assert out["failure_cause"] == "timeout"


def test_no_reward_is_an_error_not_a_zero_submission(tasks_dir: Path) -> None:
    out = trial_outcome(make_result(tasks_dir, rewards=None), reward_key="reward")
    assert out["exit_status"] == ExitStatus.AGENT_ERROR and out["reward"] == 0.0
    assert out["error"]["type"] == "NoReward"


def test_error_messages_are_scrubbed(tasks_dir: Path, monkeypatch) -> None:
    secret = "sk-outcome-secret-42424242"
    monkeypatch.setenv("SOME_PROVIDER_API_KEY", secret)
    result = make_result(
        tasks_dir, exception="AuthenticationError", message=f"Incorrect API key {secret} given"
    )
    out = trial_outcome(result, reward_key="reward")
    assert secret not in json.dumps(out)
    assert out["error"]["message"] == "Incorrect API key *** given"


def test_error_messages_lose_urls_credentials_and_terminal_escapes(tasks_dir: Path) -> None:
    """Harbor's message may hold secrets no credential-named variable holds: a proxy URL with a
    password (HTTPS_PROXY is not credential-named), an `API_KEY=...` it echoed, a bearer token;
    and terminal escapes from model output."""
    password = "Q77proxy-password-1234"
    message = (
        f"ConnectError via http://user:{password}@proxy.internal:3128 (HTTPS_PROXY); "
        f"sent OPENAI_API_KEY={password} and Authorization: Bearer {password}\n"
        "\x1b[2J\x1b]0;owned\x07 \u202egnp.exe"
    )
    result = make_result(tasks_dir, exception="NonZeroAgentExitCodeError", message=message)
    out = trial_outcome(result, reward_key="reward")
    shown = out["error"]["message"]
    assert password not in json.dumps(out)
    assert "http://***@proxy.internal:3128" in shown and "OPENAI_API_KEY=***" in shown
    assert "\x1b" not in shown and "\x07" not in shown and "\u202e" not in shown
    assert "\n" in shown  # line breaks stay


def test_turns_from_the_trajectory_and_missing_data_is_none(tasks_dir: Path, tmp_path) -> None:
    (tmp_path / "agent").mkdir()
    (tmp_path / "agent" / "trajectory.json").write_text(
        json.dumps({"steps": [{"source": "user"}, {"source": "agent"}, {"source": "agent"}]})
    )
    result = make_result(tasks_dir, rewards={"reward": 0.0}, tokens=None)
    out = trial_outcome(result, reward_key="reward", trial_dir=tmp_path)
    assert out["turns"] == 2
    assert out["input_tokens"] is None and out["cost_usd"] is None
    assert out["tool_time_s"] is None  # the harness reported no model-call times


def test_substituted_nop_is_recorded(tasks_dir: Path) -> None:
    out = trial_outcome(
        make_result(tasks_dir, rewards={"reward": 0.0}),
        reward_key="reward",
        harness="mini-swe-agent",
        substituted_for="mini-swe-agent",
    )
    assert out["harness"] == "mini-swe-agent" and out["agent_run"] == "nop"
    assert out["turns"] == 0
