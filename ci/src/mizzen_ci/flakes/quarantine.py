"""``ci/flaky.toml``: the (test file, arch) pairs quarantined for flakiness, written by
``mizzen-ci flakes propose`` and landed on main through its pull request::

    [[flaky]]
    file = "tests/train/test_lora.py"
    arch = "hopper"               # cpu, or a GPU generation of ci/fleet.toml
    since = 2026-12-01            # the day it was proposed (UTC)
    reason = "flipped 4 times in its last 20 trusted runs"

This is a separate list from ``ci/quarantine.toml`` (known *metric* regressions, which expire):
a flaky test is lifted on evidence (m clean runs), not on a date.

Invariants:
- A pull request and a merge group read the list from their **base** revision
  (:func:`read_revision`, like ``ci/quarantine.toml`` and ``ci/fleet.toml``): a change can
  neither quarantine its own flaky test nor lift a quarantine.
- Parsing never raises for a bad entry: each problem names the file, the entry's line, the rule
  and the fix; a broken file quarantines nothing (its tests gate as usual) and says so.
- :func:`render` is the one writer: entries sorted by (file, arch), one per pair, so a proposal's
  diff shows exactly the pairs it adds or lifts; :func:`parse` reads back what it wrote.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from ..gate.artefacts import ARCH, valid_test_path
from ..registry.rules import MAX_REASON_CHARS, shown
from ..sources import read_bytes

FLAKY_RELATIVE_PATH = Path("ci") / "flaky.toml"
MAX_BYTES = 256 * 1024
MAX_ENTRIES = 500
_HEADER = re.compile(r"^[ \t]*\[\[[ \t]*flaky[ \t]*\]\]", re.M)
_KEYS = ("file", "arch", "since", "reason")
FILE_HEADER = """\
# Tests quarantined for flakiness, per (file, arch): they keep running in the nightly lanes (their
# results recorded, never gating) and are skipped by pull requests and the merge queue, which read
# this list from their base revision.  `mizzen-ci flakes propose` (nightly.yml) writes this file:
# it adds a pair that flipped k times in its last n trusted runs or passed only on retry, and
# lifts one after m consecutive clean runs (k, n, m: [tool.mizzen.flakes] in pyproject.toml).
"""


@dataclass(frozen=True)
class FlakyEntry:
    file: str
    arch: str
    since: dt.date
    reason: str
    line: int = 0

    @property
    def key(self) -> tuple[str, str]:
        return self.file, self.arch


@dataclass(frozen=True)
class Problem:
    where: str
    line: int
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.where}:{self.line}: {self.message}. Fix: {self.fix}"


def _entry(item: object, line: int, bad) -> FlakyEntry | None:
    if not isinstance(item, dict):
        return bad("an entry is not a table", "write [[flaky]] with file, arch, since, reason")
    unknown = sorted(set(item) - set(_KEYS))
    if unknown:
        return bad(
            f"unknown key(s) {', '.join(map(repr, unknown[:5]))}", "use file, arch, since, reason"
        )
    file, arch, since, reason = (item.get(k) for k in _KEYS)
    if not valid_test_path(file):
        return bad(
            f"`file` {shown(file)} is not a test file path", 'write file = "tests/.../test_x.py"'
        )
    if not (isinstance(arch, str) and ARCH.fullmatch(arch)):
        return bad(f"`arch` {shown(arch)} is not an arch", 'write arch = "cpu" or a GPU generation')
    if isinstance(since, str):
        with contextlib.suppress(ValueError):
            since = dt.date.fromisoformat(since)
    if isinstance(since, dt.datetime) or not isinstance(since, dt.date):
        return bad(
            f"`since` {shown(since)} is not a date", "write since = 2026-12-01 (a TOML date)"
        )
    if not (isinstance(reason, str) and reason.strip() and reason.isprintable()
            and len(reason) <= MAX_REASON_CHARS):  # fmt: skip
        return bad(
            f"`reason` {shown(reason)} is not one printable line of 1-{MAX_REASON_CHARS} characters",
            'say what was seen, e.g. reason = "flipped 4 times in its last 20 runs"',
        )
    return FlakyEntry(file, arch, since, reason.strip(), line)


def parse(text: str, where: str) -> tuple[list[FlakyEntry], list[Problem]]:
    """The entries of the list's text and the problems of the bad ones (see the invariants)."""
    try:
        data = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError) as e:
        return [], [Problem(where, 1, f"not valid TOML: {e}", "fix the syntax")]
    problems: list[Problem] = []
    extra = sorted(set(data) - {"flaky"})
    if extra:
        problems.append(Problem(where, 1, f"unknown key(s) {', '.join(map(repr, extra[:5]))}",
                                "write [[flaky]] entries only"))  # fmt: skip
    raw = data.get("flaky", [])
    if not isinstance(raw, list) or len(raw) > MAX_ENTRIES:
        problems.append(Problem(where, 1, f"`flaky` must be at most {MAX_ENTRIES} [[flaky]] tables",
                                "write [[flaky]] tables; fix the flakiest tests first"))  # fmt: skip
        return [], problems
    lines = [text.count("\n", 0, m.start()) + 1 for m in _HEADER.finditer(text)]
    entries: list[FlakyEntry] = []
    seen: dict[tuple[str, str], int] = {}
    for i, item in enumerate(raw):
        line = lines[i] if i < len(lines) else 1
        entry = _entry(
            item, line, lambda m, f, line=line: problems.append(Problem(where, line, m, f))
        )
        if entry is None:
            continue
        if entry.key in seen:
            problems.append(Problem(where, line, f"a second entry for {entry.file} on {entry.arch} "
                                    f"(the first is on line {seen[entry.key]})", "keep one entry per (file, arch)"))  # fmt: skip
            continue
        seen[entry.key] = line
        entries.append(entry)
    return entries, problems


