"""The process-wide mask set (`mizzen_rollout.masking`): registration, encodings, every sink.

Properties (hypothesis):
- A secret of any shape (any Unicode text of at least `MIN_SECRET_LENGTH` characters but line
  breaks and lone surrogates; printable ASCII with punctuation; `sk-` tokens) at a random place
  of random text, or of a random JSON structure, registered once, is emitted by NO sink — the
  CLI's logging (records and tracebacks), the CLI's stream writers (writes cut at random places),
  the rollout CLI's error boundary (`main`, in-process), the samples JSONL writer, `repr()` of a
  config object (`HarborSettings`, a `masked_repr` dataclass), the env description and the
  worker-env check, and the redaction's free-text rule — neither as itself nor in any of its
  registered encodings, nor in a form computed independently of the registration (JSON and
  repr bodies, NFKC, percent-encoded, base64), so a missing encoding fails too.
- Text holding no registered encoding of a secret passes every text sink unchanged (the mask
  eats nothing innocent).
Mutation-checked by hand: each sink with its `mask` call removed fails the first property.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import string
import unicodedata
from contextlib import redirect_stderr, redirect_stdout, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from mizzen_ci import register_cpu_ci
from mizzen_rollout.api import (
    MIN_SECRET_LENGTH,
    SecretError,
    SecretTooShortError,
    mask,
    register_secret,
    register_url,
)
from mizzen_rollout.cli import main
from mizzen_rollout.harbor.local_environment import LOCAL_ENVIRONMENT_IMPORT_PATH
from mizzen_rollout.harbor.redaction import redact_text
from mizzen_rollout.harbor.settings import HarborSettings
from mizzen_rollout.masking import (
    MaskedStream,
    check_worker_env,
    describe_env,
    encodings,
    install_output_masks,
    isolated_masks,
    mask_value,
    masked_repr,
    register_environment,
    shown_line,
)
from mizzen_rollout.samples import Sample, SampleStatus, write_samples

register_cpu_ci(est_time=40, labels=["rollout"])

LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
FUZZ = settings(
    max_examples=120,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
ANY_CHAR = st.characters(blacklist_categories=("Cs",))
SECRETS = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters=LINE_BREAKS),
            min_size=MIN_SECRET_LENGTH, max_size=40),
    st.text(st.sampled_from(string.ascii_letters + string.digits + string.punctuation + " "),
            min_size=MIN_SECRET_LENGTH, max_size=40),
    st.from_regex(r"sk-[A-Za-z0-9_-]{6,40}", fullmatch=True),
).filter(lambda s: s.strip())  # fmt: skip
TEXTS = st.text(ANY_CHAR, max_size=60)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | TEXTS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXTS, inner, max_size=4),
    max_leaves=12,
)


def _place(draw: Any, structure: Any, text: str) -> Any:
    """`structure` with `text` put at a random place (a value, a list item or a mapping key)."""
    if isinstance(structure, list) and structure and draw(st.booleans()):
        index = draw(st.integers(0, len(structure) - 1))
        return [*structure[:index], _place(draw, structure[index], text), *structure[index + 1 :]]
    if isinstance(structure, dict) and structure and draw(st.booleans()):
        key = draw(st.sampled_from(sorted(structure)))
        return {**structure, key: _place(draw, structure[key], text)}
    if isinstance(structure, dict) and draw(st.booleans()):
        return {**structure, text: 1}
    return [structure, text]


@dataclass
class Case:
    secret: str
    text: str  # the secret at a random place of random text
    structure: Any  # the text at a random place of a random JSON structure
    cuts: list[int]  # where the stream writes are cut


@st.composite
def cases(draw: Any) -> Case:
    secret = draw(SECRETS)
    text = draw(TEXTS) + secret + draw(TEXTS)
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=5)))
    return Case(secret, text, _place(draw, draw(JSON), text), cuts)


@masked_repr
@dataclass
class EngineConfig:
    """A config object holding a secret-bearing value."""

    url: str
    extra: Any


def _logged(text: str, structure: Any) -> str:
    """What the CLIs' logging writes (installed as the CLIs install it) for a message with
    `text`, a structure argument and an exception holding `text` (traceback included)."""
    sink = io.StringIO()
    restore = install_output_masks()
    handler = logging.StreamHandler(sink)
    logger = logging.getLogger("mizzen.test.masking")
    logger.addHandler(handler)
    try:
        logger.warning("loaded %s from %r", text, structure)
        try:
            raise ValueError(f"engine said: {text}")
        except ValueError:
            logger.exception("call failed: %s", text)
    finally:
        logger.removeHandler(handler)
        restore()
    return sink.getvalue()


def _streamed(text: str, cuts: list[int]) -> str:
    """What a CLI stream writer emits for `text` written in pieces cut at `cuts`."""
    sink = io.StringIO()
    stream = MaskedStream(sink)  # type: ignore[arg-type]
    for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True):
        stream.write(text[start:end])
    stream.flush()
    return sink.getvalue()


def _boundary(text: str, tmp: Path) -> str:
    """What `mizzen-rollout generate` prints for a failure whose message holds `text`."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err), suppress(SystemExit):
        main(["generate", f"--data={text}", f"--out={tmp / 'o.jsonl'}"])
    return out.getvalue() + err.getvalue()


