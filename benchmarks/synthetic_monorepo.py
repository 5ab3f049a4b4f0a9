"""A generator of synthetic mizzen-shaped monorepos for the planner benchmarks.

``generate(root, modules=5000, tests=10000, seed=0)`` writes a uv workspace with the repository's
layout: ``packages/<pkg>/src/<pkg>/…`` (packages of layered subpackages), ``tests/<pkg>/<sub>/``
test files with registrations (CPU and CUDA, several arches, 1/2/4/8 GPUs), ``conftest.py``
files, a copy of a fleet table, and a root ``pyproject.toml``.

Import fan-out (realistic, deterministic from ``seed``):
- Modules are layered inside each package (``layer0`` … ``layerK``); a module imports 1–6 others
  from its own or lower layers, preferring a few popular "core" modules (Zipf-like), plus stdlib
  modules; one import in four is written inside a function (lazy) and a few are relative.
- About one module in ten also imports a module of another package (lower package index), so
  packages depend on each other the way ``train`` depends on ``plugins``.
- A test file imports 1–4 modules of its package (plus, sometimes, of another), half of them
  lazily inside test functions, as real tests do.

With ``hidden=True`` the tree also holds the dependencies no plain import shows (what the
planner's soundness check, ``benchmarks/check_plan_soundness.py``, exercises), per package:

- a ``__main__.py``, a console script and a plugin entry point in its ``pyproject.toml``;
- a package data file that one of its modules names by path (``Path(__file__).parent / …``);
- a module importing by a computed name (``importlib.import_module(f"…{name}")``) and one
  importing through an alias (``import importlib as il``; ``il.import_module("…")``);
- tests that import through ``pytest.importorskip``, ``from importlib import import_module as
  load``, a relative name with a literal package, or a computed name;
- test data under ``area*/data/`` (read by the area's tests, and by a test elsewhere by path);
- a helper under ``tests/<pkg>/shared/`` that the area conftests load by path;
- a worker script under ``tests/<pkg>/tools/`` importing its sibling ``kit*.py``, run by a test
  of another directory by path, and tests running ``python -m <pkg>`` without importing it;
- a test importing another test file as a sibling (``sys.path``), tests declaring ``watches``,
  and a test reading the root ``README.md``.

Invariants: pure function of its arguments; files are small but syntactically rich (functions,
classes, decorators, docstrings) so that parsing costs what real files cost.  ``hidden=False``
(the default) writes exactly the tree it always wrote (the speed benchmarks' tree).
"""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

STDLIB = ("os", "sys", "json", "math", "re", "itertools", "functools", "dataclasses", "pathlib")
ARCH_CHOICES = ((("hopper",), 0.45), (("blackwell",), 0.15), (("hopper", "blackwell"), 0.40))
GPU_CHOICES = ((1, 0.5), (2, 0.25), (4, 0.15), (8, 0.10))
LABELS = ("train", "lora", "megatron", "attention", "plugins", "rollout", "distributed")


@dataclass
class Repo:
    """What was generated: module name -> file, its imports; test file -> imported modules."""

    root: Path
    modules: dict[str, str] = field(default_factory=dict)
    imports: dict[str, list[str]] = field(default_factory=dict)  # module -> modules it imports
    tests: dict[str, list[str]] = field(default_factory=dict)
    gpu_tests: set[str] = field(default_factory=set)
    packages: list[str] = field(default_factory=list)


def _weighted(rng: random.Random, choices):
    values, weights = zip(*choices, strict=True)
    return rng.choices(values, weights)[0]


