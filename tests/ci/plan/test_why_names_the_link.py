"""A test's "why" names the file that links it to the change (issue 33): on this repository,
tests/train/sft/test_sft_data.py is planned for a change to ``slot_kit.py`` because its conftest
loads that file, and the why says so; a change to the 2-GPU worker script beside it, which
neither the test nor its conftests load, does not plan it at all."""

from __future__ import annotations

from pathlib import Path

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=10, labels=["ci"])

REPO = Path(__file__).resolve().parents[3]
TEST = "tests/train/sft/test_sft_data.py"


def test_the_why_names_the_conftest_that_loads_the_changed_helper(selected) -> None:
    why = selected(REPO, "tests/train/slots/slot_kit.py")[TEST]
    assert why == "tests/train/conftest.py names tests/train/slots/slot_kit.py, which changed"


def test_a_worker_script_the_test_never_loads_does_not_plan_it(selected) -> None:
    planned = selected(REPO, "tests/train/slots/lora_slots_2gpu_worker.py")
    assert TEST not in planned, planned.get(TEST)
    assert "tests/train/slots/test_lora_slots_2gpu.py" not in planned  # a GPU test: not a CPU job
