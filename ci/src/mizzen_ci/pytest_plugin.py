"""mizzen's pytest plugin (entry point ``pytest11: mizzen_ci``): the registry decides what runs.

Active only when pytest's rootdir holds ``ci/fleet.toml`` (a mizzen checkout); elsewhere (e.g.
pytester runs in temporary directories) it does nothing.

Invariants:
- A lane is ``cpu`` or a GPU generation of the fleet (``--mizzen-lane``, else ``$MIZZEN_LANE``,
  else ``cpu``).  Only files registered for that lane are collected: CPU registrations in the CPU
  lane, GPU registrations (``register_cuda_ci``/``register_gpu_ci``) declaring the arch in that
  arch's lane.
- A disabled registration is never imported; it is reported as one skipped item with its reason.
- A file whose registration is broken is a collection error carrying the registry's messages.
- A file named explicitly on the command line that is not registered for the lane is an error,
  not a silent deselection.
- Paths excluded from the registry (``[tool.mizzen.registry] exclude``) are never collected.
- A file is known by its own path, never by a link's target: a symbolic link named like a test
  file is a collection error carrying the registry's "symlink" violation, not a second copy of
  the file it points at.
- In a lane, files run heaviest first: items are ordered by their file's registered
  ``est_time``, descending (a file's own tests keep their order; ties keep pytest's).  Under
  ``--dist loadfile --no-loadscope-reorder`` xdist hands files out in that order, so the longest
  ones start first and the lane does not end waiting on one started last (``nox -s cpu``).
- Every path, reason and registry message it reports goes through
  :func:`mizzen_ci.output.plain` (a file name or a skip reason cannot print a workflow command or
  a terminal escape); a malformed ``[tool.mizzen.registry]`` is a usage error naming the file.

Truth rules (what is declared is what runs):
- GPU lane: each test checks, before its fixtures run, that the GPUs it sees are of the lane's
  generation (their compute capabilities, or ISA names on AMD, from
  ``--mizzen-compute-capability`` / ``$MIZZEN_COMPUTE_CAPABILITY``, which the GPU runner sets
  from its probe; else probed here with the lane's vendor's tools) and that it sees exactly its
  file's ``num_gpus`` devices (the lane vendor's variable: ``CUDA_VISIBLE_DEVICES``, or
  ``HIP_VISIBLE_DEVICES`` on AMD with no other variable picking devices; and
  ``torch.cuda.device_count()`` when torch is imported, which a ROCm build answers the same way).
  Otherwise the test errors.
- GPU lane: a test or a module that skips *fails* ("skipped on hardware it declared", with the
  skip reason); ``disabled=`` in the registration is the only way not to run.  ``xfail`` is not a
  skip and is left to pytest.
- CPU lane: the first test during which ``torch.cuda.is_initialized()`` becomes true (checked after
  each setup, call and teardown when torch is imported; this plugin never imports it) fails.
- In a GPU lane's child, the session's compile-cache counts go to ``$MIZZEN_COMPILE_STATS`` at
  its end (:func:`mizzen_ci.lane.compile_cache.write_child_stats`: only when torch is imported).
- Like every module of ``mizzen_ci`` it imports only the stdlib at module scope: ``pytest`` is
  imported inside the hooks (which only pytest calls), so the package installs and imports alone.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .fleet import (
    CPU_LANE,
    FLEET_RELATIVE_PATH,
    NVIDIA,
    Fleet,
    Vendor,
    load_fleet,
    nox_session_name,
)
from .output import plain
from .registry import (
    Backend,
    Registration,
    Violation,
    declares_target,
    is_excluded,
    read_registry,
    registry_excludes,
)
from .sources import ConfigError

LANE_ENV = "MIZZEN_LANE"
CAPABILITY_ENV = "MIZZEN_COMPUTE_CAPABILITY"


@dataclass
class LaneState:
    root: Path
    fleet: Fleet
    lane: str
    registrations: dict[str, Registration]
    violations: dict[str, list[Violation]]
    excludes: tuple[str, ...]
    explicit: set[str] = field(default_factory=set)
    #: Files the plan runs as the base declares them (its ``overrides``): a ``disabled=`` the
    #: head added does not stop them (``--mizzen-as-planned``).
    as_planned: set[str] = field(default_factory=set)
    capability_input: str | None = None  # "9.0" or "10.0,10.3"; None: probe the visible GPUs
    cuda_init_reported: bool = False

    def rel(self, path: Path) -> str | None:
        """``path`` relative to the root, its directories resolved but not its last component:
        a symbolic link is judged as itself (the registry reports it), never as its target."""
        p = Path(path)
        try:
            return (p.parent.resolve() / p.name).relative_to(self.root).as_posix()
        except ValueError:
            return None

    def in_lane(self, reg: Registration) -> bool:
        return declares_target(reg, self.lane)

    @property
    def vendor(self) -> Vendor:
        """The vendor of the lane's generation (NVIDIA's words for the CPU lane, which has none)."""
        return NVIDIA if self.lane == CPU_LANE else self.fleet.generation(self.lane).runtime


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
    group.addoption(
        "--mizzen-as-planned",
        action="append",
        default=[],
        metavar="FILE",
        help="a test file the plan runs as the base revision declares it (the plan's overrides): "
        "it runs even where the head's registration disables it",
    )
    group.addoption(
        "--mizzen-compute-capability",
        default=None,
        help="compute capability (NVIDIA) or ISA name (AMD) of the GPUs this process sees, e.g. "
        f"9.0 or gfx942 (GPU lanes; default: ${CAPABILITY_ENV}, else probed with the vendor's "
        "tools)",
    )


def pytest_configure(config) -> None:
    import pytest

    root = Path(config.rootpath).resolve()
    if not (root / FLEET_RELATIVE_PATH).is_file():
        return
    fleet = load_fleet(root / FLEET_RELATIVE_PATH)
    lane = config.getoption("--mizzen-lane") or os.environ.get(LANE_ENV) or CPU_LANE
    if lane != CPU_LANE and lane not in fleet.generation_names:
        raise pytest.UsageError(
            plain(
                f"mizzen: unknown lane {lane!r}; use cpu or one of {', '.join(fleet.generation_names)} "
                f"(from {FLEET_RELATIVE_PATH})"
            )
        )
    try:
        excludes = registry_excludes(root)
        registry = read_registry(root, fleet)
    except ConfigError as e:
        raise pytest.UsageError(plain(f"mizzen: {e}")) from None
    state = LaneState(
        root, fleet, lane, registry.by_path(), registry.violations_by_path(), excludes
    )
    state.capability_input = (
        config.getoption("--mizzen-compute-capability") or os.environ.get(CAPABILITY_ENV) or None
    )
    for arg in config.args:
        path = Path(arg.split("::", 1)[0])
        path = path if path.is_absolute() else Path(config.invocation_params.dir) / path
        rel = state.rel(path)
        if rel and path.is_file():
            state.explicit.add(rel)
    state.as_planned = set(config.getoption("--mizzen-as-planned") or ())
    config.stash[_state_key()] = state
    config.pluginmanager.register(_truth_rules_class()(state), "mizzen-truth-rules")


def _state(config) -> LaneState | None:
    return config.stash.get(_state_key(), None)


def pytest_report_header(config) -> str | None:
    state = _state(config)
    if state is None:
        return None
    n = sum(1 for r in state.registrations.values() if state.in_lane(r))
    header = f"mizzen lane: {state.lane} ({n} registered file(s) in this lane)"
    if state.lane != CPU_LANE and state.capability_input:
        header += f", {state.vendor.target_word} {state.capability_input}"
    return header


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
    if rel in state.violations or rel in state.explicit:
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
            raise self.CollectError("\n".join(plain(e) for e in self.mizzen_errors))

    class WrongLaneFile(pytest.File):
        """A file named on the command line that its registration does not put in this lane."""

        def collect(self):
            raise self.CollectError(plain(self.mizzen_message))

    class DisabledItem(pytest.Item):
        mizzen_disabled = True

        def runtest(self) -> None:  # never called: the item carries a skip marker
            raise AssertionError("a disabled registration must not run")

        def reportinfo(self):
            return self.path, 0, f"{self.path.name} (disabled)"

    class DisabledFile(pytest.File):
        """A disabled registration: one skipped item with its reason; the module is never imported."""

        def collect(self):
            item = DisabledItem.from_parent(self, name="disabled")
            reason = plain(f"disabled in registry: {self.mizzen_reason}")
            item.add_marker(pytest.mark.skip(reason=reason))
            yield item

    return RegistryErrorFile, WrongLaneFile, DisabledFile


def _lane_mismatch(state: LaneState, rel: str, reg: Registration | None) -> str:
    if reg is None:
        return f"{rel}: not registered"
    if reg.backend is Backend.CPU:
        where = "the cpu lane (nox -s cpu)"
    else:
        where = " or ".join(f"nox -s {nox_session_name(a)}" for a in reg.hardware)
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
    if rel in state.violations:
        node = registry_error_file.from_parent(parent, path=module_path)
        node.mizzen_errors = state.violations[rel]
        return node
    reg = state.registrations.get(rel)
    if reg is None or not state.in_lane(reg):
        if rel in state.explicit:
            node = wrong_lane_file.from_parent(parent, path=module_path)
            node.mizzen_message = _lane_mismatch(state, rel, reg)
            return node
        return None
    if not reg.enabled and rel not in state.as_planned:
        node = disabled_file.from_parent(parent, path=module_path)
        node.mizzen_reason = reg.disabled
        return node
    return None


def pytest_collection_modifyitems(session, config, items) -> None:
    state = _state(config)
    if state is not None:
        items[:] = heaviest_files_first(state, items)


def heaviest_files_first(state: LaneState, items: list) -> list:
    """``items`` ordered by their file's registered ``est_time``, descending; stable, so a
    file's items stay together and in order (an unregistered file counts as 0)."""
    cost: dict[Path, float] = {}
    for item in items:
        if item.path not in cost:
            reg = state.registrations.get(state.rel(item.path) or "")
            cost[item.path] = reg.est_time if reg is not None else 0.0
    return sorted(items, key=lambda item: -cost[item.path])


