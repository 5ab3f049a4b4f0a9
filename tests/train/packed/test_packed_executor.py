"""Packed (THD) attention in the slot executor is the old dense-mask computation, without its mask.

- The executor's packed path (one ``[1, T]`` stream per micro-batch, routed per run of slot:
  single-slot micro-batches, and one holding both slots) gives the losses and LoRA gradients of
  the old path: megatron's
  dense ``DotProductAttention`` over a block-diagonal ``[b, 1, s, s]`` mask (kept here as the
  reference, built with ``build_gpt(attention="dense")``, LoRA merged functionally).
- Packed rows and one-sample-per-row padded rows give every sample the same loss.
- No cross-sample attention: changing sample 2's tokens changes no logit of sample 1 in the same
  packed stream; learned positions restart per sample (a sample's logits do not depend on where
  in the row it sits).
- Packing efficiency is reported per slot and per request.
"""

from __future__ import annotations

import torch

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=20, labels=["lora", "megatron", "train"])

# samples per row (token counts); the rest of each row of SEQ is padding (segment -1)
ROW_SAMPLES = [[7, 9, 5], [11, 10], [6, 6, 6, 4], [20]]
SEQ = 24


def packed_batch(row_slots, row_samples=ROW_SAMPLES, seq_len=SEQ, seed=0, vocab=128):
    from mizzen_train.batch import SlotBatch

    generator = torch.Generator().manual_seed(seed)
    rows = len(row_samples)
    input_ids = torch.randint(0, vocab, (rows, seq_len), generator=generator)
    target_ids = torch.randint(0, vocab, (rows, seq_len), generator=generator)
    segment_ids = torch.full((rows, seq_len), -1)
    loss_mask = torch.zeros(rows, seq_len, dtype=torch.bool)
    for row, lengths in enumerate(row_samples):
        start = 0
        for index, length in enumerate(lengths):
            segment_ids[row, start : start + length] = index
            loss_mask[row, start + 1 : start + length] = True  # a prompt token, then targets
            start += length
    slot_ids = torch.tensor(row_slots).unsqueeze(1).expand(rows, seq_len).clone()
    return SlotBatch(input_ids, target_ids, loss_mask, slot_ids, segment_ids=segment_ids)


def dense_mask(segment_ids):
    """The old executor's mask: True where attention is masked (later or other segment)."""
    seq_len = segment_ids.shape[1]
    causal = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)
    other = segment_ids.unsqueeze(2) != segment_ids.unsqueeze(1)
    return (causal.unsqueeze(0) | other).unsqueeze(1)


def dense_logprobs(dense, batch, overrides):
    """Target log-probs of the old path: dense model, dense mask, positions per segment."""
    from torch.func import functional_call

    from mizzen_train.executor import segment_positions

    logits = functional_call(
        dense,
        overrides,
        (batch.input_ids, segment_positions(batch.segment_ids), dense_mask(batch.segment_ids)),
    )
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    return logprobs.gather(-1, batch.target_ids.unsqueeze(-1)).squeeze(-1)


def _tiny_llama():
    from mizzen_train.gpt import GPTSpec

    return GPTSpec.llama(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=96,
        vocab_size=128,
        max_sequence_length=64,
    )