def _toml_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render(entries: list[FlakyEntry]) -> str:
    """The file's text for ``entries`` (sorted, one per pair; see the invariants)."""
    out = [FILE_HEADER]
    for e in sorted({e.key: e for e in entries}.values(), key=lambda e: e.key):
        out.append(f"\n[[flaky]]\nfile = {_toml_string(e.file)}\narch = {_toml_string(e.arch)}\n"
                   f"since = {e.since.isoformat()}\nreason = {_toml_string(e.reason)}\n")  # fmt: skip
    return "".join(out)


def read_tree(root: Path) -> tuple[list[FlakyEntry], list[Problem]]:
    """The working tree's list (no file: no entries)."""
    where = FLAKY_RELATIVE_PATH.as_posix()
    try:
        data, _ = read_bytes(Path(root) / FLAKY_RELATIVE_PATH, MAX_BYTES)
    except FileNotFoundError:
        return [], []
    except OSError as e:
        return [], [Problem(where, 1, f"cannot read: {e}", "make it a regular file")]
    try:
        return parse(data.decode("utf-8"), where)
    except UnicodeDecodeError:
        return [], [Problem(where, 1, "not UTF-8", "save it as UTF-8")]


def read_revision(root: Path, rev: str) -> tuple[list[FlakyEntry], list[Problem]]:
    """The list as revision ``rev`` (a pull request's base) has it; a revision without the file
    has no entries, a revision that cannot be read is a problem."""
    from ..plan.change import GitError, file_at, resolve

    name = FLAKY_RELATIVE_PATH.as_posix()
    if not rev or rev.startswith("-") or not rev.isprintable():
        return [], [
            Problem(
                f"{shown(rev)}:{name}", 1, "not a revision", "pass a commit, e.g. --base-rev HEAD^1"
            )
        ]
    try:
        sha = resolve(root, rev)
    except GitError as e:
        return [], [Problem(f"{rev}:{name}", 1, f"the revision cannot be read ({e})",
                            "fetch the base (fetch-depth: 0) or pass --base-rev")]  # fmt: skip
    where = f"{sha[:12]}:{name}"
    try:
        text = file_at(root, sha, name)
    except GitError as e:
        if "not UTF-8" in str(e):
            return [], [Problem(where, 1, "not UTF-8", "save it as UTF-8")]
        return [], []  # no list at that revision
    if len(text) > MAX_BYTES:
        return [], [Problem(where, 1, f"over {MAX_BYTES} bytes", "keep the list short")]
    return parse(text, where)
