"""Sandbox-provider credentials: provisioned on the launcher, resolved on the workers.

`PROVIDER_SPECS` is the one table of what each known provider (Harbor environment type) needs;
`provision_provider` (launcher side) and `resolve_provider_credentials` (worker side) read it.

Invariants:
- A key VALUE never leaves the process that read it: the launcher forwards the key FILE PATH to
  workers (runtime environments are logged in plain text), never the key. Keys already in the
  launcher's environment are assumed present in the workers' environment and are not forwarded.
- An explicitly given key file (`<key_file_var>`) that does not exist is an error; the default key
  path is used only when it exists. No key at all is an error with a hint on how to provide one.
- Address variables (endpoints, regions) are forwarded by value, but refused when they carry
  credentials (`user:pass@host`, `token@host`, `?api_key=...`).
- The provider's SDK must import at its minimum version before anything is forwarded.
- Printed lines name the source of the key (variable or file path) and the endpoint in effect,
  never a secret; error messages likewise.
- Worker side: the key comes from the variable, else the key file (`<key_file_var>` or the default
  path), else a clear error.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import parse_qsl, urlsplit

from mizzen_rollout.harbor.errors import ProviderCredentialError

KeyFileFormat = Literal["raw", "modal-toml"]

_LOG_PREFIX = "[mizzen-harbor]"
_SENSITIVE_QUERY_KEY = re.compile(r"key|secret|token|passw|auth|sig|credential", re.IGNORECASE)


@dataclass(frozen=True)
class ProviderSpec:
    """What one sandbox provider needs.

    Fields:
        name: the Harbor `EnvironmentType` value.
        key_vars: the variables that carry the key (all required; modal has two).
        key_file_var: the variable naming a key file; this path is what workers receive.
        default_key_path: the key file used when neither the variables nor key_file_var are set
            (`~` is expanded; used only if it exists).
        key_file_format: `raw` (the file holds the key) or `modal-toml` (modal's own config file,
            profile from MODAL_PROFILE, else the active one, else the only one).
        sdk_module / sdk_distribution / sdk_min_version: the SDK Harbor's environment imports.
        address_vars: endpoint/region variables forwarded by value (credential-free only).
        default_endpoint: what is in effect when no address variable is set.
        harbor_extra: the `harbor[...]` extra that installs the SDK.
    """

    name: str
    key_vars: tuple[str, ...]
    key_file_var: str
    default_key_path: str
    key_file_format: KeyFileFormat
    sdk_module: str
    sdk_distribution: str
    sdk_min_version: str
    address_vars: tuple[str, ...]
    default_endpoint: str
    harbor_extra: str


PROVIDER_SPECS: dict[str, ProviderSpec] = {
    spec.name: spec
    for spec in (
        ProviderSpec(
            name="daytona",
            key_vars=("DAYTONA_API_KEY",),
            key_file_var="DAYTONA_API_KEY_FILE",
            default_key_path="~/.config/mizzen/daytona.key",
            key_file_format="raw",
            sdk_module="daytona",
            sdk_distribution="daytona",
            sdk_min_version="0.210.0",
            address_vars=("DAYTONA_API_URL", "DAYTONA_TARGET"),
            default_endpoint="https://app.daytona.io/api",
            harbor_extra="daytona",
        ),
        ProviderSpec(
            name="e2b",
            key_vars=("E2B_API_KEY",),
            key_file_var="E2B_API_KEY_FILE",
            default_key_path="~/.config/mizzen/e2b.key",
            key_file_format="raw",
            sdk_module="e2b",
            sdk_distribution="e2b",
            sdk_min_version="2.25.0",
            address_vars=("E2B_DOMAIN",),
            default_endpoint="e2b.app",
            harbor_extra="e2b",
        ),
        ProviderSpec(
            name="modal",
            key_vars=("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET"),
            key_file_var="MODAL_CONFIG_PATH",
            default_key_path="~/.modal.toml",
            key_file_format="modal-toml",
            sdk_module="modal",
            sdk_distribution="modal",
            sdk_min_version="1.5.4",
            address_vars=("MODAL_SERVER_URL",),
            default_endpoint="https://api.modal.com",
            harbor_extra="modal",
        ),
        ProviderSpec(
            name="runloop",
            key_vars=("RUNLOOP_API_KEY",),
            key_file_var="RUNLOOP_API_KEY_FILE",
            default_key_path="~/.config/mizzen/runloop.key",
            key_file_format="raw",
            sdk_module="runloop_api_client",
            sdk_distribution="runloop-api-client",
            sdk_min_version="1.23.2",
            address_vars=("RUNLOOP_BASE_URL",),
            default_endpoint="https://api.runloop.ai",
            harbor_extra="runloop",
        ),
    )
}


def _spec(name: str, specs: Mapping[str, ProviderSpec]) -> ProviderSpec:
    try:
        return specs[name]
    except KeyError:
        raise ProviderCredentialError(
            f"no credential spec for provider {name!r}; known providers: {sorted(specs)}. "
            "Unknown environment types are passed through by harbor_env_vars instead."
        ) from None


# ------------------------------------------------------------------------------ key files


def read_key_file(spec: ProviderSpec, path: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """The key variables' values from a key file; errors name the file, never its content."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ProviderCredentialError(
            f"{spec.name}: cannot read key file {path} ({exc.strerror}); make it readable by "
            "the launcher and the workers, or set "
            f"{' and '.join(spec.key_vars)} instead."
        ) from None
    if spec.key_file_format == "raw":
        key = text.strip()
        if not key or len(key.split()) != 1:
            raise ProviderCredentialError(
                f"{spec.name}: key file {path} must hold exactly one key (one token, no spaces); "
                "write only the key into it."
            )
        return {spec.key_vars[0]: key}
    return _read_modal_toml(spec, path, text, environ)


