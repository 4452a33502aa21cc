"""The initialize-era half of the Streamable HTTP endpoint (2025-06-18, 2025-11-25).

:class:`~tritask.transports.http.HttpTransport` admits a request (path, Host, Origin,
Content-Type, Accept, body size, authentication) and decides its era; a legacy request comes
here. The rules (``mcp-legacy-2025.md`` §2.2, §2.3):

- ``initialize`` without ``Mcp-Session-Id`` opens a session and names it in that header;
  every later request must carry it (400 without, 404 for an unknown, ended or expired one, or
  one another principal opened).
- A POSTed notification or JSON-RPC *response* (the answer to a server-initiated request) is
  202. ``DELETE`` ends the session. ``GET`` opens its standalone SSE stream (one at a time:
  409), or resumes any of its streams with ``Last-Event-ID``.
- A request that may emit (``tools/call``, ``prompts/get``, ``resources/read``, anything not in
  ``_JSON_METHODS``) is answered with SSE, so progress, logs and server-initiated requests can
  precede its response; the rest with JSON.
- **The work does not belong to the connection.** It runs in the transport's nursery (when the
  transport is running, see :meth:`LegacyEndpoint.running`), writes to a resumable stream, and
  a lost connection only detaches the stream: the client cancels with
  ``notifications/cancelled``, and resumes with ``Last-Event-ID``. That is the opposite of
  2026-07-28, where closing the stream is the cancellation.
- 2025-11-25 streams start with a priming event (an id, empty data, the ``retry`` field), and a
  tool may close its own stream to be polled (``Context.close_stream``); 2025-06-18 has
  neither.

Without a running transport (an ASGI host that runs no lifespan), a request's work runs in the
request's own task instead, and idle sessions expire lazily.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, MutableMapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Final

import trio

from tritask.jsonrpc import (
    InternalError,
    InvalidRequest,
    JsonRpcError,
    JSONValue,
    MessageError,
    Notification,
    Request,
    RequestId,
    dumps,
    error_message,
    message_from_value,
    result_message,
)
from tritask.protocol.auth import AccessToken
from tritask.protocol.headers import HeaderView
from tritask.protocol.legacy import INITIALIZE, LEGACY_VERSIONS
from tritask.server.legacy import LegacyDispatcher
from tritask.transports._h11server import WATCH_EXTENSION
from tritask.transports._http_sessions import HttpSession, SessionsFull, SessionTable
from tritask.transports._sse_streams import KEEPALIVE, ResumableStream, Writer

if TYPE_CHECKING:
    from tritask.auth.bearer import BearerAuth
    from tritask.transports.http import HttpOptions

log = logging.getLogger("tritask.http")

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

SESSION_HEADER: Final = "mcp-session-id"
LAST_EVENT_ID_HEADER: Final = "last-event-id"
FINISHED_STREAMS: Final = 16
"""Finished request streams a session keeps for a late resumption (within its byte budget)."""
POLLING_VERSION: Final = "2025-11-25"
"""From this revision on: priming events, ``retry`` and server-closed streams (SEP-1699)."""
RETRY_AFTER_SECONDS: Final = 30

_JSON_METHODS: Final = frozenset(
    {
        INITIALIZE,  # inside a session: refused at once
        "ping",
        "logging/setLevel",
        "resources/subscribe",
        "resources/unsubscribe",
        "tools/list",
        "prompts/list",
        "resources/list",
        "resources/templates/list",
        "completion/complete",
        "tasks/get",
        "tasks/list",
        "tasks/cancel",
    }
)
"""Methods answered with plain JSON: they neither emit nor ask the client anything."""

_SSE_HEADERS: Final = (
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
)


def is_response(value: dict[str, JSONValue]) -> bool:
    """A JSON-RPC response (no method; a result or an error): the client answering us."""
    return "method" not in value and ("result" in value or "error" in value)


def _request_id(value: dict[str, JSONValue]) -> RequestId | None:
    raw = value.get("id")
    if isinstance(raw, bool) or not isinstance(raw, str | int):
        return None
    return raw


def _accepts_sse(values: Iterable[str]) -> bool:
    for value in values:
        for part in value.split(","):
            if part.split(";")[0].strip().lower() in ("text/event-stream", "text/*", "*/*"):
                return True
    return False


async def _respond(
    send: Send,
    status: int,
    body: bytes = b"",
    *,
    entry: HttpSession | None = None,
    content_type: bytes | None = None,
    extra: Iterable[tuple[bytes, bytes]] = (),
) -> None:
    headers: list[tuple[bytes, bytes]] = []
    if content_type is not None:
        headers.append((b"content-type", content_type))
    headers.append((b"content-length", b"%d" % len(body)))
    if entry is not None:
        headers.append((SESSION_HEADER.encode("ascii"), entry.id.encode("ascii")))
    headers.extend(extra)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _json(
    send: Send,
    status: int,
    message: dict[str, JSONValue],
    *,
    entry: HttpSession | None = None,
    extra: Iterable[tuple[bytes, bytes]] = (),
) -> None:
    body = dumps(message).encode("utf-8")
    await _respond(send, status, body, entry=entry, content_type=b"application/json", extra=extra)


async def _refuse(
    send: Send,
    status: int,
    message: str,
    request_id: RequestId | None = None,
    *,
    entry: HttpSession | None = None,
    extra: Iterable[tuple[bytes, bytes]] = (),
) -> None:
    await _json(
        send, status, error_message(request_id, InvalidRequest(message)), entry=entry, extra=extra
    )


async def _unknown_session(send: Send, request_id: RequestId | None = None) -> None:
    await _refuse(
        send,
        404,
        "Session not found: it ended, expired or was never opened here; send initialize again",
        request_id,
    )


async def _watch_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


class LegacyEndpoint:
    """Legacy sessions over Streamable HTTP for one ``App``: POST, GET and DELETE."""

    def __init__(
        self, dispatcher: LegacyDispatcher, options: HttpOptions, auth: BearerAuth | None = None
    ) -> None:
        self.app = dispatcher.app
        self.dispatcher = dispatcher
        self.auth = auth
        self.options = options
        self.auth = auth
        self.table = SessionTable(
            options.max_sessions,
            options.session_idle_seconds,
            (options.sse_replay_bytes, options.sse_replay_events, FINISHED_STREAMS),
        )
        self._nursery: trio.Nursery | None = None
        self._closing = False

    # -- lifetime ------------------------------------------------------------------------

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Host the sessions' work and the idle sweeper; end every session on the way out.

        Re-entrant: ``serve_http`` and the ASGI lifespan may both ask, the first one wins.
        """
        if self._nursery is not None:
            yield
            return
        async with trio.open_nursery() as nursery:
            await nursery.start(self.table.run_sweeper)
            self._nursery = nursery
            self._closing = False
            try:
                yield
            finally:
                self._nursery = None
                self.table.end_all()
                nursery.cancel_scope.cancel()

    def begin_shutdown(self) -> None:
        """The server is stopping: standalone streams end (requests may still finish)."""
        self._closing = True
        for entry in self.table.sessions():
            standalone = entry.standalone_stream()
            if standalone is not None:
                standalone.end()

    @asynccontextmanager
    async def _host(self, *, wait: bool) -> AsyncIterator[trio.Nursery]:
        """Where a session's work runs: the transport's nursery, or else the request's own.

        In the request's own nursery, ``wait`` says whether the request waits for the work
        (a call's handler) or stops it when its response ends (a forwarder).
        """
        if self._nursery is not None:
            yield self._nursery
            return
        async with trio.open_nursery() as local:
            yield local
            if not wait:
                local.cancel_scope.cancel()

    # -- POST ----------------------------------------------------------------------------

    async def post(
        self,
        value: dict[str, JSONValue],
        headers: HeaderView,
        principal: Any,
        scope: MutableMapping[str, Any],
        receive: Receive,
        send: Send,
        *,
        auth: AccessToken | None = None,
    ) -> None:
        session_id = headers.get(SESSION_HEADER)
        if session_id is None:
            if value.get("method") == INITIALIZE and "id" in value:
                await self._initialize(value, principal, send)
                return
            await _refuse(
                send,
                400,
                "Bad Request: the Mcp-Session-Id header is required (send initialize first)",
                _request_id(value),
            )
            return
        entry = self.table.get(session_id, principal)
        if entry is None:
            await _unknown_session(send, _request_id(value))
            return
        if is_response(value):
            if not entry.session.resolve(value):
                log.debug("session %s: no request of ours has id %r", entry.id[:8], value.get("id"))
            await _respond(send, 202, entry=entry)
            return
        try:
            message = message_from_value(value)
        except MessageError as error:
            await _json(send, 400, error_message(error.request_id, error), entry=entry)
            return
        if isinstance(message, Notification):
            self.dispatcher.handle_notification(message, entry.session)
            await _respond(send, 202, entry=entry)
            return
        await self._request(message, entry, scope, receive, send, auth)

    async def _initialize(self, value: dict[str, JSONValue], principal: Any, send: Send) -> None:
        try:
            request = message_from_value(value)
        except MessageError as error:
            await _json(send, 400, error_message(error.request_id, error))
            return
        assert isinstance(request, Request)
        try:
            session, result = self.dispatcher.initialize(request.params, principal=principal)
        except JsonRpcError as error:
            await _json(send, 400, error_message(request.id, error))
            return
        try:
            entry = self.table.add(session)
        except SessionsFull:
            log.warning("refusing a legacy session: %d are open", len(self.table))
            await _refuse(
                send,
                503,
                f"Too many sessions: this server holds at most {self.options.max_sessions}; "
                f"retry in {RETRY_AFTER_SECONDS} s (MCP 2026-07-28 clients need no session)",
                request.id,
                extra=[(b"retry-after", b"%d" % RETRY_AFTER_SECONDS)],
            )
            return
        log.debug("session %s opened at %s", entry.id[:8], session.protocol_version)
        await _json(send, 200, result_message(request.id, result), entry=entry)

    async def _request(
        self,
        request: Request,
        entry: HttpSession,
        scope: MutableMapping[str, Any],
        receive: Receive,
        send: Send,
        auth: AccessToken | None = None,
    ) -> None:
        if auth is not None and await self._forbidden(request, auth, entry, send):
            return
        if entry.request_running(request.id):
            await _refuse(
                send,
                400,
                "Invalid request: this id is already in use by a running request",
                request.id,
                entry=entry,
            )
            return
        limit = self.options.max_session_requests
        if entry.in_flight >= limit:
            await _refuse(
                send,
                429,
                f"Too many requests in flight in this session (at most {limit})",
                request.id,
                entry=entry,
                extra=[(b"retry-after", b"1")],
            )
            return
        legacy = self.dispatcher
        if request.method in _JSON_METHODS:
            entry.start_request(request.id)
            try:
                response = await legacy.handle_request(
                    request, entry.session, transport="http", auth=auth
                )
            finally:
                entry.end_request(request.id)
            if response is None:  # cancelled by the client: no answer will come
                await _respond(send, 202, entry=entry)
            else:
                await _json(send, 200, response, entry=entry)
            return
        stream = entry.open_stream()
        polling = entry.session.protocol_version >= POLLING_VERSION
        # The priming id comes before any event of the work, so resuming from it loses none.
        prelude = stream.priming(self.options.sse_retry_ms) if polling else b""
        writer = stream.attach(0)
        entry.start_request(request.id)
        async with self._host(wait=True) as host:
            host.start_soon(self._work, entry, request, stream, polling, auth)
            await self._serve(entry, stream, writer, prelude, False, scope, receive, send)

    async def _forbidden(
        self, request: Request, auth: AccessToken, entry: HttpSession, send: Send
    ) -> bool:
        """A ``tools/call`` whose token lacks the tool's scopes: 403 before any stream opens."""
        if request.method != "tools/call" or self.auth is None:
            return False
        name = (request.params or {}).get("name")
        tool = self.app.tools.get(name) if isinstance(name, str) else None
        if tool is None:
            return False
        refusal = self.auth.insufficient(auth, tool.required_scopes)
        if refusal is None:
            return False
        rendered = self.auth.refusal_response(refusal, (), request.id)
        headers = [*rendered.headers, (SESSION_HEADER.encode("ascii"), entry.id.encode("ascii"))]
        await send({"type": "http.response.start", "status": rendered.status, "headers": headers})
        await send({"type": "http.response.body", "body": rendered.body})
        return True

    async def _work(
        self,
        entry: HttpSession,
        request: Request,
        stream: ResumableStream,
        polling: bool,
        auth: AccessToken | None = None,
    ) -> None:
        """Run one request for the session; its response ends the stream."""
        response: dict[str, JSONValue] | None = None
        try:
            with trio.CancelScope() as scope:
                entry.add_scope(scope)
                try:
                    response = await self.dispatcher.handle_request(
                        request,
                        entry.session,
                        transport="http",
                        emit=stream.emit,
                        close_stream=stream.close_connection if polling else None,
                        auth=auth,
                    )
                finally:
                    entry.remove_scope(scope)
        except Exception:
            log.exception("legacy request %r (%s) failed", request.id, request.method)
            response = error_message(request.id, InternalError())
        finally:
            entry.end_request(request.id)
            stream.finish(response)

    # -- GET and DELETE ------------------------------------------------------------------

    async def _session_for(
        self, headers: HeaderView, principal: Any, send: Send
    ) -> HttpSession | None:
        """The session a GET or DELETE names (its header is present), or an answer sent."""
        entry = self.table.get(headers.get(SESSION_HEADER) or "", principal)
        if entry is None:
            await _unknown_session(send)
            return None
        version = headers.get("mcp-protocol-version")
        if version is not None and version not in LEGACY_VERSIONS:
            await _refuse(
                send,
                400,
                f"Bad Request: unsupported MCP-Protocol-Version {version!r} for this session "
                f"(it negotiated {entry.session.protocol_version})",
                entry=entry,
            )
            return None
        return entry

    async def get(
        self,
        headers: HeaderView,
        principal: Any,
        scope: MutableMapping[str, Any],
        receive: Receive,
        send: Send,
    ) -> None:
        if not _accepts_sse(headers.get_all("accept")):
            await _refuse(send, 406, "Not Acceptable: a GET stream needs Accept: text/event-stream")
            return
        entry = await self._session_for(headers, principal, send)
        if entry is None:
            return
        if self._closing:
            await _refuse(send, 503, "The server is shutting down", entry=entry)
            return
        polling = entry.session.protocol_version >= POLLING_VERSION
        last_event_id = headers.get(LAST_EVENT_ID_HEADER)
        if last_event_id is not None:
            found = entry.log.find(last_event_id)
            if found is None:
                await _refuse(
                    send,
                    400,
                    f"Bad Request: Last-Event-ID {last_event_id!r} names no stream this "
                    "session still holds",
                    entry=entry,
                )
                return
            stream, after = found
            # A resumption takes the stream over from a connection that may linger.
            writer = stream.attach(after)
            await self._stream_with_forwarder(
                entry, stream, writer, b"", polling, scope, receive, send
            )
            return
        stream = entry.log.standalone()
        if stream.writer is not None:
            await _refuse(
                send,
                409,
                "Conflict: this session's standalone SSE stream is already open",
                entry=entry,
            )
            return
        prelude = stream.priming(self.options.sse_retry_ms) if polling else b""
        writer = stream.attach(stream.last_event)
        await self._stream_with_forwarder(
            entry, stream, writer, prelude, False, scope, receive, send
        )

    async def _stream_with_forwarder(
        self,
        entry: HttpSession,
        stream: ResumableStream,
        writer: Writer,
        prelude: bytes,
        reprime: bool,
        scope: MutableMapping[str, Any],
        receive: Receive,
        send: Send,
    ) -> None:
        if stream is not entry.standalone_stream() or entry.forwarding:
            await self._serve(entry, stream, writer, prelude, reprime, scope, receive, send)
            return
        async with self._host(wait=False) as host:
            entry.forwarding = True
            # Subscribed before the response starts: nothing published after it is missed.
            await host.start(self._forward, entry, stream)
            await self._serve(entry, stream, writer, prelude, reprime, scope, receive, send)

    async def _forward(
        self,
        entry: HttpSession,
        stream: ResumableStream,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """List changes and subscribed updates onto the standalone stream, for the session."""
        try:
            with trio.CancelScope() as scope:
                entry.add_scope(scope)
                try:
                    await self.dispatcher.run_standalone(
                        entry.session, stream.emit, task_status=task_status
                    )
                finally:
                    entry.remove_scope(scope)
        finally:
            entry.forwarding = False
        if self.app.hub.closed:
            stream.end()
        else:  # fell behind: let the client reconnect, which starts a new forwarder
            stream.close_connection()

    async def delete(self, headers: HeaderView, principal: Any, send: Send) -> None:
        entry = await self._session_for(headers, principal, send)
        if entry is None:
            return
        self.table.end(entry)
        log.debug("session %s ended by the client", entry.id[:8])
        await _respond(send, 200)

    # -- writing a stream out ------------------------------------------------------------

    async def _serve(
        self,
        entry: HttpSession,
        stream: ResumableStream,
        writer: Writer,
        prelude: bytes,
        reprime: bool,
        scope: MutableMapping[str, Any],
        receive: Receive,
        send: Send,
    ) -> None:
        """Write ``stream`` out on this response until it is over, displaced or the peer goes.

        Only this task writes the response (keep-alives included), so no lock is needed. A
        lost peer cancels the writing, never the work.
        """
        entry.attached += 1
        try:
            headers = [*_SSE_HEADERS, (SESSION_HEADER.encode("ascii"), entry.id.encode("ascii"))]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            # The priming event, or nothing: either way the headers go out now (a 2025-06-18
            # stream may have nothing to say for a long time).
            await send({"type": "http.response.body", "body": prelude, "more_body": True})
            with trio.CancelScope() as writing:
                extensions = scope.get("extensions")
                if extensions is not None and WATCH_EXTENSION in extensions:
                    await send(
                        {
                            "type": WATCH_EXTENSION,
                            "cancel_scope": writing,
                            "interval": 0.0,
                            "tick": None,
                        }
                    )
                    await self._pump(entry, stream, writer, reprime, send)
                else:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(_watch_disconnect, receive, writing)
                        await self._pump(entry, stream, writer, reprime, send)
                        nursery.cancel_scope.cancel()
            if not writing.cancelled_caught:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            stream.detach(writer)
            entry.attached -= 1
            self.table.touch(entry)

    async def _pump(
        self,
        entry: HttpSession,
        stream: ResumableStream,
        writer: Writer,
        reprime: bool,
        send: Send,
    ) -> None:
        keepalive = self.options.keepalive_seconds
        while True:
            batch = stream.pending(writer)
            if batch:
                for number, data in batch:
                    if stream.writer is not writer:
                        return
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                    stream.written(writer, number)
                continue
            if reprime:
                # A resumed stream is primed once the replay is written (nothing pending, and
                # nothing awaited since looking), so resuming from its id skips nothing.
                reprime = False
                data = stream.priming(self.options.sse_retry_ms)
                await send({"type": "http.response.body", "body": data, "more_body": True})
                continue
            if stream.done_for(writer):
                return
            if keepalive > 0:
                with trio.move_on_after(keepalive) as timer:
                    await stream.wait()
                if timer.cancelled_caught:
                    await send({"type": "http.response.body", "body": KEEPALIVE, "more_body": True})
            else:
                await stream.wait()
