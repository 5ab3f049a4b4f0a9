"""The eval dispatcher with real threads and real directories: results land at the snapshot's
step whatever order points finish in, the in-flight limit skips or waits, the final point is never
skipped, each snapshot is deleted exactly once (also when the evaluator raises or the export
fails), a resumed run's results are never redone, drain() waits for everything, and close()
closes every evaluator (one that raises does not keep the others open) and reports its events."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=5, labels=["train"])


class Recorder:
    """An evaluator that waits for its step's gate (if any) and reports the snapshot it saw."""

    needs_engine = False

    def __init__(self, name="probe", gates=None, fail_at=(), skip_at=(), bad_at=()):
        self.name = name
        self.gates = gates or {}
        self.fail_at, self.skip_at, self.bad_at = set(fail_at), set(skip_at), set(bad_at)
        self.started: list[int] = []
        self.finished: list[int] = []

    def evaluate(self, snapshot):
        from mizzen_train.eval_dispatch import EvalSkip

        self.started.append(snapshot.step)
        gate = self.gates.get(snapshot.step)
        if gate is not None:
            assert gate.wait(10), f"gate of step {snapshot.step} never opened"
        marker = json.loads((snapshot.path / "config.json").read_text())
        assert marker == {"step": snapshot.step, "tenant": snapshot.tenant}
        self.finished.append(snapshot.step)
        if snapshot.step in self.fail_at:
            raise RuntimeError(f"evaluator broke at {snapshot.step}")
        if snapshot.step in self.skip_at:
            raise EvalSkip("nothing to score here")
        if snapshot.step in self.bad_at:
            return {"score": float("nan")}
        snapshot.note("looked", tenant=snapshot.tenant)
        return {"score": snapshot.step / 100}


def make_dispatcher(tmp_path, evaluators, *, tenants=("a", "b"), fail_export=(), **kwargs):
    from mizzen_train.eval_dispatch import EvalDispatcher

    exports: list[tuple[int, str]] = []

    def export(step, tenant, directory: Path):
        exports.append((step, tenant))
        if step in fail_export and tenant == tenants[-1]:
            raise OSError("disk full")
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps({"step": step, "tenant": tenant}))

    records, points = [], []
    dispatcher = EvalDispatcher(
        evaluators=evaluators,
        tenants=list(tenants),
        export=export,
        snapshot_root=tmp_path / "snapshots",
        on_record=records.append,
        on_point=points.append,
        **kwargs,
    )
    return dispatcher, exports, records, points


def test_results_are_logged_at_their_snapshot_step_whatever_finishes_first(tmp_path):
    slow = threading.Event()
    probe = Recorder(gates={10: slow})
    dispatcher, exports, records, points = make_dispatcher(
        tmp_path, [probe], max_in_flight=2, keep_snapshots=0
    )
    assert dispatcher.submit(10) == "dispatched"
    assert dispatcher.submit(20) == "dispatched"  # not blocked: training goes on
    deadline = time.monotonic() + 10
    while 20 not in [p.step for p in points] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [p.step for p in points] == [20], "point 20 settles while 10 is still running"
    slow.set()
    outcomes = dispatcher.drain(timeout_s=10)
    assert [o.step for o in outcomes] == [10, 20] and all(o.status == "ok" for o in outcomes)
    assert [p.step for p in points] == [20, 10]
    assert {(r.step, r.tenant): r.metrics["score"] for r in records} == {
        (10, "a"): 0.1,
        (10, "b"): 0.1,
        (20, "a"): 0.2,
        (20, "b"): 0.2,
    }
    assert exports == [(10, "a"), (10, "b"), (20, "a"), (20, "b")]
    assert records[0].events[0]["event"] == "looked"
    assert sorted(dispatcher.deleted) == [
        tmp_path / "snapshots" / f"step-{s:08d}" for s in (10, 20)
    ]
    assert not list((tmp_path / "snapshots").iterdir())


def test_in_flight_limit_skips_but_never_the_final_point(tmp_path):
    gate = threading.Event()
    probe = Recorder(gates={10: gate})
    dispatcher, exports, records, _points = make_dispatcher(
        tmp_path, [probe], max_in_flight=1, overflow="skip", keep_snapshots=0
    )
    assert dispatcher.submit(10) == "dispatched"
    assert dispatcher.submit(20) == "skipped"
    skipped = [r for r in records if r.step == 20]
    assert {r.tenant for r in skipped} == {"a", "b"} and all(r.status == "skipped" for r in skipped)
    assert "max_in_flight=1" in skipped[0].reason and "overflow='skip'" in skipped[0].reason
    assert (20, "a") not in exports, "a skipped point exports nothing"

    opened_at = []

    def release():
        time.sleep(0.3)
        opened_at.append(time.monotonic())
        gate.set()

    threading.Thread(target=release).start()
    assert dispatcher.submit(30, final=True) == "dispatched"  # waited instead of skipping
    assert opened_at and time.monotonic() >= opened_at[0]
    outcomes = {o.step: o for o in dispatcher.drain(timeout_s=10)}
    assert outcomes[10].status == "ok" and outcomes[30].status == "ok" and outcomes[30].final
    assert outcomes[20].status == "skipped"


