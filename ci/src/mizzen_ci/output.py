"""What mizzen-ci prints for people and for GitHub: text and Markdown tables, workflow annotations.

Invariants:
- Every table renderer takes the same (headers, rows) shape; cells are converted with ``str``.
- Markdown cells never break the table (``|`` escaped, newlines folded).
- Annotations (``::error file=…,line=…::…``) are printed only when ``GITHUB_ACTIONS=true``; values
  are escaped as the workflow-command syntax requires, so a message can never inject a second
  command.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence


def text_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()  # noqa: E731
    out = [line(headers), line(["-" * w for w in widths])]
    out += [line(r) for r in cells]
    return "\n".join(out)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    esc = lambda c: str(c).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    out = ["| " + " | ".join(esc(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


# --------------------------------------------------------------------------------------------
# GitHub Actions workflow commands


def in_github_actions() -> bool:
    return os.environ.get("GITHUB_ACTIONS") == "true"


def _escape_data(s: str) -> str:
    return s.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


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
        props.append(f"file={_escape_property(file)}")
    if line:
        props.append(f"line={line}")
    if title:
        props.append(f"title={_escape_property(title)}")
    head = f"::{level} {','.join(props)}" if props else f"::{level}"
    return f"{head}::{_escape_data(message)}"


def emit(level: str, message: str, **where) -> None:
    """Print the annotation to stdout when running under GitHub Actions."""
    if in_github_actions():
        print(annotation(level, message, **where), file=sys.stdout)
