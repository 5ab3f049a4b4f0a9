"""Probing AMD GPUs: amd-smi's and rocm-smi's JSON, a ROCm build of torch, HIP_VISIBLE_DEVICES,
and the lanes refusing a host of another generation or vendor.

No AMD GPU exists here: stand-in ``amd-smi`` / ``rocm-smi`` scripts print outputs recorded in the
tools' documented JSON shapes (``tests/ci/fixtures/amd_probe``, see its README), and a stand-in
ROCm torch (pinned below to the real package's attribute names) answers the torch fallback, so
the real probe code runs end to end.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.fleet import AMD
from mizzen_ci.lane.hardware import (
    Gpu,
    ProbeError,
    parse_amd_smi_static,
    parse_rocm_smi_product,
    parse_torch_probe,
    probe,
    restrict_to_visible,
    visible_setting,
)

register_cpu_ci(est_time=20, labels=["ci", "gpu-lane"], watches=["tests/ci/fixtures/amd_probe/**"])

RECORDED = Path(__file__).parents[1] / "fixtures" / "amd_probe"
MI300X = RECORDED / "amd-smi-static-asic.mi300x-x8.rocm7.json"
MI250X = RECORDED / "amd-smi-static-asic.mi250x-x4.rocm6.json"
MI355X = RECORDED / "rocm-smi-showproductname.mi355x-x8.json"
ROCM_TORCH = RECORDED / "rocm_torch"
AMD_VARIABLES = ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


@pytest.fixture
def tools(tmp_path: Path, monkeypatch):
    """``tools(amd_smi=FILE|None, rocm_smi=FILE|None, nvidia_smi=TEXT|None, code=0)``: a new PATH
    of stand-ins printing those outputs (each checks it got the documented arguments), and nothing
    else of the GPU tools'; the AMD variables unset."""
    for var in (*AMD_VARIABLES, "GPU_DEVICE_ORDINAL"):
        monkeypatch.delenv(var, raising=False)
    made = []

    def make(amd_smi=None, rocm_smi=None, nvidia_smi=None, code=0) -> dict[str, str]:
        made.append(1)
        bin_dir = tmp_path / f"bin{len(made)}"
        bin_dir.mkdir()
        stand_ins = {
            "amd-smi": (amd_smi, "static --asic --json"),
            "rocm-smi": (rocm_smi, "--showproductname --json"),
        }
        for name, (out, args) in stand_ins.items():
            if out is None:
                continue
            script = bin_dir / name
            answer = f"cat '{out}'" if code == 0 else f"echo '{name}: amdgpu driver not loaded' >&2"
            script.write_text(
                f'#!/bin/sh\n[ "$*" = "{args}" ] || {{ echo "unexpected: $*" >&2; exit 2; }}\n'
                f"{answer}\nexit {code}\n"
            )
            script.chmod(0o755)
        if nvidia_smi is not None:
            (bin_dir / "nvidia.txt").write_text(nvidia_smi)
            script = bin_dir / "nvidia-smi"
            script.write_text(f"#!/bin/sh\ncat '{bin_dir / 'nvidia.txt'}'\n")
            script.chmod(0o755)
        path = f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin"
        monkeypatch.setenv("PATH", path)
        return {"PATH": path}

    return make


def test_amd_smi_json_in_both_documented_shapes():
    mi300x = parse_amd_smi_static(MI300X.read_text())  # ROCm 7: {"gpu_data": [...]}
    assert [g.index for g in mi300x] == list(range(8))
    assert {(g.target, g.name, g.vendor, g.uuid) for g in mi300x} == {
        ("gfx942", "AMD Instinct MI300X", "amd", None)
    }
    assert (mi300x[3].visible_id, mi300x[3].lease_key) == ("3", "amd-index-3")
    mi250x = parse_amd_smi_static(MI250X.read_text())  # ROCm 6: a top-level list
    assert [(g.index, g.target) for g in mi250x] == [(i, "gfx90a") for i in range(4)]


def test_rocm_smi_json_cards():
    gpus = parse_rocm_smi_product(MI355X.read_text())
    assert [(g.index, g.target, g.name) for g in gpus] == [
        (i, "gfx950", "AMD Instinct MI355X") for i in range(8)
    ]
    # keys that are not cards (rocm-smi's "system" section) are not GPUs
    with_system = json.dumps(
        {"system": {"Driver version": "6.8.5"}, **json.loads(MI355X.read_text())}
    )
    assert len(parse_rocm_smi_product(with_system)) == 8


