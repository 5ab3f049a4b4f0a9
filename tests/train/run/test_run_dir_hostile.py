"""The run directory as hostile input: what is already there is never trusted, waited on, or
deleted unless the run wrote it.

A finished tiny run (4 steps, checkpoints every 2, two kept) is copied for each case: a user's
folder beside the checkpoints survives pruning and export; ``--resume`` below the newest
checkpoint's step is refused; a refused start leaves nothing behind; a FIFO or a non-file where a
record or the lock should be is one line and exit 2, never a hang or a traceback.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=120, labels=["train"])

CONFIG = """
[run]
dir = "{run_dir}"
steps = {steps}
checkpoint_interval = 2
[model]
path = "tiny"
[data]
seq_len = 144
[[tenants]]
name = "a"
data = "example:colours_train"
rows = 4
lr = 1e-3
"""


def _train(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-m", "mizzen_train", *argv],
        capture_output=True, text=True, timeout=timeout, env=env,
    )  # fmt: skip


def _config(tmp_path, run_dir, steps: int):
    path = tmp_path / f"run-{steps}.toml"
    path.write_text(CONFIG.format(run_dir=run_dir, steps=steps))
    return path


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    root = tmp_path_factory.mktemp("finished")
    done = _train("sft", "--config", str(_config(root, root / "run", 4)))
    assert done.returncode == 0, done.stderr
    return root / "run"


@pytest.fixture
def run_dir(finished, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(finished, copy, symlinks=True)
    return copy


def _refused(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    for needle in needles:
        assert needle in result.stderr, result.stderr


def test_a_users_folder_beside_the_checkpoints_survives_pruning_and_export(run_dir, tmp_path):
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000002", "step-00000004"]
    backup = checkpoints / "step-00000002.keep"
    shutil.copytree(checkpoints / "step-00000002", backup)
    (checkpoints / ".tmp-notes").mkdir()  # not a partial checkpoint's name either
    for lookalike in ("step-000000002", "step-\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0669"):
        shutil.copytree(checkpoints / "step-00000002", checkpoints / lookalike)
    resumed = _train("sft", "--resume", "--config", str(_config(tmp_path, run_dir, 8)))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    kept = sorted(p.name for p in checkpoints.iterdir())
    assert kept == sorted([".tmp-notes", "step-00000002.keep", "step-000000002",
                           "step-\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0669",
                           "step-00000006", "step-00000008"]), kept  # fmt: skip
    exported = _train("export", str(run_dir), "--step", "8")
    assert exported.returncode == 0, exported.stderr[-2000:]


def test_resume_below_the_newest_checkpoint_is_refused(run_dir, tmp_path):
    before = sorted(p.name for p in run_dir.rglob("*"))
    result = _train("sft", "--resume", "--config", str(_config(tmp_path, run_dir, 2)))
    _refused(
        result, "run.steps=2", "newest checkpoint is step 4", "Fix: resume with run.steps >= 4"
    )
    assert sorted(p.name for p in run_dir.rglob("*")) == before


def test_a_refused_start_leaves_nothing_behind(tmp_path):
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "metrics.jsonl").write_text("my own metrics\n")
    result = _train("sft", "--config", str(_config(tmp_path, foreign, 4)))
    _refused(result, "is not empty and holds no run (metrics.jsonl)")
    assert sorted(p.name for p in foreign.iterdir()) == ["metrics.jsonl"]
    assert (foreign / "metrics.jsonl").read_text() == "my own metrics\n"
    missing = tmp_path / "not" / "there"
    result = _train("sft", "--resume", "--config", str(_config(tmp_path, missing, 4)))
    _refused(result, "holds no run")
    assert not (tmp_path / "not").exists()
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for run_dir in (a_file, a_file / "sub"):
        _refused(_train("sft", "--config", str(_config(tmp_path, run_dir, 4))), str(a_file))
    assert a_file.read_text() == "x"


@pytest.mark.parametrize("entry", ["run.json", ".lock"])
def test_a_fifo_in_place_of_a_record_is_refused_not_waited_on(run_dir, tmp_path, entry):
    (run_dir / entry).unlink()
    os.mkfifo(run_dir / entry)
    config = _config(tmp_path, run_dir, 4)
    _refused(_train("sft", "--resume", "--config", str(config), timeout=60), "not a regular file")
    if entry == "run.json":
        _refused(_train("export", str(run_dir), timeout=60), "not a regular file")


def test_a_run_record_with_a_malformed_tenant_table_is_refused(run_dir, tmp_path):
    import json

    record = json.loads((run_dir / "run.json").read_text())
    record["config"]["tenants"] = 5
    (run_dir / "run.json").write_text(json.dumps(record))
    result = _train("sft", "--resume", "--config", str(_config(tmp_path, run_dir, 4)))
    _refused(result, "config.tenants is not a list of tables")


@pytest.mark.parametrize(("entry", "make"), [("metrics.jsonl", "dir"), ("checkpoints", "file")])
def test_an_entry_of_the_wrong_kind_is_refused_before_anything_changes(
    run_dir, tmp_path, entry, make
):
    shutil.rmtree(run_dir / entry) if (run_dir / entry).is_dir() else (run_dir / entry).unlink()
    (run_dir / entry).mkdir() if make == "dir" else (run_dir / entry).write_text("x")
    before = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    result = _train("sft", "--resume", "--config", str(_config(tmp_path, run_dir, 6)))
    _refused(result, f"{run_dir / entry}: not a")
    assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")) == before


def test_metrics_records_of_the_wrong_shape_are_dropped_as_broken(run_dir):
    import json

    from mizzen_train.run.metrics import read_metrics

    path = run_dir / "metrics.jsonl"
    good, broken = read_metrics(path)
    assert good and broken == 0
    odd = [
        '{"kind": "train", "step": "x"}', '{"kind": "eval_point"}', '{"kind": "train"}',
        '{"kind": "eval", "step": true, "tenant": "a", "evaluator": "e"}',
        '{"kind": "train", "step": 1, "tenant": "a", "loss": [1]}',
        '{"kind": "train", "step": 1, "tenant": "a", "loss": "1.5"}',
        "[" * 100_000 + "]" * 100_000, '{"kind": "train", "step": ' + "9" * 5000 + "}",
    ]  # fmt: skip
    with open(path, "a", encoding="utf-8") as handle:
        handle.write("\n".join(odd) + "\n")
    records, broken = read_metrics(path)
    assert records == good and broken == len(odd)
    # a kind the run does not read back is kept whatever it holds (a user evaluator's note), and
    # records as the trainers write them, nulls included
    written = [
        {"kind": "event", "event": "note", "status": 200, "step": "late"},
        {"kind": "eval", "step": 2, "tenant": "a", "evaluator": "e", "status": "ok",
         "metrics": {"score": 1.0}, "reason": None, "wall_s": 0.1},
        {"kind": "eval", "step": 4, "tenant": "a", "evaluator": "e", "status": "skipped",
         "metrics": {}, "reason": "engine down", "wall_s": 0.0},
        {"kind": "train", "step": 5, "tenant": "a", "loss": None, "reward_mean": 0.5},
        {"kind": "train", "step": 6, "tenant": "a", "loss": "nan", "reward_mean": "-inf"},
    ]  # fmt: skip
    with open(path, "a", encoding="utf-8") as handle:
        handle.write("".join(json.dumps(record) + "\n" for record in written))
    records, broken = read_metrics(path)
    assert records[-len(written) :] == written and broken == len(odd)


def test_checkpoints_on_another_volume_behind_a_link_resume(run_dir, tmp_path):
    elsewhere = tmp_path / "volume" / "checkpoints"
    elsewhere.parent.mkdir()
    shutil.move(run_dir / "checkpoints", elsewhere)
    (run_dir / "checkpoints").symlink_to(elsewhere)
    resumed = _train("sft", "--resume", "--config", str(_config(tmp_path, run_dir, 6)))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from" in resumed.stderr and "step 4" in resumed.stderr, resumed.stderr[-2000:]
    assert (elsewhere / "step-00000006").is_dir()


@pytest.mark.parametrize("damage", ["no-slots", "no-cursor", "cursor-seed"])
def test_a_damaged_newest_checkpoint_is_one_line(run_dir, tmp_path, damage):
    import json

    newest = run_dir / "checkpoints" / "step-00000004"
    state_file = newest / "trainer_state.json"
    state = json.loads(state_file.read_text())
    if damage == "no-slots":
        shutil.rmtree(newest / "slots")
    elif damage == "no-cursor":
        del state["streams"]["a"]["cursor"]
    else:
        state["streams"]["a"]["cursor"]["seed"] = "x"
    state_file.write_text(json.dumps(state))
    result = _train("sft", "--resume", "--config", str(_config(tmp_path, run_dir, 6)))
    _refused(result)
    assert len([line for line in result.stderr.splitlines() if "error" in line]) == 1