def _parity_scenario(kit) -> dict:
    """Executor (packed) vs the old dense-mask path with merged LoRA: losses and gradients."""
    from mizzen_train.gpt import build_gpt
    from mizzen_train.losses import CrossEntropyLoss

    spec = _tiny_llama()
    specs = {0: (4, 8.0, 31), 1: (8, 4.0, 32)}
    row_slots = [0, 0, 1, 1]
    batch = packed_batch(row_slots, seed=1)
    dense = build_gpt(spec, device="cpu", attention="dense")
    out: dict = {"loss": {}, "grad": {}}
    for mode, micro_batch_size in (("one_slot", 2), ("two_slots", 4)):
        executor = kit.tiny_executor(
            num_slots=2, max_rank=8, micro_batch_size=micro_batch_size, gpt=spec
        )
        adapters = {}
        for slot, (rank, alpha, seed) in specs.items():
            adapters[slot] = kit.random_adapter(executor, rank, seed=seed)
            executor.load_slot(slot, rank, alpha, weights=adapters[slot])
        reports = executor.forward_backward(batch, CrossEntropyLoss())
        out["packing"] = {s: r.packing_efficiency for s, r in reports.items()}
        out["request_packing"] = executor.last_packing.efficiency
        for slot, (rank, alpha, _) in specs.items():
            rows = [r for r, s in enumerate(row_slots) if s == slot]
            part = _rows(batch, rows)
            factors = {
                name: value.clone().double().requires_grad_(True)
                for name, value in adapters[slot].items()
            }
            overrides = {}
            for key in executor.layers:
                weight = dense.get_submodule(key).weight.detach().double()
                lora = factors[f"{key}.lora_B"] @ factors[f"{key}.lora_A"]
                overrides[f"{key}.weight"] = (weight + alpha / rank * lora).float()
            logprobs = dense_logprobs(dense, part, overrides)
            mask = part.loss_mask
            loss = -(logprobs[mask]).sum() / mask.sum()
            loss.backward()
            got = executor.inspect_slot(slot)["grad"]
            scale = max(f.grad.abs().max().item() for f in factors.values())
            assert scale > 0, "reference gradient is zero: the comparison would be vacuous"
            out["loss"][(mode, slot)] = abs(reports[slot].loss - loss.item()) / loss.item()
            out["grad"][(mode, slot)] = max(
                (_true_rank(got[name], factors[name].shape) - factors[name].grad).abs().max().item()
                / scale
                for name in factors
            )
    return out


def _true_rank(padded, shape):
    """A max-rank padded factor cut to the true-rank ``shape`` (the padding must be zero)."""
    cut = padded.double()
    for dim, size in enumerate(shape):
        assert not cut.narrow(dim, size, cut.shape[dim] - size).any(), "non-zero rank padding"
        cut = cut.narrow(dim, 0, size)
    return cut


def _rows(batch, rows):
    import dataclasses

    return dataclasses.replace(
        batch, **{name: value[rows] for name, value in batch.token_fields().items()}
    )


