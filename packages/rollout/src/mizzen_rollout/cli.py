"""``mizzen-rollout``: generate scored samples from a prompt dataset, or serve the embedded engine.

    mizzen-rollout generate --data prompts.jsonl --n 4 --out samples.jsonl
    mizzen-rollout generate --data example:math --n 4 --out samples.jsonl --reward math
    mizzen-rollout generate --data prompts.jsonl --engine-url http://gpu-host:30000 --out s.jsonl
    mizzen-rollout serve --port 30000

Invariants:
- ``generate`` renders each prompt with :func:`~mizzen_rollout.prompts.render_prompt`, the rule
  the trainer's evaluation uses: by default through the engine's chat template (a text prompt is
  one user message, sent to ``/v1/chat/completions``, one request a sample); with
  ``--no-chat-template`` text prompts go as text (tokenised by ``/tokenize``, batched with
  ``--batch-size``).
- ``generate`` without ``--engine-url`` starts the embedded engine (``serve`` in a subprocess on
  127.0.0.1), uses it and stops it; with ``--engine-url`` (repeatable) it talks to running SGLang
  (or embedded) servers.  ``--ray`` routes through the Ray rollout manager instead of the local
  router.
- Progress goes to stderr, the final summary to stdout; the samples file is written atomically.
- Exit codes: 0 success; 1 when every sample failed (the summary says why); 2 for bad arguments,
  data or reward specs (the message names the problem and the fix).
- One error boundary (``main``): every expected failure — bad arguments (non-finite numbers,
  out-of-range sizes, an engine URL that is not ``http(s)://host[:port]``), bad data (not UTF-8,
  not JSON, nested too deep, a number too long), an output path that is a directory or cannot be
  written, a missing optional dependency, a secret that cannot be masked — is one line naming the
  problem and the fix, exit 2, no traceback; checked before any engine starts.  Anything else is
  one ``internal error`` line, exit 1 (``MIZZEN_ROLLOUT_TRACEBACK=1`` prints the traceback).
- Secrets are masked at the output boundary (:mod:`.masking`): ``main`` wraps stdout/stderr and
  logging first, registers the password-like environment and the credentials of every
  ``--engine-url`` (its userinfo password, key-like query items) before anything is printed or
  written; the samples and metrics files are written through the mask too.
- Usage errors are one line with the fix; third-party warnings are counted in one summary line
  unless ``--verbose`` (:mod:`.cli_surface`); ``--version`` reads the installed metadata.
- No heavy import at module scope: the engine backends import torch/transformers, the manager
  imports ray, each only when used.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from .cli_surface import HelpFormatter, OneLineParser, package_version, quiet_third_party
from .data import DataCursor, DataError, DatasetKeys, PromptDataset, example_datasets
from .engines.base import ENGINE_MAX_BATCH, SamplingParams
from .masking import (
    SecretError,
    install_output_masks,
    mask_json,
    register_environment,
    register_url,
    shown_line,
)
from .progress import ProgressBar
from .prompts import render_prompt
from .rewards import RewardSpecError, load_reward
from .rollout import (
    RolloutBatch,
    RolloutConfig,
    drop_groups_with_aborted,
    drop_groups_with_failed,
)
from .samples import write_samples

__all__ = ["build_parser", "main"]


class UsageError(Exception):
    """A problem with the command line, the data or the reward spec (exit code 2)."""


class RunError(Exception):
    """The run could not proceed (e.g. the embedded engine did not start; exit code 1)."""


#: the most samples one prompt may ask for (``--n``), and the largest integer argument
MAX_SAMPLES_PER_PROMPT = 65_536
MAX_INT_ARGUMENT = 2**63 - 1


def _number(text: str, *, kind: type, low: float, high: float, what: str) -> int | float:
    try:
        value = kind(text)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number; {what}")
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"{text} is out of range; {what}")
    return value


def _ranged(kind: type, low: float, high: float, what: str):
    """An argparse type: a `kind` in [low, high], else a usage error naming the rule."""

    def parse(text: str) -> int | float:
        return _number(text, kind=kind, low=low, high=high, what=what)

    parse.__name__ = what
    return parse


_POSITIVE_INT = _ranged(int, 1, MAX_INT_ARGUMENT, "use an integer >= 1")
_SEED = _ranged(int, 0, MAX_INT_ARGUMENT, "use an integer in [0, 2**63)")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="mizzen-rollout",
        description="Rollout for RL post-training: prompts in, scored samples out.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"mizzen-rollout {package_version('mizzen-rollout')}",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser(
        "generate",
        help="generate n samples per prompt and write them as JSON lines",
        description="Generate n samples per prompt through an engine, score them and write them "
        "as JSON lines.",
        formatter_class=HelpFormatter,
    )
    gen.add_argument(
        "--data",
        required=True,
        help="prompt dataset (JSON lines), or example:NAME for a shipped one "
        f"({', '.join(sorted(example_datasets()))})",
    )
    gen.add_argument("--out", required=True, help="where to write the samples (JSON lines)")
    gen.add_argument(
        "--n",
        type=_ranged(int, 1, MAX_SAMPLES_PER_PROMPT, f"use 1..{MAX_SAMPLES_PER_PROMPT}"),
        default=4,
        help="samples per prompt",
    )
    gen.add_argument("--limit", type=_POSITIVE_INT, default=None, help="use only this many prompts")
    gen.add_argument("--shuffle", action="store_true", help="take prompts in seeded random order")
    gen.add_argument("--data-seed", type=_SEED, default=0, help="seed of the prompt shuffle")
    gen.add_argument("--input-key", default="prompt", help="JSON key of the prompt")
    gen.add_argument("--label-key", default="label", help="JSON key of the reference answer")
    gen.add_argument(
        "--metadata-keys",
        default=None,
        help="comma-separated keys kept as metadata (default: every other key)",
    )
    gen.add_argument("--tenant-key", default=None, help="JSON key of the tenant / LoRA slot id")
    engine = gen.add_argument_group("engine")
    engine.add_argument(
        "--engine-url",
        action="append",
        default=[],
        help="an SGLang server URL (repeatable); default: start the embedded engine",
    )
    engine.add_argument(
        "--model", default=None, help="embedded engine: local HF model directory (default: tiny)"
    )
    engine.add_argument(
        "--backend",
        default="transformers",
        choices=("transformers", "echo"),
        help="embedded engine backend",
    )
    engine.add_argument("--engine-seed", type=_SEED, default=0, help="embedded engine weight seed")
    engine.add_argument(
        "--timeout",
        type=_ranged(float, 1e-3, 7 * 24 * 3600, "use seconds in [0.001, 604800]"),
        default=600.0,
        help="timeout of one engine call (s; a batch is one call)",
    )
    engine.add_argument(
        "--concurrency", type=_POSITIVE_INT, default=64, help="max engine calls in flight"
    )
    engine.add_argument(
        "--batch-size",
        type=_ranged(int, 1, ENGINE_MAX_BATCH, f"use 1..{ENGINE_MAX_BATCH} (the engine limit)"),
        default=1,
        help="samples per engine call (one batched /generate, text prompts only: see "
        "--no-chat-template; default 1: a request per sample)",
    )
    engine.add_argument(
        "--no-chat-template",
        action="store_true",
        help="send text prompts as text, not as a user message through the engine's chat "
        "template (the trainer's evaluation uses the template)",
    )
    engine.add_argument(
        "--no-server-tokenize",
        action="store_true",
        help="send prompt text instead of ids tokenised by the server's /tokenize",
    )
    engine.add_argument("--ray", action="store_true", help="route through the Ray manager")
    engine.add_argument("--ray-address", default=None, help="existing Ray cluster address")
    engine.add_argument(
        "--num-engines",
        type=_ranged(int, 1, 1024, "use 1..1024"),
        default=1,
        help="with --ray and no URL: embedded engines",
    )
    sampling = gen.add_argument_group("sampling")
    sampling.add_argument(
        "--max-new-tokens",
        type=_ranged(int, 0, 2**31 - 1, "use 0..2147483647"),
        default=64,
        help="the most tokens generated per sample",
    )
    sampling.add_argument(
        "--temperature",
        type=_ranged(float, 0.0, 1e6, "use a finite number >= 0 (0 is greedy), e.g. 1.0"),
        default=1.0,
        help="sampling temperature (0 is greedy)",
    )
    sampling.add_argument(
        "--top-p",
        type=_ranged(float, 1e-9, 1.0, "use a number in (0, 1]"),
        default=1.0,
        help="nucleus sampling: keep the smallest set of tokens whose probability reaches this "
        "(1 is off)",
    )
    sampling.add_argument(
        "--top-k",
        type=_ranged(int, -1, 2**31 - 1, "use -1 (off) or k >= 1"),
        default=-1,
        help="keep only the k most likely tokens (-1 is off)",
    )
    sampling.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    sampling.add_argument(
        "--seed",
        type=_SEED,
        default=0,
        help="sampling seed (per-sample derived)",
    )
    sampling.add_argument("--no-logprobs", action="store_true", help="do not request log-probs")
    scoring = gen.add_argument_group("scoring and filters")
    scoring.add_argument(
        "--reward",
        default="none",
        help="math | f1 | none | package.module:function | path/to/file.py:function",
    )
    scoring.add_argument("--drop-aborted", action="store_true", help="drop groups with aborts")
    scoring.add_argument("--drop-failed", action="store_true", help="drop groups with failures")
    output = gen.add_argument_group("output")
    output.add_argument("--no-progress", action="store_true", help="no progress bar")
    output.add_argument("--metrics-out", default=None, help="also write the metrics as JSON")
    output.add_argument(
        "--verbose", action="store_true", help="show the warnings of third-party libraries"
    )

    srv = sub.add_parser(
        "serve",
        help="serve the embedded engine (SGLang protocol subset) over HTTP",
        description="Serve the embedded engine (a subset of SGLang's HTTP protocol).",
        formatter_class=HelpFormatter,
    )
    srv.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    srv.add_argument("--port", type=int, default=30000, help="0 lets the kernel pick")
    srv.add_argument("--model", default=None, help="local HF model directory (default: tiny)")
    srv.add_argument(
        "--backend",
        default="transformers",
        choices=("transformers", "echo"),
        help="transformers: a real model; echo: answers with the prompt (tests)",
    )
    srv.add_argument("--seed", type=int, default=0, help="seed of the tiny model's weights")
    srv.add_argument("--num-threads", type=int, default=1, help="torch CPU threads")
    srv.add_argument(
        "--device", default="cpu", choices=("cpu", "cuda"), help="where the model generates"
    )
    srv.add_argument(
        "--load-dir",
        action="append",
        default=[],
        help="a directory /update_weights_from_disk and /load_lora_adapter may read under "
        "(repeatable; default: the directory holding --model; none without --model)",
    )
    srv.add_argument(
        "--read-timeout",
        type=float,
        default=30.0,
        help="seconds a client has to send a request's head, and then its body",
    )
    srv.add_argument("--port-file", default=None, help="write the URL here once listening")
    srv.add_argument("--parent-pid", type=int, default=None, help="exit when this pid is gone")
    srv.add_argument(
        "--verbose",
        action="store_true",
        help="log every request, and show the warnings of third-party libraries",
    )
    return parser


# ============================================================================= serve
def cmd_serve(args: argparse.Namespace) -> int:
    """Serve the embedded engine; every expected failure (an impossible or busy port, a missing
    model directory, a backend that cannot load) is a UsageError: one line, exit 2."""
    from .engines.embedded.backend import BackendUnavailableError, make_backend
    from .engines.embedded.body import Limits
    from .engines.embedded.server import (
        ServeError,
        bind_socket,
        default_load_dirs,
        serve,
        watch_parent,
    )

    if args.parent_pid is not None:
        watch_parent(args.parent_pid)  # before the (slow) model load: no orphan if killed then
    _check_model_dir(args.model)
    for directory in args.load_dir:
        if not Path(directory).is_dir():
            raise UsageError(f"--load-dir {directory}: no such directory; create it or drop it")
    try:
        limits = Limits(read_timeout_s=args.read_timeout)
        sock = bind_socket(args.host, args.port)  # before the model load: a busy port fails fast
    except (ServeError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    try:
        backend = make_backend(
            args.backend,
            model_path=args.model,
            seed=args.seed,
            num_threads=args.num_threads,
            device=args.device,
        )
    except (ValueError, OSError, BackendUnavailableError) as exc:
        sock.close()
        raise UsageError(" ".join(str(exc).split())) from None
    serve(
        backend,
        sock=sock,
        port_file=args.port_file,
        parent_pid=args.parent_pid,
        verbose=args.verbose,
        load_dirs=default_load_dirs(args.model, args.load_dir),
        limits=limits,
    )
    return 0


# ============================================================================= generate
def _config(args: argparse.Namespace) -> RolloutConfig:
    try:
        sampling = SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            stop=tuple(args.stop),
            seed=args.seed,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    filters = []
    if args.drop_aborted:
        filters.append(drop_groups_with_aborted)
    if args.drop_failed:
        filters.append(drop_groups_with_failed)
    if args.n < 1:
        raise UsageError(f"--n is {args.n}; use >= 1")
    if args.concurrency < 1:
        raise UsageError(f"--concurrency is {args.concurrency}; use >= 1")
    if args.batch_size < 1:
        raise UsageError(f"--batch-size is {args.batch_size}; use >= 1")
    return RolloutConfig(
        n_samples=args.n,
        sampling=sampling,
        return_logprob=not args.no_logprobs,
        server_tokenize=not args.no_server_tokenize,
        max_concurrency=args.concurrency,
        filters=tuple(filters),
        batch_size=args.batch_size,
    )


async def _generate_local(args, prompts, config, reward, progress) -> tuple[RolloutBatch, str]:
    from .engines.client import SGLangClient
    from .engines.launcher import LaunchError, launch_embedded
    from .router import EngineRouter

    server = None
    urls = list(args.engine_url)
    if not urls:
        print(
            f"mizzen-rollout: starting the embedded engine ({args.backend}"
            f"{', model ' + args.model if args.model else ', tiny random model'})...",
            file=sys.stderr,
            flush=True,
        )
        try:
            server = await asyncio.to_thread(
                launch_embedded, model_path=args.model, seed=args.engine_seed, backend=args.backend
            )
        except LaunchError as exc:
            raise RunError(f"the embedded engine did not start: {exc}") from None
        urls = [server.url]
    clients = [SGLangClient(u, timeout_s=args.timeout) for u in urls]
    router = EngineRouter(clients)
    try:
        from .rollout import run_rollout

        batch = await run_rollout(
            prompts,
            router,
            config,
            reward=reward,
            on_sample=lambda s: progress.update(s.status.value),
        )
    finally:
        await router.aclose()
        if server is not None:
            server.stop()
            server.cleanup_logs()
    where = "embedded engine" if server is not None else ", ".join(urls)
    return batch, where


def _generate_ray(args, prompts, config, reward, progress) -> tuple[RolloutBatch, str]:
    from .manager import EngineSpec, RolloutManager

    if args.engine_url:
        specs = [EngineSpec(kind="url", url=u, timeout_s=args.timeout) for u in args.engine_url]
    else:
        specs = [
            EngineSpec(
                kind="embedded",
                model_path=args.model,
                backend=args.backend,
                seed=args.engine_seed,
                timeout_s=args.timeout,
            )
            for _ in range(args.num_engines)
        ]
    with RolloutManager(specs, address=args.ray_address) as manager:
        batch = manager.generate_groups(
            prompts, config, reward=reward, on_sample=lambda s: progress.update(s.status.value)
        )
        where = f"Ray manager over {len(specs)} engine(s)"
    return batch, where


def _check_engine_url(url: str) -> None:
    """Register the credentials `url` carries, then require the engine URL rule of
    :func:`~mizzen_rollout.engines.client.check_engine_url` (``http(s)://host[:port][/path]``)."""
    from .engines.client import check_engine_url

    register_url(url, source="--engine-url")
    try:
        check_engine_url(url)
    except ValueError as exc:
        raise UsageError(f"--engine-url {url}: {exc}") from None


def _check_output_path(path: str, flag: str) -> None:
    """`path` can be written as a file: not a directory, its parent a writable directory (or
    creatable under one)."""
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"{flag} {path} is a directory; fix: give a file path in it, e.g. "
                         f"{target / ('metrics.json' if 'metrics' in flag else 'samples.jsonl')}")  # fmt: skip
    if target.exists() and not target.is_file():
        raise UsageError(f"{flag} {path} exists and is not a regular file; fix: give a file path")
    probe = target.absolute().parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise UsageError(f"{flag} {path}: {probe} is not a directory; fix: give a file path "
                         "under a directory")  # fmt: skip
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: {probe} is not writable; fix: choose a writable place")


