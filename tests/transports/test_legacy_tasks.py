"""Tasks for initialize-era clients over stdio, byte-exact: task tools waited for, and the
2025-11-25 experimental task wire (``params.task``, ``tasks/get|result|list|cancel``,
``notifications/tasks/status``), on the same durable tasks as 2026-07-28.

The server runs in process on memory streams (``test_stdio.stdio_server``) with a
``MemoryStore`` on ``TrioClock`` under ``MockClock(autojump_threshold=0)``, so instants, TTLs and
poll waits are exact. The store is checked directly for what the wire cannot show (a waited-for
task's status, its cancellation, that it goes on after the client left).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from test_legacy_stdio import initialized_peer, legacy
from test_stdio import Peer, cancel, request, stdio_server

from tritask.jsonrpc import InvalidParams, JSONValue
from tritask.server.app import App
from tritask.server.context import Context
from tritask.server.dispatcher import Dispatcher
from tritask.server.mrtr import elicitation, sampling
from tritask.server.results import ToolError
from tritask.tasks import TrioClock
from tritask.tasks._time import parse_instant
from tritask.tasks.extension import EXTENSION_ID, Tasks, principal_scope
from tritask.tasks.memory import MemoryStore
from tritask.tasks.model import Snapshot, TaskStatus
from tritask.tasks.relay import RequestRelay
from tritask.tasks.runner import Runner
from tritask.tasks.store import Action, NotFound

START_US = parse_instant("2026-08-24T10:00:00.000Z")
T0 = "2026-08-24T10:00:00.000Z"
RELATED = "io.modelcontextprotocol/related-task"
NAME_FORM = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
TASK_CAPS: dict[str, Any] = {
    "tasks": {"list": {}, "cancel": {}, "requests": {"tools": {"call": {}}}}
}
CLIENT_TASKS: dict[str, Any] = {"list": {}, "cancel": {}}
"""What the TypeScript SDK 1.32.2 declares when configured with tasks."""
NOT_FOUND = {"code": -32602, "message": "Failed to retrieve task: Task not found"}
REFUSED = {"code": -32602, "message": "That label is not allowed", "data": {"label": "x"}}


@attrs.define(eq=False)
class Probe:
    events: list[str] = attrs.field(factory=list)
    started: trio.Event = attrs.field(factory=trio.Event)
    release: trio.Event = attrs.field(factory=trio.Event)
    contexts: list[Context] = attrs.field(factory=list)


class CountingIds:
    """Task ids ``task-1``, ``task-2``, ... so the wire can be asserted byte for byte."""

    def __init__(self) -> None:
        self.issued: list[str] = []

    def __call__(self) -> str:
        self.issued.append(f"task-{len(self.issued) + 1}")
        return self.issued[-1]


ANONYMOUS = SimpleNamespace(principal=None)


@attrs.define(eq=False)
class World:
    app: App
    tasks: Tasks
    memory: MemoryStore
    runner: Runner
    probe: Probe
    ids: CountingIds

    async def snapshot(self, task_id: str) -> Snapshot | NotFound:
        access = await self.memory.authorize(ANONYMOUS, Action.GET, task_id)
        return await self.memory.get(task_id, access)

    async def status(self, task_id: str) -> str:
        snapshot = await self.snapshot(task_id)
        assert isinstance(snapshot, Snapshot), snapshot
        return snapshot.task.status.value

    def task_ids(self) -> list[str]:
        return list(self.ids.issued)

    def kinds(self, task_id: str) -> list[str]:
        return [entry.event.kind.value for entry in self.memory.history(task_id)]

    async def wait_status(self, task_id: str, status: str) -> None:
        for _ in range(10_000):
            if await self.status(task_id) == status:
                return
            await trio.sleep(0.01)
        raise AssertionError(f"task {task_id} never became {status}")


def build_app(probe: Probe) -> App:
    app = App("legacy-tasks", "1.0.0", state_key="legacy-tasks-state-key-0123456789")

    @app.tool()
    async def echo(text: str) -> str:
        """Not a task tool."""
        return text

    @app.tool()
    async def slow(ctx: Context, seconds: float = 1.0, label: str = "x") -> str:
        """Two progress steps around a sleep."""
        await ctx.progress(1, 2, "started")
        await trio.sleep(seconds)
        await ctx.progress(2, 2)
        return f"slow {label}"

    @app.tool()
    async def must(label: str = "m") -> str:
        """Only ever a task."""
        await trio.sleep(1)
        return f"must {label}"

    @app.tool()
    async def ask(ctx: Context) -> str:
        """Parks for the user's name."""
        answer = await ctx.await_input("who", elicitation("Your name?", NAME_FORM))
        content = answer.get("content") or {}
        assert isinstance(content, dict)
        return f"{answer.get('action')}: {content.get('name')}"

    @app.tool()
    async def ask_model(ctx: Context) -> str:
        """Parks for the client's model (needs sampling)."""
        question = {"role": "user", "content": {"type": "text", "text": "2+2?"}}
        answer = await ctx.await_input("q", sampling([question], 10))
        return f"model said {answer}"

    @app.tool()
    async def ask_url(ctx: Context) -> str:
        """Parks for a URL elicitation (2025-11-25 only)."""
        request = {
            "method": "elicitation/create",
            "params": {"mode": "url", "message": "Sign in", "url": "https://example.com/"},
        }
        answer = await ctx.await_input("url", request)
        return f"url {answer.get('action')}"

    @app.tool()
    async def flaky() -> str:
        """A domain error (isError)."""
        raise ToolError("The flux capacitor is out of flux")

    @app.tool()
    async def refusing() -> str:
        """A JSON-RPC error from inside the task."""
        raise InvalidParams("That label is not allowed", {"label": "x"})

    @app.tool()
    async def introspect(ctx: Context) -> str:
        """Keeps its worker context for the test, then reports progress once released."""
        probe.contexts.append(ctx)
        probe.started.set()
        await probe.release.wait()
        await ctx.progress(1, 2, "after release")
        return "looked"

    @app.tool()
    async def block() -> str:
        """Runs until released or cancelled."""
        probe.events.append("block started")
        probe.started.set()
        try:
            await probe.release.wait()
        except trio.Cancelled:
            probe.events.append("block cancelled")
            raise
        probe.events.append("block released")
        return "released"

    return app


