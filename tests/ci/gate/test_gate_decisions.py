"""The gate's decisions as a table: the robust statistics (median and MAD of trusted values) and
what a run's artefacts and declarations make of them — cold start, within band, an outlier in
the history, drift, a missing metric or step, non-finite values, enforce=False, quarantine and an
expired quarantine."""

from __future__ import annotations

import datetime as dt
import math

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.gate.backends import open_store
from mizzen_ci.gate.check import Settings, run_gate
from mizzen_ci.gate.declarations import Declarations, Gate
from mizzen_ci.gate.judge import FAIL, IMPROVED, INACTIVE, PASS, decide, robust_band
from mizzen_ci.gate.quarantine import Entry
from mizzen_ci.gate.store import RunInfo

register_cpu_ci(est_time=5, labels=["ci"])

STEADY = [1.00, 1.01, 0.99, 1.00, 1.02, 0.98, 1.00]
OUTLIER = [1.00, 1.01, 0.99, 1.00, 9.00, 0.98, 1.00]  # one broken trusted run

# (name, value, history, direction, tolerance, floor, status, reference)
DECISIONS = [
    ("cold start", 5.0, [1.0, 1.0], "lower", 0.1, 0.0, INACTIVE, None),
    ("cold start counts finite values only", 1.0, [1.0] * 4 + [math.nan], "lower", 0.1, 0.0, INACTIVE, None),
    ("within band", 1.05, STEADY, "lower", 0.1, 0.0, PASS, 1.0),
    ("30 % worse loss", 1.30, STEADY, "lower", 0.1, 0.0, FAIL, 1.0),
    ("lower loss is an improvement", 0.70, STEADY, "lower", 0.1, 0.0, IMPROVED, 1.0),
    ("outlier history: the median ignores it", 1.30, OUTLIER, "lower", 0.1, 0.0, FAIL, 1.0),
    ("outlier history: still within band", 1.05, OUTLIER, "lower", 0.1, 0.0, PASS, 1.0),
    ("score drop", 0.70, STEADY, "higher", 0.1, 0.0, FAIL, 1.0),
    ("score rise is an improvement", 1.30, STEADY, "higher", 0.1, 0.0, IMPROVED, 1.0),
    ("drift up, both sides gated", 1.30, STEADY, "both", 0.1, 0.0, FAIL, 1.0),
    ("drift down, both sides gated", 0.70, STEADY, "both", 0.1, 0.0, FAIL, 1.0),
    ("the floor widens a tiny band", 0.015, [0.001] * 6, "lower", 0.1, 0.02, PASS, 0.001),
    ("noise widens the band (k × MAD)", 1.4, [1.0, 1.2, 0.8, 1.1, 0.9, 1.0], "lower", 0.05, 0.0, PASS, 1.0),
    ("non-finite value fails even on a cold start", math.nan, [], "lower", 0.1, 0.0, FAIL, None),
    ("infinite value fails", math.inf, STEADY, "higher", 0.1, 0.0, FAIL, None),
    ("non-finite history values are not used", 1.05, [*STEADY, math.inf, math.nan], "lower", 0.1, 0.0, PASS, 1.0),
]  # fmt: skip


@pytest.mark.parametrize(
    ("value", "history", "direction", "tolerance", "floor", "status", "reference"),
    [d[1:] for d in DECISIONS],
    ids=[d[0] for d in DECISIONS],
)
def test_decisions(value, history, direction, tolerance, floor, status, reference):
    d = decide(value, history, direction=direction, tolerance=tolerance, floor=floor, min_history=5)
    assert d.status == status, d.why
    assert d.reference == (pytest.approx(reference) if reference is not None else None)


def test_band_is_the_widest_of_tolerance_noise_and_floor():
    history = [10.0, 10.5, 9.5, 10.0, 11.0, 9.0, 10.0]  # median 10, MAD 0.5
    assert robust_band(history, 0.01, 0.0, 3.0)[1] == pytest.approx(3 * 1.4826 * 0.5)
    assert robust_band(history, 0.5, 0.0, 3.0)[1] == pytest.approx(5.0)
    assert robust_band(history, 0.0, 7.0, 3.0)[1] == 7.0
    # a mean would move 1.3 with one broken run; the median does not move at all
    assert robust_band([*history, 1000.0], 0.1, 0.0)[0] == robust_band(history, 0.1, 0.0)[0]
    assert robust_band([*history[:6], 1000.0], 0.1, 0.0)[0] == 10.0


# -- a whole gate run: artefacts, declarations, the store, quarantine --------------------------

