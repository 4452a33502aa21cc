"""tritask's embedded durable task store on one SQLite file (``sqlite:PATH``).

``open_store("sqlite:tasks.db", scope=...)`` returns an unopened :class:`SqliteStore`; enter it
with ``async with``. See :mod:`tritask_sqlite.store` for the design.
"""

from __future__ import annotations

from typing import Any

from tritask.tasks.store import AuditFinding as AuditFinding
from tritask.tasks.store import AuditPage as AuditPage
from tritask.tasks.store import LedgerEntry as LedgerEntry
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
    "ReadOnlyStore",
    "SqliteStore",
    "StoreLocked",
    "StoreSchemaError",
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
    """
    options.setdefault("scope", "shared")
    options.setdefault("exclusive", not options.get("read_only", False))
    return SqliteStore(path_from_url(url), **options)
