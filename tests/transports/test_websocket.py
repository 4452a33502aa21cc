"""The WebSocket transport over a real socket: call, progress, cancellation and listen.

Localhost only, port 0; the server runs in the test's nursery and a trio-websocket client
talks to it. Every I/O wait has an absolute ``fail_after``; nothing asserts on timing.
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing
import trio_websocket
from transport_app import Probe
from transport_app import build_app as build_transport_app

from tritask.server.app import App
from tritask.transports.websocket import origin_allowed, serve_websocket

META = {
    "io.modelcontextprotocol/protocolVersion": "2026-07-28",
    "io.modelcontextprotocol/clientCapabilities": {},
}
SUB = "io.modelcontextprotocol/subscriptionId"
SERVER_INFO = {"io.modelcontextprotocol/serverInfo": {"name": "ws-test", "version": "1.0.0"}}


def request(request_id: int | str, method: str, **params: Any) -> str:
    meta = dict(META)
    meta.update(params.pop("_meta", {}))
    message: dict[str, Any] = {"jsonrpc": "2.0", "id": request_id, "method": method}
    message["params"] = {**params, "_meta": meta}
    return json.dumps(message)


def cancel(request_id: int | str) -> str:
    params = {"requestId": request_id}
    return json.dumps({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": params})


def build_app(probe: Probe) -> App:
    return build_transport_app(probe, "ws-test")


async def receive(ws: trio_websocket.WebSocketConnection) -> dict[str, Any]:
    with trio.fail_after(10):
        frame = await ws.get_message()
    assert isinstance(frame, str)
    value = json.loads(frame)
    assert isinstance(value, dict)
    return value


@asynccontextmanager
async def ws_server(app: App, **options: Any) -> AsyncIterator[str]:
    async with trio.open_nursery() as nursery:
        with trio.fail_after(10):
            url: str = await nursery.start(
                functools.partial(serve_websocket, app, "127.0.0.1", 0, **options)
            )
        yield url
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def client(url: str, **options: Any) -> AsyncIterator[trio_websocket.WebSocketConnection]:
    async with trio_websocket.open_websocket_url(url, connect_timeout=10, **options) as ws:
        yield ws


async def test_reports_a_ws_url_on_the_bound_port() -> None:
    async with ws_server(build_app(Probe())) as url:
        assert url.startswith("ws://127.0.0.1:")
        assert url.endswith("/")
        assert int(url.removeprefix("ws://127.0.0.1:").rstrip("/")) > 0


async def test_call_round_trip() -> None:
    async with ws_server(build_app(Probe())) as url, client(url) as ws:
        await ws.send_message(request(1, "tools/call", name="echo", arguments={"text": "hi"}))
        assert await receive(ws) == {
            "jsonrpc": "2.0",
            "id": 1,
            "result": {
                "content": [{"type": "text", "text": "hi"}],
                "isError": False,
                "resultType": "complete",
                "_meta": SERVER_INFO,
            },
        }


async def test_progress_then_result() -> None:
    async with ws_server(build_app(Probe())) as url, client(url) as ws:
        progress_meta = {"progressToken": 42}
        await ws.send_message(
            request("s", "tools/call", name="steps", arguments={}, _meta=progress_meta)
        )
        assert await receive(ws) == {
            "jsonrpc": "2.0",
            "method": "notifications/progress",
            "params": {"progressToken": 42, "progress": 1, "total": 2, "message": "half"},
        }
        assert await receive(ws) == {
            "jsonrpc": "2.0",
            "method": "notifications/progress",
            "params": {"progressToken": 42, "progress": 2, "total": 2},
        }
        response = await receive(ws)
        assert response["id"] == "s"
        assert response["result"]["content"] == [{"type": "text", "text": "done"}]


async def test_cancellation_stops_the_handler_and_nothing_is_sent_for_its_id() -> None:
    probe = Probe()
    async with ws_server(build_app(probe)) as url, client(url) as ws:
        await ws.send_message(request(1, "tools/call", name="block", arguments={}))
        with trio.fail_after(10):
            await probe.started.wait()
        await ws.send_message(cancel(1))
        with trio.fail_after(10):
            await probe.saw_cancelled.wait()
        await ws.send_message(request(2, "tools/call", name="echo", arguments={"text": "next"}))
        response = await receive(ws)
        assert response["id"] == 2
        assert response["result"]["content"] == [{"type": "text", "text": "next"}]


async def test_listen_stream_is_tagged_and_ends_with_result_then_cancelled() -> None:
    app = build_app(Probe())
    async with ws_server(app) as url, client(url) as ws:
        await ws.send_message(
            request("sub-1", "subscriptions/listen", notifications={"toolsListChanged": True})
        )
        assert await receive(ws) == {
            "jsonrpc": "2.0",
            "method": "notifications/subscriptions/acknowledged",
            "params": {"_meta": {SUB: "sub-1"}, "notifications": {"toolsListChanged": True}},
        }
        app.notify_tools_changed()
        assert await receive(ws) == {
            "jsonrpc": "2.0",
            "method": "notifications/tools/list_changed",
            "params": {"_meta": {SUB: "sub-1"}},
        }
        app.hub.close()
        assert await receive(ws) == {
            "jsonrpc": "2.0",
            "id": "sub-1",
            "result": {"_meta": {SUB: "sub-1", **SERVER_INFO}, "resultType": "complete"},
        }
        assert await receive(ws) == {
            "jsonrpc": "2.0",
            "method": "notifications/cancelled",
            "params": {"requestId": "sub-1", "reason": "The server closed the subscription"},
        }


async def test_closing_the_connection_cancels_its_requests() -> None:
    probe = Probe()
    app = build_app(probe)
    async with ws_server(app) as url:
        async with client(url) as ws:
            await ws.send_message(request(1, "tools/call", name="block", arguments={}))
            await ws.send_message(
                request(2, "subscriptions/listen", notifications={"toolsListChanged": True})
            )
            assert (await receive(ws))["method"] == "notifications/subscriptions/acknowledged"
            with trio.fail_after(10):
                await probe.started.wait()
        with trio.fail_after(10):
            await probe.saw_cancelled.wait()
        # both requests were cancelled together; let the listen task finish its cleanup
        await trio.testing.wait_all_tasks_blocked()
        assert app.hub.subscriber_count == 0


async def test_bad_frames_get_errors() -> None:
    async with ws_server(build_app(Probe())) as url, client(url) as ws:
        await ws.send_message("{oops")
        assert await receive(ws) == {
            "jsonrpc": "2.0",
            "id": None,
            "error": {"code": -32700, "message": "Parse error: the message is not valid JSON"},
        }
        await ws.send_message(b'{"jsonrpc":"2.0","id":1,"method":"tools/list"}')
        assert await receive(ws) == {
            "jsonrpc": "2.0",
            "id": None,
            "error": {
                "code": -32600,
                "message": "Invalid request: binary frames are not supported; send text",
            },
        }
        await ws.send_message(json.dumps({"jsonrpc": "2.0", "id": 9, "method": 3}))
        assert await receive(ws) == {
            "jsonrpc": "2.0",
            "id": 9,
            "error": {
                "code": -32600,
                "message": 'Invalid request: "method" must be a non-empty string',
            },
        }


async def test_oversize_message_closes_with_1009() -> None:
    async with ws_server(build_app(Probe()), max_message_bytes=1024) as url, client(url) as ws:
        await ws.send_message(request(1, "tools/call", name="echo", arguments={"text": "x" * 2000}))
        with trio.fail_after(10), pytest.raises(trio_websocket.ConnectionClosed) as closed:
            await ws.get_message()
        assert closed.value.reason is not None
        assert closed.value.reason.code == 1009


async def test_foreign_origin_is_refused_and_mcp_subprotocol_accepted() -> None:
    async with ws_server(build_app(Probe())) as url:
        with pytest.raises(trio_websocket.ConnectionRejected) as rejected:
            async with client(url, extra_headers=[(b"Origin", b"https://evil.example")]):
                pass
        assert rejected.value.status_code == 403
        headers = [(b"Origin", b"http://localhost:3000")]
        async with client(url, extra_headers=headers, subprotocols=["mcp"]) as ws:
            assert ws.subprotocol == "mcp"
            await ws.send_message(request(1, "tools/list"))
            assert (await receive(ws))["id"] == 1


def test_origin_rule() -> None:
    assert origin_allowed(None, None)
    assert origin_allowed("http://127.0.0.1:8080", None)
    assert origin_allowed("https://[::1]", None)
    assert not origin_allowed("https://localhost.evil.example", None)
    assert not origin_allowed("null", None)
    assert origin_allowed("https://app.example", ("https://app.example",))
    assert not origin_allowed("http://localhost", ("https://app.example",))


@asynccontextmanager
async def stoppable_server(app: App, **options: Any) -> AsyncIterator[tuple[str, trio.Event]]:
    """A server with a shutdown trigger; leaving the block asserts it returned by itself."""
    trigger = trio.Event()
    returned = trio.Event()

    async def run(task_status: trio.TaskStatus[str]) -> None:
        await serve_websocket(
            app,
            "127.0.0.1",
            0,
            shutdown_trigger=trigger.wait,
            task_status=task_status,
            **options,
        )
        returned.set()

    async with trio.open_nursery() as nursery:
        with trio.fail_after(10):
            url: str = await nursery.start(run)
        yield url, trigger
        with trio.fail_after(10):
            await returned.wait()
    # the nursery was never cancelled: serve_websocket ended because of its trigger


async def closed_code(ws: trio_websocket.WebSocketConnection) -> int:
    """Read until the server closes the connection; the close code it sent."""
    with trio.fail_after(10):
        while True:
            try:
                await ws.get_message()
            except trio_websocket.ConnectionClosed as closed:
                assert closed.reason is not None
                return closed.reason.code


async def test_shutdown_answers_the_call_in_flight_then_closes_connections_with_1001() -> None:
    probe = Probe()
    server = stoppable_server(build_app(probe))
    async with server as (url, trigger), client(url) as busy, client(url) as idle:
        await busy.send_message(request(1, "tools/call", name="block", arguments={}))
        with trio.fail_after(10):
            await probe.started.wait()
        trigger.set()
        # The idle connection goes away at once, while the call is still running.
        assert await closed_code(idle) == 1001
        assert busy.closed is None
        with pytest.raises((OSError, trio_websocket.HandshakeError)):
            async with client(url):
                pass  # the listener is closed: no new connection
        probe.release.set()
        response = await receive(busy)
        assert response["id"] == 1
        assert response["result"]["content"] == [{"type": "text", "text": "released"}]
        assert await closed_code(busy) == 1001
    assert not probe.saw_cancelled.is_set()


async def test_shutdown_cancels_what_outlives_the_grace_and_still_closes_with_1001() -> None:
    probe = Probe()
    server = stoppable_server(build_app(probe), graceful_timeout=0)
    async with server as (url, trigger), client(url) as ws:
        await ws.send_message(request(1, "tools/call", name="block", arguments={}))
        with trio.fail_after(10):
            await probe.started.wait()
        trigger.set()
        assert await closed_code(ws) == 1001
        assert probe.saw_cancelled.is_set()


async def test_a_peer_that_leaves_during_the_grace_has_its_requests_cancelled() -> None:
    probe = Probe()
    async with stoppable_server(build_app(probe)) as (url, trigger), client(url) as idle:
        async with client(url) as busy:
            await busy.send_message(request(1, "tools/call", name="block", arguments={}))
            with trio.fail_after(10):
                await probe.started.wait()
            trigger.set()
            assert await closed_code(idle) == 1001  # the shutdown is under way
        # busy closed its side: nobody is left to read the answer
        with trio.fail_after(10):
            await probe.saw_cancelled.wait()


async def test_shutdown_ends_listen_streams_and_closes_with_1001() -> None:
    app = build_app(Probe())
    async with stoppable_server(app) as (url, trigger), client(url) as ws:
        await ws.send_message(
            request("sub-1", "subscriptions/listen", notifications={"toolsListChanged": True})
        )
        assert (await receive(ws))["method"] == "notifications/subscriptions/acknowledged"
        trigger.set()
        # A listen stream never finishes by itself, so it does not hold the shutdown up: it
        # ends at once (as on a stdio EOF) and the 1001 close is the client's notice.
        assert await closed_code(ws) == 1001
    assert app.hub.subscriber_count == 0
