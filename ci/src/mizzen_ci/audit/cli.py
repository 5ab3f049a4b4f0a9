"""``mizzen-ci audit``: observe the tests' execution, store it, and audit the selection.

    mizzen-ci audit [PATH…]                 run PATH… (default: tests) under coverage, store the
                                            rows under HEAD, print recall/precision/misses
    mizzen-ci audit --no-observe [--revision REV]   audit the stored rows of REV (default HEAD)
    mizzen-ci audit --mutants N --seed S    then apply N seeded mutants and report misses
    mizzen-ci audit --merge INPUT… --store OUT      merge execution stores (the nightly job)

Invariants:
- Exit 0: recall 1.0 and no mutant missed; 1: a miss (each listed); 2: bad usage or input.
- ``--markdown FILE`` appends the Markdown tables (the nightly step summary) to ``FILE``.
- ``--record STORE`` appends the health page's ``audit`` record (recall, caught, failing) to the
  JSON-lines ``STORE``; the nightly history job carries it into ``health.jsonl``.
- The pytest outcome of the observed run is printed; failing tests do not void what they executed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..history_execution import DEFAULT_STORE, ExecutionStoreError, merge, read, replace_revision
from ..output import plain

MAX_MUTANTS = 10_000


def add_arguments(command: str, parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="*", help="tests to observe (default: tests)")
    parser.add_argument("--root", type=Path, default=Path("."), help="the repository (default: .)")
    parser.add_argument(
        "--store", type=Path, help=f"the execution store (default: {DEFAULT_STORE})"
    )
    parser.add_argument("--revision", help="the revision the rows are stored under (default HEAD)")
    parser.add_argument("--no-observe", dest="observe", action="store_false",
                        help="audit the stored rows of --revision, run nothing")  # fmt: skip
    parser.add_argument("--workers", default="0", help="pytest-xdist workers (default 0: none)")
    parser.add_argument("--markdown", type=Path, help="append the Markdown tables to this file")
    parser.add_argument("--record", type=Path, metavar="STORE",
                        help="append the health page's audit record to this .jsonl store")  # fmt: skip
    parser.add_argument("--verbose", action="store_true", help="every file in the per-file table")
    parser.add_argument("--mutants", type=int, default=0, help="seeded mutants to check")
    parser.add_argument("--seed", type=int, default=0, help="the mutants' seed (default 0)")
    parser.add_argument("--mutate", default="*", metavar="GLOB",
                        help="mutate only the audited source files matching GLOB (default: all)")  # fmt: skip
    parser.add_argument("--merge", nargs="+", type=Path, metavar="INPUT",
                        help="merge these execution stores into --store and exit")  # fmt: skip


def run(command: str, args: argparse.Namespace) -> int:
    from ..cli import UsageError

    root = args.root.resolve()
    store = args.store or root / DEFAULT_STORE
    if not 0 <= args.mutants <= MAX_MUTANTS:
        raise UsageError(f"--mutants must be from 0 to {MAX_MUTANTS}, got {args.mutants}")
    try:
        if args.merge:
            count, problems = merge(store, args.merge)
            _warn(problems)
            print(plain(f"merged {count} execution rows into {store}"))
            return 0
        return _audit(root, store, args)
    except ExecutionStoreError as e:
        raise UsageError(str(e)) from None


def _audit(root: Path, store: Path, args: argparse.Namespace) -> int:
    from ..bisect.scratch import ScratchError, resolve
    from ..cli import UsageError

    try:
        revision = resolve(root, args.revision or "HEAD")
    except ScratchError as e:
        raise UsageError(str(e)) from None
    rows = _observed(root, store, revision, args) if args.observe else _stored(store, revision)
    if not rows:
        raise UsageError(f"no execution rows for {revision[:12]} in {store}; run "
                         "`mizzen-ci audit` (without --no-observe) first")  # fmt: skip
    return _report(root, revision, rows, args)


def _observed(root: Path, store: Path, revision: str, args) -> list:
    from .observe import ObserveError, observe

    try:
        run = observe(root, revision, args.paths or ["tests"], workers=args.workers)
    except ObserveError as e:
        from ..cli import UsageError

        raise UsageError(str(e)) from None
    replace_revision(store, revision, run.rows)
    files = len({r.file for r in run.rows})
    print(plain(f"observed {files} test files in {run.seconds:.0f} s (pytest exit "
                f"{run.returncode}); {len(run.rows)} rows stored under {revision[:12]} in {store}"))  # fmt: skip
    if run.returncode not in (0, 5):
        print(plain(f"warning: pytest exited {run.returncode}: some tests failed; what they "
                    "executed is audited all the same"), file=sys.stderr)  # fmt: skip
    return run.rows


def _stored(store: Path, revision: str) -> list:
    rows, problems = read(store, revision)
    _warn(problems)
    return rows


def _warn(problems: list[str]) -> None:
    for p in problems[:5]:
        print(plain(f"warning: dropped {p}"), file=sys.stderr)
    if len(problems) > 5:
        print(plain(f"warning: and {len(problems) - 5} more bad rows"), file=sys.stderr)


def _report(root: Path, revision: str, rows: list, args) -> int:
    from ..fleet import load_fleet
    from ..plan.index import build_index
    from .explain import Explainer
    from .recall import audit
    from .report import markdown_summary, text

    index = build_index(root, load_fleet(root / "ci" / "fleet.toml"), save=False)
    by_test: dict[str, set[str]] = {}
    for r in rows:
        by_test.setdefault(r.file, set()).add(r.path)
    result = audit(root, rows, index, Explainer(root, index, by_test))
    print(text(result, revision, args.verbose))
    summary = markdown_summary(result, revision)
    failed = bool(result.misses)
    if args.mutants:
        mutant_lines, missed = _mutants(root, rows, index, result, args)
        summary += mutant_lines
        failed = failed or missed
    if args.markdown:
        with args.markdown.open("a", encoding="utf-8") as f:
            f.write(summary)
    if args.record:
        _record(args.record, result, revision)
    return 1 if failed else 0


def _record(store: Path, result, revision: str) -> None:
    """One ``audit`` record (:mod:`mizzen_ci.report.records`) appended to ``store``, read back
    through the page's own parser first: a record the page would drop is never written."""
    import json

    from ..history import append_jsonl, now_utc
    from ..report.records import AuditRun, parse_audit

    record = AuditRun(now_utc(), round(result.recall, 6), result.hit_pairs,
                      result.executed_pairs, f"revision {revision[:12]}")  # fmt: skip
    line = record.to_json()
    parse_audit(json.loads(line), "the audit record")
    append_jsonl(store, [line])
    print(plain(f"audit record (recall {record.recall:.4f}) appended to {store}"))


