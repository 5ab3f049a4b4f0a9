"""``mizzen-train serve --config serve.toml``: build the service and serve it until interrupted.

Order: configuration (every path checked for its use), key file, state directory and its
``models.json``, descriptor limit, then the port is bound (a busy port fails before the slow
model load), then the base model and the executor (its own thread), then the embedded engine,
then HTTP (:mod:`.connections`).  ``server.port_file`` receives the URL (written atomically)
once everything serves.

Invariants: no key on the command line (only the key file's path, in the config); the process
prints one ``listening on URL`` line; the engine subprocess is stopped on the way out.  Every
startup failure the operator fixes (a bad field or file, an OSError of a step) exits 2 with one
line naming the field or file, the rule and the fix (:class:`StartupError`), never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import sys
import uuid
from pathlib import Path

__all__ = ["StartupError", "add_serve_command", "run_serve"]


class StartupError(Exception):
    """A startup step failed for a reason the operator fixes: one line, field or file first."""


@contextlib.contextmanager
def _field(name: str, fix: str):
    """The step's OSError as a StartupError naming the field ``name``, the file and ``fix``."""
    try:
        yield
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        raise StartupError(f"{name}{where}: {exc.strerror or exc}. Fix: {fix}") from None


def add_serve_command(sub) -> None:
    command = sub.add_parser(
        "serve",
        help="a multi-tenant LoRA training service for the Tinker SDK",
        description="Serve one base model with K LoRA slots over the Tinker API; clients use the "
        "official SDK with TINKER_BASE_URL and TINKER_API_KEY. See --help-config.",
    )
    command.add_argument("--config", default=None, help="the server's TOML configuration")
    command.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                         help="override any field: --set server.port=8001")  # fmt: skip
    command.add_argument("--help-config", action="store_true", help="list every field and exit")


def _say(line: str, stream) -> None:
    """Print one line of the command through rollout's ``shown_line`` (masked, escaped to one
    terminal line: names from files cannot drive the terminal), as ``mizzen-train`` does."""
    from mizzen_rollout.api import shown_line

    print(shown_line(line), file=stream, flush=True)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _write_atomic(path: str, text: str) -> None:
    target = Path(path)
    tmp = target.with_name(f".tmp-{target.name}-{uuid.uuid4().hex[:8]}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def run_serve(args: argparse.Namespace) -> int:
    from mizzen_train.serve.config import load_serve_config, serve_config_help

    if args.help_config:
        print(serve_config_help())
        return 0
    config = load_serve_config(args.config, args.set)
    try:
        keys, state, sock = _open(config)
    except StartupError as exc:
        _say(f"mizzen-train serve: error: {exc}", sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per operation is ours
    return _serve(config, keys, state, sock)


def _open(config):
    """``(keys, state, socket)``: every fast startup step, before the model is built; a
    StartupError names the field or file of a failing one."""
    from mizzen_train.serve.auth import KeyFileError, read_key_file
    from mizzen_train.serve.connections import fit_descriptor_limit
    from mizzen_train.serve.state import ServerState, StateError

    try:
        keys = read_key_file(config.server.api_keys_file)  # its OSErrors name the file
        with _field("server.state_dir", "give a writable directory; check what is in it"):
            config.state_dir.mkdir(parents=True, exist_ok=True)
            state = ServerState(config.state_dir)
    except (KeyFileError, StateError) as exc:
        raise StartupError(str(exc)) from None
    if state.swept:
        _say(f"mizzen-train serve: deleted {state.swept} leftover(s) of the last server "
             "(unnamed sampler weights, half-written checkpoints)", sys.stderr)  # fmt: skip
    try:
        fit_descriptor_limit(config.server.max_connections)
    except ValueError as exc:
        raise StartupError(
            f"server.max_connections={config.server.max_connections}: {exc}. Fix: lower it, "
            "or raise the hard limit (ulimit -Hn)"
        ) from None
    host, port = config.server.host, config.server.port
    try:
        return keys, state, _bind(host, port)
    except OSError as exc:
        raise StartupError(
            f"server.port: cannot listen on {host}:{port} ({exc.strerror}). Fix: set server.port"
        ) from None


def _serve(config, keys, state, sock: socket.socket) -> int:
    from mizzen_train.serve.app import Service, build_app, sweep_sessions
    from mizzen_train.serve.connections import AcceptErrorLog, http_server
    from mizzen_train.serve.metrics import ServeMetrics
    from mizzen_train.serve.operations import OperationBook
    from mizzen_train.serve.sampling import Sampling
    from mizzen_train.serve.scheduler import Scheduler

    book = OperationBook(
        max_queue=config.server.max_queue, keep_bytes=config.server.kept_result_bytes
    )
    metrics = ServeMetrics()
    sampling = Sampling(config, state)
    scheduler = Scheduler(config, state, book, metrics, publish=sampling.publish)
    scheduler.start()
    scheduler.ready.wait()
    if scheduler.startup_error is not None:
        _say(f"mizzen-train serve: error: {scheduler.startup_error}", sys.stderr)
        return 1
    try:
        sampling.start(scheduler.model_dir, scheduler._device()[0])
        service = Service(config, keys, state, book, scheduler, sampling, metrics)
        server = http_server(build_app(service), config.server)
        host, port = sock.getsockname()[:2]
        url = f"http://{host}:{port}"

        async def main() -> None:
            asyncio.get_running_loop().set_exception_handler(AcceptErrorLog())
            sampling.bind(asyncio.get_running_loop())
            if config.server.port_file:
                with _field("server.port_file", "give a file name in a writable directory"):
                    _write_atomic(config.server.port_file, url)
            _say(f"mizzen-train serve: listening on {url} ({config.base_model_name}, "
                 f"{config.model.slots} slots)", sys.stdout)  # fmt: skip
            sweeper = asyncio.get_running_loop().create_task(sweep_sessions(service))
            try:
                await server.serve(sockets=[sock])
            finally:
                sweeper.cancel()

        asyncio.run(main())
        return 0
    except StartupError as exc:
        _say(f"mizzen-train serve: error: {exc}", sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    finally:
        scheduler.stop()
        sampling.stop()
        sock.close()
