"""The Runner on an exclusive SqliteStore, end to end: work in flight when everything stops is
reclaimed by the next process at once (the boot epoch fences the old claim), a retry's
deadline survives the reopen on the store's clock, and the input inbox survives it too.

The store clock is a ``ManualClock`` (called in the store's worker thread); trio's clock is
the real one (never ``MockClock`` autojump with real threads). Waiting is done on observable
progress (store calls, claims, commits), never on guessed durations.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio
from tritask_sqlite import SqliteStore

from tritask.jsonrpc import JSONValue, Request
from tritask.protocol.meta import CLIENT_CAPABILITIES_KEY, PROTOCOL_VERSION_KEY
from tritask.server.app import App
from tritask.server.context import Context
from tritask.server.dispatcher import Dispatcher
from tritask.tasks.events import Event
from tritask.tasks.executor import Completed, ExecutionToken, Outcome, Retry
from tritask.tasks.extension import EXTENSION_ID, Tasks
from tritask.tasks.model import Snapshot, Task, TaskStatus, new_task
from tritask.tasks.runner import Runner
from tritask.tasks.store import (
    NOT_FOUND,
    Access,
    Action,
    Claimed,
    Deferred,
    Lease,
    NotFound,
    RequestAuthority,
    StaleLease,
    Transition,
    Unavailable,
    WorkerAuthority,
)
from tritask.tasks.work import RetryPolicy, Work
from tritask.testing.store_contract import START, ManualClock

pytestmark = pytest.mark.contract("tasks-durable-store")

T = TypeVar("T")
MS = 1000
ANYONE: dict[str, str] = {}
ASK = {"method": "elicitation/create", "params": {"message": "Proceed?"}}
DONE: dict[str, Any] = {"content": [{"type": "text", "text": "done"}], "isError": False}
STATE_KEY = "tritask-test-state-key-0123456789"


class Tracked:
    """Delegates to a SqliteStore, recording claims; once ``dead`` its releases are lost (what
    a killed process leaves behind)."""

    def __init__(self, inner: SqliteStore) -> None:
        self.inner = inner
        self.dead = False
        self.leases: list[Lease] = []
        self.claim_next_calls = 0
        self.changed = trio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _tick(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def create_claimed(
        self, task: Task, work: Work, access: Access, owner_id: str, lease_ms: int
    ) -> Claimed:
        result = await self.inner.create_claimed(task, work, access, owner_id, lease_ms)
        self.leases.append(result.lease)
        self._tick()
        return result

    async def claim(
        self, task_id: str, owner_id: str, lease_ms: int
    ) -> Claimed | Deferred | Unavailable | NotFound:
        result = await self.inner.claim(task_id, owner_id, lease_ms)
        if isinstance(result, Claimed):
            self.leases.append(result.lease)
        self._tick()
        return result

    async def claim_next(self, owner_id: str, lease_ms: int) -> Claimed | None:
        result = await self.inner.claim_next(owner_id, lease_ms)
        self.claim_next_calls += 1
        if result is not None:
            self.leases.append(result.lease)
        self._tick()
        return result

    async def release(self, lease: Lease) -> None:
        if self.dead:
            await trio.lowlevel.checkpoint()
            return
        await self.inner.release(lease)

    async def recovery_passes(self, count: int) -> None:
        """Wait until the recovery loop has asked the store ``count`` more times."""
        target = self.claim_next_calls + count
        with trio.fail_after(30):
            while self.claim_next_calls < target:
                await self.changed.wait()


async def eventually(probe: Callable[[], Awaitable[T | None]]) -> T:
    """Poll ``probe`` (real time) until it returns a value; fail after 30 s."""
    with trio.fail_after(30):
        while True:
            value = await probe()
            if value is not None:
                return value
            await trio.sleep(0.005)


async def snapshot_of(store: SqliteStore, task_id: str) -> Snapshot:
    snapshot = await store.get(task_id, await store.authorize(ANYONE, Action.GET, task_id))
    assert isinstance(snapshot, Snapshot), snapshot
    return snapshot


async def status_is(store: SqliteStore, task_id: str, *statuses: str) -> Snapshot | None:
    snapshot = await snapshot_of(store, task_id)
    return snapshot if snapshot.task.status in statuses else None


async def ledger_kinds(store: SqliteStore, task_id: str) -> list[str]:
    return [entry.event.kind.value for entry in await store.history(task_id)]


async def start_killable(nursery: trio.Nursery, runner: Runner) -> trio.CancelScope:
    async def host(*, task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        async with trio.open_nursery() as inner:
            await inner.start(runner.run)
            task_status.started(inner.cancel_scope)

    scope: trio.CancelScope = await nursery.start(host)
    return scope


def sqlite(path: Path, clock: ManualClock) -> SqliteStore:
    return SqliteStore(path, scope="shared", clock=clock, exclusive=True)


async def create_job(store: SqliteStore, runner: Runner, task_id: str, work: Work) -> None:
    access = await store.authorize(ANYONE, Action.CREATE, task_id)
    await runner.create_task(new_task(task_id, await store.now(), None, 100), work, access)


# -- work in flight when everything stops -------------------------------------------------------


def tools_call(name: str, arguments: dict[str, JSONValue]) -> Request:
    meta: dict[str, JSONValue] = {
        PROTOCOL_VERSION_KEY: "2026-07-28",
        CLIENT_CAPABILITIES_KEY: {"extensions": {EXTENSION_ID: {}}},
    }
    params: dict[str, JSONValue] = {"name": name, "arguments": arguments, "_meta": meta}
    return Request(id=1, method="tools/call", params=params)


async def test_reopening_exclusively_fences_the_dead_claim_and_reclaims_it_at_once(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """The store clock never moves and the lease is 10 minutes: the new process cannot wait
    the lease out, it reclaims at generation 2 only because the boot epoch advanced."""
    path, clock = tmp_path / "tasks.db", ManualClock()
    app = App("durable-test", "0.1.0", state_key=STATE_KEY)
    tasks = Tasks(task_support={"export": "required"})
    app.add_extension(tasks)
    attempts: list[tuple[str | None, bool]] = []
    started = trio.Event()

    @app.tool()
    async def export(ctx: Context, document: str) -> str:
        """The first attempt is in flight when its process dies."""
        attempts.append((ctx.idempotency_key, ctx.detached))
        if len(attempts) == 1:
            started.set()
            await trio.sleep_forever()
        return f"exported {document}"

    first_store = sqlite(path, clock)
    await first_store.open()
    first_epoch = first_store.boot_epoch
    tracked = Tracked(first_store)
    runner_1 = Runner(tracked, lease_ms=600_000, reap_interval_ms=None)
    kill = await start_killable(nursery, runner_1)
    tasks.store, tasks.runner = tracked, runner_1
    response = await Dispatcher(app).handle_request(tools_call("export", {"document": "q3"}))
    task_id = response["result"]["taskId"]
    with trio.fail_after(30):
        await started.wait()
    old_access = await first_store.authorize(ANYONE, Action.GET, task_id)
    (old_lease,) = tracked.leases
    assert (old_lease.generation, old_lease.epoch) == (1, first_epoch)

    # Everything stops mid-flight: the runner dies without releasing, the file is closed.
    tracked.dead = True
    kill.cancel()
    await runner_1.wait_stopped()
    await first_store.aclose()
    tasks.store = tasks.runner = None

    async with sqlite(path, clock) as store:
        assert store.boot_epoch == first_epoch + 1
        retracked = Tracked(store)
        runner_2 = Runner(retracked, recover=True, lease_ms=600_000, reap_interval_ms=None)
        tasks.store, tasks.runner = retracked, runner_2
        await nursery.start(runner_2.run)
        done = await eventually(functools.partial(status_is, store, task_id, "completed"))
        (new_lease,) = retracked.leases
        assert (new_lease.generation, new_lease.epoch) == (2, first_epoch + 1)
        assert new_lease.expires_at == START + 600_000 * MS  # claimed at the same instant
        # Same idempotency key on both attempts; the recovered one is detached from any request.
        assert attempts == [(task_id, True), (task_id, True)]
        assert done.task.result is not None
        assert done.task.result["content"] == [{"type": "text", "text": "exported q3"}]
        assert await ledger_kinds(store, task_id) == ["completed"]

        # The dead process's lease and access values are fenced by the epoch.
        failure = Event.failed({"code": -32603, "message": "late"}, "late")
        with pytest.raises(StaleLease):
            await store.transition(task_id, done.revision, failure, WorkerAuthority(old_lease))
        with pytest.raises(StaleLease):
            await store.worker_snapshot(task_id, old_lease)
        with pytest.raises(StaleLease):
            await store.renew(old_lease, 1_000)
        with pytest.raises(StaleLease):
            await store.release(old_lease)
        assert await store.get(task_id, old_access) is NOT_FOUND
        runner_2.stop()
        await runner_2.wait_stopped()
    tasks.store = tasks.runner = None


# -- a retry deadline survives the reopen -------------------------------------------------------


async def test_a_retry_deadline_survives_a_reopen_on_the_store_clock(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    path, clock = tmp_path / "tasks.db", ManualClock()
    attempts: list[tuple[int, int]] = []

    async def execute(work: Work, token: ExecutionToken, state: Any) -> Outcome:
        attempts.append((token.generation, clock()))
        if len(attempts) == 1:
            return Retry({"code": -32000, "message": "later"}, "retrying")
        return Completed(DONE)

    executor = type("Executor", (), {"execute": staticmethod(execute)})()
    work = Work(idempotency_key="t1", type="job", input={}, retry_policy=RetryPolicy([60_000]))
    async with sqlite(path, clock) as store, Runner(store, executor=executor) as runner:
        await create_job(store, runner, "t1", work)
        waiting = await eventually(functools.partial(_retry_pending, store))
        # Created at START; the retry committed 1 ms later (same clock reading).
        assert waiting.retry_at == START + 60_001 * MS
    assert attempts == [(1, START)]

    async with sqlite(path, clock) as store:
        snapshot = await snapshot_of(store, "t1")
        assert snapshot.retry_at == START + 60_001 * MS
        assert snapshot.retry_count == 1
        # The reference's worked example: reopened while the clock still reads the creation
        # instant, the claim is deferred by 60001 ms.
        assert await store.claim("t1", "probe", 1_000) == Deferred(60_001)
        tracked = Tracked(store)
        runner = Runner(tracked, executor=executor, recover=True, recovery_interval_ms=5)
        await nursery.start(runner.run)
        await tracked.recovery_passes(3)
        clock.advance(60_000)  # retry_at - 1 ms
        assert await store.claim("t1", "probe", 1_000) == Deferred(1)
        await tracked.recovery_passes(3)
        assert attempts == [(1, START)]  # nothing ran early
        clock.advance(1)
        done = await eventually(functools.partial(status_is, store, "t1", "completed"))
        assert attempts == [(1, START), (2, START + 60_001 * MS)]
        assert [lease.generation for lease in tracked.leases] == [2]
        assert done.retry_count == 1 and done.retry_at is None
        assert done.task.last_updated_at == START + 60_001 * MS
        assert await ledger_kinds(store, "t1") == ["retry_requested", "completed"]
        runner.stop()
        await runner.wait_stopped()


async def _retry_pending(store: SqliteStore) -> Snapshot | None:
    snapshot = await snapshot_of(store, "t1")
    return snapshot if snapshot.retry_at is not None else None


# -- the inbox survives the reopen --------------------------------------------------------------


@pytest.mark.parametrize("answered", ["before the stop", "while nothing runs"])
async def test_the_input_inbox_survives_a_reopen(
    tmp_path: Path, nursery: trio.Nursery, answered: str
) -> None:
    path, clock = tmp_path / "tasks.db", ManualClock()
    answers: list[tuple[int, dict[str, Any]]] = []
    got_answer = trio.Event()

    async def execute(work: Work, token: ExecutionToken, state: Any) -> Outcome:
        answer = await token.await_input("confirm", ASK)
        answers.append((token.generation, answer))
        if token.generation == 1:
            got_answer.set()
            await trio.sleep_forever()  # still working when everything stops
        return Completed({"content": [], "structuredContent": answer, "isError": False})

    executor = type("Executor", (), {"execute": staticmethod(execute)})()
    work = Work(idempotency_key="t1", type="job", input={})
    response = {"action": "accept", "content": {"confirmed": True}}
    async with sqlite(path, clock) as store, Runner(store, executor=executor) as runner:
        await create_job(store, runner, "t1", work)
        await eventually(functools.partial(status_is, store, "t1", "input_required"))
        if answered == "before the stop":
            access = await store.authorize(ANYONE, Action.UPDATE, "t1")
            await runner.update("t1", {"confirm": response}, access)
            with trio.fail_after(30):
                await got_answer.wait()
    # Runner stopped (its attempt cancelled, its claim released), file closed.

    async with sqlite(path, clock) as store:
        if answered == "while nothing runs":
            parked = await snapshot_of(store, "t1")
            assert parked.task.status is TaskStatus.INPUT_REQUIRED
            update = RequestAuthority(await store.authorize(ANYONE, Action.UPDATE, "t1"))
            accepted = await store.transition(
                "t1", parked.revision, Event.input_responses_accepted({"confirm": response}), update
            )
            assert isinstance(accepted, Transition) and accepted.outcome == "applied"
        stored = await snapshot_of(store, "t1")
        assert stored.accepted_input_responses == {"confirm": response}
        assert stored.input_history == {"confirm": ASK}
        assert stored.task.status is TaskStatus.WORKING
        async with Runner(store, executor=executor, recover=True):
            done = await eventually(functools.partial(status_is, store, "t1", "completed"))
        # The recovered attempt got the persisted answer at once: no second request.
        first = [(1, response)] if answered == "before the stop" else []
        assert answers == [*first, (2, response)]
        assert done.task.result == {"content": [], "structuredContent": response, "isError": False}
        assert await ledger_kinds(store, "t1") == [
            "input_requested",
            "input_responses_accepted",
            "completed",
        ]
