"""The retry classifier's table: infrastructure failures get one retry, test failures never."""

from __future__ import annotations

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.lane.retry import RULES, classify

register_cpu_ci(est_time=2, labels=["ci", "gpu-lane"])

NCCL_WATCHDOG = (
    "[rank1]:[E1130 06:12:00.123456 ProcessGroupNCCL.cpp:632] [Rank 1] Watchdog caught "
    "collective operation timeout: WorkNCCL(SeqNum=3, OpType=ALLREDUCE, NumelIn=4096, "
    "NumelOut=4096, Timeout(ms)=600000) ran for 600123 milliseconds before timing out."
)
EADDRINUSE = (
    "torch.distributed.DistNetworkError: The server socket has failed to listen on any local "
    "network address. port: 29500, useIPv6: false, code: -98, name: EADDRINUSE, message: "
    "address already in use"
)
RENDEZVOUS = (
    "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError: rendezvous timed out "
    "after 900 s"
)
DEVICE_BUSY = (
    "E       RuntimeError: CUDA error: CUDA-capable device(s) is/are busy or unavailable\n"
    "E       CUDA kernel errors might be asynchronously reported at some other API call"
)
ASSERTION = (
    "    def test_sum():\n>       assert total == 3\nE       assert 2 == 3\n"
    "tests/gpu/test_x.py:12: AssertionError"
)
PYTEST_TIMEOUT = "E   Failed: Timeout >900.0s"
PLAIN_ERROR = "E       RuntimeError: shape mismatch: [4, 8] vs [8, 4]"

CASES = [
    # (output, class, retried)
    (NCCL_WATCHDOG, "nccl-timeout", True),
    ("RuntimeError: NCCL communicator was aborted: timed out after 1800 s", "nccl-timeout", True),
    (EADDRINUSE, "rendezvous", True),
    (RENDEZVOUS, "rendezvous", True),
    (DEVICE_BUSY, "cuda-device-unavailable", True),
    (
        "RuntimeError: CUDA driver initialization failed, you might not have a CUDA gpu.",
        "cuda-device-unavailable",
        True,
    ),
    (
        "mizzen: GPU lease timeout: waited 1800 s for 2 GPU(s) leased by another lane",
        "lease-timeout",
        True,
    ),
    (ASSERTION, "assertion", False),
    ("E       AssertionError: losses differ", "assertion", False),
    ("FAILED tests/gpu/test_x.py::test_y - AssertionError: no", "assertion", False),
    (PYTEST_TIMEOUT, "test-timeout", False),
    (
        "+++++++++++++++++++++++++++++++++++ Timeout ++++++++++++++++++++++++++++++++++++",
        "test-timeout",
        False,
    ),
    (PLAIN_ERROR, "test-failure", False),
    ("", "test-failure", False),
    # a test that asserted AND logged an NCCL timeout is a real failure: no retry
    (NCCL_WATCHDOG + "\n" + ASSERTION, "assertion", False),
    # pytest-timeout firing inside a collective: the test's own timeout wins, no retry
    (PYTEST_TIMEOUT + "\n" + NCCL_WATCHDOG, "test-timeout", False),
]


@pytest.mark.parametrize(("output", "klass", "retry"), CASES)
def test_the_table(output: str, klass: str, retry: bool):
    c = classify(output)
    assert (c.name, c.retry) == (klass, retry)
    if klass != "test-failure":
        assert c.evidence and c.evidence in output  # the line that decided it


def test_the_lanes_own_timeout_is_never_retried_whatever_the_output_says():
    c = classify(NCCL_WATCHDOG, timed_out=True)
    assert (c.name, c.retry) == ("test-timeout", False)


def test_only_the_infrastructure_classes_retry_and_non_retry_rules_come_first():
    assert {r.name for r in RULES if r.retry} == {
        "nccl-timeout",
        "rendezvous",
        "cuda-device-unavailable",
        "lease-timeout",
    }
    retry_flags = [r.retry for r in RULES]
    assert retry_flags == sorted(retry_flags)  # every "never retry" rule precedes every retry rule
