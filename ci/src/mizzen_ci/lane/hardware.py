"""Which GPUs this machine has, what generation they are, and whether a lane may run on them.

Invariants:
- Nothing here imports torch or initialises a GPU runtime in this process.  A probe asks the
  vendor's tools, then torch in a *subprocess*:
  - NVIDIA: ``nvidia-smi --query-gpu=index,uuid,name,compute_cap`` (CSV), then torch
    (``CUDA_DEVICE_ORDER=PCI_BUS_ID``, so indices match nvidia-smi's);
  - AMD: ``amd-smi static --asic --json`` (each GPU's ``target_graphics_version``, e.g.
    ``gfx942``), then ``rocm-smi --showproductname --json`` (its ``GFX Version``), then torch when
    it is a ROCm build (``torch.version.hip`` set; ``gcnArchName`` per device, its feature
    suffixes such as ``:sramecc+:xnack-`` dropped).  A CUDA build of torch reports no AMD GPU, a
    ROCm build no NVIDIA GPU.
- A probe never raises for a machine without GPUs: it returns no GPUs plus one note per method
  saying what it found, so a refusal can explain itself.  Output a tool printed that is not what
  it documents (or over :data:`MAX_TOOL_OUTPUT` bytes) is a :class:`ProbeError`, never guessed at.
- The caller's own restriction is honoured: ``CUDA_VISIBLE_DEVICES`` on NVIDIA (index or UUID
  prefix, as CUDA reads it; a MIG instance is refused), ``HIP_VISIBLE_DEVICES`` on AMD (indices;
  ``CUDA_VISIBLE_DEVICES``, which HIP also reads, must agree with it).  An entry matching no GPU
  is a :class:`ProbeError`, and so is a variable that renumbers the devices under the one the lane
  pins with (``ROCR_VISIBLE_DEVICES``, ``GPU_DEVICE_ORDINAL``: :attr:`mizzen_ci.fleet.Vendor.renumbering`).
- A GPU is named to children the way its runtime reads it (:attr:`Gpu.visible_id`): an NVIDIA GPU
  by UUID when known (unambiguous whatever the device order), else by its PCI-order index; an AMD
  GPU by its index (``HIP_VISIBLE_DEVICES`` takes indices).  Its lease key is that same identity,
  so every lane of the host leases what its children are pinned to.
- :func:`lane_gpus` is the refusal rule: a lane runs only on GPUs of its own generation (by
  compute capability or ISA, from the fleet), never on a machine without them; ``--fake-gpus`` is
  the one, printed, exception for exercising the runner without a GPU.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..fleet import AMD, FLEET_RELATIVE_PATH, NVIDIA, VENDORS, Fleet, Vendor, nox_session_name
from .refusal import LaneRefusal

PROBE_TIMEOUT_S = 120.0
MAX_TOOL_OUTPUT = 16 * 1024 * 1024  # bytes of one probe's output (a host of 8 GPUs prints ~10 KiB)
MAX_NAME_CHARS = 120  # of a product name a tool reports
_NVIDIA_SMI_QUERY = "--query-gpu=index,uuid,name,compute_cap"
AMD_SMI_ARGS = ("static", "--asic", "--json")
ROCM_SMI_ARGS = ("--showproductname", "--json")

# Run by ``python -c`` in a subprocess: torch's view of the GPUs, as JSON on stdout.  A ROCm build
# uses the same torch.cuda API; it says so with torch.version.hip.
_TORCH_PROBE = """
import json, torch
gpus = []
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    uuid = getattr(p, "uuid", None)
    gpus.append({"index": i, "name": p.name, "compute_cap": f"{p.major}.{p.minor}",
                 "gcn_arch": getattr(p, "gcnArchName", None),
                 "uuid": None if uuid is None else "GPU-" + str(uuid)})
