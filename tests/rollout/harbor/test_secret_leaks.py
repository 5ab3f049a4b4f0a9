"""Secret leaks reproduced on the old wrapper, each refused or handled now, through the real paths.

Every test drives the public entry points (`provision_provider`, `harbor_env_vars`,
`HarborSettings`, `build_trial_config` building a real Harbor `TrialConfig`,
`resolve_provider_credentials`, the agent function `run_sync` against a scripted engine over real
HTTP on 127.0.0.1, `python -m mizzen_rollout.harbor` as a subprocess) and checks, with the
`leaked` fixture, that the secret appears in no error text, exception chain, `repr()`, worker
variable, printed line, request to the engine or file written.
Invariant of this file: it uses only entry points that existed before the redaction work, so each
test can be run against the old code and fails there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_rollout.harbor import run_sync
from mizzen_rollout.harbor.credentials import (
    PROVIDER_SPECS,
    export_provider_credentials,
    provision_provider,
    resolve_provider_credentials,
)
from mizzen_rollout.harbor.errors import HarborConfigError, ProviderCredentialError
from mizzen_rollout.harbor.harnesses import agent_setup, merge_agent_kwargs
from mizzen_rollout.harbor.launcher import harbor_env_vars
from mizzen_rollout.harbor.local_environment import LOCAL_ENVIRONMENT_IMPORT_PATH
from mizzen_rollout.harbor.settings import ENV_VARS, HarborSettings
from mizzen_rollout.harbor.trial_config import build_trial_config

register_cpu_ci(est_time=6, labels=["rollout", "harbor"])

SECRET = "Q42pw-SECRET-7f3a9c"


class Printed(list[str]):
    def __call__(self, line: str) -> None:
        self.append(line)


@pytest.fixture
def provision(provider_specs) -> Callable[..., Printed]:
    """`provision(variable, value, provider="daytona")`: provision `provider` with
    `variable=value` (and a key in the environment); returns the printed lines."""

    def run(variable: str, value: str, provider: str = "daytona") -> Printed:
        env = {var: "k-env-0123" for var in PROVIDER_SPECS[provider].key_vars} | {variable: value}
        printed = Printed()
        provision_provider(provider, env, specs=provider_specs, echo=printed)
        return printed

    return run


def local_settings(tmp_path: Path, tasks_dir: Path, **overrides) -> HarborSettings:
    values = dict(
        tasks_dir=tasks_dir,
        trials_dir=tmp_path / "trials",
        model_name="mizzen-test-model",
        environment_import_path=LOCAL_ENVIRONMENT_IMPORT_PATH,
    )
    values.update(overrides)
    return HarborSettings(**values)


def launcher_kwargs(tmp_path: Path, tasks_dir: Path, **overrides) -> dict:
    values = dict(
        tasks_dir=tasks_dir,
        trials_dir=tmp_path / "trials",
        model_name="mizzen-test-model",
        environment_import_path=LOCAL_ENVIRONMENT_IMPORT_PATH,
        echo=lambda line: None,
    )
    values.update(overrides)
    return values


# --------------------------------------------------- provider addresses: secret in a component


@pytest.mark.parametrize(
    ("variable", "value", "provider"),
    [
        ("DAYTONA_API_URL", f"https://daytona.example.com/api#token={SECRET}", "daytona"),
        ("DAYTONA_API_URL", f"https://daytona.example.com/api#{SECRET}", "daytona"),
        ("MODAL_SERVER_URL", f"https://api.modal.example/#access_token={SECRET}", "modal"),
        ("RUNLOOP_BASE_URL", f"https://api.runloop.example/v1#sig={SECRET}", "runloop"),
        ("E2B_DOMAIN", f"e2b.example#token={SECRET}", "e2b"),
        ("DAYTONA_TARGET", f"eu#token={SECRET}", "daytona"),
    ],
)
def test_a_secret_in_an_address_fragment_is_refused(
    variable: str, value: str, provider: str, leaked, provision
) -> None:
    with pytest.raises(ProviderCredentialError, match=f"{variable}=.* carries credentials") as e:
        provision(variable, value, provider)
    assert leaked(SECRET, e.value) == []


@pytest.mark.parametrize(
    ("variable", "value", "provider"),
    [
        ("DAYTONA_API_URL", f"https://daytona.example.com/api;token={SECRET}", "daytona"),
        ("DAYTONA_API_URL", f"https://daytona.example.com;api_key={SECRET}/api", "daytona"),
        ("RUNLOOP_BASE_URL", f"https://api.runloop.example/v1;jsessionid={SECRET}", "runloop"),
        ("E2B_DOMAIN", f"e2b.example;token={SECRET}", "e2b"),
        ("DAYTONA_TARGET", f"eu;token={SECRET}", "daytona"),
    ],
)
def test_a_secret_in_address_params_is_refused(
    variable: str, value: str, provider: str, leaked, provision
) -> None:
    with pytest.raises(ProviderCredentialError, match=f"{variable}=") as e:
        provision(variable, value, provider)
    assert leaked(SECRET, e.value) == []


@pytest.mark.parametrize(
    "value",
    [
        f"https://user:{SECRET}\uff20daytona.example.com/api",  # fullwidth commercial at
        f"https://user:{SECRET}\ufe6bdaytona.example.com/api",  # small commercial at
        f"https\uff1a\uff0f\uff0fuser\uff1a{SECRET}\uff20daytona.example.com\uff0fapi",
        f"https://{SECRET}\uff20daytona.example.com/api",
    ],
)
def test_a_fullwidth_at_sign_in_the_userinfo_is_a_clear_refusal(
    value: str, leaked, provision
) -> None:
    with pytest.raises(
        ProviderCredentialError, match=r"DAYTONA_API_URL=.*carries credentials"
    ) as e:
        provision("DAYTONA_API_URL", value)
    assert leaked(SECRET, e.value) == []
    assert "userinfo" in str(e.value)


@pytest.mark.parametrize(
    "value",
    [
        f"//user:{SECRET}@daytona.example.com/api",
        f"https:/user:{SECRET}@daytona.example.com/api",
        f"https:user:{SECRET}@daytona.example.com/api",
        f"https:\\\\user:{SECRET}@daytona.example.com/api",
        f"/user:{SECRET}@daytona.example.com",
        f"HTTPS://user:{SECRET}@daytona.example.com/api",
    ],
)
def test_userinfo_in_odd_url_forms_is_refused_without_the_password(
    value: str, leaked, provision
) -> None:
    with pytest.raises(ProviderCredentialError, match="carries credentials") as e:
        provision("DAYTONA_API_URL", value)
    assert leaked(SECRET, e.value) == []


def test_a_password_with_url_delimiters_never_shows(leaked, provision) -> None:
    """A password holding `/`, `?` or `#` ends the authority early (as clients read it): the
    rest must not be shown as a host, port or path."""
    for password in (f"{SECRET}/x", f"a/{SECRET}", f"{SECRET}?q", f"{SECRET}#f", f"x#{SECRET}"):
        with pytest.raises(ProviderCredentialError) as e:
            provision("DAYTONA_API_URL", f"https://admin:{password}@daytona.example.com/api")
        assert leaked(SECRET, e.value) == [], password


# ------------------------------------------------------------------ malformed addresses


@pytest.mark.parametrize(
    ("variable", "value", "provider", "rule"),
    [
        ("E2B_DOMAIN", "[::1", "e2b", "without its closing"),
        ("DAYTONA_API_URL", "https://[::1/api", "daytona", "without its closing"),
        ("DAYTONA_API_URL", "[::1", "daytona", "no scheme"),
        ("DAYTONA_API_URL", "https://[::zz]/api", "daytona", "not an IPv6 address"),
        ("DAYTONA_API_URL", "https://daytona.example.com:99999/api", "daytona", "port"),
        ("DAYTONA_API_URL", "https://daytona.example.com:0/api", "daytona", "port"),
        ("MODAL_SERVER_URL", "https://api.modal.example:abc", "modal", "port"),
        ("DAYTONA_API_URL", "https://d\u0430ytona.io/api", "daytona", "not ASCII after"),
        ("E2B_DOMAIN", "e2b.\u4f8b\u3048", "e2b", "not ASCII after"),
        ("DAYTONA_API_URL", "ftp://daytona.example.com", "daytona", "not http or https"),
        ("DAYTONA_API_URL", "https://:443/api", "daytona", "host is empty"),
        ("E2B_DOMAIN", "https://e2b.app", "e2b", "write the host alone"),
        ("DAYTONA_TARGET", "eu west", "daytona", "not a plain name"),
        ("DAYTONA_API_URL", "https://daytona.example.com/\x1b[2Japi", "daytona", "control"),
        ("DAYTONA_API_URL", "https://daytona\uff0eexample.com/api", "daytona", "look-alikes"),
    ],
)
def test_a_malformed_address_is_a_clear_credential_error(
    variable: str, value: str, provider: str, rule: str, provision
) -> None:
    with pytest.raises(ProviderCredentialError, match=f"{variable}=") as e:
        provision(variable, value, provider)
    message = str(e.value)
    assert rule in message and "fix:" in message
    assert "\x1b" not in message


def test_clean_addresses_of_every_kind_are_forwarded(provision) -> None:
    for variable, value, provider in (
        ("DAYTONA_API_URL", "https://daytona.internal:8443/api", "daytona"),
        ("DAYTONA_API_URL", "http://[::1]:3000/api", "daytona"),
        ("E2B_DOMAIN", "e2b.internal:8443", "e2b"),
        ("DAYTONA_TARGET", "us-east-1", "daytona"),
    ):
        printed = provision(variable, value, provider)
        assert f"endpoint {value} ({variable})" in printed[0]


# ------------------------------------------------------------ agent kwargs and base_url


@pytest.mark.parametrize(
    "agent_kwargs",
    [
        {"llm_kwargs": [{"api_key": SECRET}]},  # a list of mappings
        {"api_keys": [SECRET]},  # a list under a password-like name
        {"llm_kwargs": {"auth": {"value": SECRET}}},  # text below a password-like name
        {"db": {"passwd": SECRET}},
        {"db": {"Pass": SECRET}},
        {"MY_SECRET": SECRET},
        {"a": [[{"b": [{"x_token": SECRET}]}]]},
        {"llm_kwargs": {"api_key": f"${{{SECRET}}}"}},  # templates are not resolved in kwargs
        {"auth": {SECRET: True}},  # a mapping key under a password-like name is text too
    ],
)
def test_password_like_kwargs_at_any_depth_never_reach_the_workers(
    agent_kwargs: dict, tmp_path: Path, tasks_dir: Path, leaked
) -> None:
    with pytest.raises(HarborConfigError, match="MIZZEN_HARBOR_AGENT_KWARGS") as e:
        harbor_env_vars(**launcher_kwargs(tmp_path, tasks_dir), agent_kwargs=agent_kwargs)
    assert isinstance(e.value, ProviderCredentialError)
    assert leaked(SECRET, e.value) == []
    # the same kwargs as environment kwargs
    with pytest.raises(ProviderCredentialError, match="MIZZEN_HARBOR_ENVIRONMENT_KWARGS") as e:
        harbor_env_vars(**launcher_kwargs(tmp_path, tasks_dir), environment_kwargs=agent_kwargs)
    assert leaked(SECRET, e.value) == []


def test_numbers_and_switches_under_password_like_names_are_fine(
    tmp_path: Path, tasks_dir: Path
) -> None:
    kwargs = {"max_thinking_tokens": 2048, "model_info": {"input_cost_per_token": 0.0}}
    env = harbor_env_vars(**launcher_kwargs(tmp_path, tasks_dir), agent_kwargs=kwargs)
    assert json.loads(env[ENV_VARS["agent_kwargs"]]) == kwargs


def test_settings_repr_masks_kwargs_and_urls(tmp_path: Path, tasks_dir: Path) -> None:
    settings = local_settings(
        tmp_path,
        tasks_dir,
        agent_kwargs={"llm_kwargs": [{"api_key": SECRET}], "api_base": f"http://u:{SECRET}@h/v1"},
        environment_kwargs={"token": SECRET},
        model_name=f"https://u:{SECRET}@models.example/m",
    )
    assert SECRET not in repr(settings) and SECRET not in str(settings)
    assert "'api_key': '***'" in repr(settings)


def test_to_env_refuses_credentials_even_without_validate(tmp_path: Path, tasks_dir: Path) -> None:
    settings = local_settings(tmp_path, tasks_dir, agent_kwargs={"llm_kwargs": [{"token": SECRET}]})
    with pytest.raises(ProviderCredentialError) as e:
        settings.to_env()
    assert SECRET not in str(e.value)


def test_trial_config_json_never_holds_kwargs_credentials(
    tmp_path: Path, tasks_dir: Path, leaked
) -> None:
    """`build_trial_config` checks the merged kwargs itself, whatever the settings went through."""
    for kwargs in ({"llm_kwargs": [{"api_key": SECRET}]}, {"api_base": f"http://u:{SECRET}@h/v1"}):
        settings = local_settings(tmp_path, tasks_dir, agent_kwargs=kwargs)
        with pytest.raises(ProviderCredentialError) as e:
            build_trial_config(
                settings,
                instance_id="write-greeting",
                base_url="http://127.0.0.1:30000/v1",
                sampling_params={},
            )
        assert leaked(SECRET, e.value) == []


@pytest.mark.parametrize(
    "base_url",
    [
        f"http://user:{SECRET}@127.0.0.1:30000/v1",
        f"http://{SECRET}@127.0.0.1:30000/v1",
        f"http://127.0.0.1:30000/v1?api_key={SECRET}",
        f"http://127.0.0.1:30000/v1?{SECRET}",
        f"http://127.0.0.1:30000/v1#{SECRET}",
        f"http://127.0.0.1:30000/v1;token={SECRET}",
        f"http://user:{SECRET}\uff20127.0.0.1:30000/v1",
        f"http:/user:{SECRET}@127.0.0.1:30000/v1",
    ],
)
def test_base_url_credentials_never_reach_the_trial_config(
    base_url: str, tmp_path: Path, tasks_dir: Path, leaked
) -> None:
    settings = local_settings(tmp_path, tasks_dir).validate()
    with pytest.raises(
        ProviderCredentialError, match=r"base_url.*MIZZEN_HARBOR_ENGINE_API_KEY_VAR"
    ) as e:
        build_trial_config(
            settings, instance_id="write-greeting", base_url=base_url, sampling_params={}
        )
    assert leaked(SECRET, e.value) == []


def test_the_designed_engine_key_path_keeps_the_config_clean(
    tmp_path: Path, tasks_dir: Path, monkeypatch
) -> None:
    """Positive control: the engine key by variable name, resolved by Harbor in-process, is in
    neither the repr nor the JSON of the real TrialConfig."""
    monkeypatch.setenv("MIZZEN_TEST_ENGINE_KEY", SECRET)
    settings = local_settings(tmp_path, tasks_dir, engine_api_key_var="MIZZEN_TEST_ENGINE_KEY")
    config, setup = build_trial_config(
        settings.validate(),
        instance_id="write-greeting",
        base_url="http://127.0.0.1:30000/v1",
        sampling_params={"temperature": 0.5},
    )
    assert config.agent.env["MIZZEN_ENGINE_API_KEY"] == "${MIZZEN_TEST_ENGINE_KEY}"
    for text in (repr(config), config.model_dump_json(), repr(setup)):
        assert SECRET not in text


# ------------------------------------------------------------------------------ key files


def test_a_non_utf8_key_file_is_a_clear_error_that_holds_no_key(
    tmp_path: Path, leaked, provider_specs
) -> None:
    key_file = tmp_path / "daytona.key"
    key_file.write_bytes(SECRET.encode() + b"\xff\xfe" + SECRET.encode())
    env = {"DAYTONA_API_KEY_FILE": str(key_file)}
    with pytest.raises(ProviderCredentialError, match=r"DAYTONA_API_KEY_FILE.*not UTF-8") as e:
        provision_provider("daytona", env, specs=provider_specs, echo=Printed())
    assert leaked(SECRET, e.value) == []  # UnicodeDecodeError.object would hold the whole file
    with pytest.raises(ProviderCredentialError, match="not UTF-8") as e:
        resolve_provider_credentials("daytona", env)
    assert leaked(SECRET, e.value) == []


@pytest.mark.parametrize(
    ("content", "rule"),
    [
        (b"", "is empty"),
        (b"  \n\t\n", "is empty"),
        (b"\0" * 64, "characters no key has"),
        (b"sk-\x1b[2Jabc", "characters no key has"),
        ("sk-\u00e9t\u00e9".encode(), "characters no key has"),
    ],
)
def test_an_empty_or_binary_key_file_is_refused(
    tmp_path: Path, content: bytes, rule: str, provider_specs
) -> None:
    key_file = tmp_path / "e2b.key"
    key_file.write_bytes(content)
    env = {"E2B_API_KEY_FILE": str(key_file)}
    with pytest.raises(ProviderCredentialError, match=f"E2B_API_KEY_FILE.*{rule}"):
        provision_provider("e2b", env, specs=provider_specs, echo=Printed())
    with pytest.raises(ProviderCredentialError, match=rule):
        resolve_provider_credentials("e2b", env)


def test_an_unreadable_key_file_is_a_clear_error(tmp_path: Path, provider_specs) -> None:
    # /proc/self/mem is a regular file whose first page cannot be read (EIO), root or not
    env = {"RUNLOOP_API_KEY_FILE": "/proc/self/mem"}
    with pytest.raises(ProviderCredentialError, match=r"RUNLOOP_API_KEY_FILE.*cannot be read"):
        provision_provider("runloop", env, specs=provider_specs, echo=Printed())


def test_a_huge_key_file_is_not_read_whole(tmp_path: Path) -> None:
    key_file = tmp_path / "huge.key"
    with key_file.open("wb") as handle:  # sparse: 2 GiB of nothing
        handle.truncate(2 << 30)
    with pytest.raises(ProviderCredentialError, match="too large for a key file"):
        resolve_provider_credentials("e2b", {"E2B_API_KEY_FILE": str(key_file)})


def test_a_key_pasted_into_the_key_file_variable_is_not_printed(
    tmp_path: Path, leaked, provider_specs
) -> None:
    env = {"DAYTONA_API_KEY_FILE": SECRET}
    with pytest.raises(ProviderCredentialError, match="names no existing file") as e:
        provision_provider("daytona", env, specs=provider_specs, echo=Printed())
    assert leaked(SECRET, e.value) == []
    with pytest.raises(ProviderCredentialError, match="names no existing file") as e:
        resolve_provider_credentials("daytona", env)
    assert leaked(SECRET, e.value) == []


def test_an_unknown_home_in_the_key_file_path_is_a_clear_error(provider_specs) -> None:
    env = {"DAYTONA_API_KEY_FILE": "~mizzen-no-such-user/daytona.key"}
    with pytest.raises(ProviderCredentialError, match="names no existing file"):
        provision_provider("daytona", env, specs=provider_specs, echo=Printed())


def test_resolved_keys_have_a_masked_repr(tmp_path: Path) -> None:
    key_file = tmp_path / "k"
    key_file.write_text(SECRET)
    resolved = resolve_provider_credentials("e2b", {"E2B_API_KEY_FILE": str(key_file)})
    assert resolved == {"E2B_API_KEY": SECRET}  # the value itself is intact
    assert SECRET not in repr(resolved) and SECRET not in str(resolved)


def test_worker_side_address_variables_are_checked_too(tmp_path: Path, monkeypatch) -> None:
    """A worker whose own environment has a credential-bearing address (not one the launcher
    forwarded) refuses it before Harbor's SDK reads it."""
    monkeypatch.setenv("DAYTONA_API_KEY", "k-env-0123")
    monkeypatch.setenv("DAYTONA_API_URL", f"https://user:{SECRET}@daytona.example.com/api")
    with pytest.raises(ProviderCredentialError, match="DAYTONA_API_URL") as e:
        export_provider_credentials("daytona")
    assert SECRET not in str(e.value)


