"""Envelopes: what makes a request structurally valid in one protocol era.

An ``Era`` turns (id, method, params, capabilities) into the JSON-RPC message and the HTTP
headers a correct client of that era sends. ``MODERN`` is 2026-07-28: every request carries its
own ``_meta`` (protocol version, client capabilities) and, on HTTP, mirrors its method and
target name in headers. ``LegacyEra`` is the initialize era (2025-06-18, 2025-11-25): its
``opening`` messages (``initialize``, ``notifications/initialized``) run once per connection,
and its requests carry the session (``Mcp-Session-Id`` on HTTP) instead of ``_meta``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from typing import Any, Final, Protocol

from tritask.protocol.headers import encode_header_value
from tritask.protocol.legacy import LEGACY_VERSIONS

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

    def response(
        self, request_id: Any, outcome: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """The client's answer (``outcome``: ``{"result": ...}`` or ``{"error": ...}``) to a
        server-initiated request, and its HTTP headers."""
        ...

    def opened(self, session_id: str | None) -> None:
        """The opening's answer named this session (``Mcp-Session-Id``, HTTP only)."""
        ...


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

    def response(
        self, request_id: Any, outcome: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, str]]:
        message = {"jsonrpc": "2.0", "id": request_id, **outcome}
        headers = {
            "content-type": "application/json",
            "accept": "application/json, text/event-stream",
            "mcp-protocol-version": VERSION,
        }
        return message, headers

    def opened(self, session_id: str | None) -> None:
        return None


MODERN: Final = ModernEra()


class LegacyEra:
    """2025-06-18 / 2025-11-25: one session per connection, opened by ``initialize``.

    The version and the client capabilities are chosen once per connection (the session
    fixes them), so they are constructor arguments: ``legacy_era`` draws them. Requests carry
    no ``_meta`` envelope (the per-request capabilities a step declares are dropped: the
    session's count); on HTTP they carry ``Mcp-Session-Id`` and ``MCP-Protocol-Version``.
    """

    def __init__(self, version: str, capabilities: Mapping[str, Any]) -> None:
        self.version = version
        self.name = version
        self.capabilities = dict(capabilities)
        self.session_id: str | None = None

    def _headers(self) -> dict[str, str]:
        headers = {
            "content-type": "application/json",
            "accept": "application/json, text/event-stream",
        }
        if self.session_id is not None:
            headers["mcp-session-id"] = self.session_id
            headers["mcp-protocol-version"] = self.version
        return headers

    def opening(self) -> list[dict[str, Any]]:
        initialize = {
            "jsonrpc": "2.0",
            "id": 0,
            "method": "initialize",
            "params": {
                "protocolVersion": self.version,
                "capabilities": self.capabilities,
                "clientInfo": {"name": "stress.fuzz", "version": "0"},
            },
        }
        initialized = {"jsonrpc": "2.0", "method": "notifications/initialized"}
        return [initialize, initialized]

    def opened(self, session_id: str | None) -> None:
        self.session_id = session_id

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
        if meta:
            body["_meta"] = dict(meta)  # progressToken and the like: legacy _meta, no envelope
        message = {"jsonrpc": "2.0", "id": request_id, "method": method, "params": body}
        return message, self._headers()

    def notification(
        self, method: str, params: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, str]]:
        return {"jsonrpc": "2.0", "method": method, "params": dict(params)}, self._headers()

    def response(
        self, request_id: Any, outcome: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, str]]:
        return {"jsonrpc": "2.0", "id": request_id, **outcome}, self._headers()


def legacy_era(seed: int) -> LegacyEra:
    """A session's opening, generated: one of the versions and a subset of the capabilities."""
    rng = random.Random(seed)
    capabilities: dict[str, Any] = {}
    for name in ("elicitation", "sampling", "roots"):
        if rng.random() < 0.75:
            capabilities[name] = {"listChanged": True} if name == "roots" else {}
    return LegacyEra(rng.choice(LEGACY_VERSIONS), capabilities)
