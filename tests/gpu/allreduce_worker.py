"""A 2-process all-reduce: this file is both the worker script and the function that starts it.

A plain module (not a test file): ``tests/gpu/conftest.py`` loads it by path and hands it to
tests as the ``allreduce`` fixture.  ``run_workers(backend, device_kind)`` starts this very file
twice as a script (``python allreduce_worker.py --rank R --port P ...``); each process joins a
process group over TCP on 127.0.0.1 and all-reduces a rank-dependent float32 tensor and a
seeded random one, and prints what it saw as one JSON line.  The GPU lane runs it with
``("nccl", "cuda")`` (``test_nccl_allreduce.py``: rank R takes GPU R of the two it sees), the CPU
lane with ``("gloo", "cpu")`` (``test_gpu_tests_on_cpu.py``), so only the NCCL transport is
GPU-only.

Invariants:
- The workers are real processes started from a script (no fork, no multiprocessing): what a
  launcher such as torchrun does, and the only start that CUDA allows.
- NVLink SHARP (NVLS) is off (``NCCL_NVLS_ENABLE=0``): multicast objects are not available on
  every host the lane runs on.
- A worker that fails, exits non-zero or outlives ``WORKER_TIMEOUT_S`` fails ``run_workers``
  with its rank and the tail of its stderr; on a timeout every worker is killed.
- The script needs only torch: no test module, no workspace package.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

WORLD = 2
WORKER_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, world: int, port: int, backend: str, device_kind: str) -> dict:
    """One rank: all-reduce a rank-dependent float32 and a random tensor; return what it saw."""
    import torch
    import torch.distributed as dist

    device = torch.device(device_kind, rank) if device_kind == "cuda" else torch.device("cpu")
    if device_kind == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    try:
        ones = torch.full((4096,), float(rank + 1), device=device)
        dist.all_reduce(ones)
        gen = torch.Generator().manual_seed(100 + rank)
        mine = torch.randn(1024, generator=gen)
        expected = sum(
            torch.randn(1024, generator=torch.Generator().manual_seed(100 + r))
            for r in range(world)
        )
        summed = mine.to(device)
        dist.all_reduce(summed)
        dist.barrier()
        return {
            "rank": rank,
            "device": str(summed.device),
            "ones_min": float(ones.min()),
            "ones_max": float(ones.max()),
            "max_error": float((summed.cpu() - expected).abs().max()),
        }
    finally:
        dist.destroy_process_group()


def run_workers(backend: str, device_kind: str) -> list[dict]:
    """Start ``WORLD`` copies of this file as workers; their results, by rank."""
    port = free_port()
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "--rank",
                str(r),
                "--port",
                str(port),
                "--backend",
                backend,
                "--device",
                device_kind,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(WORLD)
    ]
    results, failures = [], []
    for r, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=WORKER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, err = p.communicate()
            failures.append(f"rank {r} timed out after {WORKER_TIMEOUT_S} s:\n{err[-3000:]}")
            continue
        if p.returncode != 0:
            failures.append(f"rank {r} exited {p.returncode}:\n{err[-3000:]}")
            continue
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert not failures, "\n".join(failures)
    return sorted(results, key=lambda d: d["rank"])


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backend", default="nccl")
    parser.add_argument("--device", default="cuda")
    a = parser.parse_args()
    print(json.dumps(worker(a.rank, WORLD, a.port, a.backend, a.device)))
