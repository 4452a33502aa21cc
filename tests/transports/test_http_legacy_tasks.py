"""Tasks for initialize-era clients over Streamable HTTP, on real sockets.

The same rules as ``test_legacy_tasks`` (stdio), where HTTP adds something of its own: a task
tool waited for streams its progress and its server-initiated requests on the call's SSE
response, answered by POST; ``tasks/get|list|cancel`` answer JSON and ``tasks/result`` SSE
(input is side-channelled there); ``notifications/tasks/status`` and the progress of a
task-augmented call come on the session's standalone GET stream; a disconnect or an ended
session leaves the task running, ``notifications/cancelled`` cancels it; one session never
reaches another's tasks.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import trio
from test_http import Raw, header
from test_http_legacy import (
    NAME_FORM,
    V0618,
    V1125,
    Server,
    connected,
    iter_events,
    messages,
    parse_events,
    rpc,
)

from tritask.server import App, Context
from tritask.server.mrtr import elicitation
from tritask.tasks.extension import Tasks, principal_scope
from tritask.tasks.memory import MemoryStore
from tritask.tasks.runner import Runner
from tritask.tasks.store import Action, NotFound
from tritask.transports.http import HttpOptions

RELATED = "io.modelcontextprotocol/related-task"
ANONYMOUS = SimpleNamespace(principal=None)
CLIENT_TASKS: dict[str, Any] = {"list": {}, "cancel": {}}


class Probe:
    def __init__(self) -> None:
        self.started = trio.Event()
        self.release = trio.Event()
        self.cancelled = trio.Event()
        self.finished = trio.Event()


class Ids:
    def __init__(self) -> None:
        self.issued: list[str] = []

    def __call__(self) -> str:
        self.issued.append(f"http-task-{len(self.issued) + 1}")
        return self.issued[-1]


class World:
    def __init__(self, app: App, tasks: Tasks, memory: MemoryStore, probe: Probe, ids: Ids):
        self.app, self.tasks, self.memory, self.probe, self.ids = app, tasks, memory, probe, ids

    async def status(self, task_id: str) -> str | None:
        access = await self.memory.authorize(ANONYMOUS, Action.GET, task_id)
        snapshot = await self.memory.get(task_id, access)
        return None if isinstance(snapshot, NotFound) else snapshot.task.status.value

    async def wait_status(self, task_id: str, status: str) -> None:
        with trio.fail_after(10):
            for _ in range(100_000):
                if await self.status(task_id) == status:
                    return
                await trio.sleep(0.01)


@pytest.fixture
async def world(nursery: trio.Nursery, make_app: Callable[..., App]) -> World:
    probe = Probe()
    app = make_app()

    @app.tool()
    async def quick(ctx: Context, label: str = "q") -> str:
        """Two progress steps."""
        await ctx.progress(1, 2)
        await trio.sleep(0.01)
        await ctx.progress(2, 2)
        return f"quick {label}"

    @app.tool()
    async def ask(ctx: Context) -> str:
        """Parks for the user's name."""
        answer = await ctx.await_input("who", elicitation("Your name?", NAME_FORM))
        content = answer.get("content") or {}
        assert isinstance(content, dict)
        return f"{answer.get('action')}: {content.get('name')}"

    @app.tool()
    async def wait(ctx: Context) -> str:
        """Runs until released, recording cancellation."""
        probe.started.set()
        try:
            await probe.release.wait()
        except trio.Cancelled:
            probe.cancelled.set()
            raise
        finally:
            probe.finished.set()
        return "released"

    @app.tool()
    async def echo(text: str) -> str:
        """Not a task tool."""
        return text

    memory = MemoryStore(scope=principal_scope)
    runner = Runner(memory, reap_interval_ms=None)
    await nursery.start(runner.run)
    ids = Ids()
    tasks = Tasks(
        store=memory,
        runner=runner,
        id_generator=ids,
        task_support={"quick": "optional", "ask": "required", "wait": "optional"},
    )
    app.add_extension(tasks)
    return World(app, tasks, memory, probe, ids)


@pytest.fixture
async def server(http_server: Callable[..., Awaitable[str]], world: World) -> AsyncIterator[Server]:
    async with httpx.AsyncClient(timeout=10) as client:
        yield Server(await http_server(world.app, HttpOptions(sse_retry_ms=50)), client, world.app)


def result_of(events: list[Any]) -> Any:
    return messages(events)[-1]


def text(value: str, *, error: bool = False) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": value}], "isError": error}


# -- task tools waited for -------------------------------------------------------------------------


@pytest.mark.parametrize("version", [V0618, V1125])
async def test_a_task_tool_is_waited_for_with_progress_on_the_call_stream(
    server: Server, world: World, version: str
) -> None:
    client = await connected(server, version)
    events = await client.call(1, "quick", arguments={}, _meta={"progressToken": "p"})
    assert messages(events) == [
        {
            "jsonrpc": "2.0",
            "method": "notifications/progress",
            "params": {"progressToken": "p", "progress": 1, "total": 2},
        },
        {
            "jsonrpc": "2.0",
            "method": "notifications/progress",
            "params": {"progressToken": "p", "progress": 2, "total": 2},
        },
        {"jsonrpc": "2.0", "id": 1, "result": text("quick q")},
    ]
    assert await world.status("http-task-1") == "completed"


