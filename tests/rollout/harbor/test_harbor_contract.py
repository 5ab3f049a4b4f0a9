"""Contract tests against the real harbor package (0.25): every name, field and type we rely on.

A rename in Harbor must fail here instead of silently dropping data or misconfiguring a trial.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_rollout.harbor.credentials import PROVIDER_SPECS
from mizzen_rollout.harbor.harnesses import ANTHROPIC_MESSAGES, HARNESSES, OPENAI_CHAT
from mizzen_rollout.harbor.local_environment import (
    LOCAL_ENVIRONMENT_IMPORT_PATH,
    LOCAL_ENVIRONMENT_TYPE,
)
from mizzen_rollout.harbor.outcome import (
    SEQUENCE_LENGTH_ERRORS,
    TIME_LIMIT_ERRORS,
    TRIAL_RESULT_FIELDS_READ,
)
from mizzen_rollout.harbor.settings import HarborSettings
from mizzen_rollout.harbor.terminus_abort import RESPONSE_LENGTH_ERROR
from mizzen_rollout.harbor.trial_config import build_trial_config

register_cpu_ci(est_time=20, labels=["rollout", "harbor"])

FULL_SAMPLING = {
    "temperature": 0.8,
    "top_p": 0.95,
    "top_k": 20,
    "min_p": 0.05,
    "max_new_tokens": 512,
    "presence_penalty": 0.1,
    "frequency_penalty": 0.1,
    "repetition_penalty": 1.05,
    "stop": ["</done>"],
    "seed": 7,
}
SAMPLING_FOR = {
    "terminus-2": FULL_SAMPLING,
    "mini-swe-agent": FULL_SAMPLING,
    "claude-code": {"max_new_tokens": 512},
    "opencode": {"temperature": 0.8, "top_p": 0.95},
    "oracle": FULL_SAMPLING,  # no model: ignored
    "nop": FULL_SAMPLING,
}
POLICY_FOR = {"claude-code": "recover", "opencode": "recover"}


def test_harbor_version() -> None:
    assert importlib.metadata.version("harbor") == "0.25.0"


def test_provider_specs_are_harbor_environment_types() -> None:
    from harbor.environments.factory import _ENVIRONMENT_REGISTRY
    from harbor.models.environment_type import EnvironmentType

    for name in PROVIDER_SPECS:
        assert EnvironmentType(name) in _ENVIRONMENT_REGISTRY


@pytest.mark.parametrize("name", sorted(PROVIDER_SPECS))
def test_provider_key_variables_are_the_ones_harbor_reads(name: str) -> None:
    from harbor.environments.factory import _ENVIRONMENT_REGISTRY
    from harbor.models.environment_type import EnvironmentType

    spec = PROVIDER_SPECS[name]
    module = _ENVIRONMENT_REGISTRY[EnvironmentType(name)].module
    origin = importlib.util.find_spec(module).origin
    source = Path(origin).read_text()
    if origin.endswith("__init__.py"):  # a package: read its modules
        source += "".join(p.read_text() for p in Path(origin).parent.glob("*.py"))
    for variable in spec.key_vars:
        assert variable in source, f"{module} no longer reads {variable}"


def test_provider_sdk_minimums_are_at_least_harbors() -> None:
    requirements = importlib.metadata.requires("harbor") or []
    for spec in PROVIDER_SPECS.values():
        pattern = re.compile(
            rf"^{re.escape(spec.sdk_distribution)}\s*>=\s*([\d.]+).*extra == '{spec.harbor_extra}'"
        )
        found = [m.group(1) for r in requirements if (m := pattern.match(r))]
        assert found, f"harbor[{spec.harbor_extra}] no longer requires {spec.sdk_distribution}"
        harbor_min = tuple(int(x) for x in found[0].split("."))
        ours = tuple(int(x) for x in spec.sdk_min_version.split("."))
        assert ours >= harbor_min, (spec.name, ours, harbor_min)


def test_harnesses_are_registered_harbor_agents() -> None:
    from harbor.agents.factory import AgentFactory
    from harbor.models.agent.name import AgentName

    required = {"terminus-2", "claude-code", "opencode", "mini-swe-agent", "oracle", "nop"}
    assert required <= set(HARNESSES)
    for name in HARNESSES:
        assert AgentName(name).value in AgentFactory.registered_names()


def test_api_formats_exist() -> None:
    from harbor.models.model_api_format import ModelApiFormat

    assert ModelApiFormat(OPENAI_CHAT) and ModelApiFormat(ANTHROPIC_MESSAGES)
    for spec in HARNESSES.values():
        if spec.api_format is not None:
            ModelApiFormat(spec.api_format)


def test_config_fields_we_set_exist() -> None:
    from harbor.models.trial.config import (
        AgentConfig,
        EnvironmentConfig,
        TaskConfig,
        TrialConfig,
        VerifierConfig,
    )

    used = {
        TrialConfig: {"task", "trials_dir", "agent", "environment", "verifier", "trial_name"},
        TaskConfig: {"path"},
        AgentConfig: {
            "name",
            "model_name",
            "base_url",
            "model_api_key_name",
            "model_api_format",
            "kwargs",
            "env",
            "override_timeout_sec",
        },
        EnvironmentConfig: {"type", "import_path", "kwargs", "delete"},
        VerifierConfig: {"override_timeout_sec"},
    }
    for model, names in used.items():
        missing = names - set(model.model_fields)
        assert not missing, f"{model.__name__} lost {missing}"


@pytest.mark.parametrize("name", sorted(HARNESSES))
def test_built_config_is_a_valid_trial_config_and_the_agent_accepts_it(
    name: str, tasks_dir: Path, tmp_path: Path
) -> None:
    from harbor.agents.factory import AgentFactory
    from harbor.models.trial.config import TrialConfig
    from harbor.models.trial.paths import TrialPaths

    settings = HarborSettings(
        tasks_dir=tasks_dir,
        trials_dir=tmp_path / "trials",
        model_name="Qwen/Qwen3-8B",
        agent=name,
        environment_import_path=LOCAL_ENVIRONMENT_IMPORT_PATH,
        max_iterations=3,
        agent_timeout_s=60,
        verifier_timeout_s=30,
        response_too_long=POLICY_FOR.get(name, "abort"),
    ).validate()
    config, setup = build_trial_config(
        settings,
        instance_id="write-greeting",
        base_url="http://127.0.0.1:30000/v1",
        sampling_params=SAMPLING_FOR[name],
    )
    assert isinstance(config, TrialConfig)
    # it survives Harbor's own JSON round trip (what Harbor writes as config.json)
    again = TrialConfig.model_validate(json.loads(config.model_dump_json()))
    assert again.task.path == tasks_dir / "write-greeting"
    assert (again.agent.name, again.agent.import_path) == (setup.name, setup.import_path)
    assert config.agent.override_timeout_sec == 60
    assert config.verifier.override_timeout_sec == 30
    assert config.environment.import_path == LOCAL_ENVIRONMENT_IMPORT_PATH
    if HARNESSES[name].uses_model:
        assert config.agent.base_url == "http://127.0.0.1:30000/v1"
    # The agent class validates its kwargs against its options model (extra=forbid): every key
    # we derive per harness must be one the harness knows.
    extra = {}
    if name == "oracle":
        extra = {"task_dir": tasks_dir / "write-greeting", "trial_paths": TrialPaths(tmp_path)}
    agent = AgentFactory.create_agent_from_config(
        config.agent, logs_dir=tmp_path / "agent", **extra
    )
    assert agent.name() == name


def test_aborting_terminus_is_terminus_and_aborts_truncated_replies(tmp_path: Path) -> None:
    from harbor.agents.factory import AgentFactory
    from harbor.agents.terminus_2 import Terminus2
    from harbor.llms.base import ContextLengthExceededError, OutputLengthExceededError
    from harbor.models.trial.config import AgentConfig

    from mizzen_rollout.harbor import terminus_abort

    config = AgentConfig(
        import_path=terminus_abort.ABORTING_TERMINUS_IMPORT_PATH,
        model_name="openai/x",
        base_url="http://127.0.0.1:9/v1",
        kwargs={"enable_summarize": False, "record_terminal_session": False},
    )
    agent = AgentFactory.create_agent_from_config(config, logs_dir=tmp_path)
    assert isinstance(agent, Terminus2) and agent.name() == "terminus-2"
    error = terminus_abort.ResponseLengthExceededError
    assert issubclass(error, ContextLengthExceededError)
    assert error.__name__ == terminus_abort.RESPONSE_LENGTH_ERROR

    llm_class = type(agent._llm)

    async def truncated(self, *args, **kwargs):
        raise OutputLengthExceededError("hit max_tokens", truncated_response="{")

    # the wrapper sits on top of the LLM's own call: make the inner call truncate
    base_class = llm_class.__mro__[1]
    original = base_class.call
    base_class.call = truncated
    try:
        with pytest.raises(error, match="response_too_long=abort"):
            asyncio.run(agent._llm.call(prompt="hi", message_history=[]))
    finally:
        base_class.call = original


def test_agent_construction_rejects_unknown_kwargs(tmp_path: Path) -> None:
    """Negative control: the construction check above would catch a misspelled kwarg."""
    from harbor.agents.factory import AgentFactory
    from harbor.models.trial.config import AgentConfig

    config = AgentConfig(
        name="terminus-2",
        model_name="openai/x",
        base_url="http://x/v1",
        kwargs={"max_turnz": 1},
    )
    with pytest.raises(ValueError, match="max_turnz"):
        AgentFactory.create_agent_from_config(config, logs_dir=tmp_path)


def test_terminus_reports_the_metadata_we_read() -> None:
    import harbor.agents.terminus_2.terminus_2 as terminus

    source = Path(terminus.__file__).read_text()
    for key in ('"n_episodes"', '"api_request_times_msec"'):
        assert key in source
    assert "range(self._max_episodes)" in source  # max_turns=0 means zero turns


def test_trial_result_fields_we_read_exist() -> None:
    from harbor.models.trial.result import TimingInfo, TrialResult
    from harbor.models.verifier.result import VerifierResult

    for name in TRIAL_RESULT_FIELDS_READ:
        assert name in TrialResult.model_fields or hasattr(TrialResult, name), name
    assert {"started_at", "finished_at"} <= set(TimingInfo.model_fields)
    assert "rewards" in VerifierResult.model_fields
    totals = inspect.signature(TrialResult.compute_token_cost_totals)
    assert list(totals.parameters) == ["self"]


def test_exception_names_we_map_are_harbors() -> None:
    import harbor.trial.errors as trial_errors
    from harbor.models.trial.error_policy import ERROR_POLICIES, FailureCause

    harbors = (SEQUENCE_LENGTH_ERRORS | TIME_LIMIT_ERRORS) - {RESPONSE_LENGTH_ERROR}
    for name in harbors:
        assert name in ERROR_POLICIES, name
    for name in SEQUENCE_LENGTH_ERRORS - {RESPONSE_LENGTH_ERROR}:
        assert ERROR_POLICIES[name].cause is FailureCause.AGENT_EXHAUSTED_BUDGET
    assert hasattr(trial_errors, "AgentTimeoutError")
    assert hasattr(trial_errors, "VerifierTimeoutError")


def test_local_environment_is_a_complete_harbor_environment() -> None:
    from harbor.environments.base import BaseEnvironment
    from harbor.utils.import_path import import_class

    cls = import_class(LOCAL_ENVIRONMENT_IMPORT_PATH, label="environment")
    assert issubclass(cls, BaseEnvironment)
    assert not inspect.isabstract(cls)
    assert cls.type() == LOCAL_ENVIRONMENT_TYPE
    # Harbor's base signatures are the ones we implement
    for method in (
        "exec",
        "upload_file",
        "upload_dir",
        "download_file",
        "download_dir",
        "start",
        "stop",
    ):
        ours = inspect.signature(getattr(cls, method))
        theirs = inspect.signature(getattr(BaseEnvironment, method))
        assert list(ours.parameters) == list(theirs.parameters), method


def test_importing_the_package_imports_no_heavy_library() -> None:
    """Every module imports with harbor, torch, ray, transformers and litellm made unimportable
    (as on a machine without them), and none of them gets imported."""
    modules = [
        "mizzen_rollout.harbor",
        "mizzen_rollout.harbor.agent",
        "mizzen_rollout.harbor.launcher",
        "mizzen_rollout.harbor.local_environment",
        "mizzen_rollout.harbor.namespace_sandbox",
        "mizzen_rollout.harbor.terminus_abort",
        "mizzen_rollout.harbor.__main__",
    ]
    heavy = ("harbor", "torch", "ray", "transformers", "litellm")
    code = (
        "import importlib, sys\n"
        f"for name in {heavy!r}: sys.modules[name] = None\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "from mizzen_rollout.harbor.harnesses import agent_setup\n"
        "agent_setup('terminus-2', model_name='m', sampling_params={'temperature': 1.0},\n"
        "            max_iterations=0, response_too_long='abort')\n"
        "print('imported')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "imported", out.stderr


def test_harbor_resolves_templates_in_agent_env_only(tmp_path: Path, monkeypatch) -> None:
    """Why credentials never go in kwargs, not even as `${VAR}`: Harbor resolves templates in
    `AgentConfig.env` (our engine key path) but hands kwargs to the agent as literal text."""
    from harbor.agents.factory import AgentFactory
    from harbor.models.trial.config import AgentConfig

    monkeypatch.setenv("MIZZEN_CONTRACT_KEY", "resolved-value")
    config = AgentConfig(
        name="terminus-2",
        model_name="openai/x",
        base_url="http://127.0.0.1:9/v1",
        kwargs={
            "llm_kwargs": {"api_key": "${MIZZEN_CONTRACT_KEY}"},
            "record_terminal_session": False,
        },
        env={"MIZZEN_ENGINE_API_KEY": "${MIZZEN_CONTRACT_KEY}"},
    )
    agent = AgentFactory.create_agent_from_config(config, logs_dir=tmp_path)
    assert agent._llm._llm_kwargs["api_key"] == "${MIZZEN_CONTRACT_KEY}"  # not resolved
    assert agent._extra_env["MIZZEN_ENGINE_API_KEY"] == "resolved-value"
    assert "resolved-value" not in config.model_dump_json()  # the config keeps the reference
