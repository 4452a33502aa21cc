"""The initialize era (2025-06-18, 2025-11-25): the rules that differ from 2026-07-28.

Pure rules, no I/O, beside the 2026-07-28 ones in :mod:`tritask.protocol.versions` and
:mod:`tritask.protocol.meta`:

- **Which era a message belongs to.** The one reliable marker of a modern request is
  ``params._meta["io.modelcontextprotocol/protocolVersion"]``: legacy traffic carries ``_meta``
  too (``progressToken``, ``related-task``), so "has ``_meta``" is no evidence. Over HTTP a
  request without that envelope is still modern when its ``MCP-Protocol-Version`` header names a
  version that is not a legacy one (the 2026 ladder then answers it), which keeps every check of
  the 2026-07-28 suite true: ``initialize`` *with* the envelope is a modern request for a method
  that does not exist there.
- **Version negotiation**: echo a served legacy version, answer anything else with the latest.
- **Result shapes**: legacy results carry no ``resultType``, no caching fields and no
  ``serverInfo`` in ``_meta``; the 2026 error codes -32020..-32022 do not exist there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from tritask.jsonrpc import JSONValue
from tritask.protocol.meta import PROTOCOL_VERSION_KEY, SERVER_INFO_KEY

LATEST_LEGACY_VERSION: Final = "2025-11-25"
LEGACY_VERSIONS: Final[tuple[str, ...]] = ("2025-11-25", "2025-06-18")
"""The initialize-era revisions this server negotiates, latest first."""

INITIALIZE: Final = "initialize"
INITIALIZED: Final = "notifications/initialized"
PING: Final = "ping"

LEGACY_ONLY_METHODS: Final[frozenset[str]] = frozenset(
    {"initialize", "ping", "logging/setLevel", "resources/subscribe", "resources/unsubscribe"}
)
MODERN_ONLY_METHODS: Final[frozenset[str]] = frozenset({"server/discover", "subscriptions/listen"})
"""2026-07-28 methods a legacy session does not have (answered -32601 there)."""

RESOURCE_NOT_FOUND: Final = -32002
"""Legacy code for an unknown resource URI (2026-07-28 uses -32602)."""

MODERN_ONLY_CODES: Final[frozenset[int]] = frozenset({-32020, -32021, -32022})

_STRIPPED_RESULT_KEYS: Final = ("resultType", "ttlMs", "cacheScope")


def has_modern_envelope(params: Mapping[str, JSONValue] | None) -> bool:
    """Whether ``params`` carries the 2026-07-28 per-request envelope."""
    if not params:
        return False
    meta = params.get("_meta")
    return isinstance(meta, dict) and PROTOCOL_VERSION_KEY in meta


def is_legacy_request(params: Mapping[str, JSONValue] | None, header_version: str | None) -> bool:
    """The HTTP rule: no modern envelope, and a version header that is absent or legacy.

    Transports without headers pass ``None`` for the header.
    """
    if has_modern_envelope(params):
        return False
    return header_version is None or header_version in LEGACY_VERSIONS


def negotiate_version(requested: JSONValue) -> str:
    """The version an ``InitializeResult`` names for a client that asked for ``requested``."""
    if isinstance(requested, str) and requested in LEGACY_VERSIONS:
        return requested
    return LATEST_LEGACY_VERSION


def legacy_result(result: Mapping[str, JSONValue]) -> dict[str, JSONValue]:
    """A 2026-07-28 result in legacy form: no ``resultType``, caching fields or server stamp."""
    shaped = {key: value for key, value in result.items() if key not in _STRIPPED_RESULT_KEYS}
    meta = shaped.get("_meta")
    if isinstance(meta, dict) and SERVER_INFO_KEY in meta:
        rest = {key: value for key, value in meta.items() if key != SERVER_INFO_KEY}
        if rest:
            shaped["_meta"] = rest
        else:
            del shaped["_meta"]
    return shaped
