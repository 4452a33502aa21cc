"""Per-request ``_meta``: every 2026-07-28 request carries its own version and capabilities."""

from __future__ import annotations

from typing import Any, Final

import attrs

from tritask.jsonrpc import InvalidParams, JSONValue

PROTOCOL_VERSION_KEY: Final = "io.modelcontextprotocol/protocolVersion"
CLIENT_CAPABILITIES_KEY: Final = "io.modelcontextprotocol/clientCapabilities"
CLIENT_INFO_KEY: Final = "io.modelcontextprotocol/clientInfo"
LOG_LEVEL_KEY: Final = "io.modelcontextprotocol/logLevel"
SERVER_INFO_KEY: Final = "io.modelcontextprotocol/serverInfo"
SUBSCRIPTION_ID_KEY: Final = "io.modelcontextprotocol/subscriptionId"

LOG_LEVELS: Final[tuple[str, ...]] = (
    "debug",
    "info",
    "notice",
    "warning",
    "error",
    "critical",
    "alert",
    "emergency",
)


@attrs.frozen
class RequestMeta:
    """The validated ``params._meta`` of one request."""

    protocol_version: str
    client_capabilities: dict[str, JSONValue]
    client_info: dict[str, JSONValue] | None = None
    log_level: str | None = None
    progress_token: str | int | None = None
    raw: dict[str, JSONValue] = attrs.field(factory=dict)


def parse_request_meta(params: dict[str, Any] | None) -> RequestMeta:
    """Validate the required ``_meta`` fields (step 5 of the validation order)."""
    meta = (params or {}).get("_meta")
    if meta is None:
        raise InvalidParams(
            f"params._meta is required and must carry {PROTOCOL_VERSION_KEY} "
            f"and {CLIENT_CAPABILITIES_KEY}"
        )
    if not isinstance(meta, dict):
        raise InvalidParams("params._meta must be an object")
    version = meta.get(PROTOCOL_VERSION_KEY)
    if version is None:
        raise InvalidParams(f"params._meta is missing {PROTOCOL_VERSION_KEY}")
    if not isinstance(version, str) or not version:
        raise InvalidParams(f"params._meta {PROTOCOL_VERSION_KEY} must be a non-empty string")
    capabilities = meta.get(CLIENT_CAPABILITIES_KEY)
    if capabilities is None:
        raise InvalidParams(f"params._meta is missing {CLIENT_CAPABILITIES_KEY}")
    if not isinstance(capabilities, dict):
        raise InvalidParams(f"params._meta {CLIENT_CAPABILITIES_KEY} must be an object")
    client_info = meta.get(CLIENT_INFO_KEY)
    if client_info is not None and not isinstance(client_info, dict):
        raise InvalidParams(f"params._meta {CLIENT_INFO_KEY} must be an object")
    return RequestMeta(
        protocol_version=version,
        client_capabilities=capabilities,
        client_info=client_info,
        log_level=None,
        progress_token=None,
        raw=meta,
    )


def parse_optional_meta(meta: RequestMeta) -> RequestMeta:
    """Validate the optional fields once the version is known to be supported."""
    raw = meta.raw
    log_level = raw.get(LOG_LEVEL_KEY)
    if log_level is not None and log_level not in LOG_LEVELS:
        raise InvalidParams(f"params._meta {LOG_LEVEL_KEY} must be one of: {', '.join(LOG_LEVELS)}")
    token = raw.get("progressToken")
    if token is not None and (isinstance(token, bool) or not isinstance(token, str | int)):
        raise InvalidParams("params._meta progressToken must be a string or an integer")
    unset = meta.log_level is None and meta.progress_token is None
    if unset and log_level is None and token is None:
        return meta  # nothing to add (the usual request): the frozen value as it is
    return attrs.evolve(meta, log_level=log_level, progress_token=token)