print(json.dumps({"hip": getattr(torch.version, "hip", None), "gpus": gpus}))
"""


class ProbeError(RuntimeError):
    """The GPUs cannot be determined (a bad ``*_VISIBLE_DEVICES``, unreadable probe output)."""


@dataclass(frozen=True)
class Gpu:
    """One physical GPU: its index (PCI order on NVIDIA, the HIP device index on AMD), its
    *target* (compute capability ``"9.0"`` or ISA ``"gfx942"``: what the fleet maps to a
    generation), product name, UUID (when known) and vendor."""

    index: int
    target: str
    name: str = ""
    uuid: str | None = None
    vendor: str = NVIDIA.name

    @property
    def visible_id(self) -> str:
        """How a child process names this GPU in its vendor's visible-devices variable."""
        if self.vendor == NVIDIA.name and self.uuid:
            return self.uuid
        return str(self.index)

    @property
    def lease_key(self) -> str:
        """The physical identity a lease is taken on (one lock file per key)."""
        if self.vendor == NVIDIA.name:
            return self.uuid or f"index-{self.index}"
        return f"{self.vendor}-index-{self.index}"


@dataclass(frozen=True)
class Probe:
    gpus: tuple[Gpu, ...]
    source: str  # "nvidia-smi" | "amd-smi" | "rocm-smi" | "torch" | "none"
    notes: tuple[str, ...] = ()
    vendor: str = NVIDIA.name

    def describe(self) -> str:
        runtime = VENDORS[self.vendor]
        if not self.gpus:
            return f"no {runtime.title} GPU found (" + "; ".join(self.notes) + ")"
        by_target: dict[tuple[str, str], int] = {}
        for g in self.gpus:
            key = (g.name or "GPU", g.target)
            by_target[key] = by_target.get(key, 0) + 1
        return ", ".join(
            f"{n}× {name} ({runtime.target_word} {target})"
            for (name, target), n in by_target.items()
        )


def parse_nvidia_smi(text: str) -> list[Gpu]:
    """GPUs from ``nvidia-smi --query-gpu=index,uuid,name,compute_cap --format=csv,noheader``."""
    gpus = []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 4:
            raise ProbeError(f"nvidia-smi printed an unexpected line: {line!r}")
        index, uuid, cc = fields[0], fields[1], fields[-1]
        name = ", ".join(fields[2:-1])
        if not index.isdigit() or not _is_capability(cc):
            raise ProbeError(f"nvidia-smi printed an unexpected line: {line!r}")
        gpus.append(Gpu(int(index), cc, name, uuid if uuid.startswith("GPU-") else None))
    return gpus


def _is_capability(cc: str) -> bool:
    return NVIDIA.is_target(cc)


def _isa(value: object, where: str) -> str:
    """The ISA name of an AMD device from a tool's field (``gfx942``; ``gfx90a:sramecc+:xnack-``
    loses its feature suffixes)."""
    isa = value.split(":", 1)[0].strip() if isinstance(value, str) else ""
    if not AMD.is_target(isa):
        raise ProbeError(f"{where}: {_cut(repr(value))} is not an ISA name such as gfx942")
    return isa


def _cut(text: str) -> str:
    return text if len(text) <= MAX_NAME_CHARS else text[: MAX_NAME_CHARS - 1] + "…"


def _json(text: str, tool: str) -> object:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        raise ProbeError(f"{tool} printed {_cut(repr(text))}, not JSON") from None


def parse_amd_smi_static(text: str) -> list[Gpu]:
    """GPUs from ``amd-smi static --asic --json``: a list of ``{"gpu": N, "asic": {"market_name":
    ..., "target_graphics_version": "gfx942", ...}}`` (ROCm 6), or the same list under
    ``"gpu_data"`` (ROCm 7).  ``gpu`` is amd-smi's device index."""
    tool = "amd-smi " + " ".join(AMD_SMI_ARGS)
    data = _json(text, tool)
    if isinstance(data, dict) and isinstance(data.get("gpu_data"), list):
        data = data["gpu_data"]
    if not isinstance(data, list):
        raise ProbeError(f"{tool} printed {_cut(repr(data))}, not a list of GPUs")
    gpus = []
    for entry in data:
        index = entry.get("gpu") if isinstance(entry, dict) else None
        asic = entry.get("asic") if isinstance(entry, dict) else None
        if type(index) is not int or index < 0 or not isinstance(asic, dict):
            raise ProbeError(f"{tool} printed an unexpected entry: {_cut(repr(entry))}")
        name = asic.get("market_name")
        gpus.append(
            Gpu(
                index,
                _isa(asic.get("target_graphics_version"), f"{tool}, GPU {index}"),
                _cut(name) if isinstance(name, str) and name != "N/A" else "",
                None,
                AMD.name,
            )
        )
    return sorted(gpus, key=lambda g: g.index)