# -------------------------------------------------------- further leaks of the same kind


@pytest.mark.parametrize(
    "agent_kwargs",
    [
        {"llm_call_kwargs": {"extra_headers": [["Authorization", f"Bearer {SECRET}"]]}},
        {"env": [f"OPENAI_API_KEY={SECRET}"]},
        {"api_base": f"https://user:{SECRET}@llm.example/v1"},
        {"llm_kwargs": {"api_base": f"https://llm.example/v1?key={SECRET}"}},
        {"notes": f"see https://llm.example/v1#{SECRET}"},
        {"\uff41\uff50\uff49_\uff4b\uff45\uff59": SECRET},  # fullwidth "api_key"
        {"api\u200b_x": SECRET},  # a zero-width character in the name
    ],
)
def test_credential_shaped_kwargs_under_innocent_names_are_refused(
    agent_kwargs: dict, tmp_path: Path, tasks_dir: Path, leaked
) -> None:
    with pytest.raises(ProviderCredentialError, match="MIZZEN_HARBOR_AGENT_KWARGS") as e:
        harbor_env_vars(**launcher_kwargs(tmp_path, tasks_dir), agent_kwargs=agent_kwargs)
    assert leaked(SECRET, e.value) == []


def test_a_malformed_kwargs_variable_is_not_echoed(tasks_dir: Path, tmp_path: Path, leaked) -> None:
    env = {
        ENV_VARS["tasks_dir"]: str(tasks_dir),
        ENV_VARS["trials_dir"]: str(tmp_path),
        ENV_VARS["model_name"]: "m",
        ENV_VARS["environment_import_path"]: LOCAL_ENVIRONMENT_IMPORT_PATH,
        ENV_VARS["agent_kwargs"]: f'{{"api_key": "{SECRET}"',  # cut short
    }
    with pytest.raises(HarborConfigError, match=r"MIZZEN_HARBOR_AGENT_KWARGS.*not valid JSON") as e:
        HarborSettings.from_env(env)
    assert leaked(SECRET, e.value) == []  # JSONDecodeError.doc would hold the whole text


