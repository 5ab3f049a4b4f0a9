"""Optional metric loggers (:mod:`mizzen_train.run.loggers`), with the real packages: the records
a run writes to ``metrics.jsonl`` reach a TensorBoard event file (read back with tensorboard's
EventAccumulator) and an offline W&B run (``WANDB_MODE=offline``: its run directory under
run.dir, read back from its files; no network); a logger whose package is missing, or an unknown
one, is a ConfigError naming the extra to install, raised while the configuration is checked."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_train.run.config import ConfigError
from mizzen_train.run.loggers import check_loggers, open_loggers
from mizzen_train.run.metrics import MetricsLog, read_metrics

register_cpu_ci(est_time=25, labels=["train"])


def _write_run(run_dir: Path, names: list[str]) -> MetricsLog:
    log = MetricsLog(
        run_dir / "metrics.jsonl", open_loggers(names, run_dir, name="r1", command="sft")
    )
    for step, loss in ((1, 2.5), (2, 1.5)):
        log.write("train", step=step, tenant="a", loss=loss, lr=1e-3, stepped=True, time=0.0)
    log.write("eval", step=2, tenant="a", evaluator="answers", status="ok",
              metrics={"score": 0.75, "samples": 8.0})  # fmt: skip
    log.event("checkpoint", step=2)  # stays in the JSONL only
    log.close()
    return log


def test_tensorboard_gets_train_and_eval_scalars(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _write_run(tmp_path, ["jsonl", "tensorboard"])
    (events,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    acc = EventAccumulator(str(events))
    acc.Reload()
    loss = [(e.step, e.value) for e in acc.Scalars("train/a/loss")]
    assert loss == [(1, 2.5), (2, 1.5)]
    assert [(e.step, e.value) for e in acc.Scalars("eval/answers/a/score")] == [(2, 0.75)]
    assert "train/a/stepped" not in acc.Tags()["scalars"]
    assert len(read_metrics(tmp_path / "metrics.jsonl")[0]) == 4  # the JSONL is whole


def _wandb_history(path: Path) -> tuple[list[dict], bool]:
    """The history rows of an offline run file (``run-*.wandb``: a 7-byte ``:W&B`` header, then
    LevelDB-log records -- 32 KiB blocks, each record ``crc32, length, type`` + a chunk, types
    FULL 1 / FIRST 2 / MIDDLE 3 / LAST 4 -- each whole one a ``wandb_internal_pb2.Record``).
    wandb 0.31 ships no Python reader of its own; this is the format its ``wandb sync`` reads.
    Returns (the rows, whether the run's exit record is there yet)."""
    import json
    import struct

    from wandb.proto import wandb_internal_pb2

    data, rows, ended = path.read_bytes(), [], False
    assert data[:4] == b":W&B", data[:7]
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record.FromString(pending)
            pending = b""
            ended = ended or record.WhichOneof("record_type") == "exit"
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                rows.append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
                )
    return rows, ended


def test_wandb_offline_run_holds_the_metrics(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))  # nothing outside tmp_path
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "data"))
    _write_run(tmp_path, ["jsonl", "wandb"])
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")  # under run.dir
    deadline = time.monotonic() + 60  # wandb-core writes the file on its own after finish()
    while not (found := _wandb_history(run_file))[1] and time.monotonic() < deadline:
        time.sleep(0.2)
    rows = [{k: v for k, v in row.items() if not k.startswith("_")} for row in found[0]]
    assert rows == [
        {"step": 1, "train/a/loss": 2.5, "train/a/lr": 0.001},
        {"step": 2, "train/a/loss": 1.5, "train/a/lr": 0.001},
        {"eval_step": 2, "eval/answers/a/score": 0.75, "eval/answers/a/samples": 8},
    ]


@pytest.mark.parametrize("name", ["tensorboard", "wandb"])
def test_a_missing_package_names_the_extra(monkeypatch, name: str) -> None:
    monkeypatch.setitem(sys.modules, name, None)  # importlib.util.find_spec now finds nothing
    with pytest.raises(ConfigError) as caught:
        check_loggers(["jsonl", name], "run.toml")
    assert f"pip install 'mizzen-train[{name}]'" in str(caught.value)
    assert "run.loggers" in str(caught.value) and "run.toml" in str(caught.value)


def test_an_unknown_logger_is_refused_by_the_configuration(tmp_path: Path) -> None:
    from mizzen_train.sft.config import SftConfig

    with pytest.raises(ConfigError, match="'csv' is not a logger"):
        SftConfig.load("example:sft_tiny", ['run.loggers=["jsonl", "csv"]'])