def _read_modal_toml(
    spec: ProviderSpec, path: Path, text: str, environ: Mapping[str, str]
) -> dict[str, str]:
    try:
        profiles = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        raise ProviderCredentialError(
            f"{spec.name}: {path} is not valid TOML; recreate it with `modal token new`."
        ) from None
    tables = {name: table for name, table in profiles.items() if isinstance(table, dict)}
    wanted = environ.get("MODAL_PROFILE")
    if wanted:
        chosen = tables.get(wanted)
        where = f"profile {wanted!r} (MODAL_PROFILE)"
    else:
        active = [table for table in tables.values() if table.get("active")]
        chosen = (
            active[0] if active else (next(iter(tables.values())) if len(tables) == 1 else None)
        )
        where = "the active profile"
    if chosen is None:
        raise ProviderCredentialError(
            f"{spec.name}: {path} has no {where} (profiles: {sorted(tables)}); set MODAL_PROFILE "
            "or run `modal profile activate <name>`."
        )
    missing = [field for field in ("token_id", "token_secret") if not chosen.get(field)]
    if missing:
        raise ProviderCredentialError(
            f"{spec.name}: {where} in {path} lacks {missing}; recreate it with `modal token new`."
        )
    return {
        "MODAL_TOKEN_ID": str(chosen["token_id"]),
        "MODAL_TOKEN_SECRET": str(chosen["token_secret"]),
    }


# ------------------------------------------------------------------------------ addresses


def redact_address(value: str) -> str:
    """`value` with any userinfo and sensitive query values replaced by `***`."""
    if "://" not in value:
        return re.sub(r"^[^@/]*@", "***@", value)
    parts = urlsplit(value)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    query = "&".join(
        f"{key}=***" if _SENSITIVE_QUERY_KEY.search(key) else f"{key}={val}"
        for key, val in parse_qsl(parts.query, keep_blank_values=True)
    )
    rebuilt = f"{parts.scheme}://{netloc}{parts.path}"
    return f"{rebuilt}?{query}" if query else rebuilt


def check_address(spec: ProviderSpec, variable: str, value: str) -> str:
    """Return `value` if it carries no credentials; raise otherwise (without echoing them)."""
    carries = False
    if "://" in value:
        parts = urlsplit(value)
        carries = "@" in parts.netloc or any(
            _SENSITIVE_QUERY_KEY.search(key) for key, _ in parse_qsl(parts.query)
        )
    else:
        carries = "@" in value
    if carries:
        raise ProviderCredentialError(
            f"{spec.name}: {variable}={redact_address(value)} carries credentials; address "
            "variables are forwarded to workers in plain text, so they may hold only "
            "scheme://host[:port]/path. Pass the key through "
            f"{' and '.join(spec.key_vars)} or a key file named by {spec.key_file_var}."
        )
    return value


# ------------------------------------------------------------------------------------ SDK


def _version_tuple(version: str) -> tuple[int, ...]:
    numbers = []
    for part in version.split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        numbers.append(int(digits.group()))
    return tuple(numbers)


