"""SFT configuration: every rule is checked before anything is built, and each refusal names the
file and field, the rule and the fix -- evaluation without a snapshot source, an eval interval
longer than the run, an empty eval set, typos, wrong types, impossible combinations; overrides
from the command line; engines_needed derived once; the forced final eval point; the schedule."""

from __future__ import annotations

import copy
import itertools
import subprocess
import sys

import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=45, labels=["train"])

BASE = {
    "run": {"dir": "runs/x", "steps": 60, "checkpoint_interval": 10},
    "model": {"path": "tiny"},
    "data": {"seq_len": 64},
    "tenants": [{"name": "a", "data": "example:colours_train", "rows": 4, "lr": 1e-3}],
    "eval": {
        "interval": 20,
        "snapshot_dir": "snapshots",
        "evaluators": [
            {"kind": "generate", "data": "example:colours_eval", "reward": "f1"},
            {"kind": "loss", "data": "example:colours_eval"},
        ],
    },
}


def parse(patch=None, drop=None):
    from mizzen_train.sft.config import parse_config

    raw = copy.deepcopy(BASE)
    for path, value in (patch or {}).items():
        node = raw
        *parents, last = path.split(".")
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
        node[int(last) if isinstance(node, list) else last] = value
    for path in drop or ():
        node = raw
        *parents, last = path.split(".")
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        del node[last]
    return parse_config(raw, source="run.toml")


def refused(**kwargs) -> str:
    from mizzen_train.run.config import ConfigError

    with pytest.raises(ConfigError) as info:
        parse(**kwargs)
    message = str(info.value)
    assert message.startswith("run.toml: ") and "Fix: " in message, message
    return message


def test_the_base_configuration_is_valid_and_derives_what_the_run_needs():
    config = parse()
    assert config.engines_needed == "eval-only"
    assert config.eval_points() == [20, 40, 60]
    assert [e.name or e.kind for e in config.evaluators] == ["generate", "loss"]
    assert parse({"eval.evaluators": [{"kind": "loss", "data": "x.jsonl"}]}).engines_needed == (
        "none"
    )
    assert (
        parse(drop=["eval"]).engines_needed == "none" and parse(drop=["eval"]).eval_points() == []
    )
    # the final step is evaluated even off the interval
    assert parse({"run.steps": 50}).eval_points() == [20, 40, 50]


def test_evaluation_rules_name_the_field_and_the_fix():
    message = refused(drop=["eval.snapshot_dir"])
    assert "eval.snapshot_dir=''" in message and "no snapshot source" in message
    assert 'eval.snapshot_dir = "snapshots"' in message
    message = refused(patch={"eval.interval": 100})
    assert "eval.interval=100" in message and "longer than the run (run.steps=60)" in message
    assert "eval.interval <= 60" in message
    assert "lists no evaluator" in refused(patch={"eval.evaluators": []})
    assert "eval.evaluators[0].data=''" in refused(patch={"eval.evaluators.0.data": ""})
    assert "eval.evaluators[0].reward=''" in refused(patch={"eval.evaluators.0.reward": ""})
    assert "eval.evaluators[1].name='generate': is not unique" in refused(
        patch={"eval.evaluators.1.name": "generate"}
    )
    assert "python evaluator is built by a factory" in refused(
        patch={"eval.evaluators.1": {"kind": "python"}}
    )
    assert "names no tenant 'b'" in refused(patch={"eval.evaluators.0.tenants": ["b"]})
    assert "is not an http(s) URL" in refused(patch={"eval.evaluators.0.engine_urls": ["host:1"]})
    # the generate evaluator's own engines live for the run unless told "point"
    assert parse().evaluators[0].engine_lifetime == "run"
    assert parse({"eval.evaluators.0.engine_lifetime": "point"}).evaluators[0].engine_lifetime == (
        "point"
    )
    assert "eval.evaluators[0].engine_lifetime='step': must be one of ['run', 'point']" in refused(
        patch={"eval.evaluators.0.engine_lifetime": "step"}
    )
    message = refused(
        patch={"eval.evaluators.0.engine_lifetime": "point",
               "eval.evaluators.0.engine_urls": ["http://127.0.0.1:1"]}
    )  # fmt: skip
    assert "eval.evaluators[0].engine_lifetime='point'" in message and "it starts none" in message
    assert "eval.overflow='drop': must be one of ['skip', 'wait']" in refused(
        patch={"eval.overflow": "drop"}
    )


