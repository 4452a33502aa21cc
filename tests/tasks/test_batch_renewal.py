"""Runner-level lease renewal: on a store that offers ``renew_all`` a runner renews the leases of
all its attempts in one store call per heartbeat (issue 15, item 3), fencing stays exact per
attempt, changes committed elsewhere still reach the attempt at its next heartbeat, and a runner
that dies with hundreds of running tasks has them adopted by another runner after expiry.

Every test runs on the memory store under ``MockClock``; the SQL stores' ``renew_all`` is held
to the same contract by the store contract suite.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import trio
import trio.testing
from helpers import (
    ANONYMOUS,
    DONE,
    HookedStore,
    MortalStore,
    ScriptedExecutor,
    create_job,
    no_hook,
    sleeper,
    status_of,
    unlimited_memory_store,
    wait_stops,
)

from tritask.tasks import instrumentation as ins
from tritask.tasks.events import Event, EventKind
from tritask.tasks.executor import Completed, ExecutionToken, Outcome
from tritask.tasks.instrumentation import RecordingInstrumentation
from tritask.tasks.memory import MemoryStore
from tritask.tasks.model import TaskStatus
from tritask.tasks.runner import Runner
from tritask.tasks.store import (
    UNAVAILABLE,
    Action,
    DatabaseBusy,
    Lease,
    LeaseLost,
    Renewed,
    RequestAuthority,
    renews_leases,
)
from tritask.tasks.work import Work

pytestmark = pytest.mark.contract("tasks-recovery-claims")

ASK = {"method": "elicitation/create", "params": {"message": "Proceed?"}}


class BatchHookedStore(MortalStore):
    """``MortalStore`` that also offers ``renew_all`` (hook op ``renew_all``); ``batches``
    records the task ids of every batch the runner sent."""

    def __init__(self, inner: MemoryStore, hook: Any = no_hook) -> None:
        super().__init__(inner, hook)
        self.batches: list[tuple[float, list[str]]] = []

    async def renew_all(
        self, owner_id: str, leases: list[Lease] | tuple[Lease, ...], lease_ms: int
    ) -> list[Renewed | LeaseLost]:
        await self._reach()
        self.batches.append((trio.current_time(), [lease.task_id for lease in leases]))
        await self._before("renew_all", owner_id, leases, lease_ms)
        return await self.memory.renew_all(owner_id, leases, lease_ms)


def test_the_built_in_memory_store_renews_in_batches() -> None:
    assert renews_leases(unlimited_memory_store())
    assert not renews_leases(HookedStore(unlimited_memory_store(), no_hook))


async def test_one_store_call_per_heartbeat_renews_every_attempt(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """50 attempts, 10 heartbeats: 10 renew_all calls, no single renew and no re-read."""
    store = BatchHookedStore(unlimited_memory_store())
    events = RecordingInstrumentation()
    runner = Runner(
        store,
        executor=sleeper(10.5),
        lease_ms=3_000,
        max_jobs=100,
        reap_interval_ms=None,
        instrumentation=events,
    )
    await nursery.start(runner.run)
    for n in range(49):
        await create_job(store, runner, f"t{n:02}")
    await trio.sleep_until(0.5)
    await create_job(store, runner, "late")  # started half a heartbeat later
    ids = sorted([f"t{n:02}" for n in range(49)] + ["late"])
    await trio.sleep_until(10.75)
    for n in range(49):
        await wait_stops(events, f"t{n:02}")
    # t00..t48 are due at 1 s, 2 s, ... 10 s; "late" rides along from the first batch on.
    assert [at for at, _ in store.batches] == [float(s) for s in range(1, 11)]
    assert all(sorted(batch) == ids for _, batch in store.batches)
    assert store.calls.count("renew_all") == 10
    assert store.calls.count("renew") == 0
    assert store.calls.count("worker_snapshot") == 0
    renewed = events.named(ins.LEASE_RENEWED)
    assert len(renewed) == 500
    assert {m["generation"] for m, _ in renewed} == {1}
    assert events.named(ins.LEASE_LOST) == []
    await trio.sleep_until(11.25)
    await wait_stops(events, "late")
    for task_id in ids:
        assert await status_of(store, task_id) is TaskStatus.COMPLETED
        assert [md["outcome"] for md in await wait_stops(events, task_id)] == ["completed"]
    runner.stop()


async def test_a_lost_lease_in_a_batch_stops_that_attempt_alone(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """A stale token in the batch is refused for that lease alone: that attempt stops (and
    releases the claim it still holds), recovery adopts the task at the next generation, the
    others keep running on their renewed leases."""
    memory = unlimited_memory_store()
    forged: list[str] = []

    class Forging(BatchHookedStore):
        async def renew_all(
            self, owner_id: str, leases: list[Lease] | tuple[Lease, ...], lease_ms: int
        ) -> list[Renewed | LeaseLost]:
            if not forged:
                leases = [
                    attrs.evolve(lease, token="forged") if lease.task_id == "victim" else lease
                    for lease in leases
                ]
                forged.append("victim")
            return await super().renew_all(owner_id, leases, lease_ms)

    store = Forging(memory)
    events = RecordingInstrumentation()
    attempts: list[tuple[str, int, float]] = []

    async def script(work: Work, token: ExecutionToken) -> Outcome:
        attempts.append((token.task_id, token.generation, trio.current_time()))
        await trio.sleep(5)
        return Completed(DONE)

    runner = Runner(
        store,
        executor=ScriptedExecutor(script),
        recover=True,
        lease_ms=3_000,
        recovery_interval_ms=700,
        reap_interval_ms=None,
        instrumentation=events,
    )
    await nursery.start(runner.run)
    for task_id in ("a", "victim", "b"):
        await create_job(store, runner, task_id)
    await trio.sleep_until(1.0)
    (stop,) = await wait_stops(events, "victim")
    assert stop["outcome"] == "stale_lease"
    assert [(md["task_id"], m["generation"]) for m, md in events.named(ins.LEASE_LOST)] == [
        ("victim", 1)
    ]
    await trio.sleep_until(8.5)
    await wait_stops(events, "victim", 2)
    assert attempts == [
        ("a", 1, 0.0),
        ("victim", 1, 0.0),
        ("b", 1, 0.0),
        ("victim", 2, 1.4),  # the recovery pass after the stop
    ]
    for task_id in ("a", "b", "victim"):
        assert await status_of(store, task_id) is TaskStatus.COMPLETED
        assert [entry.event.kind.value for entry in memory.history(task_id)] == ["completed"]
    assert [md["outcome"] for md in await wait_stops(events, "a")] == ["completed"]
    runner.stop()


async def test_answers_and_cancellations_committed_elsewhere_arrive_at_the_next_heartbeat(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """Another process commits straight to the store: the batch sees the task's revision move,
    and only that attempt re-reads its task (an answer is delivered, a cancellation stops it)."""
    store = BatchHookedStore(unlimited_memory_store())
    events = RecordingInstrumentation()
    answers: list[tuple[Any, float]] = []

    async def script(work: Work, token: ExecutionToken) -> Outcome:
        if token.task_id == "asks":
            answers.append((await token.await_input("go", ASK), trio.current_time()))
        await trio.sleep(30)
        return Completed(DONE)

    runner = Runner(
        store,
        executor=ScriptedExecutor(script),
        lease_ms=3_000,
        reap_interval_ms=None,
        instrumentation=events,
    )
    await nursery.start(runner.run)
    for task_id in ("asks", "cancelled", "idle"):
        await create_job(store, runner, task_id)
    await trio.sleep_until(1.25)
    reads_before = store.calls.count("worker_snapshot")
    update = await store.authorize(ANONYMOUS, Action.UPDATE, "asks")
    cancel = await store.authorize(ANONYMOUS, Action.CANCEL, "cancelled")
    await store.memory.transition(
        "asks", 1, Event.input_responses_accepted({"go": {"ok": True}}), RequestAuthority(update)
    )
    await store.memory.transition("cancelled", 0, Event.cancelled(), RequestAuthority(cancel))
    await trio.sleep_until(1.999)
    assert answers == []
    assert await status_of(store, "cancelled") is TaskStatus.CANCELLED
    assert [md["task_id"] for _, md in events.named(ins.JOB_STOP)] == []
    await trio.sleep_until(2.0)
    (stop,) = await wait_stops(events, "cancelled")
    assert stop["outcome"] == "cancelled"
    assert answers == [({"ok": True}, 2.0)]
    # One re-read each for the two tasks that changed; none for the idle one.
    assert store.calls.count("worker_snapshot") - reads_before == 2
    assert await status_of(store, "idle") is TaskStatus.WORKING
    runner.stop()


async def test_a_transient_renew_all_failure_is_retried_at_the_next_heartbeat(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    failures = 0

    async def hook(op: str, args: tuple[Any, ...]) -> None:
        nonlocal failures
        await trio.lowlevel.checkpoint()
        if op == "renew_all" and failures < 2:
            failures += 1
            raise DatabaseBusy("database is busy")

    store = BatchHookedStore(unlimited_memory_store(), hook)
    events = RecordingInstrumentation()
    runner = Runner(
        store,
        executor=sleeper(9.5),
        lease_ms=6_000,
        heartbeat_ms=1_000,
        reap_interval_ms=None,
        instrumentation=events,
    )
    await nursery.start(runner.run)
    await create_job(store, runner, "slow")
    await trio.sleep_until(9.75)
    (stop,) = await wait_stops(events, "slow")
    assert stop["outcome"] == "completed"
    assert failures == 2
    assert runner.running
    assert [at for at, _ in store.batches] == [float(s) for s in range(1, 10)]
    assert len(events.named(ins.LEASE_RENEWED)) == 7  # 3 s .. 9 s
    assert events.named(ins.LEASE_LOST) == []
    runner.stop()


async def test_an_attempt_whose_commit_is_in_flight_is_renewed_alone_after_it(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """The batch never waits for an attempt's own commit: that attempt's lease is renewed by
    itself as soon as the commit is done, and it rejoins the batch at the next heartbeat."""

    async def hook(op: str, args: tuple[Any, ...]) -> None:
        await trio.lowlevel.checkpoint()
        if op == "transition" and args[2].kind is EventKind.INPUT_REQUESTED:
            await trio.sleep(1.0)  # committing input_requested from 0.5 s to 1.5 s

    store = BatchHookedStore(unlimited_memory_store(), hook)
    events = RecordingInstrumentation()

    async def script(work: Work, token: ExecutionToken) -> Outcome:
        if token.task_id == "asks":
            await trio.sleep(0.5)
            with trio.move_on_after(1.5):
                await token.await_input("go", ASK)
            await trio.sleep(3.25)  # ends at 5.25 s, between two heartbeats
        else:
            await trio.sleep(3.5)
        return Completed(DONE)

    runner = Runner(
        store,
        executor=ScriptedExecutor(script),
        lease_ms=3_000,
        reap_interval_ms=None,
        instrumentation=events,
    )
    await nursery.start(runner.run)
    await create_job(store, runner, "asks")
    await create_job(store, runner, "other")
    await trio.sleep_until(3.75)
    await wait_stops(events, "other")
    assert store.batches[0] == (1.0, ["other"])
    assert store.batches[1] == (2.0, ["asks", "other"])
    assert store.calls.count("renew") == 1
    renewed = [(md["task_id"], trio.current_time()) for _, md in events.named(ins.LEASE_RENEWED)]
    assert [task_id for task_id, _ in renewed].count("asks") >= 2
    await trio.sleep_until(5.5)
    (stop,) = await wait_stops(events, "asks")
    assert stop["outcome"] == "completed"
    assert events.named(ins.LEASE_LOST) == []
    runner.stop()


async def test_a_runner_dying_with_hundreds_of_running_tasks_hands_them_all_over(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """300 attempts renewed in batches; the runner dies between two heartbeats. Nobody takes
    its tasks before the last batch's leases lapse, then a recovering runner adopts every one
    at generation 2 and completes it exactly once."""
    count = 300
    memory = unlimited_memory_store()
    dying = BatchHookedStore(memory)
    attempts: dict[str, list[int]] = {}

    async def script(work: Work, token: ExecutionToken) -> Outcome:
        attempts.setdefault(token.task_id, []).append(token.generation)
        if token.generation == 1:
            await trio.sleep_forever()  # in flight when its runner dies
        await trio.sleep(1)
        return Completed(DONE)

    runner_a = Runner(
        dying,
        executor=ScriptedExecutor(script),
        owner_id="runner-a",
        lease_ms=3_000,
        max_jobs=count,
        reap_interval_ms=None,
    )

    async def host(*, task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        async with trio.open_nursery() as inner:
            await inner.start(runner_a.run)
            task_status.started(inner.cancel_scope)

    kill_a: trio.CancelScope = await nursery.start(host)
    ids = [f"task-{n:03}" for n in range(count)]
    for task_id in ids:
        await create_job(dying, runner_a, task_id)
    await trio.sleep_until(2.5)  # renewed at 1 s and 2 s: leases end at 5 s
    assert [len(batch) for _, batch in dying.batches] == [count, count]
    dying.dead = True
    kill_a.cancel()
    await runner_a.wait_stopped()

    store_b = BatchHookedStore(memory)
    events = RecordingInstrumentation()
    runner_b = Runner(
        store_b,
        executor=ScriptedExecutor(script),
        owner_id="runner-b",
        recover=True,
        lease_ms=3_000,
        max_jobs=count,
        recovery_interval_ms=500,
        recovery_batch_size=count,
        reap_interval_ms=None,
        instrumentation=events,
    )
    await nursery.start(runner_b.run)
    await trio.sleep_until(4.999)
    assert events.named(ins.LEASE_CLAIMED) == []
    for task_id in ids:
        assert await memory.claim(task_id, "intruder", 1_000) is UNAVAILABLE
    await trio.sleep_until(6.5)
    for task_id in ids:
        await wait_stops(events, task_id)
    claimed = events.named(ins.LEASE_CLAIMED)
    assert [md["task_id"] for _, md in claimed] == ids
    assert {m["generation"] for m, _ in claimed} == {2}
    assert {md["source"] for _, md in claimed} == {"recovery"}
    assert attempts == {task_id: [1, 2] for task_id in ids}
    for task_id in ids:
        assert await status_of(memory, task_id) is TaskStatus.COMPLETED
        assert [entry.event.kind.value for entry in memory.history(task_id)] == ["completed"]
    # The heir renewed them together too: one batch at 6 s (adopted at 5 s, done at 6 s).
    assert [len(batch) for _, batch in store_b.batches] <= [count]
    runner_b.stop()
