"""The metric store's contract, one suite run against both backends: SQLite (a file) and
PostgreSQL (a real server, started by .ci/run or by the conftest; never skipped).  Then what only
one backend can be handed: a hostile SQLite file, a wrong PostgreSQL password."""

from __future__ import annotations

import math
import os
import sqlite3

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.gate.backends import open_store
from mizzen_ci.gate.store import RunInfo, StoreError

register_cpu_ci(est_time=20, labels=["ci"])

TEST = "tests/x/test_a.py"


def run(
    source: str, created: str, *, trusted=True, commit="a" * 40, test=TEST, arch="cpu", attempt=1
):
    return RunInfo(test, arch, "cpu-hosted", commit, None, "push" if trusted else "pull_request",
                   trusted, attempt, created, source)  # fmt: skip


def t(i: int) -> str:
    return f"2026-12-01T10:{i:02d}:00.000000+00:00"


def test_history_is_the_newest_trusted_values_newest_first(store_url):
    with open_store(store_url) as store:
        for i in range(8):
            assert store.add_run(
                run(f"r{i}", t(i)), {("eval/loss", 60): 1.0 + i, ("eval/loss", 20): 9.0}
            )
        store.add_run(run("pr", t(30), trusted=False), {("eval/loss", 60): 100.0})
        store.add_run(run("other-arch", t(31), arch="hopper"), {("eval/loss", 60): 50.0})
        store.add_run(run("other-test", t(32), test="tests/x/test_b.py"), {("eval/loss", 60): 50.0})
        values, problems = store.history(TEST, "cpu", "eval/loss", 60, limit=5)
        assert problems == []
        assert [v.value for v in values] == [8.0, 7.0, 6.0, 5.0, 4.0]
        assert [v.source for v in values] == ["r7", "r6", "r5", "r4", "r3"]
        judged, _ = store.history(TEST, "cpu", "eval/loss", 60, limit=3, exclude_source="r7")
        assert [v.source for v in judged] == ["r6", "r5", "r4"]  # the judged run is left out
        assert store.last_steps(TEST, "cpu", "eval/loss") == (20, 60)
        assert store.count_runs() == 11 and store.count_runs(trusted=True) == 10


def test_writes_are_idempotent_by_natural_key(store_url):
    with open_store(store_url) as store:
        assert store.add_run(run("r1", t(1)), {("eval/score", 60): 0.5})
        # the same artefact again, even with other values: nothing written, nothing doubled
        assert not store.add_run(
            run("r1", t(1)), {("eval/score", 60): 0.9, ("eval/score", 20): 0.1}
        )
        assert store.add_run(run("r1", t(2), attempt=2), {("eval/score", 60): 0.6})  # a re-run
        values, _ = store.history(TEST, "cpu", "eval/score", 60, limit=10)
        assert sorted(v.value for v in values) == [0.5, 0.6]
        assert store.history(TEST, "cpu", "eval/score", 20, limit=10)[0] == []
    with open_store(store_url) as again:  # reopening finds the schema, keeps the data
        assert again.count_runs() == 2


def test_non_finite_values_are_kept_as_they_were(store_url):
    with open_store(store_url) as store:
        store.add_run(run("r1", t(1)), {("eval/loss", 1): math.nan, ("eval/loss", 2): math.inf,
                                        ("eval/loss", 3): -math.inf, ("eval/loss", 4): 0.25})  # fmt: skip
        got = [
            store.history(TEST, "cpu", "eval/loss", s, limit=1)[0][0].value for s in (1, 2, 3, 4)
        ]
        assert math.isnan(got[0]) and got[1:] == [math.inf, -math.inf, 0.25]


def test_untrusted_runs_leave_the_reference(store_url):
    with open_store(store_url) as store:
        store.add_run(run("good", t(1), commit="b" * 40), {("eval/loss", 60): 1.0})
        store.add_run(run("bad", t(2), commit="c" * 40), {("eval/loss", 60): 9.0})
        store.add_run(
            run("bad-hopper", t(3), commit="c" * 40, arch="hopper"), {("eval/loss", 60): 9.0}
        )
        assert store.mark_untrusted(commit="c" * 40, arch="cpu") == 1
        assert [v.source for v in store.history(TEST, "cpu", "eval/loss", 60, limit=9)[0]] == [
            "good"
        ]
        assert store.history(TEST, "hopper", "eval/loss", 60, limit=9)[0][0].source == "bad-hopper"
        assert store.mark_untrusted(source="bad-hopper") == 1
        assert store.mark_untrusted(source="bad-hopper") == 0
        with pytest.raises(StoreError, match="needs a commit or a run key"):
            store.mark_untrusted(test=TEST)


def test_a_read_only_store_refuses_every_write(store_url):
    open_store(store_url).close()  # create it
    store = open_store(store_url, readonly=True)
    try:
        with pytest.raises(StoreError, match="read-only"):
            store.add_run(run("r1", t(1)), {("eval/loss", 60): 1.0})
        with pytest.raises(StoreError, match="read-only"):
            store.mark_untrusted(commit="a" * 40)
        assert store.count_runs() == 0
    finally:
        store.close()


def test_runs_the_schema_cannot_hold_faithfully_are_refused(store_url):
    with open_store(store_url) as store:
        for bad in (
            RunInfo("../etc/passwd", "cpu", "p", "a" * 40, None, "push", True, 1, t(1), "r1"),
            RunInfo(TEST, "cpu", "p", "a" * 40, None, "pull_request", True, 1, t(1), "r1"),
            RunInfo(TEST, "cpu", "p", "a" * 40, None, "push", True, 0, t(1), "r1"),
            RunInfo(TEST, "c" * 500, "p", "a" * 40, None, "push", True, 1, t(1), "r1"),
        ):
            with pytest.raises(StoreError, match="refused run"):
                store.add_run(bad, {("eval/loss", 1): 1.0})
        assert store.count_runs() == 0


