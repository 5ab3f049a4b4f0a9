"""Speed of the lazy-import checks, each printed against its baseline measured in the same run.

    uv run python benchmarks/bench_lazy_imports.py [--modules 5000] [--repeats 3] [--no-runtime]

1. Static check of the whole workspace (every package of the uv workspace, all budgets of the root
   policy), cold (no cache) and warm (facts cache file), against the baseline: read + plain
   ``ast.parse`` of the same files.  Target: cold <= 0.5 s.
2. Static check of a generated tree of ``--modules`` modules (default 5,000), same measurements.
   Target: cold <= 3 s.
3. The runtime check of the workspace (one subprocess per package, all at once), timed once.
   Target: <= 30 s.

Static figures: ``--repeats`` runs, baseline and check alternating; wall is the best run (other jobs
on a shared machine only add time), CPU the median (this process plus its parse workers).  Cold
runs parse in one process per CPU when 400+ files need parsing; the baseline uses one.  The
generated tree: 20 packages of 9 subpackages; every module has a docstring, stdlib imports, 2-4
imports of lower modules of its package (absolute and relative, some through ``from pkg import
submodule``), one package in five imports a lower package, a guarded optional import, a
``TYPE_CHECKING`` block, functions and methods with lazy imports; the last module of each package
imports torch at module scope (forbidden in pkg01) and five of them sglang, so chains are found.  Files get an
mtime 10 s in the past so the warm run uses the cache's stat fast path as on a real checkout.

Invariants: the generated tree is a pure function of ``--modules``; the check's results are
printed (violations found) so a broken check cannot look fast.
"""

from __future__ import annotations

import argparse
import ast
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from mizzen_ci.imports import ImportGraph, iter_source_modules
from mizzen_ci.lazy_imports.cli import resolve_packages
from mizzen_ci.lazy_imports.policy import load_policy, parse_policy
from mizzen_ci.lazy_imports.runtime import check_runtime
from mizzen_ci.lazy_imports.static import check_static
from mizzen_ci.plan.index.facts_cache import FactsCache

REPO = Path(__file__).resolve().parents[1]

N_PACKAGES = 20
N_SUBPACKAGES = 9


def generate(root: Path, n_modules: int) -> list[str]:
    """Write the synthetic tree under ``root/src``; return its package names."""
    per_package = n_modules // N_PACKAGES
    packages = [f"pkg{i:02d}" for i in range(N_PACKAGES)]
    count = 0
    for p, pkg in enumerate(packages):
        names = [pkg]
        n_sub = N_SUBPACKAGES
        per_sub = (per_package - 1 - n_sub) // n_sub
        for s in range(n_sub):
            names.append(f"{pkg}.sub{s}")
            names += [f"{pkg}.sub{s}.mod{m:02d}" for m in range(per_sub)]
        names += [f"{pkg}.top{t}" for t in range(per_package - len(names))]
        for i, name in enumerate(names):
            count += 1
            is_pkg = name == pkg or name.rsplit(".", 1)[1].startswith("sub")
            parts = name.split(".")
            path = root / "src" / Path(*parts) / "__init__.py" if is_pkg else None
            path = path or root / "src" / Path(*parts[:-1]) / f"{parts[-1]}.py"
            path.parent.mkdir(parents=True, exist_ok=True)
            lower = names[max(0, i - 40) : i]
            imports = []
            for k in range(2 + count % 3):
                if not lower:
                    break
                target = lower[(count * 7 + k * 13) % len(lower)]
                tp = target.split(".")
                if k == 0 and len(tp) > 1:
                    imports.append(f"from {'.'.join(tp[:-1])} import {tp[-1]}")
                elif k == 1 and len(tp) == 3 and tp[:2] == parts[:2] and not is_pkg:
                    imports.append(f"from . import {tp[-1]}")
                else:
                    imports.append(f"import {target}")
            if p and count % 5 == 0:
                other = packages[(p * 3 + count) % p]
                imports.append(f"from {other} import sub{count % N_SUBPACKAGES}")
            last = i == len(names) - 1  # imported by nothing: a leaf, as real offenders are
            if last:
                imports.append("import torch")
            if last and p % 4 == 3:
                imports.append("import sglang.srt.server")
            path.write_text(_module_source(name, imports, count))
    return packages


def _module_source(name: str, imports: list[str], k: int) -> str:
    lines = [
        f'"""Module {name}: synthetic, shaped like real code."""',
        "",
        "from __future__ import annotations",
        "",
        "import json",
        "import os",
        "from dataclasses import dataclass",
        "from typing import TYPE_CHECKING",
        "",
        *imports,
        "",
        "try:",
        "    import orjson",
        "except ImportError:",
        "    orjson = None",
        "",
        "if TYPE_CHECKING:",
        "    import torch.nn",
        "",
        f"CONSTANT_{k} = {{'name': {name!r}, 'sizes': [1, 2, 3], 'flag': True}}",
        "",
    ]
    for f in range(3):
        lines += [
            "",
            f"def function_{f}(x: int, y: int = 1, *args, **kwargs) -> dict:",
            f'    """Does thing {f}."""',
            "    import math",
            "",
            "    total = 0",
            "    for i in range(x):",
            "        if i % 3 == 0:",
            "            total += math.floor(i * y / 2)",
            "        elif i % 3 == 1:",
            "            total -= i",
            "    return {'total': total, 'args': list(args), **kwargs}",
        ]
    lines += [
        "",
        "",
        "@dataclass",
        "class Thing:",
        "    size: int = 4",
        "    name: str = 'thing'",
        "",
        "    def total(self) -> int:",
        "        return sum(range(self.size))",
        "",
        "    def heavy(self):",
        "        import sglang",
        "",
        "        return sglang",
        "",
        "    def to_json(self) -> str:",
        "        return json.dumps({'size': self.size, 'name': self.name, 'cwd': os.getcwd()})",
    ]
    return "\n".join(lines) + "\n"


