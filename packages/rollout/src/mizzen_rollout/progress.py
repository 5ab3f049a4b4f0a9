"""A dependency-free progress bar for the CLI (stderr).

Invariants:
- On a terminal it redraws one line at most 10 times a second; elsewhere (CI logs, pipes) it
  prints a plain line at every 10 % step, so logs stay short and readable.
- It never writes to stdout (stdout carries the summary).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["ProgressBar"]


class ProgressBar:
    def __init__(
        self,
        total: int,
        *,
        label: str = "samples",
        stream: TextIO | None = None,
        enabled: bool = True,
        width: int = 30,
    ):
        self.total = max(total, 0)
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.width = width
        self.done = 0
        self.counts: dict[str, int] = {}
        self._start = time.perf_counter()
        self._last_draw = 0.0
        self._last_step = -1
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def update(self, status: str | None = None, n: int = 1) -> None:
        self.done += n
        if status is not None:
            self.counts[status] = self.counts.get(status, 0) + n
        if not self.enabled:
            return
        now = time.perf_counter()
        if self._tty:
            if now - self._last_draw >= 0.1 or self.done >= self.total:
                self._last_draw = now
                self.stream.write("\r" + self._line(now))
                self.stream.flush()
        else:
            step = (10 * self.done // self.total) if self.total else 10
            if step != self._last_step:
                self._last_step = step
                self.stream.write(self._line(now) + "\n")
                self.stream.flush()

    def _line(self, now: float) -> str:
        frac = self.done / self.total if self.total else 1.0
        filled = int(self.width * frac)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = now - self._start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        counts = " ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))
        return (
            f"[{bar}] {self.done}/{self.total} {self.label} {frac:4.0%} "
            f"{rate:.1f}/s {elapsed:.1f}s {counts}"
        )

    def close(self) -> None:
        if self.enabled and self._tty:
            self.stream.write("\n")
            self.stream.flush()
