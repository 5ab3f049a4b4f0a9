"""Why the planner did not select a test that executed a file: one line per miss.

The causes, in the order they are looked for (the first that applies is the answer):

| cause                | evidence                                                              |
|----------------------|-----------------------------------------------------------------------|
| data path            | F is no Python module: T (or what it ran) read it, nothing T's        |
|                      | closure reaches names it by a path literal the planner resolves       |
| missing import edge  | some file T executed imports F's module, but T's closure does not     |
|                      | reach that file (it ran in a subprocess or a plugin no import shows)  |
| dynamic import       | some file T executed names F's module in a string (``import_module``, |
|                      | ``python -m``, a computed path) the planner does not resolve           |
| unseen loader        | no import, string or path that T executed names F: it was loaded by a |
|                      | path or name computed at run time                                     |

Invariants:
- Evidence comes from the planner's own index (who names F's module: ``ReachIndex.importers``)
  and from the text of files T executed (read with :func:`mizzen_ci.sources.read_bytes`, bounded);
  nothing is imported or run.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ..plan.impact import module_of
from ..sources import read_bytes


class Explainer:
    """``explainer(source, test) -> why`` for the misses of one audit."""

    def __init__(self, root: Path, index, executed_by_test: dict[str, set[str]]):
        self.root, self.index, self.executed = root, index, executed_by_test
        self._paths = {path: name for name, path in index.modules.items()}

    def __call__(self, source: str, test: str) -> str:
        module = module_of(source, self.index.source_dirs)
        ran = sorted(self.executed.get(test, ()))
        if module is None:
            return (
                f"data path: {test} read {source} and nothing its import closure reaches names "
                "it by a path literal the planner resolves"
            )
        importers = self._importers_among(module, ran)
        if importers:
            return (
                f"missing import edge: {', '.join(importers[:3])} (executed by {test}) imports "
                f"{module}, but {test}'s import closure does not reach it (started in a "
                "subprocess or loaded as a plugin that no import shows)"
            )
        naming = self._naming(module, ran)
        if naming:
            return (
                f"dynamic import: {', '.join(naming[:3])} names {module!r} in a string "
                "(import_module, python -m, a computed path) that the planner does not resolve"
            )
        return (
            f"unseen loader: nothing {test} executed imports or names {module}; it was loaded "
            "by a name or path computed at run time"
        )

    def _importers_among(self, module: str, ran: Iterable[str]) -> list[str]:
        reach = self.index.reach
        nodes = set(reach.importers(module, self.index.modules))
        files = {self.index.modules.get(n, n) for n in nodes}
        return [p for p in ran if p in files]

    def _naming(self, module: str, ran: Iterable[str]) -> list[str]:
        needles = {module, module.rsplit(".", 1)[-1], module.replace(".", "/")}
        found = []
        for path in ran:
            if not path.endswith(".py"):
                continue
            try:
                text = read_bytes(self.root / path)[0].decode("utf-8", "replace")
            except OSError:  # RefusedFile included: a file it cannot read names nothing
                continue
            if any(f'"{n}' in text or f"'{n}" in text for n in needles):
                found.append(path)
        return found
