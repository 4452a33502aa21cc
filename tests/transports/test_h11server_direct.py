"""The lean server's direct path writes exactly the bytes h11 would, and leaves h11's state right.

``_Cycle._direct`` formats a complete response itself and tells h11 only that a response was
sent; anything unusual goes to h11. These tests compare it with the h11 path
(``_Cycle._serialize_h11``): first sans-IO on many request/response pairs (bytes, errors and the
h11 states after), then on the wire through real sockets with the direct path on and off.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

import h11
import pytest
import trio

from tritask.protocol.meta import CLIENT_CAPABILITIES_KEY, PROTOCOL_VERSION_KEY
from tritask.server import App
from tritask.transports import _h11server
from tritask.transports._h11server import ServerConfig, _Cycle, serve
from tritask.transports.http import HttpTransport

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
V = "2026-07-28"
DATE = b"Thu, 01 Jan 2026 00:00:00 GMT"
JSON = b'{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"hi"}]}}'


@pytest.fixture(autouse=True)
def fixed_date(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_h11server, "_date_header", lambda: DATE)


@contextmanager
def direct_path(enabled: bool, used: list[bool] | None = None) -> Iterator[None]:
    """Turn the direct path off (every response through h11), or record when it answers."""
    original = _Cycle._direct

    def direct(self: _Cycle, body: bytes) -> bytes | None:
        result = original(self, body) if enabled else None
        if used is not None:
            used.append(result is not None)
        return result

    _Cycle._direct = direct  # type: ignore[method-assign]
    try:
        yield
    finally:
        _Cycle._direct = original  # type: ignore[method-assign]


# -- sans-IO: one request, one complete response ---------------------------------------------------


class StubConnection:
    """What a ``_Cycle`` uses of its ``_Connection``."""

    def __init__(self, request: bytes, *, read_body: bool, closing: bool) -> None:
        self.config = ServerConfig()
        self.closing = closing
        self.eof = False
        self.h11 = h11.Connection(h11.SERVER)
        self.h11.receive_data(request)
        request_event = self.h11.next_event()
        assert isinstance(request_event, h11.Request), request_event
        self.request = request_event
        while read_body:
            event = self.h11.next_event()
            if event is h11.NEED_DATA or event is h11.PAUSED or type(event) is h11.EndOfMessage:
                break  # (also a body that was not sent, or a request to switch protocols)


POST = b"POST /mcp HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
REQUESTS = {
    "post": POST,
    "head": b"HEAD /mcp HTTP/1.1\r\nHost: x\r\n\r\n",
    "get": b"GET /mcp HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n",
    "http10": b"POST /mcp HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}",
    "http10-keep-alive": b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
    "close": b"POST /mcp HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}",
    "close-list": b"GET / HTTP/1.1\r\nHost: x\r\nConnection: Keep-Alive, CLOSE\r\n\r\n",
    "expect-100": (
        b"POST / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n"
    ),
    # Answered before most of a large body arrived: the connection closes.
    "large-body": b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{}",
    "connect": b"CONNECT example.org:443 HTTP/1.1\r\nHost: example.org:443\r\n\r\n",
    "upgrade": b"GET / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
}
CT_JSON = (b"content-type", b"application/json")
RESPONSES: dict[str, tuple[int, list[tuple[bytes, bytes]], bytes]] = {
    "json-200": (200, [CT_JSON, (b"content-length", b"%d" % len(JSON))], JSON),
    "accepted-202": (202, [(b"content-length", b"0")], b""),
    "error-400": (400, [CT_JSON, (b"content-length", b"9")], b'{"x":"y"}'),
    "plain-404-no-length": (404, [(b"content-type", b"text/plain")], b"nope"),
    "no-headers": (200, [], b"x"),
    "empty-value": (200, [(b"x-empty", b"")], b""),
    "inner-spaces": (200, [(b"x-a", b"a \t b")], b"ab"),
    "unknown-reason": (299, [], b""),
    "status-599": (599, [], b"!"),
    "no-content-204": (204, [], b""),
    "not-modified-304": (304, [(b"etag", b'"1"')], b""),
    "head-length-declared": (200, [(b"content-length", b"94")], b""),
    "leading-zero-length": (200, [(b"content-length", b"01")], b"x"),
    "wrong-length": (200, [(b"content-length", b"3")], b"x"),
    "double-length": (200, [(b"content-length", b"1"), (b"content-length", b"1")], b"x"),
    "length-list": (200, [(b"content-length", b"1, 1")], b"x"),
    "upper-case-name": (200, [(b"Content-Type", b"text/plain")], b"x"),
    "trailing-space": (200, [(b"x-a", b"a ")], b"x"),
    "leading-tab": (200, [(b"x-a", b"\ta")], b"x"),
    "obs-text": (200, [(b"x-a", b"caf\xc3\xa9")], b"x"),
    "control-char": (200, [(b"x-a", b"a\x01b")], b"x"),
    "newline": (200, [(b"x-a", b"a\r\nx-b: b")], b"x"),
    "bad-name": (200, [(b"x a", b"b")], b"x"),
    "empty-name": (200, [(b"", b"b")], b"x"),
    "host-header": (200, [(b"x-a", b"1"), (b"host", b"h")], b"x"),
    "connection-header": (200, [(b"connection", b"keep-alive")], b"x"),
    "connection-close-header": (200, [(b"connection", b"close")], b"x"),
    "transfer-encoding": (200, [(b"transfer-encoding", b"chunked")], b"x"),
    "informational": (101, [], b""),
    "huge-status": (1000, [], b""),
}
# The pairs the direct path must answer itself (the rest it must hand to h11).
DIRECT_REQUESTS = {"post", "head", "get", "upgrade"}
DIRECT_RESPONSES = {
    "json-200",
    "accepted-202",
    "error-400",
    "plain-404-no-length",
    "no-headers",
    "empty-value",
    "inner-spaces",
    "unknown-reason",
    "status-599",
}
# A HEAD response may declare any length (its body is never sent).
DIRECT_PAIRS = {
    ("head", "head-length-declared"),
    ("head", "leading-zero-length"),
    ("head", "wrong-length"),
}


def serialize(
    request: str, response: str, *, direct: bool, read_body: bool = True, closing: bool = False
) -> tuple[bytes | str, Any, Any, bool]:
    """The bytes (or the error), h11's states after, and whether the direct path answered."""
    status, headers, body = RESPONSES[response]
    conn = StubConnection(REQUESTS[request], read_body=read_body, closing=closing)
    cycle = _Cycle.of(conn, conn.request)  # type: ignore[arg-type]
    cycle.response_started = True
    cycle.pending = (status, list(headers))
    cycle._complete()
    used: list[bool] = []
    with direct_path(direct, used):
        try:
            data: bytes | str = cycle._serialize(body, False)
        except h11.LocalProtocolError as error:
            data = f"LocalProtocolError: {error}"
    h = conn.h11
    states = (h.our_state, h.their_state)
    if states == (h11.DONE, h11.DONE):
        h.start_next_cycle()  # keep-alive as h11 sees it: ready for the next request
        states = (h.our_state, h.their_state)
    return data, states, h.client_is_waiting_for_100_continue, any(used)


