"""The audit's tables: recall and precision overall, per package and per source file, and every
miss as ``F -> T: why``; as terminal text and as Markdown (the nightly step summary).

Invariants:
- Every value from the tree or the store is escaped for its medium (:func:`mizzen_ci.output.
  plain` for the terminal, the Markdown table cells by :func:`mizzen_ci.output.markdown_table`).
- The per-file table lists the files with a miss (all files with ``verbose``); every miss is
  always listed, never a count alone.
"""

from __future__ import annotations

from ..output import markdown, markdown_table, plain, text_table
from .recall import Audit


def _ratio(num: int, den: int) -> str:
    return f"{num / den:.3f} ({num}/{den})" if den else "1.000 (0/0)"


def _package_rows(audit: Audit) -> list[list[object]]:
    files: dict[str, int] = {}
    for f in audit.files:
        files[f.package] = files.get(f.package, 0) + 1
    return [[pkg, files[pkg], _ratio(h, e), _ratio(h, s)]
            for pkg, (e, h, s) in audit.by_package().items()]  # fmt: skip


def _file_rows(audit: Audit, verbose: bool) -> list[list[object]]:
    return [
        [f.source, len(f.executed), _ratio(len(f.hits), len(f.executed)),
         _ratio(len(f.hits), len(f.selected))]
        for f in audit.files if verbose or f.missed
    ]  # fmt: skip


def headline(audit: Audit, revision: str) -> list[str]:
    return [
        f"selection audit at {revision[:12]}: {len(audit.files)} files executed by "
        f"{len(audit.tests)} test files ({audit.executed_pairs} file-test pairs)",
        f"recall {_ratio(audit.hit_pairs, audit.executed_pairs)}   precision "
        f"{_ratio(audit.hit_pairs, audit.selected_pairs)}",
    ]


def text(audit: Audit, revision: str, verbose: bool = False) -> str:
    out = [plain(line) for line in headline(audit, revision)]
    out += ["", text_table(["package", "files", "recall", "precision"], _package_rows(audit))]
    rows = _file_rows(audit, verbose)
    if rows:
        out += ["", text_table(["source file", "tests", "recall", "precision"], rows)]
    out += ["", f"misses ({len(audit.misses)}):" if audit.misses else "misses: none"]
    out += [plain(f"  {m}") for m in audit.misses]
    return "\n".join(out)


def markdown_summary(audit: Audit, revision: str) -> str:
    out = ["## Selection audit", ""] + [markdown(line) + "  " for line in headline(audit, revision)]
    out += ["", markdown_table(["package", "files", "recall", "precision"], _package_rows(audit))]
    rows = _file_rows(audit, verbose=False)
    if rows:
        out += ["", markdown_table(["source file", "tests", "recall", "precision"], rows)]
    if audit.misses:
        out += ["", f"### Misses ({len(audit.misses)})", ""]
        out += [f"- {markdown(str(m))}" for m in audit.misses]
    return "\n".join(out) + "\n"
