"""`mizzen-ci validate` / `list` as real subprocesses under `python3 -S` with only `ci/src` on the
path (what a bare runner has), plus the GitHub annotation format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.fleet import load_fleet
from mizzen_ci.output import annotation
from mizzen_ci.registry import read_registry

register_cpu_ci(est_time=15, labels=["ci"])


@pytest.fixture(scope="module")
def fixtures(ci_fixtures: Path) -> Path:
    return ci_fixtures / "registry"


@pytest.fixture(scope="module")
def expected_bad(fixtures: Path) -> set[tuple[str, int, str]]:
    """What the registry itself reports for the bad tree (test_registry pins that to the tree's
    expected-errors.txt); the CLI must print exactly these."""
    registry = read_registry(fixtures / "bad", load_fleet(fixtures / "fleet.toml"))
    return {(e.path, e.line, e.rule) for e in registry.violations}


@pytest.fixture(scope="module")
def fixture_args(fixtures: Path):
    def args(tree: str) -> list[str]:
        return ["--root", str(fixtures / tree), "--fleet", str(fixtures / "fleet.toml")]

    return args


def test_validate_passes_on_the_repository_with_python_S(mizzen_ci):
    out = mizzen_ci("validate")
    assert out.returncode == 0, out.stderr
    assert "no errors" in out.stdout


def test_validate_rejects_every_bad_fixture_with_file_and_line(
    mizzen_ci, fixture_args, expected_bad
):
    out = mizzen_ci("validate", *fixture_args("bad"))
    assert out.returncode == 1
    lines = [ln for ln in out.stderr.splitlines() if ": [" in ln]
    got = set()
    for ln in lines:
        where, rest = ln.split(": [", 1)
        path, line = where.rsplit(":", 1)
        got.add((path, int(line), rest.split("]", 1)[0]))
    assert got == expected_bad
    assert f"{len(expected_bad)} error(s)" in out.stderr


def test_validate_prints_github_annotations_under_actions(mizzen_ci, fixture_args):
    out = mizzen_ci("validate", *fixture_args("bad"), github=True)
    assert out.returncode == 1
    assert (
        "::error file=tests/test_hardware_unknown.py,line=3,title=mizzen registry::[hardware-unknown]"
        in out.stdout
    )
    plain = mizzen_ci("validate", *fixture_args("bad"))
    assert "::error" not in plain.stdout


def test_list_json_shows_derived_pool_and_disabled_reason(mizzen_ci, fixture_args):
    out = mizzen_ci("list", "--json", *fixture_args("good"))
    assert out.returncode == 0, out.stderr
    rows = {r["file"]: r for r in json.loads(out.stdout)["tests"]}
    assert rows["tests/test_gpu_rdma.py"]["pool"] == "h100-8-rdma"
    assert rows["tests/deep/nested/folder/test_gpu_two.py"]["pool"] == "h200-2"
    assert rows["tests/test_cpu_minimal.py"]["pool"] == "cpu"
    assert rows["tests/test_disabled.py"]["disabled"] == "waiting on upstream fix"


def test_list_lane_filters_to_what_the_lane_runs(mizzen_ci, fixture_args):
    out = mizzen_ci("list", "--json", "--lane", "blackwell", *fixture_args("good"))
    rows = {r["file"]: r for r in json.loads(out.stdout)["tests"]}
    assert set(rows) == {"tests/deep/nested/folder/test_gpu_two.py", "tests/test_gpu_rdma.py"}
    assert rows["tests/deep/nested/folder/test_gpu_two.py"]["pool"] == "b200-4"
    assert rows["tests/test_gpu_rdma.py"]["pool"] == "-"  # no blackwell pool with rdma
    out = mizzen_ci("list", "--lane", "cpu", *fixture_args("good"))
    assert "tests/test_cpu_full.py" in out.stdout and "test_gpu_rdma" not in out.stdout
    bad = mizzen_ci("list", "--lane", "volta", *fixture_args("good"))
    assert bad.returncode == 2 and "unknown lane 'volta'" in bad.stderr


def test_table_lists_every_repository_test_with_its_pool(mizzen_ci):
    out = mizzen_ci("list")
    assert out.returncode == 0, out.stderr
    assert "tests/ci/registry/test_registry_cli.py" in out.stdout and "cpu-hosted" in out.stdout


def test_missing_fleet_is_a_clear_usage_error(mizzen_ci, tmp_path: Path):
    out = mizzen_ci("validate", cwd=tmp_path)
    assert out.returncode == 2
    assert "no ci/fleet.toml found" in out.stderr and "--root" in out.stderr


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"file": "a.py", "line": 3}, "::error file=a.py,line=3::boom"),
        ({}, "::error::boom"),
        ({"file": "a,b:c.py", "title": "t"}, "::error file=a%2Cb%3Ac.py,title=t::boom"),
    ],
)
def test_annotation_format_escapes_properties(kwargs, expected):
    assert annotation("error", "boom", **kwargs) == expected


def test_annotation_message_cannot_inject_a_second_command():
    line = annotation("error", "x\n::error::injected 100%")
    assert "\n" not in line and line == "::error::x%0A::error::injected 100%25"
