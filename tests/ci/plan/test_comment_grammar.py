"""Comment commands under a strict grammar (``mizzen_ci.plan.request.read_commands``) and approval
that no text can give: the probe's comment bodies carry no command, a refused command plans and
approves nothing, and a property over random bodies (lines, separators, quotes, fences, HTML,
commands) checked against an oracle that knows by construction which lines are plain commands."""

from __future__ import annotations

import json
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mizzen_ci import register_cpu_ci
from mizzen_ci.plan.request import Comment, parse_commands

register_cpu_ci(est_time=30, labels=["ci"])

CPU_TEST = "from mizzen_ci import register_cpu_ci\nregister_cpu_ci(est_time=5)\n"
GPU_TEST = (
    "from mizzen_ci import register_cuda_ci\n"
    "register_cuda_ci(est_time=5, hardware=['hopper'], labels=['lora'])\n"
)
#: The line separators other than "\n" and "\r\n" (str.splitlines splits on each of them; a
#: Markdown renderer on none but CR): the probe's seven and U+2029.
SEPARATORS = {
    "U+2028": "\u2028", "U+2029": "\u2029", "VT": "\x0b", "FF": "\x0c", "FS": "\x1c",
    "GS": "\x1d", "RS": "\x1e", "NEL": "\x85", "lone CR": "\r",
}  # fmt: skip
UNTRUSTED = {"fork": True, "author_association": "NONE"}


@pytest.fixture
def fork_change(workspace):
    """A fork's pull request that changes a GPU test: what an approval would run on GPUs."""
    ws = workspace({"tests/t/test_cpu.py": CPU_TEST, "tests/t/test_gpu.py": GPU_TEST})
    ws.write(
        {"tests/t/test_gpu.py": GPU_TEST + "# changed\n", "tests/t/test_cpu.py": CPU_TEST + "#\n"}
    )
    ws.commit()
    return ws


def gpu_runs(p: dict) -> set[tuple[str, str]]:
    return {(t["file"], j["arch"]) for j in p["jobs"] if j["arch"] for t in j["tests"]}


@pytest.mark.parametrize("sep", SEPARATORS.values(), ids=SEPARATORS.keys())
def test_a_quote_reply_holding_a_separator_carries_no_command(fork_change, sep):
    body = f"> looks fine{sep}/run-ci all"
    assert parse_commands(body) == []
    p = fork_change.plan(comments=(Comment("MEMBER", body),), **UNTRUSTED)
    assert gpu_runs(p) == set() and p["approval"] is None
    assert any("carries no command" in w for w in p["warnings"]), p["warnings"]


@pytest.mark.parametrize(
    "body",
    [
        "<!--\n/run-ci all\n-->",  # invisible when rendered
        "<style>\n/run-ci all\n</style>",  # GitHub drops a style element's text
        "<?\n/run-ci all\n?>",
        "/run-ci all\u200d",  # a zero-width joiner after the label
        "/run-ci lo\u200dra",
        "/run\u200d-ci all",  # inside the command's name (no command at 10bec9e either)
        "/run-ci all\u202e",  # a bidi override
        "/run-ci\tall",  # a tab is a control character
    ],
    ids=["html-comment", "style", "pi", "zwj-after", "zwj-label", "zwj-name", "bidi", "tab"],
)
def test_hidden_or_invisible_text_carries_no_command(fork_change, body):
    assert parse_commands(body) == []
    p = fork_change.plan(comments=(Comment("OWNER", body),), **UNTRUSTED)
    assert gpu_runs(p) == set() and p["approval"] is None


def test_a_fullwidth_command_is_the_command_it_shows():
    # NFKC: "／run-ci ｌｏｒａ" shows as a command and is one (documented in request.py and README)
    assert parse_commands("\uff0frun-ci \uff4c\uff4f\uff52\uff41") == [("run-ci", ["lora"])]
    assert parse_commands("\uff0frun\uff0dci all") == [("run-ci", ["all"])]


def test_quotes_fences_and_indentation_hold_no_command():
    assert parse_commands("> quoted\n/run-ci all") == []  # a lazy continuation of the quote
    assert parse_commands("> quoted\n\n/run-ci all") == [("run-ci", ["all"])]
    assert parse_commands("- > quoted in a list\n/run-ci all") == []
    assert parse_commands("````\n```\n/run-ci all\n````\n/run-ci lora") == [("run-ci", ["lora"])]
    assert parse_commands("~~~\n/run-ci all\n```\n/run-ci lora") == []  # never closed
    assert parse_commands("    /run-ci all") == [] and parse_commands(" /run-ci all") == []
    assert parse_commands("thanks!\r\n/run-ci lora  \r\nmore") == [("run-ci", ["lora"])]


