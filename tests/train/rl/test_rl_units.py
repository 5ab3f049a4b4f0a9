"""Units of the RL step: group advantages, the clipped policy-gradient loss with its KL term, the
RL configuration's refusals, and the engines a failed set-up or engine start leaves (none)."""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=25, labels=["train"])


def test_grpo_normalises_each_group_and_equal_rewards_give_zero():
    from mizzen_train.rl.advantages import ESTIMATORS, group_advantages, load_estimator

    grpo = load_estimator("grpo")
    values = group_advantages([1.0, 0.0, 0.0, 1.0], grpo)
    assert values == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    skewed = group_advantages([3.0, 0.0, 0.0, 0.0], grpo)
    assert sum(skewed) == pytest.approx(0.0, abs=1e-9)
    assert skewed[0] == pytest.approx(math.sqrt(3), rel=1e-5)
    for name, estimator in ESTIMATORS.items():
        assert group_advantages([0.7] * 5, estimator) == [0.0] * 5, name
    # no reward (failed sample): advantage 0 and out of the group's statistics
    assert group_advantages([None, 2.0, 0.0], grpo) == pytest.approx([0.0, 1.0, -1.0], abs=1e-5)
    assert group_advantages([None, None], grpo) == [0.0, 0.0]
    assert group_advantages([2.0, 0.0], load_estimator("mean")) == [1.0, -1.0]
    with pytest.raises(ValueError, match="neither built in"):
        load_estimator("ppo")


def test_clipped_loss_clips_the_ratio_and_adds_kl_to_the_base():
    import torch

    from mizzen_train.losses import ClippedPolicyGradientLoss

    logprobs = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]]))
    old = torch.log(torch.tensor([[0.5, 0.25, 0.5, 0.25]]))  # ratios 1, 2, 1, 2
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss = ClippedPolicyGradientLoss(clip_low=0.2, clip_high=0.2)
    values, metrics = loss.per_token(logprobs, {"old_logprobs": old, "advantages": advantages})
    # A > 0: the ratio 2 is clipped to 1.2; A < 0: min(-2, -1.2) keeps the unclipped -2
    assert values[0].tolist() == pytest.approx([-1.0, -1.2, 1.0, 2.0])
    assert metrics["clip_fraction"].tolist() == [[0.0, 1.0, 0.0, 0.0]]
    assert metrics["importance_ratio"][0].tolist() == pytest.approx([1.0, 2.0, 1.0, 2.0])
    assert metrics["kl"].tolist() == [[0.0] * 4]  # no reference given
    assert loss.requires == ("old_logprobs", "advantages")

    # KL: k3 = exp(d) - d - 1 >= 0, d = ref - logprob; zero where the policy is the base
    ref = torch.log(torch.tensor([[0.5, 0.25, 0.5, 1.0]]))
    kl_loss = ClippedPolicyGradientLoss(kl_coef=0.5)
    assert kl_loss.requires == ("old_logprobs", "advantages", "ref_logprobs")
    fields = {"old_logprobs": logprobs, "advantages": advantages, "ref_logprobs": ref}
    with_kl, kl_metrics = kl_loss.per_token(logprobs, fields)
    plain, _ = ClippedPolicyGradientLoss().per_token(logprobs, fields)
    d = ref - logprobs
    k3 = torch.exp(d) - d - 1
    assert kl_metrics["kl"][0].tolist() == pytest.approx(k3[0].tolist())
    assert kl_metrics["kl"][0, 0] == 0.0 and bool((kl_metrics["kl"] >= 0).all())
    assert (with_kl - plain)[0].tolist() == pytest.approx((0.5 * k3)[0].tolist())
    # the gradient of the KL term pulls the policy towards the base
    lp = logprobs.clone().requires_grad_(True)
    kl_loss.per_token(lp, {**fields, "advantages": torch.zeros_like(lp)})[0].sum().backward()
    assert lp.grad[0, 3] < 0 < lp.grad[0, 1]  # raise lp where ref is higher, lower it where lower


def _config(tmp_path, **changes):
    sections = {
        "run": {"dir": str(tmp_path / "run"), "steps": 10, "checkpoint_interval": 5},
        "model": {"path": "tiny"},
        "tenants": [
            {"name": "a", "data": "example:rl_fixed", "reward": "math", "lr": 1e-3,
             "prompts_per_step": 2, "n_samples": 2},
        ],
    }  # fmt: skip
    for key, value in changes.items():
        section, _, field = key.partition(".")
        if section == "tenants":
            sections["tenants"][0][field] = value
        else:
            sections.setdefault(section, {})[field] = value
    return sections


