"""The fleet: GPU generations, capabilities, labels and runner pools, read from ``ci/fleet.toml``.

Invariants:
- ``fleet.toml`` is the one table of hardware facts; this module only reads and checks it and
  derives from it (which generation a device identifier belongs to, which pool hosts a test).
- Generations keep the file's order, which is the auto-dispatch preference order, across vendors:
  one list of NVIDIA and AMD generations, not one per vendor.
- Every generation names its vendor (:data:`VENDORS`: ``nvidia`` or ``amd``) and lists its device
  identifiers under the vendor's key: compute capabilities (``"9.0"``) for NVIDIA, ISA names
  (``"gfx942"``) for AMD.  One identifier belongs to one generation, whatever the vendor; the
  identifiers' spellings are checked (an ISA name never passes for a compute capability).
- What a vendor's runtime needs is the :class:`Vendor` record, one per vendor, and nothing else
  names it: the variable that pins a process to its GPUs (``CUDA_VISIBLE_DEVICES``;
  ``HIP_VISIBLE_DEVICES`` on AMD) and the variables that would renumber or hide devices under it.
- Pool derivation is deterministic: on one generation, the smallest pool (fewest GPUs per runner) that
  has enough GPUs and every needed capability; ties broken by fewer extra capabilities, then name.
- A malformed table raises :class:`FleetError` naming the file, the entry and the fix, and
  nothing else: every value is read through one reader that checks its shape where it is read
  (a table, an array of tables whose every entry is a table, a list of names, a string, a count
  ≥ 1, seconds in range), so no TOML value of another shape reaches the code that derives from
  it; TOML nested too deeply to parse is a FleetError too.
- Hosting is part of the table and checked: every GPU pool is self-hosted (its ``runs_on`` starts
  with ``self-hosted``) and names the runner group that holds its machines (``runner_group``; the
  group is what restricts those runners to the default branch's GPU workflow — labels alone do
  not); the CPU pool is GitHub-hosted (no ``self-hosted`` label, no group).
- Lane names are derived here and nowhere else: :data:`CPU_LANE` and :func:`nox_session_name` (the
  nox session and plan job lane of a generation, ``gpu-<generation>``).  A test's *target*
  (:func:`mizzen_ci.registry.declares_target`) is ``cpu`` or a generation, never such a name.
"""

from __future__ import annotations

import argparse
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

FLEET_RELATIVE_PATH = Path("ci") / "fleet.toml"
CPU_LANE = "cpu"
GPU_LANE_PREFIX = "gpu-"


def nox_session_name(generation: str | None) -> str:
    """The nox session (and plan job lane) that runs tests on ``generation``: ``gpu-<generation>``;
    None: the CPU lane, ``cpu``."""
    return CPU_LANE if generation is None else GPU_LANE_PREFIX + generation


class FleetError(ValueError):
    """``fleet.toml`` is malformed; the message names the entry and the fix."""


@dataclass(frozen=True)
class Vendor:
    """What mizzen needs to know about one GPU vendor's runtime (not a fact of the fleet: the same
    for every machine of that vendor)."""

    name: str  # the value of ``vendor`` in fleet.toml
    title: str  # how people write it
    runtime: str  # the GPU runtime's name: CUDA, ROCm
    targets_key: str  # the [[arch]] key listing the generation's device identifiers
    target_word: str  # what one identifier is called in messages
    target_example: str
    target_pattern: re.Pattern[str]
    visible_devices: str  # the variable that pins a process to its GPUs
    # Other spellings of visible_devices that the runtime also reads: they must agree with it,
    # and a lane's children get visible_devices alone.
    visible_aliases: tuple[str, ...] = ()
    # Variables that restrict or renumber the devices under visible_devices: a lane refuses to
    # run when they are set (the GPUs it leased would not be the ones a test sees) and keeps them
    # out of its children's environment.
    renumbering: tuple[str, ...] = ()

    @property
    def pinning_variables(self) -> tuple[str, ...]:
        """Every variable that decides which devices a process of this vendor sees."""
        return (self.visible_devices, *self.visible_aliases, *self.renumbering)

    def is_target(self, text: str) -> bool:
        return bool(self.target_pattern.fullmatch(text))


