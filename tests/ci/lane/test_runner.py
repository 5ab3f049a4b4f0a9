"""The GPU lane end to end on CPU: real pytest processes packed onto pretend GPUs.

``--fake-gpus N`` replaces only the probe: packing, leases (real flock files), per-file processes,
CUDA_VISIBLE_DEVICES, timeouts that kill process groups, classified retries, the truth rules of the
plugin, the junit merge, the summary, the history and the flake record are the real ones.  Each
tiny test file records when it ran and which GPUs it saw, so overlaps are checked from inside.
"""

from __future__ import annotations

import io
import itertools
import json
import subprocess
import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.lane.leases import LeaseDir
from mizzen_ci.lane.progress import Progress
from mizzen_ci.plan import Job, Plan, PlannedTest, SelectionSummary

register_cpu_ci(est_time=45, labels=["ci", "gpu-lane"])

HEAD = "import json, os, pathlib, time, subprocess, sys, pytest\n"
HEAD += "from mizzen_ci import register_cpu_ci, register_cuda_ci\n"
# Every worker records (file, GPUs it sees, capability, start, end) into $LANE_TRACE.
WORK = """
def record(start):
    out = pathlib.Path(os.environ["LANE_TRACE"]) / f"{pathlib.Path(__file__).stem}.{os.getpid()}"
    out.write_text(json.dumps({"file": pathlib.Path(__file__).name, "start": start,
        "end": time.time(), "gpus": os.environ["CUDA_VISIBLE_DEVICES"].split(","),
        "cc": os.environ["MIZZEN_COMPUTE_CAPABILITY"], "lane": os.environ["MIZZEN_LANE"]}))

def test_work():
    start = time.time()
    time.sleep(0.4)
    record(start)
"""


def cuda(est: float, num_gpus: int = 1, extra: str = "", hardware: str = "['hopper']") -> str:
    return (
        f"register_cuda_ci(est_time={est}, hardware={hardware}, num_gpus={num_gpus}, "
        f"labels=['gpu-lane']{extra})\n"
    )


FLAKY = """
def test_flaky():
    marker = pathlib.Path(os.environ["LANE_TRACE"]) / "flaky-attempted"
    if not marker.exists():
        marker.write_text("1")
        print("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, "
              "OpType=ALLREDUCE) ran for 600000 milliseconds before timing out.")
        raise RuntimeError("NCCL communicator was aborted")
"""
ASSERTS = "\ndef test_wrong():\n    assert 1 + 1 == 3\n"
SKIPS = "\ndef test_skips():\n    pytest.skip('needs FP8 kernels')\n"
HANG = """
def test_hang():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    (pathlib.Path(os.environ["LANE_TRACE"]) / "grandchild.pid").write_text(str(child.pid))
    (pathlib.Path(os.environ["LANE_TRACE"]) / "hang.json").write_text(json.dumps(
        {"start": time.time(), "gpus": os.environ["CUDA_VISIBLE_DEVICES"].split(",")}))
    time.sleep(300)
"""

FILES = {
    "tests/gpu/test_wide.py": HEAD + cuda(8, 2) + WORK,
    "tests/gpu/test_w1.py": HEAD + cuda(6) + WORK,
    "tests/gpu/test_w2.py": HEAD + cuda(5) + WORK,
    "tests/gpu/test_w3.py": HEAD + cuda(4) + WORK,
    "tests/gpu/test_flaky.py": HEAD + cuda(4) + FLAKY,
    "tests/gpu/test_asserts.py": HEAD + cuda(4) + ASSERTS,
    "tests/gpu/test_skips.py": HEAD + cuda(4) + SKIPS,
    "tests/gpu/test_hang.py": HEAD + cuda(5.5) + HANG,  # timeout 5.5 × 2 = 11 s
    "tests/gpu/test_three.py": HEAD + cuda(4, 3) + WORK,
    "tests/gpu/test_disabled.py": HEAD + cuda(4, extra=", disabled='driver bug 7'") + WORK,
    "tests/gpu/test_blackwell_only.py": HEAD + cuda(4, hardware="['blackwell']") + WORK,
    "tests/test_cpu.py": HEAD + "register_cpu_ci(est_time=1)\n" + WORK,
}


