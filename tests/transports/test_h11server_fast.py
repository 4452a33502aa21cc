"""The lean server's request fast path reads what h11 reads, and leaves everything else to h11.

``_parse_simple`` reads a complete, plain request itself; for anything else it answers ``None``
and h11 reads the request (and decides its errors). These tests compare both: sans-IO on listed
and generated requests (what the fast path accepts, h11 reads the same way, and the listed
unusual ones are left to h11), then on the wire, where the same byte streams, in one write or
split across reads, must give the application the same requests and the client the same bytes
with the fast path on and off.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

import h11
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from tritask.transports import _h11server
from tritask.transports._h11server import ServerConfig, _parse_simple, serve

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
LIMIT = 16 * 1024
DATE = b"Thu, 01 Jan 2026 00:00:00 GMT"

POST = (
    b"POST /mcp HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: 2\r\n\r\n{}"
)


def via_h11(data: bytes) -> tuple[Any, ...] | str:
    """What h11 reads of the first request in ``data``: as ``_parse_simple`` returns it, or the
    name of what stopped it (an error, a need for more data, a pause)."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=LIMIT)
    conn.receive_data(data)
    try:
        request = conn.next_event()
        if type(request) is not h11.Request:
            return repr(request)
        chunks = []
        while True:
            event = conn.next_event()
            if type(event) is h11.Data:
                chunks.append(bytes(event.data))
                continue
            if type(event) is not h11.EndOfMessage:
                return repr(event)
            break
    except h11.RemoteProtocolError as error:
        return f"RemoteProtocolError {error.error_status_hint}"
    headers = [(bytes(name), bytes(value)) for name, value in request.headers]
    declared = next((int(value) for name, value in headers if name == b"content-length"), None)
    rest = conn.trailing_data[0]
    return (
        bytes(request.method),
        bytes(request.target),
        headers,
        declared,
        b"".join(chunks),
        rest,
        conn.their_state,
        conn.client_is_waiting_for_100_continue,
    )


def check(data: bytes) -> bool:
    """``_parse_simple`` agrees with h11 whenever it reads ``data``; whether it did."""
    simple = _parse_simple(data, LIMIT)
    if simple is None:
        return False
    expected = via_h11(data)
    assert isinstance(expected, tuple), (data, expected)
    # The fast path only reads requests h11 reads to their end, with nothing to wait for.
    assert expected[6] is h11.DONE and expected[7] is False, (data, expected)
    assert simple == expected[:6], data
    return True


def request(*lines: bytes, body: bytes = b"") -> bytes:
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


