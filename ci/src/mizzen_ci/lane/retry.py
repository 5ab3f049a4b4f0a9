"""Which failed test-file runs are infrastructure failures worth one retry: a small pattern table.

Invariants:
- One table, :data:`RULES`, read top to bottom; the first rule whose pattern occurs in the output
  decides.  Rules that forbid a retry come first, so a run that both failed an assertion and
  logged an NCCL timeout is *not* retried.
- Only the classes marked ``retry=True`` are retried (NCCL or rendezvous timeout, CUDA device
  unavailable, GPU lease timeout), once, by re-running the file's process with a fresh timeout.
  A timeout of the test itself (the lane's per-file timeout, or pytest-timeout's) and an
  assertion error are never retried; neither is anything the table does not recognise.
- Retrying at the process level, not with pytest-rerunfailures, keeps pytest-timeout's budget
  intact on the second run (a rerun inside one pytest process after a timeout runs with none).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TEST_TIMEOUT = "test-timeout"
LEASE_TIMEOUT = "lease-timeout"
NOT_INFRA = "test-failure"


@dataclass(frozen=True)
class Rule:
    name: str
    retry: bool
    pattern: re.Pattern[str]
    meaning: str


def _rule(name: str, retry: bool, pattern: str, meaning: str) -> Rule:
    return Rule(name, retry, re.compile(pattern, re.MULTILINE), meaning)


RULES: tuple[Rule, ...] = (
    _rule(
        TEST_TIMEOUT,
        False,
        r"^E?\s*Failed: Timeout >|^\+{5,} Timeout \+{5,}$|^mizzen: the test file timed out",
        "the test itself ran out of time (pytest-timeout or the lane's per-file timeout)",
    ),
    _rule(
        "assertion",
        False,
        r"^E\s+(AssertionError\b|assert\b)|^AssertionError\b|^FAILED \S+ - (AssertionError|assert)\b",
        "an assertion failed: a real test failure",
    ),
    _rule(
        "nccl-timeout",
        True,
        r"Watchdog caught collective operation timeout"
        r"|NCCL[^\n]{0,200}\b(timed out|timeout|Timeout)\b"
        r"|\b(timed out|Timeout)\b[^\n]{0,200}\bNCCL\b",
        "an NCCL collective or communicator timed out",
    ),
    _rule(
        "rendezvous",
        True,
        r"RendezvousTimeoutError|RendezvousConnectionError|DistNetworkError"
        r"|[Rr]endezvous[^\n]{0,200}\b(timed out|timeout)\b"
        r"|(EADDRINUSE|[Aa]ddress already in use)",
        "the process group could not rendezvous (timeout or a port already taken)",
    ),
    _rule(
        "cuda-device-unavailable",
        True,
        r"CUDA-capable device\(s\) (is|are)[^\n]{0,20}busy or unavailable"
        r"|all CUDA-capable devices are busy or unavailable"
        r"|cudaErrorDevicesUnavailable|CUDA_ERROR_DEVICE_UNAVAILABLE"
        r"|CUDA driver initialization failed",
        "the GPU was busy or unavailable when the test started",
    ),
    _rule(
        LEASE_TIMEOUT,
        True,
        r"^mizzen: GPU lease timeout",
        "the lane waited too long for GPUs leased by another lane on the host",
    ),
)


@dataclass(frozen=True)
class Classification:
    name: str
    retry: bool
    evidence: str  # the line that matched, or why nothing did


def classify(output: str, *, timed_out: bool = False) -> Classification:
    """Classify a failed run from its output; ``timed_out`` when the lane killed it."""
    if timed_out:
        return Classification(TEST_TIMEOUT, False, "killed by the lane's per-file timeout")
    for rule in RULES:
        m = rule.pattern.search(output)
        if m:
            start = output.rfind("\n", 0, m.start()) + 1
            end = output.find("\n", m.end())
            line = output[start : end if end != -1 else len(output)].strip()
            return Classification(rule.name, rule.retry, line[:300])
    return Classification(NOT_INFRA, False, "no infrastructure pattern matched")
