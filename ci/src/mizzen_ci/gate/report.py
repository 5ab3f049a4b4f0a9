"""The gate's verdicts for people: a text table for the log, a Markdown table for
``$GITHUB_STEP_SUMMARY``, workflow annotations; each row with a sparkline of its history.

Invariants:
- Every cell goes through :mod:`mizzen_ci.output` (one escaping function per medium): a test
  path, a reason or a stored value cannot break a table or print a workflow command.
- Every active quarantine entry, every expired one and every dropped input line is listed in
  every summary, whatever the verdicts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .. import output
from .check import GateRun, Row

BLOCKS = "▁▂▃▄▅▆▇█"
SPARK_POINTS = 20
HEADERS = (
    "test",
    "arch",
    "metric",
    "step",
    "reference",
    "band",
    "value",
    "history → value",
    "verdict",
    "details",
)


def sparkline(history: Sequence[float], value: float | None) -> str:
    """The last :data:`SPARK_POINTS` history values, then ``→`` and the value, as block
    characters on one scale (``×`` for a non-finite value, ``-`` for none)."""
    shown = list(history[-SPARK_POINTS:])
    finite = [x for x in [*shown, value] if x is not None and math.isfinite(x)]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 0.0)

    def glyph(x: float | None) -> str:
        if x is None:
            return "-"
        if not math.isfinite(x):
            return "×"
        if hi == lo:
            return BLOCKS[3]
        return BLOCKS[min(len(BLOCKS) - 1, int((x - lo) / (hi - lo) * len(BLOCKS)))]

    return ("".join(glyph(x) for x in shown) or "(none)") + " → " + glyph(value)


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.4g}" if math.isfinite(x) else str(x)


def _cells(r: Row, markdown: bool) -> tuple:
    test = output.Code(r.test) if markdown else r.test
    verdict = (
        r.verdict if not markdown or r.verdict not in ("FAIL", "warning") else r.verdict.upper()
    )
    return (
        test, r.arch, r.metric, "-" if r.step is None else r.step, _num(r.reference),
        "-" if r.band is None else f"±{_num(r.band)}", _num(r.value),
        sparkline(r.history, r.value), verdict, r.why,
    )  # fmt: skip


def _counts(result: GateRun) -> str:
    counts: dict[str, int] = {}
    for r in result.rows:
        counts[r.verdict] = counts.get(r.verdict, 0) + 1
    order = ("FAIL", "warning", "inactive", "pass", "improved")
    said = ", ".join(f"{counts[v]} {v}" for v in order if v in counts) or "nothing judged"
    status = "FAILED" if result.failed else "passed"
    return f"metric gate {status}: {said}"


def _lists(result: GateRun) -> list[tuple[str, str]]:
    """``(level, text)`` lines every summary shows besides the table."""
    out = []
    for e in result.active:
        out.append(("warning", f"quarantined until {e.expires}: {e.file} on {e.arch}: {e.reason}"))
    for e in result.expired:
        out.append(
            (
                "warning",
                f"expired quarantine (since {e.expires}; remove it from ci/quarantine.toml): {e.file} on {e.arch}: {e.reason}",
            )
        )
    out += [("error", e) for e in result.errors]
    out += [("warning", p) for p in result.problems]
    out += [("notice", n) for n in result.notes]
    return out


def text(result: GateRun) -> str:
    lines = [_counts(result)]
    if result.rows:
        lines += ["", output.text_table(HEADERS, [_cells(r, False) for r in result.rows])]
    extra = _lists(result)
    if extra:
        lines.append("")
        lines += [output.plain(f"{level}: {t}") for level, t in extra]
    return "\n".join(lines) + "\n"


def markdown(result: GateRun) -> str:
    lines = ["### Metric gate", "", output.markdown(_counts(result)), ""]
    if result.rows:
        lines += [output.markdown_table(HEADERS, [_cells(r, True) for r in result.rows]), ""]
    for level, t in _lists(result):
        lines.append(f"- **{level}**: {output.markdown(t)}")
    return "\n".join(lines) + "\n"


def annotate(result: GateRun) -> None:
    for r in result.rows:
        if r.verdict in ("FAIL", "warning"):
            where = f"{r.metric}" + ("" if r.step is None else f"@{r.step}") + f" on {r.arch}"
            output.emit(
                "error" if r.fails else "warning",
                f"{where}: {r.why}",
                file=r.test,
                title="mizzen metric gate",
            )
    for level, t in _lists(result):
        output.emit(level, t, title="mizzen metric gate")
