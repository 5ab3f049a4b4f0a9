"""mizzen's lanes: each session is exactly what CI runs for it, runnable on any machine.

Sessions stay thin: they install (from ``uv.lock``, never resolving anew) and call ``mizzen-ci`` or
pytest; the logic lives in ``mizzen_ci``.  Facts come from their one table: workspace members from
the root ``pyproject.toml``, GPU generations from ``ci/fleet.toml``.

    nox -s plan                                        the main job: the CI plan for your change
    nox -s validate lint lazy-imports cpu packages     what CI runs (see README)
    nox -s gpu-hopper                                  a GPU lane, on a machine of that generation
"""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).parent
CI_SRC = ROOT / "ci" / "src"
sys.path.insert(0, str(CI_SRC))  # mizzen_ci is stdlib-only: the lanes' names and plans come from it

from mizzen_ci.fleet import CPU_LANE, load_fleet, nox_session_name  # noqa: E402
from mizzen_ci.plan import Plan, PlanError  # noqa: E402

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["validate", "lint", "lazy-imports", "cpu", "packages"]
nox.options.error_on_missing_interpreters = True

# Environment every test process of a CPU lane gets: no GPU, no Ray dashboards or auth prompts.
CPU_TEST_ENV = {
    "CUDA_VISIBLE_DEVICES": "",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "MIZZEN_LANE": "cpu",
}
CPU_TEST_TIMEOUT_S = (
    "900"  # per test (pytest-timeout): a hang fails loudly instead of eating the job
)


