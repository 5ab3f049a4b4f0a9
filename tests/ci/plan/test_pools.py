"""Pools that can host the same tests share them, and every job pays its set-up: the planner's
job records against the fleet (a property test over random fleets and tests, and the case the
issue measured: two equivalent 8-GPU pools, one of which used to idle)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mizzen_ci import register_cpu_ci
from mizzen_ci.fleet import parse_fleet
from mizzen_ci.history import Estimator
from mizzen_ci.packing.gpus import PackItem
from mizzen_ci.packing.pool import pack
from mizzen_ci.plan.jobs import pack_jobs
from mizzen_ci.plan.selection import Selected
from mizzen_ci.registry import Backend, Registration

register_cpu_ci(est_time=30, labels=["ci"])

EPS = 1e-6
HEAD = """\
labels = ["ci"]
capabilities = ["rdma"]

[[arch]]
name = "hopper"
vendor = "nvidia"
compute_capabilities = ["9.0"]

[cpu_pool]
name = "cpu"
runs_on = ["ubuntu-24.04"]
runners = 4
job_setup_s = 60
"""


def pool_toml(name: str, gpus: int, runners: int, setup: float, caps: tuple[str, ...] = ()) -> str:
    return (
        f'\n[[pool]]\nname = "{name}"\narch = "hopper"\ngpu = "H"\ngpus_per_runner = {gpus}\n'
        f'runners = {runners}\nruns_on = ["self-hosted", "{name}"]\nrunner_group = "g-{name}"\n'
        f"job_setup_s = {setup}\ncapabilities = {list(caps)!r}\n"
    )


def selected(fleet, tests: list[tuple[str, int, float, tuple[str, ...]]]) -> list[Selected]:
    out = []
    for path, gpus, seconds, needs in tests:
        reg = Registration(
            path, 1, Backend.CUDA, seconds, ("ci",), False, None, ("hopper",), gpus, needs
        )
        out.append(Selected(reg, "hopper", fleet.pool_for("hopper", gpus, set(needs)), "asked for"))
    return out


def default_finish(fleet, chosen: list[Selected], budget: float) -> float:
    """When the arch is done if every test takes its smallest pool (what the planner did)."""
    by_pool: dict[str, list[Selected]] = {}
    for s in chosen:
        by_pool.setdefault(s.pool.name, []).append(s)
    ends = []
    for name, tests in by_pool.items():
        p = fleet.pool(name)
        items = [PackItem(s.reg.path, s.reg.num_gpus, s.reg.est_time) for s in tests]
        ends.append(
            pack(
                items,
                gpus=p.gpus_per_runner,
                runners=p.runners,
                budget=budget,
                min_job=max(300, p.job_setup_s),
                setup=p.job_setup_s,
            ).makespan
        )
    return max(ends)


def check(fleet, chosen: list[Selected], budget: float = 3600) -> tuple[float, float, dict]:
    jobs, pools, arches, _ = pack_jobs(chosen, fleet, Estimator(), budget, 300)
    (arch,) = arches
    where = {t.file: j.pool for j in jobs for t in j.tests}
    by_file = {s.reg.path: s for s in chosen}
    assert sorted(where) == sorted(by_file)  # each test once
    for file, pool_name in where.items():
        pool, reg = fleet.pool(pool_name), by_file[file].reg
        assert pool.gpus_per_runner >= reg.num_gpus and set(reg.needs) <= pool.capabilities
    setups = {p.pool: p.setup_seconds for p in pools}
    for j in jobs:
        assert j.est_seconds >= setups[j.pool] and all(
            t.start_seconds >= setups[j.pool] for t in j.tests
        )
        if not j.over_budget:
            assert j.est_seconds <= budget + EPS  # the budget holds the set-up too
    assert arch.makespan_seconds == pytest.approx(max(p.makespan_seconds for p in pools), abs=0.1)
    assert arch.makespan_seconds >= arch.bound_seconds - 0.1
    return arch.makespan_seconds, default_finish(fleet, chosen, budget), where


def test_two_equivalent_pools_share_the_work_the_first_one_used_to_take(tmp_path: Path):
    fleet = parse_fleet(
        HEAD + pool_toml("h200-8", 8, 2, 300) + pool_toml("h100-8", 8, 2, 300), "fleet.toml"
    )
    tests = [
        (f"tests/t/test_{k:03d}.py", 8 if k % 3 == 0 else 1, 600 + 37 * k, ()) for k in range(60)
    ]
    shared, alone, where = check(fleet, selected(fleet, tests))
    assert {"h200-8", "h100-8"} == set(where.values())
    assert shared <= 0.65 * alone, (shared, alone)


def test_a_test_that_needs_a_capability_stays_on_the_pools_that_have_it():
    fleet = parse_fleet(
        HEAD + pool_toml("plain", 8, 3, 300) + pool_toml("rdma", 8, 1, 300, ("rdma",)), "f.toml"
    )
    tests = [(f"tests/t/test_r{k}.py", 8, 900.0, ("rdma",)) for k in range(4)]
    tests += [(f"tests/t/test_p{k}.py", 8, 900.0, ()) for k in range(12)]
    _, _, where = check(fleet, selected(fleet, tests))
    assert all(where[f"tests/t/test_r{k}.py"] == "rdma" for k in range(4))


@st.composite
def cases(draw):
    n_pools = draw(st.integers(1, 3))
    toml = HEAD
    for k in range(n_pools):
        gpus = draw(st.sampled_from([1, 2, 4, 8]))
        toml += pool_toml(
            f"p{k}", gpus, draw(st.integers(1, 4)), draw(st.sampled_from([0, 60, 300, 900])),
            ("rdma",) if draw(st.booleans()) else (),
        )  # fmt: skip
    fleet = parse_fleet(toml, "fleet.toml")
    biggest = max(p.gpus_per_runner for p in fleet.pools)
    tests = []
    for k in range(draw(st.integers(1, 30))):
        gpus = draw(st.sampled_from([g for g in (1, 2, 4, 8) if g <= biggest]))
        needs = ("rdma",) if draw(st.integers(0, 4)) == 0 else ()
        if fleet.pool_for("hopper", gpus, set(needs)) is None:
            needs = ()
            if fleet.pool_for("hopper", gpus) is None:
                continue
        tests.append((f"tests/t/test_{k:02d}.py", gpus, draw(st.floats(10, 5000)), needs))
    return fleet, tests


@settings(max_examples=60, deadline=None)
@given(cases())
def test_sharing_pools_is_never_worse_than_each_test_on_its_smallest_pool(case):
    fleet, tests = case
    if not tests:
        return
    shared, alone, _ = check(fleet, selected(fleet, tests))
    assert shared <= alone + 0.1  # (the plan rounds seconds to 0.1)