@pytest.mark.parametrize(
    "override",
    [
        {"model_name": f"https://u:{SECRET}@hub.example/m"},
        {"reward_key": f"Bearer {SECRET}"},
        {"engine_api_key_var": f"sk-{SECRET}"},  # the key given instead of its variable's name
    ],
)
def test_credentials_in_text_settings_are_refused(
    override: dict, tmp_path: Path, tasks_dir: Path, leaked
) -> None:
    with pytest.raises(ProviderCredentialError, match="MIZZEN_HARBOR_") as e:
        harbor_env_vars(**launcher_kwargs(tmp_path, tasks_dir, **override))
    assert leaked(SECRET, e.value) == []


def test_harbor_validation_errors_do_not_echo_input_values(
    tmp_path: Path, tasks_dir: Path, leaked
) -> None:
    """pydantic's error text repeats the offending input; ours names the field only."""
    settings = local_settings(tmp_path, tasks_dir, agent_timeout_s=SECRET)  # never validated
    with pytest.raises(HarborConfigError, match="override_timeout_sec") as e:
        build_trial_config(
            settings,
            instance_id="write-greeting",
            base_url="http://127.0.0.1:30000/v1",
            sampling_params={},
        )
    assert leaked(SECRET, e.value) == []


def test_agent_setup_repr_masks_its_kwargs() -> None:
    setup = agent_setup(
        "terminus-2",
        model_name="m",
        sampling_params={"temperature": 0.5},
        max_iterations=None,
        response_too_long="abort",
    )
    merge_agent_kwargs(setup, {"llm_kwargs": {"api_key": SECRET}})
    assert setup.kwargs["llm_kwargs"]["api_key"] == SECRET  # the value is untouched
    assert SECRET not in repr(setup)


