"""The lean HTTP/1.1 server (``tritask.transports._h11server``) over real loopback sockets.

Most tests serve small ASGI applications written here, to pin the server's own behaviour
(framing, keep-alive, pipelining, limits, shutdown); the last ones serve tritask's Streamable
HTTP application through ``serve_http`` (disconnect cancellation, SSE streaming, the hypercorn
option).
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any, Literal

import h11
import httpx
import pytest
import trio
import trio.testing

from tritask.protocol.meta import CLIENT_CAPABILITIES_KEY, PROTOCOL_VERSION_KEY
from tritask.server import App, Context
from tritask.transports._h11server import HANDOFF_EXTENSION, WATCH_EXTENSION, ServerConfig, serve
from tritask.transports.http import serve_http

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
V = "2026-07-28"


# -- helpers ---------------------------------------------------------------------------------------


async def start(nursery: trio.Nursery, app: Any, **config: Any) -> tuple[str, int]:
    """Serve ``app`` in ``nursery`` on a free loopback port; returns ``(host, port)``."""
    config.setdefault("lifespan", False)
    urls: list[str] = await nursery.start(
        functools.partial(serve, app, "127.0.0.1", 0, config=ServerConfig(**config))
    )
    host, port = urls[0].removeprefix("http://").rsplit(":", 1)
    return host, int(port)


class Client:
    """One TCP connection driven by h11 (or by raw bytes)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.conn = h11.Connection(h11.CLIENT)

    @classmethod
    async def connect(cls, address: tuple[str, int]) -> Client:
        return cls(await trio.open_tcp_stream(*address))

    async def send(self, *events: Any) -> None:
        await self.stream.send_all(b"".join(self.conn.send(event) or b"" for event in events))

    async def request(
        self,
        target: str = "/",
        body: bytes = b"",
        method: str = "POST",
        headers: list[tuple[str, str]] | None = None,
    ) -> None:
        pairs = [("host", "127.0.0.1"), ("content-length", str(len(body))), *(headers or [])]
        await self.send(
            h11.Request(method=method, target=target, headers=pairs),
            h11.Data(data=body),
            h11.EndOfMessage(),
        )

    async def event(self) -> Any:
        while True:
            event = self.conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            self.conn.receive_data(await self.stream.receive_some(65536))

    async def response(self) -> tuple[h11.Response, bytes]:
        response = await self.event()
        while isinstance(response, h11.InformationalResponse):
            response = await self.event()
        assert isinstance(response, h11.Response), response
        parts: list[bytes] = []
        while True:
            event = await self.event()
            if isinstance(event, h11.EndOfMessage):
                return response, b"".join(parts)
            assert isinstance(event, h11.Data), event
            parts.append(bytes(event.data))

    def next_cycle(self) -> None:
        self.conn.start_next_cycle()

    def expect_response(self, method: str = "POST") -> None:
        """Ready to read one more response to a request that was sent as raw bytes."""
        leftover = self.conn.trailing_data[0]
        self.conn = h11.Connection(h11.CLIENT)
        self.conn.send(h11.Request(method=method, target="/", headers=[("host", "x")]))
        self.conn.send(h11.EndOfMessage())
        if leftover:  # (receiving b"" would mean EOF)
            self.conn.receive_data(leftover)

    async def raw_until_closed(self) -> bytes:
        """Everything the server still sends, until it closes the connection."""
        data = b""
        while chunk := await self.stream.receive_some(65536):
            data += chunk
        return data

    async def aclose(self) -> None:
        await self.stream.aclose()


def header(response: h11.Response, name: str) -> str | None:
    for key, value in response.headers:
        if key.decode() == name:
            return value.decode()
    return None


async def read_body(receive: Receive) -> bytes:
    body: bytes = b""
    while True:
        message = await receive()
        assert message["type"] == "http.request", message
        body += message["body"]
        if not message["more_body"]:
            return body