def test_shape_and_type_rules():
    assert "run.stpes=1: unknown key in [run]" in refused(patch={"run.stpes": 1})
    assert "run.steps=<missing>: is required" in refused(drop=["run.steps"])
    assert "run.steps='60': must be an integer" in refused(patch={"run.steps": "60"})
    assert "run.steps=0: must be >= 1" in refused(patch={"run.steps": 0})
    assert "tenants[0].lr=0.0: must be > 0" in refused(patch={"tenants.0.lr": 0.0})
    assert "tenants[0].rows=6: must be a multiple of run.micro_batch_size=4" in refused(
        patch={"tenants.0.rows": 6}
    )
    message = refused(patch={"tenants": [BASE["tenants"][0], BASE["tenants"][0]]})
    assert "tenants[1].name='a': is not unique" in message
    assert "tenants[0].name='a/b'" in refused(patch={"tenants.0.name": "a/b"})
    assert "at least one [[tenants]]" in refused(patch={"tenants": []})
    assert "model.tiny.hidden=64: is not a field of the tiny Llama config" in refused(
        patch={"model.tiny": {"hidden": 64}}
    )
    assert 'applies to model.path = "tiny" only' in refused(
        patch={"model.path": "/models/llama", "model.tiny": {"seed": 1}}
    )
    assert "tenants[0].betas" in refused(patch={"tenants.0.betas": [0.9, 1.5]})
    assert "training=1: unknown section" in refused(patch={"training": 1})


def test_tiny_is_checked_by_the_rule_the_server_uses():
    """``[model.tiny]`` has one rule (``check_tiny``) for a training run and the server: what the
    server refused, a run refuses too -- a vocabulary the byte tokenizer does not fit, another
    architecture, a size or a weight scale out of its range."""
    assert (
        "model.tiny.vocab_size=10: must be in [259, 262144] (the byte tokenizer uses 259 token "
        "ids). Fix: use e.g. vocab_size = 259" in refused(patch={"model.tiny": {"vocab_size": 10}})
    )
    assert "model.tiny.model_type='gpt2': must be one of ['llama']" in refused(
        patch={"model.tiny": {"model_type": "gpt2"}}
    )
    assert "model.tiny.num_hidden_layers=300: must be in [1, 256]" in refused(
        patch={"model.tiny": {"num_hidden_layers": 300}}
    )
    assert "model.tiny.initializer_range=20: must be in (0, 10]" in refused(
        patch={"model.tiny": {"initializer_range": 20}}
    )
    tiny = {"model_type": "llama", "vocab_size": 259, "seed": 1, "initializer_range": 1}
    assert parse(patch={"model.tiny": tiny}).model.tiny == tiny  # kept as written: its digest


@pytest.mark.parametrize(
    ("tiny", "needle"),
    [
        ({"head_dim": 7}, "model.tiny.head_dim=7: makes heads 7 wide; rotary embeddings need"),
        ({"hidden_size": 12}, "model.tiny.num_attention_heads=4: makes heads 3 wide"),
        (
            {"hidden_size": 65536, "intermediate_size": 65536, "num_hidden_layers": 256},
            "parameters; a tiny one has at most 2,147,483,648",
        ),
        (
            {"plugin": "deepseek_v4", "compress_ratios": "x"},
            "makes no valid deepseek_v4 config (invalid literal for int()",
        ),
        (
            {"plugin": "nemotron_h", "hybrid_override_pattern": "XYZ"},
            "makes no valid nemotron_h config (NemotronH config is inconsistent",
        ),
    ],
    ids=[
        "odd-head-dim",
        "odd-derived-width",
        "too-many-parameters",
        "plugin-field",
        "plugin-whole",
    ],
)
def test_a_tiny_model_that_cannot_be_built_is_refused_before_anything_runs(tiny, needle):
    """What a build would fail on later (with a traceback, or an error naming a generated
    config.json): an odd head width, a model too large to draw in memory, a plugin config its
    config class refuses -- refused as the config's error, naming model.tiny."""
    tiny = dict(tiny)
    plugin = tiny.pop("plugin", "")
    patch = {"model.tiny": tiny, **({"model.plugin": plugin} if plugin else {})}
    assert needle in refused(patch=patch)


def test_overrides_and_flags_set_every_field():
    from mizzen_train.cli import _field_values, build_parser
    from mizzen_train.run.config import ConfigError, apply_overrides
    from mizzen_train.sft.config import parse_config

    raw = apply_overrides(
        copy.deepcopy(BASE),
        [
            "run.steps=120",
            "tenants.0.lr=5e-4",
            'tenants.1={name = "b", data = "example:colours_train", rows = 4, lr = 1e-3}',
            "eval.evaluators.1.limit=8",
            "run.dir=runs/other",  # not TOML: taken as a string
        ],
    )
    config = parse_config(raw)
    assert config.run.steps == 120 and config.run.dir == "runs/other"
    assert [t.name for t in config.tenants] == ["a", "b"] and config.tenants[0].lr == 5e-4
    assert config.evaluators[1].limit == 8
    with pytest.raises(ConfigError, match="list index '5' does not exist"):
        apply_overrides(copy.deepcopy(BASE), ["tenants.5.lr=1"])
    with pytest.raises(ConfigError, match="an override is KEY=VALUE"):
        apply_overrides({}, ["run.steps"])
    args = build_parser().parse_args(
        ["sft", "--run.steps", "30", "--run.dir", "123", "--eval.overflow", "wait"]
    )
    assert sorted(_field_values(args)) == [
        ("eval.overflow", "wait"),
        ("run.dir", "123"),  # a str field stays a string
        ("run.steps", 30),
    ]


