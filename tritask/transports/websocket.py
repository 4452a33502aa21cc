"""WebSocket: one JSON-RPC message per text frame, served with trio-websocket.

A WebSocket is a message-framed connection like stdio, so it reuses the same engine
(``MessageConnection``, see ``tritask.transports.stdio``): concurrent requests, each in its own
cancel scope; ``notifications/cancelled`` cancels one request and silences its id; listen
streams are demultiplexed by their subscriptionId tag; a server-side listen teardown is the
graceful result followed by ``notifications/cancelled`` (the client has no per-request stream
to see closing, exactly as on stdio).

Differences from stdio: binary frames get -32600; an oversize message closes the connection
with 1009 (trio-websocket enforces ``max_message_size`` before the message is assembled);
and closing the connection cancels every request of that connection at once, since nobody
is left to read their answers.

A browser page may open a WebSocket to any address, so, as on HTTP, a handshake carrying an
``Origin`` that is not loopback (or not in ``allowed_origins``) is refused with 403.
Clients that are not browsers send no ``Origin`` and are unaffected.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any, Final
from urllib.parse import urlsplit

import trio
import trio_websocket

from tritask.jsonrpc import InvalidRequest
from tritask.server.app import App
from tritask.transports.stdio import MessageConnection, PeerGone

log = logging.getLogger("tritask.websocket")

DEFAULT_MAX_MESSAGE_BYTES: Final = 4 * 1024 * 1024
SUBPROTOCOL: Final = "mcp"
_LOOPBACK: Final = frozenset({"127.0.0.1", "localhost", "::1"})


def origin_allowed(origin: str | None, allowed_origins: tuple[str, ...] | None) -> bool:
    """No ``Origin`` (not a browser) is fine; otherwise an exact match or a loopback origin."""
    if origin is None:
        return True
    origin = origin.strip()
    if allowed_origins is not None:
        return origin in allowed_origins
    try:
        parts = urlsplit(origin)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and parts.hostname in _LOOPBACK


def _header(request: trio_websocket.WebSocketRequest, name: bytes) -> str | None:
    for key, value in request.headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def serve_connection(
    app: App, ws: trio_websocket.WebSocketConnection, *, principal: Any = None
) -> None:
    """Serve one accepted WebSocket until it closes or the client stops receiving."""

    async def send_text(text: str) -> None:
        try:
            await ws.send_message(text)
        except trio_websocket.ConnectionClosed as error:
            raise PeerGone from error

    async def read(connection: MessageConnection) -> None:
        while True:
            try:
                frame = await ws.get_message()
            except trio_websocket.ConnectionClosed as closed:
                log.debug("WebSocket closed: %s", closed.reason)
                return
            if isinstance(frame, bytes):
                await connection.refuse(
                    InvalidRequest("Invalid request: binary frames are not supported; send text")
                )
            else:
                await connection.receive(frame)

    connection = MessageConnection(
        app, send_text, transport="websocket", principal=principal, grace_seconds=0
    )
    await connection.run(read)


async def serve_websocket(
    app: App,
    host: str,
    port: int,
    *,
    principal: Any = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    allowed_origins: tuple[str, ...] | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``ws://host:port/`` until cancelled; reports that URL when listening.

    An app with ``App(auth=...)`` is refused (``ValueError``): WebSocket carries no bearer
    tokens, so it would be served to anyone, tools with ``required_scopes`` included.
    """
    if getattr(app, "auth", None) is not None:
        raise ValueError(
            "WebSocket cannot serve an app with auth= (no bearer tokens on WebSocket: it "
            "would be unprotected); serve it over HTTP"
        )

    async def handler(request: trio_websocket.WebSocketRequest) -> None:
        if not origin_allowed(_header(request, b"origin"), allowed_origins):
            await request.reject(403, body=b"Origin is not allowed")
            return
        subprotocol = SUBPROTOCOL if SUBPROTOCOL in request.proposed_subprotocols else None
        ws = await request.accept(subprotocol=subprotocol)
        await serve_connection(app, ws, principal=principal)

    async with trio.open_nursery() as nursery:
        server = await nursery.start(
            partial(
                trio_websocket.serve_websocket,
                handler,
                host,
                port,
                None,
                max_message_size=max_message_bytes,
                connect_timeout=30,
                disconnect_timeout=5,
            )
        )
        assert isinstance(server, trio_websocket.WebSocketServer)
        endpoint = server.listeners[0]
        bound = endpoint.port if isinstance(endpoint, trio_websocket.Endpoint) else port
        shown = f"[{host}]" if ":" in host else host
        task_status.started(f"ws://{shown}:{bound}/")