def _workspace_members() -> dict[str, Path]:
    """{distribution name: directory} of the uv workspace members, from the root pyproject."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        members = tomllib.load(f)["tool"]["uv"]["workspace"]["members"]
    out = {}
    for rel in members:
        with (ROOT / rel / "pyproject.toml").open("rb") as f:
            out[tomllib.load(f)["project"]["name"]] = ROOT / rel
    return out


def _bare_mizzen_ci(session: nox.Session, *args: str) -> None:
    """Run ``python -S -m mizzen_ci ARGS`` with only ``ci/src`` on the path: a bare runner."""
    session.run(
        sys.executable,
        "-S",
        "-m",
        "mizzen_ci",
        *args,
        env={"PYTHONPATH": str(CI_SRC)},
        external=True,
    )


def _sync_workspace(session: nox.Session, *extra: str) -> None:
    """Install the locked workspace (all members, their CPU extras, the dev group) into the venv,
    its bytecode compiled: every test process (xdist workers, ``python -m mizzen_train`` runs,
    torchrun ranks) then loads torch, megatron-core and transformers from ``.pyc``.  Without it a
    machine with ``PYTHONDONTWRITEBYTECODE`` set (this project's CI image) compiled them from source
    in every process: ~7 of the 12 s that importing megatron-core took on 2 cores."""
    session.run_install(
        "uv",
        "sync",
        "--frozen",
        "--inexact",
        "--compile-bytecode",
        *extra,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location, "UV_PYTHON_DOWNLOADS": "never"},
        external=True,
    )


@nox.session(venv_backend="none")
def validate(session: nox.Session) -> None:
    """Check every test file's registration (stdlib only, `python -S`)."""
    _bare_mizzen_ci(session, "validate")


@nox.session(venv_backend="none")
def registry(session: nox.Session) -> None:
    """The registry table: every test, its lane, arches, GPUs, labels and derived pool."""
    _bare_mizzen_ci(session, "list", *session.posargs)


@nox.session(venv_backend="none")
def plan(session: nox.Session) -> None:
    """The CI plan for the working tree's change against its merge-base with main, as a pull
    request from this repository: the jobs, their runners and tests, and why every other test is
    not run.  Posargs go to `mizzen-ci plan` (e.g. `-- --verbose`, `--label run-ci-lora`,
    `--event schedule --cadence weekly`, `--fork --author-association NONE`)."""
    origin = [] if {"--fork", "--same-repo"} & set(session.posargs) else ["--same-repo"]
    _bare_mizzen_ci(session, "plan", *origin, *session.posargs)


@nox.session(name="lazy-imports")
def lazy_imports(session: nox.Session) -> None:
    """The lazy-import policy: statically with bare `python -S` (nothing installed), then at run
    time in the synced workspace (each package's modules imported with forbidden modules blocked).
    Posargs go to both, e.g. `-- --package mizzen_rollout`."""
    _bare_mizzen_ci(session, "lazy-imports", "--static", *session.posargs)
    _sync_workspace(session)
    session.run(
        "python", "-m", "mizzen_ci", "lazy-imports", "--runtime", *session.posargs, env=CPU_TEST_ENV
    )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the repository; actionlint and zizmor (offline, any
    finding fails) over the GitHub workflows."""
    _sync_workspace(session, "--only-group", "lint")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    workflows = sorted(str(p) for p in (ROOT / ".github" / "workflows").glob("*.y*ml"))
    session.run("actionlint", *workflows)
    session.run("zizmor", "--offline", *workflows)


@nox.session
def cpu(session: nox.Session) -> None:
    """Every enabled CPU-registered test, in parallel; no tests collected (exit 5) is a failure."""
    _sync_workspace(session)
    session.run(
        "pytest",
        "--mizzen-lane",
        "cpu",
        "-n",
        os.environ.get("MIZZEN_XDIST", "auto"),
        "--dist",
        "loadfile",
        "--no-loadscope-reorder",  # files in the plugin's order: heaviest est_time first
        "--timeout",
        CPU_TEST_TIMEOUT_S,
        "--durations=30",  # the slowest tests in every log: what to trim when the lane grows
        *_planned_job_args(session),
        env=CPU_TEST_ENV,
    )


def _planned_job_args(session: nox.Session) -> list[str]:
    """Posargs, with ``--job ID --plan plan.json`` replaced by the files of that planned job."""
    args = list(session.posargs)
    if "--job" not in args and "--plan" not in args:
        return args or ["tests"]
    values = {}
    for flag in ("--job", "--plan"):
        at = args.index(flag) if flag in args else -1
        if at < 0 or at + 1 >= len(args):
            session.error("--job and --plan go together: `nox -s cpu -- --job ID --plan plan.json`")
        values[flag] = args[at + 1]
        del args[at : at + 2]
    try:
        plan = Plan.load(values["--plan"])
        job = plan.job(values["--job"])
    except PlanError as e:
        session.error(str(e))
    if job.lane != CPU_LANE:
        session.error(f"job {job.id} is for {job.lane}; run it with `nox -s {job.lane}`")
    # files the plan runs as the base declares them: the head's disabled= does not stop them
    overridden = {o.file for o in plan.overrides if o.arch in (None, CPU_LANE)}
    as_planned = [a for f in job.files if f in overridden for a in ("--mizzen-as-planned", f)]
    return job.files + as_planned + args


@nox.session
def audit(session: nox.Session) -> None:
    """The selection audit: every CPU test (posargs: paths or `mizzen-ci audit` options) under
    coverage with per-test contexts, stored under HEAD in the execution store, then recall and
    precision of the planner's selection and every miss (`mizzen-ci audit`)."""
    _sync_workspace(session)
    args = list(session.posargs)
    if not any(a.startswith("--workers") for a in args):
        args = ["--workers", os.environ.get("MIZZEN_XDIST", "auto"), *args]
    session.run("python", "-m", "mizzen_ci", "audit", *args, env=CPU_TEST_ENV)


@nox.session
def bisect(session: nox.Session) -> None:
    """The first commit at which a planned job fails, in a scratch clone (your tree and branch
    are untouched): `nox -s bisect -- --job ID --plan plan.json --good REV --bad REV
    [--test FILE::NAME]`."""
    _sync_workspace(session)
    session.run("python", "-m", "mizzen_ci", "bisect", *session.posargs, env=CPU_TEST_ENV)


@nox.session
def packages(session: nox.Session) -> None:
    """Build each member's wheel, install it alone into a fresh venv (its declared dependencies only,
    at the locked versions) and import every module of it.  Posargs pick members (default: all)."""
    members = _workspace_members()
    chosen = session.posargs or list(members)
    unknown = sorted(set(chosen) - set(members))
    if unknown:
        session.error(f"unknown workspace member(s) {unknown}; choose from {sorted(members)}")
    tmp = Path(session.create_tmp())
    wheels = tmp / "wheels"
    session.run(
        "uv",
        "build",
        "--all-packages",
        "--wheel",
        "--out-dir",
        str(wheels),
        external=True,
        silent=True,
    )
    constraints = tmp / "locked.txt"
    session.run(
        "uv", "export", "--frozen", "--all-packages", "--all-extras", "--no-hashes",
        "--no-emit-workspace", "--no-header", "--output-file", str(constraints),
        external=True, silent=True,
    )  # fmt: skip
    with constraints.open("a") as f:  # members come from the wheels just built, never from an index
        for wheel in sorted(wheels.glob("*.whl")):
            f.write(f"{wheel.name.split('-')[0].replace('_', '-')} @ {wheel.resolve().as_uri()}\n")
    walker = CI_SRC / "mizzen_ci" / "lazy_imports" / "walk.py"
    for name in chosen:
        venv = tmp / f"venv-{name}"
        session.run(
            "uv", "venv", "--quiet", "--clear", "--python", sys.executable, str(venv), external=True
        )
        python = str(venv / "bin" / "python")
        session.run(
            "uv", "pip", "install", "--quiet", "--python", python,
            "--constraints", str(constraints), name,
            env={"UV_PYTHON_DOWNLOADS": "never"}, external=True,
        )  # fmt: skip
        import_name = name.replace("-", "_")
        session.run(python, "-P", str(walker), import_name, external=True, env=CPU_TEST_ENV)


# GPU lanes, generated: one session per generation of ci/fleet.toml (gpu-hopper, gpu-blackwell, …).
# They run in the machine's own Python (the GPU image has torch and pytest but reaches no package
# registry): nothing is installed, the workspace's src dirs go on PYTHONPATH.
def _lane_python(posargs: list[str]) -> str:
    """The interpreter of a GPU lane: this one (a GPU image's own Python), except for a pretend
    lane (--fake-gpus) on a machine whose nox Python lacks pytest (a CPU machine where nox was
    pip-installed into the system Python): the workspace's environment, `uv sync`'s .venv or
    the one `nox -s cpu` made, which has the workspace's test dependencies."""
    import importlib.util

    fake = any(a == "--fake-gpus" or a.startswith("--fake-gpus=") for a in posargs)
    if not fake or importlib.util.find_spec("pytest") is not None:
        return sys.executable
    for venv in (ROOT / ".venv", ROOT / ".nox" / "cpu"):
        if (venv / "bin" / "python").is_file():
            return str(venv / "bin" / "python")
    raise SystemExit(
        f"nox -s gpu-…: --fake-gpus runs test files, and {sys.executable} has no pytest; "
        "fix: `uv sync --frozen --all-packages --all-extras` (the workspace's .venv), then run "
        "the same command again"
    )


def _gpu_lane_session(arch: str) -> None:
    def gpu_lane(session: nox.Session) -> None:
        src = [str(d / "src") for d in _workspace_members().values()]
        outer = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        session.run(
            _lane_python(session.posargs), "-m", "mizzen_ci", "gpu-lane", arch, *session.posargs,
            env={"PYTHONPATH": os.pathsep.join(dict.fromkeys([*src, *outer]))}, external=True,
        )  # fmt: skip

    gpu_lane.__doc__ = (
        f"Every enabled {arch} test on this machine's {arch} GPUs, leased and packed (refuses "
        "other GPUs).  Posargs: --job ID --plan plan.json | tests/..."
    )
    nox.session(name=nox_session_name(arch), venv_backend="none")(gpu_lane)


for _arch in load_fleet(ROOT / "ci" / "fleet.toml").generation_names:
    _gpu_lane_session(_arch)
