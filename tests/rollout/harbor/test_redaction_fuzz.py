"""Property tests: generated secrets never show up in anything the wrapper produces.

Secrets are one to three chunks `Q<2 digits><5-9 of A-Z0-9>` (a shape no fixed text here has)
joined by URL delimiters and their NFKC look-alikes (`@ : / ? # ; & =` and fullwidth or small
forms); a test fails if ANY chunk shows up, so a secret split by a delimiter cannot leak by
halves. They are placed in the userinfo (user, password), the query (under password-like and
innocent names, or unnamed), the `;params` and the fragment of URLs written in every form a
client accepts (`https://`, `https:/`, `https:`, `//`, none, fullwidth `：／／`, backslashes).

Properties, through the real entry points:
- `redact_url` of any such URL, and `redact_text` of a message holding one, hold no chunk.
- Every such URL as a provider address variable (each provider, each kind) or as the engine
  `base_url` is refused with a ProviderCredentialError, and neither the error (text, repr, args,
  attributes, whole chain, traceback) nor the printed lines hold a chunk.
- A URL whose secret is a credential by the kwargs rule (userinfo, password-like or unnamed
  item) anywhere in `agent_kwargs` is refused by `harbor_env_vars`; so is any text under a
  password-like key (any case, fullwidth letters, any nesting of dicts and lists); the error and
  the `repr()` of the settings hold no chunk.
In free text and kwargs a URL ends at whitespace (as it does for every reader of text) and a bare
`token@host` with no scheme and no `:` is an e-mail address, so neither is generated there.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mizzen_ci import register_cpu_ci
from mizzen_rollout.harbor.credentials import PROVIDER_SPECS, provision_provider
from mizzen_rollout.harbor.errors import ProviderCredentialError
from mizzen_rollout.harbor.launcher import harbor_env_vars
from mizzen_rollout.harbor.local_environment import LOCAL_ENVIRONMENT_IMPORT_PATH
from mizzen_rollout.harbor.redaction import redact_text, redact_url
from mizzen_rollout.harbor.settings import HarborSettings
from mizzen_rollout.harbor.trial_config import check_base_url
from mizzen_rollout.masking import isolated_masks

register_cpu_ci(est_time=15, labels=["rollout", "harbor"])

FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
CHUNK = st.from_regex(r"Q[0-9]{2}[A-Z0-9]{5,9}", fullmatch=True)
TEXT_DELIMITERS = [
    "/", "?", "#", "@", ":", ";", "&", "=", "%", "+", "'", '"', "\\", "[", "]", ".", "-",
    "\uff20", "\ufe6b", "\uff1a", "\ufe55", "\uff0f", "\uff1f", "\uff03", "\uff1b", "\uff06",
    "\uff3c",
]  # fmt: skip
DELIMITERS = [*TEXT_DELIMITERS, " ", "\t", "\n", "<", ">", "`"]
SCHEMES = [
    "https://", "http://", "https:/", "https:", "//", "", "HTTPS://", "https:\\\\",
    "https\uff1a\uff0f\uff0f", "http\ufe55//",
]  # fmt: skip
HOSTS = ["daytona.example.com", "127.0.0.1", "[::1]", "api.internal"]
PASSWORD_LIKE_KEYS = ["api_key", "token", "access_token", "X-Amz-Signature", "sig", "passwd"]
INNOCENT_KEYS = ["region", "k", "x", "page"]
PLACES = ["user", "password", "query", "params", "fragment"]


@dataclasses.dataclass
class Leaky:
    url: str
    chunks: list[str]


@st.composite
def leaky_urls(draw, *, credential_only: bool = False, in_text: bool = False) -> Leaky:
    """A URL with at least one generated secret in it (see the module docstring).

    credential_only: every secret sits where the kwargs rule calls it a credential (no innocent
    query names). in_text: the URL is found inside text: no whitespace or `<>`` in secrets, and
    no bare `token@host` without a scheme (in text that is an e-mail address).
    """
    chunks: list[str] = []
    delimiters = TEXT_DELIMITERS if in_text else DELIMITERS

    def secret(joined_by=delimiters) -> str:
        parts = draw(st.lists(CHUNK, min_size=1, max_size=3))
        joints = draw(
            st.lists(st.sampled_from(joined_by), min_size=len(parts) - 1, max_size=len(parts) - 1)
        )
        chunks.extend(parts)
        return parts[0] + "".join(
            joint + part for joint, part in zip(joints, parts[1:], strict=True)
        )

    def keyed() -> str:
        names = PASSWORD_LIKE_KEYS if credential_only else PASSWORD_LIKE_KEYS + INNOCENT_KEYS
        if draw(st.booleans()):
            if credential_only:  # `Q1=Q2` would be an item named Q1: no credential by the rule
                return secret([d for d in delimiters if d != "="])  # unnamed
            return secret()  # unnamed
        return f"{draw(st.sampled_from(names))}{draw(st.sampled_from(['=', '\uff1d']))}{secret()}"

    places = draw(st.sets(st.sampled_from(PLACES), min_size=1))
    scheme = draw(st.sampled_from(SCHEMES))
    if in_text and scheme == "" and "user" in places:
        places = (places - {"user"}) | {"password"}  # a bare `token@host` is no URL in text
    at = draw(st.sampled_from(["@", "\uff20", "\ufe6b"]))
    userinfo = ""
    if "password" in places:
        colon = draw(st.sampled_from([":", "\uff1a"]))
        user = secret() if "user" in places else draw(st.sampled_from(["admin", "u"]))
        userinfo = f"{user}{colon}{secret()}{at}"
    elif "user" in places:
        userinfo = f"{secret()}{at}"
    url = (
        scheme
        + userinfo
        + draw(st.sampled_from(HOSTS))
        + draw(st.sampled_from(["", ":8443", ":1"]))
        + draw(st.sampled_from(["", "/api", "/v1/x"]))
    )
    if "params" in places:
        url += ";" + keyed()
    if "query" in places:
        url += draw(st.sampled_from(["?", "\uff1f"])) + keyed()
        if draw(st.booleans()):
            url += "&page=2"
    if "fragment" in places:
        url += draw(st.sampled_from(["#", "\uff03"])) + keyed()
    return Leaky(url, chunks)


@pytest.fixture(scope="module")
def trials_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz-trials")


# ------------------------------------------------------------------------------ the shown forms


@FUZZ
@given(leaky=leaky_urls())
def test_redact_url_never_shows_a_secret(leaky: Leaky) -> None:
    shown = redact_url(leaky.url)
    assert [c for c in leaky.chunks if c in shown] == [], shown
    assert shown.isascii() and shown.isprintable()


@FUZZ
@given(leaky=leaky_urls(in_text=True), quote=st.sampled_from(["", "'", '"', "(", "<"]))
def test_redact_text_never_shows_a_secret(leaky: Leaky, quote: str) -> None:
    closing = {"(": ")", "<": ">"}.get(quote, quote)
    message = f"ConnectError: cannot reach {quote}{leaky.url}{closing}: refused\nretrying"
    shown = redact_text(message, environ={})
    assert [c for c in leaky.chunks if c in shown] == [], shown


# ---------------------------------------------------------------------- the wrapper's outputs

URL_ADDRESSES = [
    (provider, variable)
    for provider, spec in sorted(PROVIDER_SPECS.items())
    for variable in spec.address_vars
]


@FUZZ
@given(leaky=leaky_urls(), address=st.sampled_from(URL_ADDRESSES))
def test_every_leaky_address_is_refused_without_showing_it(
    leaky: Leaky, address: tuple[str, str], provider_specs, leaked
) -> None:
    provider, variable = address
    env = {var: "k-env-0123" for var in PROVIDER_SPECS[provider].key_vars} | {variable: leaky.url}
    printed: list[str] = []
    with pytest.raises(ProviderCredentialError) as error:
        provision_provider(provider, env, specs=provider_specs, echo=printed.append)
    assert variable in str(error.value)
    assert leaked(leaky.chunks, error.value, *printed) == []


@FUZZ
@given(leaky=leaky_urls())
def test_every_leaky_base_url_is_refused_without_showing_it(leaky: Leaky, leaked) -> None:
    with pytest.raises(ProviderCredentialError, match="base_url") as error:
        check_base_url(leaky.url)
    assert leaked(leaky.chunks, error.value) == []


@FUZZ
@given(
    leaky=leaky_urls(credential_only=True, in_text=True),
    name=st.sampled_from(["api_base", "notes"]),
)
def test_credential_urls_in_agent_kwargs_never_reach_the_workers(
    leaky: Leaky, name: str, tasks_dir: Path, trials_root: Path, leaked
) -> None:
    kwargs = {"llm_kwargs": {name: leaky.url}} if name == "api_base" else {name: [leaky.url]}
    shown = _refused_kwargs(kwargs, "MIZZEN_HARBOR_AGENT_KWARGS", tasks_dir, trials_root)
    assert leaked(leaky.chunks, *shown) == []


def _refused_kwargs(kwargs: dict, match: str, tasks_dir: Path, trials_root: Path) -> tuple:
    """(the refusal, the settings' repr) of ``agent_kwargs=kwargs``, with this example's secrets
    registered only while it runs (the process-wide mask set would grow with every example)."""
    with isolated_masks():
        with pytest.raises(ProviderCredentialError, match=match) as error:
            harbor_env_vars(
                tasks_dir=tasks_dir,
                trials_dir=trials_root,
                model_name="m",
                environment_import_path=LOCAL_ENVIRONMENT_IMPORT_PATH,
                agent_kwargs=kwargs,
                echo=lambda line: None,
            )
        settings = HarborSettings(
            tasks_dir=tasks_dir, trials_dir=trials_root, model_name="m", agent_kwargs=kwargs
        )
        return error.value, repr(settings)


def _fullwidth(text: str) -> str:
    return "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in text)


@st.composite
def kwargs_with_a_secret(draw) -> tuple[dict, str]:
    secret = draw(CHUNK)
    word = draw(st.sampled_from(["pass", "passwd", "secret", "token", "key", "auth", "cookie"]))
    word = "".join(c.upper() if draw(st.booleans()) else c for c in word)
    name = (
        draw(st.sampled_from(["", "api_", "x-", "db", "My"]))
        + word
        + draw(st.sampled_from(["", "_value", "s", "-id", "Word"]))
    )
    if draw(st.booleans()):
        name = _fullwidth(name)
    leaf = draw(
        st.sampled_from(
            [secret, [secret], {"value": secret}, [{"v": [secret]}], f"${{{secret}}}", (secret,)]
        )
    )
    value: object = {name: leaf, "temperature": 0.5, "max_tokens": 64}
    for container in draw(st.lists(st.sampled_from(["dict", "list"]), max_size=4)):
        value = {"nested": value, "flag": True} if container == "dict" else [value, 1]
    if not isinstance(value, dict):
        value = {"top": value}
    return value, secret


@FUZZ
@given(case=kwargs_with_a_secret())
def test_text_under_password_like_keys_never_reaches_the_workers(
    case: tuple[dict, str], tasks_dir: Path, trials_root: Path, leaked
) -> None:
    kwargs, secret = case
    shown = _refused_kwargs(kwargs, "carries credentials", tasks_dir, trials_root)
    assert leaked(secret, *shown) == []
