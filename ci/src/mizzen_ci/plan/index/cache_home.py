"""Where the planner's caches live, and how a cache proves this user's mizzen-ci wrote it.

A cache can make a plan faster, never different; a pull request can add any file to the work
tree, so nothing it can write may be believed as a cache:

- The default cache directory is outside the work tree: ``$XDG_CACHE_HOME/mizzen-ci/plan/<id>``
  (``~/.cache`` without XDG), ``<id>`` a hash of the tree's path.
- A cache directory given inside the work tree must be one git ignores and that holds no file git
  tracks (:func:`check_cache_dir`); anything else is refused with the path and the fix.
- Every cache file is authenticated: an HMAC-SHA256 over its bytes under a key only this user
  holds (``$XDG_CACHE_HOME/mizzen-ci/key``, created with mode 0600 from ``os.urandom``).  A file
  without a valid tag — planted, copied from elsewhere, truncated — is never unmarshalled (marshal
  is not meant for data from strangers): it is ignored, and the plan is made from the files.  A
  key file that is not a regular file owned by this user with mode 0600 is not used, and then no
  cache is read or written.

Stdlib only (``hmac``, ``hashlib``, ``os``); nothing here raises for a missing or broken cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import stat
import subprocess
from pathlib import Path

KEY_BYTES = 32
TAG_BYTES = 32
MAGIC = b"mzcache1"


class CacheDirError(ValueError):
    """A cache directory that files of the change could occupy; the message says the fix."""


def cache_home() -> Path:
    """``$XDG_CACHE_HOME/mizzen-ci`` (``~/.cache/mizzen-ci`` without XDG)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mizzen-ci"


def default_cache_dir(root: Path) -> Path:
    """The plan cache of the tree at ``root``: outside it, one directory per tree."""
    tree = hashlib.sha256(os.fsencode(Path(root).resolve())).hexdigest()[:16]
    return cache_home() / "plan" / tree


def check_cache_dir(root: Path, directory: Path) -> None:
    """Refuse a cache directory inside the work tree that git does not ignore or where git
    tracks a file (a pull request could have committed the cache it wants believed)."""
    root, directory = Path(root).resolve(), Path(directory).resolve()
    if directory != root and root not in directory.parents:
        return
    rel = directory.relative_to(root).as_posix() or "."
    fix = "use the default cache (outside the tree) or an ignored, untracked directory"
    tracked = _git(root, "ls-files", "-z", "--", rel)
    if tracked is None:
        raise CacheDirError(f"--cache-dir {rel}: cannot ask git about it inside the tree; {fix}")
    if tracked:
        first = tracked.split("\0")[0]
        raise CacheDirError(f"--cache-dir {rel}: git tracks {first} there; {fix}")
    if _git(root, "check-ignore", "-q", "--", rel + "/x") is None:
        raise CacheDirError(f"--cache-dir {rel}: git does not ignore it; {fix}")


def _git(root: Path, *args: str) -> str | None:
    """The output of a git command in ``root``, or None when it fails."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    try:
        done = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, timeout=60, env=env
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.decode("utf-8", "surrogateescape") if done.returncode == 0 else None


def user_key() -> bytes | None:
    """This user's cache key, created on first use; None when it cannot be had safely."""
    home = cache_home()
    path = home / "key"
    with contextlib.suppress(OSError):
        home.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return _read_key(path)
    except OSError:
        return None
    try:
        os.write(fd, os.urandom(KEY_BYTES))
    finally:
        os.close(fd)
    return _read_key(path)


def _read_key(path: Path) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if (
            not stat.S_ISREG(st.st_mode)
            or st.st_uid != os.getuid()
            or st.st_mode & 0o077
            or st.st_size != KEY_BYTES
        ):
            return None
        key = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    return key if len(key) == KEY_BYTES else None


def seal(key: bytes, blob: bytes) -> bytes:
    """The bytes a cache file holds: a magic, the tag, the blob."""
    return MAGIC + hmac.new(key, blob, hashlib.sha256).digest() + blob


def unseal(key: bytes, data: bytes) -> bytes | None:
    """The blob of a sealed file, or None when its tag is not this key's."""
    head = len(MAGIC) + TAG_BYTES
    if len(data) < head or data[: len(MAGIC)] != MAGIC:
        return None
    tag, blob = data[len(MAGIC) : head], data[head:]
    if not hmac.compare_digest(tag, hmac.new(key, blob, hashlib.sha256).digest()):
        return None
    return blob
