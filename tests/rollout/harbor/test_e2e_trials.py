"""End to end on this machine: real Harbor trials of the shipped task in the local sandbox.

Agents that need a model talk over real HTTP to a scripted OpenAI-compatible server on 127.0.0.1
(`fake_engine.py`), standing in for the GPU inference engine. Needs root (the local sandbox).
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import time
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_rollout.harbor import HarborConfigError, harbor_env_vars, run_sync
from mizzen_rollout.harbor.local_environment import LOCAL_ENVIRONMENT_IMPORT_PATH
from mizzen_rollout.harbor.settings import ENV_VARS, HarborSettings

register_cpu_ci(est_time=40, labels=["rollout", "harbor", "e2e"])

TASK = "write-greeting"
SOLVE = "printf 'hello from mizzen\\n' > /app/greeting.txt\n"


def local_settings(tmp_path: Path, tasks_dir: Path, **overrides) -> HarborSettings:
    values = dict(
        tasks_dir=tasks_dir,
        trials_dir=tmp_path / "trials",
        model_name="mizzen-test-model",
        agent="terminus-2",
        environment_import_path=LOCAL_ENVIRONMENT_IMPORT_PATH,
        environment_kwargs={"layers_root": str(tmp_path / "layers")},
        trial_timeout_s=120,
    )
    values.update(overrides)
    return HarborSettings(**values)


def assert_host_untouched() -> None:
    assert not Path("/app/greeting.txt").exists(), "a trial wrote to the real root"


def no_sandbox_left(tmp_path: Path) -> None:
    layers = tmp_path / "layers"
    assert not layers.exists() or not any(layers.iterdir()), "sandbox layers left behind"
    ps = subprocess.run(["pgrep", "-f", str(layers)], capture_output=True, text=True)
    assert ps.stdout.strip() == "", "sandbox processes left behind"


# ------------------------------------------------------------- Harbor's own Trial API


@pytest.mark.parametrize(("agent", "reward"), [("oracle", 1.0), ("nop", 0.0)])
def test_harbor_trial_in_the_local_sandbox(
    agent: str, reward: float, tasks_dir: Path, tmp_path: Path
) -> None:
    from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig, TrialConfig
    from harbor.trial.trial import Trial

    config = TrialConfig(
        task=TaskConfig(path=tasks_dir / TASK),
        trials_dir=tmp_path / "trials",
        agent=AgentConfig(name=agent),
        environment=EnvironmentConfig(
            import_path=LOCAL_ENVIRONMENT_IMPORT_PATH,
            kwargs={"layers_root": str(tmp_path / "layers")},
        ),
    )

    async def go():
        trial = await Trial.create(config)
        return await trial.run()

    result = asyncio.run(go())
    assert result.exception_info is None, result.exception_info
    assert result.verifier_result.rewards == {"reward": reward}
    trial_dir = tmp_path / "trials" / config.trial_name
    assert (trial_dir / "result.json").is_file()
    verifier_log = (trial_dir / "verifier" / "test-stdout.txt").read_text()
    assert ("greeting found" if reward else "greeting missing") in verifier_log
    if agent == "oracle":
        assert (trial_dir / "agent" / "oracle.txt").exists()
    assert_host_untouched()
    no_sandbox_left(tmp_path)


# ------------------------------------------------------------------ the agent function


def test_agent_function_oracle(tasks_dir: Path, tmp_path: Path) -> None:
    settings = local_settings(tmp_path, tasks_dir, agent="oracle")
    outcome = run_sync(
        "http://127.0.0.1:9/v1",
        "ignored",
        {"temperature": 1.0},
        {"instance_id": TASK},
        settings=settings,
    )
    assert outcome["reward"] == 1.0 and outcome["exit_status"] == "submitted"
    assert outcome["harness"] == "oracle" and outcome["error"] is None
    assert set(outcome["timings_s"]) == {
        "environment_setup",
        "agent_setup",
        "agent_execution",
        "verifier",
        "total",
    }
    assert Path(outcome["trial_dir"], "result.json").is_file()
    json.dumps(outcome)
    no_sandbox_left(tmp_path)


def test_agent_function_terminus_solves_through_the_engine(
    tasks_dir: Path, tmp_path: Path, fake_engine, terminus_reply
) -> None:
    engine = fake_engine(replies=[terminus_reply(SOLVE, task_complete=True)])
    settings = local_settings(tmp_path, tasks_dir, max_iterations=5)
    sampling = {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_new_tokens": 256}
    outcome = run_sync(
        engine.base_url, "ignored", sampling, {"instance_id": TASK}, settings=settings
    )
    assert outcome["exit_status"] == "submitted", outcome["error"]
    assert outcome["reward"] == 1.0
    assert outcome["turns"] == 2  # the action, then terminus-2's completion confirmation
    assert len(engine.requests) == 2
    assert outcome["input_tokens"] == 100 + 101 and outcome["output_tokens"] == 20
    assert outcome["tool_time_s"] is not None and outcome["tool_time_s"] >= 0
    body = engine.requests[0].body
    assert body["model"] == "mizzen-test-model"
    assert (body["temperature"], body["top_p"], body["max_tokens"], body["top_k"]) == (
        0.7,
        0.9,
        256,
        20,
    )
    assert "hello from mizzen" in json.dumps(body["messages"])  # the task instruction
    assert_host_untouched()
    no_sandbox_left(tmp_path)


def test_max_iterations_zero_means_zero_turns(
    tasks_dir: Path, tmp_path: Path, fake_engine, terminus_reply
) -> None:
    engine = fake_engine(replies=[terminus_reply(SOLVE, task_complete=True)])
    settings = local_settings(tmp_path, tasks_dir, max_iterations=0)
    outcome = run_sync(
        engine.base_url, None, {"temperature": 1.0}, {"instance_id": TASK}, settings=settings
    )
    assert engine.requests == []
    assert outcome["turns"] == 0 and outcome["reward"] == 0.0
    assert outcome["exit_status"] == "submitted" and outcome["harness"] == "terminus-2"

    # a harness whose own limit would read 0 as "unlimited" runs no agent at all
    mini = local_settings(tmp_path, tasks_dir, agent="mini-swe-agent", max_iterations=0)
    outcome = run_sync(
        engine.base_url, None, {"temperature": 1.0}, {"instance_id": TASK}, settings=mini
    )
    assert engine.requests == []
    assert outcome["harness"] == "mini-swe-agent" and outcome["agent_run"] == "nop"
    assert outcome["turns"] == 0 and outcome["reward"] == 0.0


def test_truncated_reply_aborts_the_trial(
    tasks_dir: Path, tmp_path: Path, fake_engine, terminus_reply
) -> None:
    engine = fake_engine(
        replies=[terminus_reply(SOLVE, task_complete=False)[:40]], finish_reason="length"
    )
    settings = local_settings(tmp_path, tasks_dir)  # response_too_long=abort (the default)
    outcome = run_sync(
        engine.base_url, None, {"max_new_tokens": 16}, {"instance_id": TASK}, settings=settings
    )
    assert len(engine.requests) == 1  # no re-asking, no retries
    assert outcome["exit_status"] == "sequence_length_exceeded" and outcome["reward"] == 0.0
    assert outcome["error"]["type"] == "ResponseLengthExceededError"
    assert outcome["failure_cause"] == "agent_exhausted_budget"
    assert outcome["tool_time_s"] is None  # the failed call's time is not reported
    no_sandbox_left(tmp_path)


def test_terminus_against_the_rollout_embedded_engine(tasks_dir: Path, tmp_path: Path) -> None:
    """The real `mizzen-rollout serve` (echo backend: replies are the prompt's last tokens, cut
    at max_new_tokens) over real HTTP: the request/response shapes work with terminus-2."""
    from mizzen_rollout.engines.base import SamplingParams
    from mizzen_rollout.engines.launcher import embedded_server

    settings = local_settings(tmp_path, tasks_dir, model_name="echo", max_iterations=3)
    with embedded_server(backend="echo", deadline_s=60) as server:
        outcome = run_sync(
            f"{server.url}/v1",
            None,
            SamplingParams(max_new_tokens=32, temperature=0.7),
            {"instance_id": TASK},
            settings=settings,
        )
    assert outcome["exit_status"] == "sequence_length_exceeded", outcome["error"]
    assert outcome["reward"] == 0.0 and outcome["turns"] == 1
    no_sandbox_left(tmp_path)


def test_agent_time_limit_gives_reward_zero(tasks_dir: Path, tmp_path: Path, fake_engine) -> None:
    engine = fake_engine(stall_s=60)
    settings = local_settings(tmp_path, tasks_dir, agent_timeout_s=2)
    outcome = run_sync(engine.base_url, None, {}, {"instance_id": TASK}, settings=settings)
    assert outcome["exit_status"] == "time_limit_exceeded"
    assert outcome["reward"] == 0.0
    assert outcome["error"]["type"] == "AgentTimeoutError"
    no_sandbox_left(tmp_path)


def test_wall_clock_timeout_gives_reward_zero_and_tears_down(
    tasks_dir: Path, tmp_path: Path, fake_engine
) -> None:
    engine = fake_engine(stall_s=60)
    settings = local_settings(tmp_path, tasks_dir, trial_timeout_s=5)
    started = time.monotonic()
    outcome = run_sync(engine.base_url, None, {}, {"instance_id": TASK}, settings=settings)
    elapsed = time.monotonic() - started
    assert outcome["exit_status"] == "time_limit_exceeded" and outcome["reward"] == 0.0
    assert outcome["failure_cause"] == "timeout"
    assert elapsed < 40, elapsed  # Trial.create (LiteLLM import) + 5 s + teardown
    result = json.loads(Path(outcome["trial_dir"], "result.json").read_text())
    assert result["exception_info"]["exception_type"] == "CancelledError"
    no_sandbox_left(tmp_path)


def test_configuration_errors_raise(tasks_dir: Path, tmp_path: Path) -> None:
    settings = local_settings(tmp_path, tasks_dir)
    for bad in ("../x", "/etc/passwd", "a/b", "x y", "missing-task"):
        with pytest.raises(HarborConfigError):
            run_sync("http://127.0.0.1:9/v1", None, {}, {"instance_id": bad}, settings=settings)
    with pytest.raises(HarborConfigError, match="instance_id"):
        run_sync("http://127.0.0.1:9/v1", None, {}, {}, settings=settings)
    with pytest.raises(HarborConfigError, match="unknown parameter"):
        run_sync(
            "http://127.0.0.1:9/v1", None, {"beams": 2}, {"instance_id": TASK}, settings=settings
        )
    with pytest.raises(HarborConfigError, match="base_url"):
        run_sync("127.0.0.1:9", None, {}, {"instance_id": TASK}, settings=settings)
    with pytest.raises(HarborConfigError, match="MIZZEN_HARBOR_TASKS_DIR"):
        run_sync("http://127.0.0.1:9/v1", None, {}, {"instance_id": TASK})  # no settings at all


# ------------------------------------------------------------------------------ security


def test_no_secret_leaks_from_the_launcher_or_the_agent_function(
    tasks_dir: Path, tmp_path: Path, fake_engine, terminus_reply, monkeypatch, capfd, caplog
) -> None:
    engine_key = "sk-engine-SECRET-4f1c2b9a77d0e3"
    provider_key = "dtn-provider-SECRET-a81b22c3d4"
    key_file = tmp_path / "daytona.key"
    key_file.write_text(provider_key)
    monkeypatch.setenv("MIZZEN_TEST_ENGINE_KEY", engine_key)
    monkeypatch.setenv("DAYTONA_API_KEY", provider_key)  # in the worker env, like a real one
    caplog.set_level(logging.DEBUG)

    printed: list[str] = []
    worker_env = harbor_env_vars(
        tasks_dir=tasks_dir,
        trials_dir=tmp_path / "trials",
        model_name="mizzen-test-model",
        environment_import_path=LOCAL_ENVIRONMENT_IMPORT_PATH,
        environment_kwargs={"layers_root": str(tmp_path / "layers")},
        engine_api_key_var="MIZZEN_TEST_ENGINE_KEY",
        trial_timeout_s=120,
        echo=printed.append,
    )
    for variable, value in worker_env.items():
        monkeypatch.setenv(variable, value)

    # the agent dumps its sandbox environment into its logs dir (downloaded into the trial dir)
    dump = "env > /logs/agent/sandbox-env.txt; " + SOLVE
    engine = fake_engine(replies=[terminus_reply(dump, task_complete=True)])
    outcome = run_sync(engine.base_url, None, {"temperature": 0.5}, {"instance_id": TASK})
    assert outcome["reward"] == 1.0, outcome

    # the engine really received the key (so the check below is not vacuous) ...
    assert engine.requests[0].headers["authorization"] == f"Bearer {engine_key}"
    trial_dir = Path(outcome["trial_dir"])
    sandbox_env = (trial_dir / "agent" / "sandbox-env.txt").read_text()
    assert "PATH=" in sandbox_env

    # ... and appears nowhere else: launcher output and env, logs, stdout/stderr, metadata,
    # every file Harbor wrote for the trial, the sandboxed commands' environment.
    captured = capfd.readouterr()
    texts = {
        "launcher env": json.dumps(worker_env),
        "launcher output": "\n".join(printed),
        "stdout": captured.out,
        "stderr": captured.err,
        "logs": "\n".join(f"{r.name} {r.getMessage()} {r.args!r}" for r in caplog.records),
        "outcome": json.dumps(outcome),
    }
    assert any(r.name.startswith("harbor") for r in caplog.records)  # logs were captured
    for path in sorted(p for p in Path(tmp_path / "trials").rglob("*") if p.is_file()):
        texts[str(path)] = path.read_bytes().decode(errors="replace")
    assert str(trial_dir / "config.json") in texts and str(trial_dir / "trial.log") in texts
    for where, text in texts.items():
        for secret in (engine_key, provider_key):
            assert secret not in text, f"secret found in {where}"
    assert ENV_VARS["engine_api_key_var"] in worker_env  # forwarded by NAME
    assert "DAYTONA_API_KEY" not in sandbox_env
