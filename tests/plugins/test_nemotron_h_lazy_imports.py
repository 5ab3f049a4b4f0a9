"""The repo's lazy-import check catches a module-scope GPU-only import in the Nemotron-H plugin.

A copy of ``mizzen_plugins`` is written to a temporary tree with ``import mamba_ssm`` at module
scope in ``nemotron_h/scan_backend.py`` (where the lazy ``mamba_ssm`` import really lives);
``python -m mizzen_ci lazy-imports`` must reject it, statically and at run time, printing the whole
import chain down to that line.  The untouched copy passes, so the finding is the injected line.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci

# It copies the plugins source tree and checks it in subprocesses against the workspace policy.
register_cpu_ci(est_time=40, labels=["ssm", "plugins"], watches=["packages/*/src/**/*.py"])

REPO = Path(__file__).resolve().parents[2]
PLUGINS_PACKAGE = REPO / "packages" / "plugins" / "src" / "mizzen_plugins"
TARGET = "src/mizzen_plugins/nemotron_h/scan_backend.py"


def lazy_imports(root: Path, *options: str, forbid: str | None = "mamba_ssm"):
    """``python -m mizzen_ci lazy-imports`` on ``root``'s mizzen_plugins (a real subprocess)."""
    forbidding = ("--forbid", forbid) if forbid else ()
    return subprocess.run(
        [
            *(sys.executable, "-m", "mizzen_ci", "lazy-imports", "--root", str(root)),
            *("--package", "mizzen_plugins", *forbidding, *options),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
    )


@pytest.fixture
def plugin_copy(tmp_path):
    shutil.copytree(
        PLUGINS_PACKAGE,
        tmp_path / "src" / "mizzen_plugins",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    return tmp_path


def inject_module_scope_import(root: Path) -> int:
    """Put ``import mamba_ssm`` at module scope of the copy's scan backend; its line number."""
    path = root / TARGET
    lines = path.read_text().splitlines(keepends=True)
    line = next(i for i, text in enumerate(lines) if text == "import torch\n")
    lines.insert(line, "import mamba_ssm\n")
    path.write_text("".join(lines))
    return line + 1


def test_the_untouched_plugin_copy_is_clean(plugin_copy):
    result = lazy_imports(plugin_copy, "--static")
    assert result.returncode == 0, result.stdout + result.stderr


def test_static_check_rejects_a_module_scope_mamba_ssm_import_with_the_chain(plugin_copy):
    line = inject_module_scope_import(plugin_copy)
    result = lazy_imports(plugin_copy, "--static")
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert f"{TARGET}:{line} imports mamba_ssm (module scope)" in out
    # The chain from a package module down to the offending line.
    assert "src/mizzen_plugins/nemotron_h/mixer.py:" in out
    assert "imports mizzen_plugins.nemotron_h.scan_backend (module scope)" in out
    assert "Fix: move the import into the function that uses it" in out

    # The repository's own policy forbids it as well (mamba_ssm is GPU-only there).
    with_policy = lazy_imports(
        plugin_copy, "--static", "--policy", str(REPO / "pyproject.toml"), forbid=None
    )
    out = with_policy.stdout + with_policy.stderr
    assert with_policy.returncode == 1, out
    assert f"{TARGET}:{line} imports mamba_ssm (module scope)" in out


def test_runtime_check_rejects_it_with_the_chain(plugin_copy):
    line = inject_module_scope_import(plugin_copy)
    result = lazy_imports(plugin_copy, "--runtime")
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert f"{TARGET}:{line} asked for mamba_ssm while importing mizzen_plugins" in out
    assert f"{TARGET}:{line}  import mamba_ssm" in out
    assert (
        "src/mizzen_plugins/nemotron_h/mixer.py:" in out
        and "from mizzen_plugins.nemotron_h.scan_backend import selective_scan" in out
    )
