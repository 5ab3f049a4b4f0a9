"""Provider credentials: spec table, launcher provisioning, worker resolution, secret hygiene."""

from __future__ import annotations

import dataclasses
import importlib.metadata
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_rollout.harbor.credentials import (
    PROVIDER_SPECS,
    ProviderSpec,
    check_sdk,
    provision_provider,
    resolve_provider_credentials,
)
from mizzen_rollout.harbor.errors import ProviderCredentialError
from mizzen_rollout.harbor.redaction import redact_url

register_cpu_ci(est_time=4, labels=["rollout", "harbor"])

SECRET = "sk-live-0123456789abcdef-SECRET"
SECRET2 = "tok-secret-fedcba9876543210"


def installed_sdk(spec: ProviderSpec) -> ProviderSpec:
    """The same spec, but with an SDK that is installed here (httpx), to reach the success paths.

    The real providers' SDKs are not installed on the CPU image; their absence is tested below.
    """
    version = importlib.metadata.version("httpx")
    return dataclasses.replace(
        spec, sdk_module="httpx", sdk_distribution="httpx", sdk_min_version=version
    )


def specs_with_sdk() -> dict[str, ProviderSpec]:
    return {name: installed_sdk(spec) for name, spec in PROVIDER_SPECS.items()}


class Printed(list[str]):
    def __call__(self, line: str) -> None:
        self.append(line)


# ------------------------------------------------------------------------------ spec table


def test_spec_table_covers_the_required_providers_and_is_complete() -> None:
    assert {"daytona", "e2b", "modal", "runloop"} <= set(PROVIDER_SPECS)
    for name, spec in PROVIDER_SPECS.items():
        assert spec.name == name
        assert spec.key_vars and all(v.isupper() for v in spec.key_vars)
        assert spec.key_file_var and spec.key_file_var not in spec.key_vars
        assert spec.default_key_path.startswith("~/")
        assert spec.sdk_module and spec.sdk_distribution
        assert all(part.isdigit() for part in spec.sdk_min_version.split("."))
        assert spec.address_vars and not set(spec.address_vars) & set(spec.key_vars)
        assert spec.default_endpoint


def test_spec_table_values() -> None:
    assert PROVIDER_SPECS["daytona"].key_vars == ("DAYTONA_API_KEY",)
    assert PROVIDER_SPECS["e2b"].key_vars == ("E2B_API_KEY",)
    assert PROVIDER_SPECS["runloop"].key_vars == ("RUNLOOP_API_KEY",)
    assert PROVIDER_SPECS["modal"].key_vars == ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET")
    assert PROVIDER_SPECS["modal"].key_file_var == "MODAL_CONFIG_PATH"
    assert PROVIDER_SPECS["runloop"].sdk_module == "runloop_api_client"


# ---------------------------------------------------------------------------- launcher side


def test_key_file_path_is_forwarded_never_the_value(tmp_path: Path) -> None:
    key_file = tmp_path / "daytona.key"
    key_file.write_text(SECRET + "\n")
    printed = Printed()
    env = {"DAYTONA_API_KEY_FILE": str(key_file), "HOME": str(tmp_path)}
    forwarded = provision_provider("daytona", env, specs=specs_with_sdk(), echo=printed)
    assert forwarded == {"DAYTONA_API_KEY_FILE": str(key_file.resolve())}
    assert SECRET not in repr(forwarded) and SECRET not in "".join(printed)
    assert str(key_file.resolve()) in printed[0] and "default" in printed[0]


def test_explicit_missing_key_file_is_an_error(tmp_path: Path) -> None:
    env = {"E2B_API_KEY_FILE": str(tmp_path / "nope.key"), "E2B_API_KEY": SECRET}
    with pytest.raises(ProviderCredentialError, match=r"E2B_API_KEY_FILE is set but names no") as e:
        provision_provider("e2b", env, specs=specs_with_sdk(), echo=Printed())
    assert SECRET not in str(e.value)


def test_keys_in_environment_are_assumed_on_workers_and_not_forwarded() -> None:
    printed = Printed()
    env = {"RUNLOOP_API_KEY": SECRET}
    forwarded = provision_provider("runloop", env, specs=specs_with_sdk(), echo=printed)
    assert forwarded == {}
    assert "RUNLOOP_API_KEY" in printed[0] and "assumed set on the workers" in printed[0]
    assert SECRET not in printed[0]


