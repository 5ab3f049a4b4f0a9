"""``mizzen-ci gpu-lane ARCH``: run a GPU lane on this machine, exactly as CI runs it.

What it runs (checked against the registry, never trusted from the command line):
- no argument: every enabled CUDA test file declaring ARCH;
- ``--plan plan.json --job ID``: the tests of that planned job (the job must be for ARCH);
- ``PATH ...``: the given files (or every enabled ARCH file under a given directory); a file that
  does not declare ARCH, is not a CUDA test or is not registered is an error before anything runs.

Invariants:
- It refuses (exit 2, before running anything) on a machine whose GPUs are not of ARCH, with the
  probed GPUs and the fix in the message.  ``--fake-gpus N`` replaces the probe with N pretend
  GPUs of ARCH for testing the runner without CUDA; it is printed as such and never the default.
- A file needing more GPUs than the host has is listed as *not runnable here*; under ``CI=true``
  that fails the lane (the planner never sends one there), locally it is reported only.
- Disabled registrations are listed with their reason and not run; a broken registration fails
  the lane.  A lane with nothing to run fails: running nothing is not a pass.
- Outputs, under ``--report-dir``: per-file logs and junit XML of every attempt (``files/``), the
  merged ``junit.xml``, ``summary.txt``/``summary.md``/``summary.json``; durations are appended
  to the history store (:mod:`mizzen_ci.history`), retries to the flake record.
- Exit codes: 0 every file passed, 1 something failed, 2 refused or bad input.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

from . import history, junit
from .cli import add_common_arguments, resolve_root_and_fleet
from .device_probe import Gpu, ProbeError, probe
from .fleet import FLEET_RELATIVE_PATH, Fleet
from .gpu_leases import LEASE_DIR_ENV, default_lease_dir
from .gpu_report import (
    FlakeEntry,
    Progress,
    SummaryRow,
    append_flakes,
    flake_counts,
    now_utc,
    summary_tables,
)
from .gpu_runner import FileResult, GpuLaneRunner, LaneFile, RunnerConfig
from .registry import Registration, read_registry

ARTIFACTS = Path(".ci-artifacts")


class LaneRefusal(Exception):
    """The lane must not run here or with this input; the message says why and what to do."""


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
    parser = argparse.ArgumentParser(prog="mizzen-ci gpu-lane ARCH")
    add_common_arguments(parser)
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
        "--report-dir", type=Path, help=f"outputs (default: ROOT/{ARTIFACTS}/gpu-ARCH)"
    )
    parser.add_argument(
        "--history",
        type=Path,
        help=f"duration history to append to (default: ROOT/{ARTIFACTS}/history/gpu-ARCH.jsonl)",
    )
    parser.add_argument("--no-history", action="store_true", help="do not record durations")
    parser.add_argument(
        "--flake-record",
        type=Path,
        help=f"flake record to append retries to (default: ROOT/{ARTIFACTS}/flakes.jsonl)",
    )
    parser.add_argument(
        "--pytest-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for every pytest process (repeatable)",
    )
    return parser


# --------------------------------------------------------------------------------------------
# Hardware


def lane_gpus(fleet: Fleet, arch: str, fake_gpus: int | None) -> tuple[tuple[Gpu, ...], str]:
    """(the GPUs of this host that belong to ``arch``, how they were found); refuses otherwise."""
    wanted = fleet.arch(arch)
    what = (
        f"The {arch} lane runs tests declaring {arch} on {arch} GPUs (compute capability "
        f"{', '.join(wanted.compute_capabilities)}"
        + (f": {', '.join(wanted.gpus)}" if wanted.gpus else "")
        + ")."
    )
    if fake_gpus is not None:
        if fake_gpus < 1:
            raise LaneRefusal(f"--fake-gpus must be at least 1, got {fake_gpus}")
        cc = wanted.compute_capabilities[0]
        gpus = tuple(Gpu(i, cc, f"fake {arch} GPU", f"FAKE-{i}") for i in range(fake_gpus))
        return gpus, f"FAKE: {fake_gpus} pretend {arch} GPU(s) (--fake-gpus), no CUDA"
    try:
        found = probe()
    except ProbeError as e:
        raise LaneRefusal(f"refusing to run: {e}\n{what}") from None
    if not found.gpus:
        raise LaneRefusal(
            f"refusing to run: {found.describe()}.\n{what}\n"
            f"Run `nox -s gpu-{arch}` on such a machine; on a CPU machine run `nox -s cpu`."
        )
    mine = tuple(g for g in found.gpus if fleet.arch_of_capability(g.compute_capability) == arch)
    if not mine:
        others = sorted(
            {fleet.arch_of_capability(g.compute_capability) or "?" for g in found.gpus} - {"?"}
        )
        hint = (
            f" Run {' or '.join(f'`nox -s gpu-{a}`' for a in others)} here instead."
            if others
            else ""
        )
        raise LaneRefusal(
            f"refusing to run: this machine's GPUs are {found.describe()}, "
            f"{'generation ' + ', '.join(others) if others else f'not a generation of {FLEET_RELATIVE_PATH}'}, "
            f"not {arch}.\n{what}{hint}"
        )
    note = f"{found.describe()} via {found.source}"
    if len(mine) < len(found.gpus):
        note += f"; using the {len(mine)} {arch} GPU(s)"
    return mine, note


# --------------------------------------------------------------------------------------------
# Selection


@dataclass
class Selection:
    runnable: list[LaneFile] = field(default_factory=list)
    not_runnable: list[tuple[LaneFile, str]] = field(default_factory=list)
    disabled: list[Registration] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)  # registry errors that fail the lane


def _why_not_in_lane(rel: str, reg: Registration | None, arch: str, errors: list) -> str | None:
    if errors:
        return "; ".join(str(e) for e in errors)
    if reg is None:
        return f"{rel}: not a registered test file (tests/**/test_*.py with a registration)"
    if reg.backend != "cuda":
        return (
            f"{rel}:{reg.line}: registered for the cpu lane, not for gpu-{arch}. Fix: run it "
            "with `nox -s cpu`, or register it with register_cuda_ci(hardware=[...])"
        )
    if arch not in reg.hardware:
        return (
            f"{rel}:{reg.line}: declares hardware={list(reg.hardware)}, not {arch}. Fix: run it "
            f"with {' or '.join(f'`nox -s gpu-{a}`' for a in reg.hardware)}, or add {arch!r} "
            "to its hardware if it supports it"
        )
    return None


def _plan_tests(plan_path: Path, job_id: str, arch: str) -> list[dict]:
    """The tests of job ``job_id`` of the planner's JSON; the job must be for ``arch``."""
    from .planner import PlanError, job, job_tests, load_plan  # only when a plan is given

    try:
        plan = load_plan(plan_path)
        planned = job(plan, job_id)
        tests = job_tests(plan, job_id)
    except PlanError as e:
        raise LaneRefusal(f"{plan_path}: {e}") from None
    if planned.get("arch") != arch:
        raise LaneRefusal(
            f"{plan_path}: job {job_id} is for {planned.get('lane') or planned.get('arch')!r}, "
            f"not gpu-{arch}. Fix: run `nox -s gpu-{planned.get('arch')} -- --job {job_id} "
            f"--plan {plan_path}`"
        )
    return tests


