"""``mizzen-train``'s command line as a user meets it, through the real CLI in subprocesses.

- Every bad input of the table (a missing, unreadable or malformed file, an unknown key or flag, a
  value of the wrong type, a directory where a file belongs and the reverse) ends in exactly one
  stderr line naming the file, field or flag and the fix, exit 2, no traceback.
- A run's stderr carries no third-party warning (megatron, Transformer Engine/Apex fallbacks,
  torch's "No CUDA runtime", deprecations, SyntaxWarnings, progress bars): one summary line counts
  them; ``--verbose`` is the way to see them (tests/rollout/test_cli_surface.py checks it).
- ``--help`` of every command shows each option once with text and its default once;
  ``--version`` is the installed distribution's.
"""

from __future__ import annotations

import argparse
from importlib.metadata import version
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=60, labels=["train"])


@pytest.fixture(scope="module")
def inputs(sft, tmp_path_factory) -> Path:
    """A folder of bad inputs (and one good configuration, good.toml: the small run of 2 steps,
    one thread)."""
    root = tmp_path_factory.mktemp("inputs")

    def small(run_dir, data="example:colours_train"):
        return sft.small_sections(run_dir, steps=2, data=str(data), threads=1)

    unknown_key = small("r", data="x") | {"model.tiny": {"sneed": 1}}
    bad_type = small("r", data="x")
    bad_type["run"]["steps"] = "2"
    configs = {
        "good.toml": small(root / "run"),
        "unknown_key.toml": unknown_key,
        "bad_type.toml": bad_type,
        "no_data.toml": small(root / "r", data=root / "missing.jsonl"),
    }
    for name, sections in configs.items():
        sft.write_config(root / name, sections)
    files = {
        "bad_toml.toml": "[run\nsteps = 2\n",
        "not_utf8.toml": b"[run]\ndir = '\xff'\n",
        "metrics.jsonl": "not json\n",
        "a_file": "",
    }
    for name, text in files.items():
        (root / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    (root / "not_a_run").mkdir()
    return root


#: (argv, what the one error line must contain); {root} is the inputs folder
BAD_INPUTS = [
    (["sft", "--config", "missing.toml"], "--config='missing.toml': no such file"),
    (["sft", "--config", "not_a_run"], "is not a regular file"),
    (["sft", "--config", "bad_toml.toml"], "is not valid TOML"),
    (["sft", "--config", "not_utf8.toml"], "not_utf8.toml"),
    (["sft", "--config", "unknown_key.toml"], "model.tiny.sneed"),
    (["sft", "--config", "bad_type.toml"], "run.steps='2': must be an integer"),
    (["sft", "--config", "no_data.toml"], "no_data.toml: tenants[0].data='"),
    (
        ["rl", "--config", "example:rl_tiny", "--set", 'tenants.0.data="nope.jsonl"'],
        "tenants[0].data='nope.jsonl': no such file",
    ),
    (["rl", "--config", "bad_type.toml"], "data={'seq_len': 144}: unknown section"),
    (["sft", "--config", "good.toml", "--run.steps", "two"], "run.steps='two'"),
    (["sft", "--config", "good.toml", "--set", "run.nope=1"], "run.nope=1: unknown key in [run]"),
    (["sft", "--config", "good.toml", "--set", "tenants"], "an override is KEY=VALUE"),
    (["sft", "--config", "good.toml", "--bogus"], "unrecognized arguments: --bogus"),
    (["sft"], "give --config run.toml"),
    ([], "the following arguments are required: command"),
    (["tune"], "invalid choice: 'tune'"),
    (["export", "not_a_run"], "not_a_run holds no run (run.json is missing)"),
    (["export", "a_file"], "a_file is not a directory"),
    (["export", "not_a_run", "--step", "x"], "argument --step: invalid int value: 'x'"),
    (["plot", "missing.jsonl", "-o", "c.png"], "missing.jsonl: no such file"),
    (["plot", "not_a_run", "-o", "c.png"], "not_a_run is a directory"),
    (["plot", "metrics.jsonl", "-o", "c.png"], "metrics.jsonl: holds no training records"),
    (["plot", "metrics.jsonl"], "the following arguments are required: -o/--output"),
]


@pytest.mark.parametrize(("argv", "needle"), BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_a_bad_input_is_one_line_with_the_fix(
    sft, inputs: Path, argv: list[str], needle: str
) -> None:
    out = sft.cli(*argv, cwd=inputs)
    lines = out.stderr.splitlines()
    assert out.returncode == 2, out.stderr[-3000:]
    assert len(lines) == 1 and needle in lines[0], out.stderr[-3000:]
    assert "Traceback" not in out.stderr + out.stdout
    assert any(word in lines[0].lower() for word in ("fix", "give", "use", "see", "add")), lines


def test_a_missing_data_file_is_refused_before_the_run_dir_or_a_model_is_written(sft, inputs: Path):
    """Before: the base model was written into the run dir (~10 s) and the error named neither
    the config file nor where a relative path is read from."""
    out = sft.cli("sft", "--config", "no_data.toml", cwd=inputs)
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.startswith("mizzen-train sft: error: no_data.toml: tenants[0].data="), (
        out.stderr
    )
    assert f"a relative path is read from {inputs}" in out.stderr
    assert not (inputs / "r").exists()


def test_a_run_shows_one_summary_line_for_third_party_warnings(sft, inputs: Path) -> None:
    """SFT, 2 steps of the tiny model: the run's own lines and one summary line, nothing else
    (before: megatron's and torch's warnings, a progress bar -- about 20 lines).  The run also
    logs to TensorBoard ([run] loggers), which adds no line either."""
    out = sft.cli(
        "sft", "--config", "good.toml", "--set", 'run.loggers=["tensorboard"]', cwd=inputs
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stderr.splitlines()
    own = [line for line in lines if line.startswith("[mizzen-train sft] ")]
    summary = [line for line in lines if "third-party warning(s) hidden (" in line]
    assert len(summary) == 1 and summary[0].endswith("--verbose shows them"), lines
    assert "megatron" in summary[0], summary
    assert sorted(own + summary) == sorted(lines), [x for x in lines if x not in own + summary]
    for noise in ("Warning", "No CUDA runtime", "DEPRECATED", "Writing model shards"):
        assert noise not in out.stderr, noise
    assert list((inputs / "run" / "tensorboard").glob("events.out.tfevents.*"))


def _options(parser: argparse.ArgumentParser):
    """(command, help text, option actions) of `parser` and every subcommand below it."""
    yield parser.prog, parser.format_help(), parser._actions
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                yield from _options(sub)


def test_every_option_has_help_and_shows_its_default_once() -> None:
    from mizzen_train.cli import build_parser

    for prog, text, actions in _options(build_parser()):
        assert "(default: None)" not in text and "default: False" not in text, prog
        for line in text.splitlines():
            assert line.count("default") <= 1, (prog, line)
        for action in actions:
            if action.option_strings:
                assert action.help, (prog, action.option_strings)


def test_version_is_the_installed_distributions(sft, tmp_path: Path) -> None:
    out = sft.cli("--version", cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == f"mizzen-train {version('mizzen-train')}"


def test_the_fix_a_missing_field_suggests_is_one_set_accepts(sft, inputs: Path) -> None:
    """A tenant without ``data``: the error's ``--set`` is in the form ``--set`` reads (it said
    ``--set tenants[0].data=...``, which ``--set`` refuses), and that override completes it."""
    from mizzen_train.sft.config import SftConfig

    config = inputs / "no_data_field.toml"
    config.write_text("\n".join(line for line in (inputs / "good.toml").read_text().splitlines()
                                if not line.startswith("data = ")))  # fmt: skip
    out = sft.cli("sft", "--config", config.name, cwd=inputs)
    assert out.returncode == 2 and "or with --set tenants.0.data=..." in out.stderr, out.stderr
    loaded = SftConfig.load(str(config), ['tenants.0.data="example:colours_train"'])
    assert loaded.tenants[0].data == "example:colours_train"
