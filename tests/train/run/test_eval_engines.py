"""The eval engine group's lease rules (``mizzen_train.eval_engines``) where real engines cannot
provoke them: points of ``engine_lifetime = "point"`` run side by side, a group whose second
engine fails to launch is stopped whole and not kept, and a group a point failed on -- or had
failed generations on (the evaluator's ``spoiled`` lease) -- is not handed to the next point.
The servers are stand-ins with ``ServerProcess``'s surface (checked below against the real
class); real engines serving kept points are tests/train/run/test_evaluators.py's."""

from __future__ import annotations

import inspect
import threading
import time
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=5, labels=["train"])

SURFACE = ("pid", "url", "process", "wait_healthy", "stop", "cleanup_logs")


class StandInServer:
    """What EvalEngines uses of a ServerProcess."""

    count = 0

    def __init__(self):
        StandInServer.count += 1
        self.pid = 1000 + StandInServer.count
        self.url = f"http://127.0.0.1:1/{self.pid}"
        self.process = type("Process", (), {"returncode": None})()
        self.stopped = 0

    def wait_healthy(self, timeout_s):
        from mizzen_rollout.api import LaunchError

        if self.stopped:
            raise LaunchError("exited")

    def stop(self):
        self.stopped += 1

    def cleanup_logs(self):
        pass


def test_the_stand_in_has_the_real_servers_surface():
    from mizzen_rollout.api import ServerProcess

    members = set(dir(ServerProcess)) | set(inspect.signature(ServerProcess).parameters)
    source = inspect.getsource(ServerProcess)
    for name in SURFACE:
        assert name in members or f"self.{name} =" in source, name


@pytest.fixture
def launches(monkeypatch):
    import mizzen_train.eval_engines as eval_engines

    launched: list[StandInServer] = []
    failing = {"at": None}

    def launch(**kwargs):
        if failing["at"] == len(launched) + 1:
            raise OSError("cannot fork")
        launched.append(StandInServer())
        return launched[-1]

    monkeypatch.setattr(eval_engines, "launch_embedded", launch)
    return launched, failing


def snapshot(step):
    from mizzen_train.eval_dispatch import Snapshot

    return Snapshot(step, "a", Path(f"/nowhere/step-{step}/a"), root=Path("/nowhere"))


def engines(lifetime, num_engines=1):
    from mizzen_train.eval_engines import EvalEngines

    return EvalEngines(
        num_engines=num_engines, threads=1, device="cpu", startup_timeout_s=5, lifetime=lifetime
    )


def test_points_of_the_point_lifetime_run_side_by_side(launches):
    group = engines("point")
    inside, peak, lock = [0], [0], threading.Lock()

    def point(step):
        with group.lease(snapshot(step), key="w", model_path="m", load_dirs=["/nowhere"]):
            with lock:
                inside[0] += 1
                peak[0] = max(peak[0], inside[0])
            time.sleep(0.3)
            with lock:
                inside[0] -= 1

    threads = [threading.Thread(target=point, args=(step,)) for step in (10, 20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert peak[0] == 2, "each point owns its engines: nothing to queue for"
    assert [server.stopped for server in launches[0]] == [1, 1]


def test_a_group_whose_second_engine_fails_to_launch_is_stopped_whole(launches):
    launched, failing = launches
    group = engines("run", num_engines=2)
    failing["at"] = 2
    with (
        pytest.raises(OSError),
        group.lease(snapshot(10), key="w", model_path="m", load_dirs=["/nowhere"]),
    ):
        pass
    assert [server.stopped for server in launched] == [1], "the first engine is not kept"
    failing["at"] = None
    later = snapshot(20)
    with group.lease(later, key="w", model_path="m", load_dirs=["/nowhere"]) as lease:
        assert len(lease.urls) == 2 and lease.fresh
    assert [e["event"] for e in group.close()] == ["engine_stopped", "engine_stopped"]


def test_a_kept_group_a_point_failed_on_is_not_handed_to_the_next_point(launches):
    """An engine can answer /health and still not serve (a wedged backend): after a point on
    the kept group fails, the next point gets fresh engines."""
    launched, _ = launches
    group = engines("run")
    with group.lease(snapshot(10), key="w", model_path="m", load_dirs=["/nowhere"]) as lease:
        assert lease.fresh
    with (
        pytest.raises(RuntimeError),
        group.lease(snapshot(20), key="w", model_path="m", load_dirs=["/nowhere"]) as lease,
    ):
        assert not lease.fresh, "kept from point 10"
        raise RuntimeError("generation failed")
    assert [server.stopped for server in launched] == [1]
    with group.lease(snapshot(30), key="w", model_path="m", load_dirs=["/nowhere"]) as lease:
        assert lease.fresh and len(launched) == 2
    group.close()


def test_a_fresh_kept_group_its_first_point_failed_on_is_not_kept(launches):
    """The point that started the group fails on it (its engines maybe wedged from the start):
    the next point gets fresh engines too, not the group."""
    launched, _ = launches
    group = engines("run")
    with (
        pytest.raises(RuntimeError),
        group.lease(snapshot(10), key="w", model_path="m", load_dirs=["/nowhere"]) as lease,
    ):
        assert lease.fresh
        raise RuntimeError("generation failed")
    assert [server.stopped for server in launched] == [1]
    with group.lease(snapshot(20), key="w", model_path="m", load_dirs=["/nowhere"]) as lease:
        assert lease.fresh and len(launched) == 2
    group.close()


def test_a_point_with_failed_generations_does_not_keep_its_group(launches, monkeypatch):
    """Failed generations come back as failed samples, not as an exception: the evaluator marks
    the lease spoiled and the group, fresh or reused, is stopped after the point."""
    from mizzen_train.evaluators import GenerationEvaluator

    launched, _ = launches
    evaluator = GenerationEvaluator(name="answers", prompts=[], reward="f1")
    failures = iter([1, 0, 2, 0])  # point 10 fresh, 20 fresh, 30 reused, 40 fresh

    async def scores(*args, **kwargs):
        return {"score": 0.5, "failed": float(next(failures))}

    monkeypatch.setattr(evaluator, "_generate", scores)
    monkeypatch.setattr(evaluator, "_on_urls", scores)  # a reused group: pointed at the snapshot
    stopped_after = []
    for step in (10, 20, 30, 40):
        evaluator.evaluate(snapshot(step))
        stopped_after.append([server.stopped for server in launched])
    assert stopped_after == [
        [1],  # 10: started, one generation failed: stopped
        [1, 0],  # 20: started, none failed: kept
        [1, 1],  # 30: reused, two failed: stopped
        [1, 1, 0],  # 40: started again
    ]
    assert [e["event"] for e in evaluator.close()] == ["engine_stopped"]