def _jsonl(text: str, structure: Any, tmp: Path) -> str:
    sample = Sample(
        prompt=text,
        status=SampleStatus.FAILED,
        error=f"EngineUnavailableError: {text}",
        metadata={"engine": text, "extra": json.loads(json.dumps(structure))},
        label=structure,
    )
    write_samples(tmp / "s.jsonl", [sample])
    return (tmp / "s.jsonl").read_bytes().decode("utf-8")


def _repr(text: str, structure: Any, tmp: Path) -> str:
    settings_ = HarborSettings(
        tasks_dir=tmp,
        trials_dir=tmp,
        model_name=text,
        environment_import_path=LOCAL_ENVIRONMENT_IMPORT_PATH,
        agent_kwargs={"notes": structure},
    )
    config = EngineConfig(url=text, extra=structure)
    return "\n".join([repr(settings_), str(settings_), repr(config), str(config)])


def _env(text: str) -> str:
    env = {"MIZZEN_NOTE": text, text: "x"}
    try:
        check_worker_env(env, where="test")
        refusal = "not refused"
    except SecretError as exc:
        refusal = str(exc)
    return describe_env(env) + "\n" + refusal


def emitted(case: Case, tmp: Path) -> dict[str, str]:
    """Every sink's output for the case, by sink."""
    return {
        "logging": _logged(case.text, case.structure),
        "stream writer": _streamed(case.text, case.cuts),
        "error boundary": _boundary(case.text, tmp),
        "samples JSONL": _jsonl(case.text, case.structure, tmp),
        "repr of a config": _repr(case.text, case.structure, tmp),
        "worker env": _env(case.text),
        "redact_text": redact_text(case.text, environ={}),
        "shown_line": shown_line(case.text),
        "mask_value": json.dumps(mask_value(case.structure), ensure_ascii=False),
    }


def _oracle_forms(secret: str) -> set[str]:
    """How the sinks may show `secret`, computed here independently of `masking.encodings`:
    itself, NFKC, its JSON string bodies, both bodies Python's repr writes (quoted with ' or "),
    percent-encoded, base64."""
    normal = unicodedata.normalize("NFKC", secret)
    forms = {secret, normal, quote(secret, safe=""), base64.b64encode(secret.encode()).decode()}
    for text in (secret, normal):
        forms |= {json.dumps(text)[1:-1], json.dumps(text, ensure_ascii=False)[1:-1]}
        forms |= {repr(text + "'\"")[1:-4], repr(text + "'")[1:-2]}
    return {form for form in forms if len(form) >= 4}


def _found(secret: str, outputs: dict[str, str]) -> list[str]:
    registered = {form for form in encodings(secret) if len(form) >= 4}
    forms = registered | _oracle_forms(secret) | {secret}
    return [f"{sink}: {form!r}" for sink, out in outputs.items() for form in forms if form in out]


@FUZZ
@given(case=cases())
def test_no_sink_ever_emits_a_registered_secret(case: Case, tmp_path: Path) -> None:
    with isolated_masks():
        register_secret(case.secret, source="test")
        assert _found(case.secret, emitted(case, tmp_path)) == []


@FUZZ
@given(SECRETS, TEXTS, st.lists(st.integers(0, 60), max_size=4))
def test_text_without_a_secret_passes_unchanged(secret: str, text: str, cuts: list[int]) -> None:
    with isolated_masks():
        register_secret(secret, source="test")
        assume(not any(form in text for form in encodings(secret) if len(form) >= 4))
        assert mask(text) == text
        cuts = sorted(c for c in cuts if c <= len(text))
        assert _streamed(text, cuts) == text
        assert mask_value({text: [text]}) == {text: [text]}
        sink = io.StringIO()
        stream = MaskedStream(sink)  # type: ignore[arg-type]
        print(text, file=stream, flush=True)
        assert sink.getvalue() == text + "\n"


