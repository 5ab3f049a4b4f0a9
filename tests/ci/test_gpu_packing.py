"""The GPU packer: side by side by num_gpus, longest first, never two files on one GPU."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mizzen_ci import register_cpu_ci
from mizzen_ci.lane.packing import (
    GpuPacker,
    PackingError,
    PackItem,
    Slot,
    longest_first_key,
    simulate,
)

register_cpu_ci(est_time=8, labels=["ci", "gpu-lane"])


def check_schedule(items: list[PackItem], gpus: list[str], slots: list[Slot]) -> None:
    """Every invariant of a simulated schedule, from the slots alone."""
    # all placed, exactly once, with exactly num_gpus distinct GPUs of the host
    assert sorted(s.item.key for s in slots) == sorted(i.key for i in items)
    for s in slots:
        assert len(set(s.gpus)) == s.item.num_gpus and set(s.gpus) <= set(gpus)
        assert s.end - s.start == pytest.approx(s.item.est_seconds)
    # no GPU shared at any instant
    for g in gpus:
        on_g = sorted((s.start, s.end) for s in slots if g in s.gpus)
        for (_, end), (start, _) in itertools.pairwise(on_g):
            assert start >= end - 1e-9, f"GPU {g} holds two files at once"
    # longest first, work-conserving: when a file starts, every file ahead of it in longest-first
    # order that has not started yet needs more GPUs than were free at that moment
    order = sorted(items, key=longest_first_key)
    rank = {i.key: n for n, i in enumerate(order)}
    starts = sorted({s.start for s in slots})
    started: set[str] = set()
    for t in starts:
        busy = sum(s.item.num_gpus for s in slots if s.start < t < s.end)
        free = len(gpus) - busy
        now = sorted((s for s in slots if s.start == t), key=lambda s: rank[s.item.key])
        for s in now:
            waiting = [i for i in order[: rank[s.item.key]] if i.key not in started]
            waiting = [i for i in waiting if i.key not in {x.item.key for x in now}]
            assert all(i.num_gpus > free for i in waiting), (
                f"{s.item.key} started at {t} before {[i.key for i in waiting]} that fit"
            )
            free -= s.item.num_gpus
            assert free >= 0
        started.update(s.item.key for s in now)
        # and nothing that fits is left waiting while GPUs idle
        pending = [i for i in order if i.key not in started]
        assert all(i.num_gpus > free for i in pending)


def test_longest_starts_first_and_narrow_files_fill_the_gaps():
    items = [
        PackItem("tests/a.py", 1, 100),
        PackItem("tests/b.py", 2, 50),
        PackItem("tests/c.py", 1, 30),
        PackItem("tests/d.py", 4, 20),
        PackItem("tests/e.py", 1, 10),
    ]
    gpus = ["g0", "g1", "g2", "g3"]
    slots = simulate(items, gpus)
    check_schedule(items, gpus, slots)
    by_key = {s.item.key: s for s in slots}
    assert by_key["tests/a.py"].start == 0 and by_key["tests/b.py"].start == 0
    assert by_key["tests/c.py"].start == 0  # the fourth GPU is not left idle
    # the 4-GPU file waits for the whole host, which frees at 100
    assert by_key["tests/d.py"].start == 100
    assert by_key["tests/e.py"].start == 30  # backfills after c, on c's GPU
    assert by_key["tests/e.py"].gpus == by_key["tests/c.py"].gpus


def test_a_file_wider_than_the_host_is_rejected_up_front():
    with pytest.raises(PackingError, match="needs 3 GPU"):
        GpuPacker([PackItem("tests/wide.py", 3, 1)], ["g0", "g1"])


def test_refused_gpus_make_the_packer_try_the_next_file_and_retry_later():
    packer = GpuPacker(
        [PackItem("tests/two.py", 2, 50), PackItem("tests/one.py", 1, 10)], ["g0", "g1"]
    )
    held_elsewhere = {"g0"}  # another lane's lease

    def acquire(item, free):
        ok = [g for g in free if g not in held_elsewhere]
        return tuple(ok[: item.num_gpus]) if len(ok) >= item.num_gpus else None

    assert packer.start_ready(acquire) == [(PackItem("tests/one.py", 1, 10), ("g1",))]
    assert [i.key for i in packer.pending] == ["tests/two.py"]
    packer.finish("tests/one.py")
    held_elsewhere.clear()
    assert packer.start_ready(acquire) == [(PackItem("tests/two.py", 2, 50), ("g0", "g1"))]
    packer.finish("tests/two.py")
    assert packer.done()


def test_a_retried_file_goes_back_to_its_longest_first_place():
    packer = GpuPacker([PackItem("tests/b.py", 1, 5), PackItem("tests/c.py", 1, 1)], ["g0"])
    ((first, _),) = packer.start_ready()
    assert first.key == "tests/b.py"
    packer.finish("tests/b.py")
    packer.add(PackItem("tests/b.py", 1, 5))
    assert [i.key for i in packer.pending] == ["tests/b.py", "tests/c.py"]
    with pytest.raises(PackingError, match="already queued"):
        packer.add(PackItem("tests/b.py", 1, 5))


items_strategy = st.lists(
    st.tuples(st.integers(1, 8), st.floats(0.5, 500, allow_nan=False)),
    min_size=1,
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(raw=items_strategy, host=st.sampled_from([1, 2, 4, 8]))
def test_property_every_file_placed_no_gpu_shared_longest_first(raw, host):
    items = [PackItem(f"tests/t{i}.py", min(n, host), est) for i, (n, est) in enumerate(raw)]
    gpus = [f"gpu{i}" for i in range(host)]
    check_schedule(items, gpus, simulate(items, gpus))
