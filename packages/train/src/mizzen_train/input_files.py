"""Reading files that are input (run directories, checkpoints, model folders, the service's
state): one bounded read and one JSON parse, so every reader refuses the same things the same way.

Invariants:
- :func:`read_regular_file` reads a regular file only (a FIFO or device is refused without
  waiting on it) and at most ``limit`` bytes; it raises OSError (cannot open or read) or
  ValueError (the rule it breaks), nothing else.
- :func:`parse_json` raises ValueError for anything that is not one JSON value: bad syntax, bad
  UTF-8, a number Python refuses, or nesting deeper than the parser follows (which ``json.loads``
  reports as RecursionError).
- Standard library only; imports nothing of mizzen_train (every folder may use it).
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

__all__ = ["MAX_MODEL_CONFIG_BYTES", "parse_json", "read_json_file", "read_regular_file"]

#: a model folder's JSON files (config.json, the safetensors index): megabytes at most
MAX_MODEL_CONFIG_BYTES = 64 * 1024 * 1024


def read_regular_file(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of ``path``: a regular file (opened without waiting on a FIFO, so one is
    refused, never waited on) of at most ``limit`` bytes.  OSError when it cannot be opened or
    read; ValueError ("is not a regular file ...", "is N bytes, more than ...") otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise ValueError("is not a regular file (a directory, FIFO or device)")
    with os.fdopen(fd, "rb") as handle:  # closes fd
        if info.st_size > limit:
            raise ValueError(f"is {info.st_size} bytes, more than {limit}")
        data = handle.read(limit + 1)
    if len(data) > limit:  # it grew while being read
        raise ValueError(f"is more than {limit} bytes")
    return data


def parse_json(data: bytes | str) -> Any:
    """The JSON value of ``data``; ValueError for anything else (see the module's invariants)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("nested deeper than the JSON parser follows") from None


def read_json_file(path: str | os.PathLike, limit: int) -> Any:
    """:func:`parse_json` of :func:`read_regular_file`; OSError or ValueError."""
    return parse_json(read_regular_file(path, limit))
