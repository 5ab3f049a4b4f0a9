"""One command per run directory: a second run or ``--resume`` on a directory in use is refused
in one line naming the holder's pid; a fresh run never writes into a directory that holds
something else; a killed holder frees the directory at once; Ctrl-C ends with the newest
checkpoint and the exact resume command."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=40, labels=["train"])

CONFIG = """
[run]
dir = "{run_dir}"
steps = {steps}
checkpoint_interval = 2
[model]
path = "tiny"
[data]
seq_len = 144
[[tenants]]
name = "a"
data = "example:colours_train"
rows = 4
lr = 1e-3
"""

HOLDER = """
import sys
from pathlib import Path
from mizzen_train.run.lock import hold_run_dir
with hold_run_dir(Path(sys.argv[1]), resume=False):
    print("held", flush=True)
    sys.stdin.read()
"""


def _config(tmp_path, run_dir, steps=4):
    path = tmp_path / "run.toml"
    path.write_text(CONFIG.format(run_dir=run_dir, steps=steps))
    return path


def _main(capsys, *argv):
    from mizzen_train.cli import main

    code = main(list(argv))
    return code, capsys.readouterr().err


def test_a_run_dir_in_use_is_refused_naming_the_holder(tmp_path, capsys):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        for argv in (("sft", "--config"), ("sft", "--resume", "--config")):
            code, err = _main(capsys, *argv, str(_config(tmp_path, run_dir)))
            assert code == 2, err
            assert f"is in use by pid {holder.pid}" in err and len(err.splitlines()) == 1, err
        assert sorted(p.name for p in run_dir.iterdir()) == [".lock"], "the refused run wrote"
    finally:
        holder.kill()
        holder.wait()
    from mizzen_train.run.lock import hold_run_dir

    with hold_run_dir(run_dir, resume=False):  # the killed holder's lock ended with it
        pass


def test_a_fresh_run_never_writes_into_a_foreign_directory(tmp_path, capsys):
    run_dir = tmp_path / "notes"
    run_dir.mkdir()
    (run_dir / "thesis.tex").write_text("precious")
    code, err = _main(capsys, "sft", "--config", str(_config(tmp_path, run_dir)))
    assert code == 2 and "is not empty and holds no run (thesis.tex)" in err, err
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "thesis.tex"]
    assert (run_dir / "thesis.tex").read_text() == "precious"


def test_what_a_failed_start_left_does_not_block_the_next(tmp_path):
    from mizzen_train.run.lock import hold_run_dir

    run_dir = tmp_path / "run"
    (run_dir / "base-model-tiny-0123456789").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("")
    with hold_run_dir(run_dir, resume=False):
        assert (run_dir / ".lock").read_text().strip() == str(os.getpid())


def test_ctrl_c_names_the_newest_checkpoint_and_the_resume_command(tmp_path):
    run_dir = tmp_path / "run"
    # far more steps than run before the interrupt (the packed path trains 400 tiny steps in
    # ~10 s): wait for any checkpoint (older ones are pruned as newer ones land), then Ctrl-C
    config = _config(tmp_path, run_dir, steps=100_000)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}
    run = subprocess.Popen(
        [sys.executable, "-m", "mizzen_train", "sft", "--config", str(config)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    checkpoints = run_dir / "checkpoints"

    def any_checkpoint() -> bool:
        return checkpoints.is_dir() and any(checkpoints.glob("step-*"))

    deadline = time.monotonic() + 120
    while not any_checkpoint() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    if not any_checkpoint():
        run.kill()
        pytest.fail(f"no checkpoint within 120 s: {run.communicate()[1][-2000:]}")
    run.send_signal(signal.SIGINT)
    _, err = run.communicate(timeout=60)
    assert run.returncode == 130, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert "interrupted; the newest checkpoint is " in last and "step-000000" in last, last
    assert last.endswith(f"Resume with: mizzen-train sft --config {config} --resume"), last
    assert "Traceback" not in err, err[-2000:]
