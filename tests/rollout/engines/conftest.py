"""Fixtures of the engine tests: the pinned SGLang wheel (for the contract test) and an embedded
server with short limits (for the HTTP cases and the schema fuzzing).

- ``sglang_wheel``: the path of SGLang's wheel, downloaded once from PyPI with ``pip download``
  into ``~/.cache/mizzen/wheels`` (``$XDG_CACHE_HOME/mizzen/wheels``) and checked against the
  sha256 pinned here.  A failed download or a different file FAILS the test (never a skip): the
  contract is only as good as the wheel it reads.  Pre-fill the cache on a machine without PyPI
  with the same ``pip download`` command.
- ``limited_server``: the tiny-model embedded engine, read timeout 2 s, load directory
  ``<tmp>/loadable`` (``outside`` beside it exists and is not loadable).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from mizzen_rollout.engines.launcher import ServerProcess, launch_embedded

#: The SGLang release the embedded engine's shapes are pinned to, and its wheel's sha256 (the
#: CPython 3.12 x86-64 manylinux wheel: the one file whatever machine downloads it).
SGLANG_VERSION = "0.5.23"
SGLANG_WHEEL = f"sglang-{SGLANG_VERSION}-cp312-cp312-manylinux_2_34_x86_64.whl"
SGLANG_WHEEL_SHA256 = "8d257a319395b322bb1be327d05e5528859358153c8563b04c0a4a3c8af164b6"
PIP_DOWNLOAD_ARGS = [
    "download", f"sglang=={SGLANG_VERSION}", "--no-deps", "--only-binary=:all:",
    "--platform", "manylinux_2_34_x86_64", "--python-version", "3.12",
    "--implementation", "cp", "--abi", "cp312", "--disable-pip-version-check", "--quiet",
]  # fmt: skip


def wheel_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mizzen" / "wheels"


def _pip() -> list[str]:
    """A pip to download with: this interpreter's, the one its venv was made from (CI's
    python3.12, which installed nox with pip), or pip run by uv."""
    if importlib.util.find_spec("pip") is not None:
        return [sys.executable, "-m", "pip"]
    base = getattr(sys, "_base_executable", None)
    if (
        base
        and subprocess.run([base, "-m", "pip", "--version"], capture_output=True).returncode == 0
    ):
        return [base, "-m", "pip"]
    uv = shutil.which("uv")
    if uv:
        return [uv, "tool", "run", "--from", "pip", "pip"]
    pytest.fail("no pip to download the SGLang wheel with (none in this venv or its base, no uv)")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@pytest.fixture(scope="session")
def sglang_wheel() -> Path:
    cache = wheel_cache()
    target = cache / SGLANG_WHEEL
    if target.is_file() and _sha256(target) == SGLANG_WHEEL_SHA256:
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        command = [*_pip(), *PIP_DOWNLOAD_ARGS, "-d", tmp]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
        got = Path(tmp) / SGLANG_WHEEL
        if proc.returncode != 0 or not got.is_file():
            pytest.fail(
                f"could not download {SGLANG_WHEEL} from PyPI ({' '.join(command)} exited "
                f"{proc.returncode}): {proc.stderr[-1500:]}\nFix: let this machine reach PyPI, or "
                f"put the wheel in {cache}"
            )
        digest = _sha256(got)
        if digest != SGLANG_WHEEL_SHA256:
            pytest.fail(
                f"{SGLANG_WHEEL} from PyPI has sha256 {digest}, not the pinned "
                f"{SGLANG_WHEEL_SHA256}: a different file; the contract test refuses to read it"
            )
        os.replace(got, target)
    return target


@dataclass(frozen=True)
class LimitedServer:
    server: ServerProcess
    loadable: Path  # the server's one load directory
    outside: Path  # an existing directory beside it, not loadable
    read_timeout_s: float

    @property
    def url(self) -> str:
        return self.server.url


@pytest.fixture(scope="session")
def limited_server(tmp_path_factory) -> LimitedServer:
    root = tmp_path_factory.mktemp("load-dirs")
    (root / "loadable").mkdir()
    (root / "outside").mkdir()
    server = launch_embedded(seed=0, load_dirs=[str(root / "loadable")], read_timeout_s=2.0)
    yield LimitedServer(server, root / "loadable", root / "outside", 2.0)
    server.stop()
    server.cleanup_logs()
