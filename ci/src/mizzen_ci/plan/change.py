"""The change under test, read from real git: which repository paths a diff touches.

Invariants:
- Stdlib only; git is run as a subprocess (``git -C ROOT ...``) with ``-z`` output, so any path
  (spaces, unicode, newlines) round-trips exactly.  Commands that do not depend on each other
  (HEAD, the untracked files, the base and its diff) run side by side; the first error wins.
- Default range: the merge-base of ``HEAD`` with the main branch (``main``, else ``origin/main``)
  against the *working tree*, untracked files included (``git ls-files --others
  --exclude-standard``): what a pull request made from this checkout would change.
- A rename or copy counts as a change to both paths; a deletion counts as a change to the path
  that is gone.  ``Change.paths`` holds every such path once.
- Ignored files (:func:`ignored_paths`) are never a change; the planner reports them.
- Nothing fails silently: when the diff cannot be read (no git, not a repository, unknown base,
  shallow clone without the base commit) the result is ``usable=False`` with the reason, and the
  planner selects everything (fail open).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field, replace
from pathlib import Path

MAIN_BRANCHES = ("main", "origin/main")
ZERO_SHA = "0" * 40


@dataclass(frozen=True)
class Entry:
    """One line of ``git diff --name-status``: ``status`` is A, M, D, R, C or T; ``old_path`` is
    set for renames and copies."""

    status: str
    path: str
    old_path: str | None = None


@dataclass(frozen=True)
class Change:
    """The paths a range changes.  ``usable=False`` means "assume everything changed"."""

    base: str | None
    head: str | None
    entries: tuple[Entry, ...] = ()
    usable: bool = True
    reason: str | None = None
    paths: frozenset[str] = field(default=frozenset())
    worktree: bool = False  # the range ends at the working tree (uncommitted changes included)

    @classmethod
    def from_entries(cls, base: str | None, head: str | None, entries) -> Change:
        entries = tuple(entries)
        paths = set()
        for e in entries:
            paths.add(e.path)
            if e.old_path and e.status == "R":  # a copy leaves its source as it was
                paths.add(e.old_path)
        return cls(base, head, entries, True, None, frozenset(paths))

    @classmethod
    def unusable(cls, reason: str, base: str | None = None, head: str | None = None) -> Change:
        return cls(base, head, (), False, reason, frozenset())

    @property
    def deleted(self) -> frozenset[str]:
        """Paths that no longer exist at the head (deleted, or the old side of a rename)."""
        return frozenset(
            e.path if e.status == "D" else e.old_path
            for e in self.entries
            if e.status == "D" or (e.status == "R" and e.old_path)
        )


class GitError(RuntimeError):
    pass


def _git(root: Path, *args: str) -> str:
    return _git_start(root, *args).result()


class _GitRun:
    """One git command started in the background; :meth:`result` waits for its output."""

    def __init__(self, root: Path, args: tuple[str, ...]):
        env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
        env["GIT_OPTIONAL_LOCKS"] = "0"  # planning must never take the index lock from a git
        self.args = args
        try:
            self.proc = subprocess.Popen(
                ["git", "-C", str(root), *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
            )
        except FileNotFoundError:
            raise GitError("git is not installed") from None

    def result(self) -> str:
        try:
            out, err = self.proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            raise GitError(f"`git {' '.join(self.args)}` timed out") from None
        if self.proc.returncode != 0:
            msg = err.decode(errors="replace").strip().splitlines()
            raise GitError(
                f"`git {' '.join(self.args)}` failed: {msg[-1] if msg else self.proc.returncode}"
            )
        return out.decode("utf-8", errors="surrogateescape")

    def discard(self) -> None:
        """Stop waiting for it (after another command failed)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()


def _git_start(root: Path, *args: str) -> _GitRun:
    return _GitRun(root, args)


def resolve(root: Path, rev: str) -> str:
    """The commit sha of ``rev``; :class:`GitError` when there is none."""
    return _git(root, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}").strip()