def test_a_credential_base_url_never_reaches_the_engine(
    tmp_path: Path, tasks_dir: Path, fake_engine, terminus_reply, leaked
) -> None:
    """Through the agent function, over real HTTP on 127.0.0.1: the engine receives nothing and
    no trial directory (config.json, logs) is written."""
    engine = fake_engine(replies=[terminus_reply("", task_complete=True)])
    host = engine.base_url.removeprefix("http://")
    settings = local_settings(tmp_path, tasks_dir)
    for base_url in (f"http://user:{SECRET}@{host}", f"{engine.base_url}?api_key={SECRET}"):
        with pytest.raises(ProviderCredentialError, match="base_url") as e:
            run_sync(base_url, None, {}, {"instance_id": "write-greeting"}, settings=settings)
        assert leaked(SECRET, e.value) == []
    assert engine.requests == []
    assert not (tmp_path / "trials").exists() or not any((tmp_path / "trials").iterdir())


def test_a_worker_refuses_credentials_put_into_its_variables(
    tmp_path: Path, tasks_dir: Path, monkeypatch, leaked
) -> None:
    """Worker variables set by hand (not by harbor_env_vars) go through the same checks."""
    env = harbor_env_vars(**launcher_kwargs(tmp_path, tasks_dir))
    env[ENV_VARS["agent_kwargs"]] = json.dumps({"llm_kwargs": [{"api_key": SECRET}]})
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    with pytest.raises(ProviderCredentialError, match="MIZZEN_HARBOR_AGENT_KWARGS") as e:
        run_sync("http://127.0.0.1:9/v1", None, {}, {"instance_id": "write-greeting"})
    assert leaked(SECRET, e.value) == []


