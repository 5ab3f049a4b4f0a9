"""Recording (mizzen_ci.metrics.record) and reading metric artefacts: what a test records lands
under the lane's artefact folder with its test file, arch and run; bad arguments are refused at
once; a hostile artefact line is dropped with its path:line, never a traceback; ingesting the
same artefact twice stores nothing twice, and a pull request's values are never trusted."""

from __future__ import annotations

import json
import math

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.gate.artefacts import read_points
from mizzen_ci.gate.backends import open_store
from mizzen_ci.metrics import MetricError, record

register_cpu_ci(est_time=10, labels=["ci"])

TEST = "tests/ci/gate/test_gate_artefacts.py"
ENV = "python=3.12.3; torch=2.11.0+cu130; runtime=cuda-13.0; driver=580.82.07; gpu=NVIDIA H200; image=sha256:4f1c"


@pytest.fixture
def metrics_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MIZZEN_METRICS_DIR", str(tmp_path / "metrics"))
    monkeypatch.setenv("MIZZEN_RUN_KEY", "gh-123-1-cpu-1")
    monkeypatch.setenv("MIZZEN_JOB", "cpu-1")
    monkeypatch.setenv("MIZZEN_LANE", "cpu")
    monkeypatch.setenv("MIZZEN_ENVIRONMENT", ENV)
    return tmp_path / "metrics"


def test_record_writes_a_line_for_the_running_test(metrics_dir):
    path = record("eval/score", 0.75, step=60)
    assert path == metrics_dir / "cpu.jsonl"
    record("eval/heldout_loss", math.nan, step=60)
    record("eval/heldout_loss", -math.inf, step=61)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0] | {"when": None} == {
        "v": 1, "test": TEST, "arch": "cpu", "metric": "eval/score", "step": 60, "value": 0.75,
        "run": "gh-123-1-cpu-1", "job": "cpu-1", "when": None, "env": ENV,
    }  # fmt: skip
    assert [line["value"] for line in lines[1:]] == ["nan", "-inf"]  # recorded as such
    points, problems = read_points(metrics_dir)
    assert problems == [] and points[0].value == 0.75 and points[0].env == ENV
    assert math.isnan(points[1].value) and points[2].value == -math.inf


def test_a_gpu_lane_records_into_its_own_file(metrics_dir, monkeypatch):
    monkeypatch.setenv("MIZZEN_LANE", "hopper")
    assert record("eval/score", 1, step=0).name == "gpu-hopper.jsonl"
    (point,), _ = read_points(metrics_dir)
    assert point.arch == "hopper"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("eval/scroe", 1.0), "unknown metric 'eval/scroe'"),
        (("Eval Score", 1.0), "is not 1-64 characters"),
        (("eval/score", True), "must be a real number, got bool"),
        (("eval/score", "0.5"), "must be a real number, got str"),
        (("eval/score", 1e301), "within"),
    ],
)
def test_record_refuses_bad_values_at_once(metrics_dir, args, message):
    with pytest.raises(MetricError, match=message):
        record(*args, step=1)
    assert not metrics_dir.exists()


@pytest.mark.parametrize("step", [-1, 10**10, 1.5, True])
def test_record_refuses_bad_steps(metrics_dir, step):
    with pytest.raises(MetricError, match="step"):
        record("eval/score", 0.5, step=step)


def test_record_refuses_a_bad_run_key_or_test(metrics_dir, monkeypatch):
    monkeypatch.setenv("MIZZEN_RUN_KEY", "a key with spaces")
    with pytest.raises(MetricError, match="MIZZEN_RUN_KEY"):
        record("eval/score", 0.5, step=1)
    monkeypatch.delenv("MIZZEN_RUN_KEY")
    with pytest.raises(MetricError, match="not a test file path"):
        record("eval/score", 0.5, step=1, test="../outside/test_x.py")


HOSTILE = [
    ('["a list"]', "a metric line is a JSON object"),
    ('{"v": 2}', "not a version-1 metric line"),
    ('{"v": 1, "test": "../../etc/test_x.py"}', "`test` must be a test file path"),
    ('{"v": 1, "test": "tests/test_x.py", "arch": "HOPPER"}', "`arch` must be an arch name"),
    ('{"v": 1, "test": "tests/test_x.py", "arch": "cpu", "metric": "x\\u202ey", "step": 1}', "`metric` must be"),
    ('{"v": 1, "test": "tests/test_x.py", "arch": "cpu", "metric": "m", "step": true}', "`step` must be an integer"),
    ('{"v": 1, "test": "tests/test_x.py", "arch": "cpu", "metric": "m", "step": 1, "value": 1' + "0" * 400 + "}", "within"),
    ('{"v": 1, "test": "tests/test_x.py", "arch": "cpu", "metric": "m", "step": 1, "value": "NaN"}', "must be a number or"),
    ('{"v": 1, "test": "tests/test_x.py", "arch": "cpu", "metric": "m", "step": 1, "value": 1, "run": "", "when": "x"}', "`run` must be"),
    ('{"v": 1, "test": "tests/test_x.py", "arch": "cpu", "metric": "m", "step": 1, "value": 1, "run": "r", "when": "2026-12-01"}', "`when` must be"),
    # valid ISO-8601 times whose UTC form is out of range: no OverflowError traceback
    ('{"v": 1, "test": "tests/test_x.py", "arch": "cpu", "metric": "m", "step": 1, "value": 1, "run": "r", "when": "9999-12-31T23:59:59-23:59"}', "`when` must be"),
    ('{"v": 1, "test": "tests/test_x.py", "arch": "cpu", "metric": "m", "step": 1, "value": 1, "run": "r", "when": "0001-01-01T00:00:00+23:59"}', "`when` must be"),
    ("{" * 100000, "over"),
    ("not json", "not JSON"),
    ('{"v": 1, "n": ' + "9" * 5000 + "}", "not usable JSON"),
]  # fmt: skip


