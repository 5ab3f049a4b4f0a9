"""The registry, read through a cache keyed by each test file's content hash.

:func:`read_registry_cached` returns exactly what :func:`mizzen_ci.registry.read_registry` returns
(it calls it for every file it has no answer for); the cache only remembers answers.

Invariants:
- An answer is reused only for the same path and file bytes (sha256), the same fleet table and the
  same registry code (the sha256 of ``registry.py`` and of the ``register_*`` signatures'
  module): a change to any of them re-reads.
- A stat fast path (size + mtime_ns, trusted only for files older than 2 s before the cache was
  written, as git's index does) avoids reading unchanged files; a touched but unchanged file
  costs a hash, never a parse.
- The cache file is written atomically (temporary file + rename) and only when something changed;
  a cache that cannot be read or written is ignored: the answer is the same, only slower.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import fields
from pathlib import Path

from . import __file__ as _package_init
from . import registry as _registry
from .fleet import Fleet
from .registry import (
    SKIP_DIRS,
    Registration,
    Registry,
    RegistryError,
    is_excluded,
    registry_excludes,
)

_FORMAT = 2
_RACY_WINDOW_NS = 2_000_000_000


def _code_key(fleet: Fleet) -> str:
    h = hashlib.sha256()
    for path in (Path(_registry.__file__), Path(_package_init), fleet.path):
        try:
            h.update(path.read_bytes())
        except OSError:
            h.update(str(path).encode())
    return h.hexdigest()


_REG_FIELDS = tuple(f.name for f in fields(Registration))
_ERR_FIELDS = tuple(f.name for f in fields(RegistryError))
_TUPLES = frozenset(f.name for f in fields(Registration) if str(f.type).startswith("tuple"))


def _encode(reg: Registration | None, errors: list[RegistryError]) -> list:
    """Compact JSON: field values in declaration order (the format key covers the order)."""
    row = None if reg is None else [getattr(reg, f) for f in _REG_FIELDS]
    return [row, [[getattr(e, f) for f in _ERR_FIELDS] for e in errors]]


def _decode(data: list) -> tuple[Registration | None, list[RegistryError]]:
    row, errors = data
    reg = None
    if row is not None:
        values = dict(zip(_REG_FIELDS, row, strict=True))
        for key in _TUPLES:
            values[key] = tuple(values[key])
        reg = Registration(**values)
    return reg, [RegistryError(*e) for e in errors]


def discover_fast(root: Path, excludes=()) -> list[str]:
    """What :func:`mizzen_ci.registry.discover` returns (the same rules, its constants), walked
    with ``os.scandir`` on strings: on a tree of 15,000 files pathlib costs a second here."""
    excludes = tuple(excludes)
    found: list[str] = []
    stack = [(str(root), "")]
    while stack:
        path, rel_dir = stack.pop()
        try:
            entries = list(os.scandir(path))
        except OSError:
            continue
        for e in entries:
            rel = f"{rel_dir}{e.name}"
            if e.is_dir():
                name = e.name
                if name.startswith(".") or name in SKIP_DIRS or name.endswith(".egg-info"):
                    continue
                if (excludes and is_excluded(rel, excludes)) or os.path.exists(
                    os.path.join(e.path, "pyvenv.cfg")
                ):
                    continue
                stack.append((e.path, rel + "/"))
            elif (
                e.name.startswith("test_")
                and e.name.endswith(".py")
                and not (excludes and is_excluded(rel, excludes))
            ):
                found.append(rel)
    return sorted(found)


def read_registry_cached(root: Path, fleet: Fleet, cache_path: Path | None) -> Registry:
    """The registry of ``root`` (every discovered test file), reusing cached answers."""
    root = root.resolve()
    rels = discover_fast(root, registry_excludes(root))
    if cache_path is None:
        return _registry.read_registry(root, fleet, rels)
    key = _code_key(fleet)
    stat_index: dict[str, list] = {}
    answers: dict[str, list] = {}
    written_ns = 0
    try:
        data = json.loads(cache_path.read_bytes())
        if data.get("format") == _FORMAT and data.get("code") == key:
            stat_index, answers, written_ns = data["files"], data["answers"], data["written_ns"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass

    seen: dict[str, list] = {}
    results: dict[str, list] = {}
    misses: list[str] = []
    miss_shas: dict[str, str] = {}
    for rel in rels:
        path = root / rel
        try:
            st = os.stat(path)
        except OSError:
            misses.append(rel)
            continue
        old = stat_index.get(rel)
        sha = None
        if (
            old is not None
            and old[0] == st.st_size
            and old[1] == st.st_mtime_ns
            and st.st_mtime_ns < written_ns - _RACY_WINDOW_NS
        ):
            sha = old[2]
        if sha is None or f"{sha}:{rel}" not in answers:
            try:
                sha = hashlib.sha256(path.read_bytes()).hexdigest()
            except OSError:
                misses.append(rel)
                continue
        seen[rel] = [st.st_size, st.st_mtime_ns, sha]
        answer = answers.get(f"{sha}:{rel}")  # the answer names the path: keyed by both
        if answer is not None:
            results[rel] = answer
        else:
            misses.append(rel)
            miss_shas[rel] = sha

    fresh = _read_many(root, fleet, misses)
    by_path_errors = fresh.errors_by_path()
    by_path_regs = fresh.by_path()
    for rel in misses:
        encoded = _encode(by_path_regs.get(rel), by_path_errors.get(rel, []))
        results[rel] = encoded
        if rel in miss_shas:
            answers[f"{miss_shas[rel]}:{rel}"] = encoded

    registry = Registry(root)
    for rel in rels:
        reg, errors = _decode(results[rel])
        if reg is not None:
            registry.registrations.append(reg)
        registry.errors.extend(errors)

    if (
        misses
        or set(seen) != set(stat_index)
        or any(stat_index.get(k) != v for k, v in seen.items())
    ):
        used = {f"{v[2]}:{rel}" for rel, v in seen.items()}
        _save(
            cache_path,
            {
                "format": _FORMAT,
                "code": key,
                "written_ns": time.time_ns(),
                "files": seen,
                "answers": {k: a for k, a in answers.items() if k in used},
            },
        )
    return registry


PARALLEL_MIN = 400  # files to read before a process pool pays for its start-up


def _read_chunk(args: tuple[Path, Fleet, list[str]]) -> Registry:
    return _registry.read_registry(*args)


def _read_many(root: Path, fleet: Fleet, rels: list[str], workers: int | None = None) -> Registry:
    """``read_registry(root, fleet, rels)``, spread over ``workers`` processes (default: the CPU
    count) when there are at least ``PARALLEL_MIN`` files; the same result either way."""
    workers = workers or os.cpu_count() or 1
    if workers < 2 or len(rels) < PARALLEL_MIN:
        return _registry.read_registry(root, fleet, rels)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    step = max(64, len(rels) // (workers * 4))
    chunks = [(root, fleet, rels[i : i + step]) for i in range(0, len(rels), step)]
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else None)
    try:
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            parts = list(pool.map(_read_chunk, chunks))
    except (OSError, RuntimeError):  # no processes to be had (sandbox, limits): read here
        return _registry.read_registry(root, fleet, rels)
    out = Registry(root)
    for part in parts:
        out.registrations += part.registrations
        out.errors += part.errors
    return out


def _save(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, separators=(",", ":")), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:  # a read-only checkout plans as well, only slower next time
        tmp.unlink(missing_ok=True)
