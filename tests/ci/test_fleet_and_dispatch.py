"""The fleet table (its checks, pool derivation) and the arch dispatch policy, as tables of cases."""

from __future__ import annotations

from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.fleet import FleetError, load_fleet
from mizzen_ci.plan.dispatch import DispatchPolicy, Mode, dispatch, home_generation
from mizzen_ci.registry import Registration

register_cpu_ci(est_time=5, labels=["ci"])

FIXTURE_FLEET = load_fleet(Path(__file__).parent / "fixtures" / "registry" / "fleet.toml")


def cuda(hardware, num_gpus=1, needs=()):
    return Registration(
        path="tests/x/test_x.py",
        line=1,
        backend="cuda",
        est_time=10,
        labels=("lora",),
        hardware=tuple(hardware),
        num_gpus=num_gpus,
        needs=tuple(needs),
    )


@pytest.mark.parametrize(
    ("arch", "num_gpus", "needs", "pool"),
    [
        ("hopper", 1, (), "h200-2"),  # smallest that fits
        ("hopper", 2, (), "h200-2"),
        ("hopper", 3, (), "h100-8-rdma"),  # only the 8-GPU pool has 3
        ("hopper", 1, ("rdma",), "h100-8-rdma"),  # capability decides
        ("hopper", 9, (), None),
        ("blackwell", 4, (), "b200-4"),
        ("blackwell", 1, ("rdma",), None),
        ("ampere", 1, (), None),  # generation without a pool
    ],
)
def test_pool_derivation(arch, num_gpus, needs, pool):
    found = FIXTURE_FLEET.pool_for(arch, num_gpus, set(needs))
    assert (found.name if found else None) == pool


def test_pool_ties_break_on_fewer_capabilities_then_name(tmp_path: Path):
    text = (Path(__file__).parent / "fixtures" / "registry" / "fleet.toml").read_text()
    text += (
        '\n[[pool]]\nname = "a-h200-2-rdma"\narch = "hopper"\ngpu = "H200"\n'
        'gpus_per_runner = 2\nrunners = 1\nruns_on = ["self-hosted", "x"]\nrunner_group = "g"\njob_setup_s = 300\n'
        'capabilities = ["rdma"]\n'
        '\n[[pool]]\nname = "a-h200-2"\narch = "hopper"\ngpu = "H200"\n'
        'gpus_per_runner = 2\nrunners = 1\nruns_on = ["self-hosted", "y"]\nrunner_group = "g"\njob_setup_s = 300\n'
    )
    (tmp_path / "fleet.toml").write_text(text)
    fleet = load_fleet(tmp_path / "fleet.toml")
    assert fleet.pool_for("hopper", 2).name == "a-h200-2"  # no extra capability, then name order
    assert fleet.pool_for("hopper", 2, {"rdma"}).name == "a-h200-2-rdma"


def test_repo_fleet_has_the_required_generations_and_pools(repo_root):
    repo_fleet = load_fleet(repo_root / "ci" / "fleet.toml")
    assert repo_fleet.generation_names[0] == "hopper"
    assert {"ampere", "ada", "hopper", "blackwell"} <= set(repo_fleet.generation_names)
    assert repo_fleet.generation_of_target("9.0") == "hopper"
    assert repo_fleet.generation_of_target("10.0") == "blackwell"
    assert repo_fleet.generation_of_target("12.0") != "blackwell"  # consumer Blackwell is separate
    assert repo_fleet.generation_of_target("7.5") is None
    shapes = {
        (p.arch, p.gpu, p.gpus_per_runner, "rdma" in p.capabilities) for p in repo_fleet.pools
    }
    assert {
        ("hopper", "H200", 2, False),
        ("hopper", "H200", 8, False),
        ("hopper", "H100", 8, True),
        ("blackwell", "B200", 8, False),
    } <= shapes
    assert repo_fleet.cpu_pool.runs_on


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("labels = []\n[cpu_pool]\nname='c'\nruns_on=['u']\nrunners=1\n", "lacks `arch`"),
        (
            "labels=[]\n[[arch]]\nname='a'\nvendor='nvidia'\ncompute_capabilities=['9.0']\n[[arch]]\nname='b'\n"
            "vendor='nvidia'\ncompute_capabilities=['9.0']\n[cpu_pool]\nname='c'\nruns_on=['u']\nrunners=1\n",
            "listed for both a and b",
        ),
        (
            "labels=[]\n[[arch]]\nname='a'\nvendor='nvidia'\ncompute_capabilities=['nine']\n"
            "[cpu_pool]\nname='c'\nruns_on=['u']\nrunners=1\n",
            "is not 'M.m'",
        ),
        (
            "labels=[]\n[[arch]]\nname='a'\nvendor='nvidia'\ncompute_capabilities=['9.0']\n[[pool]]\nname='p'\n"
            "arch='zz'\ngpu='G'\ngpus_per_runner=1\nrunners=1\nruns_on=['x']\n"
            "[cpu_pool]\nname='c'\nruns_on=['u']\nrunners=1\n",
            "arch 'zz' is not one of",
        ),
        (
            "capabilities=['rdma']\nlabels=[]\n[[arch]]\nname='a'\nvendor='nvidia'\ncompute_capabilities=['9.0']\n"
            "[[pool]]\nname='p'\narch='a'\ngpu='G'\ngpus_per_runner=1\nrunners=1\nruns_on=['x']\n"
            "capabilities=['ib']\n[cpu_pool]\nname='c'\nruns_on=['u']\nrunners=1\n",
            "unknown capabilities ['ib']",
        ),
        (
            "labels=[]\n[[arch]]\nname='a'\nvendor='nvidia'\ncompute_capabilities=['9.0']\n[[pool]]\nname='p'\n"
            "arch='a'\ngpu='G'\ngpus_per_runner=true\nrunners=1\nruns_on=['x']\n"
            "[cpu_pool]\nname='c'\nruns_on=['u']\nrunners=1\n",
            "gpus_per_runner must be an integer",
        ),
        ("labels = [", "not valid TOML"),
    ],
)
def test_malformed_fleet_is_rejected_with_the_entry_named(tmp_path: Path, toml: str, message: str):
    (tmp_path / "fleet.toml").write_text(toml)
    with pytest.raises(FleetError, match=r"fleet\.toml") as info:
        load_fleet(tmp_path / "fleet.toml")
    assert message in str(info.value)


