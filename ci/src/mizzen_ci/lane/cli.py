"""``mizzen-ci gpu-lane ARCH``: run a GPU lane on this machine, exactly as CI runs it.

What it runs is decided by :mod:`.selection` (a planned job, given paths, or every ARCH file —
checked against the registry, never trusted from the command line); where, by :mod:`.hardware`
(only on ARCH GPUs); how, by :mod:`.runner` (one pytest process per file, packed onto leased
GPUs); what it reports, by :mod:`.report`.

Invariants:
- It refuses (exit 2, before running anything) on a machine whose GPUs are not of ARCH, with the
  probed GPUs and the fix in the message.  ``--fake-gpus N`` replaces the probe with N pretend
  GPUs of ARCH (of ARCH's vendor: pinned as that vendor's runtime reads it) for testing the
  runner without a GPU; it is printed as such and never the default.
- A file needing more GPUs than the host has is listed as *not runnable here*; under ``CI=true``
  that fails the lane (the planner never sends one there), locally it is reported only.
- Disabled registrations are listed with their reason and not run; a broken registration fails
  the lane.  A lane with nothing to run fails: running nothing is not a pass.
- Every output path (``--report-dir``, ``--history``, ``--flake-record``,
  ``--record-execution``, ``$GITHUB_STEP_SUMMARY``) is checked first
  (:mod:`mizzen_ci.output_files`): one that cannot be written refuses the lane before anything
  is created, run or printed.
- The children's compile caches (:mod:`.compile_cache`) are checked, and created when new, before
  anything runs: an unsafe cache directory refuses the lane.
- Files registered with ``shares_gpu=True`` run up to ``--gpu-seats`` (default
  :data:`mizzen_ci.packing.gpus.DEFAULT_GPU_SEATS`, at most :data:`mizzen_ci.packing.gpus.MAX_GPU_SEATS`) at once on one
  GPU; the others have theirs alone.
- Files quarantined as flaky on ARCH (:mod:`mizzen_ci.flakes.lane`, ``$MIZZEN_FLAKY``): in
  ``skip`` mode they are listed and not run; in ``record`` mode they run, their results are
  recorded, and their failure does not fail the lane.
- ``--record-execution STORE``: each file's pytest runs under coverage with per-test contexts
  (:class:`mizzen_ci.audit.observe.Recording`, the selection audit's own observer); what every
  test executed is stored under HEAD in STORE after the run, failing tests included.
- Exit codes: 0 every file passed, 1 something failed, 2 refused or bad input.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import signal
import sys
from pathlib import Path

from ..flakes.lane import lane_quarantine
from ..fleet import (
    FLEET_RELATIVE_PATH,
    add_root_and_fleet_arguments,
    nox_session_name,
    root_and_fleet,
)
from ..imports import workspace_source_dirs
from ..output import plain, plain_lines
from ..output_files import OutputPathError, check_dir, check_file
from ..packing.gpus import DEFAULT_GPU_SEATS, MAX_GPU_SEATS
from ..registry.rules import MAX_NUM_GPUS
from . import compile_cache
from .hardware import lane_gpus
from .leases import LEASE_DIR_ENV, default_lease_dir
from .progress import Progress
from .refusal import LaneRefusal
from .report import LaneOutcome, write_reports
from .runner import MAX_FILE_TIMEOUT_S, GpuLaneRunner, RunnerConfig
from .selection import select

ARTIFACTS = Path(".ci-artifacts")


# --------------------------------------------------------------------------------------------
# Arguments


def add_arguments(command: str, parser: argparse.ArgumentParser) -> None:
    # Options and paths may come in any order after ARCH (``nox -s gpu-hopper -- --retries 0
    # tests/x.py``); argparse cannot mix them with a subcommand, so they are parsed in :func:`run`.
    lane = lane_parser()
    parser.add_argument("arch", help="the GPU generation of the lane, e.g. hopper")
    parser.add_argument("lane_args", nargs=argparse.REMAINDER, help="see below")
    parser.epilog = lane.format_help()
    parser.formatter_class = argparse.RawDescriptionHelpFormatter


def lane_parser() -> argparse.ArgumentParser:
    """The options and paths of ``mizzen-ci gpu-lane ARCH ...``."""
    from mizzen_ci.cli import OneLineParser

    parser = OneLineParser(prog="mizzen-ci gpu-lane ARCH")  # usage errors: one line
    add_root_and_fleet_arguments(parser)
    parser.add_argument(
        "paths", nargs="*", help="test files or directories to run (default: every ARCH test)"
    )
    parser.add_argument("--plan", type=Path, help="plan JSON written by `mizzen-ci plan`")
    parser.add_argument("--job", help="the id of the job of --plan to run")
    parser.add_argument(
        "--fake-gpus",
        type=int,
        metavar="N",
        help="pretend this host has N GPUs of ARCH (tests the runner without CUDA)",
    )
    parser.add_argument(
        "--lease-dir",
        type=Path,
        help=f"shared directory of per-GPU lock files (default: ${LEASE_DIR_ENV} or "
        f"{default_lease_dir()})",
    )
    parser.add_argument(
        "--lease-timeout",
        type=float,
        default=1800.0,
        metavar="S",
        help="seconds to wait for GPUs leased by another lane before failing the file "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--timeout-factor",
        type=float,
        default=3.0,
        help="per-file timeout = estimate × this (default %(default)s)",
    )
    parser.add_argument(
        "--min-timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="per-file timeout floor in seconds (default %(default)s)",
    )
    parser.add_argument(
        "--gpu-seats",
        type=int,
        default=DEFAULT_GPU_SEATS,
        metavar="N",
        help="files registered with shares_gpu=True run up to N at once on one GPU; 1: every "
        "file has its GPUs to itself (default %(default)s)",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=1,
        help="retries of a file whose failure is classified as infrastructure (default 1)",
    )
    parser.add_argument(
        "--kill-grace",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds between SIGTERM and SIGKILL of a timed-out file (default %(default)s)",
    )
    parser.add_argument(
        "--report-dir",
        type=Path,
        help=f"outputs (default: ROOT/{ARTIFACTS}/{nox_session_name('ARCH')})",
    )
    parser.add_argument(
        "--history",
        type=Path,
        help="duration history to append to (default: "
        f"ROOT/{ARTIFACTS}/history/{nox_session_name('ARCH')}.jsonl)",
    )
    parser.add_argument("--no-history", action="store_true", help="do not record durations")
    parser.add_argument(
        "--collect-only",
        action="store_true",
        help="a dry run: each file is collected (imported) in its own leased process, no test "
        "body runs (with --fake-gpus: the lane's packing, leases and reports on a machine "
        "without GPUs); implies --no-history",
    )
    parser.add_argument(
        "--flake-record",
        type=Path,
        help=f"flake record to append retries to (default: ROOT/{ARTIFACTS}/flakes.jsonl)",
    )
    parser.add_argument(
        "--record-execution",
        type=Path,
        metavar="STORE",
        help="run each file under coverage with per-test contexts and store what every test "
        "executed under HEAD in this execution store (the selection audit's rows for GPU-only "
        "paths; needs mizzen-ci[audit])",
    )
    parser.add_argument(
        "--pytest-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for every pytest process (repeatable)",
    )
    return parser


def run(command: str, args: argparse.Namespace) -> int:
    parser = lane_parser()
    parser.prog = f"mizzen-ci gpu-lane {args.arch}"
    options = parser.parse_intermixed_args(args.lane_args)  # exits 2 with usage on bad input
    options.arch = args.arch
    try:
        return _run(options)
    except LaneRefusal as e:
        print(plain_lines(f"mizzen-ci gpu-lane {args.arch}: {e}"), file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    root, fleet = root_and_fleet(args)
    if args.arch not in fleet.generation_names:
        raise LaneRefusal(
            f"unknown GPU generation {args.arch!r}; {FLEET_RELATIVE_PATH} has "
            f"{', '.join(fleet.generation_names)}"
        )
    seconds = (args.timeout_factor, args.min_timeout, args.lease_timeout, args.kill_grace)
    if not (
        0 <= args.retries <= 10
        and all(math.isfinite(x) and 0 <= x <= MAX_FILE_TIMEOUT_S for x in seconds)
        and args.timeout_factor > 0
    ):
        raise LaneRefusal(
            "--retries must be 0-10; --timeout-factor above 0, --min-timeout, --lease-timeout "
            f"and --kill-grace from 0, all finite and at most {MAX_FILE_TIMEOUT_S:.0f}"
        )
    if args.fake_gpus is not None and not 1 <= args.fake_gpus <= MAX_NUM_GPUS:
        raise LaneRefusal(f"--fake-gpus must be from 1 to {MAX_NUM_GPUS}, got {args.fake_gpus}")
    if not 1 <= args.gpu_seats <= MAX_GPU_SEATS:
        raise LaneRefusal(
            f"--gpu-seats must be from 1 to {MAX_GPU_SEATS} (a sharing file is promised a "
            f"quarter of its GPU), got {args.gpu_seats}"
        )
    arch = args.arch
    name = nox_session_name(arch)
    report_dir, flake_path, history_path = _outputs(root, name, args)
    gpus, hardware_note = lane_gpus(fleet, arch, args.fake_gpus)
    sel = select(root, fleet, arch, len(gpus), args.paths, args.plan, args.job)
    if sel.runnable and importlib.util.find_spec("pytest") is None:
        raise LaneRefusal(
            f"pytest is not importable in {sys.executable}: the lane runs every test file with "
            "this interpreter's pytest. Install pytest there, or run the lane with a Python that "
            "has it (`python3 -m nox -s gpu-…` uses the Python that runs nox)"
        )
    in_ci = os.environ.get("CI", "").lower() == "true"
    cache = compile_cache.configure(os.environ, [g.target for g in gpus])
    flaky = lane_quarantine(root, arch)  # $MIZZEN_FLAKY: skip (PRs) or record (nightly)
    skipped = [
        (f, flaky.listed[f.file])
        for f in sel.runnable
        if flaky.mode == "skip" and f.file in flaky.listed
    ]
    sel.runnable = [f for f in sel.runnable if f.file not in {s.file for s, _ in skipped}]

    report_dir.mkdir(parents=True, exist_ok=True)
    print(f"mizzen {name}: {hardware_note}")
    print(
        f"mizzen {name}: {len(sel.runnable)} file(s) to run"
        + (f", {len(sel.not_runnable)} not runnable here" if sel.not_runnable else "")
        + (f", {len(sel.disabled)} disabled" if sel.disabled else "")
        + (f", {len(sel.broken)} registry error(s)" if sel.broken else "")
        + (f" (job {args.job})" if args.job else "")
        + (
            f", {sharing} of them sharing GPUs, up to {args.gpu_seats} per GPU"
            if (sharing := sum(f.shares_gpu for f in sel.runnable)) and args.gpu_seats > 1
            else ""
        )
        + f"; reports in {report_dir}"
    )
    print(plain(f"mizzen {name}: {cache.describe()}"))
    for message in sel.broken:
        print(plain(f"REGISTRY ERROR {message}"), file=sys.stderr)
    for problem in flaky.problems:
        print(
            plain(f"mizzen {name}: flaky list {flaky.where}: {problem} (nothing quarantined)"),
            file=sys.stderr,
        )
    for f, why in skipped:
        print(
            plain(
                f"mizzen {name}: not run, quarantined as flaky ({flaky.where}): {f.target}: {why}"
            )
        )

    recording = None
    if args.record_execution is not None and sel.runnable and not args.collect_only:
        from ..audit.observe import ObserveError, Recording

        try:
            recording = Recording.start(root, report_dir / "execution")
        except ObserveError as e:
            raise LaneRefusal(str(e)) from None

    config = RunnerConfig(
        root=root,
        arch=arch,
        gpus=gpus,
        report_dir=report_dir,
        lease_dir=(args.lease_dir or default_lease_dir()).resolve(),
        timeout_factor=args.timeout_factor,
        min_timeout_s=args.min_timeout,
        lease_timeout_s=args.lease_timeout,
        retries=args.retries,
        kill_grace_s=args.kill_grace,
        pythonpath=tuple(str(d) for d in workspace_source_dirs(root) if d.is_dir()),
        pytest_args=tuple(args.pytest_arg),
        compile_cache=cache,
        gpu_seats=args.gpu_seats,
        collect_only=args.collect_only,
        recording=recording,
    )
    progress = Progress(total=len(sel.runnable), gpus=len(gpus))
    runner = GpuLaneRunner(config, progress)

    def on_sigterm(signum, frame):  # CI cancelled the job: kill every test group, then leave
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        results = runner.run(sel.runnable) if sel.runnable else []
    finally:
        signal.signal(signal.SIGTERM, previous)
        progress.close()

    outcome = LaneOutcome(
        arch, args.job, results, sel.not_runnable, sel.disabled, sel.broken, in_ci, cache,
        quarantined=flaky.listed if flaky.mode == "record" else {}, quarantine_skipped=skipped,
    )  # fmt: skip
    code = write_reports(outcome, report_dir, flake_path, history_path)
    if recording is not None:
        _store_execution(root, recording, args.record_execution, name)
    return code


def _outputs(root: Path, name: str, args: argparse.Namespace) -> tuple[Path, Path, Path | None]:
    """(report folder, flake record, duration history or None), every output path of the lane
    checked before anything is created, run or printed: LaneRefusal naming the option."""
    report_dir = (args.report_dir or root / ARTIFACTS / name).resolve()
    flake_path = (args.flake_record or root / ARTIFACTS / "flakes.jsonl").resolve()
    history_path = None
    if not (args.no_history or args.collect_only):  # a dry run times nothing real
        history_path = (args.history or root / ARTIFACTS / "history" / f"{name}.jsonl").resolve()
    files = [("--flake-record", flake_path), ("--history", history_path),
             ("--record-execution", args.record_execution),
             ("$GITHUB_STEP_SUMMARY", os.environ.get("GITHUB_STEP_SUMMARY") or None)]  # fmt: skip
    try:
        check_dir("--report-dir", report_dir)
        for option, path in files:
            if path is not None:
                check_file(option, path)
    except OutputPathError as e:
        raise LaneRefusal(str(e)) from None
    return report_dir, flake_path, history_path


def _store_execution(root: Path, recording, store: Path, name: str) -> None:
    """The recorded rows under HEAD in ``store`` (the rows of the tests run here replace their
    earlier ones; every other test's are kept: lanes add up)."""
    from ..bisect.scratch import ScratchError, resolve
    from ..history_execution import ExecutionStoreError, replace_revision

    try:
        revision = resolve(root, "HEAD")
        count = replace_revision(store, revision, recording.rows(revision))
    except (ScratchError, ExecutionStoreError) as e:
        raise LaneRefusal(f"--record-execution: {e}") from None
    print(plain(f"mizzen {name}: {count} execution rows stored under {revision[:12]} in {store}"))