def _check_model_dir(model: str | None) -> None:
    """``--model`` names a directory (checked before an engine starts: its server would fail
    with its own error in its log)."""
    if model is not None and not Path(model).is_dir():
        raise UsageError(
            f"--model {model}: no such directory; fix: give a local Hugging Face model directory "
            "(config.json, weights, tokenizer), or drop --model to serve the tiny model"
        )


def cmd_generate(args: argparse.Namespace) -> int:
    for url in args.engine_url:
        _check_engine_url(url)
    if not args.engine_url:
        _check_model_dir(args.model)
    _check_output_path(args.out, "--out")
    if args.metrics_out:
        _check_output_path(args.metrics_out, "--metrics-out")
    metadata_keys = (
        tuple(k.strip() for k in args.metadata_keys.split(",") if k.strip())
        if args.metadata_keys is not None
        else None
    )
    keys = DatasetKeys(
        input_key=args.input_key,
        label_key=args.label_key or None,
        metadata_keys=metadata_keys,
        tenant_key=args.tenant_key,
    )
    try:
        dataset = PromptDataset.from_jsonl(args.data, keys)
        reward = load_reward(args.reward)
    except (DataError, RewardSpecError) as exc:
        raise UsageError(str(exc)) from None
    config = _config(args)
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit is {args.limit}; use >= 1")
    count = min(args.limit or len(dataset), len(dataset))
    drawn = DataCursor(dataset, seed=args.data_seed, shuffle=args.shuffle).next_batch(count)
    chat = not args.no_chat_template
    prompts = [replace(r, input=render_prompt(r.input, chat_template=chat)) for r in drawn]
    total = len(prompts) * config.n_samples
    progress = ProgressBar(total, enabled=not args.no_progress)
    started = time.perf_counter()
    if args.ray:
        batch, where = _generate_ray(args, prompts, config, reward, progress)
    else:
        batch, where = asyncio.run(_generate_local(args, prompts, config, reward, progress))
    progress.close()
    written = write_samples(args.out, batch.samples)
    metrics = batch.metrics
    print(
        f"mizzen-rollout generate: {len(prompts)} prompts x {config.n_samples} samples from "
        f"{dataset.source} via {where}; wrote {written} samples to {args.out} "
        f"(total {time.perf_counter() - started:.1f} s)"
    )
    for line in metrics.summary_lines():
        print("  " + line)
    failed = [s for g in batch.groups + batch.dropped for s in g.samples if s.error]
    if failed:
        print(f"  first error: {shown_line(f'{failed[0].request_id}: {failed[0].error}')}")
    if args.metrics_out:
        Path(args.metrics_out).write_text(mask_json(metrics.to_dict(), indent=2) + "\n")
    return (
        1
        if metrics.num_samples and metrics.status_counts.get("failed") == metrics.num_samples
        else 0
    )