_CARD = re.compile(r"card([0-9]{1,4})")


def parse_rocm_smi_product(text: str) -> list[Gpu]:
    """GPUs from ``rocm-smi --showproductname --json``: ``{"card0": {"Card Series": ...,
    "GFX Version": "gfx942", ...}, ...}`` (other top-level keys, such as ``system``, are not
    GPUs).  ``cardN``'s N is rocm-smi's device index."""
    tool = "rocm-smi " + " ".join(ROCM_SMI_ARGS)
    data = _json(text, tool)
    if not isinstance(data, dict):
        raise ProbeError(f"{tool} printed {_cut(repr(data))}, not an object of cards")
    gpus = []
    for key, card in data.items():
        found = _CARD.fullmatch(key)
        if found is None:
            continue
        if not isinstance(card, dict):
            raise ProbeError(f"{tool} printed an unexpected {key}: {_cut(repr(card))}")
        name = card.get("Card Series")
        gpus.append(
            Gpu(
                int(found[1]),
                _isa(card.get("GFX Version"), f"{tool}, {key}"),
                _cut(name) if isinstance(name, str) and name != "N/A" else "",
                None,
                AMD.name,
            )
        )
    return sorted(gpus, key=lambda g: g.index)


def _run_probe(argv: list[str], label: str, env: dict[str, str] | None = None):
    """``(completed process, "")`` of one probe command, or ``(None, why it could not run)``."""
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{label}: {e}"
    if len(out.stdout) > MAX_TOOL_OUTPUT:
        raise ProbeError(f"{label} printed {len(out.stdout)} characters, over {MAX_TOOL_OUTPUT}")
    return out, ""


def _probe_tool(
    tool: str, args: tuple[str, ...], parse: Callable[[str], list[Gpu]]
) -> tuple[list[Gpu] | None, str]:
    """One vendor tool: ``(its GPUs, note)``, or ``(None, why not)`` when it is absent or fails."""
    exe = shutil.which(tool)
    if exe is None:
        return None, f"{tool}: not on PATH"
    out, why = _run_probe([exe, *args], tool)
    if out is None:
        return None, why
    if out.returncode != 0:
        first = (out.stdout + out.stderr).strip().splitlines()[:1]
        return None, f"{tool} exited {out.returncode}: {first[0] if first else ''}".rstrip()
    gpus = parse(out.stdout)
    return gpus, f"{tool}: {len(gpus)} GPU(s)"


def _probe_nvidia_smi() -> tuple[list[Gpu] | None, str]:
    return _probe_tool("nvidia-smi", (_NVIDIA_SMI_QUERY, "--format=csv,noheader"), parse_nvidia_smi)


def _probe_amd_smi() -> tuple[list[Gpu] | None, str]:
    return _probe_tool("amd-smi", AMD_SMI_ARGS, parse_amd_smi_static)


def _probe_rocm_smi() -> tuple[list[Gpu] | None, str]:
    return _probe_tool("rocm-smi", ROCM_SMI_ARGS, parse_rocm_smi_product)


# Each vendor's tools, in the order they are asked (torch comes after them).
TOOL_PROBES: dict[str, tuple[tuple[str, Callable[[], tuple[list[Gpu] | None, str]]], ...]] = {
    NVIDIA.name: (("nvidia-smi", _probe_nvidia_smi),),
    AMD.name: (("amd-smi", _probe_amd_smi), ("rocm-smi", _probe_rocm_smi)),
}


def parse_torch_probe(text: str, vendor: Vendor, python: str) -> tuple[list[Gpu] | None, str]:
    """What the torch probe script printed, for ``vendor``: a CUDA build of torch sees NVIDIA
    GPUs only and a ROCm build (``hip`` set) AMD GPUs only."""
    try:
        raw = json.loads(text.strip().splitlines()[-1])
        hip, devices = raw["hip"], raw["gpus"]
        entries = [
            (d["index"], d["name"], d["compute_cap"], d["gcn_arch"], d["uuid"]) for d in devices
        ]
    except (ValueError, IndexError, KeyError, TypeError, RecursionError):
        raise ProbeError(f"the torch probe printed {_cut(repr(text))}, not its JSON") from None
    if vendor is AMD:
        if not hip:
            return None, f"torch in {python} is not a ROCm build (torch.version.hip is None)"
        gpus = [
            Gpu(i, _isa(arch, f"torch device {i} gcnArchName"), _cut(str(name)), None, AMD.name)
            for i, name, _, arch, _ in entries
        ]
        return gpus, f"torch (ROCm {hip}): torch.cuda.device_count() == {len(gpus)}"
    if hip:
        return None, f"torch in {python} is a ROCm build (HIP {hip}): it reports AMD GPUs only"
    gpus = [Gpu(i, cc, name, uuid) for i, name, cc, _, uuid in entries]
    return gpus, f"torch.cuda.device_count() == {len(gpus)}"


