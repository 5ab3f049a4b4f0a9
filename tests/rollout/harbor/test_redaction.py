"""The redaction module by example: URL splitting the way clients split, the shown forms, the
password-like name rule, credential shapes, free-text scrubbing and the masked `Secret`."""

from __future__ import annotations

import json
import pickle

import httpx
import pytest

from mizzen_ci import register_cpu_ci
from mizzen_rollout.harbor.redaction import (
    Secret,
    credential_shape,
    is_sensitive_name,
    redact_text,
    redact_url,
    redact_value,
    shown,
    split_url,
)

register_cpu_ci(est_time=3, labels=["rollout", "harbor"])

PW = "Q17hunter2"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("https://daytona.example.com:8443/api", "https://daytona.example.com:8443/api"),
        (f"https://u:{PW}@h:1/x?token=abc&b=1", "https://***@h:1/x?***"),
        (f"https://h/api#token={PW}", "https://h/api#***"),
        (f"https://h/api;token={PW}", "https://h/api;***"),
        (f"https://h;token={PW}/api", "https://h;***"),
        (f"https://u:{PW}\uff20h/api", "https://***@h/api"),
        (f"https\uff1a\uff0f\uff0fu\uff1a{PW}\uff20h\uff0fx", "https://***@h/x"),
        (f"//user:{PW}@host", "//***@host"),
        (f"https:/user:{PW}@host", "https://***@host"),
        (f"https:user:{PW}@host", "https://***@host"),
        (f"https:\\\\user:{PW}@host\\x", "https://***@host/x"),
        (f"user:{PW}@host", "***@host"),
        (f"https://admin:{PW}/@host", "https://***:***/***"),
        (f"https://host/user%3A{PW}%40evil", "https://***/***"),
        (f"https://us\ner:{PW}@host", "https://***@host"),  # WHATWG drops tabs and newlines
        ("[::1", "***"),
        ("https://[::1/api", "https://***/api"),
        ("http://[::1]:8080/v1", "http://[::1]:8080/v1"),
        ("https://h:99999/api", "https://h:99999/api"),  # shown (digits), refused elsewhere
        (f"https://h:{PW}/api", "https://h:***/api"),
        (f"https://{PW}%40h/api", "https://***/api"),
        (f"{PW}://h", "***://h"),
        ("https://h/\u202eevil/\x1b[2J", "https://h/%E2%80%AEevil/%1B%5B2J"),
        ("https://h/?", "https://h/?"),
    ],
)
def test_redact_url(value: str, expected: str) -> None:
    assert redact_url(value) == expected


@pytest.mark.parametrize(
    "url",
    [
        f"https://user:{PW}@example.com/x",
        f"https://user:{PW}@example.com:8443/x",
        f"http://user:{PW}@[::1]:8080/x",
        f"https://user:a@b:{PW}@example.com/x",  # the userinfo ends at the last '@'
    ],
)
def test_the_userinfo_is_where_a_real_http_client_finds_it(url: str) -> None:
    """Contract with httpx (the client our engines use): what it reads as the password is inside
    what `split_url` reads as the userinfo, so `redact_url` masks it."""
    client_view = httpx.URL(url)
    ours = split_url(url)
    assert PW in client_view.password
    assert ours.userinfo is not None and ours.userinfo.endswith(client_view.password)
    assert ours.host.strip("[]") == client_view.host
    assert PW not in redact_url(url)


@pytest.mark.parametrize(
    "url", [f"https:/user:{PW}@example.com/x", f"https:user:{PW}@example.com/x"]
)
def test_lenient_forms_are_read_as_the_most_lenient_client_reads_them(url: str) -> None:
    """httpx (RFC 3986) reads these as a path; WHATWG parsers (browsers, Node, curl's leniency)
    read a userinfo. We take the WHATWG reading, so the password is masked either way."""
    assert httpx.URL(url).password == "" and PW in httpx.URL(url).path
    assert split_url(url).userinfo == f"user:{PW}"
    assert PW not in redact_url(url)


def test_split_url_never_raises_and_hides_its_secrets_in_repr() -> None:
    for value in ("", "[", "]", "[::1", "http://[", "::::", "@@@", "#?;", "\x00", "\ud800", 12):
        split_url(value)
        redact_url(value)
    parts = split_url(f"https://u:{PW}@h/x?token={PW}#{PW}")
    assert parts.userinfo == f"u:{PW}" and parts.query == f"token={PW}" and parts.fragment == PW
    assert PW not in repr(parts)


def test_redact_url_is_bounded() -> None:
    assert len(redact_url("https://h/" + "a" * 10_000)) <= 300


@pytest.mark.parametrize(
    "name",
    [
        "api_key",
        "API_KEY",
        "x-api-key",
        "passwd",
        "db_pass",
        "Password",
        "client_secret",
        "access_token",
        "max_tokens",  # password-like too: what it may hold is the caller's rule
        "Authorization",
        "credentials",
        "Cookie",
        "sig",
        "X-Amz-Signature",
        "\uff41\uff50\uff49_\uff4b\uff45\uff59",  # fullwidth
        "PA\u00dfWORD",  # casefold: ss
    ],
)
def test_password_like_names(name: str) -> None:
    assert is_sensitive_name(name)


