"""``mizzen-ci``'s own surface on a bare runner (``python -S``): a usage error of any command is
one line with the fix (never argparse's usage block), ``--help`` is plain text (no RST markup),
``--version`` answers from the installed metadata (or says it is a source tree) and is read only
when asked."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version

import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=5, labels=["ci"])

#: (argv, what the one line says)
USAGE_ERRORS = [
    (["lint"], "argument COMMAND: invalid choice: 'lint'"),
    ([], "the following arguments are required: COMMAND"),
    (["validate", "--bogus"], "unrecognized arguments: --bogus"),
    (["validate", "/nope"], "unrecognized arguments: /nope"),
    (["plan", "--event"], "argument --event: expected one argument"),
    (["history", "record", "--lane", "cpu"], "required: --junit"),
    (["gate", "check", "--bogus"], "unrecognized arguments: --bogus"),
    (["gpu-lane", "hopper", "--retries", "x"], "argument --retries: invalid int value: 'x'"),
    (["gpu-lane", "hopper", "--bogus"], "unrecognized arguments: --bogus"),
]


@pytest.mark.parametrize(
    ("argv", "needle"), USAGE_ERRORS, ids=[" ".join(a) for a, _ in USAGE_ERRORS]
)
def test_a_usage_error_is_one_line_with_the_fix(mizzen_ci, repo_root, argv, needle) -> None:
    out = mizzen_ci(*argv, cwd=repo_root, timeout=30)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and needle in out.stderr, out.stderr
    assert "; fix: see mizzen-ci" in out.stderr and "Traceback" not in out.stderr


def test_help_is_plain_text(mizzen_ci, repo_root) -> None:
    out = mizzen_ci("--help", cwd=repo_root)
    assert out.returncode == 0 and "``" not in out.stdout and ":class:" not in out.stdout
    assert "--version" in out.stdout


def test_version_from_the_installed_metadata(mizzen_ci, repo_root) -> None:
    bare = mizzen_ci("--version", cwd=repo_root)  # python -S: no site-packages, a source tree
    assert bare.stdout == "mizzen-ci unknown (not installed: running from a source tree)\n"
    installed = subprocess.run(
        [sys.executable, "-m", "mizzen_ci", "--version"], capture_output=True, text=True
    )
    assert installed.stdout == f"mizzen-ci {version('mizzen-ci')}\n"
    probe = "import sys, mizzen_ci.cli; sys.exit('importlib.metadata' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-S", "-c", probe], cwd=repo_root / "ci" / "src").returncode
        == 0
    )