A, E, ALL = Mode.AUTO, Mode.EXPLICIT, Mode.ALL


@pytest.mark.parametrize(
    ("hardware", "num_gpus", "needs", "policy", "placed", "skipped"),
    [
        # AUTO: the first declared arch in preference order that the fleet can host.
        (["hopper", "blackwell"], 1, (), DispatchPolicy(A), ["hopper"], []),
        (["blackwell", "hopper"], 1, (), DispatchPolicy(A), ["hopper"], []),  # fleet order wins
        (["ampere", "blackwell"], 1, (), DispatchPolicy(A), ["blackwell"], []),  # ampere: no pool
        (["blackwell", "hopper"], 8, ("rdma",), DispatchPolicy(A), ["hopper"], []),
        (["hopper", "blackwell"], 3, (), DispatchPolicy(A), ["hopper"], []),
        # EXPLICIT without leave_home: the home arch stays, requested arches are added.
        (
            ["hopper", "blackwell"],
            1,
            (),
            DispatchPolicy(E, ("blackwell",)),
            ["hopper", "blackwell"],
            [],
        ),
        (
            ["hopper"],
            1,
            (),
            DispatchPolicy(E, ("blackwell",)),
            ["hopper"],
            [("blackwell", "does not declare blackwell")],
        ),
        # EXPLICIT with leave_home: exactly what was asked, never an undeclared arch.
        (
            ["hopper", "blackwell"],
            1,
            (),
            DispatchPolicy(E, ("blackwell",), leave_home=True),
            ["blackwell"],
            [],
        ),
        (
            ["hopper"],
            1,
            (),
            DispatchPolicy(E, ("blackwell",), leave_home=True),
            [],
            [("blackwell", "does not declare blackwell")],
        ),
        (
            ["hopper", "ampere"],
            1,
            (),
            DispatchPolicy(E, ("ampere",), leave_home=True),
            [],
            [("ampere", "arch not in fleet: no ampere pool")],
        ),
        (
            ["hopper", "blackwell"],
            8,
            (),
            DispatchPolicy(E, ("blackwell",), leave_home=True),
            [],
            [("blackwell", "no blackwell pool has 8 GPU(s)")],
        ),
        # ALL: every declared arch the fleet has (weekly).
        (
            ["hopper", "blackwell", "ampere"],
            1,
            (),
            DispatchPolicy(ALL),
            ["hopper", "blackwell"],
            [("ampere", "arch not in fleet: no ampere pool")],
        ),
        (
            ["blackwell", "hopper"],
            1,
            ("rdma",),
            DispatchPolicy(ALL),
            ["hopper"],
            [("blackwell", "no blackwell pool has 1 GPU(s) with rdma")],
        ),
    ],
)
def test_dispatch_policy_table(hardware, num_gpus, needs, policy, placed, skipped):
    got_placed, got_skipped = dispatch(cuda(hardware, num_gpus, needs), FIXTURE_FLEET, policy)
    assert [p.arch for p in got_placed] == placed
    assert got_skipped == skipped
    for p in got_placed:  # the pool is always the derived one
        assert p.pool == FIXTURE_FLEET.pool_for(p.arch, num_gpus, set(needs))


def test_home_arch_is_none_when_nothing_declared_is_hostable():
    assert home_generation(cuda(["ampere"]), FIXTURE_FLEET) is None
