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

Graceful shutdown mirrors HTTP's: when ``shutdown_trigger`` returns, the listeners close (a
handshake completing after that is refused with 503), every connection stops reading new
frames, ends its listen streams, and gives its in-flight requests ``graceful_timeout`` to
answer; once their answers are written it is closed with 1001 (going away). What is still
running after that grace is cancelled, and the connection is closed with 1001 all the same. A
peer that closes its side during the grace cancels its requests at once (nobody is left to
read the answers). Without a trigger the server runs until cancelled.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
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
GOING_AWAY: Final = 1001
DEFAULT_GRACEFUL_TIMEOUT: Final = 5.0
"""After a shutdown trigger, how long in-flight requests may take (as on HTTP)."""
CLOSE_TIMEOUT: Final = 5.0
"""How long the closing handshake (and the last answers' flush) may take after the grace."""


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
    app: App,
    ws: trio_websocket.WebSocketConnection,
    *,
    principal: Any = None,
    stopping: trio.Event | None = None,
    graceful_timeout: float = DEFAULT_GRACEFUL_TIMEOUT,
) -> None:
    """Serve one accepted WebSocket until it closes, the client stops receiving, or shutdown.

    ``stopping`` is the server's shutdown: once it is set the connection reads no more frames
    (so it takes no new requests), lets the running ones answer for ``graceful_timeout``, and
    closes with 1001 after their answers are written. The reading stops between frames,
    never in the middle of handling one.
    """

    async def send_text(text: str) -> None:
        try:
            await ws.send_message(text)
        except trio_websocket.ConnectionClosed as error:
            raise PeerGone from error

    waiting = trio.CancelScope()
    """Cancelled at shutdown: it only ever surrounds the wait for the next frame."""
    serving = trio.CancelScope()
    """Cancelled when the peer closes during the grace: its requests have nobody to answer."""

    async def read(connection: MessageConnection) -> None:
        nonlocal waiting
        while stopping is None or not stopping.is_set():
            waiting = trio.CancelScope()
            with waiting:
                try:
                    frame = await ws.get_message()
                except trio_websocket.ConnectionClosed as closed:
                    log.debug("WebSocket closed: %s", closed.reason)
                    return
            if waiting.cancelled_caught:
                break
            if isinstance(frame, bytes):
                await connection.refuse(
                    InvalidRequest("Invalid request: binary frames are not supported; send text")
                )
            else:
                await connection.receive(frame)
        # Shutdown: the in-flight requests may answer, while the peer is still there.
        connection.grace_seconds = graceful_timeout
        watch.start_soon(notice_peer_closing)

    async def stop_reading() -> None:
        assert stopping is not None
        await stopping.wait()
        waiting.cancel()

    async def notice_peer_closing() -> None:
        # Frames that arrive during the grace are not served (the server is going away).
        try:
            while True:
                await ws.get_message()
                log.debug("WebSocket frame received during shutdown: not served")
        except trio_websocket.ConnectionClosed:
            serving.cancel()

    connection = MessageConnection(
        app, send_text, transport="websocket", principal=principal, grace_seconds=0
    )
    async with trio.open_nursery() as watch:
        if stopping is not None:
            watch.start_soon(stop_reading)
        with serving:
            await connection.run(read)
        watch.cancel_scope.cancel()
    if stopping is not None and stopping.is_set():
        with trio.move_on_after(CLOSE_TIMEOUT):
            await ws.aclose(code=GOING_AWAY, reason="The server is shutting down")


async def serve_websocket(
    app: App,
    host: str,
    port: int,
    *,
    principal: Any = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    allowed_origins: tuple[str, ...] | None = None,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    graceful_timeout: float = DEFAULT_GRACEFUL_TIMEOUT,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``ws://host:port/``; reports that URL when listening.

    Runs until cancelled or, given ``shutdown_trigger`` (as for ``serve_http``), until that
    returns and every connection has wound down: see the module docstring. The grace is
    bounded by ``graceful_timeout`` and by any deadline of the caller's.

    An app with ``App(auth=...)`` is refused (``ValueError``): WebSocket carries no bearer
    tokens, so it would be served to anyone, tools with ``required_scopes`` included.
    """
    if getattr(app, "auth", None) is not None:
        raise ValueError(
            "WebSocket cannot serve an app with auth= (no bearer tokens on WebSocket: it "
            "would be unprotected); serve it over HTTP"
        )
    stopping = trio.Event()

    async def handler(request: trio_websocket.WebSocketRequest) -> None:
        if not origin_allowed(_header(request, b"origin"), allowed_origins):
            await request.reject(403, body=b"Origin is not allowed")
            return
        if stopping.is_set():
            await request.reject(503, body=b"The server is shutting down")
            return
        subprotocol = SUBPROTOCOL if SUBPROTOCOL in request.proposed_subprotocols else None
        ws = await request.accept(subprotocol=subprotocol)
        await serve_connection(
            app, ws, principal=principal, stopping=stopping, graceful_timeout=graceful_timeout
        )

    listeners = await trio.open_tcp_listeners(port, host=host)
    try:
        # Connections live in their own nursery, so that closing the listeners (cancelling
        # the accepting) at shutdown leaves them running through their grace.
        async with trio.open_nursery() as connections:
            server = trio_websocket.WebSocketServer(
                handler,
                listeners,
                handler_nursery=connections,
                max_message_size=max_message_bytes,
                connect_timeout=30,
                disconnect_timeout=CLOSE_TIMEOUT,
            )
            async with trio.open_nursery() as accepting:
                await accepting.start(server.run)
                endpoint = server.listeners[0]
                bound = endpoint.port if isinstance(endpoint, trio_websocket.Endpoint) else port
                shown = f"[{host}]" if ":" in host else host
                task_status.started(f"ws://{shown}:{bound}/")
                if shutdown_trigger is None:
                    await trio.sleep_forever()
                await shutdown_trigger()
                stopping.set()
                accepting.cancel_scope.cancel()
            for listener in listeners:
                await trio.aclose_forcefully(listener)
            # A handshake still in progress is not waited for past the grace and the close.
            connections.cancel_scope.deadline = min(
                connections.cancel_scope.deadline,
                trio.current_time() + graceful_timeout + 2 * CLOSE_TIMEOUT,
            )
    finally:
        for listener in listeners:
            await trio.aclose_forcefully(listener)