@pytest.fixture(scope="module")
def make_repo(repo_root: Path):
    """``make_repo(root, files)``: a repository at ``root`` with this checkout's fleet table,
    ``files`` ({path: source}) and an empty ``trace/``."""

    def make(root: Path, files: dict[str, str]) -> Path:
        (root / "ci").mkdir(parents=True)
        (root / "ci" / "fleet.toml").write_text((repo_root / "ci" / "fleet.toml").read_text())
        (root / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
        for rel, src in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(src)
        (root / "trace").mkdir()
        return root

    return make


def traces(root: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in (root / "trace").glob("test_*.*")]


def assert_no_gpu_shared(runs: list[dict]) -> None:
    for a, b in itertools.combinations(runs, 2):
        if set(a["gpus"]) & set(b["gpus"]):
            assert a["end"] <= b["start"] or b["end"] <= a["start"], (a, b)


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, make_repo, lane):
    """One lane run over every kind of file, as the H200 image runs it (plugin loaded by -p)."""
    root = make_repo(tmp_path_factory.mktemp("lane"), FILES)
    out = lane(root, "--timeout-factor", "2", "--min-timeout", "0",
               env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})  # fmt: skip
    return root, out


def test_full_run_outcomes_summary_and_exit_code(full_run):
    root, out = full_run
    assert out.returncode == 1, out.stdout + out.stderr
    summary = json.loads((root / ".ci-artifacts" / "gpu-hopper" / "summary.json").read_text())
    outcomes = {Path(f["file"]).name: f["outcome"] for f in summary["files"]}
    assert outcomes == {
        "test_wide.py": "passed",
        "test_w1.py": "passed",
        "test_w2.py": "passed",
        "test_w3.py": "passed",
        "test_flaky.py": "passed",
        "test_asserts.py": "failed",
        "test_skips.py": "failed",
        "test_hang.py": "timeout",
    }
    assert summary["not_runnable"] == [
        {"file": "tests/gpu/test_three.py", "why": "needs 3 GPUs, this host has 2 hopper GPU(s)"}
    ]
    assert summary["disabled"] == [{"file": "tests/gpu/test_disabled.py", "why": "driver bug 7"}]
    text = out.stdout
    assert "FAKE: 2 pretend hopper GPU(s) (--fake-gpus), no CUDA" in text
    for line in [
        "passed on retry (nccl-timeout)",
        "FAILED [assertion]: 1 failed of 1; first: test_wrong: assert (1 + 1) == 3",
        "FAILED [test-failure]: 1 failed of 1; first: test_skips: skipped on "
        "hardware it declared (lane hopper, compute capability 9.0): needs FP8 kernels",
        "TIMEOUT [test-timeout]: timed out after 11 s (estimate 5.5 s × 2, at least 0 s)",
        "not runnable here: needs 3 GPUs, this host has 2 hopper GPU(s)",
        "disabled: driver bug 7",
        "1 not runnable on this host (reported only; under CI=true this fails the lane)",
        "gpu-hopper: 5 passed, 3 not passing of 10 file(s)",
    ]:
        assert line in text, line
    assert "test_blackwell_only" not in text and "test_cpu.py" not in text


