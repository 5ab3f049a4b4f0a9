"""Reading the registry of a tree: discovery, then each file's syntax, then the rules.

Invariants:
- Never raises for bad input: what the walk cannot register (:attr:`.Discovery.violations`,
  first), an unreadable file, a file outside ``tests/`` and every broken rule are
  :class:`~mizzen_ci.registry.model.Violation` s; all of them are reported, in discovery order.
  A malformed ``[tool.mizzen.registry]`` is a :class:`.RegistryConfigError` (the whole tree
  cannot be read without it).
- The registry never imports a test file.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ..fleet import Fleet
from ..sources import read_bytes
from .discover import TESTS_DIR, discover, outside_tests, registry_excludes
from .model import Registration, Registry, Violation
from .rules import validate
from .syntax import registration_syntax, unreadable


def read_source(
    source: bytes | str, rel: str, fleet: Fleet
) -> tuple[Registration | None, list[Violation]]:
    """Read the registration of one test file's source; never raises for bad input."""
    return validate(registration_syntax(source), rel, fleet)


def read_registry(root: Path, fleet: Fleet, paths: Iterable[str] | None = None) -> Registry:
    """Read every test file under ``root`` (or only ``paths``, repository-relative)."""
    root = root.resolve()
    registry = Registry(root)
    if paths is None:
        found = discover(root, registry_excludes(root))
        registry.violations.extend(found.violations)
        paths = found.test_files
    for rel in paths:
        parts = Path(rel).parts
        if not parts or parts[0] != TESTS_DIR:
            registry.violations.append(outside_tests(rel))
            continue
        try:
            source, _ = read_bytes(root / rel)
        except OSError as e:
            registry.violations.extend(validate(unreadable(e), rel, fleet)[1])
            continue
        registration, violations = read_source(source, rel, fleet)
        registry.violations.extend(violations)
        if registration is not None:
            registry.registrations.append(registration)
    return registry