async def test_a_required_tool_on_2025_06_18_asks_for_input_on_the_call_stream(
    server: Server, world: World
) -> None:
    client = await connected(server, V0618, elicitation={})
    with trio.fail_after(10):
        async with client.stream(rpc(1, "tools/call", name="ask", arguments={})) as response:
            events = iter_events(response)
            asked = (await events.__anext__()).message
            assert asked == {
                "jsonrpc": "2.0",
                "id": 0,
                "method": "elicitation/create",
                "params": {"message": "Your name?", "requestedSchema": NAME_FORM},
            }
            answer: dict[str, Any] = {
                "jsonrpc": "2.0",
                "id": 0,
                "result": {"action": "accept", "content": {}},
            }
            answer["result"]["content"] = {"name": "Ada"}
            assert (await client.post(answer)).status_code == 202
            final = (await events.__anext__()).message
    assert final == {"jsonrpc": "2.0", "id": 1, "result": text("accept: Ada")}
    assert await world.status("http-task-1") == "completed"


async def test_notifications_cancelled_cancels_the_task(server: Server, world: World) -> None:
    client = await connected(server)
    with trio.fail_after(10):
        async with client.stream(rpc(7, "tools/call", name="wait", arguments={})) as response:
            events = iter_events(response)
            await events.__anext__()  # priming
            await world.probe.started.wait()
            cancel = rpc(None, "notifications/cancelled", requestId=7, reason="no longer needed")
            assert (await client.post(cancel)).status_code == 202
            await world.probe.cancelled.wait()
            assert [event async for event in events] == []
    await world.wait_status("http-task-1", "cancelled")


async def test_a_disconnect_or_an_ended_session_leaves_the_task_running(
    server: Server, world: World
) -> None:
    client = await connected(server)
    raw = await Raw.connect(server)  # type: ignore[arg-type]
    message = json.dumps(rpc(1, "tools/call", name="wait", arguments={})).encode()
    with trio.fail_after(10):
        headers = {**client.headers(), "content-length": str(len(message))}
        await raw.start_request(server, headers)  # type: ignore[arg-type]
        await raw.send(message)
        await raw.end()
        response = await raw.response()
        assert header(response, "content-type") == "text/event-stream"
        first = b""
        async for chunk in raw.chunks():
            first += chunk
            if b"\n\n" in first:
                break
        priming = parse_events(first.decode())[0]
        await world.probe.started.wait()
    await raw.aclose()
    await trio.sleep(0.2)
    assert await world.status("http-task-1") == "working"
    # The client resumes and still gets its answer once the task is done.
    world.probe.release.set()
    await world.wait_status("http-task-1", "completed")
    with trio.fail_after(10):
        async with client.get(**{"last-event-id": priming.id}) as resumed:
            replay = [event async for event in iter_events(resumed)]
    assert messages(replay) == [{"jsonrpc": "2.0", "id": 1, "result": text("released")}]
    # A second task whose session is deleted meanwhile: the task goes on without it.
    world.probe.release = trio.Event()
    world.probe.started = trio.Event()
    other = await connected(server)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(other.call, 2, "wait")
        with trio.fail_after(10):
            await world.probe.started.wait()
        assert (await other.delete()).status_code == 200
        await trio.sleep(0.2)
        assert await world.status("http-task-2") == "working"
        world.probe.release.set()
        await world.wait_status("http-task-2", "completed")
        nursery.cancel_scope.cancel()


# -- the 2025-11-25 experimental task wire ---------------------------------------------------------


