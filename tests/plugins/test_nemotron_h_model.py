"""The hybrid model: THD packing == per-sequence runs, and the Hugging Face weight mapping.

The mapping is pinned to the real ``transformers`` NemotronH implementation: a randomly initialised
HF model and ours, sharing weights through the mapping, give the same logits, and checkpoints
written by either side load into the other (local files, no hub).
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mizzen_ci import register_cpu_ci
from mizzen_plugins.nemotron_h import NemotronHConfig, build_model
from mizzen_plugins.nemotron_h.weights import WeightMappingError, from_hf, to_hf

register_cpu_ci(est_time=30, labels=["ssm", "plugins", "thd"])

SMALL = {
    "vocab_size": 97,
    "hidden_size": 32,
    "hybrid_override_pattern": "M-M*-M-",
    "ssm_state_size": 8,
    "mamba_num_heads": 4,
    "mamba_head_dim": 8,
    "n_groups": 2,
    "conv_kernel": 4,
    "chunk_size": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 48,
}


def small_config(**changes):
    return NemotronHConfig.from_hf_dict({**SMALL, **changes})


@torch.no_grad()
def randomise(model, seed):
    """Weights far from their init (init leaves norms at 1, D at 1, …), so mix-ups show."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)


def cu_from_lengths(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def test_packed_batch_equals_each_sequence_alone_forward_and_backward():
    torch.manual_seed(0)
    model = build_model(small_config()).double()
    randomise(model, seed=1)
    lengths = [9, 1, 0, 20, 13]  # 20 > chunk_size 8: sequences straddle chunks
    cu = cu_from_lengths(lengths)
    ids = torch.randint(0, 97, (int(cu[-1]),))
    targets = torch.randn(int(cu[-1]), 97, dtype=torch.float64)

    packed_logits = model(ids, cu)
    (packed_logits * targets).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        if end > start:
            alone = model(ids[start:end])
            torch.testing.assert_close(packed_logits[start:end], alone, rtol=1e-9, atol=1e-9)
            (alone * targets[start:end]).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], p.grad, rtol=1e-8, atol=1e-9, msg=name)


def test_batched_input_is_uniform_packing():
    model = build_model(small_config(tie_word_embeddings=True))
    ids = torch.randint(0, 97, (3, 11))
    logits = model(ids)
    assert logits.shape == (3, 11, 97)
    torch.testing.assert_close(logits[1], model(ids[1]))
    with pytest.raises(ValueError, match="not both"):
        model(ids, torch.tensor([0, 11, 22, 33]))
    with pytest.raises(ValueError, match="cu_seqlens describes 30 tokens but input_ids has 33"):
        model(ids.reshape(-1), torch.tensor([0, 10, 30]))


def test_mapping_round_trips_for_every_optional_tensor():
    for changes in (
        {},
        {"use_bias": True, "mlp_bias": True},
        {"use_conv_bias": False, "tie_word_embeddings": True},
    ):
        config = small_config(**changes)
        model = build_model(config)
        ours = model.state_dict()
        hub = to_hf(ours, config)
        assert all(k.startswith(("backbone.", "lm_head.")) for k in hub)
        back = from_hf(hub, config)
        assert back.keys() == ours.keys()
        for key, tensor in ours.items():
            assert torch.equal(back[key], tensor), key
        model.load_state_dict(back, strict=True)


def test_mapping_errors_name_the_keys():
    config = small_config()
    hub = to_hf(build_model(config).state_dict(), config)
    broken = dict(hub)
    del broken["backbone.layers.3.mixer.k_proj.weight"]
    broken["backbone.layers.1.mixer.experts.0.up_proj.weight"] = torch.zeros(1)
    with pytest.raises(WeightMappingError) as info:
        from_hf(broken, config)
    message = str(info.value)
    assert "missing 1 Hugging Face key(s): ['backbone.layers.3.mixer.k_proj.weight']" in message
    assert (
        "unexpected 1 Hugging Face key(s): ['backbone.layers.1.mixer.experts.0.up_proj.weight']"
        in message
    )
    # A checkpoint for another pattern does not load silently.
    with pytest.raises(WeightMappingError, match="missing"):
        from_hf(hub, small_config(hybrid_override_pattern="M-M*-M-M"))
    wrong_shape = dict(hub)
    wrong_shape["backbone.layers.0.mixer.conv1d.weight"] = torch.zeros(48, 4)
    with pytest.raises(WeightMappingError, match=r"conv1d.weight: \(48, 4\), expected \[C, 1, K\]"):
        from_hf(wrong_shape, config)


# --------------------------------------------------- contract with transformers' NemotronH
@pytest.fixture(scope="module")
def transformers_nemotron_h():
    import transformers  # in the CPU image; a missing install is a failure, not a skip

    return transformers.NemotronHConfig, transformers.NemotronHForCausalLM


def test_same_logits_as_transformers_nemotron_h(transformers_nemotron_h):
    hf_config_class, hf_model_class = transformers_nemotron_h
    config = small_config()
    hf_model = hf_model_class(hf_config_class(**config.to_hf_dict())).eval()
    randomise(hf_model, seed=2)
    ours = build_model(config).eval()
    ours.load_state_dict(from_hf(hf_model.state_dict(), config, prefix="model."))
    ids = torch.randint(0, 97, (2, 21))  # 21 tokens: three chunks of 8, the last partial
    with torch.no_grad():
        expected = hf_model(input_ids=ids).logits
        got = ours(ids)
    assert expected.abs().max() > 1.0  # weights large enough for mix-ups to show
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    # And back: our names mapped to HF's are exactly HF's tensors.
    back = to_hf(ours.state_dict(), config, prefix="model.")
    reference = hf_model.state_dict()
    assert back.keys() == reference.keys()
    assert all(torch.equal(back[k], reference[k]) for k in reference)


def test_checkpoints_load_both_ways_through_files(transformers_nemotron_h, tmp_path):
    hf_config_class, hf_model_class = transformers_nemotron_h
    config = small_config()
    ids = torch.randint(0, 97, (1, 17))

    # Ours -> hub layout on disk -> transformers.from_pretrained (local directory).
    ours = build_model(config).eval()
    randomise(ours, seed=3)
    out_dir = tmp_path / "from_mizzen"
    out_dir.mkdir()
    (out_dir / "config.json").write_text(json.dumps(config.to_hf_dict()))
    save_file(
        {k: v.contiguous() for k, v in to_hf(ours.state_dict(), config).items()},
        out_dir / "model.safetensors",
    )
    loaded = hf_model_class.from_pretrained(out_dir).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, ours(ids), rtol=1e-4, atol=1e-4)

    # transformers.save_pretrained -> our config and weights from its files.
    hf_model = hf_model_class(hf_config_class(**config.to_hf_dict())).eval()
    randomise(hf_model, seed=4)
    saved = tmp_path / "from_transformers"
    hf_model.save_pretrained(saved)
    saved_config = NemotronHConfig.from_hf_dict(json.loads((saved / "config.json").read_text()))
    assert saved_config == config
    reloaded = build_model(saved_config).eval()
    reloaded.load_state_dict(from_hf(load_file(saved / "model.safetensors"), saved_config))
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(ids), hf_model(input_ids=ids).logits, rtol=1e-4, atol=1e-4
        )
