"""Hostile file-system shapes: the shared reader (``sources.read_bytes``) refuses everything but a
bounded regular file without a blocking open, and the registry's one walk reports every shape
under ``tests/`` that could not become a test that runs (links, loops, FIFOs, sockets, directories
named ``test_*.py``, test files in skipped folders, unprintable names, unreadable directories) with
its path and the fix, while outside ``tests/`` the skipped folders stay silent.

Every blocking call runs under :func:`deadline`, so a hang is a failure, not a stuck run."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mizzen_ci import history, register_cpu_ci
from mizzen_ci.fleet import load_fleet
from mizzen_ci.plan import Plan
from mizzen_ci.plan.model import PlanError
from mizzen_ci.registry import RegistryConfigError, discover, read_registry, registry_excludes
from mizzen_ci.sources import MAX_SOURCE_BYTES, RefusedFile, read_bytes, read_tail

register_cpu_ci(est_time=20, labels=["ci"])

REPO = Path(__file__).resolve().parents[3]
CI_SRC = REPO / "ci" / "src"
FLEET = load_fleet(Path(__file__).parents[1] / "fixtures" / "registry" / "fleet.toml")
GOOD = "from mizzen_ci import register_cpu_ci\nregister_cpu_ci(est_time=1, labels=['ci'])\n"


def make_socket(path: Path) -> None:
    """A UNIX socket file at ``path`` (bound by a relative name: socket paths are short)."""
    cwd = os.getcwd()
    os.chdir(path.parent)
    try:
        s = socket.socket(socket.AF_UNIX)
        s.bind(path.name)
        s.close()
    finally:
        os.chdir(cwd)


def write(root: Path, rel: str, text: str = GOOD) -> Path:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


# ----------------------------------------------------------------------------------------------
# The shared reader


def test_read_bytes_refuses_a_fifo_without_blocking(tmp_path: Path, deadline):
    fifo = tmp_path / "test_fifo.py"
    os.mkfifo(fifo)
    with deadline(), pytest.raises(RefusedFile) as info:
        read_bytes(fifo)
    assert str(fifo) in str(info.value) and "FIFO" in str(info.value) and info.value.fix


@pytest.mark.parametrize("shape", ["socket", "directory", "link-out", "link-loop", "device"])
def test_read_bytes_refuses_every_file_that_is_not_regular(tmp_path: Path, shape: str, deadline):
    target = tmp_path / "test_x.py"
    if shape == "socket":
        make_socket(target)
    elif shape == "directory":
        target.mkdir()
    elif shape == "link-out":
        outside = tmp_path.parent / f"{tmp_path.name}-outside.py"
        outside.write_text("SECRET = 1\n")
        target.symlink_to(outside)
    elif shape == "link-loop":
        target.symlink_to(target.name)
    else:
        target = Path("/dev/zero")  # would read forever without the size cap
    with deadline(), pytest.raises(RefusedFile) as info:
        read_bytes(target)
    message = str(info.value)
    assert str(target) in message
    assert "not a regular file" in message or "symbolic link" in message
    assert "fix: " in message


def test_read_bytes_caps_the_size_and_read_tail_reads_only_the_end(tmp_path: Path):
    big = tmp_path / "test_big.py"
    with big.open("wb") as f:
        f.truncate(MAX_SOURCE_BYTES + 1)  # sparse: costs no disk
    with pytest.raises(RefusedFile, match=r"over the 8\.0 MiB"):
        read_bytes(big)
    assert read_bytes(big, MAX_SOURCE_BYTES + 1)[0] == b"\0" * (MAX_SOURCE_BYTES + 1)
    log = tmp_path / "log"
    log.write_bytes(b"x" * 100_000 + b"the end\n")
    assert read_tail(log, 8) == b"the end\n"


# ----------------------------------------------------------------------------------------------
# The walk: every shape under tests/ is registered or reported; outside tests/ skipped folders
# stay silent


def hostile_tree(root: Path) -> None:
    write(root, "tests/test_ok.py")
    os.mkfifo(root / "tests" / "test_fifo.py")
    make_socket(root / "tests" / "test_sock.py")
    write(root, "tests/test_dir.py/test_inner.py")  # a directory named like a test file
    outside = root.parent / f"{root.name}-outside.py"
    outside.write_text(GOOD)
    (root / "tests" / "test_link_out.py").symlink_to(outside)
    (root / "tests" / "test_link_in.py").symlink_to("test_ok.py")
    (root / "tests" / "test_loop.py").symlink_to("test_loop.py")
    (root / "tests" / "linked_dir").symlink_to(root / "pkg", target_is_directory=True)
    write(root, "pkg/test_behind_link.py")
    for folder in ("build", "dist", "x.egg-info", ".hidden", "node_modules", "site-packages"):
        write(root, f"tests/{folder}/test_in_{folder.strip('.').replace('.', '_')}.py")
    write(root, "tests/venv/pyvenv.cfg", "home = /usr\n")
    write(root, "tests/venv/lib/test_in_venv.py")
    write(root, "tests/data/build/test_excluded.py")  # excluded: never reported
    write(root, "tests/helper\nname.py", "X = 1\n")
    write(root, "build/test_tool_output.py")  # outside tests/: silent
    write(root, ".venv/lib/test_in_root_venv.py")
    write(root, "pyproject.toml", '[tool.mizzen.registry]\nexclude = ["tests/data"]\n')


EXPECTED_VIOLATIONS = {
    ("tests/build/test_in_build.py", "skipped-folder"),
    ("tests/dist/test_in_dist.py", "skipped-folder"),
    ("tests/x.egg-info/test_in_x_egg-info.py", "skipped-folder"),
    ("tests/.hidden/test_in_hidden.py", "skipped-folder"),
    ("tests/node_modules/test_in_node_modules.py", "skipped-folder"),
    ("tests/site-packages/test_in_site-packages.py", "skipped-folder"),
    ("tests/venv/lib/test_in_venv.py", "skipped-folder"),
    ("tests/helper\nname.py", "path-unprintable"),
    ("tests/linked_dir", "symlink"),
    ("tests/test_dir.py", "not-a-file"),
    ("tests/test_fifo.py", "not-a-file"),
    ("tests/test_link_in.py", "symlink"),
    ("tests/test_link_out.py", "symlink"),
    ("tests/test_loop.py", "symlink"),
    ("tests/test_sock.py", "not-a-file"),
    ("pkg/test_behind_link.py", "outside-tests"),
}


def test_every_hostile_shape_under_tests_is_reported_with_its_path_and_fix(
    tmp_path: Path, deadline
):
    root = tmp_path / "repo"
    hostile_tree(root)
    with deadline():
        registry = read_registry(root, FLEET)
    got = {(v.path, v.rule) for v in registry.violations}
    assert got == EXPECTED_VIOLATIONS
    assert sorted(registry.by_path()) == ["tests/test_dir.py/test_inner.py", "tests/test_ok.py"]
    for v in registry.violations:
        assert v.line == 1 and v.message and v.fix
    messages = {v.path: v.message for v in registry.violations}
    assert "pointing out of the repository" in messages["tests/test_link_out.py"]
    assert "pointing inside the repository" in messages["tests/test_link_in.py"]
    assert "loop" in messages["tests/test_loop.py"]
    assert "FIFO" in messages["tests/test_fifo.py"] and "socket" in messages["tests/test_sock.py"]
    assert "pyvenv.cfg" in messages["tests/venv/lib/test_in_venv.py"]
    # the import graph's view of tests/ holds only regular files
    tree = discover(root, registry_excludes(root)).tree
    assert tree.all == ["tests/test_ok.py", "tests/test_dir.py/test_inner.py"]


def test_the_plan_reports_the_same_violations_and_finishes(tmp_path: Path, deadline):
    from mizzen_ci.plan.index import build_index

    root = tmp_path / "repo"
    hostile_tree(root)
    with deadline():
        index = build_index(root, FLEET)
        registry = read_registry(root, FLEET)
    assert [str(v) for v in index.registry.violations] == [str(v) for v in registry.violations]


def test_many_test_files_in_a_skipped_folder_are_reported_a_few_then_counted(tmp_path: Path):
    for i in range(25):
        write(tmp_path, f"tests/pkg/build/test_{i:02d}.py")
    violations = discover(tmp_path).violations
    assert [v.path for v in violations][:10] == [
        f"tests/pkg/build/test_{i:02d}.py" for i in range(10)
    ]
    assert len(violations) == 11
    assert violations[-1].path == "tests/pkg/build" and "15 more" in violations[-1].message


def test_tests_itself_as_a_link_is_reported_not_silently_empty(tmp_path: Path):
    root = tmp_path / "repo"
    write(tmp_path, "real/test_a.py")
    root.mkdir()
    (root / "tests").symlink_to(tmp_path / "real", target_is_directory=True)
    registry = read_registry(root, FLEET)
    assert [(v.path, v.rule) for v in registry.violations] == [("tests", "symlink")]


def test_a_tree_deeper_than_the_path_limit_is_reported_and_the_rest_registered(
    tmp_path: Path, deadline
):
    write(tmp_path, "tests/test_top.py")
    fd = os.open(tmp_path / "tests", os.O_RDONLY)
    try:  # build it relative to a descriptor: the full path is longer than PATH_MAX
        for depth in range(300):
            name = f"level{depth:03d}_{'d' * 12}"
            os.mkdir(name, dir_fd=fd)
            new = os.open(name, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = new
            if depth == 100:
                f = os.open("test_mid.py", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
                os.write(f, GOOD.encode())
                os.close(f)
    finally:
        os.close(fd)
    with deadline(30):
        registry = read_registry(tmp_path, FLEET)
    assert len(registry.registrations) == 2  # top and the one at depth 100
    (v,) = registry.violations
    assert v.rule == "unreadable-dir" and "would never run" in v.message
    assert len(v.path) > 4000


# ----------------------------------------------------------------------------------------------
# [tool.mizzen.registry]: a malformed table is one clear error, never a traceback


@pytest.mark.parametrize(
    "text, expected",
    [
        ("[tool.mizzen.registry\nexclude = 1\n", "not valid TOML"),
        ('[tool.mizzen.registry]\nexclude = "tests/ci/fixtures"\n', "must be a list of path globs"),
        ("[tool.mizzen.registry]\nexclude = [1, 2]\n", "must be a list of path globs"),
        ("[tool]\nmizzen = 3\n", "must be a table"),
        ("a = " + "[" * 2000 + "]" * 2000 + "\n", "not valid TOML"),
        (b"\xff\xfe[tool]", "not UTF-8"),
    ],
)
def test_a_malformed_registry_table_is_a_clear_error(tmp_path: Path, text, expected):
    pyproject = tmp_path / "pyproject.toml"
    if isinstance(text, bytes):
        pyproject.write_bytes(text)
    else:
        pyproject.write_text(text)
    with pytest.raises(RegistryConfigError, match=expected):
        registry_excludes(tmp_path)
    (tmp_path / "ci").mkdir()
    (tmp_path / "ci" / "fleet.toml").write_text(FLEET.path.read_text())
    proc = subprocess.run(
        [sys.executable, "-S", "-m", "mizzen_ci", "validate", "--root", str(tmp_path)],
        env={"PATH": os.environ["PATH"], "PYTHONPATH": str(CI_SRC)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("mizzen-ci validate: ") and "pyproject.toml" in proc.stderr
    assert expected in proc.stderr


def test_a_fifo_as_pyproject_is_refused_without_blocking(tmp_path: Path, deadline):
    os.mkfifo(tmp_path / "pyproject.toml")
    with deadline(), pytest.raises(RegistryConfigError, match="FIFO"):
        registry_excludes(tmp_path)


# ----------------------------------------------------------------------------------------------
# Stores and plans the lanes and the planner read: never through a link, never blocking

ROW = (
    '{"file": "tests/test_ok.py", "arch": null, "seconds": 42.0, "outcome": "passed", '
    '"when": "2026-11-01T00:00:00+00:00", "lane": "cpu"}'
)


def test_stores_that_are_not_regular_files_are_named_and_skipped_without_blocking(
    tmp_path, deadline
):
    stores = tmp_path / "stores"
    stores.mkdir()
    os.mkfifo(stores / "fifo.jsonl")
    (stores / "bad-utf8.jsonl").write_bytes(b"\xff\xfe" + ROW.encode() + b"\n")
    (stores / "good.jsonl").write_text(ROW + "\n")
    outside = tmp_path / "outside.jsonl"
    outside.write_text(ROW.replace("42.0", "1.0") + "\n")
    (stores / "link.jsonl").symlink_to(outside)
    (stores / "loop").symlink_to(stores, target_is_directory=True)  # a walk must not follow it
    with deadline():
        records, problems = history.read_stores(stores)
    assert [r.seconds for r in records] == [42.0]
    assert len(problems) == 1 and "bad-utf8.jsonl: not UTF-8" in problems[0]
    # given by name, a FIFO and a link are refused with what they are
    with deadline():
        _, problems = history.read_stores([stores / "fifo.jsonl", stores / "link.jsonl"])
    assert "FIFO" in problems[0] and "symbolic link" in problems[1]


def test_a_fifo_plan_is_refused_without_blocking(tmp_path: Path, deadline):
    os.mkfifo(tmp_path / "plan.json")
    with deadline(), pytest.raises(PlanError, match="FIFO"):
        Plan.load(tmp_path / "plan.json")


# ----------------------------------------------------------------------------------------------
# [tool.uv.workspace] members: the import graph reads only the repository's own modules


@pytest.mark.parametrize(
    "members, expected",
    [
        ('["/etc"]', "is absolute or climbs out"),
        ('["../../../../usr/lib/python3*"]', "is absolute or climbs out"),
        ('["packages/*"]', "lies outside the repository"),  # packages/evil links out
        ('"packages/*"', "must be a list of globs"),
    ],
)
def test_workspace_members_outside_the_repository_are_a_clear_error(tmp_path, members, expected):
    root = tmp_path / "repo"
    write(root, "ci/fleet.toml", FLEET.path.read_text())
    write(root, "tests/test_ok.py")
    write(root, "packages/good/pyproject.toml", '[project]\nname = "good"\n')
    outside = tmp_path / "outside"
    write(outside, "pyproject.toml", '[project]\nname = "evil"\n')
    write(outside, "src/evil/__init__.py", "SECRET = 1\n")
    (root / "packages" / "evil").symlink_to(outside, target_is_directory=True)
    write(root, "pyproject.toml", f"[tool.uv.workspace]\nmembers = {members}\n")
    proc = subprocess.run(
        [sys.executable, "-S", "-m", "mizzen_ci", "plan", "--root", str(root), "--no-cache",
         "--event", "push"],
        env={"PATH": os.environ["PATH"], "PYTHONPATH": str(CI_SRC)},
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("mizzen-ci plan: ") and expected in proc.stderr
