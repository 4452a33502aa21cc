"""Streamable HTTP (2026-07-28) as a plain ASGI application, plus the servers that run it.

One POST endpoint. A request is answered with JSON, or with an SSE stream scoped to that one
request as soon as it has something to stream (progress, logs, a listen acknowledgement, or a
keep-alive on a long call). Closing the response cancels the request.

The same endpoint serves the initialize-era revisions (2025-06-18, 2025-11-25). Every request
is admitted here first (Host, Origin, Content-Type, Accept, body size, authentication); then a
POST without the modern ``_meta`` envelope whose ``MCP-Protocol-Version`` is absent or legacy,
and a GET or DELETE naming an ``Mcp-Session-Id``, go to the session machinery of
:mod:`tritask.transports._http_legacy`. Everything else is 2026-07-28 and meets the ladder
below exactly as if no other era existed (a GET or DELETE without a session is 405).

How the disconnect and the keep-alives are noticed depends on the server. Under tritask's own
server (:mod:`tritask.transports._h11server`, the default of :func:`serve_http`) the scope
advertises the ``tritask.request_watch`` extension: the exchange hands the server its cancel
scope and a keep-alive ``tick``, the server's reading task cancels the scope when the peer goes
away and calls ``tick`` every ``keepalive_seconds``, and the handler runs without any task of
its own. Under any other ASGI server (hypercorn, or mounted in another app) a sibling task
watches ``receive()`` for ``http.disconnect`` and another sends the keep-alives, as ``send()``
does not raise after a disconnect there.

A stream that lasts hours (``subscriptions/listen``) is handed off. When the server also
offers ``tritask.response_handoff``, the exchange passes the dispatcher a ``hand_off`` that
takes the handler's stream (``Context.hand_off``); once the handler has returned, the exchange
gives the server a :class:`_StreamTail` (the stream, the request id, the response already
framed) and returns, so the request, its headers, the scope and every frame down to the
handler are released, and the server's connection task delivers the stream and notices the
client going away. Elsewhere the handler delivers the stream in the request as before.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any, Final, Literal

import attrs
import trio

from tritask.auth.bearer import BearerAuth, Refusal
from tritask.jsonrpc import (
    InternalError,
    InvalidRequest,
    JSONValue,
    MessageError,
    Notification,
    Request,
    RequestId,
    dumps,
    error_message,
    load_message,
    loads,
    message_from_value,
)
from tritask.protocol.auth import AccessToken, InsufficientScope
from tritask.protocol.errors import HeaderMismatch, http_response_status
from tritask.protocol.headers import (
    METHOD_HEADER,
    NAME_HEADER,
    PROTOCOL_VERSION_HEADER,
    HeaderView,
    check_protocol_version_present,
)
from tritask.protocol.legacy import is_legacy_request
from tritask.server.app import App
from tritask.server.dispatcher import Dispatcher
from tritask.server.legacy import LegacyDispatcher
from tritask.server.listen import PushStream
from tritask.transports._h11server import HANDOFF_EXTENSION, WATCH_EXTENSION, ServerConfig
from tritask.transports._h11server import serve as serve_h11
from tritask.transports._http_legacy import SESSION_HEADER, LegacyEndpoint

log = logging.getLogger("tritask.http")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Authenticate = Callable[[HeaderView], Awaitable[Any]]

DEFAULT_MAX_BODY: Final = 4 * 1024 * 1024
LOOPBACK_HOSTS: Final[tuple[str, ...]] = ("127.0.0.1", "localhost", "[::1]", "::1")
_VERDICTS_KEPT: Final = 64


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
    """A custom scheme: map the headers to a principal or raise ``Unauthenticated`` (401)."""
    auth: BearerAuth | None = None
    """OAuth 2.1 bearer tokens (``tritask.auth.BearerAuth``); ``App(auth=...)`` also sets it."""
    # -- initialize-era (2025) sessions; 2026-07-28 needs none of these --
    max_sessions: int = 10_000
    """Legacy sessions held at once; past it a new ``initialize`` gets 503 and Retry-After."""
    session_idle_seconds: float = 1800.0
    """A legacy session unused this long (no request, no open stream) ends: then 404."""
    max_session_requests: int = 64
    """Requests one legacy session may have in flight; past it 429."""
    sse_retry_ms: int = 1000
    """The ``retry`` a 2025-11-25 stream announces: how long a client waits to reconnect."""
    sse_replay_bytes: int = 256 * 1024
    """Per legacy session, bytes of SSE events kept for ``Last-Event-ID`` replay."""
    sse_replay_events: int = 256
    """Per stream, events kept for replay (and how far behind a connection may fall)."""


def _header_view(pairs: Iterable[tuple[bytes, bytes]]) -> HeaderView:
    """``HeaderView.from_pairs`` for ASGI's byte pairs, in one pass without intermediate lists."""
    collected: dict[str, tuple[str, ...]] = {}
    for raw_name, raw_value in pairs:
        name = raw_name.decode("latin-1").lower()
        value = raw_value.decode("latin-1")
        seen = collected.get(name)
        collected[name] = (value,) if seen is None else (*seen, value)
    return HeaderView(collected)


