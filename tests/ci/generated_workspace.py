"""Generated workspaces for the planner's tests: a random but seeded repository to plan over.

A plain module (not a test file, not a conftest): ``tests/ci/conftest.py`` loads it by path and
hands it to tests as the ``workspace_kit`` fixture.

Invariants:
- ``make_workspace(root, seed, modules, tests)`` is a pure function of its arguments (and of
  the fleet fixture ``tests/ci/fixtures/registry/fleet.toml``): the same arguments write the same
  bytes.  The workspace has two packages (``alpha``, ``beta``, each with a ``sub`` package) whose
  modules import one another absolutely, relatively, lazily, guarded, under ``TYPE_CHECKING``,
  through ``importlib`` and a PEP 562 ``__getattr__``; one module does not parse; test files in
  three areas carry the registrations of :data:`REGISTRATIONS` in turn (valid and invalid), one
  test file has none, one lies outside ``tests/``, and each area has a conftest; area 1 has a
  helper.
- ``age_all(root)`` only moves mtimes (10 s into the past); it never changes a byte.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

FLEET = (Path(__file__).resolve().parent / "fixtures" / "registry" / "fleet.toml").read_text()
HEADER = "from mizzen_ci import register_cpu_ci, register_cuda_ci\n"
REGISTRATIONS = [
    "register_cpu_ci(est_time=5, labels=['ci'])",
    "register_cpu_ci(est_time=5, labels=['ci'], nightly=True)",
    "register_cuda_ci(est_time=60, hardware=['hopper'], labels=['lora'])",
    "register_cuda_ci(est_time=60, hardware=['hopper'], num_gpus=2, labels=['rollout'])",
    "register_cpu_ci(est_time=0)",  # error: est_time
    "register_cuda_ci(est_time=60, labels=['lora'])",  # error: hardware required
    "register_cpu_ci(est_time=5, labels=['nope'])",  # error: unknown label
    "register_cpu_ci(est_time=f'{1}')",  # error: f-string
]


def make_workspace(root: Path, seed: int = 0, modules: int = 30, tests: int = 24) -> None:
    rng = random.Random(seed)
    files: dict[str, str] = {
        "pyproject.toml": '[project]\nname = "ws"\nversion = "0"\n\n'
        '[tool.uv.workspace]\nmembers = ["packages/*"]\n',
        "ci/fleet.toml": FLEET,
    }
    names: list[str] = []
    for pkg in ("alpha", "beta"):
        files[f"packages/{pkg}/pyproject.toml"] = f'[project]\nname = "{pkg}"\nversion = "0"\n'
        files[f"packages/{pkg}/src/{pkg}/__init__.py"] = '"""A package."""\n'
        files[f"packages/{pkg}/src/{pkg}/sub/__init__.py"] = ""
        names += [pkg, f"{pkg}.sub"]
    for k in range(modules):
        pkg = "alpha" if k % 2 else "beta"
        sub = ".sub" if k % 3 == 0 else ""
        name = f"{pkg}{sub}.m{k}"
        lines = []
        for _ in range(rng.randint(0, 4)):
            target = rng.choice(names)
            how = rng.randrange(7)
            if how == 0:
                lines.append(f"import {target}")
            elif how == 1 and "." in target:
                parent, _, leaf = target.rpartition(".")
                lines.append(f"from {parent} import {leaf}")
            elif how == 2:
                lines.append(f"def f{len(lines)}():\n    import {target}")
            elif how == 3:
                lines.append(f"try:\n    import {target}\nexcept ImportError:\n    pass")
            elif how == 4:
                lines.append(f"import importlib\nimportlib.import_module({target!r})")
            elif how == 5:
                lines.append(
                    f"from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import {target}"
                )
            else:
                lines.append("from . import m0" if sub else "from .sub import helper_name")
        if k == 7:
            lines.append(f"def __getattr__(name):\n    import {rng.choice(names)}\n    return 1")
        if k == 11:
            lines.append("def broken(:")
        files[f"packages/{pkg}/src/{pkg}{sub.replace('.', '/')}/m{k}.py"] = "\n".join(lines) + "\n"
        names.append(name)
    for t in range(tests):
        area = f"tests/area{t % 3}"
        imports = [f"import {rng.choice(names)}" for _ in range(rng.randint(0, 3))]
        if t % 4 == 0:
            imports.append(f"def test_lazy():\n    import {rng.choice(names)}")
        reg = REGISTRATIONS[t % len(REGISTRATIONS)]
        files[f"{area}/test_t{t}.py"] = "\n".join([*imports, HEADER + reg]) + "\n"
        files[f"{area}/conftest.py"] = "import pytest\n"
    files["tests/area1/helper.py"] = f"import {names[5]}\n"
    files["tests/area2/test_no_registration.py"] = "def test_x():\n    pass\n"
    files["tools/test_outside.py"] = HEADER + REGISTRATIONS[0] + "\n"
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def age_all(root: Path) -> None:
    """Move every mtime 10 s into the past, out of the racy window (as time passing would)."""
    past = time.time() - 10
    for d, _, fs in os.walk(root):
        for f in fs:
            os.utime(os.path.join(d, f), (past, past))
