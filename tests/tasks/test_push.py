"""Push of ``notifications/tasks`` from the store's change feed (``OffersChanges``), in process.

What is guaranteed (docs/architecture.md, "Push"): a listen stream sends each watched task's
revisions in increasing order, never one twice, ending with the terminal one; a stream that
keeps up sees every revision committed in this process; one that falls behind has its buffer
coalesced to the latest state of each task, never more than the hub's buffer. A watched task
that is reaped is dropped from the stream, which ends when nothing is left to listen for.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import pytest
import trio
import trio.testing
from helpers import (
    ELICIT_CAPS,
    Env,
    Recorder,
    by_principal,
    start_env,
)

from tritask.jsonrpc import JSONValue
from tritask.protocol.meta import SUBSCRIPTION_ID_KEY
from tritask.server.context import Context
from tritask.server.mrtr import elicitation
from tritask.tasks.changes import RESYNC, ChangeFeed, TaskChange
from tritask.tasks.extension import Tasks
from tritask.tasks.memory import MemoryStore
from tritask.tasks.model import TaskStatus
from tritask.tasks.runner import Runner
from tritask.tasks.store import Unauthorized, offers_changes

SUB = SUBSCRIPTION_ID_KEY


async def _env(nursery: trio.Nursery, **kw: Any) -> tuple[Env, dict[str, trio.Event]]:
    env = await start_env(
        nursery,
        task_support={"gated": "required", "rounds": "required"},
        scope=by_principal,
        **kw,
    )
    gates: dict[str, trio.Event] = {}

    @env.app.tool()
    async def gated(ctx: Context) -> str:
        """Waits for its gate."""
        assert ctx.task_id is not None
        await gates.setdefault(ctx.task_id, trio.Event()).wait()
        return "done"

    @env.app.tool()
    async def rounds(ctx: Context, count: int = 2) -> str:
        """Asks ``count`` questions in turn."""
        for index in range(count):
            request = elicitation(f"Question {index}?", {"type": "object"})
            await ctx.await_input(f"q{index}", request)
        return f"answered {count}"

    return env, gates


class Listen:
    def __init__(self, env: Env, listen_id: str) -> None:
        self.env = env
        self.listen_id = listen_id
        self.recorder = Recorder()
        self.scope = trio.CancelScope()
        self.response: dict[str, Any] | None = None
        self.done = trio.Event()

    async def run(self, notifications: dict[str, Any], principal: Any) -> None:
        try:
            with self.scope:
                self.response = await self.env.call(
                    "subscriptions/listen",
                    {"notifications": notifications},
                    emit=self.recorder,
                    id=self.listen_id,
                    principal=principal,
                )
        finally:
            self.done.set()

    def statuses(self) -> list[tuple[str, str]]:
        return [(f["taskId"], f["status"]) for f in self.recorder.of("notifications/tasks")]


async def _listen(
    nursery: trio.Nursery,
    env: Env,
    notifications: dict[str, Any],
    *,
    principal: Any = "alice",
    listen_id: str = "listen-1",
) -> Listen:
    listener = Listen(env, listen_id)
    nursery.start_soon(listener.run, notifications, principal)
    await listener.recorder.wait_for(1)
    return listener


async def _answer(env: Env, task_id: str, key: str, principal: str = "alice") -> None:
    await env.result(
        "tasks/update",
        {"taskId": task_id, "inputResponses": {key: {"action": "accept"}}},
        principal=principal,
    )


# -- the feed ---------------------------------------------------------------------------------


async def test_the_feed_resyncs_first_delivers_in_order_and_a_laggard_gets_one_resync() -> None:
    feed = ChangeFeed(limit=3)
    assert not feed.active
    changes = [TaskChange("reaped", f"t{i}") for i in range(5)]
    async with trio.open_nursery() as nursery:
        fast: list[TaskChange] = []
        slow_stream = feed.changes()
        assert await anext(slow_stream) is RESYNC  # registered now, reading nothing more

        async def consume(stream: AsyncGenerator[TaskChange, None]) -> None:
            async for change in stream:
                fast.append(change)

        nursery.start_soon(consume, feed.changes())
        await trio.testing.wait_all_tasks_blocked()
        assert (feed.active,) == (True,)  # a tuple: mypy keeps the earlier narrowing
        for change in changes:
            feed.announce(change)
            await trio.testing.wait_all_tasks_blocked()
        assert fast == [RESYNC, *changes]
        # The slow one fell behind its 3 changes: it lost them all and gets one resync, then
        # what came after it read the resync.
        assert await anext(slow_stream) is RESYNC
        feed.announce(changes[0])
        assert await anext(slow_stream) == changes[0]
        feed.close()
        with pytest.raises(StopAsyncIteration):
            await anext(slow_stream)
    assert fast == [RESYNC, *changes, changes[0]]
    assert not feed.active
    assert [c async for c in feed.changes()] == []  # a closed feed yields nothing


async def test_the_memory_store_announces_every_applied_commit_and_every_reap(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env, _ = await _env(nursery, runner_options={"reap_interval_ms": None})
    assert offers_changes(env.memory)
    stream = env.memory.changes()
    assert await anext(stream) is RESYNC
    task_id = await env.create("rounds", {"count": 1}, caps=ELICIT_CAPS, principal="alice")
    await env.wait_status(task_id, "input_required", principal="alice")
    await _answer(env, task_id, "q0")
    await env.wait_status(task_id, "completed", principal="alice")
    seen = [await anext(stream) for _ in range(3)]
    assert [(c.kind, c.task_id, c.revision, c.status) for c in seen] == [
        ("changed", task_id, 1, TaskStatus.INPUT_REQUIRED),
        ("changed", task_id, 2, TaskStatus.WORKING),
        ("changed", task_id, 3, TaskStatus.COMPLETED),
    ]
    assert all(c.task is not None and c.task.status == c.status for c in seen)
    await trio.sleep(3_601)
    assert await env.runner.reap_once() == [task_id]
    assert await anext(stream) == TaskChange("reaped", task_id)
    await stream.aclose()


# -- listen streams ---------------------------------------------------------------------------


async def test_a_listener_sees_every_committed_status_in_order_and_nothing_else(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env, _ = await _env(nursery)
    mine = await env.create("rounds", {"count": 2}, caps=ELICIT_CAPS, principal="alice")
    other = await env.create("rounds", {"count": 1}, caps=ELICIT_CAPS, principal="alice")
    foreign = await env.create("rounds", {"count": 1}, caps=ELICIT_CAPS, principal="bob")
    await env.wait_status(mine, "input_required", principal="alice")
    listener = await _listen(nursery, env, {"taskIds": [mine, foreign]})
    assert listener.recorder.messages[0]["params"]["notifications"] == {"taskIds": [mine]}
    for key in ("q0", "q1"):
        await env.wait_status(mine, "input_required", principal="alice")
        await _answer(env, mine, key)
    await env.wait_status(other, "input_required", principal="alice")
    await _answer(env, other, "q0")
    await env.wait_status(foreign, "input_required", principal="bob")
    await _answer(env, foreign, "q0", principal="bob")
    await env.wait_status(mine, "completed", principal="alice")
    await env.wait_status(other, "completed", principal="alice")
    await env.wait_status(foreign, "completed", principal="bob")
    await trio.testing.wait_all_tasks_blocked()
    # Every revision of the watched task from the one current at listen time: input_required
    # (q0), working, input_required (q1), working, completed; nothing of the others.
    assert listener.statuses() == [
        (mine, "input_required"),
        (mine, "working"),
        (mine, "input_required"),
        (mine, "working"),
        (mine, "completed"),
    ]
    frames = listener.recorder.of("notifications/tasks")
    asked = [set(f.get("inputRequests", {})) for f in frames]
    assert asked == [{"q0"}, set(), {"q1"}, set(), set()]
    assert frames[-1]["result"]["content"] == [{"type": "text", "text": "answered 2"}]
    assert all(f["_meta"] == {SUB: "listen-1"} for f in frames)
    listener.scope.cancel()
    await listener.done.wait()
    assert env.app.hub.subscriber_count == 0


async def test_a_task_run_by_another_runner_on_the_same_store_is_pushed(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """Two runners (two "hosts" in one process) share a MemoryStore: the listener's extension
    hears commits made by the other runner, through the store's feed."""
    env, gates = await _env(nursery)
    worker = Runner(env.memory, reap_interval_ms=None)
    await nursery.start(worker.run)
    other_tasks = Tasks(store=env.memory, runner=worker, task_support={"gated": "required"})
    other_app = type(env.app)("other-host", "0.1.0", state_key="other-host-state-key-0123456789")
    other_app.add_extension(other_tasks)

    @other_app.tool()
    async def gated(ctx: Context) -> str:
        """Waits for its gate."""
        assert ctx.task_id is not None
        await gates.setdefault(ctx.task_id, trio.Event()).wait()
        return "done elsewhere"

    other_env = Env(
        app=other_app,
        tasks=other_tasks,
        store=env.memory,
        memory=env.memory,
        runner=worker,
        events=env.events,
        clock=env.clock,
    )
    task_id = await other_env.create("gated", principal="alice")
    assert task_id not in env.runner.active_task_ids()
    listener = await _listen(nursery, env, {"taskIds": [task_id]})
    await listener.recorder.wait_for(2)
    gates.setdefault(task_id, trio.Event()).set()
    await listener.recorder.wait_for(3)
    assert listener.statuses() == [(task_id, "working"), (task_id, "completed")]
    frame = listener.recorder.of("notifications/tasks")[-1]
    assert frame["result"]["content"] == [{"type": "text", "text": "done elsewhere"}]
    listener.scope.cancel()