NVIDIA = Vendor(
    name="nvidia",
    title="NVIDIA",
    runtime="CUDA",
    targets_key="compute_capabilities",
    target_word="compute capability",
    target_example="9.0",
    target_pattern=re.compile(r"[0-9]+\.[0-9]+"),
    visible_devices="CUDA_VISIBLE_DEVICES",
)
# ROCm: HIP reads HIP_VISIBLE_DEVICES (device indices; CUDA_VISIBLE_DEVICES is its alias), within
# the devices that ROCR_VISIBLE_DEVICES (the ROCm runtime, below HIP) and GPU_DEVICE_ORDINAL (ROCclr)
# expose.  The lane pins with HIP_VISIBLE_DEVICES alone.
AMD = Vendor(
    name="amd",
    title="AMD",
    runtime="ROCm",
    targets_key="isa",
    target_word="ISA",
    target_example="gfx942",
    target_pattern=re.compile(r"gfx[0-9a-f]{3,4}"),
    visible_devices="HIP_VISIBLE_DEVICES",
    visible_aliases=("CUDA_VISIBLE_DEVICES",),
    renumbering=("ROCR_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL"),
)
VENDORS: dict[str, Vendor] = {v.name: v for v in (NVIDIA, AMD)}


@dataclass(frozen=True)
class Generation:
    """A GPU generation (not a SKU) of one vendor, with the device identifiers that belong to it:
    compute capabilities (NVIDIA) or ISA names (AMD), its *targets*."""

    name: str
    vendor: str  # a key of VENDORS
    targets: tuple[str, ...]
    gpus: tuple[str, ...] = ()

    @property
    def runtime(self) -> Vendor:
        return VENDORS[self.vendor]

    def describe(self) -> str:
        """``compute capability 9.0: H100, H200`` / ``ISA gfx942: MI300X, MI325X``."""
        text = f"{self.runtime.target_word} {', '.join(self.targets)}"
        return text + (f": {', '.join(self.gpus)}" if self.gpus else "")


SELF_HOSTED = "self-hosted"


@dataclass(frozen=True)
class Pool:
    """A set of identical self-hosted GPU runners: ``runners`` machines of ``gpus_per_runner``
    GPUs each, in the runner group ``runner_group``."""

    name: str
    arch: str
    gpu: str
    gpus_per_runner: int
    runners: int
    runs_on: tuple[str, ...]
    runner_group: str
    job_setup_s: float  # what a job costs its runner before its first test
    capabilities: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True)
class CpuPool:
    """The pool that runs CPU jobs (GitHub-hosted runners: no runner group)."""

    name: str
    runs_on: tuple[str, ...]
    runners: int
    job_setup_s: float
    runner_group: None = None


@dataclass(frozen=True)
class Fleet:
    """Everything ``fleet.toml`` says, with the derivations the registry and planner need."""

    path: Path
    generations: tuple[Generation, ...]
    capabilities: frozenset[str]
    labels: frozenset[str]
    pools: tuple[Pool, ...]
    cpu_pool: CpuPool

    @property
    def generation_names(self) -> tuple[str, ...]:
        """Generation names in auto-dispatch preference order."""
        return tuple(a.name for a in self.generations)

    def generation(self, name: str) -> Generation:
        for a in self.generations:
            if a.name == name:
                return a
        raise KeyError(name)

    def pools_of(self, generation: str) -> tuple[Pool, ...]:
        return tuple(p for p in self.pools if p.arch == generation)

    def generations_in_fleet(self) -> tuple[str, ...]:
        """Generations that have at least one pool, in preference order."""
        have = {p.arch for p in self.pools}
        return tuple(a for a in self.generation_names if a in have)

    def max_gpus(self, generation: str) -> int:
        """The most GPUs one runner of ``generation`` has (0 when the fleet has none of it)."""
        return max((p.gpus_per_runner for p in self.pools_of(generation)), default=0)

    def pool_for(
        self, generation: str, num_gpus: int, needs: frozenset[str] | set[str] = frozenset()
    ):
        """The smallest pool of ``generation`` with ``num_gpus`` GPUs per runner and every
        capability in ``needs``; ``None`` when no pool can host it."""
        fits = [
            p
            for p in self.pools_of(generation)
            if p.gpus_per_runner >= num_gpus and set(needs) <= p.capabilities
        ]
        if not fits:
            return None
        return min(fits, key=lambda p: (p.gpus_per_runner, len(p.capabilities), p.name))

    def pool(self, name: str) -> Pool | CpuPool:
        if name == self.cpu_pool.name:
            return self.cpu_pool
        for p in self.pools:
            if p.name == name:
                return p
        raise KeyError(name)

    def generation_of_target(self, target: str) -> str | None:
        """The generation a device identifier belongs to (a compute capability ``"9.0"`` or an ISA
        name ``"gfx942"``), or ``None``."""
        for a in self.generations:
            if target in a.targets:
                return a.name
        return None

    def vendor_of(self, generation: str | None) -> Vendor | None:
        """The vendor of ``generation`` (``None``: the CPU lane)."""
        return None if generation is None else self.generation(generation).runtime


