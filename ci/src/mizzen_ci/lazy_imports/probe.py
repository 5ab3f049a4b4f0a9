"""The child process of the runtime lazy-import check: import one package with its budget enforced.

Run as a plain script (``python -P lazy_imports_probe.py CONFIG.json``) so that nothing of
``mizzen_ci`` is imported before the blocker is in place; the config says which package, which
modules are forbidden, which are tolerated from which third-party loaders, the source dirs (our
code) and where to write the JSON result.

Invariants:
- Stdlib only.  A ``sys.meta_path`` blocker, installed before the package is touched, makes every
  forbidden module unimportable (``ModuleNotFoundError``) and records who asked: the importing
  stack with ``file:line`` and the source line of each frame (import machinery frames dropped).
  The only requests let through are those the policy tolerates: a tolerated module asked for by
  its named third-party loader, or by the module's own internals once it was let in.
- Every module of the package is imported by :func:`walk.walk_modules` (loaded by path) (the package is
  walked, never listed by hand); a module that fails is imported once more afterwards only to
  capture its traceback.
- Afterwards: which forbidden modules are in ``sys.modules`` that were not there before the walk;
  whether torch was imported; ``torch.cuda.is_initialized()``; and every attempt to initialise
  CUDA (``torch._C._cuda_init`` is wrapped as soon as ``torch._C`` loads, so an attempt is seen
  even on a machine without a GPU, where it fails).
- The result is written as JSON to the config's ``out`` path; stdout and stderr stay the
  package's own.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import linecache
import os
import sys
import traceback

_HERE = os.path.dirname(os.path.abspath(__file__))
_SKIP_FILES = frozenset({os.path.abspath(__file__), os.path.join(_HERE, "walk.py")})
BLOCKED_MARK = "is blocked by the lazy-import policy"


def _machinery(path: str) -> bool:
    """Frames of the import system and of this probe (never the code that asked)."""
    return (
        path.startswith("<frozen importlib")
        or path.endswith(("importlib/__init__.py", "/pkgutil.py"))
        or os.path.abspath(path) in _SKIP_FILES
    )


def _load_import_walk():
    spec = importlib.util.spec_from_file_location(
        "_mizzen_probe_import_walk", os.path.join(_HERE, "walk.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _matches(name: str, prefixes) -> str | None:
    for p in prefixes:
        if name == p or name.startswith(p + "."):
            return p
    return None


class Policy:
    def __init__(self, cfg: dict):
        self.package = cfg["package"]
        self.forbid: dict[str, str] = cfg["forbid"]  # prefix -> origin
        self.stdlib_only: bool = cfg["stdlib_only"]
        self.tolerated: dict[str, list[str]] = cfg["tolerated"]
        self.stdlib = frozenset(sys.stdlib_module_names) | {self.package.partition(".")[0]}

    def rule(self, name: str) -> tuple[str, str] | None:
        """(forbidden prefix, origin) for ``name`` or None."""
        p = _matches(name, self.forbid)
        if p is not None:
            return p, self.forbid[p]
        if self.stdlib_only:
            top = name.partition(".")[0]
            if top not in self.stdlib:
                return top, "stdlib-only"
        return None


def _frames(skip_top: int = 0) -> list[dict]:
    """The current stack as [{file, line, code, module}], importlib and probe frames dropped."""
    out = []
    f = sys._getframe(skip_top + 1)
    while f is not None:
        fn = f.f_code.co_filename
        if not _machinery(fn):
            out.append({"file": fn, "line": f.f_lineno, "module": f.f_globals.get("__name__")})
        f = f.f_back
    out.reverse()
    for fr in out:
        fr["code"] = _source_line(fr["file"], fr["line"])
    return out


def _source_line(path: str, line: int) -> str:
    return linecache.getline(path, line).strip()


class Blocker:
    """A ``sys.meta_path`` finder that refuses forbidden modules and records every request."""

    def __init__(self, policy: Policy):
        self.policy = policy
        self.blocked: list[dict] = []
        self.tolerated: list[dict] = []
        self._let_in: set[str] = set()

    def find_spec(self, name, path=None, target=None):
        found = self.policy.rule(name)
        if found is None:
            return None
        prefix, origin = found
        stack = _frames(1)
        requester = stack[-1]["module"] if stack else None
        record = {"module": name, "prefix": prefix, "origin": origin, "stack": stack}
        loaders = self.policy.tolerated.get(prefix) or next(
            (v for k, v in self.policy.tolerated.items() if _matches(name, [k])), None
        )
        if (
            loaders
            and requester
            and (
                _matches(requester, loaders)
                or (prefix in self._let_in and _matches(requester, [prefix]))
            )
        ):
            self._let_in.add(prefix)
            record["requester"] = requester
            self.tolerated.append(record)
            return None
        self.blocked.append(record)
        raise ModuleNotFoundError(f"{name} {BLOCKED_MARK} ({origin}: {prefix})", name=name)

    def find_module(self, name, path=None):  # pragma: no cover - legacy protocol
        return None


class CudaInitWatch:
    """Wraps ``torch._C._cuda_init`` as soon as ``torch._C`` is loaded, recording each caller."""

    def __init__(self):
        self.attempts: list[list[dict]] = []

    def find_spec(self, name, path=None, target=None):
        if name != "torch._C":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module
        watch = self

        def exec_and_wrap(module):
            exec_module(module)
            real = getattr(module, "_cuda_init", None)
            if real is not None:

                def _cuda_init(*args, **kwargs):
                    watch.attempts.append(_frames(0))
                    return real(*args, **kwargs)

                module._cuda_init = _cuda_init

        spec.loader.exec_module = exec_and_wrap
        return spec


def _failure(name: str, error: str) -> dict:
    """One failed module, imported once more to capture its traceback (frames as [file, line,
    code], machinery dropped) and, when the blocker refused it, the refused module's name."""
    frames: list[list] = []
    blocked = None
    if name not in sys.modules:
        try:
            importlib.import_module(name)
        except BaseException as e:
            frames = [
                [fs.filename, fs.lineno, (fs.line or "").strip()]
                for fs in traceback.extract_tb(e.__traceback__)
                if not _machinery(fs.filename)
            ]
            if isinstance(e, ModuleNotFoundError) and BLOCKED_MARK in str(e):
                blocked = e.name
    return {"module": name, "error": error, "frames": frames, "blocked": blocked}


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        cfg = json.load(f)
    policy = Policy(cfg)
    import_walk = _load_import_walk()
    blocker = Blocker(policy)
    watch = CudaInitWatch()
    before = set(sys.modules)
    sys.meta_path.insert(0, watch)
    sys.meta_path.insert(0, blocker)
    imported, failed = import_walk.walk_modules(policy.package)
    n_blocked = len(blocker.blocked)
    failures = [_failure(name, error) for name, error in failed]
    del blocker.blocked[n_blocked:]  # requests made again while capturing tracebacks
    loaded = sorted(m for m in set(sys.modules) - before if policy.rule(m) is not None)
    let_in = {r["prefix"] for r in blocker.tolerated}
    result = {
        "package": policy.package,
        "imported": imported,
        "failed": failures,
        "blocked": blocker.blocked,
        "tolerated": blocker.tolerated,
        "loaded_forbidden": [m for m in loaded if policy.rule(m)[0] not in let_in],
        "loaded_tolerated": [m for m in loaded if policy.rule(m)[0] in let_in],
        "preloaded_forbidden": sorted(m for m in before if policy.rule(m) is not None),
        "torch_imported": "torch" in sys.modules,
        "cuda_initialized": False,
        "cuda_init_attempts": watch.attempts,
    }
    if "torch" in sys.modules:
        try:
            result["cuda_initialized"] = bool(sys.modules["torch"].cuda.is_initialized())
        except Exception as e:  # a broken torch is itself worth reporting
            result["cuda_initialized"] = f"could not ask torch.cuda.is_initialized(): {e!r}"
    with open(cfg["out"], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
