"""Baselines that survive environment changes, on both stores: a two-environment history (an
image and torch bump) where an unchanged metric passes across the bump and a real regression in
the new environment fails, the summary saying "new environment: X -> Y"; the new environment's
trusted runs then build its own baseline; and a store written before environments existed (no
`run_environments` table, opened read-only) still loads, as the environment "unknown"."""

from __future__ import annotations

import datetime as dt
import sqlite3
from dataclasses import replace

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.gate.artefacts import Point, point_from
from mizzen_ci.gate.backends import open_store
from mizzen_ci.gate.check import run_gate
from mizzen_ci.gate.declarations import Declarations, Gate
from mizzen_ci.gate.environment import UNKNOWN, checked, describe_change
from mizzen_ci.gate.store import RunInfo, StoreError

register_cpu_ci(est_time=8, labels=["ci"])

TEST = "tests/x/test_a.py"
LOSS = Gate(TEST, 3, "eval/loss", "lower", 0.0, steps="last")  # no tolerance: the noise band only
OLD = "python=3.12.3; torch=2.11.0+cu130; runtime=cuda-13.0; driver=580.82.07; gpu=NVIDIA H200; image=sha256:aaaa"
NEW = "python=3.12.3; torch=2.13.0+cu130; runtime=cuda-13.0; driver=580.82.07; gpu=NVIDIA H200; image=sha256:bbbb"
OLD_LOSSES = [1.00, 1.01, 0.99, 1.00, 1.02, 0.98, 1.01, 0.99]  # median 1.0, MAD 0.01: band 0.0445


def add(store, i: int, loss: float, env: str, *, trusted: bool = True) -> None:
    store.add_run(RunInfo(TEST, "cpu", "p", f"{i:040x}", None, "push" if trusted else "pull_request",
                          trusted, 1, f"2026-11-{i + 1:02d}T00:00:00+00:00", f"run-{i}", env),
                  {("eval/loss", 60): loss})  # fmt: skip


def judge(store, value: float, env: str):
    pts = [
        Point(
            TEST,
            "cpu",
            "eval/loss",
            60,
            value,
            "now",
            None,
            "2026-12-01T00:00:00.000000+00:00",
            env,
        )
    ]
    return run_gate(Declarations(gates={TEST: [LOSS]}), pts, store, [(TEST, "cpu")], [],
                    today=dt.date(2026, 12, 1))  # fmt: skip


@pytest.fixture
def two_environments(store_url):
    with open_store(store_url) as store:
        for i, loss in enumerate(OLD_LOSSES):
            add(store, i, loss, OLD)
        add(store, 8, 1.05, NEW)  # the image bump's first trusted run: a little higher
        add(store, 9, 50.0, NEW, trusted=False)  # a pull request's: never a reference
    return store_url


def test_an_image_bump_passes_an_unchanged_metric_and_fails_a_real_regression(two_environments):
    with open_store(two_environments, readonly=True) as store:
        assert store.environments(TEST, "cpu", "eval/loss", 60) == [NEW, OLD]
        moved = judge(store, 1.06, NEW)  # beyond the old band (1.0 ± 0.0445), inside twice it
        (row,) = moved.rows
        assert (row.verdict, row.fails) == ("pass", False), row.why
        assert row.why.startswith("new environment (under 5 trusted values of its own)")
        assert row.band == pytest.approx(2 * 3 * 1.4826 * 0.01) and len(row.history) == 8
        assert moved.notes == [f"{TEST} on cpu: new environment: torch 2.11.0+cu130 -> 2.13.0+cu130, "
                               "image sha256:aaaa -> sha256:bbbb"]  # fmt: skip
        regressed = judge(store, 1.15, NEW)
        assert [r.verdict for r in regressed.rows] == ["FAIL"] and regressed.failed
        # the same 1.06 in the old environment is judged by its own band, unwidened: it fails
        assert [r.verdict for r in judge(store, 1.06, OLD).rows] == ["FAIL"]


def test_the_new_environments_trusted_runs_build_its_own_baseline(two_environments):
    with open_store(two_environments) as store:
        for i, loss in enumerate([1.07, 1.03, 1.06, 1.04, 1.05], start=10):
            add(store, i, loss, NEW)
    with open_store(two_environments, readonly=True) as store:
        result = judge(store, 1.06, NEW)
        (row,) = result.rows
        assert (
            row.verdict == "pass" and not row.why.startswith("new environment") and not result.notes
        )
        assert row.reference == pytest.approx(1.05) and len(row.history) == 6  # NEW's own values
        assert judge(store, 1.00, NEW).rows[0].verdict == "improved"  # its band, not OLD's


def test_a_store_written_before_environments_loads_as_unknown(tmp_path):
    path = tmp_path / "metrics.sqlite"
    with open_store(str(path)) as store:
        for i, loss in enumerate(OLD_LOSSES):
            add(store, i, loss, UNKNOWN)
    with sqlite3.connect(path) as conn:  # what an older mizzen-ci wrote: no such table
        conn.execute("DROP TABLE run_environments")
    with open_store(str(path), readonly=True) as store:
        assert store.environments(TEST, "cpu", "eval/loss", 60) == [UNKNOWN]
        assert [r.verdict for r in judge(store, 1.01, UNKNOWN).rows] == ["pass"]
        bumped = judge(store, 1.06, NEW)  # the first known environment: new against "unknown"
        assert bumped.rows[0].verdict == "pass" and bumped.notes == [
            f"{TEST} on cpu: new environment: unknown -> {NEW}"
        ]
        assert judge(store, 1.15, NEW).rows[0].verdict == "FAIL"


