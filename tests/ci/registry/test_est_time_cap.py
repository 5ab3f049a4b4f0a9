"""One ceiling for a test file's time (issue 31, mechanism 6): ``est_time`` is at most
MAX_EST_TIME_SECONDS (3 hours), a `file:line: [est-time] … Fix: …` error beyond it; whatever the
registrations, the recorded durations and the budget, every job the plan emits has a timeout within
the workflows' job limit (MAX_JOB_TIMEOUT_MINUTES), and a GPU lane's per-file timeout too."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mizzen_ci import history, register_cpu_ci
from mizzen_ci.fleet import MAX_JOB_SETUP_S, load_fleet
from mizzen_ci.lane.runner import MAX_FILE_TIMEOUT_S, RunnerConfig
from mizzen_ci.plan.change import Change
from mizzen_ci.plan.jobs import TIMEOUT_FACTOR, TIMEOUT_SLACK_MINUTES
from mizzen_ci.plan.pipeline import MAX_BUDGET_SECONDS, PlanOptions, build_plan
from mizzen_ci.plan.request import Inputs
from mizzen_ci.registry import read_source
from mizzen_ci.registry.rules import MAX_EST_TIME_SECONDS, MAX_JOB_TIMEOUT_MINUTES

register_cpu_ci(est_time=60, labels=["ci"])

FLEET_FILE = Path(__file__).parents[1] / "fixtures" / "registry" / "fleet.toml"
FLEET = load_fleet(FLEET_FILE)
CPU = "from mizzen_ci import register_cpu_ci\nregister_cpu_ci(est_time={est}, labels=['ci'])\n"
GPU = (
    "from mizzen_ci import register_cuda_ci\n"
    "register_cuda_ci(est_time={est}, hardware=['hopper'], num_gpus={gpus}, labels=['lora'])\n"
)


@pytest.mark.parametrize("literal", ["604800", "10801", "86400.0", "1e5"])
def test_an_est_time_over_three_hours_is_a_registry_error(literal):
    reg, errors = read_source(CPU.format(est=literal), "tests/test_x.py", FLEET)
    assert reg is None and len(errors) == 1
    text = str(errors[0])
    assert text.startswith("tests/test_x.py:2: [est-time]") and "at most 10800 s" in text
    assert "Fix: " in text and "split" in text


def test_the_ceiling_is_accepted_and_its_one_file_job_fits_the_workflow_limit():
    reg, errors = read_source(CPU.format(est=MAX_EST_TIME_SECONDS), "tests/test_x.py", FLEET)
    assert errors == [] and reg.est_time == MAX_EST_TIME_SECONDS
    worst = (MAX_JOB_SETUP_S + MAX_EST_TIME_SECONDS * TIMEOUT_FACTOR) / 60 + TIMEOUT_SLACK_MINUTES
    assert worst <= MAX_JOB_TIMEOUT_MINUTES  # the cap fits without the clamp
    assert MAX_FILE_TIMEOUT_S == MAX_JOB_TIMEOUT_MINUTES * 60


registrations = st.lists(
    st.tuples(
        st.one_of(st.integers(1, 7 * 86400), st.floats(0.001, MAX_EST_TIME_SECONDS)),
        st.sampled_from([None, 1, 2, 8]),  # None: a CPU test
        st.one_of(st.none(), st.floats(0, history.MAX_SECONDS)),  # a recorded duration
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=40, deadline=None)
@given(tests=registrations, budget=st.floats(600, MAX_BUDGET_SECONDS))  # over every set-up
def test_any_registration_gives_jobs_within_the_workflow_job_limit(tests, budget):
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        (root / "ci").mkdir()
        (root / "ci" / "fleet.toml").write_text(FLEET_FILE.read_text())
        records = []
        for i, (est, gpus, seconds) in enumerate(tests):
            path = f"tests/test_{i}.py"
            source = CPU.format(est=est) if gpus is None else GPU.format(est=est, gpus=gpus)
            (root / path).parent.mkdir(exist_ok=True)
            (root / path).write_text(source)
            if seconds is not None:
                arch = None if gpus is None else "hopper"
                lane = "cpu" if gpus is None else "gpu-hopper"
                records.append(history.Record(path, arch, seconds, "passed", "2026-12-01", lane))
        store = root / "history.jsonl"
        history.append(store, records)
        change = Change.unusable("no git in this test", None, None)
        plan = build_plan(
            root,
            FLEET,
            change,
            Inputs(event="schedule", cadence="nightly"),
            PlanOptions(budget_seconds=budget, min_job_seconds=0, history=(store,)),
        )
    over = {f"tests/test_{i}.py" for i, t in enumerate(tests) if t[0] > MAX_EST_TIME_SECONDS}
    assert {e.split(":")[0] for e in plan.errors} == over
    planned = {t.file for j in plan.jobs for t in j.tests}
    assert planned == {f"tests/test_{i}.py" for i in range(len(tests))} - over
    assert all(0 < j.timeout_minutes <= MAX_JOB_TIMEOUT_MINUTES for j in plan.jobs)


@given(
    est=st.floats(allow_nan=True, allow_infinity=True),
    factor=st.floats(0.001, 1e300),
    floor=st.floats(0, 1e6),
)
def test_a_lane_file_timeout_never_exceeds_the_job_limit(est, factor, floor):
    config = RunnerConfig(
        root=Path("."), arch="hopper", gpus=(), report_dir=Path("."), lease_dir=Path("."),
        timeout_factor=factor, min_timeout_s=floor,
    )  # fmt: skip
    assert config.timeout_for(est) <= MAX_FILE_TIMEOUT_S
