"""GPU lease files as an attacker plants them, for real: a lane (root here) never follows a planted
symbolic link or hard link, never truncates or chmods a file that is not its lock file, and
refuses a lease directory that someone else could rewrite — each refusal names the path and the
fix.  Files owned by another user are made with ``os.chown`` (root only: skipped otherwise)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.lane.leases import LeaseDir, LeaseDirError
from mizzen_ci.lane.runner import GpuLaneRunner, RunnerConfig

register_cpu_ci(est_time=5, labels=["ci", "gpu-lane"])

REPO = Path(__file__).resolve().parents[3]
OTHER_UID = 54321  # a user that is neither this one nor root
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to own files as another user")


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file an attacker wants a root lane to truncate and chmod: it must stay as it is."""
    path = tmp_path / "victim" / "shadow"
    path.parent.mkdir()
    path.write_text("precious\n")
    path.chmod(0o600)
    return path


def untouched(path: Path) -> bool:
    return path.read_text() == "precious\n" and stat.S_IMODE(path.stat().st_mode) == 0o600


def lease_dir(tmp_path: Path, mode: int = 0o1777) -> Path:
    d = tmp_path / "leases"
    d.mkdir()
    d.chmod(mode)
    return d


def test_a_planted_symlink_lock_file_is_refused_and_its_target_untouched(tmp_path, victim):
    d = lease_dir(tmp_path)
    (d / "gpu-0.lock").symlink_to(victim)
    with pytest.raises(LeaseDirError) as info:
        LeaseDir(d).try_acquire(["0"], 1, holder="lane")
    assert f"{d}/gpu-0.lock is a symbolic link" in str(info.value) and "Fix: remove it" in str(
        info.value
    )
    assert untouched(victim)


@as_root
def test_a_planted_hard_link_to_a_root_file_is_refused_and_untouched(tmp_path, victim):
    d = lease_dir(tmp_path)
    os.link(victim, d / "gpu-0.lock")  # what protected_hardlinks=0 lets any user do
    with pytest.raises(LeaseDirError, match="hard links"):
        LeaseDir(d).try_acquire(["0"], 1)
    assert untouched(victim)


def test_a_planted_fifo_lock_file_is_refused_without_blocking(tmp_path: Path, deadline):
    d = lease_dir(tmp_path)
    os.mkfifo(d / "gpu-0.lock")
    os.mkfifo(d / "gpu-1.lock")
    leases = LeaseDir(d)
    with deadline(), pytest.raises(LeaseDirError, match="FIFO"):
        leases.try_acquire(["0"], 1)
    with deadline():
        assert leases.describe_holders(["1"]) == "unknown"  # a FIFO note is not read


@as_root
def test_a_lease_dir_owned_by_another_user_is_refused(tmp_path: Path, victim):
    d = lease_dir(tmp_path, 0o755)
    os.chown(d, OTHER_UID, OTHER_UID)
    (d / "gpu-0.lock").symlink_to(victim)
    with pytest.raises(LeaseDirError) as info:
        LeaseDir(d).try_acquire(["0"], 1)
    assert f"owned by uid {OTHER_UID}" in str(info.value) and "MIZZEN_GPU_LEASE_DIR" in str(
        info.value
    )
    assert untouched(victim)


def test_a_world_writable_lease_dir_without_the_sticky_bit_is_refused(tmp_path: Path):
    d = lease_dir(tmp_path, 0o777)
    with pytest.raises(LeaseDirError, match=r"world-writable \(mode 777\) without the sticky bit"):
        LeaseDir(d).check()
    d.chmod(0o1777)
    LeaseDir(d).check()


def test_a_lease_dir_that_is_a_symlink_is_refused(tmp_path: Path):
    real = lease_dir(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    with pytest.raises(LeaseDirError, match="is a symbolic link, not a directory"):
        LeaseDir(link).try_acquire(["0"], 1)
    assert list(real.iterdir()) == []


@as_root
def test_an_existing_lock_file_keeps_its_mode_and_owner(tmp_path: Path):
    d = lease_dir(tmp_path)
    lock = d / "gpu-0.lock"
    lock.write_text("")
    lock.chmod(0o644)
    os.chown(lock, OTHER_UID, OTHER_UID)  # another user's lane made it first
    lease = LeaseDir(d).try_acquire(["0"], 1, holder="root lane")
    assert lease is not None
    lease.release()
    st = lock.stat()
    assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o644, OTHER_UID)


def test_a_new_lease_dir_and_lock_file_are_made_shared_and_exclusive(tmp_path: Path):
    d = tmp_path / "new" / "leases"
    lease = LeaseDir(d).try_acquire(["0", "1"], 2, holder="lane\n::error::x")
    assert lease is not None and lease.keys == ("0", "1")
    assert stat.S_IMODE(d.stat().st_mode) == 0o1777
    assert stat.S_IMODE((d / "gpu-0.lock").stat().st_mode) == 0o666
    holders = LeaseDir(d).describe_holders(["0"])
    assert "lane\\x0a::error" in holders and "\n" not in holders  # a note is shown escaped
    lease.release()


def test_the_gpu_lane_refuses_an_unsafe_lease_dir_before_running_anything(tmp_path: Path):
    d = lease_dir(tmp_path, 0o777)
    config = RunnerConfig(
        root=tmp_path,
        arch="hopper",
        gpus=(),
        report_dir=tmp_path / "reports",
        lease_dir=d,
    )
    with pytest.raises(LeaseDirError, match="sticky bit"):
        GpuLaneRunner(config, progress=None)
    assert not (tmp_path / "reports").exists()


def test_the_lane_command_refuses_a_planted_lock_link_with_exit_2_and_runs_nothing(
    tmp_path: Path, victim: Path
):
    root = tmp_path / "repo"
    (root / "ci").mkdir(parents=True)
    (root / "ci" / "fleet.toml").write_text((REPO / "ci" / "fleet.toml").read_text())
    (root / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    test = root / "tests" / "gpu" / "test_a.py"
    test.parent.mkdir(parents=True)
    test.write_text(
        "from mizzen_ci import register_cuda_ci\n"
        "register_cuda_ci(est_time=1, hardware=['hopper'], labels=['gpu-lane'])\n"
        "def test_a():\n    open(__file__ + '.ran', 'w').close()\n"
    )
    d = lease_dir(tmp_path)
    (d / "gpu-FAKE-0.lock").symlink_to(victim)
    proc = subprocess.run(
        [sys.executable, "-m", "mizzen_ci", "gpu-lane", "hopper", "--fake-gpus", "1",
         "--lease-dir", str(d), "--root", str(root), "tests/gpu/test_a.py"],
        cwd=root, env={**os.environ, "PYTHONPATH": str(REPO / "ci" / "src"), "CI": "",
                       "MIZZEN_COMPILE_CACHE_DIR": str(tmp_path / "compile-cache")},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "Traceback" not in proc.stderr
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "mizzen-ci gpu-lane hopper: GPU lease directory: " in proc.stderr
    assert "gpu-FAKE-0.lock is a symbolic link" in proc.stderr
    assert untouched(victim) and not Path(str(test) + ".ran").exists()
