"""``mizzen-ci flakes propose``: the flaky loop's proposal from the trusted history.

``mizzen-ci flakes propose [--history PATH…] [--write] [--body FILE] [--today DATE] [--json]``
reads the duration and flake records (default: the tree's ``.ci-artifacts/history`` and
``.ci-artifacts/flakes.jsonl``, which nightly.yml's history job writes from trusted runs only),
``ci/flaky.toml`` of the working tree and ``[tool.mizzen.flakes]``; prints what it proposes;
with ``--write`` replaces ``ci/flaky.toml`` with the proposal (atomically; untouched when nothing
changes); with ``--body`` writes the pull-request body (Markdown).

Invariants:
- Exit 0 whether or not something changed (``--json``'s ``changed`` and the file say which);
  2 for bad input (a broken ``ci/flaky.toml``: one line naming ``file:line``, nothing written).
- Dropped history lines are named on stderr (``path:line``), never silently used or ignored.
- Every file is written through a temporary file and a rename.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

from ..output import plain

DEFAULT_INPUTS = (Path(".ci-artifacts") / "history", Path(".ci-artifacts") / "flakes.jsonl")


def add_arguments(command: str, parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="flakes_command", required=True, metavar="ACTION")
    p = sub.add_parser(
        "propose", help="quarantine flipping tests, re-enable clean ones (ci/flaky.toml)"
    )
    p.add_argument("--history", type=Path, action="append", default=None,
                   help="duration and flake stores, files or folders (default: .ci-artifacts/history and .ci-artifacts/flakes.jsonl)")  # fmt: skip
    p.add_argument(
        "--root", type=Path, default=None, help="the checkout (default: found from here)"
    )
    p.add_argument("--write", action="store_true", help="write the proposal to ci/flaky.toml")
    p.add_argument("--body", type=Path, help="write the pull-request body (Markdown) here")
    p.add_argument(
        "--today",
        type=dt.date.fromisoformat,
        default=None,
        help="the date of the proposal (default: today, UTC)",
    )
    p.add_argument("--json", action="store_true", help="print the proposal as JSON")


def _atomic_write(path: Path, text: str) -> None:
    import os

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def run(command: str, args: argparse.Namespace) -> int:
    from ..fleet import find_repo_root
    from ..history import dropped_warning, read_flake_records, read_stores
    from .evidence import gather
    from .proposal import body, propose
    from .quarantine import FLAKY_RELATIVE_PATH, read_tree
    from .settings import load_settings

    root = args.root or find_repo_root()
    settings = load_settings(root)
    listed, problems = read_tree(root)
    if problems:
        print(plain(f"flakes propose: {problems[0]}"), file=sys.stderr)
        return 2
    inputs = args.history or [root / p for p in DEFAULT_INPUTS]
    records, dropped = read_stores(inputs, missing_ok=True)
    flakes, dropped_flakes = read_flake_records(inputs)
    if dropped or dropped_flakes:
        print(plain(dropped_warning([*dropped, *dropped_flakes])), file=sys.stderr)
    today = args.today or dt.datetime.now(dt.UTC).date()
    proposal = propose(gather(records, flakes, window=settings.window), listed, settings, today)
    if args.write and proposal.changed:
        _atomic_write(root / FLAKY_RELATIVE_PATH, proposal.file_text())
    if args.body:
        _atomic_write(args.body, body(proposal, history_runs=len(records)))
    summary = {
        "changed": proposal.changed,
        "quarantine": [
            {"file": e.file, "arch": e.arch, "reason": e.reason} for e, _ in proposal.add
        ],
        "re_enable": [
            {"file": e.file, "arch": e.arch, "clean_streak": ev.clean_streak}
            for e, ev in proposal.lift
        ],
        "still_quarantined": [{"file": e.file, "arch": e.arch} for e, _ in proposal.keep],
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(plain(f"flakes propose: {len(proposal.add)} to quarantine, {len(proposal.lift)} to re-enable, "
                    f"{len(proposal.keep)} still quarantined (k={settings.flips}, n={settings.window}, m={settings.clean})"))  # fmt: skip
        for e, _ in proposal.add:
            print(plain(f"  quarantine {e.file} on {e.arch}: {e.reason}"))
        for e, ev in proposal.lift:
            print(plain(f"  re-enable  {e.file} on {e.arch}: {ev.clean_streak} clean runs"))
    return 0
