"""The AMD GPU lanes end to end on CPU: real pytest processes packed onto pretend AMD GPUs, pinned
with HIP_VISIBLE_DEVICES; the truth rules in an AMD lane's child; and the issue's Done-when: a
file declaring ["hopper", "cdna3"] validates, plans onto an H200 pool by default and onto the
MI300X pool with run-on-cdna3 or weekly, runs in ``nox -s gpu-cdna3`` on a stand-in MI300X host,
and is refused on a host of another generation.

Each tiny test file records which devices it saw, and when, so pinning and overlaps are checked
from inside the children.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=60, labels=["ci", "gpu-lane"])

RECORDED = Path(__file__).parents[1] / "fixtures" / "amd_probe"
PINNING = ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")

HEAD = "import json, os, pathlib, time, pytest\n"
HEAD += "from mizzen_ci import register_cpu_ci, register_cuda_ci, register_gpu_ci\n"
WORK = """
def test_work():
    start = time.time()
    time.sleep(2.5)  # longer than a pytest start: files started together overlap here
    out = pathlib.Path(os.environ["LANE_TRACE"]) / f"{pathlib.Path(__file__).stem}.{os.getpid()}"
    out.write_text(json.dumps({"file": pathlib.Path(__file__).name, "start": start,
        "end": time.time(), "env": {v: os.environ.get(v) for v in PINNING},
        "target": os.environ["MIZZEN_COMPUTE_CAPABILITY"], "lane": os.environ["MIZZEN_LANE"]}))