@pytest.mark.parametrize("response", sorted(RESPONSES))
@pytest.mark.parametrize("request_name", sorted(REQUESTS))
def test_direct_path_writes_what_h11_writes(request_name: str, response: str) -> None:
    for options in ({}, {"closing": True}, {"read_body": False}):
        via_h11 = serialize(request_name, response, direct=False, **options)
        direct = serialize(request_name, response, direct=True, **options)
        assert direct[:3] == via_h11[:3], options
        expected = (
            request_name in DIRECT_REQUESTS
            and (response in DIRECT_RESPONSES or (request_name, response) in DIRECT_PAIRS)
            and not options.get("closing")
        )
        assert direct[3] is expected, options


def test_direct_json_response_bytes() -> None:
    data, states, _, used = serialize("post", "json-200", direct=True)
    assert used
    assert data == (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"date: %s\r\n\r\n%s" % (len(JSON), DATE, JSON)
    )
    assert states == (h11.IDLE, h11.IDLE)


def test_streamed_responses_are_left_to_h11() -> None:
    conn = StubConnection(POST, read_body=True, closing=False)
    cycle = _Cycle.of(conn, conn.request)  # type: ignore[arg-type]
    cycle.pending = (200, [(b"content-type", b"text/event-stream")])
    used: list[bool] = []
    with direct_path(True, used):
        first = cycle._serialize(b"data: 1\n\n", True)
        last = cycle._serialize(b"", False)
    assert used == []
    assert first == (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ndate: %s\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n" % DATE
    )
    assert last == b"0\r\n\r\n"


# -- on the wire -----------------------------------------------------------------------------------


def mcp_request(body: bytes, method: str = "tools/call", *extra: str) -> bytes:
    head = [
        "POST /mcp HTTP/1.1",
        "Host: 127.0.0.1",
        "Content-Type: application/json",
        "Accept: application/json, text/event-stream",
        f"Mcp-Protocol-Version: {V}",
        f"Mcp-Method: {method}",
        *extra,
        f"Content-Length: {len(body)}",
    ]
    return "\r\n".join(head).encode() + b"\r\n\r\n" + body


