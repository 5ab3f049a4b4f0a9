"""Fixtures of the health-page tests: a real headless Chromium driven over the DevTools protocol.

- ``browser`` (session): Debian's ``chromium`` started headless with a DevTools port on
  127.0.0.1 and a throwaway profile, stopped at the end.  A missing ``chromium`` FAILS the test
  with the fix (``apt-get install -y chromium``; ``.ci/run`` installs it): never a skip.
- ``browser.load(path) -> Loaded``: opens ``file://path`` in a new tab of 1280x900, waits for its
  load event, and returns ``Loaded(errors, text, png)``: every console error the page caused
  (``console.error``/``console.assert``, an uncaught exception, a log entry of level ``error``
  such as a failed request or a Content-Security-Policy violation), the page's visible text,
  and a PNG screenshot of the whole page.
"""

from __future__ import annotations

import base64
import itertools
import json
import re
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

CHROMIUM = ("chromium", "chromium-browser")  # Debian's name, and Ubuntu's (GitHub's hosted runners)
START_SECONDS = 60
LOAD_SECONDS = 30


@dataclass
class Loaded:
    errors: list[str]
    text: str
    png: bytes


class Browser:
    def __init__(self, ws_url: str):
        from websockets.sync.client import connect

        self.ws = connect(ws_url, max_size=64 * 1024 * 1024, open_timeout=START_SECONDS)
        self.ids = itertools.count(1)
        self.events: list[dict] = []

    def call(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        msg_id = next(self.ids)
        msg = {"id": msg_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        self.ws.send(json.dumps(msg))
        deadline = time.monotonic() + LOAD_SECONDS
        while time.monotonic() < deadline:
            reply = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)
        raise TimeoutError(method)

    def _drain(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            try:
                self.events.append(json.loads(self.ws.recv(timeout=left)))
            except TimeoutError:
                return

    def load(self, path: Path) -> Loaded:
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})[
            "sessionId"
        ]
        for domain in ("Runtime", "Log", "Page"):
            self.call(f"{domain}.enable", session=session)
        self.call("Emulation.setDeviceMetricsOverride",
                  {"width": 1280, "height": 900, "deviceScaleFactor": 1, "mobile": False}, session)  # fmt: skip
        self.events.clear()
        self.call("Page.navigate", {"url": Path(path).resolve().as_uri()}, session)
        deadline = time.monotonic() + LOAD_SECONDS
        while not any(
            ev.get("method") == "Page.loadEventFired" and ev.get("sessionId") == session
            for ev in self.events
        ):
            assert time.monotonic() < deadline, f"{path} did not load in {LOAD_SECONDS} s"
            self._drain(0.2)
        self._drain(0.5)  # late console messages
        text = self.call("Runtime.evaluate", {"expression": "document.body.innerText", "returnByValue": True},
                         session)["result"]["value"]  # fmt: skip
        shot = self.call(
            "Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}, session
        )
        self.call("Target.closeTarget", {"targetId": target})
        return Loaded(self._errors(session), text, base64.b64decode(shot["data"]))

    def _errors(self, session: str) -> list[str]:
        out = []
        for ev in self.events:
            if ev.get("sessionId") != session:
                continue
            method, params = ev.get("method"), ev.get("params", {})
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                out.append(
                    "console: "
                    + " ".join(
                        str(a.get("value", a.get("description", "")))
                        for a in params.get("args", [])
                    )
                )
            elif method == "Runtime.exceptionThrown":
                out.append("exception: " + str(params.get("exceptionDetails", {}).get("text")))
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                out.append("log: " + str(params["entry"].get("text")))
        return out


@pytest.fixture(scope="session")
def browser():
    exe = next(filter(None, map(shutil.which, CHROMIUM)), None)
    if exe is None:
        pytest.fail("chromium is not installed: `apt-get install -y chromium` (Debian's package; .ci/run "
                    "installs it). The health page is checked in a real browser, never skipped.")  # fmt: skip
    profile = tempfile.mkdtemp(prefix="mizzen-chromium-")
    proc = subprocess.Popen(
        [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--no-first-run", "--no-default-browser-check", "--remote-debugging-address=127.0.0.1",
         "--remote-debugging-port=0", f"--user-data-dir={profile}", "about:blank"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        deadline, seen = time.monotonic() + START_SECONDS, []
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                break
            seen.append(line)
            found = re.search(r"DevTools listening on (ws://\S+)", line)
            if found:  # from here on stderr is drained, so a chatty browser never blocks on it
                threading.Thread(target=proc.stderr.read, daemon=True).start()
                driver = Browser(found.group(1))
                yield driver
                driver.ws.close()
                return
        pytest.fail(f"chromium did not start its DevTools server: {''.join(seen[-20:])}")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(profile, ignore_errors=True)