def test_hostile_artefact_lines_are_dropped_with_path_and_line(tmp_path, deadline):
    path = tmp_path / "cpu.jsonl"
    good = '{"v": 1, "test": "tests/test_x.py", "arch": "cpu", "metric": "m", "step": 1, "value": 2.5, "run": "r", "job": null, "when": "2026-12-01T10:00:00+00:00"}'
    path.write_text("\n".join([good, *(line for line, _ in HOSTILE)]) + "\n")
    with deadline(10):
        points, problems = read_points(tmp_path)
    assert [p.value for p in points] == [2.5]
    assert len(problems) == len(HOSTILE)
    for lineno, ((_, message), problem) in enumerate(zip(HOSTILE, problems, strict=True), 2):
        assert problem.startswith(f"{path}:{lineno}: ") and message in problem, problem


def test_links_and_fifos_among_artefacts_are_refused(tmp_path):
    import os

    (tmp_path / "real.jsonl").write_text("")
    os.symlink("/etc/passwd", tmp_path / "link.jsonl")
    os.mkfifo(tmp_path / "fifo.jsonl")
    points, problems = read_points([tmp_path / "link.jsonl", tmp_path / "fifo.jsonl"])
    assert points == [] and len(problems) == 2
    assert "FIFO" in problems[0] and "symbolic link" in problems[1]  # in path order


def test_ingest_is_idempotent_and_never_trusts_a_pull_request(
    tmp_path, mizzen_ci, points, write_points
):
    artefact = write_points(
        tmp_path / "a" / "cpu.jsonl",
        points(run="gh-1-1-cpu-1", job="cpu-1", eval__score_at_60=0.8, eval__heldout_loss_at_60=0.3)
        + points(run="gh-1-1-cpu-1", test="tests/x/test_b.py", eval__score_at_60=0.7),
    )
    store = tmp_path / "metrics.sqlite"
    ingest = (
        "gate",
        "ingest",
        "--store",
        str(store),
        "--trusted",
        "--event",
        "push",
        "--commit",
        "a" * 40,
    )
    first = mizzen_ci(*ingest, str(artefact))
    assert first.returncode == 0, first.stderr
    assert "2 run(s) stored (trusted), 0 already stored" in first.stdout
    # the artefact downloaded again beside itself (a re-upload): nothing counts twice
    copy = write_points(tmp_path / "b" / "cpu.jsonl", read_points(artefact)[0])
    again = mizzen_ci(*ingest, str(artefact.parent), str(copy.parent))
    assert "0 run(s) stored (trusted), 2 already stored" in again.stdout
    with open_store(str(store), readonly=True) as s:
        assert s.count_runs() == 2
        assert len(s.history("tests/x/test_a.py", "cpu", "eval/score", 60, limit=9)[0]) == 1
    refused = mizzen_ci("gate", "ingest", "--store", str(store), "--trusted", "--event",
                        "pull_request", "--pr", "7", "--commit", "b" * 40, str(artefact))  # fmt: skip
    assert refused.returncode == 2 and "never trusted" in refused.stderr
    untrusted = mizzen_ci("gate", "ingest", "--store", str(store), "--untrusted", "--event",
                          "pull_request", "--pr", "7", "--commit", "b" * 40, str(artefact))  # fmt: skip
    assert untrusted.returncode == 0 and "2 already stored" in untrusted.stdout  # same run keys


def test_ingest_drops_conflicting_values_and_names_them(tmp_path, mizzen_ci, points, write_points):
    artefact = write_points(
        tmp_path / "cpu.jsonl",
        points(run="r1", eval__score_at_60=0.8, eval__heldout_loss_at_60=0.3)
        + points(run="r1", eval__score_at_60=0.1),
    )
    out = mizzen_ci("gate", "ingest", "--store", str(tmp_path / "s.sqlite"), "--trusted",
                    "--event", "local", "--commit", "local", str(artefact))  # fmt: skip
    assert out.returncode == 0 and "1 run(s) stored" in out.stdout
    assert "eval/score@60 recorded with different values; not stored" in out.stderr
    with open_store(str(tmp_path / "s.sqlite"), readonly=True) as s:
        assert s.history("tests/x/test_a.py", "cpu", "eval/score", 60, limit=9)[0] == []
        assert len(s.history("tests/x/test_a.py", "cpu", "eval/heldout_loss", 60, limit=9)[0]) == 1
