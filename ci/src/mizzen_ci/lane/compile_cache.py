"""The persistent compile caches a GPU lane gives its children (TorchInductor's FX graph and
AOTAutograd caches, Triton's kernels, the CUDA driver's JIT cache, Python's bytecode), and the
cache hits and misses its children report back.

Where and keyed how:
- The root is ``$MIZZEN_COMPILE_CACHE_DIR`` if set (``off`` disables the cache: the children then
  get no cache variable from the lane), else ``$XDG_CACHE_HOME/mizzen-ci/compile`` (an absolute
  ``XDG_CACHE_HOME``), else ``~/.cache/mizzen-ci/compile``.
- Under it, one directory per set of things that make compiled artifacts incompatible
  (:func:`cache_key`): ``torch-<version>[+cu<NNN>|+rocm<X.Y>]-<devices>-py<MAJOR><MINOR>``,
  e.g. ``torch-2.11.0+cu130-sm90-py312`` or ``torch-2.5.1+rocm6.2-gfx942-py312``: torch's
  version, the CUDA/HIP version it was built for, the lane's GPUs (compute capabilities as
  ``sm<NN>[_<NN>…]``, AMD ISA names as they are: :mod:`.hardware`) and the Python version.  It holds
  ``inductor/`` (``TORCHINDUCTOR_CACHE_DIR``), ``triton/`` (``TRITON_CACHE_DIR``), ``cuda/``
  (``CUDA_CACHE_PATH``) and ``bytecode/`` (``PYTHONPYCACHEPREFIX``: the ``.pyc`` files of every
  module the children import, torch's and megatron's included, in a tree mirroring the sources);
  ``TORCHINDUCTOR_FX_GRAPH_CACHE=1`` and ``TORCHINDUCTOR_AUTOGRAD_CACHE=1`` turn the persistent
  graph caches on (:data:`CACHE_VARIABLES`, the one table of them).
- Bytecode: GPU images often ship site-packages without ``.pyc`` files and set
  ``PYTHONDONTWRITEBYTECODE=1`` (the H200 image of the device tool does both), so every child
  compiles torch, transformers and megatron from source, ~15-20 s per process.  When the lane
  sets ``PYTHONPYCACHEPREFIX`` it also gives the children ``PYTHONDONTWRITEBYTECODE`` empty
  (:data:`BYTECODE_SWITCH`: writing on), since their bytecode then goes only to the lane's cache,
  never beside any source; the summary says when it lifted a value of the lane's environment.
  With a prefix Python reads bytecode only from it: on a host whose packages carry their own
  ``.pyc`` files the first run compiles once more, into the cache.

Invariants:
- Nothing here imports torch in the lane.  The children run this interpreter
  (``sys.executable -m pytest``, :mod:`.runner`), so torch's version is
  ``importlib.metadata.version("torch")`` in this process, and its CUDA/HIP version is read from
  the text of the installed ``torch/version.py`` (parsed, never executed; bounded by
  :func:`mizzen_ci.sources.read_bytes`).  Without torch there is no cache, and the summary says so.
- A compile cache holds Python sources and shared objects the children execute: it is a
  code-execution channel.  The root, the key directory and each cache directory in it are
  opened and checked by
  :func:`.host_dirs.open_dir` (:data:`COMPILE_CACHE_RULE`): a symbolic link, a directory owned by
  another user (root's included) or a group- or world-writable one is refused, as a
  :class:`.refusal.LaneRefusal` (exit 2, one line: the path, the rule, the fix) before anything
  runs; directories the lane creates get mode ``0700``.
- A cache variable the lane's own environment already sets (even to ``""``) is the user's: it is
  passed on as it is, never overridden, and listed in the summary (:attr:`CompileCache.kept`);
  a ``PYTHONPYCACHEPREFIX`` of the user's keeps their ``PYTHONDONTWRITEBYTECODE`` as well.
- Counts: at the end of a child's pytest session, if and only if ``torch`` is in its
  ``sys.modules``, :func:`write_child_stats` writes the counters of :data:`CACHES` (from
  ``torch._dynamo.utils.counters`` when that module is loaded, else zeros: nothing compiled) as
  JSON to ``$MIZZEN_COMPILE_STATS``.  That file is written by the code under test, so
  :func:`read_stats` reads it as hostile: a regular file of at most :data:`MAX_STATS_BYTES`
  (:func:`mizzen_ci.sources.read_bytes`), a JSON object of the known groups and counters only,
  each a whole number in ``[0, MAX_COUNT]``; anything else is a warning, never an exception.
- Recompiles: the same file carries, under ``"recompiles"``, the functions ``torch.compile``
  compiled more than once in the child (from dynamo's own record of failed guards,
  ``torch._dynamo.utils.guard_failures``, kept whatever ``TORCH_LOGS`` says): at most
  :data:`MAX_RECOMPILED` functions, each its name, ``file:line``, how many times it was
  recompiled (:func:`_recompiles`: the recompile limit and ``torch._dynamo.reset()`` included) and
  at most :data:`MAX_REASONS` distinct reasons of :data:`MAX_REASON_CHARS` characters, first line
  only.  Gathering them can never cost the counts.  Read as hostile like the counts (no repeated
  keys, exact keys, bounded strings and numbers); the report escapes every string.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..fleet import NVIDIA
from ..output import plain
from ..sources import read_bytes
from .host_dirs import DirRule, open_dir
from .refusal import LaneRefusal

CACHE_DIR_ENV = "MIZZEN_COMPILE_CACHE_DIR"
STATS_ENV = "MIZZEN_COMPILE_STATS"
OFF = "off"
MAX_STATS_BYTES = 64 * 1024
MAX_COUNT = 10**9
MAX_RECOMPILED = 16  # functions listed per child, most recompiled first
MAX_REASONS = 3  # distinct guard-failure reasons kept per function
MAX_REASON_CHARS = 240
MAX_NAME_CHARS = 200  # a function's name or its file:line
RECOMPILES_KEY = "recompiles"
VERSION_PY_BYTES = 64 * 1024  # torch/version.py is a few hundred bytes

# The one table of the variables the children get:
# (variable, its subdirectory of the key directory, or None and its fixed value)
CACHE_VARIABLES: tuple[tuple[str, str | None, str | None], ...] = (
    ("TORCHINDUCTOR_CACHE_DIR", "inductor", None),
    ("TRITON_CACHE_DIR", "triton", None),
    ("CUDA_CACHE_PATH", "cuda", None),
    ("PYTHONPYCACHEPREFIX", "bytecode", None),
    ("TORCHINDUCTOR_FX_GRAPH_CACHE", None, "1"),
    ("TORCHINDUCTOR_AUTOGRAD_CACHE", None, "1"),
)

#: Python's switch that stops bytecode writes; the children get it empty (writing on) whenever
#: the lane gives them its own ``PYTHONPYCACHEPREFIX`` (see the module docstring).
BYTECODE_SWITCH = "PYTHONDONTWRITEBYTECODE"
BYTECODE_PREFIX = "PYTHONPYCACHEPREFIX"


class CompileCacheError(LaneRefusal):
    """The compile-cache directory is unsafe to give to the children; the message names the path,
    the rule and the fix."""


COMPILE_CACHE_RULE = DirRule(
    what="compile cache",
    error=CompileCacheError,
    fix=f"use a directory only you can write (`{CACHE_DIR_ENV}=/path`), or `{CACHE_DIR_ENV}={OFF}`",
    stake="plant code that the tests execute",
    create_mode=0o700,
)


# --------------------------------------------------------------------------------------------
# Where, keyed how


@dataclass(frozen=True)
class TorchBuild:
    """The torch the children import: its version and what it was built for (``None``: unknown
    or not built for it)."""

    version: str
    cuda: str | None = None
    hip: str | None = None


def _version_py_literals(text: str) -> dict[str, str]:
    """``name = "literal"`` assignments at the top of ``torch/version.py`` (never executed)."""
    out: dict[str, str] = {}
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return out
    for node in tree.body:
        target = value = None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        literal = value.value if isinstance(value, ast.Constant) else None
        if isinstance(target, ast.Name) and isinstance(literal, str):
            out[target.id] = literal
    return out


def find_torch() -> TorchBuild | None:
    """The torch of this interpreter (the children's), found without importing it; ``None`` when
    it is not installed."""
    try:
        dist = importlib.metadata.distribution("torch")
        version = dist.version
    except importlib.metadata.PackageNotFoundError:
        return None
    if not version:
        return None
    literals: dict[str, str] = {}
    try:
        data, _ = read_bytes(Path(dist.locate_file("torch/version.py")), VERSION_PY_BYTES)
        literals = _version_py_literals(data.decode("utf-8", errors="replace"))
    except (OSError, TypeError, ValueError):  # not there, not a regular file: build unknown
        pass
    number = re.compile(r"\d+(\.\d+)*")
    cuda, hip = literals.get("cuda"), literals.get("hip")
    return TorchBuild(
        version,
        cuda if cuda and number.match(cuda) else None,
        hip if hip and number.match(hip) else None,
    )


def _component(text: str) -> str:
    """``text`` as part of one path component: no separator, no dot-dot, bounded."""
    return re.sub(r"[^A-Za-z0-9.+_-]", "_", text).replace("..", "_")[:80]


def cache_key(torch: TorchBuild, capabilities: Sequence[str], python: Sequence[int]) -> str:
    """The key directory's name (see the module docstring): what makes artifacts incompatible."""
    version = torch.version
    if "+" not in version:  # PyPI's default CUDA wheels have no local tag: add what it is for
        if torch.cuda:
            version += "+cu" + "".join(torch.cuda.split(".")[:2])
        elif torch.hip:
            version += "+rocm" + ".".join(torch.hip.split(".")[:2])
    nvidia = sorted(
        {c.replace(".", "") for c in capabilities if NVIDIA.is_target(c)}, key=lambda c: (len(c), c)
    )
    others = sorted({c for c in capabilities if not NVIDIA.is_target(c)})  # ISA names: gfx942
    devices = "_".join((["sm" + "_".join(nvidia)] if nvidia else []) + others) or "smnone"
    return _component(f"torch-{version}-{devices}-py{python[0]}{python[1]}")


def cache_root(environ: Mapping[str, str]) -> Path | None:
    """The root of the lane's compile caches; ``None`` when it is :data:`OFF`."""
    chosen = environ.get(CACHE_DIR_ENV, "")
    if chosen == OFF:
        return None
    if chosen:
        return Path(os.path.abspath(chosen))  # absolute, links not resolved: they are checked
    xdg = environ.get("XDG_CACHE_HOME", "")
    try:
        base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    except (RuntimeError, KeyError):  # no $HOME and no passwd entry
        raise CompileCacheError(
            f"compile cache: cannot find your home directory for ~/.cache. Fix: set "
            f"`{CACHE_DIR_ENV}=/path` (a directory only you can write) or `{CACHE_DIR_ENV}={OFF}`"
        ) from None
    return Path(os.path.abspath(base)) / "mizzen-ci" / "compile"


@dataclass(frozen=True)
class CompileCache:
    """What the lane gives its children for compile caching, and how to say it."""

    directory: Path | None  # the key directory; None: no cache (see note)
    env: Mapping[str, str] = field(default_factory=dict)  # what the children get from the lane
    kept: Mapping[str, str] = field(default_factory=dict)  # set by the user, passed on as is
    note: str = ""  # "off (why)" or "none (why)" when there is no cache
    lifted: Mapping[str, str] = field(default_factory=dict)  # the user's values the lane replaced

    def describe(self) -> str:
        text = f"compile cache: {self.directory or self.note}"
        if self.kept:
            text += "; kept from the lane's environment: " + ", ".join(
                f"{k}={v}" for k, v in self.kept.items()
            )
        if self.lifted:
            text += "; lifted for the children (their bytecode goes to the cache only): " + (
                ", ".join(f"{k}={v}" for k, v in self.lifted.items())
            )
        return text  # raw: each medium escapes it

    def as_json(self) -> dict:
        return {
            "directory": str(self.directory) if self.directory else None,
            "variables": dict(self.env),
            "kept": dict(self.kept),
            "lifted": dict(self.lifted),
            "note": self.note or None,
        }


def configure(
    environ: Mapping[str, str],
    capabilities: Sequence[str],
    *,
    torch: Callable[[], TorchBuild | None] = find_torch,
) -> CompileCache:
    """The compile cache of a lane whose GPUs have ``capabilities``: its checked (and, when new,
    created) key directory and the variables for the children; :class:`CompileCacheError` when a
    directory is unsafe (see the module docstring)."""
    kept = {name: environ[name] for name, _, _ in CACHE_VARIABLES if name in environ}
    root = cache_root(environ)
    if root is None:
        return CompileCache(
            None, kept=kept, note=f"off (${CACHE_DIR_ENV}={OFF}: the lane sets no cache variable)"
        )
    build = torch()
    if build is None:
        return CompileCache(
            None,
            kept=kept,
            note=f"none (torch is not installed for {sys.executable}: nothing to compile)",
        )
    key = root / cache_key(build, capabilities, sys.version_info[:2])
    root_fd = open_dir(root, COMPILE_CACHE_RULE)
    try:
        key_fd = open_dir(key, COMPILE_CACHE_RULE, parent_fd=root_fd)
    finally:
        os.close(root_fd)
    env: dict[str, str] = {}
    try:
        for name, subdir, value in CACHE_VARIABLES:
            if subdir is not None:  # checked like the key (a link planted there is refused)
                os.close(open_dir(key / subdir, COMPILE_CACHE_RULE, parent_fd=key_fd))
                value = str(key / subdir)
            if name not in kept:
                env[name] = value
    finally:
        os.close(key_fd)
    lifted = {}
    if BYTECODE_PREFIX in env:
        env[BYTECODE_SWITCH] = ""
        if environ.get(BYTECODE_SWITCH):
            lifted[BYTECODE_SWITCH] = environ[BYTECODE_SWITCH]
    return CompileCache(key, env=env, kept=kept, lifted=lifted)


# --------------------------------------------------------------------------------------------
# Hits and misses, as the children count them


@dataclass(frozen=True)
class TorchCache:
    """One persistent cache of torch.compile, as ``torch._dynamo.utils.counters`` counts it:
    ``counters[group][prefix + outcome]``."""

    label: str  # the summary's column: "fx" → "fx hit/miss"
    group: str
    prefix: str


CACHES = (
    TorchCache("fx", "inductor", "fxgraph_cache_"),  # torch/_inductor/codecache.py
    TorchCache("aot", "aot_autograd", "autograd_cache_"),  # torch/_functorch/.../autograd_cache.py
)
OUTCOMES = ("hit", "miss", "bypass")


@dataclass(frozen=True)
class Recompile:
    """A function ``torch.compile`` compiled again in one child, and why (raw text: the code
    under test wrote it; each medium escapes it)."""

    function: str
    where: str  # file name:first line
    count: int  # times recompiled: distinct cache entries whose guards failed
    reasons: tuple[str, ...]  # distinct guard-failure reasons, first seen first

    def as_json(self) -> dict:
        return {
            "function": self.function,
            "where": self.where,
            "count": self.count,
            "reasons": list(self.reasons),
        }


@dataclass(frozen=True)
class CompileStats:
    """Counts of :data:`CACHES` × :data:`OUTCOMES` from one child (or summed over several),
    and the functions it recompiled."""

    counts: Mapping[tuple[str, str], int]  # (label, outcome) -> count
    recompiles: tuple[Recompile, ...] = ()

    def get(self, cache: TorchCache, outcome: str) -> int:
        return self.counts.get((cache.label, outcome), 0)

    def hit_miss(self, cache: TorchCache) -> str:
        return f"{self.get(cache, 'hit')}/{self.get(cache, 'miss')}"

    @property
    def recompiled(self) -> int:
        """Recompiles of every function listed."""
        return sum(r.count for r in self.recompiles)

    def __add__(self, other: CompileStats) -> CompileStats:
        keys = set(self.counts) | set(other.counts)
        return CompileStats(
            {k: self.counts.get(k, 0) + other.counts.get(k, 0) for k in keys},
            self.recompiles + other.recompiles,
        )

    def as_json(self) -> dict:
        return {
            **{c.group: {c.prefix + o: self.get(c, o) for o in OUTCOMES} for c in CACHES},
            RECOMPILES_KEY: [r.as_json() for r in self.recompiles],
        }


def _recompiles(guard_failures: object, limit: object) -> list[dict]:
    """The :class:`Recompile` records (as JSON) of dynamo's ``guard_failures``: code object ->
    reasons, each ``"<compile id>: <reason>"`` for one cache entry whose guards failed when the
    function was called and no entry served.  Compiling entry ``k`` follows failures of entries
    ``0..k-1``, so the distinct entries that failed are the recompiles -- except once dynamo hit
    its ``recompile_limit`` (``limit``): then every entry failed, the count is ``limit - 1`` and
    the first reason says that later calls ran uncompiled.  ``torch._dynamo.reset()`` clears the
    record: recompiles before a reset are not counted.  Anything not of that shape is skipped."""
    if not isinstance(guard_failures, Mapping):
        return []
    found = []
    for code, failures in list(guard_failures.items()):
        if not isinstance(failures, (list, tuple)):
            continue
        entries, reasons = set(), []
        for failure in failures:
            entry, separator, reason = str(failure).partition(": ")
            if not separator:
                continue
            entries.add(entry)
            reason = (reason.splitlines() or [""])[0].strip()[:MAX_REASON_CHARS]
            if reason not in reasons:
                reasons.append(reason)
        if not entries:
            continue
        count = len(entries)
        if type(limit) is int and 1 <= limit <= count:
            count = limit - 1
            reasons.insert(
                0, f"hit torch._dynamo.config.recompile_limit ({limit}): later calls ran uncompiled"
            )
        name = str(getattr(code, "co_name", code))[:MAX_NAME_CHARS]
        where = f"{os.path.basename(str(getattr(code, 'co_filename', '?')))}:"
        where = (where + str(getattr(code, "co_firstlineno", "?")))[:MAX_NAME_CHARS]
        found.append(
            {"function": name, "where": where, "count": count, "reasons": reasons[:MAX_REASONS]}
        )
    found.sort(key=lambda r: (-r["count"], r["where"]))
    return found[:MAX_RECOMPILED]


def child_stats(modules: Mapping[str, object]) -> dict | None:
    """The counts of a child whose imported modules are ``modules``; ``None`` without torch."""
    if "torch" not in modules:
        return None
    dynamo_utils = modules.get("torch._dynamo.utils")
    counters = getattr(dynamo_utils, "counters", None) or {}
    out: dict = {}
    for c in CACHES:
        group = counters.get(c.group) or {}  # .get: never create a group in torch's defaultdict
        out[c.group] = {c.prefix + o: int(group.get(c.prefix + o, 0)) for o in OUTCOMES}
    try:  # torch's private record: if its shape changed, the counts above still go out
        limit = getattr(modules.get("torch._dynamo.config"), "recompile_limit", None)
        out[RECOMPILES_KEY] = _recompiles(getattr(dynamo_utils, "guard_failures", None), limit)
    except Exception:
        out[RECOMPILES_KEY] = []
    return out


def write_child_stats() -> None:
    """In a lane's child at the end of its session: write its compile-cache counts to
    ``$MIZZEN_COMPILE_STATS`` (see the module docstring).  A failure is a warning on stderr,
    never a failure of the session."""
    path = os.environ.get(STATS_ENV)
    if not path:
        return
    try:
        stats = child_stats(sys.modules)
        if stats is None:
            return
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(stats, f)
        os.replace(tmp, path)
    except Exception as e:  # the counts are diagnostics: losing them must not fail the tests
        print(
            plain(f"mizzen: could not write compile-cache counts to {path}: {e}"), file=sys.stderr
        )


def _no_constant(name: str):
    raise ValueError(f"holds {name}, not a count")


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"an object repeats a key ({sorted(keys)[:8]})")
    return dict(pairs)


