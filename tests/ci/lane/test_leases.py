"""GPU leases between real processes: one holder per GPU, and SIGKILL frees a GPU at once."""

from __future__ import annotations

import io
import os
import select
import signal
import subprocess
import time
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.lane.leases import LeaseDir, LeaseTimeout

register_cpu_ci(est_time=11, labels=["ci", "gpu-lane"])

# A contender: lease N of the given GPUs (waiting up to TIMEOUT s), say which, then hold them.
HOLDER = """
import sys, time
from mizzen_ci.lane.leases import LeaseDir, LeaseTimeout
lease_dir, n, timeout, *keys = sys.argv[1:]
try:
    lease = LeaseDir(lease_dir).acquire(keys, int(n), timeout=float(timeout), holder="test")
except LeaseTimeout as e:
    print("TIMEOUT", e, flush=True)
    sys.exit(3)
print("HELD", ",".join(lease.keys), flush=True)
time.sleep(600)
"""


@pytest.fixture
def start_holder(mizzen_ci):
    """Start a holder under ``python3 -S`` with only ci/src on the path (as a lane runs)."""

    def start(lease_dir: Path, n: int, keys: list[str], timeout: float = 30) -> subprocess.Popen:
        return subprocess.Popen(
            mizzen_ci.command("-c", HOLDER, str(lease_dir), str(n), str(timeout), *keys),
            env=mizzen_ci.environ(),
            stdout=subprocess.PIPE,
            text=True,
        )

    return start


