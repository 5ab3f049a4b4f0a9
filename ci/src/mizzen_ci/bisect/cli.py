"""``mizzen-ci bisect``: the first commit at which a planned job (or one test) fails.

    mizzen-ci bisect --good REV --bad REV --job ID --plan plan.json [--runner pytest|nox]
    mizzen-ci bisect --good REV --bad REV --test FILE::NAME
    mizzen-ci bisect --failed-jobs HISTORY [--allow-missing]   the CPU jobs that failed

The job's test files come from the plan (``--test`` narrows to one test); each step
(:mod:`.step`) runs them at one commit.  The default runner is pytest in the commit's tree (the
CPU lane's command on the job's files); ``--runner nox`` runs ``nox -s LANE -- --job ID --plan
PLAN`` as the lane does (GPU lanes: on a machine of that generation).

Invariants:
- All of it happens in a scratch clone (:func:`.scratch.scratch_clone`), each commit checked
  out there in turn: the user's work tree, index, branch and refs are never written, also when
  interrupted (SIGINT): each step runs in its own process group, which is killed, and the clone
  removed.
- The search (:func:`search`) is a binary search over the first-parent commits of
  ``good..bad`` with git bisect's step protocol (0 good, 1 bad, 125 skip).  It is not ``git
  bisect run``: git answers a skip by jumping to a pseudo-random neighbour, which costs halvings;
  here a skipped commit (registry errors, or a test that cannot be judged) is replaced by the
  unjudged commit nearest the middle, so a skip costs a registry check, not a run.  The report
  states the runs of the tests, the skipped commits, and the first bad commit, or the
  candidates when skipped commits leave it ambiguous.
- Exit 0: found; 1: not found (the bad revision passes, or only skipped commits remain);
  2: bad usage (an unknown revision, good not an ancestor of bad, a job not in the plan, a
  ``--test`` that is not a test path, :func:`mizzen_ci.gate.artefacts.valid_test_path`), with
  one line saying what is wrong.
- The ``--markdown`` file is checked (:func:`mizzen_ci.output_files.check_file`) before
  anything runs: a path that cannot be written (a folder, a missing folder above it, …) is
  exit 2 before the bisect, never a traceback after it.  The result is printed, then appended
  to it whole or not at all, masked (:class:`mizzen_ci.output_files.Outputs`).
- ``--failed-jobs HISTORY``: a HISTORY that does not exist is exit 2 naming it (a typo never
  reads as "no failed jobs"), unless ``--allow-missing`` says that no history is a possible
  answer (the nightly bisect job downloads the ``history-*`` artefacts of a run that failed,
  perhaps before any lane uploaded one: then it has nothing to bisect).  A history store that
  exists but cannot be read (a link, a fifo, not UTF-8, too large, no permission) is exit 2
  naming it, with or without ``--allow-missing`` (which allows a missing HISTORY only): an
  unread store never reads as "no failed jobs".  Bad lines of a readable store are dropped with
  a warning, as every history reader does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .. import masking
from ..gate.artefacts import valid_test_path
from ..output import markdown, plain
from ..output_files import OutputPathError, Outputs
from .scratch import ScratchError, git, resolve, scratch_clone

_TEST_NAME = re.compile(r"[^\x00-\x1f\x7f]{1,512}")  # after FILE::


@dataclass(frozen=True)
class BisectResult:
    first_bad: str | None  # full SHA, None when not found
    candidates: tuple[str, ...]  # when only skipped commits are left
    steps: tuple[dict, ...]  # the step log
    subject: str = ""

    @property
    def runs(self) -> int:
        """Runs of the job's tests (a skipped commit is judged by its registry alone)."""
        return len(self.steps) - self.skipped

    @property
    def skipped(self) -> int:
        return sum(s.get("verdict") == "skip" for s in self.steps)


