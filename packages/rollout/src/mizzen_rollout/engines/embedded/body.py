"""Request bodies of the embedded engine, read within its limits and decoded to JSON values.

The HTTP framing itself (``Content-Length``, chunked transfer, keep-alive, pipelining) is
uvicorn's and h11's; this module bounds what the framing delivers:

- :class:`Limits`: the body cap (16 MiB by default; a ``Content-Length`` above it is refused
  before a byte of the body is read), the read timeout (30 s by default: for a request's head
  from the start of the connection or the end of the previous answer, and again for its body
  from the end of the head), the keep-alive idle time (5 s), and the JSON nesting depth (64).
- :func:`read_body` raises :class:`~.schema.RequestRefused` with 413 (too large) or 408 (too
  slow); the server then answers and closes the connection.
- :func:`decode_json`: UTF-8 only (no other encoding guessed), JSON only, nesting at most
  ``max_json_depth``, no lone surrogate in any string or key (each a 400 naming the place).

Standard library only.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

from .schema import RequestRefused

__all__ = ["Limits", "decode_json", "read_body"]

_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class Limits:
    """The embedded server's bounds on one request (see the module docstring)."""

    max_body_bytes: int = 16 * 2**20
    read_timeout_s: float = 30.0
    keep_alive_s: float = 5.0
    max_json_depth: int = 64

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "read_timeout_s", "keep_alive_s", "max_json_depth"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"Limits.{name} is {getattr(self, name)}; use a positive value")


async def read_body(
    chunks: AsyncIterator[bytes], declared_length: str | None, limits: Limits
) -> bytes:
    """The whole body from ``chunks`` (the ASGI stream), within the size cap and the deadline."""
    cap = limits.max_body_bytes
    if declared_length is not None and declared_length.isdigit() and int(declared_length) > cap:
        raise RequestRefused(_too_large(f"Content-Length {declared_length}", cap), status=413)
    parts, size = [], 0
    try:
        async with asyncio.timeout(limits.read_timeout_s):
            async for chunk in chunks:
                size += len(chunk)
                if size > cap:
                    raise RequestRefused(_too_large("the body", cap), status=413)
                parts.append(chunk)
    except TimeoutError:
        raise RequestRefused(
            f"the request body did not arrive within {limits.read_timeout_s:g} s (got {size} "
            "bytes); send the whole body at once",
            status=408,
        ) from None
    return b"".join(parts)


def _too_large(what: str, cap: int) -> str:
    return f"{what} exceeds this server's {cap} byte limit on a request body; send less per request"


def decode_json(raw: bytes, limits: Limits) -> Any:
    """``raw`` as a JSON value (see the module docstring for what is refused)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestRefused(
            f"the body is not UTF-8 (byte {exc.start}: {raw[exc.start : exc.start + 1]!r}); "
            "send JSON encoded as UTF-8"
        ) from None
    if not text.strip():
        raise RequestRefused("the body is empty; send a JSON object")
    try:
        value = json.loads(text)
    except RecursionError:
        raise RequestRefused(_too_deep(limits)) from None
    except ValueError as exc:  # JSONDecodeError, and an integer past Python's digit limit
        raise RequestRefused(f"the body is not JSON: {exc}") from None
    _check_tree(value, limits)
    return value


def _too_deep(limits: Limits) -> str:
    return f"the JSON body nests deeper than {limits.max_json_depth} levels; flatten it"


def _check_tree(value: Any, limits: Limits) -> None:
    """Depth and lone surrogates, without recursion (a deep value cannot exhaust the stack)."""
    stack: list[tuple[Any, int, tuple[Any, ...]]] = [(value, 1, ())]
    while stack:
        node, depth, path = stack.pop()
        if depth > limits.max_json_depth:
            raise RequestRefused(_too_deep(limits))
        items: Iterable[tuple[Any, Any]]
        if isinstance(node, dict):
            for key in node:
                _check_string(key, (*path, key))
            items = node.items()
        elif isinstance(node, list):
            items = enumerate(node)
        else:
            _check_string(node, path)
            continue
        for key, child in items:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1, (*path, key)))
            elif isinstance(child, str):
                _check_string(child, (*path, key))


def _check_string(value: Any, path: tuple[Any, ...]) -> None:
    if isinstance(value, str) and _SURROGATE.search(value):
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
        raise RequestRefused(
            f"field '{where or '(body)'}' holds a lone surrogate (\\ud800-\\udfff), which is not "
            "text; send valid Unicode"
        )