def test_the_command_line_refuses_a_credential_base_url_without_printing_it(
    tmp_path: Path, tasks_dir: Path
) -> None:
    """`python -m mizzen_rollout.harbor run-trial`, a real subprocess: exit 2, a message naming
    base_url, the password nowhere in its output or in any file it wrote."""
    trials = tmp_path / "trials"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mizzen_rollout.harbor",
            "run-trial",
            "--tasks-dir",
            str(tasks_dir),
            "--task",
            "write-greeting",
            "--agent",
            "terminus-2",
            "--trials-dir",
            str(trials),
            "--base-url",
            f"http://user:{SECRET}@127.0.0.1:9/v1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
    )
    assert result.returncode == 2, result.stderr
    assert "configuration error: base_url" in result.stderr
    assert SECRET not in result.stdout + result.stderr
    written = [p for p in trials.rglob("*") if p.is_file()] if trials.exists() else []
    assert [p for p in written if SECRET.encode() in p.read_bytes()] == []


# ------------------------------------- keys named beside them, not above them (issue 31 probe)


@pytest.mark.parametrize(
    "agent_kwargs",
    [
        {"env": [{"name": "OPENAI_API_KEY", "value": SECRET}]},
        {"headers": [{"header": "X-Api-Key", "value": SECRET}]},
        {"llm_call_kwargs": {"extra_headers": [["X-Api-Key", SECRET]]}},
        {"extra_headers": [("Cookie", SECRET)]},
        {"args": ["--model", "m", "--api-key", SECRET]},
        {"args": ["--model", "m", f"--api-key={SECRET}"]},
        {"command": f'export OPENAI_API_KEY="{SECRET}" && run-agent'},
        {"notes": f'{{"api_key": "{SECRET}"}}'},
    ],
)
def test_a_key_named_beside_it_never_reaches_the_workers(
    agent_kwargs: dict, tmp_path: Path, tasks_dir: Path, leaked
) -> None:
    with pytest.raises(ProviderCredentialError, match="MIZZEN_HARBOR_AGENT_KWARGS") as e:
        harbor_env_vars(**launcher_kwargs(tmp_path, tasks_dir), agent_kwargs=agent_kwargs)
    assert leaked(SECRET, e.value) == []