def read_stats(path: Path) -> tuple[CompileStats | None, str | None]:
    """(the counts a child wrote to ``path``, a warning: raw text, for the medium to escape);
    ``(None, None)`` when it wrote none (it never imported torch).  Read as hostile input (see
    the module docstring)."""
    if not os.path.lexists(path):
        return None, None
    try:
        data, _ = read_bytes(path, MAX_STATS_BYTES)
        raw = json.loads(
            data.decode("utf-8"), parse_constant=_no_constant, object_pairs_hook=_no_duplicates
        )
    except OSError as e:
        return None, f"compile-cache counts {e}; not shown"
    except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, NaN, over-long numbers
        return None, f"compile-cache counts {path}: not valid JSON counts ({e}); not shown"
    groups = {c.group: c for c in CACHES}
    counts: dict[tuple[str, str], int] = {}
    recompiles: tuple[Recompile, ...] = ()
    problem = None
    if not isinstance(raw, dict):
        problem = f"is a JSON {type(raw).__name__}, not an object of {', '.join(groups)}"
    else:
        if RECOMPILES_KEY in raw:
            recompiles, problem = _read_recompiles(raw.pop(RECOMPILES_KEY))
        for group, values in raw.items():
            if problem:
                break
            cache = groups.get(group)
            if cache is None or not isinstance(values, dict):
                problem = f"has {str(group)[:40]!r}, not one of {', '.join(groups)} with counters"
                break
            for name, value in values.items():
                outcome = name.removeprefix(cache.prefix)  # JSON object keys are strings
                if not name.startswith(cache.prefix) or outcome not in OUTCOMES:
                    problem = f"has counter {group}.{str(name)[:40]!r}, which torch does not count"
                    break
                if type(value) is not int or not 0 <= value <= MAX_COUNT:
                    problem = f"has {group}.{name} = {str(value)[:40]}, not a whole number in [0, {MAX_COUNT}]"
                    break
                counts[(cache.label, outcome)] = value
            if problem:
                break
    if problem:
        return None, f"compile-cache counts {path}: {problem}; not shown"
    return CompileStats(counts, recompiles), None


