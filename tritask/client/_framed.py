"""The client side of a message-framed connection (stdio, WebSocket): many requests, one pipe.

Requests are told apart by id. A reader task routes every incoming frame to the exchange it
belongs to: a response by its id, a listen stream's notification by
``_meta["io.modelcontextprotocol/subscriptionId"]`` (the listen request's id), a progress
notification by the ``progressToken`` the request chose, and a server's
``notifications/cancelled`` (its teardown of a listen stream) ends the exchange it names.
What belongs to no open exchange goes to ``on_unrouted`` (by default, the debug log).

Each exchange has a bounded buffer. The reader never waits for a slow consumer (that would
stall every other request on the connection): an exchange that falls behind is ended with
``TransportError`` and cancelled on the server, so memory stays bounded.

One writer task owns the output and every frame reaches it through a channel, so a request
cancelled while its frame is being written can never leave half a line behind. Leaving an
exchange before its response arrived sends ``notifications/cancelled {requestId}``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager, suppress
from typing import Any, Final, TypeGuard

import attrs
import trio

from tritask.client.errors import CancelledByServer, TransportError
from tritask.client.transport import Exchange, Transport
from tritask.jsonrpc import JSONValue, RequestId, dumps, error_message, loads, notification_message
from tritask.protocol.meta import SUBSCRIPTION_ID_KEY
from tritask.protocol.versions import CANCELLED_NOTIFICATION

log = logging.getLogger("tritask.client")

DEFAULT_BUFFER: Final = 1024
"""Frames an exchange may hold unread before it is ended as fallen behind."""

SendText = Callable[[str], Awaitable[None]]


def _is_id(value: object) -> TypeGuard[RequestId]:
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


@attrs.define(eq=False)
class _Route:
    send: trio.MemorySendChannel[dict[str, JSONValue]]
    receive: trio.MemoryReceiveChannel[dict[str, JSONValue]]
    answered: bool = False
    reason: str | None = None
    cancelled: bool = False

    def end(self, reason: str, *, cancelled: bool = False) -> None:
        if self.reason is None:
            self.reason = reason
            self.cancelled = cancelled
        self.send.close()


@attrs.define(eq=False)
class _FramedExchange:
    route: _Route
    http_status: int | None = None

    async def receive(self) -> dict[str, JSONValue]:
        try:
            return await self.route.receive.receive()
        except trio.EndOfChannel:
            reason = self.route.reason or "the connection closed"
            if self.route.cancelled:
                raise CancelledByServer(reason) from None
            raise TransportError(reason) from None


class FramedConnection(Transport):
    """A Transport over ``send_text`` and a stream of incoming frames (see ``run``)."""

    def __init__(
        self,
        send_text: SendText,
        *,
        description: str,
        buffer: int = DEFAULT_BUFFER,
        on_unrouted: Callable[[dict[str, JSONValue]], None] | None = None,
    ) -> None:
        self._send_text = send_text
        self._description = description
        self.buffer = buffer
        self.on_unrouted = on_unrouted
        self._routes: dict[RequestId, _Route] = {}
        self._tokens: dict[Any, RequestId] = {}
        self._outbox, self._outbox_reader = trio.open_memory_channel[str](0)
        self._closed: str | None = None

    @property
    def description(self) -> str:
        return self._description

    @property
    def closed(self) -> bool:
        return self._closed is not None

    async def run(
        self,
        frames: AsyncIterator[str | bytes],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Write queued frames and route incoming ones until ``frames`` ends (or we are
        cancelled); then every open exchange ends with ``TransportError``."""
        reason = "the server closed the connection"
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._write_loop)
                task_status.started()
                try:
                    async for frame in frames:
                        self._route(frame)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as error:
                    reason = f"the connection failed: {error}"
                nursery.cancel_scope.cancel()
        finally:
            self._shut(reason)

    def _shut(self, reason: str) -> None:
        if self._closed is None:
            self._closed = reason
        for route in self._routes.values():
            route.end(self._closed)
        self._outbox.close()

    async def _write_loop(self) -> None:
        async for text in self._outbox_reader:
            try:
                await self._send_text(text)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as error:
                self._shut(f"the connection failed: {error}")
                return

    async def _send(self, message: dict[str, JSONValue]) -> None:
        if self._closed is not None:
            raise TransportError(self._closed)
        try:
            await self._outbox.send(dumps(message))
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise TransportError(self._closed or "the connection closed") from None

    # -- Transport -----------------------------------------------------------------------

    @asynccontextmanager
    async def exchange(
        self, message: dict[str, JSONValue], headers: Mapping[str, str]
    ) -> AsyncIterator[Exchange]:
        request_id = message.get("id")
        if not _is_id(request_id) or request_id in self._routes:
            raise ValueError(f"request id {request_id!r} is not a free JSON-RPC id")
        assert isinstance(request_id, str | int)
        if self._closed is not None:
            raise TransportError(self._closed)
        send, receive = trio.open_memory_channel[dict[str, JSONValue]](self.buffer)
        route = _Route(send, receive)
        self._routes[request_id] = route
        params = message.get("params")
        meta = params.get("_meta") if isinstance(params, dict) else None
        token = meta.get("progressToken") if isinstance(meta, dict) else None
        if token is not None:
            self._tokens[token] = request_id
        try:
            await self._send(message)
            yield _FramedExchange(route)
        finally:
            del self._routes[request_id]
            if token is not None:
                self._tokens.pop(token, None)
            route.end("the exchange is over")
            if not route.answered and self._closed is None:
                cancel = notification_message(
                    CANCELLED_NOTIFICATION,
                    {"requestId": request_id, "reason": "The client stopped waiting"},
                )
                with (
                    trio.CancelScope(shield=True),
                    trio.move_on_after(5),
                    suppress(TransportError),
                ):
                    await self._send(cancel)

    async def notify(self, message: dict[str, JSONValue], headers: Mapping[str, str]) -> None:
        await self._send(message)

    # -- routing -------------------------------------------------------------------------

    def _route(self, raw: str | bytes) -> None:
        try:
            frame = loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            log.warning("%s: ignoring a frame that is not JSON", self._description)
            return
        if not isinstance(frame, dict):
            log.warning("%s: ignoring a frame that is not a JSON-RPC message", self._description)
            return
        method = frame.get("method")
        if isinstance(method, str):
            if "id" in frame:
                self._refuse_request(frame)
            else:
                self._route_notification(method, frame)
            return
        request_id = frame.get("id")
        if ("result" in frame or "error" in frame) and _is_id(request_id):
            route = self._routes.get(request_id)
            if route is None:
                log.debug("%s: response for unknown id %r", self._description, request_id)
                return
            route.answered = True
            self._deliver(request_id, route, frame)
            return
        if "error" in frame:  # an error the server could not attribute (e.g. a torn line)
            log.warning("%s: server error without an id: %s", self._description, frame["error"])
            return
        log.warning("%s: ignoring an invalid JSON-RPC message", self._description)

    def _route_notification(self, method: str, frame: dict[str, JSONValue]) -> None:
        params = frame.get("params")
        params = params if isinstance(params, dict) else {}
        if method == CANCELLED_NOTIFICATION:
            target = params.get("requestId")
            route = self._routes.get(target) if _is_id(target) else None
            if route is not None:
                route.end("the server cancelled the request", cancelled=True)
            return
        meta = params.get("_meta")
        owner: Any = meta.get(SUBSCRIPTION_ID_KEY) if isinstance(meta, dict) else None
        if owner is None and "progressToken" in params:
            owner = self._tokens.get(params["progressToken"])
        route = self._routes.get(owner) if _is_id(owner) else None
        if route is None:
            if self.on_unrouted is not None:
                self.on_unrouted(frame)
            else:
                log.debug("%s: unrouted notification %s", self._description, method)
            return
        self._deliver(owner, route, frame)

    def _deliver(self, request_id: RequestId, route: _Route, frame: dict[str, JSONValue]) -> None:
        if route.reason is not None:
            return
        try:
            route.send.send_nowait(frame)
        except trio.WouldBlock:
            log.warning("%s: request %r fell behind; ending it", self._description, request_id)
            route.end(f"request {request_id!r} fell more than {self.buffer} frames behind")

    def _refuse_request(self, frame: dict[str, JSONValue]) -> None:
        """Servers send no requests at 2026-07-28; answer -32601 rather than leave one hanging."""
        request_id = frame.get("id")
        log.warning("%s: the server sent a request (%s)", self._description, frame.get("method"))
        if not _is_id(request_id) or self._closed is not None:
            return
        refusal = error_message(
            request_id, {"code": -32601, "message": "This client serves no requests"}
        )
        try:
            self._outbox.send_nowait(dumps(refusal))
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            log.debug("%s: could not refuse request %r", self._description, request_id)
