"""Shared fixtures of the mizzen_ci tests: where the repository is, and mizzen-ci as a subprocess.

- ``repo_root``: the checkout these tests belong to; ``ci_src``: its ``ci/src``;
  ``ci_fixtures``: ``tests/ci/fixtures`` (trees read, planned or run by the tests, never
  collected); ``workflow_files``: the repository's ``.github/workflows/*.yml``, and
  ``workflow_file``: each of them in turn (a parametrized fixture, one test per file).
- ``mizzen_ci``: the one way to run the CLI as a real subprocess.  ``mizzen_ci(*ARGS)`` runs
  ``python -S -m mizzen_ci ARGS`` (what a bare runner has: no site-packages) with the
  environment ``PATH`` and ``PYTHONPATH=ci/src`` only, in ``repo_root``, with a timeout, and
  returns the ``CompletedProcess`` (text, output captured, never raising on an exit code).
  Options: ``env`` (variables set on top of that environment, ``PYTHONPATH`` included; a
  ``None`` value removes the variable),
  ``inherit_env`` (start from this process's environment instead), ``site`` (leave ``-S``
  out), ``github`` (``GITHUB_ACTIONS=true``), ``cwd``, ``timeout``.  ``mizzen_ci.python(*ARGV)``
  runs ``python [-S] ARGV`` the same way (a probe script instead of the CLI), and
  ``mizzen_ci.command`` / ``mizzen_ci.environ`` give the argv and the environment for a
  ``Popen`` the test manages itself.
- ``lane``: ``lane(root, *ARGS, env=None, fake_gpus=2, cwd=None, arch="hopper")`` runs
  ``mizzen-ci gpu-lane ARCH --fake-gpus N`` through ``mizzen_ci`` in this environment
  (site-packages: pytest, torch), with ``--lease-dir ROOT/leases``, ``LANE_TRACE=ROOT/trace``,
  ``CI`` empty and its compile cache under ``ROOT/compile-cache`` (never the user's ``~/.cache``);
  ``env`` overrides any of them.  The pretend GPUs are of ARCH's vendor (``arch="cdna3"``: AMD
  GPUs, pinned with ``HIP_VISIBLE_DEVICES``).
- ``deadline``: ``with deadline(seconds):`` fails the test with ``TimeoutError`` when the body
  blocks longer (SIGALRM, main thread), so a hang on a hostile input is a failure, not a stuck
  run.
- ``soundness``: ``benchmarks/check_plan_soundness.py`` loaded by path (it imports
  ``synthetic_monorepo`` beside it), the planner-soundness check the property tests run.
- ``workspace_kit``: the generated-workspace builders of ``generated_workspace.py`` (loaded by
  path: test modules are imported by path, so a helper is no importable module either), and its
  two functions as fixtures of their own, ``make_workspace`` and ``age_all``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

from mizzen_ci.lane.compile_cache import BYTECODE_SWITCH, CACHE_VARIABLES

REPO = Path(__file__).resolve().parents[2]
CI_SRC = REPO / "ci" / "src"
WORKFLOW_FILES = sorted((REPO / ".github" / "workflows").glob("*.yml"))


def _load_helper(name: str) -> ModuleType:
    """The helper module ``tests/ci/NAME.py``, loaded by path under a private name."""
    path = Path(__file__).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"mizzen_tests_ci_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generated_workspace = _load_helper("generated_workspace")


@dataclass(frozen=True)
class MizzenCi:
    """``mizzen-ci`` (and plain ``python``) as subprocesses of a bare runner; see the module
    docstring for the options."""

    repo: Path
    ci_src: Path

    def environ(
        self,
        env: Mapping[str, str] | None = None,
        *,
        github: bool = False,
        inherit_env: bool = False,
    ) -> dict[str, str]:
        base = dict(os.environ) if inherit_env else {"PATH": os.environ.get("PATH", "")}
        out = {**base, "PYTHONPATH": str(self.ci_src)}
        if github:
            out["GITHUB_ACTIONS"] = "true"
        return {k: v for k, v in {**out, **(env or {})}.items() if v is not None}

    def command(self, *argv: str, site: bool = False) -> list[str]:
        return [sys.executable, *(() if site else ("-S",)), *argv]

    def python(
        self,
        *argv: str,
        env: Mapping[str, str] | None = None,
        github: bool = False,
        inherit_env: bool = False,
        site: bool = False,
        cwd: Path | None = None,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.command(*argv, site=site),
            cwd=cwd or self.repo,
            env=self.environ(env, github=github, inherit_env=inherit_env),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def __call__(self, *args: str, **options) -> subprocess.CompletedProcess:
        return self.python("-m", "mizzen_ci", *args, **options)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def ci_src() -> Path:
    return CI_SRC


@pytest.fixture(scope="session")
def ci_fixtures() -> Path:
    return REPO / "tests" / "ci" / "fixtures"


@pytest.fixture(scope="session")
def workflow_files() -> list[Path]:
    return WORKFLOW_FILES


@pytest.fixture(params=WORKFLOW_FILES, ids=lambda path: path.name)
def workflow_file(request) -> Path:
    return request.param


@pytest.fixture(scope="session")
def mizzen_ci() -> MizzenCi:
    return MizzenCi(REPO, CI_SRC)


@pytest.fixture(scope="session")
def lane(mizzen_ci: MizzenCi):
    """``lane(root, *args, env=None, fake_gpus=2, cwd=None, arch="hopper")``: ``mizzen-ci
    gpu-lane ARCH`` on pretend GPUs over ``root``, in this environment (site-packages, pytest and
    its plugins)."""

    def run(
        root: Path,
        *args: str,
        env: Mapping[str, str] | None = None,
        fake_gpus: int = 2,
        cwd: Path | None = None,
        arch: str = "hopper",
    ) -> subprocess.CompletedProcess:
        defaults: dict[str, str | None] = {
            "LANE_TRACE": str(root / "trace"),
            "CI": "",
            "MIZZEN_COMPILE_CACHE_DIR": str(root / "compile-cache"),
            # torch sets some of these in its own process once it compiles (an earlier test in
            # this worker may have): the lane would take them for the user's
            **{name: None for name, _, _ in CACHE_VARIABLES},
            BYTECODE_SWITCH: None,  # tests that need it set it
        }
        return mizzen_ci(
            "gpu-lane", arch, "--fake-gpus", str(fake_gpus),
            "--lease-dir", str(root / "leases"), "--kill-grace", "1", *args,
            cwd=cwd or root,
            env={**defaults, **(env or {})},
            inherit_env=True,
            site=True,
            timeout=240,
        )  # fmt: skip

    return run


@contextlib.contextmanager
def _deadline(seconds: float = 10):
    def expired(signum, frame):
        raise TimeoutError(f"blocked for more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="session")
def deadline():
    """``with deadline(seconds=10):`` — a blocking body fails instead of hanging."""
    return _deadline


@pytest.fixture(scope="module")
def soundness():
    """``benchmarks/check_plan_soundness.py`` as a module (registered in ``sys.modules`` while
    in use: its dataclasses need it), with ``synthetic_monorepo`` beside it, which it imports (a
    script run as ``python benchmarks/X.py`` finds it on its own ``sys.path[0]``)."""
    names = ("synthetic_monorepo", "mizzen_check_plan_soundness")
    files = ("synthetic_monorepo.py", "check_plan_soundness.py")
    added = [name for name in names if name not in sys.modules]
    for name, file in zip(names, files, strict=True):
        spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    yield module
    for name in added:
        sys.modules.pop(name, None)


@pytest.fixture(scope="session")
def workspace_kit() -> ModuleType:
    """``make_workspace(root, seed=0, modules=30, tests=24)``, ``age_all(root)``, ``HEADER``,
    ``REGISTRATIONS`` (see ``generated_workspace.py``)."""
    return generated_workspace


@pytest.fixture(scope="session")
def make_workspace(workspace_kit: ModuleType):
    """``make_workspace(root, seed=0, modules=30, tests=24)``: write a generated workspace."""
    return workspace_kit.make_workspace


@pytest.fixture(scope="session")
def age_all(workspace_kit: ModuleType):
    """``age_all(root)``: move every mtime under ``root`` 10 s into the past."""
    return workspace_kit.age_all