class HttpTransport:
    """The ASGI application serving one ``App`` over Streamable HTTP."""

    def __init__(self, app: App, options: HttpOptions | None = None, **overrides: Any) -> None:
        self.app = app
        base = options or HttpOptions()
        self.options = attrs.evolve(base, **overrides) if overrides else base
        self._allowed_hosts: tuple[tuple[str, ...] | None, frozenset[str]] = (None, frozenset())
        # Verdicts on the few Host and Accept values a deployment sees (every request sends
        # one), computed once each; bounded, so varied values cost the computation, not memory.
        self._host_verdicts: dict[str, bool] = {}
        self._accept_verdicts: dict[tuple[str, ...], bool] = {}
        auth = self.options.auth if self.options.auth is not None else app.auth
        if auth is not None and not isinstance(auth, BearerAuth):
            raise TypeError("auth must be a tritask.auth.BearerAuth")
        if auth is not None and self.options.authenticate is not None:
            raise ValueError("configure either authenticate= or auth=, not both")
        self.auth: BearerAuth | None = auth
        self._metadata_paths = (
            auth.metadata_paths(self.options.path) if auth is not None else frozenset()
        )
        self.dispatcher = Dispatcher(app)
        """Routes this endpoint's 2026-07-28 requests (and, wrapped, its legacy sessions')."""
        self.legacy = LegacyEndpoint(LegacyDispatcher(self.dispatcher), self.options, auth)
        """The initialize-era sessions (``Mcp-Session-Id``) this endpoint holds."""

    def running(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Host what outlives a request (legacy sessions' work, the idle sweeper).

        ``serve_http`` enters it, and so does the ASGI lifespan; without it legacy requests
        still work, in their own tasks.
        """
        return self.legacy.running()

    def begin_shutdown(self) -> None:
        """Stop the streams that would never end by themselves (standalone GET streams)."""
        self.legacy.begin_shutdown()

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
        async with contextlib.AsyncExitStack() as stack:
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await stack.enter_async_context(self.running())
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    self.begin_shutdown()
                    await stack.aclose()
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
        cached, lowered = self._allowed_hosts
        if cached is not allowed:
            lowered = frozenset(h.lower() for h in allowed)
            self._allowed_hosts = (allowed, lowered)
            self._host_verdicts = {}
        verdicts = self._host_verdicts
        verdict = verdicts.get(host)
        if verdict is None:
            verdict = _host_only(host) in lowered
            if len(verdicts) < _VERDICTS_KEPT:
                verdicts[host] = verdict
        return verdict

    def _accepted(self, headers: HeaderView) -> bool:
        """``Accept`` lists both JSON and SSE (``_accepts_both``), remembered per value."""
        values = headers.get_all("accept")
        verdicts = self._accept_verdicts
        verdict = verdicts.get(values)
        if verdict is None:
            verdict = _accepts_both(values)
            if len(verdicts) < _VERDICTS_KEPT:
                verdicts[values] = verdict
        return verdict

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

    async def _authenticate(
        self, headers: HeaderView, scope: Scope, send: Send, body: bytes | None = None
    ) -> tuple[bool, Any, AccessToken | None]:
        """``(True, principal, token)``, or ``(False, None, None)`` once a refusal was sent."""
        if self.auth is not None:
            try:
                token = await self.auth.authenticate(
                    headers.get_all("authorization"), scope.get("query_string") or b""
                )
            except Refusal as refusal:
                if refusal.kind == "unavailable":
                    log.warning("refused a request: %s", refusal.description)
                await self._refuse(send, refusal, headers, body)
                return False, None, None
            return True, self.auth.principal(token), token
        if self.options.authenticate is None:
            return True, None, None
        try:
            return True, await self.options.authenticate(headers), None
        except Unauthenticated:
            await _error(send, 401, error_message(None, InvalidRequest("Unauthenticated")))
            return False, None, None

    async def _refuse(
        self, send: Send, refusal: Refusal, headers: HeaderView, body: bytes | None
    ) -> None:
        assert self.auth is not None
        scopes, request_id = self._refusal_hint(headers, body)
        rendered = self.auth.refusal_response(refusal, scopes, request_id)
        await send(
            {"type": "http.response.start", "status": rendered.status, "headers": rendered.headers}
        )
        await send({"type": "http.response.body", "body": rendered.body})

    def _refusal_hint(
        self, headers: HeaderView, body: bytes | None
    ) -> tuple[frozenset[str], RequestId | None]:
        """The scopes of the tool a refused request calls (so one challenge names them all),
        and the request id for the error body.

        The tool from ``Mcp-Method``/``Mcp-Name`` when present, else from the body, which is
        parsed leniently on this refusal path only.
        """
        value: Any = None
        if body:
            try:
                value = loads(body)
            except (ValueError, UnicodeDecodeError, RecursionError):
                value = None
        request_id: RequestId | None = None
        name: object = None
        if isinstance(value, dict):
            raw_id = value.get("id")
            if isinstance(raw_id, str | int) and not isinstance(raw_id, bool):
                request_id = raw_id
            if value.get("method") == "tools/call":
                params = value.get("params")
                name = params.get("name") if isinstance(params, dict) else None
        if headers.get(METHOD_HEADER) == "tools/call" and headers.get(NAME_HEADER) is not None:
            name = headers.get(NAME_HEADER)
        tool = self.app.tools.get(name) if isinstance(name, str) else None
        return (tool.required_scopes if tool is not None else frozenset()), request_id

    async def _metadata(self, scope: Scope, send: Send) -> None:
        """The RFC 9728 Protected Resource Metadata: GET/HEAD, CORS for any origin."""
        assert self.auth is not None
        method = scope.get("method", "GET").upper()
        cors = [
            (b"access-control-allow-origin", b"*"),
            (b"access-control-allow-methods", b"GET, HEAD, OPTIONS"),
            (b"access-control-allow-headers", b"mcp-protocol-version, authorization"),
            (b"access-control-max-age", b"86400"),
        ]
        if method == "OPTIONS":
            await send(
                {
                    "type": "http.response.start",
                    "status": 204,
                    "headers": [*cors, (b"content-length", b"0")],
                }
            )
            await send({"type": "http.response.body", "body": b""})
            return
        if method not in ("GET", "HEAD"):
            await _plain(send, 405, b"Method Not Allowed", [(b"allow", b"GET, HEAD, OPTIONS")])
            return
        body = dumps(self.auth.metadata()).encode("utf-8")
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
            (b"cache-control", b"public, max-age=300"),
            *cors,
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if method == "HEAD" else body})

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = _header_view(scope.get("headers") or ())
        path = scope.get("path", "")
        if self._metadata_paths and path in self._metadata_paths:
            # Public and built from configuration alone: served before Host/Origin checks.
            await self._metadata(scope, send)
            return
        if path.rstrip("/") != self.options.path.rstrip("/"):
            await _plain(send, 404, b"Not Found")
            return
        # Host and Origin first: nothing (a legacy session least of all) exists for a
        # request from a page that may not talk to this server.
        if not self._host_allowed(headers):
            await _error(send, 403, error_message(None, InvalidRequest("Host is not allowed")))
            return
        if not self._origin_allowed(headers):
            await _error(send, 403, error_message(None, InvalidRequest("Origin is not allowed")))
            return
        method = scope.get("method", "GET").upper()
        if method != "POST":
            if method in ("GET", "DELETE") and headers.get(SESSION_HEADER) is not None:
                admitted, principal, _ = await self._authenticate(headers, scope, send)
                if not admitted:
                    return
                if method == "GET":
                    await self.legacy.get(headers, principal, scope, receive, send)
                else:
                    await self.legacy.delete(headers, principal, send)
                return
            await _plain(send, 405, b"Method Not Allowed", [(b"allow", b"POST")])
            return
        content_type = (headers.get("content-type") or "").split(";")[0].strip().lower()
        if content_type != "application/json":
            await _error(
                send,
                415,
                error_message(None, InvalidRequest("Content-Type must be application/json")),
            )
            return
        if not self._accepted(headers):
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
        admitted, principal, token = await self._authenticate(headers, scope, send, body)
        if not admitted:
            return
        try:
            value = load_message(body)
            if isinstance(value, dict):
                params = value.get("params")
                if is_legacy_request(
                    params if isinstance(params, dict) else None,
                    headers.get(PROTOCOL_VERSION_HEADER),
                ):
                    await self.legacy.post(
                        value, headers, principal, scope, receive, send, auth=token
                    )
                    return
            message = message_from_value(value)
        except MessageError as error:
            await _error(send, 400, error_message(error.request_id, error))
            return
        if isinstance(message, Notification):
            await self._notification(message, headers, send)
            return
        extensions = scope.get("extensions") or {}
        watched = WATCH_EXTENSION in extensions
        handoff = watched and HANDOFF_EXTENSION in extensions
        await _Exchange(self, send, receive, self.options.keepalive_seconds, watched, handoff).run(
            message, headers, principal, token
        )

    async def _read_body(self, headers: HeaderView, receive: Receive, send: Send) -> bytes | None:
        limit = self.options.max_body_bytes
        declared = headers.get("content-length")

        def too_large() -> dict[str, JSONValue]:  # (built only for a refusal)
            return error_message(None, InvalidRequest(f"Body exceeds {limit} bytes"))

        if declared is not None:
            try:
                if int(declared) > limit:
                    await _error(send, 413, too_large())
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
                await _error(send, 413, too_large())
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
        await send(
            {"type": "http.response.start", "status": 202, "headers": [(b"content-length", b"0")]}
        )
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
    response_headers = [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", b"%d" % len(body)),
        *(extra or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": response_headers})
    await send({"type": "http.response.body", "body": body})


async def _error(send: Send, status: int, message: dict[str, JSONValue]) -> None:
    await _json(send, status, message)


async def _json(
    send: Send, status: int, message: dict[str, JSONValue], retry_after: int | None = None
) -> None:
    body = dumps(message).encode("utf-8")
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
    ]
    if retry_after is not None:
        headers.append((b"retry-after", b"%d" % retry_after))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _status_of(response: dict[str, JSONValue]) -> tuple[int, int | None]:
    """The HTTP status of a response (and its ``Retry-After``, for a retryable refusal)."""
    error = response.get("error")
    if error is None:
        return 200, None
    return http_response_status(error)


_KEEPALIVE: Final = b": keep-alive\n\n"
_KEEPALIVE_COMMENT: Final[Message] = {
    "type": "http.response.body",
    "body": _KEEPALIVE,
    "more_body": True,
}


def _sse_event(message: dict[str, JSONValue]) -> bytes:
    return b"event: message\ndata: " + dumps(message).encode("utf-8") + b"\n\n"


class _StreamTail:
    """A handed-off stream (``Context.hand_off``) as the rest of its SSE response, for the
    server to drive (``tritask.response_handoff``): the stream's notifications, then the
    request's response as the last event.

    It holds the stream, the request id and the response already framed: the exchange, the
    request, its headers and the ASGI scope are gone while it lives.
    """

    __slots__ = ("_final", "_request_id", "_stream")

    def __init__(self, stream: PushStream, request_id: RequestId, final: bytes) -> None:
        self._stream = stream
        self._request_id = request_id
        self._final = final

    @property
    def ready(self) -> bool:
        return self._stream.ready

    def set_waker(self, wake: Callable[[], None] | None) -> None:
        self._stream.set_waker(wake)

    async def next_chunk(self) -> tuple[bytes, bool]:
        stream = self._stream
        try:
            message = await stream.next_message()
        except Exception:
            # As Dispatcher.handle_request answers a handler that raised.
            log.exception("stream of request %r failed", self._request_id)
            stream.close()
            return _sse_event(
                error_message(self._request_id, InternalError("Internal error"))
            ), False
        if message is not None:
            return _sse_event(message), True
        if stream.ended:
            return self._final, False
        return b"", True

    def close(self) -> None:
        self._stream.close()


@attrs.define(eq=False)
class _Exchange:
    """One request/response exchange: JSON unless something needs streaming first.

    Every write once something may write concurrently (an ``emit`` from the handler, a
    keep-alive) goes through ``_lock``; it is created by the first such write, so a call
    answered with plain JSON never builds one.
    """

    transport: HttpTransport
    send: Send
    receive: Receive
    keepalive: float
    watched: bool = False
    """The server offers ``tritask.request_watch``: no watcher or keep-alive tasks needed."""
    handoff: bool = False
    """The server offers ``tritask.response_handoff``: a long-lived stream the handler hands
    off (``Context.hand_off``) is driven by the server once this exchange has returned."""
    _streaming: bool = False
    _closed: bool = False
    _lock: trio.Lock | None = None
    _refused: InsufficientScope | None = None
    _handed: PushStream | None = None

    def _take(self, stream: PushStream) -> bool:
        """``Context.hand_off``: keep ``stream`` to hand to the server after the handler."""
        if self._handed is not None or self._closed:
            return False
        self._handed = stream
        return True

    def _writer_lock(self) -> trio.Lock:
        if self._lock is None:
            self._lock = trio.Lock()
        return self._lock

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
        async with self._writer_lock():
            if self._closed:
                return
            await self._start_stream()
            await self.send(
                {"type": "http.response.body", "body": _sse_event(message), "more_body": True}
            )

    async def _tick(self) -> None:
        """One keep-alive comment (starting the stream if need be), unless already closed."""
        async with self._writer_lock():
            if self._closed:
                return
            await self._start_stream()
            await self.send(dict(_KEEPALIVE_COMMENT))

    async def _keepalive(self) -> None:
        while not self._closed:
            await trio.sleep(self.keepalive)
            await self._tick()

    async def _watch_disconnect(self, scope: trio.CancelScope) -> None:
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self._closed = True
                scope.cancel()
                return

    async def _handle(
        self,
        request: Any,
        headers: HeaderView,
        principal: Any,
        token: AccessToken | None,
        scope: trio.CancelScope,
    ) -> dict[str, JSONValue] | None:
        response: dict[str, JSONValue] | None = None
        with scope:
            try:
                response = await self.transport.dispatcher.handle_request(
                    request,
                    headers=headers,
                    principal=principal,
                    transport="http",
                    emit=self.emit,
                    cancel_scope=scope,
                    auth=token,
                    hand_off=self._take if self.handoff else None,
                )
            except InsufficientScope as error:
                # A real 403 so the client can step up; inside a started stream it can only
                # be the JSON-RPC error.
                self._refused = error
                response = error_message(request.id, error)
        return response

    async def run(
        self, request: Any, headers: HeaderView, principal: Any, token: AccessToken | None = None
    ) -> None:
        handler_scope = trio.CancelScope()
        if self.watched:
            # The server cancels the scope when the peer goes away and calls _tick from its
            # own reading task: the handler runs right here, with no task beside it.
            await self.send(
                {
                    "type": WATCH_EXTENSION,
                    "cancel_scope": handler_scope,
                    "interval": self.keepalive,
                    "tick": self._tick if self.keepalive > 0 else None,
                }
            )
            response = await self._handle(request, headers, principal, token, handler_scope)
        else:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_disconnect, handler_scope)
                if self.keepalive > 0:
                    nursery.start_soon(self._keepalive)
                response = await self._handle(request, headers, principal, token, handler_scope)
                nursery.cancel_scope.cancel()
        handed, self._handed = self._handed, None
        if handed is not None:
            try:
                if response is not None and not self._closed and self._refused is None:
                    await self._hand_over(handed, request.id, response)
                    handed = None  # the server owns it now, and closes it
            finally:
                if handed is not None:
                    handed.close()
            return
        if response is None or self._closed:
            return
        if self._lock is None:
            # Nothing has written yet, and nothing can start writing once _closed is set.
            self._closed = True
            if self._refused is not None:
                await self._forbid(request, self._refused)
            else:
                status, retry_after = _status_of(response)
                await _json(self.send, status, response, retry_after)
            return
        async with self._lock:
            self._closed = True
            if self._streaming:
                await self.send(
                    {"type": "http.response.body", "body": _sse_event(response), "more_body": False}
                )
            elif self._refused is not None:
                await self._forbid(request, self._refused)
            else:
                status, retry_after = _status_of(response)
                await _json(self.send, status, response, retry_after)

    async def _hand_over(
        self, stream: PushStream, request_id: RequestId, response: dict[str, JSONValue]
    ) -> None:
        """Give the server the rest of the response; this exchange writes nothing after it
        (a keep-alive tick already waiting for the lock finds it closed)."""
        async with self._writer_lock():
            self._closed = True
            await self._start_stream()
            await self.send(
                {
                    "type": HANDOFF_EXTENSION,
                    "source": _StreamTail(stream, request_id, _sse_event(response)),
                    "interval": self.keepalive,
                    "keepalive": _KEEPALIVE,
                }
            )

    async def _forbid(self, request: Request, error: InsufficientScope) -> None:
        auth = self.transport.auth
        assert auth is not None
        refusal = Refusal("insufficient_scope", error.description, error.scopes)
        rendered = auth.refusal_response(refusal, (), request.id)
        await self.send(
            {"type": "http.response.start", "status": rendered.status, "headers": rendered.headers}
        )
        await self.send({"type": "http.response.body", "body": rendered.body})


Server = Literal["tritask", "hypercorn"]


async def serve_http(
    app: App,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    options: HttpOptions | None = None,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    server: Server = "tritask",
    server_config: ServerConfig | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` over Streamable HTTP; reports the bound URLs via ``task_status``.

    ``server="tritask"`` (the default) is the lean HTTP/1.1 server on trio and h11
    (:mod:`tritask.transports._h11server`, tuned by ``server_config``); ``"hypercorn"`` runs
    the same ASGI application on hypercorn's trio worker (for HTTP/2 or TLS, configure
    hypercorn yourself with :class:`HttpTransport`). Both close idle keep-alive connections
    after 75 s and give in-flight requests 5 s after ``shutdown_trigger`` returns.
    """
    if server not in ("tritask", "hypercorn"):
        raise ValueError(f"unknown HTTP server {server!r}: 'tritask' or 'hypercorn'")
    if server == "hypercorn" and server_config is not None:
        raise ValueError("server_config applies to the tritask server only")
    transport = HttpTransport(app, options)

    async def shutdown_then_end_streams() -> None:
        assert shutdown_trigger is not None
        await shutdown_trigger()
        transport.begin_shutdown()

    trigger = shutdown_then_end_streams if shutdown_trigger is not None else None
    async with transport.running():
        if server == "tritask":
            await serve_h11(
                transport,
                host,
                port,
                config=server_config,
                shutdown_trigger=trigger,
                task_status=task_status,
            )
        else:
            await _serve_hypercorn(transport, host, port, trigger, task_status)


async def _serve_hypercorn(
    transport: HttpTransport,
    host: str,
    port: int,
    shutdown_trigger: Callable[[], Awaitable[None]] | None,
    task_status: trio.TaskStatus[list[str]],
) -> None:
    try:
        from hypercorn.config import Config
        from hypercorn.trio import serve
    except ImportError as error:
        raise RuntimeError(
            "serve_http(server='hypercorn') needs hypercorn: pip install 'tritask[hypercorn]'"
        ) from error

    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("tritask.hypercorn")
    config.graceful_timeout = 5.0
    config.keep_alive_timeout = 75.0
    await serve(
        transport,  # type: ignore[arg-type]
        config,
        shutdown_trigger=shutdown_trigger,
        task_status=task_status,
        mode="asgi",
    )