def test_default_key_path_used_when_it_exists(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    default = tmp_path / ".config" / "mizzen" / "e2b.key"
    default.parent.mkdir(parents=True)
    default.write_text(SECRET)
    forwarded = provision_provider("e2b", {}, specs=specs_with_sdk(), echo=Printed())
    assert forwarded == {"E2B_API_KEY_FILE": str(default.resolve())}


def test_nothing_at_all_is_an_error_with_a_hint(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ProviderCredentialError) as error:
        provision_provider("daytona", {}, specs=specs_with_sdk(), echo=Printed())
    message = str(error.value)
    for hint in ("DAYTONA_API_KEY", "DAYTONA_API_KEY_FILE", "~/.config/mizzen/daytona.key"):
        assert hint in message


def test_partial_multi_key_is_an_error() -> None:
    with pytest.raises(ProviderCredentialError, match="MODAL_TOKEN_SECRET"):
        provision_provider(
            "modal", {"MODAL_TOKEN_ID": "ak-1-work"}, specs=specs_with_sdk(), echo=Printed()
        )


def test_modal_config_file(tmp_path: Path) -> None:
    config = tmp_path / "modal.toml"
    config.write_text(
        f'[old]\ntoken_id = "ak-old"\ntoken_secret = "as-old"\n'
        f'[work]\ntoken_id = "ak-1-work"\ntoken_secret = "{SECRET}"\nactive = true\n'
    )
    env = {"MODAL_CONFIG_PATH": str(config)}
    printed = Printed()
    forwarded = provision_provider("modal", env, specs=specs_with_sdk(), echo=printed)
    assert forwarded == {"MODAL_CONFIG_PATH": str(config.resolve())}
    assert SECRET not in "".join(printed)
    assert resolve_provider_credentials("modal", env) == {
        "MODAL_TOKEN_ID": "ak-1-work",
        "MODAL_TOKEN_SECRET": SECRET,
    }
    assert resolve_provider_credentials("modal", {**env, "MODAL_PROFILE": "old"}) == {
        "MODAL_TOKEN_ID": "ak-old",
        "MODAL_TOKEN_SECRET": "as-old",
    }


def test_malformed_key_file_is_refused_without_showing_it(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(f"{SECRET} {SECRET2}\n")
    with pytest.raises(ProviderCredentialError, match="exactly one key") as error:
        provision_provider(
            "e2b", {"E2B_API_KEY_FILE": str(key_file)}, specs=specs_with_sdk(), echo=Printed()
        )
    assert SECRET not in str(error.value) and SECRET2 not in str(error.value)


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("DAYTONA_API_URL", f"https://user:{SECRET}@daytona.example.com/api"),
        ("DAYTONA_API_URL", f"https://{SECRET}@daytona.example.com/api"),
        ("DAYTONA_API_URL", f"https://daytona.example.com/api?api_key={SECRET}"),
        ("DAYTONA_TARGET", f"admin:{SECRET}@eu"),
    ],
)
def test_address_variables_with_credentials_are_refused(variable: str, value: str) -> None:
    env = {"DAYTONA_API_KEY": "k-env-0123", variable: value}
    printed = Printed()
    with pytest.raises(ProviderCredentialError, match=f"{variable}=.*carries credentials") as e:
        provision_provider("daytona", env, specs=specs_with_sdk(), echo=printed)
    assert SECRET not in str(e.value) and not printed


def test_clean_address_variables_are_forwarded_and_printed() -> None:
    env = {
        "DAYTONA_API_KEY": SECRET,
        "DAYTONA_API_URL": "https://daytona.internal:8443/api",
        "DAYTONA_TARGET": "eu",
    }
    printed = Printed()
    forwarded = provision_provider("daytona", env, specs=specs_with_sdk(), echo=printed)
    assert forwarded == {
        "DAYTONA_API_URL": "https://daytona.internal:8443/api",
        "DAYTONA_TARGET": "eu",
    }
    assert "endpoint https://daytona.internal:8443/api (DAYTONA_API_URL)" in printed[0]
    assert SECRET not in printed[0]


def test_default_endpoint_is_printed() -> None:
    printed = Printed()
    provision_provider("e2b", {"E2B_API_KEY": SECRET}, specs=specs_with_sdk(), echo=printed)
    assert "endpoint e2b.app (default)" in printed[0]


def test_redact_url() -> None:
    # the whole query is masked now, not only its password-like values
    assert redact_url("https://u:p@h:1/x?token=abc&b=1") == "https://***@h:1/x?***"
    assert redact_url("u:p@host") == "***@host"


# ------------------------------------------------------------------------------------- SDK


@pytest.mark.parametrize("name", sorted(PROVIDER_SPECS))
def test_real_provider_sdks_are_checked(name: str) -> None:
    spec = PROVIDER_SPECS[name]
    try:
        importlib.metadata.version(spec.sdk_distribution)
    except importlib.metadata.PackageNotFoundError:
        with pytest.raises(ProviderCredentialError, match=rf"harbor\[{spec.harbor_extra}\]"):
            check_sdk(spec)
    else:  # installed somewhere: then the version rule applies
        check_sdk(dataclasses.replace(spec, sdk_min_version="0"))


def test_sdk_below_minimum_is_refused() -> None:
    spec = dataclasses.replace(
        PROVIDER_SPECS["e2b"],
        sdk_module="httpx",
        sdk_distribution="httpx",
        sdk_min_version="999.0",
    )
    with pytest.raises(ProviderCredentialError, match=r"older than the minimum 999\.0"):
        check_sdk(spec)


def test_provision_fails_when_sdk_missing() -> None:
    spec = dataclasses.replace(PROVIDER_SPECS["e2b"], sdk_module="mizzen_no_such_sdk_module")
    with pytest.raises(ProviderCredentialError, match="not importable"):
        provision_provider("e2b", {"E2B_API_KEY": SECRET}, specs={"e2b": spec}, echo=Printed())


# ------------------------------------------------------------------------------ worker side


def test_worker_prefers_the_variable(tmp_path: Path) -> None:
    key_file = tmp_path / "k"
    key_file.write_text("from-file")
    env = {"E2B_API_KEY": "from-env", "E2B_API_KEY_FILE": str(key_file)}
    assert resolve_provider_credentials("e2b", env) == {"E2B_API_KEY": "from-env"}


def test_worker_falls_back_to_the_forwarded_file(tmp_path: Path) -> None:
    key_file = tmp_path / "k"
    key_file.write_text(SECRET + "\n")
    env = {"RUNLOOP_API_KEY_FILE": str(key_file)}
    assert resolve_provider_credentials("runloop", env) == {"RUNLOOP_API_KEY": SECRET}


def test_worker_without_key_gets_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    env = {"DAYTONA_API_KEY_FILE": str(tmp_path / "missing")}
    with pytest.raises(ProviderCredentialError, match="forwards only the key file path"):
        resolve_provider_credentials("daytona", env)


def test_unknown_provider_is_named() -> None:
    with pytest.raises(ProviderCredentialError, match="known providers"):
        provision_provider("docker", {}, echo=Printed())
