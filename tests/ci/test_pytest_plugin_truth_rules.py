"""The pytest plugin's truth rules, driven through pytester with the compute capability as input.

Each run is a real pytest subprocess with only the mizzen plugin loaded (``-p``, autoload off):
what a GPU lane child runs, and what the H200 image does with the workspace on ``PYTHONPATH``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=25, labels=["ci", "gpu-lane"])

FLEET = (Path(__file__).parent / "fixtures" / "registry" / "fleet.toml").read_text()
HEAD = "import os, pytest\nfrom mizzen_ci import register_cpu_ci, register_cuda_ci\n"
HOPPER = "register_cuda_ci(est_time=1, hardware=['hopper'], labels=['lora'])\n"


@pytest.fixture
def repo(pytester: pytest.Pytester, monkeypatch) -> pytest.Pytester:
    pytester.makefile(".toml", **{"ci/fleet": FLEET})
    pytester.makepyprojecttoml("[tool.pytest.ini_options]\n")
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("MIZZEN_COMPUTE_CAPABILITY", "9.0")
    for var in ("MIZZEN_LANE", "CI"):
        monkeypatch.delenv(var, raising=False)
    return pytester


def write(pytester: pytest.Pytester, files: dict[str, str]) -> None:
    for rel, src in files.items():
        p = pytester.path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(src)


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess(
        "-p", "mizzen_ci.pytest_plugin", "-p", "no:cacheprovider", "-rA", *args
    )


def test_a_skip_on_a_gpu_lane_fails_with_its_reason_and_disabled_is_the_only_way_out(repo):
    write(
        repo,
        {
            "tests/test_runs.py": HEAD
            + HOPPER
            + "def test_ok():\n    pass\n"
            + "def test_skips():\n    pytest.skip('needs sm_100a kernels')\n"
            + "@pytest.mark.skipif(True, reason='flash_attn missing')\n"
            + "def test_skipif():\n    pass\n"
            + "@pytest.mark.xfail(reason='known bug 12', strict=True)\n"
            + "def test_xfail():\n    assert False\n",
            "tests/test_module_skip.py": HEAD
            + HOPPER
            + "pytest.importorskip('not_installed_gpu_lib')\n"
            + "def test_never():\n    pass\n",
            "tests/test_disabled.py": HEAD
            + "register_cuda_ci(est_time=1, hardware=['hopper'], labels=['lora'], "
            + "disabled='NCCL 2.27 hang, issue 9')\n"
            + "def test_d():\n    pass\n",
        },
    )
    result = run(repo, "--mizzen-lane", "hopper", "--continue-on-collection-errors", "tests")
    # pytest.skip() in the test fails its call; a skipif marker fails its setup (an error);
    # a module-level skip fails collection (an error)
    result.assert_outcomes(passed=1, failed=1, xfailed=1, skipped=1, errors=2)
    out = result.stdout.str()
    result.stdout.fnmatch_lines_random(
        [
            "*mizzen lane: hopper*compute capability 9.0*",
            "*skipped on hardware it declared (lane hopper, compute capability 9.0): "
            "needs sm_100a kernels*",
            "*skipped on hardware it declared (lane hopper, compute capability 9.0): "
            "flash_attn missing*",
            "*tests/test_module_skip.py: skipped on hardware it declared*"
            "could not import 'not_installed_gpu_lib'*",
            "*disabled in registry: NCCL 2.27 hang, issue 9*",
        ]
    )
    assert 'set `disabled="<reason>"` in its registration' in out
    # the same skips on the CPU lane stay skips (the rule is for hardware a test was sent to)
    write(
        repo,
        {
            "tests/test_cpu.py": HEAD
            + "register_cpu_ci(est_time=1)\n"
            + "def test_skips():\n    pytest.skip('only on Tuesdays')\n"
        },
    )
    run(repo, "tests/test_cpu.py").assert_outcomes(skipped=1)


def test_gpus_of_another_generation_fail_every_test_before_it_runs(repo, monkeypatch):
    write(repo, {"tests/test_h.py": HEAD + HOPPER + "def test_a():\n    open('ran', 'w')\n"})
    monkeypatch.setenv("MIZZEN_COMPUTE_CAPABILITY", "8.0")
    result = run(repo, "--mizzen-lane", "hopper", "tests")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [
            "*mizzen truth rule: lane 'hopper' runs on hopper GPUs (compute capability 9.0), "
            "but this process sees compute capability 8.0 (ampere)*"
        ]
    )
    assert not (repo.path / "ran").exists()
    # the option beats the environment, and an unknown capability says where the table is
    result = run(repo, "--mizzen-lane", "hopper", "--mizzen-compute-capability", "7.5", "tests")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*sees compute capability 7.5 (not in ci/fleet.toml)*"])
    monkeypatch.setenv("MIZZEN_COMPUTE_CAPABILITY", "9.0")
    run(repo, "--mizzen-lane", "hopper", "tests").assert_outcomes(passed=1)


def test_each_test_sees_exactly_its_num_gpus(repo, monkeypatch):
    write(
        repo,
        {
            "tests/test_two.py": HEAD
            + "register_cuda_ci(est_time=1, hardware=['hopper'], num_gpus=2, labels=['lora'])\n"
            + "def test_a():\n    pass\n",
            "tests/test_torch.py": HEAD + HOPPER + "import torch\n" + "def test_b():\n    pass\n",
        },
    )
    result = run(repo, "--mizzen-lane", "hopper", "tests")
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines_random(
        [
            "*tests/test_two.py declares num_gpus=2 but CUDA_VISIBLE_DEVICES='0' makes 1 visible*",
            # torch is imported: its own count must agree too (0 here: this machine has no GPU)
            "*tests/test_torch.py declares num_gpus=1 and CUDA_VISIBLE_DEVICES='0', but "
            "torch.cuda.device_count() == 0*",
        ]
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    run(repo, "--mizzen-lane", "hopper", "tests/test_two.py").assert_outcomes(passed=1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    result = run(repo, "--mizzen-lane", "hopper", "tests/test_two.py")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*CUDA_VISIBLE_DEVICES is not set*nox -s gpu-<arch>*"])


def test_without_a_capability_input_the_plugin_probes_the_gpus(repo, monkeypatch, tmp_path):
    # nvidia-smi cannot run here: a stand-in prints what it prints on an A100 host
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\necho '0, GPU-1c2d3e4f-aaaa-bbbb-cccc-0123456789ab, NVIDIA A100, 8.0'\n"
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("MIZZEN_COMPUTE_CAPABILITY")
    write(repo, {"tests/test_h.py": HEAD + HOPPER + "def test_a():\n    pass\n"})
    result = run(repo, "--mizzen-lane", "hopper", "tests")
    result.assert_outcomes(errors=1)
    assert (
        "sees compute capability 8.0 (ampere) [1× NVIDIA A100 (compute capability 8.0)]"
        in result.stdout.str()
    )


def test_a_cpu_lane_test_that_initialises_cuda_fails_and_only_that_one(repo):
    import torch

    # contract with the real torch this repo pins: this is the state the plugin reads
    assert torch.cuda.is_initialized() is False
    write(
        repo,
        {
            "tests/test_cpu_cuda.py": HEAD
            + "register_cpu_ci(est_time=1)\n"
            + "import torch\n"
            + "def test_clean():\n    assert not torch.cuda.is_initialized()\n"
            # what a real CUDA initialisation leaves behind (this machine has no GPU to init)
            + "def test_inits_cuda():\n    torch.cuda._initialized = True\n"
            + "    assert torch.cuda.is_initialized()\n"
            + "def test_after():\n    pass\n",
        },
    )
    result = run(repo, "-p", "no:randomly", "tests")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*tests/test_cpu_cuda.py::test_inits_cuda initialised CUDA on the CPU lane "
            "(torch.cuda.is_initialized() became true during call)*",
            "FAILED tests/test_cpu_cuda.py::test_inits_cuda*",
        ]
    )
