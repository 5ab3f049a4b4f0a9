"""A 2-process NCCL all-reduce on the 2 GPUs the lane leases to this file.

The ``allreduce`` fixture (``tests/gpu/allreduce_worker.py``) starts its worker script twice
(``python allreduce_worker.py --rank R ...``): each process takes GPU R of the two it sees, joins
a process group over TCP on 127.0.0.1 and checks an all-reduce against the sum computed on the
host.  NVLink SHARP (NVLS) is off (``NCCL_NVLS_ENABLE=0``): multicast objects are not available
on every host the lane runs on.  The same workers run with ``("gloo", "cpu")`` in the CPU lane
(tests/gpu/test_gpu_tests_on_cpu.py), so only the NCCL transport is GPU-only.
"""

from __future__ import annotations

from mizzen_ci import register_cuda_ci

register_cuda_ci(
    est_time=90, hardware=["hopper", "blackwell"], num_gpus=2, labels=["gpu-lane", "distributed"]
)


def test_two_process_nccl_all_reduce_sums_across_both_gpus(allreduce):
    import torch

    assert torch.cuda.device_count() == allreduce.WORLD
    results = allreduce.run_workers("nccl", "cuda")
    assert [r["device"] for r in results] == ["cuda:0", "cuda:1"]
    for r in results:
        assert r["ones_min"] == r["ones_max"] == sum(range(1, allreduce.WORLD + 1))
        assert r["max_error"] <= 1e-5