def read_line(proc: subprocess.Popen, timeout: float = 20) -> str:
    """The one line a holder prints (then it sleeps or exits)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"the holder said nothing in {timeout} s"
    return proc.stdout.readline().strip()


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_two_contenders_never_share_a_gpu_and_sigkill_frees_at_once(
    tmp_path: Path, procs, start_holder
):
    first = start_holder(tmp_path, 2, ["gpu-a", "gpu-b", "gpu-c"])
    procs.append(first)
    assert read_line(first) == "HELD gpu-a,gpu-b"

    # A second lane wants 2 of the same 3 GPUs: only one is free, so it must wait.
    second = start_holder(tmp_path, 2, ["gpu-a", "gpu-b", "gpu-c"])
    procs.append(second)
    time.sleep(0.5)
    assert second.poll() is None
    # This process sees the same: one GPU is free, two are not.
    leases = LeaseDir(tmp_path)
    assert leases.try_acquire(["gpu-a", "gpu-b", "gpu-c"], 2) is None
    assert "pid" in leases.describe_holders(["gpu-a"])

    killed_at = time.monotonic()
    os.kill(first.pid, signal.SIGKILL)
    assert read_line(second) in ("HELD gpu-a,gpu-b", "HELD gpu-a,gpu-c", "HELD gpu-b,gpu-c")
    assert time.monotonic() - killed_at < 1.0, "a SIGKILLed holder must free its GPUs at once"


def test_acquisition_is_all_or_nothing_and_times_out(tmp_path: Path, procs, start_holder):
    holder = start_holder(tmp_path, 1, ["gpu-b"])
    procs.append(holder)
    assert read_line(holder) == "HELD gpu-b"
    leases = LeaseDir(tmp_path)
    assert leases.try_acquire(["gpu-a", "gpu-b"], 2) is None
    # gpu-a was not kept by the failed attempt: another process can take it alone
    other = start_holder(tmp_path, 1, ["gpu-a"], timeout=5)
    procs.append(other)
    assert read_line(other) == "HELD gpu-a"
    started = time.monotonic()
    with pytest.raises(LeaseTimeout, match="GPU lease timeout: 1 of gpu-a, gpu-b not free"):
        leases.acquire(["gpu-a", "gpu-b"], 1, timeout=0.3)
    assert time.monotonic() - started < 2


def test_a_lease_passed_to_a_child_outlives_the_parents_copy(tmp_path: Path, procs):
    leases = LeaseDir(tmp_path)
    lease = leases.try_acquire(["gpu-a"], 1)
    assert lease is not None
    child = subprocess.Popen(["sleep", "600"], pass_fds=lease.fds)
    procs.append(child)
    lease.release()  # the runner's copy; the test process still holds the lock
    assert leases.try_acquire(["gpu-a"], 1) is None
    child.kill()
    child.wait()
    again = leases.try_acquire(["gpu-a"], 1)
    assert again is not None and again.keys == ("gpu-a",)
    again.release()


def test_a_shared_lease_holds_its_gpu_until_its_last_handle_is_released(tmp_path: Path):
    leases = LeaseDir(tmp_path)
    lease = leases.try_acquire(["gpu-a"], 1)
    assert lease is not None
    first, second = lease.share(), lease.share()
    lease.release()
    first.release()
    first.release()  # a handle's second release is a no-op, not another holder's
    assert leases.try_acquire(["gpu-a"], 1) is None
    second.release()
    again = leases.try_acquire(["gpu-a"], 1)
    assert again is not None
    again.release()
    with pytest.raises(ValueError, match="cannot be shared"):
        second.share()


# --------------------------------------------------------------------------------------------
# A file whose process cannot start holds no GPU


@pytest.mark.parametrize("fails", ["spawn", "after spawn"])
@pytest.mark.parametrize("seats", [1, 4], ids=["exclusive", "shared"])
def test_a_start_that_fails_frees_the_gpus_of_its_whole_batch(tmp_path, monkeypatch, seats, fails):
    """Four one-GPU files start in one batch on four (pretend) GPUs; spawning the second one
    fails, or its start fails right after the spawn.  The error reaches the caller, every
    process spawned is killed, and no lock of any GPU stays held (exclusive leases, or the one
    shared lease of a GPU with seats)."""
    from mizzen_ci.lane import runner as runner_module
    from mizzen_ci.lane.hardware import Gpu
    from mizzen_ci.lane.progress import Progress
    from mizzen_ci.lane.runner import GpuLaneRunner, LaneFile, RunnerConfig

    for i in range(4):
        (tmp_path / f"test_{i}.py").write_text(
            "def test_sleep():\n    import time; time.sleep(30)\n"
        )
    gpus = tuple(Gpu(i, "9.0", "fake", f"FAKE-{i}") for i in range(4))
    lease_dir = tmp_path / "leases"
    config = RunnerConfig(
        root=tmp_path, arch="hopper", gpus=gpus, report_dir=tmp_path / "report",
        lease_dir=lease_dir, gpu_seats=seats,
    )  # fmt: skip
    real_popen, spawned = subprocess.Popen, []

    def popen(*args, **kwargs):
        if spawned and fails == "spawn":
            raise OSError(24, "Too many open files")
        spawned.append(real_popen(*args, **kwargs))
        return spawned[-1]

    progress = Progress(4, 4, io.StringIO(), live=False)
    event = progress.event

    def announce(line: str) -> None:
        if line.startswith("START") and len(spawned) == 2:
            raise OSError(24, "Too many open files")
        event(line)

    monkeypatch.setattr(runner_module.subprocess, "Popen", popen)
    monkeypatch.setattr(progress, "event", announce)
    files = [LaneFile(f"test_{i}.py", f"test_{i}.py", 1, 10.0, shares_gpu=True) for i in range(4)]
    runner = GpuLaneRunner(config, progress)
    with pytest.raises(OSError, match="Too many open files"):
        runner.run(files)
    assert len(spawned) == (1 if fails == "spawn" else 2)
    assert all(p.poll() is not None for p in spawned)  # every group spawned was killed
    keys = [g.lease_key for g in gpus]
    everything = LeaseDir(lease_dir).try_acquire(keys, 4, holder="the next lane")
    assert everything is not None, LeaseDir(lease_dir).describe_holders(keys)
    everything.release()