TEST = "tests/x/test_a.py"
TODAY = dt.date(2026, 12, 1)
LOSS = Gate(TEST, 3, "eval/loss", "lower", 0.1, steps="last")
SCORE = Gate(TEST, 4, "eval/score", "higher", 0.1, steps=[20, 40])
ALL = Gate(TEST, 5, "eval/loss", "lower", 0.1, steps="all")
WATCH = Gate(TEST, 6, "eval/score", "higher", 0.1, enforce=False, reason="noisy, issue #12")


@pytest.fixture
def history_store(tmp_path):
    """A SQLite store with 6 trusted runs: loss at steps 20 and 60 around 1.0 (one outlier at
    5.0), score at 20 and 40 around 0.8; and one untrusted run with absurd values."""
    path = str(tmp_path / "metrics.sqlite")
    with open_store(path) as store:
        for i, loss in enumerate([1.0, 1.01, 0.99, 5.0, 1.0, 1.02]):
            store.add_run(
                RunInfo(TEST, "cpu", "p", f"{i:040x}", None, "push", True, 1,
                        f"2026-11-2{i}T00:00:00+00:00", f"hist-{i}"),
                {("eval/loss", 20): loss + 1, ("eval/loss", 60): loss,
                 ("eval/score", 20): 0.8, ("eval/score", 40): 0.8},
            )  # fmt: skip
        store.add_run(
            RunInfo(TEST, "cpu", "p", "f" * 40, 7, "pull_request", False, 1,
                    "2026-11-29T00:00:00+00:00", "a-pr"),
            {("eval/loss", 60): 100.0},
        )  # fmt: skip
    return open_store(path, readonly=True)


def judge(store, gates, pts, quarantine=(), targets=((TEST, "cpu"),), **settings):
    decl = Declarations(gates={TEST: list(gates)})
    return run_gate(
        decl, pts, store, targets, list(quarantine), today=TODAY, settings=Settings(**settings)
    )


def only(result):
    (row,) = result.rows
    return row


def test_within_band_passes_against_trusted_history_only(history_store, points):
    row = only(judge(history_store, [LOSS], points(eval__loss_at_60=1.05)))
    assert (row.verdict, row.fails, row.step) == ("pass", False, 60)  # "last" is the last step
    # the median of 0.99 1.0 1.0 1.01 1.02 5.0: the outlier does not move it
    assert row.reference == pytest.approx(1.005) and len(row.history) == 6
    assert 100.0 not in row.history  # the untrusted run


def test_30_percent_worse_fails(history_store, points):
    result = judge(history_store, [LOSS], points(eval__loss_at_60=1.3065))  # 1.3 × 1.005
    assert only(result).verdict == "FAIL" and result.failed
    assert "regressed" in only(result).why and "+30.0%" in only(result).why


def test_cold_start_is_inactive_not_a_pass(history_store, points):
    result = judge(history_store, [LOSS], points(eval__loss_at_60=9.0), min_history=7)
    assert only(result).verdict == "inactive" and not result.failed
    assert "cold start: 6 of 7" in only(result).why


def test_no_store_means_every_gate_is_inactive(points):
    result = judge(None, [LOSS], points(eval__loss_at_60=9.0))
    assert only(result).verdict == "inactive"


def test_missing_metric_and_missing_step_fail(history_store, points):
    result = judge(history_store, [LOSS, SCORE], points(eval__score_at_20=0.8))
    verdicts = {(r.metric, r.step): (r.verdict, r.why) for r in result.rows}
    assert verdicts[("eval/loss", None)][0] == "FAIL"
    assert "not recorded" in verdicts[("eval/loss", None)][1]
    assert verdicts[("eval/score", 20)][0] == "pass"
    assert verdicts[("eval/score", 40)][0] == "FAIL"
    assert "step 40 not recorded" in verdicts[("eval/score", 40)][1]


def test_steps_all_fails_a_step_the_newest_trusted_run_had(history_store, points):
    result = judge(history_store, [ALL], points(eval__loss_at_60=1.0))
    verdicts = {r.step: r.verdict for r in result.rows}
    assert verdicts == {20: "FAIL", 60: "pass"}


def test_a_test_that_recorded_nothing_fails_every_gate(history_store):
    result = judge(history_store, [LOSS, SCORE], [])
    assert [r.verdict for r in result.rows] == ["FAIL", "FAIL"]
    assert "did it run?" in result.rows[0].why


def test_non_finite_value_fails(history_store, points):
    row = only(judge(history_store, [LOSS], points(eval__loss_at_60=math.nan)))
    assert row.verdict == "FAIL" and "non-finite" in row.why


def test_two_different_values_for_one_step_fail(history_store, points):
    pts = points(eval__loss_at_60=1.0) + points(eval__loss_at_60=1.1)
    row = only(judge(history_store, [LOSS], pts))
    assert row.verdict == "FAIL" and "2 different values" in row.why


