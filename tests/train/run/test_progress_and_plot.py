"""What a run shows while and after it trains: the step line's ETA counts the wall time of the
last steps (evaluation points and checkpoints included), and the curves leave out flat panels
(naming their value) and draw a single eval point on the run's step axis.  In process: a
metrics file written here, matplotlib's Agg figure read back."""

from __future__ import annotations

import io
import json
from pathlib import Path

from mizzen_ci import register_cpu_ci
from mizzen_train.run.metrics import Progress
from mizzen_train.run.plot import curves_figure, plot_metrics

register_cpu_ci(est_time=6, labels=["train"])


def test_the_eta_counts_the_time_between_steps_not_only_their_compute() -> None:
    """Each step computes for 0.1 s, but an eval point between steps makes each take 1 s of
    wall time: 8 steps left are 8 s, not 0.8 s."""
    ticks = iter([0.0, 1.0, 2.0])
    stream = io.StringIO()
    progress = Progress(10, stream=stream, clock=lambda: next(ticks))
    for step in (1, 2):
        progress.step(step, {"a": 1.0}, tokens_per_s=100.0, step_s=0.1)
    progress.step(3, {"a": 1.0}, tokens_per_s=100.0, step_s=0.1)
    first, second, third = stream.getvalue().splitlines()
    assert first.endswith("eta 0:00:01")  # 9 steps x 0.1 s: nothing else known yet
    assert second.endswith("eta 0:00:08") and third.endswith("eta 0:00:07"), stream.getvalue()


def _rl_metrics(path: Path) -> Path:
    records = [
        {"kind": "train", "step": s, "tenant": "t", "loss": 1.0 / s, "reward_mean": 0.1 * s,
         "kl": 0.0, "response_length": 16}
        for s in range(1, 21)
    ] + [
        {"kind": "eval", "step": 10, "tenant": "t", "evaluator": "answers", "status": "ok",
         "metrics": {"score": 0.5, "samples": 8.0}},
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_flat_panels_are_named_not_drawn_and_one_eval_point_spans_the_run(tmp_path) -> None:
    figure = curves_figure(_rl_metrics(tmp_path / "metrics.jsonl"))
    titles = [ax.get_title() for ax in figure.axes if ax.get_title()]
    assert titles == ["training loss", "reward (mean over samples)", "eval answers: score"]
    caption = " ".join(t.get_text() for t in figure.texts)
    assert "constant, not drawn:" in caption and "kl = 0" in caption
    assert "response_length = 16" in caption
    (eval_ax,) = [ax for ax in figure.axes if ax.get_title() == "eval answers: score"]
    low, high = eval_ax.get_xlim()
    assert low <= 1 and high >= 20, (low, high)  # the run's steps, not a one-point axis
    assert all(float(t).is_integer() for t in eval_ax.get_xticks())
    assert any(t.get_text() == "0.5" for t in eval_ax.texts)  # the point's value beside it


def test_the_image_is_written(tmp_path) -> None:
    out = plot_metrics(_rl_metrics(tmp_path / "metrics.jsonl"), tmp_path / "c" / "curves.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
