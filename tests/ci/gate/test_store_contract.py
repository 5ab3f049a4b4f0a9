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


# -- bad rows never shrink the evidence (both backends) ----------------------------------------

ENV_GOOD = "python=3.12.3; torch=2.13.0+cu130; runtime=cuda-13.0; driver=580.82.07; gpu=NVIDIA H200; image=sha256:aaaa"
ENV_BAD = "python=3.12.3; torch=2.11.0+cu130; runtime=cuda-13.0; driver=580.82.07; gpu=NVIDIA H200; image=sha256:bbbb"


def crafted(store_url: str, sql: str, params: tuple = ()) -> None:
    """Run ``sql`` on the store's database itself, as a crafted or damaged store would hold it."""
    if store_url.startswith("postgresql"):
        import psycopg

        with psycopg.connect(store_url, autocommit=True) as conn:
            conn.execute(sql.replace("?", "%s"), params)
        return
    conn = sqlite3.connect(store_url)
    try:
        conn.execute(sql, params)
        conn.commit()
    finally:
        conn.close()


def newest_sorting_bad_created(store_url: str) -> tuple[str, str]:
    """What sorts before every real time in the backend's ``created`` column: text ``'9999'`` in
    SQLite's, ``'infinity'`` in PostgreSQL's TIMESTAMPTZ; and a time in the future in both."""
    far = "2099-01-01T00:00:00.000000+00:00"
    return ("infinity", far) if store_url.startswith("postgresql") else ("9999", far)


def good_and_crafted(store_url: str) -> None:
    """20 good trusted runs (loss 1.0 .. 1.19 at steps 20 and 60, environment ENV_GOOD), then 20
    trusted runs that sort newest with bad rows (``created`` '9999'/'infinity' or 2099, a nan with
    a number beside it), recording the loss at steps 60 and 61 in ENV_BAD."""
    from dataclasses import replace

    with open_store(store_url) as store:
        for i in range(20):
            store.add_run(replace(run(f"good-{i:02d}", t(i)), environment=ENV_GOOD),
                          {("eval/loss", 20): 9.0, ("eval/loss", 60): 1.0 + i / 100})  # fmt: skip
        for i in range(20):
            store.add_run(replace(run(f"bad-{i:02d}", t(30 + i)), environment=ENV_BAD),
                          {("eval/loss", 60): math.nan, ("eval/loss", 61): 1.0})  # fmt: skip
    sorts_first, future = newest_sorting_bad_created(store_url)
    crafted(store_url, "UPDATE metric_values SET value = 5.0 WHERE kind = 'nan'")
    crafted(store_url, "UPDATE runs SET created = ? WHERE source LIKE ?", (sorts_first, "bad-0%"))
    crafted(store_url, "UPDATE runs SET created = ? WHERE source LIKE ?", (future, "bad-1%"))


def test_bad_rows_that_sort_newest_never_shrink_the_window(store_url):
    # 20 crafted rows filled the window (LIMIT before checking) and were dropped: no history,
    # the gate went inactive and a failing change passed
    good_and_crafted(store_url)
    with open_store(store_url, readonly=True) as store:
        values, problems = store.history(TEST, "cpu", "eval/loss", 60, limit=20)
        assert [v.source for v in values] == [f"good-{i:02d}" for i in range(19, -1, -1)]
        assert [v.value for v in values][:2] == [1.19, 1.18]
        assert all(v.created.endswith(".000000+00:00") for v in values)
        assert problems and all("rebuild it from artefacts" in p for p in problems), problems
        assert "run(s) 21, 22, 23" in problems[0] and "`created`" in problems[0]
        judged, _ = store.history(TEST, "cpu", "eval/loss", 60, limit=5, exclude_source="good-19")
        assert [v.source for v in judged] == [f"good-{i}" for i in (18, 17, 16, 15, 14)]
        # the health page: the newest trusted run's steps, and its value at each
        assert store.last_steps(TEST, "cpu", "eval/loss") == (20, 60)
        (newest,), _ = store.history(TEST, "cpu", "eval/loss", 60, limit=1)
        assert newest.source == "good-19"
        assert store.environments(TEST, "cpu", "eval/loss", 60) == [ENV_GOOD]
        in_env, _ = store.history(TEST, "cpu", "eval/loss", 60, limit=20, environment=ENV_GOOD)
        assert len(in_env) == 20


