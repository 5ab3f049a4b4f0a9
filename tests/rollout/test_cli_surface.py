"""What every mizzen command line shares (:mod:`mizzen_rollout.cli_surface`), and
``mizzen-rollout``'s own surface through the real CLI.

- Third-party warnings (a warning raised from a file of site-packages or the standard library, a
  record of megatron's or torch's loggers below ERROR) are hidden and counted in one summary
  line; mizzen's own warnings and third-party errors still show; ``verbose`` changes nothing.
- Usage errors are one line with the fix; ``--model /nope`` is refused before an engine starts;
  every option of ``--help`` has text and shows its default once; ``--version`` is the installed
  distribution's.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import sysconfig
import warnings
from importlib.metadata import version
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_rollout.api import quiet_third_party

register_cpu_ci(est_time=6, labels=["rollout"])

SITE = Path(sysconfig.get_paths()["purelib"]) / "megatron" / "core" / "optimizer" / "__init__.py"


def _warn_from(filename: Path | str, category: type[Warning] = UserWarning) -> None:
    warnings.warn_explicit("Apex is not installed", category, str(filename), 25, module="x")


def test_third_party_warnings_and_logs_are_counted_in_one_line(capsys) -> None:
    shown: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, category, filename, *rest: shown.append(filename)
        finish = quiet_third_party("prog", verbose=False)
        try:
            _warn_from(SITE)
            _warn_from(SITE, SyntaxWarning)
            _warn_from(Path(__file__))  # the user's own code: shown
            logger = logging.getLogger("megatron.core.models.gpt.gpt_model")
            logger.warning("GPTModel IS DEPRECATED")
            logging.getLogger("torch.utils.cpp_extension").warning("No CUDA runtime is found")
            logging.getLogger("megatron.core").error("a real megatron error")
        finally:
            finish()
    err = capsys.readouterr().err
    assert shown == [str(Path(__file__))]  # only the user's own warning went on
    assert "GPTModel" not in err and "No CUDA runtime" not in err
    assert err.splitlines() == [
        "megatron.core: ERROR: a real megatron error",
        "prog: 4 third-party warning(s) hidden (megatron 3, torch 1); --verbose shows them",
    ]


def test_a_warning_is_counted_for_its_library_whatever_the_roots_order() -> None:
    """A venv's site-packages lies inside its lib/python3.X (a root too): the library is named
    from the deepest root (the summary said "site-packages 8" on some hash seeds)."""
    from mizzen_rollout.cli_surface import library_of

    purelib = str(SITE.parents[3])
    roots = (str(Path(purelib).parent), "/nowhere", purelib)
    assert library_of(str(SITE), roots) == library_of(str(SITE), roots[::-1]) == "megatron"
    assert library_of("/elsewhere/x.py", roots) == "?"


def test_verbose_hides_nothing_and_finishing_restores(capsys) -> None:
    before = warnings.showwarning
    quiet_third_party("prog", verbose=True)()
    assert warnings.showwarning is before
    finish = quiet_third_party("prog", verbose=False)
    finish()
    finish()  # twice is harmless
    assert warnings.showwarning is before
    assert logging.getLogger("megatron").propagate
    assert capsys.readouterr().err == ""  # nothing hidden, no summary


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mizzen_rollout", *args], capture_output=True, text=True, timeout=60
    )


BAD = [
    (["generate", "--data", "example:math", "--out", "{tmp}/s.jsonl", "--model", "/nope"],
     "--model /nope: no such directory"),
    (["generate", "--data", "example:math", "--out", "{tmp}/s.jsonl", "--bogus"],
     "unrecognized arguments: --bogus"),
    ([], "the following arguments are required: command"),
    (["serve", "--backend", "vllm"], "argument --backend: invalid choice: 'vllm'"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "needle"), BAD, ids=[" ".join(a[-2:]) for a, _ in BAD])
def test_a_bad_argument_is_one_line_before_any_engine(tmp_path, argv, needle) -> None:
    out = _cli(*[a.format(tmp=tmp_path) for a in argv])
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1 and needle in out.stderr, out.stderr
    assert "fix:" in out.stderr and "starting the embedded engine" not in out.stderr


def test_every_option_has_help_and_shows_its_default_once() -> None:
    from mizzen_rollout.cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in subparsers.choices.items():
        text = command.format_help()
        assert "(default: None)" not in text and "(default: False)" not in text, name
        for line in text.splitlines():
            assert line.count("default") <= 1, (name, line)
        for action in command._actions:
            assert action.help, (name, action.option_strings)


def test_version_is_the_installed_distributions() -> None:
    out = _cli("--version")
    assert out.stdout.strip() == f"mizzen-rollout {version('mizzen-rollout')}"
