"""AMD generations in the one fleet table: the vocabulary's checks, one registration spanning
vendors, and the dispatch policy over the repository's fleet (NVIDIA and AMD pools together)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.fleet import FleetError, load_fleet, parse_fleet
from mizzen_ci.plan.dispatch import DispatchPolicy, Mode, dispatch, home_generation
from mizzen_ci.registry import Backend, declares_target, read_registry, read_source

register_cpu_ci(est_time=5, labels=["ci"])

REPO_FLEET = load_fleet(Path(__file__).resolve().parents[2] / "ci" / "fleet.toml")

CPU_POOL = "[cpu_pool]\nname='c'\nruns_on=['u']\nrunners=1\njob_setup_s=60\n"
HOPPER = "[[arch]]\nname='hopper'\nvendor='nvidia'\ncompute_capabilities=['9.0']\n"


def test_the_repository_fleet_has_the_cdna_generations_and_their_pools():
    f = REPO_FLEET
    assert {a.name: (a.vendor, a.targets) for a in f.generations if a.vendor == "amd"} == {
        "cdna2": ("amd", ("gfx90a",)),
        "cdna3": ("amd", ("gfx942",)),
        "cdna4": ("amd", ("gfx950",)),
    }
    assert {"MI210", "MI250", "MI250X"} == set(f.generation("cdna2").gpus)
    assert {"MI300X", "MI300A", "MI325X"} == set(f.generation("cdna3").gpus)
    assert {"MI350X", "MI355X"} == set(f.generation("cdna4").gpus)
    assert f.generation_of_target("gfx942") == "cdna3" and f.generation_of_target("9.0") == "hopper"
    assert f.generation_of_target("gfx1100") is None
    # one preference order across vendors: the NVIDIA generations come first
    names = f.generation_names
    assert names.index("hopper") < names.index("cdna3") < names.index("cdna4")
    amd_pools = {p.gpu: p for p in f.pools if f.generation(p.arch).vendor == "amd"}
    assert set(amd_pools) == {"MI300X", "MI355X"}
    for gpu, arch in (("MI300X", "cdna3"), ("MI355X", "cdna4")):
        pool = amd_pools[gpu]
        assert (pool.arch, pool.gpus_per_runner) == (arch, 8)
        assert pool.runs_on[0] == "self-hosted" and gpu.lower() in pool.runs_on
        assert pool.runner_group and pool.job_setup_s > 0
        assert "nvlink" not in pool.capabilities and "xgmi" in pool.capabilities
    assert f.vendor_of("cdna3").visible_devices == "HIP_VISIBLE_DEVICES"
    assert f.vendor_of("hopper").visible_devices == "CUDA_VISIBLE_DEVICES"
    assert f.vendor_of(None) is None


@pytest.mark.parametrize(
    ("arches", "message"),
    [
        ("[[arch]]\nname='a'\ncompute_capabilities=['9.0']\n", "[[arch]] #1 (a) lacks `vendor`"),
        (
            "[[arch]]\nname='a'\nvendor='intel'\nisa=['gfx942']\n",
            "vendor must be one of ['amd', 'nvidia'], got 'intel'",
        ),
        (
            "[[arch]]\nname='a'\nvendor='amd'\ncompute_capabilities=['9.4']\n",
            "is AMD, but lists `compute_capabilities` (NVIDIA's identifiers); list its ISAs under "
            "`isa`, e.g. ['gfx942']",
        ),
        (
            "[[arch]]\nname='a'\nvendor='nvidia'\nisa=['gfx942']\n",
            "is NVIDIA, but lists `isa` (AMD's identifiers)",
        ),
        ("[[arch]]\nname='a'\nvendor='amd'\n", "(a).isa must be a list of non-empty strings"),
        ("[[arch]]\nname='a'\nvendor='amd'\nisa=['9.4']\n", "ISA '9.4' is not an ISA name"),
        ("[[arch]]\nname='a'\nvendor='amd'\nisa=['gfx94']\n", "ISA 'gfx94' is not an ISA name"),
        (
            "[[arch]]\nname='a'\nvendor='amd'\nisa=['gfx90a:xnack-']\n",
            "ISA 'gfx90a:xnack-' is not an ISA name",
        ),
        (
            "[[arch]]\nname='a'\nvendor='nvidia'\ncompute_capabilities=['gfx942']\n",
            "compute capability 'gfx942' is not 'M.m'",
        ),
        (
            "[[arch]]\nname='a'\nvendor='amd'\nisa=['gfx942']\n"
            "[[arch]]\nname='b'\nvendor='amd'\nisa=['gfx950', 'gfx942']\n",
            "ISA gfx942 is listed for both a and b; an identifier belongs to one generation",
        ),
        (
            HOPPER + "[[arch]]\nname='hopper'\nvendor='amd'\nisa=['gfx942']\n",
            "arch 'hopper' is listed twice",
        ),
    ],
)
def test_the_vocabulary_is_checked_with_the_entry_and_the_fix_named(arches: str, message: str):
    with pytest.raises(FleetError) as info:
        parse_fleet("labels = []\n" + arches + CPU_POOL, "t/fleet.toml")
    assert message in str(info.value) and str(info.value).startswith("t/fleet.toml: ")


def test_an_amd_generation_and_an_nvidia_one_live_in_one_table():
    f = parse_fleet(
        "labels = []\n" + HOPPER + "[[arch]]\nname='cdna3'\nvendor='amd'\nisa=['gfx942']\n"
        "gpus=['MI300X']\n" + CPU_POOL,
        "t/fleet.toml",
    )
    assert f.generation_names == ("hopper", "cdna3")
    assert [a.describe() for a in f.generations] == ["compute capability 9.0", "ISA gfx942: MI300X"]


# ---- one registration across vendors


def registration(call: str):
    source = f"from mizzen_ci import register_cuda_ci, register_gpu_ci\nimport os\n{call}\n"
    return read_source(source, "tests/x/test_x.py", REPO_FLEET)


def test_register_gpu_ci_declares_generations_of_both_vendors_in_one_call():
    reg, errors = registration(
        "register_gpu_ci(est_time=300, hardware=['hopper', 'cdna3'], num_gpus=8, labels=['train'])"
    )
    assert errors == []
    assert reg.backend is Backend.GPU and reg.hardware == ("hopper", "cdna3")
    assert [
        lane for lane in ("cpu", *REPO_FLEET.generation_names) if declares_target(reg, lane)
    ] == [
        "hopper",
        "cdna3",
    ]
    assert home_generation(reg, REPO_FLEET) == "hopper"  # the fleet's order, across vendors
    amd_only, errors = registration(
        "register_gpu_ci(est_time=30, hardware=['cdna4', 'cdna3'], labels=['lora'])"
    )
    assert errors == [] and home_generation(amd_only, REPO_FLEET) == "cdna3"


@pytest.mark.parametrize(
    ("call", "rule", "message", "fix"),
    [
        (
            "register_cuda_ci(est_time=5, hardware=['hopper', 'cdna3'], labels=['lora'])",
            "hardware-vendor",
            "register_cuda_ci declares NVIDIA generations only, but cdna3 is AMD",
            "`register_gpu_ci(hardware=['hopper', 'cdna3'], ...)`",
        ),
        (
            "register_gpu_ci(est_time=5, hardware=['hopper', 'mi300x'], labels=['lora'])",
            "hardware-unknown",
            "unknown GPU generation(s) mi300x",
            "cdna3",  # the fix lists the generations, AMD ones included
        ),
        (
            "register_gpu_ci(est_time=5, hardware=['cdna2'], labels=['lora'])",
            "no-pool",
            "the fleet has no pool of cdna2",
            "cdna3",
        ),
        (
            "register_gpu_ci(est_time=5, hardware=['cdna3'], num_gpus=16, labels=['lora'])",
            "num-gpus",
            "`num_gpus=16` but the largest runner of cdna3 has 8 GPU(s)",
            "add a larger pool",
        ),
        (
            "register_gpu_ci(est_time=5, hardware=['cdna3'], labels=['lora'], needs=['nvlink'])",
            "no-pool",
            "no pool of cdna3 has 1 GPU(s) with nvlink",
            "drop a `needs` entry",
        ),
        (
            "register_gpu_ci(est_time=5, hardware=['cdna3'], labels=[])",
            "labels-empty",
            "a GPU test needs at least one domain label",
            "run-ci-<label>",
        ),
    ],
)
def test_a_broken_gpu_registration_names_the_line_the_rule_and_the_fix(call, rule, message, fix):
    reg, errors = registration(call)
    assert reg is None
    (error,) = errors
    assert (error.path, error.line, error.rule) == ("tests/x/test_x.py", 3, rule)
    assert message in error.message and fix in error.fix, str(error)


def test_every_file_of_the_repository_is_still_valid_and_keeps_its_backend(repo_root):
    registry = read_registry(repo_root, REPO_FLEET)
    assert registry.violations == []
    cuda = [r for r in registry.registrations if r.backend is Backend.CUDA]
    assert cuda, "the repository's NVIDIA-only GPU tests"
    assert all(REPO_FLEET.generation(a).vendor == "nvidia" for r in cuda for a in r.hardware)


# ---- dispatch spanning vendors (the repository's fleet)

A, E, ALL = Mode.AUTO, Mode.EXPLICIT, Mode.ALL
BOTH = ("hopper", "cdna3")


@pytest.mark.parametrize(
    ("hardware", "num_gpus", "needs", "policy", "placed", "skipped"),
    [
        # AUTO: the first declared generation of the fleet's one order that a pool can host
        (BOTH, 8, (), DispatchPolicy(A), [("hopper", "h200-8gpu")], []),
        (("cdna3", "hopper"), 8, (), DispatchPolicy(A), [("hopper", "h200-8gpu")], []),
        (("cdna4", "cdna3"), 1, (), DispatchPolicy(A), [("cdna3", "mi300x-8gpu")], []),
        (("cdna2", "cdna4"), 2, (), DispatchPolicy(A), [("cdna4", "mi355x-8gpu")], []),
        (BOTH, 8, ("rdma",), DispatchPolicy(A), [("hopper", "h100-8gpu-rdma")], []),
        (BOTH, 2, ("xgmi",), DispatchPolicy(A), [("cdna3", "mi300x-8gpu")], []),
        # run-on-cdna3: the home arch stays, the AMD pool is added
        (
            BOTH,
            8,
            (),
            DispatchPolicy(E, ("cdna3",)),
            [("hopper", "h200-8gpu"), ("cdna3", "mi300x-8gpu")],
            [],
        ),
        (
            BOTH,
            8,
            (),
            DispatchPolicy(E, ("cdna3",), leave_home=True),
            [("cdna3", "mi300x-8gpu")],
            [],
        ),
        (
            ("hopper",),
            1,
            (),
            DispatchPolicy(E, ("cdna3",)),
            [("hopper", "h200-2gpu")],
            [("cdna3", "does not declare cdna3")],
        ),
        # weekly: every declared generation the fleet can host, whatever the vendor
        (
            ("hopper", "cdna3", "cdna4", "cdna2"),
            8,
            (),
            DispatchPolicy(ALL),
            [("hopper", "h200-8gpu"), ("cdna3", "mi300x-8gpu"), ("cdna4", "mi355x-8gpu")],
            [("cdna2", "arch not in fleet: no cdna2 pool")],
        ),
        (
            BOTH,
            8,
            ("rdma",),
            DispatchPolicy(ALL),
            [("hopper", "h100-8gpu-rdma")],
            [("cdna3", "no cdna3 pool has 8 GPU(s) with rdma")],
        ),
    ],
)
def test_dispatch_table_spanning_vendors(hardware, num_gpus, needs, policy, placed, skipped):
    reg, errors = registration(
        f"register_gpu_ci(est_time=60, hardware={list(hardware)!r}, num_gpus={num_gpus}, "
        f"labels=['train'], needs={list(needs)!r})"
    )
    assert errors == [], errors
    got_placed, got_skipped = dispatch(reg, REPO_FLEET, policy)
    assert [(p.arch, p.pool.name) for p in got_placed] == placed
    assert got_skipped == skipped
    for p in got_placed:
        assert p.pool.runs_on == REPO_FLEET.pool(p.pool.name).runs_on  # from the table, only


def test_register_gpu_ci_follows_the_registry_syntax_rules():
    _, errors = registration(
        "register_gpu_ci(est_time=5, hardware=['cdna3'], labels=['lora'])\n"
        "def helper():\n"
        "    register_gpu_ci(est_time=5, hardware=['cdna3'], labels=['lora'])\n"
    )
    assert [(e.line, e.rule) for e in errors] == [(5, "nested-call")]
    _, errors = registration(
        "register_gpu_ci(est_time=5, hardware=['cdna3'], labels=['lora'])\n"
        "register_cuda_ci(est_time=5, hardware=['hopper'], labels=['lora'])\n"
    )
    assert [(e.line, e.rule) for e in errors] == [(4, "multiple-registrations")]
    _, errors = registration("register_gpu_ci(est_time=5, labels=['lora'])")
    assert [(e.rule, e.fix[:40]) for e in errors] == [
        ("hardware-required", "add `hardware=[...]` with the GPU genera")
    ]
    assert "cdna3" in errors[0].fix