def find_repo_root(start: Path | None = None) -> Path:
    """The nearest directory at or above ``start`` (default: cwd) that holds ``ci/fleet.toml``."""
    here = (start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        if (d / FLEET_RELATIVE_PATH).is_file():
            return d
    raise FleetError(
        f"no {FLEET_RELATIVE_PATH} found at or above {here}: run from a mizzen checkout "
        "or pass --root DIR"
    )


def add_root_and_fleet_arguments(parser: argparse.ArgumentParser) -> None:
    """``--root`` and ``--fleet``, the options every command that reads the tree takes."""
    parser.add_argument("--root", type=Path, help="repository root (default: found from the cwd)")
    parser.add_argument(
        "--fleet", type=Path, help=f"fleet table (default: ROOT/{FLEET_RELATIVE_PATH})"
    )


def root_and_fleet(args: argparse.Namespace) -> tuple[Path, Fleet]:
    """(root, fleet) from ``--root``/``--fleet``; raises FleetError with a clear message."""
    root = args.root.resolve() if args.root else find_repo_root()
    return root, load_fleet(args.fleet.resolve() if args.fleet else root / FLEET_RELATIVE_PATH)


def load_fleet(path: Path | str) -> Fleet:
    """Read and check ``fleet.toml``."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FleetError(f"{path}: no such fleet file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise FleetError(f"{path}: cannot read the fleet file: {e}") from None
    return parse_fleet(text, path)


def parse_fleet(text: str, path: Path | str) -> Fleet:
    """Check the text of a fleet table (``path`` names it in errors; e.g. ``BASE:ci/fleet.toml``
    for the table as a base revision has it)."""
    path = Path(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise FleetError(f"{path}: not valid TOML: {e}") from None
    except RecursionError:
        raise FleetError(
            f"{path}: not valid TOML: arrays or tables nested too deeply. Fix: write the table "
            "flat, as ci/fleet.toml documents it"
        ) from None
    return _parse(path, data)


# --------------------------------------------------------------------------------------------
# Reading the table: every value goes through _read, which checks its shape where it is read
# (tables, arrays of tables, lists of names, scalars), so no other shape reaches the code below.

_REQUIRED = object()
MAX_JOB_SETUP_S = 3600  # a set-up longer than an hour is a mistake in the table


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class _Shape:
    """What one value of ``fleet.toml`` must be: its name in messages, how to write one, its test."""

    name: str
    example: str  # how to write one, ``{key}`` standing for its key
    accepts: Callable[[object], bool]


STRING = _Shape("a string", '`{key} = "…"`', lambda v: isinstance(v, str))
COUNT = _Shape("an integer ≥ 1", "`{key} = 1`", lambda v: _is_int(v) and v >= 1)
SECONDS = _Shape(
    f"seconds from 0 to {MAX_JOB_SETUP_S}",
    "`{key} = 60`",
    lambda v: (_is_int(v) or isinstance(v, float)) and 0 <= v <= MAX_JOB_SETUP_S,
)
TABLE = _Shape("a table", "a [{key}] section with its keys below it", lambda v: isinstance(v, dict))
TABLES = _Shape(
    "a list of tables",
    "one [[{key}]] section per entry, with its keys below it",
    lambda v: isinstance(v, list),  # each entry is checked on its own (named by its number)
)
NAMES = _Shape(
    "a list of non-empty strings",
    '`{key} = ["a", "b"]`',
    lambda v: isinstance(v, list) and all(isinstance(x, str) and x for x in v),
)


def _shown(value) -> str:
    """A value as a message shows it: TOML-like, one line, bounded."""
    if value is None:
        return "nothing"
    try:
        text = "true" if value is True else "false" if value is False else repr(value)
    except RecursionError:
        text = f"a deeply nested {type(value).__name__}"
    return text if len(text) <= 60 else text[:57] + "..."


def _read(path: Path, where: str, table: dict, key: str, shape: _Shape, default=_REQUIRED):
    """``table[key]``, checked to be ``shape`` (``default`` when absent, if one is given)."""
    if key not in table and default is _REQUIRED:
        raise FleetError(f"{path}: {where} lacks `{key}`. Fix: add {shape.example.format(key=key)}")
    value = table.get(key, default)
    if not shape.accepts(value):
        at = key if where == "the top level" else f"{where}.{key}"
        raise FleetError(
            f"{path}: {at} must be {shape.name}, got {_shown(value)}. "
            f"Fix: write {shape.example.format(key=key)}"
        )
    return value


def _entries(path: Path, data: dict, key: str, what: str) -> list[tuple[str, dict]]:
    """The ``[[key]]`` entries, each checked to be a table: ``[("[[key]] #N", table), …]``."""
    entries = []
    for i, raw in enumerate(_read(path, "the top level", data, key, TABLES, default=[])):
        where = f"[[{key}]] #{i + 1}"
        if not isinstance(raw, dict):
            raise FleetError(
                f"{path}: {where} must be a table, got {_shown(raw)}. Fix: write each {what} "
                f"as a [[{key}]] section with its keys below it"
            )
        entries.append((where, raw))
    return entries


def _names(path: Path, where: str, table: dict, key: str, default=_REQUIRED) -> tuple[str, ...]:
    """A list of non-empty strings, none twice."""
    value = _read(path, where, table, key, NAMES, default)
    if len(set(value)) != len(value):
        at = key if where == "the top level" else f"{where}.{key}"
        raise FleetError(f"{path}: {at} lists a name twice: {_shown(value)}. Fix: list each once")
    return tuple(value)


def _runs_on(path: Path, where: str, table: dict) -> tuple[str, ...]:
    labels = _names(path, where, table, "runs_on")
    if not labels:
        raise FleetError(
            f"{path}: {where}.runs_on is empty. Fix: list the runner labels, e.g. "
            f'["ubuntu-latest"] or ["{SELF_HOSTED}", "linux", "h100"]'
        )
    return labels


def _vendor(path: Path, where: str, raw: dict) -> Vendor:
    """The generation's vendor, and its identifiers under that vendor's key only."""
    value = _read(path, where, raw, "vendor", STRING)
    vendor = VENDORS.get(value)
    if vendor is None:
        raise FleetError(
            f"{path}: {where}.vendor must be one of {sorted(VENDORS)}, got {_shown(value)}"
        )
    for other in VENDORS.values():
        if other is not vendor and other.targets_key in raw:
            raise FleetError(
                f"{path}: {where} is {vendor.title}, but lists `{other.targets_key}` "
                f"({other.title}'s identifiers); list its {vendor.target_word}s under "
                f"`{vendor.targets_key}`, e.g. [{vendor.target_example!r}]"
            )
    return vendor


def _target_shape(vendor: Vendor) -> str:
    if vendor is NVIDIA:
        return "'M.m' (e.g. '9.0')"
    return "an ISA name such as 'gfx90a', 'gfx942' (gfx and 3-4 lowercase hex digits, no features)"


def _setup(path: Path, where: str, raw: dict) -> float:
    """``job_setup_s``: seconds a job holds its runner before its first test (checkout,
    environment, image); required, so that no plan silently assumes a set-up of zero."""
    return float(_read(path, where, raw, "job_setup_s", SECONDS))


def _generations(path: Path, data: dict) -> list[Generation]:
    generations: list[Generation] = []
    owner: dict[str, str] = {}
    for where, raw in _entries(path, data, "arch", "generation"):
        name = _read(path, where, raw, "name", STRING)
        where = f"{where} ({name})"
        vendor = _vendor(path, where, raw)
        targets = _names(path, where, raw, vendor.targets_key, default=None)
        for target in targets:
            if not vendor.is_target(target):
                raise FleetError(
                    f"{path}: {where}: {vendor.target_word} {target!r} is not "
                    f"{_target_shape(vendor)}"
                )
            if target in owner:
                raise FleetError(
                    f"{path}: {vendor.target_word} {target} is listed for both {owner[target]} "
                    f"and {name}; an identifier belongs to one generation"
                )
            owner[target] = name
        if name in {a.name for a in generations}:
            raise FleetError(f"{path}: arch {name!r} is listed twice")
        gpus = _names(path, where, raw, "gpus", default=[])
        generations.append(Generation(name, vendor.name, targets, gpus))
    return generations


def _pool(path: Path, where: str, raw: dict, generations: set[str], known: frozenset[str]) -> Pool:
    name = _read(path, where, raw, "name", STRING)
    arch = _read(path, where, raw, "arch", STRING)
    if arch not in generations:
        raise FleetError(f"{path}: pool {name}: arch {arch!r} is not one of {sorted(generations)}")
    where = f"pool {name}"
    gpus = _read(path, where, raw, "gpus_per_runner", COUNT)
    runners = _read(path, where, raw, "runners", COUNT)
    caps = frozenset(_names(path, where, raw, "capabilities", default=[]))
    if not caps <= known:
        raise FleetError(
            f"{path}: pool {name}: unknown capabilities {sorted(caps - known)}; "
            f"known: {sorted(known)}"
        )
    runs_on = _runs_on(path, where, raw)
    if runs_on[0] != SELF_HOSTED:
        raise FleetError(
            f"{path}: pool {name}: a GPU pool is self-hosted; its runs_on starts with "
            f"{SELF_HOSTED!r}, got {list(runs_on)}"
        )
    group = _read(path, where, raw, "runner_group", STRING)
    if not group.strip():
        raise FleetError(f"{path}: pool {name}: runner_group is empty; name the group")
    return Pool(
        name=name,
        arch=arch,
        gpu=_read(path, where, raw, "gpu", STRING),
        gpus_per_runner=gpus,
        runners=runners,
        runs_on=runs_on,
        runner_group=group,
        job_setup_s=_setup(path, where, raw),
        capabilities=caps,
    )


def _cpu_pool(path: Path, data: dict) -> CpuPool:
    raw = _read(path, "the top level", data, "cpu_pool", TABLE)
    cpu_pool = CpuPool(
        name=_read(path, "[cpu_pool]", raw, "name", STRING),
        runs_on=_runs_on(path, "[cpu_pool]", raw),
        runners=_read(path, "[cpu_pool]", raw, "runners", COUNT),
        job_setup_s=_setup(path, "[cpu_pool]", raw),
    )
    if SELF_HOSTED in cpu_pool.runs_on or "runner_group" in raw:
        raise FleetError(
            f"{path}: [cpu_pool] runs on GitHub-hosted runners (untrusted pull requests get "
            f"exactly these): drop {SELF_HOSTED!r} and runner_group from it"
        )
    return cpu_pool


def _parse(path: Path, data: dict) -> Fleet:
    capabilities = frozenset(_names(path, "the top level", data, "capabilities", default=[]))
    labels = frozenset(_names(path, "the top level", data, "labels"))
    if "arch" not in data:
        raise FleetError(
            f"{path}: the top level lacks `arch`. Fix: add an [[arch]] section per generation"
        )
    generations = _generations(path, data)
    names = {a.name for a in generations}
    pools: list[Pool] = []
    for where, raw in _entries(path, data, "pool", "runner pool"):
        pool = _pool(path, where, raw, names, capabilities)
        if pool.name in {p.name for p in pools}:
            raise FleetError(f"{path}: pool {pool.name!r} is listed twice")
        pools.append(pool)
    cpu_pool = _cpu_pool(path, data)
    if any(p.name == cpu_pool.name for p in pools):
        raise FleetError(f"{path}: the cpu pool and a GPU pool are both named {cpu_pool.name!r}")
    return Fleet(path, tuple(generations), capabilities, labels, tuple(pools), cpu_pool)
