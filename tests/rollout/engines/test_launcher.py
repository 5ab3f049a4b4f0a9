"""The launcher: healthy embedded servers, clear errors (with the log tail) when a server cannot
start, and no process left behind."""

from __future__ import annotations

import os
import time

import httpx
import pytest

from mizzen_ci import register_cpu_ci
from mizzen_rollout.engines.launcher import (
    LaunchError,
    launch_embedded,
    launch_sglang,
    sglang_available,
)

register_cpu_ci(est_time=12, labels=["engine"])


def test_echo_server_lifecycle_and_model_info():
    server = launch_embedded(backend="echo", deadline_s=60)
    try:
        assert server.alive and server.url.startswith("http://127.0.0.1:")
        info = httpx.get(server.url + "/get_model_info", timeout=5).json()
        assert info["is_generation"] is True and "echo" in info["model_path"]
        assert httpx.post(server.url + "/nope", json={}, timeout=5).status_code == 404
    finally:
        server.stop()
        server.cleanup_logs()
    assert not server.alive


def test_a_server_that_cannot_start_raises_with_its_log_and_is_stopped():
    with pytest.raises(LaunchError) as info:
        launch_embedded(backend="echo", model_path="/no/such/model", deadline_s=60)
    message = str(info.value)
    assert "the process exited with code 2" in message
    assert "--model /no/such/model: no such directory" in message  # the server's own log
    assert "command: " in message and "mizzen_rollout serve" in message


def test_the_embedded_server_exits_when_its_parent_dies(tmp_path):
    # A parent process that launches a server, prints its pid, then dies without stopping it.
    import subprocess
    import sys

    script = (
        "from mizzen_rollout.engines.launcher import launch_embedded\n"
        "s = launch_embedded(backend='echo', deadline_s=60)\n"
        "print(s.pid, flush=True)\n"
        "import os; os._exit(0)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=90
    )
    server_pid = int(proc.stdout.strip())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(server_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(server_pid, 9)
        pytest.fail("the orphaned embedded server kept running")


def test_sglang_launcher_explains_where_sglang_lives():
    # CPU images never hold sglang (DESIGN.md); the launcher must say where it lives.
    assert not sglang_available()
    with pytest.raises(LaunchError, match=r"sglang is not importable .* GPU images only"):
        launch_sglang("some/model")