def test_rl_config_refuses_what_cannot_train(tmp_path):
    from mizzen_train.rl.config import parse_rl_config
    from mizzen_train.run.config import ConfigError

    config = parse_rl_config(_config(tmp_path), source="t.toml")
    assert str(config.engines_needed) == "train+eval"
    assert [t.name for t in config.active(1)] == ["a"]
    cases = {
        "tenants.prompts_per_step": (3, "multiple of run.micro_batch_size"),
        "rollout.temperature": (0.0, "needs samples of the policy"),
        "rollout.top_k": (0, "0 keeps no token"),
        "rollout.batch_size": (257, "256"),
        "rollout.engines": ("urls", "needs the servers"),
        "algo.advantage": ("ppo", "neither built in"),
        "tenants.leave_step": (0, None),
        "tenants.join_step": (11, "after the last step"),
        "tenants.n_samples": (1, ">= 2"),
        "tenants.reward": ("none", "RL needs a reward"),
        "rollout.request_timeout_s": (0.0, ">= 0.001"),  # a deadline of no time
        "rollout.startup_timeout_s": (0.0, ">= 0.001"),
    }
    for key, (value, message) in cases.items():
        changes = {key: value, "run.micro_batch_size": 4} if "prompts" in key else {key: value}
        if message is None:
            parse_rl_config(_config(tmp_path, **changes), source="t.toml")
            continue
        with pytest.raises(ConfigError, match=message) as caught:
            parse_rl_config(_config(tmp_path, **changes), source="t.toml")
        assert "t.toml" in str(caught.value) and "Fix:" in str(caught.value), key
    generate = {"kind": "generate", "data": "example:rl_fixed", "reward": "math"}
    for field, value in [("device", "cuda"), ("num_engines", 2), ("engine_threads", 4),
                         ("engine_urls", ["http://127.0.0.1:1"]),
                         ("engine_lifetime", "point")]:  # fmt: skip
        raw = _config(tmp_path)
        raw["eval"] = {
            "interval": 5,
            "snapshot_dir": "s",
            "evaluators": [{**generate, field: value}],
        }
        with pytest.raises(ConfigError, match="on the run's own engines") as caught:
            parse_rl_config(raw, source="t.toml")
        assert f"eval.evaluators[0].{field}" in str(caught.value), field
    raw = _config(tmp_path)
    raw["eval"] = {
        "interval": 5,
        "snapshot_dir": "s",
        "evaluators": [{**generate, "device": "cpu"}],
    }
    parse_rl_config(raw, source="t.toml")  # the default, written out, changes nothing
    with pytest.raises(ConfigError, match="is no evaluator kind of this command"):
        raw = _config(tmp_path)
        raw["eval"] = {"interval": 5, "snapshot_dir": "s",
                       "evaluators": [{"kind": "loss", "data": "x"}]}  # fmt: skip
        parse_rl_config(raw, source="t.toml")


@pytest.mark.parametrize("fails_in", ["set-up", "engine start"])
def test_engines_run_rl_spawned_are_stopped_however_it_fails(tmp_path, monkeypatch, fails_in):
    """``run_rl`` spawns its embedded engines before set-up (they load while it imports megatron
    and the base model).  A set-up that fails, or a failure while the trainer takes them over
    after set-up (here: one's health wait crashes), stops them all: no engine outlives the run."""
    import io

    from mizzen_train.rl import trainer as rl_trainer
    from mizzen_train.rl.config import parse_rl_config
    from mizzen_train.run import trainer as run_trainer

    config = parse_rl_config(_config(tmp_path, **{"rollout.num_engines": 2}), source="t.toml")
    spawned, events = [], []
    launch = rl_trainer.RlTrainer.launch_engines

    def crash(*_):
        raise RuntimeError("probe crashed")

    def recording(self):
        servers = launch(self)
        spawned.extend(servers)
        if fails_in == "engine start":
            servers[-1].wait_healthy = crash
        return servers

    def setup(self):  # what _start_engines and the clean-up use, nothing heavier
        assert len(spawned) == 2 and all(s.alive for s in spawned), "spawned before set-up"
        if fails_in == "set-up":
            raise RuntimeError("set-up failed")
        self.metrics = SimpleNamespace(event=lambda name, **fields: events.append(name))
        self.evaluators = []

    monkeypatch.setattr(rl_trainer.RlTrainer, "launch_engines", recording)
    monkeypatch.setattr(rl_trainer.RlTrainer, "setup", setup)
    # no process group or megatron CPU shim in this pytest process: with them, the ranks a later
    # test forked from it hung (test_slot_optimizer after this one, in one worker: 150 s, killed)
    from mizzen_train.run.parallel import RankWorld

    class NoGroupWorld(RankWorld):  # one rank, no process group and no megatron state
        def model_parallel(self):
            return contextlib.nullcontext()

    monkeypatch.setattr(
        run_trainer,
        "join_world",
        lambda plan, device: contextlib.nullcontext(NoGroupWorld(plan, device)),
    )
    failure = "set-up failed" if fails_in == "set-up" else "probe crashed"
    with pytest.raises(RuntimeError, match=failure):
        rl_trainer.run_rl(config, stream=io.StringIO())
    assert len(spawned) == 2
    assert not any(s.alive for s in spawned), f"an engine outlived the failed {fails_in}"
    run_dir = str((tmp_path / "run").resolve())  # the adapters it publishes load from there
    assert all(s.command[s.command.index(run_dir) - 1] == "--load-dir" for s in spawned)
    assert events.count("engine_stopped") == (2 if fails_in == "engine start" else 0)


def test_batch_size_limits_are_the_embedded_servers(tmp_path):
    """The trainers stop batch_size where the embedded server refuses a batch."""
    import dataclasses

    from mizzen_rollout.api import ENGINE_MAX_BATCH as MAX_BATCH_SIZE
    from mizzen_train.rl.config import RolloutSection, parse_rl_config
    from mizzen_train.run.config import ConfigError

    (field,) = [f for f in dataclasses.fields(RolloutSection) if f.name == "batch_size"]
    assert field.metadata["high"] == MAX_BATCH_SIZE
    raw = _config(tmp_path)
    generate = {"kind": "generate", "data": "example:rl_fixed", "reward": "math"}
    raw["eval"] = {"interval": 5, "snapshot_dir": "s", "evaluators": [
        {**generate, "batch_size": MAX_BATCH_SIZE + 1}]}  # fmt: skip
    with pytest.raises(ConfigError, match="carries at most 256 prompts") as caught:
        parse_rl_config(raw, source="t.toml")
    assert "eval.evaluators[0].batch_size" in str(caught.value)
    raw["eval"]["evaluators"] = [{**generate, "batch_size": MAX_BATCH_SIZE}]
    parse_rl_config(raw, source="t.toml")
