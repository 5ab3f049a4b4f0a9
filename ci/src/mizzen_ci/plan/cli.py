"""``mizzen-ci plan``: plan the CI jobs for a change and print, write or publish the plan; and
``mizzen-ci comment``: read the commands of a pull-request comment.

Default: the working tree's change against its merge-base with main, printed as a table (``nox -s
plan``, which plans as a pull request from this repository).  In CI the workflow passes the
event, the range, the labels and the trust facts (``--fork``/``--same-repo``,
``--author-association``, ``--action``, ``--label-added``, comments) as options.

Outputs: ``--output plan.json`` (the plan, see :mod:`mizzen_ci.plan.model`), ``--summary FILE``
(Markdown appended, e.g. ``$GITHUB_STEP_SUMMARY``), ``--github-output FILE`` (appends
``matrix=<json>``, ``jobs=<n>``, ``sha=<head>``, ``blocked=<n>`` (GPU test runs waiting for an
approval), ``trusted=true|false`` (whether the head is trusted: the GPU jobs of an
untrusted one run in the environment :data:`~mizzen_ci.plan.request.UNTRUSTED_ENVIRONMENT`,
whose required reviewers approve the run), ``fast_fail=true|false`` (whether the GPU jobs wait for the cheap checks and the CPU
lane) and ``compile_cache=shared|private`` (:func:`mizzen_ci.plan.request.compile_cache_scope`) for
a ``strategy.matrix`` of the lanes; ``--matrix hosted|self-hosted`` keeps the jobs of that kind of
runner), ``--json`` (the plan on stdout instead of the table).

Invariants:
- Stdlib only (runs with ``python3 -S`` and only ``ci/src`` on the path).
- Trust and hosting never come from the change: for a pull request the arches, pools and
  ``runs_on`` labels come from ``ci/fleet.toml`` as the *base* revision has it (read with git);
  the change's own table only checks the change's registrations.  A pull request whose base
  has no readable fleet table is refused (exit 2).  An unknown fork status is untrusted.
- Every output path (``--output``, ``--summary``, ``--github-output``; ``comment``'s
  ``--github-output`` and ``--reply``) is checked before anything is written or printed, and the
  outputs are written all or nothing (:mod:`mizzen_ci.output_files`) before the answer is printed:
  a path that cannot be written is exit 2 naming the option, with no output half-written.
- Exit 0 when a plan was made; 1 when it was made but the registry has violations (written,
  annotated and printed first: CI fails on what it cannot trust); 2 for bad input.
- ``comment`` prints, as JSON, the commands the body holds (the grammar of
  :mod:`mizzen_ci.plan.request`), why it holds none when it may carry none (``refused``), and
  whether the association may give them; it exits 0 either way (the JSON says), 2 for bad input.  With
  ``--github-output FILE`` it appends ``run=true|false`` (accepted) and ``rerun_failed=true|false``
  (an accepted ``/rerun-failed``: the workflow fetches the last run's records); with ``--reply
  FILE --run-url URL --head SHA [--last-run URL]`` it writes the Markdown reply that
  acknowledges accepted commands: what was accepted (escaped), the run it started, the head it is
  pinned to and, for ``/rerun-failed``, the run whose failures it reruns.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from .. import history, output
from ..fleet import (
    FLEET_RELATIVE_PATH,
    Fleet,
    FleetError,
    add_root_and_fleet_arguments,
    parse_fleet,
    root_and_fleet,
)
from ..output_files import OutputPathError, Outputs
from ..sources import RefusedFile, read_bytes
from . import report
from .change import Change, GitError, file_at, git_change, ignored_paths
from .index.cache_home import CacheDirError, check_cache_dir, default_cache_dir
from .model import Plan
from .pipeline import (
    DEFAULT_BUDGET_MINUTES,
    DEFAULT_MIN_JOB_MINUTES,
    PlanOptions,
    build_plan,
    check_checkout_is_head,
    default_history,
)
from .request import (
    CADENCES,
    EVENTS,
    TRUSTED_ASSOCIATIONS,
    Comment,
    Inputs,
    RequestError,
    compile_cache_scope,
    read_commands,
)
from .selection import UNTRUSTED

RUNNER_KINDS = ("all", "hosted", "self-hosted")
MAX_COMMENT_BYTES = 65536  # GitHub caps a comment body at 65,536 characters


def add_arguments(command: str, parser: argparse.ArgumentParser) -> None:
    if command == "comment":
        parser.add_argument("--body-file", type=Path, required=True, help="the comment's text")
        parser.add_argument("--association", required=True, help="the commenter's association")
        parser.add_argument("--github-output", type=Path, help="append run=… and rerun_failed=…")
        parser.add_argument("--reply", type=Path, help="write the acknowledging reply here")
        parser.add_argument("--run-url", help="with --reply: the run the commands started")
        parser.add_argument("--head", help="with --reply: the head SHA the run is pinned to")
        parser.add_argument(
            "--last-run",
            default="",
            help="with --reply: the run whose failures /rerun-failed reruns (empty: none found)",
        )
        return
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
    origin = g.add_mutually_exclusive_group()
    origin.add_argument(
        "--fork", dest="fork", action="store_const", const=True, help="the PR comes from a fork"
    )
    origin.add_argument(
        "--same-repo",
        dest="fork",
        action="store_const",
        const=False,
        help="the PR comes from a branch of this repository (without either: unknown, untrusted)",
    )
    g.add_argument("--action", help="the pull_request activity (opened, synchronize, labeled, …)")
    g.add_argument("--label-added", help="on a `labeled` event: the label it added")
    g.add_argument(
        "--failed-from",
        action="append",
        type=Path,
        default=[],
        help="history records (`mizzen-ci history record` of its junit) of this pull request's "
        "last run: the files /rerun-failed reruns (repeat)",
    )
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
    p.add_argument(
        "--cache-dir",
        type=Path,
        help="parse cache (default: outside the tree, under $XDG_CACHE_HOME/mizzen-ci/plan; a "
        "directory inside the tree must be git-ignored and hold no tracked file)",
    )
    p.add_argument("--no-cache", action="store_true", help="parse every file afresh")
    o = parser.add_argument_group("outputs")
    o.add_argument("--output", type=Path, help="write the plan JSON here")
    o.add_argument("--summary", type=Path, help="append the Markdown summary here")
    o.add_argument("--github-output", type=Path, help="append matrix=…, jobs=… and sha=… here")
    o.add_argument(
        "--matrix",
        choices=RUNNER_KINDS,
        default="all",
        help="which jobs the matrix holds: hosted (CPU), self-hosted (GPU) or all",
    )
    o.add_argument("--json", action="store_true", help="print the plan JSON, not the table")
    o.add_argument("--verbose", action="store_true", help="list every test and every reason")


def _labels(values: list[str]) -> tuple[str, ...]:
    out: list[str] = []
    for v in values:
        out += [x.strip() for x in v.replace("\n", ",").split(",") if x.strip()]
    return tuple(dict.fromkeys(out))


def matrix(plan: Plan, runners: str = "all") -> dict:
    """The ``strategy.matrix`` of the lane jobs: one entry per planned job of the ``runners``
    kind (its ``lane`` is the nox session that runs it; ``runs_on`` the JSON of its runs-on)."""
    return {
        "include": [
            {
                "id": j.id,
                "lane": j.lane,
                "runs_on": json.dumps(j.runs_on_value()),
                "timeout_minutes": j.timeout_minutes,
                "tests": len(j.tests),
            }
            for j in plan.jobs
            if runners == "all" or j.self_hosted == (runners == "self-hosted")
        ]
    }


def run(command: str, args: argparse.Namespace) -> int:
    try:
        if command == "comment":
            return _comment(args)
        return _plan(args)
    except (RequestError, PlanInputError, OutputPathError) as e:
        print(output.plain(f"mizzen-ci {command}: {e}"), file=sys.stderr)
        return 2


class PlanInputError(ValueError):
    """An input the plan cannot be made from; the message says which and how to fix it."""


_RUN_URL = re.compile(r"https://[A-Za-z0-9.-]+(?::[0-9]{1,5})?/[\w.-]+/[\w.-]+/actions/runs/[0-9]+")
_SHA = re.compile(r"[0-9a-f]{40}")


def _comment(args: argparse.Namespace) -> int:
    outputs = Outputs()  # every output path checked before anything is read, written or printed
    outputs.check("--github-output", args.github_output)
    outputs.check("--reply", args.reply)
    body = _read_comment(args.body_file)
    commands, refused = read_commands(body)
    association = args.association.upper()
    accepted = bool(commands) and association in TRUSTED_ASSOCIATIONS
    rerun_failed = accepted and any(c == "rerun-failed" for c, _ in commands)
    if args.reply is not None:
        outputs.add("--reply", args.reply, _reply(args, commands if accepted else []))
    outputs.add(
        "--github-output",
        args.github_output,
        f"run={str(accepted).lower()}\nrerun_failed={str(rerun_failed).lower()}\n",
        append=True,
    )
    outputs.commit()  # all or nothing, before the answer is printed
    print(
        json.dumps(
            {
                "commands": [{"command": c, "args": a} for c, a in commands],
                "association": association,
                "accepted": accepted,
                "refused": refused,
            }
        )
    )
    return 0


def _reply(args: argparse.Namespace, commands: list[tuple[str, list[str]]]) -> str:
    """The Markdown reply acknowledging ``commands`` (accepted ones only; nothing to say
    otherwise): every value from the comment is escaped, the URLs and the SHA are checked."""
    if not commands:
        raise PlanInputError("--reply: the comment holds no accepted command to acknowledge")
    for name, value in (("--run-url", args.run_url), ("--last-run", args.last_run or None)):
        if value is not None and not _RUN_URL.fullmatch(value):
            raise PlanInputError(f"{name}: not the URL of a workflow run: {output.plain(value)}")
    if not args.run_url:
        raise PlanInputError("--reply needs --run-url (the run the commands started)")
    if not (args.head and _SHA.fullmatch(args.head)):
        raise PlanInputError("--reply needs --head, the 40-hex-digit SHA the run is pinned to")
    shown = ", ".join(output.markdown_code(" ".join(["/" + c, *a])) for c, a in commands)
    lines = [
        f"Accepted {shown}: started {args.run_url} at `{args.head[:12]}` (the head of this pull "
        "request when the comment was read; a later push needs a new command). The default "
        "branch's planner makes the plan: its summary lists anything it refused.",
    ]
    if any(c == "rerun-failed" for c, _ in commands):
        if args.last_run:
            lines.append(
                f"`/rerun-failed` reruns the GPU test files that failed in {args.last_run} "
                "(the last GPU run reported on this head); CPU lanes are rerun with "
                "*Re-run failed jobs* on the pull request's `pr` run."
            )
        else:
            lines.append(
                "`/rerun-failed`: no GPU run with test records was found for this head, so it "
                "reruns nothing (the plan says so)."
            )
    return "\n\n".join(lines) + "\n"


def _read_comment(path: Path) -> str:
    try:  # a regular file only (a FIFO would block), at most what GitHub can hold
        data, _ = read_bytes(path, limit=4 * MAX_COMMENT_BYTES)
    except RefusedFile as e:
        raise PlanInputError(str(e)) from None
    except OSError as e:
        raise PlanInputError(f"{path}: cannot read the comment: {e.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise PlanInputError(f"{path}: the comment is not UTF-8 text") from None


def _last_failed(stores: list[Path]) -> tuple[tuple[str, ...] | None, list[str]]:
    """The files that failed or errored in the records of ``stores`` (None when none is given),
    and the problems of the lines that were dropped (untrusted files: every line validated)."""
    if not stores:
        return None, []
    records, problems = history.read_stores(stores, missing_ok=True)
    failed = sorted({r.file for r in records if r.outcome in ("failed", "error")})
    return tuple(failed), problems


def base_fleet(root: Path, change: Change) -> Fleet:
    """The fleet table as the change's base revision has it: the trusted source of a pull
    request's arches, pools and runner labels."""
    if not change.usable or not change.base:
        raise PlanInputError(
            f"the base of this pull request cannot be read ({change.reason}), so its pools and "
            "runner labels cannot come from the base revision. Fix: fetch the base "
            "(`git fetch origin main`, a checkout with fetch-depth: 0) or pass --base"
        )
    where = f"{change.base[:12]}:{FLEET_RELATIVE_PATH.as_posix()}"
    try:
        return parse_fleet(file_at(root, change.base, FLEET_RELATIVE_PATH.as_posix()), where)
    except GitError as e:
        raise PlanInputError(
            f"the base revision has no readable {FLEET_RELATIVE_PATH} ({e}): a pull request's "
            "pools come from its base. Fix: land the fleet table on the base branch first"
        ) from None
    except FleetError as e:
        raise PlanInputError(f"the base revision's fleet table is broken: {e}") from None


