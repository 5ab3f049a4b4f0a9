"""Which backend a store URL names, and opening it: ``postgresql://…`` (or ``postgres://…``) is
:mod:`.postgres`, anything else a SQLite file (:mod:`.sqlite`).

Invariants:
- The interface (:mod:`.store`) never imports a backend; this module is the one place that
  chooses (the backends import the interface, so the choice lives outside it).
- A backend module is imported only when its URL is opened: the PostgreSQL driver is loaded by
  nothing else.
- A libpq key/value string (``host=… password=…``) is PostgreSQL too, never a SQLite file named
  after its password.
- A URL with any other ``scheme://`` (``postgresql+psycopg://``, ``POSTGRESQL://``, ``mysql://``)
  is a :class:`~.store.StoreError` (shown redacted), never a SQLite file of that name: a mistyped
  URL must not become "no store, every gate inactive", nor a folder named after its password.
"""

from __future__ import annotations

import os
import re

from ..masking import is_conninfo, register_connection
from .redact import redact_url
from .store import MetricStore, StoreError

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


def is_postgres(url: str) -> bool:
    """A ``postgresql://``/``postgres://`` URL or a libpq key/value string (``host=… dbname=…``;
    a SQLite file whose name starts like ``word=`` is written ``./word=…`` or ``sqlite:…``)."""
    return url.startswith(("postgresql://", "postgres://")) or is_conninfo(url)


def open_store(url: str, *, readonly: bool = False) -> MetricStore | None:
    """The store at ``url``: ``postgresql://…`` (or ``postgres://…``) is PostgreSQL, anything
    else a SQLite file (``sqlite:///abs``, ``sqlite:rel`` or a path).  ``readonly``: never
    writes (a pull request's gate); a missing SQLite file is then ``None`` (no history).  The
    URL's secrets are registered in the mask set first."""
    register_connection(url)
    scheme = _SCHEME.match(url)
    if scheme is not None and scheme[1] not in ("postgresql", "postgres", "sqlite"):
        raise StoreError(
            f"{redact_url(url)}: not a metric store URL (scheme {scheme[1][:20]!r}); write "
            "postgresql://USER:PASSWORD@HOST:PORT/DATABASE (lowercase scheme) or a SQLite file path"
        )
    if is_postgres(url):
        from .postgres import PostgresStore

        return PostgresStore(url, readonly=readonly)
    from .sqlite import SqliteStore, sqlite_path

    path = sqlite_path(url)
    if readonly and not os.path.lexists(path):
        return None
    return SqliteStore(path, readonly=readonly)
