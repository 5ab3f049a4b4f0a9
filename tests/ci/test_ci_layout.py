"""The shape of mizzen_ci itself: its import graph has no cycle, and one predicate decides which
lane runs a test file — the pytest plugin, ``mizzen-ci list --lane``, the GPU lane and the
planner agree with it on a table of registrations × lanes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.fleet import CPU_LANE, load_fleet, nox_session_name
from mizzen_ci.imports import ImportGraph
from mizzen_ci.lane.selection import select as lane_select
from mizzen_ci.plan.change import Change
from mizzen_ci.plan.pipeline import build_plan
from mizzen_ci.plan.request import Inputs
from mizzen_ci.registry import declares_target, read_registry

register_cpu_ci(est_time=20, labels=["ci"])


def dependencies(graph: ImportGraph, module: str) -> set[str]:
    """The modules of the graph that importing or calling ``module`` needs first.  Reaching a
    package that encloses ``module`` is no dependency: it is initialised before ``module`` runs
    (its parent hop, or ``from <ancestor> import <submodule>``)."""
    out = set()
    for hop in graph.successors(module, "all"):
        target = hop.target
        if target not in graph.modules or target == module:
            continue
        enclosing = module.startswith(target + ".")
        if enclosing and (hop.parent_of or hop.edge.kind == "from"):
            names = hop.edge.names
            if hop.parent_of or all(f"{target}.{n}" in graph.modules for n in names):
                continue
        out.add(target)
    return out


def cycles(graph: ImportGraph, prefix: str) -> list[list[str]]:
    """The strongly connected components of more than one module under ``prefix``."""
    nodes = sorted(m for m in graph.modules if m == prefix or m.startswith(prefix + "."))
    edges = {m: sorted(dependencies(graph, m) & set(nodes)) for m in nodes}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in nodes:
        if start in index:
            continue
        work = [(start, 0)]
        while work:  # Tarjan's algorithm, iteratively
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            if i < len(edges[node]):
                work.append((node, i + 1))
                nxt = edges[node][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return found


def test_mizzen_ci_has_no_import_cycle(ci_src: Path):
    graph = ImportGraph.build(ci_src.parent, [ci_src])
    assert graph.problems == []
    assert cycles(graph, "mizzen_ci") == []


def test_the_cycle_finder_finds_a_planted_cycle(tmp_path: Path):
    pkg = tmp_path / "src" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import x\n")
    (pkg / "a.py").write_text("from . import b\nx = 1\n")  # a sibling: a real dependency
    (pkg / "b.py").write_text("def f():\n    from .a import x\n    return x\n")
    (pkg / "c.py").write_text("from . import a\n")  # the package encloses c: not a cycle
    graph = ImportGraph.build(tmp_path, [tmp_path / "src"])
    assert cycles(graph, "pkg") == [["pkg.a", "pkg.b"]]


# --------------------------------------------------------------------------------------------
# One lane predicate.

REGISTRATIONS = {
    "tests/t/test_cpu.py": "register_cpu_ci(est_time=5)",
    "tests/t/test_cpu_nightly.py": "register_cpu_ci(est_time=5, nightly=True)",
    "tests/t/test_hopper.py": "register_cuda_ci(est_time=5, hardware=['hopper'], labels=['ci'])",
    "tests/t/test_both.py": (
        "register_cuda_ci(est_time=5, hardware=['hopper', 'blackwell'], num_gpus=2, labels=['ci'])"
    ),
    "tests/t/test_blackwell.py": (
        "register_cuda_ci(est_time=5, hardware=['blackwell'], labels=['ci'])"
    ),
    "tests/t/test_hopper_off.py": (
        "register_cuda_ci(est_time=5, hardware=['hopper'], labels=['ci'], disabled='broken')"
    ),
}
# The specification: which lane runs which file (a disabled file belongs to its lane).
LANES = {
    CPU_LANE: {"tests/t/test_cpu.py", "tests/t/test_cpu_nightly.py"},
    "hopper": {"tests/t/test_hopper.py", "tests/t/test_both.py", "tests/t/test_hopper_off.py"},
    "blackwell": {"tests/t/test_both.py", "tests/t/test_blackwell.py"},
    "ada": set(),
}


@pytest.fixture(scope="module")
def tree(tmp_path_factory, ci_src: Path) -> Path:
    root = tmp_path_factory.mktemp("lanes")
    (root / "ci").mkdir()
    (root / "ci" / "fleet.toml").write_text((ci_src.parent / "fleet.toml").read_text())
    (root / "pyproject.toml").write_text('[project]\nname = "lanes"\nversion = "0"\n')
    for rel, call in REGISTRATIONS.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            f"from mizzen_ci import register_cpu_ci, register_cuda_ci\n\n{call}\n\n\n"
            "def test_it():\n    pass\n"
        )
    return root


def test_the_predicate_is_the_specification(tree: Path):
    registry = read_registry(tree, load_fleet(tree / "ci" / "fleet.toml"))
    assert registry.violations == []
    for lane, files in LANES.items():
        assert {r.path for r in registry.registrations if declares_target(r, lane)} == files, lane


def test_list_lane_agrees(tree: Path, mizzen_ci):
    for lane, files in LANES.items():
        out = mizzen_ci("list", "--root", str(tree), "--json", "--lane", lane)
        assert out.returncode == 0, out.stderr
        assert {row["file"] for row in json.loads(out.stdout)["tests"]} == files, lane


def test_the_pytest_plugin_collects_what_the_lane_runs(tree: Path, mizzen_ci):
    env = {k: v for k, v in os.environ.items() if k != "MIZZEN_LANE"}  # the plugin is installed
    for lane, files in LANES.items():
        out = mizzen_ci.python(
            "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider", "--mizzen-lane", lane,
            "tests", env=env, inherit_env=True, site=True, cwd=tree, timeout=120,
        )  # fmt: skip
        collected = {line.split("::")[0] for line in out.stdout.splitlines() if "::" in line}
        assert collected == files, (lane, out.stdout[-2000:])
        assert out.returncode == (0 if files else 5), (lane, out.stdout[-2000:])


def test_the_gpu_lane_selects_what_the_lane_runs(tree: Path):
    fleet = load_fleet(tree / "ci" / "fleet.toml")
    for lane, files in LANES.items():
        if lane == CPU_LANE:
            continue
        sel = lane_select(tree, fleet, lane, 8, [], None, None)
        chosen = {lf.file for lf in sel.runnable} | {r.path for r in sel.disabled}
        assert chosen == files, lane


def test_the_planner_schedules_each_file_on_the_lanes_that_run_it(tree: Path):
    fleet = load_fleet(tree / "ci" / "fleet.toml")
    weekly = Inputs(event="schedule", cadence="weekly")
    plan = build_plan(tree, fleet, Change.from_entries(None, None, []), weekly)
    for lane, files in LANES.items():
        name = nox_session_name(None if lane == CPU_LANE else lane)
        planned = {t.file for j in plan.jobs if j.lane == name for t in j.tests}
        disabled = {
            n.file
            for n in plan.not_scheduled
            if n.code == "disabled" and (n.arch or CPU_LANE) == lane
        }
        assert planned | disabled == files, lane
