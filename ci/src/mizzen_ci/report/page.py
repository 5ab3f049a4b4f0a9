"""The health page's HTML: one self-contained file, readable without JavaScript.

Invariants: every text from a store or the checkout goes through :func:`.escape.e` (registered
secrets masked first, then :func:`html.escape`: a secret holding ``&`` or ``<`` is masked too); the page
carries a Content-Security-Policy that allows inline styles and nothing else (no script, no
request); numbers are formatted here and nowhere else; each section says plainly when it has
nothing to show, and the audit and queue sections name the record shape that would fill them.
"""

from __future__ import annotations

import math
import statistics

from .collect import Health
from .escape import e
from .svg import sparkline, strip

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em auto;max-width:1200px;color:#222;padding:0 1em}
h1{font-size:1.6em}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;margin:.5em 0}th,td{padding:3px 8px;border-bottom:1px solid #eee;
text-align:left;vertical-align:middle}th{background:#f3f3f3}td.n{text-align:right;font-variant-numeric:tabular-nums}
code{font-size:.92em}.FAIL,.fail{color:#a40000;font-weight:bold}.pass{color:#4e9a06}.improved{color:#204a87}
.warning{color:#c4a000;font-weight:bold}.inactive{color:#777}.muted{color:#777}
.problems li{color:#a40000}nav a{margin-right:1em}
"""
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"

AUDIT_SHAPE = '{"kind": "audit", "v": 1, "when": ISO-8601, "recall": 0.97, "caught": 33, "failing": 34, "window": "…"}'
QUEUE_SHAPE = '{"kind": "queue", "v": 1, "when": ISO-8601, "pool": "h200-2gpu", "job": "…", "queued_seconds": 84.0}'
POOL_SHAPE = "mizzen-ci report --record-plan plan.json --out STORE/health.jsonl"


def number(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, fmt)


def table(headers: list[str], rows: list[list[str]], numeric: set[int] = frozenset()) -> str:
    head = "".join(f"<th>{e(h)}</th>" for h in headers)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="n">{c}</td>' if i in numeric else f"<td>{c}</td>" for i, c in enumerate(r)
        )
        + "</tr>"
        for r in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _pools(h: Health) -> str:
    if not h.pools:
        return f'<p class="muted">No pool record yet: nightly.yml writes them (<code>{e(POOL_SHAPE)}</code>).</p>'
    rows = []
    for pool, runs in sorted(h.pools.items()):
        last = runs[-1]
        ratios = [r.ratio if r.ratio is not None else math.nan for r in runs]
        utils = [r.utilisation if r.utilisation is not None else math.nan for r in runs]
        rows.append([f"<code>{e(pool)}</code>", e(last.lane), str(len(runs)), str(last.jobs), number(last.makespan_seconds / 60),
                     number(last.lower_bound_seconds / 60), number(last.ratio, ".2f"), sparkline(ratios, title=f"{pool} makespan / bound"),
                     number(100 * last.utilisation if last.utilisation is not None else None, ".0f") + " %",
                     sparkline(utils, title=f"{pool} utilisation")])  # fmt: skip
    return table(["pool", "lane", "runs", "jobs (last)", "makespan min", "bound min", "ratio", "ratio over time",
                  "utilisation", "utilisation over time"], rows, {2, 3, 4, 5, 6, 8})  # fmt: skip


def _drift(h: Health) -> str:
    if not h.drift:
        return '<p class="muted">No passing run recorded yet.</p>'
    rows = [[f"<code>{e(r.file)}</code>", e(r.arch), number(r.est_time, ".0f"), str(r.runs), number(r.median),
             number(r.ratio, ".2f") if r.est_time else "not registered", sparkline(list(r.series), title=f"{r.file} seconds")]
            for r in h.drift]  # fmt: skip
    note = f"<p>{len(h.drift)} of {h.drift_total} (file, arch) pairs, largest drift first (median of the last passing runs / est_time).</p>"
    return note + table(
        ["test file", "arch", "est_time s", "runs", "median s", "drift", "seconds over time"],
        rows,
        {2, 3, 4, 5},
    )


def _flakes(h: Health) -> str:
    if not h.flakes:
        return '<p class="muted">No failing or retried run in the history, and nothing quarantined.</p>'
    rows = [[f"<code>{e(r.file)}</code>", e(r.arch), str(r.runs), str(r.bad), str(r.retried), str(r.flips),
             number(100 * r.rate, ".0f") + " %", strip(r.window, title=" ".join(r.window)), e(r.state)] for r in h.flakes]  # fmt: skip
    return table(["test file", "arch", "runs", "failed", "retried", "flips (window)", "flake rate", "last runs", "quarantine"],
                 rows, {2, 3, 4, 5, 6})  # fmt: skip


def _gate(h: Health) -> str:
    if not h.gate:
        return f'<p class="muted">{e(h.gate_note)}</p>'
    rows = [[f"<code>{e(r.test)}</code>", e(r.arch), f"<code>{e(r.metric)}</code>", e("-" if r.step is None else r.step),
             number(r.value, ".4g"), f'<span class="{e(r.verdict)}">{e(r.verdict)}</span>',
             sparkline([*r.history, r.value if r.value is not None else math.nan], band=r.band, title=f"{r.metric} history"),
             e(r.why)] for r in h.gate]  # fmt: skip
    notes = "".join(f"<li>{e(n)}</li>" for n in h.gate_notes)
    intro = ("<p>The newest trusted value of each gated series, judged as <code>mizzen-ci gate check</code> "
             "judges it (band shaded).</p>")  # fmt: skip
    headers = ["test file", "arch", "metric", "step", "value", "verdict", "history", "why"]
    return intro + (f"<ul>{notes}</ul>" if notes else "") + table(headers, rows, {3, 4})


def _audit(h: Health) -> str:
    if not h.audits:
        return (f'<p class="muted">No audit recorded. The selection audit writes one line per run into the history '
                f"store:</p><pre>{e(AUDIT_SHAPE)}</pre>")  # fmt: skip
    last = h.audits[-1]
    return (f"<p>Recall of the selection: <strong>{number(100 * last.recall, '.1f')} %</strong> ({last.caught} of "
            f"{last.failing} failing test runs selected) on {e(last.when[:10])}"
            f"{' (' + e(last.window) + ')' if last.window else ''}. {sparkline([a.recall for a in h.audits], title='recall')}</p>")  # fmt: skip


def _queues(h: Health) -> str:
    if not h.queues:
        return f'<p class="muted">No queue time recorded. A job may write:</p><pre>{e(QUEUE_SHAPE)}</pre>'
    rows = []
    for pool, waits in sorted(h.queues.items()):
        seconds = [w.queued_seconds for w in waits]
        p90 = sorted(seconds)[max(0, math.ceil(0.9 * len(seconds)) - 1)]
        rows.append([f"<code>{e(pool)}</code>", str(len(seconds)), number(statistics.median(seconds)), number(p90),
                     sparkline(seconds, title=f"{pool} queue seconds")])  # fmt: skip
    return table(["pool", "jobs", "median s", "p90 s", "over time"], rows, {1, 2, 3})


SECTIONS = (("pools", "Runner pools", _pools), ("durations", "Test file durations against est_time", _drift),
            ("flakes", "Flaky tests", _flakes), ("gate", "Metric gate", _gate),
            ("audit", "Selection audit", _audit), ("queue", "Queue time", _queues))  # fmt: skip


def render(h: Health) -> str:
    nav = "".join(f'<a href="#{key}">{e(title)}</a>' for key, title, _ in SECTIONS)
    body = "".join(
        f'<section id="{key}"><h2>{e(title)}</h2>{fn(h)}</section>' for key, title, fn in SECTIONS
    )
    problems = ""
    if h.problems:
        items = "".join(f"<li>{e(p)}</li>" for p in h.problems[:100])
        more = f"<p>… and {len(h.problems) - 100} more.</p>" if len(h.problems) > 100 else ""
        problems = f'<section id="problems"><h2>Dropped input ({len(h.problems)})</h2><ul class="problems">{items}</ul>{more}</section>'
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>mizzen CI health</title><style>{STYLE}</style></head><body>"
        f'<h1>mizzen CI health</h1><p class="muted">Generated {e(h.generated)} from {h.runs} recorded test-file runs '
        f"({', '.join(e(i) for i in h.inputs)}).</p><nav>{nav}</nav>{body}{problems}</body></html>\n"
    )
