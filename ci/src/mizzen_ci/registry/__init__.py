"""The test registry: every ``tests/**/test_*.py`` declares itself with one module-level call.

The registry reads each test file's syntax tree and never imports a test, so it runs on a bare
runner with nothing installed.  Rooms: :mod:`.model` (registrations, violations, the lane
predicate :func:`declares_target`), :mod:`.syntax` (what a file's syntax tree declares), :mod:`.rules`
(the checks against the fleet), :mod:`.discover` (the one walk of the tree), :mod:`.reader` (all
of it over a tree).  Its commands (``mizzen-ci validate`` and ``list``) live above it, in
:mod:`mizzen_ci.registry_cli`: they also read the gate's declarations and the plan's dispatch
rules, which depend on the registry (never the other way round).
"""

from .discover import (
    TESTS_DIR,
    Discovery,
    RegistryConfigError,
    TestTree,
    discover,
    is_excluded,
    registry_excludes,
)
from .model import CPU_LANE, Backend, Registration, Registry, Violation, declares_target
from .reader import read_registry, read_source

__all__ = [
    "CPU_LANE",
    "TESTS_DIR",
    "Backend",
    "Discovery",
    "Registration",
    "Registry",
    "RegistryConfigError",
    "TestTree",
    "Violation",
    "declares_target",
    "discover",
    "is_excluded",
    "read_registry",
    "read_source",
    "registry_excludes",
]
