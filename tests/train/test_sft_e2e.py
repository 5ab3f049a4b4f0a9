"""e2e: ``mizzen-train sft`` trains a tiny Llama on the shipped colours task for 60 steps with
evaluation every 20: exactly three eval points (20, 40 and 60, the last one forced), the eval
score and the held-out loss improve, no engine runs before the first eval point and every engine
started serves an eval point, snapshots and curves are where the run says."""

from __future__ import annotations

import json
import time

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=120, labels=["e2e", "train"])

#: What the later metric gate will hold this run to (see the summary record).
MIN_FINAL_SCORE = 0.6
MAX_FINAL_HELDOUT_LOSS = 0.7


def test_sft_run_evaluates_snapshots_on_the_side(sft, tmp_path):
    run_dir = tmp_path / "run"
    config = sft.write_config(tmp_path / "run.toml", sft.colours_sections(run_dir))
    log = tmp_path / "sft.log"
    started = time.monotonic()
    process = sft.launch(config, log)
    engines_seen_before_first_point = []
    try:
        while process.poll() is None:
            step = sft.max_train_step(sft.read_metrics(run_dir / "metrics.jsonl"))
            engines = sft.engine_descendants(process.pid)
            if engines and step < 20:
                engines_seen_before_first_point.append((step, engines))
            time.sleep(0.05)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(30)
    wall = time.monotonic() - started
    output = log.read_text()
    assert process.returncode == 0, output[-4000:]
    assert engines_seen_before_first_point == [], "an engine ran during the first 20 steps"

    records = sft.read_metrics(run_dir / "metrics.jsonl")
    for record in records:
        if record["kind"] in sft.RECORD_KEYS:
            assert set(record) == sft.RECORD_KEYS[record["kind"]], record
    started_event = next(r for r in records if r.get("event") == "run_started")
    assert started_event["engines_needed"] == "eval-only"
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 61))

    points = [r for r in records if r["kind"] == "eval_point"]
    assert [(p["step"], p["status"], p["final"]) for p in points] == [
        (20, "ok", False),
        (40, "ok", False),
        (60, "ok", True),
    ]
    evals = {(r["step"], r["evaluator"]): r for r in records if r["kind"] == "eval"}
    assert sorted(evals) == [(s, e) for s in (20, 40, 60) for e in ("answers", "heldout")]
    assert all(r["status"] == "ok" and r["tenant"] == "colours" for r in evals.values())
    score = {s: evals[(s, "answers")]["metrics"]["score"] for s in (20, 40, 60)}
    heldout = {s: evals[(s, "heldout")]["metrics"]["loss"] for s in (20, 40, 60)}
    assert score[60] > score[20], score
    assert heldout[60] < heldout[20], heldout

    # every engine was started for an eval point, after that point's step was trained
    trained_at = {r["step"]: r["time"] for r in records if r["kind"] == "train"}
    engine_starts = [r for r in records if r.get("event") == "engine_started"]
    assert [e["step"] for e in engine_starts] == [20, 40, 60]
    for event in engine_starts:
        assert event["purpose"] == "eval" and event["time"] >= trained_at[event["step"]]
    stops = {e["pid"] for e in records if e.get("event") == "engine_stopped"}
    assert stops == {e["pid"] for e in engine_starts}

    summary = records[-1]
    assert summary["kind"] == "summary" and summary["eval_points"] == [20, 40, 60]
    final_score = summary["final_eval"]["colours"]["answers"]["score"]
    final_loss = summary["final_eval"]["colours"]["heldout"]["loss"]
    assert (final_score, final_loss) == (score[60], heldout[60])
    print(f"final eval score={final_score:.4f} heldout_loss={final_loss:.4f} wall={wall:.0f}s")
    assert final_score >= MIN_FINAL_SCORE
    assert final_loss <= MAX_FINAL_HELDOUT_LOSS

    snapshots = run_dir / "snapshots"
    assert sorted(p.name for p in snapshots.iterdir()) == ["step-00000060"]
    final_snapshot = snapshots / "step-00000060" / "colours"
    assert json.loads((final_snapshot / "config.json").read_text())["model_type"] == "llama"
    assert (run_dir / "curves.png").stat().st_size > 10_000
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["step-00000050", "step-00000060"]
    assert f"curves:      {run_dir / 'curves.png'}" in output
    assert f"snapshots:   {snapshots} (kept: step-00000060)" in output
    assert "eval step 20 colours/answers: score=" in output
