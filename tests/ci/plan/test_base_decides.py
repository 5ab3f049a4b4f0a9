"""The base decides what must run (``mizzen_ci.plan.base_runs``): a pull request's registrations
may add runs, never remove one the base revision's registry and selection would make for the same
change.  The probe's case on a real git repository, and a property: random head edits to the
registrations (disabled, nightly, labels, hardware, num_gpus, est_time, deletion, renames) never
remove a (test, target) pair of the plan whose head keeps the base's registrations."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mizzen_ci import register_cpu_ci
from mizzen_ci.plan.request import Comment

register_cpu_ci(est_time=60, labels=["ci"])

FLEET = """
labels = ["ci", "lora", "train"]

[[arch]]
name = "hopper"
vendor = "nvidia"
compute_capabilities = ["9.0"]

[[arch]]
name = "blackwell"
vendor = "nvidia"
compute_capabilities = ["10.0"]

[cpu_pool]
name = "cpu-hosted"
runs_on = ["ubuntu-24.04"]
runners = 2
job_setup_s = 60

[[pool]]
name = "h200-2gpu"
arch = "hopper"
gpu = "H200"
gpus_per_runner = 2
runners = 1
runs_on = ["self-hosted", "h200"]
runner_group = "mizzen-h200"
job_setup_s = 300

[[pool]]
name = "b200-2gpu"
arch = "blackwell"
gpu = "B200"
gpus_per_runner = 2
runners = 1
runs_on = ["self-hosted", "b200"]
runner_group = "mizzen-b200"
job_setup_s = 300
"""
WORKSPACE = {
    "ci/fleet.toml": FLEET,
    "pyproject.toml": (
        '[project]\nname = "ws"\nversion = "0"\n\n'
        '[tool.uv.workspace]\nmembers = ["packages/rollout"]\n'
    ),
    "packages/rollout/pyproject.toml": '[project]\nname = "mizzen-rollout"\nversion = "0"\n',
    "packages/rollout/src/mizzen_rollout/__init__.py": "",
    "packages/rollout/src/mizzen_rollout/rewards.py": "def reward(x):\n    return x\n",
    "packages/rollout/src/mizzen_rollout/other.py": "def other():\n    return 1\n",
}
#: The base's registrations: {test file: (imported module, register function, arguments)}.
BASE = {
    "tests/rollout/test_rewards.py": ("rewards", "cpu", {"est_time": 30, "labels": ["ci"]}),
    "tests/rollout/test_other.py": ("other", "cpu", {"est_time": 20}),
    "tests/rollout/test_rewards_gpu.py": (
        "rewards", "cuda",
        {"est_time": 60, "hardware": ["hopper", "blackwell"], "num_gpus": 1, "labels": ["lora"]},
    ),
    "tests/rollout/test_train_gpu.py": (
        "other", "cuda",
        {"est_time": 90, "hardware": ["hopper"], "num_gpus": 2, "labels": ["train"]},
    ),
}  # fmt: skip


def source(module: str, backend: str, args: dict, note: str = "") -> str:
    call = ", ".join(f"{k}={v!r}" for k, v in args.items())
    return (
        f"from mizzen_ci import register_{backend}_ci\n"
        f"from mizzen_rollout import {module}\n\n"
        f"register_{backend}_ci({call})\n{note}"
    )


def base_files() -> dict[str, str]:
    return {**WORKSPACE, **{path: source(*spec) for path, spec in BASE.items()}}


def pairs(p: dict) -> set[tuple[str, str | None]]:
    return {(t["file"], j["arch"]) for j in p["jobs"] for t in j["tests"]}


# -- the probe: a pull request that breaks test_rewards.py and excuses it --------------------------


@pytest.mark.parametrize(
    "excuse, shown",
    [
        ({"nightly": True}, "nightly=True"),
        ({"disabled": "flaky, see #1"}, "disabled='flaky, see #1'"),
    ],
)
def test_a_test_the_change_breaks_runs_whatever_the_head_declares(workspace, excuse, shown):
    ws = workspace(base_files())
    module, backend, args = BASE["tests/rollout/test_rewards.py"]
    ws.write(
        {
            "packages/rollout/src/mizzen_rollout/rewards.py": "def reward(x):\n    return -x\n",
            "tests/rollout/test_rewards.py": source(module, backend, {**args, **excuse}),
        }
    )
    ws.commit("break rewards, excuse its test")
    p = ws.plan()
    assert ("tests/rollout/test_rewards.py", None) in pairs(p)
    (override,) = [o for o in p["overrides"] if o["file"] == "tests/rollout/test_rewards.py"]
    assert override["reason"] == f"runs as the base declares it: the head set {shown}"
    why = {t["file"]: t["why"] for j in p["jobs"] for t in j["tests"]}
    assert why["tests/rollout/test_rewards.py"].startswith("runs as the base declares it")
    assert not p["errors"]
    from mizzen_ci.plan import report
    from mizzen_ci.plan.model import Plan

    shown_plan = Plan.from_json(p)
    assert f"override: tests/rollout/test_rewards.py (cpu) runs as the base declares it: the head set {shown}" in report.terminal(shown_plan)  # fmt: skip
    markdown = report.markdown(shown_plan)
    assert "Runs the base revision keeps" in markdown and "runs as the base declares it" in markdown
    assert Plan.from_json(shown_plan.to_json()) == shown_plan


def test_the_head_can_add_runs_and_a_rerun_or_a_push_is_not_overridden(workspace):
    ws = workspace(base_files())
    module, backend, args = BASE["tests/rollout/test_other.py"]
    ws.write({"tests/rollout/test_other.py": source(module, backend, {**args, "nightly": True})})
    ws.commit()
    assert ("tests/rollout/test_other.py", None) in pairs(ws.plan())
    rerun = ws.plan(comments=(Comment("MEMBER", "/rerun-test tests/rollout/test_rewards.py"),))
    assert pairs(rerun) == {("tests/rollout/test_rewards.py", None)} and "overrides" not in rerun
    # a GPU test the head moves to blackwell only still runs on its base's home arch
    module, backend, args = BASE["tests/rollout/test_rewards_gpu.py"]
    ws.write({
        "tests/rollout/test_rewards_gpu.py": source(module, backend, {**args, "hardware": ["blackwell"]}),
    })  # fmt: skip
    ws.commit()
    p = ws.plan()
    assert {("tests/rollout/test_rewards_gpu.py", "hopper"), ("tests/rollout/test_rewards_gpu.py", "blackwell")} <= pairs(p)  # fmt: skip


# -- the property: random head edits never remove a pair of the base's plan ----------------------

EDITS = ["none", "disabled", "nightly", "labels", "hardware", "num_gpus", "est_time",
         "delete", "rename", "rename-away"]  # fmt: skip


def edited(path: str, edit: str) -> dict:
    """The head's registration arguments of ``path`` under ``edit``."""
    _, backend, args = BASE[path]
    args = dict(args)
    if edit == "disabled":
        args["disabled"] = "excused"
    elif edit == "nightly":
        args["nightly"] = True
    elif edit == "labels":
        args["labels"] = ["train"] if backend == "cuda" else []
    elif edit == "hardware" and backend == "cuda":
        args["hardware"] = ["blackwell"]
    elif edit == "num_gpus" and backend == "cuda":
        args["num_gpus"] = 3 - args["num_gpus"]
    elif edit == "est_time":
        args["est_time"] = 7
    return args


