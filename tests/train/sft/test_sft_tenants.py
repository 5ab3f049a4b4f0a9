"""Two tenants trained together by ``mizzen-train sft`` (one subprocess): each has its own slot,
data, rows, schedule and learning rate in the metrics and its own slot checkpoint; an off-interval
last step is still evaluated (forced, flagged final); ``mizzen-train plot`` draws the curves; a
resume that changes what was trained is refused naming the field."""

from __future__ import annotations

import json
import subprocess
import sys

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=45, labels=["train", "lora"])


def test_two_tenants_train_together_with_their_own_settings(sft, tmp_path):
    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text(
        "".join(
            json.dumps({"prompt": f"{a}+{b}=", "response": f"#### {a + b}"}) + "\n"
            for a in range(5)
            for b in range(5)
        )
    )
    run_dir = tmp_path / "run"
    sections = sft.colours_sections(run_dir, steps=6, interval=4, checkpoint_interval=3)
    sections["tenants"].append(
        {"name": "numbers", "data": str(numbers), "rows": 8, "lr": 5e-3, "lora_rank": 4,
         "lora_alpha": 8.0, "warmup_steps": 2, "lr_schedule": "cosine", "data_seed": 1}
    )  # fmt: skip
    sections["eval.evaluators"] = [
        {"kind": "loss", "name": "heldout", "data": "example:colours_eval", "limit": 4,
         "tenants": ["colours"]},
        {"kind": "loss", "name": "sums", "data": str(numbers), "limit": 4, "tenants": ["numbers"]},
    ]  # fmt: skip
    config = sft.write_config(tmp_path / "run.toml", sections)
    run = sft.run_to_completion(config, tmp_path / "sft.log", run_dir, first_point=4)
    records = run["records"]
    assert next(r for r in records if r.get("event") == "run_started")["engines_needed"] == "none"
    train = {(r["step"], r["tenant"]): r for r in records if r["kind"] == "train"}
    assert sorted(train) == [(s, t) for s in range(1, 7) for t in ("colours", "numbers")]
    assert [round(train[(s, "numbers")]["lr"], 6) for s in (1, 2)] == [0.0025, 0.005]
    lrs = [train[(s, "numbers")]["lr"] for s in range(3, 7)]
    assert lrs[0] == 5e-3 and lrs == sorted(lrs, reverse=True) and lrs[-1] > 0, "cosine decay"
    assert {train[(s, "colours")]["lr"] for s in range(1, 7)} == {0.01}
    assert all(train[(s, "numbers")]["tokens"] != train[(s, "colours")]["tokens"] for s in (1, 2))
    assert train[(6, "numbers")]["loss"] < train[(1, "numbers")]["loss"]
    assert train[(6, "colours")]["loss"] < train[(1, "colours")]["loss"]
    evals = sorted((r["step"], r["tenant"], r["evaluator"]) for r in records if r["kind"] == "eval")
    assert evals == [
        (4, "colours", "heldout"),
        (4, "numbers", "sums"),
        (6, "colours", "heldout"),
        (6, "numbers", "sums"),
    ]
    points = [(r["step"], r["final"]) for r in records if r["kind"] == "eval_point"]
    assert points == [(4, False), (6, True)], "the last step is evaluated although 6 % 4 != 0"
    checkpoint = run_dir / "checkpoints" / "step-00000006"
    assert sorted(p.name for p in (checkpoint / "slots").iterdir()) == ["colours", "numbers"]
    manifest = json.loads((checkpoint / "slots" / "numbers" / "manifest.json").read_text())
    assert manifest["slot_spec"]["rank"] == 4 and manifest["step"] == 6
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert sorted(state["streams"]) == ["colours", "numbers"]
    snapshot = run_dir / "snapshots" / "step-00000006"
    assert sorted(p.name for p in snapshot.iterdir()) == ["colours", "numbers"]

    command = [sys.executable, "-m", "mizzen_train"]
    plot = subprocess.run(
        [*command, "plot", str(run_dir / "metrics.jsonl"), "-o", str(tmp_path / "c.png")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert plot.returncode == 0, plot.stderr
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    missing = subprocess.run(
        [*command, "plot", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "d.png")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert missing.returncode == 2 and "no such file" in missing.stderr

    changed = subprocess.run(
        [*command, "sft", "--config", str(config), "--resume", "--set", "tenants.1.lora_rank=8"],
        capture_output=True, text=True, timeout=300, env=sft.env(),
    )  # fmt: skip
    assert changed.returncode == 2 and "Traceback" not in changed.stderr
    assert "tenants[1].lora_rank is 8, the run trained with 4" in changed.stderr
    again = subprocess.run(
        [*command, "sft", "--config", str(config)],
        capture_output=True, text=True, timeout=300, env=sft.env(),
    )  # fmt: skip
    assert again.returncode == 2 and "already holds a run" in again.stderr
    assert "--resume" in again.stderr
