"""e2e: ``mizzen-train rl`` trains two LoRA tenants on one tiny Llama by GRPO, on a CPU.

Tenant "fixed" is rewarded for answering with the token "Y", tenant "format" for answering in
lowercase letters (``mizzen_train.rl.toy``).  Two real runs side by side:

- the reference run: over 30 steps each tenant's mean reward rises from its start (< 0.4) to
  >= 0.8 (mean of the last five steps); the final adapter snapshots, evaluated on both tasks by
  the run's engine, score high on their own task, and "fixed"'s adapter scores low on "format"'s
  task (isolation; the reverse is not asserted: the shaped reward of "fixed" gives partial credit
  to lowercase letters, which lie 8-33 bytes above "Y");
- the faulty run: tenant "format" gets NaN advantages at step 12, and the process is SIGKILLed
  after step 23 and resumed with ``--resume``.  At step 12 "format" is skipped (not stepped, its
  adapter not re-published: its next samples come from the same version) while "fixed" steps,
  and every adapter "fixed" publishes -- the one of step 12, and through the kill and resume
  the last one -- is byte for byte the reference run's; the resumed run continues from the
  step-20 checkpoint with the checkpoint's adapter versions, re-publishes exactly those, logs
  each step once, and the killed run's engine does not outlive it.
"""

from __future__ import annotations

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=120, labels=["e2e", "train", "rollout"])

STEPS, NAN_STEP, KILL_AFTER, CHECKPOINT_INTERVAL = 30, 12, 23, 10


def test_two_tenants_learn_apart_skip_nan_and_resume(rl, tmp_path):
    run = rl.protocol(
        tmp_path,
        lambda run_dir: rl.sections(run_dir, steps=STEPS, checkpoint_interval=CHECKPOINT_INTERVAL),
        steps=STEPS,
        nan_step=NAN_STEP,
        kill_after=KILL_AFTER,
        checkpoint_interval=CHECKPOINT_INTERVAL,
    )
    reference, faulty = run["reference"], run["faulty"]

    # -- the reference run learns both tasks, each adapter its own ----------------------------
    by = rl.check_run(reference["records"], steps=STEPS)
    curves = {}
    for tenant in rl.TENANTS:
        start = by[tenant][1]["reward_mean"]
        end = sum(by[tenant][s]["reward_mean"] for s in range(STEPS - 4, STEPS + 1)) / 5
        curves[tenant] = (start, end)
    print(f"reward start -> end (mean of the last 5 steps): {curves}; wall {run['wall']:.0f} s")
    for tenant, (start, end) in curves.items():
        assert start < 0.4 and end >= 0.8, (tenant, start, end)
    summary = reference["records"][-1]
    assert summary["kind"] == "summary" and summary["adapter_versions"] == {
        "fixed": STEPS,
        "format": STEPS,
    }
    final = summary["final_eval"]
    assert final["fixed"]["task_fixed"]["score"] >= 0.8, final
    assert final["format"]["task_format"]["score"] >= 0.8, final
    assert final["fixed"]["task_format"]["score"] <= 0.3, final  # A's adapter on B's task
    assert (reference["dir"] / "curves.png").stat().st_size > 10_000
    assert f"curves:      {reference['dir'] / 'curves.png'}" in reference["output"]

    # -- the faulty run: NaN in B's step 12 touches neither A nor B's published adapter -------
    fby = rl.check_run(faulty["records"], steps=STEPS)
    assert fby["format"][NAN_STEP]["stepped"] is False
    assert fby["format"][NAN_STEP]["published_version"] == NAN_STEP - 1
    assert fby["format"][NAN_STEP + 1]["adapter_version"] == NAN_STEP - 1
    assert all(fby["fixed"][s]["stepped"] for s in range(1, STEPS + 1))
    assert all(fby["format"][s]["stepped"] for s in range(1, STEPS + 1) if s != NAN_STEP)
    assert not (faulty["dir"] / "adapters" / "format" / f"v{NAN_STEP:08d}").exists() or (
        fby["format"][NAN_STEP + 1]["published_version"] == NAN_STEP
    )
    for version in (NAN_STEP - 1, NAN_STEP, NAN_STEP + 1, STEPS):
        assert rl.adapter_bytes(faulty["dir"], "fixed", version) == rl.adapter_bytes(
            reference["dir"], "fixed", version
        ), f"fixed's adapter v{version} differs from the reference run's"
    assert rl.adapter_bytes(faulty["dir"], "format", NAN_STEP - 1) == rl.adapter_bytes(
        reference["dir"], "format", NAN_STEP - 1
    )

    # -- killed and resumed: the checkpoint's versions, every step once ------------------------
    assert faulty["orphans"] == [], "an engine outlived the killed run"
    killed_at = max(r["step"] for r in faulty["killed_records"] if r["kind"] == "train")
    assert KILL_AFTER <= killed_at < STEPS
    assert [n for n in faulty["checkpoints_at_kill"] if n.startswith("step-")][-1] == (
        "step-00000020"
    )
    resumed = [r for r in faulty["records"] if r.get("event") == "resumed"]
    assert len(resumed) == 1 and resumed[0]["run_id"] == faulty["run_id"]
    assert resumed[0]["from_step"] == 20
    assert resumed[0]["adapter_versions"] == {"fixed": 20, "format": 19}
    assert fby["fixed"][21]["adapter_version"] == 20 and fby["format"][21]["adapter_version"] == 19
    for record in faulty["records"]:
        if record["kind"] == "train":
            assert (record["time"] >= faulty["resumed_at"]) == (record["step"] > 20), record
    assert faulty["records"][-1]["adapter_versions"] == {"fixed": STEPS, "format": STEPS - 1}
