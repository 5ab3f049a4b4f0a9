"""``mizzen-rollout`` end to end in subprocesses: generate with the embedded engine (default),
generate against a running server (``--engine-url``), and argument/data errors."""

from __future__ import annotations

import json
import subprocess
import sys

from mizzen_ci import register_cpu_ci
from mizzen_rollout.samples import SampleStatus, read_samples

register_cpu_ci(est_time=30, labels=["rollout"])


# Runs the CLI with torch, ray, transformers and harbor unimportable: what a base install
# (httpx only) can do.
BASE_INSTALL = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "ray", "transformers", "harbor"):
            raise ImportError("not in a base install: " + name)
sys.meta_path.insert(0, Block())
from mizzen_rollout.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _cli(*args, timeout=240, base_install=False):
    command = (
        [sys.executable, "-c", BASE_INSTALL]
        if base_install
        else [sys.executable, "-m", "mizzen_rollout"]
    )
    return subprocess.run(
        [*command, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_generate_with_the_embedded_engine(tmp_path):
    out, metrics = tmp_path / "samples.jsonl", tmp_path / "metrics.json"
    proc = _cli(
        "generate",
        "--data", "example:math",
        "--n", "3",
        "--limit", "4",
        "--out", str(out),
        "--reward", "math",
        "--max-new-tokens", "8",
        "--metrics-out", str(metrics),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    samples = read_samples(out)
    assert len(samples) == 12
    assert len({s.request_id for s in samples}) == 12
    assert sorted({(s.group_index, s.index_in_group) for s in samples}) == [
        (g, i) for g in range(4) for i in range(3)
    ]
    for sample in samples:
        assert sample.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)
        assert sample.reward in (0.0, 1.0)
        assert 0 < len(sample.response_tokens) <= 8
        assert len(sample.rollout_logprobs) == len(sample.response_tokens)
        assert sample.prompt_tokens and sample.label is not None
        assert sample.metadata["topic"] and sample.metadata["id"].startswith("math-")
    assert "starting the embedded engine" in proc.stderr
    assert "12/12 samples" in proc.stderr  # the progress bar's last line
    assert "wrote 12 samples to" in proc.stdout
    assert "latency    p50" in proc.stdout and "tok/s" in proc.stdout
    recorded = json.loads(metrics.read_text())
    assert recorded["num_samples"] == 12 and recorded["num_scored"] == 12


def test_generate_against_a_running_server(echo_servers, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        json.dumps({"question": "2+2=4", "answer": "4", "src": "x"})
        + "\n"
        + json.dumps({"question": [{"role": "user", "content": "hi"}], "answer": "hi"})
        + "\n"
    )
    out = tmp_path / "s.jsonl"
    proc = _cli(
        "generate",
        "--data", str(data),
        "--input-key", "question",
        "--label-key", "answer",
        "--n", "2",
        "--out", str(out),
        "--engine-url", echo_servers[0].url,
        "--engine-url", echo_servers[1].url,
        "--reward", "f1",
        "--no-progress",
        base_install=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    samples = read_samples(out)
    assert len(samples) == 4
    # the chat template by default: a text prompt is one user message, rendered by the engine
    # (the echo backend answers with the rendered prompt's tail)
    assert samples[0].prompt == [{"role": "user", "content": "2+2=4"}]
    assert samples[0].response_text == "<|user|>\n2+2=4\n<|assistant|>\n"
    assert samples[0].metadata["src"] == "x"
    assert samples[2].prompt == [{"role": "user", "content": "hi"}]
    assert echo_servers[0].url in proc.stdout and proc.stderr == ""


def test_no_chat_template_sends_text_prompts_as_they_are(echo_servers, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}={2 * i}"}) + "\n" for i in range(3)))
    out = tmp_path / "s.jsonl"
    proc = _cli(
        "generate",
        "--data", str(data),
        "--n", "2",
        "--batch-size", "4",
        "--out", str(out),
        "--engine-url", echo_servers[0].url,
        "--no-chat-template",
        "--no-progress",
        base_install=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    samples = read_samples(out)
    assert [s.prompt for s in samples] == [f"{i}+{i}={2 * i}" for i in range(3) for _ in range(2)]
    assert [s.response_text for s in samples] == [s.prompt for s in samples]


def test_bad_inputs_exit_2_with_a_message(tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"q": "x"}) + "\n")
    proc = _cli("generate", "--data", str(data), "--out", str(tmp_path / "o.jsonl"))
    assert proc.returncode == 2
    assert f"{data}:1: no 'prompt' key" in proc.stderr and "--input-key" in proc.stderr
    proc = _cli("generate", "--data", "example:math", "--out", "o.jsonl", "--reward", "nope")
    assert proc.returncode == 2 and "neither built in" in proc.stderr
    assert not (tmp_path / "o.jsonl").exists()


def test_unreachable_engine_fails_every_sample_and_exits_1(tmp_path):
    from mizzen_rollout.engines.launcher import find_free_port

    out = tmp_path / "o.jsonl"
    proc = _cli(
        "generate",
        "--data", "example:math",
        "--limit", "1",
        "--n", "2",
        "--out", str(out),
        "--engine-url", f"http://127.0.0.1:{find_free_port()}",
        "--no-chat-template",
        "--no-server-tokenize",
        "--no-progress",
    )  # fmt: skip
    assert proc.returncode == 1
    assert "first error:" in proc.stdout and "Check that the engine is running" in proc.stdout
    assert [s.status for s in read_samples(out)] == [SampleStatus.FAILED] * 2
