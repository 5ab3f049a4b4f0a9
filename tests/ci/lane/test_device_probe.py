"""Probing the GPUs: nvidia-smi's output, CUDA_VISIBLE_DEVICES, the torch fallback, and the lane
refusing GPUs of another generation.  nvidia-smi cannot run on this machine: a stand-in script
prints what nvidia-smi prints (same query, same CSV), so the real probe code runs end to end."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.lane.hardware import Gpu, ProbeError, parse_nvidia_smi, probe, restrict_to_visible

register_cpu_ci(est_time=12, labels=["ci", "gpu-lane"])

H200_X2 = (
    "0, GPU-5c2a1e3b-0000-1111-2222-333344445555, NVIDIA H200, 9.0\n"
    "1, GPU-9f8e7d6c-0000-1111-2222-333344445555, NVIDIA H200, 9.0\n"
)


def fake_nvidia_smi(tmp_path: Path, stdout: str, code: int = 0) -> dict[str, str]:
    """An environment whose PATH starts with an nvidia-smi printing ``stdout``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "nvidia-smi"
    (bin_dir / "out.txt").write_text(stdout)
    script.write_text(
        "#!/bin/sh\n"
        'case "$*" in *--query-gpu=index,uuid,name,compute_cap*--format=csv,noheader*) ;; '
        '*) echo "unexpected arguments: $*" >&2; exit 2;; esac\n'
        f"cat {bin_dir / 'out.txt'}\nexit {code}\n"
    )
    script.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def test_parse_nvidia_smi_lines_including_names_with_commas():
    gpus = parse_nvidia_smi(H200_X2 + "2, GPU-abc, NVIDIA RTX PRO 6000, Blackwell, 12.0\n")
    assert gpus[0] == Gpu(0, "9.0", "NVIDIA H200", "GPU-5c2a1e3b-0000-1111-2222-333344445555")
    assert gpus[2].name == "NVIDIA RTX PRO 6000, Blackwell" and gpus[2].target == "12.0"
    assert gpus[0].visible_id == gpus[0].lease_key == gpus[0].uuid
    with pytest.raises(ProbeError, match="unexpected line"):
        parse_nvidia_smi("0, GPU-x, H200, [N/A]\n")


def test_cuda_visible_devices_restricts_by_index_or_uuid_prefix_and_rejects_unknowns():
    gpus = parse_nvidia_smi(H200_X2)
    assert restrict_to_visible(gpus, None) == gpus
    assert restrict_to_visible(gpus, "") == []
    assert restrict_to_visible(gpus, "1") == [gpus[1]]
    assert restrict_to_visible(gpus, "GPU-9f8e,0") == [gpus[1], gpus[0]]
    with pytest.raises(ProbeError, match="entry '7' matches 0"):
        restrict_to_visible(gpus, "7")
    with pytest.raises(ProbeError, match="MIG instance"):
        restrict_to_visible(gpus, "MIG-1234")


def test_probe_reads_nvidia_smi_and_honours_cuda_visible_devices(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path, H200_X2)["PATH"])
    found = probe(cuda_visible_devices="1")
    assert found.source == "nvidia-smi"
    assert [g.index for g in found.gpus] == [1]
    assert found.describe() == "1× NVIDIA H200 (compute capability 9.0)"


def test_without_nvidia_smi_the_probe_asks_torch_in_a_subprocess(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi anywhere
    found = probe(sys.executable)
    # this machine has torch (a CUDA build) and no GPU: torch answers, and says none
    assert found.gpus == () and found.source == "none"
    assert found.notes == ("nvidia-smi: not on PATH", "torch.cuda.device_count() == 0")
    assert "torch" not in sys.modules or not sys.modules["torch"].cuda.is_initialized()


@pytest.fixture
def run_lane(mizzen_ci):
    """``mizzen-ci gpu-lane ARGS`` under ``python3 -S``, with ``env`` (a PATH) on top."""

    def run(*args: str, env: dict[str, str]):
        return mizzen_ci("gpu-lane", *args, env=env, timeout=120)

    return run


def test_the_lane_refuses_gpus_of_another_generation_and_names_the_right_lane(tmp_path, run_lane):
    env = fake_nvidia_smi(tmp_path, "0, GPU-aaaa, NVIDIA L4, 8.9\n1, GPU-bbbb, NVIDIA L4, 8.9\n")
    out = run_lane("hopper", env=env)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "refusing to run: this machine's GPUs are 2× NVIDIA L4 (compute capability 8.9), " in (
        out.stderr
    )
    assert "generation ada, not hopper." in out.stderr
    assert "(compute capability 9.0: H100, H200, H20)" in out.stderr
    assert "Run `nox -s gpu-ada` here instead." in out.stderr
    assert out.stdout == ""  # nothing ran


def test_the_lane_refuses_a_machine_whose_driver_does_not_answer(tmp_path, run_lane):
    env = fake_nvidia_smi(
        tmp_path,
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n",
        code=9,
    )
    out = run_lane("blackwell", env=env)
    assert out.returncode == 2
    assert "refusing to run: no NVIDIA GPU found (nvidia-smi exited 9: NVIDIA-SMI has failed" in (
        out.stderr
    )
    assert "torch.cuda.device_count() == 0" in out.stderr  # the fallback answered too
    assert "on a CPU machine run `nox -s cpu`" in out.stderr