def test_an_artefact_line_without_env_is_unknown_and_a_bad_env_is_refused(tmp_path):
    line = {"v": 1, "test": TEST, "arch": "cpu", "metric": "eval/loss", "step": 60, "value": 1.0,
            "run": "r", "job": None, "when": "2026-12-01T00:00:00+00:00"}  # fmt: skip
    assert point_from(line, "a.jsonl:1").env == UNKNOWN
    assert point_from(line | {"env": NEW}, "a.jsonl:1").env == NEW
    for bad in (
        "torch 2.11",
        "cuda=13.0",
        "python=3.12; python=3.13",
        "gpu=",
        7,
        "x" * 600,
        "gpu=a;b",
    ):
        with pytest.raises(ValueError, match=r"a\.jsonl:1: `env`"):
            point_from(line | {"env": bad}, "a.jsonl:1")
    with (
        open_store(str(tmp_path / "s.sqlite")) as store,
        pytest.raises(StoreError, match="environment"),
    ):
        add(store, 0, 1.0, "torch=2.11; torch=2.12")
    assert checked(NEW) == NEW and describe_change(UNKNOWN, NEW) == f"unknown -> {NEW}"


def test_the_probe_reads_the_driver_sku_and_lock_hash(tmp_path, monkeypatch):
    """What `nvidia-smi --query-gpu=driver_version,name --format=csv,noheader` prints on the H200
    machine (`580.82.07, NVIDIA H200`) becomes driver and gpu; the image is the lock's hash
    unless the runner names its digest.  (A stand-in nvidia-smi: no GPU here.)"""
    import hashlib
    import os

    from mizzen_ci.gate import environment

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '580.82.07, NVIDIA H200'\necho '580.82.07, NVIDIA H200'\n")
    smi.chmod(0o755)
    (tmp_path / "uv.lock").write_text("version = 1\n")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for name in ("MIZZEN_ENVIRONMENT", "MIZZEN_IMAGE_DIGEST"):
        monkeypatch.delenv(name, raising=False)
    environment._probe.cache_clear()
    facts = environment.parse(environment.current(tmp_path))
    lock = "lock:" + hashlib.sha256(b"version = 1\n").hexdigest()[:16]
    assert (facts["driver"], facts["gpu"], facts["image"]) == ("580.82.07", "NVIDIA H200", lock)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the CPU lane: no GPU, whatever is installed
    monkeypatch.setenv("MIZZEN_IMAGE_DIGEST", "sha256:4f1c")
    environment._probe.cache_clear()
    facts = environment.parse(environment.current(tmp_path))
    assert (facts["driver"], facts["gpu"], facts["image"]) == ("none", "none", "sha256:4f1c")
    environment._probe.cache_clear()


BAD = OLD.replace("aaaa", "cccc")


def test_a_newer_environment_whose_values_are_all_bad_never_takes_the_fallback(tmp_path):
    # its run's values were not checked: it became the "previous environment" (no history), the
    # fallback to OLD was lost and a regression in NEW went inactive and passed
    path = tmp_path / "metrics.sqlite"
    with open_store(str(path)) as store:
        for i, loss in enumerate(OLD_LOSSES):
            add(store, i, loss, OLD)
        store.add_run(RunInfo(TEST, "cpu", "p", "b" * 40, None, "push", True, 1,
                              "2026-11-20T00:00:00+00:00", "bad", BAD),
                      {("eval/loss", 60): float("nan"), ("eval/loss", 61): float("nan")})  # fmt: skip
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE metric_values SET value = 5.0 WHERE kind = 'nan'")
    with open_store(str(path), readonly=True) as store:
        result = judge(store, 1.15, NEW)
    assert [(r.step, r.verdict) for r in result.rows] == [(60, "FAIL")], result.rows
    assert result.rows[0].why.startswith("new environment") and result.failed
    assert result.notes == [f"{TEST} on cpu: new environment: {describe_change(OLD, NEW)}"]


def test_a_run_left_out_of_the_history_is_reported_once(tmp_path):
    # each history read named every out-of-bounds run of the series, whatever its environment:
    # judged in NEW, the reads of NEW's and OLD's history (per run judged) repeated one problem
    path = tmp_path / "metrics.sqlite"
    with open_store(str(path)) as store:
        for i, loss in enumerate(OLD_LOSSES):
            add(store, i, loss, OLD)
        add(store, 20, 1.0, BAD)
    with sqlite3.connect(path) as conn:
        conn.execute(
            "UPDATE runs SET created = '2099-01-01T00:00:00.000000+00:00' WHERE source = 'run-20'"
        )
    pts = [Point(TEST, "cpu", "eval/loss", 60, 1.0, run, None, f"2026-12-01T00:0{i}:00.000000+00:00", NEW)
           for i, run in enumerate(("now-1", "now-2"))]  # fmt: skip
    with open_store(str(path), readonly=True) as store:
        result = run_gate(Declarations(gates={TEST: [LOSS]}), pts, store, [(TEST, "cpu")], [],
                          today=dt.date(2026, 12, 1))  # fmt: skip
        assert [r.verdict for r in result.rows] == ["pass", "pass"]
        assert result.problems == [], result.problems  # run 9 is BAD's: neither NEW's nor OLD's
        # judged in BAD (no valid value: against OLD), each run reads BAD's history: named once
        bad = [replace(p, env=BAD) for p in pts]
        result = run_gate(Declarations(gates={TEST: [LOSS]}), bad, store, [(TEST, "cpu")], [],
                          today=dt.date(2026, 12, 1))  # fmt: skip
        assert [r.verdict for r in result.rows] == ["pass", "pass"]
        (problem,) = result.problems
        assert "run(s) 9 (environment 'python=3.12.3; torch=2.11.0" in problem, problem
