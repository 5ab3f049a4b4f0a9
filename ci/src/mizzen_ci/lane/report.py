"""What a GPU lane tells people and leaves behind: the summary, the merged junit, the durations
and the flake record (live progress is :mod:`.progress`).

Invariants:
- The summary lists every file the lane considered, once: run (passed / failed / timeout, with
  GPUs and seconds), not runnable here, disabled, or broken in the registry.
- Its one table is :data:`COLUMNS` (the text and Markdown renderings and the totals line are
  derived from the same rows).  A file's GPU-seconds are the wall time × GPUs held of every one of
  its attempts (retries cost GPU time too), a GPU's time split evenly between the files sharing it
  at each instant, so the lane's total is the time its GPUs were held; its share is of that
  total, and the files run are listed by share, largest first.  Its compile-cache hits/misses are its final attempt's, as
  its child counted them (``-``: it never imported torch), with the functions it recompiled
  (how often, why: :class:`.compile_cache.Recompile`); the summary names the compile cache
  (or why there is none) and every counts file that was not believed (a warning, not a failure).
- Every retried attempt goes to the flake record (:mod:`mizzen_ci.history`, keyed by (test file,
  arch)); the summary shows this run's retries with how often each key appears in the record.
- Outputs, under the report directory: the merged ``junit.xml``, ``summary.txt``/``summary.md``/
  ``summary.json`` (and ``$GITHUB_STEP_SUMMARY`` when set); durations go to the history store.
  A file that ran nothing or was not runnable in CI is an error in the junit, never missing.
- Every path, reason and message in the summaries goes through the medium's one escaping function
  (:mod:`mizzen_ci.output`; the table renderers escape every cell): a test's output, a skip
  reason or a file name cannot break a table, inject Markdown or print a workflow command.  At
  most :data:`TAIL_BYTES` of a test's log are read (for its junit error case).  Every file
  written here is masked (:func:`mizzen_ci.masking.write_text`; junit text through
  :func:`mizzen_ci.output.xml_text`): a registered secret a test printed never reaches it.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .. import history, junit, masking
from ..fleet import nox_session_name
from ..output import markdown as markdown_text
from ..output import markdown_table, plain, text_table
from ..packing.gpus import split_held_time
from ..sources import read_tail
from .compile_cache import CACHES, OUTCOMES, CompileCache, CompileStats
from .runner import FileResult, LaneFile


@dataclass(frozen=True)
class SummaryRow:
    file: str
    gpus: str
    seconds: float | None
    outcome: str
    ok: bool
    gpu_seconds: float | None = None  # None: not run
    share: float | None = None  # of the lane's GPU-seconds, 0..1
    compile_stats: CompileStats | None = None  # None: no counts (torch never imported)
    shared: bool = False  # its final attempt shared its GPU with other files


def _number(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


COLUMNS: tuple[tuple[str, Callable[[SummaryRow], object]], ...] = (
    ("file", lambda r: r.file),
    ("GPUs", lambda r: r.gpus),
    ("seconds", lambda r: _number(r.seconds)),
    ("GPU-s", lambda r: _number(r.gpu_seconds)),
    ("share", lambda r: "-" if r.share is None else f"{100 * r.share:.1f}%"),
    *(
        (
            f"{c.label} hit/miss",
            lambda r, c=c: r.compile_stats.hit_miss(c) if r.compile_stats else "-",
        )
        for c in CACHES
    ),
    ("recompiles", lambda r: r.compile_stats.recompiled if r.compile_stats else "-"),
    ("outcome", lambda r: r.outcome),
)


def split_gpu_time(
    results: Sequence[FileResult],
) -> tuple[dict[tuple[str, int], float], set[tuple[str, int]]]:
    """GPU-seconds of every attempt, by (target, attempt number), and the attempts that really
    held a GPU together with another (:func:`mizzen_ci.packing.gpus.split_held_time`; an attempt shares when it
    sat on a sharable seat, :attr:`Attempt.sharing`: one that ran alone is charged, and shown,
    as alone)."""
    return split_held_time(
        ((r.lane_file.target, a.number), [str(g.index) for g in a.gpus], a.started,
         a.started + a.seconds, a.sharing)
        for r in results
        for a in r.attempts
    )  # fmt: skip


def totals_line(rows: Sequence[SummaryRow]) -> str | None:
    """The table's totals (``None`` when no file ran): GPU-seconds, and the compile-cache counts
    of the files that reported them."""
    run = [r for r in rows if r.gpu_seconds is not None]
    if not run:
        return None
    total = sum(r.gpu_seconds for r in run)
    shared = sum(1 for r in run if r.shared)
    text = f"total: {total:.1f} GPU-seconds over {len(run)} file(s) run (wall time × GPUs held" + (
        f"; {shared} file(s) shared a GPU, its time split between them)" if shared else ")"
    )
    counted = [r.compile_stats for r in run if r.compile_stats is not None]
    if counted:
        stats = sum(counted[1:], counted[0])
        text += "; compile cache " + ", ".join(
            f"{c.label} {stats.get(c, 'hit')} hit(s) / {stats.get(c, 'miss')} miss(es)"
            for c in CACHES
        )
        text += f" in the {len(counted)} file(s) that imported torch"
    else:
        text += "; no file imported torch (no compile-cache counts)"
    return text


def recompile_lines(rows: Sequence[SummaryRow]) -> list[str]:
    """One line per function a file's child recompiled (raw: the caller's medium escapes it)."""
    return [
        f"- {r.file}: {rc.function} ({rc.where}) recompiled {rc.count} time(s): "
        + (" | ".join(rc.reasons) or "no reason recorded")
        for r in rows
        if r.compile_stats is not None
        for rc in r.compile_stats.recompiles
    ]


def summary_tables(
    rows: Sequence[SummaryRow],
    flakes: Sequence[history.FlakeRecord],
    record_counts: dict[tuple[str, str], int],
    *,
    markdown: bool = False,
    cache: CompileCache | None = None,
    warnings: Sequence[str] = (),
) -> str:
    render = markdown_table if markdown else text_table
    line = markdown_text if markdown else plain
    out = [line(cache.describe()), ""] if cache is not None else []
    out.append(render([h for h, _ in COLUMNS], [[cell(r) for _, cell in COLUMNS] for r in rows]))
    totals = totals_line(rows)
    if totals:
        out += ["", line(totals)]
    out += [line(f"warning: {w}") for w in warnings]
    recompiled = recompile_lines(rows)
    if recompiled:
        out += [
            "",
            line("Recompiled by torch.compile (each a compile more; dynamo's guard failures):"),
        ]
        out += [line(text) for text in recompiled]
    if flakes:
        out.append("")
        out.append("Retried infrastructure failures (flake record, keyed by file and arch):")
        out.append(
            render(
                ("file", "arch", "class", "after retry", "in record"),
                [
                    (f.file, f.arch, f.klass, f.final, record_counts.get((f.file, f.arch), 0))
                    for f in flakes
                ],
            )
        )
    return "\n".join(out)


# --------------------------------------------------------------------------------------------
# The lane's outputs, in the order they are written


@dataclass(frozen=True)
class LaneOutcome:
    """What a lane considered: files it ran (with their results) and files it did not run."""

    arch: str
    job: str | None
    results: list[FileResult]
    not_runnable: list[tuple[LaneFile, str]]
    disabled: list  # registrations: path, num_gpus, disabled reason
    broken: list[str]  # registry violations that fail the lane
    in_ci: bool
    compile_cache: CompileCache | None = None
    #: the flaky quarantine (:mod:`mizzen_ci.flakes.lane`): files run in ``record`` mode whose
    #: failure is recorded, never gating (file -> reason), and files not run in ``skip`` mode
    quarantined: Mapping[str, str] = field(default_factory=dict)
    quarantine_skipped: Sequence[tuple[LaneFile, str]] = ()

    @functools.cached_property
    def _split(self) -> tuple[dict[tuple[str, int], float], set[tuple[str, int]]]:
        return split_gpu_time(self.results)

    @property
    def _charged(self) -> dict[tuple[str, int], float]:
        return self._split[0]

    def held_together(self, result: FileResult) -> bool:
        """Whether the file's final attempt held its GPU together with another file."""
        return bool(result.attempts) and (
            (result.lane_file.target, result.final.number) in self._split[1]
        )

    def gpu_seconds_of(self, result: FileResult) -> float:
        """The file's GPU-seconds over every attempt (:func:`split_gpu_time`)."""
        return sum(self._charged[(result.lane_file.target, a.number)] for a in result.attempts)

    @property
    def gpu_seconds(self) -> float:
        return sum(self.gpu_seconds_of(r) for r in self.results)

    def share(self, result: FileResult) -> float | None:
        total = self.gpu_seconds
        return self.gpu_seconds_of(result) / total if total > 0 else None

    def ordered(self) -> list[FileResult]:
        """The files run, largest share of the GPU-seconds first (then by path)."""
        return sorted(self.results, key=lambda r: (-self.gpu_seconds_of(r), r.lane_file.target))

    def compile_warnings(self) -> list[str]:
        """Every counts file of this run that was not believed, named by file and attempt."""
        return [
            f"{r.lane_file.target}"
            + (f" (attempt {a.number})" if len(r.attempts) > 1 else "")
            + f": {a.compile_warning}"
            for r in self.ordered()
            for a in r.attempts
            if a.compile_warning
        ]


