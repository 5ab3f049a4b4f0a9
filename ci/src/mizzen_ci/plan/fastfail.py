"""``mizzen-ci fastfail``: whether a pull request's GPU jobs may start, judged from the state of the
cheap checks and the CPU lane of the same head (the fast-fail policy of
:func:`mizzen_ci.plan.request.fast_fail`).

The GPU workflow (``gpu.yml``) and the CPU workflow (``pr.yml``) are separate runs of one head, so
a hosted job of ``gpu.yml`` polls the GitHub API (``gh api``, read-only token) and asks this
module, each time, what the answers say::

    mizzen-ci fastfail --plan plan.json --runs runs.json --pull pull.json --run-id
        → the id of the newest pr.yml run of the plan's head (empty: none yet)
    mizzen-ci fastfail --plan plan.json --runs runs.json [--jobs jobs.json] --pull pull.json \\
        --started-by event|comment [--summary FILE]
        → one word on stdout: wait | pass | fail | superseded; the reason on stderr

``runs.json`` is ``GET /repos/R/actions/workflows/pr.yml/runs?head_sha=SHA&event=pull_request``,
``jobs.json`` ``GET /repos/R/actions/runs/ID/jobs`` of that run and ``pull.json``
``GET /repos/R/pulls/N`` (its current head and labels).

Verdicts, in this order:

- ``pass``: the plan does not fast-fail (then nothing waits), or the newest pr.yml run of the head
  (``checks``: registry, lazy imports, lint; the plan; every CPU lane job; the CPU metric gate;
  ``ci``) completed with success;
- ``superseded``: the pull request is closed or its head moved (the new head's run takes over),
  or ``bypass-fastfail`` was added while this run waited and this run was started by a
  pull-request event without an approval: the labeled event's own run (queued behind this one)
  plans the same GPU jobs without waiting, so this one steps aside instead of running them twice;
- ``pass`` as well when the label was added while a run started by a comment command or an
  ``ok-to-test`` approval waited (a labeled event's run would not plan what that run plans);
- ``fail``: a job of that run failed, was cancelled or timed out (at once: no need to wait for
  the rest), or the run completed otherwise than with success;
- ``wait``: no run of the head yet, the run is in progress, or it awaits a maintainer's approval.

Invariants:
- Stdlib only (``python3 -S``).  A pure function (:func:`judge`) of the plan and the API answers;
  the polling and its deadline are the workflow's.
- Fast-fail saves GPU minutes; it is not a trust boundary.  Under ``pull_request`` a fork's own
  ``pr.yml`` is what runs, so a fork can make its CPU run pass; what may run on a GPU runner is
  still decided by the trusted plan (trust, approval, the pinned head).
- ``--summary`` is checked before anything is read and appended whole
  (:mod:`mizzen_ci.output_files`) before the verdict is printed; a path that cannot be written
  is exit 2 naming it.
- The API answers are data from disk: each file is a regular file of bounded size, each field is
  type-checked before use (a malformed answer is exit 2 naming the field), and every name taken
  from them (job names come from the pull request's own ``pr.yml``) is escaped when printed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from .. import output
from ..output_files import OutputPathError, Outputs
from ..sources import RefusedFile, read_bytes
from .model import Plan, PlanError
from .request import BYPASS_FASTFAIL

PR_WORKFLOW = ".github/workflows/pr.yml"
VERDICTS = ("wait", "pass", "fail", "superseded")
STARTED_BY = ("event", "comment")
FAILED = frozenset({"failure", "cancelled", "timed_out", "startup_failure"})
MAX_ANSWER_BYTES = 16 * 1024 * 1024
_SHA = re.compile(r"[0-9a-f]{40}")


class AnswerError(ValueError):
    """An API answer is not what GitHub sends; the message names the file and the field."""


@dataclass(frozen=True)
class Run:
    """One workflow run of pr.yml, as the runs API lists it."""

    id: int
    head_sha: str
    event: str
    status: str
    conclusion: str | None
    path: str
    attempt: int


@dataclass(frozen=True)
class JobState:
    name: str
    status: str
    conclusion: str | None


@dataclass(frozen=True)
class Pull:
    state: str
    head_sha: str
    labels: tuple[str, ...]


@dataclass(frozen=True)
class Verdict:
    state: str  # one of VERDICTS
    why: str
    run: int | None = None


def _field(obj: object, key: str, kind: type | tuple[type, ...], where: str, nullable=False):
    if not isinstance(obj, dict):
        raise AnswerError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    value = obj.get(key)
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, kind):
        raise AnswerError(f"{where}.{key}: expected {_kind(kind)}, got {type(value).__name__}")
    if isinstance(value, str) and len(value) > 1000:
        raise AnswerError(f"{where}.{key}: longer than 1000 characters")
    if isinstance(value, int) and not 0 <= value < 2**63:
        raise AnswerError(f"{where}.{key}: out of range")
    return value


def _kind(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(
        {str: "a string", int: "an integer", list: "a list", dict: "an object"}[k] for k in kinds
    )


def parse_runs(data: object, where: str = "runs") -> list[Run]:
    listed = _field(data, "workflow_runs", list, where)
    out = []
    for i, r in enumerate(listed):
        w = f"{where}.workflow_runs[{i}]"
        out.append(
            Run(
                id=_field(r, "id", int, w),
                head_sha=_field(r, "head_sha", str, w),
                event=_field(r, "event", str, w),
                status=_field(r, "status", str, w),
                conclusion=_field(r, "conclusion", str, w, nullable=True),
                path=_field(r, "path", str, w),
                attempt=_field(r, "run_attempt", int, w, nullable=True) or 1,
            )
        )
    return out


def parse_jobs(data: object, where: str = "jobs") -> list[JobState]:
    listed = _field(data, "jobs", list, where)
    return [
        JobState(
            name=_field(j, "name", str, f"{where}.jobs[{i}]"),
            status=_field(j, "status", str, f"{where}.jobs[{i}]"),
            conclusion=_field(j, "conclusion", str, f"{where}.jobs[{i}]", nullable=True),
        )
        for i, j in enumerate(listed)
    ]


def parse_pull(data: object, where: str = "pull") -> Pull:
    head = _field(data, "head", dict, where)
    labels = _field(data, "labels", list, where)
    return Pull(
        state=_field(data, "state", str, where),
        head_sha=_field(head, "sha", str, f"{where}.head"),
        labels=tuple(_field(x, "name", str, f"{where}.labels[{i}]") for i, x in enumerate(labels)),
    )


def latest_run(runs: list[Run], head: str) -> Run | None:
    """The newest pull-request run of pr.yml for ``head`` (the highest id; its latest attempt
    is what the API shows), or None."""
    mine = [
        r
        for r in runs
        if r.head_sha == head
        and r.event == "pull_request"
        and (r.path == PR_WORKFLOW or r.path.startswith(PR_WORKFLOW + "@"))
    ]
    return max(mine, key=lambda r: r.id, default=None)


def judge(
    plan: Plan,
    runs: list[Run],
    jobs: list[JobState] | None,
    pull: Pull,
    started_by: str,
) -> Verdict:
    """The verdict for ``plan``'s GPU jobs (see the module docstring)."""
    if started_by not in STARTED_BY:
        raise ValueError(f"started_by must be one of {STARTED_BY}, got {started_by!r}")
    if not plan.fast_fail:
        return Verdict("pass", f"no fast-fail: {plan.fast_fail_reason or 'not a pull request'}")
    head = plan.head or ""
    if pull.state != "open":
        return Verdict("superseded", f"the pull request is {pull.state}: its GPU jobs are not run")
    if pull.head_sha != head:
        return Verdict(
            "superseded",
            f"the pull request's head moved from {head[:12]} to {pull.head_sha[:12]}: the run "
            "of the new head takes over",
        )
    if BYPASS_FASTFAIL in pull.labels:
        if started_by == "event" and plan.approval is None:
            return Verdict(
                "superseded",
                f"`{BYPASS_FASTFAIL}` was added while this run waited: the run of that labeled "
                "event (queued behind this one) runs the same GPU jobs without waiting",
            )
        return Verdict("pass", f"`{BYPASS_FASTFAIL}` was added while this run waited")
    run = latest_run(runs, head)
    if run is None:
        return Verdict("wait", f"no pull-request run of {PR_WORKFLOW} for {head[:12]} yet")
    where = f"{PR_WORKFLOW} run {run.id} (attempt {run.attempt})"
    failed = sorted(
        {j.name for j in jobs or () if j.status == "completed" and j.conclusion in FAILED}
    )
    if failed:
        shown = ", ".join(failed[:10]) + (
            f" and {len(failed) - 10} more" if len(failed) > 10 else ""
        )
        return Verdict(
            "fail",
            f"{where}: {shown} did not pass, so the GPU jobs are not run (fast-fail; fix them, "
            f"or a maintainer adds `{BYPASS_FASTFAIL}`)",
            run.id,
        )
    if run.status != "completed" or run.conclusion == "action_required":
        done = sum(j.status == "completed" for j in jobs or ())
        state = "awaits a maintainer's approval" if run.conclusion else run.status
        progress = f", {done} of {len(jobs)} job(s) done" if jobs else ""
        return Verdict("wait", f"{where}: {state}{progress}", run.id)
    if run.conclusion == "success":
        return Verdict("pass", f"{where}: the cheap checks and the CPU lane passed", run.id)
    return Verdict(
        "fail",
        f"{where} concluded {run.conclusion or 'without a conclusion'}: the GPU jobs are not run "
        f"(fast-fail; a maintainer's `{BYPASS_FASTFAIL}` skips the wait)",
        run.id,
    )


