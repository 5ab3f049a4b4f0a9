"""What a lane is told about the flaky quarantine: the mode, and the files quarantined on its arch.

The mode is ``$MIZZEN_FLAKY`` (``off`` by default; ``skip`` for pull requests and merge groups,
``record`` for pushes to main and nightly runs; a command-line option may give it instead), the
list ``ci/flaky.toml`` as revision ``$MIZZEN_FLAKY_REV`` has it (a pull request's base), else as
the working tree has it.  Both lanes ask here: the pytest plugin (:mod:`.pytest_plugin`, the CPU
lane) and the GPU lane (:mod:`mizzen_ci.lane.cli`).

Invariants:
- ``off`` reads nothing; a broken list, or ``skip`` inside GitHub Actions without a base revision
  (a change's own list is never read in CI), quarantines nothing and says why in ``problems``.
- A bad mode is a :class:`~mizzen_ci.sources.ConfigError` naming the variable and the modes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..sources import ConfigError
from .quarantine import FLAKY_RELATIVE_PATH, read_revision, read_tree

MODE_ENV, REV_ENV = "MIZZEN_FLAKY", "MIZZEN_FLAKY_REV"
MODES = ("off", "skip", "record")


@dataclass(frozen=True)
class LaneQuarantine:
    mode: str
    arch: str
    listed: dict[str, str] = field(default_factory=dict)  # test file -> reason
    problems: tuple[str, ...] = ()
    where: str = FLAKY_RELATIVE_PATH.as_posix()


def lane_quarantine(root: Path, arch: str, *, mode: str | None = None, rev: str | None = None,
                    environ: Mapping[str, str] = os.environ) -> LaneQuarantine:  # fmt: skip
    """The quarantine of a lane of ``arch`` (``cpu`` or a GPU generation); see the invariants."""
    mode = mode or environ.get(MODE_ENV) or "off"
    if mode not in MODES:
        raise ConfigError(f"${MODE_ENV}={mode[:40]!r} is not a mode: use one of {', '.join(MODES)}")
    if mode == "off":
        return LaneQuarantine(mode, arch)
    rev = rev or environ.get(REV_ENV) or None
    where = f"{rev}:{FLAKY_RELATIVE_PATH.as_posix()}" if rev else FLAKY_RELATIVE_PATH.as_posix()
    if mode == "skip" and rev is None and environ.get("GITHUB_ACTIONS") == "true":
        why = f"no base revision given (${REV_ENV}): a change's own list is never read in CI"
        return LaneQuarantine(mode, arch, problems=(why,), where=where)
    entries, problems = read_revision(Path(root), rev) if rev else read_tree(Path(root))
    if problems:
        return LaneQuarantine(mode, arch, problems=tuple(map(str, problems)), where=where)
    return LaneQuarantine(
        mode, arch, {e.file: e.reason for e in entries if e.arch == arch}, where=where
    )
