"""Sandbox-provider credentials: provisioned on the launcher, resolved on the workers.

`PROVIDER_SPECS` is the one table of what each known provider (Harbor environment type) needs;
`provision_provider` (launcher side) and `resolve_provider_credentials` (worker side) read it.

Invariants:
- A key VALUE never leaves the process that read it: the launcher forwards the key FILE PATH to
  workers (runtime environments are logged in plain text), never the key. Keys already in the
  launcher's environment are assumed present in the workers' environment and are not forwarded.
- An explicitly given key file (`<key_file_var>`) that does not exist is an error, and its value
  is not repeated (a key pasted into the path variable must not be printed); the default key path
  is used only when it exists. No key at all is an error with a hint on how to provide one.
- A key file is read bounded (`MAX_KEY_FILE_BYTES`), as UTF-8, and must hold one key of printable
  ASCII; unreadable, too large, not UTF-8, empty or malformed files are errors naming the
  variable and the path, never the content (and never chained to an exception that holds it).
- Address variables (endpoints, regions) are forwarded by value only after `addresses.check_address`
  for their kind (`ProviderSpec.address_vars`), on the launcher and again on the worker: no
  userinfo, query, `;params` or fragment; a valid host and port.
- The provider's SDK must import at its minimum version before anything is forwarded.
- Printed lines name the source of the key (variable or file path) and the endpoint in effect
  (in its `redact_url` form), never a secret; error messages likewise.
- Every error here is a `ProviderCredentialError`.
- Worker side: the key comes from the variable, else the key file (`<key_file_var>` or the default
  path), else a clear error. Resolved values are `redaction.Secret`s (their `repr()` is masked).
- Every key value read here (variables on the launcher and the workers, key files) is registered
  in the process-wide mask set (`mizzen_rollout.masking.register_secret`) as it is read, so no
  output of the process shows it; a key shorter than `masking.MIN_SECRET_LENGTH` is refused
  (ProviderCredentialError naming the variable or file, never the value).
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
from typing import Literal, NoReturn

from mizzen_rollout.harbor.addresses import FORMS, AddressKind, check_address
from mizzen_rollout.harbor.errors import ProviderCredentialError
from mizzen_rollout.harbor.redaction import Secret, redact_url, shown
from mizzen_rollout.masking import SecretError, register_secret

KeyFileFormat = Literal["raw", "modal-toml"]

_LOG_PREFIX = "[mizzen-harbor]"
#: the largest key file read (keys are short; modal's config file holds a few profiles)
MAX_KEY_FILE_BYTES = 64 * 1024
_KEY_CHARACTERS = re.compile(r"[\x21-\x7e]+")


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
        address_vars: endpoint/region variable -> its kind (`addresses.FORMS`), forwarded by
            value once checked.
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
    address_vars: Mapping[str, AddressKind]
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
            address_vars={"DAYTONA_API_URL": "url", "DAYTONA_TARGET": "name"},
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
            address_vars={"E2B_DOMAIN": "host"},
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
            address_vars={"MODAL_SERVER_URL": "url"},
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
            address_vars={"RUNLOOP_BASE_URL": "url"},
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
            f"no credential spec for provider {shown(name)}; known providers: {sorted(specs)}. "
            "Unknown environment types are passed through by harbor_env_vars instead."
        ) from None


# ------------------------------------------------------------------------------ key files


def register_keys(spec: ProviderSpec, values: Mapping[str, str], origin: str) -> None:
    """Register every key value in the mask set; ProviderCredentialError if one cannot be."""
    for variable, value in values.items():
        problem = ""
        try:
            register_secret(value, source=f"{spec.name}: {variable} ({origin})")
        except SecretError as exc:
            problem = str(exc)
        if problem:
            raise ProviderCredentialError(problem)


def _key_file_error(spec: ProviderSpec, path: Path, origin: str, problem: str) -> NoReturn:
    raise ProviderCredentialError(
        f"{spec.name}: the key file {path} ({origin}) {problem}; fix: write only the key into "
        f"it (UTF-8 text, one line), make it readable by the launcher and every worker, or set "
        f"{' and '.join(spec.key_vars)} instead."
    )


def _read_text(path: Path) -> tuple[str | None, str]:
    """The file's text, or None and why not (without any of its content)."""
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        return None, f"cannot be read ({exc.strerror or type(exc).__name__})"
    if len(data) > MAX_KEY_FILE_BYTES:
        return None, f"is larger than {MAX_KEY_FILE_BYTES} bytes, too large for a key file"
    try:
        return data.decode("utf-8-sig"), ""
    except UnicodeDecodeError as exc:  # exc.object is the whole file: only its offset leaves
        return None, f"is not UTF-8 text (undecodable byte at offset {exc.start})"


