"""Fixtures of the ``mizzen-train serve`` tests: a real server process on 127.0.0.1 (the tiny
Llama on CPU, the embedded engine for sampling) driven by the official ``tinker`` SDK, unmodified.

- ``serve_kit`` (module scope): one server per test module; ``kit.client(tenant)`` is an SDK
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
        self.url = ""
        self.launches = 0

    def start(self, *overrides: str) -> None:
        (self.root / "url").unlink(missing_ok=True)
        self.launches += 1
        args = [sys.executable, "-m", "mizzen_train", "serve", "--config", str(self.config)]
        for item in overrides:
            args += ["--set", item]
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false")
        with open(self.root / f"server-{self.launches}.log", "w") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 240
        while not (self.root / "url").exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"server did not start:\n{self.log()[-4000:]}")
            time.sleep(0.2)
        self.url = (self.root / "url").read_text().strip()

    def log(self) -> str:
        return (self.root / f"server-{self.launches}.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)

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


@pytest.fixture(scope="module")
def serve_kit(tmp_path_factory):
    kit = ServeKit(tmp_path_factory.mktemp("serve"))
    kit.start()
    try:
        yield kit
    finally:
        kit.stop()
