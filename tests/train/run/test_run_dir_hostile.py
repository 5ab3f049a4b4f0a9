"""The run directory as hostile input: what is already there is never trusted, waited on, or
deleted unless the run wrote it.

A finished tiny run (4 steps, checkpoints every 2, two kept) is copied for each case: a user's
folder beside the checkpoints survives pruning and export; ``--resume`` below the newest
checkpoint's step is refused; a refused start leaves nothing behind; a FIFO or a non-file where a
record or the lock should be is one line and exit 2, never a hang or a traceback; so is a
checkpoint record of the wrong shape, a slot checkpoint of another run or step or with non-finite
values, and a base model at ``model.path`` other than the one the run trained on.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=230, labels=["train"])


def _config(sft, tmp_path, run_dir, steps: int):
    """The small run (``sft.small_sections``, checkpoints every 2 steps) of ``steps`` steps."""
    sections = sft.small_sections(run_dir, steps=steps)
    return sft.write_config(tmp_path / f"run-{steps}.toml", sections)


@pytest.fixture(scope="module")
def finished(sft, tmp_path_factory):
    root = tmp_path_factory.mktemp("finished")
    done = sft.cli("sft", "--config", str(_config(sft, root, root / "run", 4)), timeout=120)
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


def test_a_users_folder_beside_the_checkpoints_survives_pruning_and_export(sft, run_dir, tmp_path):
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000002", "step-00000004"]
    backup = checkpoints / "step-00000002.keep"
    shutil.copytree(checkpoints / "step-00000002", backup)
    (checkpoints / ".tmp-notes").mkdir()  # not a partial checkpoint's name either
    for lookalike in ("step-000000002", "step-\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0669"):
        shutil.copytree(checkpoints / "step-00000002", checkpoints / lookalike)
    config = _config(sft, tmp_path, run_dir, 8)
    resumed = sft.cli("sft", "--resume", "--config", str(config), timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    kept = sorted(p.name for p in checkpoints.iterdir())
    assert kept == sorted([".tmp-notes", "step-00000002.keep", "step-000000002",
                           "step-\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0669",
                           "step-00000006", "step-00000008"]), kept  # fmt: skip
    exported = sft.cli("export", str(run_dir), "--step", "8", timeout=120)
    assert exported.returncode == 0, exported.stderr[-2000:]


def test_resume_below_the_newest_checkpoint_is_refused(sft, run_dir, tmp_path):
    before = sorted(p.name for p in run_dir.rglob("*"))
    config = _config(sft, tmp_path, run_dir, 2)
    result = sft.cli("sft", "--resume", "--config", str(config), timeout=120)
    _refused(
        result, "run.steps=2", "newest checkpoint is step 4", "Fix: resume with run.steps >= 4"
    )
    assert sorted(p.name for p in run_dir.rglob("*")) == before


def test_a_refused_start_leaves_nothing_behind(sft, tmp_path):
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "metrics.jsonl").write_text("my own metrics\n")
    result = sft.cli("sft", "--config", str(_config(sft, tmp_path, foreign, 4)), timeout=120)
    _refused(result, "is not empty and holds no run (metrics.jsonl)")
    assert sorted(p.name for p in foreign.iterdir()) == ["metrics.jsonl"]
    assert (foreign / "metrics.jsonl").read_text() == "my own metrics\n"
    missing = tmp_path / "not" / "there"
    config = _config(sft, tmp_path, missing, 4)
    result = sft.cli("sft", "--resume", "--config", str(config), timeout=120)
    _refused(result, "holds no run")
    assert not (tmp_path / "not").exists()
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for run_dir in (a_file, a_file / "sub"):
        config = _config(sft, tmp_path, run_dir, 4)
        _refused(sft.cli("sft", "--config", str(config), timeout=120), str(a_file))
    assert a_file.read_text() == "x"


@pytest.mark.parametrize("entry", ["run.json", ".lock"])
def test_a_fifo_in_place_of_a_record_is_refused_not_waited_on(sft, run_dir, tmp_path, entry):
    (run_dir / entry).unlink()
    os.mkfifo(run_dir / entry)
    config = _config(sft, tmp_path, run_dir, 4)
    _refused(sft.cli("sft", "--resume", "--config", str(config), timeout=60), "not a regular file")
    if entry == "run.json":
        _refused(sft.cli("export", str(run_dir), timeout=60), "not a regular file")


def test_a_run_record_with_a_malformed_tenant_table_is_refused(sft, run_dir, tmp_path):
    import json

    record = json.loads((run_dir / "run.json").read_text())
    record["config"]["tenants"] = 5
    (run_dir / "run.json").write_text(json.dumps(record))
    config = _config(sft, tmp_path, run_dir, 4)
    result = sft.cli("sft", "--resume", "--config", str(config), timeout=120)
    _refused(result, "config.tenants is not a list of tables")


@pytest.mark.parametrize(("entry", "make"), [("metrics.jsonl", "dir"), ("checkpoints", "file")])
def test_an_entry_of_the_wrong_kind_is_refused_before_anything_changes(
    sft, run_dir, tmp_path, entry, make
):
    shutil.rmtree(run_dir / entry) if (run_dir / entry).is_dir() else (run_dir / entry).unlink()
    (run_dir / entry).mkdir() if make == "dir" else (run_dir / entry).write_text("x")
    before = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    config = _config(sft, tmp_path, run_dir, 6)
    result = sft.cli("sft", "--resume", "--config", str(config), timeout=120)
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


def test_checkpoints_on_another_volume_behind_a_link_resume(sft, run_dir, tmp_path):
    elsewhere = tmp_path / "volume" / "checkpoints"
    elsewhere.parent.mkdir()
    shutil.move(run_dir / "checkpoints", elsewhere)
    (run_dir / "checkpoints").symlink_to(elsewhere)
    config = _config(sft, tmp_path, run_dir, 6)
    resumed = sft.cli("sft", "--resume", "--config", str(config), timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from" in resumed.stderr and "step 4" in resumed.stderr, resumed.stderr[-2000:]
    assert (elsewhere / "step-00000006").is_dir()


@pytest.mark.parametrize("damage", ["no-slots", "no-cursor", "cursor-seed"])
def test_a_damaged_newest_checkpoint_is_one_line(sft, run_dir, tmp_path, damage):
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
    config = _config(sft, tmp_path, run_dir, 6)
    result = sft.cli("sft", "--resume", "--config", str(config), timeout=120)
    _refused(result)
    assert len([line for line in result.stderr.splitlines() if "error" in line]) == 1


def _damage_slot(slot, damage: str) -> None:
    """``damage`` to the committed shard of the slot checkpoint ``slot``, its size kept in step
    with the manifest (so only the content check can see it)."""
    import json

    import torch

    manifest = json.loads((slot / "manifest.json").read_text())
    shard = manifest["shards"]["tp00-pp00-ep00"]
    payload = torch.load(slot / shard["file"], weights_only=True)
    for key, tensor in payload["tensors"].items():
        if key.endswith("/master"):
            tensor.fill_(float("nan"))
    torch.save(payload, slot / shard["file"])
    shard["bytes"] = (slot / shard["file"]).stat().st_size
    (slot / "manifest.json").write_text(json.dumps(manifest))


def _damage_checkpoint(run_dir, damage: str) -> None:
    import torch

    newest = run_dir / "checkpoints" / "step-00000004"
    if damage == "fifo-state":
        (newest / "trainer_state.json").unlink()
        os.mkfifo(newest / "trainer_state.json")
    elif damage == "list-state":
        (newest / "trainer_state.json").write_text("[]\n")
    elif damage == "rng-empty":
        torch.save({}, newest / "rng.pt")
    elif damage == "list-manifest":
        (newest / "slots" / "a" / "manifest.json").write_text("[]\n")
    elif damage == "other-step-slot":  # step 2's slot (same run) in step 4's checkpoint
        shutil.rmtree(newest / "slots" / "a")
        shutil.copytree(run_dir / "checkpoints" / "step-00000002" / "slots" / "a",
                        newest / "slots" / "a")  # fmt: skip
    elif damage == "nan-masters":
        _damage_slot(newest / "slots" / "a", damage)
    else:  # a resume to 6 would train 5 and 6, then fail to commit step 6's checkpoint
        (run_dir / "checkpoints" / "step-00000006").write_text("x")


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        ("fifo-state", "trainer_state.json: unreadable (is not a regular file"),
        ("other-step-slot", "the slot checkpoint of run"),
    ],
)
def test_a_malformed_or_foreign_checkpoint_record_is_one_line(
    sft, run_dir, tmp_path, damage, needle
):
    """End to end, through ``--resume``: a FIFO in place of a record (never waited on) and a slot
    directory of another step (the trainer's owner check) -- one error line naming the file,
    exit 2, never a hang, a traceback or a run that trains on it."""
    _damage_checkpoint(run_dir, damage)
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    config = _config(sft, tmp_path, run_dir, 6)
    result = sft.cli("sft", "--resume", "--config", str(config), timeout=90)
    _refused(result, needle)
    assert len([line for line in result.stderr.splitlines() if "error" in line]) == 1
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics, "it trained before refusing"


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        ("list-state", "trainer_state.json: a JSON list, not a table"),
        ("rng-empty", "rng.pt: python is not the RNG state a checkpoint saves"),
        ("list-manifest", "manifest.json: a JSON list, not a manifest table"),
        ("nan-masters", "holds non-finite values"),
        ("step-file", "step-00000006: not a directory, but named like the checkpoint of step 6"),
    ],
)
def test_each_checkpoint_record_is_checked_by_its_reader(run_dir, damage, needle):
    """The readers a resume and an export go through (the same errors the CLI prints as one
    line, above), called directly: a record of the wrong shape, non-finite masters, a file where
    a step's checkpoint directory would go."""
    import json

    from mizzen_train.checkpoint import SlotCheckpointError, export_adapter, read_manifest
    from mizzen_train.run.state import (
        RunStateError,
        check_run_dir,
        load_checkpoint,
        read_run_config,
    )

    _damage_checkpoint(run_dir, damage)
    newest = run_dir / "checkpoints" / "step-00000004"
    run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
    readers = {
        "list-state": lambda: load_checkpoint(newest, run_id=run_id),
        "rng-empty": lambda: load_checkpoint(newest, run_id=run_id),
        "list-manifest": lambda: read_manifest(newest / "slots" / "a"),
        "nan-masters": lambda: export_adapter(newest / "slots" / "a"),
        "step-file": lambda: check_run_dir(run_dir, read_run_config(run_dir)[0], resume=True),
    }
    with pytest.raises((RunStateError, SlotCheckpointError), match=re.escape(needle)):
        readers[damage]()


def test_export_of_a_checkpoint_without_slots_is_one_line(sft, run_dir):
    shutil.rmtree(run_dir / "checkpoints" / "step-00000004" / "slots")
    _refused(sft.cli("export", str(run_dir), timeout=90), "slots: missing or not a directory")


def test_another_base_model_at_the_same_path_is_refused(sft, run_dir, tmp_path):
    """The base model's files are fingerprinted in run.json: the same shapes with other weights
    (another seed) at the same path are refused on resume and export, naming the file."""
    from mizzen_train.hf.tiny import write_tiny_llama

    (base,) = run_dir.glob("base-model-tiny-*")
    other = write_tiny_llama(tmp_path / "other", seed=1)
    shutil.copyfile(other / "model.safetensors", base / "model.safetensors")
    needle = "model.safetensors has other content"
    config = _config(sft, tmp_path, run_dir, 6)
    _refused(sft.cli("sft", "--resume", "--config", str(config), timeout=90), needle)
    _refused(sft.cli("export", str(run_dir), timeout=90), needle)
    assert not (run_dir / "checkpoints" / "step-00000006").exists()


def test_records_of_an_older_run_resume_with_a_warning(sft, run_dir, tmp_path):
    """A run.json without a base fingerprint and slot manifests without an owner (what an older
    mizzen-train wrote) resume, each unchecked record named in a warning line."""
    import json

    record = json.loads((run_dir / "run.json").read_text())
    del record["base_model"]
    (run_dir / "run.json").write_text(json.dumps(record))
    manifest_path = run_dir / "checkpoints" / "step-00000004" / "slots" / "a" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["owner"]
    manifest_path.write_text(json.dumps(manifest))
    config = _config(sft, tmp_path, run_dir, 6)
    resumed = sft.cli("sft", "--resume", "--config", str(config), timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "records no fingerprint of the base model" in resumed.stderr, resumed.stderr[-2000:]
    assert "records no owner" in resumed.stderr, resumed.stderr[-2000:]
    owner = json.loads((run_dir / "checkpoints" / "step-00000006" / "slots" / "a" /
                        "manifest.json").read_text())["owner"]  # fmt: skip
    assert owner == {"run_id": record["run_id"], "step": 6}