def outcome_text(result: FileResult) -> str:
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


def flake_records(outcome: LaneOutcome) -> list[history.FlakeRecord]:
    """One record per retried attempt of this run."""
    return [
        history.FlakeRecord(
            file=r.lane_file.file,
            arch=outcome.arch,
            klass=a.classification.name,
            evidence=a.classification.evidence,
            final=r.final.outcome,
            when=history.now_utc(),
            job=outcome.job,
        )
        for r in outcome.results
        for a in r.attempts[:-1]
        if a.classification is not None
    ]


def summary_rows(outcome: LaneOutcome) -> list[SummaryRow]:
    """Every file the lane considered, once (see the module docstring)."""
    rows: list[SummaryRow] = []
    for r in outcome.ordered():
        gpus = r.final.gpus
        rows.append(
            SummaryRow(
                r.lane_file.target,
                f"{r.lane_file.num_gpus} ({','.join(str(g.index) for g in gpus) or '-'}"
                + (", shared)" if outcome.held_together(r) else ")"),
                r.final.seconds,
                outcome_text(r) + _quarantine_note(outcome, r),
                r.passed or r.lane_file.file in outcome.quarantined,
                gpu_seconds=outcome.gpu_seconds_of(r),
                share=outcome.share(r),
                compile_stats=r.final.compile_stats,
                shared=outcome.held_together(r),
            )
        )
    for lf, why in outcome.not_runnable:
        rows.append(
            SummaryRow(
                lf.target, str(lf.num_gpus), None, f"not runnable here: {why}", not outcome.in_ci
            )
        )
    for reg in outcome.disabled:
        rows.append(
            SummaryRow(reg.path, str(reg.num_gpus), None, f"disabled: {reg.disabled}", True)
        )
    for lf, why in outcome.quarantine_skipped:
        rows.append(
            SummaryRow(
                lf.target, str(lf.num_gpus), None, f"not run, quarantined as flaky: {why}", True
            )
        )
    for message in outcome.broken:
        rows.append(SummaryRow(message.split(":", 1)[0], "-", None, "registry error", False))
    return rows


