"""The metric artefacts: JSON lines that :func:`mizzen_ci.metrics.record` writes under the lane's
artefact folder, and the one reader of them.

One line is one value of one metric at one step of one test file's run::

    {"v": 1, "test": "tests/train/test_sft_e2e.py", "arch": "cpu", "metric": "eval/score",
     "step": 60, "value": 0.8125, "run": "local-3f9c…", "job": null,
     "when": "2026-12-01T22:41:07.123456+00:00"}

- ``arch``: ``cpu`` for the CPU lane, else the GPU generation of the lane (``$MIZZEN_LANE``).
- ``value``: a finite number, or the string ``"nan"``, ``"inf"`` or ``"-inf"`` (a non-finite value
  is recorded as such: it fails its gate, it is never dropped).
- ``run``: the identity of the run (``$MIZZEN_RUN_KEY``, which CI sets to the workflow run,
  attempt and job; else one random key per process); ``job``: ``$MIZZEN_JOB`` (the planned job).
- ``env`` (optional): the environment that produced the value (:mod:`.environment`: torch,
  CUDA/ROCm, driver, GPU SKU, image or lock hash, Python); a line without it is ``unknown``.
- ``when``: ISO-8601 time of the recording with its offset (read back as UTC with microseconds,
  :func:`utc_iso`, so that comparing the text compares the times).

Invariants:
- Where: ``$MIZZEN_METRICS_DIR`` when set, else ``ROOT/.ci-artifacts/metrics``; the file is
  ``<lane>.jsonl`` (``cpu.jsonl``, ``gpu-hopper.jsonl``), appended with one ``write`` per line, so
  processes of one lane (xdist workers, GPU files side by side) append to it safely.
- An artefact is read from disk the CI did not write (a downloaded artifact): through
  :func:`mizzen_ci.history.read_lines` (regular files only, size and line caps, directories walked
  without following links), then every field is checked and bounded (:func:`point_from`); a bad
  line is dropped with a problem naming ``path:line``, never silently, and never a traceback.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath

from ..registry.rules import shown
from .environment import UNKNOWN, EnvironmentLineError, checked
from .vocabulary import valid_name

FORMAT_VERSION = 1
METRICS_DIR_ENV = "MIZZEN_METRICS_DIR"
RUN_KEY_ENV = "MIZZEN_RUN_KEY"
JOB_ENV = "MIZZEN_JOB"
LANE_ENV = "MIZZEN_LANE"
DEFAULT_DIR = Path(".ci-artifacts") / "metrics"
CPU_ARCH = "cpu"
NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
MAX_STEP = 10**9
MAX_ABS_VALUE = 1e300
MAX_PATH_CHARS = 1024
MAX_KEY_CHARS = 200
ARCH = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")
KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/+-]*")


class ArtefactError(ValueError):
    """A metric line or value that cannot be used; the message says where and why."""


@dataclass(frozen=True)
class Point:
    """One recorded value (see the module docstring)."""

    test: str
    arch: str
    metric: str
    step: int
    value: float
    run: str
    job: str | None
    when: str
    env: str = UNKNOWN  # the environment that produced it (:mod:`.environment`)

    def to_json_object(self) -> dict:
        return {
            **({"env": self.env} if self.env != UNKNOWN else {}),
            "v": FORMAT_VERSION,
            "test": self.test,
            "arch": self.arch,
            "metric": self.metric,
            "step": self.step,
            "value": encode_value(self.value),
            "run": self.run,
            "job": self.job,
            "when": self.when,
        }


def encode_value(value: float) -> float | str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def valid_test_path(test: object) -> bool:
    """A repository-relative POSIX path of a test file under ``tests/``, printable, no ``..``."""
    if not (isinstance(test, str) and 0 < len(test) <= MAX_PATH_CHARS and test.isprintable()):
        return False
    p = PurePosixPath(test)
    return (
        p.parts[:1] == ("tests",)
        and p.name.startswith("test_")
        and p.suffix == ".py"
        and ".." not in p.parts
        and "\\" not in test
        and not test.startswith("/")
        and str(p) == test
    )


def valid_key(value: object) -> bool:
    return isinstance(value, str) and len(value) <= MAX_KEY_CHARS and bool(KEY.fullmatch(value))


def valid_when(value: object) -> bool:
    """An ISO-8601 time with its offset, within the history's bounds
    (:func:`mizzen_ci.history.time_problem`: not before its epoch, not in the future)."""
    from ..history import time_problem

    if not (isinstance(value, str) and len(value) <= 40):
        return False
    try:
        if datetime.fromisoformat(value).tzinfo is None:
            return False
    except ValueError:
        return False
    return time_problem(value) is None


def utc_iso(when: str) -> str:
    """A valid ``when`` in the one form every comparison uses: UTC, microseconds
    (``2026-12-01T10:00:00.000000+00:00``), so that text order is time order."""
    return datetime.fromisoformat(when).astimezone(UTC).isoformat(timespec="microseconds")


def check_value(value: object, what: str = "value") -> float:
    """A recorded value as a float: a finite number within ±:data:`MAX_ABS_VALUE`, or one of the
    non-finite spellings; :class:`ArtefactError` otherwise (compared before any conversion)."""
    if isinstance(value, str) and value in NONFINITE:
        return NONFINITE[value]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ArtefactError(f"{what} must be a number or 'nan'/'inf'/'-inf', got {shown(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        return value  # a float nan/inf given to record(): kept as what it is
    if not -MAX_ABS_VALUE <= value <= MAX_ABS_VALUE:
        raise ArtefactError(f"{what} must be within ±{MAX_ABS_VALUE:g}, got {shown(value)}")
    return float(value)


def point_from(obj: object, where: str) -> Point:
    """The :class:`Point` of one parsed line; :class:`ArtefactError` naming ``where`` and the
    field otherwise."""
    if not isinstance(obj, dict):
        raise ArtefactError(f"{where}: a metric line is a JSON object, got {type(obj).__name__}")
    if obj.get("v") != FORMAT_VERSION:
        raise ArtefactError(
            f"{where}: not a version-{FORMAT_VERSION} metric line (v={shown(obj.get('v'))}); "
            "record values with mizzen_ci.metrics.record"
        )

    def need(name: str, ok, rule: str):
        if name not in obj:
            raise ArtefactError(f"{where}: the line lacks `{name}`")
        value = obj[name]
        if not ok(value):
            raise ArtefactError(f"{where}: `{name}` must be {rule}, got {shown(value)}")
        return value

    test = need("test", valid_test_path, "a test file path under tests/")
    arch = need("arch", lambda v: isinstance(v, str) and bool(ARCH.fullmatch(v)), "an arch name")
    metric = need("metric", valid_name, "a metric name (a-z 0-9 _ . - in /-separated parts)")
    step = need(
        "step", lambda v: type(v) is int and 0 <= v <= MAX_STEP, f"an integer from 0 to {MAX_STEP}"
    )
    if "value" not in obj:
        raise ArtefactError(f"{where}: the line lacks `value`")
    try:
        value = check_value(obj["value"], "`value`")
    except ArtefactError as e:
        raise ArtefactError(f"{where}: {e}") from None
    run = need(
        "run", valid_key, f"a run key of 1-{MAX_KEY_CHARS} characters A-Z a-z 0-9 _ . : / + -"
    )
    job = obj.get("job")
    if job is not None and not valid_key(job):
        raise ArtefactError(f"{where}: `job` must be a job id or null, got {shown(job)}")
    when = need("when", valid_when, "an ISO-8601 time with its UTC offset, not in the future")
    try:  # a line recorded before environments were has none: "unknown" (see .environment)
        env = checked(obj.get("env", UNKNOWN))
    except EnvironmentLineError as e:
        raise ArtefactError(f"{where}: `env`: {e}") from None
    return Point(test, arch, metric, step, value, run, job, utc_iso(when), env)


def read_points(paths: Iterable[Path | str] | Path | str) -> tuple[list[Point], list[str]]:
    """``(points, problems)`` of the artefacts at ``paths`` (files, or directories of
    ``*.jsonl``); a missing path is no artefact (a lane that recorded nothing)."""
    from ..history import read_parsed  # the bounded reader of every store

    return read_parsed(paths, point_from, ArtefactError, missing_ok=True)


def default_dir(root: Path) -> Path:
    override = os.environ.get(METRICS_DIR_ENV)
    return Path(override) if override else Path(root) / DEFAULT_DIR