def select(
    root: Path,
    fleet: Fleet,
    arch: str,
    host_gpus: int,
    paths: list[str],
    plan: Path | None,
    job: str | None,
) -> Selection:
    """What the lane runs; :class:`LaneRefusal` for any input that does not match the registry."""
    if arch not in fleet.arch_names:
        raise LaneRefusal(
            f"unknown GPU generation {arch!r}; {FLEET_RELATIVE_PATH} has "
            f"{', '.join(fleet.arch_names)}"
        )
    if (plan is None) != (job is None):
        raise LaneRefusal("--plan and --job go together: `--job ID --plan plan.json`")
    if plan is not None and paths:
        raise LaneRefusal("give either test paths or --job/--plan, not both")
    registry = read_registry(root, fleet)
    by_path = registry.by_path()
    errors = registry.errors_by_path()
    sel = Selection()
    chosen: list[tuple[Registration, str, float]] = []  # (registration, pytest target, estimate)

    if plan is not None:
        tests = _plan_tests(plan, job, arch)
        problems = []
        for t in tests:
            rel = str(t["file"])
            reg = by_path.get(rel)
            why = _why_not_in_lane(rel, reg, arch, errors.get(rel, []))
            if why is None and reg.num_gpus != t.get("num_gpus", reg.num_gpus):
                why = (
                    f"{rel}: the plan says num_gpus={t.get('num_gpus')}, the registration "
                    f"{reg.num_gpus}. Fix: re-plan (`nox -s plan`)"
                )
            if why:
                problems.append(why)
            else:
                est = t.get("est_seconds")
                ok = isinstance(est, int | float) and not isinstance(est, bool) and est > 0
                chosen.append((reg, rel, float(est) if ok else reg.est_time))
        if problems:
            raise LaneRefusal("the plan does not match the registry:\n  " + "\n  ".join(problems))
        if not tests:
            raise LaneRefusal(f"{plan}: job {job} has no tests")
    elif paths:
        problems = []
        for given in paths:
            file_part, sep, node = given.partition("::")
            p = Path(file_part)
            p = (p if p.is_absolute() else Path.cwd() / p).resolve()
            try:
                rel = p.relative_to(root).as_posix()
            except ValueError:
                problems.append(f"{given}: not inside the repository {root}")
                continue
            if p.is_dir():
                prefix = "" if rel == "." else rel + "/"
                under = [
                    r
                    for r in registry.registrations
                    if r.path.startswith(prefix) and r.backend == "cuda" and arch in r.hardware
                ]
                broken = sorted(e for e in errors if e.startswith(prefix))
                sel.broken.extend(str(e) for b in broken for e in errors[b])
                chosen.extend((r, r.path, r.est_time) for r in under)
                if not under and not broken:
                    problems.append(f"{given}: no test under it declares {arch}")
                continue
            if not p.is_file():
                problems.append(f"{given}: no such file")
                continue
            reg = by_path.get(rel)
            why = _why_not_in_lane(rel, reg, arch, errors.get(rel, []))
            if why:
                problems.append(why)
            else:
                chosen.append((reg, rel + sep + node, reg.est_time))
        if problems:
            raise LaneRefusal(
                f"refusing to run files that gpu-{arch} does not run:\n  " + "\n  ".join(problems)
            )
    else:
        sel.broken.extend(str(e) for e in registry.errors)
        chosen = [
            (r, r.path, r.est_time)
            for r in registry.registrations
            if r.backend == "cuda" and arch in r.hardware
        ]

    seen: set[str] = set()
    for reg, target, est in chosen:
        if target in seen:
            continue
        seen.add(target)
        if not reg.enabled:
            sel.disabled.append(reg)
            continue
        lf = LaneFile(reg.path, target, reg.num_gpus, est)
        if reg.num_gpus > host_gpus:
            sel.not_runnable.append(
                (lf, f"needs {reg.num_gpus} GPUs, this host has {host_gpus} {arch} GPU(s)")
            )
        else:
            sel.runnable.append(lf)
    return sel


