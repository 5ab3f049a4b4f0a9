"""What ``mizzen-ci validate`` checks of the metric gate: every ``register_ci_gate(...)``
declaration of the registered test files (against ``ci/metrics.toml``) and the working tree's
``ci/quarantine.toml`` (:func:`~.quarantine.check_entries`), as registry violations.

Invariants:
- Only registered test files are read (a file whose registration is broken already fails).
- A malformed ``ci/metrics.toml`` is a :class:`~.vocabulary.VocabularyError` (exit 2), like a
  malformed fleet table.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from pathlib import Path

from ..fleet import Fleet
from ..registry.model import Violation
from .artefacts import CPU_ARCH
from .declarations import read_declarations
from .quarantine import QUARANTINE_RELATIVE_PATH, check_entries, read_tree
from .vocabulary import load_vocabulary


def gate_violations(
    root: Path, fleet: Fleet, registered: Iterable[str], today: dt.date | None = None
) -> list[Violation]:
    declarations = read_declarations(root, load_vocabulary(root), sorted(registered))
    entries, problems = read_tree(root)
    problems += check_entries(
        entries,
        QUARANTINE_RELATIVE_PATH.as_posix(),
        gated=set(declarations.gates),
        arches={CPU_ARCH, *fleet.generation_names},
        today=today or dt.datetime.now(dt.UTC).date(),
    )
    return declarations.violations + [
        Violation(p.where, p.line, "quarantine", p.message, p.fix) for p in problems
    ]
