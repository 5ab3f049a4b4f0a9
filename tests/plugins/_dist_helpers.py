"""Run a function of a test file in N spawned processes joined by torch.distributed.

Not a test module (no registration needed).  Usage from a test file::

    sys.path.insert(0, str(Path(__file__).parent))
    import _dist_helpers
    _dist_helpers.run_distributed(__file__, "check_something", world_size=2, backend="gloo")

The child processes load ``target_file`` by path (pytest's importlib mode makes test modules
unimportable by name) and call ``func(rank, world_size, *args)`` after ``init_process_group``.
A failure in any rank fails the caller with that rank's traceback.  NCCL runs pin rank ``r`` to
``cuda:r`` and disable NVLink SHARP (``NCCL_NVLS_ENABLE=0``).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from pathlib import Path


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load(target_file: str):
    name = "_dist_target_" + Path(target_file).stem
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, target_file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _worker(rank, world_size, backend, port, target_file, func_name, args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        getattr(_load(target_file), func_name)(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_distributed(
    target_file: str, func_name: str, *args, world_size: int = 2, backend: str = "gloo"
) -> None:
    import torch.multiprocessing as mp

    if backend == "nccl":
        os.environ["NCCL_NVLS_ENABLE"] = "0"
    mp.spawn(
        _worker,
        args=(world_size, backend, _free_port(), str(target_file), func_name, args),
        nprocs=world_size,
        join=True,
    )
