"""A lean HTTP/1.1 server for ASGI applications on trio, parsing with h11 (sans-IO).

It implements only what tritask's Streamable HTTP application needs, and keeps the hot path
short: per connection one task runs the requests one after the other (the ASGI application is
called directly in it, no task per request) and, while the application runs, one sibling reads
the socket, so that

* pipelined requests are buffered (by the connection or h11) and answered strictly in order;
* EOF or a reset while a request is in flight becomes ``http.disconnect`` at once (and cancels
  the cancel scope registered through the ``tritask.request_watch`` extension, see below);
* idle keep-alive connections are closed after ``keep_alive_timeout``;
* a request head must be complete within ``header_timeout`` (from the accept on a new
  connection, from its first byte on a kept-alive one), or the connection is closed (with 408
  when part of a head arrived), so a client that trickles or never finishes a head holds its
  slot for seconds, not for the keep-alive timeout;
* at most ``max_connections`` connections are open at once: at the cap the server stops
  accepting until one closes (see ``ServerConfig.max_connections`` for why it does not answer
  503).

ASGI subset: ``http`` scopes (``http.request`` with ``more_body``, ``http.disconnect`` when the
peer goes away or once the response is complete, ``http.response.start`` and
``http.response.body`` with ``more_body``) and, optionally, ``lifespan``. A response started and
completed in one go (the start, then a single body message without ``more_body``) is sent with
``Content-Length`` in one write; a streamed one is sent chunked. ``Expect: 100-continue`` is
answered when the application asks for the body. Sending after the peer went away is a no-op
(like hypercorn), never an exception.

**Fast paths.** h11's event machinery costs several times what a small JSON-RPC request needs,
so the common case skips it both ways, and h11 stays the authority on everything else. A
complete, plain HTTP/1.1 keep-alive request already in the buffer (``_parse_simple``: head and
whole body, nothing unusual) is read without h11: while the fast path reads, the connection
keeps received bytes itself and h11, idle and with an empty buffer, never sees the request.
Anything else (a head or body still arriving, chunked, ``Expect``, obs-fold, a duplicate
``Content-Length``, HTTP/1.0, ``Connection: close``, malformed bytes...) is handed to h11 with
everything buffered, and h11 reads requests until it is idle again with nothing buffered. A
complete response with plain headers is written directly (``_Cycle._direct``); one h11 must
write (streamed, unusual) to a request the fast path read is preceded by telling h11 of an
equivalent request (``_SHADOW_REQUEST``), so h11 frames it as it would have.

**The ``tritask.request_watch`` extension.** The scope advertises
``scope["extensions"]["tritask.request_watch"] == {}``. An application may then send one
message ``{"type": "tritask.request_watch", "cancel_scope": CancelScope, "interval": float,
"tick": async callable | None}`` per request: the server cancels ``cancel_scope`` as soon as the
peer is gone before the response is complete, and (when ``interval > 0`` and ``tick`` is given)
awaits ``tick()`` from its reading task every ``interval`` seconds until the response is
complete. This gives an application disconnect-cancellation and periodic keep-alives without a
task of its own per request; under any other server it falls back to watching ``receive()``.

**The ``tritask.response_handoff`` extension.** The scope also advertises
``scope["extensions"]["tritask.response_handoff"] == {}``. An application whose response is a
stream lasting hours (a listen stream) may, once it has started the response, send
``{"type": "tritask.response_handoff", "source": ResponseSource, "interval": float,
"keepalive": bytes}`` and return. The server then drives the source from the connection's own
task: the reading task ends, and that one task writes the source's chunks as they become ready,
writes ``keepalive`` every ``interval`` seconds, and meanwhile waits on the socket itself, so
EOF or a reset ends the response at once; the source's waker cancels that wait when it has
something (:class:`ResponseSource`). The application's frames, its scope and whatever it read
of the request are gone while the stream lasts, and the connection costs one trio task. The
source is closed exactly once, however the response ends; after a complete one the connection
reads and serves the next request as usual. Under any other server the application delivers
the stream itself.

Graceful shutdown: when ``shutdown_trigger`` returns, the listeners close, idle connections are
closed, in-flight requests finish (their response says ``Connection: close``) and whatever is
left after ``graceful_timeout`` is cancelled.
"""

from __future__ import annotations

import errno
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, Final, Protocol
from urllib.parse import unquote, urlsplit

import attrs
import h11
import trio

__all__ = ["HANDOFF_EXTENSION", "WATCH_EXTENSION", "ResponseSource", "ServerConfig", "serve"]

