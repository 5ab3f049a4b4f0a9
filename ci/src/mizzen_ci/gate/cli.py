"""``mizzen-ci gate ACTION``: judge a run's metrics, and keep the trusted history.

- ``gate check``: the verdict table of the gates of the tests that ran (``--plan plan.json
  --lanes cpu|gpu``: the plan's jobs; ``--test FILE [--arch A]``; default: every gated test with
  artefacts) against the store, read-only.  ``--base-rev BASE`` (pull requests, merge groups)
  reads the quarantine list and the gates of every test file the base has from the base: a change
  can neither quarantine nor loosen its own regression.  Exit 1 when an enforced, unquarantined gate fails or
  a declaration is broken.
- ``gate ingest``: store the runs of metric artefacts (``--trusted`` only for pushes to main,
  schedules and local histories; a pull request's values are never trusted).  Idempotent.
- ``gate untrust``: mark runs untrusted (``--commit SHA`` or ``--run-key KEY``, narrowed by
  ``--test``/``--arch``).
- ``gate show``: the stored history of one series, newest first, with its reference and band.

Invariants:
- Exit codes: 0 passed (or stored), 1 the gate failed, 2 bad input (a store that cannot be
  used, a broken quarantine file or vocabulary, bad arguments): one escaped line, no traceback.
- The store is shown only redacted; ``check`` never opens it writable.
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
import sys
from pathlib import Path

from .. import masking, output
from ..fleet import find_repo_root
from ..registry.rules import shown
from .artefacts import (
    ARCH,
    CPU_ARCH,
    MAX_STEP,
    Point,
    default_dir,
    read_points,
    valid_key,
    valid_test_path,
)
from .backends import open_store
from .check import Settings, run_gate, targets_from_plan, targets_from_points
from .declarations import held_to_base, read_declarations
from .judge import DEFAULT_K, DEFAULT_MIN_HISTORY, DEFAULT_WINDOW, robust_band
from .quarantine import read_revision, read_tree
from .redact import redact_url
from .store import EVENTS, MAX_WINDOW, RunInfo, StoreError, store_url
from .vocabulary import load_vocabulary, valid_name

_COMMIT = re.compile(r"[0-9a-f]{7,64}|local")


def add_arguments(command: str, parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="gate_command", required=True, metavar="ACTION")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--root", type=Path, help="repository root (default: found from the cwd)")
        p.add_argument(
            "--store",
            help="postgresql://… or a SQLite file (default: $MIZZEN_METRICS_STORE, else "
            "ROOT/.ci-artifacts/history/metrics.sqlite)",
        )

    check = sub.add_parser("check", help="judge the gated metrics of a run (read-only)")
    common(check)
    check.add_argument(
        "--metrics",
        type=Path,
        action="append",
        help="artefact files or folders (default: $MIZZEN_METRICS_DIR or ROOT/.ci-artifacts/metrics)",
    )
    check.add_argument("--plan", type=Path, help="judge the tests of this plan's jobs")
    check.add_argument(
        "--lanes", choices=("cpu", "gpu", "all"), default="all", help="with --plan: which jobs"
    )
    check.add_argument(
        "--test", action="append", default=[], help="judge this test file (repeatable)"
    )
    check.add_argument("--arch", help=f"with --test: the arch (default: {CPU_ARCH})")
    check.add_argument(
        "--base-rev",
        help="the trusted revision of a pull request or merge group (its base): ci/quarantine.toml "
        "and the gates of the test files it has are read from it",
    )
    check.add_argument(
        "--summary", type=Path, help="append the Markdown table to this file ($GITHUB_STEP_SUMMARY)"
    )
    check.add_argument(
        "--window",
        type=int,
        default=DEFAULT_WINDOW,
        help="trusted values per reference (default %(default)s)",
    )
    check.add_argument(
        "--min-history",
        type=int,
        default=DEFAULT_MIN_HISTORY,
        help="fewer trusted values: inactive (default %(default)s)",
    )
    check.add_argument(
        "--mad-k",
        type=float,
        default=DEFAULT_K,
        help="band ≥ k × 1.4826 × MAD (default %(default)s)",
    )
    check.add_argument(
        "--today",
        type=dt.date.fromisoformat,
        help="the date quarantine expiry is judged at (default: today, UTC)",
    )

    ingest = sub.add_parser("ingest", help="store the runs of metric artefacts (idempotent)")
    common(ingest)
    trust = ingest.add_mutually_exclusive_group(required=True)
    trust.add_argument(
        "--trusted", action="store_true", help="a push to main, a schedule, a local history"
    )
    trust.add_argument("--untrusted", action="store_true")
    ingest.add_argument("--event", required=True, choices=EVENTS)
    ingest.add_argument("--commit", required=True, help="the commit the runs tested")
    ingest.add_argument("--pr", type=int, help="the pull request number, if any")
    ingest.add_argument("--attempt", type=int, default=1, help="the workflow run attempt")
    ingest.add_argument(
        "--plan", type=Path, action="append", default=[], help="plans whose jobs name the pools"
    )
    ingest.add_argument("inputs", nargs="+", type=Path, help="artefact files or folders")

    untrust = sub.add_parser("untrust", help="mark stored runs untrusted")
    common(untrust)
    untrust.add_argument("--commit")
    untrust.add_argument("--run-key")
    untrust.add_argument("--test")
    untrust.add_argument("--arch")

    show = sub.add_parser("show", help="the stored trusted history of one series")
    common(show)
    show.add_argument("--test", required=True)
    show.add_argument("--arch", default=CPU_ARCH)
    show.add_argument("--metric", required=True)
    show.add_argument("--step", type=int, help="default: the newest trusted run's last step")
    show.add_argument("--window", type=int, default=DEFAULT_WINDOW)


class GateInputError(ValueError):
    """Bad arguments or input; the message says what to fix."""


def run(command: str, args: argparse.Namespace) -> int:
    root = args.root.resolve() if args.root else find_repo_root()
    try:
        action = {"check": _check, "ingest": _ingest, "untrust": _untrust, "show": _show}
        return action[args.gate_command](root, args)
    except (StoreError, GateInputError) as e:
        print(output.plain(f"mizzen-ci gate {args.gate_command}: {e}"), file=sys.stderr)
        return 2
    except OSError as e:  # a --summary, --plan or artefact path that cannot be used
        print(output.plain(f"mizzen-ci gate {args.gate_command}: {e.filename or ''}: "
                           f"{e.strerror or e}; give a path that can be read or written"),
              file=sys.stderr)  # fmt: skip
        return 2


def _check(root: Path, args: argparse.Namespace) -> int:
    if not (
        1 <= args.window <= MAX_WINDOW
        and 1 <= args.min_history <= args.window
        and 0 < args.mad_k <= 100
    ):
        raise GateInputError(
            f"--window must be 1-{MAX_WINDOW}, --min-history 1 to --window, --mad-k in (0, 100]"
        )
    vocabulary = load_vocabulary(root)
    declarations = read_declarations(root, vocabulary)
    held_notes: list[str] = []
    if args.base_rev is not None:
        rev = args.base_rev
        if not rev or rev.startswith("-") or not rev.isprintable() or len(rev) > 256:
            raise GateInputError(
                f"--base-rev {shown(rev)}: not a revision; pass a commit, e.g. --base-rev HEAD^1"
            )
        from ..plan.change import GitError

        try:
            declarations, held_notes = held_to_base(root, args.base_rev, vocabulary, declarations)
        except GitError as e:
            raise GateInputError(
                f"the gates of the base {shown(args.base_rev)} cannot be read ({e}); fetch the "
                "base (fetch-depth: 0)"
            ) from None
    points, problems = read_points(args.metrics or [default_dir(root)])
    if args.plan is not None:
        from ..plan import Plan, PlanError

        try:
            plan = Plan.load(args.plan)
        except PlanError as e:
            raise GateInputError(str(e)) from None
        targets = targets_from_plan(plan, args.lanes, declarations)
    elif args.test:
        for t in args.test:
            if not valid_test_path(t):
                raise GateInputError(f"--test {t!r:.100} is not a test file path under tests/")
        targets = [(t, args.arch or CPU_ARCH) for t in args.test]
    else:
        targets = targets_from_points(points, declarations)
    if args.base_rev:
        entries, q_problems, _ = read_revision(root, args.base_rev)
    else:
        entries, q_problems = read_tree(root)
    if q_problems:
        raise GateInputError(
            "the quarantine list cannot be used: " + "; ".join(map(str, q_problems[:5]))
        )
    url = store_url(args.store, root)
    store = open_store(url, readonly=True)
    try:
        result = run_gate(
            declarations,
            points,
            store,
            targets,
            entries,
            today=args.today or dt.datetime.now(dt.UTC).date(),
            settings=Settings(args.window, args.min_history, args.mad_k),
        )
    finally:
        if store is not None:
            store.close()
    if store is None:
        result.notes.insert(
            0, f"no metric store at {redact_url(url)}: no history, every gate is inactive"
        )
    result.notes.extend(held_notes)
    result.errors += [str(v) for v in declarations.violations]
    result.problems[:0] = problems
    if not targets:
        result.notes.append("no gated test ran (nothing to judge)")
    from .report import annotate, markdown, text

    sys.stdout.write(text(result))
    if args.summary:
        masking.write_text(args.summary, markdown(result), append=True)
    annotate(result)
    return 1 if result.failed else 0


def _ingest(root: Path, args: argparse.Namespace) -> int:
    if not _COMMIT.fullmatch(args.commit or ""):
        raise GateInputError(
            f"--commit {args.commit!r:.80} is not a commit sha (7-64 hex digits) or 'local'"
        )
    if args.trusted and args.event in ("pull_request", "merge_group"):
        raise GateInputError(f"a {args.event} run is never trusted: its code is not main's")
    if not 1 <= args.attempt <= 1000 or (args.pr is not None and not 1 <= args.pr <= 10**9):
        raise GateInputError("--attempt must be 1-1000 and --pr a pull-request number")
    pools = _pools(args.plan)
    points, problems = read_points(args.inputs)
    runs: dict[tuple[str, str, str], list[Point]] = {}
    for p in points:
        runs.setdefault((p.run, p.test, p.arch), []).append(p)
    stored = already = 0
    store = open_store(store_url(args.store, root))
    try:
        for (key, test, arch), pts in sorted(runs.items()):
            values: dict[tuple[str, int], float] = {}
            conflicts = set()
            for p in pts:
                coordinate = (p.metric, p.step)
                if coordinate in values and repr(values[coordinate]) != repr(p.value):
                    conflicts.add(coordinate)
                values.setdefault(coordinate, p.value)
            for c in sorted(conflicts):
                problems.append(
                    f"run {key} of {test} on {arch}: {c[0]}@{c[1]} recorded with different values; not stored"
                )
                del values[c]
            jobs = {p.job for p in pts if p.job}
            pool = (
                pools.get(next(iter(jobs)), "-")
                if len(jobs) == 1
                else ("local" if not jobs else "-")
            )
            info = RunInfo(
                test=test, arch=arch, pool=pool, commit=args.commit, pr=args.pr,
                event=args.event, trusted=bool(args.trusted), attempt=args.attempt,
                created=max(p.when for p in pts), source=key,
                environment=max(pts, key=lambda p: p.when).env,  # the run's newest value's
            )  # fmt: skip
            if store.add_run(info, values):
                stored += 1
            else:
                already += 1
    finally:
        store.close()
    for problem in problems:
        print(output.plain(f"gate ingest: dropped {problem}"), file=sys.stderr)
    print(
        output.plain(
            f"gate ingest: {stored} run(s) stored ({'trusted' if args.trusted else 'untrusted'}), "
            f"{already} already stored, {len(problems)} line(s) or value(s) dropped; store {store.shown}"
        )
    )
    return 0


def _pools(plans: list[Path]) -> dict[str, str]:
    if not plans:
        return {}
    from ..plan import Plan, PlanError

    out = {}
    for path in plans:
        try:
            plan = Plan.load(path)
        except PlanError as e:
            raise GateInputError(str(e)) from None
        out.update({j.id: j.pool for j in plan.jobs})
    return out


def _untrust(root: Path, args: argparse.Namespace) -> int:
    if not (args.commit or args.run_key):
        raise GateInputError("give --commit SHA or --run-key KEY (and optionally --test, --arch)")
    if args.commit and not _COMMIT.fullmatch(args.commit):
        raise GateInputError("--commit is not a commit sha")
    if args.run_key and not valid_key(args.run_key):
        raise GateInputError("--run-key is not a run key")
    if args.test and not valid_test_path(args.test):
        raise GateInputError("--test is not a test file path under tests/")
    if args.arch and not ARCH.fullmatch(args.arch):
        raise GateInputError("--arch is not an arch (cpu or a GPU generation)")
    store = open_store(store_url(args.store, root))
    try:
        n = store.mark_untrusted(
            commit=args.commit, source=args.run_key, test=args.test, arch=args.arch
        )
    finally:
        store.close()
    print(output.plain(f"gate untrust: {n} run(s) marked untrusted in {store.shown}"))
    return 0


def _show(root: Path, args: argparse.Namespace) -> int:
    if not valid_test_path(args.test) or not 1 <= args.window <= MAX_WINDOW:
        raise GateInputError("--test must be a test file path and --window 1-1000")
    if not (ARCH.fullmatch(args.arch) and valid_name(args.metric)):
        raise GateInputError("--arch must be an arch and --metric a metric name of ci/metrics.toml")
    if args.step is not None and not 0 <= args.step <= MAX_STEP:
        raise GateInputError(f"--step must be from 0 to {MAX_STEP}")
    url = store_url(args.store, root)
    store = open_store(url, readonly=True)
    if store is None:
        raise GateInputError(f"no metric store at {redact_url(url)}")
    try:
        step = args.step
        if step is None:
            steps = store.last_steps(args.test, args.arch, args.metric)
            if not steps:
                print(
                    output.plain(
                        f"no trusted history of {args.metric} for {args.test} on {args.arch}"
                    )
                )
                return 0
            step = steps[-1]
        values, problems = store.history(args.test, args.arch, args.metric, step, limit=args.window)
    finally:
        store.close()
    rows = [(v.created, v.commit[:12], v.source, f"{v.value:.6g}") for v in values]
    print(output.text_table(("created", "commit", "run", "value"), rows))
    finite = [v.value for v in values if v.value == v.value and abs(v.value) != float("inf")]
    if finite:
        reference, _, mad = robust_band(finite, 0.0, 0.0)
        print(
            output.plain(
                f"{args.metric}@{step} on {args.arch}: {len(finite)} trusted finite value(s), median {reference:.6g}, MAD {mad:.4g}"
            )
        )
    for p in problems:
        print(output.plain(f"warning: {p}"), file=sys.stderr)
    return 0
