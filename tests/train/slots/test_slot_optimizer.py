"""SlotOptimizer is AdamW (torch's, step for step) with per-request hyperparameters and clipping,
on gradients held by megatron's DistributedDataParallel; a non-finite norm skips cleanly."""

from __future__ import annotations

import math

import torch

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=15, labels=["train", "megatron"])

SHAPES = [(3, 4), (5,), (2, 6)]


def _slot(slot: int):
    """A slot-like parameter set: views of one flat storage, gradients in a megatron DDP."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mizzen_train.slot_optimizer import SlotOptimizer

    total = sum(math.prod(shape) for shape in SHAPES)
    generator = torch.Generator().manual_seed(100 + slot)
    storage = torch.randn(total, generator=generator)
    module = torch.nn.Module()
    module.factors = torch.nn.ParameterList()
    offset = 0
    for shape in SHAPES:
        param = torch.nn.Parameter(torch.empty(0))
        param.data = storage[offset : offset + math.prod(shape)].view(shape)
        module.factors.append(param)
        offset += math.prod(shape)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    config.calculate_per_token_loss = True
    grad_sync = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=module
    )
    params = list(module.factors)
    optimizer = SlotOptimizer(
        slot,
        params,
        counts_in_norm=[True] * len(params),
        grad_sync=grad_sync,
        weight_storage=storage,
    )
    return params, optimizer


def _accumulate(params, gradients) -> None:
    loss = sum((p * g).sum() for p, g in zip(params, gradients, strict=True))
    loss.backward()  # megatron DDP's hooks move .grad into fp32 main_grad


def _parity_scenario() -> dict:
    from mizzen_train.slot_optimizer import step_slot_optimizers
    from mizzen_train.specs import AdamParams

    schedule = {
        0: [
            AdamParams(lr=1e-2),
            AdamParams(lr=5e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
            AdamParams(lr=2e-2, max_grad_norm=0.05),  # clipping active
            AdamParams(lr=1e-2, max_grad_norm=None, weight_decay=0.02),
        ],
        1: [
            AdamParams(lr=3e-3, betas=(0.5, 0.9)),
            AdamParams(lr=3e-3, max_grad_norm=0.01),
            AdamParams(lr=1e-3, weight_decay=0.5),
            AdamParams(lr=1e-2),
        ],
    }
    slots = {slot: _slot(slot) for slot in schedule}
    references = {}
    for slot, (params, _) in slots.items():
        copies = [p.detach().clone().requires_grad_(True) for p in params]
        references[slot] = (copies, torch.optim.AdamW(copies, lr=1.0, foreach=False))
    generator = torch.Generator().manual_seed(7)
    errors, clipped = [], []
    for step in range(4):
        expected_norms = {}
        for slot, (params, _) in slots.items():
            gradients = [torch.randn(p.shape, generator=generator) for p in params]
            _accumulate(params, gradients)
            copies, reference = references[slot]
            for copy, gradient in zip(copies, gradients, strict=True):
                copy.grad = gradient.clone()
            hyper = schedule[slot][step]
            reference.param_groups[0].update(
                lr=hyper.lr, betas=hyper.betas, eps=hyper.eps, weight_decay=hyper.weight_decay
            )
            max_norm = hyper.max_grad_norm if hyper.max_grad_norm is not None else float("inf")
            expected_norms[slot] = float(torch.nn.utils.clip_grad_norm_(copies, max_norm))
            reference.step()
        reports = step_slot_optimizers(
            {slot: opt for slot, (_, opt) in slots.items()},
            {slot: schedule[slot][step] for slot in slots},
        )
        for slot, (params, optimizer) in slots.items():
            copies, _ = references[slot]
            report = reports[slot]
            assert report.stepped and not report.skipped_nonfinite and report.step == step + 1
            errors.append(abs(report.grad_norm - expected_norms[slot]) / expected_norms[slot])
            clipped.append(report.clip_coef < 1.0)
            for master, param, copy in zip(optimizer.masters, params, copies, strict=True):
                errors.append((master - copy.detach()).abs().max().item())
                assert torch.equal(param.detach(), master), "weights not published"
            for grad in optimizer.grads():
                assert torch.count_nonzero(grad) == 0, "grads not zeroed after the step"
    return {"max_error": max(errors), "clipped": sum(clipped)}


def test_matches_torch_adamw_with_per_request_hyperparameters(kit):
    (result,) = kit.run_ranks(_parity_scenario)
    assert result["clipped"] >= 2, "the schedule must exercise clipping"
    assert result["max_error"] < 1e-6


def _nonfinite_scenario() -> dict:
    from mizzen_train.slot_optimizer import step_slot_optimizers
    from mizzen_train.specs import AdamParams

    params, optimizer = _slot(0)
    _accumulate(params, [torch.ones(p.shape) for p in params])
    step_slot_optimizers({0: optimizer}, {0: AdamParams(lr=1e-2)})
    before = [t.clone() for t in optimizer.masters + optimizer.exp_avg + optimizer.exp_avg_sq]
    weights_before = [p.detach().clone() for p in params]
    gradients = [torch.ones(p.shape) for p in params]
    gradients[1][2] = float("nan")
    _accumulate(params, gradients)
    (report,) = step_slot_optimizers({0: optimizer}, {0: AdamParams(lr=1e-2)}).values()
    after = optimizer.masters + optimizer.exp_avg + optimizer.exp_avg_sq
    return {
        "report": (report.stepped, report.skipped_nonfinite, report.step),
        "norm_finite": math.isfinite(report.grad_norm),
        "state_unchanged": all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
        "weights_unchanged": all(
            torch.equal(w, p.detach()) for w, p in zip(weights_before, params, strict=True)
        ),
        "grads_zero": all(torch.count_nonzero(g) == 0 for g in optimizer.grads()),
    }


def test_nonfinite_gradient_skips_and_discards(kit):
    (result,) = kit.run_ranks(_nonfinite_scenario)
    assert result["report"] == (False, True, 1)
    assert not result["norm_finite"]
    assert result["state_unchanged"] and result["weights_unchanged"] and result["grads_zero"]
