"""e2e: a real ``mizzen-train sft`` process is SIGKILLed after step 30 (once eval point 20 has
settled) and ``--resume`` continues it: same run id, training again from the step-30 checkpoint,
every step logged once, point 20 never evaluated again, 40 and 60 evaluated by the resumed
process, no half-written checkpoint or orphaned engine left by the kill, and the same metrics keys
as an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=150, labels=["e2e", "train"])


def _wait(process, predicate, what: str, timeout_s: float = 300.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the run exited ({process.returncode}) before {what}")
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_killed_run_resumes_from_its_checkpoint_without_re_evaluating(sft, tmp_path):
    run_dir = tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"
    # checkpoints at 15, 30, 45, 60: a kill between step 30 and the eval gate at 40 (where
    # overflow="wait" holds training until point 20 settles) resumes from step 30
    sections = sft.colours_sections(run_dir, checkpoint_interval=15)
    config = sft.write_config(tmp_path / "run.toml", sections)
    log = tmp_path / "sft.log"
    first = sft.launch(config, log)
    try:

        def killable():
            records = sft.read_metrics(metrics)
            settled = any(r["kind"] == "eval_point" and r["step"] == 20 for r in records)
            return settled and sft.max_train_step(records) >= 30

        _wait(first, killable, "step 30 with eval point 20 settled")
        engines = sft.engine_descendants(first.pid)
        os.kill(first.pid, signal.SIGKILL)
        first.wait(30)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(30)
    assert first.returncode == -signal.SIGKILL
    before = sft.read_metrics(metrics)
    killed_at = sft.max_train_step(before)
    assert 30 <= killed_at < 60, killed_at
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    complete = [name for name in checkpoints if name.startswith("step-")]
    newest = int(complete[-1].split("-")[1])
    assert newest == 30, checkpoints
    run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
    deadline = time.monotonic() + 10  # the engine of a killed run exits on its own
    while any(sft.alive(pid) for pid in engines) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in engines if sft.alive(pid)], "orphaned engine"

    resumed_at = time.time()
    second = sft.launch(config, log, "--resume")
    assert second.wait(600) == 0, log.read_text()[-4000:]
    records = sft.read_metrics(metrics)
    output = log.read_text()

    resumed = [r for r in records if r.get("event") == "resumed"]
    assert len(resumed) == 1 and resumed[0]["run_id"] == run_id
    assert resumed[0]["from_step"] == newest
    assert f"resuming from {run_dir / 'checkpoints' / complete[-1]} (step {newest})" in output
    assert "removed partial checkpoint" in output or not [
        n for n in checkpoints if n.startswith(".tmp")
    ]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp")]

    train_steps = [r["step"] for r in records if r["kind"] == "train"]
    assert train_steps == list(range(1, 61)), "every step logged exactly once, in order"
    for record in records:
        if record["kind"] == "train" and record["step"] > newest:
            assert record["time"] >= resumed_at, "steps after the checkpoint were trained again"
        if record["kind"] == "train" and record["step"] <= newest:
            assert record["time"] < resumed_at

    evals = [r for r in records if r["kind"] == "eval"]
    assert Counter((r["step"], r["evaluator"]) for r in evals) == {
        (s, e): 1 for s in (20, 40, 60) for e in ("answers", "heldout")
    }
    by_process = {r["step"]: r["time"] >= resumed_at for r in evals}
    assert by_process == {20: False, 40: True, 60: True}, "resumed: evaluates 40 and 60 only"
    points = [(r["step"], r["status"], r["final"]) for r in records if r["kind"] == "eval_point"]
    assert points == [(20, "ok", False), (40, "ok", False), (60, "ok", True)]

    for record in records:
        if record["kind"] in sft.RECORD_KEYS:
            assert set(record) == sft.RECORD_KEYS[record["kind"]], record
    summary = records[-1]
    assert summary["kind"] == "summary" and summary["run_id"] == run_id
    final_score = summary["final_eval"]["colours"]["answers"]["score"]
    final_loss = summary["final_eval"]["colours"]["heldout"]["loss"]
    print(f"resumed run: final eval score={final_score:.4f} heldout_loss={final_loss:.4f}")
    assert final_score > next(
        r["metrics"]["score"] for r in evals if r["step"] == 20 and r["evaluator"] == "answers"
    )
    assert sorted(p.name for p in (run_dir / "snapshots").iterdir()) == ["step-00000060"]
