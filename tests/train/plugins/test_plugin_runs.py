"""``[model] plugin = ...`` through the run commands: a tiny Nemotron-H-style and a tiny
DeepSeek-V4-style model train 20 SFT steps with falling loss and export (nemotron_h: a PEFT adapter
``transformers`` + ``peft`` apply and a merged Hugging Face model; deepseek_v4: a PEFT adapter of
the plugin module and a plugin-native merged base, checked against each other); nemotron_h takes
one RL step through the embedded engine serving its Hugging Face export; deepseek_v4 RL on embedded
engines, an unknown plugin name and tensor parallelism are refused naming the field.

The runs go through ``run_sft`` / ``run_rl`` in this process (the runners ``mizzen-train sft|rl``
call after parsing), so megatron is imported once for the file."""

from __future__ import annotations

import json

import pytest
import torch

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=45, labels=["train", "lora", "plugins", "e2e"])
pytestmark = pytest.mark.in_child  # its body's threads/world end with it


@pytest.fixture
def sft_config(plugin_sft_config):
    """``sft_config(tmp_path, plugin, *, steps=20, **model)``: the CPU run of the plugin config."""

    def build(tmp_path, plugin, *, steps=20, **model):
        run = {"device": "cpu", "threads": 1}
        return plugin_sft_config(tmp_path / f"sft-{plugin}", plugin, steps=steps, run=run, **model)

    return build


def rl_config(tmp_path, plugin):
    from mizzen_train.rl.config import RlConfig

    return RlConfig.parse(
        {
            "run": {
                "dir": str(tmp_path / f"rl-{plugin}"), "steps": 1, "checkpoint_interval": 1,
                "device": "cpu", "micro_batch_size": 8, "threads": 1, "plot": False,
            },
            "model": {"path": "tiny", "plugin": plugin},
            "rollout": {"engines": "embedded", "num_engines": 1, "max_new_tokens": 1,
                        "temperature": 1.0},
            "tenants": [
                {"name": "fixed", "data": "example:rl_fixed",
                 "reward": "mizzen_train.rl.toy:fixed_token", "prompts_per_step": 2,
                 "n_samples": 4, "lr": 2e-2, "lora_rank": 8, "lora_alpha": 16.0},
            ],
        },
        source="test.toml",
    )  # fmt: skip


def train_losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["kind"] == "train"]


def peft_vs_merged(plugin, export, ids):
    """Logits of (base + the PEFT adapter through ``peft``), of the merged export, of the base."""
    import peft

    adapter = export / "adapter"
    base_dir = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    if plugin == "nemotron_h":  # the Hugging Face architecture, through transformers
        import transformers

        def load(directory):
            return transformers.AutoModelForCausalLM.from_pretrained(directory).eval()

        def logits(model):
            return model(input_ids=ids).logits
    else:  # the plugin's own module and state dict
        from safetensors.torch import load_file

        from mizzen_plugins import get

        def load(directory):
            config = json.loads((directory / "config.json").read_text())
            model = get(plugin).causal_lm(config)
            model.load_state_dict(load_file(directory / "model.safetensors"))
            return model.eval()

        def logits(model):
            return model(ids)

    from pathlib import Path

    with torch.no_grad():
        base = load(Path(base_dir))
        base_logits = logits(base)
        merged_logits = logits(load(export / "merged"))
        adapted_logits = logits(peft.PeftModel.from_pretrained(base, str(adapter)).eval())
    return adapted_logits, merged_logits, base_logits


@pytest.mark.parametrize("plugin", ["nemotron_h", "deepseek_v4"])
def test_sft_trains_a_tiny_plugin_model_and_exports_it(plugin, tmp_path, sft_config):
    from mizzen_train.sft.trainer import run_sft

    config = sft_config(tmp_path, plugin)
    summary = run_sft(config)
    losses = train_losses(config.run_dir)
    assert len(losses) == 20
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
    assert summary["final_train_loss"]["colours"] == losses[-1]
    export = config.run_dir / "export" / "step-00000020" / "colours"
    assert sorted(p.name for p in export.iterdir()) == ["adapter", "merged"]
    ids = torch.randint(3, 259, (1, 24), generator=torch.Generator().manual_seed(0))
    if plugin == "deepseek_v4":
        ids = ids[0]  # the plugin module takes a [T] stream
    adapted, merged, base = peft_vs_merged(plugin, export, ids)
    torch.testing.assert_close(adapted, merged, rtol=1e-4, atol=1e-4)
    assert (merged - base).abs().max() > 0.1, "the adapter changes the model"


