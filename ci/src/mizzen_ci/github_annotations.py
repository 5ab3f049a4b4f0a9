"""GitHub Actions workflow-command annotations (``::error file=…,line=…::…``).

Invariant: annotations are printed only when ``GITHUB_ACTIONS=true``; values are escaped as the
workflow-command syntax requires, so a message can never inject a second command.
"""

from __future__ import annotations

import os
import sys


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
