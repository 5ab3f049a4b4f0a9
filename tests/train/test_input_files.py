"""Every reader of an input file refuses what it cannot read with its own one-line error, never
a traceback: one bounded read and one JSON parse (``mizzen_train.input_files``) behind them all.

Each case writes a file nested deeper than ``json.loads`` follows (it raises RecursionError,
which no reader caught) where a reader looks for its record, and expects that reader's error
type naming the file.
"""

from __future__ import annotations

import json
import os
import struct

import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=5, labels=["train"])

DEEP = "[" * 200_000 + "]" * 200_000


def test_parse_json_turns_every_failure_into_value_error(tmp_path):
    from mizzen_train.input_files import parse_json, read_json_file

    for bad in (DEEP, "{", b"\xff", "1" * 5000):
        with pytest.raises(ValueError):
            parse_json(bad)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        read_json_file(fifo, 1024)  # refused at once, never waited on
    assert parse_json('{"a": [1]}') == {"a": [1]}


def _manifest(directory):
    from mizzen_train.checkpoint import MANIFEST, read_manifest

    (directory / MANIFEST).write_text(DEEP)
    return read_manifest(directory)


def _run_record(directory):
    from mizzen_train.run.state import RUN_FILE, read_run_config

    (directory / RUN_FILE).write_text(DEEP)
    return read_run_config(directory)


def _model_config(directory):
    from mizzen_train.hf.config import read_llama_config

    (directory / "config.json").write_text(DEEP)
    return read_llama_config(directory)


def _safetensors_header(directory):
    from mizzen_train.run.fingerprint import model_fingerprint

    header = DEEP.encode()
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    (directory / "config.json").write_text(json.dumps({}))
    return model_fingerprint(directory)


def _service_models(directory):
    from mizzen_train.serve.state import ServerState

    (directory / "models.json").write_text(DEEP)
    return ServerState(directory)


@pytest.mark.parametrize(
    ("read", "error", "file"),
    [
        (_manifest, "SlotCheckpointError", "manifest.json"),
        (_run_record, "RunStateError", "run.json"),
        (_model_config, "HFModelError", "config.json"),
        (_safetensors_header, "FingerprintError", "model.safetensors"),
        (_service_models, "StateError", "models.json"),
    ],
    ids=["slot-manifest", "run-record", "model-config", "safetensors-header", "service-models"],
)
def test_a_record_nested_too_deep_is_the_readers_own_error(tmp_path, read, error, file):
    with pytest.raises(Exception) as caught:
        read(tmp_path)
    assert type(caught.value).__name__ == error, repr(caught.value)[:300]
    assert file in str(caught.value) and "\n" not in str(caught.value)