""".replace("PINNING", repr(PINNING))


def gpu(est: float, hardware: list[str], num_gpus: int = 1, function: str = "register_gpu_ci"):
    return (
        f"{function}(est_time={est}, hardware={hardware!r}, num_gpus={num_gpus}, "
        "labels=['gpu-lane'])\n"
    )


FILES = {
    "tests/amd/test_wide.py": HEAD + gpu(8, ["cdna3"], 2) + WORK,
    "tests/amd/test_a1.py": HEAD + gpu(6, ["cdna3"]) + WORK,
    "tests/amd/test_a2.py": HEAD + gpu(5, ["cdna3", "cdna4"]) + WORK,
    "tests/amd/test_a3.py": HEAD + gpu(4, ["cdna4", "cdna3"]) + WORK,
    "tests/amd/test_both.py": HEAD + gpu(4, ["hopper", "cdna3"], 3) + WORK,
    "tests/amd/test_skips.py": HEAD
    + gpu(4, ["cdna3"])
    + "def test_skips():\n    pytest.skip('needs aiter kernels')\n",
    "tests/gpu/test_hopper_only.py": HEAD + gpu(4, ["hopper"], function="register_cuda_ci") + WORK,
    "tests/gpu/test_cdna4_only.py": HEAD + gpu(4, ["cdna4"]) + WORK,
}


@pytest.fixture(scope="module")
def make_repo(repo_root: Path):
    """``make_repo(root, files)``: a repository at ``root`` with this checkout's fleet table,
    ``files`` and an empty ``trace/``."""

    def make(root: Path, files: dict[str, str]) -> Path:
        (root / "ci").mkdir(parents=True)
        (root / "ci" / "fleet.toml").write_text((repo_root / "ci" / "fleet.toml").read_text())
        (root / "pyproject.toml").write_text('[project]\nname = "t"\nversion = "0"\n')
        for rel, src in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(src)
        (root / "trace").mkdir()
        return root

    return make


def traces(root: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in (root / "trace").glob("test_*.*")]


@pytest.fixture(scope="module")
def amd_run(tmp_path_factory, make_repo, lane):
    """One cdna3 lane over 4 pretend MI300X GPUs, started from an environment that sets every
    other variable picking devices (as the CPU lane's CUDA_VISIBLE_DEVICES="" does)."""
    root = make_repo(tmp_path_factory.mktemp("amd-lane"), FILES)
    out = lane(
        root, arch="cdna3", fake_gpus=4,
        env={"CUDA_VISIBLE_DEVICES": "", "ROCR_VISIBLE_DEVICES": "3", "HIP_VISIBLE_DEVICES": "7"},
    )  # fmt: skip
    return root, out


def test_the_cdna3_lane_pins_each_file_with_hip_visible_devices_alone(amd_run):
    root, out = amd_run
    assert out.returncode == 1, out.stdout + out.stderr  # the skip fails the lane
    assert "FAKE: 4 pretend cdna3 GPU(s) (--fake-gpus), no ROCm" in out.stdout
    runs = {r["file"]: r for r in traces(root)}
    assert set(runs) == {"test_wide.py", "test_a1.py", "test_a2.py", "test_a3.py", "test_both.py"}
    gpus = {"test_wide.py": 2, "test_both.py": 3}
    for name, r in runs.items():
        hip = r["env"]["HIP_VISIBLE_DEVICES"].split(",")
        assert len(hip) == gpus.get(name, 1) and set(hip) <= {"0", "1", "2", "3"}, r
        assert r["env"]["CUDA_VISIBLE_DEVICES"] is None  # HIP reads it too: never inherited
        assert r["env"]["ROCR_VISIBLE_DEVICES"] is None  # it would renumber HIP's devices
        assert (r["target"], r["lane"]) == ("gfx942", "cdna3")
    log = next((root / ".ci-artifacts" / "gpu-cdna3" / "files").glob("tests__amd__test_wide*.log"))
    assert log.read_text().startswith("$ HIP_VISIBLE_DEVICES=")


def test_files_are_packed_side_by_side_and_never_share_a_gpu(amd_run):
    root, _ = amd_run
    runs = traces(root)
    overlapping = 0
    for a, b in itertools.combinations(runs, 2):
        if a["end"] > b["start"] and b["end"] > a["start"]:
            overlapping += 1
            shared = set(a["env"]["HIP_VISIBLE_DEVICES"].split(",")) & set(
                b["env"]["HIP_VISIBLE_DEVICES"].split(",")
            )
            assert not shared, (a, b)
    assert overlapping >= 1  # 2 + 1 + 1 of the 4 GPUs at once, then the 3-GPU file


def test_the_lane_runs_only_what_declares_cdna3_and_a_skip_fails(amd_run):
    root, _ = amd_run
    summary = json.loads((root / ".ci-artifacts" / "gpu-cdna3" / "summary.json").read_text())
    outcomes = {Path(f["file"]).name: f["outcome"] for f in summary["files"]}
    assert outcomes == {
        "test_wide.py": "passed",
        "test_a1.py": "passed",
        "test_a2.py": "passed",
        "test_a3.py": "passed",
        "test_both.py": "passed",
        "test_skips.py": "failed",
    }
    (skipped,) = [f for f in summary["files"] if f["file"].endswith("test_skips.py")]
    assert (
        "skipped on hardware it declared (lane cdna3, ISA gfx942): needs aiter"
        in (skipped["summary"])
    )
    assert len(skipped["attempts"][0]["gpus"]) == 1


def test_naming_a_file_of_another_generation_is_refused(tmp_path, make_repo, lane):
    root = make_repo(tmp_path / "r", FILES)
    out = lane(root, "tests/gpu/test_hopper_only.py", arch="cdna3", fake_gpus=1)
    assert out.returncode == 2
    assert "declares hardware=['hopper'], not cdna3. Fix: run it with `nox -s gpu-hopper`" in (
        out.stderr
    )
    out = lane(root, "tests/gpu/test_cdna4_only.py", arch="cdna4", fake_gpus=1)
    assert out.returncode == 0, out.stdout + out.stderr
    (run,) = traces(root)
    assert (run["target"], run["env"]["HIP_VISIBLE_DEVICES"]) == ("gfx950", "0")


# ---- the truth rules in an AMD lane's child (pytester: a real pytest subprocess)


@pytest.fixture
def child(pytester: pytest.Pytester, monkeypatch, repo_root: Path) -> pytest.Pytester:
    """A tree like an AMD lane child's: one HIP device, the lane's ISA as input."""
    pytester.makefile(".toml", **{"ci/fleet": (repo_root / "ci" / "fleet.toml").read_text()})
    pytester.makepyprojecttoml("[tool.pytest.ini_options]\n")
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    for var in (*PINNING, "GPU_DEVICE_ORDINAL", "MIZZEN_LANE", "CI"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("MIZZEN_COMPUTE_CAPABILITY", "gfx942")
    for rel, src in {
        "tests/test_one.py": HEAD + gpu(1, ["hopper", "cdna3"]) + "def test_a():\n    pass\n",
        "tests/test_two.py": HEAD + gpu(1, ["cdna3"], 2) + "def test_b():\n    pass\n",
        "tests/test_skip.py": HEAD
        + gpu(1, ["cdna3"])
        + "def test_s():\n    pytest.skip('no MI300X kernels')\n",
    }.items():
        (pytester.path / rel).parent.mkdir(parents=True, exist_ok=True)
        (pytester.path / rel).write_text(src)
    return pytester


def run_child(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess(
        "-p", "mizzen_ci.pytest_plugin", "-p", "no:cacheprovider", "-rA", "--mizzen-lane", "cdna3",
        *args,
    )  # fmt: skip


def test_an_amd_child_counts_hip_visible_devices_and_checks_the_isa(child, monkeypatch):
    result = run_child(child, "tests")
    result.assert_outcomes(passed=1, failed=1, errors=1)
    result.stdout.fnmatch_lines_random(
        [
            "*mizzen lane: cdna3 (3 registered file(s) in this lane), ISA gfx942*",
            "*tests/test_two.py declares num_gpus=2 but HIP_VISIBLE_DEVICES='0' makes 1 visible*",
            "*skipped on hardware it declared (lane cdna3, ISA gfx942): no MI300X kernels*",
        ]
    )
    monkeypatch.setenv("MIZZEN_COMPUTE_CAPABILITY", "gfx950")
    result = run_child(child, "tests/test_one.py")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [
            "*mizzen truth rule: lane 'cdna3' runs on cdna3 GPUs (ISA gfx942), but this process "
            "sees ISA gfx950 (cdna4)*"
        ]
    )
    monkeypatch.setenv("MIZZEN_COMPUTE_CAPABILITY", "gfx942")
    for var, value in (("ROCR_VISIBLE_DEVICES", "1"), ("CUDA_VISIBLE_DEVICES", "")):
        monkeypatch.setenv(var, value)
        result = run_child(child, "tests/test_one.py")
        result.assert_outcomes(errors=1)
        result.stdout.fnmatch_lines(
            [
                f"*runs with HIP_VISIBLE_DEVICES='0' and also {var}={value!r}, which pick or renumber*"
            ]
        )
        monkeypatch.delenv(var)
    monkeypatch.delenv("HIP_VISIBLE_DEVICES")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # the NVIDIA variable does not pin an AMD lane
    result = run_child(child, "tests/test_one.py")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*HIP_VISIBLE_DEVICES is not set*sets HIP_VISIBLE_DEVICES*"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "0")
    run_child(child, "tests/test_one.py").assert_outcomes(passed=1)


def test_without_an_isa_input_the_child_probes_with_amd_smi(child, monkeypatch, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "amd-smi"
    smi.write_text(f"#!/bin/sh\ncat '{RECORDED / 'amd-smi-static-asic.mi250x-x4.rocm6.json'}'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("MIZZEN_COMPUTE_CAPABILITY")
    result = run_child(child, "tests/test_one.py")
    result.assert_outcomes(errors=1)
    assert (
        "sees ISA gfx90a (cdna2) [1× AMD Instinct MI250X (ISA gfx90a)]" in result.stdout.str()
    )  # HIP_VISIBLE_DEVICES=0 left one of the four


# ---- the Done-when

BOTH_VENDORS = (
    HEAD
    + "register_gpu_ci(est_time=300, hardware=['hopper', 'cdna3'], num_gpus=8, labels=['train'])\n"
    + WORK
)


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t"}
    env |= {"GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t", "GIT_CONFIG_NOSYSTEM": "1"}
    out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def stand_in(tmp_path: Path, name: str, recorded: str) -> str:
    """A PATH whose ``name`` prints the recorded output (a stand-in host)."""
    bin_dir = tmp_path / f"host-{recorded}"
    bin_dir.mkdir()
    (bin_dir / name).write_text(f"#!/bin/sh\ncat '{RECORDED / recorded}'\n")
    (bin_dir / name).chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def test_done_when_hopper_and_cdna3_in_one_declaration(tmp_path, make_repo, mizzen_ci, repo_root):
    root = make_repo(tmp_path / "repo", {"tests/cpu/test_cpu.py": HEAD + "register_cpu_ci(1)\n"})
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "base")
    git(root, "checkout", "-qb", "change")
    (root / "tests" / "train").mkdir(parents=True)
    (root / "tests" / "train" / "test_both_vendors.py").write_text(BOTH_VENDORS)
    git(root, "add", "-A")
    git(root, "commit", "-qm", "a test for both vendors")

    # 1. it validates
    out = mizzen_ci("validate", "--root", str(root))
    assert out.returncode == 0 and "2 test file(s) registered, no errors" in out.stdout, out.stderr

    # 2. it plans onto an H200 pool by default, onto the MI300X pool with run-on-cdna3 or weekly
    def plan(*args: str) -> dict:
        done = mizzen_ci(
            "plan", "--root", str(root), "--head", "HEAD", "--no-cache", "--same-repo",
            "--output", str(tmp_path / "plan.json"), *args, cwd=root, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return json.loads((tmp_path / "plan.json").read_text())

    def placed(p: dict) -> dict[str, tuple]:
        return {
            j["pool"]: (j["lane"], j["vendor"], tuple(j["runs_on"]), j["runner_group"])
            for j in p["jobs"]
            if j["arch"]
        }

    h200 = ("gpu-hopper", "nvidia", ("self-hosted", "linux", "x64", "h200", "gpu-8"))
    mi300x = ("gpu-cdna3", "amd", ("self-hosted", "linux", "x64", "mi300x", "gpu-8"))
    default = plan("--base", "main")
    assert placed(default) == {"h200-8gpu": (*h200, "mizzen-h200-8gpu")}
    (cdna3,) = [n for n in default["not_scheduled"] if n["arch"] == "cdna3"]
    assert cdna3["code"] == "not-auto-arch" and "run-on-cdna3" in cdna3["reason"]
    asked = plan("--base", "main", "--label", "run-on-cdna3")
    assert placed(asked) == {
        "h200-8gpu": (*h200, "mizzen-h200-8gpu"),
        "mi300x-8gpu": (*mi300x, "mizzen-mi300x-8gpu"),
    }
    weekly = plan("--event", "schedule", "--cadence", "weekly")  # plan.json: the weekly plan
    assert placed(weekly) == placed(asked)

    # 3. it runs in the cdna3 lane on a (stand-in) MI300X host, pinned with HIP: `nox -s
    # gpu-cdna3` accepts the host (and checks what it is given), and the command it runs,
    # `mizzen-ci gpu-lane cdna3`, runs the planned job
    (job,) = [j for j in weekly["jobs"] if j["arch"] == "cdna3"]
    mi300x_host = stand_in(tmp_path, "amd-smi", "amd-smi-static-asic.mi300x-x8.rocm7.json")
    nox = shutil.which("nox")
    cmd = [nox] if nox else [sys.executable, "-m", "nox"]
    env = {k: v for k, v in os.environ.items() if k not in (*PINNING, "CI")}
    done = subprocess.run(
        [*cmd, "-f", str(repo_root / "noxfile.py"), "-s", "gpu-cdna3", "--",
         "--root", str(root), str(root / "tests" / "cpu" / "test_cpu.py")],
        cwd=repo_root, env={**env, "PATH": mi300x_host, "NO_COLOR": "1"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    text = done.stdout + done.stderr
    assert done.returncode != 0 and "refusing to run: " not in text, text  # the host is accepted
    assert "tests/cpu/test_cpu.py:3: registered for the cpu lane, not for gpu-cdna3" in text
    lane_args = [
        "--root", str(root), "--job", job["id"], "--plan", str(tmp_path / "plan.json"),
        "--lease-dir", str(tmp_path / "leases"), "--no-history",
    ]  # fmt: skip
    out = mizzen_ci(
        "gpu-lane", "cdna3", *lane_args, site=True, inherit_env=True, timeout=240,
        env={
            **{v: "" for v in ("CI",)},
            **{v: None for v in PINNING},  # the CPU lane's CUDA_VISIBLE_DEVICES='' is not ours
            "PATH": mi300x_host,
            "LANE_TRACE": str(root / "trace"),
            "MIZZEN_COMPILE_CACHE_DIR": str(tmp_path / "compile-cache"),
        },
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "8× AMD Instinct MI300X (ISA gfx942) via amd-smi" in out.stdout
    (run,) = traces(root)
    assert run["file"] == "test_both_vendors.py" and run["lane"] == "cdna3"
    assert run["env"]["HIP_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7" and run["target"] == "gfx942"
    assert run["env"]["CUDA_VISIBLE_DEVICES"] is None

    # 4. and is refused on a host of another generation (MI355X, MI250X) or vendor (H200)
    hosts = {
        "rocm-smi-showproductname.mi355x-x8.json": ("rocm-smi", "generation cdna4, not cdna3"),
        "amd-smi-static-asic.mi250x-x4.rocm6.json": ("amd-smi", "generation cdna2, not cdna3"),
    }
    for recorded, (tool, refusal) in hosts.items():
        out = mizzen_ci(
            "gpu-lane", "cdna3", *lane_args, site=True,
            env={"PATH": stand_in(tmp_path, tool, recorded)},
        )  # fmt: skip
        assert out.returncode == 2 and refusal in out.stderr, out.stderr
    bin_dir = tmp_path / "h200"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho '0, GPU-aaaa, NVIDIA H200, 9.0'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    out = mizzen_ci(
        "gpu-lane", "cdna3", *lane_args, site=True,
        env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"},
    )  # fmt: skip
    assert out.returncode == 2 and "refusing to run: no AMD GPU found" in out.stderr
    assert "run `nox -s gpu-hopper` here instead" in out.stderr
    assert len(traces(root)) == 1  # nothing ran on the refused hosts


def test_the_compile_cache_of_an_amd_lane_is_keyed_by_its_rocm_build_and_isa():
    from mizzen_ci.lane.compile_cache import TorchBuild, cache_key

    rocm = TorchBuild("2.9.1", cuda=None, hip="6.4.43482-0f2d60242")
    assert cache_key(rocm, ["gfx942"] * 8, (3, 12)) == "torch-2.9.1+rocm6.4-gfx942-py312"
    assert cache_key(rocm, ["gfx950"], (3, 12)) != cache_key(rocm, ["gfx942"], (3, 12))
    cuda = TorchBuild("2.11.0+cu130", cuda="13.0")
    assert cache_key(cuda, ["9.0"], (3, 12)) == "torch-2.11.0+cu130-sm90-py312"  # as before
