"""The content-hash cache of :class:`~.source_facts.FileFacts`, with a stat index,
per-file derived values and aggregate sections, read in parallel on a cold run.

``FactsCache(path=None, context="")`` keeps the FileFacts of :func:`.source_facts.extract`
by the sha256 of the file's bytes:

- ``facts_for(path, key)`` / ``facts_for_many([(path, key), ...])``: the facts of files; ``key``
  names the file in the stat index (e.g. its root-relative path).
- ``derive_iter([(path, key, arg), ...], derive)``: per file ``derive(key, arg, facts) ->
  (kept, extra)``, for a caller with per-file results of its own (the planner: a test file's
  validated registration is ``kept``, a module's resolved import names are ``extra``), as
  ``(index, (kept, extra))`` pairs in the order they are ready (a cold run's workers start before
  it returns).  ``kept`` is stored and reused by a later run for the same key, bytes, ``arg`` and
  cache ``context`` without looking at the facts at all (then ``extra`` is None); ``extra`` lives
  for this run only.  With nothing changed a run costs one ``stat`` per file and one cache load.
  With ``scan(key, arg, source) -> kept | None`` a file read afresh is first offered to ``scan``
  (where its bytes are: in a worker on a cold run): a value that is not None is the file's
  ``kept`` (``extra`` None), and the file is not parsed; None parses it as usual.  So a key's
  ``kept`` is one of two values for the same bytes and ``arg`` (the caller's ``scan`` and
  ``derive`` must both be answers it can use); ``scanned`` counts the files answered so.
  ``recomputed`` names the keys derived afresh, ``previous_derived()`` is what the last run kept, ``sha_of(key)`` a file's content hash in this run and ``facts_of(sha)`` the facts
  of any content this or the last run saw (to update an aggregate incrementally).
- ``section(name)`` / ``set_section(name, value)``: one aggregate value per name kept with the
  cache (the planner's reverse import index).  Saved only when set in this run and every kept
  value of the run is saved, so a section always agrees with the derived values beside it.
- Stat fast path: a file whose size and mtime_ns match the index and whose mtime is older than the
  previous save by more than 2 s (git's racy-timestamp rule) is trusted without reading; any
  other file is read and hashed, and parsed only when its content is new.
- Files to read are read, hashed and parsed in ``workers`` forked processes (default: the CPU
  count) when there are at least :data:`PARALLEL_MIN` of them (a cold run), else in this process.
- ``save()`` writes one ``marshal`` file atomically (temporary file + rename), and only when
  something changed; facts and kept values are stored as blobs decoded only when a run needs
  them.  A scanned file is kept by its stat entry and kept value (it has no facts).  Files not looked at are dropped (``save(keep_unseen=True)``: kept as they were).  A
  directory the cache creates gets a ``.gitignore`` of ``*``.
- Workers are forked (they inherit the job, nothing is pickled to them), skip the cyclic GC, take
  small chunks (no long single-core tail) and send results back marshalled.

Invariants:
- A FileFacts depends only on the bytes; a kept value only on (key, bytes, ``arg``, ``context``).
  A cache written by another format, another Python minor or another version of the extraction
  and validation code (the sha256 of :data:`CODE_MODULES`) is ignored, and its kept values and
  sections when its ``context`` differs: a stale answer is never served.
- A cache that cannot be read is ignored (the answer is the same, only slower); a value ``marshal``
  cannot store is simply not kept.
- The cache file is this user's own state: it is sealed with an HMAC under this user's key
  (:mod:`.cache_home`), and a file whose seal does not verify is never unmarshalled (``marshal``
  is not meant for data from strangers), so a cache planted in the tree, copied from elsewhere
  or truncated is ignored.  A verified file's parts are still checked for shape before use (a
  stat entry, a stored FileFacts, a kept value through the caller's ``valid_kept``): a row of
  the wrong shape is a miss, never a wrong answer or a crash.  Without a usable key nothing is
  read or written.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import marshal
import os
import stat
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from ... import __file__ as _register_functions
from ... import sources
from ...imports import facts as _import_facts
from ...imports import loaders as _loaders
from ...imports import path_literals as _path_literals
from ...registry import model as _registry_model
from ...registry import rules as _registry_rules
from ...registry import syntax as _registry_syntax
from ...sources import read_bytes
from . import source_facts
from .cache_home import seal, unseal, user_key
from .source_facts import FileFacts, extract, unreadable

PARALLEL_MIN = 400  # files to read before worker processes pay for their start-up
_FORMAT = 5
_RACY_WINDOW_NS = 2_000_000_000


# The modules whose code decides the facts and the validated registrations a cache keeps.
CODE_MODULES = (
    __file__,
    source_facts.__file__,
    _import_facts.__file__,
    _loaders.__file__,
    _path_literals.__file__,
    _registry_syntax.__file__,
    _registry_rules.__file__,
    _registry_model.__file__,
    _register_functions,
    sources.__file__,
)
_CODE_KEY: str | None = None


def _code_key() -> str:
    """sha256 of :data:`CODE_MODULES` (a change to any of them re-reads every file)."""
    global _CODE_KEY
    if _CODE_KEY is None:
        h = hashlib.sha256()
        for path in CODE_MODULES:
            try:
                with open(path, "rb") as f:
                    h.update(f.read())
            except OSError:
                h.update(str(path).encode())
        _CODE_KEY = h.hexdigest()
    return _CODE_KEY


Derive = Callable[[str, object, FileFacts], tuple[object, object]]
Scan = Callable[[str, object, bytes], object]
_Item = tuple[str | Path, str, object]  # (path, key, arg)
_JOB: tuple | None = None  # (cache, items, todo, derive, scan): inherited by forked workers
# How a file read afresh was answered (the last field of a `_read_one` result).
_DERIVED, _REUSED, _SCANNED = 0, 1, 2


def _is_stat_entry(entry: object) -> bool:
    return (
        type(entry) is tuple
        and len(entry) == 3
        and type(entry[0]) is int
        and type(entry[1]) is int
        and type(entry[2]) is str
        and len(entry[2]) == 64
    )


def _is_file_facts(facts: FileFacts) -> bool:
    """The shape :func:`.source_facts.extract` gives (read back from a cache)."""
    if not isinstance(facts, tuple) or len(facts) != len(FileFacts._fields):
        return False
    imports, error, error_line, bound, registration, dynamic, paths, syspath, opaque = facts
    return (
        type(imports) is tuple
        and all(type(i) is tuple and len(i) == 7 for i in imports)
        and (error is None or type(error) is str)
        and type(error_line) is int
        and (bound is None or type(bound) is frozenset)
        and type(registration) is tuple
        and len(registration) == 2
        and type(dynamic) is int
        and type(paths) is tuple
        and all(type(p) is str for p in paths)
        and type(syspath) is tuple
        and all(type(p) is str for p in syspath)
        and type(opaque) is str
    )


def _loads(blob: bytes | None, kind: type) -> object | None:
    if blob is None:
        return None
    try:
        value = marshal.loads(blob)
    except (ValueError, EOFError, TypeError):
        return None
    return value if isinstance(value, kind) else None


class FactsCache:
    """FileFacts keyed by content hash, a stat index by key, kept derived values and sections;
    see the module docstring.  ``hits`` / ``parsed`` / ``scanned`` count what the lookups
    needed."""

    def __init__(
        self,
        path: Path | str | None = None,
        context: str = "",
        *,
        key: bytes | None = None,
        valid_kept: Callable[[object, object], bool] | None = None,
    ):
        """``key``: the sealing key (default: this user's, :func:`.cache_home.user_key`);
        ``valid_kept(arg, kept)``: whether a kept value read back has the shape the caller's
        ``derive`` gives (default: any value)."""
        self.path = Path(path) if path is not None else None
        self.context = context
        self._key = key if key is not None or self.path is None else user_key()
        if self.path is not None and self._key is None:
            self.path = None  # no safe key: a cache nobody can trust is neither read nor written
        self._valid_kept = valid_kept or (lambda arg, kept: True)
        self.hits = 0
        self.parsed = 0
        self.scanned = 0
        self.recomputed: set[str] = set()  # keys derived afresh in this run
        self._stat: dict[str, tuple] = {}  # key -> (size, mtime_ns, sha) as last saved
        self._written_ns = 0
        self._facts_blob: bytes | None = None  # marshal of {sha: marshal of FileFacts}
        self._stored: dict[str, bytes] | None = None  # that blob, decoded on first need
        self._facts: dict[str, FileFacts] = {}  # sha -> facts in memory
        self._raw: dict[str, bytes] = {}  # sha -> marshalled facts parsed by a worker this run
        self._derived_blob: bytes | None = None  # marshal of {key: (sha, arg, kept)}
        self._derived: dict[str, tuple] | None = None  # that blob, decoded on first need
        self._sections: dict[str, object] = {}  # as last saved
        self._seen: dict[str, tuple] = {}  # key -> (size, mtime_ns, sha) in this run
        self._new_derived: dict[str, tuple] = {}
        self._new_sections: dict[str, object] = {}
        self._dirty = False
        if self.path is not None:
            self._load()

    # ---- loading

    def _load(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return
                with os.fdopen(fd, "rb", closefd=False) as f:
                    sealed = f.read()
            finally:
                os.close(fd)
        except OSError:
            return
        blob = unseal(self._key, sealed)
        if blob is None:
            return  # not written by this user's mizzen-ci: never unmarshalled
        try:
            data = marshal.loads(blob)
        except (ValueError, EOFError, TypeError):
            return
        if (
            not isinstance(data, dict)
            or data.get("format") != _FORMAT
            or data.get("python") != tuple(sys.version_info[:2])
            or data.get("code") != _code_key()
        ):
            return
        files, facts, written = data.get("files"), data.get("facts"), data.get("written_ns")
        if not (isinstance(files, dict) and isinstance(facts, bytes) and isinstance(written, int)):
            return
        if not all(type(k) is str and _is_stat_entry(v) for k, v in files.items()):
            return
        self._stat, self._facts_blob, self._written_ns = files, facts, written
        if data.get("context") == self.context:
            derived, sections = data.get("derived"), data.get("sections")
            self._derived_blob = derived if isinstance(derived, bytes) else None
            self._sections = sections if isinstance(sections, dict) else {}

    def _stored_facts(self) -> dict[str, bytes]:
        if self._stored is None:
            self._stored = _loads(self._facts_blob, dict) or {}
        return self._stored

    def previous_derived(self) -> dict[str, tuple]:
        """``{key: (sha, arg, kept)}`` as the last run saved them (same context), read-only."""
        if self._derived is None:
            self._derived = _loads(self._derived_blob, dict) or {}
        return self._derived

    def facts_of(self, sha: str) -> FileFacts | None:
        """The facts of content ``sha`` if this cache has them (seen in this or the last run)."""
        facts = self._facts.get(sha)
        if facts is None:
            raw = self._raw.get(sha) or self._stored_facts().get(sha)
            if raw is None:
                return None
            try:
                facts = FileFacts._make(marshal.loads(raw))
            except (ValueError, EOFError, TypeError):
                return None
            if not _is_file_facts(facts):
                return None
            self._facts[sha] = facts
        return facts

    def _reusable(self, kept_row: object, sha: str, arg: object) -> bool:
        """Whether a kept row of the last run answers this file: same content and ``arg``, and a
        kept value of the shape ``derive`` gives."""
        return (
            type(kept_row) is tuple
            and len(kept_row) == 3
            and kept_row[0] == sha
            and kept_row[1] == arg
            and self._valid_kept(arg, kept_row[2])
        )

    def sha_of(self, key: str) -> str | None:
        """The content hash of ``key`` as this run saw it (None: not seen or unreadable)."""
        entry = self._seen.get(key)
        return entry[2] if entry is not None else None

    # ---- lookups

    def facts_for(self, path: Path | str, key: str) -> FileFacts:
        return self.facts_for_many([(path, key)])[0]

    def facts_for_many(
        self, items: Sequence[tuple[Path | str, str]], workers: int | None = None
    ) -> list[FileFacts]:
        """The facts of each ``(path, key)``; unknown contents are parsed once each."""
        out: list = [None] * len(items)
        for i, facts in self._run([(path, key, None) for path, key in items], None, workers):
            out[i] = facts
        return out

    def derive_iter(
        self,
        items: Sequence[_Item],
        derive: Derive,
        workers: int | None = None,
        scan: Scan | None = None,
    ) -> Iterator[tuple[int, tuple[object, object]]]:
        """``(index in items, (kept, extra))`` of each ``(path, key, arg)``: from
        ``derive(key, arg, facts)``, or ``(kept, None)`` reused from the last run when the key's
        content, ``arg`` and the cache context are the same; ``derive`` runs where the facts are
        (in a worker process on a cold run): it must be a pure function of its arguments.  Pairs
        come in the order they
        are ready (workers finish in any order), so that a caller can use each while the rest
        is being parsed.  On a cold cache the reading starts before this returns, so the
        caller can do other work first.  Every index comes once; consume it to the end.
        ``scan``: see the module docstring."""
        return self._run(items, derive, workers, scan)

    def section(self, name: str) -> object | None:
        """The aggregate ``name`` as the last run saved it (same context), or None."""
        return self._sections.get(name)

    def set_section(self, name: str, value: object, *, modified: bool = True) -> None:
        """Keep ``value`` as section ``name`` (``modified=False``: the loaded value, unchanged,
        kept without forcing a write)."""
        self._new_sections[name] = value
        if modified:
            self._dirty = True

    def _run(
        self,
        items: Sequence[_Item],
        derive: Derive | None,
        workers: int | None,
        scan: Scan | None = None,
    ) -> Iterator[tuple[int, object]]:
        """``(i, facts or (kept, extra))`` for every item, as ready: first those the stat index
        vouches for, then those read here or in workers."""
        if not self._stat:  # nothing known (a cold run): read every file, starting now
            return self._read_many(items, list(range(len(items))), derive, workers, scan)
        return self._vouch_then_read(items, derive, workers, scan)

    def _vouch_then_read(
        self,
        items: Sequence[_Item],
        derive: Derive | None,
        workers: int | None,
        scan: Scan | None,
    ) -> Iterator[tuple[int, object]]:
        todo: list[int] = []
        stat_get, facts_of = self._stat.get, self.facts_of
        derived_get = self.previous_derived().get if derive is not None else None
        seen, new_derived = self._seen, self._new_derived
        trusted_before = self._written_ns - _RACY_WINDOW_NS
        for i, (path, key, arg) in enumerate(items):
            try:
                st = os.stat(path)
            except OSError:
                todo.append(i)  # reported as unreadable where it is read
                continue
            old = stat_get(key)
            if (
                old is None
                or old[0] != st.st_size
                or old[1] != st.st_mtime_ns
                or st.st_mtime_ns >= trusted_before
            ):
                todo.append(i)
                continue
            sha = old[2]
            if derived_get is not None:
                d = derived_get(key)
                if self._reusable(d, sha, arg):
                    seen[key] = old
                    new_derived[key] = d
                    self.hits += 1
                    yield i, (d[2], None)
                    continue
            facts = facts_of(sha)
            if facts is None:
                todo.append(i)
                continue
            seen[key] = old
            self.hits += 1
            if derive is None:
                yield i, facts
            else:
                value = derive(key, arg, facts)
                new_derived[key] = (sha, arg, value[0])
                self.recomputed.add(key)
                self._dirty = True
                yield i, value
        if todo:
            yield from self._read_many(items, todo, derive, workers, scan)

    def _read_many(
        self,
        items: Sequence[_Item],
        todo: list[int],
        derive: Derive | None,
        workers: int | None,
        scan: Scan | None,
    ) -> Iterator[tuple[int, object]]:
        """Read, hash and (for new content) parse ``items[i]`` for ``i`` in ``todo`` (the
        workers, when there are enough files for them, start at once); results are recorded as
        they come (from workers, in any order; here, before the next read)."""
        results = _in_workers(self, items, todo, derive, workers, scan)
        if results is None:
            results = ((i, _read_one(self, *items[i], derive, scan)) for i in todo)
        return self._record(items, results, derive)

    def _record(
        self, items: Sequence[_Item], results: Iterator, derive: Derive | None
    ) -> Iterator[tuple[int, object]]:
        for i, (entry, parsed, value, how) in results:
            _, key, arg = items[i]
            if entry is None:  # unreadable: nothing to key it by, so nothing is kept
                if derive is not None:
                    self.recomputed.add(key)
                    yield i, value
                else:
                    yield (
                        i,
                        FileFacts._make(marshal.loads(parsed) if type(parsed) is bytes else parsed),
                    )
                self._dirty = True
                continue
            sha = entry[2]
            if self._stat.get(key) != entry:
                self._dirty = True
            self._seen[key] = entry
            if parsed is not None and sha not in self._facts and sha not in self._raw:
                if type(parsed) is bytes:  # from a worker: kept marshalled until needed
                    self._raw[sha] = parsed
                else:
                    self._facts[sha] = parsed
                self.parsed += 1
            elif how == _SCANNED:
                self.scanned += 1
            else:
                self.hits += 1
            if derive is None:
                yield i, self.facts_of(sha)
                continue
            if how == _REUSED:
                self._new_derived[key] = self.previous_derived()[key]
            else:
                self._new_derived[key] = (sha, arg, value[0])
                self.recomputed.add(key)
                self._dirty = True
            yield i, value

    # ---- saving

    def save(self, keep_unseen: bool = False) -> None:
        """Write the cache (atomically) if it has a path and something changed.  Files not
        looked at in this run are dropped, or kept as they were with ``keep_unseen`` (a run
        that looked at a part of the tree only); sections are kept only when set in this run."""
        if self.path is None:
            return
        if not self._dirty and (
            self._seen.keys() == self._stat.keys()
            or (keep_unseen and self._seen.keys() <= self._stat.keys())
        ):
            return
        stored = self._stored_facts()
        facts: dict[str, bytes] = {}
        files: dict[str, tuple] = {}
        seen = self._seen
        if keep_unseen:
            previous = self.previous_derived()
            seen = {**{k: v for k, v in self._stat.items() if k not in seen}, **seen}
            for key in seen.keys() - self._seen.keys():
                if key in previous:
                    self._new_derived.setdefault(key, previous[key])
        for key, entry in seen.items():
            sha = entry[2]
            if sha not in facts:
                raw = self._raw.get(sha) or (stored.get(sha) if sha not in self._facts else None)
                if raw is None:
                    f = self.facts_of(sha)
                    try:
                        raw = marshal.dumps(tuple(f)) if f is not None else None
                    except ValueError:  # a literal marshal cannot store: re-read next time
                        raw = None
                if raw is not None:
                    facts[sha] = raw
                elif key not in self._new_derived:
                    continue  # nothing to answer it from: read again next time
            files[key] = entry
        derived = {k: v for k, v in self._new_derived.items() if k in files}
        sections = self._new_sections
        try:  # version 2: no reference table (its values are mostly distinct; twice as fast)
            derived_blob = marshal.dumps(derived, 2)
        except ValueError:  # a kept value marshal cannot store: keep none (re-derived next time)
            derived, derived_blob = {}, marshal.dumps({})
        if len(derived) != len(self._new_derived):
            sections = {}  # a section may aggregate every kept value: keep it only with all
        data = {
            "format": _FORMAT,
            "python": tuple(sys.version_info[:2]),
            "code": _code_key(),
            "written_ns": time.time_ns(),
            "files": files,
            "facts": marshal.dumps(facts),
            "context": self.context,
            "derived": derived_blob,
            "sections": sections,
        }
        try:
            blob = marshal.dumps(data)
        except ValueError:  # a section marshal cannot store: keep the rest
            data["sections"] = sections = {}
            blob = marshal.dumps(data)
        if not self.path.parent.is_dir():
            # A directory we create holds only caches: keep it out of git from the start.
            self.path.parent.mkdir(parents=True)
            (self.path.parent / ".gitignore").write_text("# created by mizzen-ci\n*\n")
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(seal(self._key, blob))
            os.replace(tmp, self.path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        self._stat, self._written_ns, self._dirty = files, data["written_ns"], False
        self._facts_blob, self._stored, self._raw = data["facts"], facts, {}
        self._derived_blob, self._derived, self._sections = derived_blob, derived, sections


# --------------------------------------------------------------------------------------------
# Reading files, here or in forked workers.


def _read_one(
    cache: FactsCache,
    path: Path | str,
    key: str,
    arg: object,
    derive: Derive | None,
    scan: Scan | None = None,
) -> tuple[tuple | None, FileFacts | None, object, int]:
    """``(stat entry or None if unreadable, facts if parsed here or unreadable, (kept, extra) or
    None, how: _DERIVED, _REUSED (kept is the last run's) or _SCANNED)`` of one file."""
    try:
        source, st = read_bytes(path)
    except OSError as e:
        facts = unreadable(e)
        return None, facts, derive(key, arg, facts) if derive is not None else None, _DERIVED
    sha = hashlib.sha256(source).hexdigest()
    entry = (st.st_size, st.st_mtime_ns, sha)
    if derive is not None and cache._stat:
        d = cache.previous_derived().get(key)
        if cache._reusable(d, sha, arg):
            return entry, None, (d[2], None), _REUSED
    if scan is not None and derive is not None:
        kept = scan(key, arg, source)
        if kept is not None:
            return entry, None, (kept, None), _SCANNED
    facts = cache.facts_of(sha)
    parsed = None
    if facts is None:
        facts = parsed = extract(source, os.fspath(path))
    return entry, parsed, derive(key, arg, facts) if derive is not None else None, _DERIVED


def _read_chunk(bounds: tuple[int, int]) -> tuple[int, bytes | list]:
    """In a worker: ``_read_one`` of ``todo[start:end]`` of the job, as ``(start, results)``.
    New facts go back marshalled (the form the cache stores), and the whole list too when
    ``marshal`` can hold it (cheaper than pickling it); else the list itself."""
    cache, items, todo, derive, scan = _JOB
    out = []
    for i in todo[bounds[0] : bounds[1]]:
        entry, parsed, value, how = _read_one(cache, *items[i], derive, scan)
        if parsed is not None:
            with contextlib.suppress(ValueError):  # an unmarshallable literal: send the object
                parsed = marshal.dumps(tuple(parsed))
        out.append((entry, parsed, value, how))
    try:
        return bounds[0], marshal.dumps(out)
    except ValueError:
        return bounds[0], out


def _in_workers(
    cache: FactsCache,
    items: Sequence[_Item],
    todo: list[int],
    derive: Derive | None,
    workers: int | None,
    scan: Scan | None = None,
) -> Iterator[tuple[int, tuple]] | None:
    """``(i, _read_one(items[i]))`` for each ``i`` of ``todo``, from forked worker processes as
    they finish; None when there are too few files to pay for the processes or no processes can
    be had (then the caller reads them itself)."""
    global _JOB
    workers = workers or os.cpu_count() or 1
    if workers < 2 or len(todo) < PARALLEL_MIN:
        return None
    import multiprocessing

    if "fork" not in multiprocessing.get_all_start_methods():
        return None  # the workers inherit the job; without fork, read here
    _JOB = (cache, items, todo, derive, scan)
    try:
        # Workers skip the cyclic GC: parse trees are acyclic and freed by reference counting,
        # and a collection would touch (copy) every page inherited from this process.
        pool = multiprocessing.get_context("fork").Pool(workers, initializer=gc.disable)
    except (OSError, RuntimeError):  # no processes to be had (sandbox, limits): read here
        _JOB = None
        return None
    step = max(32, -(-len(todo) // (workers * 32)))  # small chunks: no long single-core tail
    chunks = [(i, min(i + step, len(todo))) for i in range(0, len(todo), step)]
    return _collect(pool, pool.imap_unordered(_read_chunk, chunks), todo)  # submitted now


def _collect(pool, parts: Iterator, todo: list[int]) -> Iterator[tuple[int, tuple]]:
    global _JOB
    try:
        for start, part in parts:
            if type(part) is bytes:
                part = marshal.loads(part)
            for k, result in enumerate(part, start):
                yield todo[k], result
    finally:
        pool.terminate()
        pool.join()
        _JOB = None
