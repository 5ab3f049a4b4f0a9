"""A plugin base directory is untrusted input: a tiny base is the same bits for the same seed;
an unreadable or inconsistent ``config.json``, missing, extra, mis-shaped or non-finite weights
are each refused with an HFModelError naming the file, before any weight is loaded."""

from __future__ import annotations

import json
import shutil

import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=8, labels=["train", "plugins"])


def test_a_tiny_base_is_a_function_of_plugin_and_seed(tmp_path):
    from mizzen_train.plugin_models.base import write_tiny_base

    a = write_tiny_base(tmp_path / "a", "deepseek_v4", seed=1)
    b = write_tiny_base(tmp_path / "b", "deepseek_v4", seed=1)
    c = write_tiny_base(tmp_path / "c", "deepseek_v4", seed=2)
    weights = [(d / "model.safetensors").read_bytes() for d in (a, b, c)]
    assert weights[0] == weights[1] != weights[2]
    assert json.loads((a / "config.json").read_text())["mizzen_plugin"] == "deepseek_v4"
    with pytest.raises(FileExistsError):
        write_tiny_base(a, "deepseek_v4")


def broken_copy(tiny_base, tmp_path, plugin="nemotron_h"):
    target = tmp_path / "base"
    shutil.copytree(tiny_base(plugin), target)
    return target


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("not json", r"config\.json: unreadable"),
        ("bad config", r"config\.json: not a valid nemotron_h config"),
        ("bad positions", r"config\.json: max_position_embeddings=-1"),
        ("missing tensor", r"model\.safetensors: .*missing"),
        ("extra tensor", r"model\.safetensors: .*unexpected"),
        ("nan", r"model\.safetensors: .* must hold finite floats"),
    ],
)
def test_a_broken_base_is_refused_naming_the_file(damage, message, tiny_base, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    from mizzen_train.errors import HFModelError
    from mizzen_train.plugin_models.base import read_plugin_base

    base = broken_copy(tiny_base, tmp_path)
    config, weights = base / "config.json", base / "model.safetensors"
    raw, tensors = json.loads(config.read_text()), load_file(weights)
    if damage == "not json":
        config.write_text("{")
    elif damage == "bad config":
        config.write_text(json.dumps({**raw, "hidden_size": -4}))
    elif damage == "bad positions":
        config.write_text(json.dumps({**raw, "max_position_embeddings": -1}))
    elif damage == "missing tensor":
        tensors.pop("backbone.norm_f.weight")
    elif damage == "extra tensor":
        tensors["backbone.extra.weight"] = torch.zeros(2)
    else:
        tensors["backbone.norm_f.weight"] = (
            torch.full_like(tensors["backbone.norm_f.weight"], 1e38) * 10
        )
    save_file(tensors, str(weights))
    with pytest.raises(HFModelError, match=message) as info:
        read_plugin_base("nemotron_h", base)
    assert "\n" not in str(info.value), "errors are printed one per line"