def _module_source(rng: random.Random, name: str, imports: list[tuple[str, bool]]) -> str:
    eager = [m for m, lazy in imports if not lazy]
    lazy = [m for m, lazy in imports if lazy]
    lines = [f'"""Synthetic module {name}."""', "", "from __future__ import annotations", ""]
    for s in rng.sample(STDLIB, 2):
        lines.append(f"import {s}")
    for m in eager:
        if rng.random() < 0.5 and "." in m:
            pkg, _, leaf = m.rpartition(".")
            lines.append(f"from {pkg} import {leaf}")
        else:
            lines.append(f"import {m}")
    lines.append("")
    for k in range(rng.randint(2, 4)):
        lines += [
            "",
            f"def function_{k}(x, y=1, *args, **kwargs):",
            f'    """Do step {k} of {name}."""',
        ]
        if lazy and k == 0:
            lines += [f"    import {m}" for m in lazy]
        lines += [
            "    total = 0",
            "    for i in range(x):",
            "        if i % 3 == 0:",
            "            total += i * y",
            "        else:",
            "            total -= len(args) + len(kwargs)",
            f"    return {{'name': {name!r}, 'total': total, 'k': {k}}}",
        ]
    lines += [
        "",
        "",
        "class Component:",
        '    """A component with a few methods."""',
        "",
        "    def __init__(self, size: int = 4) -> None:",
        "        self.size = size",
        "        self.items = [i * i for i in range(size)]",
        "",
        "    @property",
        "    def total(self) -> int:",
        "        return sum(self.items)",
        "",
        "    def scaled(self, factor: float) -> list[float]:",
        "        return [x * factor for x in self.items if x >= 0]",
        "",
    ]
    return "\n".join(lines)


def _test_source(rng: random.Random, imports: list[tuple[str, bool]], registration: str) -> str:
    lines = [
        '"""Synthetic tests."""',
        "",
        "from __future__ import annotations",
        "",
        "import pytest",
    ]
    lines += [f"import {m}" for m, lazy in imports if not lazy]
    lines += ["", "from mizzen_ci import register_cpu_ci, register_cuda_ci", "", registration, ""]
    lazy = [m for m, lazy in imports if lazy]
    for k in range(rng.randint(2, 5)):
        lines += ["", f"@pytest.mark.parametrize('n', [1, 2, {k + 3}])", f"def test_case_{k}(n):"]
        if lazy and k == 0:
            lines += [f"    import {m}" for m in lazy]
        lines += [
            "    values = [i for i in range(n)]",
            "    assert len(values) == n",
            f"    assert sum(values) >= {k} - {k}",
        ]
    return "\n".join(lines) + "\n"


def _registration(rng: random.Random, gpu: bool) -> str:
    if not gpu:
        return f"register_cpu_ci(est_time={rng.randint(2, 120)}, labels=['ci'])"
    hardware = list(_weighted(rng, ARCH_CHOICES))
    gpus = _weighted(rng, GPU_CHOICES)
    est = int(min(9000, max(30, rng.lognormvariate(5.7, 1.1))))
    label = rng.choice(LABELS)
    return (
        f"register_cuda_ci(est_time={est}, hardware={hardware!r}, num_gpus={gpus}, "
        f"labels=[{label!r}])"
    )


