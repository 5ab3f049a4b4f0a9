"""Which GPUs this machine has, their compute capability, and whether a lane may run on them.

Invariants:
- Nothing here imports torch or initialises CUDA in this process.  The probe asks
  ``nvidia-smi --query-gpu=index,uuid,name,compute_cap`` first and, when that is unavailable,
  torch in a *subprocess* (``CUDA_DEVICE_ORDER=PCI_BUS_ID``, so indices match nvidia-smi's).
- A probe never raises for a machine without GPUs: it returns no GPUs plus one note per method
  saying what it found, so a refusal can explain itself.
- ``CUDA_VISIBLE_DEVICES`` of the caller restricts the probed GPUs (by index or UUID prefix, as
  CUDA reads it); an entry matching no GPU, or a MIG instance, is a :class:`ProbeError`.
- A GPU is named to children by UUID when known (unambiguous whatever the device order), else by
  its PCI-order index; its lease key is the same physical identity.
- :func:`lane_gpus` is the refusal rule: a lane runs only on GPUs of its own generation (by
  compute capability, from the fleet), never on a machine without them; ``--fake-gpus`` is the
  one, printed, exception for exercising the runner without CUDA.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

from ..fleet import FLEET_RELATIVE_PATH, Fleet, lane_name
from .refusal import LaneRefusal

PROBE_TIMEOUT_S = 120.0
_NVIDIA_SMI_QUERY = "--query-gpu=index,uuid,name,compute_cap"

# Run by ``python -c`` in a subprocess: torch's view of the GPUs, as JSON on stdout.
_TORCH_PROBE = """
import json, torch
gpus = []
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    uuid = getattr(p, "uuid", None)
    gpus.append({"index": i, "name": p.name, "compute_cap": f"{p.major}.{p.minor}",
                 "uuid": None if uuid is None else "GPU-" + str(uuid)})
