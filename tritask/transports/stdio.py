"""stdio: newline-delimited JSON-RPC on stdin/stdout, and the connection engine it shares.

A message-framed connection (a stdio process, a WebSocket) carries many requests at once, so
unlike HTTP it needs its own multiplexing. ``MessageConnection`` is that engine; stdio and the
WebSocket transport only turn their bytes into frames and back:

- Every request runs in its own task inside its own cancel scope, so a slow call never blocks
  the next line, and ``notifications/cancelled {requestId}`` cancels exactly that scope. From
  then on nothing more is written for that id (no progress, no result), even if the handler
  had already produced its answer; unknown and finished ids are ignored. A listen request
  cancelled this way simply ends: the client asked for the end, so there is nothing to say.
- One writer task owns the output stream and every message reaches it through a channel. A
  request cancelled in the middle of ``send_all`` would otherwise leave a torn line that
  corrupts every later message; here cancellation can only stop a message *before* it is
  handed over, and the writer drops messages of requests cancelled meanwhile.
- Listen streams need no routing of their own: the dispatcher tags each of their
  notifications with ``_meta["io.modelcontextprotocol/subscriptionId"]`` (the listen request's
  id), which is what the client demultiplexes on.
- When the server ends a listen stream (the app's hub closed at shutdown, or the subscriber fell
  too far behind), the client first gets the graceful ``subscriptions/listen`` result and then
  ``notifications/cancelled`` naming the listen request id. The cancellation page says a server
  MUST send that notification when it tears a subscription down (the schema says stdio only),
  the subscriptions page says it SHOULD send the result first; sending both, in that order,
  satisfies both readings, and clients ignore a cancel for an id that already completed.
  (Measured with ``mcp`` 2.3.0: its listen driver settles the result in a separate task while
  its read loop takes a server-sent cancel as an abrupt loss, so when both lines arrive back to
  back it occasionally reports ``SubscriptionLost`` instead of a graceful end. The stream ends
  either way; the race is the client's.)
- Lines that are not JSON get -32700 with id null; invalid envelopes get -32600 with the id
  when it could be read; responses sent by the client are ignored (this server never sends
  requests); a line longer than the limit gets -32600 and the rest of it is skipped without
  being buffered.
- On EOF the server stops reading, ends open listen streams at once (they never finish on their
  own), gives other in-flight requests a short grace period to answer (a client may close
  stdin and still read stdout), then cancels what is left and returns.

Nothing but MCP messages goes to stdout. When serving the real process stdio, file
descriptor 1 is pointed at stderr for the duration, so a stray ``print()`` in a tool or a
child process cannot corrupt the protocol; logs go to stderr.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack, suppress
from typing import Any, Final, TypeGuard

import attrs
import trio

from tritask.jsonrpc import (
    InternalError,
    InvalidRequest,
    JsonRpcError,
    JSONValue,
    MessageError,
    ParseError,
    Request,
    RequestId,
    UnrepresentableJSON,
    dumps,
    error_message,
    loads_wire,
    message_from_value,
    notification_message,
    result_message,
)
from tritask.protocol.legacy import INITIALIZE, PING, has_modern_envelope
from tritask.protocol.lines import LineSplitter, Oversize
from tritask.protocol.versions import CANCELLED_NOTIFICATION
from tritask.server.app import App
from tritask.server.dispatcher import Dispatcher
from tritask.server.legacy import LegacyDispatcher
from tritask.server.session import Session

log = logging.getLogger("tritask.stdio")

DEFAULT_MAX_LINE_BYTES: Final = 4 * 1024 * 1024
DEFAULT_GRACE_SECONDS: Final = 1.0
"""How long in-flight requests may still answer after stdin reaches EOF."""
FLUSH_SECONDS: Final = 5.0
"""How long already-produced messages may take to drain once every request has ended."""
LISTEN_METHOD: Final = "subscriptions/listen"
_READ_CHUNK: Final = 65536


class PeerGone(Exception):
    """Raised by a transport's ``send_text`` when the peer can no longer receive."""


SendText = Callable[[str], Awaitable[None]]


@attrs.define(eq=False)
class _InFlight:
    """One running request: its cancel scope, and whether the client cancelled it."""

    method: str
    legacy: bool = False
    """Served in the connection's initialize-era session rather than statelessly."""
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True
        self.scope.cancel()


_Outgoing = tuple[_InFlight | None, dict[str, JSONValue]]


def _is_request_id(value: object) -> TypeGuard[RequestId]:
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


