"""Prompt rendering (:func:`mizzen_rollout.api.render_prompt`): the rule itself, and one record
rendered by ``mizzen-rollout generate`` and by the trainer's generation evaluation reaches the
engine as the same prompt tokens (the tiny model, the byte tokenizer, all on CPU)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

from mizzen_ci import register_cpu_ci
from mizzen_rollout.api import (
    EngineRouter,
    RolloutConfig,
    SamplingParams,
    SGLangClient,
    read_samples,
    render_prompt,
    run_rollout,
)

register_cpu_ci(est_time=40, labels=["rollout"])


def test_text_becomes_one_user_message_and_chat_stays_chat():
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert render_prompt("2+2?") == [{"role": "user", "content": "2+2?"}]
    assert render_prompt("2+2?", chat_template=False) == "2+2?"
    for chat_template in (True, False):
        rendered = render_prompt(messages, chat_template=chat_template)
        assert rendered == messages and rendered[0] is not messages[0]  # a copy


def _cli_prompt_tokens(url: str, tmp_path, prompt: str) -> list[int]:
    data, out = tmp_path / "prompts.jsonl", tmp_path / "samples.jsonl"
    data.write_text(json.dumps({"prompt": prompt, "label": "4"}) + "\n")
    command = [sys.executable, "-m", "mizzen_rollout", "generate", "--data", str(data)]
    command += ["--out", str(out), "--engine-url", url, "--n", "1", "--max-new-tokens", "2"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    (sample,) = read_samples(out)
    return sample.prompt_tokens


def _evaluation_prompt_tokens(url: str, tmp_path, prompt: str) -> tuple[list[int], list[int]]:
    """What the trainer's generation evaluation sends for the SFT record ``prompt -> 4``: the
    tokens the engine saw, and the trainer's own rendering of them."""
    from mizzen_train.data import SftTokenizer, load_sft_dataset
    from mizzen_train.evaluators import generation_prompts

    path = tmp_path / "eval.jsonl"
    path.write_text(json.dumps({"prompt": prompt, "response": "4"}) + "\n")
    tokenizer = SftTokenizer.load("byte")
    dataset = load_sft_dataset(path, tokenizer, field="eval.data", seq_len=256)
    records = generation_prompts(tokenizer, dataset.examples)
    config = RolloutConfig(n_samples=1, sampling=SamplingParams(max_new_tokens=2, temperature=0))

    async def generate():
        router = EngineRouter([SGLangClient(url)])
        try:
            return await run_rollout(records, router, config)
        finally:
            await router.aclose()

    (sample,) = asyncio.run(generate()).samples
    return sample.prompt_tokens, tokenizer.prompt_ids(dataset.examples[0].record)


def test_the_cli_and_the_trainer_evaluation_send_the_same_prompt_tokens(embedded_server, tmp_path):
    prompt = "What is 2+2?"
    cli = _cli_prompt_tokens(embedded_server.url, tmp_path, prompt)
    evaluation, trainer_side = _evaluation_prompt_tokens(embedded_server.url, tmp_path, prompt)
    assert cli == evaluation == trainer_side
    # the chat template was applied: <bos><|user|>\n...\n<|assistant|>\n in byte tokens
    expected = "<|user|>\n" + prompt + "\n<|assistant|>\n"
    assert cli == [1, *(b + 3 for b in expected.encode())]