def generate(
    root: Path | str,
    *,
    modules: int = 5000,
    tests: int = 10000,
    packages: int = 10,
    gpu_share: float = 0.3,
    seed: int = 0,
    fleet: Path | str | None = None,
    hidden: bool = False,
) -> Repo:
    """Write a synthetic monorepo under ``root`` (emptied first); ``hidden``: see the module
    docstring."""
    rng = random.Random(seed)
    root = Path(root)
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    repo = Repo(root)
    per_pkg = modules // packages
    layers = 6
    all_modules: list[list[str]] = []
    for p in range(packages):
        pkg = f"syn{p}"
        repo.packages.append(pkg)
        src = root / "packages" / pkg / "src" / pkg
        names: list[str] = []
        # subpackages: pkg.layer{L}.{group}; modules in them
        for k in range(per_pkg):
            layer = min(layers - 1, k * layers // per_pkg)
            group = k % 7
            names.append(f"{pkg}.layer{layer}.g{group}.m{k}")
        all_modules.append(names)
        (root / "packages" / pkg).mkdir(parents=True, exist_ok=True)
        (root / "packages" / pkg / "pyproject.toml").write_text(
            f'[project]\nname = "{pkg}"\nversion = "0.1.0"\n'
        )
        inits = {pkg} | {n.rsplit(".", 1)[0] for n in names} | {n.rsplit(".", 2)[0] for n in names}
        for init in sorted(inits):
            d = src.parent.joinpath(*init.split("."))
            d.mkdir(parents=True, exist_ok=True)
            (d / "__init__.py").write_text(f'"""Package {init}."""\n')
            repo.modules[init] = (d / "__init__.py").relative_to(root).as_posix()

    for p, names in enumerate(all_modules):
        core = names[: max(5, len(names) // 50)]  # popular low-layer modules
        for k, name in enumerate(names):
            candidates = names[:k] or []
            imports: list[tuple[str, bool]] = []
            for _ in range(rng.randint(1, 6) if candidates else 0):
                pool = core if rng.random() < 0.4 and core[0] != name else candidates
                target = rng.choice([c for c in pool if c != name] or candidates)
                imports.append((target, rng.random() < 0.25))
            if p and rng.random() < 0.1:
                other = all_modules[rng.randrange(p)]
                imports.append((rng.choice(other[: len(other) // 2]), rng.random() < 0.25))
            imports = list(dict.fromkeys(imports))
            path = root / "packages" / f"syn{p}" / "src" / Path(*name.split("."))
            path = path.with_suffix(".py")
            path.write_text(_module_source(rng, name, imports))
            repo.modules[name] = path.relative_to(root).as_posix()
            repo.imports[name] = [m for m, _ in imports]

    for t in range(tests):
        p = t % packages
        names = all_modules[p]
        sub = f"area{(t // packages) % 20}"
        d = root / "tests" / f"syn{p}" / sub
        if not d.exists():
            d.mkdir(parents=True)
            (d / "conftest.py").write_text(
                "import pytest\n\n\n@pytest.fixture\ndef value():\n    return 1\n"
            )
        imports = [(rng.choice(names), rng.random() < 0.5) for _ in range(rng.randint(1, 4))]
        if p and rng.random() < 0.2:
            imports.append((rng.choice(all_modules[rng.randrange(p)]), False))
        imports = list(dict.fromkeys(imports))
        gpu = rng.random() < gpu_share
        rel = f"tests/syn{p}/{sub}/test_{t:05d}.py"
        (root / rel).write_text(_test_source(rng, imports, _registration(rng, gpu)))
        repo.tests[rel] = [m for m, _ in imports]
        if gpu:
            repo.gpu_tests.add(rel)

    if hidden:
        _add_hidden_dependencies(root, repo, random.Random(seed + 1), all_modules)

    members = ", ".join(f'"packages/{p}"' for p in repo.packages)
    (root / "pyproject.toml").write_text(
        '[project]\nname = "synthetic"\nversion = "0.1.0"\n\n'
        f"[tool.uv.workspace]\nmembers = [{members}]\n"
    )
    (root / "ci").mkdir()
    fleet = Path(fleet) if fleet else Path(__file__).resolve().parents[1] / "ci" / "fleet.toml"
    shutil.copy(fleet, root / "ci" / "fleet.toml")
    return repo


_CPU = (
    "from mizzen_ci import register_cpu_ci\n\nregister_cpu_ci(est_time=5, labels=['ci']{extra})\n"
)


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _test(root: Path, repo: Repo, rel: str, body: str, extra: str = "") -> None:
    _write(root, rel, '"""Synthetic test."""\n\n' + body + "\n" + _CPU.format(extra=extra))
    repo.tests[rel] = []


def _add_hidden_dependencies(
    root: Path, repo: Repo, rng: random.Random, all_modules: list[list[str]]
) -> None:
    """The dependencies no plain import shows (see the module docstring)."""
    _write(root, "README.md", "# synthetic\n")
    for p, names in enumerate(all_modules):
        pkg = repo.packages[p]
        src = f"packages/{pkg}/src/{pkg}"
        pick = rng.choice
        # __main__, a console script and a plugin entry point
        _write(root, f"{src}/__main__.py", f"from {pkg} import cli\n\ncli.main()\n")
        _write(root, f"{src}/cli.py", f"import {pick(names)}\n\n\ndef main():\n    return 0\n")
        plugin = pick(names)
        (root / "packages" / pkg / "pyproject.toml").write_text(
            f'[project]\nname = "{pkg}"\nversion = "0.1.0"\n\n'
            f'[project.scripts]\n{pkg}-cli = "{pkg}.cli:main"\n\n'
            f'[project.entry-points."synthetic.plugins"]\n{pkg} = "{plugin}:Component"\n'
        )
        # package data named by a module; a computed and an aliased dynamic import
        _write(root, f"{src}/data/table_{pkg}.json", "{}\n")
        _write(
            root,
            f"{src}/tables.py",
            "from pathlib import Path\n\n"
            f'TABLE = Path(__file__).parent / "data" / "table_{pkg}.json"\n',
        )
        _write(
            root,
            f"{src}/registry.py",
            "import importlib\n\n\ndef load(name):\n"
            f'    return importlib.import_module(f"{pkg}.{{name}}")\n',
        )
        _write(
            root,
            f"{src}/aliased.py",
            f'import importlib as il\n\nMOD = il.import_module("{pick(names)}")\n',
        )
        for extra in ("cli", "tables", "registry", "aliased"):
            repo.modules[f"{pkg}.{extra}"] = f"{src}/{extra}.py"
        repo.modules[f"{pkg}.__main__"] = f"{src}/__main__.py"
        tests = f"tests/{pkg}"
        # a helper loaded by path from the area conftests, beside a worker and its kit
        _write(root, f"{tests}/shared/engine_{pkg}.py", f"import {pick(names)}\n")
        _write(root, f"{tests}/tools/kit_{pkg}.py", f"import {pick(names)}\n")
        _write(root, f"{tests}/tools/worker_{pkg}.py", f"import kit_{pkg}\n\nkit_{pkg}.run = 1\n")
        areas = sorted({t.split("/")[2] for t in repo.tests if t.startswith(f"{tests}/area")})
        for a in areas:
            conftest = root / tests / a / "conftest.py"
            conftest.write_text(
                conftest.read_text() + "\nimport importlib.util\nfrom pathlib import Path\n\n"
                f'ENGINE = Path(__file__).parent.parent / "shared" / "engine_{pkg}.py"\n'
            )
            _write(root, f"{tests}/{a}/data/case_{pkg}_{a}.json", "{}\n")
        a0, a1 = areas[0], areas[-1]
        package, _, leaf = pick(names).rpartition(".")
        forms = [
            f'import pytest\n\nMOD = pytest.importorskip("{pick(names)}")\n',
            f'from importlib import import_module as load\n\nMOD = load("{pick(names)}")\n',
            "import importlib\n\n\ndef test_relative():\n"
            f'    importlib.import_module(".{leaf}", "{package}")\n',
            f"import importlib\nimport {pkg}\n\n\ndef test_computed(name='x'):\n"
            f'    importlib.import_module(f"{pkg}.{{name}}")\n',
        ]
        for k, form in enumerate(forms):
            _test(root, repo, f"{tests}/{a0}/test_dynamic_{k}.py", form)
        _test(
            root,
            repo,
            f"{tests}/{a1}/test_reads_other_data.py",
            "from pathlib import Path\n\n"
            f'CASE = Path("tests") / "{pkg}/{a0}/data/case_{pkg}_{a0}.json"\n',
        )
        _test(
            root,
            repo,
            f"{tests}/{a1}/test_runs_worker.py",
            "import subprocess\nimport sys\nfrom pathlib import Path\n\n"
            f'WORKER = Path(__file__).parent.parent / "tools" / "worker_{pkg}.py"\n\n\n'
            "def test_worker():\n    subprocess.run([sys.executable, str(WORKER)], check=True)\n",
        )
        _test(
            root,
            repo,
            f"{tests}/{a1}/test_python_m.py",
            "import subprocess\nimport sys\n\n\ndef test_cli():\n"
            f'    subprocess.run([sys.executable, "-m", "{pkg}"], check=True)\n',
        )
        _test(
            root,
            repo,
            f"{tests}/{a1}/test_sibling_test.py",
            "import sys\nfrom pathlib import Path\n\nsys.path.insert(0, str(Path(__file__).parent))\n"
            "import test_python_m\n",
        )
        _test(
            root,
            repo,
            f"{tests}/{a1}/test_watches_package.py",
            "",
            extra=f', watches=["packages/{pkg}/src/**/*.py"]',
        )
    _test(
        root,
        repo,
        "tests/docs/test_readme.py",
        'from pathlib import Path\n\nREADME = Path(__file__).parents[2] / "README.md"\n',
    )
    _test(
        root,
        repo,
        "tests/policy/test_every_module_imports.py",
        "",
        extra=', watches=["packages/*/src/**/*.py"]',
    )


def leaf_modules(repo: Repo) -> list[str]:
    """Modules (not packages) that no other module imports, sorted."""
    imported = {m for targets in repo.imports.values() for m in targets}
    return sorted(m for m in repo.imports if m not in imported)