def _check_key(value: object) -> str | None:
    """Why `value` cannot be a key, or None."""
    if not isinstance(value, str):
        return "is not a text value"
    if not value.strip():
        return "is empty"
    if len(value.split()) != 1:
        return "must hold exactly one key (one token, no spaces)"
    if not _KEY_CHARACTERS.fullmatch(value.strip()):
        return "holds characters no key has (control or non-ASCII characters)"
    return None


def read_key_file(
    spec: ProviderSpec, path: Path, environ: Mapping[str, str], *, origin: str
) -> dict[str, Secret]:
    """The key variables' values from a key file; errors name the file and `origin` (the
    variable that named it, or "default key file"), never its content."""
    text, problem = _read_text(path)
    if text is None:
        _key_file_error(spec, path, origin, problem)
    if spec.key_file_format == "raw":
        problem = _check_key(text)
        if problem is not None:
            _key_file_error(spec, path, origin, problem)
        keys = {spec.key_vars[0]: Secret(text.strip())}
    else:
        keys = _read_modal_toml(spec, path, text, environ, origin)
    register_keys(spec, keys, f"the key file {path}")
    return keys


def _read_modal_toml(
    spec: ProviderSpec, path: Path, text: str, environ: Mapping[str, str], origin: str
) -> dict[str, Secret]:
    position = ""
    try:
        profiles = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        found = re.search(r"\(at (line \d+, column \d+)\)", str(exc))
        position, profiles = (found.group(1) if found else ""), None
    if profiles is None:  # raised here, outside the except: the decode error holds the text
        raise ProviderCredentialError(
            f"{spec.name}: {path} ({origin}) is not valid TOML"
            f"{f' ({position})' if position else ''}; recreate it with `modal token new`."
        )
    tables = {name: table for name, table in profiles.items() if isinstance(table, dict)}
    wanted = environ.get("MODAL_PROFILE")
    if wanted:
        chosen = tables.get(wanted)
        where = f"profile {shown(wanted)} (MODAL_PROFILE)"
    else:
        active = [table for table in tables.values() if table.get("active")]
        chosen = (
            active[0] if active else (next(iter(tables.values())) if len(tables) == 1 else None)
        )
        where = "the active profile"
    if chosen is None:
        raise ProviderCredentialError(
            f"{spec.name}: {path} ({origin}) has no {where} (profiles: "
            f"{shown(sorted(tables))}); set MODAL_PROFILE or run `modal profile activate <name>`."
        )
    missing = [field for field in ("token_id", "token_secret") if not chosen.get(field)]
    if missing:
        raise ProviderCredentialError(
            f"{spec.name}: {where} in {path} ({origin}) lacks {missing}; recreate it with "
            "`modal token new`."
        )
    for field in ("token_id", "token_secret"):
        problem = _check_key(chosen[field])
        if problem is not None:
            raise ProviderCredentialError(
                f"{spec.name}: {field} of {where} in {path} ({origin}) {problem}; recreate it "
                "with `modal token new`."
            )
    return {
        "MODAL_TOKEN_ID": Secret(chosen["token_id"].strip()),
        "MODAL_TOKEN_SECRET": Secret(chosen["token_secret"].strip()),
    }


def _expanded(raw: str) -> Path | None:
    """`raw` with `~` expanded; None when it cannot be (an unknown `~user`)."""
    try:
        return Path(raw).expanduser()
    except RuntimeError:
        return None


