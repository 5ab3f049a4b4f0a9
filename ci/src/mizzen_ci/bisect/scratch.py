"""Scratch trees: a temporary copy or clone of the user's repository where tests run, and the
one way to run pytest in such a tree.

Invariants:
- The user's work tree, index, branch and refs are never written: a scratch clone is
  ``git clone --shared --no-checkout`` into a temporary folder (it reads the user's objects,
  writes only its own), a scratch copy copies the files git lists (tracked and untracked, not
  ignored); both are removed when their ``with`` block ends, by an exception (``KeyboardInterrupt``
  from SIGINT included) or not.
- Tests in a scratch tree import that tree's code: its workspace source folders come first on
  ``PYTHONPATH`` (:func:`tree_pythonpath`), before any editable install of the interpreter.
- Revisions given by the user are resolved in the user's repository to full SHAs first
  (:func:`resolve`); a name that is no commit is a :class:`ScratchError`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..imports import workspace_source_dirs

CPU_TEST_ENV = {
    "CUDA_VISIBLE_DEVICES": "",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "MIZZEN_LANE": "cpu",
}
GIT_TIMEOUT_S = 300


class ScratchError(RuntimeError):
    """git could not give a scratch tree or resolve a revision; the message says what to do."""


def git(root: Path, *args: str, check: bool = True) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env |= {"GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0"}
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              env=env, timeout=GIT_TIMEOUT_S, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ScratchError(f"git {args[0]} could not run in {root} ({e})") from None
    if check and done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise ScratchError(f"git {' '.join(args[:2])} failed in {root}: {last}")
    return done.stdout.strip()


def resolve(root: Path, revision: str) -> str:
    """The full SHA of the commit ``revision`` names in ``root``."""
    if not revision or revision.startswith("-") or any(ord(c) < 32 for c in revision):
        raise ScratchError(f"{revision!r} is no revision; give a commit SHA, a branch or a tag")
    sha = git(root, "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}", check=False)
    if len(sha) != 40:
        raise ScratchError(f"{revision!r} names no commit in {root}; fetch it or fix the name")
    return sha


@contextlib.contextmanager
def scratch_clone(root: Path, revision: str) -> Iterator[Path]:
    """A temporary clone of ``root`` checked out (detached) at ``revision`` (a full SHA)."""
    with tempfile.TemporaryDirectory(prefix="mizzen-scratch-") as tmp:
        tree = Path(tmp) / "tree"
        git(root, "clone", "--quiet", "--shared", "--no-checkout", str(root.resolve()), str(tree))
        git(tree, "-c", "advice.detachedHead=false", "checkout", "--quiet", "--detach", revision)
        yield tree


@contextlib.contextmanager
def scratch_copy(root: Path) -> Iterator[Path]:
    """A temporary copy of the files of ``root`` git lists (tracked, and untracked unignored)."""
    listed = git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    with tempfile.TemporaryDirectory(prefix="mizzen-scratch-") as tmp:
        tree = Path(tmp) / "tree"
        for rel in sorted(set(filter(None, listed.split("\0")))):
            source = root / rel
            if source.is_symlink() or not source.is_file():
                continue
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, tree / rel)
        yield tree


def tree_pythonpath(tree: Path) -> str:
    """``PYTHONPATH`` with the tree's own source folders first (see the module docstring)."""
    outer = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    src = [str(d) for d in workspace_source_dirs(tree)]
    return os.pathsep.join(dict.fromkeys([*src, *outer]))


def run_pytest(
    tree: Path, args: Iterable[str], *, python: str = sys.executable, timeout: float = 900,
    quiet: bool = True,
) -> int:  # fmt: skip
    """pytest's exit status for ``args`` in ``tree`` (CPU lane, the tree's code); 124 when it
    ran past ``timeout`` seconds."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COVERAGE_")}
    env |= CPU_TEST_ENV | {"PYTHONPATH": tree_pythonpath(tree)}
    command = [python, "-m", "pytest", "--mizzen-lane", "cpu", "-q", "-p", "no:cacheprovider",
               "-p", "no:xdist", *args]  # fmt: skip
    out = subprocess.DEVNULL if quiet else None
    try:
        return subprocess.run(command, cwd=tree, env=env, stdout=out, stderr=out,
                              timeout=timeout, check=False).returncode  # fmt: skip
    except subprocess.TimeoutExpired:
        return 124