FAST = {
    "post": POST,
    "get-no-body": request(b"GET /mcp?x=1&y=%20 HTTP/1.1", b"Host: x"),
    "delete": request(b"DELETE /mcp HTTP/1.1", b"Host: x", b"Mcp-Session-Id: abc"),
    "lower-case-method": request(b"post /mcp HTTP/1.1", b"Host: x"),
    "keep-alive": request(b"POST / HTTP/1.1", b"Host: x", b"Connection: Keep-Alive"),
    "whitespace-around-values": request(
        b"POST / HTTP/1.1", b"Host:x", b"X-A: \t a \t b \t", b"X-Empty:", b"X-Spaces:   "
    ),
    "mixed-case-names": request(b"POST / HTTP/1.1", b"HOST: x", b"content-LENGTH: 3", body=b"abc"),
    "leading-zero-length": request(b"POST / HTTP/1.1", b"Host: x", b"Content-Length: 003") + b"abc",
    "zero-length": request(b"POST / HTTP/1.1", b"Host: x", b"Content-Length: 0"),
    "pipelined": POST + POST + b"GET / HT",
    "body-then-more": POST + b"garbage",
    "colon-in-value": request(b"POST / HTTP/1.1", b"Host: [::1]:8080", b"X-Url: http://a/b"),
    "many-headers": request(
        b"POST / HTTP/1.1", b"Host: x", *(b"X-%d: %d" % (i, i) for i in range(50))
    ),
}
# Left to h11 (which answers, refuses or waits for them as it always did).
SLOW = {
    "incomplete-head": POST[:40],
    "incomplete-body": POST[:-1],
    "no-head-end": b"POST / HTTP/1.1\r\nHost: x\r\n",
    "malformed-request-line": request(b"POST /mcp", b"Host: x"),
    "double-space": request(b"POST  /mcp HTTP/1.1", b"Host: x"),
    "garbage": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",
    "http-1.0": request(b"POST /mcp HTTP/1.0", b"Host: x", b"Content-Length: 2", body=b"{}"),
    "http-2-preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    "head": request(b"HEAD /mcp HTTP/1.1", b"Host: x"),
    "connect": request(b"CONNECT example.org:443 HTTP/1.1", b"Host: example.org:443"),
    "absolute-form": request(b"GET http://x/mcp HTTP/1.1", b"Host: x"),
    "asterisk": request(b"OPTIONS * HTTP/1.1", b"Host: x"),
    "obs-fold": request(b"POST / HTTP/1.1", b"Host: x", b"X-A: a", b" folded"),
    "obs-fold-tab": request(b"POST / HTTP/1.1", b"Host: x", b"X-A: a", b"\tfolded"),
    "fold-first": request(b"POST / HTTP/1.1", b" Host: x"),
    "duplicate-length": request(
        b"POST / HTTP/1.1", b"Host: x", b"Content-Length: 2", b"Content-Length: 2", body=b"{}"
    ),
    "conflicting-length": request(
        b"POST / HTTP/1.1", b"Host: x", b"Content-Length: 2", b"Content-Length: 3", body=b"{}x"
    ),
    "length-list": request(b"POST / HTTP/1.1", b"Host: x", b"Content-Length: 2, 2", body=b"{}"),
    "signed-length": request(b"POST / HTTP/1.1", b"Host: x", b"Content-Length: +2", body=b"{}"),
    "huge-length": request(b"POST / HTTP/1.1", b"Host: x", b"Content-Length: 1" + b"0" * 18),
    "chunked": request(b"POST / HTTP/1.1", b"Host: x", b"Transfer-Encoding: chunked")
    + b"2\r\n{}\r\n0\r\n\r\n",
    "chunked-and-length": request(
        b"POST / HTTP/1.1", b"Host: x", b"Transfer-Encoding: chunked", b"Content-Length: 2"
    )
    + b"2\r\n{}\r\n0\r\n\r\n",
    "gzip-coding": request(b"POST / HTTP/1.1", b"Host: x", b"Transfer-Encoding: gzip"),
    "expect-100": request(
        b"POST / HTTP/1.1", b"Host: x", b"Expect: 100-continue", b"Content-Length: 2", body=b"{}"
    ),
    "upgrade": request(b"GET / HTTP/1.1", b"Host: x", b"Connection: Upgrade", b"Upgrade: h2c"),
    "upgrade-alone": request(b"GET / HTTP/1.1", b"Host: x", b"Upgrade: websocket"),
    "connection-close": request(b"POST / HTTP/1.1", b"Host: x", b"Connection: close"),
    "connection-list": request(b"POST / HTTP/1.1", b"Host: x", b"Connection: keep-alive, TE"),
    "no-host": request(b"POST / HTTP/1.1", b"Content-Length: 0"),
    "two-hosts": request(b"POST / HTTP/1.1", b"Host: x", b"Host: y"),
    "space-before-colon": request(b"POST / HTTP/1.1", b"Host : x"),
    "no-colon": request(b"POST / HTTP/1.1", b"Host: x", b"X-A"),
    "empty-name": request(b"POST / HTTP/1.1", b"Host: x", b": a"),
    "bad-name": request(b"POST / HTTP/1.1", b"Host: x", b"X(A): a"),
    "bare-lf": b"POST / HTTP/1.1\nHost: x\n\n",
    "bare-lf-in-head": b"POST / HTTP/1.1\r\nHost: x\nX-A: a\r\n\r\n",
    "bare-cr": request(b"POST / HTTP/1.1", b"Host: x", b"X-A: a\rb"),
    "nul": request(b"POST / HTTP/1.1", b"Host: x", b"X-A: a\x00b"),
    "control-char": request(b"POST / HTTP/1.1", b"Host: x", b"X-A: a\x01b"),
    "del": request(b"POST / HTTP/1.1", b"Host: x", b"X-A: a\x7fb"),
    "obs-text": request(b"POST / HTTP/1.1", b"Host: x", b"X-A: caf\xc3\xa9"),
    "tab-in-target": request(b"POST /a\tb HTTP/1.1", b"Host: x"),
    "leading-crlf": b"\r\n" + POST,
    "oversized-head": request(b"POST / HTTP/1.1", b"Host: x", b"X-Big: " + b"a" * LIMIT),
}


