"""A GPU lane's live progress.

Invariant: on a terminal it is one status line redrawn in place (files done/total, GPUs busy,
what runs); in CI (``CI`` set) or when stdout is not a terminal every event is one plain line and
nothing is redrawn.  Event and status text (file names, a test's failure message) goes through
:func:`mizzen_ci.output.plain_lines` / :func:`~mizzen_ci.output.plain`: the only control
characters written are the redraw's own.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path
from typing import TextIO

from ..output import plain, plain_lines


class Progress:
    """Live progress: a redrawn status line on a terminal, plain event lines otherwise."""

    def __init__(
        self, total: int, gpus: int, stream: TextIO | None = None, live: bool | None = None
    ):
        self.stream = stream or sys.stdout
        self.total = total
        self.gpus = gpus
        self.done = 0
        self.live = (
            live if live is not None else (self.stream.isatty() and not os.environ.get("CI"))
        )
        self._status_shown = False
        self._last_draw = 0.0

    def _clear(self) -> None:
        if self._status_shown:
            self.stream.write("\r\x1b[K")
            self._status_shown = False

    def event(self, line: str) -> None:
        self._clear()
        self.stream.write(plain_lines(line) + "\n")
        self.stream.flush()

    def status(self, running: dict[str, tuple[str, ...]], force: bool = False) -> None:
        if not self.live:
            return
        now = time.monotonic()
        if not force and now - self._last_draw < 0.5:
            return
        self._last_draw = now
        busy = len({gpu for held in running.values() for gpu in held})  # a shared GPU counts once
        names = plain(", ".join(Path(k).name for k in sorted(running)))
        line = f"[{self.done}/{self.total} files] GPUs busy {busy}/{self.gpus} · {names}"
        width = shutil.get_terminal_size((120, 24)).columns
        self._clear()
        self.stream.write(line[: max(width - 1, 20)])
        self.stream.flush()
        self._status_shown = True

    def close(self) -> None:
        self._clear()
        self.stream.flush()
