"""Streamable HTTP (2026-07-28) as a plain ASGI application, plus a hypercorn runner.

One POST endpoint. A request is answered with JSON, or with an SSE stream scoped to that one
request as soon as it has something to stream (progress, logs, a listen acknowledgement, or a
keep-alive on a long call). Closing the response cancels the request: hypercorn's ``send()``
does not raise after a disconnect, so a sibling task watches ``receive()`` for
``http.disconnect`` and cancels the handler's scope.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any, Final

import attrs
import trio

from tritask.jsonrpc import (
    InvalidRequest,
    JSONValue,
    MessageError,
    Notification,
    dumps,
    error_message,
    parse_message,
)
from tritask.protocol.errors import HeaderMismatch, http_status_for
from tritask.protocol.headers import HeaderView, check_protocol_version_present
from tritask.server.app import App

log = logging.getLogger("tritask.http")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Authenticate = Callable[[HeaderView], Awaitable[Any]]

DEFAULT_MAX_BODY: Final = 4 * 1024 * 1024
LOOPBACK_HOSTS: Final[tuple[str, ...]] = ("127.0.0.1", "localhost", "[::1]", "::1")


class Unauthenticated(Exception):
    """Raise from ``authenticate`` to answer 401."""


def _host_only(value: str) -> str:
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        return value[: end + 1] if end != -1 else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


_ORIGIN = re.compile(r"^(https?)://([^/]+)$", re.IGNORECASE)


@attrs.define
class HttpOptions:
    """Security and limit settings of the HTTP transport."""

    path: str = "/mcp"
    allowed_hosts: tuple[str, ...] | None = LOOPBACK_HOSTS
    """Host names (without port) accepted in ``Host``; ``None`` accepts any (behind a proxy)."""
    allowed_origins: tuple[str, ...] | None = None
    """Exact origins accepted; the default accepts loopback origins only."""
    max_body_bytes: int = DEFAULT_MAX_BODY
    keepalive_seconds: float = 15.0
    authenticate: Authenticate | None = None


class HttpTransport:
    """The ASGI application serving one ``App`` over Streamable HTTP."""

    def __init__(self, app: App, options: HttpOptions | None = None, **overrides: Any) -> None:
        self.app = app
        base = options or HttpOptions()
        self.options = attrs.evolve(base, **overrides) if overrides else base

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope.get("type")
        if kind == "lifespan":
            await self._lifespan(receive, send)
            return
        if kind != "http":
            if kind == "websocket":
                await send({"type": "websocket.close", "code": 1003})
            return
        try:
            await self._http(scope, receive, send)
        except trio.Cancelled:
            raise
        except Exception:
            log.exception("HTTP transport failure")

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- admission -----------------------------------------------------------------------

    def _host_allowed(self, headers: HeaderView) -> bool:
        allowed = self.options.allowed_hosts
        if allowed is None:
            return True
        host = headers.get("host")
        if host is None:
            return False
        return _host_only(host) in {h.lower() for h in allowed}

    def _origin_allowed(self, headers: HeaderView) -> bool:
        origin = headers.get("origin")
        if origin is None:
            return True
        origin = origin.strip()
        if self.options.allowed_origins is not None:
            return origin in self.options.allowed_origins
        match = _ORIGIN.match(origin)
        if match is None:
            return False
        return _host_only(match.group(2)) in LOOPBACK_HOSTS

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = HeaderView.from_pairs(scope.get("headers") or [])
        path = scope.get("path", "")
        if path.rstrip("/") != self.options.path.rstrip("/"):
            await _plain(send, 404, b"Not Found")
            return
        method = scope.get("method", "GET").upper()
        if method != "POST":
            await _plain(send, 405, b"Method Not Allowed", [(b"allow", b"POST")])
            return
        if not self._host_allowed(headers):
            await _error(send, 403, error_message(None, InvalidRequest("Host is not allowed")))
            return
        if not self._origin_allowed(headers):
            await _error(send, 403, error_message(None, InvalidRequest("Origin is not allowed")))
            return
        content_type = (headers.get("content-type") or "").split(";")[0].strip().lower()
        if content_type != "application/json":
            await _error(
                send,
                415,
                error_message(None, InvalidRequest("Content-Type must be application/json")),
            )
            return
        if not _accepts_both(headers.get_all("accept")):
            await _error(
                send,
                406,
                error_message(
                    None,
                    InvalidRequest("Accept must list application/json and text/event-stream"),
                ),
            )
            return
        body = await self._read_body(headers, receive, send)
        if body is None:
            return
        principal: Any = None
        if self.options.authenticate is not None:
            try:
                principal = await self.options.authenticate(headers)
            except Unauthenticated:
                await _error(send, 401, error_message(None, InvalidRequest("Unauthenticated")))
                return
        try:
            message = parse_message(body)
        except MessageError as error:
            await _error(send, 400, error_message(error.request_id, error))
            return
        if isinstance(message, Notification):
            await self._notification(message, headers, send)
            return
        await _Exchange(self, send, receive, self.options.keepalive_seconds).run(
            message, headers, principal
        )

    async def _read_body(self, headers: HeaderView, receive: Receive, send: Send) -> bytes | None:
        limit = self.options.max_body_bytes
        declared = headers.get("content-length")
        too_large = error_message(None, InvalidRequest(f"Body exceeds {limit} bytes"))
        if declared is not None:
            try:
                if int(declared) > limit:
                    await _error(send, 413, too_large)
                    return None
            except ValueError:
                await _error(send, 400, error_message(None, InvalidRequest("Bad Content-Length")))
                return None
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _error(send, 413, too_large)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _notification(self, message: Notification, headers: HeaderView, send: Send) -> None:
        try:
            check_protocol_version_present(headers)
        except HeaderMismatch as error:
            await _error(send, 400, error_message(None, error))
            return
        await send({"type": "http.response.start", "status": 202, "headers": []})
        await send({"type": "http.response.body", "body": b""})


def _accepts_both(values: Iterable[str]) -> bool:
    types: set[str] = set()
    for value in values:
        for part in value.split(","):
            media = part.split(";")[0].strip().lower()
            if media:
                types.add(media)
    has_json = bool({"application/json", "application/*", "*/*"} & types)
    has_sse = bool({"text/event-stream", "text/*", "*/*"} & types)
    return has_json and has_sse


async def _plain(
    send: Send, status: int, body: bytes, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    response_headers = [(b"content-type", b"text/plain; charset=utf-8"), *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": response_headers})
    await send({"type": "http.response.body", "body": body})


async def _error(send: Send, status: int, message: dict[str, JSONValue]) -> None:
    await _json(send, status, message)


async def _json(send: Send, status: int, message: dict[str, JSONValue]) -> None:
    body = dumps(message).encode("utf-8")
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _status_of(response: dict[str, JSONValue]) -> int:
    error = response.get("error")
    if isinstance(error, dict) and isinstance(error.get("code"), int):
        return http_status_for(error["code"])
    return 200


@attrs.define(eq=False)
class _Exchange:
    """One request/response exchange: JSON unless something needs streaming first."""

    transport: HttpTransport
    send: Send
    receive: Receive
    keepalive: float
    _streaming: bool = False
    _closed: bool = False
    _lock: trio.Lock = attrs.field(factory=trio.Lock)

    async def _start_stream(self) -> None:
        if self._streaming:
            return
        self._streaming = True
        await self.send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream"),
                    (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no"),
                ],
            }
        )

    async def emit(self, message: dict[str, JSONValue]) -> None:
        async with self._lock:
            if self._closed:
                return
            await self._start_stream()
            data = b"event: message\ndata: " + dumps(message).encode("utf-8") + b"\n\n"
            await self.send({"type": "http.response.body", "body": data, "more_body": True})

    async def _keepalive(self) -> None:
        while True:
            await trio.sleep(self.keepalive)
            async with self._lock:
                if self._closed:
                    return
                await self._start_stream()
                await self.send(
                    {"type": "http.response.body", "body": b": keep-alive\n\n", "more_body": True}
                )

    async def _watch_disconnect(self, scope: trio.CancelScope) -> None:
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self._closed = True
                scope.cancel()
                return

    async def run(self, request: Any, headers: HeaderView, principal: Any) -> None:
        response: dict[str, JSONValue] | None = None
        async with trio.open_nursery() as nursery:
            handler_scope = trio.CancelScope()
            nursery.start_soon(self._watch_disconnect, handler_scope)
            if self.keepalive > 0:
                nursery.start_soon(self._keepalive)
            with handler_scope:
                response = await self.transport.app.dispatcher.handle_request(
                    request,
                    headers=headers,
                    principal=principal,
                    transport="http",
                    emit=self.emit,
                    cancel_scope=handler_scope,
                )
            nursery.cancel_scope.cancel()
        if response is None or self._closed:
            return
        async with self._lock:
            self._closed = True
            if self._streaming:
                data = b"event: message\ndata: " + dumps(response).encode("utf-8") + b"\n\n"
                await self.send({"type": "http.response.body", "body": data, "more_body": False})
            else:
                await _json(self.send, _status_of(response), response)


async def serve_http(
    app: App,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    options: HttpOptions | None = None,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` with hypercorn's trio worker; reports the bound URLs via ``task_status``."""
    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("tritask.hypercorn")
    config.graceful_timeout = 5.0
    config.keep_alive_timeout = 75.0
    transport = HttpTransport(app, options)
    await serve(
        transport,  # type: ignore[arg-type]
        config,
        shutdown_trigger=shutdown_trigger,
        task_status=task_status,
        mode="asgi",
    )