class MessageConnection:
    """The server side of one connection that carries one JSON-RPC message per frame."""

    def __init__(
        self,
        app: App,
        send_text: SendText,
        *,
        transport: str,
        principal: Any = None,
        grace_seconds: float = DEFAULT_GRACE_SECONDS,
        teardown_notice: bool = True,
        dispatcher: Dispatcher | None = None,
    ) -> None:
        self.app = app
        self.dispatcher = dispatcher or Dispatcher(app)
        self.legacy = LegacyDispatcher(self.dispatcher)
        self.transport = transport
        self.principal = principal
        self.grace_seconds = grace_seconds
        self.teardown_notice = teardown_notice
        self._send_text = send_text
        self._inflight: dict[RequestId, _InFlight] = {}
        self._outbox, self._outbox_reader = trio.open_memory_channel[_Outgoing](0)
        self._requests: trio.Nursery | None = None
        self._connection: trio.Nursery | None = None
        self._closing = False
        self._drained = trio.Event()
        self.session: Session | None = None
        """The connection's initialize-era session, once a legacy client sent ``initialize``."""
        self._standalone = trio.CancelScope()

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    async def run(self, read: Callable[[MessageConnection], Awaitable[None]]) -> None:
        """Serve until ``read`` returns (end of input) or the peer stops receiving.

        ``read`` feeds frames to ``receive`` and ``refuse``; when it returns, in-flight
        requests get ``grace_seconds`` to finish before they are cancelled.
        """
        async with trio.open_nursery() as connection:
            self._connection = connection
            connection.start_soon(self._write_loop, connection.cancel_scope)
            async with trio.open_nursery() as requests:
                self._requests = requests
                await read(self)
                await self._wind_down()
                requests.cancel_scope.cancel()
            self._standalone.cancel()
            if self.session is not None:
                self.session.close()
            self._outbox.close()
            connection.cancel_scope.deadline = min(
                connection.cancel_scope.deadline, trio.current_time() + FLUSH_SECONDS
            )

    async def _wind_down(self) -> None:
        self._closing = True
        self._standalone.cancel()
        for entry in self._inflight.values():
            if entry.method == LISTEN_METHOD:
                entry.cancel()
        if self._inflight and self.grace_seconds > 0:
            with trio.move_on_after(self.grace_seconds):
                await self._drained.wait()

    async def _write_loop(self, connection: trio.CancelScope) -> None:
        async for owner, message in self._outbox_reader:
            if owner is not None and owner.cancelled:
                continue
            try:
                await self._send_text(dumps(message))
            except PeerGone:
                log.info("%s peer stopped receiving; cancelling its requests", self.transport)
                connection.cancel()
                return

    # -- input ---------------------------------------------------------------------------

    async def refuse(self, error: JsonRpcError, request_id: RequestId | None = None) -> None:
        """Answer a frame that could not be read as a message."""
        await self._outbox.send((None, error_message(request_id, error)))

    async def receive(self, frame: str | bytes) -> None:
        """Handle one frame: start a request, apply a notification, or answer an error."""
        try:
            value = loads_wire(frame)
        except UnrepresentableJSON as error:
            await self.refuse(ParseError(f"Parse error: {error}"), error.request_id)
            return
        except (ValueError, UnicodeDecodeError, RecursionError):
            await self.refuse(ParseError("Parse error: the message is not valid JSON"))
            return
        if (
            isinstance(value, dict)
            and "method" not in value
            and ("result" in value or "error" in value)
        ):
            # The answer to a request this server sent in the connection's legacy session.
            if self.session is None or not self.session.resolve(value):
                log.debug("ignoring a response from the client (id %r)", value.get("id"))
            return
        try:
            message = message_from_value(value)
        except MessageError as error:
            await self.refuse(error, error.request_id)
            return
        if isinstance(message, Request):
            legacy = not has_modern_envelope(message.params) and (
                self.session is not None or message.method in (INITIALIZE, PING)
            )
            if legacy and self.session is None:
                if message.method == INITIALIZE:
                    await self._initialize(message)
                else:  # a ping before initialize: allowed, and answered at once
                    await self._outbox.send((None, result_message(message.id, {})))
            else:
                await self._start(message, legacy)
        elif message.method == CANCELLED_NOTIFICATION:
            request_id = (message.params or {}).get("requestId")
            entry = self._inflight.get(request_id) if _is_request_id(request_id) else None
            if entry is not None:
                log.debug("client cancelled request %r", request_id)
                if entry.legacy and self.session is not None:
                    self.session.cancel_client_request(request_id)
                entry.cancel()
        elif self.session is not None and not has_modern_envelope(message.params):
            self.legacy.handle_notification(message, self.session)
        else:
            log.debug("ignoring client notification %s", message.method)

    async def _initialize(self, request: Request) -> None:
        """Open the connection's one legacy session (stdio and WebSocket need no session id)."""
        legacy = self.legacy
        try:
            session, result = legacy.initialize(request.params, principal=self.principal)
        except JsonRpcError as error:
            await self.refuse(error, request.id)
            return
        self.session = session
        assert self._connection is not None

        async def notify(message: dict[str, JSONValue]) -> None:
            await self._outbox.send((None, message))

        async def standalone() -> None:
            with self._standalone:
                await legacy.run_standalone(session, notify)

        if not self._closing:
            self._connection.start_soon(standalone)
        await self._outbox.send((None, result_message(request.id, result)))

    async def _start(self, request: Request, legacy: bool = False) -> None:
        if request.id in self._inflight:
            await self.refuse(
                InvalidRequest("Invalid request: this id is already in use by a running request"),
                request.id,
            )
            return
        assert self._requests is not None
        entry = _InFlight(request.method, legacy)
        self._inflight[request.id] = entry
        self._requests.start_soon(self._serve, request, entry)

    async def _serve(self, request: Request, entry: _InFlight) -> None:
        async def emit(message: dict[str, JSONValue]) -> None:
            if not entry.cancelled:
                await self._outbox.send((entry, message))

        try:
            response: dict[str, JSONValue] | None = None
            with entry.scope:
                try:
                    if entry.legacy and self.session is not None:
                        response = await self.legacy.handle_request(
                            request, self.session, transport=self.transport, emit=emit
                        )
                    else:
                        response = await self.dispatcher.handle_request(
                            request,
                            principal=self.principal,
                            transport=self.transport,
                            emit=emit,
                            cancel_scope=entry.scope,
                        )
                except Exception:
                    log.exception("request %r (%s) failed", request.id, request.method)
                    response = error_message(request.id, InternalError())
            if response is None or entry.cancelled:
                return
            await self._outbox.send((entry, response))
            if self.teardown_notice and request.method == LISTEN_METHOD and "result" in response:
                notice = notification_message(
                    CANCELLED_NOTIFICATION,
                    {"requestId": request.id, "reason": "The server closed the subscription"},
                )
                await self._outbox.send((entry, notice))
        finally:
            if self._inflight.get(request.id) is entry:
                del self._inflight[request.id]
            if self._closing and not self._inflight:
                self._drained.set()


