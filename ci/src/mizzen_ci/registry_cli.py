"""The registry's commands: ``mizzen-ci validate`` and ``mizzen-ci list``.

A root module, not part of :mod:`mizzen_ci.registry`: ``validate`` also checks the metric gates
(:mod:`mizzen_ci.gate`) and ``list`` derives pools through the planner's dispatch rules
(:mod:`mizzen_ci.plan.dispatch`); both depend on the registry, so the registry folder imports
neither.

Invariants:
- ``validate`` checks the metric gates' declarations and ``ci/quarantine.toml`` too
  (:mod:`mizzen_ci.gate.validation`); it prints every violation of the run (``file:line: [rule] message. Fix: …``), also as
  GitHub ``::error`` annotations under Actions, and exits 1 when there is any.
- What it prints for people goes through :func:`mizzen_ci.output.plain` (the table renderer
  escapes every cell); ``--json`` is JSON (``json.dumps`` escapes every control character).
- ``list`` derives each test's pool from the fleet (never from the test file) and shows the
  disabled reason; ``--lane`` keeps what that lane runs (:func:`~mizzen_ci.registry.declares_target`).
"""

from __future__ import annotations

import argparse
import json
import sys

from . import output
from .fleet import CPU_LANE, Fleet, add_root_and_fleet_arguments, root_and_fleet
from .plan.dispatch import home_generation
from .registry.model import Backend, Registration, Registry, declares_target
from .registry.reader import read_registry


def add_arguments(command: str, parser: argparse.ArgumentParser) -> None:
    add_root_and_fleet_arguments(parser)
    if command == "list":
        parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
        parser.add_argument("--lane", help="only what this lane runs: cpu or a GPU generation")


def run(command: str, args: argparse.Namespace) -> int:
    root, fleet = root_and_fleet(args)
    registry = read_registry(root, fleet)
    if command == "validate":
        from .gate.validation import gate_violations  # the metric gates' declarations too

        registered = (r.path for r in registry.registrations)
        registry.violations.extend(gate_violations(root, fleet, registered))
        return _validate(registry)
    return _list(registry, fleet, args)


def _validate(registry: Registry) -> int:
    for v in registry.violations:
        print(output.plain(v), file=sys.stderr)
        output.emit(
            "error",
            f"[{v.rule}] {v.message}. Fix: {v.fix}",
            file=v.path,
            line=v.line,
            title="mizzen registry",
        )
    n_files = len(registry.registrations) + len({v.path for v in registry.violations})
    if registry.violations:
        print(
            f"registry: {len(registry.violations)} error(s) in {n_files} test file(s)",
            file=sys.stderr,
        )
        return 1
    print(f"registry: {len(registry.registrations)} test file(s) registered, no errors")
    return 0


def lane_row(reg: Registration, fleet: Fleet, lane: str | None) -> dict:
    """One ``list`` row: the registration plus the pool derived for ``lane`` (default: home)."""
    if reg.backend is Backend.CPU:
        arch, pool = None, fleet.cpu_pool.name
    else:
        arch = lane if lane and lane != CPU_LANE else home_generation(reg, fleet)
        found = fleet.pool_for(arch, reg.num_gpus, set(reg.needs)) if arch else None
        pool = found.name if found else "-"
    return {
        "file": reg.path,
        "line": reg.line,
        "backend": reg.backend.value,
        "arches": list(reg.hardware),
        "arch": arch,
        "num_gpus": reg.num_gpus,
        "labels": list(reg.labels),
        "needs": list(reg.needs),
        "pool": pool,
        "est_time": reg.est_time,
        "nightly": reg.nightly,
        "disabled": reg.disabled,
        "shares_gpu": reg.shares_gpu,
    }


def _list(registry: Registry, fleet: Fleet, args: argparse.Namespace) -> int:
    if args.lane and args.lane != CPU_LANE and args.lane not in fleet.generation_names:
        print(
            output.plain(
                f"mizzen-ci list: unknown lane {args.lane!r}; use cpu or one of "
                f"{', '.join(fleet.generation_names)}"
            ),
            file=sys.stderr,
        )
        return 2
    rows = [
        lane_row(r, fleet, args.lane)
        for r in registry.registrations
        if args.lane is None or declares_target(r, args.lane)
    ]
    if args.json:
        print(
            json.dumps({"tests": rows, "errors": [str(v) for v in registry.violations]}, indent=2)
        )
    else:
        table = [
            (
                r["file"],
                r["backend"],
                ",".join(r["arches"]) or "-",
                r["num_gpus"] or "-",
                ",".join(r["labels"]) or "-",
                r["pool"],
                f"{r['est_time']:g}",
                ("nightly " if r["nightly"] else "")
                + ("shares GPU " if r["shares_gpu"] else "")
                + (f"disabled: {r['disabled']}" if r["disabled"] else ""),
            )
            for r in rows
        ]
        print(
            output.text_table(
                ("file", "backend", "arches", "gpus", "labels", "pool", "est_s", "notes"), table
            )
        )
        print(f"\n{len(rows)} test file(s)" + (f" in lane {args.lane}" if args.lane else ""))
    if registry.violations:
        print(
            f"{len(registry.violations)} registry error(s): run `mizzen-ci validate`",
            file=sys.stderr,
        )
        return 1
    return 0
