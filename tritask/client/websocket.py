"""WebSocket for the client, on trio-websocket: one JSON-RPC message per text frame.

The handshake proposes the ``mcp`` subprotocol and carries the ``Authorization`` value the
application's hook supplies (asked once, at connect: a WebSocket has no per-message headers).
A refused handshake, or a connection that fails, raises ``TransportError``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Final

import trio
import trio_websocket

from tritask.client._framed import DEFAULT_BUFFER, FramedConnection
from tritask.client.errors import TransportError
from tritask.client.http import Authorizer

SUBPROTOCOL: Final = "mcp"
DEFAULT_MAX_MESSAGE_BYTES: Final = 64 * 1024 * 1024


async def _frames(ws: trio_websocket.WebSocketConnection) -> AsyncIterator[str | bytes]:
    while True:
        try:
            message = await ws.get_message()
        except trio_websocket.ConnectionClosed:
            return
        yield message


@asynccontextmanager
async def open_websocket(
    url: str,
    *,
    headers: Mapping[str, str] | None = None,
    authorizer: Authorizer | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    connect_timeout: float = 30.0,
    buffer: int = DEFAULT_BUFFER,
) -> AsyncIterator[FramedConnection]:
    extra = {name.lower(): (name, value) for name, value in (headers or {}).items()}
    if authorizer is not None:
        credential = await authorizer(None)
        if credential is not None:
            extra["authorization"] = ("Authorization", credential)
    pairs = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in extra.values()]
    async with AsyncExitStack() as stack:
        try:
            ws = await stack.enter_async_context(
                trio_websocket.open_websocket_url(
                    url,
                    subprotocols=[SUBPROTOCOL],
                    extra_headers=pairs,
                    max_message_size=max_message_bytes,
                    connect_timeout=connect_timeout,
                    disconnect_timeout=5,
                )
            )
        except trio_websocket.HandshakeError as error:
            raise TransportError(f"WebSocket handshake with {url} failed: {error}") from error
        except (OSError, trio_websocket.ConnectionTimeout) as error:
            raise TransportError(f"cannot connect to {url}: {error}") from error

        async def send_text(text: str) -> None:
            try:
                await ws.send_message(text)
            except trio_websocket.ConnectionClosed as error:
                raise trio.BrokenResourceError(str(error.reason)) from error

        connection = FramedConnection(send_text, description=url, buffer=buffer)
        nursery = await stack.enter_async_context(trio.open_nursery())
        await nursery.start(connection.run, _frames(ws))
        try:
            yield connection
        finally:
            nursery.cancel_scope.cancel()
