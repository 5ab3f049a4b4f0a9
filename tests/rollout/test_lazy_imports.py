"""Every module of mizzen_rollout (this package's own; ``harbor/`` is checked by its tests)
imports with torch, ray, transformers, harbor and sglang blocked: the base install (httpx only)
imports everything."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from mizzen_ci import register_cpu_ci

# It imports every module of the workspace in a subprocess: no import of its own shows them.
register_cpu_ci(est_time=3, labels=["rollout"], watches=["packages/*/src/**/*.py"])

BLOCKED = ("torch", "ray", "transformers", "harbor", "sglang")

SCRIPT = textwrap.dedent(
    """
    import importlib, importlib.abc, pkgutil, sys

    BLOCKED = {blocked!r}

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"blocked heavy import: {{name}}")
            return None

    sys.meta_path.insert(0, Block())
    import mizzen_rollout

    names = []
    for info in pkgutil.walk_packages(mizzen_rollout.__path__, "mizzen_rollout."):
        if info.name.startswith("mizzen_rollout.harbor") or info.name.endswith("__main__"):
            continue
        importlib.import_module(info.name)
        names.append(info.name)
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not loaded, loaded
    print("\\n".join(names))
    """
).format(blocked=BLOCKED)


def test_every_module_imports_without_heavy_libraries():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    imported = set(proc.stdout.split())
    for module in (
        "mizzen_rollout.samples",
        "mizzen_rollout.engines.client",
        "mizzen_rollout.engines.launcher",
        "mizzen_rollout.engines.embedded.backend",
        "mizzen_rollout.engines.embedded.server",
        "mizzen_rollout.manager",
        "mizzen_rollout.cli",
    ):
        assert module in imported
