"""Reading CUDA allocated memory once asynchronous frees have landed.

``torch.cuda.memory_allocated()`` read right after tensors are dropped can still count them: a
tensor last used by a collective on another stream is released by the caching allocator only
after that stream's event completed *and* the allocator next processed its events, and
ProcessGroupNCCL may keep a collective's inputs alive until its watchdog retires the work.

:func:`settled_allocated_bytes` synchronises the device, nudges the allocator to process its
pending events and, when an expected value is given, polls briefly until the count reaches it.

Invariant: it never frees or caches anything itself (no ``empty_cache``); it only waits.
"""

from __future__ import annotations

import gc
import time

import torch


def settled_allocated_bytes(expected: int | None = None, *, timeout_s: float = 3.0) -> int:
    """``torch.cuda.memory_allocated()`` after pending frees; waits up to ``timeout_s`` for
    ``expected`` (returning the last reading if it is not reached)."""
    deadline = time.monotonic() + timeout_s
    while True:
        gc.collect()
        torch.cuda.synchronize()
        torch.empty(1, device="cuda")  # an allocation makes the allocator process its events
        allocated = torch.cuda.memory_allocated()
        if expected is None or allocated == expected or time.monotonic() > deadline:
            return allocated
        time.sleep(0.05)
