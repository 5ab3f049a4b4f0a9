"""Inline SVG sparklines: small line charts and outcome strips that need no JavaScript and no
file beside the page.

Invariants: every number written is finite and rounded (a non-finite value is left out of the
line and drawn as a red tick); the output is well-formed SVG whose only text (the title) comes
through the page's escaping function (:func:`.escape.e`: masked, then HTML-escaped); an empty series is an empty string.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .escape import e

WIDTH, HEIGHT, PAD = 140, 28, 3


def _y(v: float, lo: float, hi: float) -> float:
    span = hi - lo or 1.0
    return round(HEIGHT - PAD - (v - lo) / span * (HEIGHT - 2 * PAD), 2)


def sparkline(
    values: Sequence[float], *, band: tuple[float, float] | None = None, title: str = ""
) -> str:
    """A line of ``values`` (oldest first), the last point marked, ``band`` (low, high) shaded."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return ""
    lo, hi = min(finite), max(finite)
    if band is not None and all(math.isfinite(b) for b in band):
        lo, hi = min(lo, band[0]), max(hi, band[1])
    step = (WIDTH - 2 * PAD) / max(len(values) - 1, 1)
    xs = [round(PAD + i * step, 2) for i in range(len(values))]
    points = " ".join(
        f"{x},{_y(v, lo, hi)}" for x, v in zip(xs, values, strict=True) if math.isfinite(v)
    )
    parts = [f'<svg class="spark" role="img" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" '
             f'xmlns="http://www.w3.org/2000/svg"><title>{e(title)}</title>']  # fmt: skip
    if band is not None and all(math.isfinite(b) for b in band):
        top, bottom = _y(band[1], lo, hi), _y(band[0], lo, hi)
        parts.append(
            f'<rect x="0" y="{top}" width="{WIDTH}" height="{round(bottom - top, 2)}" fill="#d9f0d9"/>'
        )
    parts.append(f'<polyline fill="none" stroke="#3465a4" stroke-width="1.5" points="{points}"/>')
    for x, v in zip(xs, values, strict=True):
        if not math.isfinite(v):
            parts.append(f'<line x1="{x}" y1="0" x2="{x}" y2="{HEIGHT}" stroke="#cc0000"/>')
    if math.isfinite(values[-1]):
        parts.append(
            f'<circle cx="{xs[-1]}" cy="{_y(values[-1], lo, hi)}" r="2.5" fill="#204a87"/>'
        )
    return "".join(parts) + "</svg>"


COLOURS = {"passed": "#4e9a06", "failed": "#cc0000", "error": "#a40000", "skipped": "#babdb6"}


def strip(outcomes: Sequence[str], *, title: str = "") -> str:
    """One small square per outcome (oldest first), coloured by outcome."""
    if not outcomes:
        return ""
    size = 7
    width = len(outcomes) * (size + 1)
    cells = "".join(f'<rect x="{i * (size + 1)}" y="0" width="{size}" height="{size * 2}" '
                    f'fill="{COLOURS.get(o, "#555753")}"/>' for i, o in enumerate(outcomes))  # fmt: skip
    return (f'<svg class="strip" role="img" width="{width}" height="{size * 2}" viewBox="0 0 {width} {size * 2}" '
            f'xmlns="http://www.w3.org/2000/svg"><title>{e(title)}</title>{cells}</svg>')  # fmt: skip
