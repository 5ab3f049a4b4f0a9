"""What a lane does with a test file quarantined for flakiness (entry point ``pytest11:
mizzen_ci_flakes``), by mode (``--mizzen-flaky``, else ``$MIZZEN_FLAKY``):

- ``off`` (the default): nothing; the plugin reads no list.
- ``skip`` (pull requests, the merge queue): the quarantined files of the lane's arch are
  deselected (not run, so a GPU lane's "skipped on declared hardware" rule does not apply) and
  listed in the terminal summary with their reasons.
- ``record`` (nightly lanes): they run; their results go to the junit report as they are (the
  history records them, which is how a quarantine is lifted), and when every failure of the
  session is a quarantined file's, the exit status is 0: recorded, never gating.

The list is read from revision ``--mizzen-flaky-rev`` (``$MIZZEN_FLAKY_REV``: a pull request's
or merge group's base), else from the working tree.  The lane's arch is ``--mizzen-lane`` /
``$MIZZEN_LANE`` (``cpu`` when neither).

Invariants:
- A broken list quarantines nothing and says so in the summary (its tests gate as usual); so
  does ``skip`` in GitHub Actions without a base revision (a change's own list is never read).
- Only failures (``failed`` reports of setup, call or teardown) of quarantined files are
  forgiven; an error of any other file, an internal error, an interruption or a usage error keep
  their exit status.
- Active only when pytest's rootdir holds ``ci/fleet.toml`` (a mizzen checkout), like the
  registry plugin: a pytester tree of another test never reads the lane's list.
- Stdlib only at module scope; pytest calls the hooks.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..output import plain
from ..sources import ConfigError
from .lane import MODE_ENV, MODES, REV_ENV

__all__ = ["MODE_ENV", "REV_ENV"]


def pytest_addoption(parser) -> None:
    group = parser.getgroup("mizzen-flaky", "mizzen: flaky-test quarantine (ci/flaky.toml)")
    group.addoption("--mizzen-flaky", choices=MODES, default=None,
                    help="off | skip (PRs, merge queue) | record (nightly); default $MIZZEN_FLAKY or off")  # fmt: skip
    group.addoption("--mizzen-flaky-rev", default=None,
                    help="read ci/flaky.toml from this revision (a PR's base); default $MIZZEN_FLAKY_REV or the tree")  # fmt: skip


class _Quarantine:
    def __init__(
        self, mode: str, arch: str, listed: dict[str, str], problems: list[str], where: str
    ):
        self.mode, self.arch, self.listed, self.problems, self.where = (
            mode,
            arch,
            listed,
            problems,
            where,
        )
        self.deselected: list[str] = []
        self.failed_quarantined: set[str] = set()
        self.failed_other = 0

    def reason(self, nodeid: str) -> str | None:
        return self.listed.get(nodeid.split("::", 1)[0])

    def pytest_collection_modifyitems(self, config, items) -> None:
        if self.mode != "skip":
            return
        keep, drop = [], []
        for item in items:
            (drop if self.reason(item.nodeid) is not None else keep).append(item)
        if drop:
            self.deselected = sorted({i.nodeid.split("::", 1)[0] for i in drop})
            config.hook.pytest_deselected(items=drop)
            items[:] = keep

    def pytest_runtest_logreport(self, report) -> None:
        if report.failed:
            if self.mode == "record" and self.reason(report.nodeid) is not None:
                self.failed_quarantined.add(report.nodeid.split("::", 1)[0])
            else:
                self.failed_other += 1

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        if (
            self.mode == "record"
            and exitstatus == 1
            and self.failed_quarantined
            and not self.failed_other
        ):
            session.exitstatus = 0
        elif self.mode == "skip" and exitstatus == 5 and self.deselected:
            session.exitstatus = 0  # every collected test was a quarantined file's: none to run

    def pytest_terminal_summary(self, terminalreporter) -> None:
        tr = terminalreporter
        for problem in self.problems:
            tr.write_line(plain(f"mizzen flaky: {problem} (nothing quarantined)"))
        for file in self.deselected:
            tr.write_line(
                plain(
                    f"mizzen flaky: not run, quarantined on {self.arch} ({self.where}): {file}: {self.listed[file]}"
                )
            )
        for file in sorted(self.failed_quarantined):
            tr.write_line(
                plain(
                    f"mizzen flaky: failed, recorded, not gating (quarantined on {self.arch}): {file}"
                )
            )


def pytest_configure(config) -> None:
    from ..fleet import FLEET_RELATIVE_PATH
    from .lane import lane_quarantine

    if not (Path(config.rootpath) / FLEET_RELATIVE_PATH).is_file():
        return  # not a mizzen checkout (a pytester tree of another test): like the registry plugin

    try:
        q = lane_quarantine(Path(config.rootpath), _lane_arch(config), mode=config.getoption("mizzen_flaky"),
                            rev=config.getoption("mizzen_flaky_rev"))  # fmt: skip
    except ConfigError as e:
        import pytest

        raise pytest.UsageError(plain(str(e))) from None
    if q.mode != "off":
        config.pluginmanager.register(_Quarantine(q.mode, q.arch, q.listed, list(q.problems), q.where),
                                      "mizzen-flaky-quarantine")  # fmt: skip


def _lane_arch(config) -> str:
    try:
        lane = config.getoption("mizzen_lane")
    except ValueError:  # the registry plugin is not loaded
        lane = None
    return lane or os.environ.get("MIZZEN_LANE") or "cpu"
