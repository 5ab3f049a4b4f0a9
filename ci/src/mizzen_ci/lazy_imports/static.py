"""The static lazy-import check: the module-scope import graph, walked from every module.

For each checked package and each of its modules (``__main__`` entry points excepted, as the
runtime walk excepts them), the shortest module-scope chain (:meth:`ImportGraph.chains_to`, one
reverse pass per package) to a name that the package's budget forbids is a violation.  The chain may cross other workspace
packages: what counts is what importing the module would load.

Invariants:
- Nothing is imported; the check reads syntax trees only (stdlib, runs under ``python -S``).
- Lazy imports (function bodies, ``if TYPE_CHECKING:``, a module-level ``__getattr__``) do not
  count, except that a module-scope ``from P import n`` where ``P`` does not bind ``n`` runs
  ``P.__getattr__`` and so counts its imports; a module-scope import guarded by ``try/except
  ImportError`` counts (it loads the module wherever it exists: the policy decides, not the guard).
- What the syntax tree cannot show (computed ``importlib`` names, attribute access that triggers
  a ``__getattr__``, third-party code) is the runtime check's job.
- Every violation keeps its whole chain, one hop per ``file:line``, the last hop naming the
  forbidden module.  The report groups violations by their last hop (one offending import line)
  and prints the longest chain of each group in full, naming the other modules it also breaks.
- Files that do not parse and unresolvable relative imports are reported as problems (they fail
  the check: an unreadable module cannot be shown clean).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..imports import GraphProblem, Hop, ImportGraph
from ..plan.index.facts_cache import FactsCache
from .policy import Policy, Rule

FIX = (
    "move the import into the function that uses it, or re-export it through a lazy module-level "
    "__getattr__ (see README: modules that need a heavy library)"
)


@dataclass(frozen=True)
class StaticViolation:
    """Importing ``module`` (of ``package``) loads ``forbidden`` through ``chain``."""

    package: str
    module: str
    forbidden: str
    rule: Rule
    chain: tuple[Hop, ...]

    @property
    def last(self) -> Hop:
        return self.chain[-1]

    def lines(self) -> list[str]:
        return [h.describe() for h in self.chain]


@dataclass
class StaticReport:
    graph: ImportGraph
    packages: dict[str, list[str]]  # package -> modules checked
    violations: list[StaticViolation]
    problems: list[GraphProblem]

    @property
    def ok(self) -> bool:
        return not self.violations and not self.problems

    def groups(self) -> list[tuple[StaticViolation, list[str]]]:
        """(violation shown in full, other modules of the same package it covers) per offending
        import line, in file order."""
        by_key: dict[tuple, list[StaticViolation]] = {}
        for v in self.violations:
            by_key.setdefault((v.package, v.last.file, v.last.line, v.forbidden), []).append(v)
        out = []
        for key in sorted(by_key):
            group = sorted(by_key[key], key=lambda v: (-len(v.chain), v.module))
            shown = group[0]
            out.append((shown, [v.module for v in group[1:]]))
        return out


def _modules_by_package(graph: ImportGraph, packages: list[str]) -> dict[str, list[str]]:
    """The modules of each package in the graph (``__main__`` entry points excepted), in one
    pass over the graph."""
    out: dict[str, list[str]] = {p: [] for p in packages}
    for m in graph.modules:
        if m.endswith(".__main__"):
            continue
        parts = m.split(".")
        for i in range(1, len(parts) + 1):
            bucket = out.get(".".join(parts[:i]))
            if bucket is not None:
                bucket.append(m)
    return {p: sorted(v) for p, v in out.items()}


def check_static(
    root: Path,
    source_dirs: list[Path],
    packages: list[str],
    policy: Policy,
    cache: FactsCache | None = None,
    graph: ImportGraph | None = None,
) -> StaticReport:
    # the facts cache (even without a file) parses a large tree in worker processes
    graph = graph or ImportGraph.build(root, source_dirs, cache=cache or FactsCache(None))
    checked: dict[str, list[str]] = {}
    violations: list[StaticViolation] = []
    by_budget: dict[tuple, dict] = {}  # packages with the same budget share one graph pass
    all_modules = _modules_by_package(graph, packages)
    for package in packages:
        budget = policy.budget(package)
        modules = all_modules[package]
        checked[package] = modules
        tops = budget.allowed_tops if budget.stdlib_only else None
        key = (tuple(sorted(budget.forbidden.items())), budget.stdlib_only, tops)
        chains = by_budget.get(key)
        if chains is None:
            chains = by_budget[key] = graph.chains_to(budget.violated_by, "module")
        for module in modules:
            chain = chains.get(module)
            if chain is None:
                continue
            forbidden = chain[-1].target
            rule = budget.violated_by(forbidden)
            violations.append(StaticViolation(package, module, forbidden, rule, tuple(chain)))
    wanted = {graph.files[m] for mods in checked.values() for m in mods}
    problems = [p for p in graph.problems if p.file in wanted]
    return StaticReport(graph, checked, violations, problems)


def render(report: StaticReport) -> list[str]:
    """The human report: one block per offending import line."""
    out: list[str] = []
    for v, others in report.groups():
        out.append(f"{v.module} loads {v.forbidden} at import time: {v.rule.explain(v.package)}.")
        out.extend(f"  {line}" for line in v.lines())
        if others:
            out.append(f"  (the same import line is also reached from: {_some(others)})")
    if report.violations:
        out.append(f"Fix: {FIX}.")
    for p in report.problems:
        out.append(f"{p}. Fix: make the file importable (the check cannot read it otherwise).")
    return out


def _some(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"
