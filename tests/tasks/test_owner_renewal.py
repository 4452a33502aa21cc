"""Runner-level renewal through an owner lease: on a store that offers ``renew_owner`` a runner
renews every attempt's claim with one store call per heartbeat whose answer is one value
(issue 15, item 3), each attempt keeps the lease it was given and builds its exact lease from
the owner lease's expiry only when it writes, fencing stays exact, losing the owner lease stops
every attempt that followed it, and a runner that dies with hundreds of running tasks has them
adopted by another runner after the owner lease's expiry.

Every test runs on the memory store under ``MockClock``; the SQLite store's ``renew_owner`` is
held to the same contract by the store contract suite.
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
    START_US,
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
    OwnerRenewal,
    RequestAuthority,
    renews_leases,
    renews_owner_lease,
)
from tritask.tasks.work import Work

pytestmark = pytest.mark.contract("tasks-recovery-claims")

ASK = {"method": "elicitation/create", "params": {"message": "Proceed?"}}


class OwnerHookedStore(MortalStore):
    """``MortalStore`` that also offers ``renew_owner`` (hook op ``renew_owner``), not
    ``renew_all``; ``batches`` records the time and the leases of every batch."""

    def __init__(self, inner: MemoryStore, hook: Any = no_hook) -> None:
        super().__init__(inner, hook)
        self.batches: list[tuple[float, list[Lease], int | None]] = []

    async def renew_owner(
        self,
        owner_id: str,
        leases: list[Lease] | tuple[Lease, ...],
        revisions: list[int] | tuple[int, ...],
        following: int | None,
        lease_ms: int,
    ) -> OwnerRenewal:
        await self._reach()
        self.batches.append((trio.current_time(), list(leases), following))
        await self._before("renew_owner", owner_id, leases, revisions, following, lease_ms)
        return await self.memory.renew_owner(owner_id, leases, revisions, following, lease_ms)

    def ids(self, n: int) -> list[str]:
        return sorted(lease.task_id for lease in self.batches[n][1])


def test_the_memory_store_offers_renew_owner_and_wrappers_only_by_their_class() -> None:
    memory = unlimited_memory_store()
    assert renews_owner_lease(memory) and renews_leases(memory)
    assert not renews_owner_lease(HookedStore(memory, no_hook))
    assert renews_owner_lease(OwnerHookedStore(memory)) and not renews_leases(
        OwnerHookedStore(memory)
    )


async def test_one_call_per_heartbeat_and_no_new_lease_per_attempt(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """50 attempts, 10 heartbeats: 10 renew_owner calls, no single renew, no re-read, and
    every batch passes the very lease objects the claims made: a heartbeat makes none. Each
    batch after the first passes the expiry the previous one answered."""
    store = OwnerHookedStore(unlimited_memory_store())
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
    await create_job(store, runner, "late")
    ids = sorted([f"t{n:02}" for n in range(49)] + ["late"])
    await trio.sleep_until(10.75)
    for n in range(49):
        await wait_stops(events, f"t{n:02}")
    assert [at for at, _, _ in store.batches] == [float(s) for s in range(1, 11)]
    assert all(store.ids(n) == ids for n in range(10))
    first = store.batches[0][1]
    for _, leases, _ in store.batches[1:]:
        assert all(a is b for a, b in zip(leases, first, strict=True))
    assert [following for _, _, following in store.batches] == [None] + [
        START_US + (s * 1000 + 3_000) * 1000 for s in range(1, 10)
    ]
    assert store.calls.count("renew_owner") == 10
    assert store.calls.count("renew") == 0
    assert store.calls.count("worker_snapshot") == 0
    assert len(events.named(ins.LEASE_RENEWED)) == 500
    assert events.named(ins.LEASE_LOST) == []
    await trio.sleep_until(11.25)
    await wait_stops(events, "late")
    for task_id in ids:
        assert await status_of(store, task_id) is TaskStatus.COMPLETED
        assert [md["outcome"] for md in await wait_stops(events, task_id)] == ["completed"]
    await trio.sleep(1.5)  # past the next heartbeat's due time
    assert runner._following == []  # nothing running: the runner keeps no ended attempt
    runner.stop()


async def test_a_lost_lease_in_a_batch_stops_that_attempt_alone(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """A stale token in the batch is lost for that lease alone: that attempt stops, recovery
    adopts the task at the next generation, the others keep running on the owner lease and
    complete with their exact leases."""
    memory = unlimited_memory_store()
    forged: list[str] = []

    class Forging(OwnerHookedStore):
        async def renew_owner(
            self,
            owner_id: str,
            leases: list[Lease] | tuple[Lease, ...],
            revisions: list[int] | tuple[int, ...],
            following: int | None,
            lease_ms: int,
        ) -> OwnerRenewal:
            if not forged:
                leases = [
                    attrs.evolve(lease, token="forged") if lease.task_id == "victim" else lease
                    for lease in leases
                ]
                forged.append("victim")
            return await super().renew_owner(owner_id, leases, revisions, following, lease_ms)

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
        ("victim", 2, 1.4),
    ]
    for task_id in ("a", "b", "victim"):
        assert await status_of(store, task_id) is TaskStatus.COMPLETED
        assert [entry.event.kind.value for entry in memory.history(task_id)] == ["completed"]
    assert [md["outcome"] for md in await wait_stops(events, "a")] == ["completed"]
    assert events.named(ins.FENCED_WRITE_REJECTED) == []
    runner.stop()


async def test_a_lapsed_owner_lease_stops_every_attempt_and_fences_their_writes(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """The store fails every renewal from 1.5 s on, so the owner lease renewed at 1 s lapses at
    4 s: another runner adopts the tasks at generation 2 and completes them; the first
    runner's attempts, which finish at 4.5 s, have their writes refused as stale, and its next
    batch loses every lease, stopping whatever still runs. Each task completes once."""
    memory = unlimited_memory_store()
    failing = False

    async def hook(op: str, args: tuple[Any, ...]) -> None:
        await trio.lowlevel.checkpoint()
        if op == "renew_owner" and failing:
            raise DatabaseBusy("database is busy")

    store_a = OwnerHookedStore(memory, hook)
    events_a = RecordingInstrumentation()
    attempts: list[tuple[str, int]] = []

    async def script(work: Work, token: ExecutionToken) -> Outcome:
        attempts.append((token.task_id, token.generation))
        if token.task_id == "long" and token.generation == 1:
            await trio.sleep(30)
        else:
            await trio.sleep(4.5 if token.generation == 1 else 0.5)
        return Completed(DONE)

    runner_a = Runner(
        store_a,
        executor=ScriptedExecutor(script),
        owner_id="runner-a",
        lease_ms=3_000,
        reap_interval_ms=None,
        instrumentation=events_a,
    )
    await nursery.start(runner_a.run)
    for task_id in ("a", "b", "long"):
        await create_job(store_a, runner_a, task_id)
    await trio.sleep_until(1.5)
    failing = True
    events_b = RecordingInstrumentation()
    runner_b = Runner(
        OwnerHookedStore(memory),
        executor=ScriptedExecutor(script),
        owner_id="runner-b",
        recover=True,
        lease_ms=3_000,
        recovery_interval_ms=250,
        reap_interval_ms=None,
        instrumentation=events_b,
    )
    await nursery.start(runner_b.run)
    await trio.sleep_until(3.999)
    assert events_b.named(ins.LEASE_CLAIMED) == []
    await trio.sleep_until(4.75)
    for task_id in ("a", "b"):
        (stop,) = await wait_stops(events_a, task_id)
        assert stop["store_outcome"] == "error"  # its completion was refused as stale
    rejected = sorted(md["task_id"] for _, md in events_a.named(ins.FENCED_WRITE_REJECTED))
    assert rejected == ["a", "b"]
    failing = False
    await trio.sleep_until(6.5)
    (stop,) = await wait_stops(events_a, "long")
    assert stop["outcome"] == "stale_lease"
    assert sorted(md["task_id"] for _, md in events_a.named(ins.LEASE_LOST)) == ["long"]
    for task_id in ("a", "b", "long"):
        await wait_stops(events_b, task_id)
        assert await status_of(memory, task_id) is TaskStatus.COMPLETED
        assert [entry.event.kind.value for entry in memory.history(task_id)] == ["completed"]
    assert sorted(attempts) == sorted((t, g) for t in ("a", "b", "long") for g in (1, 2))
    runner_a.stop()
    runner_b.stop()


async def test_answers_and_cancellations_committed_elsewhere_arrive_at_the_next_heartbeat(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """Another process commits straight to the store: the batch answers the indexes whose
    revision moved, and only those attempts re-read their task (an answer is delivered, a
    cancellation stops it)."""
    store = OwnerHookedStore(unlimited_memory_store())
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
    assert [md["task_id"] for _, md in events.named(ins.JOB_STOP)] == []
    await trio.sleep_until(2.0)
    (stop,) = await wait_stops(events, "cancelled")
    assert stop["outcome"] == "cancelled"
    assert answers == [({"ok": True}, 2.0)]
    assert store.calls.count("worker_snapshot") - reads_before == 2
    assert await status_of(store, "idle") is TaskStatus.WORKING
    runner.stop()


async def test_a_following_attempt_whose_commit_is_in_flight_keeps_its_exact_lease(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """An attempt that follows the owner lease commits across a heartbeat: the batch leaves
    it out (its claim keeps the expiry it had, as its own), the commit goes through with that
    exact lease, the attempt is renewed alone after it and rejoins the next batch with the
    lease that renewal gave it. Nothing is lost or refused."""

    async def hook(op: str, args: tuple[Any, ...]) -> None:
        await trio.lowlevel.checkpoint()
        if op == "transition" and args[2].kind is EventKind.INPUT_REQUESTED:
            await trio.sleep(1.0)  # committing input_requested from 1.5 s to 2.5 s

    store = OwnerHookedStore(unlimited_memory_store(), hook)
    events = RecordingInstrumentation()

    async def script(work: Work, token: ExecutionToken) -> Outcome:
        if token.task_id == "asks":
            await trio.sleep(1.5)  # after the first batch: its claim follows the owner lease
            with trio.move_on_after(1.5):
                await token.await_input("go", ASK)
            await trio.sleep(2.25)  # ends at 5.25 s, between two heartbeats
        else:
            await trio.sleep(4.5)
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
    await trio.sleep_until(4.75)
    await wait_stops(events, "other")
    assert [(at, store.ids(n)) for n, (at, _, _) in enumerate(store.batches)][:4] == [
        (1.0, ["asks", "other"]),
        (2.0, ["other"]),
        (3.0, ["asks", "other"]),
        (4.0, ["asks", "other"]),
    ]
    assert store.calls.count("renew") == 1
    await trio.sleep_until(5.5)
    (stop,) = await wait_stops(events, "asks")
    assert stop["outcome"] == "completed"
    assert events.named(ins.LEASE_LOST) == []
    assert events.named(ins.FENCED_WRITE_REJECTED) == []
    runner.stop()


async def test_a_runner_dying_with_hundreds_of_running_tasks_hands_them_all_over(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """300 attempts follow one owner lease; the runner dies between two heartbeats. Nobody
    takes its tasks before the owner lease lapses, then a recovering runner adopts every one
    at generation 2 and completes it exactly once."""
    count = 300
    memory = unlimited_memory_store()
    dying = OwnerHookedStore(memory)
    attempts: dict[str, list[int]] = {}

    async def script(work: Work, token: ExecutionToken) -> Outcome:
        attempts.setdefault(token.task_id, []).append(token.generation)
        if token.generation == 1:
            await trio.sleep_forever()
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
    await trio.sleep_until(2.5)  # renewed at 1 s and 2 s: the owner lease ends at 5 s
    assert [len(leases) for _, leases, _ in dying.batches] == [count, count]
    dying.dead = True
    kill_a.cancel()
    await runner_a.wait_stopped()

    store_b = OwnerHookedStore(memory)
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
    assert attempts == {task_id: [1, 2] for task_id in ids}
    for task_id in ids:
        assert await status_of(memory, task_id) is TaskStatus.COMPLETED
        assert [entry.event.kind.value for entry in memory.history(task_id)] == ["completed"]
    runner_b.stop()
