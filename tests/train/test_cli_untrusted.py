"""``mizzen-train`` against what others put on disk or in a flag, through the real CLI.

- A name read from disk (an entry of the run directory, the pid text of its ``.lock``, a path in
  a progress line) reaches the terminal escaped on one line: no escape sequence, no forged line.
- ``mizzen-train export RUN_DIR`` reads the run's ``run.json`` as data: code it names (an
  advantage estimator, a reward) is never imported.
- A ``--section.field`` string flag is the text given, whatever its characters; a quoted
  ``--set`` value that is no valid TOML string is an error naming the field, never a fallback.
"""

from __future__ import annotations

import fcntl
import io
import json
import subprocess

import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=120, labels=["train"])

#: OSC (set the window title), clear the screen, then a forged line
HOSTILE = "evil\x1b]0;PWNED\x07\x1b[2J\nfake: line"


def _one_escaped_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stderr
    assert "\x1b" not in result.stderr and "\x07" not in result.stderr, repr(result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.mark.parametrize("where", ["entry", "lock"])
def test_names_from_the_run_directory_are_shown_escaped_on_one_line(sft, tmp_path, where):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    sft.write_config(
        tmp_path / "c.toml", sft.small_sections(run_dir, steps=1, checkpoint_interval=1)
    )
    if where == "entry":  # a file the run directory should not hold
        (run_dir / HOSTILE).touch()
        line = _one_escaped_line(sft.cli("sft", "--config", "c.toml", cwd=tmp_path))
        assert "is not empty and holds no run" in line, line
    else:  # the lock's holder wrote this instead of its pid
        lock = run_dir / ".lock"
        lock.write_text(HOSTILE)
        with open(lock, "rb") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            line = _one_escaped_line(sft.cli("sft", "--config", "c.toml", cwd=tmp_path))
        assert "is in use by pid" in line, line
    assert "evil\\x1b]0;PWNED\\x07\\x1b[2J\\nfake: line" in line, line


def test_export_never_imports_code_the_run_record_names(sft, tmp_path):
    from mizzen_train.rl.config import RlConfig

    marker = tmp_path / "PWNED"
    run_dir = tmp_path / "handed_over"
    run_dir.mkdir()
    hook = run_dir / "hook.py"
    hook.write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "def f(values):\n    return values\n"
    )
    config = RlConfig.load("example:rl_tiny").to_dict()
    config["algo"]["advantage"] = f"{hook}:f"
    for tenant in config["tenants"]:
        tenant["reward"] = f"{hook}:f"
    record = {"format": "mizzen-sft-run/1", "run_id": "x", "created": 0, "config": config}
    (run_dir / "run.json").write_text(json.dumps(record))
    result = sft.cli("export", str(run_dir), cwd=tmp_path)
    assert not marker.exists(), "export imported the hook named by run.json"
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr


def test_a_progress_line_naming_a_file_from_disk_is_one_escaped_line():
    from mizzen_train.run.metrics import Progress

    stream = io.StringIO()
    Progress(2, stream=stream, command="sft").print(f"resuming from run/checkpoints/{HOSTILE}")
    assert stream.getvalue() == (
        "[mizzen-train sft] resuming from run/checkpoints/"
        "evil\\x1b]0;PWNED\\x07\\x1b[2J\\nfake: line\n"
    ), repr(stream.getvalue())


def _main_error(argv: list[str], capsys) -> str:
    from mizzen_train.cli import main

    assert main(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_string_flag_is_the_text_given(capsys):
    # a non-BMP character: json.dumps made it a surrogate pair TOML refuses, read back raw
    line = _main_error(["sft", "--config", "example:sft_tiny", "--run.device", "cpu\U0001f600"],
                       capsys)  # fmt: skip
    assert "run.device='cpu\U0001f600': must be one of" in line, line


def test_a_quoted_set_value_that_is_no_toml_string_is_an_error(capsys):
    line = _main_error(
        ["sft", "--config", "example:sft_tiny", "--set", 'run.device="cpu\\ud83d\\ude00"'], capsys
    )
    assert "run.device" in line and "not a valid TOML" in line and "Fix:" in line, line
