"""``mizzen-ci lazy-imports``: the lazy-import invariant, checked statically and at run time.

    mizzen-ci lazy-imports [--static|--runtime] [--root DIR] [--package NAME ...]
                           [--forbid MODULE ...] [--policy PYPROJECT] [--python PY]

The invariant: importing any module of any checked package on a CPU image succeeds and loads no
module its budget forbids (policy: ``[tool.mizzen.lazy-imports]`` of the root ``pyproject.toml``,
see :mod:`.policy`).  Both checks run unless one is chosen.

Invariants:
- Works on any source tree: a root and package names are enough.  Packages are found in the uv
  workspace members of the root (``<member>/src/<name>``) or else at ``ROOT/<name>``,
  ``ROOT/src/<name>`` or ``<dir>/src/<name>`` below the root.  Without ``--package``: every
  top-level package of the workspace members plus every package the policy names.
- The static check (:mod:`.static`) is stdlib-only and imports nothing; the
  runtime check (:mod:`.runtime`) needs an interpreter where the packages'
  dependencies are installed (``--python``, default: this one).
- Output: each violation with its whole chain, one ``file:line`` per line; under GitHub Actions
  one ``::error`` annotation per offending line.  Exit 0 clean, 1 violations, 2 bad usage/policy.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .. import output
from ..cli import UsageError
from ..imports import iter_source_modules, locate_packages, workspace_source_dirs
from .policy import SECTION, PolicyError, load_policy


def add_arguments(command: str, parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--static", action="store_true", help="only the static check")
    which.add_argument("--runtime", action="store_true", help="only the runtime check")
    parser.add_argument(
        "--root", type=Path, help="source tree root (default: nearest pyproject with the policy)"
    )
    parser.add_argument(
        "--package",
        action="append",
        default=[],
        metavar="NAME",
        help="top-level package to check (repeatable; default: the workspace's and the policy's)",
    )
    parser.add_argument(
        "--forbid",
        action="append",
        default=[],
        metavar="MODULE",
        help="also forbid MODULE (dotted prefix) in every checked package (repeatable)",
    )
    parser.add_argument(
        "--policy",
        type=Path,
        help="pyproject.toml holding the policy (default: ROOT/pyproject.toml)",
    )
    parser.add_argument(
        "--python", default=sys.executable, help="interpreter for the runtime check (default: this)"
    )
    parser.add_argument(
        "--cache", type=Path, help="facts cache file for the static check (default: none)"
    )
    parser.add_argument(
        "--jobs", type=int, help="runtime probes at once (default: all, up to 2 per CPU)"
    )
    parser.add_argument(
        "--timeout", type=float, default=600, help="seconds per runtime probe (default: 600)"
    )


def find_root(start: Path | None = None) -> Path:
    """The nearest directory at or above ``start`` whose pyproject holds the policy section,
    else the nearest holding ``.git``, else ``start``."""
    here = (start or Path.cwd()).resolve()
    marker = "[" + SECTION + "]"
    for d in (here, *here.parents):
        p = d / "pyproject.toml"
        if p.is_file() and marker in p.read_text(errors="replace"):
            return d
    for d in (here, *here.parents):
        if (d / ".git").exists():
            return d
    return here


def resolve_packages(root: Path, names: list[str], policy_packages) -> tuple[list[str], list[Path]]:
    """(package names, source dirs) for the check; raises UsageError naming what is missing."""
    ws_dirs = workspace_source_dirs(root)
    ws_packages = {
        name: d
        for d in ws_dirs
        for name, f in iter_source_modules(d)
        if "." not in name
        if f.name == "__init__.py"
    }
    wanted = list(dict.fromkeys(names or [*sorted(ws_packages), *policy_packages]))
    if not wanted:
        raise UsageError(
            f"no packages to check under {root}: it is no uv workspace and the policy names none. "
            "Fix: pass --package NAME"
        )
    source_dirs = list(ws_dirs)
    located = locate_packages(root, wanted)
    for name in wanted:
        found = sorted({*located[name], *(d / name for d in ws_dirs if name in ws_packages)})
        found = [p for p in found if (p / "__init__.py").is_file()]
        if not found:
            raise UsageError(
                f"package {name} not found under {root} (looked for {name}/, src/{name}/ and "
                f"*/src/{name}/ with an __init__.py). Fix: pass --root of the tree that holds it"
            )
        if len(found) > 1:
            shown = ", ".join(str(p) for p in found)
            raise UsageError(
                f"package {name} is ambiguous under {root}: {shown}. Fix: narrow --root"
            )
        if found[0].parent not in source_dirs:
            source_dirs.append(found[0].parent)
    return wanted, source_dirs


def run(command: str, args: argparse.Namespace) -> int:
    try:
        root = args.root.resolve() if args.root else find_root()
        policy = load_policy(args.policy.resolve() if args.policy else root / "pyproject.toml")
        policy = policy.with_forbid(tuple(args.forbid))
        if policy.empty:
            raise UsageError(
                f"nothing is forbidden: {policy.source} has no [{SECTION}] and no --forbid was "
                "given. Fix: add the section, pass --policy FILE or --forbid MODULE"
            )
        packages, source_dirs = resolve_packages(root, args.package, list(policy.packages))
    except (UsageError, PolicyError) as e:
        print(f"mizzen-ci lazy-imports: {e}", file=sys.stderr)
        return 2
    status = 0
    if not args.runtime:
        status |= _static(root, source_dirs, packages, policy, args)
    if not args.static:
        status |= _runtime(root, source_dirs, packages, policy, args)
    return status


def _static(root, source_dirs, packages, policy, args) -> int:
    from ..plan.index.facts_cache import FactsCache
    from .static import FIX, check_static, render

    t0 = time.perf_counter()
    cache = FactsCache(args.cache) if args.cache else None
    report = check_static(root, source_dirs, packages, policy, cache=cache)
    if cache is not None:
        cache.save()
    seconds = time.perf_counter() - t0
    n_modules = sum(len(m) for m in report.packages.values())
    for line in render(report):
        print(line, file=sys.stderr)
    for v, others in report.groups():
        also = f"\nAlso reached from: {', '.join(others)}" if others else ""
        output.emit(
            "error",
            f"{v.module} loads {v.forbidden} at import time: {v.rule.explain(v.package)}.\n"
            + "\n".join(v.lines())
            + also
            + f"\nFix: {FIX}.",
            file=v.last.file,
            line=v.last.line,
            title="mizzen lazy-imports (static)",
        )
    for p in report.problems:
        output.emit(
            "error", p.message, file=p.file, line=p.line, title="mizzen lazy-imports (static)"
        )
    where = f"{n_modules} module(s) of {len(packages)} package(s) ({', '.join(packages)})"
    if report.ok:
        print(f"lazy-imports static: {where} clean in {seconds:.2f} s")
        return 0
    print(
        f"lazy-imports static: {len(report.groups())} offending import line(s) "
        f"({len(report.violations)} module(s) affected), {len(report.problems)} problem(s) "
        f"in {where}",
        file=sys.stderr,
    )
    return 1


def _runtime(root, source_dirs, packages, policy, args) -> int:
    from .runtime import check_runtime, render

    report = check_runtime(
        root, source_dirs, packages, policy, python=args.python, timeout=args.timeout,
        jobs=args.jobs,
    )  # fmt: skip
    for line in render(report):
        print(line, file=sys.stderr)
    for f in report.findings:
        output.emit(
            "error",
            "\n".join(f.lines()),
            file=f.file,
            line=f.line,
            title="mizzen lazy-imports (runtime)",
        )
    for r in report.results:
        notes = []
        if r.third_party_refusals:
            notes.append(f"{r.third_party_refusals} guarded third-party request(s) refused")
        notes += [f"tolerated: {t}" for t in r.tolerated]
        extra = f"; {'; '.join(notes)}" if notes else ""
        state = "clean" if not r.findings else f"{len(r.findings)} finding(s)"
        print(
            f"lazy-imports runtime: {r.package}: {len(r.imported)} module(s) imported, {state} "
            f"in {r.seconds:.1f} s{extra}"
        )
    if report.ok:
        print(f"lazy-imports runtime: {len(packages)} package(s) clean in {report.seconds:.1f} s")
        return 0
    print(
        f"lazy-imports runtime: {len(report.findings)} finding(s) in {report.seconds:.1f} s",
        file=sys.stderr,
    )
    return 1