# --------------------------------------------------------------------------------------------
# Truth rules


@functools.cache
def _visible_targets(capability_input: str | None, vendor: str) -> tuple[tuple[str, ...], str]:
    """(compute capabilities or ISA names of the GPUs this process sees, where that came from)."""
    if capability_input:
        return tuple(c.strip() for c in capability_input.split(",") if c.strip()), (
            f"--mizzen-compute-capability / ${CAPABILITY_ENV}"
        )
    from .lane.hardware import ProbeError, probe  # subprocesses only; never torch in-process

    try:
        found = probe(vendor=vendor)
    except ProbeError as e:
        return (), str(e)
    return tuple(g.target for g in found.gpus), found.describe()


def hardware_problem(state: LaneState) -> str | None:
    """Why this process's GPUs are not of the lane's generation, or ``None`` when they are."""
    arch = state.fleet.generation(state.lane)
    word = arch.runtime.target_word
    targets, source = _visible_targets(state.capability_input, arch.vendor)
    wanted = f"lane {state.lane!r} runs on {state.lane} GPUs ({word} {', '.join(arch.targets)})"
    if not targets:
        return f"{wanted}, but this process sees no GPU: {source}"
    wrong = [
        f"{t} ({state.fleet.generation_of_target(t) or 'not in ' + str(FLEET_RELATIVE_PATH)})"
        for t in targets
        if state.fleet.generation_of_target(t) != state.lane
    ]
    if wrong:
        return f"{wanted}, but this process sees {word} {', '.join(wrong)} [{source}]"
    return None


