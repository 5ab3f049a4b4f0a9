"""``mizzen-train serve --config serve.toml``: build the service and serve it until interrupted.

Order: configuration and key file (exit 2 on a bad one, one line naming field or file:line),
then the port is bound (a busy port fails before the slow model load), then the base model and
the executor (its own thread), then the embedded engine, then HTTP.  ``server.port_file``
receives the URL (written atomically) once everything serves.

Invariants: no key on the command line (only the key file's path, in the config); the process
prints one ``listening on URL`` line; the engine subprocess is stopped on the way out.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import uuid
from pathlib import Path

__all__ = ["add_serve_command", "run_serve"]


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


def _bind(host: str, port: int) -> socket.socket:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def _write_atomic(path: str, text: str) -> None:
    target = Path(path)
    tmp = target.with_name(f".tmp-{target.name}-{uuid.uuid4().hex[:8]}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, target)


def run_serve(args: argparse.Namespace) -> int:
    from mizzen_train.serve.auth import KeyFileError, read_key_file
    from mizzen_train.serve.config import load_serve_config, serve_config_help

    if args.help_config:
        print(serve_config_help())
        return 0
    config = load_serve_config(args.config, args.set)
    try:
        keys = read_key_file(config.server.api_keys_file)
    except KeyFileError as exc:
        print(f"mizzen-train serve: error: {exc}", file=sys.stderr)
        return 2
    try:
        sock = _bind(config.server.host, config.server.port)
    except OSError as exc:
        print(
            f"mizzen-train serve: error: cannot listen on {config.server.host}:"
            f"{config.server.port} ({exc.strerror}). Fix: set server.port",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per operation is ours
    return _serve(config, keys, sock)


def _serve(config, keys, sock: socket.socket) -> int:
    import uvicorn

    from mizzen_train.serve.app import Service, build_app, sweep_sessions
    from mizzen_train.serve.metrics import ServeMetrics
    from mizzen_train.serve.operations import OperationBook
    from mizzen_train.serve.sampling import Sampling
    from mizzen_train.serve.scheduler import Scheduler
    from mizzen_train.serve.state import ServerState

    config.state_dir.mkdir(parents=True, exist_ok=True)
    state = ServerState(config.state_dir)
    book = OperationBook(
        max_queue=config.server.max_queue, keep_bytes=config.server.kept_result_bytes
    )
    metrics = ServeMetrics()
    sampling = Sampling(config, state)
    scheduler = Scheduler(config, state, book, metrics, publish=sampling.publish)
    scheduler.start()
    scheduler.ready.wait()
    if scheduler.startup_error is not None:
        print(f"mizzen-train serve: error: {scheduler.startup_error}", file=sys.stderr)
        return 1
    try:
        sampling.start(scheduler.model_dir, scheduler._device()[0])
        service = Service(config, keys, state, book, scheduler, sampling, metrics)
        app = build_app(service)
        server = uvicorn.Server(uvicorn.Config(
            app, ws="none", lifespan="off", log_level="warning", access_log=False,
            server_header=False, timeout_graceful_shutdown=2,
        ))  # fmt: skip
        host, port = sock.getsockname()[:2]
        url = f"http://{host}:{port}"

        async def main() -> None:
            sampling.bind(asyncio.get_running_loop())
            if config.server.port_file:
                _write_atomic(config.server.port_file, url)
            print(f"mizzen-train serve: listening on {url} ({config.base_model_name}, "
                  f"{config.model.slots} slots)", flush=True)  # fmt: skip
            sweeper = asyncio.get_running_loop().create_task(sweep_sessions(service))
            try:
                await server.serve(sockets=[sock])
            finally:
                sweeper.cancel()

        asyncio.run(main())
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        scheduler.stop()
        sampling.stop()
        sock.close()
