"""Durations and flake records accumulate: `history merge` keeps both kinds (the flake records
in their own file), a re-uploaded artifact counts once, the planner reads a merged history folder
without mistaking flake records for bad lines, and `history flakes` lists the flakiest
(file, arch) pairs with their rates."""

from __future__ import annotations

import json

from mizzen_ci import register_cpu_ci
from mizzen_ci.history import FlakeRecord, Record, append, append_flakes, read_stores

register_cpu_ci(est_time=5, labels=["ci"])

FLAKY, STEADY = "tests/x/test_flaky.py", "tests/x/test_steady.py"


def lane_artifacts(root, job: str, runs: dict[str, int], retried: dict[str, int]):
    """One GPU job's upload: a duration record per run and a flake record per retried attempt."""
    durations, flakes = [], []
    for file, n in runs.items():
        durations += [Record(file, "hopper", 10.0 + i, "passed", f"2026-11-{i + 1:02d}T00:00:00+00:00",
                             "gpu-hopper", job) for i in range(n)]  # fmt: skip
    for file, n in retried.items():
        flakes += [FlakeRecord(file, "hopper", "nccl-timeout", "NCCL watchdog", "passed",
                               f"2026-11-{i + 1:02d}T00:00:00+00:00", job) for i in range(n)]  # fmt: skip
    append(root / job / "history" / "gpu-hopper.jsonl", durations)
    append_flakes(root / job / "flakes.jsonl", flakes)


def test_merge_keeps_flakes_and_counts_a_reupload_once(tmp_path, mizzen_ci):
    new = tmp_path / "new-history"
    lane_artifacts(new, "history-hopper-1", {FLAKY: 4, STEADY: 4}, {FLAKY: 2})
    lane_artifacts(new, "history-hopper-2", {FLAKY: 4}, {FLAKY: 1})
    # the same artifact downloaded twice
    lane_artifacts(tmp_path / "again", "history-hopper-2", {FLAKY: 4}, {FLAKY: 1})
    out_dir = tmp_path / "merged"
    out = mizzen_ci("history", "merge", "--out", str(out_dir / "durations.jsonl"), str(new),
                    str(tmp_path / "again"))  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "dropped" not in out.stderr  # flake lines are the other kind, not bad lines
    flakes = [json.loads(line) for line in (out_dir / "flakes.jsonl").read_text().splitlines()]
    assert len(flakes) == 3  # 2 of job 1, 1 of job 2; its re-upload adds nothing
    records, problems = read_stores(out_dir)  # the planner's read of the merged folder
    assert problems == [] and len(records) == 12  # 8 runs of job 1, 4 of job 2, none twice

    listed = mizzen_ci("history", "flakes", "--json", str(out_dir))
    assert listed.returncode == 0, listed.stderr
    (row,) = json.loads(listed.stdout)["flakes"]
    assert row == {"file": FLAKY, "arch": "hopper", "runs": 8, "retried": 3, "rate": 0.375}


def test_flakes_table_orders_by_rate(tmp_path, mizzen_ci):
    lane_artifacts(tmp_path, "a", {FLAKY: 10, STEADY: 4}, {FLAKY: 1, STEADY: 2})
    out = mizzen_ci("history", "flakes", str(tmp_path))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["file", "arch", "runs", "retried", "rate"]
    assert lines[2].split() == [STEADY, "hopper", "4", "2", "50%"]
    assert lines[3].split() == [FLAKY, "hopper", "10", "1", "10%"]
    assert "2 flaky (file, arch) pair(s) over 14 recorded run(s)" in out.stdout
    bad = tmp_path / "a" / "flakes.jsonl"
    bad.write_text(bad.read_text() + '{"class": "x", "final": "passed", "file": 7}\n')
    out = mizzen_ci("history", "flakes", str(tmp_path))
    assert out.returncode == 0 and "dropped" in out.stderr and f"{bad}:4" in out.stderr