def decide_by_label(params: Any, ctx: Context) -> str:
    arguments = params.get("arguments") or {}
    return "sync" if arguments.get("label") == "now" else "optional"


POLICIES: dict[str, Any] = {
    "slow": "optional",
    "must": "required",
    "ask": "optional",
    "ask_model": "optional",
    "ask_url": "optional",
    "flaky": "optional",
    "refusing": "optional",
    "block": "optional",
    "introspect": "optional",
    "decided": decide_by_label,
}


@asynccontextmanager
async def world(**tasks_options: Any) -> AsyncIterator[World]:
    probe = Probe()
    app = build_app(probe)

    @app.tool()
    async def decided(label: str = "x") -> str:
        """A callable policy: sync for label 'now'."""
        return f"decided {label}"

    memory = MemoryStore(scope=principal_scope, clock=TrioClock(START_US))
    runner = Runner(memory, reap_interval_ms=None)
    ids = CountingIds()
    tasks = Tasks(
        store=memory, runner=runner, task_support=POLICIES, id_generator=ids, **tasks_options
    )
    app.add_extension(tasks)
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        yield World(app, tasks, memory, runner, probe, ids)
        runner.stop()


async def read_until(peer: Peer, request_id: Any) -> list[dict[str, Any]]:
    """Everything the server writes up to and including the response to ``request_id``."""
    out: list[dict[str, Any]] = []
    while True:
        message = await peer.receive()
        out.append(message)
        if message.get("id") == request_id and "method" not in message:
            return out


async def read_with_statuses(
    peer: Peer, request_id: Any, statuses: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The response to ``request_id`` and the next ``statuses`` status notifications, in
    whatever order they come.

    A status notification goes out on the session's own stream, the response on the
    request's: 2025-11-25 makes the notification a MAY that "requestors MUST NOT rely on", and
    nothing orders the two streams' writes, so both orders are correct and both occur (the
    trio scheduler runs the two writers in either order). The notifications among themselves
    keep the order of the transitions."""
    response: dict[str, Any] | None = None
    notifications: list[dict[str, Any]] = []
    with trio.fail_after(30):
        while response is None or len(notifications) < statuses:
            message = await peer.receive()
            if message.get("method") == "notifications/tasks/status":
                notifications.append(message)
            else:
                assert message.get("id") == request_id, message
                assert response is None, message
                response = message
    return response, notifications


def text_result(text: str, *, error: bool = False) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": text}], "isError": error}


def progress(token: Any, value: int, message: str | None = None, **meta: Any) -> dict[str, Any]:
    params: dict[str, Any] = {"progressToken": token, "progress": value, "total": 2}
    if message is not None:
        params["message"] = message
    if meta:
        params["_meta"] = meta
    return {"jsonrpc": "2.0", "method": "notifications/progress", "params": params}


def task_of(task_id: str, status: str, **fields: Any) -> dict[str, Any]:
    """A 2025-11-25 ``Task`` with this suite's defaults (ttl 1 h, poll 250 ms)."""
    task: dict[str, Any] = {"taskId": task_id, "status": status}
    if status not in ("completed",):
        task["statusMessage"] = fields.pop(
            "statusMessage", "Cancellation requested" if status == "cancelled" else "Task accepted"
        )
    task["createdAt"] = fields.pop("createdAt", T0)
    task["lastUpdatedAt"] = fields.pop("lastUpdatedAt", T0)
    task["ttl"] = fields.pop("ttl", 3_600_000)
    task["pollInterval"] = fields.pop("pollInterval", 250)
    assert not fields, fields
    return task


# -- task tools waited for (every legacy session) -------------------------------------------------


@pytest.mark.parametrize("version", ["2025-06-18", "2025-11-25"])
async def test_an_optional_tool_runs_as_a_task_and_the_call_waits_with_progress(
    version: str, autojump_clock: trio.testing.MockClock
) -> None:
    async with world() as w, stdio_server(w.app) as (peer, _, _):
        await initialized_peer(peer, version)
        token = {"progressToken": 7}
        await peer.send(legacy(1, "tools/call", name="slow", arguments={"label": "a"}, _meta=token))
        assert await read_until(peer, 1) == [
            progress(7, 1, "started"),
            progress(7, 2),
            {"jsonrpc": "2.0", "id": 1, "result": text_result("slow a")},
        ]
        (task_id,) = w.task_ids()
        assert await w.status(task_id) == "completed"
        assert trio.current_time() == pytest.approx(1.0)


