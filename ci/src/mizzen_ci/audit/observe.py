"""Observed execution: run tests under coverage.py with per-test contexts and turn the measured
data into execution rows (:class:`mizzen_ci.history_execution.Executed`).

Invariants:
- coverage.py is an optional extra (``mizzen-ci[audit]``), imported inside :func:`rows_of_data`
  only; the pytest run is a subprocess ``python -m coverage run -m pytest …`` with
  ``patch = subprocess`` (coverage's own subprocess support, no hand-written tracer), ``parallel``
  data files in a temporary folder, and the contexts plugin (:mod:`.contexts`).
- Measured: the workspace's source folders and ``tests/``; a row's path is repository-relative
  and names a file that exists in the tree (the contexts plugin itself, the instrument, is left
  out); a context that is no test id is dropped.
- The tests import the tree's own code: its source folders come first on ``PYTHONPATH``
  (:func:`mizzen_ci.bisect.scratch.tree_pythonpath`), before any editable install of the interpreter.
- The tests' own outcome does not change what was observed (a failing test executed what it
  executed); it is reported (``ObservedRun.returncode``), never hidden.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..bisect.scratch import CPU_TEST_ENV, tree_pythonpath
from ..history_execution import Executed, checked_row
from ..imports import workspace_source_dirs
from .contexts import AUDIT_DIR_ENV

PLUGIN = "mizzen_ci.audit.contexts"
TEST_TIMEOUT_S = "900"  # per test, as the CPU lane (pytest-timeout): a hang fails, never stalls
INSTRUMENT = "mizzen_ci/audit/contexts.py"  # the observer's own plugin: no test's dependency


class ObserveError(RuntimeError):
    """The observed run could not start or left no data; the message says what to do."""


@dataclass(frozen=True)
class ObservedRun:
    rows: list[Executed]
    returncode: int  # pytest's exit status
    seconds: float


def rcfile_text(root: Path, data_file: Path) -> str:
    """The coverage configuration of an observed run of ``root``."""
    sources = [str(d) for d in workspace_source_dirs(root)] + [str(root / "tests")]
    listed = "".join(f"\n    {s}" for s in sources)
    return (
        "[run]\n"
        f"data_file = {data_file}\n"
        "parallel = true\n"
        f"source ={listed}\n"
        "patch =\n    subprocess\n    _exit\n"
        "disable_warnings =\n    no-data-collected\n    module-not-measured\n"
        "    module-not-imported\n    couldnt-parse\n    no-ctracer\n"
    )


@dataclass(frozen=True)
class Recording:
    """Observed execution of test processes started elsewhere (a GPU lane's per-file pytest
    processes, ``mizzen-ci gpu-lane --record-execution``): the coverage configuration and the
    folders a run writes into.  :meth:`command` wraps a pytest command line, :meth:`env` adds
    the contexts plugin's folder, :meth:`rows` reads what every process recorded."""

    root: Path
    folder: Path  # coverage data and opened-file records go here

    @classmethod
    def start(cls, root: Path, folder: Path) -> Recording:
        """A fresh recording in ``folder`` (created; coverage.py must be importable: the
        ``mizzen-ci[audit]`` extra), else ObserveError saying what to install."""
        if importlib.util.find_spec("coverage") is None:
            raise ObserveError(
                "--record-execution needs coverage.py in this Python: install mizzen-ci[audit] "
                "(uv sync --all-extras)"
            )
        rec = cls(root.resolve(), folder.resolve())
        (rec.folder / "coverage").mkdir(parents=True, exist_ok=True)
        (rec.folder / "opened").mkdir(exist_ok=True)
        rec.rcfile.write_text(rcfile_text(rec.root, rec.folder / "coverage" / ".coverage"))
        return rec

    @property
    def rcfile(self) -> Path:
        return self.folder / "coveragerc"

    def command(self, pytest_command: list[str]) -> list[str]:
        """``[python, -m, pytest, ARGS…]`` run under coverage with the contexts plugin."""
        python, _, _, *args = pytest_command
        return [python, "-m", "coverage", "run", f"--rcfile={self.rcfile}", "-m", "pytest",
                "-p", PLUGIN, *args]  # fmt: skip

    def env(self) -> dict[str, str]:
        return {AUDIT_DIR_ENV: str(self.folder / "opened")}

    def rows(self, revision: str) -> list[Executed]:
        return rows_of_data(self.root, revision, self.rcfile, self.folder / "opened")