def _load(path: Path, what: str) -> object:
    try:
        data, _ = read_bytes(path, limit=MAX_ANSWER_BYTES)
        return json.loads(data.decode("utf-8"))
    except RefusedFile as e:
        raise AnswerError(str(e)) from None
    except OSError as e:
        raise AnswerError(f"{path}: cannot read the {what}: {e.strerror}") from None
    except (ValueError, RecursionError) as e:
        raise AnswerError(f"{path}: the {what} is not JSON: {e}") from None


def add_arguments(command: str, parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan", type=Path, required=True, help="the trusted GPU plan")
    parser.add_argument("--runs", type=Path, required=True, help="the pr.yml runs of the head")
    parser.add_argument("--jobs", type=Path, help="the jobs of the newest of those runs")
    parser.add_argument(
        "--pull", type=Path, required=True, help="the pull request, as the API has it"
    )
    parser.add_argument("--started-by", choices=STARTED_BY, default="event")
    parser.add_argument(
        "--run-id", action="store_true", help="print the newest pr.yml run id of the head, only"
    )
    parser.add_argument("--summary", type=Path, help="append the final verdict (Markdown) here")


def run(command: str, args: argparse.Namespace) -> int:
    outputs = Outputs()
    try:
        outputs.check("--summary", args.summary)  # before anything is read, written or printed
        plan = Plan.load(args.plan)
        if plan.head is None or not _SHA.fullmatch(plan.head):
            raise AnswerError(f"{args.plan}: the plan names no commit (head)")
        runs = parse_runs(_load(args.runs, "runs answer"), str(args.runs))
        if args.run_id:
            found = latest_run(runs, plan.head)
            print(found.id if found else "")
            return 0
        jobs = parse_jobs(_load(args.jobs, "jobs answer"), str(args.jobs)) if args.jobs else None
        pull = parse_pull(_load(args.pull, "pull request answer"), str(args.pull))
        verdict = judge(plan, runs, jobs, pull, args.started_by)
        if verdict.state != "wait":
            text = f"## Fast-fail: {verdict.state}\n\n{output.markdown(verdict.why)}\n\n"
            outputs.add("--summary", args.summary, text, append=True)
        outputs.commit()  # whole or not at all, before the verdict is printed
    except (AnswerError, PlanError, OutputPathError) as e:
        print(output.plain(f"mizzen-ci fastfail: {e}"), file=sys.stderr)
        return 2
    print(verdict.state)
    print(output.plain(f"fast-fail: {verdict.state}: {verdict.why}"), file=sys.stderr)
    return 0
