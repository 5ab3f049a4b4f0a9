"""What the trusted history shows about each (test file, arch): its last n outcomes, how often
they flip, the attempts that passed only on retry, and its clean streak.

Invariants:
- Inputs are the duration records and flake records of the history cache (already validated and
  bounded by :mod:`mizzen_ci.history`'s readers); a CPU-lane record (``arch`` null) is arch
  ``cpu``, the name both quarantine lists use.
- A run is *bad* when it failed or errored; a skipped run is neither good nor bad and is left
  out of the series (it says nothing about flakiness).  A *flip* is a change between good and bad
  from one run to the next in the window.
- A *retry pass* is a flake record whose file ended ``passed``: the file passed only on retry.
  It counts in the window when it is not older than the window's first run.
- The *clean streak* counts the newest runs that passed, after the last bad run and the last
  flake record of the pair: a retried attempt is never clean.
- Records given twice (a re-uploaded artifact) count once; order is by time, then job.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from ..history import FlakeRecord, Record

CPU_ARCH = "cpu"
BAD = ("failed", "error")


@dataclass(frozen=True)
class Evidence:
    file: str
    arch: str
    window: tuple[str, ...]  # outcomes of the last n runs, oldest first
    flips: int
    retry_passes: int  # flake records in the window whose file then passed
    first_seen: str | None  # time of the window's first bad run or retry pass
    clean_streak: int
    runs: int  # every recorded run of the pair (the flake rate's denominator)
    retried: int  # every flake record of the pair

    @property
    def key(self) -> tuple[str, str]:
        return self.file, self.arch

    @property
    def failures(self) -> int:
        return sum(o in BAD for o in self.window)

    def sparkline(self) -> str:
        """The window as text: ``P`` passed, ``F`` failed or errored."""
        return "".join("F" if o in BAD else "P" for o in self.window)


def _flips(outcomes: list[str]) -> int:
    bad = [o in BAD for o in outcomes]
    return sum(a != b for a, b in itertools.pairwise(bad))


def gather(
    records: Iterable[Record], flakes: Iterable[FlakeRecord], *, window: int
) -> dict[tuple[str, str], Evidence]:
    """The evidence of every (file, arch) with a run or a flake record."""
    runs: dict[tuple[str, str], list[Record]] = {}
    for r in dict.fromkeys(records):
        if r.outcome != "skipped":
            runs.setdefault((r.file, r.arch or CPU_ARCH), []).append(r)
    retries: dict[tuple[str, str], list[FlakeRecord]] = {}
    for f in dict.fromkeys(flakes):
        retries.setdefault((f.file, f.arch), []).append(f)
    out = {}
    for key in sorted(set(runs) | set(retries)):
        rs = sorted(runs.get(key, []), key=lambda r: (r.when, r.job or ""))
        fs = sorted(retries.get(key, []), key=lambda f: f.when)
        out[key] = _evidence(key, rs, fs, window)
    return out


def _evidence(key, rs: list[Record], fs: list[FlakeRecord], window: int) -> Evidence:
    last = rs[-window:]
    start = last[0].when if last else ""
    passes = [f for f in fs if f.final == "passed" and f.when >= start]
    bad_times = [r.when for r in last if r.outcome in BAD] + [f.when for f in passes]
    last_bad = max([r.when for r in rs if r.outcome in BAD] + [f.when for f in fs], default="")
    streak = 0
    for r in reversed(rs):
        if r.outcome != "passed" or r.when <= last_bad:
            break
        streak += 1
    return Evidence(
        file=key[0], arch=key[1], window=tuple(r.outcome for r in last), flips=_flips([r.outcome for r in last]),
        retry_passes=len(passes), first_seen=min(bad_times, default=None), clean_streak=streak,
        runs=len(rs), retried=len(fs),
    )  # fmt: skip
