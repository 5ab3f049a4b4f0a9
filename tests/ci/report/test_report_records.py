"""The health page's inputs are hostile until checked: kinded records (pool, queue, audit) are
validated field by field and a bad one is dropped naming `path:line`; the duration and flake
readers (the planner's) leave kinded lines alone instead of calling them bad; and a file name
from the history is escaped on the page, never markup."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.history import Record, append, read_flake_records, read_stores
from mizzen_ci.report.collect import collect
from mizzen_ci.report.page import render
from mizzen_ci.report.records import PARSERS, RecordError

register_cpu_ci(est_time=3, labels=["ci"])

WHEN = "2026-11-30T02:17:00+00:00"
AUDIT = {"kind": "audit", "v": 1, "when": WHEN, "recall": 0.9, "caught": 9, "failing": 10}
POOL = {"kind": "pool", "v": 1, "when": WHEN, "run": "gh-1-1", "event": "schedule", "pool": "p",
        "lane": "cpu", "jobs": 1, "runners": 1, "gpus_per_runner": 1, "tests": 3, "gpu_seconds": 10.0,
        "makespan_seconds": 20.0, "lower_bound_seconds": 15.0}  # fmt: skip


@pytest.mark.parametrize(("record", "message"), [
    (AUDIT | {"recall": 1.5}, "`recall` is not a valid share"),
    (AUDIT | {"caught": 11}, "`caught` 11 is more than `failing` 10"),
    (AUDIT | {"v": 2}, "not a version-1 kinded record"),
    (AUDIT | {"when": "2999-01-01T00:00:00+00:00"}, "in the future"),
    (POOL | {"jobs": -1}, "`jobs` is not a valid count"),
    (POOL | {"makespan_seconds": float("inf")}, "`makespan_seconds` is not a valid seconds"),
    ({k: v for k, v in POOL.items() if k != "pool"}, "pool record lacks `pool`"),
    (POOL | {"pool": "a\x1b[31m"}, "`pool` is not a valid text"),
])  # fmt: skip
def test_a_bad_kinded_record_is_refused_naming_the_field(record, message):
    with pytest.raises(RecordError, match=message.replace("[", r"\[")):
        PARSERS[record["kind"]](record, "h.jsonl:3")
    assert PARSERS["pool"](POOL, "h.jsonl:1").utilisation == pytest.approx(0.5)


def test_kinded_lines_are_not_bad_duration_or_flake_lines(tmp_path):
    store = tmp_path / "history"
    append(
        store / "durations.jsonl", [Record("tests/x/test_a.py", None, 1.0, "passed", WHEN, "cpu")]
    )
    (store / "health.jsonl").write_text(json.dumps(POOL) + "\n" + json.dumps(AUDIT) + "\n")
    records, problems = read_stores(store)
    assert len(records) == 1 and problems == []
    assert read_flake_records(store) == ([], [])


def test_a_file_name_from_the_history_is_escaped_on_the_page(tmp_path):
    evil = "tests/x/<script>alert(1)</script>.py"
    store = tmp_path / "history"
    append(store / "durations.jsonl", [Record(evil, None, 1.0, "failed", WHEN, "cpu")] * 1
           + [Record(evil, None, 1.0, "passed", "2026-11-30T03:00:00+00:00", "cpu")])  # fmt: skip
    (store / "health.jsonl").write_text(json.dumps(POOL | {"pool": "<b>p</b>"}) + "\n")
    page = render(collect(tmp_path, [store], None, now=dt.datetime(2026, 12, 1, tzinfo=dt.UTC)))
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<b>p</b>" not in page and "&lt;b&gt;p&lt;/b&gt;" in page