def check_sdk(spec: ProviderSpec) -> str:
    """The installed SDK version; raises unless it imports at `sdk_min_version` or newer."""
    hint = f"install it with `pip install 'harbor[{spec.harbor_extra}]'` (or `uv sync` with it)"
    if importlib.util.find_spec(spec.sdk_module) is None:
        raise ProviderCredentialError(
            f"{spec.name}: its SDK module {spec.sdk_module!r} is not importable; {hint}."
        )
    try:
        installed = importlib.metadata.version(spec.sdk_distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ProviderCredentialError(
            f"{spec.name}: distribution {spec.sdk_distribution!r} is not installed; {hint}."
        ) from None
    if _version_tuple(installed) < _version_tuple(spec.sdk_min_version):
        raise ProviderCredentialError(
            f"{spec.name}: {spec.sdk_distribution} {installed} is older than the minimum "
            f"{spec.sdk_min_version}; upgrade: {hint}."
        )
    return installed


# -------------------------------------------------------------------------- launcher side


def _missing_key_hint(spec: ProviderSpec) -> str:
    variables = " and ".join(spec.key_vars)
    return (
        f"{spec.name}: no credentials. Provide them one of three ways: (1) set {variables} in "
        "the environment of the launcher AND of every worker; (2) write the key to a file "
        f"readable on every worker and set {spec.key_file_var}=/path/to/file (only the path is "
        f"forwarded); (3) create {spec.default_key_path}."
    )


def provision_provider(
    name: str,
    environ: Mapping[str, str] | None = None,
    *,
    specs: Mapping[str, ProviderSpec] = PROVIDER_SPECS,
    echo: Callable[[str], None] = print,
) -> dict[str, str]:
    """Check a provider's credentials on the launcher; return the variables to forward to workers.

    The result holds at most the key FILE path (`key_file_var`) and the credential-free address
    variables; never a key value. Raises ProviderCredentialError with the fix on any problem.
    """
    spec = _spec(name, specs)
    env = os.environ if environ is None else environ
    forward: dict[str, str] = {}

    explicit_file = env.get(spec.key_file_var, "").strip()
    key_file: Path | None = None
    if explicit_file:
        key_file = Path(explicit_file).expanduser()
        if not key_file.is_file():
            raise ProviderCredentialError(
                f"{spec.name}: {spec.key_file_var}={key_file} does not exist (or is not a file); "
                "fix the path, or unset it to use "
                f"{' and '.join(spec.key_vars)} or {spec.default_key_path}."
            )
        key_file = key_file.resolve()
        read_key_file(spec, key_file, env)  # validates the content; the values are dropped

    present = [var for var in spec.key_vars if env.get(var, "").strip()]
    if present and len(present) != len(spec.key_vars):
        missing = [var for var in spec.key_vars if var not in present]
        raise ProviderCredentialError(
            f"{spec.name}: {present} set but {missing} missing; set all of {list(spec.key_vars)} "
            f"or none (and use {spec.key_file_var})."
        )
    if present:
        source = f"environment ({', '.join(spec.key_vars)}; assumed set on the workers too)"
    else:
        if key_file is None:
            default = Path(spec.default_key_path).expanduser()
            if not default.is_file():
                raise ProviderCredentialError(_missing_key_hint(spec))
            key_file = default.resolve()
            read_key_file(spec, key_file, env)
        forward[spec.key_file_var] = str(key_file)
        source = f"file {key_file} (forwarded as {spec.key_file_var})"

    endpoint = f"{spec.default_endpoint} (default)"
    for variable in spec.address_vars:
        value = env.get(variable, "").strip()
        if value:
            forward[variable] = check_address(spec, variable, value)
            if endpoint.endswith("(default)"):
                endpoint = f"{value} ({variable})"

    version = check_sdk(spec)
    echo(
        f"{_LOG_PREFIX} {spec.name}: key from {source}; endpoint {endpoint}; "
        f"SDK {spec.sdk_distribution} {version}"
    )
    return forward


# ---------------------------------------------------------------------------- worker side


def resolve_provider_credentials(
    name: str,
    environ: Mapping[str, str] | None = None,
    *,
    specs: Mapping[str, ProviderSpec] = PROVIDER_SPECS,
) -> dict[str, str]:
    """The key variables' values on a worker: from the variables, else the key file, else error.

    The returned dict holds secrets: put it into the process environment (see
    `export_provider_credentials`), never into a log, a config or a runtime environment.
    """
    spec = _spec(name, specs)
    env = os.environ if environ is None else environ
    values = {var: env.get(var, "").strip() for var in spec.key_vars}
    if all(values.values()):
        return values
    explicit = env.get(spec.key_file_var, "").strip()
    path = Path(explicit or spec.default_key_path).expanduser()
    if not path.is_file():
        origin = f"{spec.key_file_var}={path}" if explicit else f"default key file {path}"
        raise ProviderCredentialError(
            f"{spec.name}: on this worker {' and '.join(spec.key_vars)} are not set and the "
            f"{origin} does not exist. The launcher forwards only the key file path: make that "
            "file exist on every worker (shared filesystem or image), or set the variables in "
            "the workers' environment."
        )
    return read_key_file(spec, path, env)


def export_provider_credentials(
    name: str, *, specs: Mapping[str, ProviderSpec] = PROVIDER_SPECS
) -> list[str]:
    """Resolve the keys on this worker and set them in `os.environ` (where Harbor's environment
    and the SDK read them); returns the variable NAMES set."""
    values = resolve_provider_credentials(name, specs=specs)
    for variable, value in values.items():
        os.environ[variable] = value
    return sorted(values)
