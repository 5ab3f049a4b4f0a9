"""History dates are bounded (issue 31, mechanism 6): a duration or flake record, or a metric
artefact line, dated `9999-99-99`, in the future beyond a small clock skew, or before the CI's
epoch is dropped with a warning naming path:line, like any other bad line; every time within the
bounds is kept."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mizzen_ci import history, register_cpu_ci
from mizzen_ci.gate.artefacts import read_points

register_cpu_ci(est_time=30, labels=["ci"])


def duration(when) -> str:
    return json.dumps({"file": "tests/test_a.py", "arch": None, "seconds": 1.0,
                       "outcome": "passed", "when": when, "lane": "cpu"})  # fmt: skip


def flake(when) -> str:
    return json.dumps({"file": "tests/test_a.py", "arch": "hopper", "class": "nccl-timeout",
                       "evidence": "e", "final": "passed", "when": when})  # fmt: skip


def metric(when) -> str:
    return json.dumps({"v": 1, "test": "tests/test_a.py", "arch": "cpu", "metric": "m",
                       "step": 1, "value": 1.0, "run": "r", "job": None, "when": when})  # fmt: skip


@pytest.mark.parametrize(
    "when",
    [
        "9999-99-99",
        "9999-12-31T23:59:59+00:00",
        "in 2 days",
        "in 1 hour",
        "1970-01-01T00:00:00+00:00",
        "0001-01-01T00:00:00+23:59",
        "2019-12-31T23:59:59+00:00",
        "yesterday",
    ],
)
def test_a_record_out_of_the_time_bounds_is_dropped_naming_path_and_line(tmp_path, when):
    ahead = {"in 2 days": timedelta(days=2), "in 1 hour": timedelta(hours=1)}
    if when in ahead:
        when = (datetime.now(UTC) + ahead[when]).isoformat()
    store = tmp_path / "d.jsonl"
    good = duration("2026-11-01T00:00:00+00:00")
    store.write_text(good + "\n" + duration(when) + "\n")
    records, problems = history.read_stores(store)
    assert len(records) == 1 and len(problems) == 1
    assert problems[0].startswith(f"{store}:2: `when`"), problems
    flakes = tmp_path / "flakes.jsonl"
    flakes.write_text(flake(when) + "\n")
    kept, problems = history.read_flake_records(flakes)
    assert kept == [] and problems[0].startswith(f"{flakes}:1: `when`")
    if "T" in when and when[-6] in "+-":  # an artefact's time must carry its offset anyway
        artefact = tmp_path / "cpu.jsonl"
        artefact.write_text(metric(when) + "\n")
        points, problems = read_points(artefact)
        assert points == [] and problems[0].startswith(f"{artefact}:1: `when` must be")


def test_the_history_cli_warns_with_path_and_line(tmp_path, mizzen_ci):
    store = tmp_path / "d.jsonl"
    store.write_text(duration("2026-11-01T00:00:00+00:00") + "\n" + duration("9999-99-99") + "\n")
    out = mizzen_ci("history", "merge", "--out", str(tmp_path / "m.jsonl"), str(store))
    assert out.returncode == 0 and f"history: dropped {store}:2: `when` '9999-99-99'" in out.stderr
    assert "1 record(s)" in out.stdout


times = st.datetimes(
    min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30),
    timezones=st.one_of(st.none(), st.just(UTC), st.timezones()),
)  # fmt: skip
dates = st.one_of(
    times.map(lambda t: t.isoformat()),
    st.from_regex(r"\A[0-9]{4}-[0-9]{2}-[0-9]{2}(T[0-9]{2}:[0-9]{2}(:[0-9]{2})?)?\Z"),
    st.text(max_size=40),
    st.integers(),
    st.none(),
)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(when=dates)
def test_any_date_is_kept_only_within_the_bounds(tmp_path, when):
    store = tmp_path / "p.jsonl"
    store.write_text(duration(when) + "\n")
    records, problems = history.read_stores(store)
    within = False
    if isinstance(when, str):
        try:
            t = datetime.fromisoformat(when)
            t = (t if t.tzinfo else t.replace(tzinfo=UTC)).astimezone(UTC)
            within = history.EARLIEST <= t <= datetime.now(UTC) + history.MAX_CLOCK_SKEW
        except (ValueError, OverflowError):
            within = False
    if within:
        assert problems == [] and records[0].when == when
    else:
        assert records == [] and len(problems) == 1 and problems[0].startswith(f"{store}:1: ")
