"""What mizzen-ci prints for people and for GitHub: one escaping function per medium, text and
Markdown tables, workflow annotations.

Text that reaches these functions may come from anyone (a file name in a pull request, a label, a
skip reason, a history store, a plan file); each medium has exactly one escaping function, and
every renderer here applies it to every cell, so a caller never escapes twice or forgets to.

Invariants:
- :func:`plain` (terminals, logs, plain-text files) returns one line of printable text:
  control characters (C0, DEL, C1: newlines and terminal escapes included), format characters
  (zero-width, bidirectional overrides), line/paragraph separators, non-ASCII spaces, surrogates,
  private-use and unassigned code points are shown as ``\\xNN`` / ``\\uNNNN`` / ``\\UNNNNNNNN``;
  so are look-alikes of ASCII (non-ASCII dashes; compatibility forms of one ASCII character or of
  ASCII letters and digits, such as fullwidth letters; non-Latin letters inside a word that has
  ASCII letters: ``run\\u2010ci\\u2010lora``, ``l\\u043era`` with a Cyrillic o).
  A leading ``::`` (after spaces) and every ``##[`` are broken (``:\\x3a``, ``#\\x23[``), so
  no line that starts with its result can be read as a GitHub workflow command (the runner reads
  ``::command`` at the start of a line, a legacy ``##[command]`` anywhere); a ``::`` inside the
  text (a pytest node id) is harmless there and kept.  Other text, non-ASCII included, is kept (a backslash too:
  the shown form is for people, not meant to be parsed back).
- :func:`markdown` (``$GITHUB_STEP_SUMMARY``, ``summary.md``) is :func:`plain` with every ASCII
  punctuation character backslash-escaped (CommonMark renders each literally): no table break, no
  HTML, no link, image, autolink or mention, no emphasis.  :func:`markdown_code` is a code span
  whose fence is longer than any run of backticks inside it (``|`` escaped, as a table needs).
- :func:`xml_text` (text the CI writes into junit XML) keeps newlines and tabs and shows as code
  points the characters XML 1.0 cannot hold (other C0 controls, surrogates, U+FFFE/U+FFFF);
  ``ElementTree`` escapes the markup characters.
- :func:`annotation` (``::error file=…,line=…::…``) escapes values as the workflow-command
  syntax requires (``%``, CR and LF percent-encoded; ``:`` and ``,`` too in properties), so a
  message can never inject a second command; any other character that does not print (a
  terminal escape, a direction override) is shown as its code point, as :func:`plain` does.
  Annotations are printed only when ``GITHUB_ACTIONS=true``.
- Every escaping function here masks the values of the process-wide mask set
  (:func:`mizzen_ci.masking.mask`) *before* it escapes, so a registered secret never reaches a
  terminal, a summary or an annotation, whatever text carries it; text without one is unchanged.
- Every table renderer takes the same (headers, rows) shape; cells are converted with ``str``
  and escaped for the renderer's medium (a :class:`Code` cell is a code span in Markdown).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence

from . import masking

# One pattern finds everything plain() may change: any non-printable-ASCII character, and the
# two workflow-command openers.  Pure printable ASCII without them is returned as it is.
_SUSPECT = re.compile(r"[^\x20-\x7e]|^\s*::|##\[")
_ASCII_LETTER = re.compile(r"[A-Za-z]")
_WORD = re.compile(r"\S+")


class Code(str):
    """A table cell shown as code: a code span in Markdown, plain text elsewhere."""


def _code_point(ch: str) -> str:
    n = ord(ch)
    if n < 0x100:
        return f"\\x{n:02x}"
    return f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def _shown_as_code_point(ch: str, in_ascii_word: bool) -> bool:
    """Whether a non-ASCII character is shown as its code point (see the module docstring)."""
    import unicodedata  # only for non-ASCII text (an extension module: loaded on demand)

    if not ch.isprintable():  # Cc, Cf, Cs, Co, Cn, Zl, Zp and every space but U+0020
        return True
    category = unicodedata.category(ch)
    if category == "Pd":  # a dash that looks like "-"
        return True
    folded = unicodedata.normalize("NFKC", ch)
    if folded != ch and folded.isascii() and (len(folded) == 1 or folded.isalnum()):
        return (
            True  # a compatibility form of ASCII: fullwidth, superscripts, ligatures ("…" is not)
        )
    return (
        in_ascii_word
        and category.startswith("L")
        and not unicodedata.name(ch, "").startswith("LATIN")
    )


def plain(text: object) -> str:
    """``text`` as one line of safe printable text, registered secrets masked first (see the
    module docstring)."""
    return _plain(masking.mask(text))


def _plain(s: str) -> str:
    if not _SUSPECT.search(s):
        return s
    if not s.isascii():
        s = "".join(_escape_word(m.group()) if m else c for m, c in _words_and_spaces(s))
    else:
        s = "".join(c if " " <= c <= "~" else _code_point(c) for c in s)
    s = s.replace("##[", "#\\x23[")  # the runner finds a legacy ``##[command]`` anywhere
    stripped = s.lstrip()
    if stripped.startswith("::"):  # a ``::command`` only at the start of a line (after spaces)
        s = s[: len(s) - len(stripped)] + ":\\x3a" + stripped[2:]
    return s


def _words_and_spaces(s: str):
    """``(match, None)`` for each word and ``(None, char)`` for each character between words."""
    pos = 0
    for m in _WORD.finditer(s):
        for c in s[pos : m.start()]:
            yield None, (c if c == " " else _code_point(c))
        yield m, None
        pos = m.end()
    for c in s[pos:]:
        yield None, (c if c == " " else _code_point(c))


def _escape_word(word: str) -> str:
    in_ascii_word = bool(_ASCII_LETTER.search(word))
    return "".join(
        c
        if " " <= c <= "~"
        else (_code_point(c) if c.isascii() or _shown_as_code_point(c, in_ascii_word) else c)
        for c in word
    )


def plain_lines(text: object) -> str:
    """Multi-line text the CI wrote (a refusal with its details), each line through
    :func:`plain`: the lines stay lines, none can be a workflow command."""
    return "\n".join(plain(line) for line in str(text).splitlines())


_MARKDOWN_PUNCTUATION = re.compile(r"([!-/:-@\[-`{-~])")


def markdown(text: object) -> str:
    """``text`` as Markdown that renders as exactly its :func:`plain` form (see the module
    docstring)."""
    return _MARKDOWN_PUNCTUATION.sub(r"\\\1", plain(text))


def markdown_code(text: object) -> str:
    """``text`` as a Markdown code span (safe in a table cell; see the module docstring)."""
    s = plain(text).replace("|", "\\|")
    longest = max((len(run) for run in re.findall(r"`+", s)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if s.startswith("`") or s.endswith("`") or not s.strip() else ""
    return f"{fence}{pad}{s}{pad}{fence}"


_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def xml_text(text: object) -> str:
    """``text`` as characters XML 1.0 can hold (see the module docstring)."""
    s = masking.mask(text)
    return _NOT_XML.sub(lambda m: _code_point(m.group()), s) if _NOT_XML.search(s) else s


def text_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[plain(c) for c in r] for r in rows]
    heads = [plain(h) for h in headers]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(heads)]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()  # noqa: E731
    out = [line(heads), line(["-" * w for w in widths])]
    out += [line(r) for r in cells]
    return "\n".join(out)


def _markdown_cell(c: object) -> str:
    return markdown_code(c) if isinstance(c, Code) else markdown(c)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    out = [
        "| " + " | ".join(_markdown_cell(h) for h in headers) + " |",
        "|" + "---|" * len(headers),
    ]
    out += ["| " + " | ".join(_markdown_cell(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


# --------------------------------------------------------------------------------------------
# GitHub Actions workflow commands


def in_github_actions() -> bool:
    return os.environ.get("GITHUB_ACTIONS") == "true"


def _escape_data(s: str) -> str:
    s = s.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    if s.isascii() and s.isprintable():
        return s
    return "".join(c if c.isprintable() else _code_point(c) for c in s)


def _escape_property(s: str) -> str:
    return _escape_data(s).replace(":", "%3A").replace(",", "%2C")


def annotation(
    level: str,
    message: str,
    *,
    file: str | None = None,
    line: int | None = None,
    title: str | None = None,
) -> str:
    """The workflow command line for one annotation (``level``: error, warning or notice)."""
    props = []
    if file:
        props.append(f"file={_escape_property(masking.mask(file))}")
    if line:
        props.append(f"line={int(line)}")
    if title:
        props.append(f"title={_escape_property(masking.mask(title))}")
    head = f"::{level} {','.join(props)}" if props else f"::{level}"
    return f"{head}::{_escape_data(masking.mask(message))}"


# A registered secret is masked in the escaped forms of these media too (a text escaped before
# it reaches a masked stream).
masking.add_encoding(_plain)
masking.add_encoding(lambda s: _MARKDOWN_PUNCTUATION.sub(r"\\\1", _plain(s)))
masking.add_encoding(_escape_data)
masking.add_encoding(_escape_property)


def emit(level: str, message: str, **where) -> None:
    """Print the annotation to stdout when running under GitHub Actions."""
    if in_github_actions():
        print(annotation(level, message, **where), file=sys.stdout)
