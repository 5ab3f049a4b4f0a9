"""Property: whatever a pull request puts on disk — links (in, out, dangling, loops, to
directories), FIFOs, sockets, directories named like test files, skipped folders, deep trees,
names with newlines, control, format and look-alike characters, huge literals, garbage bytes —
the registry and the planner finish (a hang is a failure) and either register each test file or
report it with a ``path:line: [rule] message. Fix: …`` violation; nothing they print is a
workflow command, a terminal escape or a traceback.  In-process for many shapes, and
``mizzen-ci validate`` / ``mizzen-ci plan`` as ``python3 -S`` subprocesses (with a timeout) for
fewer."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mizzen_ci import register_cpu_ci
from mizzen_ci.fleet import load_fleet
from mizzen_ci.output import plain
from mizzen_ci.plan import Plan
from mizzen_ci.plan.index import build_index
from mizzen_ci.registry import discover, read_registry
from mizzen_ci.registry.rules import MAX_EST_TIME_SECONDS

register_cpu_ci(est_time=60, labels=["ci"])

REPO = Path(__file__).resolve().parents[3]
CI_SRC = REPO / "ci" / "src"
FLEET_FILE = Path(__file__).parents[1] / "fixtures" / "registry" / "fleet.toml"
FLEET = load_fleet(FLEET_FILE)

FOLDERS = [
    "tests",
    "tests/sub",
    "tests/a/b/c/d/e/f/g/h/i/j/k/l/m/n/o/p",
    "tests/build",
    "tests/.hidden",
    "tests/pkg.egg-info",
    "tests/test_dir.py",
    "tests/sp\u00e4ce d\u200bir",
    "tools",
    "build",
]
NAMES = [
    "test_a.py",
    "test_b c.py",
    "test_\n::error file=x::pwned.py",
    "test_\r##[error]x.py",
    "test_\x1b[2Jclear.py",
    "test_\u202eyp.exe.py",
    "test_\u00fcn\u00efcode.py",
    "test_\uff4c\uff4f\uff52\uff41.py",
    "test_\u200b.py",
    "test_" + "x" * 200 + ".py",
    "test_tab\there.py",
    "conftest.py",
    "helper.py",
    "data.txt",
]
SHAPES = [
    "file",
    "fifo",
    "socket",
    "dir",
    "link_in",
    "link_out",
    "link_loop",
    "dangling",
    "link_dir",
]
HEAD = "from mizzen_ci import register_cpu_ci, register_cuda_ci\n"
SOURCES = [
    HEAD + "register_cpu_ci(est_time=3, labels=['ci'])\n",
    HEAD + "register_cuda_ci(est_time=30, hardware=['hopper'], labels=['lora'])\n",
    HEAD + "register_cpu_ci(est_time=" + "9" * 400 + ", labels=['ci'])\n",
    HEAD + "register_cpu_ci(est_time=1.6e308, labels=['ci'])\n",
    HEAD + "register_cpu_ci(est_time=1e308)\n",
    HEAD + "register_cuda_ci(est_time=1, hardware=['hopper'], num_gpus=" + "7" * 300 + ")\n",
    HEAD + "register_cpu_ci(est_time=1, disabled='\\u200b')\n",
    HEAD + "register_cpu_ci(est_time=1, disabled='x\\n::error::pwned')\n",
    HEAD + "register_cpu_ci(est_time=1, labels=[" + "'l', " * 3000 + "])\n",
    HEAD + "register_cpu_ci(est_time=" + "[" * 150 + "]" * 150 + ")\n",
    HEAD + "x = " + "-" * 50_000 + "1\nregister_cpu_ci(est_time=1)\n",
    HEAD + "x = " + "(" * 300 + ")" * 300 + "\nregister_cpu_ci(est_time=1)\n",
    HEAD + "x = " + "a." * 20_000 + "b\nregister_cpu_ci(est_time=1)\n",
    HEAD + "def f():\n" + "".join("    " * i + "if x:\n" for i in range(1, 120)) + "    " * 120 + "register_cpu_ci(est_time=1)\n",
    HEAD + "register_cpu_ci(est_time=1)\n\x00",
    "\xff\xfe register_cpu_ci(1)",
    "",
]  # fmt: skip
ENTRY = st.tuples(
    st.sampled_from(FOLDERS),
    st.sampled_from(NAMES),
    st.sampled_from(SHAPES),
    st.sampled_from(SOURCES),
)
TREE = st.lists(ENTRY, min_size=1, max_size=8, unique_by=lambda e: (e[0], e[1]))
SKIPPED = ("build", ".hidden", "pkg.egg-info")


def build(root: Path, entries) -> list[str]:
    """Make the entries under ``root``; the repository-relative paths made."""
    (root / "ci").mkdir(parents=True)
    (root / "ci" / "fleet.toml").write_text(FLEET_FILE.read_text())
    (root / "tests").mkdir()
    outside = root.parent / "outside.py"
    outside.write_text(SOURCES[0])
    made = []
    for folder, name, shape, source in entries:
        d = root / folder
        if d.is_symlink() or (d.exists() and not d.is_dir()):
            continue
        d.mkdir(parents=True, exist_ok=True)
        p = d / name
        if os.path.lexists(p):
            continue
        if shape == "socket" and len(name.encode()) > 100:
            shape = "fifo"  # socket names are short
        if shape == "file":
            p.write_bytes(source.encode("utf-8", "surrogateescape"))
        elif shape == "fifo":
            os.mkfifo(p)
        elif shape == "socket":
            cwd = os.getcwd()
            os.chdir(d)
            try:
                s = socket.socket(socket.AF_UNIX)
                s.bind(name)
                s.close()
            finally:
                os.chdir(cwd)
        elif shape == "dir":
            p.mkdir()
            (p / "test_inside.py").write_text(source)
        elif shape == "link_in":
            p.symlink_to(root / "ci" / "fleet.toml")
        elif shape == "link_out":
            p.symlink_to(outside)
        elif shape == "link_loop":
            p.symlink_to(name)
        elif shape == "dangling":
            p.symlink_to(root / "missing")
        else:
            p.symlink_to(root / "tests", target_is_directory=True)
        made.append(p.relative_to(root).as_posix())
    return made


def check_violations(violations) -> None:
    for v in violations:
        assert isinstance(v.path, str) and v.path and isinstance(v.line, int) and v.line >= 1
        assert v.rule and v.message and v.fix
        shown = plain(v)
        assert shown.startswith(plain(v.path) + f":{v.line}: [{v.rule}] ") and ". Fix: " in shown
        assert all(c.isprintable() for c in shown) and not shown.startswith("::")
        assert len(v.message) < 2000


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(entries=TREE)
def test_every_shape_is_registered_or_reported_and_the_index_agrees(entries, deadline):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "repo"
        made = build(root, entries)
        with deadline(30):
            registry = read_registry(root, FLEET)
            index = build_index(root, FLEET)
            tree = discover(root).tree
        check_violations(registry.violations)
        assert [str(v) for v in index.registry.violations] == [str(v) for v in registry.violations]
        assert index.registry.registrations == registry.registrations
        for reg in registry.registrations:
            assert 0 < reg.est_time <= MAX_EST_TIME_SECONDS
            assert (root / reg.path).is_file() and not (root / reg.path).is_symlink()
        for rel in tree.all:
            assert (root / rel).is_file() and not (root / rel).is_symlink()
        reported = {v.path for v in registry.violations} | set(registry.by_path())
        for rel in made:
            name = rel.rsplit("/", 1)[-1]
            if not (name.startswith("test_") and name.endswith(".py")):
                continue
            if not rel.startswith("tests/") and rel.split("/")[0] in SKIPPED:
                continue  # outside tests/ a skipped folder is tool output: silent
            # the entry itself, or its parent (a link to a directory, a directory named like a
            # test file), or what is inside it (a directory named like a test file) is reported
            assert rel in reported or any(
                rel.startswith(p + "/") or p.startswith(rel + "/") for p in reported
            ), f"{rel!a} is neither registered nor reported"


def run_ci(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-S", "-m", "mizzen_ci", *args, "--root", str(root)],
        env={"PATH": os.environ["PATH"], "PYTHONPATH": str(CI_SRC), "GITHUB_ACTIONS": "true"},
        capture_output=True,
        text=True,
        errors="replace",
        timeout=90,
        cwd=root,
    )


def check_printed(text: str) -> None:
    assert "Traceback" not in text and "\x1b" not in text
    for line in text.splitlines():
        if line.startswith(("::error ", "::warning ")):  # our annotations: one line each
            _, _, message = line.partition("::")[2].partition("::")
            assert "%0A" in message or "\n" not in message
            continue
        assert not line.lstrip().startswith(("::", "##[")), ascii(line)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(entries=TREE)
def test_validate_and_plan_as_subprocesses_finish_and_print_safely(entries):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "repo"
        build(root, entries)
        validate = run_ci(root, "validate")
        assert validate.returncode in (0, 1), validate.stderr
        check_printed(validate.stdout + validate.stderr)
        out = root / "plan.json"
        plan = run_ci(
            root, "plan", "--event", "schedule", "--cadence", "nightly", "--verbose",
            "--output", str(out), "--summary", str(root / "summary.md"),
        )  # fmt: skip
        # the plan is written either way; it exits 1 when the registry has errors (as validate)
        assert plan.returncode == validate.returncode, plan.stderr
        check_printed(plan.stdout + plan.stderr)
        check_printed((root / "summary.md").read_text())
        loaded = Plan.load(out)  # what the lanes read
        assert all(j.timeout_minutes < 10**4 for j in loaded.jobs)
        assert (validate.returncode == 1) == bool(loaded.errors)
