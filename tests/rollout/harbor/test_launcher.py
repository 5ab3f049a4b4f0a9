"""`harbor_env_vars` and the settings table: every check, and the round trip to the workers."""

from __future__ import annotations

import dataclasses
import importlib.metadata
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_rollout.harbor import credentials
from mizzen_rollout.harbor.errors import HarborConfigError, ProviderCredentialError
from mizzen_rollout.harbor.launcher import harbor_env_vars
from mizzen_rollout.harbor.local_environment import LOCAL_ENVIRONMENT_IMPORT_PATH
from mizzen_rollout.harbor.settings import ENV_VARS, HarborSettings

register_cpu_ci(est_time=5, labels=["rollout", "harbor"])

SECRET = "sk-launcher-secret-0123456789"


def base(tmp_path: Path, tasks: Path, **overrides):
    kwargs = dict(
        tasks_dir=tasks,
        trials_dir=tmp_path / "trials" / "nested",
        model_name="Qwen/Qwen3-8B",
        environment_import_path=LOCAL_ENVIRONMENT_IMPORT_PATH,
        echo=lambda line: None,
    )
    kwargs.update(overrides)
    return kwargs


def test_minimal_local_run_and_round_trip(tmp_path: Path, tasks_dir: Path) -> None:
    env = harbor_env_vars(**base(tmp_path, tasks_dir))
    assert (tmp_path / "trials" / "nested").is_dir()  # created
    assert env == {
        ENV_VARS["tasks_dir"]: str(tasks_dir.resolve()),
        ENV_VARS["trials_dir"]: str((tmp_path / "trials" / "nested").resolve()),
        ENV_VARS["model_name"]: "Qwen/Qwen3-8B",
        ENV_VARS["agent"]: "terminus-2",
        ENV_VARS["environment_import_path"]: LOCAL_ENVIRONMENT_IMPORT_PATH,
        ENV_VARS["trial_timeout_s"]: "3600.0",
        ENV_VARS["response_too_long"]: "abort",
        ENV_VARS["reward_key"]: "reward",
    }
    settings = HarborSettings.from_env(env)
    assert settings.model_name == "Qwen/Qwen3-8B" and settings.max_iterations is None


def test_optional_knobs_only_when_set_and_zero_counts(tmp_path: Path, tasks_dir: Path) -> None:
    env = harbor_env_vars(
        **base(tmp_path, tasks_dir),
        max_iterations=0,
        agent_timeout_s=30,
        verifier_timeout_s=20,
        reward_key="pass",
        engine_api_key_var="ENGINE_KEY",
        agent_kwargs={"parser_name": "xml"},
        environment_kwargs={"layers_root": "/var/tmp/x"},
        keep_sandbox=True,
    )
    assert env[ENV_VARS["max_iterations"]] == "0"
    assert env[ENV_VARS["agent_timeout_s"]] == "30.0"
    assert env[ENV_VARS["keep_sandbox"]] == "1"
    settings = HarborSettings.from_env(env)
    assert settings.max_iterations == 0
    assert settings.agent_kwargs == {"parser_name": "xml"}
    assert settings.environment_kwargs == {"layers_root": "/var/tmp/x"}
    assert settings.reward_key == "pass" and settings.keep_sandbox


def test_environment_type_is_normalised_and_unknown_passed_through(
    tmp_path: Path, tasks_dir: Path
) -> None:
    printed: list[str] = []
    env = harbor_env_vars(
        **base(tmp_path, tasks_dir, environment_import_path=None, echo=printed.append),
        environment_type="  DoCkEr ",
    )
    assert env[ENV_VARS["environment_type"]] == "docker"
    assert any("docker has no credential spec" in line for line in printed)


def test_environment_type_checked_against_harbor(tmp_path: Path, tasks_dir: Path) -> None:
    with pytest.raises(HarborConfigError, match="'dockerr' is not a Harbor environment type"):
        harbor_env_vars(
            **base(tmp_path, tasks_dir, environment_import_path=None), environment_type="dockerr"
        )


