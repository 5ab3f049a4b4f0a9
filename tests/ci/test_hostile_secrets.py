"""The mask set of mizzen_ci (issue 31, mechanism 4): a secret loaded in any shape (a URL's
userinfo or query, a libpq key/value string, unquoted or quoted, a token variable of the
environment, a command-line argument) is masked by every sink, whatever encoding and position
carries it (raw, percent-encoded, JSON- or repr-escaped, libpq-quoted; split over stream writes);
text that holds no registered value leaves every sink unchanged."""

from __future__ import annotations

import io
import json
import os
import string
import tempfile
from pathlib import Path
from urllib.parse import quote, quote_plus

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from mizzen_ci import masking, output, register_cpu_ci
from mizzen_ci.gate.redact import redact_text, redact_url
from mizzen_ci.gate.store import StoreError
from mizzen_ci.history import append_jsonl

register_cpu_ci(est_time=60, labels=["ci"])

UPPER = st.text(string.ascii_uppercase, min_size=4, max_size=8)
ANY = st.characters(blacklist_categories=("Cs",))
NO_UPPER = st.characters(blacklist_categories=("Cs", "Lu", "Lt"))


@st.composite
def secrets(draw) -> str:
    """A secret: uppercase letters (so no sink's own text can spell it) with any characters
    between them."""
    pieces = [draw(UPPER)]
    for _ in range(draw(st.integers(0, 3))):
        pieces += [draw(st.text(ANY, max_size=6)), draw(UPPER)]
    return "".join(pieces)


def _libpq(s: str) -> str:
    return s.replace("\\", "\\\\").replace("'", "\\'")


def loaders(secret: str) -> dict[str, object]:
    """How a process may load ``secret``: the registration call for each shape."""
    out = {
        "url-userinfo": lambda: masking.register_connection(
            f"postgresql://u:{quote(secret, safe='')}@db.example:5432/m"
        ),
        "url-query": lambda: masking.register_connection(
            f"postgres://db.example/m?sslmode=require&password={quote_plus(secret)}"
        ),
        "dsn-quoted": lambda: masking.register_connection(
            f"host=db port=5432 password='{_libpq(secret)}' dbname=m"
        ),
        "env-token": lambda: masking.register_environment({"GITHUB_TOKEN": secret}),
        "env-store": lambda: masking.register_environment(
            {"MIZZEN_METRICS_STORE": f"postgresql://u:{quote(secret, safe='')}@h/m"}
        ),
        "argument": lambda: masking.register_arguments(
            ["gate", f"--store=host=h password='{_libpq(secret)}'"]
        ),
    }
    if not any(c.isspace() or c in "'\\" for c in secret):
        out["dsn-plain"] = lambda: masking.register_connection(f"host=h password={secret}")
    return out


ENCODINGS = {
    "raw": lambda s: s,
    "percent": lambda s: quote(s, safe=""),
    "plus": quote_plus,
    "json": lambda s: json.dumps(s)[1:-1],
    "repr": lambda s: repr(s)[1:-1],
    "libpq": _libpq,
}


def _stream(text: str, cuts: list[int]) -> str:
    sink = io.StringIO()
    stream = masking.MaskedStream(sink)
    last = 0
    for cut in sorted({c % (len(text) + 1) for c in cuts}):
        stream.write(text[last:cut])
        last = cut
    stream.write(text[last:] + "\n")
    stream.flush()
    return sink.getvalue()


def _file(write) -> str:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "out"
        write(path)
        return path.read_text(encoding="utf-8")


def sinks(cuts: list[int]) -> dict[str, object]:
    return {
        "plain": output.plain,
        "plain_lines": output.plain_lines,
        "markdown": output.markdown,
        "markdown_code": output.markdown_code,
        "xml_text": output.xml_text,
        "annotation": lambda t: output.annotation("error", t, file=t, title=t),
        "text_table": lambda t: output.text_table(["h"], [[t], [output.Code(t)]]),
        "markdown_table": lambda t: output.markdown_table(["h"], [[t], [output.Code(t)]]),
        "redact_text": redact_text,
        "redact_url(sqlite path)": lambda t: redact_url(t.replace("://", ":")),
        "StoreError": lambda t: str(StoreError(t)),
        "stream": lambda t: _stream(t, cuts),
        "write_text": lambda t: _file(lambda p: masking.write_text(p, t)),
        "append_jsonl": lambda t: _file(lambda p: append_jsonl(p, [json.dumps({"x": t})])),
    }


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    secret=secrets(),
    shape=st.sampled_from(sorted(loaders("x"))),
    encoding=st.sampled_from(sorted(ENCODINGS)),
    before=st.text(NO_UPPER, max_size=30),
    after=st.text(NO_UPPER, max_size=30),
    cuts=st.lists(st.integers(0, 200), max_size=5),
)
def test_a_registered_secret_never_leaves_any_sink(secret, shape, encoding, before, after, cuts):
    load = loaders(secret)
    assume(shape in load)
    carried = ENCODINGS[encoding](secret)
    text = before + carried + after
    shown_forms = {secret, carried, output._plain(secret), output._plain(carried)}
    with masking.scope():
        load[shape]()
        for name, sink in sinks(cuts).items():
            out = sink(text)
            leaked = sorted(f for f in shown_forms if f in out)
            assert not leaked, (name, shape, encoding, text, out)


@settings(max_examples=200, deadline=None)
@given(
    secret_list=st.lists(secrets(), min_size=1, max_size=3),
    text=st.text(NO_UPPER, max_size=60),
    cuts=st.lists(st.integers(0, 200), max_size=5),
)
def test_innocent_text_is_unchanged_by_every_sink(secret_list, text, cuts):
    before = {name: sink(text) for name, sink in sinks(cuts).items()}
    with masking.scope():
        for secret in secret_list:
            masking.register_environment({"API_TOKEN": secret})
        assert masking.mask(text) == text
        after = {name: sink(text) for name, sink in sinks(cuts).items()}
    assert after == before


def test_the_shapes_of_the_probe_are_registered():
    with masking.scope():
        masking.register_connection("host=h port=1 dbname=x user=u password=S3CRETpw")
        masking.register_connection("host=h password='S3 CRET\\'q'")
        masking.register_connection("host=h password=BROKEN pw with no equals")  # malformed
        masking.register_connection("postgresql://u@h/x?password=QUERY%zz")
        masking.register_environment({"PGPASSWORD": "PGPASSWORDVALUE", "PWD": "/work/main"})
        shown = masking.mask(
            "S3CRETpw S3 CRET'q BROKEN QUERY%zz PGPASSWORDVALUE /work/main mizzen-ci user u"
        )
    assert shown == "*** *** *** *** *** /work/main mizzen-ci user u"


def test_the_cli_masks_its_environment_and_its_arguments(mizzen_ci, tmp_path):
    """A secret of the environment printed by any path of `mizzen-ci` (here: argparse's usage
    error echoing an argument, and a history path named after it) is masked."""
    token = "ghs_" + "T0KEN" * 4
    out = mizzen_ci("gate", "show", "--window", token, env={"GITHUB_TOKEN": token})
    assert out.returncode == 2 and token not in out.stderr and "***" in out.stderr
    store = tmp_path / f"{token}.jsonl"
    out = mizzen_ci(
        "history", "merge", "--out", str(store), str(tmp_path), env={"GITHUB_TOKEN": token}
    )
    assert out.returncode == 0 and token not in out.stdout + out.stderr, out
    assert os.environ.get("GITHUB_TOKEN") != token