def test_the_shown_store_never_holds_a_password(store_url):
    with open_store(store_url) as store:
        assert "@" not in repr(store) or "***@" in repr(store)
        assert "mizzen:" not in store.shown


# -- SQLite: a store file is untrusted input --------------------------------------------------


def test_a_file_that_is_no_store_is_a_clear_error(tmp_path):
    junk = tmp_path / "metrics.sqlite"
    junk.write_bytes(b"\x00garbage" * 100)
    with pytest.raises(StoreError, match=r"cannot be used|not a mizzen metric store"):
        open_store(str(junk), readonly=True)
    other = tmp_path / "other.sqlite"
    sqlite3.connect(other).execute("CREATE TABLE runs (x)").connection.commit()
    with pytest.raises(StoreError, match="not a mizzen metric store"):
        open_store(str(other), readonly=True)


def test_links_fifos_and_missing_files(tmp_path):
    real = tmp_path / "real.sqlite"
    open_store(str(real)).close()
    link = tmp_path / "link.sqlite"
    link.symlink_to(real)
    with pytest.raises(StoreError, match="symbolic link"):
        open_store(str(link), readonly=True)
    fifo = tmp_path / "fifo.sqlite"
    os.mkfifo(fifo)
    with pytest.raises(StoreError, match="FIFO"):
        open_store(str(fifo), readonly=True)
    assert open_store(str(tmp_path / "missing.sqlite"), readonly=True) is None  # no history
    assert not (tmp_path / "missing.sqlite").exists()  # and nothing created


def test_crafted_rows_are_dropped_with_a_problem_and_views_are_refused(tmp_path):
    path = tmp_path / "metrics.sqlite"
    with open_store(str(path)) as store:
        store.add_run(run("good", t(1)), {("eval/loss", 60): 1.0})
        store.add_run(run("bad", t(2)), {("eval/loss", 60): 2.0})
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA ignore_check_constraints = ON")
    conn.execute("UPDATE metric_values SET value = 'a string' WHERE run = 2")
    conn.commit()
    with open_store(str(path), readonly=True) as store:
        values, problems = store.history(TEST, "cpu", "eval/loss", 60, limit=10)
    assert [v.source for v in values] == ["good"]
    assert len(problems) == 1 and "run 2" in problems[0] and "not a number" in problems[0]
    conn.execute("UPDATE metric_values SET value = NULL, kind = 'finite' WHERE run = 2")
    conn.commit()
    with open_store(str(path), readonly=True) as store:
        assert len(store.history(TEST, "cpu", "eval/loss", 60, limit=10)[1]) == 1
    conn.execute("DROP TABLE metric_values")
    conn.execute("CREATE VIEW metric_values AS SELECT 1 AS run")
    conn.commit()
    with pytest.raises(StoreError, match="not tables"):
        open_store(str(path), readonly=True)


def test_stored_values_beyond_what_an_artefact_may_hold_are_dropped(tmp_path):
    # ±1e308 in the history would make the MAD (and so the band) infinite: everything passes
    from mizzen_ci.gate.judge import decide

    path = tmp_path / "metrics.sqlite"
    with open_store(str(path)) as store:
        for i in range(6):
            store.add_run(run(f"r{i}", t(i + 1)), {("eval/loss", 60): 1.0})
    conn = sqlite3.connect(path)
    conn.execute("UPDATE metric_values SET value = 1e308 WHERE run IN (1, 2, 3)")
    conn.execute("UPDATE metric_values SET value = -1e308 WHERE run IN (4, 5)")
    conn.commit()
    with open_store(str(path), readonly=True) as store:
        values, problems = store.history(TEST, "cpu", "eval/loss", 60, limit=10)
    assert [v.source for v in values] == ["r5"] and len(problems) == 5, problems
    assert all("within" in p for p in problems)
    history = [v.value for v in values] * 5
    assert decide(1e6, history, direction="lower", tolerance=0.1, floor=0.0).status == "fail"


def test_a_wrong_schema_version_is_refused(tmp_path):
    path = tmp_path / "metrics.sqlite"
    open_store(str(path)).close()
    conn = sqlite3.connect(path)
    conn.execute("UPDATE mizzen_meta SET value = '99' WHERE key = 'schema'")
    conn.commit()
    with pytest.raises(StoreError, match="schema"):
        open_store(str(path), readonly=True)


# -- PostgreSQL: the password never shows -----------------------------------------------------


def test_a_wrong_password_is_an_error_without_the_password(postgres_url):
    from urllib.parse import urlsplit

    parts = urlsplit(postgres_url)
    secret = "Wr0ng-p4ss-" + "z" * 8
    bad = postgres_url.replace(f":{parts.password}@", f":{secret}@")
    with pytest.raises(StoreError) as caught:
        open_store(bad)
    message = str(caught.value)
    assert secret not in message and parts.password not in message
    assert "***@127.0.0.1" in message and "password authentication failed" in message
    unreachable = f"postgresql://u:{secret}@127.0.0.1:1/db"
    with pytest.raises(StoreError) as caught:
        open_store(unreachable)
    assert secret not in str(caught.value) and "cannot connect" in str(caught.value)


def test_a_read_only_postgres_store_without_tables_says_what_creates_them(postgres_url):
    import uuid
    from urllib.parse import quote

    import psycopg

    schema = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    try:
        with pytest.raises(StoreError, match="gate ingest"):
            open_store(f"{postgres_url}?options={quote(f'-csearch_path={schema}')}", readonly=True)
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")
