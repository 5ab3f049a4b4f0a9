"""How the mixer runs the selective scan on a device: chosen once per device type, and logged.

Backends (all compute :func:`mizzen_plugins.nemotron_h.ssd.ssd_chunked`'s result):

- ``reference``: :func:`~mizzen_plugins.nemotron_h.ssd.ssd_chunked` in eager torch (CPU default).
- ``compiled``: the same chunked scan through ``torch.compile`` (dynamic shapes); the CUDA default
  when ``mamba_ssm`` is not installed.
- ``mamba_ssm``: ``mamba_ssm``'s fused Triton ``mamba_chunk_scan_combined`` (CUDA default when it
  imports).

Invariants:
- GPU-only libraries (``mamba_ssm``, its ``triton``) are imported only inside the functions below,
  never at module scope: this module imports on a CPU machine.
- The choice for a device type is made on first use, cached for the process and logged at INFO
  with its reason (e.g. why ``mamba_ssm`` was not used).  Later calls never re-probe.
- ``MIZZEN_SSM_SCAN=<backend>`` forces a backend; a forced backend that cannot run is an error,
  never a silent fallback.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mizzen_plugins.nemotron_h.ssd import check_shapes, ssd_chunked

__all__ = ["BACKENDS", "ENV_VAR", "ScanBackend", "scan_backend", "selective_scan"]

BACKENDS = ("reference", "compiled", "mamba_ssm")
ENV_VAR = "MIZZEN_SSM_SCAN"

logger = logging.getLogger(__name__)

ScanFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class ScanBackend:
    """A chosen backend: its name, why it was chosen, and the function to call."""

    name: str
    reason: str
    run: ScanFn


def selective_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    chunk_size: int,
    seq_idx: torch.Tensor | None,
) -> torch.Tensor:
    """The scan on ``x``'s device, through that device type's backend (see module docstring)."""
    return scan_backend(x.device.type).run(x, dt, A, B, C, chunk_size=chunk_size, seq_idx=seq_idx)


@functools.cache
def scan_backend(device_type: str) -> ScanBackend:
    """The backend for ``device_type`` ("cpu", "cuda", ...), chosen once and logged."""
    forced = os.environ.get(ENV_VAR, "").strip()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(
                f"{ENV_VAR}={forced!r} is not a scan backend; choose one of {list(BACKENDS)} "
                f"or unset {ENV_VAR}"
            )
        if forced == "mamba_ssm":
            run, problem = _mamba_ssm_scan()
            if run is None:
                raise RuntimeError(
                    f"{ENV_VAR}=mamba_ssm but mamba_ssm cannot be used: {problem}. Fix: install "
                    f"mamba-ssm for this torch/CUDA, or unset {ENV_VAR}"
                )
            backend = ScanBackend("mamba_ssm", f"forced by {ENV_VAR}", run)
        elif forced == "compiled":
            backend = ScanBackend("compiled", f"forced by {ENV_VAR}", _compiled_scan())
        else:
            backend = ScanBackend("reference", f"forced by {ENV_VAR}", ssd_chunked)
    elif device_type == "cuda":
        run, problem = _mamba_ssm_scan()
        if run is not None:
            backend = ScanBackend("mamba_ssm", "mamba_ssm imports", run)
        else:
            reason = f"mamba_ssm unavailable ({problem}); torch.compile chunked scan"
            backend = ScanBackend("compiled", reason, _compiled_scan())
    else:
        backend = ScanBackend(
            "reference", f"{device_type}: eager pure-torch chunked scan", ssd_chunked
        )
    logger.info("selective scan on %s: %s (%s)", device_type, backend.name, backend.reason)
    return backend


def _compiled_scan(backend: str = "inductor") -> ScanFn:
    """:func:`ssd_chunked` through ``torch.compile``; compiled on first call, not on choice.

    The time axis is padded here, outside the compiled region, to a whole number of chunks and
    at least two (see :func:`pad_to_chunks`): every length then reaches the compiled function
    as ``n * chunk_size`` with ``n >= 2``, contiguous and not a view (the mixer's ``x``, ``B``,
    ``C`` are strided views of one projection; passed as views on a whole-chunk length they were
    a second forward and backward), so one dynamic-shape graph serves them all.  Padding inside
    the graph specialised it on the pad (0, 1 and other pads are separate guards, as is a
    single chunk): up to five compilations of forward and backward for one training run."""

    def run(x, dt, A, B, C, *, chunk_size: int, seq_idx=None) -> torch.Tensor:
        check_shapes(x, dt, A, B, C, seq_idx)  # the caller's shapes in errors, not padded ones
        length = x.shape[1]
        x, dt, B, C, seq_idx = pad_to_chunks(x, dt, B, C, seq_idx, chunk_size)
        A = _own_contiguous(A)
        y = _compiled_ssd_chunked(backend)(x, dt, A, B, C, chunk_size=chunk_size, seq_idx=seq_idx)
        return y if y.shape[1] == length else y[:, :length]

    return run


def pad_to_chunks(x, dt, B, C, seq_idx, chunk_size: int):
    """The scan's inputs with the time axis padded to ``max(ceil(T / Q), 2) * Q`` the way
    :func:`ssd_chunked` pads internally (``dt = 0``: decay 1, no input; the last token's
    sequence): padding after the end changes no output of a real token.  Always contiguous,
    never a view."""
    b, length = x.shape[:2]
    padded = max(-(-length // chunk_size), 2) * chunk_size
    pad = padded - length
    if seq_idx is None:
        seq_idx = torch.zeros(b, length, dtype=torch.int64, device=x.device)
    seq_idx = _own_contiguous(seq_idx.to(torch.int64))  # one dtype and layout whatever the pad
    if pad == 0:  # contiguous as the padded copies are: a strided view is another graph
        return (*(_own_contiguous(t) for t in (x, dt, B, C)), seq_idx)
    last = seq_idx[:, -1:] if length else seq_idx.new_zeros(b, 1)
    return (
        torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)),
        torch.nn.functional.pad(dt, (0, 0, 0, pad)),
        torch.nn.functional.pad(B, (0, 0, 0, 0, 0, pad)),
        torch.nn.functional.pad(C, (0, 0, 0, 0, 0, pad)),
        torch.cat([seq_idx, last.expand(b, pad)], dim=1),
    )


def _own_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and not a view: dynamo guards a view input on its base's sizes, so a view
    in one call (``seq_idx[None]``) and a tensor of its own in the next was another graph (the GPU
    scan test's two tests).  Copies only what is still a view once contiguous."""
    t = t.contiguous()
    # inference mode tracks no views (_base is None): an offset into a larger storage is one too
    return t.clone() if t._base is not None or t.storage_offset() else t


@functools.cache
def _compiled_ssd_chunked(backend: str = "inductor") -> ScanFn:
    return torch.compile(ssd_chunked, dynamic=True, backend=backend)


def _mamba_ssm_scan() -> tuple[ScanFn | None, str]:
    """``mamba_ssm``'s fused chunked scan adapted to our signature, or ``(None, why not)``."""
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception as exc:  # ImportError, or a broken CUDA/Triton install failing at import
        return None, f"{type(exc).__name__}: {exc}"

    def run(x, dt, A, B, C, *, chunk_size: int, seq_idx: torch.Tensor | None) -> torch.Tensor:
        # dt arrives already softplus-ed and clamped; mamba_ssm wants int32 seq_idx [b, T].
        return mamba_chunk_scan_combined(
            x,
            dt,
            A.float(),
            B,
            C,
            chunk_size,
            seq_idx=None if seq_idx is None else seq_idx.to(torch.int32),
        )

    return run, ""