def test_exactly_one_of_type_and_import_path(tmp_path: Path, tasks_dir: Path) -> None:
    with pytest.raises(HarborConfigError, match="exactly one"):
        harbor_env_vars(**base(tmp_path, tasks_dir), environment_type="docker")
    with pytest.raises(HarborConfigError, match="exactly one"):
        harbor_env_vars(**base(tmp_path, tasks_dir, environment_import_path=None))


@pytest.mark.parametrize(
    ("import_path", "match"),
    [
        ("not a path", "package.module:ClassName"),
        ("mizzen_rollout.harbor.nope:Thing", "cannot import"),
        ("mizzen_rollout.harbor.settings:HarborSettings", "not a Harbor BaseEnvironment"),
    ],
)
def test_custom_environment_import_path_is_checked(
    tmp_path: Path, tasks_dir: Path, import_path: str, match: str
) -> None:
    with pytest.raises(HarborConfigError, match=match):
        harbor_env_vars(**base(tmp_path, tasks_dir, environment_import_path=import_path))


def test_tasks_dir_must_exist(tmp_path: Path, tasks_dir: Path) -> None:
    with pytest.raises(HarborConfigError, match="MIZZEN_HARBOR_TASKS_DIR"):
        harbor_env_vars(**base(tmp_path, tasks_dir, tasks_dir=tmp_path / "missing"))


def test_trials_dir_must_be_creatable(tmp_path: Path, tasks_dir: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(HarborConfigError, match="MIZZEN_HARBOR_TRIALS_DIR"):
        harbor_env_vars(**base(tmp_path, tasks_dir, trials_dir=blocker))
    with pytest.raises(HarborConfigError, match="cannot create"):
        harbor_env_vars(**base(tmp_path, tasks_dir, trials_dir=blocker / "sub"))


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"model_name": "  "}, "MIZZEN_HARBOR_MODEL"),
        ({"trial_timeout_s": 0}, "MIZZEN_HARBOR_TRIAL_TIMEOUT_S"),
        ({"trial_timeout_s": -5}, "MIZZEN_HARBOR_TRIAL_TIMEOUT_S"),
        ({"agent_timeout_s": float("nan")}, "MIZZEN_HARBOR_AGENT_TIMEOUT_S"),
        ({"verifier_timeout_s": "soon"}, "MIZZEN_HARBOR_VERIFIER_TIMEOUT_S"),
        ({"max_iterations": -1}, "MIZZEN_HARBOR_MAX_ITERATIONS"),
        ({"response_too_long": "truncate"}, "MIZZEN_HARBOR_RESPONSE_TOO_LONG"),
        ({"agent": "gpt-agent"}, "not a supported harness"),
        ({"agent": "claude-code"}, "cannot abort"),
        ({"agent": "mini-swe-agent", "response_too_long": "recover"}, "use abort"),
        ({"engine_api_key_var": SECRET}, "NAME of the variable"),
        ({"agent_kwargs": {"llm_kwargs": {"api_key": SECRET}}}, "literal credential"),
    ],
)
def test_invalid_settings_are_refused(
    tmp_path: Path, tasks_dir: Path, override: dict, match: str
) -> None:
    with pytest.raises(HarborConfigError, match=match) as error:
        harbor_env_vars(**base(tmp_path, tasks_dir, **override))
    assert SECRET not in str(error.value)


def test_templated_credentials_in_agent_kwargs_are_refused(tmp_path: Path, tasks_dir: Path) -> None:
    # Harbor resolves ${VAR} only in AgentConfig.env (see test_harbor_contract), so a template in
    # kwargs would reach the agent as literal text: the engine key has its own path.
    with pytest.raises(
        ProviderCredentialError, match=r"llm_kwargs\.api_key holds a \$\{VAR\}"
    ) as e:
        harbor_env_vars(
            **base(tmp_path, tasks_dir), agent_kwargs={"llm_kwargs": {"api_key": "${MY_KEY}"}}
        )
    assert "MIZZEN_HARBOR_ENGINE_API_KEY_VAR" in str(e.value)


