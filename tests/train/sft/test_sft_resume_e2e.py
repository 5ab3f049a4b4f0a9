"""e2e: a real ``mizzen-train sft`` process is SIGKILLed after step 30 (once eval point 20 has
settled) and ``--resume`` continues it: same run id, training again from the step-30 checkpoint,
every step logged once, point 20 never evaluated again, 40 and 60 evaluated by the resumed
process (one eval engine, started at 40 and kept for 60), no half-written checkpoint or orphaned
engine left by the kill (the killed process's eval engine, kept after point 20, exits on its own),
and the same metrics keys as an uninterrupted run."""

from __future__ import annotations

from collections import Counter

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=65, labels=["e2e", "train"])


def test_killed_run_resumes_from_its_checkpoint_without_re_evaluating(sft, tmp_path):
    run_dir = tmp_path / "run"
    # checkpoints at 15, 30, 45, 60: a kill between step 30 and the eval gate at 40 (where
    # overflow="wait" holds training until point 20 settles) resumes from step 30
    sections = sft.colours_sections(run_dir, checkpoint_interval=15)
    config = sft.write_config(tmp_path / "run.toml", sections)
    run = sft.kill_and_resume(config, tmp_path / "sft.log", run_dir, kill_after=30, point=20)
    assert 30 <= run["killed_at"] < 60, run["killed_at"]
    assert [n for n in run["checkpoints_at_kill"] if n.startswith("step-")][-1] == "step-00000030"
    assert run["orphans"] == [], "an engine outlived the killed run"
    records, resumed_at = run["records"], run["resumed_at"]

    resumed = [r for r in records if r.get("event") == "resumed"]
    assert len(resumed) == 1 and resumed[0]["run_id"] == run["run_id"]
    assert resumed[0]["from_step"] == 30
    assert f"resuming from {run_dir / 'checkpoints' / 'step-00000030'} (step 30)" in run["output"]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp")]
    for record in records:
        if record["kind"] == "train":
            assert (record["time"] >= resumed_at) == (record["step"] > 30), record

    evals = [r for r in records if r["kind"] == "eval"]
    assert Counter((r["step"], r["evaluator"]) for r in evals) == {
        (s, e): 1 for s in (20, 40, 60) for e in ("answers", "heldout")
    }
    by_process = {r["step"]: r["time"] >= resumed_at for r in evals}
    assert by_process == {20: False, 40: True, 60: True}, "resumed: evaluates 40 and 60 only"
    result = sft.check_protocol(records, steps=60, points=(20, 40, 60))  # same keys and points
    assert result["summary"]["run_id"] == run["run_id"]
    print(
        f"resumed run: final eval score={result['score'][60]:.4f} "
        f"heldout_loss={result['heldout'][60]:.4f}"
    )
    assert sorted(p.name for p in (run_dir / "snapshots").iterdir()) == ["step-00000060"]
