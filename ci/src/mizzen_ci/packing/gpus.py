"""Packing test files onto one host's GPUs: side by side, by GPU count, longest first.

The same :class:`GpuPacker` drives the real lane (events are process exits) and
:func:`simulate` (events are estimated end times), so what the tests check is what runs; the
planner's pool packer (:mod:`.pool`) simulates its jobs with it too, on the same
:class:`PackItem` and :class:`Slot` types.

Invariants:
- A GPU is given to at most one running file at any instant, except that up to ``seats`` files
  that declared ``shares_gpu`` (one GPU each) may hold the same GPU together; a file gets exactly
  ``num_gpus`` distinct GPUs, all of them free when it starts (a sharing file: one that is free or
  held by fewer than ``seats`` sharing files only).  A sharing file joins a GPU other sharing
  files hold before it takes a free one, so exclusive files keep the most free GPUs.
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
import itertools
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

#: Files registered with ``shares_gpu=True`` run at most this many at once on one GPU: the
#: registration promises a quarter of the smallest GPU of its generations.
MAX_GPU_SEATS = 4
#: The lane's ``--gpu-seats`` when none is given, which is what a planned job runs with.
DEFAULT_GPU_SEATS = MAX_GPU_SEATS


class PackingError(ValueError):
    """A file cannot be packed on this host (needs more GPUs than it has, or none)."""


@dataclass(frozen=True)
class PackItem:
    """One test file to place: a key (its path), how many GPUs, its estimated seconds, and
    whether it may share its one GPU with other such files (``register_*_ci(shares_gpu=True)``)."""

    key: str
    num_gpus: int
    est_seconds: float
    shares_gpu: bool = False

    @property
    def gpu_seconds(self) -> float:
        return self.num_gpus * self.est_seconds

    def charged_gpu_seconds(self, seats: int) -> float:
        """Its GPU-seconds when up to ``seats`` sharing files hold one GPU together: a shared
        GPU's time is split between them (the lane's accounting), so a full one costs 1/seats."""
        return self.est_seconds / seats if self.shares_gpu and seats > 1 else self.gpu_seconds


#: One holding of GPUs: (who, the GPUs, start, end, on a sharable seat).
Hold = tuple[Hashable, Sequence[str], float, float, bool]


def split_held_time(holds: Iterable[Hold]) -> tuple[dict[Hashable, float], set[Hashable]]:
    """The GPU-seconds each holding is charged -- the one accounting of the lane's summary and
    the planner: wall time × GPUs of an exclusive holding; while ``k`` sharing holdings hold one
    GPU together, each is charged ``1/k`` of its time (so they cost the time it was held at all).
    Also which holdings really held a GPU together with another at some instant."""
    charged: dict[Hashable, float] = {}
    together: set[Hashable] = set()
    spans: dict[str, list[tuple[float, float, Hashable]]] = {}  # GPU -> sharing holdings
    for key, gpus, start, end, sharing in holds:
        if not sharing:
            charged[key] = (end - start) * len(gpus)
            continue
        charged[key] = 0.0
        for gpu in gpus:
            spans.setdefault(gpu, []).append((start, end, key))
    for on_gpu in spans.values():
        edges = sorted({t for start, end, _ in on_gpu for t in (start, end)})
        for t0, t1 in itertools.pairwise(edges):
            holders = [key for start, end, key in on_gpu if start <= t0 and t1 <= end]
            for key in holders:
                charged[key] += (t1 - t0) / len(holders)
            if len(holders) > 1 and t1 > t0:
                together.update(holders)
    return charged, together


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
    """Online longest-first packing of items onto a fixed list of GPUs, each with ``seats`` seats
    for files that share a GPU (1: every file has its GPUs to itself)."""

    def __init__(self, items: Iterable[PackItem], gpus: Sequence[str], *, seats: int = 1):
        if len(set(gpus)) != len(gpus):
            raise PackingError(f"GPU list names a GPU twice: {list(gpus)}")
        if isinstance(seats, bool) or not isinstance(seats, int) or seats < 1:
            raise PackingError(f"seats per GPU must be an integer of at least 1, got {seats!r}")
        self.gpus = tuple(gpus)
        self.seats = seats
        self._order = {g: i for i, g in enumerate(self.gpus)}
        self._pending: list[PackItem] = []
        self._free: list[str] = list(self.gpus)
        self._sharers: dict[str, int] = {}  # GPU -> sharing files on it (not in _free while > 0)
        self._running: dict[str, tuple[str, ...]] = {}
        self._sharing: set[str] = set()  # keys of the running items that share their GPU
        for item in items:
            self.add(item)

    def add(self, item: PackItem) -> None:
        """Queue ``item`` (again, for a retry) at its longest-first position."""
        if item.num_gpus < 1 or item.num_gpus > len(self.gpus):
            raise PackingError(
                f"{item.key} needs {item.num_gpus} GPU(s); this host has {len(self.gpus)}"
            )
        if item.shares_gpu and item.num_gpus != 1:
            raise PackingError(
                f"{item.key} shares a GPU, so it needs exactly 1, not {item.num_gpus}"
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

    def sharers(self, gpu: str) -> int:
        """How many running sharing files hold ``gpu`` (0: free, or held by an exclusive file)."""
        return self._sharers.get(gpu, 0)

    def done(self) -> bool:
        return not self._pending and not self._running

    def _joinable(self) -> list[str]:
        """GPUs held by sharing files with a seat left, in host order."""
        return sorted(
            (g for g, n in self._sharers.items() if 0 < n < self.seats),
            key=self._order.__getitem__,
        )

    def start_ready(self, acquire: Acquire = take_first) -> list[tuple[PackItem, tuple[str, ...]]]:
        """Start every pending item that fits now, longest first; returns (item, its GPUs).

        ``acquire`` is offered, for a sharing item, each GPU it could join (alone) before the
        free GPUs."""
        started = []
        for item in list(self._pending):
            sharing = item.shares_gpu and self.seats > 1
            offers = [(g,) for g in self._joinable()] if sharing else []
            if item.num_gpus <= len(self._free):
                offers.append(tuple(self._free))
            for offer in offers:
                got = acquire(item, offer)
                if got is None:
                    continue
                if len(got) != item.num_gpus or not set(got) <= set(offer):
                    raise PackingError(f"acquire returned {got} for {item.num_gpus} of {offer}")
                self._pending.remove(item)
                self._free = [g for g in self._free if g not in got]
                if sharing:
                    self._sharers[got[0]] = self._sharers.get(got[0], 0) + 1
                    self._sharing.add(item.key)
                self._running[item.key] = tuple(got)
                started.append((item, tuple(got)))
                break
        return started

    def withdraw(self, key: str) -> PackItem:
        """Take the pending item ``key`` out of the queue (it will not start)."""
        for item in self._pending:
            if item.key == key:
                self._pending.remove(item)
                return item
        raise KeyError(key)

    def finish(self, key: str) -> tuple[str, ...]:
        """Mark the running item ``key`` finished; returns the GPUs that are free again (a shared
        GPU once its last sharing file finished)."""
        gpus = self._running.pop(key)
        if key in self._sharing:
            self._sharing.discard(key)
            (gpu,) = gpus
            self._sharers[gpu] -= 1
            if self._sharers[gpu]:
                return ()
            del self._sharers[gpu]
        self._free = sorted([*self._free, *gpus], key=self._order.__getitem__)
        return gpus


def simulate(items: Iterable[PackItem], gpus: Sequence[str], *, seats: int = 1) -> list[Slot]:
    """Run the packer against estimated durations; the schedule the real lane would follow if
    every file took exactly its estimate (files sharing a GPU as fast as alone)."""
    packer = GpuPacker(items, gpus, seats=seats)
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
