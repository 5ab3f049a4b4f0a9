"""Fixtures of the ``mizzen-train serve`` tests: a real server process on 127.0.0.1 (the tiny
Llama on CPU, the embedded engine for sampling) driven by the official ``tinker`` SDK, unmodified.

- ``serve_kit`` (module scope): one server per test module, started with the module's
  ``SERVE_OVERRIDES`` (``--set`` items) when it has them; ``kit.client(tenant)`` is an SDK
  ``ServiceClient`` holding that tenant's key; ``kit.restart(**overrides)`` stops the server
  and starts it again on the same state directory (``--set`` overrides, e.g. a small queue).
- Keys live in a file (mode 0600) under the module's temporary directory; no key is passed on
  a command line.

Invariant: every server this file starts is stopped by the fixture (SIGINT, then SIGKILL after
a grace period), so a failing test leaves no process behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

KEYS = {
    "alice": "tml-alice-000000000000000000000001",
    "bob": "tml-bob-00000000000000000000000002",
    "carol": "tml-carol-000000000000000000000003",
    "dave": "tml-dave-0000000000000000000000004",
}
BASE_MODEL = "tiny-llama"


class ServeKit:
    """One ``mizzen-train serve`` process and SDK clients for its tenants."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.state_dir = root / "state"
        self.keys_file = root / "keys"
        self.keys_file.write_text("".join(f"{t} {k}\n" for t, k in KEYS.items()))
        os.chmod(self.keys_file, 0o600)
        self.config = root / "serve.toml"
        self.config.write_text(
            "[server]\n"
            f'state_dir = "{self.state_dir}"\n'
            f'api_keys_file = "{self.keys_file}"\n'
            "port = 0\n"
            f'port_file = "{root / "url"}"\n'
            "long_poll_s = 2.0\n"
            "[model]\n"
            'path = "tiny"\n'
            f'name = "{BASE_MODEL}"\n'
            "slots = 8\n"
            "max_rank = 8\n"
            "seq_bucket = 16\n"
            "threads = 1\n"  # an idle OpenMP worker spins: one thread is faster on a busy box
            "[model.tiny]\n"
            "initializer_range = 0.2\n"  # logits that can peak: LoRA leaves the unembedding as is
        )
        self.process: subprocess.Popen | None = None
        self.started_by = 0  # the pid of the process that started ``process``

    # The server's state lives in files under ``root``, not in this object: the SDK tests' bodies
    # run in forked children (``pytest.mark.in_child``), and a server one of them restarts must be
    # the one the next test talks to and the fixture's teardown stops.

    @property
    def url(self) -> str:
        return (self.root / "url").read_text().strip()

    @property
    def launches(self) -> int:
        return len(list(self.root.glob("server-*.log")))

    def start(self, *overrides: str) -> None:
        (self.root / "url").unlink(missing_ok=True)
        launch = self.launches + 1
        args = [sys.executable, "-m", "mizzen_train", "serve", "--config", str(self.config)]
        for item in overrides:
            args += ["--set", item]
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false")
        with open(self.root / f"server-{launch}.log", "w") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.started_by = os.getpid()  # a forked test body's copy of this object is not it
        (self.root / "pid").write_text(str(self.process.pid))
        deadline = time.monotonic() + 240
        while not (self.root / "url").exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"server did not start:\n{self.log()[-4000:]}")
            time.sleep(0.2)

    def log(self) -> str:
        return (self.root / f"server-{self.launches}.log").read_text(errors="replace")

    def stop(self) -> None:
        """Stop the current server, whichever process started it (SIGINT, then SIGKILL)."""
        mine = self.process is not None and self.started_by == os.getpid()
        if mine and self.process.pid == self._current_pid():  # a child of this very process
            self._stop_child(self.process)
        elif (pid := self._current_pid()) is not None:  # started by a forked test body
            _stop_pid(pid)
        (self.root / "pid").unlink(missing_ok=True)

    def _current_pid(self) -> int | None:
        path = self.root / "pid"
        return int(path.read_text()) if path.exists() else None

    @staticmethod
    def _stop_child(process: subprocess.Popen) -> None:
        if process.poll() is not None:
            return
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)

    def restart(self, *overrides: str) -> None:
        self.stop()
        self.start(*overrides)

    def client(self, tenant: str):
        import tinker

        return tinker.ServiceClient(base_url=self.url, api_key=KEYS[tenant])

    def headers(self, tenant: str) -> dict[str, str]:
        return {"X-API-Key": KEYS[tenant]}

    def unload(self, tenant: str, *training_clients) -> None:
        """Free the clients' slots (the SDK has no unload call; the server's endpoint does it)."""
        import httpx

        for training in training_clients:
            response = httpx.post(
                f"{self.url}/api/v1/unload_model", headers=self.headers(tenant),
                json={"model_id": training.model_id}, timeout=30,
            )  # fmt: skip
            assert response.status_code == 200, response.text
            request_id = response.json()["request_id"]
            while True:
                done = httpx.post(
                    f"{self.url}/api/v1/retrieve_future", headers=self.headers(tenant),
                    json={"request_id": request_id}, timeout=30,
                ).json()  # fmt: skip
                if done.get("type") != "try_again":
                    assert done.get("type") == "unload_model", done
                    break


def _stop_pid(pid: int) -> None:
    """Stop a server this process did not start (no child of ours: it cannot be waited for)."""
    try:
        os.kill(pid, signal.SIGINT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not _exited(pid):
            time.sleep(0.1)
        if not _exited(pid):
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _exited(pid: int) -> bool:
    """Gone, or a zombie (it exited; its parent, maybe the pytest process, has not reaped it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat[stat.rfind(")") + 2] in "ZX"


@pytest.fixture(scope="module")
def serve_kit(tmp_path_factory, request):
    """The module's server, started with the module's ``SERVE_OVERRIDES`` (``--set`` items; a
    module that needs other limits gets them at the first start, not by a second one)."""
    kit = ServeKit(tmp_path_factory.mktemp("serve"))
    kit.start(*getattr(request.module, "SERVE_OVERRIDES", ()))
    try:
        yield kit
    finally:
        kit.stop()