def _mutants(root: Path, rows: list, index, result, args) -> tuple[str, bool]:
    from fnmatch import fnmatchcase

    from ..output import markdown
    from ..plan.impact import Analyser
    from .mutants import sample, tree_candidates
    from .mutation_check import check
    from .recall import selected_by_change

    sources = [f.source for f in result.files
               if not f.source.startswith("tests/") and fnmatchcase(f.source, args.mutate)]  # fmt: skip
    mutants = sample(tree_candidates(root, sources), args.mutants, args.seed)
    analyser = Analyser.of_index(index)
    outcomes = check(root, mutants, rows,
                     lambda path: selected_by_change(analyser, path, result.tests),
                     progress=lambda line: print(plain(line), flush=True))  # fmt: skip
    counts = {k: sum(o.outcome == k for o in outcomes)
              for k in ("detected", "miss", "survived", "no tests")}  # fmt: skip
    head = (f"mutants: {len(outcomes)} (seed {args.seed}): "
            + ", ".join(f"{v} {k}" for k, v in counts.items()))  # fmt: skip
    print(plain(head))
    lines = ["", "### Mutants", "", markdown(head), ""]
    for o in outcomes:
        if o.outcome == "miss":
            why = f"miss: {o.mutant} detected only by unplanned {', '.join(o.failed)}"
            print(plain(why))
            print("\n".join(plain(line) for line in o.diff.splitlines()))
            lines += [f"- {markdown(why)}", "", "```diff", o.diff.replace("```", "'''"), "```"]
    return "\n".join(lines) + "\n", counts["miss"] > 0