def _probe_torch(python: str, vendor: Vendor) -> tuple[list[Gpu] | None, str]:
    hidden = {vendor.visible_devices, *vendor.visible_aliases}  # torch sees every GPU; we restrict
    env = {k: v for k, v in os.environ.items() if k not in hidden}
    if vendor is NVIDIA:
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    out, why = _run_probe([python, "-c", _TORCH_PROBE], "torch", env)
    if out is None:
        return None, why
    if out.returncode != 0:
        last = out.stderr.strip().splitlines()[-1:] or [f"exit {out.returncode}"]
        return None, f"torch in {python}: {last[0]}"
    return parse_torch_probe(out.stdout, vendor, python)


def visible_setting(vendor: Vendor, environ: Mapping[str, str]) -> tuple[str, str | None]:
    """``(variable, value)`` of the restriction this process's environment puts on ``vendor``'s
    GPUs (value ``None``: every GPU); :class:`ProbeError` when a variable would renumber the
    devices under it, or two spellings of it disagree."""
    for name in vendor.renumbering:
        if name in environ:
            raise ProbeError(
                f"{name}={environ[name]!r} is set: it renumbers the devices "
                f"{vendor.visible_devices} indexes, so the GPUs a lane leases would not be the ones "
                f"its tests see. Fix: unset {name} and restrict the GPUs with "
                f"{vendor.visible_devices}"
            )
    value = environ.get(vendor.visible_devices)
    variable = vendor.visible_devices
    for alias in vendor.visible_aliases:
        if alias not in environ:
            continue
        if value is not None and environ[alias] != value:
            raise ProbeError(
                f"{variable}={value!r} and {alias}={environ[alias]!r} disagree ({vendor.runtime} "
                f"reads both). Fix: unset {alias}"
            )
        if value is None:
            variable, value = alias, environ[alias]
    return variable, value


def restrict_to_visible(
    gpus: list[Gpu], visible: str | None, variable: str = NVIDIA.visible_devices
) -> list[Gpu]:
    """The GPUs ``visible`` (the value of ``variable``) lets this process use (all when unset)."""
    if visible is None:
        return list(gpus)
    chosen: list[Gpu] = []
    for entry in (e.strip() for e in visible.split(",")):
        if not entry:
            continue
        if entry.startswith("MIG-"):
            raise ProbeError(
                f"{variable} names a MIG instance ({entry}); the GPU lanes lease whole "
                f"GPUs: unset {variable} or list whole GPUs"
            )
        if entry.isdigit():
            found = [g for g in gpus if g.index == int(entry)]
        elif any(g.vendor != NVIDIA.name for g in gpus):
            raise ProbeError(
                f"{variable} entry {entry!r} is not a device index (HIP reads indices). Fix: "
                f"list indices, e.g. {variable}=0,1"
            )
        else:
            found = [g for g in gpus if g.uuid and g.uuid.startswith(entry)]
        if len(found) != 1:
            raise ProbeError(
                f"{variable} entry {entry!r} matches {len(found)} of this machine's "
                f"GPUs ({', '.join(g.visible_id for g in gpus) or 'none'}); fix or unset it"
            )
        if found[0] not in chosen:
            chosen.append(found[0])
    return chosen


