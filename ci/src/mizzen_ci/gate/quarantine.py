"""``ci/quarantine.toml``: known regressions whose metric-gate failures are warnings, with their
reason, until they expire::

    [[quarantine]]
    file = "tests/train/test_sft_e2e.py"
    arch = "cpu"                  # cpu, or a GPU generation of ci/fleet.toml
    reason = "held-out loss regressed by #123, fix in #130"
    expires = 2026-12-31          # a date; the entry applies until the end of that day (UTC)

Invariants:
- For a pull request the list is read from the **base** revision (``git show BASE:ci/quarantine.toml``,
  like ``ci/fleet.toml`` for pools), so a change cannot quarantine its own regression; other
  events read the working tree.
- Every active entry is listed in every gate summary (whether or not its gates fail), and every
  expired one too, as "expired: remove it"; an expired entry turns nothing into a warning.
- Parsing never raises for bad entries: each problem names the file, the entry (its line) and the
  fix; :func:`check_entries` adds the rules ``mizzen-ci validate`` applies to the working tree
  (a registered test that declares a gate, a known arch, an expiry at most :data:`MAX_DAYS` days
  ahead, one entry per (file, arch)).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from ..registry.rules import MAX_REASON_CHARS, shown
from ..sources import read_bytes
from .artefacts import ARCH, valid_test_path

QUARANTINE_RELATIVE_PATH = Path("ci") / "quarantine.toml"
MAX_BYTES = 256 * 1024
MAX_ENTRIES = 200
MAX_DAYS = 90
_HEADER = re.compile(r"^[ \t]*\[\[[ \t]*quarantine[ \t]*\]\]", re.M)


@dataclass(frozen=True)
class Entry:
    file: str
    arch: str
    reason: str
    expires: dt.date
    line: int

    def active(self, today: dt.date) -> bool:
        return today <= self.expires


@dataclass(frozen=True)
class Problem:
    where: str  # "ci/quarantine.toml" or "BASE:ci/quarantine.toml"
    line: int
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.where}:{self.line}: {self.message}. Fix: {self.fix}"


def parse(text: str, where: str) -> tuple[list[Entry], list[Problem]]:
    """The entries of a quarantine file's text and the problems of the bad ones."""
    try:
        data = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError) as e:
        return [], [Problem(where, 1, f"not valid TOML: {e}", "fix the syntax")]
    lines = [text.count("\n", 0, m.start()) + 1 for m in _HEADER.finditer(text)]
    extra = sorted(set(data) - {"quarantine"})
    problems: list[Problem] = []
    if extra:
        problems.append(
            Problem(
                where,
                1,
                f"unknown key(s) {', '.join(map(repr, extra[:5]))}",
                "write [[quarantine]] entries only",
            )
        )
    raw = data.get("quarantine", [])
    if not isinstance(raw, list):
        return [], [
            *problems,
            Problem(where, 1, "`quarantine` must be [[quarantine]] tables", "write [[quarantine]]"),
        ]
    if len(raw) > MAX_ENTRIES:
        return [], [
            *problems,
            Problem(where, 1, f"{len(raw)} entries, over {MAX_ENTRIES}", "fix the regressions"),
        ]
    entries: list[Entry] = []
    for i, item in enumerate(raw):
        line = lines[i] if i < len(lines) else 1
        bad = lambda message, fix, line=line: problems.append(Problem(where, line, message, fix))  # noqa: E731
        if not isinstance(item, dict):
            bad("an entry is not a table", "write [[quarantine]] with file, arch, reason, expires")
            continue
        unknown = sorted(set(item) - {"file", "arch", "reason", "expires"})
        if unknown:
            bad(
                f"unknown key(s) {', '.join(map(repr, unknown[:5]))}",
                "use file, arch, reason, expires",
            )
            continue
        file, arch, reason, expires = (item.get(k) for k in ("file", "arch", "reason", "expires"))
        if not valid_test_path(file):
            bad(
                f"`file` {shown(file)} is not a test file path",
                'write file = "tests/.../test_x.py"',
            )
            continue
        if not (isinstance(arch, str) and ARCH.fullmatch(arch)):
            bad(
                f"`arch` {shown(arch)} is not an arch",
                'write arch = "cpu" or a GPU generation, e.g. "hopper"',
            )
            continue
        if not (
            isinstance(reason, str)
            and reason.strip()
            and reason.isprintable()
            and len(reason) <= MAX_REASON_CHARS
        ):
            bad(
                f"`reason` {shown(reason)} is not one printable line of 1-{MAX_REASON_CHARS} characters",
                'say what regressed and where it is fixed, e.g. reason = "loss up 30 % by #123, fix in #130"',
            )
            continue
        if isinstance(expires, str):
            with contextlib.suppress(ValueError):
                expires = dt.date.fromisoformat(expires)
        if isinstance(expires, dt.datetime) or not isinstance(expires, dt.date):
            bad(
                f"`expires` {shown(expires)} is not a date",
                "write expires = 2026-12-31 (a TOML date)",
            )
            continue
        entries.append(Entry(file, arch, reason.strip(), expires, line))
    return entries, problems