def _files(source_dirs: list[Path]) -> list[Path]:
    return [path for d in source_dirs for _, path in iter_source_modules(d)]


def _cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system  # parse workers included


class _Clock:
    """Wall and CPU seconds of a block (CPU: this process and its finished children)."""

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), _cpu()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.wall
        self.cpu = _cpu() - self.cpu


def _best(clocks: list[_Clock]) -> tuple[float, float]:
    """The least disturbed run (min wall) and the median CPU: on a shared machine other jobs only
    ever add time, so the minimum is the best estimate of the code's own cost."""
    return min(c.wall for c in clocks), statistics.median(c.cpu for c in clocks)


def _measure(root: Path, source_dirs, packages, policy, repeats: int, cache_path: Path):
    files = _files(source_dirs)
    size = sum(f.stat().st_size for f in files)
    base, cold, warm = [], [], []
    report = None
    for _ in range(repeats):
        with _Clock() as c:
            for f in files:
                ast.parse(f.read_bytes(), str(f))
        base.append(c)
        with _Clock() as c:
            report = check_static(root, source_dirs, packages, policy)
        cold.append(c)
    prime = FactsCache(cache_path)
    ImportGraph.build(root, source_dirs, cache=prime)
    prime.save()
    for _ in range(repeats):
        with _Clock() as c:
            cache = FactsCache(cache_path)
            warm_report = check_static(root, source_dirs, packages, policy, cache=cache)
        warm.append(c)
        assert cache.parsed == 0, "warm run parsed files: the cache did not work"
        assert len(warm_report.violations) == len(report.violations)
    return {
        "files": len(files),
        "kib": size / 1024,
        "baseline": _best(base),
        "cold": _best(cold),
        "warm": _best(warm),
        "violations": len(report.violations),
        "lines": len(report.groups()),
    }


def _print_static(title: str, m: dict, target: float) -> None:
    (bw, bc), (cw, cc), (ww, wc) = m["baseline"], m["cold"], m["warm"]
    verdict = "OK" if cw <= target else "OVER TARGET"
    print(
        f"{title}: {m['files']} files, {m['kib']:.0f} KiB; {m['lines']} offending import line(s), "
        f"{m['violations']} module(s) affected\n"
        f"  baseline read + ast.parse  wall {bw:6.3f} s  cpu {bc:6.3f} s\n"
        f"  static check, cold         wall {cw:6.3f} s  cpu {cc:6.3f} s  "
        f"({cw / bw:.2f}x baseline wall, {cc / bc:.2f}x cpu; target <= {target:g} s: {verdict})\n"
        f"  static check, warm cache   wall {ww:6.3f} s  cpu {wc:6.3f} s  "
        f"({ww / bw:.2f}x baseline wall)"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modules", type=int, default=5000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-runtime", action="store_true")
    args = ap.parse_args()
    load = os.getloadavg()
    print(
        f"machine: {platform.system()} {platform.machine()}, {os.cpu_count()} CPU(s), "
        f"Python {platform.python_version()}, load average {load[0]:.2f} at start"
    )
    with tempfile.TemporaryDirectory(prefix="bench-lazy-imports-") as tmp:
        tmp = Path(tmp)
        policy = load_policy(REPO / "pyproject.toml")
        packages, source_dirs = resolve_packages(REPO, [], list(policy.packages))
        ws = _measure(REPO, source_dirs, packages, policy, args.repeats, tmp / "ws-cache.json")
        _print_static("workspace static", ws, 0.5)

        gen_root = tmp / "generated"
        gen_packages = generate(gen_root, args.modules)
        past = time.time() - 10
        for f in _files([gen_root / "src"]):
            os.utime(f, (past, past))
        gen_policy = parse_policy(
            {
                "gpu-only": ["sglang", "flash_attn", "megatron.bridge"],
                "packages": {"pkg01": {"forbid": ["torch"]}},
            },
            "bench",
        )
        gen = _measure(
            gen_root,
            [gen_root / "src"],
            gen_packages,
            gen_policy,
            args.repeats,
            tmp / "gen-cache.json",
        )
        _print_static(f"generated tree ({args.modules} modules)", gen, 3.0)

    if not args.no_runtime:
        report = check_runtime(REPO, source_dirs, packages, policy)
        verdict = "OK" if report.seconds <= 30 else "OVER TARGET"
        print(
            f"workspace runtime: {len(packages)} package(s), one subprocess each, all at once: "
            f"{report.seconds:.1f} s wall (target <= 30 s: {verdict}); "
            f"{len(report.findings)} finding(s)"
        )
        for r in report.results:
            print(f"  {r.package:<16} {len(r.imported):>4} module(s)  {r.seconds:6.1f} s")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
