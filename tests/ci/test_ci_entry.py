"""`.ci/run` leaves the machine's tools working: the `python3.12` it puts first on PATH (written by
`.ci/python-shim`) runs the interpreter by its real path, so a script pip installs through it
(nox) gets a shebang that still exists after `.ci/run` deletes its temporary directory."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=40, labels=["ci"])

ROOT = Path(__file__).resolve().parents[2]


def test_pip_scripts_installed_through_the_shim_outlive_it(tmp_path):
    shim_dir, target = tmp_path / "bin", tmp_path / "site"
    shim_dir.mkdir()
    link = tmp_path / "via-link" / "python3.12"  # a python reached through a link, as pyenv's
    link.parent.mkdir()
    link.symlink_to(sys.executable)
    subprocess.run(
        ["bash", str(ROOT / ".ci" / "python-shim"), str(shim_dir), str(link)], check=True
    )
    shim = shim_dir / "python3.12"
    shown = subprocess.run(
        [str(shim), "-c", "import sys; print(sys.executable)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(shown) == Path(sys.executable).resolve(), shown
    # pip writes sys.executable into the shebang of a console script it installs (as it does nox's)
    subprocess.run(
        [str(shim), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target",
         str(target), str(_console_script_wheel(tmp_path))],
        check=True, capture_output=True,
    )  # fmt: skip
    script = target / "bin" / "shimdemo"
    shutil.rmtree(shim_dir)
    shutil.rmtree(link.parent)
    assert script.read_text().splitlines()[0] == f"#!{Path(sys.executable).resolve()}"
    done = subprocess.run(
        [str(script)], capture_output=True, text=True, env={"PYTHONPATH": str(target)}
    )
    assert done.returncode == 0 and done.stdout.strip() == "shimdemo ran", done.stderr


def _console_script_wheel(tmp_path: Path) -> Path:
    """A one-module wheel with a console script ``shimdemo`` (built by hand: no build backend)."""
    import zipfile

    path = tmp_path / "shimdemo-0.1-py3-none-any.whl"
    files = {
        "shimdemo.py": "def main():\n    print('shimdemo ran')\n",
        "shimdemo-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: shimdemo\nVersion: 0.1\n",
        "shimdemo-0.1.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
        "shimdemo-0.1.dist-info/entry_points.txt": "[console_scripts]\nshimdemo = shimdemo:main\n",
    }
    record = "".join(f"{name},,\n" for name in files) + "shimdemo-0.1.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, text in {**files, "shimdemo-0.1.dist-info/RECORD": record}.items():
            wheel.writestr(name, text)
    return path


def test_nox_installed_by_the_ci_set_up_runs_after_it(tmp_path):
    """`.ci/setup` (the set-up part of `.ci/run`: Python 3.12, the shim, the README command's
    `pip install uv nox`), then its temporary folder deleted as `.ci/run` deletes it: the `nox`
    it installed still lists the sessions.  Installed into a user base of its own
    (PYTHONUSERBASE, PIP_USER, reinstalling what the machine has), so the machine's own tools are
    untouched.  This needs PyPI (uv and nox are downloaded, or taken from pip's cache): the
    install line under test is the one that reaches the registry."""
    import os

    userbase, shim_dir = tmp_path / "userbase", tmp_path / "bin"
    env = {**os.environ, "PYTHONUSERBASE": str(userbase), "PIP_USER": "1",
           "PIP_IGNORE_INSTALLED": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
           "PIP_BREAK_SYSTEM_PACKAGES": "1"}  # fmt: skip
    setup = subprocess.run(
        ["bash", str(ROOT / ".ci" / "setup"), str(shim_dir)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert setup.returncode == 0, setup.stderr[-3000:]
    python = Path(setup.stdout.strip())
    nox = userbase / "bin" / "nox"
    assert nox.read_text().splitlines()[0] == f"#!{python}"  # the real path, not the shim's
    shutil.rmtree(shim_dir)  # what .ci/run's clean-up does
    listed = subprocess.run(
        [str(nox), "-l", "-f", str(ROOT / "noxfile.py")],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr[-3000:]
    assert "- plan" in listed.stdout or "* plan" in listed.stdout, listed.stdout