def _quarantine_note(outcome: LaneOutcome, r: FileResult) -> str:
    if r.passed or r.lane_file.file not in outcome.quarantined:
        return ""
    return f" (quarantined as flaky: recorded, not gating; {outcome.quarantined[r.lane_file.file]})"


def junit_reports(outcome: LaneOutcome) -> list[junit.FileReport]:
    """One merged-junit suite per file run (its final attempt) and per file not runnable in CI."""
    reports = [
        junit.FileReport(
            file=r.lane_file.target,
            junit=r.final.junit,
            properties={
                "arch": outcome.arch,
                "gpus": ",".join(g.visible_id for g in r.final.gpus),
                "attempts": str(len(r.attempts)),
                **(
                    {"retried_for": r.attempts[0].classification.name}
                    if len(r.attempts) > 1 and r.attempts[0].classification
                    else {}
                ),
                **_cost_properties(outcome, r),
            },
            error=None if r.final.outcome == "passed" else outcome_text(r),
            output_tail=_tail(r.final.log),
            seconds=r.final.seconds,
        )
        for r in outcome.results
    ]
    if outcome.in_ci:
        reports += [
            junit.FileReport(
                file=lf.target,
                junit=None,
                properties={"arch": outcome.arch},
                error=f"not runnable here: {why}",
            )
            for lf, why in outcome.not_runnable
        ]
    return reports


def _cost_properties(outcome: LaneOutcome, r: FileResult) -> dict[str, str]:
    """A file's junit properties for what it cost: GPU-seconds, share, compile-cache counts (by
    torch's own counter names), recompiles and the cache it was given."""
    share = outcome.share(r)
    props = {
        "gpu_seconds": f"{outcome.gpu_seconds_of(r):.3f}",
        **({"gpu_seconds_share": f"{share:.4f}"} if share is not None else {}),
    }
    stats = r.final.compile_stats
    if stats is not None:
        props.update(
            {f"{c.group}.{c.prefix}{o}": str(stats.get(c, o)) for c in CACHES for o in OUTCOMES}
        )
        props["recompiles"] = str(stats.recompiled)
    if outcome.compile_cache is not None:
        props["compile_cache"] = outcome.compile_cache.describe().removeprefix("compile cache: ")
    return props


def history_records(outcome: LaneOutcome) -> list[history.Record]:
    """The duration of every file run: its junit testcases, or an error record when the run left
    no usable report (timed out, crashed)."""
    records = []
    arch, job, lane = outcome.arch, outcome.job, nox_session_name(outcome.arch)
    for r in outcome.results:
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


