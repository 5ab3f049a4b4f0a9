"""The proposal of one nightly run: which pairs to quarantine, which to lift, which stay; the
quarantine file after it; and the pull-request body with the evidence.

Invariants:
- Quarantine a pair that is not listed and whose window shows at least k flips, or a retry
  pass (it passed only on retry); lift a listed pair whose clean streak reached m; keep every
  other listed pair (with its streak, so the body says how far it is).
- A listed pair with no run in the history is kept and said to be unseen (a quarantine is
  lifted on evidence only).
- The body is Markdown built from escaped cells (:func:`mizzen_ci.output.markdown_table`):
  a file name from the history cannot inject markup; it is bounded to :data:`MAX_ROWS` rows per
  table, and says how many were left out.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

from ..output import Code, markdown_table
from .evidence import Evidence
from .quarantine import FLAKY_RELATIVE_PATH, FlakyEntry, render
from .settings import FlakeSettings

MAX_ROWS = 100
BODY_MARKER = "<!-- mizzen-ci flakes propose -->"


@dataclass
class Proposal:
    settings: FlakeSettings
    add: list[tuple[FlakyEntry, Evidence]] = field(default_factory=list)
    lift: list[tuple[FlakyEntry, Evidence]] = field(default_factory=list)
    keep: list[tuple[FlakyEntry, Evidence | None]] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.add or self.lift)

    def entries(self) -> list[FlakyEntry]:
        """The list after the proposal."""
        return [e for e, _ in self.keep] + [e for e, _ in self.add]

    def file_text(self) -> str:
        return render(self.entries())


def _why(ev: Evidence, s: FlakeSettings) -> str | None:
    reasons = []
    if ev.flips >= s.flips:
        reasons.append(
            f"flipped {ev.flips} times in its last {len(ev.window)} trusted runs (k = {s.flips})"
        )
    if ev.retry_passes:
        reasons.append(f"passed only on retry {ev.retry_passes} time(s)")
    return "; ".join(reasons) or None


def propose(evidence: dict[tuple[str, str], Evidence], listed: list[FlakyEntry],
            settings: FlakeSettings, today: dt.date) -> Proposal:  # fmt: skip
    """The proposal (see the module invariants)."""
    p = Proposal(settings)
    listed_keys = {e.key for e in listed}
    for entry in sorted(listed, key=lambda e: e.key):
        ev = evidence.get(entry.key)
        if ev is not None and ev.clean_streak >= settings.clean:
            p.lift.append((entry, ev))
        else:
            p.keep.append((entry, ev))
    for key, ev in sorted(evidence.items()):
        why = None if key in listed_keys else _why(ev, settings)
        if why:
            p.add.append((FlakyEntry(ev.file, ev.arch, today, why), ev))
    return p


def _bounded(rows: list[tuple], headers: tuple[str, ...]) -> str:
    table = markdown_table(headers, rows[:MAX_ROWS])
    more = len(rows) - MAX_ROWS
    return table + (f"\n\n… and {more} more row(s) left out." if more > 0 else "")


def _first(ev: Evidence | None) -> str:
    return (ev.first_seen or "-")[:10] if ev else "-"


def body(p: Proposal, *, history_runs: int) -> str:
    """The pull-request body (Markdown) of the proposal."""
    s = p.settings
    out = [
        BODY_MARKER,
        f"## Flaky tests: {len(p.add)} to quarantine, {len(p.lift)} to re-enable",
        "",
        f"Proposed by `mizzen-ci flakes propose` from the trusted history ({history_runs} recorded "
        f"test-file runs in the history cache, which only the nightly job writes, from trusted runs). "
        f"Rules: quarantine a (test, arch) that flips "
        f"**{s.flips}** times in its last **{s.window}** runs or passes only on retry; re-enable it "
        f"after **{s.clean}** consecutive clean runs (`[tool.mizzen.flakes]` in `pyproject.toml`). "
        f"A quarantined test keeps running in the nightly lanes, recorded and never gating; pull "
        f"requests and the merge queue read `{FLAKY_RELATIVE_PATH.as_posix()}` from their base.",
    ]
    headers = (
        "test",
        "arch",
        "why",
        "runs (oldest first)",
        "failures",
        "retry passes",
        "first seen",
    )
    if p.add:
        rows = [(Code(e.file), e.arch, e.reason, Code(ev.sparkline()), f"{ev.failures}/{len(ev.window)}",
                 ev.retry_passes, _first(ev)) for e, ev in p.add]  # fmt: skip
        out += ["", "### Quarantine", "", _bounded(rows, headers)]
    if p.lift:
        rows = [(Code(e.file), e.arch, f"{ev.clean_streak} clean runs in a row (m = {s.clean})",
                 Code(ev.sparkline()), e.since.isoformat()) for e, ev in p.lift]  # fmt: skip
        out += [
            "",
            "### Re-enable",
            "",
            _bounded(rows, ("test", "arch", "why", "runs (oldest first)", "quarantined since")),
        ]
    if p.keep:
        rows = [(Code(e.file), e.arch, f"{ev.clean_streak} of {s.clean}" if ev else "no run recorded yet",
                 Code(ev.sparkline()) if ev else "-", e.since.isoformat()) for e, ev in p.keep]  # fmt: skip
        out += [
            "",
            "### Still quarantined",
            "",
            _bounded(
                rows, ("test", "arch", "clean streak", "runs (oldest first)", "quarantined since")
            ),
        ]
    out += ["", "`P` passed, `F` failed or errored; a skipped run is not counted.", ""]
    return "\n".join(out)
