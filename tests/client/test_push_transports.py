"""``notifications/tasks`` pushed to listen streams over a real HTTP socket, stdio framing and
a real WebSocket, followed with the tritask client.

A listener receives every committed status of its tasks in order, ending with the terminal
one, and nothing of other tasks or other scopes. A listener that stops reading does not grow
the server's memory (tracemalloc, while megabytes of notifications are produced for it).
"""

from __future__ import annotations

import functools
import gc
import json
import socket
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from client_support import stdio_in_process

from tritask import App, Context
from tritask.client import Client, connect
from tritask.jsonrpc import JSONValue
from tritask.server.mrtr import elicitation
from tritask.tasks import MemoryStore, Runner, Tasks
from tritask.tasks.changes import TaskChange
from tritask.tasks.store import Action
from tritask.transports.http import serve_http
from tritask.transports.websocket import serve_websocket

TRANSPORTS = ("http", "stdio", "websocket")
TASKS_META: dict[str, Any] = {"extensions": {"io.modelcontextprotocol/tasks": {}}}


def tenant(ctx: Any) -> JSONValue:
    """The store scope: the client's name (each test client names its tenant)."""
    info = ctx.meta.client_info or {}
    name: JSONValue = info.get("name")
    return name


@attrs.define
class Served:
    app: App
    tasks: Tasks
    store: MemoryStore
    runner: Runner
    gates: dict[str, trio.Event]


@asynccontextmanager
async def served_app(make_app: Callable[..., App], **tasks_options: Any) -> AsyncIterator[Served]:
    app = make_app("push-tests", "1.0.0")
    gates: dict[str, trio.Event] = {}

    @app.tool()
    async def rounds(ctx: Context, count: int = 2, pad: int = 0) -> str:
        """Waits for its gate, then asks ``count`` questions in turn (each with a ``pad``
        entries long list in its schema: every copy of the task holds that list of its own)."""
        assert ctx.task_id is not None
        await gates.setdefault(ctx.task_id, trio.Event()).wait()
        schema: dict[str, JSONValue] = {"type": "object"}
        if pad:
            schema["x-pad"] = [0] * pad
        for index in range(count):
            await ctx.await_input(f"q{index}", elicitation(f"Question {index}?", schema))
        return f"answered {count}"

    store = MemoryStore(scope=tenant, max_active_tasks_per_scope=None)
    async with store, Runner(store, reap_interval_ms=None, max_jobs=100) as runner:
        tasks = Tasks(
            store=store, runner=runner, task_support={"rounds": "required"}, **tasks_options
        )
        app.add_extension(tasks)
        yield Served(app, tasks, store, runner, gates)


@pytest.fixture
def open_client(
    request: pytest.FixtureRequest,
    nursery: trio.Nursery,
    http_server: Callable[..., Awaitable[str]],
) -> Callable[..., Any]:
    """``open_client(app, tenant)`` over the parametrized transport."""
    urls: dict[int, str] = {}

    @asynccontextmanager
    async def opened(app: App, name: str) -> AsyncIterator[Client]:
        options: dict[str, Any] = {
            "client_info": {"name": name, "version": "1.0"},
            "elicitation": _never,
        }
        transport = request.param
        if transport == "stdio":
            async with stdio_in_process(app, **options) as client:
                await client.discover()
                yield client
            return
        if id(app) not in urls:
            if transport == "http":
                urls[id(app)] = await http_server(app) + "/mcp"
            else:
                urls[id(app)] = await nursery.start(
                    functools.partial(serve_websocket, app, "127.0.0.1", 0)
                )
        async with connect(urls[id(app)], **options) as client:
            yield client

    return opened


async def _never(request: Any) -> dict[str, Any]:
    raise AssertionError("the listener answers nothing itself")


@attrs.define
class Seen:
    """The ``notifications/tasks`` one listen stream received, in order."""

    frames: list[dict[str, Any]] = attrs.field(factory=list)
    changed: trio.Event = attrs.field(factory=trio.Event)

    def add(self, params: dict[str, Any]) -> None:
        self.frames.append(params)
        self.changed.set()
        self.changed = trio.Event()

    def statuses(self) -> list[tuple[str, str]]:
        return [(f["taskId"], f["status"]) for f in self.frames]

    async def until(self, predicate: Callable[[list[dict[str, Any]]], bool]) -> None:
        with trio.fail_after(30):
            while not predicate(self.frames):
                await self.changed.wait()


