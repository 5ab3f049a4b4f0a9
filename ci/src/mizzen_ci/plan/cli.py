"""``mizzen-ci plan``: plan the CI jobs for a change and print, write or publish the plan.

Default: the working tree's change against its merge-base with main, as a trusted pull request
without labels, printed as a table (``nox -s plan``).  In CI the workflow passes the event, the
range, the labels and the trust facts through environment variables into these options.

Outputs: ``--output plan.json`` (the plan, see :mod:`mizzen_ci.plan.model`), ``--summary FILE``
(Markdown appended, e.g. ``$GITHUB_STEP_SUMMARY``), ``--github-output FILE`` (appends
``matrix=<json>`` and ``jobs=<n>`` for a ``strategy.matrix`` of the lanes), ``--json`` (the plan on
stdout instead of the table).

Invariants: stdlib only (runs with ``python3 -S`` and only ``ci/src`` on the path); exit 0 when a
plan was made (registry errors are listed in it and annotated; ``mizzen-ci validate`` is the
check that fails on them), 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .. import output
from ..fleet import add_root_and_fleet_arguments, root_and_fleet
from . import report
from .change import git_change
from .model import Plan
from .pipeline import (
    CACHE_DIR,
    DEFAULT_BUDGET_MINUTES,
    DEFAULT_MIN_JOB_MINUTES,
    PlanOptions,
    build_plan,
    default_history,
)
from .request import CADENCES, EVENTS, Comment, Inputs, RequestError


def add_arguments(command: str, parser: argparse.ArgumentParser) -> None:
    add_root_and_fleet_arguments(parser)
    g = parser.add_argument_group("the event")
    g.add_argument("--event", choices=EVENTS, default="pull_request")
    g.add_argument("--cadence", choices=CADENCES, help="for schedule / workflow_dispatch")
    g.add_argument("--base", help="base revision (default: merge-base of HEAD with main)")
    g.add_argument("--head", help="head revision (default: the working tree, untracked included)")
    g.add_argument(
        "--label", action="append", default=[], help="a PR label (repeat, or comma-separated)"
    )
    g.add_argument(
        "--comment",
        nargs=2,
        action="append",
        default=[],
        metavar=("ASSOCIATION", "BODY"),
        help="a PR comment and its author's association (OWNER, MEMBER, COLLABORATOR, NONE, …)",
    )
    g.add_argument(
        "--comment-file",
        nargs=2,
        action="append",
        default=[],
        type=str,
        metavar=("ASSOCIATION", "PATH"),
        help="like --comment, the body read from a file (safe for any text in CI)",
    )
    g.add_argument("--author-association", help="the PR author's association")
    g.add_argument("--fork", action="store_true", help="the PR comes from a fork")
    g.add_argument("--action", help="the pull_request activity (opened, synchronize, labeled, …)")
    p = parser.add_argument_group("planning")
    p.add_argument("--budget-minutes", type=float, default=DEFAULT_BUDGET_MINUTES)
    p.add_argument("--min-job-minutes", type=float, default=DEFAULT_MIN_JOB_MINUTES)
    p.add_argument(
        "--history",
        action="append",
        type=Path,
        help="duration history file or directory of *.jsonl (repeat; default ROOT/"
        ".ci-artifacts/history)",
    )
    p.add_argument("--cache-dir", type=Path, help=f"parse cache (default ROOT/{CACHE_DIR})")
    p.add_argument("--no-cache", action="store_true", help="parse every file afresh")
    o = parser.add_argument_group("outputs")
    o.add_argument("--output", type=Path, help="write the plan JSON here")
    o.add_argument("--summary", type=Path, help="append the Markdown summary here")
    o.add_argument("--github-output", type=Path, help="append matrix=… and jobs=… here")
    o.add_argument("--json", action="store_true", help="print the plan JSON, not the table")
    o.add_argument("--verbose", action="store_true", help="list every test and every reason")


def _labels(values: list[str]) -> tuple[str, ...]:
    out: list[str] = []
    for v in values:
        out += [x.strip() for x in v.replace("\n", ",").split(",") if x.strip()]
    return tuple(dict.fromkeys(out))


def matrix(plan: Plan) -> dict:
    """The ``strategy.matrix`` of the lane jobs: one entry per planned job (its ``lane`` is the
    nox session that runs it)."""
    return {
        "include": [
            {
                "id": j.id,
                "lane": j.lane,
                "runs_on": json.dumps(list(j.runs_on)),
                "timeout_minutes": j.timeout_minutes,
                "tests": len(j.tests),
            }
            for j in plan.jobs
        ]
    }


def run(command: str, args: argparse.Namespace) -> int:
    root, fleet = root_and_fleet(args)
    if args.budget_minutes <= 0 or args.min_job_minutes < 0:
        print(
            "mizzen-ci plan: --budget-minutes must be > 0 and --min-job-minutes ≥ 0",
            file=sys.stderr,
        )
        return 2
    comments = [Comment(a, b) for a, b in args.comment]
    for association, path in args.comment_file:
        try:
            comments.append(Comment(association, Path(path).read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError) as e:
            print(output.plain(f"mizzen-ci plan: --comment-file {path}: {e}"), file=sys.stderr)
            return 2
    inputs = Inputs(
        event=args.event,
        cadence=args.cadence,
        labels=_labels(args.label),
        comments=tuple(comments),
        author_association=args.author_association,
        fork=args.fork,
        action=args.action,
    )
    cache_dir = None if args.no_cache else (args.cache_dir or root / CACHE_DIR)
    options = PlanOptions(
        budget_seconds=args.budget_minutes * 60,
        min_job_seconds=args.min_job_minutes * 60,
        history=tuple(args.history) if args.history else default_history(root),
        cache_dir=cache_dir,
    )
    change = git_change(root, args.base, args.head)
    try:
        plan = build_plan(root, fleet, change, inputs, options)
    except RequestError as e:
        print(output.plain(f"mizzen-ci plan: {e}"), file=sys.stderr)
        return 2

    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(plan.dumps())
    if args.summary:
        with args.summary.open("a", encoding="utf-8") as f:
            f.write(report.markdown(plan) + "\n")
    if args.github_output:
        with args.github_output.open("a", encoding="utf-8") as f:
            f.write(f"matrix={json.dumps(matrix(plan), separators=(',', ':'))}\n")
            f.write(f"jobs={len(plan.jobs)}\n")
    for w in plan.warnings:
        output.emit("warning", w, title="mizzen plan")
    for e in plan.errors:
        output.emit("error", e, title="mizzen plan")
    if args.json:
        sys.stdout.write(plan.dumps())
    else:
        sys.stdout.write(report.terminal(plan, verbose=args.verbose))
    return 0