def test_bad_rows_inside_the_bounds_are_walked_past_with_a_warning_naming_the_row(store_url):
    # rows whose `created` is a time of the right shape, but whose values are bad: the window
    # reads on past them (pages grow) until it has the valid values asked for
    with open_store(store_url) as store:
        for i in range(5):
            store.add_run(run(f"good-{i}", t(i)), {("eval/loss", 60): 1.0 + i})
        for i in range(40):
            store.add_run(run(f"bad-{i:02d}", t(10 + i)), {("eval/loss", 60): math.nan})
    crafted(store_url, "UPDATE metric_values SET value = 5.0 WHERE kind = 'nan'")
    with open_store(store_url, readonly=True) as store:
        values, problems = store.history(TEST, "cpu", "eval/loss", 60, limit=3)
    assert [v.source for v in values] == ["good-4", "good-3", "good-2"]
    assert len(problems) == 21  # 20 named one by one, then the count of the rest
    assert "run 45:" in problems[0] and "a nan value with a number beside it" in problems[0]
    assert "dropped 20 more stored value(s)" in problems[-1]


def test_a_run_is_stored_with_created_in_the_one_format_or_refused(store_url):
    with open_store(store_url) as store:
        assert store.add_run(run("r1", "2026-11-20T01:00:00+01:00"), {("eval/loss", 60): 1.0})
        (value,), problems = store.history(TEST, "cpu", "eval/loss", 60, limit=5)
        assert value.created == "2026-11-20T00:00:00.000000+00:00" and problems == []
        for bad in ("9999", "<script>alert(1)</script>", "2026-11-20T00:00:00", "2099-01-01T00:00:00+00:00",
                    "2019-12-31T23:59:59+00:00", "infinity"):  # fmt: skip
            with pytest.raises(StoreError, match=r"refused run: created .* is not an ISO-8601"):
                store.add_run(run("r2", bad), {("eval/loss", 60): 1.0})
        assert store.count_runs() == 1


def test_a_walk_that_finds_only_bad_rows_is_an_error_never_a_shorter_window(store_url, monkeypatch):
    from mizzen_ci.gate import store as store_module

    monkeypatch.setattr(store_module, "MAX_ROWS_SCANNED", 30)
    with open_store(store_url) as store:
        store.add_run(run("good", t(0)), {("eval/loss", 60): 1.0})
        for i in range(40):
            store.add_run(run(f"bad-{i:02d}", t(10 + i)), {("eval/loss", 60): math.nan})
    crafted(store_url, "UPDATE metric_values SET value = 5.0 WHERE kind = 'nan'")
    store = open_store(store_url, readonly=True)
    try:
        with pytest.raises(
            StoreError, match=r"rows read newest first .* rebuild it from artefacts"
        ):
            store.history(TEST, "cpu", "eval/loss", 60, limit=5)
    finally:
        store.close()


# -- SQLite: `created` is text, so any shape can be crafted ------------------------------------


@pytest.mark.parametrize(
    "created",
    [
        "9999",
        "<script>alert(1)</script>",
        "2026-12-02T10:00:00<script>",
        "2026-12-02 10:00:00.000000+00:00",
        "2026-12-02T10:00:00+00:00",
        "2026-12-02T10:00:00.000000+01:00",
        "2026-13-30T10:00:00.000000+00:00",
        "2099-01-01T00:00:00.000000+00:00",
        "2019-12-31T23:59:59.000000+00:00",
        99999,
        b"2026-12-02T10:00:00.000000+00:00",
    ],
)
def test_every_other_shape_of_created_is_refused_at_read_and_named(tmp_path, created):
    path = str(tmp_path / "metrics.sqlite")
    with open_store(path) as store:
        for i in range(3):
            store.add_run(run(f"good-{i}", t(i)), {("eval/loss", 60): 1.0 + i})
        for i in range(3):
            store.add_run(run(f"bad-{i}", t(10 + i)), {("eval/loss", 60): 7.0})
    crafted(path, "UPDATE runs SET created = ? WHERE source LIKE 'bad-%'", (created,))
    with open_store(path, readonly=True) as store:
        values, problems = store.history(TEST, "cpu", "eval/loss", 60, limit=3)
        assert [v.source for v in values] == ["good-2", "good-1", "good-0"]
        assert len(problems) in (1, 3) and all("`created`" in p for p in problems), problems
        assert "run(s) 4, 5, 6:" in problems[0] or "run 6: `created`" in problems[0]
        assert "<script>" not in "".join(v.created for v in values)
        assert store.last_steps(TEST, "cpu", "eval/loss") == (60,)
        (newest,), _ = store.history(TEST, "cpu", "eval/loss", 60, limit=1)
        assert newest.source == "good-2"


