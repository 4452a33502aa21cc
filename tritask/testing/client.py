"""A small 2026-07-28 client for tests, examples and the stress harness.

It builds stateless requests (``_meta`` with version and capabilities on every call), speaks
either directly to an ``App``'s dispatcher or over Streamable HTTP (with the mirrored headers),
and knows the Tasks methods. It is deliberately tiny; real applications use a full MCP client.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import trio

from tritask.jsonrpc import JSONValue, Request, loads
from tritask.protocol.headers import CORE_NAME_SOURCES, encode_header_value
from tritask.protocol.meta import CLIENT_CAPABILITIES_KEY, PROTOCOL_VERSION_KEY
from tritask.protocol.versions import LATEST_VERSION
from tritask.server.dispatcher import Dispatcher

if TYPE_CHECKING:
    from tritask.server.app import App

TASKS_ID = "io.modelcontextprotocol/tasks"
TERMINAL = frozenset({"completed", "failed", "cancelled"})
NAME_SOURCES: Mapping[str, str] = {
    **CORE_NAME_SOURCES,
    "tasks/get": "taskId",
    "tasks/update": "taskId",
    "tasks/cancel": "taskId",
}


class ClientError(Exception):
    """The server answered with a JSON-RPC error."""

    def __init__(self, error: Mapping[str, Any], status: int | None = None) -> None:
        self.code: int = error.get("code", 0)
        self.message: str = error.get("message", "")
        self.data: Any = error.get("data")
        self.status = status
        super().__init__(f"{self.code}: {self.message}")


class _Transport(Protocol):
    async def send(self, message: dict[str, JSONValue]) -> dict[str, JSONValue]: ...


class DirectTransport:
    """Calls the dispatcher in-process (no sockets), as a given principal."""

    def __init__(self, app: App, principal: Any = None) -> None:
        self.dispatcher = Dispatcher(app)
        self.app = app
        self.principal = principal

    async def send(self, message: dict[str, JSONValue]) -> dict[str, JSONValue]:
        request = Request(id=message["id"], method=message["method"], params=message["params"])
        return await self.dispatcher.handle_request(request, principal=self.principal)


class HttpTransport:
    """Streamable HTTP with the 2026-07-28 headers; reads JSON or an SSE stream."""

    def __init__(self, url: str, headers: Mapping[str, str] | None = None) -> None:
        import httpx

        self.url = url
        self._client = httpx.AsyncClient(timeout=None, headers=dict(headers or {}))
        self.notifications: list[dict[str, JSONValue]] = []

    async def aclose(self) -> None:
        await self._client.aclose()

    async def send(self, message: dict[str, JSONValue]) -> dict[str, JSONValue]:
        method = message["method"]
        params = message.get("params") or {}
        assert isinstance(method, str) and isinstance(params, dict)
        headers = {
            "content-type": "application/json",
            "accept": "application/json, text/event-stream",
            "mcp-protocol-version": LATEST_VERSION,
            "mcp-method": method,
        }
        source = NAME_SOURCES.get(method)
        if source is not None and isinstance(params.get(source), str):
            headers["mcp-name"] = encode_header_value(params[source])
        import json

        async with self._client.stream(
            "POST", self.url, content=json.dumps(message), headers=headers
        ) as response:
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    frame = loads(line[5:].strip())
                    if "id" in frame and frame.get("id") == message["id"]:
                        frame["_status"] = response.status_code
                        return frame  # type: ignore[no-any-return]
                    self.notifications.append(frame)
                raise ConnectionError("the SSE stream ended without a response")
            body = await response.aread()
            frame = loads(body)
            frame["_status"] = response.status_code
            return frame  # type: ignore[no-any-return]


class Client:
    """Request helpers over any transport; each call declares its own capabilities."""

    def __init__(
        self,
        transport: _Transport,
        *,
        capabilities: Mapping[str, JSONValue] | None = None,
        tasks: bool = True,
    ) -> None:
        self.transport = transport
        caps = dict(capabilities or {})
        if tasks:
            extensions = dict(caps.get("extensions") or {})
            extensions[TASKS_ID] = {}
            caps["extensions"] = extensions
        self.capabilities = caps
        self._ids = itertools.count(1)

    @classmethod
    def direct(cls, app: App, principal: Any = None, **options: Any) -> Client:
        return cls(DirectTransport(app, principal), **options)

    async def request(
        self,
        method: str,
        params: Mapping[str, JSONValue] | None = None,
        *,
        capabilities: Mapping[str, JSONValue] | None = None,
    ) -> dict[str, JSONValue]:
        body = dict(params or {})
        body["_meta"] = {
            PROTOCOL_VERSION_KEY: LATEST_VERSION,
            CLIENT_CAPABILITIES_KEY: dict(
                self.capabilities if capabilities is None else capabilities
            ),
        }
        message: dict[str, JSONValue] = {
            "jsonrpc": "2.0",
            "id": next(self._ids),
            "method": method,
            "params": body,
        }
        response = await self.transport.send(message)
        error = response.get("error")
        if isinstance(error, dict):
            status = response.get("_status")
            raise ClientError(error, status if isinstance(status, int) else None)
        result = response.get("result")
        assert isinstance(result, dict)
        return result

    async def call_tool(
        self, name: str, arguments: Mapping[str, JSONValue] | None = None, **extra: JSONValue
    ) -> dict[str, JSONValue]:
        return await self.request(
            "tools/call", {"name": name, "arguments": dict(arguments or {}), **extra}
        )

    async def get_task(self, task_id: str) -> dict[str, JSONValue]:
        return await self.request("tasks/get", {"taskId": task_id})

    async def update_task(
        self, task_id: str, responses: Mapping[str, JSONValue]
    ) -> dict[str, JSONValue]:
        return await self.request(
            "tasks/update", {"taskId": task_id, "inputResponses": dict(responses)}
        )

    async def cancel_task(self, task_id: str) -> dict[str, JSONValue]:
        return await self.request("tasks/cancel", {"taskId": task_id})

    async def wait_task(
        self,
        task_id: str,
        statuses: frozenset[str] = TERMINAL,
        *,
        poll_seconds: float = 0.05,
    ) -> dict[str, JSONValue]:
        """Poll ``tasks/get`` until the task reaches one of ``statuses`` (or a terminal one)."""
        while True:
            task = await self.get_task(task_id)
            if task.get("status") in statuses or task.get("status") in TERMINAL:
                return task
            await trio.sleep(poll_seconds)