def test_full_run_packs_files_without_ever_sharing_a_gpu(full_run):
    root, _ = full_run
    runs = traces(root)
    assert sorted(r["file"] for r in runs) == [
        "test_w1.py",
        "test_w2.py",
        "test_w3.py",
        "test_wide.py",
    ]
    for r in runs:
        assert len(r["gpus"]) == (2 if r["file"] == "test_wide.py" else 1)
        assert set(r["gpus"]) <= {"FAKE-0", "FAKE-1"}
        assert (r["cc"], r["lane"]) == ("9.0", "hopper")
    assert_no_gpu_shared(runs)
    # side by side: while the hang held one GPU (11 s), 1-GPU files ran on the other
    singles = [r for r in runs if r["file"] != "test_wide.py"]
    hang = json.loads((root / "trace" / "hang.json").read_text())
    beside = [r for r in singles if r["start"] > hang["start"] and r["end"] < hang["start"] + 11]
    assert beside and all(r["gpus"] != hang["gpus"] for r in beside)
    # longest first: the 2-GPU file (estimate 8 s) started before every other file
    wide = next(r for r in runs if r["file"] == "test_wide.py")
    assert all(wide["end"] <= r["start"] for r in singles)


def test_full_run_retries_only_infrastructure_and_kills_the_hung_group(full_run):
    root, _ = full_run
    summary = json.loads((root / ".ci-artifacts" / "gpu-hopper" / "summary.json").read_text())
    attempts = {Path(f["file"]).name: f["attempts"] for f in summary["files"]}
    assert [a["class"] for a in attempts["test_flaky.py"]] == ["nccl-timeout", None]
    assert [a["class"] for a in attempts["test_asserts.py"]] == ["assertion"]
    assert [a["class"] for a in attempts["test_hang.py"]] == ["test-timeout"]
    assert 10 < attempts["test_hang.py"][0]["seconds"] < 60
    grandchild = int((root / "trace" / "grandchild.pid").read_text())
    assert not pid_alive(grandchild), "the timed-out file's whole process group must be killed"
    # the flake record: one line per retried attempt, keyed by (file, arch), shown in the summary
    flakes = (root / ".ci-artifacts" / "flakes.jsonl").read_text().splitlines()
    assert len(flakes) == 1
    flake = json.loads(flakes[0])
    assert (flake["file"], flake["arch"], flake["class"], flake["final"]) == (
        "tests/gpu/test_flaky.py",
        "hopper",
        "nccl-timeout",
        "passed",
    )
    assert "Retried infrastructure failures" in summary_text(root)
    # every attempt left its own log
    logs = sorted(p.name for p in (root / ".ci-artifacts/gpu-hopper/files").glob("*flaky*.log"))
    assert logs == [
        "tests__gpu__test_flaky.py.attempt1.log",
        "tests__gpu__test_flaky.py.attempt2.log",
    ]


def summary_text(root: Path) -> str:
    return (root / ".ci-artifacts" / "gpu-hopper" / "summary.txt").read_text()


def test_full_run_writes_the_merged_junit_and_the_duration_history(full_run):
    root, _ = full_run
    tree = ET.parse(root / ".ci-artifacts" / "gpu-hopper" / "junit.xml").getroot()
    suites = {s.get("name"): s for s in tree.findall("testsuite")}
    assert len(suites) == 8
    assert suites["tests/gpu/test_hang.py"].get("errors") == "1"
    props = {
        p.get("name"): p.get("value") for p in suites["tests/gpu/test_flaky.py"].iter("property")
    }
    assert props["attempts"] == "2" and props["retried_for"] == "nccl-timeout"
    assert tree.get("failures") == "2"  # assertion + skip; the retried flake is not counted
    records = [
        json.loads(line)
        for line in (root / ".ci-artifacts/history/gpu-hopper.jsonl").read_text().splitlines()
    ]
    by_file = {r["file"]: r for r in records}
    assert len(records) == 8
    assert by_file["tests/gpu/test_w1.py"]["outcome"] == "passed"
    assert by_file["tests/gpu/test_w1.py"]["seconds"] >= 0.4
    assert by_file["tests/gpu/test_hang.py"]["outcome"] == "error"
    assert {r["lane"] for r in records} == {"gpu-hopper"}


