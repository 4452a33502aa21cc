"""Finding a store by URL: ``memory:``, ``sqlite:PATH``, ``postgresql://...``.

Stores register a factory in the ``tritask.stores`` entry-point group under their URL scheme,
so a third-party store plugs in exactly like the built-in ones and ``tritask`` never imports
``stores/`` directly.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

from tritask.tasks.store import Store


class UnknownStore(ValueError):
    """No installed store handles this URL scheme."""


def store_scheme(url: str) -> str:
    scheme, sep, _ = url.partition(":")
    if not sep or not scheme:
        raise UnknownStore(f"not a store URL: {url!r} (try memory:, sqlite:PATH, postgresql://...)")
    return scheme.lower()


def open_store(url: str, **options: Any) -> Store:
    """Build the store for ``url``; enter it with ``async with`` to open it."""
    scheme = store_scheme(url)
    for entry in entry_points(group="tritask.stores"):
        if entry.name == scheme:
            factory = entry.load()
            store: Store = factory(url, **options)
            return store
    available = sorted({entry.name for entry in entry_points(group="tritask.stores")})
    raise UnknownStore(f"no store for {scheme!r} URLs; installed: {', '.join(available)}")