def test_the_comment_cli_says_why_a_body_carries_no_command(tmp_path, mizzen_ci):
    body = tmp_path / "c.md"
    body.write_text("> looks fine\u2028/run-ci all", encoding="utf-8")
    done = mizzen_ci("comment", "--body-file", str(body), "--association", "MEMBER")
    out = json.loads(done.stdout)
    assert out["accepted"] is False and out["commands"] == []
    assert "U+2028 (LINE SEPARATOR)" in out["refused"]


# -- a refused command plans and approves nothing ----------------------------------------------


@pytest.mark.parametrize(
    "body", ["/rerun-test tests/../ci/fleet.toml", "/rerun-test /etc/passwd", "/run-ci nosuch"]
)
def test_a_refused_command_plans_nothing_extra_and_approves_nothing(fork_change, body):
    p = fork_change.plan(comments=(Comment("MEMBER", body),), **UNTRUSTED)
    assert gpu_runs(p) == set() and p["approval"] is None
    assert any("plans nothing and approves nothing" in w for w in p["warnings"]), p["warnings"]
    if body.startswith("/rerun-test"):  # a rerun of nothing: never the normal plan
        assert p["jobs"] == []
        trusted = fork_change.plan(comments=(Comment("MEMBER", body),))
        assert trusted["jobs"] == []


# -- the property: a command is parsed iff it stands as a plain whole line ------------------------

WORDS = st.text(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", min_size=1, max_size=8
)
#: characters and markup that make a body carry no command at all
POISON = [*SEPARATORS.values(), "\t", "\x00", "\x7f", "\u200b", "\u200d", "\ufeff", "\u202e",
          "\u2066", "\u00ad", "<!--", "<style>", "<br>", "</p>", "<?", "<!doctype html>"]  # fmt: skip
COMMANDS = ["run-ci", "run-on", "rerun-failed", "rerun-test"]


def text_line():
    # prose: starts with a letter, no markup that the grammar reads
    return st.builds(
        lambda first, rest: first + rest,
        WORDS,
        st.text("abc XYZ 012 .,:;!?()'\"#=/-_", max_size=30),
    )


@st.composite
def command(draw):
    """(the line as written, the command it is): ASCII or its fullwidth form, trailing spaces."""
    name = draw(st.sampled_from(COMMANDS))
    args = draw(st.lists(WORDS, max_size=3))
    line = " ".join(["/" + name, *args])
    shown = line
    if draw(st.booleans()):
        shown = "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in line)
        assert unicodedata.normalize("NFKC", shown) == line
    return shown + " " * draw(st.integers(0, 2)), (name, args)


@st.composite
def block(draw):
    """(lines, the commands they hold as plain whole lines, whether a blank line must follow)."""
    kind = draw(st.sampled_from(["text", "command", "quote", "fence", "indented"]))
    if kind == "text":
        return draw(st.lists(text_line(), min_size=1, max_size=3)), [], False
    if kind == "command":
        lines, expected = zip(*draw(st.lists(command(), min_size=1, max_size=3)), strict=True)
        return list(lines), list(expected), False
    if kind == "indented":
        line, _ = draw(command())
        return [" " * draw(st.integers(1, 6)) + line], [], False
    inner = draw(st.lists(st.one_of(text_line(), command().map(lambda c: c[0])), max_size=4))
    if kind == "quote":
        # quoted lines (one at least), then lines that continue the quote lazily
        inner = inner or [draw(text_line())]
        lazy = draw(st.lists(st.one_of(text_line(), command().map(lambda c: c[0])), max_size=2))
        return ["> " + line for line in inner] + lazy, [], True
    char = draw(st.sampled_from("`~"))
    length = draw(st.integers(3, 5))
    shorter = [char * (length - 1)] if length > 3 else []  # does not close it
    other = ["~~~" if char == "`" else "```"]  # nor does the other fence character
    opener = char * length + draw(st.sampled_from(["", "python", " text"]))
    closer = " " * draw(st.integers(0, 3)) + char * (length + draw(st.integers(0, 2)))
    return [opener, *shorter, *inner, *other, closer], [], False


@st.composite
def body(draw):
    """(body, expected commands): blocks joined by newlines (a blank line where a block needs
    one), CRLF or LF, and maybe one forbidden character or piece of HTML somewhere."""
    lines: list[str] = []
    expected: list = []
    for lines_of, commands, blank_after in draw(st.lists(block(), min_size=1, max_size=6)):
        lines += lines_of
        expected += commands
        if blank_after or draw(st.booleans()):
            lines.append("")
    text = ("\r\n" if draw(st.booleans()) else "\n").join(lines)
    if draw(st.booleans()):
        poison = draw(st.sampled_from(POISON))
        at = draw(st.integers(0, len(text)))
        if poison == "\r" and text[at : at + 1] == "\n":
            at = len(text)  # "\r\n" is a line break: put the lone CR at the end instead
        text = text[:at] + poison + text[at:]
        expected = []
    return text, expected[:20]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body())
def test_a_command_is_parsed_iff_it_stands_as_a_plain_whole_line(case):
    text, expected = case
    assert parse_commands(text) == [(name, list(args)) for name, args in expected]
