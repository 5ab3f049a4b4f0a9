"""Start engine servers as subprocesses and wait until they are healthy.

- :func:`launch_embedded`: ``python -m mizzen_rollout serve`` (the embedded engine) on 127.0.0.1,
  on a port the server picks and reports through a port file.
- :func:`launch_sglang`: ``python -m sglang.launch_server`` where sglang is installed (GPU images);
  sglang is never a dependency of mizzen and is never imported here.

Invariants:
- A launch either returns a :class:`ServerProcess` whose ``GET /health`` answered 200 before the
  deadline, or raises :class:`LaunchError` with the command, the reason and the tail of the
  server's log, after stopping the process (nothing is left running on failure).
- The embedded server is started with ``--parent-pid`` of the launching process, so it exits when
  its launcher dies (e.g. a killed Ray engine worker).
- Server output goes to a log file (never an unread pipe that could fill and block the server).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from . import protocol

__all__ = [
    "LaunchError",
    "ServerProcess",
    "find_free_port",
    "launch_embedded",
    "launch_sglang",
    "sglang_available",
]


class LaunchError(RuntimeError):
    """An engine server did not become healthy; the message has the command and its log tail."""


def find_free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def sglang_available(python: str | None = None) -> bool:
    """Whether ``sglang`` can be imported by ``python`` (default: this interpreter)."""
    if python is None or os.path.realpath(python) == os.path.realpath(sys.executable):
        return importlib.util.find_spec("sglang") is not None
    probe = subprocess.run(
        [
            python,
            "-c",
            "import importlib.util,sys; sys.exit(importlib.util.find_spec('sglang') is None)",
        ],
        capture_output=True,
    )
    return probe.returncode == 0


class ServerProcess:
    """A launched engine server: its URL, process and log."""

    def __init__(
        self,
        *,
        url: str | None,
        process: subprocess.Popen,
        log_path: Path,
        command: Sequence[str],
        port_file: Path | None = None,
    ):
        self.url = url
        self.process = process
        self.log_path = log_path
        self.command = list(command)
        self.port_file = port_file

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def _fail(self, reason: str) -> LaunchError:
        tail = self.log_tail()
        self.stop()
        return LaunchError(
            f"engine server did not become healthy: {reason}\n  command: "
            f"{' '.join(self.command)}\n  log ({self.log_path}):\n{tail}"
        )

    def wait_healthy(self, deadline_s: float) -> None:
        """Block until ``GET /health`` answers 200, the process exits, or the deadline passes."""
        end = time.monotonic() + deadline_s
        port_file = self.port_file
        while self.url is None:
            if not self.alive:
                raise self._fail(f"the process exited with code {self.process.returncode}")
            if port_file is not None and port_file.exists():
                self.url = port_file.read_text(encoding="utf-8").strip()
                break
            if time.monotonic() > end:
                raise self._fail(f"no port reported within {deadline_s:.0f} s")
            time.sleep(0.05)
        with httpx.Client(timeout=2.0) as client:
            while True:
                if not self.alive:
                    raise self._fail(f"the process exited with code {self.process.returncode}")
                try:
                    if client.get(self.url + protocol.HEALTH_PATH).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > end:
                    raise self._fail(f"/health did not answer 200 within {deadline_s:.0f} s")
                time.sleep(0.1)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate (then kill) the server; idempotent."""
        if self.alive:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout_s)

    def cleanup_logs(self) -> None:
        shutil.rmtree(self.log_path.parent, ignore_errors=True)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.cleanup_logs()


def _spawn(command: Sequence[str], log_dir: Path, env: dict[str, str] | None) -> tuple:
    log_path = log_dir / "server.log"
    log = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 (handed to the child)
    try:
        process = subprocess.Popen(
            list(command),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    finally:
        log.close()
    return process, log_path


def launch_embedded(
    *,
    model_path: str | None = None,
    seed: int = 0,
    backend: str = "transformers",
    host: str = "127.0.0.1",
    port: int = 0,
    deadline_s: float = 180.0,
    watch_parent: bool = True,
    num_threads: int = 1,
    python: str | None = None,
    env: dict[str, str] | None = None,
    wait: bool = True,
    device: str = "cpu",
    load_dirs: Sequence[str] = (),
    read_timeout_s: float | None = None,
) -> ServerProcess:
    """Start the embedded engine (``mizzen-rollout serve``) and wait for it to be healthy.

    ``load_dirs``: where it may load weights and adapters from (default: the directory holding
    ``model_path``); ``read_timeout_s``: its deadline for a request's head and body."""
    log_dir = Path(tempfile.mkdtemp(prefix="mizzen-rollout-serve-"))
    port_file = log_dir / "url"
    command = [
        python or sys.executable,
        "-m",
        "mizzen_rollout",
        "serve",
        "--host",
        host,
        "--port",
        str(port),
        "--port-file",
        str(port_file),
        "--seed",
        str(seed),
        "--backend",
        backend,
        "--num-threads",
        str(num_threads),
    ]
    if device != "cpu":
        command += ["--device", device]
    if model_path is not None:
        command += ["--model", model_path]
    for directory in load_dirs:
        command += ["--load-dir", str(directory)]
    if read_timeout_s is not None:
        command += ["--read-timeout", str(read_timeout_s)]
    if watch_parent:
        command += ["--parent-pid", str(os.getpid())]
    process, log_path = _spawn(command, log_dir, env)
    server = ServerProcess(
        url=None, process=process, log_path=log_path, command=command, port_file=port_file
    )
    if wait:
        server.wait_healthy(deadline_s)
    return server


async def await_healthy(server: ServerProcess, deadline_s: float) -> None:
    """Async wrapper of :meth:`ServerProcess.wait_healthy` (runs it in a thread)."""
    await asyncio.to_thread(server.wait_healthy, deadline_s)


def launch_sglang(
    model_path: str,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    extra_args: Sequence[str] = (),
    deadline_s: float = 900.0,
    python: str | None = None,
    env: dict[str, str] | None = None,
    wait: bool = True,
) -> ServerProcess:
    """Start ``python -m sglang.launch_server`` and wait for ``/health`` (GPU images only)."""
    python = python or sys.executable
    if not sglang_available(python):
        raise LaunchError(
            f"sglang is not importable by {python}; it lives in GPU images only (it is never in "
            "mizzen's lock). Start SGLang there and pass --engine-url, or run the embedded engine."
        )
    port = port or find_free_port(host)
    command = [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_path,
        "--host",
        host,
        "--port",
        str(port),
        *extra_args,
    ]
    log_dir = Path(tempfile.mkdtemp(prefix="mizzen-rollout-sglang-"))
    process, log_path = _spawn(command, log_dir, env)
    server = ServerProcess(
        url=f"http://{host}:{port}", process=process, log_path=log_path, command=command
    )
    if wait:
        server.wait_healthy(deadline_s)
    return server


@contextlib.contextmanager
def embedded_server(**kwargs):
    """``with embedded_server() as server: ...`` — launch, yield, stop and clean up."""
    server = launch_embedded(**kwargs)
    try:
        yield server
    finally:
        server.stop()
        server.cleanup_logs()
