"""Packing test files onto one host's GPUs: side by side, by GPU count, longest first.

The same :class:`GpuPacker` drives the real lane (events are process exits) and
:func:`simulate` (events are estimated end times), so what the tests check is what runs; the
planner's pool packer (:mod:`mizzen_ci.plan.packing`) simulates its jobs with it too, on the same
:class:`PackItem` and :class:`Slot` types.

Invariants:
- A GPU is given to at most one running file at any instant; a file gets exactly ``num_gpus``
  distinct GPUs, all of them free when it starts.
- Pending files are considered longest first (estimate descending, then more GPUs, then path);
  each time GPUs free up, every pending file that fits starts, in that order (a shorter file may
  fill GPUs a longer, wider one cannot use yet: backfill).
- Every file whose ``num_gpus`` fits the host is placed; one that cannot ever fit is rejected up
  front (:class:`PackingError`), never left pending forever.
- ``acquire`` lets the caller refuse GPUs (another lane holds their lease): the packer then tries
  the next file and retries on the next call.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


class PackingError(ValueError):
    """A file cannot be packed on this host (needs more GPUs than it has, or none)."""


@dataclass(frozen=True)
class PackItem:
    """One test file to place: a key (its path), how many GPUs, and its estimated seconds."""

    key: str
    num_gpus: int
    est_seconds: float

    @property
    def gpu_seconds(self) -> float:
        return self.num_gpus * self.est_seconds


@dataclass(frozen=True)
class Slot:
    """Where (GPU names) and when (seconds after the start) one item ran."""

    item: PackItem
    gpus: tuple[str, ...]
    start: float
    end: float


def longest_first_key(item: PackItem) -> tuple[float, int, str]:
    return (-item.est_seconds, -item.num_gpus, item.key)


# acquire(item, free GPUs in host order) -> item.num_gpus of them, now held by the caller, or None
Acquire = Callable[[PackItem, tuple[str, ...]], tuple[str, ...] | None]


def take_first(item: PackItem, free: tuple[str, ...]) -> tuple[str, ...] | None:
    return free[: item.num_gpus] if len(free) >= item.num_gpus else None


class GpuPacker:
    """Online longest-first packing of items onto a fixed list of GPUs."""

    def __init__(self, items: Iterable[PackItem], gpus: Sequence[str]):
        if len(set(gpus)) != len(gpus):
            raise PackingError(f"GPU list names a GPU twice: {list(gpus)}")
        self.gpus = tuple(gpus)
        self._order = {g: i for i, g in enumerate(self.gpus)}
        self._pending: list[PackItem] = []
        self._free: list[str] = list(self.gpus)
        self._running: dict[str, tuple[str, ...]] = {}
        for item in items:
            self.add(item)

    def add(self, item: PackItem) -> None:
        """Queue ``item`` (again, for a retry) at its longest-first position."""
        if item.num_gpus < 1 or item.num_gpus > len(self.gpus):
            raise PackingError(
                f"{item.key} needs {item.num_gpus} GPU(s); this host has {len(self.gpus)}"
            )
        if item.key in self._running or any(p.key == item.key for p in self._pending):
            raise PackingError(f"{item.key} is already queued or running")
        keys = [longest_first_key(p) for p in self._pending]
        self._pending.insert(bisect.bisect(keys, longest_first_key(item)), item)

    @property
    def pending(self) -> tuple[PackItem, ...]:
        return tuple(self._pending)

    @property
    def running(self) -> dict[str, tuple[str, ...]]:
        return dict(self._running)

    @property
    def free(self) -> tuple[str, ...]:
        return tuple(self._free)

    def done(self) -> bool:
        return not self._pending and not self._running

    def start_ready(self, acquire: Acquire = take_first) -> list[tuple[PackItem, tuple[str, ...]]]:
        """Start every pending item that fits now, longest first; returns (item, its GPUs)."""
        started = []
        for item in list(self._pending):
            if item.num_gpus > len(self._free):
                continue
            got = acquire(item, tuple(self._free))
            if got is None:
                continue
            if len(got) != item.num_gpus or not set(got) <= set(self._free):
                raise PackingError(f"acquire returned {got} for {item.num_gpus} of {self._free}")
            self._pending.remove(item)
            self._free = [g for g in self._free if g not in got]
            self._running[item.key] = tuple(got)
            started.append((item, tuple(got)))
        return started

    def withdraw(self, key: str) -> PackItem:
        """Take the pending item ``key`` out of the queue (it will not start)."""
        for item in self._pending:
            if item.key == key:
                self._pending.remove(item)
                return item
        raise KeyError(key)

    def finish(self, key: str) -> tuple[str, ...]:
        """Mark the running item ``key`` finished; its GPUs are free again."""
        gpus = self._running.pop(key)
        self._free = sorted([*self._free, *gpus], key=self._order.__getitem__)
        return gpus


def simulate(items: Iterable[PackItem], gpus: Sequence[str]) -> list[Slot]:
    """Run the packer against estimated durations; the schedule the real lane would follow if
    every file took exactly its estimate."""
    packer = GpuPacker(items, gpus)
    now = 0.0
    running: dict[str, Slot] = {}
    slots: list[Slot] = []
    while not packer.done():
        for item, got in packer.start_ready():
            running[item.key] = Slot(item, got, now, now + item.est_seconds)
        if not running:
            raise PackingError(f"nothing can start with {len(packer.free)} free GPU(s)")
        now = min(s.end for s in running.values())
        for key in sorted(k for k, s in running.items() if s.end == now):
            slots.append(running.pop(key))
            packer.finish(key)
    return sorted(slots, key=lambda s: (s.start, longest_first_key(s.item)))