print(json.dumps(gpus))
"""


class ProbeError(RuntimeError):
    """The GPUs cannot be determined (bad ``CUDA_VISIBLE_DEVICES``, unreadable probe output)."""


@dataclass(frozen=True)
class Gpu:
    """One physical GPU: PCI-order index, UUID (when known), product name, compute capability."""

    index: int
    compute_capability: str  # "9.0"
    name: str = ""
    uuid: str | None = None

    @property
    def visible_id(self) -> str:
        """How a child process names this GPU in ``CUDA_VISIBLE_DEVICES``."""
        return self.uuid or str(self.index)

    @property
    def lease_key(self) -> str:
        """The physical identity a lease is taken on (one lock file per key)."""
        return self.uuid or f"index-{self.index}"


@dataclass(frozen=True)
class Probe:
    gpus: tuple[Gpu, ...]
    source: str  # "nvidia-smi" | "torch" | "none"
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        if not self.gpus:
            return "no NVIDIA GPU found (" + "; ".join(self.notes) + ")"
        by_cc: dict[tuple[str, str], int] = {}
        for g in self.gpus:
            by_cc[(g.name or "GPU", g.compute_capability)] = (
                by_cc.get((g.name or "GPU", g.compute_capability), 0) + 1
            )
        return ", ".join(
            f"{n}× {name} (compute capability {cc})" for (name, cc), n in by_cc.items()
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
    major, dot, minor = cc.partition(".")
    return bool(dot) and major.isdigit() and minor.isdigit()


def _run_probe(argv: list[str], label: str, env: dict[str, str] | None = None):
    """``(completed process, "")`` of one probe command, or ``(None, why it could not run)``."""
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{label}: {e}"
    return out, ""


def _probe_nvidia_smi() -> tuple[list[Gpu] | None, str]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, "nvidia-smi: not on PATH"
    out, why = _run_probe([exe, _NVIDIA_SMI_QUERY, "--format=csv,noheader"], "nvidia-smi")
    if out is None:
        return None, why
    if out.returncode != 0:
        first = (out.stdout + out.stderr).strip().splitlines()[:1]
        return None, f"nvidia-smi exited {out.returncode}: {first[0] if first else ''}".rstrip()
    gpus = parse_nvidia_smi(out.stdout)
    return gpus, f"nvidia-smi: {len(gpus)} GPU(s)"


def _probe_torch(python: str) -> tuple[list[Gpu] | None, str]:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    out, why = _run_probe([python, "-c", _TORCH_PROBE], "torch", env)
    if out is None:
        return None, why
    if out.returncode != 0:
        last = out.stderr.strip().splitlines()[-1:] or [f"exit {out.returncode}"]
        return None, f"torch in {python}: {last[0]}"
    try:
        raw = json.loads(out.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        raise ProbeError(f"the torch probe printed {out.stdout!r}, not JSON") from None
    gpus = [Gpu(g["index"], g["compute_cap"], g["name"], g["uuid"]) for g in raw]
    return gpus, f"torch.cuda.device_count() == {len(gpus)}"


def restrict_to_visible(gpus: list[Gpu], cuda_visible_devices: str | None) -> list[Gpu]:
    """The GPUs ``CUDA_VISIBLE_DEVICES`` lets this process use (all of them when unset)."""
    if cuda_visible_devices is None:
        return list(gpus)
    chosen: list[Gpu] = []
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        if not entry:
            continue
        if entry.startswith("MIG-"):
            raise ProbeError(
                f"CUDA_VISIBLE_DEVICES names a MIG instance ({entry}); the GPU lanes lease whole "
                "GPUs: unset CUDA_VISIBLE_DEVICES or list whole GPUs"
            )
        if entry.isdigit():
            found = [g for g in gpus if g.index == int(entry)]
        else:
            found = [g for g in gpus if g.uuid and g.uuid.startswith(entry)]
        if len(found) != 1:
            raise ProbeError(
                f"CUDA_VISIBLE_DEVICES entry {entry!r} matches {len(found)} of this machine's "
                f"GPUs ({', '.join(g.visible_id for g in gpus) or 'none'}); fix or unset it"
            )
        if found[0] not in chosen:
            chosen.append(found[0])
    return chosen


def probe(python: str | None = None, *, cuda_visible_devices: str | None = None) -> Probe:
    """The GPUs of this machine that ``CUDA_VISIBLE_DEVICES`` (default: this process's) allows."""
    notes: list[str] = []
    gpus, note = _probe_nvidia_smi()
    notes.append(note)
    source = "nvidia-smi"
    if gpus is None:
        gpus, note = _probe_torch(python or sys.executable)
        notes.append(note)
        source = "torch"
    if gpus is None:
        return Probe((), "none", tuple(notes))
    visible = (
        os.environ.get("CUDA_VISIBLE_DEVICES")
        if cuda_visible_devices is None
        else cuda_visible_devices
    )
    restricted = restrict_to_visible(gpus, visible)
    if visible is not None and len(restricted) < len(gpus):
        notes.append(f"CUDA_VISIBLE_DEVICES={visible!r} leaves {len(restricted)} of {len(gpus)}")
    return Probe(tuple(restricted), source if restricted else "none", tuple(notes))


# --------------------------------------------------------------------------------------------
# The refusal rule


def lane_gpus(fleet: Fleet, arch: str, fake_gpus: int | None) -> tuple[tuple[Gpu, ...], str]:
    """(the GPUs of this host that belong to ``arch``, how they were found); refuses otherwise."""
    wanted = fleet.arch(arch)
    what = (
        f"The {arch} lane runs tests declaring {arch} on {arch} GPUs (compute capability "
        f"{', '.join(wanted.compute_capabilities)}"
        + (f": {', '.join(wanted.gpus)}" if wanted.gpus else "")
        + ")."
    )
    if fake_gpus is not None:
        if fake_gpus < 1:
            raise LaneRefusal(f"--fake-gpus must be at least 1, got {fake_gpus}")
        cc = wanted.compute_capabilities[0]
        gpus = tuple(Gpu(i, cc, f"fake {arch} GPU", f"FAKE-{i}") for i in range(fake_gpus))
        return gpus, f"FAKE: {fake_gpus} pretend {arch} GPU(s) (--fake-gpus), no CUDA"
    try:
        found = probe()
    except ProbeError as e:
        raise LaneRefusal(f"refusing to run: {e}\n{what}") from None
    if not found.gpus:
        raise LaneRefusal(
            f"refusing to run: {found.describe()}.\n{what}\n"
            f"Run `nox -s {lane_name(arch)}` on such a machine; on a CPU machine run `nox -s cpu`."
        )
    mine = tuple(g for g in found.gpus if fleet.arch_of_capability(g.compute_capability) == arch)
    if not mine:
        others = sorted(
            {fleet.arch_of_capability(g.compute_capability) or "?" for g in found.gpus} - {"?"}
        )
        hint = (
            f" Run {' or '.join(f'`nox -s {lane_name(a)}`' for a in others)} here instead."
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