log = logging.getLogger("tritask.http.server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

WATCH_EXTENSION: Final = "tritask.request_watch"
HANDOFF_EXTENSION: Final = "tritask.response_handoff"
_ASGI: Final = {"version": "3.0", "spec_version": "2.3"}
_ACCEPT_CAPACITY_ERRNOS: Final = frozenset(
    {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
)
_REASONS: Final[dict[int, bytes]] = {
    status.value: status.phrase.encode("ascii") for status in HTTPStatus
}
_NO_BODY_STATUSES: Final = frozenset({204, 304})
_FRAMING: Final = frozenset({b"content-length", b"transfer-encoding"})
_EOM: Final = h11.EndOfMessage()
# The direct path (see ``_Cycle._direct``) writes the head itself for header names made only of
# these bytes (lower-case tchar) and values made only of visible ASCII, space and tab; it leaves
# everything else to h11, and any header h11 treats specially on a response.
_NAME_BYTES: Final = b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyz"
_VALUE_BYTES: Final = bytes(range(0x21, 0x7F)) + b" \t"
_OWS: Final = frozenset(b" \t")
_SPECIAL_NAMES: Final = frozenset({b"transfer-encoding", b"connection", b"host"})
# What h11 is told when the direct path wrote the head and body itself: a response to a
# keep-alive request that keeps the connection alive and has no body to frame. It moves h11's
# state exactly as the real response would (to DONE, keep-alive unchanged): only ``Connection:
# close`` and a CONNECT request's 2xx answer change the state beyond that, and both go to h11.
_SHADOW: Final = h11.Response(status_code=200, headers=[(b"content-length", b"0")])
# The request fast path (``_parse_simple``) reads a request head itself when it is plain: every
# byte visible ASCII, space or tab apart from CRLF line ends, token names, one Host, at most one
# Content-Length, none of the headers that change how h11 frames or answers the request.
_TOKEN_BYTES: Final = _NAME_BYTES + b"ABCDEFGHIJKLMNOPQRSTUVWXYZ"
_HEAD_BYTES: Final = bytes(range(0x21, 0x7F)) + b" \t\r\n"
_END_OF_HEAD: Final = b"\r\n\r\n"
_FAST_SPECIAL: Final = frozenset(
    {b"content-length", b"host", b"connection", b"transfer-encoding", b"expect", b"upgrade"}
)
_NOT_FAST_METHODS: Final = frozenset({b"HEAD", b"CONNECT"})
# What h11 is told when a request the fast path read gets a response h11 must write (streamed,
# or unusual): a request with the same meaning for the response (HTTP/1.1, keep-alive, not HEAD
# or CONNECT, its body read), so h11 frames the response as it would have for the real one.
_SHADOW_REQUEST: Final = b"POST / HTTP/1.1\r\nhost: shadow\r\ncontent-length: 0\r\n\r\n"

SimpleRequest = tuple[bytes, bytes, list[tuple[bytes, bytes]], int | None, bytes, bytes]
"""What ``_parse_simple`` reads: method, target, headers (names lower-cased, values without
surrounding whitespace, as h11 gives them), the declared length, the body, what follows."""


def _parse_simple(data: bytes, limit: int) -> SimpleRequest | None:
    """A complete, plain HTTP/1.1 request at the start of ``data``, read without h11; ``None``
    when h11 is to read it (anything unusual, malformed or incomplete), so every doubtful case
    keeps h11's behaviour (its errors, 100-continue, chunked bodies, obs-fold, upgrades...).

    It accepts a strict subset of what h11 accepts, and reads it as h11 does (the tests compare
    both): a head of at most ``limit`` bytes ending in CRLF CRLF, lines ending in CRLF with no
    other CR or LF, only visible ASCII, space and tab; ``METHOD /target HTTP/1.1`` with a token
    method other than HEAD or CONNECT and an origin-form target; ``token: value`` headers with
    exactly one Host, at most one Content-Length of digits, no Transfer-Encoding, Expect or
    Upgrade, and Connection only as ``keep-alive``; and the whole body already in ``data``.
    """
    end = data.find(_END_OF_HEAD, 0, limit)
    if end < 0:
        return None
    head = data[:end]
    if head.translate(None, _HEAD_BYTES):
        return None
    lines = head.split(b"\r\n")
    breaks = len(lines) - 1
    if head.count(b"\n") != breaks or head.count(b"\r") != breaks:
        return None  # a bare CR or LF
    request_line = lines[0].split(b" ")
    if len(request_line) != 3:
        return None
    method, target, version = request_line
    if (
        version != b"HTTP/1.1"
        or not method
        or method.translate(None, _TOKEN_BYTES)
        or method in _NOT_FAST_METHODS
        or target[:1] != b"/"
        or b"\t" in target
    ):
        return None
    headers: list[tuple[bytes, bytes]] = []
    length: int | None = None
    host = False
    for index in range(1, breaks + 1):
        name, colon, value = lines[index].partition(b":")
        if not colon or not name or name.translate(None, _TOKEN_BYTES):
            return None  # also a continuation line (obs-fold): it starts with a space or tab
        name = name.lower()
        value = value.strip(b" \t")
        if name in _FAST_SPECIAL:
            if name == b"content-length":
                if length is not None or not value.isdigit() or len(value) > 18:
                    return None
                length = int(value)
            elif name == b"host":
                if host:
                    return None
                host = True
            elif name != b"connection" or value.lower() != b"keep-alive":
                return None
        headers.append((name, value))
    if not host:
        return None
    start = end + 4
    stop = start + (length or 0)
    if len(data) < stop:
        return None  # the body is still coming: h11 streams it to the application
    return method, target, headers, length, data[start:stop], data[stop:]


@attrs.frozen(kw_only=True)
class ServerConfig:
    """Limits and timeouts of the lean server."""

    max_incomplete_event_size: int = 16 * 1024
    """Largest request head (request line and headers) accepted; beyond it the answer is 431."""
    keep_alive_timeout: float = 75.0
    """An idle keep-alive connection (no request in flight) is closed after this many seconds."""
    header_timeout: float = 5.0
    """A request head (request line and headers) must be complete within this many seconds:
    from the accept on a new connection, from the head's first byte on a kept-alive one (until
    then the keep-alive timeout applies). Past it the connection is closed, after a 408 when
    part of a head arrived. Bodies are the application's to time (the request is running)."""
    max_connections: int | None = 1000
    """Open connections at most (``None``: no limit). At the cap the server stops accepting
    until a connection closes; new clients wait in the listen backlog (``backlog``), first come
    first served, and the kernel refuses connections past it.

    Why not accept and answer 503: that spends an accept, a descriptor and a write on every
    excess connection exactly when the server is saturated, and a 503 written before the
    request is read is often lost to the reset the close causes. Pausing keeps descriptors and
    memory bounded by the cap, never starves the connections already open, and with
    ``header_timeout`` a stalled client gives its slot back within seconds. This is what nginx
    (``worker_connections``) and HAProxy (``maxconn``) do. A warning is logged each time the cap
    is reached."""
    graceful_timeout: float = 5.0
    """After a shutdown trigger, how long in-flight requests may take before they are cancelled."""
    receive_size: int = 64 * 1024
    drain_limit: int = 64 * 1024
    """Request body bytes the application left unread that are read and discarded to keep the
    connection alive; a larger remainder closes the connection instead."""
    linger_seconds: float = 1.0
    """On close, how long to read (and drop) what the peer still sends after our last response,
    so that our response is not lost to a reset."""
    lifespan: bool = True
    """Run the ASGI lifespan protocol (an application that does not support it is tolerated)."""
    backlog: int | None = None

    def __attrs_post_init__(self) -> None:
        for name in ("keep_alive_timeout", "header_timeout", "graceful_timeout"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be > 0, not {value!r}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1 or None, not {self.max_connections}")


class ResponseSource(Protocol):
    """The rest of a streamed response, handed to the server (``HANDOFF_EXTENSION``).

    The server drives it from the connection's task: while nothing is :attr:`ready` that task
    waits on the socket (for the peer going away), on the keep-alive timer and on the waker it
    set, all at once, so the response needs no task of its own.
    """

    @property
    def ready(self) -> bool:
        """:meth:`next_chunk` would not wait for news (it has data, or the body is over)."""
        ...

    def set_waker(self, wake: Callable[[], None] | None) -> None:
        """Call ``wake`` once when :attr:`ready` becomes true (at once if it is); ``None``
        removes it. ``wake`` may be called from any trio task of the thread."""
        ...

    async def next_chunk(self) -> tuple[bytes, bool]:
        """The next body bytes (possibly empty) and whether more follow."""
        ...

    def close(self) -> None:
        """The response is over: complete, the peer gone, or the connection torn down or
        cancelled. Called exactly once by the server; releases what the source holds."""
        ...


_date_cache: list[Any] = [0, b""]


def _date_header() -> bytes:
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache[0] = now
        _date_cache[1] = formatdate(now, usegmt=True).encode("ascii")
    value: bytes = _date_cache[1]
    return value


def _disconnect() -> Message:
    return {"type": "http.disconnect"}


class _Cycle:
    """One request/response cycle on a connection: the ``receive`` and ``send`` it is given."""

    __slots__ = (
        "body",
        "body_done",
        "conn",
        "declared_length",
        "direct",
        "fast",
        "finished",
        "head",
        "headers_sent",
        "interval",
        "keepalive",
        "next_tick",
        "pending",
        "received",
        "response_complete",
        "response_started",
        "shadowed",
        "source",
        "tick",
        "watch_scope",
    )

    def __init__(
        self,
        conn: _Connection,
        *,
        head: bool,
        direct: bool,
        declared_length: int | None,
        body: bytes | None = None,
    ) -> None:
        self.conn = conn
        self.head = head
        self.direct = direct
        self.declared_length = declared_length
        self.body = body
        """The whole body, read by the request fast path (``None``: h11 reads the request)."""
        self.fast = body is not None
        """The fast path read the request: h11 has not seen it (see ``_shadow``)."""
        self.shadowed = False
        """h11 was told of a fast request (``_SHADOW_REQUEST``) to write the response."""
        self.received = 0
        self.body_done = False
        self.response_started = False
        self.pending: tuple[int, list[tuple[bytes, bytes]]] | None = None
        self.headers_sent = False
        self.response_complete = False
        self.finished = False
        self.watch_scope: trio.CancelScope | None = None
        self.tick: Callable[[], Awaitable[None]] | None = None
        self.interval = 0.0
        self.next_tick = math.inf
        self.keepalive = b""
        self.source: ResponseSource | None = None
        """The rest of the response, handed off (``HANDOFF_EXTENSION``): the connection's task
        drives it once the application has returned."""

    @classmethod
    def of(cls, conn: _Connection, request: h11.Request) -> _Cycle:
        """The cycle of a request h11 read."""
        declared: int | None = None
        # The direct path answers only HTTP/1.1 keep-alive requests (not CONNECT); ``close`` is
        # looked for anywhere in a Connection header, so that h11 decides every doubtful case.
        direct = request.http_version == b"1.1" and request.method != b"CONNECT"
        for name, value in request.headers:
            if name == b"content-length":
                declared = int(value)
            elif name == b"connection" and b"close" in value.lower():
                direct = False
        return cls(conn, head=request.method == b"HEAD", direct=direct, declared_length=declared)

    def _shadow(self) -> None:
        """Before h11 writes (part of) the response to a fast request: tell h11 of a request
        that means the same for the response (``_SHADOW_REQUEST``), read to its end. h11's
        buffer is empty then (the fast path keeps what arrives), so this is all it reads."""
        if self.fast and not self.shadowed:
            self.shadowed = True
            h = self.conn.h11
            h.receive_data(_SHADOW_REQUEST)
            request, end = h.next_event(), h.next_event()
            assert type(request) is h11.Request and type(end) is h11.EndOfMessage, (request, end)

    # -- receive -------------------------------------------------------------------------

    async def receive(self) -> Message:
        conn = self.conn
        body = self.body
        if body is not None:  # read by the fast path: all of it at once
            self.body = None
            self.body_done = True
            self.received = len(body)
            return {"type": "http.request", "body": body, "more_body": False}
        if self.body_done:
            # Nothing more to read for the application: wait until the peer goes away or the
            # response is complete (the reading task keeps buffering pipelined requests).
            while not (conn.eof or self.response_complete or self.finished):
                await conn.wakeup.park()
            return _disconnect()
        h = conn.h11
        while True:
            if self.finished:
                return _disconnect()
            try:
                event = h.next_event()
            except h11.RemoteProtocolError:
                conn.broken()
                return _disconnect()
            if event is h11.NEED_DATA:
                if conn.eof:
                    return _disconnect()
                if h.they_are_waiting_for_100_continue:
                    await conn.write_with(self._continue)
                    continue  # data may have arrived meanwhile: look again before parking
                conn.make_room()
                await conn.wakeup.park()
                continue
            kind = type(event)
            if kind is h11.Data:
                return self._body(event)  # type: ignore[arg-type]
            if kind is h11.EndOfMessage:
                self.body_done = True
                return {"type": "http.request", "body": b"", "more_body": False}
            return _disconnect()

    def _continue(self) -> bytes:
        h = self.conn.h11
        if not h.they_are_waiting_for_100_continue:
            return b""
        return h.send(h11.InformationalResponse(status_code=100, headers=[])) or b""

    def _body(self, first: h11.Data) -> Message:
        """The body bytes h11 has buffered, coalesced, and whether more are to come."""
        h = self.conn.h11
        chunks = [first.data]
        more = True
        while True:
            try:
                event = h.next_event()
            except h11.RemoteProtocolError:
                break  # reported by the next receive()
            kind = type(event)
            if kind is h11.Data:
                chunks.append(event.data)  # type: ignore[union-attr]
                continue
            if kind is h11.EndOfMessage:
                self.body_done = True
                more = False
            break
        body = bytes(chunks[0]) if len(chunks) == 1 else b"".join(chunks)
        self.received += len(body)
        return {"type": "http.request", "body": body, "more_body": more}

    # -- send ----------------------------------------------------------------------------

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.body":
            if self.pending is None:
                raise RuntimeError("http.response.body before http.response.start")
            if self.response_complete:
                raise RuntimeError("http.response.body after the response was complete")
            if self.source is not None:
                raise RuntimeError("http.response.body after the response was handed off")
            await self.write_body(message.get("body", b""), bool(message.get("more_body", False)))
        elif kind == "http.response.start":
            if self.response_started:
                raise RuntimeError("http.response.start sent twice")
            self.response_started = True
            headers = [(bytes(name), bytes(value)) for name, value in message.get("headers", ())]
            self.pending = (int(message["status"]), headers)
        elif kind == WATCH_EXTENSION:
            self._watch(message)
        elif kind == HANDOFF_EXTENSION:
            self._hand_off(message)
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r}")

    async def write_body(self, body: bytes, more: bool) -> None:
        """Write part of the body (all of it when ``more`` is false); a no-op once the peer is
        gone."""
        if not more:
            self._complete()
        if self.conn.eof:
            return
        await self.conn.write_with(lambda: self._serialize(body, more))
        if not more:
            self.conn.wakeup.unpark_all()

    def _serialize(self, body: bytes, more: bool) -> bytes:
        if not more and not self.headers_sent and self.direct:
            data = self._direct(body)
            if data is not None:
                return data
        return self._serialize_h11(body, more)

    def _direct(self, body: bytes) -> bytes | None:
        """A complete response written without h11 building it, or ``None`` (nothing changed).

        The bytes are those h11 would write for the response ``_serialize_h11`` gives it (the
        tests compare both), for the common case only: an HTTP/1.1 keep-alive request, a final
        status that frames a body, plain lower-case header names and visible ASCII values,
        Content-Length (if the application gave one) equal to the body's length, and no reason
        to close the connection. h11 still learns that the response was sent, through
        ``_SHADOW`` and ``EndOfMessage``, so its state machine stays the authority on the
        connection.
        """
        h = self.conn.h11
        if self.conn.closing:
            return None
        if not self.fast and (h.our_state is not h11.SEND_RESPONSE or self._close_early()):
            return None
        assert self.pending is not None
        status, headers = self.pending
        if not 200 <= status < 600 or status in _NO_BODY_STATUSES:
            return None
        length = b"%d" % len(body)
        lines = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b""))]
        declared = None
        for name, value in headers:
            if (
                not name
                or name.translate(None, _NAME_BYTES)
                or name in _SPECIAL_NAMES
                or value.translate(None, _VALUE_BYTES)
                or (value and (value[0] in _OWS or value[-1] in _OWS))
            ):
                return None
            if name == b"content-length":
                if declared is not None or not value.isdigit() or len(value) > 18:
                    return None
                if not self.head and value != length:
                    return None
                declared = value
            lines.append(b"%s: %s\r\n" % (name, value))
        if declared is None:
            lines.append(b"content-length: %s\r\n" % length)
        lines.append(b"date: %s\r\n\r\n" % _date_header())
        if body and not self.head:
            lines.append(body)
        if not self.fast:  # (a fast request: h11 never saw it, and stays idle)
            h.send(_SHADOW)
            h.send(_EOM)
        self._headers_sent()
        return b"".join(lines)

    def _serialize_h11(self, body: bytes, more: bool) -> bytes:
        self._shadow()
        h = self.conn.h11
        parts: list[bytes] = []
        if not self.headers_sent:
            assert self.pending is not None
            status, headers = self.pending
            self._headers_sent()
            length = None if more else len(body)
            parts.append(h.send(self._response(status, headers, length)) or b"")
        if body and not self.head:
            parts.append(h.send(h11.Data(data=body)) or b"")
        if not more:
            parts.append(h.send(_EOM) or b"")
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _response(
        self, status: int, headers: list[tuple[bytes, bytes]], length: int | None
    ) -> h11.Response:
        conn = self.conn
        if (
            length is not None
            and status not in _NO_BODY_STATUSES
            and not any(name.lower() in _FRAMING for name, _ in headers)
        ):
            headers.append((b"content-length", b"%d" % length))
        headers.append((b"date", _date_header()))
        if conn.closing or self._close_early():
            headers.append((b"connection", b"close"))
        return h11.Response(status_code=status, headers=headers, reason=_REASONS.get(status, b""))

    def _headers_sent(self) -> None:
        # The head is written: its header list is not kept while the body streams (a listen
        # stream's lasts hours); ``pending`` stays set, it also marks a started response.
        self.headers_sent = True
        assert self.pending is not None
        self.pending = (self.pending[0], [])

    def _close_early(self) -> bool:
        """Answering before the request body was read: close unless the rest is cheap to drop."""
        h = self.conn.h11
        if self.fast or h.their_state is not h11.SEND_BODY:
            return False
        if h.they_are_waiting_for_100_continue:
            return True
        declared = self.declared_length
        return declared is not None and declared - self.received > self.conn.config.drain_limit

    def _complete(self) -> None:
        self.response_complete = True
        self.watch_scope = None
        self.tick = None

    # -- the watch extension -------------------------------------------------------------

    def _watch(self, message: Message) -> None:
        if self.response_complete:
            return
        scope = message.get("cancel_scope")
        if scope is not None and not isinstance(scope, trio.CancelScope):
            raise TypeError("tritask.request_watch: cancel_scope must be a trio.CancelScope")
        self.watch_scope = scope
        if self.conn.eof:
            if scope is not None:
                scope.cancel()
            return
        tick = message.get("tick")
        interval = float(message.get("interval") or 0.0)
        if tick is None or interval <= 0:
            self.tick = None
            return
        self.tick = tick
        self.interval = interval
        self.next_tick = trio.current_time() + interval
        self.conn.wake_reader_by(self.next_tick)

    async def run_tick(self) -> None:
        tick = self.tick
        if tick is None or self.response_complete:
            return
        try:
            await tick()
        except Exception:
            log.exception("tritask.request_watch tick failed; no more ticks for this request")
            self.tick = None
            return
        self.next_tick = trio.current_time() + self.interval

    def peer_gone(self) -> None:
        if not self.response_complete and self.watch_scope is not None:
            self.watch_scope.cancel()

    # -- the hand-off extension ----------------------------------------------------------

    def _hand_off(self, message: Message) -> None:
        source = message.get("source")
        if source is None or not callable(getattr(source, "next_chunk", None)):
            raise TypeError(f"{HANDOFF_EXTENSION}: source must be a ResponseSource")
        if self.pending is None or self.response_complete or self.source is not None:
            raise RuntimeError(
                f"{HANDOFF_EXTENSION} needs a started, incomplete response, handed off once"
            )
        # The application's own watch ends here: from now on the connection's task is the
        # only one serving this response (the tick and the scope belong to frames that go).
        self.watch_scope = None
        self.tick = None
        if self.conn.eof:
            source.close()
            return
        self.source = source
        interval = float(message.get("interval") or 0.0)
        keepalive = bytes(message.get("keepalive") or b"")
        if interval > 0 and keepalive:
            self.interval = interval
            if self.next_tick == math.inf:
                self.next_tick = trio.current_time() + interval
            self.keepalive = keepalive
        else:
            self.interval = 0.0
            self.next_tick = math.inf

    def drop_source(self) -> None:
        """Close a handed-off source that will not be driven (the connection is ending)."""
        source, self.source = self.source, None
        if source is not None:
            source.close()