# ------------------------------------------------------------------------------ by example

SECRET = "Q42pw-SECRET-7f3a9c"


def test_registration_refuses_short_empty_and_multi_line_values() -> None:
    with pytest.raises(SecretTooShortError, match=r"HF_TOKEN: the secret is 5 characters") as e:
        register_secret("abcde", source="HF_TOKEN")
    assert "abcde" not in str(e.value) and "at least 6" in str(e.value)
    for bad in ("", "   ", f"{SECRET}\n2nd", f"{SECRET}\u2028"):
        with pytest.raises(SecretError) as e:
            register_secret(bad, source="K")
        assert SECRET not in str(e.value)
    register_secret("abcdef", source="K")  # the minimum is accepted
    assert mask("x abcdef y") == "x *** y"


def test_every_registered_encoding_is_masked() -> None:
    register_url(f"http://mizzen:{SECRET}@127.0.0.1:1/v1", source="--engine-url")
    basic = base64.b64encode(f"mizzen:{SECRET}".encode()).decode()
    for shown in (
        SECRET,
        json.dumps({"k": SECRET}),
        repr(SECRET),
        f"Authorization: Basic {basic}",
        base64.b64encode(SECRET.encode()).decode(),
    ):
        assert "SECRET" not in mask(shown) and basic not in mask(shown), shown
    assert mask(f"http://mizzen:{SECRET}@127.0.0.1:1/v1") == "http://mizzen:***@127.0.0.1:1/v1"


@pytest.mark.parametrize(
    "url",
    [
        f"http://u:{SECRET}@h:1/v1",
        f"http://u:{SECRET.replace('-', '%2D')}@h:1",
        f"http://h:1/v1?api_key={SECRET}",
        f"http://h:1/v1?{SECRET}",
        f"http://h:1/v1#{SECRET}",
        f"http://h:1/v1;token={SECRET}",
        f"http://{SECRET}@h:1",
        f"http://u:{SECRET}/x@h:1",  # a password cut short by `/` (the lenient reading)
        f"http://u:{SECRET}\uff20h:1",  # fullwidth at
    ],
)
def test_url_credentials_are_registered(url: str) -> None:
    register_url(url, source="--engine-url")
    assert SECRET not in mask(url) and "SECRET" not in mask(f"via {url}: refused")


def test_a_short_url_password_is_refused_without_being_shown() -> None:
    with pytest.raises(SecretTooShortError, match=r"--engine-url \(a credential in the URL\)"):
        register_url("http://u:abc@h:1", source="--engine-url")
    register_url("http://h:1/v1?x=1&page=2", source="--engine-url")  # nothing to register
    assert mask("x=1&page=2 h:1") == "x=1&page=2 h:1"


def test_the_environment_registers_values_not_names() -> None:
    register_environment(
        {
            "OPENAI_API_KEY": SECRET,
            "MIZZEN_HARBOR_ENGINE_API_KEY_VAR": "MIZZEN_ENGINE_KEY",  # a name, not a key
            "DAYTONA_API_KEY_FILE": "/etc/mizzen/daytona.key",
            "FEATURE_TOKEN_ENABLED": "true",
            "MAX_TOKENS": "123456",
            "HOME": "/root/innocent",
        }
    )
    text = f"key {SECRET} var MIZZEN_ENGINE_KEY file /etc/mizzen/daytona.key true 123456"
    assert mask(text) == "key *** var MIZZEN_ENGINE_KEY file /etc/mizzen/daytona.key true 123456"


def test_describe_env_names_variables_only() -> None:
    register_secret(SECRET, source="test")
    assert describe_env({"B": SECRET, "A": "x"}) == "2 variable(s): A, B"
    with pytest.raises(SecretError, match=r"\['B'\]") as e:
        check_worker_env({"B": f"x{SECRET}x", "A": "x"}, where="launcher")
    assert SECRET not in str(e.value)


def test_an_engine_spec_never_shows_a_registered_url_secret():
    from mizzen_rollout.api import EngineSpec
    from mizzen_rollout.masking import register_url

    url = "http://trainer:Eng1neSecret@127.0.0.1:30000"
    with isolated_masks():
        register_url(url, source="--engine-url")
        shown = repr(EngineSpec(kind="url", url=url))
        assert "Eng1neSecret" not in shown and "http://trainer:***@127.0.0.1:30000" in shown