def test_named_files_are_checked_against_their_registrations_before_anything_runs(
    tmp_path, make_repo, lane
):
    root = make_repo(tmp_path, FILES)
    out = lane(root, "tests/gpu/test_blackwell_only.py", "tests/test_cpu.py", "tests/nope.py")
    assert out.returncode == 2
    assert "refusing to run files that gpu-hopper does not run:" in out.stderr
    assert (
        "tests/gpu/test_blackwell_only.py:3: declares hardware=['blackwell'], not hopper. Fix: run "
        "it with `nox -s gpu-blackwell`" in out.stderr
    )
    assert "tests/test_cpu.py:3: registered for the cpu lane, not for gpu-hopper" in out.stderr
    assert "tests/nope.py: no such file" in out.stderr
    assert not (root / ".ci-artifacts").exists()


def test_under_ci_a_file_too_wide_for_the_host_fails_the_lane(tmp_path, make_repo, lane):
    root = make_repo(tmp_path, FILES)
    out = lane(root, "tests/gpu/test_three.py", "tests/gpu/test_w3.py", env={"CI": "true"})
    assert out.returncode == 1, out.stdout + out.stderr
    assert "[1/1] PASS tests/gpu/test_w3.py" in out.stdout
    assert "not runnable here: needs 3 GPUs" in out.stdout
    assert "under CI=true" not in out.stdout
    tree = ET.parse(root / ".ci-artifacts" / "gpu-hopper" / "junit.xml").getroot()
    assert tree.get("errors") == "1"


def test_a_planned_job_runs_its_tests_and_a_stale_or_foreign_job_is_refused(
    tmp_path, make_repo, lane
):
    root = make_repo(tmp_path, FILES)

    def planned(file: str, num_gpus: int, est: float) -> PlannedTest:
        return PlannedTest(file, num_gpus, est, "est_time", 0.0, "asked for")

    job = Job(
        id="gpu-hopper-h200-2gpu-1", lane="gpu-hopper", arch="hopper", pool="h200-2gpu",
        runs_on=("self-hosted", "h200", "gpu-2"), runner_group="h200", gpus=2,
        timeout_minutes=30, over_budget=False, est_seconds=12.0,
        tests=(planned("tests/gpu/test_w3.py", 1, 3.0), planned("tests/gpu/test_wide.py", 2, 9.0)),
    )  # fmt: skip
    foreign = replace(job, id="gpu-blackwell-b200-8gpu-1", lane="gpu-blackwell", arch="blackwell")
    stale = replace(job, id="stale", tests=(planned("tests/gpu/test_w3.py", 2, 3.0),))
    plan = tmp_path / "plan.json"
    everything = SelectionSummary(True, ("asked for",), 0)
    record = Plan(event="pull_request", cadence=None, base=None, head=None, worktree=False,
                  trusted=True, approval=None, fleet="ci/fleet.toml", budget_seconds=3600.0,
                  selection=everything)  # fmt: skip
    record.jobs = [job, foreign, stale]
    plan.write_text(record.dumps())

    out = lane(root, "--job", "gpu-hopper-h200-2gpu-1", "--plan", str(plan))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 file(s) to run (job gpu-hopper-h200-2gpu-1)" in out.stdout
    history = (root / ".ci-artifacts/history/gpu-hopper.jsonl").read_text().splitlines()
    assert {json.loads(r)["job"] for r in history} == {"gpu-hopper-h200-2gpu-1"}

    out = lane(root, "--job", "gpu-blackwell-b200-8gpu-1", "--plan", str(plan))
    assert out.returncode == 2
    assert "is for 'gpu-blackwell', not gpu-hopper. Fix: run `nox -s gpu-blackwell -- --job" in (
        out.stderr
    )
    out = lane(root, "--job", "nope", "--plan", str(plan))
    assert out.returncode == 2
    assert "the plan has no job 'nope'; its jobs: gpu-hopper-h200-2gpu-1, " in out.stderr
    out = lane(root, "--job", "stale", "--plan", str(plan))
    assert out.returncode == 2
    assert "the plan says num_gpus=2, the registration 1. Fix: re-plan" in out.stderr


