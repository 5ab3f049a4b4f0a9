"""mizzen's pytest plugin (entry point ``pytest11: mizzen_ci``): the registry decides what runs.

Active only when pytest's rootdir holds ``ci/fleet.toml`` (a mizzen checkout); elsewhere (e.g.
pytester runs in temporary directories) it does nothing.

Invariants:
- A lane is ``cpu`` or a GPU generation of the fleet (``--mizzen-lane``, else ``$MIZZEN_LANE``,
  else ``cpu``).  Only files registered for that lane are collected: CPU registrations in the CPU
  lane, CUDA registrations declaring the arch in that arch's lane.
- A disabled registration is never imported; it is reported as one skipped item with its reason.
- A file whose registration is broken is a collection error carrying the registry's messages.
- A file named explicitly on the command line that is not registered for the lane is an error,
  not a silent deselection.
- Paths excluded from the registry (``[tool.mizzen.registry] exclude``) are never collected.
- Like every module of ``mizzen_ci`` it imports only the stdlib at module scope: ``pytest`` is
  imported inside the hooks (which only pytest calls), so the package installs and imports alone.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path

from .fleet import FLEET_RELATIVE_PATH, Fleet, load_fleet
from .registry import Registration, RegistryError, is_excluded, read_registry, registry_excludes

LANE_ENV = "MIZZEN_LANE"


@dataclass
class LaneState:
    root: Path
    fleet: Fleet
    lane: str
    registrations: dict[str, Registration]
    errors: dict[str, list[RegistryError]]
    excludes: tuple[str, ...]
    explicit: set[str] = field(default_factory=set)

    def rel(self, path: Path) -> str | None:
        try:
            return Path(path).resolve().relative_to(self.root).as_posix()
        except ValueError:
            return None

    def in_lane(self, reg: Registration) -> bool:
        if self.lane == "cpu":
            return reg.backend == "cpu"
        return reg.backend == "cuda" and self.lane in reg.hardware


@functools.cache
def _state_key():
    import pytest

    return pytest.StashKey[LaneState]()


def pytest_addoption(parser) -> None:
    group = parser.getgroup("mizzen", "mizzen CI registry")
    group.addoption(
        "--mizzen-lane",
        default=None,
        help=f"lane to collect for: cpu or a GPU generation (default: ${LANE_ENV} or cpu)",
    )


def pytest_configure(config) -> None:
    import pytest

    root = Path(config.rootpath).resolve()
    if not (root / FLEET_RELATIVE_PATH).is_file():
        return
    fleet = load_fleet(root / FLEET_RELATIVE_PATH)
    lane = config.getoption("--mizzen-lane") or os.environ.get(LANE_ENV) or "cpu"
    if lane != "cpu" and lane not in fleet.arch_names:
        raise pytest.UsageError(
            f"mizzen: unknown lane {lane!r}; use cpu or one of {', '.join(fleet.arch_names)} "
            f"(from {FLEET_RELATIVE_PATH})"
        )
    excludes = registry_excludes(root)
    registry = read_registry(root, fleet)
    state = LaneState(root, fleet, lane, registry.by_path(), registry.errors_by_path(), excludes)
    for arg in config.args:
        path = Path(arg.split("::", 1)[0])
        path = path if path.is_absolute() else Path(config.invocation_params.dir) / path
        rel = state.rel(path)
        if rel and path.is_file():
            state.explicit.add(rel)
    config.stash[_state_key()] = state


def _state(config) -> LaneState | None:
    return config.stash.get(_state_key(), None)


def pytest_report_header(config) -> str | None:
    state = _state(config)
    if state is None:
        return None
    n = sum(1 for r in state.registrations.values() if state.in_lane(r))
    return f"mizzen lane: {state.lane} ({n} registered file(s) in this lane)"


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    state = _state(config)
    if state is None:
        return None
    rel = state.rel(collection_path)
    if rel is None:
        return None
    if is_excluded(rel, state.excludes):
        return True
    name = collection_path.name
    if not (name.startswith("test_") and name.endswith(".py")):
        return None
    if rel in state.errors or rel in state.explicit:
        return None  # collected by pytest_pycollect_makemodule as an error or a lane mismatch
    reg = state.registrations.get(rel)
    return None if reg is not None and state.in_lane(reg) else True


@functools.cache
def _node_classes():
    """The collector classes, built on first use so that importing this module needs no pytest."""
    import pytest

    class RegistryErrorFile(pytest.File):
        """A test file whose registration is broken: fails collection with the registry's errors."""

        def collect(self):
            raise self.CollectError("\n".join(str(e) for e in self.mizzen_errors))

    class WrongLaneFile(pytest.File):
        """A file named on the command line that its registration does not put in this lane."""

        def collect(self):
            raise self.CollectError(self.mizzen_message)

    class DisabledItem(pytest.Item):
        def runtest(self) -> None:  # never called: the item carries a skip marker
            raise AssertionError("a disabled registration must not run")

        def reportinfo(self):
            return self.path, 0, f"{self.path.name} (disabled)"

    class DisabledFile(pytest.File):
        """A disabled registration: one skipped item with its reason; the module is never imported."""

        def collect(self):
            item = DisabledItem.from_parent(self, name="disabled")
            item.add_marker(pytest.mark.skip(reason=f"disabled in registry: {self.mizzen_reason}"))
            yield item

    return RegistryErrorFile, WrongLaneFile, DisabledFile


def _lane_mismatch(state: LaneState, rel: str, reg: Registration | None) -> str:
    if reg is None:
        return f"{rel}: not registered"
    if reg.backend == "cpu":
        where = "the cpu lane (nox -s cpu)"
    else:
        where = " or ".join(f"nox -s gpu-{a}" for a in reg.hardware)
    return (
        f"{rel}:{reg.line}: registered for {reg.backend}"
        f"{' (' + ', '.join(reg.hardware) + ')' if reg.hardware else ''}, not for lane "
        f"{state.lane!r}. Fix: run it with {where}, or change its registration"
    )


def pytest_pycollect_makemodule(module_path: Path, parent):
    state = _state(parent.config)
    if state is None:
        return None
    rel = state.rel(module_path)
    if rel is None:
        return None
    registry_error_file, wrong_lane_file, disabled_file = _node_classes()
    if rel in state.errors:
        node = registry_error_file.from_parent(parent, path=module_path)
        node.mizzen_errors = state.errors[rel]
        return node
    reg = state.registrations.get(rel)
    if reg is None or not state.in_lane(reg):
        if rel in state.explicit:
            node = wrong_lane_file.from_parent(parent, path=module_path)
            node.mizzen_message = _lane_mismatch(state, rel, reg)
            return node
        return None
    if not reg.enabled:
        node = disabled_file.from_parent(parent, path=module_path)
        node.mizzen_reason = reg.disabled
        return node
    return None
