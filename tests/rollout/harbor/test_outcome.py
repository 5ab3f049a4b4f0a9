"""Mapping real Harbor `TrialResult` objects to sample metadata."""

from __future__ import annotations

import json
import math
import os
import tempfile
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mizzen_ci import register_cpu_ci
from mizzen_rollout.harbor import outcome as outcome_module
from mizzen_rollout.harbor.outcome import ExitStatus, select_reward, trial_outcome

register_cpu_ci(est_time=15, labels=["rollout", "harbor"])

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
    assert select_reward({"reward": 10**400, "other": 1}, "reward") is None  # no fallback
    assert select_reward({"reward": float("nan")}, "reward") is None


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


# ---------------------------------------------------------------- hostile agent / verifier output

FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**500), max_value=10**500)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
STEPS = st.lists(
    st.fixed_dictionaries({"source": st.sampled_from(["agent", "user", "system"])}) | JSON_VALUES,
    max_size=6,
)
TRAJECTORIES = st.one_of(
    JSON_VALUES.map(json.dumps),
    st.builds(lambda steps, extra: json.dumps({"steps": steps, **extra}), STEPS | JSON_VALUES,
              st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=3)),
    st.builds(lambda n, o, c: o * n + c * n, st.integers(0, 3000), st.sampled_from(["[", "{\"a\":"]),
              st.sampled_from(["]", "}", ""])),
    st.text(max_size=40),
)  # fmt: skip


def write_trajectory(trial_dir: Path, text: str | bytes) -> None:
    (trial_dir / "agent").mkdir(exist_ok=True)
    path = trial_dir / "agent" / "trajectory.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))


def assert_sound(out: dict) -> None:
    """What every outcome keeps, whatever the trial left behind."""
    json.dumps(out, allow_nan=False)  # strict JSON: no NaN, no Infinity
    assert isinstance(out["reward"], float) and math.isfinite(out["reward"])
    assert out["turns"] is None or (isinstance(out["turns"], int) and out["turns"] >= 0)
    assert all(isinstance(w, str) and "rule:" in w and "fix:" in w for w in out["warnings"])


@pytest.mark.parametrize(
    "text",
    [
        '{"steps": 5}',
        '{"steps": 1.5}',
        '{"steps": "agent"}',
        "[" * 100_000 + "]" * 100_000,
        '{"steps": [' + "[" * 5000 + "]" * 5000 + "]}",
        "[1, 2]",
        "null",
        '{"steps": [{"source": "agent"}',
        b"\xff\xfe{}",
    ],
)
def test_malformed_trajectory_gives_no_turns_and_says_why(tmp_path: Path, text) -> None:
    write_trajectory(tmp_path, text)
    out = trial_outcome(None, reward_key="reward", trial_dir=tmp_path)
    assert out["turns"] is None
    [warning] = out["warnings"]
    assert warning.startswith("agent/trajectory.json ") and "turns is None" in warning
    assert_sound(out)


