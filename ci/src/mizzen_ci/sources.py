"""Reading Python source files: what every reader of the tree shares.

Invariants:
- :data:`PARSE_ERRORS` is every exception ``ast.parse`` raises for bad input (``ValueError``:
  null bytes; ``MemoryError``/``RecursionError``: pathological nesting); a reader turns each into
  a recorded problem, never a traceback.
- :func:`read_bytes` reads with plain ``os`` calls and returns the bytes with the ``stat`` taken
  before reading; an error names the file, as ``open()`` does.
"""

from __future__ import annotations

import os
from pathlib import Path

PARSE_ERRORS = (SyntaxError, ValueError, MemoryError, RecursionError)


def read_bytes(path: Path | str) -> tuple[bytes, os.stat_result]:
    """The bytes of a file and its stat (taken before reading)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            chunks = []
            while data := os.read(fd, max(st.st_size + 1, 65536)):
                chunks.append(data)
        finally:
            os.close(fd)
    except OSError as e:
        if e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror, os.fspath(path)) from None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks), st
