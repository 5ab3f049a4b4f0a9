"""The base decides what must run: a change's own registrations may add runs, never remove one.

For a pull request (and a merge-queue entry) the planner also reads the registrations of the
*base* revision (``git ls-tree`` and ``git cat-file`` of the base commit, as the fleet table is
read) for the test files whose registration the change may have altered, selects them under the
same request and impact, and keeps every (test file, target) pair that selection runs and the
head's would not: "runs as the base declares it: the head set disabled=…".  Same rule as the
gate's quarantine list, judged by the base: a change cannot excuse its own test.

Invariants:
- Which files are read: the base's regular ``tests/**/test_*.py`` files (not in a hidden or
  skipped folder, not excluded by the base's ``[tool.mizzen.registry]``) that the change touches
  or that the head does not register cleanly (deleted, renamed, excluded, broken).  Every other
  base file has the head's bytes, so the head's registration is the base's.
- A file the change touches counts as impacted for the base (a changed test file selects itself,
  whatever the head's graph says of a file that is gone).
- A pair is matched across a rename (``R`` in the diff) to the file's new path.  A base pair whose
  file the head deletes, renames away from ``tests/`` or leaves unregistered stays in the plan at
  its base path with an error: the change cannot remove it (fix: land ``disabled="…"`` first).
- A pure function of the repository, the change and the event: git objects only, no cache.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from ..fleet import Fleet
from ..registry import (
    TESTS_DIR,
    Registration,
    Registry,
    RegistryConfigError,
    is_excluded,
    read_source,
    registry_excludes,
)
from ..registry.discover import SKIP_DIRS
from .change import Change, GitError, blobs_at, file_at, tree_files
from .impact import Impact
from .model import NotScheduled, Override
from .request import Request
from .selection import Selected, select

#: The registration fields a head may change, in the order an override names them.
DECLARED = ("backend", "disabled", "nightly", "labels", "hardware", "num_gpus", "needs")


@dataclass(frozen=True)
class BaseRuns:
    """What :func:`keep_base_runs` adds to a plan: the runs, their records and errors."""

    selected: list[Selected]
    overrides: list[Override]
    errors: list[str]


def applies(request: Request, change: Change) -> bool:
    """Whether the base decides for this plan: a change under review (pull request, merge
    queue) read from git, not a rerun a maintainer narrowed on purpose."""
    return (
        request.event in ("pull_request", "merge_group")
        and change.usable
        and change.base is not None
        and request.rerun is None
    )


def base_registrations(
    root: Path, change: Change, head: Registry, pools: Fleet
) -> tuple[list[Registration], list[str]]:
    """The base's registrations of the files whose head registration may differ, and warnings
    (a base that cannot be read: nothing is added, said so)."""
    try:
        candidates = _candidates(root, change, head)
        blobs = blobs_at(root, change.base, candidates) if candidates else {}
    except GitError as e:
        return [], [f"the base's registrations cannot be read ({e}): the head's decide alone"]
    out = []
    for path in candidates:
        if path in blobs:
            reg, violations = read_source(blobs[path], path, pools)
            if reg is not None and not violations:
                out.append(reg)
    return out, []


def _candidates(root: Path, change: Change, head: Registry) -> list[str]:
    registered = {r.path for r in head.registrations}
    if not any(p.startswith(TESTS_DIR + "/") for p in change.paths) and not (
        {"pyproject.toml"} & change.paths or {v.path for v in head.violations} - registered
    ):
        return []  # nothing of tests/ changed: every base file is the head's, registered alike
    excludes = _base_excludes(root, change.base)
    return [
        path
        for path in tree_files(root, change.base, TESTS_DIR)
        if (path in change.paths or path not in registered)
        and path.rpartition("/")[2].startswith("test_")
        and path.endswith(".py")
        and not _in_skipped_folder(path)
        and not is_excluded(path, excludes)
    ]


def _base_excludes(root: Path, base: str) -> tuple[str, ...]:
    """The ``exclude`` globs of the base's ``[tool.mizzen.registry]``, read by the registry's
    own reader (none when the base has no readable table: every file counts)."""
    try:
        text = file_at(root, base, "pyproject.toml")
    except GitError:
        return ()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "pyproject.toml").write_text(text, encoding="utf-8")
        try:
            return registry_excludes(Path(tmp))
        except RegistryConfigError:
            return ()


def _in_skipped_folder(path: str) -> bool:
    folders = path.split("/")[1:-1]
    return any(f.startswith(".") or f in SKIP_DIRS or f.endswith(".egg-info") for f in folders)


def keep_base_runs(
    base_regs: list[Registration],
    head_selected: list[Selected],
    head: Registry,
    pools: Fleet,
    request: Request,
    impact: Impact,
    change: Change,
) -> BaseRuns:
    """The runs the base's selection of ``base_regs`` makes and the head's does not (see the
    module docstring)."""
    touched = {r.path: f"{r.path} changed" for r in base_regs if r.path in change.paths}
    base_impact = replace(impact, tests={**touched, **impact.tests})
    base_selected, _, _ = select(base_regs, [], pools, request, base_impact)
    runs = {(s.reg.path, s.arch) for s in head_selected}
    renamed = {e.old_path: e.path for e in change.entries if e.status == "R" and e.old_path}
    head_regs = head.by_path()
    out = BaseRuns([], [], [])
    for s in base_selected:
        new = renamed.get(s.reg.path, s.reg.path)
        now = head_regs.get(new)
        if (new, s.arch) in runs and now is not None:
            continue
        what = _what_the_head_did(s.reg, now, new, head)
        path = new if now is not None else s.reg.path
        reason = f"runs as the base declares it: the head {what}"
        out.selected.append(replace(s, reg=replace(s.reg, path=path), why=f"{reason}; {s.why}"))
        out.overrides.append(Override(path, s.arch, s.reg.path, reason))
        if now is None:
            out.errors.append(
                f"{s.reg.path}: the base runs it for this change ({s.why}) and the head {what}: "
                'a change cannot remove a test the base runs. Fix: land `disabled="<reason>"` '
                "in its registration first (that change still runs it once), then remove it"
            )
    return out


def _what_the_head_did(base: Registration, now: Registration | None, new: str, head) -> str:
    """What the head's registration of ``base``'s file says differently, in words."""
    if now is None:
        broken = [str(v) for v in head.violations if v.path == new]
        if broken:
            return f"breaks its registration ({broken[0]})"
        if new != base.path:
            return f"renames it to {new}, which is not a registered test file"
        return "deletes it (or no longer registers it)"
    changed = [
        f"{name}={getattr(now, name)!r}"
        for name in DECLARED
        if getattr(now, name) != getattr(base, name)
    ]
    moved = f"moves it to {new}" if new != base.path else ""
    said = ", ".join(changed) or "declares it so that it is not selected"
    return f"{moved}{' and ' if moved else ''}set {said}"


def without_overridden(not_scheduled: list[NotScheduled], runs: list[Selected]) -> list:
    """``not_scheduled`` without the pairs the base's runs now schedule."""
    added = {(s.reg.path, s.arch) for s in runs}
    return [n for n in not_scheduled if (n.file, n.arch) not in added]
