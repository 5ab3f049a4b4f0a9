"""The environment a metric value was produced in, so that the gate judges a value against the
history of the same environment and an image bump is told apart from a regression.

An environment is a few named facts, kept as one canonical line (the text the artefacts and the
store hold)::

    python=3.12.3; torch=2.11.0+cu130; runtime=cuda-13.0; driver=580.82.07; gpu=NVIDIA H200; image=sha256:4f1c…

- ``python``: the interpreter's version; ``torch``: the installed torch distribution's version
  (read from its metadata: torch is never imported for this) or ``none``;
- ``runtime``: ``cuda-X.Y`` / ``rocm-X.Y`` of the torch build when torch is already imported,
  else ``$MIZZEN_GPU_RUNTIME``, else ``unknown``;
- ``driver`` and ``gpu`` (the SKU): from ``nvidia-smi`` when the process sees a GPU, else ``none``;
- ``image``: ``$MIZZEN_IMAGE_DIGEST`` (a container image digest, set by the runner), else
  ``lock:`` and the first 16 hex digits of the SHA-256 of the checkout's ``uv.lock``.

``$MIZZEN_ENVIRONMENT`` (a line of the form above) replaces the probe: a lane that knows its
environment better says so.

Invariants:
- :data:`UNKNOWN` (``"unknown"``) is the environment of every value recorded before
  environments were (an artefact line without ``env``, a stored run without a
  ``run_environments`` row): old history loads and forms one environment of its own, and the
  first value recorded with a known environment is judged as a *new* environment against it.
- :func:`checked` is the one validator of an environment read from anywhere (artefact, store,
  variable): known keys only, each once, printable values of bounded length, at most
  :data:`MAX_CHARS` in all; anything else is refused with the rule.
- :func:`current` probes once per process and root (``functools.cache``) with a bounded ``nvidia-smi``
  call; a failing probe gives ``unknown`` for that fact, never an exception.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

UNKNOWN = "unknown"
ENV_VARIABLE = "MIZZEN_ENVIRONMENT"
IMAGE_VARIABLE = "MIZZEN_IMAGE_DIGEST"
RUNTIME_VARIABLE = "MIZZEN_GPU_RUNTIME"
KEYS = ("python", "torch", "runtime", "driver", "gpu", "image")
MAX_VALUE_CHARS = 80
MAX_CHARS = 512
SMI_SECONDS = 5


class EnvironmentLineError(ValueError):
    """An environment line that cannot be used; the message says which rule it breaks."""


def render(facts: dict[str, str]) -> str:
    """The canonical line of ``facts`` (keys in :data:`KEYS` order)."""
    return "; ".join(f"{k}={facts[k]}" for k in KEYS if k in facts)


def parse(text: str) -> dict[str, str]:
    """The facts of a valid line (``{}`` for :data:`UNKNOWN`)."""
    if text == UNKNOWN:
        return {}
    return dict(part.split("=", 1) for part in text.split("; "))


def checked(text: object) -> str:
    """``text`` when it is a valid environment (see the invariants), in canonical form."""
    if text == UNKNOWN:
        return UNKNOWN
    if not (isinstance(text, str) and 0 < len(text) <= MAX_CHARS and text.isprintable()):
        raise EnvironmentLineError(
            f"an environment is one printable line of at most {MAX_CHARS} characters"
        )
    facts: dict[str, str] = {}
    for part in text.split("; "):
        key, sep, value = part.partition("=")
        if not sep or key not in KEYS or key in facts:
            raise EnvironmentLineError(
                f"environment part {part[:40]!r} is not KEY=VALUE with a KEY of {', '.join(KEYS)} (each once)"
            )
        if not (0 < len(value) <= MAX_VALUE_CHARS) or ";" in value:
            raise EnvironmentLineError(
                f"environment {key} must be 1-{MAX_VALUE_CHARS} characters without ';'"
            )
        facts[key] = value
    return render(facts)


def describe_change(old: str, new: str) -> str:
    """``"X -> Y"`` naming only the facts that differ (both whole when either is unknown)."""
    if UNKNOWN in (old, new):
        return f"{old} -> {new}"
    a, b = parse(old), parse(new)
    changed = [k for k in KEYS if a.get(k) != b.get(k)]
    return (
        ", ".join(f"{k} {a.get(k, '-')} -> {b.get(k, '-')}" for k in changed) or f"{old} -> {new}"
    )


def _torch_runtime() -> str:
    torch = sys.modules.get("torch")
    version = getattr(torch, "version", None)
    if getattr(version, "hip", None):
        return f"rocm-{version.hip}"
    if getattr(version, "cuda", None):
        return f"cuda-{version.cuda}"
    return os.environ.get(RUNTIME_VARIABLE) or UNKNOWN


def _gpu() -> tuple[str, str]:
    """``(driver, gpu SKU)`` of the first visible NVIDIA GPU, ``("none", "none")`` without one."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    smi = shutil.which("nvidia-smi")
    if visible == "" or smi is None:
        return "none", "none"
    try:
        out = subprocess.run(
            [smi, "--query-gpu=driver_version,name", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=SMI_SECONDS, check=True,
        ).stdout  # fmt: skip
        driver, name = out.splitlines()[0].split(", ", 1)
        return driver.strip()[:MAX_VALUE_CHARS] or UNKNOWN, name.strip()[
            :MAX_VALUE_CHARS
        ] or UNKNOWN
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return UNKNOWN, UNKNOWN


def _image(root: Path) -> str:
    digest = os.environ.get(IMAGE_VARIABLE)
    if digest:
        return digest[:MAX_VALUE_CHARS]
    try:
        return "lock:" + hashlib.sha256((root / "uv.lock").read_bytes()).hexdigest()[:16]
    except OSError:
        return UNKNOWN


def _torch_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return "none"


def current(root: Path) -> str:
    """This process's environment (``$MIZZEN_ENVIRONMENT``, else the probe); always valid."""
    given = os.environ.get(ENV_VARIABLE)
    return checked(given) if given else _probe(Path(root))


@functools.cache
def _probe(root: Path) -> str:
    driver, gpu = _gpu()
    facts = {"python": platform.python_version(), "torch": _torch_version(), "runtime": _torch_runtime(),
             "driver": driver, "gpu": gpu, "image": _image(root)}  # fmt: skip
    return checked(render({k: v.replace(";", ",") or UNKNOWN for k, v in facts.items()}))
