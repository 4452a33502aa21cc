"""MCP 2026-07-28 error classes and their HTTP statuses.

The codes live on the classes (see :mod:`tritask.jsonrpc`); the HTTP status table is a protocol
rule that every HTTP transport applies the same way, so it lives here and not in the transport.
"""

from __future__ import annotations

from typing import Final

from tritask.jsonrpc import InvalidParams, JsonRpcError, JSONValue


class HeaderMismatch(JsonRpcError):
    """A required HTTP header is missing, malformed or disagrees with the body."""

    code = -32020
    default_message = "Header mismatch"


class MissingRequiredClientCapability(JsonRpcError):
    """The request needs a client capability it did not declare in its own ``_meta``."""

    code = -32021
    default_message = "Missing required client capability"

    def __init__(self, required: dict[str, JSONValue], message: str | None = None) -> None:
        super().__init__(message, {"requiredCapabilities": required})
        self.required = required


class ResourceNotFound(InvalidParams):
    """No resource or template matches the URI: -32602 at 2026-07-28, -32002 in the 2025 era."""

    def __init__(self, uri: str) -> None:
        super().__init__("Resource not found", {"uri": uri})
        self.uri = uri


class UnsupportedProtocolVersion(JsonRpcError):
    code = -32022
    default_message = "Unsupported protocol version"

    def __init__(self, requested: JSONValue, supported: list[str]) -> None:
        super().__init__(
            f"Unsupported protocol version; supported: {', '.join(supported)}",
            {"supported": supported, "requested": requested},
        )


_STATUS: Final[dict[int, int]] = {
    -32700: 400,
    -32600: 400,
    -32601: 404,
    -32602: 400,
    -32603: 500,
    -32020: 400,
    -32021: 400,
    -32022: 400,
}


def http_status_for(code: int) -> int:
    """HTTP status for a JSON-RPC error code; codes outside the table travel with 200."""
    return _STATUS.get(code, 200)


RETRY_AFTER_KEY: Final = "retryAfterSeconds"
"""The ``data`` member of a retryable refusal saying when to try again (whole seconds)."""
_RETRYABLE_STATUS: Final[dict[str, int]] = {
    "max_active_tasks_per_scope": 429,  # this principal's (tenant's) quota
    "max_tasks": 503,  # the store is full for everyone
    "max_jobs": 503,
}


def http_response_status(error: object) -> tuple[int, int | None]:
    """The HTTP status of a JSON-RPC error object, and its ``Retry-After`` (seconds) if any.

    A retryable refusal (``-32603`` with ``data {"retryable": true, "limit": L,
    "retryAfterSeconds": N}``, e.g. "Task capacity exhausted") is not a server failure: it
    travels as 429 (a per-principal limit) or 503 (a limit of the whole server) with
    ``Retry-After: N``. Everything else follows :func:`http_status_for`.
    """
    if not isinstance(error, dict):
        return 200, None
    code = error.get("code")
    if not isinstance(code, int) or isinstance(code, bool):
        return 200, None
    data = error.get("data")
    if code == -32603 and isinstance(data, dict) and data.get("retryable") is True:
        seconds = data.get(RETRY_AFTER_KEY)
        limit = data.get("limit")
        if type(seconds) is int and seconds >= 0 and isinstance(limit, str):
            return _RETRYABLE_STATUS.get(limit, 503), seconds
    return http_status_for(code), None