def test_gpus_leased_by_another_lane_are_not_used_and_waiting_too_long_is_a_lease_timeout(
    tmp_path, make_repo, lane
):
    root = make_repo(
        tmp_path,
        {
            "tests/gpu/test_w1.py": FILES["tests/gpu/test_w1.py"],
            "tests/gpu/test_w2.py": FILES["tests/gpu/test_w2.py"],
            "tests/gpu/test_wide.py": HEAD + cuda(1, 2) + WORK,
        },
    )
    other_lane = LeaseDir(root / "leases").try_acquire(["FAKE-0"], 1, holder="another lane")
    assert other_lane is not None
    try:
        # plugin from its entry point this time (how the CPU image's lanes load it)
        out = lane(root, "--lease-timeout", "1.5")
    finally:
        other_lane.release()
    assert out.returncode == 1, out.stdout + out.stderr
    runs = traces(root)
    assert sorted(r["file"] for r in runs) == ["test_w1.py", "test_w2.py"]
    assert {g for r in runs for g in r["gpus"]} == {"FAKE-1"}
    summary = json.loads((root / ".ci-artifacts" / "gpu-hopper" / "summary.json").read_text())
    wide = next(f for f in summary["files"] if f["file"] == "tests/gpu/test_wide.py")
    assert [a["class"] for a in wide["attempts"]] == ["lease-timeout", "lease-timeout"]
    assert "mizzen: GPU lease timeout: waited" in wide["summary"]
    assert "another lane" in wide["summary"]


SHARE = ", shares_gpu=True"
SLOW_WORK = WORK.replace("time.sleep(0.4)", "time.sleep(2.0)")


def test_sharing_files_run_together_on_one_gpu_and_split_its_gpu_seconds(tmp_path, make_repo, lane):
    files = {
        "tests/gpu/test_s1.py": HEAD + cuda(9, extra=SHARE) + SLOW_WORK,
        "tests/gpu/test_s2.py": HEAD + cuda(8, extra=SHARE) + SLOW_WORK,
        "tests/gpu/test_s3.py": HEAD + cuda(7, extra=SHARE) + SLOW_WORK,
        "tests/gpu/test_alone.py": HEAD + cuda(6) + SLOW_WORK,
    }
    root = make_repo(tmp_path / "shared", files)
    out = lane(root, fake_gpus=1)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 of them sharing GPUs, up to 4 per GPU" in out.stdout
    runs = {r["file"]: r for r in traces(root)}
    sharing = [runs[f"test_s{k}.py"] for k in (1, 2, 3)]
    assert all(r["gpus"] == ["FAKE-0"] for r in runs.values())
    latest_start = max(r["start"] for r in sharing)
    assert all(r["end"] > latest_start for r in sharing), "the three never ran at once"
    for r in sharing:  # the exclusive file had the GPU to itself
        assert_no_gpu_shared([runs["test_alone.py"], r])
    summary = json.loads((root / ".ci-artifacts" / "gpu-hopper" / "summary.json").read_text())
    by_file = {f["file"]: f for f in summary["files"]}
    walls = {f: by_file[f]["attempts"][0]["seconds"] for f in by_file}
    # the GPU's time is split between the files holding it: the sharing files' GPU-seconds sum
    # to the span they held the GPU for (they overlapped: one interval), under their walls' sum
    held = [by_file[f"tests/gpu/test_s{k}.py"]["attempts"][0] for k in (1, 2, 3)]
    span = max(a["started"] + a["seconds"] for a in held) - min(a["started"] for a in held)
    shared_sum = sum(by_file[f"tests/gpu/test_s{k}.py"]["gpu_seconds"] for k in (1, 2, 3))
    assert shared_sum == pytest.approx(span, abs=0.01)
    assert shared_sum < 0.7 * sum(walls[f"tests/gpu/test_s{k}.py"] for k in (1, 2, 3))
    assert by_file["tests/gpu/test_alone.py"]["gpu_seconds"] == pytest.approx(
        walls["tests/gpu/test_alone.py"], abs=1e-3
    )
    assert summary["gpu_seconds"] == pytest.approx(
        shared_sum + by_file["tests/gpu/test_alone.py"]["gpu_seconds"], abs=1e-2
    )
    text = (root / ".ci-artifacts" / "gpu-hopper" / "summary.txt").read_text()
    assert "1 (0, shared)" in text and "3 file(s) shared a GPU" in text

    # --gpu-seats 1: the same files one at a time, each charged its whole wall time
    root = make_repo(tmp_path / "alone", files)
    out = lane(root, "--gpu-seats", "1", fake_gpus=1)
    assert out.returncode == 0, out.stdout + out.stderr
    assert_no_gpu_shared(traces(root))
    assert "shared" not in (root / ".ci-artifacts" / "gpu-hopper" / "summary.txt").read_text()
    out = lane(root, "--gpu-seats", "5", fake_gpus=1)
    assert out.returncode == 2 and "--gpu-seats must be from 1 to 4" in out.stderr


