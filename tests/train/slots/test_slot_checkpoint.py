"""Slot checkpoints: one writer per (tp, pp, ep) shard, exact round trip, a failure mid-save keeps
the previous checkpoint loadable, loading validates, export trims the rank padding from the end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=45, labels=["lora", "train", "distributed"])


def _train(kit, executor, slot: int, steps: int, seed: int = 0) -> None:
    from mizzen_train.losses import CrossEntropyLoss
    from mizzen_train.specs import AdamParams

    for step in range(steps):
        batch = kit.tiny_batch([slot] * 4, seed=seed + step)
        executor.forward_backward(batch, CrossEntropyLoss())
        executor.optim_step({slot: AdamParams(lr=1e-2, weight_decay=0.01)})


def _election_scenario(kit, directory: str) -> dict:
    from mizzen_train.checkpoint import current_coordinates, elect_shard_writers

    writers, proposals = elect_shard_writers(
        current_coordinates(), proposal=torch.distributed.get_rank()
    )
    executor = kit.tiny_executor(num_slots=1, max_rank=4)
    executor.load_slot(0, 4, 4.0)
    _train(kit, executor, 0, steps=1)
    executor.save_slot(0, directory)
    return {"writers": {c.tag: r for c, r in writers.items()}, "proposals": proposals}


@pytest.mark.parametrize(("tp", "expected"), [(2, {"tp00": 0, "tp01": 1}), (1, {"tp00": 0})])
def test_writer_election_over_two_ranks(kit, tmp_path, tp, expected):
    """TP=2: each rank writes its own shard. DP=2 (tp=1): only the lowest rank writes."""
    results = kit.run_ranks(_election_scenario, world_size=2, tp=tp, args=(kit, str(tmp_path)))
    expected_tags = {f"{tp_tag}-pp00-ep00": rank for tp_tag, rank in expected.items()}
    for result in results:
        assert result["writers"] == expected_tags
        assert result["proposals"] == [0, 1]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert {tag: shard["writer"] for tag, shard in manifest["shards"].items()} == expected_tags
    files = sorted(p.name for p in tmp_path.rglob("*.pt"))
    assert files == sorted(f"shard-{tag}.pt" for tag in expected_tags)
    assert not list(tmp_path.rglob(".*tmp*")), "temporary files left behind"


def _state(executor, slot: int) -> dict:
    state = executor.inspect_slot(slot)
    state.pop("grad")
    return state


def _assert_same_state(left: dict, right: dict, what: str) -> None:
    assert left["step"] == right["step"], what
    for entry in ("weight", "master", "exp_avg", "exp_avg_sq"):
        for name, tensor in left[entry].items():
            assert torch.equal(tensor, right[entry][name]), f"{what}: {entry} {name}"


def _round_trip_scenario(kit, directory: str) -> dict:
    from mizzen_train.losses import CrossEntropyLoss
    from mizzen_train.specs import AdamParams

    executor = kit.tiny_executor(num_slots=3, max_rank=8)
    executor.load_slot(0, 6, 12.0, weights=kit.random_adapter(executor, 6, seed=1))
    _train(kit, executor, 0, steps=2)
    executor.save_slot(0, directory)
    spec = executor.restore_slot(2, directory)
    _assert_same_state(_state(executor, 0), _state(executor, 2), "restored")
    # both continue identically on identical data
    batch = kit.tiny_batch([0, 0], seed=9)
    twin = type(batch)(**{**batch.token_fields(), "slot_ids": torch.full_like(batch.slot_ids, 2)})
    combined = type(batch)(
        **{
            name: torch.cat([getattr(batch, name), getattr(twin, name)])
            for name in batch.token_fields()
        }
    )
    reports = executor.forward_backward(combined, CrossEntropyLoss())
    executor.optim_step({0: AdamParams(lr=1e-2), 2: AdamParams(lr=1e-2)})
    _assert_same_state(_state(executor, 0), _state(executor, 2), "after a further step")
    return {"spec": (spec.rank, spec.alpha), "losses": (reports[0].loss, reports[2].loss)}


def test_round_trip_restores_adapter_moments_and_step(kit, tmp_path):
    for result in kit.run_ranks(
        _round_trip_scenario, world_size=2, tp=2, args=(kit, str(tmp_path))
    ):
        assert result["spec"] == (6, 12.0)
        assert result["losses"][0] == result["losses"][1]


def _failure_scenario(kit, directory: str) -> dict:
    from mizzen_train import checkpoint
    from mizzen_train.errors import SlotCheckpointError

    rank = torch.distributed.get_rank()
    executor = kit.tiny_executor(num_slots=2, max_rank=8)
    executor.load_slot(0, 4, 8.0, weights=kit.random_adapter(executor, 4, seed=2))
    _train(kit, executor, 0, steps=1)
    executor.save_slot(0, directory)
    committed = _state(executor, 0)
    _train(kit, executor, 0, steps=1, seed=5)

    outcomes = {}
    real_save, real_write = torch.save, checkpoint._atomic_write

    def failing_save(obj, handle, *args, **kwargs):
        handle.write(b"partial shard bytes")
        raise OSError(28, "No space left on device (injected)")

    def failing_manifest(path, write):
        if path.name == checkpoint.MANIFEST:
            raise OSError(5, "I/O error (injected)")
        return real_write(path, write)

    for name, patch in (
        ("shard", ("torch.save", failing_save, 1)),
        ("commit", ("_atomic_write", failing_manifest, 0)),
    ):
        attribute, replacement, failing_rank = patch
        if rank == failing_rank:
            if attribute == "torch.save":
                torch.save = replacement
            else:
                checkpoint._atomic_write = replacement
        try:
            executor.save_slot(0, directory)
            outcomes[name] = "saved"
        except SlotCheckpointError as exc:
            outcomes[name] = str(exc)
        finally:
            torch.save, checkpoint._atomic_write = real_save, real_write
    usable = executor.failed is None
    executor.restore_slot(1, directory)
    restored = _state(executor, 1)
    _assert_same_state(committed, restored, "previous checkpoint after failed saves")
    executor.save_slot(0, directory)  # a later save succeeds and prunes the failed versions
    return {
        "outcomes": outcomes,
        "usable": usable,
        "versions": len(list(Path(directory).glob("step-*"))),
    }


def test_failure_mid_save_keeps_previous_checkpoint_loadable(kit, tmp_path):
    results = kit.run_ranks(_failure_scenario, world_size=2, tp=2, args=(kit, str(tmp_path)))
    for result in results:
        assert result["usable"], "an agreed checkpoint failure must not fail the executor"
        assert "No space left on device (injected)" in result["outcomes"]["shard"]
        assert "nothing was committed" in result["outcomes"]["shard"]
        assert "I/O error (injected)" in result["outcomes"]["commit"]
        assert result["versions"] == 1


def _save_tp2(kit, directory: str) -> None:
    executor = kit.tiny_executor(num_slots=1, max_rank=8)
    executor.load_slot(0, 4, 8.0, weights=kit.random_adapter(executor, 4, seed=3))
    executor.save_slot(0, directory)


def _load_errors_scenario(kit, tp2_dir: str, tmp: str) -> dict[str, str]:
    from mizzen_train.errors import SlotCheckpointError

    errors = {}

    def attempt(name, executor, directory):
        try:
            executor.restore_slot(0, directory)
            errors[name] = "loaded"
        except SlotCheckpointError as exc:
            errors[name] = str(exc)

    executor = kit.tiny_executor(num_slots=1, max_rank=8)
    attempt("tp", executor, tp2_dir)
    attempt("empty", executor, f"{tmp}/empty")
    executor.load_slot(0, 4, 8.0)
    executor.save_slot(0, f"{tmp}/tp1")
    executor.unload_slot(0)
    attempt("max_rank", kit.tiny_executor(num_slots=1, max_rank=4), f"{tmp}/tp1")
    attempt("targets", kit.tiny_executor(num_slots=1, target_modules=["linear_qkv"]), f"{tmp}/tp1")
    shard = next(Path(f"{tmp}/tp1").rglob("*.pt"))
    shard.write_bytes(shard.read_bytes()[:-10])
    attempt("truncated", executor, f"{tmp}/tp1")
    errors["usable"] = str(executor.failed)
    return errors


def test_load_validates_layout_rank_targets_and_files(kit, tmp_path):
    tp2_dir = tmp_path / "tp2"
    kit.run_ranks(_save_tp2, world_size=2, tp=2, args=(kit, str(tp2_dir)))
    (errors,) = kit.run_ranks(_load_errors_scenario, args=(kit, str(tp2_dir), str(tmp_path)))
    assert "parallel.tp=2 but this job runs tp=1" in errors["tp"]
    assert "no manifest" in errors["empty"]
    assert "max_rank=8 but the executor's max_rank=4" in errors["max_rank"]
    assert "factors do not match" in errors["targets"]
    assert "size" in errors["truncated"] and "shard-tp00-pp00-ep00.pt" in errors["truncated"]
    assert errors["usable"] == "None"


def _export_scenario(kit, directory: str) -> dict:
    from mizzen_train.checkpoint import export_adapter

    executor = kit.tiny_executor(num_slots=1, max_rank=8)
    weights = kit.random_adapter(executor, 3, seed=4)
    executor.load_slot(0, 3, 6.0, weights=weights)
    executor.save_slot(0, directory)
    exported = export_adapter(directory) if torch.distributed.get_rank() == 0 else None
    return {"weights": weights, "exported": exported}


def test_export_joins_tp_shards_and_trims_to_true_rank(kit, tmp_path):
    result = kit.run_ranks(_export_scenario, world_size=2, tp=2, args=(kit, str(tmp_path)))[0]
    exported = result["exported"]
    assert exported.spec.rank == 3 and exported.step == 0
    assert set(exported.tensors) == set(result["weights"])
    for name, tensor in result["weights"].items():
        assert torch.equal(exported.tensors[name], tensor), name


def _trim_scenario() -> dict:
    from mizzen_train.checkpoint import trim_rank_padding
    from mizzen_train.errors import SlotCheckpointError

    experts, max_rank, rank = 4, 4, 2  # the expert axis has the same size as the rank axis
    lora_a = torch.zeros(experts, max_rank, 6)  # [E, r, in]
    lora_b = torch.zeros(experts, 5, max_rank)  # [E, out, r]
    lora_a[:, :rank] = torch.randn(experts, rank, 6)
    lora_b[:, :, :rank] = torch.randn(experts, 5, rank)
    trimmed_a = trim_rank_padding(lora_a, rank=rank, rank_axis_from_end=2, name="a")
    trimmed_b = trim_rank_padding(lora_b, rank=rank, rank_axis_from_end=1, name="b")
    values = torch.equal(trimmed_a, lora_a[:, :rank]) and torch.equal(trimmed_b, lora_b[..., :rank])
    lora_a[1, 3, 0] = 0.5  # padding that is not zero
    try:
        trim_rank_padding(lora_a, rank=rank, rank_axis_from_end=2, name="experts.lora_A")
        error = None
    except SlotCheckpointError as exc:
        error = str(exc)
    return {
        "shapes": (tuple(trimmed_a.shape), tuple(trimmed_b.shape)),
        "values": values,
        "error": error,
    }


def test_rank_trimming_counts_from_the_end_with_an_expert_axis(kit):
    (result,) = kit.run_ranks(_trim_scenario)
    assert result["shapes"] == ((4, 2, 6), (4, 5, 2)), "the expert axis must never be cut"
    assert result["values"]
    assert result["error"] is not None and "experts.lora_A" in result["error"]
    assert "non-zero" in result["error"]


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("shards", "tp00-pp00-ep00", "factors", "f"), "x"),
        (("shards", "tp00-pp00-ep00", "factors", "f", "split_dim"), 5),
        (("shards", "tp00-pp00-ep00", "factors", "f", "rank_axis_from_end"), 0),
        (("shards", "tp00-pp00-ep00", "factors", "f", "shape"), [2, "3"]),
        (("slot_spec", "alpha"), float("nan")),
        (("slot_spec", "alpha"), -1.0),
        (("slot_spec", "seed"), "0"),
    ],
    ids=["factor-not-table", "split-dim", "rank-axis", "shape", "nan-alpha", "negative-alpha",
         "seed"],
)  # fmt: skip
def test_every_manifest_field_a_reader_uses_is_checked(path, value):
    """A field the export or restore indexes with (split_dim, rank_axis_from_end, shape) or
    scales with (alpha) is checked in the manifest, before any tensor is read."""
    import copy

    from mizzen_train.checkpoint import _manifest_problems

    manifest = {
        "version": "v", "step": 1, "max_rank": 4, "parallel": {"tp": 1, "pp": 1, "ep": 1},
        "slot_spec": {"rank": 2, "alpha": 2.0, "init": "kaiming_uniform", "seed": 0},
        "shards": {"tp00-pp00-ep00": {"file": "s.pt", "bytes": 1, "factors": {
            "f": {"shape": [2, 3], "split_dim": 0, "rank_axis_from_end": 1}}}},
    }  # fmt: skip
    assert _manifest_problems(manifest) == []
    damaged = copy.deepcopy(manifest)
    *parents, last = path
    target = damaged
    for key in parents:
        target = target[key]
    target[last] = value
    assert _manifest_problems(damaged), f"{'.'.join(path)}={value!r} passed"