def add_arguments(command: str, parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--good", help="a revision where the job passes")
    parser.add_argument("--bad", help="a later revision where it fails")
    parser.add_argument("--failed-jobs", type=Path, metavar="HISTORY",
                        help="print the CPU jobs with a failed test in these duration records "
                        "(a file or folder of history stores) and exit")  # fmt: skip
    parser.add_argument("--allow-missing", action="store_true",
                        help="with --failed-jobs: a HISTORY that does not exist means no "
                        "records (no failed jobs), not an error")  # fmt: skip
    parser.add_argument("--job", help="the planned job's id (with --plan)")
    parser.add_argument("--plan", type=Path, help="the plan JSON the job belongs to")
    parser.add_argument("--test", help="one test, FILE::NAME (narrows the job, or alone)")
    parser.add_argument("--runner", choices=("pytest", "nox"), default="pytest")
    parser.add_argument("--root", type=Path, default=Path("."), help="the repository (default .)")
    parser.add_argument("--markdown", type=Path, help="append the result as Markdown to this file")


def run(command: str, args: argparse.Namespace) -> int:
    from ..cli import UsageError

    root = args.root.resolve()
    if args.failed_jobs is not None:
        return _print_failed_jobs(args.failed_jobs, allow_missing=args.allow_missing)
    if args.allow_missing:
        raise UsageError("--allow-missing goes with --failed-jobs HISTORY")
    if not (args.good and args.bad):
        raise UsageError("give --good REV and --bad REV (or --failed-jobs HISTORY)")
    outputs = Outputs()
    try:
        outputs.check("--markdown", args.markdown)  # before the bisect, not after it
        lane, tests = _what_to_run(args)
        good, bad = resolve(root, args.good), resolve(root, args.bad)
        if not _is_ancestor(root, good, bad):
            raise UsageError(f"--good {args.good} is not an ancestor of --bad {args.bad}; "
                             "give an older good revision")  # fmt: skip
        result = bisect(root, good, bad, tests, runner=args.runner, lane=lane, job=args.job,
                        plan=args.plan)  # fmt: skip
    except (ScratchError, OutputPathError) as e:
        raise UsageError(str(e)) from None
    lines = report_lines(result)
    print("\n".join(plain(line) for line in lines))  # the result first: it cost the bisect
    text = "## Bisect\n\n" + "\n".join(markdown(line) + "  " for line in lines) + "\n"
    try:
        outputs.add("--markdown", args.markdown, masking.mask(text), append=True)
        outputs.commit()
    except OutputPathError as e:
        raise UsageError(str(e)) from None
    return 0 if result.first_bad else 1


def _print_failed_jobs(store: Path, *, allow_missing: bool = False) -> int:
    """The ids of the CPU jobs whose recorded outcome is failed or error, one a line, sorted; a
    ``store`` that does not exist is a :class:`UsageError` unless ``allow_missing``, one that
    cannot be read always is (see the module docstring)."""
    from ..cli import UsageError
    from ..history import history_files, read_stores

    if not allow_missing and not os.path.lexists(store):
        raise UsageError(f"--failed-jobs {store}: no such file or folder. Fix: give the history "
                         "store (a file or folder of *.jsonl), or --allow-missing when no "
                         "history means no failed jobs")  # fmt: skip
    records, problems, unread = [], [], []
    for path in history_files(store):  # one at a time: a store's own problem names it alone
        found, dropped = read_stores([path], missing_ok=allow_missing)
        records += found
        problems += dropped
        unread += [p for p in dropped if p.startswith(f"{path}: ")]  # not `path:LINE: `
    if unread:
        raise UsageError(f"--failed-jobs {store}: {len(unread)} history store(s) cannot be read, "
                         f"so the failed jobs are unknown (--allow-missing allows only a missing "
                         f"HISTORY): {unread[0]}")  # fmt: skip
    for p in problems[:5]:
        print(plain(f"warning: dropped {p}"), file=sys.stderr)
    jobs = {
        r.job for r in records if r.lane == "cpu" and r.job and r.outcome in ("failed", "error")
    }
    for job in sorted(jobs):
        print(plain(job))
    return 0


def _what_to_run(args) -> tuple[str, list[str]]:
    """(lane, tests) of the job or the test asked for; :class:`UsageError` when unusable."""
    from ..cli import UsageError
    from ..plan import Plan, PlanError

    if args.test is not None and not _valid_test(args.test):
        raise UsageError(f"--test must be tests/…/test_*.py or FILE::NAME (a repository path "
                         f"under tests/, no '..'), got {args.test!r}")  # fmt: skip
    if args.job is None:
        if args.test is None:
            raise UsageError("give --job ID --plan plan.json, or --test FILE::NAME")
        return "cpu", [args.test]
    if args.plan is None:
        raise UsageError("--job needs --plan plan.json (the plan the job belongs to)")
    try:
        job = Plan.load(args.plan).job(args.job)
    except PlanError as e:
        raise UsageError(str(e)) from None
    if args.test is not None and args.test.split("::")[0] not in job.files:
        raise UsageError(f"--test {args.test} is not one of job {args.job}'s files")
    if job.lane != "cpu" and args.runner != "nox":
        raise UsageError(f"job {args.job} runs on {job.lane}: bisect it with --runner nox on a "
                         "machine of that generation")  # fmt: skip
    return job.lane, [args.test] if args.test else list(job.files)


def _valid_test(test: str) -> bool:
    """``FILE`` or ``FILE::NAME``: a test path by the gate's one rule, a printable name."""
    file, sep, name = test.partition("::")
    return valid_test_path(file) and (not sep or bool(_TEST_NAME.fullmatch(name)))


def _is_ancestor(root: Path, good: str, bad: str) -> bool:
    return subprocess.run(["git", "-C", str(root), "merge-base", "--is-ancestor", good, bad],
                          capture_output=True, check=False).returncode == 0  # fmt: skip


def bisect(root: Path, good: str, bad: str, tests: list[str], *, runner: str = "pytest",
           lane: str = "cpu", job: str | None = None, plan: Path | None = None) -> BisectResult:  # fmt: skip
    """The first bad commit of ``good..bad`` (first parents), judged by the step in a scratch
    clone of ``root`` (see :func:`search`)."""
    with tempfile.TemporaryDirectory(prefix="mizzen-bisect-") as tmp:
        log = Path(tmp) / "steps.jsonl"
        plan_copy = Path(tmp) / "plan.json"
        if plan is not None:
            shutil.copyfile(plan, plan_copy)  # read once: the plan may live in the user's tree
        step = [sys.executable, "-m", "mizzen_ci.bisect.step", "--log", str(log),
                "--runner", runner, "--lane", lane, "--job", job or "",
                "--plan", str(plan_copy) if plan else "", "--", *tests]  # fmt: skip
        with scratch_clone(root, bad) as tree:
            commits = git(tree, "rev-list", "--first-parent", "--reverse", f"{good}..{bad}")
            first, candidates = search(commits.split(), lambda sha: _judge(step, tree, sha))
            subject = git(tree, "log", "-1", "--format=%s", first) if first else ""
            return BisectResult(first, candidates, tuple(_steps(log)), subject)


def search(commits: list[str], judge) -> tuple[str | None, tuple[str, ...]]:
    """Binary search of the first bad of ``commits`` (oldest first; the one before them is
    good, the last is taken as bad and judged only when every other one is good).  ``judge(sha)``
    returns the step's exit: 0 good, 1 bad, 125 skip; a skipped commit costs no halving: the
    nearest unjudged commit to the middle is judged instead.  (first bad or ``None``,
    candidates when skipped commits leave it ambiguous)."""
    lo, hi = -1, len(commits) - 1  # commits[lo] good (or before all), commits[hi] bad (assumed)
    skipped: set[int] = set()
    hi_judged = False
    while True:
        middle = [i for i in _by_distance(lo, hi) if i not in skipped]
        if not middle:
            break
        i = middle[0]
        verdict = judge(commits[i])
        if verdict == 125:
            skipped.add(i)
        elif verdict == 0:
            lo = i
        else:
            hi, hi_judged = i, True
    if not hi_judged:  # the bad end itself was never judged: judge it
        verdict = judge(commits[hi]) if commits else 0
        if verdict == 0:
            return None, ()
        if verdict == 125:
            skipped.add(hi)
    between = [commits[i] for i in range(lo + 1, hi + 1)]
    if len(between) == 1 and hi not in skipped:
        return between[0], ()
    return None, tuple(between)


def _by_distance(lo: int, hi: int) -> list[int]:
    """The commits strictly between ``lo`` and ``hi``, nearest to their middle first."""
    mid = (lo + hi) // 2
    return sorted(range(lo + 1, hi), key=lambda i: (abs(i - mid), i))


def _judge(step: list[str], tree: Path, sha: str) -> int:
    git(tree, "-c", "advice.detachedHead=false", "checkout", "--quiet", "--force", "--detach", sha)
    git(tree, "clean", "-q", "-f", "-d", "-x")  # what the previous step left behind
    return _run_in_own_group(step, tree)


def _run_in_own_group(command: list[str], tree: Path) -> int:
    """Run ``command`` in its own process group, its output shown; on any exception (SIGINT's
    ``KeyboardInterrupt`` too) kill the whole group before the clone is removed."""
    proc = subprocess.Popen(command, cwd=tree, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        for raw in proc.stdout:
            sys.stdout.write(plain(raw.decode(errors="replace").rstrip("\n")) + "\n")
        return proc.wait()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


def _steps(log: Path) -> list[dict]:
    if not log.exists():
        return []
    out = []
    for line in log.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def report_lines(result: BisectResult) -> list[str]:
    runs = (f"{result.runs} runs of the tests; {result.skipped} commit(s) skipped without a run "
            "(registry errors) or not judged")  # fmt: skip
    if result.first_bad:
        return [f"first bad commit: {result.first_bad} {result.subject}", f"found in {runs}"]
    if result.candidates:
        return [f"the first bad commit is one of {', '.join(c[:12] for c in result.candidates)} "
                f"(skipped commits between them)", f"after {runs}"]  # fmt: skip
    return [f"no first bad commit: the bad revision passes ({runs})"]
