"""Shared fixtures of the rollout tests: embedded engine servers, started once per session.

The servers are real subprocesses (``python -m mizzen_rollout serve``) on 127.0.0.1; tests talk to
them over HTTP with the same client code that talks to SGLang.
"""

from __future__ import annotations

import pytest

from mizzen_rollout.engines.launcher import launch_embedded


@pytest.fixture(scope="session")
def embedded_server():
    """The default embedded engine: tiny random-weight llama, transformers generation."""
    server = launch_embedded(seed=0)
    yield server
    server.stop()
    server.cleanup_logs()


@pytest.fixture(scope="session")
def echo_servers():
    """Two instant-answer embedded servers (no model)."""
    servers = [launch_embedded(backend="echo") for _ in range(2)]
    yield servers
    for server in servers:
        server.stop()
        server.cleanup_logs()


@pytest.fixture(autouse=True)
def _isolated_masks():
    """Each test starts with the process-wide mask set as it was, and leaves it so: a secret one
    test registers does not mask another test's output."""
    try:
        from mizzen_rollout.masking import isolated_masks
    except ImportError:  # code from before the mask set (leak tests run against it fail there)
        yield
        return
    with isolated_masks():
        yield
