"""``mizzen-train plot``: loss and eval curves of a run's ``metrics.jsonl`` (matplotlib).

One panel for the training loss (a line per tenant); for RL runs one panel per RL training metric
the records carry (reward mean, response length, KL to the base, clip fraction); then one panel
per evaluator metric (a line per tenant, one marker per eval point, at the snapshot's step).  Counters (``samples``,
``tokens``, ``failed``) are not drawn.

Invariants:
- A panel whose every value is the same (a flat line: a metric the run does not move, e.g. a KL
  of 0 with no KL term) is left out; the image's caption names what was left out and its value.
- An eval panel with one point per tenant is a marker at that step on an x axis spanning the
  run's training steps (never a one-point axis of odd ticks), its value written beside it.
- Bad paths are :class:`PlotError` lines: a metrics path that is a directory or missing, an
  output that is a directory or whose folder cannot be made.  Values matplotlib cannot lay out
  (records of valid shape spanning -1e308 to 1e308) are a PlotError naming the file too: what
  matplotlib raises while drawing or writing (ValueError, OverflowError) becomes one, the figure
  closed and no image (nor its temporary file) left behind.
- matplotlib is imported inside :func:`plot_metrics` (the ``plot`` extra of mizzen-train) with the
  non-interactive Agg backend; nothing else in mizzen-train needs it.
- The image is written atomically (temporary name, then rename).
"""

from __future__ import annotations

import contextlib
import math
import os
import uuid
from collections import defaultdict
from collections.abc import Iterator
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


def _constant(by_tenant: dict[str, list[tuple[int, float]]]) -> float | None:
    """The one value of a metric that never changes over at least two points, else None."""
    values = {value for points in by_tenant.values() for _, value in points}
    count = sum(len(points) for points in by_tenant.values())
    return values.pop() if count > 1 and len(values) == 1 else None


def _span_steps(ax, x_range: tuple[int, int]) -> None:
    """A panel's x axis spans the run's training steps, with integer ticks."""
    from matplotlib.ticker import MaxNLocator

    low, high = x_range
    pad = max(1, (high - low) // 20)
    ax.set_xlim(low - pad, high + pad)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


class PlotError(ValueError):
    """The metrics file cannot be plotted (missing, holding no training records, or values
    matplotlib cannot lay out)."""


@contextlib.contextmanager
def _drawing(metrics: str | os.PathLike, figure=None) -> Iterator[None]:
    """What matplotlib raises on the values of ``metrics`` (drawing, laying out, writing) as a
    PlotError naming the file; ``figure`` (being drawn) is closed on any error."""
    try:
        yield
    except BaseException as exc:
        if figure is not None:
            import matplotlib.pyplot as plt

            plt.close(figure)
        if isinstance(exc, PlotError) or not isinstance(exc, ValueError | OverflowError):
            raise
        raise PlotError(
            f"{metrics}: matplotlib cannot draw its values ({type(exc).__name__}: {exc}); the "
            "records hold values too far apart to plot -- check the run's losses and metrics"
        ) from None


def plot_metrics(metrics: str | os.PathLike, output: str | os.PathLike) -> Path:
    """Draw the curves of ``metrics`` into the image ``output`` (atomically); returns its path."""
    out = Path(output)
    if out.is_dir():
        raise PlotError(f"-o {out} is a directory; give an image path, e.g. {out / 'curves.png'}")
    figure = curves_figure(metrics)
    import matplotlib.pyplot as plt  # after curves_figure chose the Agg backend

    kinds = figure.canvas.get_supported_filetypes()
    if out.suffix and out.suffix[1:].lower() not in kinds:
        plt.close(figure)
        raise PlotError(f"-o {out}: {out.suffix!r} is not an image format matplotlib writes; "
                        f"use one of {sorted(kinds)}, e.g. {out.with_suffix('.png')}")  # fmt: skip

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        plt.close(figure)
        raise PlotError(f"-o {out}: cannot create its folder ({exc.strerror}); give a "
                        "writable place") from None  # fmt: skip
    tmp = out.with_name(f".{out.stem}.tmp-{uuid.uuid4().hex[:8]}{out.suffix or '.png'}")
    try:
        with _drawing(metrics):
            figure.savefig(tmp, dpi=110)
        os.replace(tmp, out)
    finally:
        plt.close(figure)
        if tmp.exists():
            tmp.unlink()
    return out


def curves_figure(metrics: str | os.PathLike):
    """The matplotlib figure of a metrics file's curves (the module docstring's panels)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(metrics)
    if path.is_dir():
        raise PlotError(f"{path} is a directory; give the metrics.jsonl in it")
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
        raise PlotError(f"{path}: holds no training records; give the metrics.jsonl a run wrote "
                        "(<run.dir>/metrics.jsonl)")  # fmt: skip
    flat_values = {name: _constant(extra[name]) for name in TRAIN_PANELS if name in extra}
    flat_values.update({f"eval {e}: {n}": _constant(evals[(e, n)]) for e, n in list(evals)})
    left_out = {name: value for name, value in flat_values.items() if value is not None}
    extra_panels = [name for name in TRAIN_PANELS if name in extra and name not in left_out]
    evals = {key: v for key, v in evals.items() if f"eval {key[0]}: {key[1]}" not in left_out}
    steps = [s for points in train.values() for s, _ in points]
    x_range = (min(steps), max(steps))
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
    _span_steps(ax, x_range)
    ax.legend(fontsize="small")
    for ax, name in zip(flat[1:], extra_panels, strict=False):
        for tenant, points in sorted(extra[name].items()):
            points.sort()
            ax.plot([s for s, _ in points], [v for _, v in points], label=tenant, linewidth=1.2)
        ax.set(title=TRAIN_PANELS[name], xlabel="step", ylabel=name)
        _span_steps(ax, x_range)
        ax.legend(fontsize="small")
    order = sorted(evals.items(), key=lambda item: (_PRIORITY.get(item[0][1], 9), item[0]))
    offset = 1 + len(extra_panels)
    for ax, ((evaluator, name), by_tenant) in zip(flat[offset:], order, strict=False):
        for tenant, points in sorted(by_tenant.items()):
            points.sort()
            ax.plot([s for s, _ in points], [v for _, v in points], marker="o", label=tenant)
            if len(points) == 1:
                step, value = points[0]
                ax.annotate(f"{value:.4g}", (step, value), textcoords="offset points",
                            xytext=(6, 6), fontsize="small")  # fmt: skip
        ax.set(title=f"eval {evaluator}: {name}", xlabel="step", ylabel=name)
        _span_steps(ax, x_range)
        ax.legend(fontsize="small")
    for ax in flat[panels:]:
        ax.axis("off")
    if left_out:
        constant = ", ".join(f"{name} = {value:.4g}" for name, value in sorted(left_out.items()))
        figure.text(0.01, 0.005, f"constant, not drawn: {constant}", fontsize="small")
    with _drawing(path, figure):  # where matplotlib lays out ticks: huge spans fail here
        figure.tight_layout(rect=(0, 0.03 if left_out else 0, 1, 1))
    return figure