@pytest.mark.parametrize(
    ("parse", "text", "message"),
    [
        (parse_amd_smi_static, "amd-smi failed to initialize", "not JSON"),
        (parse_amd_smi_static, '{"cpu_data": []}', "not a list of GPUs"),
        (parse_amd_smi_static, '[{"gpu": true, "asic": {}}]', "unexpected entry"),
        (parse_amd_smi_static, '[{"gpu": -1, "asic": {}}]', "unexpected entry"),
        (
            parse_amd_smi_static,
            '[{"gpu": 0, "asic": {"target_graphics_version": "N/A"}}]',
            "GPU 0: 'N/A' is not an ISA name",
        ),
        (parse_amd_smi_static, "[" * 100000, "not JSON"),
        (parse_rocm_smi_product, '{"card0": "AMD Instinct MI300X"}', "unexpected card0"),
        (parse_rocm_smi_product, '{"card1": {"GFX Version": "9.4.2"}}', "card1: '9.4.2' is not"),
        (parse_rocm_smi_product, "[]", "not an object of cards"),
    ],
)
def test_output_that_is_not_the_documented_shape_is_an_error_not_a_guess(parse, text, message):
    with pytest.raises(ProbeError, match=r"printed|is not an ISA") as info:
        parse(text)
    assert message in str(info.value)


def test_hip_visible_devices_restricts_by_index_and_the_other_variables_are_checked():
    gpus = parse_amd_smi_static(MI300X.read_text())
    assert restrict_to_visible(gpus, "5,2", "HIP_VISIBLE_DEVICES") == [gpus[5], gpus[2]]
    with pytest.raises(ProbeError, match="entry 'GPU-1234' is not a device index"):
        restrict_to_visible(gpus, "GPU-1234", "HIP_VISIBLE_DEVICES")
    with pytest.raises(ProbeError, match="HIP_VISIBLE_DEVICES entry '8' matches 0"):
        restrict_to_visible(gpus, "8", "HIP_VISIBLE_DEVICES")
    assert visible_setting(AMD, {}) == ("HIP_VISIBLE_DEVICES", None)
    assert visible_setting(AMD, {"CUDA_VISIBLE_DEVICES": "1"}) == ("CUDA_VISIBLE_DEVICES", "1")
    assert visible_setting(AMD, {"HIP_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "1"}) == (
        "HIP_VISIBLE_DEVICES",
        "1",
    )
    with pytest.raises(ProbeError, match="'0' and CUDA_VISIBLE_DEVICES='' disagree"):
        visible_setting(AMD, {"HIP_VISIBLE_DEVICES": "0", "CUDA_VISIBLE_DEVICES": ""})
    for var in ("ROCR_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL"):
        with pytest.raises(ProbeError, match=f"{var}='0,1' is set: it renumbers") as info:
            visible_setting(AMD, {var: "0,1"})
        assert f"unset {var} and restrict the GPUs with HIP_VISIBLE_DEVICES" in str(info.value)


def test_the_probe_asks_amd_smi_and_honours_hip_visible_devices(tools, monkeypatch):
    tools(amd_smi=MI300X, rocm_smi=MI355X)
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "1,3")
    found = probe(vendor="amd")
    assert found.source == "amd-smi" and [g.index for g in found.gpus] == [1, 3]
    assert found.describe() == "2× AMD Instinct MI300X (ISA gfx942)"
    assert found.notes == ("amd-smi: 8 GPU(s)", "HIP_VISIBLE_DEVICES='1,3' leaves 2 of 8")
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "0")
    with pytest.raises(ProbeError, match="ROCR_VISIBLE_DEVICES='0' is set"):
        probe(vendor="amd")


def test_without_amd_smi_rocm_smi_answers_and_a_failing_tool_is_a_note(tools):
    tools(rocm_smi=MI355X)
    found = probe(vendor="amd")
    assert found.source == "rocm-smi" and len(found.gpus) == 8
    assert found.notes == ("amd-smi: not on PATH", "rocm-smi: 8 GPU(s)")
    tools(amd_smi=MI300X, rocm_smi=MI355X, code=1)  # the driver is not loaded: both exit 1
    found = probe(sys.executable, vendor="amd")
    assert found.gpus == () and found.source == "none"
    assert found.notes[:2] == (
        "amd-smi exited 1: amd-smi: amdgpu driver not loaded",
        "rocm-smi exited 1: rocm-smi: amdgpu driver not loaded",
    )
    # the real torch of this machine is a CUDA build: it answers for NVIDIA GPUs only
    assert found.notes[2] == (
        f"torch in {sys.executable} is not a ROCm build (torch.version.hip is None)"
    )
    assert found.describe().startswith("no AMD GPU found (amd-smi exited 1")