class _Connection:
    """One accepted socket: a request loop (this task) and a reading task beside it while an
    application runs; this task alone while it drives a handed-off response."""

    # Slots: one of these lives as long as its connection (10,000 open listen streams hold
    # 10,000 of them), and a per-instance dict of 21 attributes costs about 1 KiB.
    __slots__ = (
        "_buffer_limit",
        "_buffered",
        "_client",
        "_h11_reads",
        "_head_deadline",
        "_head_expired",
        "_head_started",
        "_idle_expired",
        "_idle_since",
        "_pending",
        "_read_scope",
        "_reading",
        "_resume",
        "_server",
        "_write_lock",
        "app",
        "closing",
        "config",
        "cycle",
        "eof",
        "h11",
        "server",
        "stream",
        "wakeup",
    )

    def __init__(self, server: _Server, stream: trio.SocketStream) -> None:
        self.server = server
        self.app = server.app
        self.config = config = server.config
        self.stream = stream
        self.h11 = h11.Connection(
            h11.SERVER, max_incomplete_event_size=config.max_incomplete_event_size
        )
        self.wakeup = trio.lowlevel.ParkingLot()
        """Parked: whoever waits for received data or a state change (EOF, completion...)."""
        self._resume = trio.lowlevel.ParkingLot()
        self._write_lock = trio.StrictFIFOLock()
        self._buffered = 0
        self._buffer_limit = config.max_incomplete_event_size + config.receive_size
        self.eof = False
        self.closing = False
        self._idle_expired = False
        self._idle_since = now = trio.current_time()
        self._head_expired = False
        self._head_started = False
        """Bytes of the next request head have arrived (the keep-alive timer no longer applies)."""
        self._head_deadline = now + config.header_timeout
        """When the pending request head must be complete (``inf``: no head is pending)."""
        self._read_scope: trio.CancelScope | None = None
        self._reading = True
        """The reading task runs (``False``: it stops, a handed-off response is to be driven)."""
        self.cycle: _Cycle | None = None
        self._pending = b""
        """Received bytes not yet read, while the fast path reads requests (``_h11_reads`` is
        false); h11's buffer is empty then."""
        self._h11_reads = False
        """What arrives goes to h11: a request the fast path left to it is being read (set
        between requests, cleared once h11 is idle again with nothing buffered)."""
        self._client = _address(stream.socket.getpeername())
        self._server = _address(stream.socket.getsockname())

    # -- the reading task ----------------------------------------------------------------

    def _next_deadline(self) -> float:
        now = trio.current_time()
        cycle = self.cycle
        timeout = self.config.keep_alive_timeout
        if cycle is None:
            deadline = self._head_deadline
            if not self._head_started:
                deadline = min(deadline, self._idle_since + timeout)
            return deadline
        deadline = now + timeout
        if cycle.tick is not None:
            deadline = min(deadline, cycle.next_tick)
        return deadline

    def _head_begins(self, scope: trio.CancelScope | None) -> None:
        """The first bytes of a request head arrived between requests: its timer runs."""
        self._head_started = True
        if self._head_deadline == math.inf:
            self._head_deadline = trio.current_time() + self.config.header_timeout
        if scope is not None:
            scope.deadline = min(scope.deadline, self._head_deadline)

    def wake_reader_by(self, deadline: float) -> None:
        scope = self._read_scope
        if scope is not None and deadline < scope.deadline:
            scope.deadline = deadline

    async def _read_loop(self) -> None:
        stream = self.stream
        h = self.h11
        size = self.config.receive_size
        while self._reading:
            # One cancel scope for many reads: its deadline is the next timer (idle timeout or
            # tick); it may fire early, then the timers are checked and it is armed again.
            with trio.CancelScope(deadline=self._next_deadline()) as scope:
                self._read_scope = scope
                while self._reading:
                    if self._buffered > self._buffer_limit:
                        await self._resume.park()
                        continue
                    try:
                        data = await stream.receive_some(size)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        data = b""
                    if not self._received(data):
                        self._read_scope = None
                        return
                    if (
                        self.cycle is None
                        and not self._head_started
                        and h.their_state is not h11.SEND_BODY  # not a body left to discard
                    ):
                        # While the fast path reads, the request loop looks at the bytes at
                        # once: a whole request stops the timer before it could matter, and
                        # only a head left to h11 arms it (``_to_h11``), which saves moving
                        # this scope's deadline on every request.
                        self._head_begins(scope if self._h11_reads else None)
                    self.wakeup.unpark_all()
            self._read_scope = None
            if not self._reading or not await self._on_timer():
                return

    def _received(self, data: bytes) -> bool:
        """Keep (or feed h11) what the socket gave; ``False`` at EOF (the peer is gone)."""
        if not data:
            if self._h11_reads:
                self.h11.receive_data(b"")
            self.peer_gone()
            return False
        if self._h11_reads:
            self.h11.receive_data(data)
        else:
            self._pending = self._pending + data if self._pending else data
        self._buffered += len(data)
        return True

    def _to_h11(self) -> None:
        """Let h11 read the next request (and what follows, until it is idle again)."""
        data, self._pending = self._pending, b""
        self._h11_reads = True
        if self._head_started:
            self.wake_reader_by(self._head_deadline)  # the head's timer, now that it matters
        if data:
            self.h11.receive_data(data)
        if self.eof:
            self.h11.receive_data(b"")

    def _stop_reading(self) -> None:
        """End the reading task at its next wait (never in the middle of a tick's write: ticks
        run outside the receive's cancel scope), so that one task serves the connection."""
        self._reading = False
        if self._read_scope is not None:
            self._read_scope.cancel()
        self._resume.unpark_all()

    async def _on_timer(self) -> bool:
        """A timer fired: run a due tick; ``False`` once the idle timeout closed the line."""
        cycle = self.cycle
        now = trio.current_time()
        if cycle is not None:
            if cycle.tick is not None and now >= cycle.next_tick:
                await cycle.run_tick()
            return True
        if now >= self._head_deadline:
            self._head_expired = True
            self.wakeup.unpark_all()
            return False
        if not self._head_started and now >= self._idle_since + self.config.keep_alive_timeout:
            self._idle_expired = True
            self.wakeup.unpark_all()
            return False
        return True

    def make_room(self) -> None:
        """h11 needs more data: everything buffered so far has been parsed."""
        self._buffered = 0
        self._resume.unpark_all()

    def peer_gone(self) -> None:
        if self.eof:
            return
        self.eof = True
        if self.cycle is not None:
            self.cycle.peer_gone()
        self.wakeup.unpark_all()

    def broken(self) -> None:
        """The request cannot be read any further (a protocol error in its body)."""
        self.peer_gone()

    # -- writing -------------------------------------------------------------------------

    async def write_with(self, serialize: Callable[[], bytes]) -> None:
        """Serialize (h11 state changes) and write under one lock, so writes keep their order."""
        lock = self._write_lock
        try:
            lock.acquire_nowait()
        except trio.WouldBlock:
            await lock.acquire()
        try:
            data = serialize()
            if data and not self.eof:
                await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.peer_gone()
        finally:
            lock.release()

    # -- the request loop ----------------------------------------------------------------

    async def run(self) -> None:
        while (handed_off := await self._serve_requests()) is not None:
            await self._drive(handed_off)
            if not await self._end_cycle(handed_off):
                break
        await self._close()

    async def _serve_requests(self) -> _Cycle | None:
        """Requests with the reading task beside them, until the connection ends (``None``) or
        a response is handed off: then the reading task ends by itself (it is between reads
        or ticks, never inside a write) and the cycle is returned, to be driven by this task
        alone. Nothing of this frame (the nursery) is kept while it is."""
        self._reading = True
        handed_off: _Cycle | None = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read_loop)
                try:
                    handed_off = await self._requests()
                finally:
                    if handed_off is None:
                        nursery.cancel_scope.cancel()
                    else:
                        self._stop_reading()
        except BaseException:
            # Cancelled (or failed) while the reading task was finishing a tick: nobody will
            # drive the handed-off source, so it is closed here (its hub subscription freed).
            if handed_off is not None:
                handed_off.drop_source()
            raise
        return handed_off

    async def _requests(self) -> _Cycle | None:
        """Serve requests until the connection ends (``None``) or a response is handed off
        (its cycle: the caller drives it without the reading task, then comes back)."""
        h = self.h11
        limit = self.config.max_incomplete_event_size
        while True:
            if self.closing or self._idle_expired:
                return None
            if self._head_expired:
                if self._head_started and not self.eof:
                    await self._refuse(408)
                return None
            if not self._h11_reads:
                data = self._pending
                if not data:
                    if self.eof:
                        return None
                    self.make_room()
                    await self.wakeup.park()
                    continue
                simple = None if self.eof else _parse_simple(data, limit)
                if simple is None:
                    self._to_h11()  # and h11 reads it, below
                else:
                    method, target, headers, length, body, rest = simple
                    self._pending = rest
                    self._buffered = len(rest)
                    self._resume.unpark_all()
                    del simple, data
                    cycle = _Cycle(self, head=False, direct=True, declared_length=length, body=body)
                    del body
                    scope = self._make_scope(method, target, b"1.1", headers)
                    del headers
                    if not await self._run_cycle(cycle, scope, method, target):
                        return None
                    if cycle.source is not None:
                        return cycle
                    continue
            try:
                event = h.next_event()
            except h11.RemoteProtocolError as error:
                await self._refuse(error.error_status_hint)
                return None
            if event is h11.NEED_DATA:
                if self.eof:
                    return None
                self.make_room()
                await self.wakeup.park()
                continue
            if type(event) is h11.Request:
                # The request event is not kept while the application runs (a listen stream
                # runs for hours): the scope carries what the application reads of it.
                cycle = _Cycle.of(self, event)
                scope = self._scope(event)
                method, target = event.method, bytes(event.target)
                del event
                if not await self._run_cycle(cycle, scope, method, target):
                    return None
                if cycle.source is not None:
                    return cycle
                continue
            return None  # ConnectionClosed

    async def _run_cycle(self, cycle: _Cycle, scope: Scope, method: bytes, target: bytes) -> bool:
        """Run the application for a request just read; ``False`` when the connection cannot
        carry another one. A handed-off response (``cycle.source``) is left to the caller."""
        self._head_deadline = math.inf
        self._head_started = False
        path = target.split(b"?", 1)[0]
        del target
        await self._call(cycle, scope, method, path)
        del scope
        if cycle.source is not None:
            return True
        return await self._end_cycle(cycle)

    def _scope(self, request: h11.Request) -> Scope:
        target = bytes(request.target)
        if not target.startswith(b"/") and b"://" in target:  # absolute-form
            split = urlsplit(target)
            target = (split.path or b"/") + (b"?" + split.query if split.query else b"")
        return self._make_scope(request.method, target, request.http_version, request.headers)

    def _make_scope(
        self,
        method: bytes,
        target: bytes,
        http_version: bytes,
        headers: Iterable[tuple[bytes, bytes]],
    ) -> Scope:
        raw_path, _, query = target.partition(b"?")
        return {
            "type": "http",
            "asgi": dict(_ASGI),
            "http_version": http_version.decode("ascii"),
            "method": method.decode("ascii"),
            "scheme": "http",
            "path": unquote(raw_path.decode("latin-1")),
            "raw_path": raw_path,
            "query_string": query,
            "root_path": "",
            "headers": list(headers),
            "client": self._client,
            "server": self._server,
            "extensions": {WATCH_EXTENSION: {}, HANDOFF_EXTENSION: {}},
        }

    async def _call(self, cycle: _Cycle, scope: Scope, method: bytes, path: bytes) -> None:
        """Run the application for one request (``path``: its target without the query, for
        the log only: a query string may carry credentials, ``?access_token=``)."""
        self.cycle = cycle
        try:
            await self.app(scope, cycle.receive, cycle.send)
        except Exception:
            log.exception("ASGI application failed on %s %r", method, path)
            cycle.drop_source()
        except BaseException:
            cycle.drop_source()
            self._cycle_over(cycle)
            raise
        if cycle.source is not None and self.eof:
            cycle.drop_source()

    def _cycle_over(self, cycle: _Cycle) -> None:
        cycle.finished = True
        self.cycle = None
        self._idle_since = trio.current_time()
        # A pipelined head has begun: its timer starts now.
        if self._pending or (self._h11_reads and self.h11.trailing_data[0]):
            self._head_begins(None)
            self.wake_reader_by(self._head_deadline)
        self.wakeup.unpark_all()

    async def _end_cycle(self, cycle: _Cycle) -> bool:
        """Finish a request whose application returned (and whose handed-off response, if
        any, was driven): ``True`` when the connection can carry the next one."""
        self._cycle_over(cycle)
        if not cycle.response_started and not self.eof:
            await cycle.send(
                {
                    "type": "http.response.start",
                    "status": 500,
                    "headers": [(b"content-type", b"text/plain; charset=utf-8")],
                }
            )
            await cycle.send({"type": "http.response.body", "body": b"Internal Server Error"})
        if self.eof or not cycle.response_complete:
            return False
        if cycle.fast and not cycle.shadowed:
            return not self.closing  # h11 saw neither the request nor the response
        h = self.h11
        if h.their_state is h11.SEND_BODY and not await self._discard_body():
            return False
        if h.our_state is not h11.DONE or h.their_state is not h11.DONE or self.closing:
            return False
        h.start_next_cycle()
        if self._h11_reads and not h.trailing_data[0]:
            self._h11_reads = False  # nothing of a next request buffered in h11: the fast path
        return True

    # -- a handed-off response: one task for the connection -------------------------------

    async def _drive(self, cycle: _Cycle) -> None:
        """Serve a handed-off response from this task alone until it is complete or the peer
        is gone: the source's chunks as they become ready, the keep-alive bytes on their
        timer, and the socket read meanwhile, so EOF or a reset ends it at once (and what
        else arrives, a pipelined request, is buffered in h11 within the usual limit).

        The source is closed however this ends (complete, peer gone, cancelled).
        """
        source = cycle.source
        assert source is not None
        try:
            while not self.eof:
                if trio.current_time() >= cycle.next_tick:
                    cycle.next_tick = trio.current_time() + cycle.interval
                    await cycle.write_body(cycle.keepalive, True)
                elif source.ready:
                    chunk, more = await source.next_chunk()
                    if chunk or not more:
                        await cycle.write_body(chunk, more)
                    if not more:
                        return
                    del chunk
                else:
                    await self._wait_idle(source, cycle.next_tick)
        finally:
            cycle.drop_source()

    async def _wait_idle(self, source: ResponseSource, deadline: float) -> None:
        """Wait for the source to become ready, for ``deadline``, or for the socket: whichever
        comes first. The source's waker cancels this wait's scope, which interrupts the
        receive without losing data (trio's receive is cancellable before it reads)."""
        data: bytes | None = None
        with trio.CancelScope(deadline=deadline) as wait:
            source.set_waker(wait.cancel)
            try:
                if self._buffered > self._buffer_limit:
                    await trio.sleep_forever()  # read no more until the response is over
                try:
                    data = await self.stream.receive_some(self.config.receive_size)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    data = b""
            finally:
                source.set_waker(None)
        if data is not None:
            self._received(data)

    async def _discard_body(self) -> bool:
        """Read and drop a request body the application left unread (within the limits)."""
        h = self.h11
        budget = self.config.drain_limit
        with trio.move_on_after(self.config.linger_seconds):
            while not self.eof:
                try:
                    event = h.next_event()
                except h11.RemoteProtocolError:
                    return False
                if event is h11.NEED_DATA:
                    if h.they_are_waiting_for_100_continue:
                        return False
                    self.make_room()
                    await self.wakeup.park()
                    continue
                if type(event) is h11.Data:
                    budget -= len(event.data)
                    if budget < 0:
                        return False
                    continue
                return type(event) is h11.EndOfMessage
        return False

    async def _refuse(self, status: int) -> None:
        """Answer a request h11 could not parse (400, 431...) and close."""
        h = self.h11
        if h.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        reason = _REASONS.get(status, b"")
        body = b"%d %s\n" % (status, reason)
        headers = [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", b"%d" % len(body)),
            (b"date", _date_header()),
            (b"connection", b"close"),
        ]

        def serialize() -> bytes:
            try:
                return b"".join(
                    [
                        h.send(h11.Response(status_code=status, headers=headers, reason=reason))
                        or b"",
                        h.send(h11.Data(data=body)) or b"",
                        h.send(_EOM) or b"",
                    ]
                )
            except h11.LocalProtocolError:
                return b""

        await self.write_with(serialize)

    async def _close(self) -> None:
        """Half-close, let the peer read our last response, then close."""
        stream = self.stream
        h = self.h11
        # Closing with unread input makes the kernel send a reset, which can destroy our last
        # response before the peer reads it: drain first when the peer may still be sending.
        if not self.eof and (
            self._pending or h.their_state in (h11.SEND_BODY, h11.ERROR) or h.trailing_data[0]
        ):
            try:
                await stream.send_eof()
                budget = self.config.drain_limit
                with trio.move_on_after(self.config.linger_seconds):
                    while budget > 0:
                        data = await stream.receive_some(self.config.receive_size)
                        if not data:
                            break
                        budget -= len(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        await stream.aclose()


def _address(value: Any) -> tuple[str, int] | None:
    if isinstance(value, tuple) and len(value) >= 2:
        return (str(value[0]), int(value[1]))
    return None


class _Server:
    def __init__(self, app: ASGIApp, config: ServerConfig) -> None:
        self.app = app
        self.config = config
        self.connections: set[_Connection] = set()
        limit = config.max_connections
        # One pool of slots for every listener: the cap is per server, not per address.
        self.slots = trio.Semaphore(limit) if limit is not None else None

    async def _slot(self) -> None:
        slots = self.slots
        if slots is None:
            return
        try:
            slots.acquire_nowait()
        except trio.WouldBlock:
            log.warning(
                "%d connections open (max_connections): not accepting until one closes",
                self.config.max_connections,
            )
            await slots.acquire()

    async def accept(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        while True:
            await self._slot()
            try:
                while True:
                    try:
                        stream = await listener.accept()
                        break
                    except OSError as error:
                        if error.errno not in _ACCEPT_CAPACITY_ERRNOS:
                            raise
                        log.error(
                            "accept failed (%s); retrying in 100 ms", errno.errorcode[error.errno]
                        )
                        await trio.sleep(0.1)
            except BaseException:
                self._release()
                raise
            nursery.start_soon(self.connection, stream)

    def _release(self) -> None:
        if self.slots is not None:
            self.slots.release()

    async def connection(self, stream: trio.SocketStream) -> None:
        try:
            try:
                conn = _Connection(self, stream)
            except OSError:  # the peer went away before we looked at it
                await trio.aclose_forcefully(stream)
                return
            self.connections.add(conn)
            try:
                await conn.run()
            except Exception:
                log.exception("HTTP connection failed")
            finally:
                self.connections.discard(conn)
                await trio.aclose_forcefully(stream)
        finally:
            self._release()

    def begin_shutdown(self) -> None:
        for conn in self.connections:
            conn.closing = True
            conn.wakeup.unpark_all()


@attrs.define(eq=False)
class _Lifespan:
    app: ASGIApp
    _startup: trio.Event = attrs.field(factory=trio.Event)
    _shutdown: trio.Event = attrs.field(factory=trio.Event)
    _shutdown_done: trio.Event = attrs.field(factory=trio.Event)
    _failure: str | None = None
    _phase: str = "startup"

    async def run(self) -> None:
        scope: Scope = {"type": "lifespan", "asgi": dict(_ASGI), "state": {}}
        try:
            await self.app(scope, self._receive, self._send)
        except Exception:
            if not self._startup.is_set():
                log.debug("the ASGI application does not support lifespan", exc_info=True)
            else:
                log.exception("ASGI lifespan failed")
        finally:
            self._startup.set()
            self._shutdown_done.set()

    async def start(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(self.run)
        await self._startup.wait()
        if self._failure is not None:
            raise RuntimeError(f"ASGI lifespan startup failed: {self._failure}")

    async def stop(self) -> None:
        self._shutdown.set()
        await self._shutdown_done.wait()

    async def _receive(self) -> Message:
        if self._phase == "startup":
            self._phase = "running"
            return {"type": "lifespan.startup"}
        await self._shutdown.wait()
        return {"type": "lifespan.shutdown"}

    async def _send(self, message: Message) -> None:
        kind = message["type"]
        if kind in ("lifespan.startup.complete", "lifespan.startup.failed"):
            if kind == "lifespan.startup.failed":
                self._failure = str(message.get("message", ""))
            self._startup.set()
        elif kind in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
            self._shutdown_done.set()


def _url(listener: trio.SocketListener) -> str:
    host, port = listener.socket.getsockname()[:2]
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


async def serve(
    app: ASGIApp,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    config: ServerConfig | None = None,
    shutdown_trigger: Callable[[], Awaitable[Any]] | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``host:port`` until cancelled or until ``shutdown_trigger`` returns.

    The bound URLs (``http://host:port``) are reported through ``task_status``.
    """
    config = config or ServerConfig()
    server = _Server(app, config)
    listeners = await trio.open_tcp_listeners(port, host=host, backlog=config.backlog)
    try:
        async with trio.open_nursery() as outer:
            lifespan = _Lifespan(app) if config.lifespan else None
            if lifespan is not None:
                await lifespan.start(outer)
            async with trio.open_nursery() as connections:
                async with trio.open_nursery() as accepting:
                    for listener in listeners:
                        accepting.start_soon(server.accept, listener, connections)
                    task_status.started([_url(listener) for listener in listeners])
                    if shutdown_trigger is not None:
                        await shutdown_trigger()
                        accepting.cancel_scope.cancel()
                for listener in listeners:
                    await listener.aclose()
                server.begin_shutdown()
                connections.cancel_scope.deadline = trio.current_time() + config.graceful_timeout
            if lifespan is not None:
                with trio.move_on_after(config.graceful_timeout):
                    await lifespan.stop()
            outer.cancel_scope.cancel()
    finally:
        for listener in listeners:
            await trio.aclose_forcefully(listener)
