"""`mizzen-ci` is total over its inputs (issue 31, mechanism 6): a path that is a folder, in a
folder that does not exist, an argument that is not text, an absurd count or a non-finite number
given to `gate`, `history` or `gpu-lane` is one line on stderr and exit 2, never a traceback or a
hang."""

from __future__ import annotations

import os

import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=40, labels=["ci"])

BAD = os.fsdecode(b"m\xff")  # an argument that is not UTF-8 (a surrogate escape in Python)


def cases(t):
    store = str(t / "s.sqlite")
    return [
        ("history", "merge", "--out", str(t / "adir"), str(t / "in.jsonl")),
        ("history", "merge", "--out", "/proc/nonexistent/y.jsonl", str(t / "in.jsonl")),
        ("gate", "check", "--root", str(t), "--summary", str(t / "adir")),
        ("gate", "check", "--root", str(t), "--summary", "/proc/nonexistent/s.md"),
        ("gate", "ingest", "--root", str(t), "--store", "/proc/nonexistent/s.sqlite", "--trusted",
         "--event", "push", "--commit", "local", str(t / "in.jsonl")),
        ("gate", "untrust", "--root", str(t), "--store", store, "--commit", "local", "--test", BAD),
        ("gate", "show", "--root", str(t), "--store", store, "--test", "tests/x/test_a.py",
         "--metric", BAD),
        ("gate", "show", "--root", str(t), "--store", store, "--test", "tests/x/test_a.py",
         "--metric", "eval/score", "--step", "9" * 30),
        ("gpu-lane", "hopper", "--fake-gpus", "99999999999"),
        ("gpu-lane", "hopper", "--fake-gpus", "2", "--timeout-factor", "nan"),
        ("gpu-lane", "hopper", "--fake-gpus", "2", "--min-timeout", "inf"),
    ]  # fmt: skip


@pytest.fixture
def tree(tmp_path, repo_root):
    (tmp_path / "ci").mkdir()
    for name in ("fleet.toml", "metrics.toml"):
        (tmp_path / "ci" / name).write_text((repo_root / "ci" / name).read_text())
    (tmp_path / "adir").mkdir()
    (tmp_path / "in.jsonl").write_text("")
    (tmp_path / "s.sqlite").touch()
    return tmp_path


@pytest.mark.parametrize("case", range(11))
def test_bad_input_is_one_line_and_exit_2(tree, mizzen_ci, case):
    args = cases(tree)[case]
    out = mizzen_ci(*args, cwd=tree, timeout=30)
    assert out.returncode == 2, (args, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr and "internal error" not in out.stderr
    last = [line for line in out.stderr.splitlines() if not line.startswith("history: dropped")]
    assert len(last) == 1, out.stderr