PLAN_OUTPUTS = (
    ("--output", "output"),
    ("--summary", "summary"),
    ("--github-output", "github_output"),
)


def _plan(args: argparse.Namespace) -> int:
    outputs = Outputs()  # every output path checked before anything is written or printed
    for option, name in PLAN_OUTPUTS:
        outputs.check(option, getattr(args, name))
    root, fleet = root_and_fleet(args)
    if args.budget_minutes <= 0 or args.min_job_minutes < 0:
        raise PlanInputError("--budget-minutes must be > 0 and --min-job-minutes ≥ 0")
    comments = [Comment(a, b) for a, b in args.comment]
    for association, path in args.comment_file:
        comments.append(Comment(association, _read_comment(Path(path))))
    last_failed, dropped = _last_failed(args.failed_from)
    inputs = Inputs(
        event=args.event,
        cadence=args.cadence,
        labels=_labels(args.label),
        comments=tuple(comments),
        author_association=args.author_association,
        fork=args.fork,
        action=args.action,
        label_added=args.label_added,
        last_failed=last_failed,
    )
    cache_dir = None if args.no_cache else (args.cache_dir or default_cache_dir(root))
    if cache_dir is not None and args.cache_dir is not None:
        try:
            check_cache_dir(root, cache_dir)
        except CacheDirError as e:
            raise PlanInputError(str(e)) from None
    options = PlanOptions(
        budget_seconds=args.budget_minutes * 60,
        min_job_seconds=args.min_job_minutes * 60,
        history=tuple(args.history) if args.history else default_history(root),
        cache_dir=cache_dir,
    )
    change = git_change(root, args.base, args.head)
    check_checkout_is_head(root, change)  # the files read below are the head's
    pools = base_fleet(root, change) if args.event == "pull_request" else fleet
    _check_setup_fits(pools, options.budget_seconds)
    plan = build_plan(root, fleet, change, inputs, options, pools=pools)
    if dropped:
        plan.warnings.append(history.dropped_warning(dropped, "last-run record"))

    outputs.add("--output", args.output, plan.dumps())
    outputs.add("--summary", args.summary, report.markdown(plan) + "\n", append=True)
    if args.github_output:
        outputs.add("--github-output", args.github_output, _github_output(plan, args.matrix),
                    append=True)  # fmt: skip
    outputs.commit()  # all or nothing, before anything is printed
    for w in plan.warnings:
        output.emit("warning", w, title="mizzen plan")
    for e in plan.errors:
        output.emit("error", e, title="mizzen plan")
    if args.json:
        sys.stdout.write(plan.dumps())
    else:
        sys.stdout.write(report.terminal(plan, verbose=args.verbose))
        _report_ignored(root, args.head)
    if plan.errors:
        print(
            f"mizzen-ci plan: {len(plan.errors)} registry error(s): CI fails until they are "
            "fixed (`mizzen-ci validate` lists them)",
            file=sys.stderr,
        )
        return 1
    return 0