def device_count_problem(reg: Registration, vendor: Vendor = NVIDIA) -> str | None:
    """Why the test does not see exactly ``reg.num_gpus`` devices of ``vendor``, or ``None``."""
    pin = vendor.visible_devices
    visible = os.environ.get(pin)
    if visible is None:
        return (
            f"{reg.path} declares num_gpus={reg.num_gpus} but {pin} is not set, so "
            "it would see every GPU of the host. Fix: run it through the lane "
            f"(nox -s gpu-<arch>), which leases its GPUs and sets {pin}"
        )
    others = [
        f"{v}={os.environ[v]!r}" for v in vendor.pinning_variables if v != pin and v in os.environ
    ]
    if others:
        return (
            f"{reg.path} runs with {pin}={visible!r} and also {', '.join(others)}, which pick or "
            f"renumber the devices {pin} counts. Fix: unset them; the lane pins with {pin} alone"
        )
    n = len([e for e in visible.split(",") if e.strip()])
    if n != reg.num_gpus:
        return (
            f"{reg.path} declares num_gpus={reg.num_gpus} but {pin}={visible!r} "
            f"makes {n} visible. Fix: give it exactly {reg.num_gpus}, or change num_gpus"
        )
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and hasattr(cuda, "device_count"):
        seen = cuda.device_count()
        if seen != reg.num_gpus:
            return (
                f"{reg.path} declares num_gpus={reg.num_gpus} and {pin}={visible!r}, "
                f"but torch.cuda.device_count() == {seen}"
            )
    return None


