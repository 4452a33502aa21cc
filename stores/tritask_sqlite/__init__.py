"""tritask's embedded durable task store on one SQLite file (``sqlite:PATH``).

``open_store("sqlite:tasks.db", scope=...)`` returns an unopened :class:`SqliteStore`; enter it
with ``async with``. See :mod:`tritask_sqlite.store` for the design.
"""

from __future__ import annotations

import os
import sqlite3
import urllib.parse
from typing import Any

import attrs
import trio

from tritask.tasks.store import AuditFinding as AuditFinding
from tritask.tasks.store import AuditPage as AuditPage
from tritask.tasks.store import LedgerEntry as LedgerEntry
from tritask_sqlite import schema
from tritask_sqlite.schema import SCHEMA_VERSION as SCHEMA_VERSION
from tritask_sqlite.schema import StoreSchemaError as StoreSchemaError
from tritask_sqlite.store import ReadOnlyStore as ReadOnlyStore
from tritask_sqlite.store import SqliteStore as SqliteStore
from tritask_sqlite.store import StoreLocked as StoreLocked

__all__ = [
    "SCHEMA_VERSION",
    "AuditFinding",
    "AuditPage",
    "LedgerEntry",
    "Migrated",
    "ReadOnlyStore",
    "SqliteStore",
    "StoreLocked",
    "StoreSchemaError",
    "migrate",
    "open_store",
    "path_from_url",
]


def path_from_url(url: str) -> str:
    """The file of ``sqlite:PATH`` (relative or absolute) or ``sqlite:///abs/path``."""
    scheme, sep, rest = url.partition(":")
    if not sep or scheme.lower() != "sqlite":
        raise ValueError(f"not an sqlite: store URL: {url!r}")
    if rest.startswith("///"):
        rest = rest[2:]
    elif rest.startswith("//"):
        raise ValueError(
            f"{url!r} names a host; use sqlite:PATH or sqlite:///absolute/path for a local file"
        )
    if rest in ("", ":memory:"):
        raise ValueError(
            f"{url!r} names no database file; the SQLite store is durable, so it needs a path "
            "(use the memory: store for a volatile one)"
        )
    return rest


def open_store(url: str, **options: Any) -> SqliteStore:
    """The ``tritask.stores`` factory for ``sqlite:`` URLs (the ``tritask serve`` default).

    Like ``memory:``, the URL form defaults ``scope`` to ``"shared"``; it also defaults
    ``exclusive=True``: one serving process owns the file and fences a crashed predecessor's
    claims. Pass ``exclusive=False`` to let several processes on one host share it, or
    ``read_only=True`` to read it beside a server that holds it (no lock, nothing written).
    And it defaults ``writer_process=True``: a serving store commits its hot writes through a
    child process of its own (see :mod:`tritask_sqlite._writer`; ``writer_process=False``
    keeps every write in this process).
    """
    options.setdefault("scope", "shared")
    options.setdefault("exclusive", not options.get("read_only", False))
    options.setdefault("writer_process", not options.get("read_only", False))
    return SqliteStore(path_from_url(url), **options)


@attrs.frozen
class Migrated:
    """What :func:`migrate` did: the file's schema version now, and the versions it applied."""

    version: int
    applied: tuple[int, ...]


def _file_version(path: str) -> int:
    """The schema version of a store file, read without writing (0: no file, an empty one)."""
    if not os.path.isfile(path):
        return 0  # the store's open refuses it: no tritask store there
    uri = "file:" + urllib.parse.quote(path) + "?mode=ro"
    conn = sqlite3.connect(uri, uri=True, isolation_level=None)
    try:
        found = schema.inspect(conn, path)
    finally:
        conn.close()
    return 0 if found is None else found.version


async def migrate(url: str, **options: Any) -> Migrated:
    """``tritask migrate --store sqlite:PATH``: bring an existing store file to
    :data:`SCHEMA_VERSION` now, rather than at the next serving open (which would do it too).

    Why a step of its own: the read-only operator commands refuse an older file (they write
    nothing), and a migration that rebuilds tables (versions 5, 6) holds the write lock while it
    copies every row, which an operator may prefer to do while the server is stopped. It opens
    the file as a shared store (no new file, no boot epoch advanced): it is refused with
    ``StoreLocked`` while a ``tritask serve`` holds the file exclusively.
    """
    if options:
        raise ValueError(f"sqlite: migrations take no options (got {', '.join(sorted(options))})")
    store = SqliteStore(path_from_url(url), scope="shared", create=False, exclusive=False)
    before = await trio.to_thread.run_sync(_file_version, store.path)
    async with store:  # migrates, under the write lock, what another process has not yet
        pass
    return Migrated(SCHEMA_VERSION, tuple(range(before + 1, SCHEMA_VERSION + 1)))