def mcp_message(method: str, params: dict[str, Any], *, notification: bool = False) -> bytes:
    meta = {PROTOCOL_VERSION_KEY: V, CLIENT_CAPABILITIES_KEY: {}}
    message: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "params": {**params}}
    message["params"]["_meta"] = meta
    if not notification:
        message["id"] = 1
    return json.dumps(message).encode()


CALL = mcp_message("tools/call", {"name": "echo", "arguments": {"text": "hi"}})
WIRE_CASES: dict[str, tuple[bytes, str]] = {
    # name: (request bytes, the method h11 answers as for reading the response)
    "json-200": (mcp_request(CALL, "tools/call", "Mcp-Name: echo"), "POST"),
    "accepted-202": (
        mcp_request(
            mcp_message("notifications/cancelled", {"requestId": 9}, notification=True),
            "notifications/cancelled",
        ),
        "POST",
    ),
    "error-4xx": (mcp_request(b"{not json", "tools/call"), "POST"),
    "head": (b"HEAD /plain HTTP/1.1\r\nHost: x\r\n\r\n", "HEAD"),
    "head-mcp": (b"HEAD /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", "HEAD"),
    "sse": (b"GET /sse HTTP/1.1\r\nHost: x\r\n\r\n", "GET"),
    "http10": (b"GET /plain HTTP/1.0\r\n\r\n", "GET"),
    "http10-sse": (b"GET /sse HTTP/1.0\r\n\r\n", "GET"),
    "connection-close": (
        mcp_request(CALL, "tools/call", "Mcp-Name: echo", "Connection: close"),
        "POST",
    ),
}


def wire_app(mcp: App) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    transport = HttpTransport(mcp)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] == "/mcp":
            await transport(scope, receive, send)
            return
        start = {"type": "http.response.start", "status": 200}
        if scope["path"] == "/sse":
            await send({**start, "headers": [(b"content-type", b"text/event-stream")]})
            for index in range(3):
                chunk = b"data: %d\n\n" % index
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        await send({**start, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"plain body"})

    return app


async def exchange(address: tuple[str, int], request: bytes, method: str) -> tuple[bytes, bool]:
    """The raw bytes of the response to ``request``, and whether the server then closed."""
    stream = await trio.open_tcp_stream(*address)
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method=method, target="/", headers=[("host", "x")]))
    client.send(h11.EndOfMessage())
    raw = b""
    with trio.fail_after(5):
        await stream.send_all(request)
        while True:
            event = client.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                raw += data
                client.receive_data(data)
                continue
            if type(event) in (h11.EndOfMessage, h11.ConnectionClosed):
                break
        if client.their_state is h11.DONE:
            # Kept alive: nothing more arrives (the connection waits for another request).
            extra = b""
            with trio.move_on_after(0.05):
                extra = await stream.receive_some(65536)
            assert extra == b"", extra
            closed = False
        else:
            while data := await stream.receive_some(65536):
                raw += data  # (would make the comparison fail: nothing may follow)
            closed = True
    await stream.aclose()
    return raw, closed


@pytest.mark.parametrize("case", sorted(WIRE_CASES))
async def test_wire_bytes_are_the_same_with_and_without_the_direct_path(
    nursery: trio.Nursery, make_app: Callable[..., App], case: str
) -> None:
    mcp = make_app()

    @mcp.tool()
    async def echo(text: str) -> str:
        """Echo."""
        return text

    urls: list[str] = await nursery.start(
        functools.partial(serve, wire_app(mcp), "127.0.0.1", 0, config=ServerConfig(lifespan=False))
    )
    host, port = urls[0].removeprefix("http://").rsplit(":", 1)
    request, method = WIRE_CASES[case]
    results = []
    for enabled in (False, True):
        used: list[bool] = []
        with direct_path(enabled, used):
            raw, closed = await exchange((host, int(port)), request, method)
        results.append((raw, closed))
        if enabled:
            expect_direct = case in {"json-200", "accepted-202", "error-4xx", "head", "head-mcp"}
            assert any(used) is expect_direct
    assert results[0] == results[1]
    raw, closed = results[0]
    status, closes = WIRE_EXPECTED[case]
    assert raw.startswith(b"HTTP/1.1 %d " % status)
    assert closed is closes
    assert (b"Transfer-Encoding: chunked\r\n" in raw) is (case == "sse")


# name: (status, whether the server closes the connection after the response)
WIRE_EXPECTED = {
    "json-200": (200, False),
    "accepted-202": (202, False),
    "error-4xx": (400, False),
    "head": (200, False),
    "head-mcp": (405, False),
    "sse": (200, False),
    "http10": (200, True),
    "http10-sse": (200, True),
    "connection-close": (200, True),
}
