"""The reusable Store contract suite: every store, built-in or third-party, must pass it.

A store runs it by subclassing :class:`StoreContract` in its own test module (pytest with
pytest-trio in trio mode; the class name must start with ``Test`` so pytest collects it)::

    # tests/test_my_store_contract.py
    from tritask.testing.store_contract import ManualClock, StoreContract
    from my_store import DatabaseBusy, MyStore

    class TestMyStoreContract(StoreContract):
        async def make_store(self, *, scope, clock, max_tasks, max_active_tasks_per_scope):
            # Return a fresh, EMPTY store (new database/schema, or truncated tables).
            return MyStore(dsn=..., scope=scope, clock=clock, max_tasks=max_tasks,
                           max_active_tasks_per_scope=max_active_tasks_per_scope)

        # Only if the store does not read time from ``clock`` (e.g. the database's clock):
        async def advance(self, ms: int) -> None:
            await move_the_database_clock(ms)

        # Optional: errors worth one retry in the concurrent-creation race.
        def retryable(self, exc: BaseException) -> bool:
            return isinstance(exc, DatabaseBusy)

Assumptions the suite makes about the store under test:

* its clock stands still between :meth:`StoreContract.advance` calls, and ``advance(ms)`` moves
  it by exactly ``ms`` milliseconds (the default moves the injected :class:`ManualClock`, which
  starts at 2026-08-24T10:00:00.000Z and reads whole milliseconds);
* it supports ``async with`` (the suite closes every store it makes);
* several stores made in one test are distinct stores: accesses and leases of one are refused
  by the other.

Each test states one clause of the contract (reference 3.2-3.10) with exact values.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import attrs
import pytest
import trio

from tritask.tasks._time import format_instant
from tritask.tasks.changes import TaskChange
from tritask.tasks.events import Effects, Event, EventKind, RetryEffect, derived_event_id
from tritask.tasks.model import CANCELLED_MESSAGE, Snapshot, TaskStatus, new_task
from tritask.tasks.store import (
    LEASE_LOST,
    NOT_FOUND,
    QUEUED_MESSAGE,
    UNAVAILABLE,
    Action,
    AlreadyExists,
    CapacityExceeded,
    Claimed,
    ClaimInfo,
    Concurrency,
    Conflict,
    CreatesClaimed,
    Deferred,
    DuplicateInputKey,
    EventIdReused,
    InvalidScope,
    InvalidTask,
    Lease,
    OwnerRenewal,
    Renewed,
    RenewsLeases,
    RenewsOwnerLease,
    RequestAuthority,
    Scope,
    StaleLease,
    StepKeyReused,
    StepLimitExceeded,
    Store,
    StoredTask,
    TaskCursor,
    TaskInspection,
    TaskListing,
    TaskQuery,
    Transition,
    Unauthorized,
    UnauthorizedAction,
    WorkerAuthority,
    lists_tasks,
    offers_changes,
    queues,
    renews_leases,
    renews_owner_lease,
    settles,
    stamps_creation,
)
from tritask.tasks.work import RetryPolicy, TraceContext, Work, canonical_json

__all__ = ["START", "ManualClock", "StoreContract", "by_tenant", "tenant"]

START = 1_787_565_600_000_000
"""2026-08-24T10:00:00.000Z in µs: where every contract store's clock starts."""

LEASE_MS = 30_000
ERROR = {"code": -32000, "message": "transient"}
ASK = {"method": "elicitation/create", "params": {"message": "Confirm delete"}}


class ManualClock:
    """A store clock that moves only when told to (µs readings)."""

    def __init__(self, start_us: int = START) -> None:
        self._now = start_us

    def __call__(self) -> int:
        return self._now

    def advance(self, ms: int) -> None:
        if ms < 0:
            raise ValueError("time only moves forward")
        self._now += ms * 1000


@attrs.frozen
class _MixedBatch:
    """What ``StoreContract._mixed_batch`` set up: the batch, and the live claims beside it."""

    batch: list[Lease]
    first: Lease
    second: Lease
    third: Lease
    fourth: Lease
    foreign: Lease
    sixth: Lease
    elsewhere: Lease


def tenant(name: str) -> dict[str, str]:
    """A request context for the suite's scope function."""
    return {"tenant": name}


def by_tenant(ctx: Any) -> object:
    """The suite's scope function: the tenant named by the context."""
    if not isinstance(ctx, dict) or "tenant" not in ctx:
        raise Unauthorized("no tenant")
    return ctx["tenant"]


A, B, C = tenant("tenant-a"), tenant("tenant-b"), tenant("tenant-c")