def test_wait_policy_blocks_the_next_point_until_a_place_frees(tmp_path):
    gate = threading.Event()
    probe = Recorder(gates={10: gate})
    dispatcher, _, records, _ = make_dispatcher(
        tmp_path, [probe], tenants=("a",), max_in_flight=1, overflow="wait", keep_snapshots=0
    )
    dispatcher.submit(10)
    threading.Timer(0.3, gate.set).start()
    started = time.monotonic()
    assert dispatcher.submit(20) == "dispatched"
    assert time.monotonic() - started >= 0.25
    dispatcher.drain(timeout_s=10)
    assert [(r.step, r.status) for r in records] == [(10, "ok"), (20, "ok")]
    assert probe.started == [10, 20]


def test_every_snapshot_is_deleted_exactly_once_whatever_happens(tmp_path):
    probe = Recorder(fail_at={20}, skip_at={30}, bad_at={40})
    dispatcher, _, records, _points = make_dispatcher(
        tmp_path, [probe], max_in_flight=1, overflow="wait", keep_snapshots=0, fail_export={50}
    )
    for step in (10, 20, 30, 40, 50):
        dispatcher.submit(step)
    assert dispatcher.submit(60, final=True) == "dispatched"
    outcomes = {o.step: o for o in dispatcher.drain(timeout_s=10)}
    assert {s: o.status for s, o in outcomes.items()} == {
        10: "ok",
        20: "skipped",
        30: "skipped",
        40: "skipped",
        50: "skipped",
        60: "ok",
    }
    reasons = {r.step: r.reason for r in records if r.status == "skipped"}
    assert "RuntimeError: evaluator broke at 20" in reasons[20]
    assert "test_eval_dispatch.py" in reasons[20], "the reason says where it raised"
    assert reasons[30] == "probe: nothing to score here"
    assert "score=nan, not finite" in reasons[40]
    assert reasons[50] == "export failed: OSError: disk full"
    assert 50 not in probe.started
    root = tmp_path / "snapshots"
    assert sorted(dispatcher.deleted) == [root / f"step-{s:08d}" for s in (10, 20, 30, 40, 50, 60)]
    assert len(set(dispatcher.deleted)) == len(dispatcher.deleted)
    assert not list(root.iterdir())


def test_keep_snapshots_keeps_the_newest_settled_points(tmp_path):
    dispatcher, _, _, _ = make_dispatcher(
        tmp_path, [Recorder()], max_in_flight=1, overflow="wait", keep_snapshots=2
    )
    for step in (10, 20, 30):
        dispatcher.submit(step)
    dispatcher.submit(40, final=True)
    dispatcher.drain(timeout_s=10)
    root = tmp_path / "snapshots"
    assert sorted(p.name for p in root.iterdir()) == ["step-00000030", "step-00000040"]
    assert dispatcher.deleted == [root / "step-00000010", root / "step-00000020"]
    assert sorted(p.name for p in (root / "step-00000040").iterdir()) == ["a", "b"]


def test_settled_results_are_never_redone_and_recovery_uses_surviving_snapshots(tmp_path):
    probe, other = Recorder(), Recorder(name="other")
    root = tmp_path / "snapshots"
    survivor = root / "step-00000030"
    for tenant in ("a", "b"):
        (survivor / tenant).mkdir(parents=True)
        (survivor / tenant / "config.json").write_text(json.dumps({"step": 30, "tenant": tenant}))
    settled = {(10, "a", "probe"), (10, "b", "probe"), (10, "a", "other"), (10, "b", "other")}
    settled |= {(20, "a", "probe"), (20, "b", "probe")}
    dispatcher, exports, records, _points = make_dispatcher(
        tmp_path, [probe, other], max_in_flight=1, overflow="wait", keep_snapshots=0,
        settled=settled,
    )  # fmt: skip
    assert dispatcher.submit(10) == "already"
    assert dispatcher.recover(30) == "dispatched"  # the killed run's complete snapshot
    assert dispatcher.recover(25) == "skipped"  # nothing survived
    assert dispatcher.submit(20) == "dispatched"
    dispatcher.drain(timeout_s=10)
    assert exports == [(20, "a"), (20, "b")]
    assert sorted((r.step, r.evaluator) for r in records if r.status == "ok") == [
        (20, "other"),
        (20, "other"),
        (30, "other"),
        (30, "other"),
        (30, "probe"),
        (30, "probe"),
    ]
    assert "snapshots of ['a', 'b'] are not on disk" in next(
        r.reason for r in records if r.step == 25
    )
    assert survivor in dispatcher.deleted and not survivor.exists()


