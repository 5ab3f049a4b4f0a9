"""The runtime lazy-import check: import every module of each package with its budget enforced.

One subprocess per package (:mod:`.probe`, run as a script, with the source
dirs first on ``PYTHONPATH`` and the interpreter given, by default this one), several at once.

Invariants:
- A package fails when: a module fails to import (for any reason; with its traceback); our own
  code (a file under a source dir) asked for a forbidden module, even if a ``try/except
  ImportError`` absorbed the refusal; a forbidden module is in ``sys.modules`` afterwards (other
  than one the policy tolerates); torch reports CUDA initialised, or anything tried to initialise
  it; or the probe itself crashed or timed out.
- Third-party code asking for a forbidden module and surviving the refusal (e.g. megatron-core's
  guarded ``import transformer_engine``) is what a CPU image does: counted, not failed.
- A ``sys.meta_path`` finder sees only first imports: once a tolerated module is loaded (e.g.
  triton by megatron-core), a later import of it by our own code is invisible here; the static
  check covers our code.
- Every finding carries the importing stack, one ``file:line  code`` per frame (paths relative to
  the root, third-party ones from ``site-packages/``), ending at the offending import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .policy import Policy, Rule

PROBE = Path(__file__).with_name("probe.py")
FIX = "move the import into the function that uses it, or re-export through a lazy __getattr__"


@dataclass(frozen=True)
class RuntimeFinding:
    """One reason a package fails the runtime check."""

    package: str
    title: str
    stack: tuple[str, ...] = ()
    file: str | None = None  # for annotations: where to point (root-relative)
    line: int | None = None
    note: str | None = None

    def lines(self) -> list[str]:
        out = [self.title]
        out += [f"    {s}" for s in self.stack]
        if self.note:
            out.append(f"  {self.note}")
        return out


@dataclass
class PackageResult:
    package: str
    seconds: float
    imported: list[str] = field(default_factory=list)
    findings: list[RuntimeFinding] = field(default_factory=list)
    third_party_refusals: int = 0
    tolerated: list[str] = field(default_factory=list)  # "triton (by megatron.core)"
    torch_imported: bool = False


@dataclass
class RuntimeReport:
    results: list[PackageResult]
    seconds: float

    @property
    def findings(self) -> list[RuntimeFinding]:
        return [f for r in self.results for f in r.findings]

    @property
    def ok(self) -> bool:
        return not self.findings


class _Paths:
    def __init__(self, root: Path, source_dirs: list[Path]):
        self.root = root.resolve()
        self.source_dirs = [str(d.resolve()) + os.sep for d in source_dirs]

    def ours(self, path: str) -> bool:
        p = os.path.abspath(path)
        return any(p.startswith(d) for d in self.source_dirs)

    def show(self, path: str) -> str:
        p = Path(os.path.abspath(path))
        try:
            return p.relative_to(self.root).as_posix()
        except ValueError:
            s = p.as_posix()
            i = s.rfind("/site-packages/")
            return s[i + 1 :] if i >= 0 else s

    def stack(self, frames: list[dict]) -> tuple[str, ...]:
        """``file:line  code`` per frame of a probe stack (dict frames)."""
        return self.frames([[f["file"], f["line"], f.get("code", "")] for f in frames])

    def frames(self, frames: list[list]) -> tuple[str, ...]:
        """``file:line  code`` per ``[file, line, code]`` frame."""
        return tuple(
            f"{self.show(file)}:{line}" + (f"  {code}" if code else "")
            for file, line, code in frames
        )

    def location(self, frames: list[list]) -> tuple[str, int] | None:
        """The deepest frame in our own code (where an annotation should point)."""
        for file, line, _ in reversed(frames):
            if self.ours(file):
                return self.show(file), line
        return None


def probe_config(package: str, policy: Policy, out: Path) -> dict:
    budget = policy.budget(package)
    return {
        "package": package,
        "forbid": {prefix: rule.origin for prefix, rule in budget.forbidden.items()},
        "stdlib_only": budget.stdlib_only,
        "tolerated": {k: list(v) for k, v in policy.tolerated.items()},
        "out": str(out),
    }


def interpret(raw: dict, policy: Policy, paths: _Paths, seconds: float) -> PackageResult:
    """Turn one probe's JSON into findings."""
    pkg = raw["package"]
    res = PackageResult(pkg, seconds, raw["imported"], torch_imported=raw["torch_imported"])
    ours: dict[tuple[str, int, str], dict] = {}  # (file, line, module) -> blocked request
    for b in raw["blocked"]:
        requester = b["stack"][-1] if b["stack"] else None
        if requester is None or not paths.ours(requester["file"]):
            res.third_party_refusals += 1
            continue
        ours.setdefault((requester["file"], requester["line"], b["module"]), b)
    casualties: dict[tuple[str, int, str], list[str]] = {k: [] for k in ours}
    for f in raw["failed"]:
        last = f["frames"][-1] if f["frames"] else None
        key = (last[0], last[1], f["blocked"]) if last and f["blocked"] else None
        if key in casualties:
            casualties[key].append(f["module"])
            continue
        stack = paths.frames(f["frames"])
        res.findings.append(
            RuntimeFinding(
                pkg,
                f"import of {f['module']} failed: {f['error']}",
                stack,
                *(paths.location(f["frames"]) or (None, None)),
            )
        )
    for key, b in ours.items():
        file, line, module = key
        failed = casualties[key]
        note = (
            f"Modules that failed to import because of it: {', '.join(failed)}."
            if failed
            else "A try/except absorbed the refusal, but wherever the module is installed this "
            "line loads it."
        )
        res.findings.append(
            RuntimeFinding(
                pkg,
                f"{paths.show(file)}:{line} asked for {module} while importing {pkg}: "
                f"{Rule(b['prefix'], b['origin']).explain(pkg)} (refused by the blocker)",
                paths.stack(b["stack"]),
                paths.show(file),
                line,
                note + f" Fix: {FIX}.",
            )
        )
    for m in raw["loaded_forbidden"]:
        rule = policy.budget(pkg).violated_by(m)
        why = rule.explain(pkg) if rule else "forbidden"
        res.findings.append(
            RuntimeFinding(pkg, f"{m} is in sys.modules after importing every module: {why}")
        )
    for attempt in raw["cuda_init_attempts"]:
        first_ours = next((fr for fr in reversed(attempt) if paths.ours(fr["file"])), None)
        res.findings.append(
            RuntimeFinding(
                pkg,
                f"CUDA initialisation attempted while importing {pkg} (a CPU image must never "
                "initialise CUDA; query torch.cuda inside the functions that need it)",
                paths.stack(attempt),
                paths.show(first_ours["file"]) if first_ours else None,
                first_ours["line"] if first_ours else None,
            )
        )
    if raw["cuda_initialized"] is True:
        res.findings.append(
            RuntimeFinding(pkg, f"torch.cuda.is_initialized() is True after importing {pkg}")
        )
    elif raw["cuda_initialized"] is not False:
        res.findings.append(RuntimeFinding(pkg, str(raw["cuda_initialized"])))
    for t in raw["tolerated"]:
        if t["requester"].startswith(t["prefix"]):
            continue  # the tolerated library importing its own submodules
        label = f"{t['prefix']} (loaded by {t['requester']}, tolerated by the policy)"
        if label not in res.tolerated:
            res.tolerated.append(label)
    return res