class StoreContract:
    """Subclass it and implement :meth:`make_store`; see the module docstring."""

    # -- hooks for the store under test ------------------------------------------------------------

    async def make_store(
        self,
        *,
        scope: Scope,
        clock: ManualClock,
        max_tasks: int | None,
        max_active_tasks_per_scope: int | None,
    ) -> Store:
        raise NotImplementedError("subclasses return a fresh, empty store")

    async def advance(self, ms: int) -> None:
        """Move the store's clock forward by exactly ``ms`` milliseconds."""
        self.clock.advance(ms)

    def retryable(self, exc: BaseException) -> bool:
        """Whether ``exc`` is a transient store error worth one retry (e.g. ``DatabaseBusy``)."""
        return False

    # -- helpers -----------------------------------------------------------------------------------

    @property
    def clock(self) -> ManualClock:
        clock: ManualClock | None = self.__dict__.get("_contract_clock")
        if clock is None:
            clock = self.__dict__["_contract_clock"] = ManualClock()
        return clock

    @contextlib.asynccontextmanager
    async def store(
        self,
        *,
        scope: Scope = by_tenant,
        max_tasks: int | None = None,
        max_active_tasks_per_scope: int | None = None,
    ) -> AsyncIterator[Store]:
        store = await self.make_store(
            scope=scope,
            clock=self.clock,
            max_tasks=max_tasks,
            max_active_tasks_per_scope=max_active_tasks_per_scope,
        )
        async with store:
            yield store

    @staticmethod
    async def create(
        store: Store,
        task_id: str,
        ctx: object = A,
        *,
        ttl_ms: int | None = 60_000,
        policy: RetryPolicy | None = None,
    ) -> Snapshot:
        access = await store.authorize(ctx, Action.CREATE, task_id)
        task = new_task(task_id, await store.now(), ttl_ms, 5)
        work = Work(
            idempotency_key=task_id,
            type="contract",
            input={"taskId": task_id},
            retry_policy=policy or RetryPolicy.none(),
        )
        return await store.create(task, work, access)

    @staticmethod
    async def request(store: Store, ctx: object, action: Action, task_id: str) -> RequestAuthority:
        return RequestAuthority(await store.authorize(ctx, action, task_id))

    @staticmethod
    async def claimed(store: Store, task_id: str, owner: str = "owner-1") -> Lease:
        result = await store.claim(task_id, owner, LEASE_MS)
        assert isinstance(result, Claimed), result
        return result.lease

    @staticmethod
    async def applied(
        store: Store,
        task_id: str,
        revision: int,
        event: Event,
        authority: RequestAuthority | WorkerAuthority,
    ) -> Transition:
        result = await store.transition(task_id, revision, event, authority)
        assert isinstance(result, Transition), result
        assert result.outcome == "applied", result
        return result

    # -- create, get, revision guard (3.10 #1) -----------------------------------------------------

    async def test_create_get_and_claim(self) -> None:
        async with self.store() as store:
            created = await self.create(store, "task-1")
            assert created.revision == 0
            assert created.task.status is TaskStatus.WORKING
            assert created.task.status_message == "Task accepted"
            assert (created.task.created_at, created.task.last_updated_at) == (START, START)
            assert created.work is not None
            assert created.work.idempotency_key == "task-1"
            assert created.work.input == {"taskId": "task-1"}
            access = await store.authorize(A, Action.GET, "task-1")
            assert await store.get("task-1", access) == created
            claim = await store.claim("task-1", "owner-1", LEASE_MS)
            assert isinstance(claim, Claimed)
            assert claim.snapshot == created

    async def test_revision_guard_and_replay(self) -> None:
        async with self.store() as store:
            await self.create(store, "task-1")
            lease = await self.claimed(store, "task-1")
            worker = WorkerAuthority(lease)
            done = Event.completed({"content": [], "isError": False}, id="done-1")
            first = await self.applied(store, "task-1", 0, done, worker)
            assert (first.event_revision, first.snapshot.revision) == (1, 1)
            assert first.committed_at > START
            loser = await store.transition("task-1", 0, Event.failed(ERROR, "x"), worker)
            assert loser == Conflict(first.snapshot)
            replay = await store.transition("task-1", 0, done, worker)
            assert replay == attrs.evolve(first, outcome="duplicate")
            get = await store.authorize(A, Action.GET, "task-1")
            assert await store.get("task-1", get) == first.snapshot

    async def test_replay_returns_original_commit_even_when_stale(self) -> None:
        async with self.store() as store:
            await self.create(store, "task-1", policy=RetryPolicy([5000]))
            lease = await self.claimed(store, "task-1")
            retry = Event.retry_requested(ERROR, "retrying", id="retry-1")
            original = await self.applied(store, "task-1", 0, retry, WorkerAuthority(lease))
            await self.advance(1000)
            cancel = await self.request(store, A, Action.CANCEL, "task-1")
            cancelled = await self.applied(store, "task-1", 1, Event.cancelled(), cancel)
            await self.advance(1000)
            replay = await store.transition("task-1", 0, retry, WorkerAuthority(lease))
            assert replay == Transition(
                outcome="duplicate",
                snapshot=cancelled.snapshot,
                effects=original.effects,
                event_revision=1,
                committed_at=original.committed_at,
            )
            assert original.effects.retry == RetryEffect(
                disposition="scheduled",
                retry_at=original.committed_at + 5_000_000,
                delay_ms=5000,
                retry_count=1,
            )

    async def test_event_id_reused_for_another_event(self) -> None:
        async with self.store() as store:
            await self.create(store, "task-1")
            lease = await self.claimed(store, "task-1")
            worker = WorkerAuthority(lease)
            first = await self.applied(
                store, "task-1", 0, Event.input_requested("a", ASK, id="ev"), worker
            )
            with pytest.raises(EventIdReused):
                await store.transition("task-1", 1, Event.completed({}, id="ev"), worker)
            assert await store.worker_snapshot("task-1", lease) == first.snapshot

    async def test_conflict_records_no_losing_event(self) -> None:
        async with self.store() as store:
            await self.create(store, "task-1")
            worker = WorkerAuthority(await self.claimed(store, "task-1"))
            await self.applied(store, "task-1", 0, Event.input_requested("a", ASK), worker)
            late = Event.input_requested("b", {"method": "x"}, id="late")
            conflict = await store.transition("task-1", 0, late, worker)
            assert isinstance(conflict, Conflict)
            assert conflict.snapshot.revision == 1
            assert conflict.snapshot.task.used_input_keys == {"a"}
            again = await self.applied(store, "task-1", 1, late, worker)
            assert again.event_revision == 2

    async def test_concurrent_writers_commit_exactly_one(self) -> None:
        async with self.store() as store:
            await self.create(store, "task-1")
            worker = WorkerAuthority(await self.claimed(store, "task-1"))
            cancel = await self.request(store, A, Action.CANCEL, "task-1")
            results: list[object] = []

            async def write(event: Event, authority: RequestAuthority | WorkerAuthority) -> None:
                results.append(await store.transition("task-1", 0, event, authority))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(write, Event.completed({"v": 1}), worker)
                nursery.start_soon(write, Event.cancelled(), cancel)
            outcomes = sorted(type(r).__name__ for r in results)
            assert outcomes == ["Conflict", "Transition"]
            winner = next(r for r in results if isinstance(r, Transition))
            assert winner.snapshot.revision == 1
            get = await store.authorize(A, Action.GET, "task-1")
            assert await store.get("task-1", get) == winner.snapshot

    async def test_unchanged_transitions_bump_nothing(self) -> None:
        async with self.store() as store:
            await self.create(store, "task-1")
            worker = WorkerAuthority(await self.claimed(store, "task-1"))
            done = await self.applied(store, "task-1", 0, Event.completed({"v": 1}), worker)
            await self.advance(1000)
            cancel = await self.request(store, A, Action.CANCEL, "task-1")
            late = Event.cancelled(id="late-cancel")
            for _ in range(2):  # not recorded: the same id is evaluated again, not replayed
                result = await store.transition("task-1", 1, late, cancel)
                assert isinstance(result, Transition)
                assert (result.outcome, result.event_revision) == ("unchanged", 1)
                assert result.snapshot == done.snapshot
                assert result.effects == Effects.none()
            update = await self.request(store, A, Action.UPDATE, "task-1")
            answer = await store.transition(
                "task-1", 1, Event.input_responses_accepted({"x": {}}), update
            )
            assert isinstance(answer, Transition)
            assert answer.outcome == "unchanged"
            assert answer.effects == Effects(accepted_input_responses={})
            get = await store.authorize(A, Action.GET, "task-1")
            assert await store.get("task-1", get) == done.snapshot

    async def test_commit_times_strictly_increase(self) -> None:
        async with self.store() as store:
            await self.create(store, "task-1")
            worker = WorkerAuthority(await self.claimed(store, "task-1"))
            times = [START]
            events = [Event.input_requested("a", ASK), Event.input_requested("b", ASK)]
            for revision, event in enumerate(events):
                result = await self.applied(store, "task-1", revision, event, worker)
                assert result.committed_at > times[-1]
                assert result.snapshot.task.last_updated_at == result.committed_at
                times.append(result.committed_at)
            await self.advance(5000)
            now = await store.now()
            assert now == START + 5_000_000
            update = await self.request(store, A, Action.UPDATE, "task-1")
            answered = await self.applied(
                store, "task-1", 2, Event.input_responses_accepted({"a": {}}), update
            )
            assert answered.committed_at == now

    # -- create rules ------------------------------------------------------------------------------

    async def test_create_refusals(self) -> None:
        async with self.store() as store, self.store() as other:
            await self.create(store, "task-1")
            with pytest.raises(AlreadyExists):
                await self.create(store, "task-1")
            task = new_task("task-2", await store.now(), 1000, None)
            work = Work.tool_call("task-2", "tool", {})
            for access in (
                await store.authorize(A, Action.GET, "task-2"),
                await store.authorize(A, Action.CREATE, "task-3"),
                await other.authorize(A, Action.CREATE, "task-2"),
            ):
                with pytest.raises(UnauthorizedAction):
                    await store.create(task, work, access)
            create = await store.authorize(A, Action.CREATE, "task-2")
            with pytest.raises(InvalidTask):
                await store.create(task, Work.tool_call("other-id", "tool", {}), create)
            with pytest.raises(InvalidTask):
                await store.create(attrs.evolve(task, status=TaskStatus.CANCELLED), work, create)
            assert await store.get("task-2", await store.authorize(A, Action.GET, "task-2")) is (
                NOT_FOUND
            )
            assert (await store.create(task, work, create)).task == task

    # -- claims and fencing (3.10 #2, 3.6) ---------------------------------------------------------

    async def test_claim_fencing(self) -> None:
        async with self.store() as store:
            await self.create(store, "task-1")
            first = await store.claim("task-1", "owner-1", LEASE_MS)
            assert isinstance(first, Claimed)
            old = first.lease
            assert (old.task_id, old.owner_id, old.generation) == ("task-1", "owner-1", 1)
            assert old.expires_at == START + LEASE_MS * 1000
            assert await store.claim("task-1", "owner-2", LEASE_MS) is UNAVAILABLE
            assert await store.claim("task-1", "owner-1", LEASE_MS) is UNAVAILABLE
            await store.release(old)
            second = await store.claim_next("owner-2", LEASE_MS)
            assert second is not None
            new = second.lease
            assert (new.task_id, new.owner_id, new.generation) == ("task-1", "owner-2", 2)
            assert new.token != old.token
            with pytest.raises(StaleLease):
                await store.worker_snapshot("task-1", old)
            with pytest.raises(StaleLease):
                await store.renew(old, LEASE_MS)
            with pytest.raises(StaleLease):
                await store.transition("task-1", 0, Event.completed({}), WorkerAuthority(old))
            with pytest.raises(StaleLease):
                await store.release(old)
            assert await store.claim_next("owner-3", LEASE_MS) is None
            done = await self.applied(
                store, "task-1", 0, Event.completed({"ok": True}), WorkerAuthority(new)
            )
            assert done.snapshot.task.status is TaskStatus.COMPLETED
            await store.release(new)
            assert await store.claim("task-1", "owner-1", LEASE_MS) is UNAVAILABLE
            assert await store.claim_next("owner-1", LEASE_MS) is None

    async def test_generation_rises_on_every_claim(self) -> None:
        async with self.store() as store:
            await self.create(store, "task-1")
            generations = []
            for _ in range(3):
                lease = await self.claimed(store, "task-1")
                generations.append(lease.generation)
                await store.release(lease)
            assert generations == [1, 2, 3]

    async def test_renew_makes_previous_lease_stale(self) -> None:
        async with self.store() as store:
            await self.create(store, "task-1")
            old = await self.claimed(store, "task-1")
            await self.advance(10_000)
            new = await store.renew(old, LEASE_MS)
            assert (new.task_id, new.owner_id, new.generation) == (
                old.task_id,
                old.owner_id,
                old.generation,
            )
            assert new.expires_at == START + 10_000_000 + LEASE_MS * 1000
            assert new != old
            with pytest.raises(StaleLease):
                await store.worker_snapshot("task-1", old)
            with pytest.raises(StaleLease):
                await store.renew(old, LEASE_MS)
            same_instant = await store.renew(new, LEASE_MS)  # no time passed: still a new value
            assert same_instant != new
            with pytest.raises(StaleLease):
                await store.worker_snapshot("task-1", new)
            snapshot = await store.worker_snapshot("task-1", same_instant)
            assert isinstance(snapshot, Snapshot)
            assert snapshot.revision == 0
            await self.advance(LEASE_MS - 1)
            assert await store.claim("task-1", "owner-2", LEASE_MS) is UNAVAILABLE

    async def test_expired_lease_is_reclaimable(self) -> None:
        async with self.store() as store:
            await self.create(store, "task-1")
            result = await store.claim("task-1", "owner-1", 1000)
            assert isinstance(result, Claimed)
            lease = result.lease
            await self.advance(999)
            assert await store.claim("task-1", "owner-2", 1000) is UNAVAILABLE
            assert await store.claim_next("owner-2", 1000) is None
            assert isinstance(await store.worker_snapshot("task-1", lease), Snapshot)
            await self.advance(1)
            with pytest.raises(StaleLease):
                await store.worker_snapshot("task-1", lease)
            with pytest.raises(StaleLease):
                await store.renew(lease, 1000)
            with pytest.raises(StaleLease):
                await store.transition("task-1", 0, Event.completed({}), WorkerAuthority(lease))
            again = await store.claim_next("owner-2", 1000)
            assert again is not None
            assert (again.lease.generation, again.lease.owner_id) == (2, "owner-2")
            with pytest.raises(StaleLease):
                await store.release(lease)

    async def test_release_needs_matching_not_live_lease(self) -> None:
        async with self.store() as store:
            await self.create(store, "task-1")
            lease = await self.claimed(store, "task-1")
            with pytest.raises(StaleLease):
                await store.release(attrs.evolve(lease, token=lease.token + "x"))
            await self.advance(LEASE_MS * 2)
            await store.release(lease)
            with pytest.raises(StaleLease):
                await store.release(lease)
            again = await store.claim_next("owner-2", LEASE_MS)
            assert again is not None
            assert again.lease.generation == 2

    async def test_lease_forgery_is_stale(self) -> None:
        async with self.store() as store, self.store() as other:
            await self.create(store, "task-1")
            await self.create(store, "task-2")
            await self.create(other, "task-1")
            lease = await self.claimed(store, "task-1")
            other_lease = await self.claimed(other, "task-1")
            forged = [
                attrs.evolve(lease, token="forged"),
                attrs.evolve(lease, owner_id="someone-else"),
                attrs.evolve(lease, generation=lease.generation + 1),
                attrs.evolve(lease, expires_at=lease.expires_at + 1000),
                attrs.evolve(lease, epoch=lease.epoch + 1),
                attrs.evolve(lease, store_id=other_lease.store_id),
                other_lease,
            ]
            for bad in forged:
                with pytest.raises(StaleLease):
                    await store.worker_snapshot("task-1", bad)
                with pytest.raises(StaleLease):
                    await store.transition("task-1", 0, Event.completed({}), WorkerAuthority(bad))
                with pytest.raises(StaleLease):
                    await store.renew(bad, LEASE_MS)
                with pytest.raises(StaleLease):
                    await store.release(bad)
            with pytest.raises(StaleLease):
                await store.worker_snapshot("task-2", lease)
            with pytest.raises(StaleLease):
                await store.transition("task-2", 0, Event.completed({}), WorkerAuthority(lease))
            snapshot = await store.worker_snapshot("task-1", lease)
            assert isinstance(snapshot, Snapshot)
            assert snapshot.revision == 0

    async def test_worker_authority_event_kinds(self) -> None:
        async with self.store() as store:
            await self.create(store, "task-1")
            lease = await self.claimed(store, "task-1")
            for event in (Event.cancelled(), Event.input_responses_accepted({"a": {}})):
                with pytest.raises(UnauthorizedAction):
                    await store.transition("task-1", 0, event, WorkerAuthority(lease))
            snapshot = await store.worker_snapshot("task-1", lease)
            assert isinstance(snapshot, Snapshot)
            assert snapshot.revision == 0

    async def test_request_authority_event_kinds(self) -> None:
        async with self.store() as store:
            await self.create(store, "task-1")
            await self.create(store, "task-2")
            refused = [
                (Action.GET, "task-1", Event.cancelled()),
                (Action.UPDATE, "task-1", Event.cancelled()),
                (Action.CANCEL, "task-1", Event.input_responses_accepted({"a": {}})),
                (Action.CANCEL, "task-1", Event.completed({})),
                (Action.UPDATE, "task-1", Event.input_requested("a", ASK)),
                (Action.CREATE, "task-1", Event.cancelled()),
                (Action.CANCEL, "task-2", Event.cancelled()),  # bound to another task id
            ]
            for action, bound_to, event in refused:
                authority = await self.request(store, A, action, bound_to)
                with pytest.raises(UnauthorizedAction):
                    await store.transition("task-1", 0, event, authority)
            get = await store.authorize(A, Action.GET, "task-1")
            snapshot = await store.get("task-1", get)
            assert isinstance(snapshot, Snapshot)
            assert snapshot.revision == 0
            cancel = await self.request(store, A, Action.CANCEL, "task-1")
            done = await self.applied(store, "task-1", 0, Event.cancelled(), cancel)
            assert done.snapshot.task.status_message == "Cancellation requested"
            assert done.snapshot.task.status is TaskStatus.CANCELLED

    async def test_get_accepts_get_update_cancel_access_only(self) -> None:
        async with self.store() as store:
            created = await self.create(store, "task-1")
            for action in (Action.GET, Action.UPDATE, Action.CANCEL):
                assert await store.get("task-1", await store.authorize(A, action, "task-1")) == (
                    created
                )
            for access in (
                await store.authorize(A, Action.CREATE, "task-1"),
                await store.authorize(A, Action.GET, "task-2"),
            ):
                with pytest.raises(UnauthorizedAction):
                    await store.get("task-1", access)

    async def test_access_from_another_store_is_not_found(self) -> None:
        async with self.store() as store, self.store() as other:
            await self.create(store, "task-1")
            await self.create(other, "task-1")
            foreign_get = await other.authorize(A, Action.GET, "task-1")
            foreign_cancel = await other.authorize(A, Action.CANCEL, "task-1")
            assert await store.get("task-1", foreign_get) is NOT_FOUND
            result = await store.transition(
                "task-1", 0, Event.cancelled(), RequestAuthority(foreign_cancel)
            )
            assert result is NOT_FOUND

    # -- retry deadlines (3.10 #3) -----------------------------------------------------------------

    async def test_retry_deadline_exact_boundary(self) -> None:
        async with self.store() as store:
            await self.create(store, "task-1", policy=RetryPolicy([2000]))
            lease = await self.claimed(store, "task-1")
            retry = await self.applied(
                store, "task-1", 0, Event.retry_requested(ERROR, None), WorkerAuthority(lease)
            )
            retry_at = retry.snapshot.retry_at
            assert retry_at == retry.committed_at + 2_000_000
            assert retry.snapshot.retry_count == 1
            assert retry.snapshot.task.status is TaskStatus.WORKING
            assert retry.effects == Effects(
                retry=RetryEffect(
                    disposition="scheduled", retry_at=retry_at, delay_ms=2000, retry_count=1
                )
            )
            await store.release(lease)
            now = await store.now()
            remaining = -(-(retry_at - now) // 1000)
            assert await store.claim("task-1", "owner-2", LEASE_MS) == Deferred(remaining)
            assert await store.claim_next("owner-2", LEASE_MS) is None
            await self.advance(remaining - 1)
            assert await store.claim("task-1", "owner-2", LEASE_MS) == Deferred(1)
            assert await store.claim_next("owner-2", LEASE_MS) is None
            await self.advance(1)
            assert await store.now() >= retry_at
            again = await store.claim_next("owner-2", LEASE_MS)
            assert again is not None
            assert again.lease.generation == 2
            assert again.snapshot.retry_count == 1
            with pytest.raises(StaleLease):
                await store.worker_snapshot("task-1", lease)

    async def test_retry_deferred_even_with_expired_claim(self) -> None:
        async with self.store() as store:
            await self.create(store, "task-1", policy=RetryPolicy([60_000]))
            result = await store.claim("task-1", "owner-1", 1000)
            assert isinstance(result, Claimed)
            retry = await self.applied(
                store,
                "task-1",
                0,
                Event.retry_requested(ERROR, "later"),
                WorkerAuthority(result.lease),
            )
            assert retry.snapshot.retry_at is not None
            await self.advance(2000)  # the lease expired, the retry is not due
            remaining = -(-(retry.snapshot.retry_at - await store.now()) // 1000)
            assert remaining > 57_000
            assert await store.claim("task-1", "owner-2", LEASE_MS) == Deferred(remaining)
            assert await store.claim_next("owner-2", LEASE_MS) is None

    async def test_retry_exhaustion_fails_atomically(self) -> None:
        async with self.store() as store:
            await self.create(store, "task-1", policy=RetryPolicy([0]))
            lease = await self.claimed(store, "task-1")
            worker = WorkerAuthority(lease)
            first = await self.applied(
                store, "task-1", 0, Event.retry_requested(ERROR, "a"), worker
            )
            assert first.snapshot.retry_at == first.committed_at
            last = await self.applied(
                store, "task-1", 1, Event.retry_requested(ERROR, "gave up"), worker
            )
            assert last.effects == Effects(
                retry=RetryEffect(
                    disposition="exhausted", retry_at=None, delay_ms=None, retry_count=1
                )
            )
            task = last.snapshot.task
            assert (task.status, task.error, task.status_message) == (
                TaskStatus.FAILED,
                ERROR,
                "gave up",
            )
            assert last.snapshot.retry_at is None
            await store.release(lease)
            assert await store.claim("task-1", "owner-1", LEASE_MS) is UNAVAILABLE

    async def test_cancel_during_backoff_clears_retry_at(self) -> None:
        async with self.store() as store:
            await self.create(store, "task-1", policy=RetryPolicy([60_000]))
            lease = await self.claimed(store, "task-1")
            await self.applied(
                store, "task-1", 0, Event.retry_requested(ERROR, None), WorkerAuthority(lease)
            )
            cancel = await self.request(store, A, Action.CANCEL, "task-1")
            done = await self.applied(store, "task-1", 1, Event.cancelled(), cancel)
            assert done.snapshot.retry_at is None
            assert done.snapshot.retry_count == 1
            await store.release(lease)
            assert await store.claim("task-1", "owner-1", LEASE_MS) is UNAVAILABLE

    # -- claim_next --------------------------------------------------------------------------------

    async def test_claim_next_orders_by_created_at_then_id(self) -> None:
        async with self.store() as store:
            await self.create(store, "task-z")
            await self.advance(1)
            await self.create(store, "task-b", B)
            await self.create(store, "task-a", C)
            order = []
            while (claimed := await store.claim_next("owner", LEASE_MS)) is not None:
                order.append(claimed.snapshot.task.id)
            assert order == ["task-z", "task-a", "task-b"]

    async def test_claim_next_skips_unclaimable(self) -> None:
        async with self.store() as store:
            for task_id in ("t-1", "t-2", "t-3", "t-4"):
                await self.create(store, task_id, policy=RetryPolicy([10_000]))
            done = WorkerAuthority(await self.claimed(store, "t-1"))
            await self.applied(store, "t-1", 0, Event.completed({}), done)
            await store.release(done.lease)
            await self.claimed(store, "t-2")  # live claim
            retry = WorkerAuthority(await self.claimed(store, "t-3"))
            scheduled = await self.applied(
                store, "t-3", 0, Event.retry_requested(ERROR, None), retry
            )
            await store.release(retry.lease)
            nxt = await store.claim_next("owner", LEASE_MS)
            assert nxt is not None
            assert nxt.snapshot.task.id == "t-4"
            assert await store.claim_next("owner", LEASE_MS) is None
            assert scheduled.snapshot.retry_at is not None
            await self.advance(-(-(scheduled.snapshot.retry_at - await store.now()) // 1000))
            due = await store.claim_next("owner", LEASE_MS)
            assert due is not None
            assert due.snapshot.task.id == "t-3"
            assert await store.claim_next("owner", LEASE_MS) is None

    # -- capacity and scopes (3.10 #4) -------------------------------------------------------------

    async def test_capacity_and_scopes(self) -> None:
        async with self.store(max_tasks=2, max_active_tasks_per_scope=1) as store:
            results: dict[str, object] = {}

            async def attempt(task_id: str) -> None:
                for tries in (1, 2):
                    try:
                        results[task_id] = await self.create(store, task_id, A)
                        return
                    except CapacityExceeded as exc:
                        results[task_id] = exc
                        return
                    except Exception as exc:
                        if tries == 2 or not self.retryable(exc):
                            raise

            async with trio.open_nursery() as nursery:
                nursery.start_soon(attempt, "a-1")
                nursery.start_soon(attempt, "a-2")
            won = [k for k, v in results.items() if isinstance(v, Snapshot)]
            lost = [v for v in results.values() if isinstance(v, CapacityExceeded)]
            assert len(won) == 1
            assert [exc.limit for exc in lost] == ["max_active_tasks_per_scope"]
            await self.create(store, "b-1", B)
            with pytest.raises(CapacityExceeded) as caught:
                await self.create(store, "c-1", C)
            assert caught.value.limit == "max_tasks"
            owner = won[0]
            for action in (Action.GET, Action.CANCEL, Action.UPDATE):
                foreign = await store.authorize(B, action, owner)
                assert await store.get(owner, foreign) is NOT_FOUND
            cancel = await self.request(store, B, Action.CANCEL, owner)
            assert await store.transition(owner, 0, Event.cancelled(), cancel) is NOT_FOUND
            update = await self.request(store, B, Action.UPDATE, owner)
            answer = Event.input_responses_accepted({"a": {}})
            assert await store.transition(owner, 0, answer, update) is NOT_FOUND
            mine = await store.get(owner, await store.authorize(A, Action.GET, owner))
            assert isinstance(mine, Snapshot)
            assert mine.revision == 0

    async def test_active_limit_counts_only_active_tasks(self) -> None:
        async with self.store(max_active_tasks_per_scope=1) as store:
            await self.create(store, "a-1")
            with pytest.raises(CapacityExceeded):
                await self.create(store, "a-2")
            cancel = await self.request(store, A, Action.CANCEL, "a-1")
            await self.applied(store, "a-1", 0, Event.cancelled(), cancel)
            created = await self.create(store, "a-2")
            assert created.task.id == "a-2"

    async def test_unlimited_limits(self) -> None:
        async with self.store(max_tasks=None, max_active_tasks_per_scope=None) as store:
            for n in range(12):
                await self.create(store, f"task-{n:02d}")
            claimed = 0
            while await store.claim_next("owner", LEASE_MS) is not None:
                claimed += 1
            assert claimed == 12

    async def test_shared_scope(self) -> None:
        async with self.store(scope="shared") as store:
            await self.create(store, "task-1", A)
            for ctx in (B, None, object()):
                snapshot = await store.get(
                    "task-1", await store.authorize(ctx, Action.GET, "task-1")
                )
                assert isinstance(snapshot, Snapshot)
                assert snapshot.task.id == "task-1"

    async def test_scope_function_errors(self) -> None:
        async with self.store(scope=lambda ctx: {"not": {"json"}}) as store:
            with pytest.raises(InvalidScope):
                await store.authorize(A, Action.CREATE, "task-1")
        async with self.store() as store:
            with pytest.raises(Unauthorized):
                await store.authorize({"no": "tenant"}, Action.GET, "task-1")

    async def test_json_equal_scopes_match(self) -> None:
        async with self.store(scope=lambda ctx: ctx) as store:
            await self.create(store, "task-1", {"b": [1, 2], "a": "x"})
            same = await store.authorize({"a": "x", "b": [1, 2]}, Action.GET, "task-1")
            assert isinstance(await store.get("task-1", same), Snapshot)
            for ctx in ({"a": "x", "b": [True, 2]}, {"a": "x", "b": [2, 1]}, {"a": "x"}):
                other = await store.authorize(ctx, Action.GET, "task-1")
                assert await store.get("task-1", other) is NOT_FOUND

    # -- TTL and reaping (3.10 #5) -----------------------------------------------------------------

    async def test_ttl_boundary(self) -> None:
        async with self.store(max_tasks=1) as store:
            created = await self.create(store, "task-1", ttl_ms=1000)
            get = await store.authorize(A, Action.GET, "task-1")
            await self.advance(999)
            assert await store.get("task-1", get) == created
            assert await store.reap() == []
            await self.advance(1)
            assert await store.get("task-1", get) is NOT_FOUND
            for action, event in (
                (Action.CANCEL, Event.cancelled()),
                (Action.UPDATE, Event.input_responses_accepted({"a": {}})),
            ):
                authority = await self.request(store, A, action, "task-1")
                assert await store.transition("task-1", 0, event, authority) is NOT_FOUND
            with pytest.raises(CapacityExceeded) as caught:  # counted until reaped
                await self.create(store, "task-2", ttl_ms=1000)
            assert caught.value.limit == "max_tasks"
            assert await store.reap() == ["task-1"]
            assert await store.reap() == []
            assert (await self.create(store, "task-2")).task.id == "task-2"

    async def test_ttl_expired_task_created_long_ago(self) -> None:
        async with self.store() as store:
            await self.create(store, "task-1", ttl_ms=1000)
            await self.advance(60_000)
            get = await store.authorize(A, Action.GET, "task-1")
            assert await store.get("task-1", get) is NOT_FOUND
            cancel = await self.request(store, A, Action.CANCEL, "task-1")
            assert await store.transition("task-1", 0, Event.cancelled(), cancel) is NOT_FOUND
            assert "task-1" in await store.reap()

    async def test_reap_sorted_including_active_and_null_ttl_kept(self) -> None:
        async with self.store() as store:
            for task_id in ("t-c", "t-a", "t-b"):  # expiry order differs from id order
                await self.create(store, task_id, ttl_ms=1000)
                await self.advance(1)
            await self.create(store, "t-forever", ttl_ms=None)
            await self.create(store, "t-later", ttl_ms=10_000)
            lease = await self.claimed(store, "t-a")
            await self.advance(996)
            assert await store.reap() == []
            await self.advance(3)
            assert await store.reap() == ["t-a", "t-b", "t-c"]
            assert await store.claim("t-a", "owner", LEASE_MS) is NOT_FOUND
            assert await store.worker_snapshot("t-a", lease) is NOT_FOUND
            result = await store.transition("t-a", 0, Event.completed({}), WorkerAuthority(lease))
            assert result is NOT_FOUND
            with pytest.raises(StaleLease):
                await store.renew(lease, LEASE_MS)
            await self.advance(9000)
            assert await store.reap() == []
            await self.advance(1)
            assert await store.reap() == ["t-later"]
            forever = await store.authorize(A, Action.GET, "t-forever")
            snapshot = await store.get("t-forever", forever)
            assert isinstance(snapshot, Snapshot)
            assert snapshot.task.ttl_ms is None

    async def test_changes_announce_every_applied_commit_and_every_reap(self) -> None:
        """``OffersChanges``: one ``changed`` per applied transition or settle, in order, with
        the committed task for commits through this store object; ``reaped`` per reaped task;
        nothing for creation, refusals, conflicts, unchanged or duplicate outcomes."""
        async with self.store() as store:
            feed = store if offers_changes(store) else None
            if feed is None:
                pytest.skip("the store does not offer changes")
            stream = feed.changes()

            async def next_change() -> TaskChange:
                with trio.fail_after(10):
                    while True:
                        change = await anext(stream)
                        assert isinstance(change, TaskChange)
                        if change.kind != "resync":  # may come at any time (a reconnect)
                            return change

            try:
                with trio.fail_after(10):
                    first = await anext(stream)
                assert first == TaskChange("resync", None)
                await self.create(store, "task-1", ttl_ms=5_000)
                lease = await self.claimed(store, "task-1")
                worker = WorkerAuthority(lease)
                asked = await self.applied(
                    store, "task-1", 0, Event.input_requested("k", ASK), worker
                )
                conflict = await store.transition("task-1", 0, Event.completed({}), worker)
                assert isinstance(conflict, Conflict)
                update = await self.request(store, A, Action.UPDATE, "task-1")
                answer = Event.input_responses_accepted({"k": {"action": "accept"}})
                await self.applied(store, "task-1", 1, answer, update)
                replay = await store.transition("task-1", 1, answer, update)
                assert isinstance(replay, Transition) and replay.outcome == "duplicate"
                done = Event.completed({"ok": True})
                settling = store if settles(store) else None
                if settling is not None:
                    final = await settling.settle("task-1", 2, done, lease)
                else:
                    final = await store.transition("task-1", 2, done, worker)
                assert isinstance(final, Transition) and final.outcome == "applied"
                seen = [await next_change() for _ in range(3)]
                assert [(c.kind, c.task_id, c.revision, c.status) for c in seen] == [
                    ("changed", "task-1", 1, TaskStatus.INPUT_REQUIRED),
                    ("changed", "task-1", 2, TaskStatus.WORKING),
                    ("changed", "task-1", 3, TaskStatus.COMPLETED),
                ]
                assert seen[0].task == asked.snapshot.task
                assert seen[2].task == final.snapshot.task
                cancel = await self.request(store, A, Action.CANCEL, "task-1")
                late = await store.transition("task-1", 3, Event.cancelled(), cancel)
                assert isinstance(late, Transition) and late.outcome == "unchanged"
                await self.advance(5_000)
                assert await store.reap() == ["task-1"]
                assert await next_change() == TaskChange("reaped", "task-1")
            finally:
                await stream.aclose()

    async def test_unknown_task_is_not_found(self) -> None:
        async with self.store() as store:
            await self.create(store, "task-1")
            lease = await self.claimed(store, "task-1")
            get = await store.authorize(A, Action.GET, "nope")
            cancel = await self.request(store, A, Action.CANCEL, "nope")
            assert await store.get("nope", get) is NOT_FOUND
            assert await store.claim("nope", "owner", LEASE_MS) is NOT_FOUND
            assert await store.worker_snapshot("nope", lease) is NOT_FOUND
            assert await store.transition("nope", 0, Event.cancelled(), cancel) is NOT_FOUND
            worker = WorkerAuthority(lease)
            assert await store.transition("nope", 0, Event.completed({}), worker) is NOT_FOUND

    # -- the inbox (3.10 #6, 3.9) ------------------------------------------------------------------

    async def test_inbox(self) -> None:
        async with self.store() as store:
            await self.create(store, "task-1")
            worker = WorkerAuthority(await self.claimed(store, "task-1"))
            asked = await self.applied(
                store, "task-1", 0, Event.input_requested("confirmation", ASK), worker
            )
            assert asked.snapshot.task.status is TaskStatus.INPUT_REQUIRED
            assert asked.snapshot.task.input_requests == {"confirmation": ASK}
            assert asked.snapshot.input_history == {"confirmation": ASK}
            responses = {"confirmation": {"action": "accept", "content": {"confirmed": True}}}
            update = await self.request(store, A, Action.UPDATE, "task-1")
            answered = await self.applied(
                store, "task-1", 1, Event.input_responses_accepted(responses), update
            )
            assert answered.snapshot.task.status is TaskStatus.WORKING
            assert answered.snapshot.task.input_requests == {}
            assert answered.snapshot.accepted_input_responses == responses
            assert answered.effects == Effects(accepted_input_responses=responses)
            get = await store.authorize(A, Action.GET, "task-1")
            assert await store.get("task-1", get) == answered.snapshot

    async def test_partial_answers_and_key_reuse(self) -> None:
        async with self.store() as store:
            await self.create(store, "task-1")
            worker = WorkerAuthority(await self.claimed(store, "task-1"))
            await self.applied(store, "task-1", 0, Event.input_requested("a", ASK), worker)
            await self.applied(store, "task-1", 1, Event.input_requested("b", ASK), worker)
            update = await self.request(store, A, Action.UPDATE, "task-1")
            partial = await self.applied(
                store,
                "task-1",
                2,
                Event.input_responses_accepted({"a": {"v": 1}, "unknown": {"v": 2}}),
                update,
            )
            assert partial.effects == Effects(accepted_input_responses={"a": {"v": 1}})
            assert partial.snapshot.task.status is TaskStatus.INPUT_REQUIRED
            assert partial.snapshot.task.input_requests == {"b": ASK}
            assert partial.snapshot.accepted_input_responses == {"a": {"v": 1}}
            for key in ("a", "b"):
                with pytest.raises(DuplicateInputKey):
                    await store.transition(
                        "task-1", 3, Event.input_requested(key, {"method": "other"}), worker
                    )
            after = await store.get("task-1", await store.authorize(A, Action.GET, "task-1"))
            assert after == partial.snapshot

    # -- durable steps (issue 16) ------------------------------------------------------------------

    @staticmethod
    async def get_snapshot(store: Store, task_id: str, ctx: object = A) -> Snapshot:
        snapshot = await store.get(task_id, await store.authorize(ctx, Action.GET, task_id))
        assert isinstance(snapshot, Snapshot), snapshot
        return snapshot

    async def test_steps_are_recorded_and_replayed_to_the_next_claim(self) -> None:
        async with self.store() as store:
            await self.create(store, "task-1", policy=RetryPolicy([1000]))
            lease = await self.claimed(store, "task-1")
            worker = WorkerAuthority(lease)
            started = await self.applied(
                store, "task-1", 0, Event.step_started("charge", "fp-c"), worker
            )
            assert started.snapshot.steps == {
                "charge": {"kind": "step", "fingerprint": "fp-c", "outcome": None}
            }
            outcome = {"result": {"refund": "re_1", "lines": [1, 2.5, "€", None, True]}}
            recorded = await self.applied(
                store, "task-1", 1, Event.step_recorded("charge", "fp-c", outcome), worker
            )
            failure = {"error": {"code": -32001, "message": "declined", "data": {"n": 1}}}
            await self.applied(
                store, "task-1", 2, Event.step_recorded("notify/0", "fp-n", failure), worker
            )
            slept = await self.applied(
                store, "task-1", 3, Event.sleep_scheduled("nap", 250), worker
            )
            steps = {
                "charge": {"kind": "step", "fingerprint": "fp-c", "outcome": outcome},
                "notify/0": {"kind": "step", "fingerprint": "fp-n", "outcome": failure},
                "nap": {"kind": "sleep", "wakeAt": format_instant(slept.committed_at + 250_000)},
            }
            assert recorded.snapshot.steps == {"charge": steps["charge"]}
            assert slept.snapshot.steps == steps
            assert await self.get_snapshot(store, "task-1") == slept.snapshot
            retry = Event.retry_requested(ERROR, "again")
            await self.applied(store, "task-1", 4, retry, worker)
            await store.release(lease)
            await self.advance(1100)
            again = await store.claim("task-1", "owner-2", LEASE_MS)
            assert isinstance(again, Claimed)
            assert again.snapshot.steps == steps  # what the next attempt replays
            assert again.snapshot.retry_count == 1

    async def test_an_interrupted_at_most_once_marker_reaches_the_next_attempt(self) -> None:
        async with self.store() as store:
            await self.create(store, "task-1")
            old = await self.claimed(store, "task-1")
            event_id = derived_event_id("task-1", EventKind.STEP_STARTED, "charge")
            marker = Event.step_started("charge", "fp", id=event_id)
            await self.applied(store, "task-1", 0, marker, WorkerAuthority(old))
            await self.advance(LEASE_MS)  # the attempt died before recording an outcome
            claimed = await store.claim("task-1", "owner-2", LEASE_MS)
            assert isinstance(claimed, Claimed)
            assert claimed.lease.generation == old.generation + 1
            assert claimed.snapshot.steps == {
                "charge": {"kind": "step", "fingerprint": "fp", "outcome": None}
            }
            # The dead attempt's resend of its marker is fenced; the record stays as it was.
            with pytest.raises(StaleLease):
                await store.transition("task-1", 0, marker, WorkerAuthority(old))
            assert await self.get_snapshot(store, "task-1") == claimed.snapshot

    async def test_a_stale_attempts_step_is_refused(self) -> None:
        async with self.store() as store:
            await self.create(store, "task-1")
            old = await self.claimed(store, "task-1")
            await self.advance(LEASE_MS)
            new = await self.claimed(store, "task-1", "owner-2")
            late = Event.step_recorded("charge", "fp", {"result": "zombie"})
            with pytest.raises(StaleLease):
                await store.transition("task-1", 0, late, WorkerAuthority(old))
            with pytest.raises(StaleLease):
                await store.transition(
                    "task-1", 0, Event.step_started("charge", "fp"), WorkerAuthority(old)
                )
            assert (await self.get_snapshot(store, "task-1")).steps == {}
            mine = Event.step_recorded("charge", "fp", {"result": "live"})
            done = await self.applied(store, "task-1", 0, mine, WorkerAuthority(new))
            assert done.snapshot.steps["charge"]["outcome"] == {"result": "live"}

    async def test_a_step_after_the_attempt_suspended_and_released_is_refused(self) -> None:
        """A zombie of an attempt that suspended (its claim released, nobody claimed since)
        or whose lease expired unclaimed cannot record a step, a sleep or another suspension."""
        async with self.store() as store:
            await self.create(store, "task-1")
            await self.create(store, "task-2")
            lease = await self.claimed(store, "task-1")
            worker = WorkerAuthority(lease)
            await self.applied(store, "task-1", 0, Event.sleep_scheduled("nap", 60_000), worker)
            suspended = await self.applied(store, "task-1", 1, Event.suspended("nap"), worker)
            await store.release(lease)
            expired = WorkerAuthority(await self.claimed(store, "task-2"))
            await self.advance(LEASE_MS)
            late = [
                Event.step_recorded("charge", "fp", {"result": "zombie"}),
                Event.step_started("charge", "fp"),
                Event.sleep_scheduled("again", 1000),
            ]
            for event in late:
                for task_id, authority in (("task-1", worker), ("task-2", expired)):
                    revision = 2 if task_id == "task-1" else 0
                    with pytest.raises(StaleLease):
                        await store.transition(task_id, revision, event, authority)
            assert await self.get_snapshot(store, "task-1") == suspended.snapshot
            assert (await self.get_snapshot(store, "task-2")).steps == {}

    async def test_a_step_resent_after_a_lost_acknowledgement_replays(self) -> None:
        async with self.store() as store:
            await self.create(store, "task-1")
            worker = WorkerAuthority(await self.claimed(store, "task-1"))
            event_id = derived_event_id("task-1", EventKind.STEP_RECORDED, "charge")
            event = Event.step_recorded("charge", "fp", {"result": 7}, id=event_id)
            first = await self.applied(store, "task-1", 0, event, worker)
            await self.advance(10)
            resent = await store.transition("task-1", 0, event, worker)
            assert resent == attrs.evolve(first, outcome="duplicate")
            other = Event.step_recorded("charge", "fp", {"result": 8}, id=event_id)
            with pytest.raises(EventIdReused):
                await store.transition("task-1", 1, other, worker)
            assert await self.get_snapshot(store, "task-1") == first.snapshot

    async def test_step_keys_are_recorded_once_per_task(self) -> None:
        async with self.store() as store:
            await self.create(store, "task-1")
            worker = WorkerAuthority(await self.claimed(store, "task-1"))
            await self.applied(store, "task-1", 0, Event.step_started("a", "fp-1"), worker)
            refused = [
                Event.step_recorded("a", "fp-2", {"result": 1}),  # another fingerprint
                Event.step_started("a", "fp-1"),
                Event.sleep_scheduled("a", 10),
            ]
            for event in refused:
                with pytest.raises(StepKeyReused):
                    await store.transition("task-1", 1, event, worker)
            await self.applied(
                store, "task-1", 1, Event.step_recorded("a", "fp-1", {"result": 1}), worker
            )
            with pytest.raises(StepKeyReused):
                await store.transition(
                    "task-1", 2, Event.step_recorded("a", "fp-1", {"result": 2}), worker
                )
            await self.applied(store, "task-1", 2, Event.input_requested("ask", ASK), worker)
            with pytest.raises(StepKeyReused):
                await store.transition(
                    "task-1", 3, Event.step_recorded("ask", "fp", {"result": 1}), worker
                )
            with pytest.raises(DuplicateInputKey):
                await store.transition("task-1", 3, Event.input_requested("a", ASK), worker)
            after = await self.get_snapshot(store, "task-1")
            assert after.revision == 3
            assert after.steps == {
                "a": {"kind": "step", "fingerprint": "fp-1", "outcome": {"result": 1}}
            }

    async def test_a_task_past_its_step_limits_records_nothing(self) -> None:
        async with self.store() as store:
            await self.create(store, "task-1")
            worker = WorkerAuthority(await self.claimed(store, "task-1"))
            chunk = "x" * 65_000  # each outcome under its 64 KiB, 17 of them over 1 MiB
            for n in range(16):
                event = Event.step_recorded(f"s{n}", "fp", {"result": chunk})
                await self.applied(store, "task-1", n, event, worker)
            with pytest.raises(StepLimitExceeded):
                await store.transition(
                    "task-1", 16, Event.step_recorded("s16", "fp", {"result": chunk}), worker
                )
            after = await self.get_snapshot(store, "task-1")
            assert (after.revision, len(after.steps)) == (16, 16)
            done = await self.applied(store, "task-1", 16, Event.completed({}), worker)
            assert done.snapshot.task.status is TaskStatus.COMPLETED

    async def test_a_suspended_sleep_is_claimable_exactly_at_its_wake_instant(self) -> None:
        async with self.store() as store:
            await self.create(store, "task-1")
            lease = await self.claimed(store, "task-1")
            worker = WorkerAuthority(lease)
            slept = await self.applied(
                store, "task-1", 0, Event.sleep_scheduled("cooldown", 5000), worker
            )
            wake_at = slept.committed_at + 5_000_000
            suspended = await self.applied(store, "task-1", 1, Event.suspended("cooldown"), worker)
            assert (suspended.snapshot.suspended_key, suspended.snapshot.suspended_until) == (
                "cooldown",
                wake_at,
            )
            assert suspended.snapshot.available_at == wake_at
            assert suspended.snapshot.retry_count == 0
            await store.release(lease)
            assert await store.claim("task-1", "owner-2", LEASE_MS) == Deferred(
                -(-(wake_at - await store.now()) // 1000)
            )
            assert await store.claim_next("owner-2", LEASE_MS) is None
            await self.advance(-(-(wake_at - await store.now()) // 1000) - 1)
            assert await store.claim_next("owner-2", LEASE_MS) is None
            await self.advance(1)
            claimed = await store.claim_next("owner-2", LEASE_MS)
            assert isinstance(claimed, Claimed)
            assert claimed.snapshot == suspended.snapshot
            # A second suspension on the due sleep changes nothing.
            again = await store.transition(
                "task-1", 2, Event.suspended("cooldown"), WorkerAuthority(claimed.lease)
            )
            assert isinstance(again, Transition) and again.outcome == "unchanged"
            # The sleep's suspension is over: a wait for input may suspend the task again.
            worker = WorkerAuthority(claimed.lease)
            await self.applied(store, "task-1", 2, Event.input_requested("ask", ASK), worker)
            waiting = await self.applied(store, "task-1", 3, Event.suspended("ask"), worker)
            assert (waiting.snapshot.suspended_key, waiting.snapshot.suspended_until) == (
                "ask",
                None,
            )

    async def test_a_task_suspended_for_input_waits_for_the_answer(self) -> None:
        async with self.store() as store:
            await self.create(store, "task-1")
            lease = await self.claimed(store, "task-1")
            worker = WorkerAuthority(lease)
            await self.applied(store, "task-1", 0, Event.input_requested("confirm", ASK), worker)
            for key in ("other", "missing"):  # nothing outstanding to wait for
                nothing = await store.transition("task-1", 1, Event.suspended(key), worker)
                assert isinstance(nothing, Transition) and nothing.outcome == "unchanged"
            suspended = await self.applied(store, "task-1", 1, Event.suspended("confirm"), worker)
            assert (suspended.snapshot.suspended_key, suspended.snapshot.suspended_until) == (
                "confirm",
                None,
            )
            await store.release(lease)
            await self.advance(LEASE_MS)
            assert isinstance(await store.claim("task-1", "owner-2", LEASE_MS), Deferred)
            assert await store.claim_next("owner-2", LEASE_MS) is None
            update = await self.request(store, A, Action.UPDATE, "task-1")
            answer = {"confirm": {"action": "accept"}}
            answered = await self.applied(
                store, "task-1", 2, Event.input_responses_accepted(answer), update
            )
            assert answered.snapshot.suspended_key is None
            assert answered.snapshot.available_at is None
            claimed = await store.claim_next("owner-2", LEASE_MS)
            assert isinstance(claimed, Claimed)
            assert claimed.snapshot.accepted_input_responses == answer

    async def test_cancel_ends_a_suspension_and_refuses_late_steps(self) -> None:
        async with self.store() as store:
            await self.create(store, "task-1")
            lease = await self.claimed(store, "task-1")
            worker = WorkerAuthority(lease)
            await self.applied(store, "task-1", 0, Event.sleep_scheduled("nap", 60_000), worker)
            await self.applied(store, "task-1", 1, Event.suspended("nap"), worker)
            cancel = await self.request(store, A, Action.CANCEL, "task-1")
            cancelled = await self.applied(store, "task-1", 2, Event.cancelled(), cancel)
            assert cancelled.snapshot.task.status is TaskStatus.CANCELLED
            assert (cancelled.snapshot.suspended_key, cancelled.snapshot.available_at) == (
                None,
                None,
            )
            late = await store.transition(
                "task-1", 3, Event.step_recorded("late", "fp", {"result": 1}), worker
            )
            assert isinstance(late, Transition) and late.outcome == "unchanged"
            assert "late" not in (await self.get_snapshot(store, "task-1")).steps

    async def test_reaping_deletes_a_task_with_its_steps(self) -> None:
        async with self.store() as store:
            await self.create(store, "task-1", ttl_ms=1000)
            worker = WorkerAuthority(await self.claimed(store, "task-1"))
            await self.applied(
                store, "task-1", 0, Event.step_recorded("a", "fp", {"result": 1}), worker
            )
            await self.applied(store, "task-1", 1, Event.sleep_scheduled("nap", 60_000), worker)
            await self.applied(store, "task-1", 2, Event.suspended("nap"), worker)
            await self.advance(1000)
            assert await store.reap() == ["task-1"]
            access = await store.authorize(A, Action.GET, "task-1")
            assert await store.get("task-1", access) is NOT_FOUND
            assert await store.claim_next("owner-2", LEASE_MS) is None

    async def test_now_moves_with_advance(self) -> None:
        async with self.store() as store:
            before = await store.now()
            await self.advance(1500)
            assert await store.now() == before + 1_500_000

    async def test_returned_values_are_isolated(self) -> None:
        async with self.store() as store:
            created = await self.create(store, "task-1")
            assert created.work is not None
            created.work.input["taskId"] = "mutated"
            get = await store.authorize(A, Action.GET, "task-1")
            snapshot = await store.get("task-1", get)
            assert isinstance(snapshot, Snapshot)
            assert snapshot.work is not None
            assert snapshot.work.input == {"taskId": "task-1"}

    # -- optional capability: create_claimed -------------------------------------------------

    async def test_create_claimed_is_one_atomic_step(self) -> None:
        """A store offering ``create_claimed`` hands its creator the first claim atomically."""
        async with self.store(max_tasks=2) as store:
            if not isinstance(store, CreatesClaimed):
                pytest.skip("the store does not offer create_claimed")
            access = await store.authorize(A, Action.CREATE, "task-1")
            task = new_task("task-1", await store.now(), 60_000, 5)
            work = Work(idempotency_key="task-1", type="contract", input={"taskId": "task-1"})
            claimed = await store.create_claimed(task, work, access, "creator", LEASE_MS)
            assert claimed.snapshot.revision == 0
            assert claimed.snapshot.task.status is TaskStatus.WORKING
            assert claimed.lease.owner_id == "creator"
            assert claimed.lease.generation == 1
            assert claimed.lease.expires_at == await store.now() + LEASE_MS * 1000
            assert await store.claim_next("recoverer", LEASE_MS) is None
            assert await store.claim("task-1", "recoverer", LEASE_MS) is UNAVAILABLE
            get = await store.authorize(A, Action.GET, "task-1")
            assert await store.get("task-1", get) == claimed.snapshot
            done = await self.applied(
                store, "task-1", 0, Event.completed({"ok": True}), WorkerAuthority(claimed.lease)
            )
            assert done.snapshot.task.status is TaskStatus.COMPLETED
            again = await store.authorize(A, Action.CREATE, "task-1")
            with pytest.raises(AlreadyExists):
                await store.create_claimed(task, work, again, "creator", LEASE_MS)
            await self.create(store, "task-2")
            third = await store.authorize(A, Action.CREATE, "task-3")
            with pytest.raises(CapacityExceeded):
                await store.create_claimed(
                    new_task("task-3", await store.now(), 60_000, 5),
                    Work(idempotency_key="task-3", type="contract", input={}),
                    third,
                    "creator",
                    LEASE_MS,
                )
            assert await store.claim("task-3", "creator", LEASE_MS) is NOT_FOUND

    # -- optional capability: settle -------------------------------------------------------------

    async def test_settle_applies_the_final_event_and_releases_the_claim(self) -> None:
        """``settle`` is a worker transition plus, in the same step, the release of the claim."""
        async with self.store() as store:
            settling = store if settles(store) else None
            if settling is None:
                pytest.skip("the store does not offer settle")
            await self.create(store, "task-1", policy=RetryPolicy([2000]))
            lease = await self.claimed(store, "task-1")
            event = Event.retry_requested(ERROR, "again")
            with pytest.raises(UnauthorizedAction):
                await settling.settle("task-1", 0, Event.input_requested("k", ASK), lease)
            with pytest.raises(StaleLease):
                await settling.settle("task-1", 0, event, attrs.evolve(lease, token="forged"))
            conflict = await settling.settle("task-1", 1, event, lease)
            assert isinstance(conflict, Conflict)
            assert conflict.snapshot.revision == 0
            assert await settling.settle("unknown", 0, event, lease) is NOT_FOUND
            # Refusals kept the claim: the lease still reads and nobody else can claim.
            assert isinstance(await store.worker_snapshot("task-1", lease), Snapshot)
            assert await store.claim("task-1", "owner-2", LEASE_MS) is UNAVAILABLE

            settled = await settling.settle("task-1", 0, event, lease)
            assert isinstance(settled, Transition)
            assert settled.outcome == "applied"
            assert settled.event_revision == 1
            assert settled.snapshot.retry_count == 1
            retry_at = settled.snapshot.retry_at
            assert retry_at == settled.committed_at + 2_000_000
            assert settled.effects == Effects(
                retry=RetryEffect(
                    disposition="scheduled", retry_at=retry_at, delay_ms=2000, retry_count=1
                )
            )
            # Released: the lease is no claim any more, and only the retry deadline holds the
            # task back (the 30 s lease would otherwise have to expire first).
            with pytest.raises(StaleLease):
                await store.release(lease)
            with pytest.raises(StaleLease):
                await store.worker_snapshot("task-1", lease)

            # A resend after a lost acknowledgement replays the original commit...
            replay = await settling.settle("task-1", 0, event, lease)
            assert replay == attrs.evolve(settled, outcome="duplicate")
            # ...but other content under the same id, or another event, is refused as stale.
            reused = Event.retry_requested(ERROR, "other", id=event.id)
            with pytest.raises(StaleLease):
                await settling.settle("task-1", 1, reused, lease)
            with pytest.raises(StaleLease):
                await settling.settle("task-1", 1, Event.completed({"ok": True}), lease)

            assert retry_at is not None
            await self.advance(-(-(retry_at - await store.now()) // 1000))
            again = await store.claim_next("owner-2", LEASE_MS)
            assert again is not None
            assert again.lease.generation == 2
            # A later claim ends even the replay of the old lease.
            with pytest.raises(StaleLease):
                await settling.settle("task-1", 0, event, lease)
            done = await settling.settle("task-1", 1, Event.completed({"ok": True}), again.lease)
            assert isinstance(done, Transition)
            assert done.outcome == "applied"
            assert done.snapshot.task.status is TaskStatus.COMPLETED
            with pytest.raises(StaleLease):
                await store.release(again.lease)
            assert await store.claim("task-1", "owner-3", LEASE_MS) is UNAVAILABLE

    async def test_settle_releases_on_unchanged_and_duplicate(self) -> None:
        async with self.store() as store:
            settling = store if settles(store) else None
            if settling is None:
                pytest.skip("the store does not offer settle")
            await self.create(store, "task-1")
            lease = await self.claimed(store, "task-1")
            await self.applied(
                store,
                "task-1",
                0,
                Event.cancelled(),
                await self.request(store, A, Action.CANCEL, "task-1"),
            )
            late = await settling.settle("task-1", 1, Event.completed({"ok": True}), lease)
            assert isinstance(late, Transition)
            assert late.outcome == "unchanged"
            assert late.snapshot.task.status is TaskStatus.CANCELLED
            with pytest.raises(StaleLease):
                await store.release(lease)

            # A final event committed by a plain transition, resent through settle: the
            # duplicate releases the claim.
            await self.create(store, "task-2")
            lease = await self.claimed(store, "task-2")
            event = Event.failed(ERROR, "broken")
            first = await self.applied(store, "task-2", 0, event, WorkerAuthority(lease))
            again = await settling.settle("task-2", 0, event, lease)
            assert again == attrs.evolve(first, outcome="duplicate")
            with pytest.raises(StaleLease):
                await store.release(lease)

    # -- optional capability: renew_all -----------------------------------------------------------

    def batch_renewer(self, store: Store) -> RenewsLeases:
        if not renews_leases(store):
            pytest.skip("the store does not offer renew_all")
        return store

    async def _mixed_batch(self, store: Store, other: Store) -> _MixedBatch:
        """Six tasks claimed by ``owner-1`` on ``store`` (task-5 by ``owner-2``, task-6 at
        revision 1), task-1 claimed on ``other`` too, 10 s later; the batch of renewals that
        the renewal tests send then, with one stale variant of each kind."""
        for n in range(1, 7):
            await self.create(store, f"task-{n}")
        await self.create(other, "task-1")
        first = await self.claimed(store, "task-1")
        old_generation = await self.claimed(store, "task-2")
        await store.release(old_generation)
        second = await self.claimed(store, "task-2")  # generation 2: the old value is stale
        old_token = await self.claimed(store, "task-3")
        third = await store.renew(old_token, LEASE_MS)
        fourth = await self.claimed(store, "task-4")
        foreign = await self.claimed(store, "task-5", owner="owner-2")
        sixth = await self.claimed(store, "task-6")
        elsewhere = await self.claimed(other, "task-1")
        await self.applied(
            store, "task-6", 0, Event.input_requested("a", ASK), WorkerAuthority(sixth)
        )
        await self.advance(10_000)
        batch = [
            first,
            old_generation,
            old_token,
            attrs.evolve(fourth, token="forged"),
            attrs.evolve(fourth, generation=fourth.generation + 1),
            attrs.evolve(fourth, expires_at=fourth.expires_at + 1000),
            foreign,
            elsewhere,
            sixth,
            first,  # a repeat: stale once the first one renewed the task
        ]
        return _MixedBatch(batch, first, second, third, fourth, foreign, sixth, elsewhere)

    async def test_renew_all_renews_live_leases_and_refuses_each_stale_one_alone(self) -> None:
        """Fencing stays exact per lease: a stale generation, token, owner or store in the batch
        is lost for that lease alone, the others are renewed at one instant."""
        async with self.store() as store, self.store() as other:
            renewer = self.batch_renewer(store)
            mixed = await self._mixed_batch(store, other)
            batch, first, sixth, elsewhere = mixed.batch, mixed.first, mixed.sixth, mixed.elsewhere
            second, third, fourth, foreign = mixed.second, mixed.third, mixed.fourth, mixed.foreign
            results = await renewer.renew_all("owner-1", batch, LEASE_MS)
            assert [type(r) if r is not LEASE_LOST else r for r in results] == [
                Renewed,
                LEASE_LOST,
                LEASE_LOST,
                LEASE_LOST,
                LEASE_LOST,
                LEASE_LOST,
                LEASE_LOST,
                LEASE_LOST,
                Renewed,
                LEASE_LOST,
            ]
            renewed_first, renewed_sixth = results[0], results[8]
            assert isinstance(renewed_first, Renewed) and isinstance(renewed_sixth, Renewed)
            expiry = START + 10_000_000 + LEASE_MS * 1000
            for renewed, old, revision in ((renewed_first, first, 0), (renewed_sixth, sixth, 1)):
                new = renewed.lease
                assert renewed.revision == revision
                assert (new.store_id, new.task_id, new.owner_id, new.generation, new.epoch) == (
                    old.store_id,
                    old.task_id,
                    old.owner_id,
                    old.generation,
                    old.epoch,
                )
                assert new.expires_at == expiry
                assert new != old  # a store may keep the token: the expiry alone differs
                with pytest.raises(StaleLease):
                    await store.worker_snapshot(old.task_id, old)
                assert isinstance(await store.worker_snapshot(new.task_id, new), Snapshot)
            # The refused leases changed nothing: each live claim is exactly as it was.
            for task_id, live in (
                ("task-2", second),
                ("task-3", third),
                ("task-4", fourth),
                ("task-5", foreign),
            ):
                snapshot = await store.worker_snapshot(task_id, live)
                assert isinstance(snapshot, Snapshot)
            assert isinstance(await other.worker_snapshot("task-1", elsewhere), Snapshot)
            # Their expiries were not extended; the renewed ones were, to the exact instant.
            await self.advance(LEASE_MS - 10_000)
            claimed = [await store.claim_next("owner-3", LEASE_MS) for _ in range(5)]
            assert sorted(c.lease.task_id for c in claimed if c is not None) == [
                "task-2",
                "task-3",
                "task-4",
                "task-5",
            ]
            assert await store.claim("task-1", "owner-3", LEASE_MS) is UNAVAILABLE
            await self.advance(10_000 - 1)
            assert await store.claim("task-1", "owner-3", LEASE_MS) is UNAVAILABLE
            assert isinstance(await store.worker_snapshot("task-1", renewed_first.lease), Snapshot)
            await self.advance(1)
            again = await store.claim("task-1", "owner-3", LEASE_MS)
            assert isinstance(again, Claimed)
            assert again.lease.generation == first.generation + 1

    async def test_renew_all_does_not_revive_an_expired_lease(self) -> None:
        async with self.store() as store:
            renewer = self.batch_renewer(store)
            await self.create(store, "task-1")
            await self.create(store, "task-2")
            short = await store.claim("task-1", "owner-1", 1000)
            assert isinstance(short, Claimed)
            long = await self.claimed(store, "task-2")
            await self.advance(1000)  # task-1's lease ends exactly now; nobody claimed it since
            results = await renewer.renew_all("owner-1", (short.lease, long), 1000)
            assert results[0] is LEASE_LOST
            assert isinstance(results[1], Renewed)
            assert results[1].lease.expires_at == START + 2_000_000
            with pytest.raises(StaleLease):
                await store.worker_snapshot("task-1", short.lease)
            with pytest.raises(StaleLease):
                await store.renew(short.lease, 1000)
            adopted = await store.claim_next("owner-2", LEASE_MS)
            assert adopted is not None
            assert (adopted.lease.task_id, adopted.lease.generation) == ("task-1", 2)
            assert await renewer.renew_all("owner-1", [short.lease], LEASE_MS) == [LEASE_LOST]
            released = results[1].lease
            await store.release(released)
            assert await renewer.renew_all("owner-1", [released], LEASE_MS) == [LEASE_LOST]

    async def test_renew_all_arguments(self) -> None:
        async with self.store() as store:
            renewer = self.batch_renewer(store)
            await self.create(store, "task-1")
            lease = await self.claimed(store, "task-1")
            assert await renewer.renew_all("owner-1", [], LEASE_MS) == []
            with pytest.raises(TypeError):
                await renewer.renew_all("owner-1", [lease, "lease"], LEASE_MS)  # type: ignore[list-item]
            with pytest.raises(TypeError):
                await renewer.renew_all("owner-1", iter([lease]), LEASE_MS)  # type: ignore[arg-type]
            with pytest.raises(ValueError):
                await renewer.renew_all("owner-1", [lease], 0)
            with pytest.raises(ValueError):
                await renewer.renew_all("", [lease], LEASE_MS)
            assert isinstance(await store.worker_snapshot("task-1", lease), Snapshot)

    async def test_a_dead_owners_hundreds_of_leases_are_recovered_after_expiry(self) -> None:
        """A runner renewing hundreds of leases in batches dies: nobody can take its tasks
        before the last batch's expiry, and then another owner adopts every one of them."""
        count = 300
        async with self.store() as store:
            renewer = self.batch_renewer(store)
            for n in range(count):
                await self.create(store, f"task-{n:03}")
            leases = []
            for _ in range(count):
                claimed = await store.claim_next("dead", LEASE_MS)
                assert claimed is not None
                leases.append(claimed.lease)
            assert [lease.task_id for lease in leases] == [f"task-{n:03}" for n in range(count)]
            await self.advance(10_000)
            results = await renewer.renew_all("dead", leases, LEASE_MS)
            assert all(isinstance(r, Renewed) for r in results)
            last = [r.lease for r in results if isinstance(r, Renewed)]
            assert {lease.expires_at for lease in last} == {START + 10_000_000 + LEASE_MS * 1000}
            # The owner dies here. Until its last renewal lapses, its tasks stay its own.
            await self.advance(LEASE_MS - 1)
            assert await store.claim_next("heir", LEASE_MS) is None
            await self.advance(1)
            adopted = []
            while (claimed := await store.claim_next("heir", LEASE_MS)) is not None:
                adopted.append(claimed.lease)
            assert [lease.task_id for lease in adopted] == [f"task-{n:03}" for n in range(count)]
            assert {lease.generation for lease in adopted} == {2}
            assert await renewer.renew_all("dead", last, LEASE_MS) == [LEASE_LOST] * count
            await self.advance(10_000)
            again = await renewer.renew_all("heir", adopted, LEASE_MS)
            assert all(isinstance(r, Renewed) for r in again)
            assert await renewer.renew_all("heir", adopted, LEASE_MS) == [LEASE_LOST] * count

    async def test_renew_all_keeps_a_live_runners_tasks_and_frees_a_dead_ones_at_its_expiry(
        self,
    ) -> None:
        """Heartbeat after heartbeat, a batch keeps every task of its runner its own, each to
        the exact expiry of the last batch; a task claimed since joins the next batch; a lease
        left out of a batch, or renewed alone, keeps exactly the expiry it had. When the runner
        stops renewing, each task becomes claimable at exactly its own last expiry."""
        beat_ms = LEASE_MS // 3
        async with self.store() as store:
            renewer = self.batch_renewer(store)
            for n in range(4):
                await self.create(store, f"task-{n}")
            leases = {f"task-{n}": await self.claimed(store, f"task-{n}") for n in range(4)}
            for beat in range(1, 4):
                await self.advance(beat_ms)
                if beat == 2:  # claimed since the last batch: it joins this one
                    await self.create(store, "task-4")
                    leases["task-4"] = await self.claimed(store, "task-4")
                results = await renewer.renew_all("owner-1", list(leases.values()), LEASE_MS)
                expiry = START + (beat * beat_ms + LEASE_MS) * 1000
                for (task_id, old), result in zip(list(leases.items()), results, strict=True):
                    assert isinstance(result, Renewed), (beat, task_id)
                    assert result.lease.expires_at == expiry
                    assert (result.lease.generation, result.lease.owner_id) == (1, "owner-1")
                    with pytest.raises(StaleLease):
                        await store.worker_snapshot(task_id, old)
                    leases[task_id] = result.lease
                for task_id, lease in leases.items():
                    assert await store.claim(task_id, "owner-2", LEASE_MS) is UNAVAILABLE
                    assert isinstance(await store.worker_snapshot(task_id, lease), Snapshot)
                assert await store.claim_next("owner-2", LEASE_MS) is None
            last = START + (3 * beat_ms + LEASE_MS) * 1000
            # task-0 is renewed alone (a shorter lease), task-1 is left out of the next batch.
            await self.advance(beat_ms)
            alone = await store.renew(leases["task-0"], LEASE_MS // 2)
            assert alone.token != leases["task-0"].token
            with pytest.raises(StaleLease):
                await store.worker_snapshot("task-0", leases["task-0"])
            batch = [leases["task-2"], leases["task-3"], leases["task-4"]]
            results = await renewer.renew_all("owner-1", batch, LEASE_MS)
            final = START + (4 * beat_ms + LEASE_MS) * 1000
            assert [r.lease.expires_at if isinstance(r, Renewed) else r for r in results] == [
                final
            ] * 3
            assert alone.expires_at == START + (4 * beat_ms + LEASE_MS // 2) * 1000
            assert isinstance(await store.worker_snapshot("task-0", alone), Snapshot)
            assert isinstance(await store.worker_snapshot("task-1", leases["task-1"]), Snapshot)
            # The runner dies. Each task is free at exactly its own last expiry.
            now = START + 4 * beat_ms * 1000
            for task_id, at in (("task-0", alone.expires_at), ("task-1", last), ("task-2", final)):
                await self.advance((at - now) // 1000 - 1)
                assert await store.claim(task_id, "heir", LEASE_MS) is UNAVAILABLE, task_id
                await self.advance(1)
                now = at
                adopted = await store.claim(task_id, "heir", LEASE_MS)
                assert isinstance(adopted, Claimed), task_id
                assert adopted.lease.generation == 2
            for task_id in ("task-3", "task-4"):
                again = await store.claim(task_id, "heir", LEASE_MS)
                assert isinstance(again, Claimed) and again.lease.generation == 2
            assert await renewer.renew_all("owner-1", batch, LEASE_MS) == [LEASE_LOST] * 3
            assert await renewer.renew_all("owner-1", [alone], LEASE_MS) == [LEASE_LOST]

    async def test_renew_all_leaves_each_tasks_fencing_exact(self) -> None:
        """After batch renewals, a stale generation or token of one task is refused for that
        task (reads, writes, renewals, releases), and the live lease keeps working."""
        async with self.store() as store:
            renewer = self.batch_renewer(store)
            for n in range(3):
                await self.create(store, f"task-{n}")
            old_generation = await self.claimed(store, "task-0")
            await store.release(old_generation)
            leases = [await self.claimed(store, f"task-{n}") for n in range(3)]
            assert leases[0].generation == 2
            for _ in range(2):
                await self.advance(10_000)
                results = await renewer.renew_all("owner-1", leases, LEASE_MS)
                leases = [r.lease for r in results if isinstance(r, Renewed)]
                assert len(leases) == 3
            live = leases[0]
            stale = [
                attrs.evolve(old_generation, expires_at=live.expires_at),
                attrs.evolve(live, generation=1),
                attrs.evolve(live, token="f" * 36),
                attrs.evolve(live, owner_id="owner-2"),
                attrs.evolve(live, expires_at=live.expires_at - 1000),
            ]
            for lease in stale:
                with pytest.raises(StaleLease):
                    await store.worker_snapshot("task-0", lease)
                with pytest.raises(StaleLease):
                    await store.renew(lease, LEASE_MS)
                with pytest.raises(StaleLease):
                    await store.transition("task-0", 0, Event.completed({}), WorkerAuthority(lease))
                with pytest.raises(StaleLease):
                    await store.release(lease)
            assert await renewer.renew_all("owner-1", stale, LEASE_MS) == [LEASE_LOST] * 5
            assert await store.claim("task-0", "owner-2", LEASE_MS) is UNAVAILABLE
            done = await self.applied(
                store, "task-0", 0, Event.completed({"ok": True}), WorkerAuthority(live)
            )
            assert done.snapshot.task.status is TaskStatus.COMPLETED
            await store.release(live)
            # The other tasks' batch leases are untouched by all of it.
            for n, lease in ((1, leases[1]), (2, leases[2])):
                assert isinstance(await store.worker_snapshot(f"task-{n}", lease), Snapshot)

    # -- optional capability: renew_owner ---------------------------------------------------------

    def owner_renewer(self, store: Store) -> RenewsOwnerLease:
        if not renews_owner_lease(store):
            pytest.skip("the store does not offer renew_owner")
        return store

    async def test_renew_owner_renews_live_leases_and_loses_each_stale_one_alone(self) -> None:
        """One answer for the batch: the owner lease's expiry, the indexes of the leases lost
        (a stale generation, token, expiry, owner or store, a repeat), the indexes whose task
        moved past the revision given. Each renewed claim is its held lease at that expiry."""
        async with self.store() as store, self.store() as other:
            renewer = self.owner_renewer(store)
            mixed = await self._mixed_batch(store, other)
            batch, first, sixth, elsewhere = mixed.batch, mixed.first, mixed.sixth, mixed.elsewhere
            second, third, fourth, foreign = mixed.second, mixed.third, mixed.fourth, mixed.foreign
            answer = await renewer.renew_owner("owner-1", batch, [0] * 10, None, LEASE_MS)
            expiry = START + 10_000_000 + LEASE_MS * 1000
            assert answer == OwnerRenewal(expiry, (1, 2, 3, 4, 5, 6, 7, 9), (8,))
            for old in (first, sixth):
                with pytest.raises(StaleLease):
                    await store.worker_snapshot(old.task_id, old)
                live = attrs.evolve(old, expires_at=expiry)
                assert isinstance(await store.worker_snapshot(old.task_id, live), Snapshot)
            for task_id, live in (
                ("task-2", second),
                ("task-3", third),
                ("task-4", fourth),
                ("task-5", foreign),
            ):
                assert isinstance(await store.worker_snapshot(task_id, live), Snapshot)
            assert isinstance(await other.worker_snapshot("task-1", elsewhere), Snapshot)
            await self.advance(LEASE_MS - 10_000)
            claimed = [await store.claim_next("owner-3", LEASE_MS) for _ in range(5)]
            assert sorted(c.lease.task_id for c in claimed if c is not None) == [
                "task-2",
                "task-3",
                "task-4",
                "task-5",
            ]
            assert await store.claim("task-1", "owner-3", LEASE_MS) is UNAVAILABLE
            await self.advance(10_000 - 1)
            assert await store.claim("task-1", "owner-3", LEASE_MS) is UNAVAILABLE
            await self.advance(1)
            again = await store.claim("task-1", "owner-3", LEASE_MS)
            assert isinstance(again, Claimed)
            assert again.lease.generation == first.generation + 1

    async def test_renew_owner_keeps_held_leases_live_beat_after_beat(self) -> None:
        """The caller keeps the leases it holds and passes the owner lease's expiry it was
        told: heartbeat after heartbeat every claim stays its own, exactly the held lease at
        the last expiry; a claim made since joins; a claim left out of a batch, or renewed
        alone, keeps exactly the expiry it had (and joins again with that exact lease); a
        revision written since the one given is reported. When the runner stops renewing,
        each task becomes claimable at exactly its own last expiry."""
        beat_ms = LEASE_MS // 3
        async with self.store() as store:
            renewer = self.owner_renewer(store)
            for n in range(4):
                await self.create(store, f"task-{n}")
            held = {f"task-{n}": await self.claimed(store, f"task-{n}") for n in range(4)}
            following: int | None = None
            for beat in range(1, 4):
                await self.advance(beat_ms)
                if beat == 2:  # claimed since the last batch: it joins this one
                    await self.create(store, "task-4")
                    held["task-4"] = await self.claimed(store, "task-4")
                revisions = [0] * len(held)
                answer = await renewer.renew_owner(
                    "owner-1", list(held.values()), revisions, following, LEASE_MS
                )
                expiry = START + (beat * beat_ms + LEASE_MS) * 1000
                assert answer == OwnerRenewal(expiry, (), ())
                following = expiry
                for task_id, lease in held.items():
                    assert await store.claim(task_id, "owner-2", LEASE_MS) is UNAVAILABLE
                    live = attrs.evolve(lease, expires_at=expiry)
                    assert isinstance(await store.worker_snapshot(task_id, live), Snapshot)
                    if live != lease:  # (task-4, claimed at the batch's instant, is the same)
                        with pytest.raises(StaleLease):
                            await store.worker_snapshot(task_id, lease)
                assert await store.claim_next("owner-2", LEASE_MS) is None
            assert following is not None
            last = following
            exact = {
                task_id: attrs.evolve(lease, expires_at=last) for task_id, lease in held.items()
            }
            # task-2 moves on (a request elsewhere would do the same); the batch reports it.
            await self.applied(
                store,
                "task-2",
                0,
                Event.input_requested("a", ASK),
                WorkerAuthority(exact["task-2"]),
            )
            # task-0 is renewed alone (a shorter lease), task-1 is left out of the next batch.
            await self.advance(beat_ms)
            alone = await store.renew(exact["task-0"], LEASE_MS // 2)
            assert alone.token != exact["task-0"].token
            batch = [held["task-2"], held["task-3"], held["task-4"], alone]
            answer = await renewer.renew_owner("owner-1", batch, [0] * 4, following, LEASE_MS)
            final = START + (4 * beat_ms + LEASE_MS) * 1000
            assert answer == OwnerRenewal(final, (), (0,))
            following = final
            assert isinstance(
                await store.worker_snapshot("task-0", attrs.evolve(alone, expires_at=final)),
                Snapshot,
            )
            # Left out: task-1 keeps the expiry it had, as its own.
            assert isinstance(await store.worker_snapshot("task-1", exact["task-1"]), Snapshot)
            with pytest.raises(StaleLease):
                await store.worker_snapshot(
                    "task-1", attrs.evolve(held["task-1"], expires_at=final)
                )
            # The next batch without task-1, then the runner dies: each task is free at exactly
            # its own last expiry.
            await self.advance(beat_ms)
            batch = [held["task-2"], held["task-3"], alone]
            answer = await renewer.renew_owner("owner-1", batch, [1, 0, 0], following, LEASE_MS)
            latest = START + (5 * beat_ms + LEASE_MS) * 1000
            assert answer == OwnerRenewal(latest, (), ())
            now = START + 5 * beat_ms * 1000
            for task_id, at in (("task-1", last), ("task-4", final), ("task-0", latest)):
                if at > now:
                    await self.advance((at - now) // 1000 - 1)
                    assert await store.claim(task_id, "heir", LEASE_MS) is UNAVAILABLE, task_id
                    await self.advance(1)
                    now = at
                adopted = await store.claim(task_id, "heir", LEASE_MS)
                assert isinstance(adopted, Claimed), task_id
                assert adopted.lease.generation == 2
            again = await store.claim("task-3", "heir", LEASE_MS)
            assert isinstance(again, Claimed) and again.lease.generation == 2
            answer = await renewer.renew_owner("owner-1", batch, [0] * 3, following, LEASE_MS)
            assert answer == OwnerRenewal(None, (0, 1, 2), ())

    async def test_renew_owner_loses_every_following_lease_with_the_owner_lease(self) -> None:
        """The owner lease is the expiry of every claim that follows it: once it lapses, or
        when the caller's ``following`` is not its expiry, every following lease is lost (a
        claim made since the last batch, exactly held, is renewed alone of them) and none is
        revived; the stale attempts' writes are refused."""
        async with self.store() as store:
            renewer = self.owner_renewer(store)
            for n in range(4):
                await self.create(store, f"task-{n}")
            held = [await self.claimed(store, f"task-{n}") for n in range(3)]
            first = await renewer.renew_owner("owner-1", held, [0] * 3, None, LEASE_MS)
            assert first.expires_at == START + LEASE_MS * 1000 and first.lost == ()
            await self.advance(10_000)
            fresh = await self.claimed(store, "task-3")
            wrong = first.expires_at + 1000
            answer = await renewer.renew_owner("owner-1", [*held, fresh], [0] * 4, wrong, LEASE_MS)
            assert answer == OwnerRenewal(START + (10_000 + LEASE_MS) * 1000, (0, 1, 2), ())
            # The lost claims kept their expiry: the exact leases still work until then.
            exact = [attrs.evolve(lease, expires_at=first.expires_at) for lease in held]
            assert isinstance(await store.worker_snapshot("task-0", exact[0]), Snapshot)
            await self.advance(LEASE_MS - 10_000)  # the first batch's expiry: they lapse
            assert answer.expires_at is not None
            answer = await renewer.renew_owner(
                "owner-1", [*held, fresh], [0] * 4, answer.expires_at, LEASE_MS
            )
            assert answer == OwnerRenewal(START + 2 * LEASE_MS * 1000, (0, 1, 2), ())
            for n, lease in enumerate(exact):
                with pytest.raises(StaleLease):
                    await store.transition(
                        f"task-{n}", 0, Event.completed({}), WorkerAuthority(lease)
                    )
                adopted = await store.claim(f"task-{n}", "heir", LEASE_MS)
                assert isinstance(adopted, Claimed) and adopted.lease.generation == 2
            # The following one lapses with its owner lease too, exactly then.
            await self.advance(10_000 - 1)
            assert await store.claim("task-3", "heir", LEASE_MS) is UNAVAILABLE
            await self.advance(LEASE_MS)
            answer = await renewer.renew_owner(
                "owner-1", [fresh], [0], START + 2 * LEASE_MS * 1000, LEASE_MS
            )
            assert answer == OwnerRenewal(None, (0,), ())
            adopted = await store.claim("task-3", "heir", LEASE_MS)
            assert isinstance(adopted, Claimed) and adopted.lease.generation == 2

    async def test_renew_owner_leaves_each_tasks_fencing_exact(self) -> None:
        """After owner renewals, a stale attempt of one task (an older generation, another
        token, owner or expiry) is refused for that task alone (reads, writes, renewals,
        releases, batches), and the live held lease keeps working."""
        async with self.store() as store:
            renewer = self.owner_renewer(store)
            for n in range(3):
                await self.create(store, f"task-{n}")
            old_generation = await self.claimed(store, "task-0")
            await store.release(old_generation)
            held = [await self.claimed(store, f"task-{n}") for n in range(3)]
            assert held[0].generation == 2
            following: int | None = None
            for _ in range(2):
                await self.advance(10_000)
                answer = await renewer.renew_owner("owner-1", held, [0] * 3, following, LEASE_MS)
                assert answer.lost == ()
                following = answer.expires_at
            assert following is not None
            live = attrs.evolve(held[0], expires_at=following)
            stale = [
                attrs.evolve(old_generation, expires_at=following),
                attrs.evolve(live, generation=1),
                attrs.evolve(live, token="f" * 36),
                attrs.evolve(live, owner_id="owner-2"),
                attrs.evolve(live, expires_at=following - 1000),
            ]
            for lease in stale:
                with pytest.raises(StaleLease):
                    await store.worker_snapshot("task-0", lease)
                with pytest.raises(StaleLease):
                    await store.renew(lease, LEASE_MS)
                with pytest.raises(StaleLease):
                    await store.transition("task-0", 0, Event.completed({}), WorkerAuthority(lease))
                with pytest.raises(StaleLease):
                    await store.release(lease)
            # In a batch, only the held lease's identity counts for a following claim (its
            # expiry is the owner lease's): a stale generation, token or owner is lost.
            answer = await renewer.renew_owner("owner-1", stale[:4], [0] * 4, following, LEASE_MS)
            assert answer == OwnerRenewal(None, (0, 1, 2, 3), ())
            # That batch renewed nothing: every claim that followed now has its expiry as its
            # own, so only the exact lease renews it.
            assert isinstance(await store.worker_snapshot("task-0", live), Snapshot)
            answer = await renewer.renew_owner("owner-1", [held[0]], [0], following, LEASE_MS)
            assert answer == OwnerRenewal(None, (0,), ())
            # Only the first lease of a task counts: the live one after a stale one is lost.
            answer = await renewer.renew_owner("owner-1", [held[0], live], [0, 0], None, LEASE_MS)
            assert answer == OwnerRenewal(None, (0, 1), ())
            answer = await renewer.renew_owner("owner-1", [live], [0], None, LEASE_MS)
            assert answer.lost == () and answer.expires_at is not None
            live = attrs.evolve(live, expires_at=answer.expires_at)
            assert await store.claim("task-0", "owner-2", LEASE_MS) is UNAVAILABLE
            done = await self.applied(
                store, "task-0", 0, Event.completed({"ok": True}), WorkerAuthority(live)
            )
            assert done.snapshot.task.status is TaskStatus.COMPLETED
            await store.release(live)
            answer = await renewer.renew_owner(
                "owner-1", [held[0]], [0], answer.expires_at, LEASE_MS
            )
            assert answer == OwnerRenewal(None, (0,), ())

    async def test_renew_owner_arguments(self) -> None:
        async with self.store() as store:
            renewer = self.owner_renewer(store)
            await self.create(store, "task-1")
            lease = await self.claimed(store, "task-1")
            assert await renewer.renew_owner("owner-1", [], [], None, LEASE_MS) == OwnerRenewal(
                None, (), ()
            )
            bad: list[tuple[Any, Any, Any, Any, Any]] = [
                ("owner-1", [lease, "lease"], [0, 0], None, LEASE_MS),
                ("owner-1", iter([lease]), [0], None, LEASE_MS),
                ("owner-1", [lease], [], None, LEASE_MS),
                ("owner-1", [lease], [-1], None, LEASE_MS),
                ("owner-1", [lease], ["0"], None, LEASE_MS),
                ("owner-1", [lease], [0], "soon", LEASE_MS),
            ]
            for args in bad:
                with pytest.raises(TypeError):
                    await renewer.renew_owner(*args)
            with pytest.raises(ValueError):
                await renewer.renew_owner("owner-1", [lease], [0], None, 0)
            with pytest.raises(ValueError):
                await renewer.renew_owner("", [lease], [0], None, LEASE_MS)
            assert isinstance(await store.worker_snapshot("task-1", lease), Snapshot)

    async def test_a_dead_owners_hundreds_of_owner_renewed_leases_are_recovered(self) -> None:
        """A runner renewing hundreds of leases with one owner lease dies: nobody can take its
        tasks before the owner lease's expiry, then another owner adopts every one, and the
        dead runner's held leases are all lost."""
        count = 300
        async with self.store() as store:
            renewer = self.owner_renewer(store)
            for n in range(count):
                await self.create(store, f"task-{n:03}")
            held = []
            for _ in range(count):
                claimed = await store.claim_next("dead", LEASE_MS)
                assert claimed is not None
                held.append(claimed.lease)
            following: int | None = None
            for _ in range(3):
                await self.advance(10_000)
                answer = await renewer.renew_owner("dead", held, [0] * count, following, LEASE_MS)
                assert answer.lost == () and answer.changed == ()
                following = answer.expires_at
            assert following == START + (30_000 + LEASE_MS) * 1000
            # The owner dies here. Until its owner lease lapses, its tasks stay its own.
            await self.advance(LEASE_MS - 1)
            assert await store.claim_next("heir", LEASE_MS) is None
            await self.advance(1)
            adopted = []
            while (claimed := await store.claim_next("heir", LEASE_MS)) is not None:
                adopted.append(claimed.lease)
            assert [lease.task_id for lease in adopted] == [f"task-{n:03}" for n in range(count)]
            assert {lease.generation for lease in adopted} == {2}
            answer = await renewer.renew_owner("dead", held, [0] * count, following, LEASE_MS)
            assert answer == OwnerRenewal(None, tuple(range(count)), ())
            await self.advance(10_000)
            again = await renewer.renew_owner("heir", adopted, [0] * count, None, LEASE_MS)
            assert again.lost == () and again.expires_at is not None
            answer = await renewer.renew_owner("heir", adopted, [0] * count, None, LEASE_MS)
            assert answer == OwnerRenewal(None, tuple(range(count)), ())

    # -- optional capability: create_claimed_stamped ---------------------------------------------

    async def test_create_claimed_stamped_takes_created_at_from_the_store_clock(self) -> None:
        async with self.store(max_tasks=2) as store:
            stamping = store if stamps_creation(store) else None
            if stamping is None:
                pytest.skip("the store does not offer create_claimed_stamped")
            await self.advance(5)
            now = await store.now()
            access = await store.authorize(A, Action.CREATE, "task-1")
            placeholder = new_task("task-1", 0, 60_000, 5)
            work = Work(idempotency_key="task-1", type="contract", input={"taskId": "task-1"})
            claimed = await stamping.create_claimed_stamped(
                placeholder, work, access, "creator", LEASE_MS
            )
            task = claimed.snapshot.task
            assert (task.created_at, task.last_updated_at) == (now, now)
            assert task.expires_at == now + 60_000_000
            assert claimed.snapshot.revision == 0
            assert claimed.lease.owner_id == "creator"
            assert claimed.lease.generation == 1
            assert claimed.lease.expires_at == now + LEASE_MS * 1000
            assert await store.claim("task-1", "recoverer", LEASE_MS) is UNAVAILABLE
            get = await store.authorize(A, Action.GET, "task-1")
            assert await store.get("task-1", get) == claimed.snapshot
            done = await self.applied(
                store, "task-1", 0, Event.completed({"ok": True}), WorkerAuthority(claimed.lease)
            )
            # One commit step after the stamp, not the placeholder (the step is the store's:
            # 1 ms in the memory and SQLite stores, 1 µs in PostgreSQL's).
            assert now < done.committed_at <= now + 1000
            again = await store.authorize(A, Action.CREATE, "task-1")
            with pytest.raises(AlreadyExists):
                await stamping.create_claimed_stamped(placeholder, work, again, "creator", LEASE_MS)
            # Still only a new task is accepted (the instants must be equal).
            second = await store.authorize(A, Action.CREATE, "task-2")
            updated = attrs.evolve(new_task("task-2", START, None, None), last_updated_at=START + 1)
            with pytest.raises(InvalidTask):
                await stamping.create_claimed_stamped(
                    updated,
                    Work(idempotency_key="task-2", type="contract", input={}),
                    second,
                    "creator",
                    LEASE_MS,
                )
            # The TTL counts from the stamp.
            await self.advance(59_999)
            assert await store.get("task-1", get) == done.snapshot
            await self.advance(1)
            assert await store.get("task-1", get) is NOT_FOUND

    # -- optional capability: operators (list_tasks, inspect_task, operator_access) -----------

    @staticmethod
    async def tool_task(
        store: Store,
        task_id: str,
        ctx: object,
        tool: str,
        *,
        policy: RetryPolicy | None = None,
    ) -> Snapshot:
        access = await store.authorize(ctx, Action.CREATE, task_id)
        task = new_task(task_id, await store.now(), 60_000, 5)
        return await store.create(task, Work.tool_call(task_id, tool, {"n": 1}, policy), access)

    async def test_list_tasks_finds_a_work_builders_work_by_its_persisted_tool(self) -> None:
        """Work a ``work_builder`` shaped names its creating tool in ``tool`` (Work v4): the
        store keeps it exactly, and listing by tool finds it by that name, which wins over a
        ``tools/call`` input's ``name``; other work is found as before."""
        async with self.store() as store:
            ops = store if lists_tasks(store) else None
            if ops is None:
                pytest.skip("the store does not offer list_tasks")
            access = await store.authorize(A, Action.CREATE, "built-1")
            built = Work(idempotency_key="built-1", type="export-job", input={}, tool="echo")
            await store.create(new_task("built-1", await store.now(), 60_000, 5), built, access)
            access = await store.authorize(A, Action.CREATE, "built-2")
            renamed = Work(
                idempotency_key="built-2",
                type="tools/call",
                input={"name": "slow", "arguments": {}},
                trace_context=TraceContext(f"00-{'a' * 32}-{'b' * 16}-01"),
                tool="echo",
            )
            await store.create(new_task("built-2", await store.now(), 60_000, 5), renamed, access)
            await self.tool_task(store, "plain-1", A, "slow")
            await self.create(store, "other-1", A)
            for task_id, work in (("built-1", built), ("built-2", renamed)):
                got = await store.get(task_id, await store.authorize(A, Action.GET, task_id))
                assert isinstance(got, Snapshot) and got.work == work

            async def ids(tool: str) -> list[str]:
                listing = await ops.list_tasks(TaskQuery(tool=tool))
                return sorted(task.task_id for task in listing.tasks)

            assert await ids("echo") == ["built-1", "built-2"]
            assert await ids("slow") == ["plain-1"]
            assert await ids("export-job") == []
            everything = await ops.list_tasks(TaskQuery())
            assert {task.task_id: task.tool for task in everything.tasks} == {
                "built-1": "echo",
                "built-2": "echo",
                "plain-1": "slow",
                "other-1": None,
            }

    async def test_list_tasks_filters_pages_and_shows_claims(self) -> None:
        """``list_tasks`` sees every scope, in ``(created_at, task_id)`` order, with exact
        filters, cursors that resume exactly, and the store's verdict on claims and expiry."""
        async with self.store() as store:
            ops = store if lists_tasks(store) else None
            if ops is None:
                pytest.skip("the store does not offer list_tasks")
            await self.tool_task(store, "task-2", A, "echo")
            await self.tool_task(store, "task-1", B, "slow")
            await self.advance(1000)
            await self.tool_task(store, "task-3", A, "echo")
            await self.advance(1000)
            await self.create(store, "task-4", C)  # not tools/call work: no tool
            claimed = await self.claimed(store, "task-2", "owner-1")
            done = WorkerAuthority(await self.claimed(store, "task-3", "owner-2"))
            await self.applied(store, "task-3", 0, Event.completed({"ok": True}), done)
            await store.release(done.lease)
            cancel = await self.request(store, B, Action.CANCEL, "task-1")
            await self.applied(store, "task-1", 0, Event.cancelled(), cancel)

            async def ids(**query: Any) -> list[str]:
                listing = await ops.list_tasks(TaskQuery(**query))
                return [task.task_id for task in listing.tasks]

            everything = await ops.list_tasks(TaskQuery())
            assert isinstance(everything, TaskListing)
            assert everything.now == START + 2_000_000
            assert everything.next_after is None
            assert [t.task_id for t in everything.tasks] == ["task-1", "task-2", "task-3", "task-4"]
            by_id = {task.task_id: task for task in everything.tasks}
            get = await store.authorize(A, Action.GET, "task-2")
            assert by_id["task-2"] == StoredTask(
                snapshot=await store.get("task-2", get),  # type: ignore[arg-type]
                scope=canonical_json("tenant-a"),
                generation=1,
                claim=ClaimInfo(
                    owner_id="owner-1",
                    generation=1,
                    expires_at=claimed.expires_at,
                    live=True,
                ),
                expired=False,
            )
            assert by_id["task-2"].tool == "echo"
            assert (by_id["task-1"].generation, by_id["task-1"].claim) == (0, None)
            assert by_id["task-1"].snapshot.task.status is TaskStatus.CANCELLED
            assert (by_id["task-3"].generation, by_id["task-3"].claim) == (1, None)
            assert by_id["task-3"].snapshot.task.status is TaskStatus.COMPLETED
            assert (by_id["task-4"].tool, by_id["task-4"].scope) == (
                None,
                canonical_json("tenant-c"),
            )

            assert await ids(statuses={TaskStatus.WORKING}) == ["task-2", "task-4"]
            assert await ids(statuses={"completed", "cancelled"}) == ["task-1", "task-3"]
            assert await ids(statuses={TaskStatus.INPUT_REQUIRED}) == []
            assert await ids(tool="echo") == ["task-2", "task-3"]
            assert await ids(tool="slow") == ["task-1"]
            assert await ids(tool="contract") == []
            assert await ids(scope=canonical_json("tenant-a")) == ["task-2", "task-3"]
            assert await ids(scope=canonical_json("tenant-z")) == []
            assert await ids(created_before=START + 1) == ["task-1", "task-2"]
            assert await ids(created_before=START) == []
            assert await ids(tool="echo", statuses={"working"}) == ["task-2"]

            first = await ops.list_tasks(TaskQuery(limit=3))
            assert [t.task_id for t in first.tasks] == ["task-1", "task-2", "task-3"]
            assert first.next_after == TaskCursor(START + 1_000_000, "task-3")
            rest = await ops.list_tasks(TaskQuery(limit=3, after=first.next_after))
            assert ([t.task_id for t in rest.tasks], rest.next_after) == (["task-4"], None)
            pair = await ops.list_tasks(TaskQuery(limit=2))
            assert pair.next_after == TaskCursor(START, "task-2")
            second = await ops.list_tasks(TaskQuery(limit=2, after=pair.next_after))
            assert ([t.task_id for t in second.tasks], second.next_after) == (
                ["task-3", "task-4"],
                None,
            )
            assert await ids(limit=1, after=TaskCursor(START, "task-1"), tool="echo") == ["task-2"]

            # The claim lapses on the store's clock; expired tasks are listed until reaped.
            await self.advance(LEASE_MS)
            lapsed = await ops.list_tasks(TaskQuery(tool="echo", statuses={"working"}))
            (task,) = lapsed.tasks
            assert task.claim == ClaimInfo(
                owner_id="owner-1", generation=1, expires_at=claimed.expires_at, live=False
            )
            await self.advance(28_000)
            aged = await ops.list_tasks(TaskQuery())
            assert [(t.task_id, t.expired) for t in aged.tasks] == [
                ("task-1", True),
                ("task-2", True),
                ("task-3", False),
                ("task-4", False),
            ]
            assert await store.reap() == ["task-1", "task-2"]
            assert await ids() == ["task-3", "task-4"]

    async def test_inspect_task_reads_the_record_the_claim_and_the_ledger(self) -> None:
        async with self.store() as store:
            ops = store if lists_tasks(store) else None
            if ops is None:
                pytest.skip("the store does not offer inspect_task")
            assert await ops.inspect_task("task-1") is NOT_FOUND
            await self.tool_task(store, "task-1", A, "echo", policy=RetryPolicy([5000]))
            lease = await self.claimed(store, "task-1", "owner-1")
            worker = WorkerAuthority(lease)
            update = await self.request(store, A, Action.UPDATE, "task-1")
            asked = Event.input_requested("a", ASK)
            answered = Event.input_responses_accepted({"a": {"action": "accept"}})
            retry = Event.retry_requested(ERROR, "again")
            commits = [
                await self.applied(store, "task-1", 0, asked, worker),
                await self.applied(store, "task-1", 1, answered, update),
                await self.applied(store, "task-1", 2, retry, worker),
            ]
            inspection = await ops.inspect_task("task-1")
            assert isinstance(inspection, TaskInspection)
            assert inspection.now == await store.now()
            stored = inspection.task
            assert stored.snapshot == commits[-1].snapshot
            assert stored.snapshot.retry_count == 1
            assert stored.snapshot.retry_at == commits[-1].committed_at + 5_000_000
            assert stored.claim == ClaimInfo(
                owner_id="owner-1", generation=1, expires_at=lease.expires_at, live=True
            )
            assert [
                (e.revision, e.event, e.committed_at, e.effects) for e in inspection.ledger
            ] == [
                (c.event_revision, event, c.committed_at, c.effects)
                for c, event in zip(commits, (asked, answered, retry), strict=True)
            ]
            # Expiry hides the task from requests, not from its operator.
            await self.advance(60_000)
            get = await store.authorize(A, Action.GET, "task-1")
            assert await store.get("task-1", get) is NOT_FOUND
            expired = await ops.inspect_task("task-1")
            assert isinstance(expired, TaskInspection)
            assert expired.task.expired
            assert expired.ledger == inspection.ledger

    async def test_operator_access_is_an_access_in_the_tasks_own_scope(self) -> None:
        """An operator's cancellation is an ordinary request transition: same access, same
        compare-and-set, same ledger entry, seen by the running attempt through its lease."""
        async with self.store() as store:
            ops = store if lists_tasks(store) else None
            if ops is None:
                pytest.skip("the store does not offer operator_access")
            await self.tool_task(store, "task-1", B, "slow")
            lease = await self.claimed(store, "task-1")
            assert await ops.operator_access("unknown", Action.CANCEL) is NOT_FOUND
            with pytest.raises(UnauthorizedAction):
                await ops.operator_access("task-1", Action.CREATE)
            access = await ops.operator_access("task-1", Action.CANCEL)
            assert access == await store.authorize(B, Action.CANCEL, "task-1")
            cancel = Event.cancelled(id="operator-cancel")
            result = await self.applied(store, "task-1", 0, cancel, RequestAuthority(access))
            assert result.snapshot.task.status is TaskStatus.CANCELLED
            assert await store.worker_snapshot("task-1", lease) == result.snapshot
            inspection = await ops.inspect_task("task-1")
            assert isinstance(inspection, TaskInspection)
            assert [(e.revision, e.event) for e in inspection.ledger] == [(1, cancel)]
            read = await ops.operator_access("task-1", Action.GET)
            assert await store.get("task-1", read) == result.snapshot  # type: ignore[arg-type]
        async with self.store(scope="shared") as shared:
            shared_ops = shared if lists_tasks(shared) else None
            assert shared_ops is not None
            await self.create(shared, "task-1", None)
            access = await shared_ops.operator_access("task-1", Action.UPDATE)
            assert access == await shared.authorize(None, Action.UPDATE, "task-1")

    # -- the queue and concurrency keys (Queues) ----------------------------------------------

    @staticmethod
    async def submit(
        store: Store,
        task_id: str,
        ctx: object = A,
        *,
        owner: str | None = None,
        concurrency: Concurrency | None = None,
        message: str | None = "Task accepted",
        ttl_ms: int | None = 60_000,
    ) -> Claimed | Snapshot:
        """``Queues.submit`` of a contract task (the test is skipped without the capability)."""
        access = await store.authorize(ctx, Action.CREATE, task_id)
        if not queues(store):
            pytest.skip("the store does not offer Queues")
        task = new_task(task_id, 0, ttl_ms, 5, message)  # createdAt is a placeholder
        work = Work(idempotency_key=task_id, type="contract", input={"taskId": task_id})
        return await store.submit(
            task, work, access, owner_id=owner, lease_ms=LEASE_MS, concurrency=concurrency
        )

    async def queued(self, store: Store, task_id: str, **options: Any) -> Snapshot:
        result = await self.submit(store, task_id, **options)
        assert isinstance(result, Snapshot), result
        return result

    @staticmethod
    async def claim_all(store: Store, owner: str = "owner-1") -> list[Claimed]:
        """``claim_next`` until it finds nothing."""
        claims: list[Claimed] = []
        while (claimed := await store.claim_next(owner, LEASE_MS)) is not None:
            claims.append(claimed)
        return claims

    async def test_submit_queues_and_the_first_claim_gives_the_message_back(self) -> None:
        async with self.store() as store:
            queued = await self.queued(store, "task-1")
            assert queued.revision == 0
            assert queued.task.status is TaskStatus.WORKING
            assert queued.task.status_message == QUEUED_MESSAGE
            assert (queued.task.created_at, queued.task.last_updated_at) == (START, START)
            assert queued.task.expires_at == START + 60_000_000
            get = await store.authorize(A, Action.GET, "task-1")
            assert await store.get("task-1", get) == queued
            claimed = await self.submit(store, "task-2", owner="owner-1")
            assert isinstance(claimed, Claimed)
            assert (claimed.lease.generation, claimed.lease.owner_id) == (1, "owner-1")
            assert claimed.snapshot.task.status_message == "Task accepted"
            await self.advance(1)
            first = await store.claim_next("owner-2", LEASE_MS)
            assert isinstance(first, Claimed)
            assert (first.lease.task_id, first.lease.generation) == ("task-1", 1)
            started = first.snapshot
            assert started.task.status_message == "Task accepted"
            assert started.revision == 0
            assert started.task.last_updated_at == START  # nothing happened: it started
            assert started == attrs.evolve(
                queued, task=attrs.evolve(queued.task, status_message="Task accepted")
            )
            assert await store.get("task-1", get) == started
            assert await store.worker_snapshot("task-1", first.lease) == started
            assert await store.claim_next("owner-2", LEASE_MS) is None
            # A task created without a message gets none back; a targeted claim starts it too.
            await self.queued(store, "task-3", message=None)
            third = await store.claim("task-3", "owner-3", LEASE_MS)
            assert isinstance(third, Claimed)
            assert third.snapshot.task.status_message is None
            # Its work and completion are an ordinary task's.
            worker = WorkerAuthority(first.lease)
            done = await self.applied(store, "task-1", 0, Event.completed({"v": 1}), worker)
            assert done.snapshot.task.status is TaskStatus.COMPLETED

    async def test_queue_order_is_first_in_first_out(self) -> None:
        async with self.store() as store:
            names = [f"task-{(n * 7) % 30:02d}" for n in range(30)]  # not in id order
            for name in names:
                await self.queued(store, name)
                await self.advance(1)
            for name in ("tie-b", "tie-a", "tie-c"):  # one instant: ties go by task id
                await self.queued(store, name)
            claims = await self.claim_all(store)
            assert [c.lease.task_id for c in claims] == [*names, "tie-a", "tie-b", "tie-c"]
            assert {c.lease.generation for c in claims} == {1}
            assert {c.snapshot.task.status_message for c in claims} == {"Task accepted"}

    async def test_queued_tasks_cancel_expire_and_reap(self) -> None:
        async with self.store() as store:
            await self.queued(store, "short", ttl_ms=1_000)
            await self.queued(store, "cancelled")
            cancel = await self.request(store, A, Action.CANCEL, "cancelled")
            result = await self.applied(store, "cancelled", 0, Event.cancelled(), cancel)
            assert result.snapshot.task.status is TaskStatus.CANCELLED
            assert result.snapshot.task.status_message == CANCELLED_MESSAGE
            update = await self.request(store, A, Action.UPDATE, "short")
            answer = Event.input_responses_accepted({"a": {"ok": True}})
            unchanged = await store.transition("short", 0, answer, update)
            assert isinstance(unchanged, Transition) and unchanged.outcome == "unchanged"
            await self.advance(1_000)
            get = await store.authorize(A, Action.GET, "short")
            assert await store.get("short", get) is NOT_FOUND
            assert await store.reap() == ["short"]
            assert await store.claim_next("owner-1", LEASE_MS) is None

    async def test_a_concurrency_key_limits_live_claims(self) -> None:
        key = Concurrency(canonical_json(["export", "tenant-a"]), 2)
        async with self.store() as store:
            for name in ("k1", "k2", "k3"):
                await self.queued(store, name, concurrency=key)
                await self.advance(1)
            await self.queued(store, "free")
            claims = await self.claim_all(store)
            assert [c.lease.task_id for c in claims] == ["k1", "free", "k2"]  # fewest first
            assert await store.claim("k3", "owner-1", LEASE_MS) is UNAVAILABLE
            await self.finish(store, claims[1].lease)  # "free" is done (frees no key slot)
            assert await store.claim_next("owner-1", LEASE_MS) is None
            # A submission with an owner queues too while the key is full.
            k4 = await self.submit(store, "k4", owner="owner-1", concurrency=key)
            assert isinstance(k4, Snapshot) and k4.task.status_message == QUEUED_MESSAGE
            await self.finish(store, claims[0].lease)  # k1 settles: a slot of the key frees
            k3 = await store.claim_next("owner-1", LEASE_MS)
            assert isinstance(k3, Claimed) and k3.lease.task_id == "k3"
            assert k3.snapshot.task.status_message == "Task accepted"
            assert await store.claim_next("owner-1", LEASE_MS) is None
            # Lapsed claims free their slots: k2 and k3 expire and are claimed again first.
            await self.advance(LEASE_MS)
            again = await self.claim_all(store, "owner-2")
            assert [(c.lease.task_id, c.lease.generation) for c in again] == [
                ("k2", 2),
                ("k3", 2),
            ]
            # A released claim frees its slot too (and its task is claimable again).
            await store.release(again[0].lease)
            last = await self.claim_all(store, "owner-2")
            assert [(c.lease.task_id, c.lease.generation) for c in last] == [("k2", 3)]
            await self.finish(store, last[0].lease)
            assert [c.lease.task_id for c in await self.claim_all(store, "owner-2")] == ["k4"]

    async def test_a_new_task_of_a_key_queues_behind_its_waiting_ones(self) -> None:
        key = Concurrency(canonical_json(["report", None]), 1)
        async with self.store() as store:
            await self.queued(store, "older", concurrency=key)
            await self.advance(1)
            newer = await self.submit(store, "newer", owner="owner-1", concurrency=key)
            assert isinstance(newer, Snapshot)  # the key has room, but "older" waits
            claims = await self.claim_all(store)
            assert [c.lease.task_id for c in claims] == ["older"]
            await self.finish(store, claims[0].lease)
            assert [c.lease.task_id for c in await self.claim_all(store)] == ["newer"]
            other = Concurrency(canonical_json(["report", "other"]), 1)
            first = await self.submit(store, "first-of-other", owner="owner-1", concurrency=other)
            assert isinstance(first, Claimed) and first.lease.generation == 1

    async def test_claims_are_fair_across_keys(self) -> None:
        a = Concurrency(canonical_json(["export", "a"]), 5)
        b = Concurrency(canonical_json(["export", "b"]), 5)
        async with self.store() as store:
            for name, key in (
                ("a1", a),
                ("a2", a),
                ("a3", a),
                ("a4", a),
                ("b1", b),
                ("b2", b),
                ("u1", None),
            ):
                await self.queued(store, name, concurrency=key)
                await self.advance(1)
            claims = await self.claim_all(store)
            # The fewest live claims of its key first (no key: none), then the oldest.
            assert [c.lease.task_id for c in claims] == ["a1", "b1", "u1", "a2", "b2", "a3", "a4"]

    async def test_a_runner_dies_with_hundreds_of_queued_and_running_tasks(self) -> None:
        key = Concurrency(canonical_json(["export", "tenant-a"]), 3)
        async with self.store() as store:
            names = [f"task-{n:03d}" for n in range(300)]
            keyed = {name for n, name in enumerate(names) if n % 3 == 0}
            for name in names:
                await self.queued(store, name, concurrency=key if name in keyed else None)
                await self.advance(1)
            dead = [await store.claim_next("dead", LEASE_MS) for _ in range(20)]
            assert all(isinstance(c, Claimed) for c in dead)
            held = [c.lease.task_id for c in dead if isinstance(c, Claimed)]
            # Fair across keys: once the key has a live claim, tasks without a key go first.
            assert [name for name in held if name in keyed] == ["task-000"]
            # The dead runner never settles: its claims lapse.
            await self.advance(LEASE_MS)
            seen: list[tuple[str, int]] = []
            live: list[Lease] = []  # the survivor holds keyed claims until it must release
            done = 0
            while done < len(names):
                claimed = await store.claim_next("survivor", LEASE_MS)
                if claimed is None:
                    assert live, "claimable work vanished"
                    for lease in live:
                        await self.finish(store, lease)
                        done += 1
                    live.clear()
                    continue
                lease = claimed.lease
                seen.append((lease.task_id, lease.generation))
                if lease.task_id in keyed:
                    live.append(lease)
                    assert len(live) <= 3
                else:
                    await self.finish(store, lease)
                    done += 1
            assert sorted(name for name, _ in seen) == names  # each claimed exactly once
            assert {name for name, generation in seen if generation == 2} == set(held)
            unkeyed = [name for name, _ in seen if name not in keyed]
            assert unkeyed == sorted(unkeyed)  # first in first out
            for name in names:
                get = await store.authorize(A, Action.GET, name)
                snapshot = await store.get(name, get)
                assert isinstance(snapshot, Snapshot)
                assert snapshot.task.status is TaskStatus.COMPLETED

    @staticmethod
    async def finish(store: Store, lease: Lease) -> None:
        worker = WorkerAuthority(lease)
        result = await store.transition(lease.task_id, 0, Event.completed({"v": 1}), worker)
        assert isinstance(result, Transition) and result.outcome == "applied", result
        await store.release(lease)
