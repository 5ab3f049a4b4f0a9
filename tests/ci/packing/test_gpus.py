"""The GPU packer: side by side by num_gpus, longest first, never two files on one GPU unless both
share it (``shares_gpu``, up to the seats of a GPU)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mizzen_ci import register_cpu_ci
from mizzen_ci.packing.gpus import (
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


def check_sharing(items: list[PackItem], gpus: list[str], seats: int, slots: list[Slot]) -> None:
    """Every file placed once; at any instant a GPU holds one exclusive file or at most
    ``seats`` sharing ones, never both; a sharing file took a free GPU only when no GPU held by
    sharing files had a seat left."""
    assert sorted(s.item.key for s in slots) == sorted(i.key for i in items)
    sharing = {i.key for i in items if i.shares_gpu and seats > 1}
    for s in slots:
        assert len(set(s.gpus)) == s.item.num_gpus and set(s.gpus) <= set(gpus)
    for t in sorted({s.start for s in slots}):
        for g in gpus:
            on = [s for s in slots if g in s.gpus and s.start <= t < s.end]
            shared = [s for s in on if s.item.key in sharing]
            assert len(shared) == len(on) or len(on) <= 1, (t, g, on)
            assert len(shared) <= seats, (t, g, shared)
        for s in (s for s in slots if s.start == t and s.item.key in sharing):
            (g,) = s.gpus

            def sharers_before(h: str, s: Slot = s, t: float = t) -> int:
                """Sharing files on ``h`` the moment before ``s`` started (same-time starts go
                longest first)."""
                return sum(
                    1
                    for o in slots
                    if h in o.gpus
                    and o.item.key in sharing
                    and o is not s
                    and o.end > t
                    and (o.start < t or longest_first_key(o.item) < longest_first_key(s.item))
                    and o.start <= t
                )

            if sharers_before(g):
                assert sharers_before(g) < seats
                continue  # it joined GPU g
            joinable = [h for h in gpus if 0 < sharers_before(h) < seats]
            assert not joinable, f"{s.item.key} took free GPU {g} while {joinable} had a seat"


def test_sharing_files_run_side_by_side_on_one_gpu_and_exclusive_ones_alone():
    items = [
        PackItem("tests/e2e_a.py", 1, 100, shares_gpu=True),
        PackItem("tests/e2e_b.py", 1, 90, shares_gpu=True),
        PackItem("tests/alone.py", 1, 80),
        PackItem("tests/small.py", 1, 10, shares_gpu=True),
        PackItem("tests/tiny.py", 1, 5, shares_gpu=True),
    ]
    slots = simulate(items, ["g0"], seats=4)
    check_sharing(items, ["g0"], 4, slots)
    at = {s.item.key: s.start for s in slots}
    # the four sharing files start at once; the exclusive one waits for the GPU to be free
    assert at == {
        "tests/e2e_a.py": 0, "tests/e2e_b.py": 0, "tests/small.py": 0, "tests/tiny.py": 0,
        "tests/alone.py": 100,
    }  # fmt: skip
    assert max(s.end for s in slots) == 180  # exclusive, the same files take 285
    assert max(s.end for s in simulate(items, ["g0"], seats=1)) == 285
    # on two GPUs, sharing files fill the GPU sharing files hold; the other stays free
    slots = simulate(items, ["g0", "g1"], seats=4)
    check_sharing(items, ["g0", "g1"], 4, slots)
    assert {s.gpus for s in slots if s.item.shares_gpu} == {("g0",)}
    assert next(s for s in slots if s.item.key == "tests/alone.py").gpus == ("g1",)


def test_a_sharing_file_needs_one_gpu_and_seats_are_at_least_one():
    with pytest.raises(PackingError, match="needs exactly 1"):
        GpuPacker([PackItem("tests/two.py", 2, 1, shares_gpu=True)], ["g0", "g1"])
    for seats in (0, True, 1.5):
        with pytest.raises(PackingError, match="seats per GPU"):
            GpuPacker([], ["g0"], seats=seats)


def test_a_shared_gpu_is_free_again_only_when_its_last_sharing_file_finished():
    packer = GpuPacker(
        [PackItem("tests/a.py", 1, 9, shares_gpu=True), PackItem("tests/b.py", 1, 8, True),
         PackItem("tests/x.py", 1, 1)], ["g0"], seats=2,
    )  # fmt: skip
    assert [(i.key, g) for i, g in packer.start_ready()] == [
        ("tests/a.py", ("g0",)),
        ("tests/b.py", ("g0",)),
    ]
    assert packer.sharers("g0") == 2 and packer.free == ()
    assert packer.finish("tests/a.py") == ()
    assert packer.start_ready() == []  # x needs g0 to itself
    assert packer.finish("tests/b.py") == ("g0",)
    assert [i.key for i, _ in packer.start_ready()] == ["tests/x.py"]


@settings(max_examples=150, deadline=None)
@given(
    raw=st.lists(
        st.tuples(st.integers(1, 4), st.floats(0.5, 500, allow_nan=False), st.booleans()),
        min_size=1,
        max_size=30,
    ),
    host=st.sampled_from([1, 2, 4]),
    seats=st.sampled_from([1, 2, 4]),
)
def test_property_sharing_never_overfills_a_gpu_nor_mixes_exclusive_files(raw, host, seats):
    items = [
        PackItem(f"tests/t{i}.py", 1 if share else min(n, host), est, share)
        for i, (n, est, share) in enumerate(raw)
    ]
    gpus = [f"gpu{i}" for i in range(host)]
    slots = simulate(items, gpus, seats=seats)
    check_sharing(items, gpus, seats, slots)
    if seats == 1:
        check_schedule(items, gpus, slots)  # no seats: exactly the exclusive schedule