def probe(
    python: str | None = None,
    *,
    vendor: str = NVIDIA.name,
    cuda_visible_devices: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> Probe:
    """The GPUs of ``vendor`` on this machine that the environment (default: this process's)
    allows; ``cuda_visible_devices`` stands for ``CUDA_VISIBLE_DEVICES`` on NVIDIA."""
    runtime = VENDORS[vendor]
    env = os.environ if environ is None else environ
    notes: list[str] = []
    gpus: list[Gpu] | None = None
    source = "none"
    for name, tool in TOOL_PROBES[vendor]:
        gpus, note = tool()
        notes.append(note)
        if gpus is not None:
            source = name
            break
    if gpus is None:
        gpus, note = _probe_torch(python or sys.executable, runtime)
        notes.append(note)
        source = "torch"
    if gpus is None:
        return Probe((), "none", tuple(notes), vendor)
    if runtime is NVIDIA and cuda_visible_devices is not None:
        variable, visible = NVIDIA.visible_devices, cuda_visible_devices
    else:
        variable, visible = visible_setting(runtime, env)
    restricted = restrict_to_visible(gpus, visible, variable)
    if visible is not None and len(restricted) < len(gpus):
        notes.append(f"{variable}={visible!r} leaves {len(restricted)} of {len(gpus)}")
    return Probe(tuple(restricted), source if restricted else "none", tuple(notes), vendor)


def other_vendors_gpus(vendor: str) -> list[Probe]:
    """What the *other* vendors' tools see here (for a refusal's hint; torch is not asked, and a
    tool that fails says nothing)."""
    found = []
    for other, tools in TOOL_PROBES.items():
        if other == vendor:
            continue
        for name, tool in tools:
            try:
                gpus, _ = tool()
            except ProbeError:
                gpus = None
            if gpus:
                found.append(Probe(tuple(gpus), name, (), other))
                break
    return found


# --------------------------------------------------------------------------------------------
# The refusal rule


def lane_gpus(fleet: Fleet, arch: str, fake_gpus: int | None) -> tuple[tuple[Gpu, ...], str]:
    """(the GPUs of this host that belong to ``arch``, how they were found); refuses otherwise."""
    wanted = fleet.generation(arch)
    runtime = wanted.runtime
    what = f"The {arch} lane runs tests declaring {arch} on {arch} GPUs ({wanted.describe()})."
    if fake_gpus is not None:
        if fake_gpus < 1:
            raise LaneRefusal(f"--fake-gpus must be at least 1, got {fake_gpus}")
        target = wanted.targets[0]
        gpus = tuple(
            Gpu(
                i,
                target,
                f"fake {arch} GPU",
                f"FAKE-{i}" if runtime is NVIDIA else None,
                runtime.name,
            )
            for i in range(fake_gpus)
        )
        return gpus, (
            f"FAKE: {fake_gpus} pretend {arch} GPU(s) (--fake-gpus), no {runtime.runtime}"
        )
    try:
        found = probe(vendor=runtime.name)
    except ProbeError as e:
        raise LaneRefusal(f"refusing to run: {e}\n{what}") from None
    if not found.gpus:
        raise LaneRefusal(
            f"refusing to run: {found.describe()}.\n{what}{_elsewhere(fleet, runtime)}\n"
            f"Run `nox -s {nox_session_name(arch)}` on such a machine; on a CPU machine run `nox -s cpu`."
        )
    mine = tuple(g for g in found.gpus if fleet.generation_of_target(g.target) == arch)
    if not mine:
        others = sorted({fleet.generation_of_target(g.target) or "?" for g in found.gpus} - {"?"})
        hint = (
            f" Run {' or '.join(f'`nox -s {nox_session_name(a)}`' for a in others)} here instead."
            if others
            else ""
        )
        raise LaneRefusal(
            f"refusing to run: this machine's GPUs are {found.describe()}, "
            f"{'generation ' + ', '.join(others) if others else f'not a generation of {FLEET_RELATIVE_PATH}'}, "
            f"not {arch}.\n{what}{hint}"
        )
    note = f"{found.describe()} via {found.source}"
    if len(mine) < len(found.gpus):
        note += f"; using the {len(mine)} {arch} GPU(s)"
    return mine, note


def _elsewhere(fleet: Fleet, runtime: Vendor) -> str:
    """`` This machine has …: run `nox -s gpu-X` here instead.`` when another vendor's tools see
    GPUs of a generation the fleet knows; empty otherwise."""
    for found in other_vendors_gpus(runtime.name):
        arches = sorted({fleet.generation_of_target(g.target) for g in found.gpus} - {None})
        lanes = " or ".join(f"`nox -s {nox_session_name(a)}`" for a in arches)
        return f" This machine has {found.describe()}" + (
            f": run {lanes} here instead." if lanes else "."
        )
    return ""