def read_tree(root: Path) -> tuple[list[Entry], list[Problem]]:
    """The working tree's quarantine file (none: no entries)."""
    path = Path(root) / QUARANTINE_RELATIVE_PATH
    where = QUARANTINE_RELATIVE_PATH.as_posix()
    try:
        data, _ = read_bytes(path, MAX_BYTES)
    except FileNotFoundError:
        return [], []
    except OSError as e:
        return [], [Problem(where, 1, f"cannot read: {e}", "make it a regular file")]
    try:
        return parse(data.decode("utf-8"), where)
    except UnicodeDecodeError:
        return [], [Problem(where, 1, "not UTF-8", "save it as UTF-8")]


def read_revision(root: Path, rev: str) -> tuple[list[Entry], list[Problem], str]:
    """The quarantine file as revision ``rev`` has it (a pull request's base); a revision
    without the file has no entries.  ``(entries, problems, where)``; a revision that cannot be
    read is a problem (the gate then cannot be judged fairly)."""
    from ..plan.change import GitError, file_at, resolve

    name = QUARANTINE_RELATIVE_PATH.as_posix()
    if not rev or rev.startswith("-") or not rev.isprintable():
        return (
            [],
            [
                Problem(
                    f"{shown(rev)}:{name}",
                    1,
                    "not a revision",
                    "pass a commit, e.g. --base-rev HEAD^1",
                )
            ],
            name,
        )
    try:
        sha = resolve(root, rev)
    except GitError as e:
        return (
            [],
            [
                Problem(
                    f"{rev}:{name}",
                    1,
                    f"the revision cannot be read ({e})",
                    "fetch the base (fetch-depth: 0) or pass --base-rev",
                )
            ],
            f"{rev}:{name}",
        )
    where = f"{sha[:12]}:{name}"
    try:
        text = file_at(root, sha, name)
    except GitError as e:
        if "not UTF-8" in str(e):
            return [], [Problem(where, 1, "not UTF-8", "save it as UTF-8")], where
        return [], [], where  # no quarantine file at that revision
    if len(text) > MAX_BYTES:
        return [], [Problem(where, 1, f"over {MAX_BYTES} bytes", "keep the list short")], where
    entries, problems = parse(text, where)
    return entries, problems, where


def check_entries(
    entries: list[Entry], where: str, *, gated: set[str], arches: set[str], today: dt.date
) -> list[Problem]:
    """The working-tree rules of ``mizzen-ci validate`` (see the module docstring)."""
    problems = []
    seen: dict[tuple[str, str], int] = {}
    for e in entries:
        if e.file not in gated:
            problems.append(
                Problem(
                    where,
                    e.line,
                    f"{e.file} declares no metric gate",
                    "quarantine a test that has a register_ci_gate(...), or remove the entry",
                )
            )
        if e.arch not in arches:
            problems.append(
                Problem(
                    where,
                    e.line,
                    f"unknown arch {e.arch!r}",
                    f"use one of {', '.join(sorted(arches))}",
                )
            )
        if e.expires > today + dt.timedelta(days=MAX_DAYS):
            problems.append(
                Problem(
                    where,
                    e.line,
                    f"expires {e.expires}, more than {MAX_DAYS} days ahead",
                    f"a quarantine is temporary: expire it by {today + dt.timedelta(days=MAX_DAYS)} and renew it if needed",
                )
            )
        if (e.file, e.arch) in seen:
            problems.append(
                Problem(
                    where,
                    e.line,
                    f"a second entry for {e.file} on {e.arch} (the first is on line {seen[(e.file, e.arch)]})",
                    "keep one entry per (file, arch)",
                )
            )
        seen.setdefault((e.file, e.arch), e.line)
    return problems
