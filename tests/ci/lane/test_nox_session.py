"""`nox -s gpu-<arch>`: one session per generation of ci/fleet.toml, refusing a CPU machine.

Real nox subprocesses on the repository's noxfile.  CUDA_VISIBLE_DEVICES is empty (as in the CPU
lane), so the refusal holds even on a developer machine that has GPUs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=10, labels=["ci", "gpu-lane"])


@pytest.fixture
def nox(repo_root: Path):
    """``nox ARGS`` on the repository's noxfile, with no GPU visible and outside CI."""

    def run(*args: str) -> subprocess.CompletedProcess:
        exe = shutil.which("nox")
        cmd = [exe] if exe else [sys.executable, "-m", "nox"]
        assert exe or subprocess.run([*cmd, "--version"], capture_output=True).returncode == 0, (
            "nox is neither on PATH nor importable: the CPU lane's runner installs it (see .ci/run)"
        )
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "NO_COLOR": "1"}
        env.pop("CI", None)
        return subprocess.run(
            [*cmd, "-f", str(repo_root / "noxfile.py"), *args],
            cwd=repo_root,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    return run


def test_one_gpu_session_per_generation_of_the_fleet_table(nox, repo_root):
    with (repo_root / "ci" / "fleet.toml").open("rb") as f:
        arches = [a["name"] for a in tomllib.load(f)["arch"]]
    out = nox("--list")
    assert out.returncode == 0, out.stderr
    listed = [
        line.split()[1] for line in out.stdout.splitlines() if line.startswith(("* gpu-", "- gpu-"))
    ]
    assert listed == [f"gpu-{a}" for a in arches]


def test_nox_gpu_hopper_refuses_to_run_on_this_cpu_machine(nox):
    out = nox("-s", "gpu-hopper")
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert "mizzen-ci gpu-lane hopper: refusing to run: no NVIDIA GPU found (" in text
    assert "The hopper lane runs tests declaring hopper on hopper GPUs (compute capability 9.0" in (
        text
    )
    assert "on a CPU machine run `nox -s cpu`" in text
    assert "Session gpu-hopper failed" in text
    assert "START " not in text  # nothing ran


def test_posargs_reach_the_lane_and_named_files_are_checked_against_the_registry(nox):
    out = nox("-s", "gpu-hopper", "--", "--fake-gpus", "1", "tests/ci/packing/test_gpus.py")
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert "tests/ci/packing/test_gpus.py:" in text
    assert "registered for the cpu lane, not for gpu-hopper" in text
    assert "START " not in text


def test_a_pretend_lane_runs_from_the_nox_command_without_a_gpu(nox, tmp_path):
    """README's no-GPU demo as written: `nox -s gpu-hopper -- --fake-gpus 2 --collect-only`
    (here one file).  The nox on PATH may live in a Python without pytest (pip-installed by
    .ci/run): the pretend lane then runs in the workspace's environment.  The file is collected
    in its own leased process (two pretend GPUs) and passes without a test body running."""
    out = nox(
        "-s", "gpu-hopper", "--", "--fake-gpus", "2", "--collect-only",
        "--report-dir", str(tmp_path), "tests/gpu/test_nccl_allreduce.py",
    )  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "FAKE: 2 pretend hopper GPU(s) (--fake-gpus)" in text
    assert "gpu-hopper: 1 passed, 0 not passing of 1 file(s)" in text
    assert "pytest is not importable" not in text
    (log,) = (tmp_path / "files").glob("*attempt1.log")
    assert "--collect-only" in log.read_text() and "1 test collected" in log.read_text()
