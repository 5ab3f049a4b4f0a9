"""``mizzen_ci.metrics.record(name, value, step=...)``: the one way a test records a metric value
for the metric gate (:mod:`mizzen_ci.gate`).

Invariants:
- ``name`` must be declared in ``ci/metrics.toml`` of the checkout the test runs in (found from
  the current directory upwards); ``value`` is a real number (``bool`` is refused), recorded as
  it is: a non-finite value is written as ``"nan"``/``"inf"``/``"-inf"`` and fails its gate;
  ``step`` is an integer from 0 to 10⁹.  A bad argument raises :class:`MetricError` at once,
  naming the fix: a gate should never learn of a typo from a missing value.
- The test file comes from ``$PYTEST_CURRENT_TEST`` (pytest sets it while a test runs) unless
  ``test=`` names it.  The line goes to :func:`mizzen_ci.gate.artefacts.default_dir` (``<lane>.jsonl``)
  with one ``write`` (see :mod:`mizzen_ci.gate.artefacts` for the format and the environment).
- Stdlib only, cheap to import; nothing is read from the network or written outside that folder.
"""

from __future__ import annotations

import functools
import json
import numbers
import os
import secrets
from datetime import UTC, datetime
from pathlib import Path

from .fleet import FLEET_RELATIVE_PATH, nox_session_name
from .gate.artefacts import (
    ARCH,
    CPU_ARCH,
    JOB_ENV,
    LANE_ENV,
    MAX_STEP,
    RUN_KEY_ENV,
    ArtefactError,
    Point,
    check_value,
    default_dir,
    valid_key,
    valid_test_path,
)
from .gate.vocabulary import VOCABULARY_RELATIVE_PATH, load_vocabulary, valid_name

__all__ = ["MetricError", "record"]


class MetricError(ValueError):
    """A value :func:`record` refuses; the message says what was wrong and the fix."""


@functools.cache
def _process_run_key() -> str:
    return f"local-{secrets.token_hex(8)}"


def _root() -> Path:
    here = Path.cwd().resolve()
    for d in (here, *here.parents):
        if (d / FLEET_RELATIVE_PATH).is_file():
            return d
    raise MetricError(
        f"no mizzen checkout above {here} (no {FLEET_RELATIVE_PATH}): record() checks names "
        f"against {VOCABULARY_RELATIVE_PATH}; run the test from the checkout"
    )


def _current_test() -> str:
    current = os.environ.get("PYTEST_CURRENT_TEST", "")
    test = current.split("::", 1)[0]
    if not test:
        raise MetricError("record() outside a running pytest test: pass test='tests/.../test_x.py'")
    return test


def _environment(root: Path) -> str:
    """The environment stamped on each value (:func:`mizzen_ci.gate.environment.current`); a bad
    ``$MIZZEN_ENVIRONMENT`` is a :class:`MetricError` naming the rule."""
    from .gate.environment import ENV_VARIABLE, EnvironmentLineError, current

    try:
        return current(Path(root))
    except EnvironmentLineError as e:
        raise MetricError(f"${ENV_VARIABLE}: {e}") from None


def record(name: str, value: float, *, step: int, test: str | None = None) -> Path:
    """Record ``value`` of metric ``name`` at ``step`` for the running test file; returns the
    artefact file written (see the module docstring)."""
    root = _root()
    if not valid_name(name):
        raise MetricError(
            f"metric name {name!r:.80} is not 1-64 characters of a-z 0-9 _ . - in /-separated "
            "parts; use a name of ci/metrics.toml"
        )
    vocabulary = load_vocabulary(root)
    if name not in vocabulary:
        raise MetricError(f"unknown metric {name!r}: {vocabulary.unknown_fix()}")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise MetricError(
            f"the value of {name} must be a real number, got {type(value).__name__}; pass "
            "float(x) (a tensor: x.item())"
        )
    try:
        number = check_value(float(value), f"the value of {name}")
    except (ArtefactError, OverflowError) as e:
        raise MetricError(str(e)) from None
    if (
        isinstance(step, bool)
        or not isinstance(step, numbers.Integral)
        or not 0 <= step <= MAX_STEP
    ):
        raise MetricError(f"`step` must be an integer from 0 to {MAX_STEP}, got {step!r:.40}")
    test = test if test is not None else _current_test()
    if not valid_test_path(test):
        raise MetricError(f"test {test!r:.200} is not a test file path under tests/ (test_*.py)")
    lane = os.environ.get(LANE_ENV) or CPU_ARCH
    if not ARCH.fullmatch(lane):
        raise MetricError(f"${LANE_ENV}={lane!r:.80} is not a lane (cpu or a GPU generation)")
    run = os.environ.get(RUN_KEY_ENV) or _process_run_key()
    job = os.environ.get(JOB_ENV) or None
    for what, key in (("$" + RUN_KEY_ENV, run), ("$" + JOB_ENV, job)):
        if key is not None and not valid_key(key):
            raise MetricError(f"{what}={key!r:.80} is not a key of A-Z a-z 0-9 _ . : / + -")
    point = Point(
        test=test,
        arch=lane,
        metric=name,
        step=int(step),
        value=number,
        run=run,
        job=job,
        when=datetime.now(UTC).isoformat(timespec="microseconds"),
        env=_environment(root),
    )
    from .history import append_jsonl

    directory = default_dir(root)
    path = directory / f"{nox_session_name(None if lane == CPU_ARCH else lane)}.jsonl"
    append_jsonl(path, [json.dumps(point.to_json_object(), sort_keys=True)])
    return path