def test_the_planted_repository_fails_its_skip_and_refuses_its_blackwell_file(
    tmp_path, lane, repo_root, ci_fixtures
):
    """What the H200 run of the planted tree shows (see its README), here with a pretend GPU."""
    planted = ci_fixtures / "gpu_lane" / "planted"
    common = ["--root", str(planted), "--report-dir", str(tmp_path / "r"), "--no-history",
              "--flake-record", str(tmp_path / "flakes.jsonl")]  # fmt: skip
    # The H200 invocation: no entry points, PYTHONPATH relative to the checkout, files run in
    # another root.  (This venv also has mizzen_ci installed, so the child finds it either way;
    # on the GPU image the lane's own absolute path is what lets it load the plugin.)
    out = lane(
        tmp_path,
        *common,
        env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONPATH": "ci/src"},
        fake_gpus=1,
        cwd=repo_root,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert "[1/2] PASS tests/test_planted_pass.py" in out.stdout or (
        "[2/2] PASS tests/test_planted_pass.py" in out.stdout
    )
    assert (
        "FAILED [test-failure]: 1 failed of 2; first: test_skips_on_the_hardware_it_declared: "
        "skipped on hardware it declared (lane hopper, compute capability 9.0): planted"
        in out.stdout
    )
    assert "test_planted_blackwell_only" not in out.stdout
    out = lane(tmp_path, *common, str(planted / "tests" / "test_planted_blackwell_only.py"))
    assert out.returncode == 2
    assert "test_planted_blackwell_only.py:5: declares hardware=['blackwell'], not hopper" in (
        out.stderr
    )


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_redraws_one_status_line_on_a_terminal_and_prints_plain_lines_in_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    term = FakeTerminal()
    progress = Progress(total=3, gpus=2, stream=term)
    assert progress.live
    progress.status({"tests/gpu/test_a.py": ("g0",)}, force=True)
    progress.event("[1/3] PASS tests/gpu/test_b.py")
    progress.status({"tests/gpu/test_a.py": ("g0",), "tests/gpu/test_c.py": ("g1",)}, force=True)
    shared = {"tests/gpu/test_a.py": ("g0",), "tests/gpu/test_d.py": ("g0",)}  # one GPU, 2 files
    progress.status(shared, force=True)
    progress.close()
    assert term.getvalue() == (
        "[0/3 files] GPUs busy 1/2 · test_a.py"
        "\r\x1b[K[1/3] PASS tests/gpu/test_b.py\n"
        "[0/3 files] GPUs busy 2/2 · test_a.py, test_c.py"
        "\r\x1b[K[0/3 files] GPUs busy 1/2 · test_a.py, test_d.py"
        "\r\x1b[K"
    )
    monkeypatch.setenv("CI", "true")
    ci = FakeTerminal()
    progress = Progress(total=3, gpus=2, stream=ci)
    progress.status({"tests/gpu/test_a.py": ("g0",)}, force=True)
    progress.event("[1/3] PASS tests/gpu/test_b.py")
    progress.close()
    assert ci.getvalue() == "[1/3] PASS tests/gpu/test_b.py\n"


def test_a_planned_file_the_base_runs_runs_though_the_head_disabled_it(tmp_path, make_repo, lane):
    """The base decides what must run (issue 31): the plan's overrides run on the GPU lane even
    where the head's registration says ``disabled=``; without the override it stays disabled."""
    from mizzen_ci.plan.model import Override

    root = make_repo(tmp_path, {"tests/gpu/test_disabled.py": FILES["tests/gpu/test_disabled.py"]})
    test = PlannedTest("tests/gpu/test_disabled.py", 1, 4.0, "est_time", 0.0, "the base runs it")
    job = Job(
        id="gpu-hopper-h200-2gpu-1", lane="gpu-hopper", arch="hopper", pool="h200-2gpu",
        runs_on=("self-hosted", "h200", "gpu-2"), runner_group="h200", gpus=2,
        timeout_minutes=30, over_budget=False, est_seconds=4.0, tests=(test,),
    )  # fmt: skip
    record = Plan(event="pull_request", cadence=None, base=None, head=None, worktree=False,
                  trusted=True, approval=None, fleet="ci/fleet.toml", budget_seconds=3600.0,
                  selection=SelectionSummary(True, ("asked for",), 0))  # fmt: skip
    record.jobs = [job]
    plain, overridden = tmp_path / "plain.json", tmp_path / "overridden.json"
    plain.write_text(record.dumps())
    record.overrides = [
        Override("tests/gpu/test_disabled.py", "hopper", "tests/gpu/test_disabled.py",
                 "runs as the base declares it: the head set disabled='driver bug 7'")
    ]  # fmt: skip
    overridden.write_text(record.dumps())

    out = lane(root, "--job", job.id, "--plan", str(plain))
    assert "1 file(s) to run" not in out.stdout and "disabled: driver bug 7" in out.stdout, (
        out.stdout
    )
    out = lane(root, "--job", job.id, "--plan", str(overridden))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 file(s) to run" in out.stdout and "PASS tests/gpu/test_disabled.py" in out.stdout


RECORDED = """
def test_reads_its_input():
    assert json.loads((pathlib.Path(__file__).parent / "input.json").read_text()) == {}
"""


def test_record_execution_stores_what_each_gpu_test_executed(tmp_path, make_repo, lane):
    """``--record-execution STORE`` (issue 34): the lane's per-file pytest runs under coverage
    with per-test contexts, and the rows (the test's own source, the data file it read) land
    under HEAD in the execution store the selection audit reads."""
    from mizzen_ci.history_execution import read

    files = {
        "tests/gpu/test_recorded.py": HEAD + cuda(2.0) + RECORDED,
        "tests/gpu/input.json": "{}",
    }
    root = make_repo(tmp_path / "repo", files)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(root)]
    for step in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "lane"]):
        subprocess.run([*git, *step], check=True)
    store = tmp_path / "execution.sqlite"
    out = lane(root, "--record-execution", str(store), "--no-history")
    assert out.returncode == 0, out.stdout + out.stderr
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert f"execution rows stored under {head[:12]} in {store}" in out.stdout, out.stdout
    rows, problems = read(store)
    assert problems == []
    test = "tests/gpu/test_recorded.py::test_reads_its_input"
    got = {(r.revision, r.test, r.path, r.kind) for r in rows}
    assert (head.strip(), test, "tests/gpu/test_recorded.py", "source") in got, got
    assert (head.strip(), test, "tests/gpu/input.json", "data") in got, got
