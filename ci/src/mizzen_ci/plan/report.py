"""Rendering a plan: a terminal table and Markdown for ``$GITHUB_STEP_SUMMARY``.

Invariants: both renderers read only the :class:`~.model.Plan` record, so a plan loaded from a
file (``Plan.load``) renders the same as a fresh one; every not-scheduled reason is counted in the
summary and listed in full on request (Markdown: inside a collapsed ``<details>``).  Jobs, pools
and arches are grouped by vendor (the CPU pool first, then each GPU vendor in the plan's order,
which is the fleet's), each group under its own heading with its job count.  Every string
of the plan (paths, reasons, warnings, errors, ids) goes through the medium's one escaping
function (:mod:`mizzen_ci.output`: ``plain`` for the terminal, ``markdown``/``markdown_code``
for Markdown, applied by the table renderers to every cell); HTML is written only around
constant text.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace

from ..fleet import CPU_LANE, VENDORS
from ..output import Code, markdown_table, plain, text_table
from ..output import markdown as markdown_text
from .model import Plan

JOB_HEADERS = ("job", "lane", "pool", "tests", "GPUs", "est. min", "timeout min")
POOL_HEADERS = (
    "pool", "jobs", "runners", "tests", "GPU-h", "set-up min", "makespan min", "bound min", "ratio"
)  # fmt: skip
ARCH_HEADERS = ("arch", "pools", "tests", "done after min", "pooled bound min", "ratio")


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f}"


def _group(vendor: str | None, lane: str) -> str:
    """The heading of the group a job, pool or arch record belongs to."""
    if lane == CPU_LANE:
        return "CPU (GitHub-hosted)"
    if vendor is None:
        return "GPUs (vendor not recorded)"
    known = VENDORS.get(vendor)
    return f"{known.title if known else vendor} GPUs"


def groups(plan: Plan) -> list[tuple[str, Plan]]:
    """``(heading, the plan with only that group's jobs, pools and arches)`` per vendor, in the
    order the plan lists them (the CPU pool first, then the fleet's order)."""
    order: list[str] = []
    for record in (*plan.jobs, *plan.pools, *plan.capacity):
        heading = _group(record.vendor, record.lane)
        if heading not in order:
            order.append(heading)
    out = []
    for heading in order:
        part = replace(
            plan,
            jobs=[j for j in plan.jobs if _group(j.vendor, j.lane) == heading],
            pools=[p for p in plan.pools if _group(p.vendor, p.lane) == heading],
            capacity=[a for a in plan.capacity if _group(a.vendor, a.lane) == heading],
        )
        out.append((heading, part))
    return out


def _group_line(heading: str, part: Plan) -> str:
    pools = len(part.pools)
    return f"{heading}: {len(part.jobs)} job(s) on {pools} pool(s)"


def _job_rows(plan: Plan) -> list[tuple]:
    return [
        (
            j.id + (" (over budget)" if j.over_budget else ""),
            j.lane,
            j.pool,
            len(j.tests),
            j.gpus,
            _minutes(j.est_seconds),
            j.timeout_minutes,
        )
        for j in plan.jobs
    ]


def _pool_rows(plan: Plan) -> list[tuple]:
    rows = []
    for p in plan.pools:
        bound = p.lower_bound_seconds
        rows.append(
            (
                p.pool,
                p.jobs,
                p.runners,
                p.tests,
                f"{p.gpu_seconds / 3600:.2f}",
                _minutes(p.setup_seconds),
                _minutes(p.makespan_seconds),
                _minutes(bound),
                f"{p.makespan_seconds / bound:.3f}" if bound else "-",
            )
        )
    return rows


def _arch_rows(plan: Plan) -> list[tuple]:
    return [
        (
            a.arch or "cpu",
            ", ".join(a.pools),
            a.tests,
            _minutes(a.makespan_seconds),
            _minutes(a.bound_seconds),
            f"{a.makespan_seconds / a.bound_seconds:.3f}" if a.bound_seconds else "-",
        )
        for a in plan.capacity
    ]


def _tables(part: Plan, table: Callable[[Sequence[str], list[tuple]], str]) -> list[str]:
    """The job, pool and capacity tables of one group, those it has, drawn by ``table``
    (:func:`~mizzen_ci.output.text_table` or :func:`~mizzen_ci.output.markdown_table`), each
    followed by a blank line."""
    out: list[str] = []
    for headers, rows, present in (
        (JOB_HEADERS, _job_rows, part.jobs),
        (POOL_HEADERS, _pool_rows, part.pools),
        (ARCH_HEADERS, _arch_rows, part.capacity),
    ):
        if present:
            out += [table(headers, rows(part)), ""]
    return out


def headline(plan: Plan) -> str:
    n_tests = sum(len(j.tests) for j in plan.jobs)
    what = plan.event + (f" ({plan.cadence})" if plan.cadence else "")
    rng = f"{(plan.base or '?')[:10]}..{(plan.head or '?')[:10]}"
    if plan.worktree:
        rng += "+worktree"
    sel = plan.selection
    scope = (
        "everything: " + "; ".join(sel.because[:3])
        if sel.everything
        else f"impact of {sel.changed_paths} changed path(s)"
    )
    return (
        f"{what} {rng}: {len(plan.jobs)} job(s), {n_tests} test run(s); "
        f"{len(plan.not_scheduled)} not scheduled; selection: {scope}"
    )


def provenance(plan: Plan) -> str:
    """Which commit the plan is for, where its pools came from, and whether it is trusted."""
    if plan.trusted:
        trust = "trusted"
    elif plan.approval:
        trust = f"untrusted author, approved by {plan.approval}"
    else:
        trust = "untrusted author: hosted CPU jobs only"
    head = (plan.head or "?")[:12] + (" + working tree" if plan.worktree else "")
    line = f"head {head}; pools and runner labels from {plan.fleet}; {trust}"
    if plan.fast_fail_reason:
        line += f"; fast-fail {'on' if plan.fast_fail else 'off'}: {plan.fast_fail_reason}"
    return line


def reason_counts(plan: Plan) -> list[tuple[str, int]]:
    return sorted(Counter(n.code for n in plan.not_scheduled).items())


def ignored_line(paths: tuple[str, ...], *, limit: int = 8) -> str:
    """One line naming what git ignores and the plan therefore left out: each name once (the
    shallowest first), with its count when several folders share it (``__pycache__/ (7)``)."""
    names: dict[str, int] = {}
    for path in paths:
        name = path.rstrip("/").rsplit("/", 1)[-1] + ("/" if path.endswith("/") else "")
        names[name] = names.get(name, 0) + 1
    shown = [f"{n} ({c})" if c > 1 else n for n, c in list(names.items())[:limit]]
    more = f" and {len(names) - limit} more names" if len(names) > limit else ""
    return plain(
        f"not planned, ignored by git (.gitignore): {len(paths)} path(s): "
        f"{', '.join(shown)}{more} (`git status --ignored` lists them)"
    )


def terminal(plan: Plan, *, verbose: bool = False) -> str:
    out = [plain(headline(plan)), plain(provenance(plan)), ""]
    if plan.jobs:
        for heading, part in groups(plan):
            out += [plain(_group_line(heading, part)), ""]
            out += _tables(part, text_table)
        if verbose:
            rows = [
                (j.id, t.file, t.num_gpus or "-", _minutes(t.est_seconds), t.why)
                for j in plan.jobs
                for t in j.tests
            ]
            out += [text_table(("job", "test", "GPUs", "est. min", "why"), rows), ""]
    else:
        out += ["no jobs: nothing to run for this change", ""]
    counts = reason_counts(plan)
    if counts:
        out.append(plain("not scheduled: " + ", ".join(f"{code} {n}" for code, n in counts)))
        if verbose:
            rows = [(n.file, n.arch or "-", n.reason) for n in plan.not_scheduled]
            out += ["", text_table(("test", "arch", "reason"), rows)]
        else:
            out.append("(--verbose lists each test with its reason)")
    for o in plan.overrides:
        out.append(plain(f"override: {o.file} ({o.arch or 'cpu'}) {o.reason}"))
    for w in plan.warnings:
        out.append(f"warning: {plain(w)}")
    for e in plan.errors:
        out.append(f"error: {plain(e)}")
    return "\n".join(out).rstrip() + "\n"


def markdown(plan: Plan) -> str:
    out = [
        "## mizzen CI plan",
        "",
        markdown_text(headline(plan)),
        "",
        markdown_text(provenance(plan)),
        "",
    ]
    if plan.overrides:
        rows = [(Code(o.file), o.arch or "cpu", o.reason) for o in plan.overrides]
        out += [
            "Runs the base revision keeps (the head's registration would not run them):",
            "",
            markdown_table(("test", "arch", "why"), rows),
            "",
        ]
    for w in plan.warnings:
        out.append(f"> [!WARNING]\n> {markdown_text(w)}\n")
    for e in plan.errors:
        out.append(f"> [!CAUTION]\n> {markdown_text(e)}\n")
    if plan.jobs:
        for heading, part in groups(plan):
            out += [f"### {markdown_text(_group_line(heading, part))}", ""]
            out += _tables(part, markdown_table)
        rows = [
            (j.id, Code(t.file), t.num_gpus or "-", _minutes(t.est_seconds), t.why)
            for j in plan.jobs
            for t in j.tests
        ]
        out += [
            "<details><summary>Scheduled tests</summary>",
            "",
            markdown_table(("job", "test", "GPUs", "est. min", "why"), rows),
            "",
            "</details>",
            "",
        ]
    else:
        out += ["No jobs: nothing to run for this change.", ""]
    if plan.not_scheduled:
        counts = ", ".join(f"{code}: {n}" for code, n in reason_counts(plan))
        rows = [(Code(n.file), n.arch or "-", n.reason) for n in plan.not_scheduled]
        out += [
            "<details><summary>Not scheduled</summary>",
            "",
            markdown_text(counts),
            "",
            markdown_table(("test", "arch", "reason"), rows),
            "",
            "</details>",
            "",
        ]
    return "\n".join(out)
