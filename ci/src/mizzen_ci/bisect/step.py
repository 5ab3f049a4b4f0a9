"""One step of a bisect: judge the commit checked out in the current directory (a scratch clone)
and exit as ``git bisect run`` expects.

    python -m mizzen_ci.bisect.step --log FILE [--runner pytest|nox] [--lane L --job ID --plan P]
                                    -- TEST…

| exit | meaning | when                                                                       |
|------|---------|----------------------------------------------------------------------------|
| 0    | good    | the job's tests pass                                                       |
| 1    | bad     | a test fails or its file cannot be collected (pytest 1, 2; nox non-zero)    |
| 125  | skip    | the commit has registry errors (``mizzen-ci validate`` of that commit fails), |
|      |         | or pytest could not judge it (3 internal error, 4 usage, 5 no tests: the    |
|      |         | test does not exist there), or the run timed out                            |

Invariants:
- The commit's own code is judged: its ``mizzen_ci`` validates its registrations (``python -S``,
  ``PYTHONPATH`` = its ``ci/src``; this ``mizzen_ci`` when it has none), its source folders come first for pytest.
- Every step appends one JSON line ``{"commit", "verdict", "exit", "why"}`` to ``--log`` (one
  ``write``): the driver counts runs from it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from .scratch import git, run_pytest

GOOD, BAD, SKIP = 0, 1, 125
PYTEST_VERDICTS = {0: GOOD, 1: BAD, 2: BAD}  # everything else: skip
STEP_TIMEOUT_S = 3600
VERDICT_NAMES = {GOOD: "good", BAD: "bad", SKIP: "skip"}


def registry_errors(tree: Path) -> bool:
    """Whether the commit's registrations are broken, checked by its own ``mizzen_ci`` (by this
    one when the tree has none: a repository that uses mizzen-ci as a tool)."""
    own = tree / "ci" / "src"
    ci_src = own if (own / "mizzen_ci" / "__main__.py").is_file() else Path(__file__).parents[2]
    done = subprocess.run(
        [sys.executable, "-S", "-m", "mizzen_ci", "validate"], cwd=tree,
        env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ci_src)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600, check=False,
    )  # fmt: skip
    return done.returncode != 0


def judge(tree: Path, args: argparse.Namespace) -> tuple[int, int, str]:
    """(verdict, the command's exit status, why) of the commit in ``tree``."""
    if registry_errors(tree):
        return SKIP, 1, "registry errors (mizzen-ci validate failed)"
    if args.runner == "nox":
        command = ["nox", "-s", args.lane, "--", "--job", args.job, "--plan", args.plan]
        try:
            code = subprocess.run(command, cwd=tree, timeout=STEP_TIMEOUT_S, check=False).returncode
        except subprocess.TimeoutExpired:
            return SKIP, 124, "timed out"
        return (GOOD if code == 0 else BAD), code, f"nox -s {args.lane} exited {code}"
    code = run_pytest(tree, args.tests, timeout=STEP_TIMEOUT_S, quiet=False)
    return PYTEST_VERDICTS.get(code, SKIP), code, f"pytest exited {code}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mizzen_ci.bisect.step")
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--runner", choices=("pytest", "nox"), default="pytest")
    parser.add_argument("--lane", default="cpu")
    parser.add_argument("--job", default="")
    parser.add_argument("--plan", default="")
    parser.add_argument("tests", nargs="*")
    args = parser.parse_args(argv)
    tree = Path.cwd()
    verdict, code, why = judge(tree, args)
    line = {"commit": git(tree, "rev-parse", "HEAD"), "verdict": VERDICT_NAMES[verdict],
            "exit": code, "why": why}  # fmt: skip
    with args.log.open("a", encoding="utf-8") as f:
        f.write(json.dumps(line, sort_keys=True) + "\n")
    return verdict


if __name__ == "__main__":
    sys.exit(main())
