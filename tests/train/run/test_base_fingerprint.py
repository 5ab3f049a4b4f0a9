"""The base model's content fingerprint (:mod:`mizzen_train.run.fingerprint`): the same files
written again elsewhere fingerprint the same (no path, no modification time in it); other weights
of the same shapes change the weights file's digest and nothing else; a FIFO among the files is
refused, never waited on."""

from __future__ import annotations

import os
import shutil

import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=20, labels=["train"])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from mizzen_train.hf.tiny import write_tiny_llama

    root = tmp_path_factory.mktemp("models")
    return {name: write_tiny_llama(root / name, seed=seed)
            for name, seed in (("a", 0), ("again", 0), ("other", 1))}  # fmt: skip


def test_the_same_model_written_again_has_the_same_fingerprint(models, tmp_path):
    from mizzen_train.run.fingerprint import model_fingerprint

    first = model_fingerprint(models["a"])
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(first), first
    assert model_fingerprint(models["again"]) == first
    copy = tmp_path / "copy"
    shutil.copytree(models["a"], copy)
    os.utime(copy / "model.safetensors", (1, 1))
    (copy / "README.md").write_text("notes\n")  # not a file a run reads
    assert model_fingerprint(copy) == first


def test_other_weights_of_the_same_shapes_change_the_weights_digest(models):
    from mizzen_train.run.fingerprint import fingerprint_changes, model_fingerprint

    before, after = model_fingerprint(models["a"]), model_fingerprint(models["other"])
    assert fingerprint_changes(before, after) == ["model.safetensors has other content"]
    del after["tokenizer.json"]
    assert fingerprint_changes(before, after)[-1] == "tokenizer.json is missing"


def test_a_fifo_among_the_files_is_refused_not_waited_on(models, tmp_path):
    from mizzen_train.run.fingerprint import FingerprintError, model_fingerprint

    for name in ("config.json", "model.safetensors"):
        copy = tmp_path / name
        shutil.copytree(models["a"], copy)
        (copy / name).unlink()
        os.mkfifo(copy / name)
        with pytest.raises(FingerprintError, match="not a regular file"):
            model_fingerprint(copy)