def test_known_provider_is_provisioned(tmp_path: Path, tasks_dir: Path, monkeypatch) -> None:
    httpx_version = importlib.metadata.version("httpx")
    fake_sdk = dataclasses.replace(
        credentials.PROVIDER_SPECS["e2b"],
        sdk_module="httpx",
        sdk_distribution="httpx",
        sdk_min_version=httpx_version,
    )
    monkeypatch.setitem(credentials.PROVIDER_SPECS, "e2b", fake_sdk)
    key_file = tmp_path / "e2b.key"
    key_file.write_text(SECRET)
    printed: list[str] = []
    env = harbor_env_vars(
        **base(tmp_path, tasks_dir, environment_import_path=None, echo=printed.append),
        environment_type="E2B",
        environ={"E2B_API_KEY_FILE": str(key_file), "E2B_DOMAIN": "sandbox.internal"},
    )
    assert env["E2B_API_KEY_FILE"] == str(key_file.resolve())
    assert env["E2B_DOMAIN"] == "sandbox.internal"
    assert SECRET not in repr(env) and SECRET not in "".join(printed)


def test_known_provider_without_sdk_fails_before_workers(tmp_path: Path, tasks_dir: Path) -> None:
    with pytest.raises(ProviderCredentialError):
        harbor_env_vars(
            **base(tmp_path, tasks_dir, environment_import_path=None),
            environment_type="daytona",
            environ={"DAYTONA_API_KEY": SECRET},
        )


def test_from_env_names_missing_variables() -> None:
    with pytest.raises(HarborConfigError, match="MIZZEN_HARBOR_TASKS_DIR"):
        HarborSettings.from_env({})
    with pytest.raises(HarborConfigError, match="cannot parse"):
        HarborSettings.from_env({ENV_VARS["max_iterations"]: "lots"})


@pytest.mark.parametrize("setting", ["agent_kwargs", "environment_kwargs"])
@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        ("[" * 100_000 + "]" * 100_000, "characters long"),  # past the decoder's recursion
        (
            "[" * 20_000,
            "brackets nested 20000 deep, over the limit of 33",
        ),  # short, unbalanced, still too deep
        ('{"a": ' * 40 + "1" + "}" * 40, "brackets nested"),
        ('{"prompt": "' + "x" * 200_000 + '"}', "characters long"),
        ('{"n": ' + "9" * 5000 + "}", "not valid JSON"),  # int() refuses 5000 digits
    ],
)
def test_hostile_kwargs_variables_are_config_errors(
    tmp_path: Path, tasks_dir: Path, setting: str, raw: str, problem: str
) -> None:
    env = harbor_env_vars(**base(tmp_path, tasks_dir))
    with pytest.raises(HarborConfigError) as error:
        HarborSettings.from_env({**env, ENV_VARS[setting]: raw})
    message = str(error.value)
    assert message.startswith(f"{ENV_VARS[setting]} ({setting}): ") and problem in message
    assert "rule: a JSON object" in message and "fix:" in message and len(message) < 600
    assert error.value.__context__ is None and error.value.__cause__ is None


def test_kwargs_too_long_for_a_worker_variable_are_refused_on_the_launcher(
    tmp_path: Path, tasks_dir: Path
) -> None:
    kwargs = {"system_prompt": "x" * 200_000}
    with pytest.raises(HarborConfigError, match=r"AGENT_KWARGS \(agent_kwargs\): is \d+ char"):
        harbor_env_vars(**base(tmp_path, tasks_dir), agent_kwargs=kwargs)
    nested = {"a": 1}
    for _ in range(31):  # 32 levels below the top: the most that travels
        nested = {"a": nested}
    env = harbor_env_vars(**base(tmp_path, tasks_dir), agent_kwargs=nested)
    assert HarborSettings.from_env(env).agent_kwargs == nested