# -- one row check for every read: steps and environments see only valid values ----------------


def env_run(source: str, created: str, environment: str) -> RunInfo:
    from dataclasses import replace

    return replace(run(source, created), environment=environment)


def test_a_newer_run_whose_values_are_all_bad_gives_neither_steps_nor_environment(store_url):
    # its created and environment were checked, not its values: last_steps returned its steps,
    # environments listed it first, and the gate fell back to an environment with no history
    with open_store(store_url) as store:
        store.add_run(
            env_run("good", t(0), ENV_GOOD), {("eval/loss", 20): 1.0, ("eval/loss", 60): 2.0}
        )
        store.add_run(
            env_run("bad", t(1), ENV_BAD),
            {("eval/loss", 60): math.nan, ("eval/loss", 61): math.nan},
        )
    crafted(store_url, "UPDATE metric_values SET value = 5.0 WHERE kind = 'nan'")
    with open_store(store_url, readonly=True) as store:
        assert store.last_steps(TEST, "cpu", "eval/loss") == (20, 60)
        assert store.environments(TEST, "cpu", "eval/loss", 60) == [ENV_GOOD]
        (value,), _ = store.history(TEST, "cpu", "eval/loss", 60, limit=5)
        assert value.source == "good"


def test_an_environment_is_listed_by_its_newest_valid_value(store_url):
    envs = [ENV_GOOD.replace("aaaa", f"{i:04d}") for i in range(5)]
    with open_store(store_url) as store:
        for i, environment in enumerate(envs):  # env i's newest valid value at t(10 + i)
            store.add_run(env_run(f"e{i}", t(10 + i), environment), {("eval/loss", 60): 1.0})
        store.add_run(env_run("e4-old", t(1), envs[4]), {("eval/loss", 60): 1.0})
        # the newest run of all is env 4's, with a bad value at 60 and a good one at 70
        store.add_run(
            env_run("e4-bad", t(30), envs[4]), {("eval/loss", 60): math.nan, ("eval/loss", 70): 3.0}
        )
    crafted(store_url, "UPDATE metric_values SET value = 5.0 WHERE kind = 'nan'")
    crafted(
        store_url,
        "UPDATE metric_values SET kind = 'nan' WHERE run = (SELECT id FROM runs WHERE source = 'e4')",
    )
    with open_store(store_url, readonly=True) as store:
        # env 4: its two newest values at 60 are bad, its newest valid one is the oldest of all
        assert store.environments(TEST, "cpu", "eval/loss", 60) == [
            envs[i] for i in (3, 2, 1, 0, 4)
        ]
        assert store.environments(TEST, "cpu", "eval/loss", 70) == [envs[4]]
        assert store.last_steps(TEST, "cpu", "eval/loss") == (70,)  # the valid values' steps only


def test_only_the_newest_environments_are_listed_past_the_limit(store_url, monkeypatch):
    from mizzen_ci.gate import sql

    monkeypatch.setattr(sql, "MAX_ENVIRONMENTS", 2)
    envs = [ENV_GOOD.replace("aaaa", f"{i:04d}") for i in range(5)]
    with open_store(store_url) as store:
        for i, environment in enumerate(envs):
            store.add_run(env_run(f"e{i}", t(10 + i), environment), {("eval/loss", 60): 1.0})
        store.add_run(env_run("e0-bad", t(40), envs[0]), {("eval/loss", 60): math.nan})
    crafted(store_url, "UPDATE metric_values SET value = 5.0 WHERE kind = 'nan'")
    with open_store(store_url, readonly=True) as store:
        assert store.environments(TEST, "cpu", "eval/loss", 60) == [envs[4], envs[3]]


