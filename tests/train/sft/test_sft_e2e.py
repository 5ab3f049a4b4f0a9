"""e2e: ``mizzen-train sft`` trains a tiny Llama on the shipped colours task for 60 steps with
evaluation every 20: exactly three eval points (20, 40 and 60, the last one forced), the eval
score and the held-out loss improve, no engine runs before the first eval point, one eval engine
started at point 20 serves all three (pointed at each snapshot) and is stopped once, at the end of
the run; snapshots and curves are where the run says.

It records the eval score and the held-out loss of every eval point for the metric gate
(``mizzen-ci gate check``), which holds the final ones to their trusted history."""

from __future__ import annotations

import json

from mizzen_ci import register_ci_gate, register_cpu_ci
from mizzen_ci.metrics import record

register_cpu_ci(est_time=50, labels=["e2e", "train"])
# The final eval point against the trusted history (median and MAD of the last 20 runs): the
# score may not drop by more than 10 % of its reference (at least 0.05), the held-out loss may not
# rise by more than 10 % (at least 0.02).
register_ci_gate(metric="eval/score", direction="higher", tolerance=0.1, floor=0.05, steps="last")
register_ci_gate(
    metric="eval/heldout_loss", direction="lower", tolerance=0.1, floor=0.02, steps="last"
)

#: Absolute bounds on every run (the summary record's final_eval); the gate watches drift.
MIN_FINAL_SCORE = 0.6
MAX_FINAL_HELDOUT_LOSS = 0.7


def test_sft_run_evaluates_snapshots_on_the_side(sft, tmp_path):
    run_dir = tmp_path / "run"
    config = sft.write_config(tmp_path / "run.toml", sft.colours_sections(run_dir))
    run = sft.run_to_completion(config, tmp_path / "sft.log", run_dir, first_point=20)
    assert run["early_engines"] == [], "an engine ran during the first 20 steps"
    result = sft.check_protocol(run["records"], steps=60, points=(20, 40, 60))
    for step in (20, 40, 60):
        record("eval/score", result["score"][step], step=step)
        record("eval/heldout_loss", result["heldout"][step], step=step)
    final_score, final_loss = result["score"][60], result["heldout"][60]
    print(
        f"final eval score={final_score:.4f} heldout_loss={final_loss:.4f} wall={run['wall']:.0f}s"
    )
    assert final_score >= MIN_FINAL_SCORE
    assert final_loss <= MAX_FINAL_HELDOUT_LOSS

    snapshots = run_dir / "snapshots"
    assert sorted(p.name for p in snapshots.iterdir()) == ["step-00000060"]
    final_snapshot = snapshots / "step-00000060" / "colours"
    assert json.loads((final_snapshot / "config.json").read_text())["model_type"] == "llama"
    assert (run_dir / "curves.png").stat().st_size > 10_000
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["step-00000050", "step-00000060"]
    output = run["output"]
    assert f"curves:      {run_dir / 'curves.png'}" in output
    assert f"snapshots:   {snapshots} (kept: step-00000060)" in output
    assert "eval step 20 colours/answers: score=" in output
