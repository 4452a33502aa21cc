"""``subscriptions/listen`` over tritask's HTTP server, handed off to the connection's task.

Once a listen stream is open, the exchange hands it to the server (``Context.hand_off``, the
``tritask.response_handoff`` extension): the request's frames are gone and the connection's one
task delivers the stream and watches the socket. These tests pin what that must keep: the
client going away releases the hub subscription, a normal end sends the final result and keeps
the connection, a stream that stalls is bounded by its hub buffer, and each stream costs one
trio task. (Delivery order and tasks across transports: tests/client/test_push_transports.py.)
"""

from __future__ import annotations

import functools
import json
import socket
from collections.abc import Callable

import trio
import trio.lowlevel
import trio.testing

from tritask import App
from tritask.transports.http import serve_http

V = "2026-07-28"


def _listen_request(port: int, request_id: str) -> bytes:
    body = json.dumps(
        {
            "jsonrpc": "2.0",
            "id": request_id,
            "method": "subscriptions/listen",
            "params": {
                "notifications": {"toolsListChanged": True},
                "_meta": {
                    "io.modelcontextprotocol/protocolVersion": V,
                    "io.modelcontextprotocol/clientCapabilities": {},
                },
            },
        }
    ).encode()
    head = (
        f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Accept: application/json, text/event-stream\r\nMcp-Protocol-Version: {V}\r\n"
        f"Mcp-Method: subscriptions/listen\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body


def _tools_list_request(port: int) -> bytes:
    body = json.dumps(
        {
            "jsonrpc": "2.0",
            "id": "list",
            "method": "tools/list",
            "params": {
                "_meta": {
                    "io.modelcontextprotocol/protocolVersion": V,
                    "io.modelcontextprotocol/clientCapabilities": {},
                }
            },
        }
    ).encode()
    head = (
        f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Accept: application/json, text/event-stream\r\nMcp-Protocol-Version: {V}\r\n"
        f"Mcp-Method: tools/list\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body


async def _serve(make_app: Callable[..., App], nursery: trio.Nursery) -> tuple[App, int]:
    app = make_app()

    @app.tool()
    async def noop() -> str:
        """Nothing."""
        return "ok"

    urls: list[str] = await nursery.start(functools.partial(serve_http, app, "127.0.0.1", 0))
    return app, int(urls[0].rsplit(":", 1)[1])


async def _until(received: bytearray, stream: trio.SocketStream, marker: bytes) -> None:
    while marker not in received:
        data = await stream.receive_some(65536)
        assert data, f"closed before {marker!r}"
        received += data


async def _open(port: int, request_id: str = "listen") -> tuple[trio.SocketStream, bytearray]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(_listen_request(port, request_id))
    received = bytearray()
    await _until(received, stream, b"notifications/subscriptions/acknowledged")
    return stream, received


async def test_a_client_going_away_releases_its_subscription(
    make_app: Callable[..., App], nursery: trio.Nursery
) -> None:
    app, port = await _serve(make_app, nursery)
    with trio.fail_after(10):
        stream, received = await _open(port)
        app.notify_tools_changed()
        await _until(received, stream, b"notifications/tools/list_changed")
        await trio.testing.wait_all_tasks_blocked()
        assert app.hub.subscriber_count == 1
        await stream.aclose()
        await trio.testing.wait_all_tasks_blocked()  # the idle connection task saw the EOF
        assert app.hub.subscriber_count == 0


async def test_an_ended_stream_sends_its_result_and_keeps_the_connection(
    make_app: Callable[..., App], nursery: trio.Nursery
) -> None:
    app, port = await _serve(make_app, nursery)
    with trio.fail_after(10):
        stream, received = await _open(port, "the-listen")
        await trio.testing.wait_all_tasks_blocked()
        app.hub.close()  # what a shutdown does: every stream ends with its result
        await _until(received, stream, b"0\r\n\r\n")  # the chunked body is complete
        events = [
            json.loads(line[len(b"data: ") :])
            for line in bytes(received).split(b"\n")
            if line.startswith(b"data: ")
        ]
        assert events[-1]["id"] == "the-listen"
        assert events[-1]["result"]["_meta"]["io.modelcontextprotocol/subscriptionId"] == (
            "the-listen"
        )
        await stream.send_all(_tools_list_request(port))  # the same connection
        after = bytearray()
        await _until(after, stream, b'"tools"')
        assert after.startswith(b"HTTP/1.1 200")
    await stream.aclose()


async def test_each_open_stream_costs_one_trio_task(
    make_app: Callable[..., App], nursery: trio.Nursery
) -> None:
    app, port = await _serve(make_app, nursery)
    with trio.fail_after(10):
        streams = [await _open(port, "first")]
        await trio.testing.wait_all_tasks_blocked()
        one = trio.lowlevel.current_statistics().tasks_living
        for index in range(10):
            streams.append(await _open(port, f"more-{index}"))
        await trio.testing.wait_all_tasks_blocked()
        assert trio.lowlevel.current_statistics().tasks_living == one + 10
        app.notify_tools_changed()
        for stream, received in streams:
            await _until(received, stream, b"notifications/tools/list_changed")
    for stream, _ in streams:
        await stream.aclose()


async def test_a_stalled_stream_is_bounded_and_released_when_its_client_goes(
    make_app: Callable[..., App], nursery: trio.Nursery
) -> None:
    app, port = await _serve(make_app, nursery)
    app.hub.buffer_size = 16
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    tsock = trio.socket.from_stdlib_socket(sock)
    with trio.fail_after(20):
        await tsock.connect(("127.0.0.1", port))
        await tsock.send(_listen_request(port, "stalled"))
        received = b""
        while b"notifications/subscriptions/acknowledged" not in received:
            received += await tsock.recv(4096)
        (subscription,) = app.hub._subscriptions
        # Unkeyed events cannot be coalesced: the stream fills the socket buffers, then its
        # hub buffer, and is closed by the hub instead of growing.
        published = 0
        while not subscription.overflowed:
            app.notify_tools_changed()
            published += 1
            await trio.lowlevel.checkpoint()  # the connection task writes what it can
            assert subscription.pending <= app.hub.buffer_size
        assert published > app.hub.buffer_size
        assert app.hub.subscriber_count == 0
        tsock.close()
        await trio.testing.wait_all_tasks_blocked()
        assert subscription.pending == 0  # closed by the connection task: nothing kept
