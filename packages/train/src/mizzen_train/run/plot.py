"""``mizzen-train plot``: loss and eval curves of a run's ``metrics.jsonl`` (matplotlib).

One panel for the training loss (a line per tenant); for RL runs one panel per RL training metric
the records carry (reward mean, response length, KL to the base, clip fraction); then one panel
per evaluator metric (a line per tenant, one marker per eval point, at the snapshot's step).  Counters (``samples``,
``tokens``, ``failed``) are not drawn.

Invariants:
- matplotlib is imported inside :func:`plot_metrics` (the ``plot`` extra of mizzen-train) with the
  non-interactive Agg backend; nothing else in mizzen-train needs it.
- The image is written atomically (temporary name, then rename).
"""

from __future__ import annotations

import math
import os
import uuid
from collections import defaultdict
from pathlib import Path

from mizzen_train.run.metrics import read_metrics

#: Eval metrics that count things rather than measure the model.
COUNTERS = frozenset({"samples", "tokens", "failed"})
#: RL training metrics drawn when the train records carry them (title of each panel).
TRAIN_PANELS = {
    "reward_mean": "reward (mean over samples)",
    "response_length": "response length (tokens)",
    "kl": "KL(policy || base)",
    "clip_fraction": "clip fraction",
}
#: Panels first: the score and the held-out loss.
_PRIORITY = {"score": 0, "loss": 1, "perplexity": 2}


class PlotError(ValueError):
    """The metrics file cannot be plotted (missing, or holding no training records)."""


def plot_metrics(metrics: str | os.PathLike, output: str | os.PathLike) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path, out = Path(metrics), Path(output)
    if not path.is_file():
        raise PlotError(f"{path}: no such file; give the metrics.jsonl of a run")
    records, _ = read_metrics(path)
    train: dict[str, list[tuple[int, float]]] = defaultdict(list)
    extra: dict[str, dict[str, list[tuple[int, float]]]] = defaultdict(lambda: defaultdict(list))
    evals: dict[tuple[str, str], dict[str, list[tuple[int, float]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for record in records:
        if record["kind"] == "train" and isinstance(record.get("loss"), int | float):
            train[record["tenant"]].append((int(record["step"]), float(record["loss"])))
            for name in TRAIN_PANELS:
                value = record.get(name)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    extra[name][record["tenant"]].append((int(record["step"]), float(value)))
        elif record["kind"] == "eval" and record.get("status") == "ok":
            for name, value in (record.get("metrics") or {}).items():
                if name not in COUNTERS and isinstance(value, int | float):
                    evals[(record["evaluator"], name)][record["tenant"]].append(
                        (int(record["step"]), float(value))
                    )
    if not train:
        raise PlotError(f"{path}: holds no training records; is it a mizzen-train metrics file?")
    extra_panels = [name for name in TRAIN_PANELS if name in extra]
    panels = 1 + len(extra_panels) + len(evals)
    columns = min(3, panels)
    rows = math.ceil(panels / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.6 * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    ax = flat[0]
    for tenant, points in sorted(train.items()):
        points.sort()
        ax.plot([s for s, _ in points], [v for _, v in points], label=tenant, linewidth=1.2)
    ax.set(title="training loss", xlabel="step", ylabel="loss")
    ax.legend(fontsize="small")
    for ax, name in zip(flat[1:], extra_panels, strict=False):
        for tenant, points in sorted(extra[name].items()):
            points.sort()
            ax.plot([s for s, _ in points], [v for _, v in points], label=tenant, linewidth=1.2)
        ax.set(title=TRAIN_PANELS[name], xlabel="step", ylabel=name)
        ax.legend(fontsize="small")
    order = sorted(evals.items(), key=lambda item: (_PRIORITY.get(item[0][1], 9), item[0]))
    offset = 1 + len(extra_panels)
    for ax, ((evaluator, name), by_tenant) in zip(flat[offset:], order, strict=False):
        for tenant, points in sorted(by_tenant.items()):
            points.sort()
            ax.plot([s for s, _ in points], [v for _, v in points], marker="o", label=tenant)
        ax.set(title=f"eval {evaluator}: {name}", xlabel="step", ylabel=name)
        ax.legend(fontsize="small")
    for ax in flat[panels:]:
        ax.axis("off")
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.stem}.tmp-{uuid.uuid4().hex[:8]}{out.suffix or '.png'}")
    try:
        figure.savefig(tmp, dpi=110)
        os.replace(tmp, out)
    finally:
        plt.close(figure)
        if tmp.exists():
            tmp.unlink()
    return out
