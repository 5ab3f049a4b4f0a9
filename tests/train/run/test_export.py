"""Every run ends with something others can load: a PEFT adapter per tenant under
``export/step-N/<tenant>/adapter`` that ``peft`` loads from any directory (the base recorded by
absolute path), files 0644; ``mizzen-train export RUN_DIR --step N --merged`` exports an older
checkpoint, and its merged model computes what base + adapter compute (real transformers/peft,
real subprocess runs of the CLI)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=90, labels=["train"])


def _ok(done) -> str:
    """The output of a command that must succeed."""
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr + done.stdout


@pytest.fixture(scope="module")
def finished_run(sft, tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    sft.write_config(root / "run.toml", sft.small_sections("run", lr=5e-2))
    # run.dir relative to cwd
    output = _ok(sft.cli("sft", "--config", "run.toml", cwd=root, timeout=300))
    return root, output


def _logits(model, ids):
    import torch

    with torch.no_grad():
        return model(input_ids=ids).logits


def test_the_final_export_loads_with_peft_from_anywhere(finished_run, tmp_path, monkeypatch):
    import torch
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM

    root, output = finished_run
    adapter = root / "run" / "export" / "step-00000004" / "a" / "adapter"
    assert "export:      run/export/step-00000004 (a PEFT adapter per tenant)" in output, output
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert os.path.isabs(config["base_model_name_or_path"]), config
    for path in [adapter, *adapter.iterdir()]:
        assert path.stat().st_mode & 0o777 == (0o755 if path.is_dir() else 0o644), path
    monkeypatch.chdir(tmp_path)  # another directory: the base is found by its absolute path
    loaded = AutoPeftModelForCausalLM.from_pretrained(str(adapter))
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"])
    ids = torch.tensor([[1, 5, 9, 14, 3]])
    assert not torch.allclose(_logits(loaded, ids), _logits(base, ids)), "the adapter is a no-op"
    again = PeftModel.from_pretrained(base, str(adapter))
    torch.testing.assert_close(_logits(again, ids), _logits(loaded, ids))


def test_export_command_writes_an_older_checkpoint_with_its_merged_model(sft, finished_run):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, _ = finished_run
    output = _ok(sft.cli("export", "run", "--step", "2", "--merged", cwd=root, timeout=300))
    step2 = root / "run" / "export" / "step-00000002" / "a"
    assert "mizzen-train export: wrote" in output and step2.is_dir(), output
    merged = AutoModelForCausalLM.from_pretrained(str(step2 / "merged"), torch_dtype=torch.float32)
    base_dir = json.loads((step2 / "adapter" / "adapter_config.json").read_text())[
        "base_model_name_or_path"
    ]
    base = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, str(step2 / "adapter"))
    ids = torch.tensor([[2, 7, 11, 4]])
    torch.testing.assert_close(
        _logits(merged, ids), _logits(with_adapter, ids), rtol=1e-4, atol=1e-4
    )
    final = (
        root / "run" / "export" / "step-00000004" / "a" / "adapter" / "adapter_model.safetensors"
    )
    assert final.read_bytes() != (step2 / "adapter" / "adapter_model.safetensors").read_bytes()


def test_export_of_a_missing_step_is_one_line(sft, finished_run):
    root, _ = finished_run
    done = sft.cli("export", "run", "--step", "3", cwd=root, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "no complete checkpoint of step 3 (checkpoints: 2, 4)" in last, done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_export_reads_past_an_eval_section_a_newer_rule_refuses(sft, finished_run):
    # a run started before eval.snapshot_dir had to be a directory of its own (snapshot_dir =
    # "export" was accepted): its checkpoints still export (an export evaluates nothing)
    root, _ = finished_run
    shutil.copytree(root / "run", root / "older", symlinks=True)
    record = json.loads((root / "older" / "run.json").read_text())
    record["config"]["eval"] = {
        "interval": 2, "snapshot_dir": "export",
        "evaluators": [{"kind": "loss", "data": "example:colours_eval"}],
    }  # fmt: skip
    (root / "older" / "run.json").write_text(json.dumps(record))
    output = _ok(sft.cli("export", "older", "--step", "2", cwd=root, timeout=300))
    assert "mizzen-train export: wrote" in output, output
    assert (root / "older" / "export" / "step-00000002" / "a" / "adapter").is_dir()
