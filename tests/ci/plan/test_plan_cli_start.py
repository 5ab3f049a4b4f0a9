"""``mizzen-ci`` starts only what the command needs: ``plan`` never imports the GPU lane or the
lazy-import checks, ``--help`` lists every command without importing any, and each command still
parses its own arguments (``python3 -S``, only ``ci/src`` on the path, as on a bare runner)."""

from __future__ import annotations

import json

import pytest

from mizzen_ci import register_cpu_ci
from mizzen_ci.cli import COMMANDS, build_parser

register_cpu_ci(est_time=10, labels=["ci"])

PROBE = """
import json, sys
from mizzen_ci.cli import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    code = e.code
else:
    code = 0
loaded = sorted(m for m in sys.modules if m.startswith("mizzen_ci."))
print(json.dumps({"code": code, "loaded": loaded}), file=sys.stderr)
"""


@pytest.fixture
def start(mizzen_ci):
    """``start(*ARGV)``: (the probe's report, stdout) of ``mizzen-ci ARGV`` under ``python3 -S``."""

    def run(*argv: str) -> tuple[dict, str]:
        out = mizzen_ci.python("-c", PROBE, *argv)
        return json.loads(out.stderr.strip().splitlines()[-1]), out.stdout

    return run


def test_plan_help_imports_only_the_plan_command(start):
    report, stdout = start("plan", "--help")
    assert report["code"] == 0
    assert "--budget-minutes" in stdout and "--cache-dir" in stdout
    loaded = set(report["loaded"])
    assert "mizzen_ci.plan.cli" in loaded
    for other in ("mizzen_ci.lane.cli", "mizzen_ci.lazy_imports", "mizzen_ci.registry_cli"):
        assert other not in loaded, f"`plan` imported {other}"


def test_top_level_help_lists_every_command_and_imports_none(start):
    report, stdout = start("--help")
    assert report["code"] == 0
    for name in COMMANDS:
        assert name in stdout
    modules = {m for m, _ in COMMANDS.values()}
    assert not modules & set(report["loaded"])


# An argument of each command that only its own module adds (a new command needs an entry).
OWN_ARGUMENT = {
    "validate": "--root",
    "list": "--lane",
    "plan": "--budget-minutes",
    "comment": "--body-file",
    "fastfail": "--started-by",
    "gpu-lane": "arch",
    "lazy-imports": "--static",
    "history": "record",
    "gate": "ingest",
    "flakes": "propose",
    "report": "--record-plan",
    "audit": "--mutants",
    "bisect": "--good",
}


def test_each_command_still_parses_its_own_arguments(start):
    assert set(OWN_ARGUMENT) == set(COMMANDS)
    for name in COMMANDS:
        report, stdout = start(name, "--help")
        assert report["code"] == 0 and OWN_ARGUMENT[name] in stdout, name
    report, _ = start("plan", "--no-such-option")
    assert report["code"] == 2


def test_the_full_parser_is_still_available():
    parser = build_parser()
    args = parser.parse_args(["list", "--json"])
    assert args.command == "list" and args.json