# -- stdio ---------------------------------------------------------------------------------


async def _read_lines(
    stdin: trio.abc.ReceiveStream, connection: MessageConnection, max_line_bytes: int
) -> None:
    """Split the byte stream into lines; an oversize line is refused and skipped unbuffered."""
    splitter = LineSplitter(max_line_bytes)
    too_long = InvalidRequest(f"Invalid request: message exceeds {max_line_bytes} bytes")
    while True:
        chunk = await stdin.receive_some(_READ_CHUNK)
        lines = splitter.feed(chunk) if chunk else splitter.end()
        for line in lines:
            if isinstance(line, Oversize):
                await connection.refuse(too_long)
            else:
                await connection.receive(line)
        if not chunk:
            return


async def serve_stdio(
    app: App,
    *,
    stdin: trio.abc.ReceiveStream | None = None,
    stdout: trio.abc.SendStream | None = None,
    principal: Any = None,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
) -> None:
    """Serve ``app`` on newline-delimited JSON-RPC until stdin reaches EOF.

    Without explicit streams this uses the process's stdin and stdout (as duplicated file
    descriptors, with fd 1 redirected to stderr meanwhile). Streams passed in stay open.
    """
    async with AsyncExitStack() as stack:
        if stdin is None:
            stdin = trio.lowlevel.FdStream(os.dup(0))
            stack.push_async_callback(stdin.aclose)
        if stdout is None:
            stdout = trio.lowlevel.FdStream(_claim_stdout(stack))
            stack.push_async_callback(stdout.aclose)
        source, output = stdin, stdout

        async def send_text(text: str) -> None:
            try:
                await output.send_all(text.encode("utf-8") + b"\n")
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as error:
                raise PeerGone from error

        async def read(connection: MessageConnection) -> None:
            try:
                await _read_lines(source, connection, max_line_bytes)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as error:
                log.info("stdin failed (%s); shutting down", error)

        connection = MessageConnection(
            app, send_text, transport="stdio", principal=principal, grace_seconds=grace_seconds
        )
        await connection.run(read)


def _claim_stdout(stack: AsyncExitStack) -> int:
    """A private descriptor for the real stdout; fd 1 points at stderr until we return."""
    saved = os.dup(1)
    with suppress(ValueError, OSError):
        sys.stdout.flush()
    os.dup2(2, 1)

    def restore() -> None:
        with suppress(ValueError, OSError):
            sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)

    stack.callback(restore)
    return os.dup(saved)