async def test_a_required_tool_never_answers_32021_to_a_2025_06_18_client(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with world() as w, stdio_server(w.app) as (peer, _, _):
        await initialized_peer(peer, "2025-06-18")
        await peer.send(legacy(1, "tools/call", name="must", arguments={"label": "r"}))
        assert await peer.receive() == {"jsonrpc": "2.0", "id": 1, "result": text_result("must r")}
        (task_id,) = w.task_ids()
        assert await w.status(task_id) == "completed"


async def test_sync_tools_and_callable_sync_decisions_make_no_task(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with world() as w, stdio_server(w.app) as (peer, _, _):
        await initialized_peer(peer, "2025-11-25")
        await peer.send(legacy(1, "tools/call", name="echo", arguments={"text": "hi"}))
        assert await peer.receive() == {"jsonrpc": "2.0", "id": 1, "result": text_result("hi")}
        await peer.send(legacy(2, "tools/call", name="decided", arguments={"label": "now"}))
        assert await peer.receive() == {
            "jsonrpc": "2.0",
            "id": 2,
            "result": text_result("decided now"),
        }
        assert w.task_ids() == []
        await peer.send(legacy(3, "tools/call", name="decided", arguments={"label": "later"}))
        assert await peer.receive() == {
            "jsonrpc": "2.0",
            "id": 3,
            "result": text_result("decided later"),
        }
        assert len(w.task_ids()) == 1


@pytest.mark.parametrize("version", ["2025-06-18", "2025-11-25"])
async def test_await_input_in_a_waited_for_task_becomes_a_server_request(
    version: str, autojump_clock: trio.testing.MockClock
) -> None:
    async with world() as w, stdio_server(w.app) as (peer, _, _):
        await initialized_peer(peer, version, elicitation={})
        await peer.send(legacy(4, "tools/call", name="ask", arguments={}))
        server_request = await peer.receive()
        params: dict[str, Any] = {"message": "Your name?", "requestedSchema": NAME_FORM}
        if version == "2025-11-25":
            params = {"mode": "form", **params}
        assert server_request == {
            "jsonrpc": "2.0",
            "id": 0,
            "method": "elicitation/create",
            "params": params,
        }
        (task_id,) = w.task_ids()
        assert await w.status(task_id) == "input_required"
        await peer.send(
            {"jsonrpc": "2.0", "id": 0, "result": {"action": "accept", "content": {"name": "Ada"}}}
        )
        assert await peer.receive() == {
            "jsonrpc": "2.0",
            "id": 4,
            "result": text_result("accept: Ada"),
        }
        assert await w.status(task_id) == "completed"


async def test_an_undeclared_capability_is_a_tool_error_and_fails_the_task(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with world() as w, stdio_server(w.app) as (peer, _, _):
        await initialized_peer(peer, "2025-11-25", elicitation={})
        await peer.send(legacy(1, "tools/call", name="ask_model", arguments={}))
        assert await peer.receive() == {
            "jsonrpc": "2.0",
            "id": 1,
            "result": text_result("Missing required client capability", error=True),
        }
        (task_id,) = w.task_ids()
        snapshot = await w.snapshot(task_id)
        assert isinstance(snapshot, Snapshot)
        assert snapshot.task.status is TaskStatus.FAILED
        assert snapshot.task.error == {
            "code": -32021,
            "message": "Missing required client capability",
            "data": {"requiredCapabilities": {"sampling": {}}},
        }


async def test_url_elicitation_cannot_be_asked_on_2025_06_18_and_cancels_the_task(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with world() as w, stdio_server(w.app) as (peer, _, _):
        await initialized_peer(peer, "2025-06-18", elicitation={"url": {}})
        await peer.send(legacy(1, "tools/call", name="ask_url", arguments={}))
        assert await peer.receive() == {
            "jsonrpc": "2.0",
            "id": 1,
            "result": text_result("URL elicitation needs MCP 2025-11-25", error=True),
        }
        (task_id,) = w.task_ids()
        assert await w.status(task_id) == "cancelled"


async def test_a_client_refusing_the_input_gets_a_tool_error_and_the_task_is_cancelled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with world() as w, stdio_server(w.app) as (peer, _, _):
        await initialized_peer(peer, "2025-11-25", elicitation={})
        await peer.send(legacy(1, "tools/call", name="ask", arguments={}))
        server_request = await peer.receive()
        assert server_request["method"] == "elicitation/create"
        await peer.send(
            {"jsonrpc": "2.0", "id": server_request["id"], "error": {"code": -1, "message": "no"}}
        )
        assert await peer.receive() == {
            "jsonrpc": "2.0",
            "id": 1,
            "result": text_result("The client answered with error -1: no", error=True),
        }
        (task_id,) = w.task_ids()
        assert await w.status(task_id) == "cancelled"


async def test_results_errors_and_cancellation_by_others_in_legacy_shape(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with world() as w, stdio_server(w.app) as (peer, _, _):
        await initialized_peer(peer, "2025-06-18")
        await peer.send(legacy(1, "tools/call", name="flaky", arguments={}))
        assert await peer.receive() == {
            "jsonrpc": "2.0",
            "id": 1,
            "result": text_result("The flux capacitor is out of flux", error=True),
        }
        await peer.send(legacy(2, "tools/call", name="refusing", arguments={}))
        assert await peer.receive() == {
            "jsonrpc": "2.0",
            "id": 2,
            "error": REFUSED,
        }
        await peer.send(legacy(3, "tools/call", name="block", arguments={}))
        await w.probe.started.wait()
        (task_id,) = set(w.task_ids()) - set(await _settled(w))
        # A 2026-07-28 caller of the same store scope cancels it (the store scope is shared).
        modern = await Dispatcher(w.app).handle_request(
            _modern("tasks/cancel", {"taskId": task_id})
        )
        assert modern["result"]["resultType"] == "complete"
        assert await peer.receive() == {
            "jsonrpc": "2.0",
            "id": 3,
            "error": {
                "code": -32603,
                "message": f"Task {task_id} was cancelled",
                "data": {"taskId": task_id},
            },
        }
        assert w.probe.events == ["block started", "block cancelled"]


async def test_the_clients_cancellation_cancels_the_task(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with world() as w, stdio_server(w.app) as (peer, _, _):
        await initialized_peer(peer, "2025-11-25")
        await peer.send(legacy(5, "tools/call", name="block", arguments={}))
        await w.probe.started.wait()
        (task_id,) = w.task_ids()
        await peer.send(cancel(5))
        await w.wait_status(task_id, "cancelled")
        await peer.send(legacy(6, "ping"))
        assert await peer.receive() == {"jsonrpc": "2.0", "id": 6, "result": {}}
        assert w.probe.events == ["block started", "block cancelled"]


async def test_a_client_that_goes_away_leaves_its_task_running(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with world() as w:
        async with stdio_server(w.app) as (peer, stdout, done):
            await initialized_peer(peer, "2025-11-25")
            await peer.send(
                legacy(5, "tools/call", name="block", arguments={}, _meta={"progressToken": "p"})
            )
            await w.probe.started.wait()
            (task_id,) = w.task_ids()
            await peer.to_server.aclose()  # EOF: the client is gone
            with trio.fail_after(10):
                await done.wait()
            await stdout.aclose()
            assert await peer.rest() == []  # no answer for the call: nobody is there
        assert w.probe.events == ["block started"]
        assert await w.status(task_id) == "working"
        w.probe.release.set()
        await w.wait_status(task_id, "completed")
        assert w.probe.events == ["block started", "block released"]


async def test_the_worker_context_stays_detached_and_its_relay_dies_with_the_request(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with world() as w, stdio_server(w.app) as (peer, stdout, done):
        await initialized_peer(peer, "2025-11-25")
        await peer.send(
            legacy(1, "tools/call", name="introspect", arguments={}, _meta={"progressToken": 3})
        )
        await w.probe.started.wait()
        (ctx,) = w.probe.contexts
        assert (ctx.detached, ctx.session, ctx.emit, ctx.request_id) == (True, None, None, None)
        assert ctx.meta.progress_token is None
        relay = ctx.relay
        assert isinstance(relay, RequestRelay) and not relay.closed
        await peer.to_server.aclose()
        with trio.fail_after(10):
            await done.wait()
        assert (relay.closed,) == (True,)  # the request is gone: its stream with it
        w.probe.release.set()
        await w.wait_status("task-1", "completed")  # progress went nowhere, harmlessly
        await stdout.aclose()
        assert await peer.rest() == []


# -- the 2025-11-25 experimental task wire ---------------------------------------------------------


async def test_capabilities_and_task_support_only_for_2025_11_25_clients_declaring_tasks(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with world() as w:
        expected_tools = {
            "echo": "forbidden",
            "slow": "optional",
            "must": "required",
            "decided": "optional",
        }
        cases = [("2025-11-25", True), ("2025-11-25", False), ("2025-06-18", True)]
        for version, declares in cases:
            offered = version == "2025-11-25" and declares
            async with stdio_server(w.app) as (peer, _, _):
                caps = {"tasks": CLIENT_TASKS} if declares else {}
                answer = await initialized_peer(peer, version, **caps)
                capabilities = answer["result"]["capabilities"]
                assert ("tasks" in capabilities) == offered
                if offered:
                    assert capabilities["tasks"] == TASK_CAPS["tasks"]
                await peer.send(legacy(1, "tools/list"))
                tools = {tool["name"]: tool for tool in (await peer.receive())["result"]["tools"]}
                for name, support in expected_tools.items():
                    if offered:
                        assert tools[name]["execution"] == {"taskSupport": support}
                    else:
                        assert "execution" not in tools[name]
        # 2026-07-28 never sees the legacy capability or the tool field.
        discover = await Dispatcher(w.app).handle_request(_modern("server/discover", {}))
        assert "tasks" not in discover["result"]["capabilities"]
        listed = await Dispatcher(w.app).handle_request(_modern("tools/list", {}))
        assert all("execution" not in tool for tool in listed["result"]["tools"])


async def test_a_task_augmented_call_answers_create_task_result_then_get_and_result(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with world() as w, stdio_server(w.app) as (peer, _, _):
        await initialized_peer(peer, "2025-11-25", tasks=CLIENT_TASKS)
        await peer.send(
            legacy(1, "tools/call", name="slow", arguments={"label": "t"}, task={"ttl": 60_000})
        )
        created = await peer.receive()
        task_id = created["result"]["task"]["taskId"]
        assert created == {
            "jsonrpc": "2.0",
            "id": 1,
            "result": {"task": task_of(task_id, "working", ttl=60_000)},
        }
        # TS SDK 1.32.2 repeats params.task on tasks/get and tasks/result: it is ignored.
        await peer.send(legacy(2, "tasks/get", taskId=task_id, task={}))
        assert await peer.receive() == {
            "jsonrpc": "2.0",
            "id": 2,
            "result": task_of(task_id, "working", ttl=60_000),
        }
        await peer.send(legacy(3, "tasks/result", taskId=task_id, task={}))
        result, statuses = await read_with_statuses(peer, 3, 1)
        done = "2026-08-24T10:00:01.000Z"
        assert statuses == [
            {
                "jsonrpc": "2.0",
                "method": "notifications/tasks/status",
                "params": task_of(task_id, "completed", ttl=60_000, lastUpdatedAt=done),
            }
        ]
        assert result == {
            "jsonrpc": "2.0",
            "id": 3,
            "result": {**text_result("slow t"), "_meta": {RELATED: {"taskId": task_id}}},
        }
        await peer.send(legacy(4, "tasks/get", taskId=task_id))
        assert await peer.receive() == {
            "jsonrpc": "2.0",
            "id": 4,
            "result": task_of(task_id, "completed", ttl=60_000, lastUpdatedAt=done),
        }
        # A settled task's result is the same every time.
        await peer.send(legacy(5, "tasks/result", taskId=task_id))
        assert (await peer.receive())["result"] == result["result"]


def _modern(method: str, params: dict[str, JSONValue]) -> Any:
    message = request(1, method, **params)
    message["params"]["_meta"]["io.modelcontextprotocol/clientCapabilities"] = {
        "extensions": {EXTENSION_ID: {}}
    }
    from tritask.jsonrpc import Request

    return Request(id=1, method=method, params=message["params"])


async def _settled(w: World) -> list[str]:
    settled = []
    for task_id in w.task_ids():
        if (await w.status(task_id)) in ("completed", "failed", "cancelled"):
            settled.append(task_id)
    return settled


async def test_task_augmentation_errors_follow_2025_11_25(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with world() as w, stdio_server(w.app) as (peer, _, _):
        await initialized_peer(peer, "2025-11-25", tasks=CLIENT_TASKS)
        await peer.send(legacy(1, "tools/call", name="echo", arguments={"text": "x"}, task={}))
        assert await peer.receive() == {
            "jsonrpc": "2.0",
            "id": 1,
            "error": {
                "code": -32601,
                "message": "Tool echo does not support task augmentation "
                "(taskSupport: 'forbidden'); call it without params.task",
            },
        }
        await peer.send(legacy(2, "tools/call", name="must", arguments={}))
        assert await peer.receive() == {
            "jsonrpc": "2.0",
            "id": 2,
            "error": {
                "code": -32601,
                "message": "Tool must requires task augmentation (taskSupport: 'required'); "
                "call it with params.task",
            },
        }
        bad_tasks: list[Any] = [[], "x", None, {"ttl": 0}, {"ttl": -5}, {"ttl": 1.5}]
        bad_tasks += [{"ttl": True}, {"ttl": "60000"}, {"ttl": None}]
        for index, bad in enumerate(bad_tasks):
            await peer.send(legacy(10 + index, "tools/call", name="slow", arguments={}, task=bad))
            answer = await peer.receive()
            assert answer["error"]["code"] == -32602, (bad, answer)
        assert w.task_ids() == []
        # A requested ttl is granted up to the configured one (1 h), and reported.
        for index, (asked, granted) in enumerate([(5_000, 5_000), (90_000_000, 3_600_000)]):
            await peer.send(
                legacy(30 + index, "tools/call", name="must", arguments={}, task={"ttl": asked})
            )
            assert (await peer.receive())["result"]["task"]["ttl"] == granted
        await peer.send(legacy(40, "tools/call", name="must", arguments={}, task={"ttl": 7e3}))
        assert (await peer.receive())["result"]["task"]["ttl"] == 7000


@pytest.mark.parametrize("version", ["2025-06-18", "2025-11-25"])
async def test_without_the_experimental_protocol_params_task_is_ignored(
    version: str, autojump_clock: trio.testing.MockClock
) -> None:
    """2025-06-18, and a 2025-11-25 client that declared no tasks: no task methods, and
    ``params.task`` is ignored (a receiver that did not declare tasks MUST ignore it)."""
    async with world() as w, stdio_server(w.app) as (peer, _, _):
        await initialized_peer(peer, version)
        for index, method in enumerate(("tasks/get", "tasks/result", "tasks/list", "tasks/cancel")):
            await peer.send(legacy(index, method, taskId="task-1"))
            assert await peer.receive() == {
                "jsonrpc": "2.0",
                "id": index,
                "error": {"code": -32601, "message": f"Method not found: {method}"},
            }
        await peer.send(legacy(10, "tools/call", name="echo", arguments={"text": "x"}, task={}))
        assert await peer.receive() == {"jsonrpc": "2.0", "id": 10, "result": text_result("x")}
        await peer.send(legacy(11, "tools/call", name="must", arguments={}, task={}))
        assert await peer.receive() == {"jsonrpc": "2.0", "id": 11, "result": text_result("must m")}


async def test_tasks_result_side_channels_input_with_the_related_task(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with world() as w, stdio_server(w.app) as (peer, _, _):
        await initialized_peer(peer, "2025-11-25", elicitation={}, tasks=CLIENT_TASKS)
        await peer.send(legacy(1, "tools/call", name="ask", arguments={}, task={}))
        assert (await peer.receive())["result"]["task"]["taskId"] == "task-1"
        # Commit instants strictly increase per task: the request comes 1 ms after creation.
        waiting = task_of("task-1", "input_required", lastUpdatedAt="2026-08-24T10:00:00.001Z")
        assert await peer.receive() == {
            "jsonrpc": "2.0",
            "method": "notifications/tasks/status",
            "params": waiting,
        }
        await peer.send(legacy(2, "tasks/get", taskId="task-1"))
        assert await peer.receive() == {"jsonrpc": "2.0", "id": 2, "result": waiting}
        await peer.send(legacy(3, "tasks/result", taskId="task-1"))
        assert await peer.receive() == {
            "jsonrpc": "2.0",
            "id": 0,
            "method": "elicitation/create",
            "params": {
                "mode": "form",
                "message": "Your name?",
                "requestedSchema": NAME_FORM,
                "_meta": {RELATED: {"taskId": "task-1"}},
            },
        }
        await peer.send(
            {"jsonrpc": "2.0", "id": 0, "result": {"action": "accept", "content": {"name": "Bo"}}}
        )
        result, statuses = await read_with_statuses(peer, 3, 2)
        assert [m["params"]["status"] for m in statuses] == ["working", "completed"]
        assert result == {
            "jsonrpc": "2.0",
            "id": 3,
            "result": {**text_result("accept: Bo"), "_meta": {RELATED: {"taskId": "task-1"}}},
        }
        assert w.kinds("task-1") == ["input_requested", "input_responses_accepted", "completed"]


async def test_one_input_is_asked_once_however_many_wait_for_the_task(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with world() as w, stdio_server(w.app) as (peer, _, _):
        await initialized_peer(peer, "2025-11-25", elicitation={}, tasks=CLIENT_TASKS)
        await peer.send(legacy(1, "tools/call", name="ask", arguments={}, task={}))
        await read_until(peer, 1)
        await w.wait_status("task-1", "input_required")
        assert (await peer.receive())["params"]["status"] == "input_required"
        await peer.send(legacy(2, "tasks/result", taskId="task-1"))
        await peer.send(legacy(3, "tasks/result", taskId="task-1"))
        server_request = await peer.receive()
        assert server_request["method"] == "elicitation/create"
        await trio.sleep(5)  # both followers re-read the store meanwhile: no second question
        await peer.send(
            {
                "jsonrpc": "2.0",
                "id": server_request["id"],
                "result": {"action": "decline"},
            }
        )
        messages = [await peer.receive() for _ in range(4)]
        answers = {m["id"]: m["result"] for m in messages if "id" in m}
        expected = {**text_result("decline: None"), "_meta": {RELATED: {"taskId": "task-1"}}}
        assert answers == {2: expected, 3: expected}


async def test_tasks_result_is_the_same_error_or_result_the_call_would_have_had(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with world() as w, stdio_server(w.app) as (peer, _, _):
        await initialized_peer(peer, "2025-11-25", tasks=CLIENT_TASKS)
        for index, tool in enumerate(("flaky", "refusing", "ask_model")):
            await peer.send(legacy(index + 1, "tools/call", name=tool, arguments={}, task={}))
            await read_until(peer, index + 1)
        related = {"_meta": {RELATED: {"taskId": "task-1"}}}
        await peer.send(legacy(10, "tasks/result", taskId="task-1"))
        assert (await read_until(peer, 10))[-1] == {
            "jsonrpc": "2.0",
            "id": 10,
            "result": {**text_result("The flux capacitor is out of flux", error=True), **related},
        }
        # isError stays completed (see tritask.tasks.legacy): TS 1.32.2 reads it only then.
        await peer.send(legacy(11, "tasks/get", taskId="task-1"))
        assert (await read_until(peer, 11))[-1]["result"]["status"] == "completed"
        await peer.send(legacy(12, "tasks/result", taskId="task-2"))
        assert (await read_until(peer, 12))[-1] == {
            "jsonrpc": "2.0",
            "id": 12,
            "error": REFUSED,
        }
        await peer.send(legacy(13, "tasks/get", taskId="task-2"))
        failed = (await read_until(peer, 13))[-1]["result"]
        assert (failed["status"], failed["statusMessage"]) == ("failed", REFUSED["message"])
        # A missing client capability fails the task, and its result is the legacy tool error.
        await peer.send(legacy(14, "tasks/result", taskId="task-3"))
        assert (await read_until(peer, 14))[-1] == {
            "jsonrpc": "2.0",
            "id": 14,
            "result": {
                **text_result("Missing required client capability", error=True),
                "_meta": {RELATED: {"taskId": "task-3"}},
            },
        }


async def test_tasks_cancel_returns_the_cancelled_task_and_refuses_terminal_ones(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with world() as w, stdio_server(w.app) as (peer, _, _):
        await initialized_peer(peer, "2025-11-25", tasks=CLIENT_TASKS)
        await peer.send(legacy(1, "tools/call", name="block", arguments={}, task={}))
        await read_until(peer, 1)
        await w.probe.started.wait()
        await trio.sleep(2)
        await peer.send(legacy(2, "tasks/cancel", taskId="task-1"))
        messages = await read_until(peer, 2)
        cancelled = task_of("task-1", "cancelled", lastUpdatedAt="2026-08-24T10:00:02.000Z")
        assert messages == [
            {"jsonrpc": "2.0", "method": "notifications/tasks/status", "params": cancelled},
            {"jsonrpc": "2.0", "id": 2, "result": cancelled},
        ]
        assert w.probe.events == ["block started", "block cancelled"]
        await peer.send(legacy(3, "tasks/cancel", taskId="task-1"))
        assert await peer.receive() == {
            "jsonrpc": "2.0",
            "id": 3,
            "error": {
                "code": -32602,
                "message": "Cannot cancel task: already in terminal status 'cancelled'",
            },
        }
        await peer.send(legacy(4, "tasks/result", taskId="task-1"))
        assert await peer.receive() == {
            "jsonrpc": "2.0",
            "id": 4,
            "error": {
                "code": -32603,
                "message": "Task task-1 was cancelled",
                "data": {"taskId": "task-1"},
            },
        }
        await peer.send(legacy(5, "tools/call", name="must", arguments={}, task={}))
        await read_until(peer, 5)
        await w.wait_status("task-2", "completed")
        await peer.receive()  # its status notification
        await peer.send(legacy(6, "tasks/cancel", taskId="task-2"))
        assert (await peer.receive())["error"] == {
            "code": -32602,
            "message": "Cannot cancel task: already in terminal status 'completed'",
        }


async def test_cancelling_a_tasks_result_request_leaves_the_task_running(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with world() as w, stdio_server(w.app) as (peer, _, _):
        await initialized_peer(peer, "2025-11-25", tasks=CLIENT_TASKS)
        await peer.send(legacy(1, "tools/call", name="block", arguments={}, task={}))
        await read_until(peer, 1)
        await w.probe.started.wait()
        await peer.send(legacy(2, "tasks/result", taskId="task-1"))
        await trio.sleep(1)
        await peer.send(cancel(2))
        await peer.send(legacy(3, "tasks/get", taskId="task-1"))
        assert await peer.receive() == {
            "jsonrpc": "2.0",
            "id": 3,
            "result": task_of("task-1", "working"),
        }
        assert w.probe.events == ["block started"]


async def test_tasks_list_pages_the_sessions_own_tasks(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with world() as w:
        w.tasks.legacy.page_size = 2
        async with stdio_server(w.app) as (peer, _, _), stdio_server(w.app) as (other, _, _):
            await initialized_peer(peer, "2025-11-25", tasks=CLIENT_TASKS)
            await initialized_peer(other, "2025-11-25", tasks=CLIENT_TASKS)
            for index in range(5):
                await peer.send(legacy(index, "tools/call", name="must", arguments={}, task={}))
                await read_until(peer, index)
            # A waited-for task of the same session is not listed: its id was never shown.
            await peer.send(legacy(9, "tools/call", name="slow", arguments={"seconds": 0}))
            await read_until(peer, 9)
            pages: list[list[str]] = []
            cursor: str | None = None
            for page in range(10):
                params = {} if cursor is None else {"cursor": cursor}
                await peer.send(legacy(f"l{page}", "tasks/list", **params))
                result = (await read_until(peer, f"l{page}"))[-1]["result"]
                assert set(result) <= {"tasks", "nextCursor"}
                pages.append([task["taskId"] for task in result["tasks"]])
                assert all(set(task) == set(task_of("x", "working")) for task in result["tasks"])
                cursor = result.get("nextCursor")
                if cursor is None:
                    break
            assert pages == [["task-1", "task-2"], ["task-3", "task-4"], ["task-5"]]
            for index, bad in enumerate(["", "nope", 7, "dDk5OQ", "dDA", "t1", "dDE=", "x" * 65]):
                await peer.send(legacy(f"b{index}", "tasks/list", cursor=bad))
                answer = (await read_until(peer, f"b{index}"))[-1]
                assert answer["error"] == {"code": -32602, "message": "Invalid cursor"}, bad
            # Another session sees none of them, and cannot reach any of them.
            await other.send(legacy(1, "tasks/list"))
            assert await other.receive() == {"jsonrpc": "2.0", "id": 1, "result": {"tasks": []}}
            for index, method in enumerate(("tasks/get", "tasks/result", "tasks/cancel")):
                await other.send(legacy(10 + index, method, taskId="task-1"))
                assert await other.receive() == {
                    "jsonrpc": "2.0",
                    "id": 10 + index,
                    "error": NOT_FOUND,
                }
            for n in range(1, 7):  # the other session's cancel reached none of them
                await w.wait_status(f"task-{n}", "completed")


async def test_expired_tasks_leave_the_list_and_answer_not_found(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with world() as w, stdio_server(w.app) as (peer, _, _):
        await initialized_peer(peer, "2025-11-25", tasks=CLIENT_TASKS)
        await peer.send(legacy(1, "tools/call", name="must", arguments={}, task={"ttl": 5_000}))
        await read_until(peer, 1)
        await peer.send(legacy(2, "tools/call", name="must", arguments={}, task={}))
        await read_until(peer, 2)
        await trio.sleep(6)
        assert await w.runner.reap_once() == ["task-1"]
        await peer.send(legacy(3, "tasks/list"))
        listed = (await read_until(peer, 3))[-1]["result"]["tasks"]
        assert [task["taskId"] for task in listed] == ["task-2"]
        for index, method in enumerate(("tasks/get", "tasks/result", "tasks/cancel")):
            await peer.send(legacy(10 + index, method, taskId="task-1"))
            assert (await read_until(peer, 10 + index))[-1]["error"] == NOT_FOUND


async def test_progress_of_an_augmented_task_reaches_the_session_with_its_task(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with world() as w, stdio_server(w.app) as (peer, _, _):
        await initialized_peer(peer, "2025-11-25", tasks=CLIENT_TASKS)
        await peer.send(
            legacy(
                1,
                "tools/call",
                name="slow",
                arguments={"seconds": 2},
                task={},
                _meta={"progressToken": 1},
            )
        )
        messages = [await peer.receive() for _ in range(4)]
        related = {RELATED: {"taskId": "task-1"}}
        assert messages == [
            {"jsonrpc": "2.0", "id": 1, "result": {"task": task_of("task-1", "working")}},
            progress(1, 1, "started", **related),
            progress(1, 2, None, **related),
            {
                "jsonrpc": "2.0",
                "method": "notifications/tasks/status",
                "params": task_of("task-1", "completed", lastUpdatedAt="2026-08-24T10:00:02.000Z"),
            },
        ]


async def test_a_legacy_created_task_survives_a_restart_as_an_ordinary_durable_task(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with world() as w:
        async with stdio_server(w.app) as (peer, stdout, done):
            await initialized_peer(peer, "2025-11-25", tasks=CLIENT_TASKS)
            await peer.send(
                legacy(1, "tools/call", name="slow", arguments={"seconds": 30}, task={})
            )
            await read_until(peer, 1)
            await peer.send(legacy(2, "tools/call", name="slow", arguments={"seconds": 30}))
            await trio.sleep(1)
            await peer.to_server.aclose()
            with trio.fail_after(10):
                await done.wait()
            await stdout.aclose()
        # The process "restarts": its runner stops (the attempts are abandoned, not settled),
        # and a recovering runner on the same store adopts the work.
        w.runner.stop()
        await w.runner.wait_stopped()
        assert {await w.status("task-1"), await w.status("task-2")} == {"working"}
        async with trio.open_nursery() as nursery:
            recovering = Runner(w.memory, recover=True, reap_interval_ms=None)
            await nursery.start(recovering.run)
            w.tasks.runner = recovering
            await w.wait_status("task-1", "completed")
            await w.wait_status("task-2", "completed")
            # 2026-07-28 callers of the store scope see them like any other task.
            for task_id in ("task-1", "task-2"):
                answer = await Dispatcher(w.app).handle_request(
                    _modern("tasks/get", {"taskId": task_id})
                )
                assert answer["result"]["status"] == "completed"
                assert answer["result"]["result"]["content"] == [{"type": "text", "text": "slow x"}]
            recovering.stop()


async def test_a_session_holds_a_bounded_number_of_tasks(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with world() as w, stdio_server(w.app) as (peer, _, _):
        w.tasks.legacy.max_session_tasks = 2
        await initialized_peer(peer, "2025-11-25", tasks=CLIENT_TASKS)
        for index in (1, 2):
            call = legacy(index, "tools/call", name="must", arguments={}, task={"ttl": 5_000})
            await peer.send(call)
            assert (await read_until(peer, index))[-1]["result"]["task"][
                "taskId"
            ] == f"task-{index}"
        await peer.send(legacy(3, "tools/call", name="must", arguments={}, task={}))
        assert (await read_until(peer, 3))[-1]["error"] == {
            "code": -32603,
            "message": "This session holds 2 tasks; let some finish and expire first",
            "data": {"retryable": True},
        }
        assert w.task_ids() == ["task-1", "task-2"]
        await trio.sleep(6)
        assert await w.runner.reap_once() == ["task-1", "task-2"]
        await peer.send(legacy(4, "tools/call", name="must", arguments={}, task={}))
        assert (await read_until(peer, 4))[-1]["result"]["task"]["taskId"] == "task-3"