@pytest.mark.parametrize("name", sorted(FAST))
def test_the_fast_path_reads_plain_requests_as_h11_does(name: str) -> None:
    assert check(FAST[name])


@pytest.mark.parametrize("name", sorted(SLOW))
def test_the_fast_path_leaves_unusual_requests_to_h11(name: str) -> None:
    assert _parse_simple(SLOW[name], LIMIT) is None


def test_a_head_of_at_most_the_limit_is_read_and_one_byte_more_is_not() -> None:
    base = request(b"POST / HTTP/1.1", b"Host: x", b"X-Pad: ")
    exact = request(b"POST / HTTP/1.1", b"Host: x", b"X-Pad: " + b"a" * (LIMIT - len(base)))
    assert len(exact) == LIMIT  # the head with its CRLF CRLF, no body
    assert check(exact)
    assert _parse_simple(exact, LIMIT - 1) is None


_PIECES = [
    b"POST",
    b"GET",
    b"HEAD",
    b"post",
    b"P(ST",
    b" ",
    b"  ",
    b"\t",
    b"/",
    b"/mcp?a=b",
    b"*",
    b"http://x/",
    b"HTTP/1.1",
    b"HTTP/1.0",
    b"\r\n",
    b"\n",
    b"\r",
    b"\x00",
    b"\x7f",
    b"\xc3\xa9",
    b"Host",
    b"host",
    b"Content-Length",
    b"Transfer-Encoding",
    b"Connection",
    b"Expect",
    b"Upgrade",
    b"X-A",
    b":",
    b": ",
    b"0",
    b"2",
    b"02",
    b"2, 2",
    b"-1",
    b"chunked",
    b"close",
    b"keep-alive",
    b"100-continue",
    b"x",
    b"{}",
    b"\r\n\r\n",
]


def _head_line(parts: list[bytes]) -> bytes:
    return b"".join(parts)


def usually(good: list[bytes], bad: list[bytes]) -> st.SearchStrategy[bytes]:
    """One of ``good`` most of the time, else one of ``bad``."""
    return st.tuples(st.integers(0, 9), st.sampled_from(good), st.sampled_from(bad)).map(
        lambda drawn: drawn[2] if drawn[0] == 9 else drawn[1]
    )


@st.composite
def near_requests(draw: st.DrawFn) -> bytes:
    """Mostly well-formed requests with a few pieces swapped for troublesome ones."""
    method = draw(usually([b"POST", b"GET", b"DELETE", b"post"], [b"HEAD", b"P(ST", b""]))
    target = draw(usually([b"/mcp", b"/", b"/a?b=c"], [b"*", b"http://x/", b"/a b", b""]))
    version = draw(usually([b"HTTP/1.1"], [b"HTTP/1.0", b"HTTP/2.0", b"http/1.1"]))
    lines = [method + b" " + target + b" " + version]
    if draw(usually([b"host"], [b""])):
        lines.append(b"Host: " + draw(usually([b"x", b"[::1]:80"], [b"", b"a b", b"x\x01"])))
    body = draw(usually([b"", b"{}", b"{}x"], [b"2\r\n{}\r\n0\r\n\r\n", b"{"]))
    if draw(usually([b"length"], [b""])):
        length = b"%d" % len(body)
        length = draw(usually([length, b"0" + length, b" " + length + b"\t"], [b"2, 2", b"+2"]))
        lines.insert(draw(st.integers(1, len(lines))), b"Content-Length: " + length)
    special = [b"Host", b"Content-Length", b"Transfer-Encoding", b"Expect", b"Upgrade"]
    names = usually(
        [b"X-A", b"x-b", b"Accept", b"Mcp-Method"], [*special, b"Connection", b"X A", b" X-B", b""]
    )
    bad_values = [b"close", b"chunked", b"100-continue", b"a\x01b", b"caf\xc3\xa9"]
    values = usually(
        [b"2", b"keep-alive", b"a b", b"\tx\t", b"", b"=?base64?YQ==?="],
        [*bad_values, b"a\rb", b"a\nb", b"1" * 19],
    )
    separators = usually([b":", b": ", b":\t"], [b" :", b""])
    for _ in range(draw(st.integers(0, 3))):
        lines.append(draw(names) + draw(separators) + draw(values))
    ending = draw(usually([b"\r\n"], [b"\n"]))
    head = ending.join(lines) + ending + ending
    return head + body + draw(usually([b"", head], [b"\r\n", b"x"]))