async def respond(send: Send, body: bytes, status: int = 200, **extra: bytes) -> None:
    headers = [(b"content-type", b"text/plain"), *((k.encode(), v) for k, v in extra.items())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def echo_app(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers ``METHOD PATH client-port body`` in one go."""
    body = await read_body(receive)
    client_port = str(scope["client"][1]).encode()
    text = b" ".join([scope["method"].encode(), scope["raw_path"], client_port, body])
    await respond(send, text)


# -- keep-alive, pipelining, framing ---------------------------------------------------------------


async def test_keep_alive_reuses_the_connection(nursery: trio.Nursery) -> None:
    address = await start(nursery, echo_app)
    client = await Client.connect(address)
    local_port = client.stream.socket.getsockname()[1]
    with trio.fail_after(5):
        for index in range(3):
            await client.request(f"/r{index}", b"x" * index)
            response, body = await client.response()
            assert response.status_code == 200
            assert header(response, "connection") is None
            assert body == f"POST /r{index} {local_port} {'x' * index}".encode()
            client.next_cycle()
    await client.aclose()


async def test_pipelined_requests_are_answered_in_order(nursery: trio.Nursery) -> None:
    order: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        order.append(scope["path"])
        await read_body(receive)
        if scope["path"] == "/slow":
            await trio.sleep(0.05)  # the next requests are already buffered meanwhile
        await respond(send, scope["path"].encode())

    address = await start(nursery, app)
    stream = await trio.open_tcp_stream(*address)
    paths = ["/slow", "/a", "/b", "/c"]
    wire = b"".join(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\n{path[:3]:3}".encode()
        for path in paths
    )
    client = Client(stream)
    with trio.fail_after(5):
        await stream.send_all(wire)  # all four requests in one write
        for path in paths:
            client.expect_response()
            response, body = await client.response()
            assert (response.status_code, body) == (200, path.encode())
    assert order == paths
    await client.aclose()


async def test_content_length_when_whole_and_chunked_when_streamed(
    nursery: trio.Nursery,
) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        start = {"type": "http.response.start", "status": 200, "headers": []}
        if scope["path"] == "/whole":
            await send(start)
            await send({"type": "http.response.body", "body": b"0123456789"})
        elif scope["path"] == "/own-length":
            await send({**start, "headers": [(b"Content-Length", b"3")]})
            await send({"type": "http.response.body", "body": b"abc"})
        elif scope["path"] == "/empty":
            await send({**start, "status": 202})
            await send({"type": "http.response.body", "body": b""})
        else:
            await send(start)
            for part in (b"ab", b"", b"cd"):
                await send({"type": "http.response.body", "body": part, "more_body": True})
            await send({"type": "http.response.body", "body": b"e"})

    address = await start(nursery, app)
    stream = await trio.open_tcp_stream(*address)
    client = Client(stream)
    with trio.fail_after(5):
        for path in ("/whole", "/own-length", "/empty", "/streamed"):
            await stream.send_all(
                f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n".encode()
            )
            client.expect_response()
            response, body = await client.response()
            headers = {k.decode(): v.decode() for k, v in response.headers}
            if path == "/whole":
                assert headers["content-length"] == "10" and body == b"0123456789"
                assert "transfer-encoding" not in headers
            elif path == "/own-length":
                assert [k for k, _ in response.headers].count(b"content-length") == 1
                assert body == b"abc"
            elif path == "/empty":
                assert response.status_code == 202 and headers["content-length"] == "0"
            else:
                assert headers["transfer-encoding"] == "chunked"
                assert "content-length" not in headers
                assert body == b"abcde"
    await stream.aclose()


async def test_request_body_arrives_in_pieces_with_more_body(nursery: trio.Nursery) -> None:
    seen: list[tuple[bytes, bool]] = []
    first = trio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            seen.append((message["body"], message["more_body"]))
            first.set()
            if not message["more_body"]:
                break
        await respond(send, b"".join(body for body, _ in seen))

    address = await start(nursery, app)
    client = await Client.connect(address)
    with trio.fail_after(5):
        await client.send(
            h11.Request(
                method="POST",
                target="/",
                headers=[("host", "x"), ("transfer-encoding", "chunked")],
            ),
            h11.Data(data=b"first"),
        )
        await first.wait()
        await client.send(h11.Data(data=b"second"), h11.EndOfMessage())
        _, body = await client.response()
    assert body == b"firstsecond"
    assert seen[0] == (b"first", True)
    assert seen[-1][1] is False
    await client.aclose()


async def test_head_gets_the_length_without_a_body(nursery: trio.Nursery) -> None:
    address = await start(nursery, echo_app)
    client = await Client.connect(address)
    with trio.fail_after(5):
        await client.send(
            h11.Request(method="HEAD", target="/h", headers=[("host", "x")]), h11.EndOfMessage()
        )
        response, body = await client.response()
        assert body == b""
        assert int(header(response, "content-length") or 0) > 0
        client.next_cycle()
        await client.request("/after")  # the connection is still in step
        response, body = await client.response()
        assert body.startswith(b"POST /after")
    await client.aclose()


async def test_application_errors_become_500(nursery: trio.Nursery) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] == "/raise":
            raise RuntimeError("boom")
        await read_body(receive)  # returns without answering

    address = await start(nursery, app)
    client = await Client.connect(address)
    with trio.fail_after(5):
        for path in ("/raise", "/silent"):
            await client.request(path)
            response, _ = await client.response()
            assert response.status_code == 500
            client.next_cycle()
    await client.aclose()


async def test_unread_request_body_is_discarded_to_keep_the_connection(
    nursery: trio.Nursery,
) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, b"not reading that", status=404)

    address = await start(nursery, app)
    client = await Client.connect(address)
    with trio.fail_after(5):
        for _ in range(2):
            await client.request("/", b"y" * 1000)
            response, _ = await client.response()
            assert response.status_code == 404
            assert header(response, "connection") is None
            client.next_cycle()
    await client.aclose()


async def test_answer_before_a_large_body_closes_the_connection(nursery: trio.Nursery) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, b"too large", status=413)

    address = await start(nursery, app, drain_limit=1024)
    client = await Client.connect(address)
    with trio.fail_after(5):
        await client.send(
            h11.Request(
                method="POST", target="/", headers=[("host", "x"), ("content-length", "100000")]
            ),
            h11.Data(data=b"z" * 100),
        )
        response, body = await client.response()
        assert response.status_code == 413 and body == b"too large"
        assert header(response, "connection") == "close"
        assert await client.raw_until_closed() == b""
    await client.aclose()


# -- 100-continue ----------------------------------------------------------------------------------


async def test_100_continue_is_sent_when_the_body_is_wanted(nursery: trio.Nursery) -> None:
    address = await start(nursery, echo_app)
    client = await Client.connect(address)
    with trio.fail_after(5):
        await client.send(
            h11.Request(
                method="POST",
                target="/c",
                headers=[("host", "x"), ("content-length", "4"), ("expect", "100-continue")],
            )
        )
        interim = await client.event()
        assert isinstance(interim, h11.InformationalResponse)
        assert interim.status_code == 100
        await client.send(h11.Data(data=b"body"), h11.EndOfMessage())
        response, body = await client.response()
        assert response.status_code == 200 and body.endswith(b" body")
        client.next_cycle()
        await client.request("/again")
        assert (await client.response())[0].status_code == 200
    await client.aclose()


async def test_no_100_continue_when_refused_without_reading(nursery: trio.Nursery) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, b"no", status=417)

    address = await start(nursery, app)
    client = await Client.connect(address)
    with trio.fail_after(5):
        await client.send(
            h11.Request(
                method="POST",
                target="/",
                headers=[("host", "x"), ("content-length", "4"), ("expect", "100-continue")],
            )
        )
        event = await client.event()
        assert isinstance(event, h11.Response) and event.status_code == 417
        assert header(event, "connection") == "close"
    await client.aclose()


# -- limits and malformed input --------------------------------------------------------------------


async def test_oversized_headers_get_431(nursery: trio.Nursery) -> None:
    address = await start(nursery, echo_app, max_incomplete_event_size=1024)
    stream = await trio.open_tcp_stream(*address)
    with trio.fail_after(5):
        await stream.send_all(b"POST / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 4096)
        client = Client(stream)
        data = await client.raw_until_closed()
    assert data.startswith(b"HTTP/1.1 431 ")
    assert b"connection: close" in data.lower()
    await stream.aclose()


async def test_malformed_request_line_gets_400(nursery: trio.Nursery) -> None:
    address = await start(nursery, echo_app)
    stream = await trio.open_tcp_stream(*address)
    with trio.fail_after(5):
        await stream.send_all(b"THIS IS NOT HTTP\r\n\r\n")
        data = await Client(stream).raw_until_closed()
    assert data.startswith(b"HTTP/1.1 400 ")
    await stream.aclose()


async def test_idle_keep_alive_connection_is_closed(nursery: trio.Nursery) -> None:
    address = await start(nursery, echo_app, keep_alive_timeout=0.2)
    client = await Client.connect(address)
    with trio.fail_after(5):
        await client.request("/")
        await client.response()
        started = trio.current_time()
        assert await client.raw_until_closed() == b""
    assert trio.current_time() - started >= 0.15
    await client.aclose()
    silent = await Client.connect(address)  # never sends anything
    with trio.fail_after(5):
        assert await silent.raw_until_closed() == b""
    await silent.aclose()


async def test_a_long_request_is_not_cut_by_the_idle_timeout(nursery: trio.Nursery) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        await trio.sleep(0.5)
        await respond(send, b"late")

    address = await start(nursery, app, keep_alive_timeout=0.1)
    client = await Client.connect(address)
    with trio.fail_after(5):
        await client.request("/")
        assert (await client.response())[1] == b"late"
    await client.aclose()


# -- disconnects -----------------------------------------------------------------------------------


async def test_client_disconnect_cancels_the_watched_scope(nursery: trio.Nursery) -> None:
    started, cancelled = trio.Event(), trio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        assert WATCH_EXTENSION in scope["extensions"]
        await read_body(receive)
        handler = trio.CancelScope()
        await send({"type": WATCH_EXTENSION, "cancel_scope": handler})
        with handler:
            started.set()
            await trio.sleep_forever()
        cancelled.set()
        await respond(send, b"nobody listens")  # a no-op, not an error

    address = await start(nursery, app)
    client = await Client.connect(address)
    with trio.fail_after(5):
        await client.request("/")
        await started.wait()
    await client.aclose()
    with trio.fail_after(2):
        await cancelled.wait()


async def test_client_disconnect_is_an_http_disconnect(nursery: trio.Nursery) -> None:
    got: list[MutableMapping[str, Any]] = []
    done = trio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        got.append(await receive())  # blocks until the peer goes away
        done.set()

    address = await start(nursery, app)
    client = await Client.connect(address)
    with trio.fail_after(5):
        await client.request("/")
        await trio.sleep(0.05)
        assert not got
    await client.aclose()
    with trio.fail_after(2):
        await done.wait()
    assert got == [{"type": "http.disconnect"}]


async def test_watch_ticks_until_the_response_is_complete(nursery: trio.Nursery) -> None:
    ticks: list[float] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)

        async def tick() -> None:
            ticks.append(trio.current_time())

        await send(
            {
                "type": WATCH_EXTENSION,
                "cancel_scope": trio.CancelScope(),
                "interval": 0.05,
                "tick": tick,
            }
        )
        await trio.sleep(0.3)
        await respond(send, b"done")

    address = await start(nursery, app)
    client = await Client.connect(address)
    with trio.fail_after(5):
        await client.request("/")
        assert (await client.response())[1] == b"done"
        count = len(ticks)
        await trio.sleep(0.2)
    assert 3 <= count <= 7
    assert len(ticks) == count  # none after the response
    await client.aclose()


# -- the hand-off extension ------------------------------------------------------------------------


class Source:
    """A ``ResponseSource`` fed by the test: chunks put in, then the end."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.done = False
        self.wake: Callable[[], None] | None = None
        self.closes = 0
        self.closed = trio.Event()

    @property
    def ready(self) -> bool:
        return bool(self.chunks) or self.done

    def set_waker(self, wake: Callable[[], None] | None) -> None:
        self.wake = wake
        if wake is not None and self.ready:
            self._wake()

    def _wake(self) -> None:
        wake, self.wake = self.wake, None
        if wake is not None:
            wake()

    def put(self, chunk: bytes) -> None:
        self.chunks.append(chunk)
        self._wake()

    def finish(self) -> None:
        self.done = True
        self._wake()

    async def next_chunk(self) -> tuple[bytes, bool]:
        if self.chunks:
            return self.chunks.pop(0), True
        return (b"end", False) if self.done else (b"", True)

    def close(self) -> None:
        self.closes += 1
        self.closed.set()


def handing_off(source: Source, **extra: Any) -> Any:
    """An app that starts a stream, writes ``first``, hands ``source`` off and returns;
    other paths are echoed."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] != "/stream":
            await echo_app(scope, receive, send)
            return
        assert HANDOFF_EXTENSION in scope["extensions"]
        await read_body(receive)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first ", "more_body": True})
        await send({"type": HANDOFF_EXTENSION, "source": source, **extra})

    return app


async def test_a_handed_off_response_is_driven_by_one_task_then_the_connection_is_reused(
    nursery: trio.Nursery,
) -> None:
    source = Source()
    address = await start(nursery, handing_off(source))
    client = await Client.connect(address)
    with trio.fail_after(5):
        await client.request("/echo")
        await client.response()
        client.next_cycle()
        await trio.testing.wait_all_tasks_blocked()
        idle = trio.lowlevel.current_statistics().tasks_living  # the connection and its reader
        await client.request("/stream")
        response = await client.event()
        assert isinstance(response, h11.Response)
        assert (await client.event()).data == b"first "
        await trio.testing.wait_all_tasks_blocked()
        # The application has returned and the reading task ended: the connection's own task
        # serves the stream (and watches the socket) alone.
        assert trio.lowlevel.current_statistics().tasks_living == idle - 1
        source.put(b"a ")
        assert (await client.event()).data == b"a "
        source.put(b"b ")
        source.finish()
        rest = b""
        while not isinstance(event := await client.event(), h11.EndOfMessage):
            rest += bytes(event.data)
        assert rest == b"b end"
        await source.closed.wait()
        client.next_cycle()
        await client.request("/again", b"x")  # the same connection, reading again
        assert (await client.response())[1].startswith(b"POST /again")
    assert source.closes == 1
    await client.aclose()


async def test_the_peer_going_away_closes_a_handed_off_source(nursery: trio.Nursery) -> None:
    source = Source()
    address = await start(nursery, handing_off(source))
    client = await Client.connect(address)
    with trio.fail_after(5):
        await client.request("/stream")
        await client.event()
        assert (await client.event()).data == b"first "
        await trio.testing.wait_all_tasks_blocked()
        assert source.closes == 0
        await client.aclose()
        await source.closed.wait()  # while idle: the wait on the socket saw the EOF
    assert source.closes == 1


async def test_a_handed_off_response_sends_its_keepalive_on_the_timer(
    nursery: trio.Nursery,
) -> None:
    source = Source()
    address = await start(nursery, handing_off(source, interval=0.01, keepalive=b": k\n"))
    client = await Client.connect(address)
    with trio.fail_after(5):
        await client.request("/stream")
        await client.event()
        assert (await client.event()).data == b"first "
        assert (await client.event()).data == b": k\n"
        assert (await client.event()).data == b": k\n"
        source.finish()
        while not isinstance(await client.event(), h11.EndOfMessage):
            pass
    await client.aclose()


async def test_cancelling_the_server_closes_a_handed_off_source() -> None:
    source = Source()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            address = await start(nursery, handing_off(source))
            client = await Client.connect(address)
            await client.request("/stream")
            await client.event()
            assert (await client.event()).data == b"first "
            await trio.testing.wait_all_tasks_blocked()  # handed off: the server holds it
            nursery.cancel_scope.cancel()
        await client.aclose()
    assert source.closes == 1


async def test_cancelling_the_server_while_a_tick_still_runs_closes_a_handed_off_source() -> None:
    """The reading task ends by itself after a hand-off, but not in the middle of a tick (a
    keep-alive written to a client that reads nothing blocks): cancelled while waiting for it,
    the connection still owns the source and must close it."""
    source = Source()
    ticking = trio.Event()

    async def tick() -> None:
        ticking.set()
        await trio.sleep_forever()  # as a keep-alive write to a client reading nothing does

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first ", "more_body": True})
        await send({"type": WATCH_EXTENSION, "tick": tick, "interval": 0.01})
        await ticking.wait()
        await send({"type": HANDOFF_EXTENSION, "source": source})

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            address = await start(nursery, app)
            client = await Client.connect(address)
            await client.request("/stream")
            await client.event()
            assert (await client.event()).data == b"first "
            await ticking.wait()
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
        await client.aclose()
    assert source.closes == 1


async def test_a_body_after_a_hand_off_is_refused(nursery: trio.Nursery) -> None:
    source = Source()
    errors: list[Exception] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await handing_off(source)(scope, receive, send)
        try:
            await send({"type": "http.response.body", "body": b"late"})
        except RuntimeError as error:
            errors.append(error)
        source.finish()

    address = await start(nursery, app)
    client = await Client.connect(address)
    with trio.fail_after(5):
        await client.request("/stream")
        assert (await client.response())[1] == b"first end"
        await source.closed.wait()  # the server closes it right after the last write
    assert len(errors) == 1
    assert source.closes == 1
    await client.aclose()


# -- graceful shutdown -----------------------------------------------------------------------------


async def test_graceful_shutdown_lets_an_in_flight_request_finish() -> None:
    entered, release, stop = trio.Event(), trio.Event(), trio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        if scope["path"] == "/slow":
            entered.set()
            await release.wait()
        await respond(send, b"finished")

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            urls: list[str] = await nursery.start(
                functools.partial(
                    serve,
                    app,
                    "127.0.0.1",
                    0,
                    config=ServerConfig(graceful_timeout=5),
                    shutdown_trigger=stop.wait,
                )
            )
            host, port = urls[0].removeprefix("http://").rsplit(":", 1)
            address = (host, int(port))
            busy, idle = await Client.connect(address), await Client.connect(address)
            await idle.request("/quick")
            assert (await idle.response())[1] == b"finished"
            await busy.request("/slow")
            await entered.wait()
            stop.set()
            assert await idle.raw_until_closed() == b""  # idle connections close at once
            with pytest.raises(OSError):
                await trio.open_tcp_stream(*address)  # no longer accepting
            release.set()
            response, body = await busy.response()
            assert (response.status_code, body) == (200, b"finished")
            assert header(response, "connection") == "close"
            assert await busy.raw_until_closed() == b""
        # serve() returned on its own: the nursery did not need cancelling
        await busy.aclose()
        await idle.aclose()


async def test_graceful_shutdown_cancels_what_outlives_the_grace_period() -> None:
    entered, cancelled, stop = trio.Event(), trio.Event(), trio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        entered.set()
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            urls: list[str] = await nursery.start(
                functools.partial(
                    serve,
                    app,
                    "127.0.0.1",
                    0,
                    config=ServerConfig(graceful_timeout=0.2, lifespan=False),
                    shutdown_trigger=stop.wait,
                )
            )
            host, port = urls[0].removeprefix("http://").rsplit(":", 1)
            client = await Client.connect((host, int(port)))
            await client.request("/")
            await entered.wait()
            stop.set()
        assert cancelled.is_set()
        await client.aclose()


async def test_lifespan_runs_around_serving() -> None:
    phases: list[str] = []
    stop = trio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                phases.append(message["type"])
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        await echo_app(scope, receive, send)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(
                functools.partial(serve, app, "127.0.0.1", 0, shutdown_trigger=stop.wait)
            )
            assert phases == ["lifespan.startup"]
            stop.set()
    assert phases == ["lifespan.startup", "lifespan.shutdown"]


# -- tritask's Streamable HTTP application on it ---------------------------------------------------


def mcp_body(method: str, params: dict[str, Any], **meta: Any) -> bytes:
    message = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": method,
        "params": {
            **params,
            "_meta": {PROTOCOL_VERSION_KEY: V, CLIENT_CAPABILITIES_KEY: {}, **meta},
        },
    }
    return json.dumps(message).encode()


def mcp_headers(method: str, name: str | None = None) -> list[tuple[str, str]]:
    headers = [
        ("content-type", "application/json"),
        ("accept", "application/json, text/event-stream"),
        ("mcp-protocol-version", V),
        ("mcp-method", method),
    ]
    if name is not None:
        headers.append(("mcp-name", name))
    return headers


class Steps:
    def __init__(self) -> None:
        self.advance = [trio.Event() for _ in range(3)]
        self.reported = [trio.Event() for _ in range(3)]
        self.cancelled = trio.Event()
        self.started = trio.Event()


@pytest.fixture
def steps() -> Steps:
    return Steps()


@pytest.fixture
def mcp_app(make_app: Callable[..., App], steps: Steps) -> App:
    app = make_app()

    @app.tool()
    async def echo(text: str) -> str:
        """Echo."""
        return text

    @app.tool()
    async def paced(ctx: Context) -> str:
        """Report progress one step at a time, as the test allows."""
        for index, event in enumerate(steps.advance):
            await event.wait()
            await ctx.progress(index + 1, len(steps.advance))
        return "paced"

    @app.tool()
    async def hang() -> str:
        """Wait until cancelled."""
        steps.started.set()
        try:
            await trio.sleep_forever()
        finally:
            steps.cancelled.set()

    return app


@pytest.fixture
async def mcp_address(nursery: trio.Nursery, mcp_app: App) -> tuple[str, int]:
    urls: list[str] = await nursery.start(functools.partial(serve_http, mcp_app, "127.0.0.1", 0))
    host, port = urls[0].removeprefix("http://").rsplit(":", 1)
    return host, int(port)


async def sse_events(client: Client) -> AsyncIterator[bytes]:
    """The SSE blocks of a streamed response, as each one arrives."""
    buffer = b""
    while True:
        event = await client.event()
        if isinstance(event, h11.EndOfMessage):
            assert buffer == b""
            return
        assert isinstance(event, h11.Data), event
        buffer += bytes(event.data)
        while b"\n\n" in buffer:
            block, buffer = buffer.split(b"\n\n", 1)
            yield block


async def test_sse_frames_arrive_incrementally(mcp_address: tuple[str, int], steps: Steps) -> None:
    client = await Client.connect(mcp_address)
    body = mcp_body("tools/call", {"name": "paced"}, progressToken="p")
    with trio.fail_after(5):
        await client.request("/mcp", body, headers=mcp_headers("tools/call", "paced"))
        steps.advance[0].set()
        response = await client.event()
        assert isinstance(response, h11.Response)
        assert header(response, "content-type") == "text/event-stream"
        assert header(response, "transfer-encoding") == "chunked"
        events = sse_events(client)
        for index in range(3):
            block = await events.__anext__()
            data = json.loads(block.split(b"data: ", 1)[1])
            assert data["method"] == "notifications/progress"
            assert data["params"]["progress"] == index + 1
            if index + 1 < 3:
                # The next frame is not produced before the test allows it.
                assert not steps.advance[index + 1].is_set()
                steps.advance[index + 1].set()
        final = json.loads((await events.__anext__()).split(b"data: ", 1)[1])
        assert final["result"]["content"] == [{"type": "text", "text": "paced"}]
        with pytest.raises(StopAsyncIteration):
            await events.__anext__()
    await client.aclose()


async def test_json_answer_has_content_length_and_keeps_the_connection(
    mcp_address: tuple[str, int],
) -> None:
    client = await Client.connect(mcp_address)
    with trio.fail_after(5):
        for text in ("one", "two"):
            body = mcp_body("tools/call", {"name": "echo", "arguments": {"text": text}})
            await client.request("/mcp", body, headers=mcp_headers("tools/call", "echo"))
            response, payload = await client.response()
            assert response.status_code == 200
            assert header(response, "content-type") == "application/json"
            assert header(response, "content-length") == str(len(payload))
            assert header(response, "transfer-encoding") is None
            assert json.loads(payload)["result"]["content"][0]["text"] == text
            client.next_cycle()
    await client.aclose()


async def test_disconnect_mid_request_cancels_the_tool(
    mcp_address: tuple[str, int], steps: Steps
) -> None:
    client = await Client.connect(mcp_address)
    with trio.fail_after(5):
        await client.request(
            "/mcp",
            mcp_body("tools/call", {"name": "hang"}),
            headers=mcp_headers("tools/call", "hang"),
        )
        await steps.started.wait()
    assert not steps.cancelled.is_set()
    await client.aclose()
    with trio.fail_after(2):
        await steps.cancelled.wait()


@pytest.mark.parametrize("server", ["tritask", "hypercorn"])
async def test_serve_http_on_either_server(
    nursery: trio.Nursery, mcp_app: App, server: Literal["tritask", "hypercorn"]
) -> None:
    urls: list[str] = await nursery.start(
        functools.partial(serve_http, mcp_app, "127.0.0.1", 0, server=server)
    )
    body = mcp_body("tools/call", {"name": "echo", "arguments": {"text": server}})
    headers = dict(mcp_headers("tools/call", "echo"))
    async with httpx.AsyncClient(timeout=10) as http:
        response = await http.post(urls[0] + "/mcp", content=body, headers=headers)
    assert response.status_code == 200
    assert response.json()["result"]["content"][0]["text"] == server
    # The application states the length itself, so no server sends a JSON answer chunked.
    assert response.headers["content-length"] == str(len(response.content))
    assert "transfer-encoding" not in response.headers


async def test_serve_http_refuses_an_unknown_server(mcp_app: App) -> None:
    with pytest.raises(ValueError, match="unknown HTTP server"):
        await serve_http(mcp_app, server="nginx")  # type: ignore[arg-type]


# -- hot-path shortcuts agree with what they stand for ---------------------------------------------


async def test_has_capability_agrees_with_capabilities(make_app: Callable[..., App]) -> None:
    app = make_app()
    names = ("tools", "prompts", "resources", "completions", "extensions", "logging", "other")

    def check() -> None:
        listed = app.capabilities()
        assert {name: app.has_capability(name) for name in names} == {
            name: name in listed for name in names
        }

    check()

    async def tool() -> str:
        """A tool."""
        return ""

    app.add_tool(tool)
    check()

    @app.prompt()
    async def prompt() -> str:
        return ""

    @app.resource("res://{item}")
    async def template(item: str) -> str:
        return item

    check()

    @app.completion("ref/prompt", "prompt")
    async def complete(name: str, value: str, context: dict[str, str]) -> list[str]:
        return []

    app.capability_overrides["logging"] = {}
    check()
    app.remove_tool("tool")
    app.remove_prompt("prompt")
    check()