def test_rl_step_on_nemotron_h_through_the_embedded_engine(tmp_path):
    """The engine serves the tiny base's Hugging Face NemotronH (transformers) with the trainer's
    published PEFT adapters; its log-probs agree with the plugin model's."""
    from mizzen_train.rl.trainer import run_rl

    config = rl_config(tmp_path, "nemotron_h")
    run_rl(config)
    records = [json.loads(x) for x in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    (train,) = [r for r in records if r["kind"] == "train"]
    assert train["stepped"] and train["published_version"] == 1 and train["samples"] == 8
    assert train["logprob_mismatch"] < 1e-3, train["logprob_mismatch"]
    adapters = config.run_dir / "adapters" / "fixed"
    assert sorted(p.name for p in adapters.iterdir()) == ["v00000000", "v00000001"]
    assert (config.run_dir / "export" / "step-00000001" / "fixed" / "adapter").is_dir()


def test_rl_on_embedded_engines_refuses_a_plugin_without_a_hf_architecture(tmp_path):
    from mizzen_train.rl.trainer import run_rl
    from mizzen_train.run.config import ConfigError

    config = rl_config(tmp_path, "deepseek_v4")
    with pytest.raises(ConfigError, match=r"rollout\.engines='embedded'.*no Hugging Face"):
        run_rl(config)
    assert not list(config.run_dir.glob("base-model-*")), "refused before a base is written"


def test_an_unknown_plugin_is_a_config_error_listing_the_installed_ones(
    tmp_path, capsys, sft_config
):
    from mizzen_train.cli import main
    from mizzen_train.run.config import ConfigError

    with pytest.raises(ConfigError) as info:
        sft_config(tmp_path, "llama9")
    message = str(info.value)
    assert message.startswith("test.toml: model.plugin='llama9': names no installed model plugin")
    assert "['deepseek_v4', 'nemotron_h']" in message
    config = tmp_path / "bad.toml"
    config.write_text(
        '[run]\ndir = "r"\nsteps = 1\ncheckpoint_interval = 1\n[model]\npath = "tiny"\n'
        'plugin = "llama9"\n[data]\nseq_len = 64\n[[tenants]]\nname = "a"\n'
        'data = "example:colours_train"\nrows = 4\nlr = 0.01\n'
    )
    assert main(["sft", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.plugin='llama9'" in err[0] and "nemotron_h" in err[0]


def test_tiny_fields_and_tensor_parallelism_are_checked_per_plugin(tmp_path, sft_config):
    from mizzen_train.run.config import ConfigError
    from mizzen_train.run.sections import ModelConfig, check_model

    with pytest.raises(ConfigError, match=r"model\.tiny\.rope_theta=.*tiny deepseek_v4 config"):
        sft_config(tmp_path, "deepseek_v4", tiny={"rope_theta": 5.0})
    sft_config(tmp_path, "deepseek_v4", tiny={"seed": 3, "sliding_window": 8})  # its own fields
    with pytest.raises(ConfigError, match=r"parallel\.tensor=2: plugin model 'nemotron_h'"):
        check_model(ModelConfig(path="tiny", plugin="nemotron_h"), "t.toml", tensor_parallel=2)


def test_run_json_of_a_llama_run_is_unchanged_and_a_plugin_run_records_its_plugin(
    tmp_path, sft_config
):
    """A Llama run's recorded [model] has no plugin key, so runs started before plugins existed
    resume (their [model] must equal the stored one)."""
    assert sft_config(tmp_path, "").to_dict()["model"] == {"path": "tiny", "tokenizer": "model",
                                                          "tiny": {}}  # fmt: skip
    assert sft_config(tmp_path, "deepseek_v4").to_dict()["model"]["plugin"] == "deepseek_v4"
