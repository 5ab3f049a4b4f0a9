"""``mizzen-train plot`` on records of valid shape and extreme values: an image, or one
:class:`~mizzen_train.run.plot.PlotError` line (exit 2), never matplotlib's traceback."""

from __future__ import annotations

import json
import subprocess
import sys

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=15, labels=["train"])


def _write(path, losses) -> None:
    rows = [
        {"kind": "train", "step": i + 1, "tenant": "a", "loss": v} for i, v in enumerate(losses)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_a_span_matplotlib_cannot_lay_out_is_one_error_line(tmp_path):
    _write(tmp_path / "metrics.jsonl", [1.0, -1e308, 1e308])
    result = subprocess.run(
        [sys.executable, "-m", "mizzen_train", "plot", "metrics.jsonl", "-o", "c.png"],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mizzen-train plot: error: "), lines
    assert "metrics.jsonl" in lines[0] and not (tmp_path / "c.png").exists(), lines
    assert not list(tmp_path.glob(".c.tmp-*")), list(tmp_path.iterdir())