def main(argv: Sequence[str] | None = None) -> int:
    """The entry point: output masks first, then the one error boundary (module docstring)."""
    restore = install_output_masks()
    try:
        register_environment()
        return _run(build_parser(), argv)
    finally:
        restore()


def _fail(command: str, problem: object, code: int) -> int:
    print(f"mizzen-rollout {command}: error: {shown_line(problem)}", file=sys.stderr)
    return code


#: arguments that are file system paths (any bytes the OS allows); every other text is UTF-8
_PATH_ARGUMENTS = frozenset({"data", "out", "metrics_out", "model", "port_file", "load_dir"})


def _check_text_arguments(args: argparse.Namespace) -> None:
    """Every text argument but a path is valid UTF-8 (the shell may pass any bytes; they would
    fail every request or the first write later)."""
    for name, value in vars(args).items():
        values = value if isinstance(value, list) else [value]
        for text in values:
            if name in _PATH_ARGUMENTS or not isinstance(text, str):
                continue
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                flag = "--" + name.replace("_", "-")
                raise UsageError(f"{flag} holds bytes that are not UTF-8 text; fix: pass it as "
                                 "UTF-8 (check the shell's locale or quoting)") from None  # fmt: skip


def _run(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> int:
    args = parser.parse_args(argv)
    command = args.command
    finish = quiet_third_party(f"mizzen-rollout {command}", verbose=args.verbose)
    code = 1
    try:
        code = _run_command(args)
    finally:
        finish(show_summary=code != 2)  # an error stays one line
    return code


def _run_command(args: argparse.Namespace) -> int:
    command = args.command
    try:
        _check_text_arguments(args)
        if command == "serve":
            return cmd_serve(args)
        return cmd_generate(args)
    except (UsageError, SecretError) as exc:
        return _fail(command, exc, 2)
    except RunError as exc:
        return _fail(command, exc, 1)
    except KeyboardInterrupt:
        return 130
    except ImportError as exc:
        return _fail(command, f"{exc}; fix: install the extra that provides "
                     f"{exc.name or 'it'} (e.g. pip install 'mizzen-rollout[ray]')", 2)  # fmt: skip
    except OSError as exc:
        where = f" {exc.filename}" if exc.filename else ""
        return _fail(command, f"cannot use{where}: {exc.strerror or exc}; fix: check the path "
                     "and its permissions", 2)  # fmt: skip
    except Exception as exc:  # a bug: one line (masked); the traceback on request
        if os.environ.get("MIZZEN_ROLLOUT_TRACEBACK") == "1":
            import traceback

            print(traceback.format_exc(), file=sys.stderr)
        return _fail(command, f"internal error: {type(exc).__name__}: {exc} (a bug: report it "
                     "with the command; MIZZEN_ROLLOUT_TRACEBACK=1 shows where)", 1)  # fmt: skip