def checkout_differs(root: Path | str, head_sha: str) -> str | None:
    """Why the files under ``root`` are not commit ``head_sha``'s (``None`` when they are): the
    checkout is another commit, or a tracked file is changed or an untracked one (not ignored)
    is there.  The planner reads the registry and the imports from the files, so a plan named
    after ``head_sha`` must be made from exactly its files.  Raises :class:`GitError`."""
    root = Path(root)
    current = _git(root, "rev-parse", "--verify", "--quiet", "HEAD^{commit}").strip()
    if current != head_sha:
        return f"the checkout is at {current[:12]}, not at {head_sha[:12]}"
    changed = [p for p in _git(root, "diff", "--name-only", "-z", "--no-ext-diff", "HEAD").split(
        "\0") if p]  # fmt: skip
    changed += [p for p in _git(root, "ls-files", "--others", "--exclude-standard", "-z").split(
        "\0") if p]  # fmt: skip
    if changed:
        return f"{len(changed)} file(s) differ from {head_sha[:12]} (first: {changed[0]!r})"
    return None


def files_containing(root: Path, rev: str, text: str, under: str) -> list[str]:
    """The paths under the folder ``under`` whose content at revision ``rev`` contains ``text``
    (``git grep -l -F``, no pathspec magic); :class:`GitError` when the revision is missing."""
    sha = resolve(root, rev)
    run = _git_start(root, "grep", "-l", "-z", "-F", "-e", text, sha, "--", f":(literal){under}/")
    try:
        out = run.result()
    except GitError:
        if run.proc.returncode == 1:  # git grep: nothing matched
            return []
        raise
    prefix = f"{sha}:"
    return [p[len(prefix) :] for p in out.split("\0") if p.startswith(prefix)]


def file_at(root: Path, rev: str, path: str) -> str:
    """The text of ``path`` as revision ``rev`` has it (``git show REV:PATH``); :class:`GitError`
    when the revision or the file is missing, or the file is not UTF-8 text."""
    text = _git(root, "show", f"{resolve(root, rev)}:{path}")
    if any(0xDC80 <= ord(c) <= 0xDCFF for c in text):  # undecodable bytes (surrogateescape)
        raise GitError(f"{path} at {rev} is not UTF-8 text")
    return text


def default_base(root: Path, main_branches=MAIN_BRANCHES) -> str:
    """The merge-base of HEAD with the first main branch that exists."""
    tried = []
    for branch in main_branches:
        try:
            resolve(root, branch)
        except GitError:
            tried.append(branch)
            continue
        return _git(root, "merge-base", "HEAD", branch).strip()
    raise GitError(
        f"no main branch to compare with (tried {', '.join(tried)}); fetch it "
        "(`git fetch origin main`) or pass --base"
    )


def parse_name_status(z_output: str) -> list[Entry]:
    """Entries of ``git diff --name-status -z`` output."""
    fields = z_output.split("\0")
    if fields and fields[-1] == "":
        fields.pop()
    entries: list[Entry] = []
    i = 0
    while i < len(fields):
        status = fields[i]
        kind = status[:1]
        if kind in ("R", "C"):
            if i + 2 >= len(fields):
                raise GitError(f"truncated rename record in git output: {fields[i:]!r}")
            entries.append(Entry(kind, fields[i + 2], fields[i + 1]))
            i += 3
        else:
            if i + 1 >= len(fields) or not kind:
                raise GitError(f"truncated record in git output: {fields[i:]!r}")
            entries.append(Entry("M" if kind in ("T", "U", "X") else kind, fields[i + 1]))
            i += 2
    return entries


