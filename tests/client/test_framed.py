"""The framed connection's routing, against a scripted peer that plays the server."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

from tritask.client import CancelledByServer, TransportError
from tritask.client._framed import FramedConnection
from tritask.client.stdio import read_lines


class Peer:
    """The server side: reads the client's frames, writes whatever the test says."""

    def __init__(self, send: trio.abc.SendStream, receive: trio.abc.ReceiveStream) -> None:
        self._send = send
        self._lines = read_lines(receive)

    async def read(self) -> dict[str, Any]:
        line = await self._lines.__anext__()
        frame: dict[str, Any] = json.loads(line)
        return frame

    async def write(self, *frames: Any) -> None:
        for frame in frames:
            text = frame if isinstance(frame, str) else json.dumps(frame)
            await self._send.send_all(text.encode() + b"\n")

    async def close(self) -> None:
        await self._send.aclose()


@asynccontextmanager
async def framed(buffer: int = 4) -> AsyncIterator[tuple[FramedConnection, Peer]]:
    to_peer_send, to_peer_receive = trio.testing.memory_stream_one_way_pair()
    to_client_send, to_client_receive = trio.testing.memory_stream_one_way_pair()

    async def send_text(text: str) -> None:
        await to_peer_send.send_all(text.encode() + b"\n")

    connection = FramedConnection(send_text, description="test", buffer=buffer)
    async with trio.open_nursery() as nursery:
        await nursery.start(connection.run, read_lines(to_client_receive))
        yield connection, Peer(to_client_send, to_peer_receive)
        nursery.cancel_scope.cancel()


def request(request_id: int, token: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {} if token is None else {"progressToken": token}
    return {"jsonrpc": "2.0", "id": request_id, "method": "x", "params": {"_meta": meta}}


async def test_frames_are_routed_by_id_token_and_subscription() -> None:
    with trio.fail_after(10):
        async with framed() as (connection, peer):
            async with (
                connection.exchange(request(1, "tok"), {}) as first,
                connection.exchange(request(2), {}) as second,
            ):
                assert (await peer.read())["id"] == 1
                assert (await peer.read())["id"] == 2
                await peer.write(
                    "not json",
                    {
                        "jsonrpc": "2.0",
                        "method": "notifications/progress",
                        "params": {"progressToken": "tok", "progress": 1},
                    },
                    {
                        "jsonrpc": "2.0",
                        "method": "notifications/tools/list_changed",
                        "params": {"_meta": {"io.modelcontextprotocol/subscriptionId": 2}},
                    },
                    {"jsonrpc": "2.0", "id": 2, "result": {"b": 2}},
                    {"jsonrpc": "2.0", "id": 1, "result": {"a": 1}},
                )
                assert (await first.receive())["method"] == "notifications/progress"
                assert (await first.receive())["result"] == {"a": 1}
                assert (await second.receive())["method"] == "notifications/tools/list_changed"
                assert (await second.receive())["result"] == {"b": 2}
            # Both were answered: leaving them sends no cancellation.
            async with connection.exchange(request(3), {}):
                assert (await peer.read())["id"] == 3


async def test_leaving_early_sends_notifications_cancelled() -> None:
    with trio.fail_after(10):
        async with framed() as (connection, peer):
            async with connection.exchange(request(7), {}):
                await peer.read()
            assert await peer.read() == {
                "jsonrpc": "2.0",
                "method": "notifications/cancelled",
                "params": {"requestId": 7, "reason": "The client stopped waiting"},
            }


async def test_a_slow_consumer_is_ended_not_buffered() -> None:
    with trio.fail_after(10):
        async with framed(buffer=4) as (connection, peer):
            async with connection.exchange(request(1), {}) as slow:
                await peer.read()
                tick = {
                    "jsonrpc": "2.0",
                    "method": "notifications/x",
                    "params": {"_meta": {"io.modelcontextprotocol/subscriptionId": 1}},
                }
                await peer.write(*[tick] * 10)
                # Another request on the connection is not held up by the slow one.
                async with connection.exchange(request(2), {}) as other:
                    await peer.read()
                    await peer.write({"jsonrpc": "2.0", "id": 2, "result": {}})
                    assert (await other.receive())["result"] == {}
                for _ in range(4):
                    assert (await slow.receive())["method"] == "notifications/x"
                with pytest.raises(TransportError, match="fell more than 4 frames behind"):
                    await slow.receive()
            assert (await peer.read())["method"] == "notifications/cancelled"


async def test_server_cancellation_ends_the_exchange() -> None:
    with trio.fail_after(10):
        async with framed() as (connection, peer), connection.exchange(request(5), {}) as listen:
            await peer.read()
            await peer.write(
                {
                    "jsonrpc": "2.0",
                    "method": "notifications/cancelled",
                    "params": {"requestId": 5},
                }
            )
            with pytest.raises(CancelledByServer):
                await listen.receive()


async def test_requests_from_the_server_are_refused() -> None:
    with trio.fail_after(10):
        async with framed() as (connection, peer), connection.exchange(request(1), {}) as exchange:
            await peer.read()
            await peer.write({"jsonrpc": "2.0", "id": "s1", "method": "roots/list"})
            assert await peer.read() == {
                "jsonrpc": "2.0",
                "id": "s1",
                "error": {"code": -32601, "message": "This client serves no requests"},
            }
            await peer.write({"jsonrpc": "2.0", "id": 1, "result": {}})
            assert (await exchange.receive())["result"] == {}


async def test_a_closed_connection_fails_open_and_new_exchanges() -> None:
    with trio.fail_after(10):
        async with framed() as (connection, peer):
            async with connection.exchange(request(1), {}) as exchange:
                await peer.read()
                await peer.close()
                with pytest.raises(TransportError, match="the server closed the connection"):
                    await exchange.receive()
            assert connection.closed
            with pytest.raises(TransportError, match="the server closed the connection"):
                async with connection.exchange(request(2), {}):
                    pass