def apply(ws, edits: dict[str, str], code_change: bool, keep_base: bool) -> None:
    """The change on a fresh branch off main: ``edits`` to the registrations (``keep_base``:
    the same files touched and moved, with the base's registrations), and a code change."""
    ws.git("checkout", "-q", "-f", "-B", "change", "main")
    ws.git("clean", "-qfdx")
    for folder in ("tests/moved", "scripts"):
        (ws.root / folder).mkdir(exist_ok=True)
    if code_change:
        ws.write(
            {"packages/rollout/src/mizzen_rollout/rewards.py": "def reward(x):\n    return 0\n"}
        )
    for path, edit in edits.items():
        if edit == "none":
            continue
        module, backend, base_args = BASE[path]
        args = edited(path, edit)
        text = source(module, backend, base_args if keep_base else args, "# touched\n")
        name = path.rpartition("/")[2]
        if edit == "delete":
            if keep_base:
                ws.write({path: text})
            else:
                ws.git("rm", "-q", path)
        elif edit == "rename":
            ws.git("mv", path, f"tests/moved/{name}")
            ws.write({f"tests/moved/{name}": text})
        elif edit == "rename-away":
            if keep_base:
                ws.write({path: text, f"scripts/{name}": text})
            else:
                ws.git("mv", path, f"scripts/{name}")
        else:
            ws.write({path: text})
    ws.commit()


@pytest.fixture(scope="module")
def base_repo(module_workspace):
    return module_workspace(base_files())


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    edits=st.fixed_dictionaries({path: st.sampled_from(EDITS) for path in BASE}),
    code_change=st.booleans(),
    labels=st.sampled_from([(), ("run-ci-lora",), ("run-ci-all",)]),
)
def test_head_edits_never_remove_a_pair_the_base_plan_had(base_repo, edits, code_change, labels):
    apply(base_repo, edits, code_change, keep_base=True)
    reference = base_repo.plan(labels=labels)
    apply(base_repo, edits, code_change, keep_base=False)
    actual = base_repo.plan(labels=labels)
    moved = {
        path: f"tests/moved/{path.rpartition('/')[2]}"
        for path, edit in edits.items()
        if edit == "rename"
    }
    kept = {(moved.get(f, f), a) for f, a in pairs(reference)}
    assert kept <= pairs(actual), (edits, sorted(kept - pairs(actual)))
    gone = {f for f, e in edits.items() if e in ("delete", "rename-away")}
    if any(f in gone for f, _ in pairs(reference)):
        assert actual["errors"], "a removed test the base runs fails the plan"
    else:  # nothing removed: no error (a rename is matched to the file's new path)
        assert not actual["errors"], actual["errors"]
