"""Selection may use what it saw (opt-in per repository, off by default): the tests that
executed a changed file at the base revision are selected too.

    [tool.mizzen.plan]            # root pyproject.toml
    observed-selection = true     # default false

Invariants:
- A union, never an intersection: observed tests are *added* to the import graph's impact; the
  graph stays the safety net for code no test executed yet.  A test already selected keeps its
  reason; an added one's reason names the changed path, the base revision and the store.
- The observations are the execution store's rows (:mod:`mizzen_ci.history_execution`) of the
  change's *base* revision, read from ``execution.sqlite`` in each history folder of the plan's
  options; bad rows and unusable stores become warnings (the plan is never worse than the
  graph's).  With no base revision, or none observed, nothing is added.
- The setting is read from the tree's ``pyproject.toml``; a value that is no boolean is a
  :class:`~mizzen_ci.sources.ConfigError` naming the file, the key and the fix.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable
from pathlib import Path

from ..history_execution import ExecutionStoreError, read
from ..sources import ConfigError, read_bytes
from .change import Change
from .impact import Impact

KEY = "observed-selection"
STORE_NAME = "execution.sqlite"
PYPROJECT_LIMIT = 1024 * 1024


def enabled(root: Path) -> bool:
    """``[tool.mizzen.plan] observed-selection`` of ``root/pyproject.toml`` (default false)."""
    pyproject = root / "pyproject.toml"
    try:
        data = tomllib.loads(read_bytes(pyproject, PYPROJECT_LIMIT)[0].decode("utf-8"))
    except FileNotFoundError:
        return False
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(
            f"{pyproject}: cannot read [tool.mizzen.plan] ({e}); fix the file"
        ) from None
    table: object = data
    for key in ("tool", "mizzen", "plan"):
        table = table.get(key, {}) if isinstance(table, dict) else None
    value = table.get(KEY, False) if isinstance(table, dict) else None
    if not isinstance(value, bool):
        raise ConfigError(
            f"{pyproject}: [tool.mizzen.plan] {KEY} must be true or false, got {value!r}; "
            f"write `{KEY} = true` to let the plan add the tests that executed a changed file"
        )
    return value


def add_observed(impact: Impact, change: Change, history: Iterable[Path],
                 tests: Iterable[str]) -> list[str]:  # fmt: skip
    """Add to ``impact`` the registered ``tests`` that executed a changed path at the base
    revision; the warnings (unusable stores, dropped rows)."""
    if impact.everything or not change.base or not change.paths:
        return []
    registered = set(tests)
    warnings: list[str] = []
    for folder in history:
        store = Path(folder) / STORE_NAME
        try:
            rows, problems = read(store, change.base)
        except ExecutionStoreError as e:
            warnings.append(f"observed selection: {e}")
            continue
        if problems:
            warnings.append(f"observed selection: dropped {len(problems)} bad rows ({problems[0]})")
        for r in sorted(rows):
            if r.path in change.paths and r.file in registered and r.file not in impact.tests:
                impact.tests[r.file] = (
                    f"executed {r.path} at the base revision {change.base[:12]} "
                    f"(observed selection, {store.name})"
                )
    return warnings