def verdict(outcome: LaneOutcome, rows: list[SummaryRow]) -> tuple[str, bool]:
    """The last line of the summary, and whether the lane failed."""
    arch, results = outcome.arch, outcome.results
    failed = [r for r in rows if not r.ok]
    nothing = not results and not outcome.not_runnable and not outcome.disabled
    nothing = nothing and not outcome.quarantine_skipped
    nothing = nothing and not outcome.broken
    if nothing:
        text = f"{nox_session_name(arch)}: nothing to run: no enabled test declares {arch}"
    else:
        text = (
            f"{nox_session_name(arch)}: {sum(r.passed for r in results)} passed, {len(failed)} not "
            f"passing of {len(rows)} file(s)"
        )
    if outcome.not_runnable and not outcome.in_ci:
        text += (
            f"; {len(outcome.not_runnable)} not runnable on this host (reported only; under "
            "CI=true this fails the lane)"
        )
    return text, bool(failed or nothing)


def summary_json(outcome: LaneOutcome, flakes: list[history.FlakeRecord]) -> dict:
    return {
        "arch": outcome.arch,
        "job": outcome.job,
        "files": [
            {
                "file": r.lane_file.target,
                "num_gpus": r.lane_file.num_gpus,
                "outcome": r.final.outcome,
                "summary": outcome_text(r),
                "gpu_seconds": round(outcome.gpu_seconds_of(r), 3),
                "share": None if outcome.share(r) is None else round(outcome.share(r), 6),
                "compile_stats": r.final.compile_stats.as_json()
                if r.final.compile_stats is not None
                else None,
                "attempts": [
                    {
                        "gpus": [g.visible_id for g in a.gpus],
                        "started": round(a.started, 3),  # seconds after the lane started
                        "seconds": round(a.seconds, 3),
                        "outcome": a.outcome,
                        "class": a.classification.name if a.classification else None,
                        "log": str(a.log) if a.log else None,
                        "compile_warning": a.compile_warning,
                    }
                    for a in r.attempts
                ],
            }
            for r in outcome.ordered()
        ],
        "gpu_seconds": round(outcome.gpu_seconds, 3),
        "compile_cache": outcome.compile_cache.as_json() if outcome.compile_cache else None,
        "not_runnable": [{"file": lf.target, "why": why} for lf, why in outcome.not_runnable],
        "disabled": [{"file": reg.path, "why": reg.disabled} for reg in outcome.disabled],
        "registry_errors": outcome.broken,
        "flakes": [json.loads(f.to_json()) for f in flakes],
    }


def write_reports(
    outcome: LaneOutcome,
    report_dir: Path,
    flake_path: Path,
    history_path: Path | None,
) -> int:
    """Write every output of the lane (see the module docstring); the lane's exit code."""
    flakes = flake_records(outcome)
    history.append_flakes(flake_path, flakes)
    record_counts: dict[tuple[str, str], int] = {}
    if flakes:
        record_counts, problems = history.read_flakes(flake_path)
        if problems:
            print(plain(history.dropped_warning(problems, f"flake record {flake_path}")))
    rows = summary_rows(outcome)
    name = nox_session_name(outcome.arch)
    junit.write(
        junit.merge(junit_reports(outcome), name=f"mizzen {name}"), report_dir / "junit.xml"
    )
    if history_path is not None and outcome.results:
        history.append(history_path, history_records(outcome))

    warnings = outcome.compile_warnings()
    tables = functools.partial(
        summary_tables, rows, flakes, record_counts, cache=outcome.compile_cache, warnings=warnings
    )
    table = tables()
    last, failed = verdict(outcome, rows)
    print(f"\n{table}\n\n{plain(last)}\nmerged junit: {plain(report_dir / 'junit.xml')}")
    masking.write_text(report_dir / "summary.txt", f"{table}\n\n{plain(last)}\n")
    markdown = f"### {markdown_text(name)}\n\n{tables(markdown=True)}\n\n{markdown_text(last)}\n"
    masking.write_text(report_dir / "summary.md", markdown)
    if os.environ.get("GITHUB_STEP_SUMMARY"):
        masking.write_text(os.environ["GITHUB_STEP_SUMMARY"], markdown, append=True)
    summary = json.dumps(summary_json(outcome, flakes), indent=2)
    masking.write_text(report_dir / "summary.json", summary)
    return 1 if failed else 0


TAIL_BYTES = 64 * 1024  # of a test's log, into the merged junit (a log may be any size)


def _tail(log: Path | None, lines: int = 60) -> str:
    """The last ``lines`` lines of a test's log (of its last :data:`TAIL_BYTES`), for the junit
    report; empty when the log is missing or is no regular file."""
    if log is None:
        return ""
    try:
        data = read_tail(log, TAIL_BYTES)
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", errors="replace").splitlines()[-lines:])
