"""A job budget no longer than a pool's job set-up is bad input, not a crash: ``mizzen-ci plan
--budget-minutes`` below the slowest set-up of ``fleet.toml`` is exit 2 naming the pool and the
smallest budget that works (the packing would raise on it)."""

from __future__ import annotations

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=10, labels=["ci"])


def test_a_budget_shorter_than_a_set_up_is_refused_in_one_line(workspace, mizzen_ci):
    test = "from mizzen_ci import register_cpu_ci\nregister_cpu_ci(est_time=5)\n"
    ws = workspace({"pyproject.toml": '[project]\nname = "t"\nversion = "0"\n',
                    "tests/t/test_cpu.py": test})  # fmt: skip
    ws.write({"tests/t/test_cpu.py": test + "# changed\n"})
    ws.commit()
    done = mizzen_ci("plan", "--root", str(ws.root), "--event", "push", "--base", "main",
                     "--head", "HEAD", "--no-cache", "--budget-minutes", "2",
                     "--min-job-minutes", "0", cwd=ws.root, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and done.stdout == "", done.stderr
    assert "--budget-minutes 2 leaves no time for tests: a job of pool h200-2gpu" in done.stderr
    assert "Fix: give a budget above 5 minutes" in done.stderr