def test_innocent_pairs_and_lists_are_forwarded(tmp_path: Path, tasks_dir: Path) -> None:
    kwargs = {
        "env": [{"name": "MODEL", "value": "m-1"}],
        "args": ["--max-tokens", 256, "--model", "m"],
        "tools": ["read_token_count", "bash", "edit"],  # (a two-item list is a name/value pair)
    }
    env = harbor_env_vars(**launcher_kwargs(tmp_path, tasks_dir), agent_kwargs=kwargs)
    assert json.loads(env[ENV_VARS["agent_kwargs"]]) == kwargs


@pytest.mark.parametrize(
    "value",
    [
        "ghp_16C7e42F292c6912E7710c838347Ae178B4a",  # identifier-shaped tokens
        "sk_live_51HxYzAbCdEfGhIjKlMnOpQr",
        "AKIAIOSFODNN7EXAMPLE",
        "xoxb_1234567890_abcdefghij",
        "a1b2c3d4e5f6a7b8c9d0",
    ],
)
def test_a_token_given_as_engine_api_key_var_is_refused_unrepeated(
    value: str, tmp_path: Path, tasks_dir: Path, leaked
) -> None:
    with pytest.raises(ProviderCredentialError, match="engine_api_key_var") as e:
        harbor_env_vars(**launcher_kwargs(tmp_path, tasks_dir, engine_api_key_var=value))
    assert leaked(value, e.value) == []


def test_the_value_of_a_key_variable_is_refused_as_its_name(
    tmp_path: Path, tasks_dir: Path, monkeypatch, leaked
) -> None:
    """A key in variable-name shape is still the key when a password-like variable holds it."""
    key = "ENGINE_KEY_" + "ABC"  # built, so the traceback's source lines do not show it
    monkeypatch.setenv("MIZZEN_TEST_ENGINE_KEY", key)
    with pytest.raises(ProviderCredentialError, match="engine_api_key_var") as e:
        harbor_env_vars(**launcher_kwargs(tmp_path, tasks_dir, engine_api_key_var=key))
    assert leaked(key, e.value) == []
    env = harbor_env_vars(
        **launcher_kwargs(tmp_path, tasks_dir, engine_api_key_var="MIZZEN_TEST_ENGINE_KEY")
    )
    assert env[ENV_VARS["engine_api_key_var"]] == "MIZZEN_TEST_ENGINE_KEY"