# --------------------------------------------------------------------------------------------
# Running and reporting


def workspace_pythonpath(root: Path) -> tuple[str, ...]:
    """``ci/src`` and every ``packages/*/src``: the workspace on the path, nothing installed."""
    dirs = [root / "ci" / "src", *sorted((root / "packages").glob("*/src"))]
    return tuple(str(d) for d in dirs if d.is_dir())


def _outcome_text(result: FileResult) -> str:
    final = result.final
    retried = [a for a in result.attempts[:-1] if a.classification is not None]
    if final.outcome == "passed":
        return "passed" + (
            f" on retry ({', '.join(a.classification.name for a in retried)})" if retried else ""
        )
    klass = final.classification.name if final.classification else "?"
    word = "TIMEOUT" if final.outcome == "timeout" else "FAILED"
    after = f" after retry ({retried[0].classification.name})" if retried else ""
    return f"{word}{after} [{klass}]: {final.detail}"


def _history_records(results: list[FileResult], arch: str, job: str | None) -> list[history.Record]:
    records = []
    lane = f"gpu-{arch}"
    for r in results:
        final = r.final
        if final.junit is not None and final.junit.is_file() and final.outcome != "timeout":
            try:
                records.extend(
                    history.records_from_junit(
                        final.junit, arch=arch, lane=lane, job=job, file=r.lane_file.file
                    )
                )
                continue
            except history.HistoryError:
                pass
        records.append(
            history.Record(
                file=r.lane_file.file,
                arch=arch,
                seconds=round(final.seconds, 3),
                outcome="error",
                when=history.now_utc(),
                lane=lane,
                job=job,
            )
        )
    return records