def test_learning_rate_schedules():
    from mizzen_train.run.schedule import lr_at

    tenant = parse({"tenants.0.warmup_steps": 10, "tenants.0.lr_schedule": "cosine"}).tenants[0]
    lrs = [lr_at(tenant, step, 60) for step in range(1, 61)]
    assert lrs[4] == pytest.approx(5e-4) and lrs[9] == pytest.approx(1e-3)  # warmup
    assert lrs[10] == pytest.approx(1e-3)  # the first step after warmup runs at the peak
    assert lr_at(tenant, 36, 60) == pytest.approx(5e-4)  # half way through the decay
    assert all(a > b for a, b in itertools.pairwise(lrs[10:])), "cosine decays"
    assert 0 < lrs[-1] < 1e-5, "the last step still has a positive rate"
    linear = parse({"tenants.0.lr_schedule": "linear", "tenants.0.min_lr_ratio": 0.1}).tenants[0]
    assert lr_at(linear, 60, 60) == pytest.approx(1e-3 - 0.9e-3 * 59 / 60)
    assert lr_at(parse().tenants[0], 33, 60) == 1e-3


def test_help_config_lists_every_field():
    from mizzen_train.sft.config import SECTIONS, SftConfig

    text = SftConfig.help_text()
    for section, spec in SECTIONS.items():
        cls = spec.cls
        assert section in text
        for name in cls.__dataclass_fields__:
            if name != "evaluators":
                assert f"  {name} " in text, name


def test_bad_configurations_end_before_step_0_without_a_traceback(tmp_path):
    """Through the real command: an empty eval set, a missing model directory, a TOML typo."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    config = tmp_path / "run.toml"
    config.write_text(
        f'[run]\ndir = "{tmp_path / "run"}"\nsteps = 4\ncheckpoint_interval = 2\n'
        '[model]\npath = "tiny"\n[data]\nseq_len = 96\n'
        '[[tenants]]\nname = "a"\ndata = "example:colours_train"\nrows = 4\nlr = 1e-3\n'
        f'[eval]\ninterval = 2\nsnapshot_dir = "snapshots"\n'
        f'[[eval.evaluators]]\nkind = "loss"\ndata = "{empty}"\n'
    )
    command = [sys.executable, "-m", "mizzen_train", "sft", "--config", str(config)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert f"eval.evaluators[0].data='{empty}'" in result.stderr
    assert "has no usable record" in result.stderr and "Fix:" in result.stderr
    assert not (tmp_path / "run" / "run.json").exists(), "a refused run leaves no run behind"

    missing = subprocess.run(
        [*command, "--set", f"model.path={tmp_path / 'nowhere'}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "config.json: no such file" in missing.stderr

    overlong = subprocess.run(
        [*command, "--data.seq_len", "32"], capture_output=True, text=True, timeout=300
    )
    assert overlong.returncode == 2 and "Traceback" not in overlong.stderr
    assert (
        "tenants[0].data: " in overlong.stderr and "more than seq_len + 1 = 33" in overlong.stderr
    )
    assert "data.on_overlong = 'drop'" in overlong.stderr

    config.write_text("[run\nsteps = 3\n")
    typo = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert typo.returncode == 2 and "is not valid TOML" in typo.stderr
    assert "Traceback" not in typo.stderr


def test_an_evaluator_on_cuda_without_a_cuda_device_is_refused_before_anything_starts(
    tmp_path, monkeypatch
):
    """The run's own device resolves to the CPU, but an evaluator asks for ``device = "cuda"``
    on a host without one: refused while validating (naming the field), before megatron starts
    or a step trains -- not at the first eval point."""
    import io

    import torch

    from mizzen_train.run.config import ConfigError
    from mizzen_train.sft import trainer as sft_trainer

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    run_dir = tmp_path / "run"
    config = parse(
        patch={"run.dir": str(run_dir), "data.seq_len": 144, "eval.evaluators.0.device": "cuda"}
    )
    monkeypatch.setattr(sft_trainer.SftTrainer, "setup", lambda self: pytest.fail("set-up ran"))
    with pytest.raises(ConfigError, match="no CUDA device is visible") as caught:
        sft_trainer.run_sft(config, stream=io.StringIO())
    assert "eval.evaluators[0].device='cuda'" in str(caught.value)
    assert "run.toml" in str(caught.value) and "Fix:" in str(caught.value)
    # the same configuration with the CPU default validates:
    fine = parse(patch={"run.dir": str(tmp_path / "fine"), "data.seq_len": 144})
    trainer = sft_trainer.SftTrainer(fine, resume=False, stream=io.StringIO())
    trainer.validate("cpu", "fp32")
    assert [e.device for e in fine.evaluators] == ["cpu", "cpu"]