def _per_sample_scenario(kit) -> dict:
    """Per-sample losses: packed rows vs one sample per padded row; no cross-attention; learned
    positions restart per sample."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from mizzen_train.gpt import GPTSpec

    out = {}
    for name, spec in (
        ("llama", _tiny_llama()),
        ("gpt2", GPTSpec(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128)),
    ):
        executor = kit.tiny_executor(num_slots=1, max_rank=8, micro_batch_size=2, gpt=spec)
        adapter = kit.random_adapter(executor, 4, seed=3)
        executor.load_slot(0, 4, 8.0, weights=adapter)
        packed = packed_batch([0, 0, 0, 0], seed=2)
        samples = [n for lengths in ROW_SAMPLES for n in lengths]
        padded = packed_batch([0] * len(samples), [[n] for n in samples], seq_len=SEQ)
        # the padded batch holds the same samples' tokens, one per row
        fields = {}
        for field in ("input_ids", "target_ids"):
            source = getattr(packed, field)
            value = getattr(padded, field).clone()
            i = 0
            for row, lengths in enumerate(ROW_SAMPLES):
                start = 0
                for n in lengths:
                    value[i, :n] = source[row, start : start + n]
                    start, i = start + n, i + 1
            fields[field] = value
        import dataclasses

        padded = dataclasses.replace(padded, **fields)
        lp_packed = executor.forward_logprobs(packed)
        lp_padded = executor.forward_logprobs(padded)
        per_sample_packed, i = [], 0
        for row, lengths in enumerate(ROW_SAMPLES):
            start = 0
            for n in lengths:
                mask = packed.loss_mask[row, start : start + n]
                per_sample_packed.append(-lp_packed[row, start : start + n][mask].mean().item())
                start, i = start + n, i + 1
        per_sample_padded = [
            -lp_padded[i, :n][padded.loss_mask[i, :n]].mean().item() for i, n in enumerate(samples)
        ]
        out[f"{name}_per_sample"] = max(
            abs(a - b) / abs(b) for a, b in zip(per_sample_packed, per_sample_padded, strict=True)
        )
        # a step trains on either layout alike: the same loss and the same gradients
        from mizzen_train.losses import CrossEntropyLoss

        loss_packed = executor.forward_backward(packed, CrossEntropyLoss())[0]
        grad_packed = executor.inspect_slot(0)["grad"]
        executor.unload_slot(0)  # the same adapter again, without the pending gradients
        executor.load_slot(0, 4, 8.0, weights=adapter)
        loss_padded = executor.forward_backward(padded, CrossEntropyLoss())[0]
        grad_padded = executor.inspect_slot(0)["grad"]
        out[f"{name}_batch_loss"] = abs(loss_packed.loss - loss_padded.loss) / loss_padded.loss
        out[f"{name}_batch_grad"] = max(
            (grad_packed[k] - grad_padded[k]).abs().max().item() / grad_padded[k].abs().max().item()
            for k in grad_padded
        )
        out[f"{name}_packing"] = (loss_packed.packing_efficiency, loss_padded.packing_efficiency)

        # no cross-sample attention, through megatron's own PackedSeqParams (the plugin contract)
        model = executor.model
        lengths = [9, 7]
        cu = torch.tensor([0, 9, 16], dtype=torch.int32)
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=9, max_seqlen_kv=9
        )
        ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(5))
        changed = ids.clone()
        changed[0, 9:] = (changed[0, 9:] + 17) % 128
        positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
        with torch.no_grad():
            first = model(ids, positions, None, packed_seq_params=params)
            second = model(changed, positions, None, packed_seq_params=params)
            # sample 2 first, sample 1 second: sample 1's logits must not move
            swapped_cu = torch.tensor([0, 7, 16], dtype=torch.int32)
            swapped = PackedSeqParams(
                qkv_format="thd",
                cu_seqlens_q=swapped_cu,
                cu_seqlens_kv=swapped_cu,
                max_seqlen_q=9,
                max_seqlen_kv=9,
            )
            order = torch.cat([ids[0, 9:], ids[0, :9]]).unsqueeze(0)
            order_pos = torch.cat([torch.arange(7), torch.arange(9)]).unsqueeze(0)
            moved = model(order, order_pos, None, packed_seq_params=swapped)
        out[f"{name}_cross"] = (first[0, :9] - second[0, :9]).abs().max().item()
        out[f"{name}_sample2_moved"] = (first[0, 9:] - second[0, 9:]).abs().max().item()
        out[f"{name}_position_restart"] = (first[0, :9] - moved[0, 7:]).abs().max().item()
    return out


def test_packed_executor_matches_the_dense_mask_path(kit):
    (out,) = kit.run_ranks(_parity_scenario, args=(kit,))
    for key, error in out["loss"].items():
        assert error < 1e-5, f"{key}: loss relative error {error}"
    for key, error in out["grad"].items():
        assert error < 1e-4, f"{key}: LoRA gradient relative error {error}"
    real = sum(sum(lengths) for lengths in ROW_SAMPLES)
    assert abs(out["request_packing"] - real / (len(ROW_SAMPLES) * SEQ)) < 1e-12
    assert abs(out["packing"][0] - (21 + 21) / (2 * SEQ)) < 1e-12


def test_packed_equals_padded_per_sample_and_no_cross_attention(kit):
    (out,) = kit.run_ranks(_per_sample_scenario, args=(kit,))
    for name in ("llama", "gpt2"):
        assert out[f"{name}_per_sample"] < 1e-5, out
        assert out[f"{name}_batch_loss"] < 1e-5, out
        assert out[f"{name}_batch_grad"] < 1e-4, out
        assert out[f"{name}_sample2_moved"] > 1e-3, "changing sample 2 changed nothing: vacuous"
        assert out[f"{name}_cross"] < 1e-5, f"{name}: sample 2 reached sample 1's logits"
        assert out[f"{name}_position_restart"] < 1e-5, f"{name}: positions do not restart"
        packed, padded = out[f"{name}_packing"]
        assert padded < packed <= 1.0