def run(command: str, args: argparse.Namespace) -> int:
    parser = lane_parser()
    parser.prog = f"mizzen-ci gpu-lane {args.arch}"
    options = parser.parse_intermixed_args(args.lane_args)  # exits 2 with usage on bad input
    options.arch = args.arch
    try:
        return _run(options)
    except LaneRefusal as e:
        print(f"mizzen-ci gpu-lane {args.arch}: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    root, fleet = resolve_root_and_fleet(args)
    if args.arch not in fleet.arch_names:
        raise LaneRefusal(
            f"unknown GPU generation {args.arch!r}; {FLEET_RELATIVE_PATH} has "
            f"{', '.join(fleet.arch_names)}"
        )
    if args.retries < 0 or args.timeout_factor <= 0 or args.min_timeout < 0:
        raise LaneRefusal("--retries must be ≥ 0, --timeout-factor > 0, --min-timeout ≥ 0")
    arch = args.arch
    gpus, hardware_note = lane_gpus(fleet, arch, args.fake_gpus)
    sel = select(root, fleet, arch, len(gpus), args.paths, args.plan, args.job)
    if sel.runnable and importlib.util.find_spec("pytest") is None:
        raise LaneRefusal(
            f"pytest is not importable in {sys.executable}: the lane runs every test file with "
            "this interpreter's pytest. Install pytest there, or run the lane with a Python that "
            "has it (`python3 -m nox -s gpu-…` uses the Python that runs nox)"
        )
    in_ci = os.environ.get("CI", "").lower() == "true"

    report_dir = (args.report_dir or root / ARTIFACTS / f"gpu-{arch}").resolve()
    report_dir.mkdir(parents=True, exist_ok=True)
    print(f"mizzen gpu-{arch}: {hardware_note}")
    print(
        f"mizzen gpu-{arch}: {len(sel.runnable)} file(s) to run"
        + (f", {len(sel.not_runnable)} not runnable here" if sel.not_runnable else "")
        + (f", {len(sel.disabled)} disabled" if sel.disabled else "")
        + (f", {len(sel.broken)} registry error(s)" if sel.broken else "")
        + (f" (job {args.job})" if args.job else "")
        + f"; reports in {report_dir}"
    )
    for message in sel.broken:
        print(f"REGISTRY ERROR {message}", file=sys.stderr)

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
        pythonpath=workspace_pythonpath(root),
        pytest_args=tuple(args.pytest_arg),
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

    return _report(args, root, arch, sel, results, report_dir, in_ci)


def _report(args, root, arch, sel: Selection, results: list[FileResult], report_dir, in_ci):
    job = args.job
    flakes = [
        FlakeEntry(
            file=r.lane_file.file,
            arch=arch,
            klass=a.classification.name,
            evidence=a.classification.evidence,
            final=r.final.outcome,
            when=now_utc(),
            job=job,
        )
        for r in results
        for a in r.attempts[:-1]
        if a.classification is not None
    ]
    flake_path = (args.flake_record or root / ARTIFACTS / "flakes.jsonl").resolve()
    append_flakes(flake_path, flakes)
    record_counts = flake_counts(flake_path) if flakes else {}

    rows: list[SummaryRow] = []
    for r in sorted(results, key=lambda r: r.lane_file.target):
        gpus = r.final.gpus
        rows.append(
            SummaryRow(
                r.lane_file.target,
                f"{r.lane_file.num_gpus} ({','.join(str(g.index) for g in gpus) or '-'})",
                r.final.seconds,
                _outcome_text(r),
                r.passed,
            )
        )
    for lf, why in sel.not_runnable:
        rows.append(
            SummaryRow(lf.target, str(lf.num_gpus), None, f"not runnable here: {why}", not in_ci)
        )
    for reg in sel.disabled:
        rows.append(
            SummaryRow(reg.path, str(reg.num_gpus), None, f"disabled: {reg.disabled}", True)
        )
    for message in sel.broken:
        rows.append(SummaryRow(message.split(":", 1)[0], "-", None, "registry error", False))

    reports = [
        junit.FileReport(
            file=r.lane_file.target,
            junit=r.final.junit,
            properties={
                "arch": arch,
                "gpus": ",".join(g.visible_id for g in r.final.gpus),
                "attempts": str(len(r.attempts)),
                **(
                    {"retried_for": r.attempts[0].classification.name}
                    if len(r.attempts) > 1 and r.attempts[0].classification
                    else {}
                ),
            },
            error=None if r.final.outcome == "passed" else _outcome_text(r),
            output_tail=_tail(r.final.log),
            seconds=r.final.seconds,
        )
        for r in results
    ]
    reports += [
        junit.FileReport(
            file=lf.target,
            junit=None,
            properties={"arch": arch},
            error=f"not runnable here: {why}" if in_ci else None,
        )
        for lf, why in sel.not_runnable
        if in_ci
    ]
    junit.write(junit.merge(reports, name=f"mizzen gpu-{arch}"), report_dir / "junit.xml")

    if not args.no_history and results:
        history_path = (
            args.history or root / ARTIFACTS / "history" / f"gpu-{arch}.jsonl"
        ).resolve()
        history.append(history_path, _history_records(results, arch, job))

    table = summary_tables(rows, flakes, record_counts)
    failed = [r for r in rows if not r.ok]
    nothing = not results and not sel.not_runnable and not sel.disabled and not sel.broken
    verdict = (
        f"gpu-{arch}: nothing to run: no enabled test declares {arch}"
        if nothing
        else f"gpu-{arch}: {sum(r.passed for r in results)} passed, {len(failed)} not passing "
        f"of {len(rows)} file(s)"
    )
    if sel.not_runnable and not in_ci:
        verdict += (
            f"; {len(sel.not_runnable)} not runnable on this host (reported only; under CI=true "
            "this fails the lane)"
        )
    print(f"\n{table}\n\n{verdict}\nmerged junit: {report_dir / 'junit.xml'}")
    (report_dir / "summary.txt").write_text(f"{table}\n\n{verdict}\n")
    markdown = f"### gpu-{arch}\n\n{summary_tables(rows, flakes, record_counts, markdown=True)}\n\n{verdict}\n"
    (report_dir / "summary.md").write_text(markdown)
    if os.environ.get("GITHUB_STEP_SUMMARY"):
        with open(os.environ["GITHUB_STEP_SUMMARY"], "a", encoding="utf-8") as f:
            f.write(markdown)
    (report_dir / "summary.json").write_text(
        json.dumps(
            {
                "arch": arch,
                "job": job,
                "files": [
                    {
                        "file": r.lane_file.target,
                        "num_gpus": r.lane_file.num_gpus,
                        "outcome": r.final.outcome,
                        "summary": _outcome_text(r),
                        "attempts": [
                            {
                                "gpus": [g.visible_id for g in a.gpus],
                                "seconds": round(a.seconds, 3),
                                "outcome": a.outcome,
                                "class": a.classification.name if a.classification else None,
                                "log": str(a.log) if a.log else None,
                            }
                            for a in r.attempts
                        ],
                    }
                    for r in results
                ],
                "not_runnable": [{"file": lf.target, "why": why} for lf, why in sel.not_runnable],
                "disabled": [{"file": reg.path, "why": reg.disabled} for reg in sel.disabled],
                "registry_errors": sel.broken,
                "flakes": [json.loads(f.to_json()) for f in flakes],
            },
            indent=2,
        )
    )
    return 1 if failed or nothing else 0


def _tail(log: Path | None, lines: int = 60) -> str:
    if log is None or not log.is_file():
        return ""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
