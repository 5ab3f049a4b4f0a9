"""Which backend a store URL names, and opening it: ``postgresql://…`` (or ``postgres://…``) is
:mod:`.postgres`, anything else a SQLite file (:mod:`.sqlite`).

Invariants:
- The interface (:mod:`.store`) never imports a backend; this module is the one place that
  chooses (the backends import the interface, so the choice lives outside it).
- A backend module is imported only when its URL is opened: the PostgreSQL driver is loaded by
  nothing else.
"""

from __future__ import annotations

import os

from .store import MetricStore


def is_postgres(url: str) -> bool:
    return url.startswith(("postgresql://", "postgres://"))


def open_store(url: str, *, readonly: bool = False) -> MetricStore | None:
    """The store at ``url``: ``postgresql://…`` (or ``postgres://…``) is PostgreSQL, anything
    else a SQLite file (``sqlite:///abs``, ``sqlite:rel`` or a path).  ``readonly``: never
    writes (a pull request's gate); a missing SQLite file is then ``None`` (no history)."""
    if is_postgres(url):
        from .postgres import PostgresStore

        return PostgresStore(url, readonly=readonly)
    from .sqlite import SqliteStore, sqlite_path

    path = sqlite_path(url)
    if readonly and not os.path.lexists(path):
        return None
    return SqliteStore(path, readonly=readonly)