def test_the_torch_fallback_reads_gcn_arch_name_of_a_rocm_build(tools, monkeypatch):
    tools()  # no vendor tool at all
    monkeypatch.setenv("PYTHONPATH", str(ROCM_TORCH))
    monkeypatch.setenv("FAKE_ROCM_DEVICES", "3")
    found = probe(sys.executable, vendor="amd")
    assert found.source == "torch"
    assert [(g.index, g.target, g.name) for g in found.gpus] == [
        (i, "gfx942", "AMD Instinct MI300X") for i in range(3)
    ]  # ":sramecc+:xnack-" dropped; major.minor 9.4 is never taken for a compute capability
    assert found.notes[-1] == "torch (ROCm 6.4.43482-0f2d60242): torch.cuda.device_count() == 3"
    # the NVIDIA probe does not take a ROCm build's devices for NVIDIA GPUs
    nvidia = probe(sys.executable, vendor="nvidia")
    assert nvidia.gpus == ()
    assert nvidia.notes[-1] == (
        f"torch in {sys.executable} is a ROCm build (HIP 6.4.43482-0f2d60242): it reports AMD "
        "GPUs only"
    )
    monkeypatch.setenv("FAKE_ROCM_ARCH", "gfx1201")  # a generation the fleet does not have
    assert [g.target for g in probe(sys.executable, vendor="amd").gpus] == ["gfx1201"] * 3
    # what the CPU lane sets (CUDA_VISIBLE_DEVICES="", which HIP reads too) hides every device
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert probe(sys.executable, vendor="amd").gpus == ()


def test_the_stand_in_rocm_torch_has_the_real_packages_names(mizzen_ci):
    import torch

    names = ("name", "major", "minor", "gcnArchName", "uuid")
    functions = ("device_count", "get_device_properties", "is_initialized")
    ask = (
        "import json, torch; p = torch.cuda.get_device_properties(0); print(json.dumps(["
        f"torch.version.hip, [hasattr(p, a) for a in {names!r}], "
        f"[callable(getattr(torch.cuda, f)) for f in {functions!r}]]))"
    )
    out = mizzen_ci.python("-c", ask, site=True, env={"PYTHONPATH": str(ROCM_TORCH)})
    assert out.returncode == 0, out.stderr
    hip, has, callables = json.loads(out.stdout)
    assert isinstance(hip, str) and all(has) and all(callables)  # the stand-in
    assert hasattr(torch.version, "hip") and torch.version.hip is None  # the real: a CUDA build
    assert all(hasattr(torch._C._CudaDeviceProperties, a) for a in names)
    assert all(callable(getattr(torch.cuda, f)) for f in functions)


def test_parse_torch_probe_rejects_what_the_script_never_prints():
    with pytest.raises(ProbeError, match="not its JSON"):
        parse_torch_probe('[{"index": 0}]', AMD, "python")
    bad_arch = json.dumps({"hip": "6.4", "gpus": [
        {"index": 0, "name": "x", "compute_cap": "9.4", "gcn_arch": None, "uuid": None}
    ]})  # fmt: skip
    with pytest.raises(ProbeError, match="gcnArchName: None is not an ISA name"):
        parse_torch_probe(bad_arch, AMD, "python")


# ---- the lanes refuse a host of another generation or vendor


@pytest.fixture
def run_lane(mizzen_ci):
    def run(*args: str, env: dict[str, str]):
        return mizzen_ci("gpu-lane", *args, env=env, timeout=120)

    return run


def test_the_cdna3_lane_refuses_an_mi250x_host_and_names_its_lane(tools, run_lane):
    out = run_lane("cdna3", env=tools(amd_smi=MI250X))
    assert out.returncode == 2, out.stdout + out.stderr
    assert (
        "refusing to run: this machine's GPUs are 4× AMD Instinct MI250X (ISA gfx90a), "
        "generation cdna2, not cdna3." in out.stderr
    )
    assert "(ISA gfx942: MI300X, MI300A, MI325X)" in out.stderr
    assert "Run `nox -s gpu-cdna2` here instead." in out.stderr
    assert out.stdout == ""


def test_an_amd_lane_on_an_nvidia_host_and_the_other_way_round(tools, run_lane):
    h200 = "0, GPU-aaaa, NVIDIA H200, 9.0\n1, GPU-bbbb, NVIDIA H200, 9.0\n"
    out = run_lane("cdna3", env=tools(nvidia_smi=h200))
    assert out.returncode == 2
    assert "refusing to run: no AMD GPU found (amd-smi: not on PATH; rocm-smi: not on PATH; " in (
        out.stderr
    )
    assert "is not a ROCm build" in out.stderr
    assert (
        "This machine has 2× NVIDIA H200 (compute capability 9.0): run `nox -s gpu-hopper` here "
        "instead." in out.stderr
    )
    out = run_lane("hopper", env=tools(amd_smi=MI300X))
    assert out.returncode == 2
    assert "refusing to run: no NVIDIA GPU found (nvidia-smi: not on PATH" in out.stderr
    assert "8× AMD Instinct MI300X (ISA gfx942): run `nox -s gpu-cdna3` here instead." in out.stderr


def test_a_gpu_of_a_vendor_is_named_the_way_its_runtime_reads_it():
    nvidia = Gpu(0, "9.0", "H200", "GPU-5c2a")
    amd = Gpu(0, "gfx942", "MI300X", None, "amd")
    assert (nvidia.visible_id, nvidia.lease_key) == ("GPU-5c2a", "GPU-5c2a")
    assert (amd.visible_id, amd.lease_key) == ("0", "amd-index-0")
    assert Gpu(2, "9.0").lease_key == "index-2" != Gpu(2, "gfx942", vendor="amd").lease_key
