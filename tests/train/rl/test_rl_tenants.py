"""``mizzen-train rl`` with tenants joining and leaving, and the one-step off-policy overlap.

Tenant "fixed" trains all 8 steps; tenant "format" joins at step 3 and leaves after step 6.  With
``rollout.off_policy = true`` the rollout of step t+1 runs while step t trains, so every sample
comes from the adapter one version behind the synchronous one -- and its ``adapter_version``
says so.  "format" trains exactly steps 3-6, starts from version 0, has its slot and adapters
unloaded when it leaves (the run ends with "fixed" alone), and the checkpoint written while it
was active holds its slot."""

from __future__ import annotations

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=45, labels=["e2e", "train", "rollout"])


def test_tenants_join_and_leave_with_off_policy_rollouts(sft, rl, tmp_path):
    run_dir = tmp_path / "run"
    sections = rl.sections(run_dir, steps=8, checkpoint_interval=5)
    sections["rollout"]["off_policy"] = True
    sections["tenants"][1].update(join_step=3, leave_step=6)
    del sections["eval"], sections["eval.evaluators"]
    config = sft.write_config(tmp_path / "rl.toml", sections)
    process = sft.launch(config, tmp_path / "rl.log", command="rl")
    assert process.wait(600) == 0, (tmp_path / "rl.log").read_text()[-6000:]
    records = sft.read_metrics(run_dir / "metrics.jsonl")
    train = {(r["tenant"], r["step"]): r for r in records if r["kind"] == "train"}
    assert sorted(s for t, s in train if t == "fixed") == list(range(1, 9))
    assert sorted(s for t, s in train if t == "format") == [3, 4, 5, 6]
    for record in train.values():
        assert set(record) == rl.TRAIN_KEYS
    # one version behind: the rollout of step s ran while step s-1 trained
    assert [train[("fixed", s)]["adapter_version"] for s in range(1, 9)] == [0, 0, 1, 2, 3, 4, 5, 6]
    assert [train[("format", s)]["adapter_version"] for s in (3, 4, 5, 6)] == [0, 0, 1, 2]
    assert all(r["stepped"] for r in train.values())
    events = [r for r in records if r["kind"] == "event"]
    joined = [(e["tenant"], e["version"]) for e in events if e["event"] == "tenant_joined"]
    assert joined == [("fixed", 0), ("format", 0)]
    left = [(e["tenant"], e["step"], e["version"]) for e in events if e["event"] == "tenant_left"]
    assert left == [("format", 6, 4)]
    checkpoints = {e["step"]: e["versions"] for e in events if e["event"] == "checkpoint"}
    assert checkpoints == {5: {"fixed": 5, "format": 3}, 8: {"fixed": 8}}
    assert (run_dir / "checkpoints" / "step-00000005" / "slots" / "format").is_dir()
    assert not (run_dir / "checkpoints" / "step-00000008" / "slots" / "format").exists()
    summary = records[-1]
    assert summary["kind"] == "summary" and summary["adapter_versions"] == {"fixed": 8}