def _check_setup_fits(fleet: Fleet, budget_seconds: float) -> None:
    """Every pool's job set-up leaves time for tests inside the budget (the packing needs it)."""
    pool = max((*fleet.pools, fleet.cpu_pool), key=lambda p: p.job_setup_s)
    if pool.job_setup_s >= budget_seconds:
        raise PlanInputError(
            f"--budget-minutes {budget_seconds / 60:g} leaves no time for tests: a job of pool "
            f"{pool.name} spends {pool.job_setup_s:g} s on its set-up ({fleet.path}). Fix: give "
            f"a budget above {pool.job_setup_s / 60:g} minutes"
        )


def _github_output(plan: Plan, runners: str) -> str:
    """The ``$GITHUB_OUTPUT`` lines of a plan (see the module docstring)."""
    chosen = matrix(plan, runners)
    return (
        f"matrix={json.dumps(chosen, separators=(',', ':'))}\n"
        f"jobs={len(chosen['include'])}\n"
        f"sha={plan.head or ''}\n"
        f"blocked={sum(n.code == UNTRUSTED for n in plan.not_scheduled)}\n"
        f"trusted={str(plan.trusted).lower()}\n"
        f"fast_fail={str(plan.fast_fail).lower()}\n"
        f"compile_cache={compile_cache_scope(plan.event)}\n"
    )


def _report_ignored(root: Path, head: str | None) -> None:
    """A plan of the working tree names the files git ignores (never part of the change)."""
    if head is not None:
        return
    try:
        paths = ignored_paths(root)
    except GitError:
        return  # the plan has said already when git cannot read the tree
    if paths:
        print(report.ignored_line(paths))