def _short_text(value: object, limit: int) -> bool:
    return isinstance(value, str) and len(value) <= limit


def _read_recompiles(raw: object) -> tuple[tuple[Recompile, ...], str | None]:
    """The ``"recompiles"`` list of a counts file, checked field by field (see the module
    docstring), or the first problem."""
    if not isinstance(raw, list) or len(raw) > MAX_RECOMPILED:
        return (), f"has {RECOMPILES_KEY} that is not a list of at most {MAX_RECOMPILED} entries"
    found = []
    for index, entry in enumerate(raw):
        where = f"{RECOMPILES_KEY}[{index}]"
        if not isinstance(entry, dict) or set(entry) != {"function", "where", "count", "reasons"}:
            return (), f"has {where} that is not an object of function, where, count, reasons"
        if not (
            _short_text(entry["function"], MAX_NAME_CHARS)
            and _short_text(entry["where"], MAX_NAME_CHARS)
        ):
            return (), f"has {where}.function or .where not a string of <= {MAX_NAME_CHARS} chars"
        count = entry["count"]
        if type(count) is not int or not 0 <= count <= MAX_COUNT:  # 0: recompile_limit = 1
            return (), (
                f"has {where}.count = {str(count)[:40]}, not a whole number in [0, {MAX_COUNT}]"
            )
        reasons = entry["reasons"]
        if (
            not isinstance(reasons, list)
            or len(reasons) > MAX_REASONS
            or not all(_short_text(r, MAX_REASON_CHARS) and "\n" not in r for r in reasons)
        ):
            return (), (
                f"has {where}.reasons not a list of at most {MAX_REASONS} one-line strings of "
                f"<= {MAX_REASON_CHARS} chars"
            )
        found.append(Recompile(entry["function"], entry["where"], count, tuple(reasons)))
    return tuple(found), None