def check_runtime(
    root: Path,
    source_dirs: list[Path],
    packages: list[str],
    policy: Policy,
    python: str = sys.executable,
    timeout: float = 600,
    jobs: int | None = None,
    env: dict[str, str] | None = None,
) -> RuntimeReport:
    """Run one probe per package (``jobs`` at a time) and interpret them."""
    t0 = time.perf_counter()
    paths = _Paths(root, source_dirs)
    # Default: every probe at once (up to twice the CPUs), so the slowest package (the one that
    # imports torch and megatron-core) starts at once and the makespan is near its own time.
    jobs = max(1, jobs or min(len(packages), 2 * (os.cpu_count() or 1)))
    base_env = dict(os.environ if env is None else env)
    pythonpath = [str(d.resolve()) for d in source_dirs]
    if base_env.get("PYTHONPATH"):
        pythonpath.append(base_env["PYTHONPATH"])
    base_env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    results: dict[str, PackageResult] = {}
    with tempfile.TemporaryDirectory(prefix="mizzen-lazy-imports-") as tmp:
        pending = list(packages)
        running: dict[str, tuple[subprocess.Popen, float, Path, Path]] = {}
        while pending or running:
            while pending and len(running) < jobs:
                pkg = pending.pop(0)
                out, log = Path(tmp, f"{pkg}.json"), Path(tmp, f"{pkg}.log")
                cfg = Path(tmp, f"{pkg}.config.json")
                cfg.write_text(json.dumps(probe_config(pkg, policy, out)))
                with log.open("wb") as log_file:
                    proc = subprocess.Popen(
                        [python, "-P", str(PROBE), str(cfg)],
                        cwd=root,
                        env=base_env,
                        stdin=subprocess.DEVNULL,
                        stdout=log_file,
                        stderr=subprocess.STDOUT,
                    )
                running[pkg] = (proc, time.perf_counter(), out, log)
            time.sleep(0.02)
            for pkg, (proc, started, out, log) in list(running.items()):
                if proc.poll() is None:
                    if time.perf_counter() - started > timeout:
                        proc.kill()
                        proc.wait()
                        del running[pkg]
                        results[pkg] = _crashed(pkg, started, f"timed out after {timeout:g} s", log)
                    continue
                del running[pkg]
                seconds = time.perf_counter() - started
                if proc.returncode != 0 or not out.is_file():
                    why = f"the probe exited with status {proc.returncode}"
                    results[pkg] = _crashed(pkg, started, why, log)
                else:
                    results[pkg] = interpret(json.loads(out.read_text()), policy, paths, seconds)
    return RuntimeReport([results[p] for p in packages], time.perf_counter() - t0)


def _crashed(pkg: str, started: float, why: str, log: Path) -> PackageResult:
    output = log.read_text(errors="replace") if log.is_file() else ""
    tail = tuple(output.strip().splitlines()[-15:])
    return PackageResult(
        pkg,
        time.perf_counter() - started,
        findings=[RuntimeFinding(pkg, f"the runtime check of {pkg} could not finish: {why}", tail)],
    )


def render(report: RuntimeReport) -> list[str]:
    out: list[str] = []
    for r in report.results:
        for f in r.findings:
            out.extend(f.lines())
    return out