def _not_a_file_hint(spec: ProviderSpec) -> str:
    return (
        f"{spec.key_file_var} is set but names no existing file (its value is not repeated "
        "here: it must be a PATH to a file holding the key, and if the key itself was put "
        "there it must not be printed)"
    )


# ------------------------------------------------------------------------------ addresses


def _address_fix(spec: ProviderSpec, kind: AddressKind) -> str:
    return (
        f"address variables reach the workers in plain text (runtime environments are logged), "
        f"so write only {FORMS[kind]} there, and pass the key through "
        f"{' and '.join(spec.key_vars)} or a key file named by {spec.key_file_var}"
    )


def check_provider_addresses(spec: ProviderSpec, environ: Mapping[str, str]) -> dict[str, str]:
    """The provider's address variables set in `environ`, each checked for its kind; raises
    ProviderCredentialError (showing only the redacted value) otherwise."""
    checked: dict[str, str] = {}
    for variable, kind in spec.address_vars.items():
        value = environ.get(variable, "")
        if value.strip():
            checked[variable] = check_address(
                value,
                kind=kind,
                field=f"{spec.name}: {variable}",
                fix=_address_fix(spec, kind),
            )
    return checked


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
        key_file = _expanded(explicit_file)
        if key_file is None or not key_file.is_file():
            raise ProviderCredentialError(
                f"{spec.name}: {_not_a_file_hint(spec)}; fix: check it with "
                f'`ls -l "${spec.key_file_var}"`, or unset it to use '
                f"{' and '.join(spec.key_vars)} or {spec.default_key_path}."
            )
        key_file = key_file.resolve()
        read_key_file(spec, key_file, env, origin=spec.key_file_var)  # content checked, dropped

    present = [var for var in spec.key_vars if env.get(var, "").strip()]
    if present and len(present) != len(spec.key_vars):
        missing = [var for var in spec.key_vars if var not in present]
        raise ProviderCredentialError(
            f"{spec.name}: {present} set but {missing} missing; set all of {list(spec.key_vars)} "
            f"or none (and use {spec.key_file_var})."
        )
    if present:
        register_keys(spec, {var: env[var].strip() for var in present}, "environment")
        source = f"environment ({', '.join(spec.key_vars)}; assumed set on the workers too)"
    else:
        if key_file is None:
            default = _expanded(spec.default_key_path)
            if default is None or not default.is_file():
                raise ProviderCredentialError(_missing_key_hint(spec))
            key_file = default.resolve()
            read_key_file(spec, key_file, env, origin="default key file")
        forward[spec.key_file_var] = str(key_file)
        source = f"file {key_file} (forwarded as {spec.key_file_var})"

    addresses = check_provider_addresses(spec, env)
    forward.update(addresses)
    endpoint = f"{spec.default_endpoint} (default)"
    if addresses:
        variable, value = next(iter(addresses.items()))
        endpoint = f"{redact_url(value)} ({variable})"

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
        register_keys(spec, values, "environment")
        return {var: Secret(value) for var, value in values.items()}
    explicit = env.get(spec.key_file_var, "").strip()
    path = _expanded(explicit or spec.default_key_path)
    if path is None or not path.is_file():
        origin = _not_a_file_hint(spec) if explicit else f"the default key file {path} is missing"
        raise ProviderCredentialError(
            f"{spec.name}: on this worker {' and '.join(spec.key_vars)} are not set and {origin}. "
            "The launcher forwards only the key file path: make that file exist on every worker "
            "(shared filesystem or image), or set the variables in the workers' environment."
        )
    return read_key_file(
        spec, path, env, origin=spec.key_file_var if explicit else "default key file"
    )


def export_provider_credentials(
    name: str, *, specs: Mapping[str, ProviderSpec] = PROVIDER_SPECS
) -> list[str]:
    """Check the address variables of this worker, resolve the keys and set them in `os.environ`
    (where Harbor's environment and the SDK read them); returns the variable NAMES set."""
    check_provider_addresses(_spec(name, specs), os.environ)
    values = resolve_provider_credentials(name, specs=specs)
    for variable, value in values.items():
        os.environ[variable] = value
    return sorted(values)