def test_every_run_of_the_artefacts_is_judged_not_only_the_newest(history_store, points):
    """Issue 31: a regressed run beside a newer good one fails; each row names its run."""
    pts = points(run="old", when="2026-12-01T09:00:00+00:00", eval__loss_at_60=9.0) + points(
        run="new", when="2026-12-01T10:00:00+00:00", eval__loss_at_60=1.0
    )
    result = judge(history_store, [LOSS], pts)
    rows = [(r.verdict, r.why.split(":")[0]) for r in result.rows]
    assert rows == [("FAIL", "run old"), ("pass", "run new")] and result.failed
    assert "2 runs in the artefacts; each is judged (old, new)" in result.notes[0]


def test_every_step_of_a_run_is_judged_not_only_the_last(history_store, points):
    """Issue 31: steps="last" with a regression at an earlier step that has history fails."""
    result = judge(history_store, [LOSS], points(eval__loss_at_20=9.0, eval__loss_at_60=1.0))
    assert {r.step: r.verdict for r in result.rows} == {20: "FAIL", 60: "pass"}
    assert result.failed


def test_a_later_step_does_not_hide_the_last_step_of_the_history(history_store, points):
    """A run that records a step beyond the history's last (no history: inactive) is still
    judged at the history's last step, and fails when it lacks it."""
    result = judge(history_store, [LOSS], points(eval__loss_at_60=9.0, eval__loss_at_61=1.0))
    assert {r.step: r.verdict for r in result.rows} == {60: "FAIL", 61: "inactive"}
    result = judge(history_store, [LOSS], points(eval__loss_at_61=1.0))
    verdicts = {r.step: (r.verdict, r.why) for r in result.rows}
    assert verdicts[61][0] == "inactive" and verdicts[60][0] == "FAIL"
    assert "newest trusted run's last step" in verdicts[60][1]


def test_two_equal_values_of_one_step_are_judged_once(history_store, points):
    pts = points(eval__loss_at_60=1.0) + points(eval__loss_at_60=1.0)
    assert only(judge(history_store, [LOSS], pts)).verdict == "pass"


def test_not_enforced_failure_is_a_warning_with_its_reason(history_store, points):
    result = judge(history_store, [WATCH], points(eval__score_at_40=0.1))
    assert only(result).verdict == "warning" and not result.failed
    assert "not enforced: noisy, issue #12" in only(result).why


def test_quarantine_turns_a_failure_into_a_warning_until_it_expires(history_store, points):
    pts = points(eval__loss_at_60=1.3)
    active = Entry(TEST, "cpu", "known regression, fix in #130", TODAY, 2)
    result = judge(history_store, [LOSS], pts, [active])
    assert only(result).verdict == "warning" and not result.failed
    assert "quarantined: known regression, fix in #130" in only(result).why
    assert result.active == [active]
    other_arch = Entry(TEST, "hopper", "elsewhere", TODAY, 2)
    assert judge(history_store, [LOSS], pts, [other_arch]).failed
    expired = Entry(TEST, "cpu", "known regression", TODAY - dt.timedelta(days=1), 2)
    result = judge(history_store, [LOSS], pts, [expired])
    assert only(result).verdict == "FAIL" and result.failed and result.expired == [expired]


def test_a_passing_quarantined_gate_still_lists_the_entry(history_store, points):
    active = Entry(TEST, "cpu", "known regression", TODAY, 2)
    result = judge(history_store, [LOSS], points(eval__loss_at_60=1.0), [active])
    assert only(result).verdict == "pass" and result.active == [active]


def test_the_run_being_judged_is_not_its_own_history(history_store, points):
    row = only(judge(history_store, [LOSS], points(run="hist-5", eval__loss_at_60=1.02)))
    assert len(row.history) == 5


def test_runs_are_ordered_by_time_not_by_the_text_of_its_offset(
    history_store, points, write_points, tmp_path
):
    from mizzen_ci.gate.artefacts import read_points

    # 10:00+02:00 is 08:00 UTC: older than 09:00 UTC although its text sorts later
    older = points(run="older", when="2026-12-01T10:00:00+02:00", eval__loss_at_60=9.0)
    newer = points(run="newer", when="2026-12-01T09:00:00+00:00", eval__loss_at_60=1.0)
    pts, problems = read_points(write_points(tmp_path / "cpu.jsonl", older + newer))
    assert problems == [] and pts[0].when == "2026-12-01T08:00:00.000000+00:00"
    result = judge(history_store, [LOSS], pts)
    assert [r.why.split(":")[0] for r in result.rows] == ["run older", "run newer"]
    assert "each is judged (older, newer)" in result.notes[0]