def test_trajectory_read_is_bounded(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(outcome_module, "MAX_TRAJECTORY_BYTES", 1000)
    write_trajectory(tmp_path, json.dumps({"steps": [{"source": "agent"}] * 100}))
    out = trial_outcome(None, reward_key="reward", trial_dir=tmp_path)
    assert out["turns"] is None and "is larger than 1000 bytes" in out["warnings"][0]


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory"])
def test_trajectory_that_is_not_a_regular_file_is_not_read(tmp_path: Path, kind: str) -> None:
    # the agent writes its own log directory: a FIFO there would block a plain open() forever
    (tmp_path / "agent").mkdir()
    path = tmp_path / "agent" / "trajectory.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":
        (tmp_path / "real.json").write_text(json.dumps({"steps": [{"source": "agent"}]}))
        path.symlink_to(tmp_path / "real.json")
    else:
        path.mkdir()
    outcomes: list[dict] = []  # in a thread, so a regression that blocks fails instead of hanging
    reader = threading.Thread(
        target=lambda: outcomes.append(
            trial_outcome(None, reward_key="reward", trial_dir=tmp_path)
        ),
        daemon=True,
    )
    reader.start()
    reader.join(timeout=30)
    assert outcomes, "trial_outcome blocked on agent/trajectory.json"
    assert outcomes[0]["turns"] is None and outcomes[0]["warnings"]


def test_missing_trajectory_is_missing_data_not_a_warning(tmp_path: Path) -> None:
    out = trial_outcome(None, reward_key="reward", trial_dir=tmp_path)
    assert out["turns"] is None and out["warnings"] == []


@pytest.mark.parametrize(
    ("value", "described"),
    [
        (10**400, "an integer of 1329 bits"),  # Harbor's parser and VerifierResult accept it
        (float("nan"), "nan"),
        (float("inf"), "inf"),
    ],
)
def test_reward_that_is_not_a_finite_number_gives_zero_with_an_error(
    tasks_dir: Path, value, described: str
) -> None:
    result = make_result(tasks_dir, rewards={"reward": value, "style": 1.0})
    out = trial_outcome(result, reward_key="reward")
    assert out["reward"] == 0.0 and out["verifier_reward"] is None
    assert out["exit_status"] == ExitStatus.AGENT_ERROR
    assert out["error"]["type"] == "InvalidReward"
    message = out["error"]["message"]
    assert message.startswith("verifier_result.rewards['reward'] is " + described)
    assert "rule: the reward must be a finite number" in message and "fix:" in message
    assert out["verifier_rewards"] == {"reward": None, "style": 1.0}
    assert out["warnings"] == [message]
    assert_sound(out)


def test_invalid_reward_keeps_the_trials_own_error(tasks_dir: Path) -> None:
    result = make_result(tasks_dir, rewards={"reward": 10**400}, exception="AgentTimeoutError")
    out = trial_outcome(result, reward_key="reward")
    assert out["exit_status"] == ExitStatus.TIME_LIMIT_EXCEEDED and out["reward"] == 0.0
    assert out["error"]["type"] == "AgentTimeoutError"
    assert "finite number" in out["warnings"][0]


def test_model_call_times_that_are_not_finite_numbers_leave_tool_time_unknown(
    tasks_dir: Path,
) -> None:
    metadata = {"n_episodes": 2, "api_request_times_msec": [10**400, 1.0]}
    out = trial_outcome(
        make_result(tasks_dir, rewards={"reward": 1.0}, agent_metadata=metadata),
        reward_key="reward",
    )
    assert out["tool_time_s"] is None and out["reward"] == 1.0
    assert_sound(out)


@FUZZ
@given(text=TRAJECTORIES)
def test_any_trajectory_gives_an_outcome(text: str) -> None:
    with tempfile.TemporaryDirectory() as trial_dir:
        write_trajectory(Path(trial_dir), text)
        out = trial_outcome(None, reward_key="reward", trial_dir=Path(trial_dir))
    assert_sound(out)
    assert (out["turns"] is None) == bool(out["warnings"])


@FUZZ
@given(rewards=st.dictionaries(st.sampled_from(["reward", "pass", "x"]), JSON_VALUES, max_size=3))
def test_any_reward_gives_an_outcome(tasks_dir: Path, rewards: dict) -> None:
    result = make_result(tasks_dir, rewards={"reward": 0.0})
    result.verifier_result.rewards = rewards  # past pydantic: whatever the verifier left
    out = trial_outcome(result, reward_key="reward")
    assert_sound(out)
    chosen = rewards.get("reward", next(iter(rewards.values()), None)) if rewards else 0.0
    finite = not isinstance(chosen, bool) and isinstance(chosen, int | float)
    try:
        finite = finite and math.isfinite(chosen)
    except OverflowError:  # an int beyond float range
        finite = False
    if rewards and not finite:
        assert out["reward"] == 0.0 and out["error"]["type"] == "InvalidReward"
    elif rewards:
        assert out["reward"] == float(chosen) and out["error"] is None