def observe(
    root: Path,
    revision: str,
    tests: Iterable[str],
    workers: str = "0",
    python: str = sys.executable,
    extra_args: Iterable[str] = (),
) -> ObservedRun:
    """Run ``tests`` (paths or node ids, CPU lane) of ``root`` under coverage; their rows."""
    import time

    root = root.resolve()
    with tempfile.TemporaryDirectory(prefix="mizzen-audit-") as tmp:
        tmp_path = Path(tmp)
        rc = tmp_path / "coveragerc"
        rc.write_text(rcfile_text(root, tmp_path / "coverage" / ".coverage"))
        (tmp_path / "coverage").mkdir()
        started = time.monotonic()
        code = _run_pytest(root, python, rc, tmp_path / "opened", tests, workers, extra_args)
        rows = rows_of_data(root, revision, rc, tmp_path / "opened")
        return ObservedRun(rows, code, time.monotonic() - started)


def _run_pytest(root, python, rc, opened, tests, workers, extra_args) -> int:
    xdist = (
        ["-n", workers, "--dist", "loadfile"] if workers not in ("0", "") else ["-p", "no:xdist"]
    )
    command = [
        python, "-m", "coverage", "run", f"--rcfile={rc}", "-m", "pytest", "-p", PLUGIN,
        "--mizzen-lane", "cpu", "-q", "-p", "no:cacheprovider", "--timeout", TEST_TIMEOUT_S,
        *xdist, *extra_args, *tests,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("COVERAGE_")}
    env |= CPU_TEST_ENV | {AUDIT_DIR_ENV: str(opened), "PYTHONPATH": tree_pythonpath(root)}
    try:
        return subprocess.run(command, cwd=root, env=env, check=False).returncode
    except OSError as e:
        raise ObserveError(f"cannot start {python} -m coverage ({e.strerror})") from None


def rows_of_data(root: Path, revision: str, rc: Path, opened: Path) -> list[Executed]:
    """The rows of the coverage data files (and opened-file records) of one observed run."""
    try:
        import coverage
    except ImportError:
        raise ObserveError(
            "the audit needs coverage.py: install mizzen-ci[audit] (uv sync --all-extras)"
        ) from None
    cov = coverage.Coverage(config_file=str(rc))
    cov.combine(keep=False)
    data = cov.get_data()
    rows: set[Executed] = set()
    for measured in data.measured_files():
        rel = _relative(root, measured)
        if rel is None or rel.endswith(INSTRUMENT):
            continue
        contexts = set()
        for names in data.contexts_by_lineno(measured).values():
            contexts.update(names)
        rows.update(_row(revision, c, rel, "source") for c in contexts)
    for record in sorted(opened.glob("opened-*.json")) if opened.is_dir() else ():
        for context, rel in json.loads(record.read_text()):
            if (root / rel).is_file():
                rows.add(_row(revision, context, rel, "data"))
    return sorted(r for r in rows if r and not checked_row(r.revision, r.test, r.path, r.kind))


def _row(revision: str, context: str, rel: str, kind: str) -> Executed | None:
    test = context.split("|", 1)[0]  # a static|dynamic pair: the static part is the test
    return Executed(revision, test, rel, kind) if test else None


def _relative(root: Path, measured: str) -> str | None:
    path = Path(measured)
    try:
        rel = path.resolve().relative_to(root)
    except (ValueError, OSError):
        return None
    return rel.as_posix() if path.is_file() else None
