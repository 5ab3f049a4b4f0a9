"""The eval dispatcher's Ray runner: each evaluation runs as a Ray task in another process (a
user evaluator shipped by value), the task closes its copy of the evaluator when the evaluation
ends, its notes (the close's too) come back with its result, a task that raises skips only its
own evaluation, and close() shuts down the Ray it started."""

from __future__ import annotations

import json
import os

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=25, labels=["train", "ray"])

EVALUATOR = """
import os


class WhereAmI:
    needs_engine = False

    def __init__(self, name):
        self.name = name

    def evaluate(self, snapshot):
        if snapshot.tenant == "broken":
            raise ValueError("no model here")
        snapshot.note("ran", pid=os.getpid())
        self.held = snapshot.step  # what a task's copy keeps: released when its task ends
        return {"pid": float(os.getpid()), "step": float(snapshot.step)}

    def close(self):
        held = getattr(self, "held", None)
        self.held = None
        return [] if held is None else [{"event": "released", "step": held, "pid": os.getpid()}]
"""


def test_evaluations_run_as_ray_tasks(tmp_path):
    import ray

    from mizzen_train.eval_dispatch import EvalDispatcher, load_evaluator

    os.environ["RAY_AUTH_MODE"] = "disabled"
    module = tmp_path / "where.py"
    module.write_text(EVALUATOR)
    evaluator = load_evaluator(f"{module}:WhereAmI", {"name": "where"})

    def export(step, tenant, directory):
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps({"step": step}))

    records = []
    dispatcher = EvalDispatcher(
        evaluators=[evaluator],
        tenants=["a", "broken"],
        export=export,
        snapshot_root=tmp_path / "snapshots",
        max_in_flight=2,
        keep_snapshots=0,
        runner="ray",
        on_record=records.append,
        ray_options={"num_cpus": 1},
    )
    try:
        dispatcher.submit(10)
        dispatcher.submit(20, final=True)
        outcomes = dispatcher.drain(timeout_s=180)
        assert ray.is_initialized()
    finally:
        dispatcher.close()
    assert not ray.is_initialized(), "close() shuts down the Ray it started"
    assert [(o.step, o.status) for o in outcomes] == [(10, "partial"), (20, "partial")]
    ok = [r for r in records if r.status == "ok"]
    assert sorted(r.metrics["step"] for r in ok) == [10.0, 20.0]
    assert all(r.metrics["pid"] != os.getpid() for r in ok), "ran in a Ray worker"
    assert all([e["event"] for e in r.events] == ["ran", "released"] for r in ok)
    assert all(r.events[1]["pid"] == r.metrics["pid"] for r in ok), "closed in its task"
    broken = [r for r in records if r.tenant == "broken"]
    assert all("ValueError: no model here" in r.reason for r in broken)
    assert not list((tmp_path / "snapshots").iterdir())