def _asking(task_id: str, key: str) -> Callable[[list[dict[str, Any]]], bool]:
    def found(frames: list[dict[str, Any]]) -> bool:
        return (
            bool(frames)
            and frames[-1]["taskId"] == task_id
            and key in frames[-1].get("inputRequests", {})
        )

    return found


async def _wait_status(client: Client, task_id: str, status: str) -> None:
    with trio.fail_after(30):
        while True:
            if (await client.task(task_id).status()).status == status:
                return
            await trio.sleep(0.01)


ACCEPT = {"action": "accept"}
BUFFER = 16


@pytest.mark.parametrize("open_client", TRANSPORTS, indirect=True)
async def test_a_listener_receives_every_status_in_order_and_nothing_else(
    make_app: Callable[..., App], open_client: Callable[..., Any], nursery: trio.Nursery
) -> None:
    async with (
        served_app(make_app) as served,
        open_client(served.app, "alice") as alice,
        open_client(served.app, "bob") as bob,
    ):
        watched = (await alice.start_tool("rounds", {"count": 2})).task_id
        unwatched = (await alice.start_tool("rounds", {"count": 1})).task_id
        foreign = (await bob.start_tool("rounds", {"count": 1})).task_id
        assert watched and unwatched and foreign
        seen = Seen()
        opened = trio.Event()
        done = trio.Event()
        accepted: list[str] = []

        async def listen() -> None:
            async with alice.listen(task_ids=[watched, foreign, unwatched[:-1]]) as stream:
                accepted.extend(stream.task_ids)
                opened.set()
                async for notification in stream:
                    assert notification.method == "notifications/tasks"
                    seen.add(notification.params)
                    if notification.params["status"] == "completed":
                        break
            done.set()

        nursery.start_soon(listen)
        with trio.fail_after(30):
            await opened.wait()
        assert accepted == [watched]  # the foreign and the unknown id are dropped silently
        await seen.until(lambda frames: len(frames) == 1)
        # The other tasks move first (anything of theirs would arrive before the end).
        for client, task_id in ((alice, unwatched), (bob, foreign)):
            served.gates.setdefault(task_id, trio.Event()).set()
            await _wait_status(client, task_id, "input_required")
            await client.task(task_id).respond("q0", ACCEPT)
            await _wait_status(client, task_id, "completed")
        served.gates.setdefault(watched, trio.Event()).set()
        for key in ("q0", "q1"):
            await seen.until(_asking(watched, key))
            await alice.task(watched).respond(key, ACCEPT)
        with trio.fail_after(30):
            await done.wait()
    assert seen.statuses() == [
        (watched, "working"),
        (watched, "input_required"),
        (watched, "working"),
        (watched, "input_required"),
        (watched, "working"),
        (watched, "completed"),
    ]
    assert [sorted(f.get("inputRequests", {})) for f in seen.frames] == [
        [],
        ["q0"],
        [],
        ["q1"],
        [],
        [],
    ]
    assert seen.frames[-1]["result"]["content"] == [{"type": "text", "text": "answered 2"}]


# -- a listener that stops reading --------------------------------------------------------------


