"""The gate's decision for one coordinate (test, arch, metric, step): robust statistics over the
trusted history, then a verdict.

- Reference: the **median** of the last N trusted finite values (one bad run cannot drag it).
- Noise: the median absolute deviation (MAD) around it, scaled by 1.4826 to estimate a standard
  deviation of normal noise.
- Band: ``max(tolerance × |reference|, k × 1.4826 × MAD, floor)``.
- ``direction="lower"`` fails a value above ``reference + band`` (a loss), ``"higher"`` one below
  ``reference − band`` (a score), ``"both"`` one outside either side; a one-sided gate calls a
  value beyond the band on the good side *improved* (a pass).

Invariants:
- Fewer than ``min_history`` finite trusted values: *inactive* (a cold start says so; it is not a
  pass, and it never fails a job).
- A missing metric or step, a value recorded twice with different values, and a non-finite value
  always *fail* (whatever the history); non-finite history values are shown, never used.
- Environments: the history is that of the value's own environment; while it has fewer than
  ``min_history`` values, the newest other environment's history with its band widened by
  :data:`NEW_ENVIRONMENT_WIDEN` (:mod:`.check` chooses; this module only widens).
- :func:`settle` applies what the declaration and the quarantine say: a failure of a gate with
  ``enforce=False`` or of a quarantined (file, arch) is a *warning* with its reason; only an
  enforced, unquarantined failure fails the job.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

MAD_SCALE = 1.4826
DEFAULT_K = 3.0
DEFAULT_WINDOW = 20
DEFAULT_MIN_HISTORY = 5
# A value of a new environment (an image, torch, CUDA or driver bump) with fewer than
# min_history trusted values of its own is judged against the previous environment's band times
# this: a new kernel or library moves numerics by a little of the band, so an unchanged metric
# passes across the bump, while a regression beyond twice the noise band still fails.
NEW_ENVIRONMENT_WIDEN = 2.0

PASS, IMPROVED, INACTIVE, FAIL = "pass", "improved", "inactive", "fail"


@dataclass(frozen=True)
class Decision:
    """What the statistics say about one value (before enforcement and quarantine)."""

    status: str  # PASS | IMPROVED | INACTIVE | FAIL
    why: str
    reference: float | None = None
    band: float | None = None


def missing(why: str) -> Decision:
    return Decision(FAIL, why)


def robust_band(
    history: Sequence[float], tolerance: float, floor: float, k: float = DEFAULT_K
) -> tuple[float, float, float]:
    """``(reference, band, mad)`` of finite ``history`` values (not empty)."""
    reference = statistics.median(history)
    mad = statistics.median(abs(x - reference) for x in history)
    band = max(tolerance * abs(reference), k * MAD_SCALE * mad, floor)
    return reference, band, mad


def _number(x: float) -> str:
    return f"{x:.4g}"


def decide(
    value: float,
    history: Sequence[float],
    *,
    direction: str,
    tolerance: float,
    floor: float,
    min_history: int = DEFAULT_MIN_HISTORY,
    k: float = DEFAULT_K,
    widen: float = 1.0,
) -> Decision:
    """The decision for ``value`` against ``history`` (oldest first; non-finite values are
    ignored by the statistics), its band multiplied by ``widen`` (a new environment judged
    against the previous one's history: :data:`NEW_ENVIRONMENT_WIDEN`)."""
    finite = [x for x in history if math.isfinite(x)]
    if not math.isfinite(value):
        return Decision(FAIL, f"the value is {value} (non-finite values always fail)")
    if len(finite) < min_history:
        skipped = len(history) - len(finite)
        return Decision(
            INACTIVE,
            f"cold start: {len(finite)} of {min_history} trusted values"
            + (f" ({skipped} non-finite not counted)" if skipped else "")
            + "; not judged",
        )
    reference, band, _ = robust_band(finite, tolerance, floor, k)
    band *= widen
    delta = value - reference
    relative = f" ({delta / reference:+.1%})" if reference else ""
    shown = f"{_number(value)} vs {_number(reference)} ± {_number(band)}{relative}"
    worse = delta > band if direction == "lower" else -delta > band
    better = -delta > band if direction == "lower" else delta > band
    if direction == "both":
        if abs(delta) > band:
            return Decision(FAIL, f"drifted: {shown}", reference, band)
        return Decision(PASS, f"within the band: {shown}", reference, band)
    if worse:
        side = "higher" if direction == "lower" else "lower"
        return Decision(FAIL, f"regressed ({side} is worse): {shown}", reference, band)
    if better:
        return Decision(IMPROVED, f"improved beyond the band: {shown}", reference, band)
    return Decision(PASS, f"within the band: {shown}", reference, band)


@dataclass(frozen=True)
class Settled:
    """A decision after enforcement and quarantine: ``verdict`` is what the table shows
    (pass, improved, inactive, FAIL, warning), ``fails`` whether it fails the job."""

    verdict: str
    fails: bool
    note: str = ""


def settle(
    decision: Decision, *, enforce: bool, reason: str | None, quarantine: str | None
) -> Settled:
    if decision.status != FAIL:
        return Settled(decision.status, False)
    if quarantine is not None:
        return Settled("warning", False, f"quarantined: {quarantine}")
    if not enforce:
        return Settled("warning", False, f"not enforced: {reason}")
    return Settled("FAIL", True)