@settings(max_examples=400, deadline=None)
@given(near_requests())
def test_generated_requests_read_by_the_fast_path_read_the_same_in_h11(data: bytes) -> None:
    check(data)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=30))
def test_generated_byte_soup_read_by_the_fast_path_reads_the_same_in_h11(
    pieces: list[bytes],
) -> None:
    check(_head_line(pieces))
    check(b"POST / HTTP/1.1\r\nHost: x\r\n" + _head_line(pieces))


# -- on the wire -----------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def fixed_date(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_h11server, "_date_header", lambda: DATE)


@contextmanager
def fast_path(enabled: bool, used: list[bool]) -> Iterator[None]:
    """Turn the fast path off (h11 reads every request), and record when it read one."""
    original = _h11server._parse_simple

    def parse(data: bytes, limit: int) -> Any:
        result = original(data, limit) if enabled else None
        used.append(result is not None)
        return result

    _h11server._parse_simple = parse
    try:
        yield
    finally:
        _h11server._parse_simple = original


def recording_app(seen: list[Any]) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """Records every request as the application sees it; answers with what it read, as JSON
    or (for ``/sse``) streamed in two chunks."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        body = b""
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        seen.append(
            (
                scope["method"],
                scope["path"],
                scope["raw_path"],
                scope["query_string"],
                scope["http_version"],
                [(bytes(name), bytes(value)) for name, value in scope["headers"]],
                body,
            )
        )
        answer = b"%d:%s" % (len(seen), body)
        if scope["path"] == "/sse":
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")],
                }
            )
            await send({"type": "http.response.body", "body": answer, "more_body": True})
            await send({"type": "http.response.body", "body": b"end"})
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/plain")],
            }
        )
        await send({"type": "http.response.body", "body": answer})

    return app


async def converse(app: Any, writes: list[bytes], **config: Any) -> bytes:
    """Serve ``app``, send ``writes`` one after the other (a pause between, so that each is a
    read of its own), half-close, and return all the server wrote until it closed."""
    config.setdefault("lifespan", False)
    async with trio.open_nursery() as nursery:
        urls: list[str] = await nursery.start(
            functools.partial(serve, app, "127.0.0.1", 0, config=ServerConfig(**config))
        )
        host, port = urls[0].removeprefix("http://").rsplit(":", 1)
        stream = await trio.open_tcp_stream(host, int(port))
        received = b""

        async def read() -> None:
            nonlocal received
            while data := await stream.receive_some(65536):
                received += data

        with trio.fail_after(10):
            async with trio.open_nursery() as reading:
                reading.start_soon(read)
                for data in writes:
                    await stream.send_all(data)
                    await trio.sleep(0.02)
                await stream.send_eof()
        await stream.aclose()
        nursery.cancel_scope.cancel()
    return received


def sse(*lines: bytes, body: bytes = b"") -> bytes:
    return request(b"POST /sse HTTP/1.1", b"Host: x", *lines, body=body)


CHUNKED = request(b"POST /c HTTP/1.1", b"Host: x", b"Transfer-Encoding: chunked")
CONVERSATIONS: dict[str, tuple[list[bytes], list[bool]]] = {
    # name: (the client's writes, whether each request the server looked at was read fast)
    "one": ([POST], [True]),
    "pipelined": ([POST + sse(b"Content-Length: 1", body=b"a") + POST], [True, True, True]),
    "split-head": ([POST[:30], POST[30:]], [False]),
    "split-body": ([POST[:-1], POST[-1:]], [False]),
    "split-then-fast": ([POST[:30], POST[30:], POST], [False, True]),
    "split-pipelined": ([POST + POST[:30], POST[30:] + POST], [True, False]),
    "streamed-response-then-fast": ([sse(b"Content-Length: 0"), POST, POST], [True, True, True]),
    "malformed-request-line": ([request(b"POST /mcp", b"Host: x")], [False]),
    "after-fast-malformed": ([POST, request(b"POST /mcp", b"Host: x")], [True, False]),
    "obs-fold": ([request(b"POST / HTTP/1.1", b"Host: x", b"X-A: a", b" b"), POST], [False, True]),
    "duplicate-length": (
        [
            request(b"POST / HTTP/1.1", b"Host: x", b"Content-Length: 1", b"Content-Length: 1")
            + b"a"
            + POST
        ],
        [False],  # (the next request was buffered in h11: h11 reads it too)
    ),
    "conflicting-length": (
        [request(b"POST / HTTP/1.1", b"Host: x", b"Content-Length: 1", b"Content-Length: 2")],
        [False],
    ),
    "chunked": ([CHUNKED + b"2\r\n{}\r\n0\r\n\r\n" + POST], [False]),
    "chunked-then-fast": ([CHUNKED + b"2\r\n{}\r\n0\r\n\r\n", POST], [False, True]),
    "expect-100": (
        [
            request(b"POST / HTTP/1.1", b"Host: x", b"Expect: 100-continue", b"Content-Length: 2"),
            b"{}",
            POST,
        ],
        [False, True],
    ),
    "oversized-head": (
        [request(b"POST / HTTP/1.1", b"Host: x", b"X-Big: " + b"a" * LIMIT)],
        [False],
    ),
    "connection-close": (
        [request(b"POST / HTTP/1.1", b"Host: x", b"Connection: close") + POST],
        [False],
    ),
    "http-1.0": ([request(b"GET / HTTP/1.0") + POST], [False]),
    "head": ([request(b"HEAD / HTTP/1.1", b"Host: x"), POST], [False, True]),
    "no-host": ([request(b"POST / HTTP/1.1", b"Content-Length: 0")], [False]),
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
async def test_the_wire_is_the_same_with_and_without_the_fast_path(name: str) -> None:
    writes, expected_fast = CONVERSATIONS[name]
    outcomes = []
    for enabled in (False, True):
        seen: list[Any] = []
        used: list[bool] = []
        with fast_path(enabled, used):
            received = await converse(recording_app(seen), writes)
        outcomes.append((received, seen))
        if enabled:
            assert used == expected_fast
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0]  # every conversation gets an answer (a refusal at least)


async def test_pipelined_fast_requests_are_answered_in_order() -> None:
    seen: list[Any] = []
    used: list[bool] = []
    bodies = [b'{"n":%d}' % n for n in range(20)]
    writes = [
        b"".join(
            request(b"POST / HTTP/1.1", b"Host: x", b"Content-Length: %d" % len(b), body=b)
            for b in bodies
        )
    ]
    with fast_path(True, used):
        received = await converse(recording_app(seen), writes)
    assert [entry[-1] for entry in seen] == bodies
    assert used == [True] * 20
    answers = [b"%d:%s" % (n + 1, body) for n, body in enumerate(bodies)]
    expected = b"".join(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\ndate: %s\r\n\r\n%s"
        % (len(answer), DATE, answer)
        for answer in answers
    )
    assert received == expected


async def test_a_streamed_response_to_a_fast_request_is_framed_by_h11() -> None:
    seen: list[Any] = []
    used: list[bool] = []
    with fast_path(True, used):
        received = await converse(recording_app(seen), [sse(b"Content-Length: 2", body=b"{}")])
    assert used == [True]
    assert received == (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ndate: %s\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n4\r\n1:{}\r\n3\r\nend\r\n0\r\n\r\n" % DATE
    )
