"""``subscriptions/listen`` with ``taskIds``: filtering, concealment, shaping, pushes; in process
(MockClock) and over Streamable HTTP as SSE (real socket)."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable
from contextlib import AsyncExitStack, aclosing
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from helpers import (
    TASKS_CAPS,
    Env,
    Recorder,
    body,
    by_principal,
    http_headers,
    poll,
    start_env,
)

from tritask.protocol.meta import SERVER_INFO_KEY, SUBSCRIPTION_ID_KEY
from tritask.server.context import Context
from tritask.server.mrtr import elicitation
from tritask.tasks.extension import EXTENSION_ID

SUB = SUBSCRIPTION_ID_KEY
BASE_FIELDS = {"taskId", "status", "createdAt", "lastUpdatedAt", "ttlMs", "pollIntervalMs"}


async def _env(nursery: trio.Nursery, **kw: Any) -> tuple[Env, dict[str, trio.Event]]:
    env = await start_env(
        nursery, task_support={"gated": "required", "ask": "required"}, scope=by_principal, **kw
    )
    gates: dict[str, trio.Event] = {}

    @env.app.tool()
    async def gated(ctx: Context, label: str = "x") -> str:
        """Waits for its gate."""
        assert ctx.task_id is not None
        gate = gates.setdefault(ctx.task_id, trio.Event())
        await gate.wait()
        return f"Completed {label}"

    @env.app.tool()
    async def ask(ctx: Context) -> str:
        """Parks for input."""
        answer = await ctx.await_input("q", elicitation("Sure?", {"type": "object"}))
        return f"answer {answer['action']}"

    return env, gates


class Listener:
    """A listen request running in the background with a recording ``emit``."""

    def __init__(self, env: Env, listen_id: str) -> None:
        self.env = env
        self.listen_id = listen_id
        self.recorder = Recorder()
        self.scope = trio.CancelScope()
        self.response: dict[str, Any] | None = None
        self.done = trio.Event()

    async def run(self, notifications: dict[str, Any], **kw: Any) -> None:
        try:
            with self.scope:
                self.response = await self.env.call(
                    "subscriptions/listen",
                    {"notifications": notifications},
                    emit=self.recorder,
                    id=self.listen_id,
                    **kw,
                )
        finally:
            self.done.set()

    def frames(self, method: str = "notifications/tasks") -> list[dict[str, Any]]:
        return self.recorder.of(method)


async def _listen(
    nursery: trio.Nursery, env: Env, notifications: dict[str, Any], **kw: Any
) -> Listener:
    listener = Listener(env, kw.pop("listen_id", "listen-1"))
    nursery.start_soon(lambda: listener.run(notifications, **kw))
    await listener.recorder.wait_for(1)
    return listener


def _ack(listener: Listener) -> dict[str, Any]:
    first = listener.recorder.messages[0]
    assert first["method"] == "notifications/subscriptions/acknowledged"
    params: dict[str, Any] = first["params"]
    return params


# -- in process ---------------------------------------------------------------------------------


@pytest.mark.contract("tasks-extension-subscriptions")
async def test_listen_filters_conceals_and_pushes_status(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env, gates = await _env(nursery)
    mine = await env.create("gated", {"label": "mine"}, principal="alice")
    other = await env.create("gated", {"label": "other"}, principal="bob")
    listener = await _listen(
        nursery,
        env,
        {"toolsListChanged": True, "taskIds": [mine, "unknown-task", mine, other]},
        principal="alice",
    )
    # The accepted filter: core keys beside taskIds, deduplicated, unknown/foreign ids dropped.
    assert _ack(listener) == {
        "_meta": {SUB: "listen-1"},
        "notifications": {"toolsListChanged": True, "taskIds": [mine]},
    }
    await listener.recorder.wait_for(2)
    # The current status right after the acknowledgement: DetailedTask fields, no resultType.
    current = await env.get(mine, principal="alice")
    (snapshot,) = listener.frames()
    assert snapshot == {
        **{k: v for k, v in current.items() if k not in ("resultType", "_meta")},
        "_meta": {SUB: "listen-1"},
    }
    assert set(snapshot) == BASE_FIELDS | {"statusMessage", "_meta"}

    gates.setdefault(other, trio.Event()).set()  # a foreign task's change is never delivered
    await env.wait_status(other, "completed", principal="bob")
    gates.setdefault(mine, trio.Event()).set()
    await listener.recorder.wait_for(3)
    pushed = listener.frames()[1]
    done = await env.get(mine, principal="alice")
    assert pushed == {
        **{k: v for k, v in done.items() if k not in ("resultType", "_meta")},
        "_meta": {SUB: "listen-1"},
    }
    assert pushed["status"] == "completed"
    assert pushed["result"]["content"] == [{"type": "text", "text": "Completed mine"}]
    assert "resultType" not in pushed

    env.app.notify_tools_changed()  # core events still flow on the same stream
    await listener.recorder.wait_for(4)
    assert listener.recorder.messages[3] == {
        "jsonrpc": "2.0",
        "method": "notifications/tools/list_changed",
        "params": {"_meta": {SUB: "listen-1"}},
    }
    assert [f["taskId"] for f in listener.frames()] == [mine, mine]

    env.app.hub.close()  # graceful end: the listen request completes
    await listener.done.wait()
    assert listener.response == {
        "jsonrpc": "2.0",
        "id": "listen-1",
        "result": {
            "resultType": "complete",
            "_meta": {SUB: "listen-1", SERVER_INFO_KEY: {"name": "tasks-test", "version": "0.1.0"}},
        },
    }


@pytest.mark.contract("tasks-extension-subscriptions")
async def test_every_applied_transition_is_pushed(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env, _ = await _env(nursery)
    asked = await env.create("ask", caps={**TASKS_CAPS, "elicitation": {}}, principal="alice")
    await env.wait_status(asked, "input_required", principal="alice")
    gated = await env.create("gated", principal="alice")
    listener = await _listen(nursery, env, {"taskIds": [asked, gated]}, principal="alice")
    await listener.recorder.wait_for(3)
    assert [(f["taskId"], f["status"]) for f in listener.frames()] == [
        (asked, "input_required"),
        (gated, "working"),
    ]
    assert listener.frames()[0]["inputRequests"] == {"q": elicitation("Sure?", {"type": "object"})}
    update = {"taskId": asked, "inputResponses": {"q": {"action": "accept"}}}
    await env.result("tasks/update", update, principal="alice")
    await env.wait_status(asked, "completed", principal="alice")
    await env.result("tasks/cancel", {"taskId": gated}, principal="alice")
    await listener.recorder.wait_for(6)
    assert [(f["taskId"], f["status"]) for f in listener.frames()] == [
        (asked, "input_required"),
        (gated, "working"),
        (asked, "working"),
        (asked, "completed"),
        (gated, "cancelled"),
    ]
    assert listener.frames()[4]["statusMessage"] == "Cancellation requested"
    assert all(f["_meta"] == {SUB: "listen-1"} for f in listener.frames())
    listener.scope.cancel()
    await listener.done.wait()
    assert env.app.hub.subscriber_count == 0


@pytest.mark.contract("tasks-extension-subscriptions")
async def test_dedup_keeps_order_and_all_unknown_opens_with_an_empty_filter(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env, _ = await _env(nursery)
    first = await env.create("gated", principal="alice")
    second = await env.create("gated", principal="alice")
    listener = await _listen(
        nursery, env, {"taskIds": [second, first, second, first]}, principal="alice"
    )
    assert _ack(listener)["notifications"] == {"taskIds": [second, first]}
    await listener.recorder.wait_for(3)
    assert [f["taskId"] for f in listener.frames()] == [second, first]
    listener.scope.cancel()

    # Only unknown or foreign ids: the stream still opens, with the accepted filter {}.
    concealed = await _listen(
        nursery,
        env,
        {"taskIds": ["unknown-task", first, "x" * 256]},
        principal="mallory",
        listen_id="listen-2",
    )
    assert _ack(concealed) == {"_meta": {SUB: "listen-2"}, "notifications": {}}
    await trio.sleep(1)
    assert len(concealed.recorder.messages) == 1
    # 100 entries is the limit, not an error.
    many = await _listen(
        nursery,
        env,
        {"taskIds": [first] + [f"t{i}" for i in range(99)]},
        principal="alice",
        listen_id="listen-3",
    )
    assert _ack(many)["notifications"] == {"taskIds": [first]}
    concealed.scope.cancel()
    many.scope.cancel()


@pytest.mark.parametrize(
    ("task_ids", "message"),
    [
        ("task-1", "subscriptions/listen taskIds must be a list"),
        ({"id": "task-1"}, "subscriptions/listen taskIds must be a list"),
        (None, "subscriptions/listen taskIds must be a list"),
        ([f"t{i}" for i in range(101)], "taskIds must contain at most 100 entries"),
        ([""], "taskIds must contain non-empty strings"),
        (["ok", 5], "taskIds must contain non-empty strings"),
        ([None], "taskIds must contain non-empty strings"),
        (["x" * 257], "taskIds entries must be at most 256 bytes"),
        (["✓" * 86], "taskIds entries must be at most 256 bytes"),
    ],
)
@pytest.mark.contract("tasks-extension-subscriptions")
async def test_malformed_task_ids_are_refused_before_the_stream_opens(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, task_ids: Any, message: str
) -> None:
    env, _ = await _env(nursery)
    recorder = Recorder()
    response = await env.call(
        "subscriptions/listen",
        {"notifications": {"toolsListChanged": True, "taskIds": task_ids}},
        emit=recorder,
    )
    assert response["error"] == {"code": -32602, "message": message}
    assert recorder.messages == []
    assert env.app.hub.subscriber_count == 0


@pytest.mark.contract("tasks-extension-subscriptions")
async def test_task_ids_need_the_declaration(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env, _ = await _env(nursery)
    task_id = await env.create("gated", principal="alice")
    for task_ids in ([task_id], "malformed"):
        recorder = Recorder()
        response = await env.call(
            "subscriptions/listen",
            {"notifications": {"taskIds": task_ids}},
            tasks=False,
            emit=recorder,
            principal="alice",
        )
        assert response["error"] == {
            "code": -32021,
            "message": "Missing required client capability",
            "data": {"requiredCapabilities": {"extensions": {EXTENSION_ID: {}}}},
        }
        assert recorder.messages == []
    # Core filters alone need no declaration.
    listener = await _listen(nursery, env, {"toolsListChanged": True}, tasks=False)
    assert _ack(listener)["notifications"] == {"toolsListChanged": True}
    listener.scope.cancel()


# -- over Streamable HTTP (real socket, real clock) ---------------------------------------------


async def _sse(response: httpx.Response) -> AsyncGenerator[dict[str, Any], None]:
    data: list[str] = []
    async for line in response.aiter_lines():
        if line.startswith("data:"):
            data.append(line[5:].strip())
        elif line == "" and data:
            yield json.loads("\n".join(data))
            data = []


@pytest.mark.contract("tasks-extension-subscriptions-http")
async def test_listen_over_http_streams_task_notifications_and_close_propagates(
    nursery: trio.Nursery, http_server: Callable[..., Any]
) -> None:
    env, gates = await _env(nursery)
    url = (await http_server(env.app)) + "/mcp"
    async with httpx.AsyncClient(timeout=10) as client:
        created = await client.post(
            url,
            content=body("tools/call", {"name": "gated", "arguments": {"label": "http"}}),
            headers=http_headers("tools/call", name="gated"),
        )
        assert created.status_code == 200
        task_id = created.json()["result"]["taskId"]
        listen = body(
            "subscriptions/listen",
            {"notifications": {"toolsListChanged": True, "taskIds": [task_id, "nope", task_id]}},
            id="sse-listen",
        )
        async with AsyncExitStack() as stack:
            response = await stack.enter_async_context(
                client.stream(
                    "POST", url, content=listen, headers=http_headers("subscriptions/listen")
                )
            )
            assert response.status_code == 200
            assert response.headers["content-type"] == "text/event-stream"
            frames = await stack.enter_async_context(aclosing(_sse(response)))
            ack = await anext(frames)
            assert ack == {
                "jsonrpc": "2.0",
                "method": "notifications/subscriptions/acknowledged",
                "params": {
                    "_meta": {SUB: "sse-listen"},
                    "notifications": {"toolsListChanged": True, "taskIds": [task_id]},
                },
            }
            current = await anext(frames)
            assert current["method"] == "notifications/tasks"
            assert current["params"]["taskId"] == task_id
            assert current["params"]["status"] == "working"
            assert current["params"]["_meta"] == {SUB: "sse-listen"}
            assert "resultType" not in current["params"]
            assert env.app.hub.subscriber_count == 1
            gates.setdefault(task_id, trio.Event()).set()
            pushed = await anext(frames)
            assert pushed["method"] == "notifications/tasks"
            assert pushed["params"]["status"] == "completed"
            assert pushed["params"]["result"]["content"] == [
                {"type": "text", "text": "Completed http"}
            ]
            assert pushed["params"]["_meta"] == {SUB: "sse-listen"}
            assert set(pushed["params"]) == BASE_FIELDS | {"result", "_meta"}

        # The client closed the stream: the server's listen ends and unsubscribes.
        async def unsubscribed() -> bool | None:
            return True if env.app.hub.subscriber_count == 0 else None

        with trio.fail_after(5):
            await poll(unsubscribed)


@pytest.mark.contract("tasks-extension-subscriptions-http")
async def test_listen_over_http_refuses_malformed_or_undeclared_task_ids_with_json(
    nursery: trio.Nursery, http_server: Callable[..., Any]
) -> None:
    env, _ = await _env(nursery)
    url = (await http_server(env.app)) + "/mcp"
    async with httpx.AsyncClient(timeout=10) as client:
        cases = [
            ({"taskIds": "t"}, True, 400, -32602),
            ({"taskIds": [""]}, True, 400, -32602),
            ({"taskIds": ["t"]}, False, 400, -32021),
        ]
        for notifications, tasks, status, code in cases:
            response = await client.post(
                url,
                content=body("subscriptions/listen", {"notifications": notifications}, tasks=tasks),
                headers=http_headers("subscriptions/listen"),
            )
            assert response.status_code == status
            assert response.headers["content-type"] == "application/json"
            assert response.json()["error"]["code"] == code
    assert env.app.hub.subscriber_count == 0
