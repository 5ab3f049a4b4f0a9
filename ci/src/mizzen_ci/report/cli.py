"""``mizzen-ci report``: the CI health page, and the pool records it reads.

- ``mizzen-ci report --html DIR [--history PATH…] [--store URL] [--root ROOT]``: writes
  ``DIR/index.html`` from the history store (default: the tree's ``.ci-artifacts/history`` and
  ``.ci-artifacts/flakes.jsonl``; the metric store: ``--store``, else ``$MIZZEN_METRICS_STORE``,
  else ``metrics.sqlite`` in the first history folder).
- ``mizzen-ci report --record-plan PLAN --out STORE [--when ISO] [--run KEY]``: appends the
  plan's ``pool`` records (:mod:`.records`) to the JSON-lines store ``STORE``.

Invariants: the page is written through a temporary file and a rename, with
:func:`mizzen_ci.masking.write_text` (the sink of every file the CI writes for people; each text
on it was masked before it was escaped, :mod:`.escape`); exit 0 when it was
written (dropped input lines are listed on it and on stderr), 2 for bad arguments or an
unreadable plan (one line, no traceback).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
from pathlib import Path

from .. import masking
from ..output import plain

DEFAULT_INPUTS = (Path(".ci-artifacts") / "history", Path(".ci-artifacts") / "flakes.jsonl")


def add_arguments(command: str, parser: argparse.ArgumentParser) -> None:
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--html", type=Path, metavar="DIR", help="write the health page to DIR/index.html"
    )
    mode.add_argument(
        "--record-plan", type=Path, metavar="PLAN", help="append PLAN's pool records to --out"
    )
    parser.add_argument(
        "--history",
        type=Path,
        action="append",
        help="history stores, files or folders (repeatable)",
    )
    parser.add_argument("--store", help="the metric store (URL or SQLite path)")
    parser.add_argument("--root", type=Path, help="the checkout (default: found from here)")
    parser.add_argument(
        "--out", type=Path, help="with --record-plan: the JSON-lines store to append to"
    )
    parser.add_argument("--when", help="with --record-plan: the run's time (ISO-8601; default now)")
    parser.add_argument("--run", default="local", help="with --record-plan: the run's key")


def _record_plan(args: argparse.Namespace) -> int:
    from ..history import HistoryError, append_jsonl, checked_when, now_utc
    from ..plan.model import Plan, PlanError
    from .records import pool_runs_of_plan

    if args.out is None:
        print(
            "report --record-plan: give --out STORE (a .jsonl file of the history store)",
            file=sys.stderr,
        )
        return 2
    try:
        when = checked_when(args.when, "--when") if args.when else now_utc()
        plan = Plan.load(args.record_plan)
    except (HistoryError, PlanError, OSError) as e:
        print(plain(f"report --record-plan: {e}"), file=sys.stderr)
        return 2
    n = append_jsonl(
        args.out, (p.to_json() for p in pool_runs_of_plan(plan, when=when, run=args.run[:200]))
    )
    print(plain(f"report: {n} pool record(s) of {args.record_plan} appended to {args.out}"))
    return 0


def _store_url(args: argparse.Namespace, inputs: list[Path]) -> str | None:
    if args.store or os.environ.get("MIZZEN_METRICS_STORE"):
        from ..gate.store import store_url

        return store_url(args.store, Path("."))
    for path in inputs:
        if (path / "metrics.sqlite").is_file():
            return str(path / "metrics.sqlite")
    return None


def run(command: str, args: argparse.Namespace) -> int:
    if args.record_plan is not None:
        return _record_plan(args)
    from ..fleet import find_repo_root
    from .collect import collect
    from .page import render

    root = args.root or find_repo_root()
    inputs = args.history or [root / p for p in DEFAULT_INPUTS]
    health = collect(root, inputs, _store_url(args, inputs), now=dt.datetime.now(dt.UTC))
    for problem in health.problems:
        print(plain(f"report: dropped {problem}"), file=sys.stderr)
    out = args.html / "index.html"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".index.html.{os.getpid()}.tmp")
        try:
            masking.write_text(tmp, render(health))
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as e:
        print(
            plain(
                f"report: cannot write {out}: {e.strerror or e}; give --html a folder you can write"
            ),
            file=sys.stderr,
        )
        return 2
    print(plain(f"report: {out} ({len(health.flakes)} flaky pair(s), {len(health.gate)} gate row(s), "
                f"{len(health.pools)} pool(s), {len(health.problems)} dropped input(s))"))  # fmt: skip
    return 0