def test_history_of_an_environment_names_only_its_own_runs_left_out(store_url):
    with open_store(store_url) as store:
        for i in range(3):
            store.add_run(env_run(f"good-{i}", t(i), ENV_GOOD), {("eval/loss", 60): 1.0})
            store.add_run(env_run(f"ahead-{i}", t(10 + i), ENV_BAD), {("eval/loss", 60): 1.0})
    _, future = newest_sorting_bad_created(store_url)
    crafted(store_url, "UPDATE runs SET created = ? WHERE source LIKE ?", (future, "ahead-%"))
    with open_store(store_url, readonly=True) as store:
        values, problems = store.history(
            TEST, "cpu", "eval/loss", 60, limit=5, environment=ENV_GOOD
        )
        assert len(values) == 3 and problems == []
        values, (problem,) = store.history(
            TEST, "cpu", "eval/loss", 60, limit=5, environment=ENV_BAD
        )
        assert values == [] and "run(s) 2, 4, 6 (environment " in problem, problem
        # a writer whose clock runs ahead is the honest cause; a damaged store the other
        assert "clock runs more than 10 min ahead of this machine's" in problem, problem
        assert "damaged or crafted" in problem
        _, (problem,) = store.history(TEST, "cpu", "eval/loss", 60, limit=5)
        assert "run(s) 2, 4, 6:" in problem


def test_the_bounds_of_created_in_messages_come_from_the_constants(tmp_path, monkeypatch):
    from datetime import UTC, datetime, timedelta

    from mizzen_ci import history

    monkeypatch.setattr(history, "EARLIEST", datetime(2021, 3, 1, tzinfo=UTC))
    monkeypatch.setattr(history, "MAX_CLOCK_SKEW", timedelta(minutes=5))
    bounds = "from 2021-03-01 to 5 min after now by this machine's clock"
    path = str(tmp_path / "metrics.sqlite")
    with open_store(path) as store:
        with pytest.raises(StoreError) as refused:
            store.add_run(run("old", "2021-02-01T00:00:00+00:00"), {("eval/loss", 60): 1.0})
        assert bounds in str(refused.value), refused.value
        store.add_run(run("good", t(0)), {("eval/loss", 60): 1.0})
        store.add_run(run("shape", t(1)), {("eval/loss", 60): 1.0})
    crafted(
        path,
        "UPDATE runs SET created = ? WHERE source = 'shape'",
        ("2026-12-01 10:01:00.000000+00:00",),
    )
    crafted(path, "INSERT INTO runs (test, arch, pool, commit_sha, event, trusted, attempt, created, source)"
                  " VALUES (?, 'cpu', 'p', 'c', 'push', 1, 1, '2021-01-01T00:00:00.000000+00:00', 'x')", (TEST,))  # fmt: skip
    crafted(
        path,
        "INSERT INTO metric_values (run, metric, step, value, kind) VALUES (3, 'eval/loss', 60, 1.0, 'finite')",
    )
    with open_store(path, readonly=True) as store:
        _, problems = store.history(TEST, "cpu", "eval/loss", 60, limit=5)
    assert len(problems) == 2 and all(bounds in p for p in problems), problems
    assert "2020-01-01" not in "".join(problems)


def test_a_large_honest_store_lists_its_environments(tmp_path):
    # a walk of every row until 50 environments: 120,000 valid rows were called "damaged or
    # crafted"; the store is grouped by environment in SQL, each walked to its newest valid row
    from datetime import UTC, datetime, timedelta

    path = str(tmp_path / "metrics.sqlite")
    with open_store(path) as store:
        store.add_run(
            env_run("seed", "2024-01-01T00:00:00+00:00", ENV_BAD), {("eval/loss", 60): 1.0}
        )
    n, start = 150_000, datetime(2024, 1, 2, tzinfo=UTC)
    runs = [(i + 2, TEST, "cpu", "p", "a" * 40, "push", 1, 1,
             (start + timedelta(minutes=i)).isoformat(timespec="microseconds"), f"r{i}")
            for i in range(n)]  # fmt: skip
    conn = sqlite3.connect(path)
    with conn:  # one transaction
        conn.executemany("INSERT INTO runs (id, test, arch, pool, commit_sha, event, trusted, attempt,"
                         " created, source) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", runs)  # fmt: skip
        conn.executemany("INSERT INTO metric_values VALUES (?, 'eval/loss', 60, 1.0, 'finite')",
                         [(i + 2,) for i in range(n)])  # fmt: skip
        conn.executemany(
            "INSERT INTO run_environments VALUES (?, ?)", [(i + 2, ENV_GOOD) for i in range(n)]
        )
    conn.close()
    with open_store(path, readonly=True) as store:
        assert store.environments(TEST, "cpu", "eval/loss", 60) == [ENV_GOOD, ENV_BAD]
        values, problems = store.history(
            TEST, "cpu", "eval/loss", 60, limit=20, environment=ENV_BAD
        )
        assert [v.source for v in values] == ["seed"] and problems == []
        assert store.last_steps(TEST, "cpu", "eval/loss") == (60,)