async def test_a_reaped_task_ends_a_stream_that_watched_only_it(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env, gates = await _env(nursery, tasks_options={"ttl_ms": 5_000})
    first = await env.create("gated", principal="alice")
    second = await env.create("gated", principal="alice")
    only = await _listen(nursery, env, {"taskIds": [first, second]})
    also_tools = await _listen(
        nursery, env, {"taskIds": [first], "toolsListChanged": True}, listen_id="listen-2"
    )
    await only.recorder.wait_for(3)
    await also_tools.recorder.wait_for(2)
    gates.setdefault(first, trio.Event()).set()
    await env.wait_status(first, "completed", principal="alice")
    await trio.sleep(6)
    assert sorted(await env.runner.reap_once()) == sorted([first, second])
    with trio.fail_after(5):
        await only.done.wait()
    # The stream ended cleanly, with the listen request's normal result.
    assert only.response is not None and only.response["result"]["resultType"] == "complete"
    assert only.statuses() == [(first, "working"), (second, "working"), (first, "completed")]
    # The other stream lost its only task but still listens for tool list changes.
    await trio.testing.wait_all_tasks_blocked()
    assert not also_tools.done.is_set()
    env.app.notify_tools_changed()
    await also_tools.recorder.wait_for(4)
    assert also_tools.recorder.messages[-1]["method"] == "notifications/tools/list_changed"
    also_tools.scope.cancel()


async def test_a_resync_rereads_every_watched_task_through_the_store(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env, gates = await _env(nursery)
    task_id = await env.create("gated", principal="alice")
    listener = await _listen(nursery, env, {"taskIds": [task_id]})
    await listener.recorder.wait_for(2)
    # A change the feed lost (as after a reconnect): the store has it, no announcement came.
    stored = await env.snapshot(task_id, type("Ctx", (), {"principal": "alice"})())
    env.tasks._on_change(RESYNC)  # what the runner hands on after a lost feed
    await trio.testing.wait_all_tasks_blocked()
    assert listener.statuses() == [(task_id, "working")]  # the same revision: not sent twice
    gates.setdefault(task_id, trio.Event()).set()
    await listener.recorder.wait_for(3)
    assert listener.statuses() == [(task_id, "working"), (task_id, "completed")]
    assert stored.revision == 0
    listener.scope.cancel()


async def test_a_slow_listener_is_coalesced_to_the_latest_state_of_each_task(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env, _ = await _env(nursery)
    env.app.hub.buffer_size = 4
    ids = [
        await env.create("rounds", {"count": 6}, caps=ELICIT_CAPS, principal="alice")
        for _ in range(2)
    ]
    for task_id in ids:
        await env.wait_status(task_id, "input_required", principal="alice")
    held = trio.Event()
    sent: list[dict[str, JSONValue]] = []

    async def stalled(message: dict[str, JSONValue]) -> None:
        sent.append(message)
        if len(sent) >= 2:  # the acknowledgement and one task, then it stops reading
            await held.wait()

    response: dict[str, Any] = {}

    async def listen() -> None:
        response.update(
            await env.call(
                "subscriptions/listen",
                {"notifications": {"taskIds": ids}},
                emit=stalled,
                id="slow",
                principal="alice",
            )
        )

    nursery.start_soon(listen)
    fast = await _listen(nursery, env, {"taskIds": ids}, listen_id="fast")
    for index in range(6):
        for task_id in ids:
            await env.wait_status(task_id, "input_required", principal="alice")
            await _answer(env, task_id, f"q{index}")
    for task_id in ids:
        await env.wait_status(task_id, "completed", principal="alice")
    await trio.testing.wait_all_tasks_blocked()
    # The fast stream saw every revision of both tasks in order (13 each: input_required and
    # working six times, then completed).
    for task_id in ids:
        mine = [status for tid, status in fast.statuses() if tid == task_id]
        assert mine == ["input_required", "working"] * 6 + ["completed"]
    # The stalled stream holds no more than the hub's buffer: coalesced to the latest state
    # of each task (the fast one has taken everything).
    assert env.app.hub.subscriber_count == 2
    pending = sorted(sub.pending for sub in env.app.hub._subscriptions)
    assert pending[0] == 0 and 2 <= pending[1] <= 4
    held.set()
    await trio.testing.wait_all_tasks_blocked()
    slow_frames = [m["params"] for m in sent if m.get("method") == "notifications/tasks"]
    # Whatever it got is in revision order per task and ends with each task's terminal state.
    for task_id in ids:
        mine = [f["status"] for f in slow_frames if f["taskId"] == task_id]
        assert mine[-1] == "completed"
        assert len(mine) < 13
    assert not response  # still open: coalescing never closes a stream
    fast.scope.cancel()


async def test_without_a_store_feed_the_runner_announces_its_own_transitions(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    class Plain:
        """A store wrapper that offers no ``changes()``."""

        def __init__(self, inner: MemoryStore) -> None:
            self._inner = inner

        def __getattr__(self, name: str) -> Any:
            if name == "changes":
                raise AttributeError(name)
            return getattr(self._inner, name)

    env, gates = await _env(nursery, store=Plain)
    assert not offers_changes(env.store)
    task_id = await env.create("gated", principal="alice")
    listener = await _listen(nursery, env, {"taskIds": [task_id]})
    await listener.recorder.wait_for(2)
    gates.setdefault(task_id, trio.Event()).set()
    await listener.recorder.wait_for(3)
    assert listener.statuses() == [(task_id, "working"), (task_id, "completed")]
    listener.scope.cancel()


TENANT_KEY = "com.example/tenant"


def by_principal_and_tenant(ctx: Any) -> JSONValue:
    """A store scope that also reads the request's own ``_meta`` (a tenant the client names)."""
    tenant = ctx.meta.raw.get(TENANT_KEY)
    if not isinstance(tenant, str):
        raise Unauthorized("no tenant named")
    return [ctx.principal, tenant]


async def test_a_stream_reads_its_tasks_with_the_access_its_listen_request_had(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """The stream outlives its request and keeps only its detached context, which has nothing of
    the request's ``_meta``: a scope function reading it must still have been asked with the
    request (at opening), or the stream would read its tasks as someone else (here: nobody)."""
    env = await start_env(
        nursery, task_support={"gated": "required"}, scope=by_principal_and_tenant
    )
    gate = trio.Event()

    @env.app.tool()
    async def gated(ctx: Context) -> str:
        """Waits for its gate."""
        await gate.wait()
        return "done"

    acme = {TENANT_KEY: "acme"}
    task_id = await env.create("gated", principal="alice", meta_extra=acme)
    recorder = Recorder()
    done = trio.Event()

    async def listen() -> None:
        await env.call(
            "subscriptions/listen",
            {"notifications": {"taskIds": [task_id]}},
            emit=recorder,
            id="listen-1",
            principal="alice",
            meta_extra=acme,
        )
        done.set()

    with trio.CancelScope() as scope:
        nursery.start_soon(listen)
        await recorder.wait_for(2)  # the acknowledgement, then the task's state read when sent
        env.tasks._on_change(RESYNC)  # read again through the store: the same revision, unsent
        await trio.testing.wait_all_tasks_blocked()
        gate.set()
        await recorder.wait_for(3)
        statuses = [(f["taskId"], f["status"]) for f in recorder.of("notifications/tasks")]
        assert statuses == [(task_id, "working"), (task_id, "completed")]
        assert not done.is_set()
        scope.cancel()