def git_change(
    root: Path | str,
    base: str | None = None,
    head: str | None = None,
    *,
    main_branches=MAIN_BRANCHES,
) -> Change:
    """The change from ``base`` (default: merge-base with main) to ``head`` (default: the working
    tree, untracked files included).  Never raises: an unreadable diff is ``usable=False``."""
    root = Path(root)
    try:
        if base is not None and set(base) == {"0"}:
            return Change.unusable(f"base {base} is the null commit (a new branch)", base, head)
        if head is None:
            # The untracked files and HEAD do not depend on the base: ask git for them while
            # the base and the diff are computed (the same answers, in a fraction of the time).
            untracked_run = _git_start(root, "ls-files", "--others", "--exclude-standard", "-z")
            head_run = _git_start(root, "rev-parse", "--verify", "--quiet", "HEAD^{commit}")
            try:
                base_sha = resolve(root, base) if base else default_base(root, main_branches)
                diff = _git(root, "diff", "--name-status", "-z", "-M", "--no-ext-diff", base_sha)
                head_sha = head_run.result().strip()
                untracked = untracked_run.result()
            except GitError:
                untracked_run.discard()
                head_run.discard()
                raise
            entries = parse_name_status(diff)
            known = {e.path for e in entries}
            entries += [Entry("A", p) for p in untracked.split("\0") if p and p not in known]
            return replace(Change.from_entries(base_sha, head_sha, entries), worktree=True)
        base_sha = resolve(root, base) if base else default_base(root, main_branches)
        head_sha = resolve(root, head)
        diff = _git(root, "diff", "--name-status", "-z", "-M", "--no-ext-diff", base_sha, head_sha)
        return Change.from_entries(base_sha, head_sha, parse_name_status(diff))
    except GitError as e:
        what = f"base {base!r}" if base else "the default base"
        return Change.unusable(f"cannot read the diff from {what}: {e}", base, head)


def ignored_paths(root: Path) -> tuple[str, ...]:
    """The untracked paths of the working tree that git ignores (``.gitignore``, the repository's
    exclude file: ``git status --ignored=matching``, an ignored folder is one path).  They are
    never part of a change; the planner names them so that a file it does not plan is no
    surprise.  :class:`GitError` when git fails."""
    out = _git(root, "status", "--porcelain=v1", "-z", "--ignored=matching")
    paths = (record[3:] for record in out.split("\0") if record.startswith("!! "))
    return tuple(sorted(paths, key=lambda p: (p.count("/"), p)))


def tree_files(root: Path, rev: str, under: str) -> list[str]:
    """The regular files (not links, not submodules) under the folder ``under`` at revision
    ``rev`` (``git ls-tree -r``); :class:`GitError` when the revision is missing."""
    out = _git(root, "ls-tree", "-r", "-z", resolve(root, rev), "--", f":(literal){under}/")
    files = []
    for record in out.split("\0"):
        meta, _, path = record.partition("\t")
        if path and meta.split(" ")[0] in ("100644", "100755"):
            files.append(path)
    return files


def blobs_at(root: Path, rev: str, paths: list[str]) -> dict[str, bytes]:
    """The bytes of each of ``paths`` at revision ``rev`` that is a file there (one ``git
    cat-file --batch`` for all of them); :class:`GitError` when git fails."""
    sha = resolve(root, rev)
    wanted = [p for p in paths if "\n" not in p]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env["GIT_OPTIONAL_LOCKS"] = "0"
    try:
        done = subprocess.run(
            ["git", "-C", str(root), "cat-file", "--batch"],
            input="".join(f"{sha}:{p}\n" for p in wanted).encode("utf-8", "surrogateescape"),
            capture_output=True, env=env, timeout=120, check=False,
        )  # fmt: skip
    except (FileNotFoundError, subprocess.TimeoutExpired) as e:
        raise GitError(f"`git cat-file --batch` failed: {e}") from None
    if done.returncode != 0:
        raise GitError(f"`git cat-file --batch` failed: {done.stderr.decode(errors='replace')}")
    out, at, blobs = done.stdout, 0, {}
    for path in wanted:
        end = out.index(b"\n", at)
        header = out[at:end].split(b" ")
        at = end + 1
        if len(header) == 3:  # SHA TYPE SIZE, then the object (else: SPEC missing)
            size = int(header[2])
            if header[1] == b"blob":
                blobs[path] = out[at : at + size]
            at += size + 1
    return blobs