def _cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    is_initialized = getattr(getattr(torch, "cuda", None), "is_initialized", None)
    if is_initialized is None:
        return False
    try:
        return bool(is_initialized())
    except Exception:  # torch half-imported: it cannot have initialised CUDA yet
        return False


def _skip_reason(longrepr) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


@functools.cache
def _truth_rules_class():
    """The truth-rule hooks, built on first use so that importing this module needs no pytest."""
    import pytest

    class TruthRules:
        def __init__(self, state: LaneState):
            self.state = state

        def _skip_message(self, what: str, reason: str) -> str:
            cc = self.state.capability_input or "probed"
            return (
                f"{what + ' ' if what else ''}skipped on hardware it declared (lane {self.state.lane}, "
                f"{self.state.vendor.target_word} {plain(cc)}): {plain(reason)}\nA skip on a GPU lane is a failure: the test was "
                "dispatched here because its registration declares this generation. Fix: make it "
                'run here, or set `disabled="<reason>"` in its registration (the only way not to '
                "run)"
            )

        @pytest.hookimpl(hookwrapper=True)
        def pytest_make_collect_report(self, collector):
            outcome = yield
            report = outcome.get_result()
            if self.state.lane != CPU_LANE and report.skipped:
                report.outcome = "failed"
                report.longrepr = self._skip_message(
                    f"{collector.nodeid or collector.path}:", _skip_reason(report.longrepr)
                )

        def pytest_runtest_setup(self, item) -> None:
            state = self.state
            if state.lane == CPU_LANE or getattr(item, "mizzen_disabled", False):
                return
            problem = hardware_problem(state)
            reg = state.registrations.get(state.rel(item.path) or "")
            if problem is None and reg is not None:
                problem = device_count_problem(reg, state.vendor)
            if problem is not None:
                pytest.fail(plain(f"mizzen truth rule: {problem}"), pytrace=False)

        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_makereport(self, item, call):
            outcome = yield
            report = outcome.get_result()
            state = self.state
            if state.lane != CPU_LANE:
                if (
                    report.skipped
                    and not hasattr(report, "wasxfail")
                    and not getattr(item, "mizzen_disabled", False)
                ):
                    report.outcome = "failed"
                    report.longrepr = self._skip_message("", _skip_reason(report.longrepr))
            elif not state.cuda_init_reported and _cuda_initialised():
                state.cuda_init_reported = True
                message = plain(
                    f"{item.nodeid} initialised CUDA on the CPU lane (torch.cuda.is_initialized() "
                    f"became true during {report.when}). A CPU-lane test must never initialise "
                    "CUDA. Fix: keep it on the CPU (device='cpu', no .cuda(), no torch.cuda calls "
                    "that create a context), or register it with register_gpu_ci(...)"
                )
                if report.failed and report.longrepr is not None:
                    message += f"\n\n{report.longrepr}"
                report.outcome = "failed"
                report.longrepr = message

    return TruthRules


# --------------------------------------------------------------------------------------------
# Compile-cache counts for the GPU lane


def pytest_sessionfinish(session) -> None:
    from .lane.compile_cache import write_child_stats  # the lane's counts; never imports torch

    write_child_stats()
