"""What a GPU lane tells people: live progress, the summary table, and the flake record.

Invariants:
- Progress on a terminal is one status line redrawn in place (files done/total, GPUs busy, what
  runs); in CI (``CI`` set) or when stdout is not a terminal every event is one plain line and
  nothing is redrawn.
- The summary lists every file the lane considered, once: run (passed / failed / timeout, with
  GPUs and seconds), not runnable here, disabled, or broken in the registry.
- The flake record is JSON lines, append-only, one line per retried attempt, keyed by
  (test file, arch): ``{"file", "arch", "class", "evidence", "final", "when", "job"}``; the summary
  shows this run's retries with how often each key appears in the record.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

from .tables import markdown_table, text_table


@dataclass(frozen=True)
class FlakeEntry:
    file: str
    arch: str
    klass: str
    evidence: str
    final: str  # outcome of the file after its retry
    when: str
    job: str | None = None

    def to_json(self) -> str:
        d = asdict(self)
        d["class"] = d.pop("klass")
        return json.dumps(d, sort_keys=True)


def append_flakes(path: Path, entries: Iterable[FlakeEntry]) -> None:
    lines = "".join(e.to_json() + "\n" for e in entries)
    if not lines:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(lines)


def flake_counts(path: Path) -> dict[tuple[str, str], int]:
    """How many retried attempts the record holds per (file, arch); unreadable lines are named."""
    counts: dict[tuple[str, str], int] = {}
    if not path.is_file():
        return counts
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            key = (obj["file"], obj["arch"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{lineno}: not a flake record line ({e})") from None
        counts[key] = counts.get(key, 0) + 1
    return counts


def now_utc() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


@dataclass(frozen=True)
class SummaryRow:
    file: str
    gpus: str
    seconds: float | None
    outcome: str
    ok: bool


def summary_tables(
    rows: Sequence[SummaryRow],
    flakes: Sequence[FlakeEntry],
    record_counts: dict[tuple[str, str], int],
    *,
    markdown: bool = False,
) -> str:
    render = markdown_table if markdown else text_table
    out = [
        render(
            ("file", "GPUs", "seconds", "outcome"),
            [
                (r.file, r.gpus, "-" if r.seconds is None else f"{r.seconds:.1f}", r.outcome)
                for r in rows
            ],
        )
    ]
    if flakes:
        out.append("")
        out.append("Retried infrastructure failures (flake record, keyed by file and arch):")
        out.append(
            render(
                ("file", "arch", "class", "after retry", "in record"),
                [
                    (f.file, f.arch, f.klass, f.final, record_counts.get((f.file, f.arch), 0))
                    for f in flakes
                ],
            )
        )
    return "\n".join(out)


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
        self.stream.write(line + "\n")
        self.stream.flush()

    def status(self, running: dict[str, tuple[str, ...]], force: bool = False) -> None:
        if not self.live:
            return
        now = time.monotonic()
        if not force and now - self._last_draw < 0.5:
            return
        self._last_draw = now
        busy = sum(len(g) for g in running.values())
        names = ", ".join(Path(k).name for k in sorted(running))
        line = f"[{self.done}/{self.total} files] GPUs busy {busy}/{self.gpus} · {names}"
        width = shutil.get_terminal_size((120, 24)).columns
        self._clear()
        self.stream.write(line[: max(width - 1, 20)])
        self.stream.flush()
        self._status_shown = True

    def close(self) -> None:
        self._clear()
        self.stream.flush()