async def _stalled_http_listen(url: str, task_ids: list[str]) -> socket.socket:
    """Open a listen stream by hand on a socket with a tiny receive buffer, read its
    acknowledgement, and then never read again."""
    host, port = url.removeprefix("http://").split("/")[0].split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    tsock = trio.socket.from_stdlib_socket(sock)
    await tsock.connect((host, int(port)))
    body = json.dumps(
        {
            "jsonrpc": "2.0",
            "id": "stalled",
            "method": "subscriptions/listen",
            "params": {
                "notifications": {"taskIds": task_ids},
                "_meta": {
                    "io.modelcontextprotocol/protocolVersion": "2026-07-28",
                    "io.modelcontextprotocol/clientCapabilities": TASKS_META,
                    "io.modelcontextprotocol/clientInfo": {"name": "alice", "version": "1"},
                },
            },
        }
    ).encode()
    head = (
        f"POST /mcp HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        "Accept: application/json, text/event-stream\r\nMcp-Protocol-Version: 2026-07-28\r\n"
        f"Mcp-Method: subscriptions/listen\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    await tsock.send(head + body)
    received = b""
    with trio.fail_after(10):
        while b"notifications/subscriptions/acknowledged" not in received:
            received += await tsock.recv(4096)
    return sock


async def _grown(make_app: Callable[..., App], nursery: trio.Nursery, *, stalled: bool) -> int:
    """Bytes the process grew (tracemalloc) while 8 tasks went through 30 input rounds, each
    notification over 12 KiB on the wire and each copy of a task holding 32 KiB of its own,
    with a listen stream on all of them that stopped reading (``stalled``) or with none. The
    store keeps every round's request in its ledger either way."""
    tasks_count, rounds, warmup, pad = 8, 40, 10, 4_000
    async with served_app(make_app) as served:
        served.app.hub.buffer_size = BUFFER
        urls: list[str] = await nursery.start(
            functools.partial(serve_http, served.app, "127.0.0.1", 0)
        )
        url = urls[0] + "/mcp"
        ctx = type("Ctx", (), {"meta": type("Meta", (), {"client_info": {"name": "alice"}})()})()
        ids = []
        async with connect(
            url, client_info={"name": "alice", "version": "1"}, elicitation=_never
        ) as alice:
            for _ in range(tasks_count):
                call = await alice.start_tool("rounds", {"count": rounds, "pad": pad})
                assert call.task_id is not None
                ids.append(call.task_id)
        sock = await _stalled_http_listen(url, ids) if stalled else None

        asked: dict[tuple[str, str], trio.Event] = {}

        def on_change(change: TaskChange) -> None:
            if change.task is not None:
                for key in change.task.input_requests:
                    asked.setdefault((change.task.id, key), trio.Event()).set()

        served.runner.watch(on_change)

        async def drive(first: int, last: int) -> None:
            for index in range(first, last):
                for task_id in ids:
                    with trio.fail_after(30):
                        await asked.setdefault((task_id, f"q{index}"), trio.Event()).wait()
                    access = await served.store.authorize(ctx, Action.UPDATE, task_id)
                    await served.runner.update(task_id, {f"q{index}": ACCEPT}, access)

        for task_id in ids:
            served.gates.setdefault(task_id, trio.Event()).set()
        try:
            await drive(0, warmup)  # fills the socket buffers: a stalled stream is stuck now
            if sock is not None:
                (subscription,) = served.app.hub._subscriptions
                assert subscription.pending > 0  # it really is behind
            gc.collect()
            tracemalloc.start()
            try:
                before = tracemalloc.get_traced_memory()[0]
                await drive(warmup, rounds)
                gc.collect()
                after = tracemalloc.get_traced_memory()[0]
            finally:
                tracemalloc.stop()
            if sock is not None:
                (subscription,) = served.app.hub._subscriptions
                assert subscription.pending <= served.app.hub.buffer_size
        finally:
            if sock is not None:
                sock.close()
        produced = (rounds - warmup) * tasks_count * 2 * len(json.dumps([0] * pad))
        assert produced > 5 * 2**20  # what the stalled stream was sent and never read
        return after - before


async def test_a_listener_that_stops_reading_does_not_grow_server_memory(
    make_app: Callable[..., App], nursery: trio.Nursery
) -> None:
    without = await _grown(make_app, nursery, stalled=False)
    with_stalled = await _grown(make_app, nursery, stalled=True)
    # The stalled stream holds at most the hub's buffer (16 changes, each a task of 32 KiB
    # shared with every other stream): about 0.5 MiB. Holding every change it was sent (480
    # tasks, 15 MiB), or their notifications (5.6 MiB of JSON), fails this.
    assert with_stalled - without < 3 * 2**20, (without, with_stalled)
