"""What the planner says about inputs it does not act on (issue 33): files git ignores are named
in the report and never plan anything (an unknown untracked file still plans everything), and a
pull request label that names a test label or a GPU generation without its ``run-ci-`` or
``run-on-`` prefix is a warning saying which label to add, never silently ignored."""

from __future__ import annotations

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=4, labels=["ci"])

REGISTERED = "from mizzen_ci import register_cpu_ci\n\nregister_cpu_ci(est_time=1, labels=[])\n"
FILES = {
    ".gitignore": "/runs/\n/.ci-artifacts/\n*.log\n",
    "tests/test_a.py": REGISTERED + "\n\ndef test_a():\n    pass\n",
}


def _plan(mizzen_ci, root, *args: str):
    return mizzen_ci("plan", "--root", str(root), "--no-cache", "--same-repo", *args, cwd=root)


def test_ignored_files_are_named_and_plan_nothing(workspace, mizzen_ci):
    ws = workspace(FILES)
    ws.write(
        {"runs/demo/metrics.jsonl": "{}\n", ".ci-artifacts/plan.json": "{}", "x/debug.log": ""}
    )
    out = _plan(mizzen_ci, ws.root)
    assert out.returncode == 0, out.stderr
    assert "no jobs: nothing to run for this change" in out.stdout
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("not planned, ignored by git")]
    assert line.startswith("not planned, ignored by git (.gitignore): 3 path(s): ")
    assert ".ci-artifacts/, runs/, debug.log" in line, line
    ws.write({"plan.json": "{}"})  # untracked and not ignored: an unknown file plans everything
    out = _plan(mizzen_ci, ws.root)
    assert "selection: everything: plan.json changed" in out.stdout, out.stdout


def test_a_label_without_its_prefix_is_a_warning_naming_the_right_one(workspace, mizzen_ci):
    ws = workspace(FILES)
    out = _plan(mizzen_ci, ws.root, "--label", "lora", "--label", "hopper", "--label", "docs")
    assert out.returncode == 0, out.stderr
    text = out.stdout + out.stderr
    assert "label 'lora' asks for nothing" in text and "add that label instead" in text
    assert "as 'run-ci-lora'" in text and "as 'run-on-hopper'" in text
    assert "'docs'" not in text  # a label of no meaning to CI is not CI's business
