"""``mizzen-rollout``'s output and error boundary, through the real CLI in subprocesses.

- Secrets: an ``--engine-url`` carrying a password (userinfo) or a key (query item) works against
  a real embedded engine over HTTP on 127.0.0.1, and the secret shows up in none of stdout,
  stderr, the samples file or the metrics file — also when every call fails and the errors are
  printed and written.
- Totality: each bad input (dataset bytes, nesting, numbers; output paths; non-finite or
  out-of-range numbers; engine URLs) ends before any engine starts, in one line on stderr naming
  the problem and the fix, exit 2, no traceback.
Invariant of this file: it drives only the command line, so each case can be run against code
from before the boundary existed (10bec9e), where it fails.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mizzen_ci import register_cpu_ci

register_cpu_ci(est_time=45, labels=["rollout"])

SECRET = "Q42pw-SECRET-7f3a9c"


def _cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mizzen_rollout", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _with_credentials(url: str, where: str) -> str:
    if where == "userinfo":
        return url.replace("http://", f"http://mizzen:{SECRET}@")
    return f"{url}/?api_key={SECRET}"


def _written(*paths: Path) -> str:
    return "".join(p.read_bytes().decode("utf-8", "replace") for p in paths if p.exists())


def test_an_engine_url_password_reaches_no_output(echo_servers, tmp_path: Path) -> None:
    out, metrics = tmp_path / "samples.jsonl", tmp_path / "metrics.json"
    url = _with_credentials(echo_servers[0].url, "userinfo")
    proc = _cli(
        "generate", "--data", "example:math", "--limit", "2", "--n", "2",
        "--out", str(out), "--metrics-out", str(metrics), "--engine-url", url,
        "--no-progress",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "wrote 4 samples" in proc.stdout  # it ran against the engine
    assert SECRET not in proc.stdout + proc.stderr
    assert SECRET not in _written(out, metrics)
    engines = {json.loads(line)["metadata"]["engine"] for line in out.read_text().splitlines()}
    assert len(engines) == 1 and "***" in engines.pop()


@pytest.mark.parametrize("where", ["userinfo", "query"])
def test_an_engine_url_secret_reaches_no_error_output(
    echo_servers, tmp_path: Path, where: str
) -> None:
    """Every call fails (nothing listens at the port; the engine has no such path): the first
    error is printed and every error is written into the samples; neither holds the secret."""
    from mizzen_rollout.engines.launcher import find_free_port

    out = tmp_path / "samples.jsonl"
    base = f"http://127.0.0.1:{find_free_port()}" if where == "userinfo" else echo_servers[0].url
    url = _with_credentials(base, where)
    proc = _cli(
        "generate", "--data", "example:math", "--limit", "1", "--n", "2", "--out", str(out),
        "--engine-url", url, "--no-chat-template", "--no-server-tokenize", "--no-progress",
    )  # fmt: skip
    assert proc.returncode == 1 and "first error:" in proc.stdout
    assert SECRET not in proc.stdout + proc.stderr + _written(out)


def test_a_too_short_url_password_is_refused_up_front(tmp_path: Path) -> None:
    proc = _cli(
        "generate", "--data", "example:math", "--out", str(tmp_path / "o.jsonl"),
        "--engine-url", "http://mizzen:pw1@127.0.0.1:9",
    )  # fmt: skip
    assert proc.returncode == 2 and "at least 6 characters" in proc.stderr
    assert "pw1" not in proc.stderr


# ------------------------------------------------------------------------------ totality


def _dataset(tmp_path: Path, content: bytes) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(content)
    return str(path)


DEEP = b'{"prompt": "x", "meta": ' + b"[" * 5000 + b"]" * 5000 + b"}\n"
MIDDLE = b'{"prompt": "x", "meta": ' + b"[" * 200 + b"]" * 200 + b"}\n"
CASES = {
    "not UTF-8": (b'{"prompt": "caf\xe9"}\n', [], "not UTF-8"),
    "5,000 deep": (DEEP, [], "nested deeper than"),
    "200 deep": (MIDDLE, [], "nested deeper than"),
    "5,000 digits": (b'{"prompt": "x", "label": ' + b"7" * 5000 + b"}\n", [], "digits"),
    "a huge float": (b'{"prompt": "x", "label": 1' + b"0" * 400 + b".5}\n", [], "finite"),
    "NaN": (b'{"prompt": "x", "label": NaN}\n', [], "NaN"),
    "a lone surrogate": (b'{"prompt": "x\\ud800"}\n', [], "surrogate"),
    "--out a directory": (None, ["--out", "{tmp}"], "is a directory"),
    "--metrics-out a directory": (None, ["--metrics-out", "{tmp}"], "is a directory"),
    "--temperature nan": (None, ["--temperature", "nan"], "--temperature"),
    "--temperature inf": (None, ["--temperature", "inf"], "--temperature"),
    "--top-p nan": (None, ["--top-p", "nan"], "--top-p"),
    "--timeout nan": (None, ["--timeout", "nan"], "--timeout"),
    "--timeout -1": (None, ["--timeout", "-1"], "--timeout"),
    "--n huge": (None, ["--n", "10" + "0" * 30], "--n"),
    "--seed huge": (None, ["--seed", "9" * 40], "--seed"),
    "--max-new-tokens huge": (None, ["--max-new-tokens", "9" * 40], "--max-new-tokens"),
    "--batch-size beyond the engine": (None, ["--batch-size", "100000"], "--batch-size"),
    "--engine-url port 99999": (None, ["--engine-url", "http://127.0.0.1:99999"], "--engine-url"),
    "--engine-url not a URL": (None, ["--engine-url", "gpu-host:30000"], "--engine-url"),
    "--engine-url no host": (None, ["--engine-url", "http://:30000"], "--engine-url"),
    "--stop not UTF-8": (None, ["--stop", "\udcff"], "--stop"),  # the byte 0xff from a shell
    "--engine-url not UTF-8": (None, ["--engine-url", "http://127.0.0.1:1/\udcff"], "UTF-8"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_line_with_the_fix_and_exit_2(case: str, tmp_path: Path) -> None:
    content, extra, expected = CASES[case]
    data = _dataset(tmp_path, content) if content is not None else "example:math"
    args = [a.replace("{tmp}", str(tmp_path)) for a in extra]
    if "--out" not in args:
        args += ["--out", str(tmp_path / "o.jsonl")]
    proc = _cli("generate", "--data", data, *args, "--no-progress", timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "starting the embedded engine" not in proc.stderr
    assert expected in lines[-1] and ("fix:" in lines[-1] or " use " in lines[-1]), lines[-1]
    assert lines[-1].startswith("mizzen-rollout generate: error:")
    assert not (tmp_path / "o.jsonl").exists()
