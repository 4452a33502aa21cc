"""Envelopes: what makes a request structurally valid in one protocol era.

An ``Era`` turns (id, method, params, capabilities) into the JSON-RPC message and the HTTP
headers a correct client of that era sends. ``MODERN`` is 2026-07-28: every request carries its
own ``_meta`` (protocol version, client capabilities) and, on HTTP, mirrors its method and
target name in headers. The initialize-era (2025) would add an era whose ``opening`` messages
(``initialize``, ``notifications/initialized``) run once per connection and whose requests
carry a session instead of ``_meta``; the drivers and strategies do not change.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final, Protocol

from tritask.protocol.headers import encode_header_value

VERSION: Final = "2026-07-28"
PROTOCOL_VERSION_KEY: Final = "io.modelcontextprotocol/protocolVersion"
CLIENT_CAPABILITIES_KEY: Final = "io.modelcontextprotocol/clientCapabilities"
TASKS_EXTENSION: Final = "io.modelcontextprotocol/tasks"

NAME_SOURCES: Final[Mapping[str, str]] = {
    "tools/call": "name",
    "prompts/get": "name",
    "resources/read": "uri",
    "tasks/get": "taskId",
    "tasks/update": "taskId",
    "tasks/cancel": "taskId",
}
"""The body parameter ``Mcp-Name`` mirrors, per method (SEP-2243 and the Tasks extension)."""


class Era(Protocol):
    name: str

    def opening(self) -> list[dict[str, Any]]:
        """Messages a connection sends before its first request (none at 2026-07-28)."""
        ...

    def request(
        self,
        request_id: int | str,
        method: str,
        params: dict[str, Any],
        capabilities: Mapping[str, Any],
        *,
        meta: Mapping[str, Any] | None = None,
        param_headers: Mapping[str, str] | None = None,
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """The message and its HTTP headers."""
        ...

    def notification(
        self, method: str, params: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, str]]: ...


def _mirrored(value: Any) -> str:
    """A body value as a client mirrors it into a header (primitives; others as JSON)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    return json.dumps(value)


class ModernEra:
    """2026-07-28: stateless requests, per-request ``_meta``, mirrored headers on HTTP."""

    name = "2026-07-28"

    def opening(self) -> list[dict[str, Any]]:
        return []

    def request(
        self,
        request_id: int | str,
        method: str,
        params: dict[str, Any],
        capabilities: Mapping[str, Any],
        *,
        meta: Mapping[str, Any] | None = None,
        param_headers: Mapping[str, str] | None = None,
    ) -> tuple[dict[str, Any], dict[str, str]]:
        body = dict(params)
        body["_meta"] = {
            **dict(meta or {}),
            PROTOCOL_VERSION_KEY: VERSION,
            CLIENT_CAPABILITIES_KEY: dict(capabilities),
        }
        message = {"jsonrpc": "2.0", "id": request_id, "method": method, "params": body}
        headers = {
            "content-type": "application/json",
            "accept": "application/json, text/event-stream",
            "mcp-protocol-version": VERSION,
            "mcp-method": method,
        }
        source = NAME_SOURCES.get(method)
        target = params.get(source) if source else None
        if isinstance(target, str):
            headers["mcp-name"] = encode_header_value(target)
        arguments = params.get("arguments")
        if method == "tools/call" and isinstance(arguments, dict):
            for suffix, argument in (param_headers or {}).items():
                value = arguments.get(argument)
                if value is not None:
                    headers[f"mcp-param-{suffix}"] = encode_header_value(_mirrored(value))
        return message, headers

    def notification(
        self, method: str, params: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, str]]:
        message = {"jsonrpc": "2.0", "method": method, "params": dict(params)}
        headers = {
            "content-type": "application/json",
            "accept": "application/json, text/event-stream",
            "mcp-protocol-version": VERSION,
            "mcp-method": method,
        }
        return message, headers


MODERN: Final = ModernEra()