def test_user_evaluators_load_from_an_import_path(tmp_path):
    from mizzen_train.eval_dispatch import EvalSpecError, load_evaluator

    module = tmp_path / "my_evals.py"
    module.write_text(
        "class Length:\n"
        "    needs_engine = False\n"
        "    def __init__(self, name, scale=1.0):\n"
        "        self.name, self.scale = name, scale\n"
        "    def evaluate(self, snapshot):\n"
        "        return {'files': self.scale * len(list(snapshot.path.iterdir()))}\n"
        "def broken():\n"
        "    return object()\n"
    )
    evaluator = load_evaluator(f"{module}:Length", {"name": "length", "scale": 2.0})
    dispatcher, _, records, _ = make_dispatcher(tmp_path, [evaluator], keep_snapshots=0)
    dispatcher.submit(5, final=True)
    dispatcher.drain(timeout_s=10)
    assert [r.metrics for r in records] == [{"files": 2.0}, {"files": 2.0}]
    with pytest.raises(EvalSpecError, match="without 'name'"):
        load_evaluator(f"{module}:broken")
    with pytest.raises(EvalSpecError, match="raised TypeError"):
        load_evaluator(f"{module}:Length", {"nom": "x"})
    with pytest.raises(EvalSpecError, match="is not 'module:factory'"):
        load_evaluator("no_colon_here")
    with pytest.raises(EvalSpecError, match="importing 'no_such_module_xyz' failed"):
        load_evaluator("no_such_module_xyz:make")


class Keeper(Recorder):
    """A Recorder that keeps something between points and says so when closed."""

    def __init__(self, name, fail_close=False):
        super().__init__(name=name)
        self.fail_close, self.closes, self.kept = fail_close, 0, True

    def evaluate(self, snapshot):
        assert snapshot.root == snapshot.path.parent.parent, "the root of every point's snapshot"
        return super().evaluate(snapshot)

    def close(self):
        self.closes += 1
        if self.fail_close:
            raise RuntimeError("cannot close")
        events = [{"event": "released", "time": time.time(), "seen": self.finished[-1:]}]
        was, self.kept = self.kept, False
        return events if was else []


def test_close_closes_every_evaluator_and_reports_their_events(tmp_path, capsys):
    broken, keeper = Keeper("broken", fail_close=True), Keeper("keeper")
    plain = Recorder(name="plain")  # no close(): nothing to do
    events = []
    dispatcher, _, records, _ = make_dispatcher(
        tmp_path, [broken, plain, keeper], tenants=("a",), keep_snapshots=0,
        on_event=lambda evaluator, event: events.append((evaluator, event)),
    )  # fmt: skip
    dispatcher.submit(10, final=True)
    dispatcher.drain(timeout_s=10)
    assert keeper.closes == 0 and events == [], "nothing is closed before close()"
    dispatcher.close()
    dispatcher.close()  # again (the run's teardown after drain): each close() is called again
    assert (broken.closes, keeper.closes) == (2, 2)
    assert [(name, e["event"], e["seen"]) for name, e in events] == [("keeper", "released", [10])]
    assert "closing evaluator 'broken' failed" in capsys.readouterr().err
    assert all(r.status == "ok" for r in records)


def test_a_point_in_flight_when_close_starts_is_left_unsettled_for_a_resume(tmp_path):
    """The teardown stops kept engines under a running point, whose evaluation then fails: that
    is not the point's result.  It records nothing, so a resumed run evaluates it again."""
    gate = threading.Event()
    probe = Recorder(gates={10: gate}, skip_at=(10,))  # what a point whose engine died reports
    dispatcher, _, records, points = make_dispatcher(tmp_path, [probe], tenants=("a",))
    assert dispatcher.submit(10) == "dispatched"
    deadline = time.monotonic() + 10
    while 10 not in probe.started and time.monotonic() < deadline:
        time.sleep(0.01)
    dispatcher.close()
    gate.set()
    dispatcher.drain(timeout_s=10)
    assert probe.finished == [10], "the point ran to its end"
    assert records == [] and points == [], "nothing settled: a resume redoes step 10"