@pytest.mark.parametrize(
    "name", ["temperature", "parser_name", "model", "region", "design", "signal", "assignee"]
)
def test_names_that_are_not_password_like(name: str) -> None:
    assert not is_sensitive_name(name)


@pytest.mark.parametrize(
    ("text", "shape"),
    [
        (f"Bearer {PW}", "Authorization header"),
        (f"  basic {PW} ", "Authorization header"),
        (f"OPENAI_API_KEY={PW}", "assignment"),
        (f"X-Api-Key: {PW}", "assignment"),
        (f"https://u:{PW}@h", "userinfo"),
        (f"see https://h/x?token={PW} there", "query"),
        (f"https://h/x#{PW}", "fragment"),
        (f"https://h/x;{PW}", ";params"),
        (f"https://h/u:{PW}@x", "'@' after its host"),
    ],
)
def test_credential_shapes(text: str, shape: str) -> None:
    found = credential_shape(text)
    assert found is not None and shape in found


@pytest.mark.parametrize(
    "text",
    [
        "max_tokens=512",
        "https://docs.example.com/guide?page=2",
        "plain words",
        "key: true",
        "me@example.com",
        "http://127.0.0.1:30000/v1",
    ],
)
def test_not_credential_shapes(text: str) -> None:
    assert credential_shape(text) is None


def test_redact_value_masks_text_under_password_like_names_at_any_depth() -> None:
    value = {
        "llm_kwargs": [{"api_key": PW, "headers": {"Authorization": [PW]}}],
        "auth": {"inner": {"deeper": PW}},
        "api_base": f"https://u:{PW}@h/v1",
        "env": [f"OPENAI_API_KEY={PW}", f"Bearer {PW}"],
        "max_tokens": 512,
        "temperature": 0.5,
        "flag": True,
        "prompt": "hello",
    }
    redacted = redact_value(value)
    assert PW not in json.dumps(redacted)
    assert redacted["max_tokens"] == 512 and redacted["flag"] is True
    assert redacted["prompt"] == "hello" and redacted["api_base"] == "https://***@h/v1"
    assert redacted["env"] == ["OPENAI_API_KEY=***", "Bearer ***"]
    assert value["llm_kwargs"][0]["api_key"] == PW  # a copy: the input is untouched
    assert PW not in shown(value, limit=10_000)


def test_redact_text_scrubs_urls_assignments_and_known_secrets() -> None:
    env = {"SOME_PROVIDER_API_KEY": "sk-env-secret-1234", "FEATURE_TOKEN_ENABLED": "true"}
    text = (
        f"proxy http://user:{PW}@proxy:3128 refused; OPENAI_API_KEY={PW}, "
        f"Authorization: Bearer {PW}; key sk-env-secret-1234 wrong; max_tokens=512; true\n"
        "\x1b[31mred\x1b[0m \u202eevil"
    )
    out = redact_text(text, environ=env)
    assert PW not in out and "sk-env-secret-1234" not in out
    assert "http://***@proxy:3128" in out and "max_tokens=512" in out
    assert "; true\n" in out  # boolean values of credential-named variables are not masked
    assert "\x1b" not in out and "\u202e" not in out and "\\x1b[31mred" in out


def test_redact_text_normalises_look_alikes_before_looking() -> None:
    out = redact_text(f"connect https\uff1a//user\uff1a{PW}\uff20host/x failed", environ={})
    assert PW not in out and "https://***@host/x" in out


def test_secret_is_a_str_with_a_masked_repr() -> None:
    key = Secret(PW)
    assert key == PW and f"{key}" == PW and key + "x" == PW + "x"
    assert repr(key) == "'***'" and PW not in repr({"E2B_API_KEY": key})
    assert pickle.loads(pickle.dumps(key)) == PW


@pytest.mark.parametrize(
    "text",
    [
        f'export OPENAI_API_KEY="{PW}"',
        f"export API_TOKEN='{PW}'",
        f'{{"api_key": "{PW}"}}',
        f"{{'api_key': '{PW}'}}",
        json.dumps({"llm": {"auth_token": PW}}),
        f'api_key = "{PW}"',
        f"--api-key {PW}",
        f"--api-key={PW}",
        f'headers=[("X-Api-Key", "{PW}")]',
        f'["--api-key", "{PW}"]',
        f"pass\u200bword={PW}",  # zero-width space inside the name
        f"to\u200dken: {PW}",  # zero-width joiner
        f"sec\u2060ret={PW}",  # word joiner
        f"pass\ufeffwd={PW}",  # zero-width no-break space
    ],
)
def test_redact_text_masks_quoted_paired_and_zero_width_named_values(text: str) -> None:
    out = redact_text(text, environ={})
    assert PW not in out and "***" in out


def test_redact_text_keeps_json_json() -> None:
    out = redact_text(json.dumps({"api_key": PW, "max_tokens": 10}), environ={})
    assert json.loads(out) == {"api_key": "***", "max_tokens": 10}
