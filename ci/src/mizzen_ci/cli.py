"""``mizzen-ci`` / ``python -m mizzen_ci``: the command-line entry of mizzen's CI.

Invariants:
- Runs with ``python3 -S`` from a bare checkout (``PYTHONPATH=ci/src``): every command module is
  stdlib-only.
- One table, :data:`COMMANDS`, maps a command to the module that implements it; such a module
  provides ``add_arguments(command, parser)`` and ``run(command, args) -> int``.
- Only the module of the command being run is imported (a start costs what that command needs,
  not every command's imports); ``mizzen-ci --help`` lists every command from the table alone.
- Exit codes: 0 success, 1 the check failed (the output says what), 2 bad usage or bad input
  (a malformed fleet table or ``pyproject.toml`` table: one escaped line naming the file).
- A usage error argparse finds (an unknown flag or command, a missing argument) is one line,
  ``mizzen-ci COMMAND: error: PROBLEM; fix: see mizzen-ci COMMAND --help``, exit 2.
- ``--version`` reads the installed distribution's metadata (``importlib.metadata``) only when
  asked: it is not imported for any other command.
- :class:`UsageError` is mizzen_ci's one exception for bad usage (arguments that name nothing
  usable); a command raises it and :func:`main` prints it as that one line.
- Secrets: before anything is parsed, the secrets of the environment and of the arguments are
  registered in the mask set (:mod:`mizzen_ci.masking`), and the command runs with masked
  ``sys.stdout``/``sys.stderr``: no line the process prints, a usage error or an unexpected
  traceback included, shows a registered value.  An unexpected exception is a bug: its masked
  traceback is printed, exit 1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from typing import NoReturn

from . import masking
from .fleet import FleetError
from .output import plain
from .sources import ConfigError


class UsageError(Exception):
    """A command was asked for something it cannot do with these arguments (exit 2)."""


#: the description ``mizzen-ci --help`` shows (plain text: the module docstring is RST)
DESCRIPTION = "The command line of mizzen's CI (also: python -m mizzen_ci)."


class OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line naming the problem and the fix (its subparsers are too)."""

    def error(self, message: str) -> NoReturn:
        text = " ".join(message.split())
        self.exit(2, plain(f"{self.prog}: error: {text}; fix: see {self.prog} --help") + "\n")


class VersionAction(argparse.Action):
    """``--version``: the installed mizzen-ci's version, read from its metadata when asked."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> NoReturn:
        from importlib.metadata import PackageNotFoundError, version

        try:
            found = version("mizzen-ci")
        except PackageNotFoundError:
            found = "unknown (not installed: running from a source tree)"
        print(f"mizzen-ci {found}")
        parser.exit(0)


COMMANDS: dict[str, tuple[str, str]] = {
    "validate": (
        "mizzen_ci.registry_cli",
        "check every test file's registration (exit 1 on errors)",
    ),
    "list": ("mizzen_ci.registry_cli", "list registered tests with their derived runner pool"),
    "plan": ("mizzen_ci.plan.cli", "plan the CI jobs for a change (default: the working tree)"),
    "comment": ("mizzen_ci.plan.cli", "the commands of a pull-request comment, as JSON"),
    "fastfail": (
        "mizzen_ci.plan.fastfail",
        "whether a pull request's GPU jobs may start (its cheap checks and CPU lane)",
    ),
    "gpu-lane": ("mizzen_ci.lane.cli", "run a GPU lane here: every ARCH test, leased and packed"),
    "lazy-imports": (
        "mizzen_ci.lazy_imports.cli",
        "check the lazy-import policy (static, runtime)",
    ),
    "history": ("mizzen_ci.history", "durations and flake records: record, merge, flakes"),
    "gate": ("mizzen_ci.gate.cli", "the metric gate: check, ingest, untrust, show"),
    "flakes": ("mizzen_ci.flakes.cli", "the flaky-test loop: propose quarantines and re-enables"),
    "report": ("mizzen_ci.report.cli", "the CI health page (static HTML) from the history store"),
    "audit": (
        "mizzen_ci.audit.cli",
        "measure the selection against observed execution: recall, misses, mutants",
    ),
    "bisect": (
        "mizzen_ci.bisect.cli",
        "find the first commit at which a planned job fails (in a scratch clone)",
    ),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command; the arguments of ``command`` only when it is given (the
    others' modules are not imported: their subparsers parse only ``--help``)."""
    parser = OneLineParser(prog="mizzen-ci", description=DESCRIPTION)
    parser.add_argument("--version", action=VersionAction, help="show the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if command is None or name == command:
            importlib.import_module(module).add_arguments(name, p)
    return parser


def _command_of(argv: list[str]) -> str:
    """The command named in ``argv`` ("" when none is: the parser then reports the usage)."""
    for arg in argv:
        if not arg.startswith("-"):
            return arg if arg in COMMANDS else ""
    return ""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    masking.register_environment(os.environ)
    masking.register_arguments(argv)
    with masking.masked_streams():
        args = build_parser(_command_of(argv)).parse_args(argv)
        module = importlib.import_module(COMMANDS[args.command][0])
        try:
            return module.run(args.command, args)
        except (FleetError, ConfigError, UsageError) as e:
            print(plain(f"mizzen-ci {args.command}: {e}"), file=sys.stderr)
            return 2
        except Exception as e:  # a bug: its traceback, masked like every other line
            traceback.print_exc(file=sys.stderr)
            print(plain(f"mizzen-ci {args.command}: internal error ({type(e).__name__}); "
                        "the traceback above is a bug of mizzen-ci, please report it"),
                  file=sys.stderr)  # fmt: skip
            return 1