async def test_the_experimental_flow_create_get_result_list_cancel(
    server: Server, world: World
) -> None:
    client = await connected(server, V1125, elicitation={}, tasks=CLIENT_TASKS)
    assert client.init_result["capabilities"]["tasks"] == {
        "list": {},
        "cancel": {},
        "requests": {"tools": {"call": {}}},
    }
    listed = await client.post(rpc(1, "tools/list"))
    support = {tool["name"]: tool["execution"] for tool in listed.json()["result"]["tools"]}
    assert support == {
        "quick": {"taskSupport": "optional"},
        "ask": {"taskSupport": "required"},
        "wait": {"taskSupport": "optional"},
        "echo": {"taskSupport": "forbidden"},
    }
    created = result_of(await client.call(2, "ask", arguments={}, task={"ttl": 60_000}))
    task = created["result"]["task"]
    assert (task["taskId"], task["status"], task["ttl"], task["pollInterval"]) == (
        "http-task-1",
        "working",
        60_000,
        250,
    )
    await world.wait_status("http-task-1", "input_required")
    got = await client.post(rpc(3, "tasks/get", taskId="http-task-1"))
    assert got.headers["content-type"] == "application/json"
    assert got.json()["result"]["status"] == "input_required"
    with trio.fail_after(10):
        async with client.stream(rpc(4, "tasks/result", taskId="http-task-1")) as response:
            events = iter_events(response)
            await events.__anext__()  # priming
            asked = (await events.__anext__()).message
            assert asked["method"] == "elicitation/create"
            assert asked["params"]["_meta"] == {RELATED: {"taskId": "http-task-1"}}
            answer = {"jsonrpc": "2.0", "id": asked["id"], "result": {"action": "decline"}}
            assert (await client.post(answer)).status_code == 202
            final = (await events.__anext__()).message
    assert final == {
        "jsonrpc": "2.0",
        "id": 4,
        "result": {**text("decline: None"), "_meta": {RELATED: {"taskId": "http-task-1"}}},
    }
    result_of(await client.call(5, "wait", arguments={}, task={}))
    with trio.fail_after(10):
        await world.probe.started.wait()
    listing = (await client.post(rpc(6, "tasks/list"))).json()["result"]
    assert [(t["taskId"], t["status"]) for t in listing["tasks"]] == [
        ("http-task-1", "completed"),
        ("http-task-2", "working"),
    ]
    cancelled = (await client.post(rpc(7, "tasks/cancel", taskId="http-task-2"))).json()
    assert cancelled["result"]["status"] == "cancelled"
    assert world.probe.cancelled.is_set()
    again = (await client.post(rpc(8, "tasks/cancel", taskId="http-task-2"))).json()
    assert again["error"] == {
        "code": -32602,
        "message": "Cannot cancel task: already in terminal status 'cancelled'",
    }
    forbidden = result_of(await client.call(9, "echo", arguments={"text": "x"}, task={}))
    assert forbidden["error"]["code"] == -32601
    required = result_of(await client.call(10, "ask", arguments={}))
    assert required["error"]["code"] == -32601


async def test_status_and_progress_of_a_sessions_tasks_come_on_its_standalone_stream(
    server: Server, world: World
) -> None:
    client = await connected(server, tasks=CLIENT_TASKS)
    bystander = await connected(server, tasks=CLIENT_TASKS)
    with trio.fail_after(10):
        async with client.get() as stream, bystander.get() as other_stream:
            events = iter_events(stream)
            await events.__anext__()  # priming
            others = iter_events(other_stream)
            await others.__anext__()
            created = result_of(
                await client.call(1, "quick", arguments={}, task={}, _meta={"progressToken": 5})
            )
            assert created["result"]["task"]["status"] == "working"
            got = [(await events.__anext__()).message for _ in range(3)]
            with trio.move_on_after(0.3):
                leaked = await others.__anext__()
                raise AssertionError(f"another session saw {leaked}")
    related = {RELATED: {"taskId": "http-task-1"}}
    assert got[:2] == [
        {
            "jsonrpc": "2.0",
            "method": "notifications/progress",
            "params": {"progressToken": 5, "progress": 1, "total": 2, "_meta": related},
        },
        {
            "jsonrpc": "2.0",
            "method": "notifications/progress",
            "params": {"progressToken": 5, "progress": 2, "total": 2, "_meta": related},
        },
    ]
    status = got[2]
    assert status["method"] == "notifications/tasks/status"
    assert (status["params"]["taskId"], status["params"]["status"]) == ("http-task-1", "completed")
    assert set(status["params"]) == {
        "taskId",
        "status",
        "createdAt",
        "lastUpdatedAt",
        "ttl",
        "pollInterval",
    }


async def test_one_session_never_reaches_anothers_tasks(server: Server, world: World) -> None:
    owner = await connected(server, tasks=CLIENT_TASKS)
    stranger = await connected(server, tasks=CLIENT_TASKS)
    result_of(await owner.call(1, "quick", arguments={}, task={}))
    await world.wait_status("http-task-1", "completed")
    listing = (await stranger.post(rpc(1, "tasks/list"))).json()
    assert listing == {"jsonrpc": "2.0", "id": 1, "result": {"tasks": []}}
    not_found = {"code": -32602, "message": "Failed to retrieve task: Task not found"}
    for index, method in enumerate(("tasks/get", "tasks/cancel")):
        answer = (await stranger.post(rpc(10 + index, method, taskId="http-task-1"))).json()
        assert answer["error"] == not_found
    answer = result_of(await stranger.call(12, "quick", arguments={}, task={}))
    assert answer["result"]["task"]["taskId"] == "http-task-2"
    streamed = await stranger.post(rpc(13, "tasks/result", taskId="http-task-1"))
    assert messages(parse_events(streamed.text))[-1]["error"] == not_found
    mine = (await owner.post(rpc(2, "tasks/list"))).json()["result"]["tasks"]
    assert [task["taskId"] for task in mine] == ["http-task-1"]


async def test_2025_06_18_sessions_have_no_task_methods_over_http(server: Server) -> None:
    client = await connected(server, V0618)
    assert "tasks" not in client.init_result["capabilities"]
    answer = (await client.post(rpc(1, "tasks/list"))).json()
    assert answer["error"] == {"code": -32601, "message": "Method not found: tasks/list"}
    listed = (await client.post(rpc(2, "tools/list"))).json()["result"]["tools"]
    assert all("execution" not in tool for tool in listed)
