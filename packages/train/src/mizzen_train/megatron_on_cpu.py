"""Run megatron-core 0.19 on a CPU-only machine (tests, ``--tiny`` benchmarks, laptops).

megatron-core reaches for ``torch.cuda`` even when every tensor lives on the CPU: it allocates on
``torch.cuda.current_device()``, its DDP asks for ``torch.cuda.current_stream()`` before a grad
all-reduce, and its RNG tracker saves and restores the *CUDA* generator around dropout regions.
On a machine without a driver each of those calls initialises CUDA and fails.

:func:`install_megatron_cpu_shim` replaces exactly those entry points, process-wide:

- ``torch.cuda.current_device()`` returns ``"cpu"`` (so ``device=torch.cuda.current_device()``
  allocates on the CPU);
- ``torch.cuda.current_stream()`` returns a stream stand-in whose ``wait_*`` methods do nothing
  (CPU work is synchronous, so there is nothing to wait for);
- the "CUDA" RNG that megatron's tracker forks is a private CPU ``torch.Generator``; CPU kernels
  never draw from it, which is exact for dropout-free configurations (the only ones the CPU lane
  builds) and keeps megatron's bookkeeping of named RNG states intact.

Invariants:
- Opt-in and idempotent; importing this module changes nothing.
- Refuses to install when CUDA is available: on a GPU machine the real calls must run.
- Never initialises CUDA (``torch.cuda.is_available()`` does not).

Other megatron paths still hard-code ``device="cuda"`` (the pipeline schedules'
``total_num_tokens``, the dense attention's default causal mask): on the CPU the executor drives
micro-batches itself, and its packed attention never builds a mask (see
:mod:`mizzen_train.executor`, :mod:`mizzen_train.packed_attention`).
"""

from __future__ import annotations

import torch

_INSTALLED = False


class _CpuStream:
    """Stand-in for ``torch.cuda.Stream`` on the CPU: all work is already synchronous."""

    def wait_event(self, event: object) -> None:
        del event

    def wait_stream(self, stream: object) -> None:
        del stream

    def synchronize(self) -> None:
        pass


def install_megatron_cpu_shim() -> None:
    """Patch the ``torch.cuda`` entry points megatron-core uses so it runs on the CPU."""
    global _INSTALLED
    if _INSTALLED:
        return
    if torch.cuda.is_available():
        raise RuntimeError(
            "install_megatron_cpu_shim: CUDA is available on this machine; the shim would hide "
            "the real device. Use it only on CPU-only machines (tests on the CPU lane, --tiny)."
        )
    from megatron.core.tensor_parallel import random as mcore_random

    generator = torch.Generator()
    stream = _CpuStream()

    def get_rng_state(device: object = "cuda") -> torch.Tensor:
        del device
        return generator.get_state()

    def set_rng_state(state: torch.Tensor, *args: object, **kwargs: object) -> None:
        del args, kwargs
        generator.set_state(state)

    def manual_seed(seed: int) -> None:
        generator.manual_seed(int(seed))

    def get_tracker_state(*args: object, **kwargs: object) -> torch.Tensor:
        del args, kwargs
        return generator.get_state()

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.current_stream = lambda *args, **kwargs: stream
    torch.cuda.get_rng_state = get_rng_state
    torch.cuda.set_rng_state = set_rng_state
    torch.cuda.manual_seed = manual_seed
    torch.cuda.manual_seed_all = manual_seed
    mcore_random._get_cuda_rng_state = get_tracker_state
    mcore_random._set_cuda_rng_state = set_rng_state
    _INSTALLED = True
