"""MemoryStore: the reusable contract suite, plus memory-specific behaviour."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from tritask.tasks._time import Clock, TrioClock, format_instant
from tritask.tasks.events import Event
from tritask.tasks.memory import MemoryStore, open_memory_store
from tritask.tasks.model import Snapshot, new_task
from tritask.tasks.store import (
    NOT_FOUND,
    Action,
    Claimed,
    Deferred,
    EventIdReused,
    LedgerEntry,
    RequestAuthority,
    Scope,
    Store,
    Transition,
    WorkerAuthority,
)
from tritask.tasks.work import RetryPolicy, Work
from tritask.testing.store_contract import START, ManualClock, StoreContract

pytestmark = pytest.mark.contract("tasks-store-hardening")


class TestMemoryStoreContract(StoreContract):
    async def make_store(
        self,
        *,
        scope: Scope,
        clock: ManualClock,
        max_tasks: int | None,
        max_active_tasks_per_scope: int | None,
    ) -> Store:
        return MemoryStore(
            scope=scope,
            clock=clock,
            max_tasks=max_tasks,
            max_active_tasks_per_scope=max_active_tasks_per_scope,
        )


async def create(
    store: MemoryStore, task_id: str, *, ttl_ms: int | None = 60_000, **kw: object
) -> Snapshot:
    access = await store.authorize(None, Action.CREATE, task_id)
    policy = kw.get("policy")
    assert policy is None or isinstance(policy, RetryPolicy)
    work = Work.tool_call(task_id, "tool", {"n": 1}, policy)
    return await store.create(new_task(task_id, await store.now(), ttl_ms, 100), work, access)


def shared(clock: Clock, **options: int | None) -> MemoryStore:
    return MemoryStore(scope="shared", clock=clock, **options)


# -- construction -------------------------------------------------------------------------------


def test_scope_is_required() -> None:
    with pytest.raises(TypeError, match="requires scope="):
        MemoryStore()
    with pytest.raises(TypeError, match="'shared' or a callable"):
        MemoryStore(scope="everyone")  # type: ignore[arg-type]


@pytest.mark.parametrize("option", ["max_tasks", "max_active_tasks_per_scope"])
@pytest.mark.parametrize(
    ("value", "error"), [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError)]
)
def test_limits_must_be_positive(option: str, value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=option):
        MemoryStore(scope="shared", **{option: value})  # type: ignore[arg-type]


def test_open_memory_store_url() -> None:
    store = open_memory_store("memory:")
    assert isinstance(store, MemoryStore)
    with pytest.raises(ValueError, match="memory:"):
        open_memory_store("memory://x")
    with pytest.raises(ValueError, match="memory:"):
        open_memory_store("sqlite:///x.db")


async def test_open_memory_store_defaults_to_shared_scope() -> None:
    store = open_memory_store("memory:", clock=ManualClock(), max_tasks=None)
    await create(store, "t")
    for ctx in ({"tenant": "a"}, None):
        assert isinstance(
            await store.get("t", await store.authorize(ctx, Action.GET, "t")), Snapshot
        )
    scoped = open_memory_store("memory:", scope=lambda ctx: ctx, clock=ManualClock())
    access = await scoped.authorize("x", Action.CREATE, "t")
    await scoped.create(new_task("t", START, None, None), Work.tool_call("t", "n", {}), access)
    assert await scoped.get("t", await scoped.authorize("y", Action.GET, "t")) is NOT_FOUND


def test_is_a_store() -> None:
    assert isinstance(MemoryStore(scope="shared"), Store)


async def test_closed_store_refuses_calls() -> None:
    async with shared(ManualClock()) as store:
        assert await store.now() == START
    with pytest.raises(trio.ClosedResourceError):
        await store.now()
    with pytest.raises(trio.ClosedResourceError):
        await store.claim_next("owner", 1000)


@pytest.mark.parametrize(("owner", "lease_ms"), [("", 1000), ("o", 0), ("o", -5), ("o", True)])
async def test_claim_arguments(owner: str, lease_ms: int) -> None:
    store = shared(ManualClock())
    await create(store, "t")
    with pytest.raises(ValueError):
        await store.claim("t", owner, lease_ms)
    with pytest.raises(ValueError):
        await store.claim_next(owner, lease_ms)


async def test_expected_revision_must_be_non_negative() -> None:
    store = shared(ManualClock())
    await create(store, "t")
    cancel = RequestAuthority(await store.authorize(None, Action.CANCEL, "t"))
    with pytest.raises(ValueError, match="expected_revision"):
        await store.transition("t", -1, Event.cancelled(), cancel)
    with pytest.raises(TypeError, match="expected_revision"):
        await store.transition("t", True, Event.cancelled(), cancel)


# -- memory-specific semantics ------------------------------------------------------------------


async def test_commit_step_is_one_millisecond() -> None:
    store = shared(ManualClock())
    await create(store, "t")
    lease = await store.claim("t", "o", 1000)
    assert isinstance(lease, Claimed)
    worker = WorkerAuthority(lease.lease)
    first = await store.transition("t", 0, Event.input_requested("a", {"method": "m"}), worker)
    second = await store.transition("t", 1, Event.input_requested("b", {"method": "m"}), worker)
    assert isinstance(first, Transition) and isinstance(second, Transition)
    assert (first.committed_at, second.committed_at) == (START + 1000, START + 2000)
    assert format_instant(second.snapshot.task.last_updated_at) == "2026-08-24T10:00:00.002Z"


async def test_reference_retry_worked_example() -> None:
    """Reference 3.6: created 10:00:00.000, delay 60 s, retry_at 10:01:00.001."""
    clock = ManualClock()
    store = shared(clock)
    await create(store, "t", policy=RetryPolicy([60_000]))
    claimed = await store.claim("t", "o", 30_000)
    assert isinstance(claimed, Claimed)
    retry = await store.transition(
        "t",
        0,
        Event.retry_requested({"code": 1, "message": "m"}, None),
        WorkerAuthority(claimed.lease),
    )
    assert isinstance(retry, Transition)
    assert retry.snapshot.retry_at is not None
    assert format_instant(retry.snapshot.retry_at) == "2026-08-24T10:01:00.001Z"
    await store.release(claimed.lease)
    assert await store.claim("t", "o", 1000) == Deferred(60_001)
    clock.advance(59_999)
    assert await store.claim("t", "o", 1000) == Deferred(2)
    clock.advance(1)
    assert await store.claim("t", "o", 1000) == Deferred(1)
    clock.advance(1)
    again = await store.claim("t", "o", 1000)
    assert isinstance(again, Claimed)
    assert again.lease.generation == 2


async def test_history_is_the_applied_ledger() -> None:
    clock = ManualClock()
    store = shared(clock)
    await create(store, "t", ttl_ms=5000)
    claimed = await store.claim("t", "o", 1000)
    assert isinstance(claimed, Claimed)
    worker = WorkerAuthority(claimed.lease)
    ask = Event.input_requested("k", {"method": "m"}, id="e1")
    answer = Event.input_responses_accepted({"k": {"ok": True}}, id="e2")
    done = Event.completed({"content": []}, id="e3")
    update = RequestAuthority(await store.authorize(None, Action.UPDATE, "t"))
    cancel = RequestAuthority(await store.authorize(None, Action.CANCEL, "t"))
    asked = await store.transition("t", 0, ask, worker)
    answered = await store.transition("t", 1, answer, update)
    await store.transition("t", 0, Event.cancelled(), cancel)  # conflict: not recorded
    completed = await store.transition("t", 2, done, worker)
    await store.transition("t", 3, Event.cancelled(), cancel)  # unchanged: not recorded
    await store.transition("t", 0, done, worker)  # duplicate: not recorded again
    assert isinstance(asked, Transition)
    assert isinstance(answered, Transition)
    assert isinstance(completed, Transition)
    assert store.history("t") == [
        LedgerEntry(event=ask, revision=1, committed_at=START + 1000, effects=asked.effects),
        LedgerEntry(event=answer, revision=2, committed_at=START + 2000, effects=answered.effects),
        LedgerEntry(event=done, revision=3, committed_at=START + 3000, effects=completed.effects),
    ]
    assert store.history("t")[1].effects.accepted_input_responses == {"k": {"ok": True}}
    clock.advance(5000)
    assert await store.reap() == ["t"]
    assert store.history("t") == []
    again = await create(store, "t")  # a reaped id starts over, with no history or seen events
    assert again.revision == 0
    assert store.history("t") == []


async def test_caller_mutation_cannot_change_stored_state() -> None:
    store = shared(ManualClock())
    await create(store, "t")
    claimed = await store.claim("t", "o", 1000)
    assert isinstance(claimed, Claimed)
    result = {"content": [{"type": "text", "text": "hi"}]}
    event = Event.completed(result, id="done")
    applied = await store.transition("t", 0, event, WorkerAuthority(claimed.lease))
    assert isinstance(applied, Transition)
    result["content"].clear()
    event.data["result"]["extra"] = 1
    assert applied.snapshot.task.result is not None
    applied.snapshot.task.result["content"].append("junk")
    stored = await store.get("t", await store.authorize(None, Action.GET, "t"))
    assert isinstance(stored, Snapshot)
    assert stored.task.result == {"content": [{"type": "text", "text": "hi"}]}
    assert store.history("t")[0].event.data == {
        "result": {"content": [{"type": "text", "text": "hi"}]}
    }
    replay = await store.transition(
        "t", 0, Event.completed(stored.task.result, id="done"), WorkerAuthority(claimed.lease)
    )
    assert isinstance(replay, Transition)
    assert replay.outcome == "duplicate"


async def test_caller_mutation_cannot_reach_shared_input_state() -> None:
    """The reducer shares unchanged JSON between revisions; what the store hands out and what
    it was given are still independent of its state."""
    store = shared(ManualClock())
    await create(store, "t")
    claimed = await store.claim("t", "o", 1000)
    assert isinstance(claimed, Claimed)
    request: dict[str, Any] = {"method": "elicitation/create", "params": {"fields": ["a"]}}
    event = Event.input_requested("k", request, id="ask")
    asked = await store.transition("t", 0, event, WorkerAuthority(claimed.lease))
    assert isinstance(asked, Transition)
    request["params"]["fields"].append("mutated")
    event.data["request"]["method"] = "mutated"
    asked.snapshot.task.input_requests["k"]["params"]["fields"].clear()
    asked.snapshot.input_history["k"]["method"] = "mutated"
    assert asked.snapshot.work is not None
    asked.snapshot.work.input["arguments"]["x"] = 1
    answered = await store.transition(
        "t",
        1,
        Event.input_responses_accepted({"k": {"action": "accept"}}),
        RequestAuthority(await store.authorize(None, Action.UPDATE, "t")),
    )
    assert isinstance(answered, Transition)
    answered.snapshot.accepted_input_responses["k"]["action"] = "mutated"
    stored = await store.get("t", await store.authorize(None, Action.GET, "t"))
    assert isinstance(stored, Snapshot)
    original = {"method": "elicitation/create", "params": {"fields": ["a"]}}
    assert stored.input_history == {"k": original}
    assert stored.accepted_input_responses == {"k": {"action": "accept"}}
    assert stored.task.status == "working"
    assert stored.work is not None and "x" not in stored.work.input["arguments"]
    assert store.history("t")[0].event.data == {"key": "k", "request": original}


async def test_event_replay_compares_exact_json() -> None:
    store = shared(ManualClock())
    await create(store, "t")
    claimed = await store.claim("t", "o", 1000)
    assert isinstance(claimed, Claimed)
    worker = WorkerAuthority(claimed.lease)
    await store.transition("t", 0, Event.completed({"v": 1}, id="same"), worker)
    for different in ({"v": 1.0}, {"v": True}):
        with pytest.raises(EventIdReused):
            await store.transition("t", 1, Event.completed(different, id="same"), worker)


async def test_clock_going_backwards_is_safe() -> None:
    now = [START]
    store = shared(lambda: now[0])
    await create(store, "t")
    first = await store.claim_next("o", 1000)
    assert first is not None
    await store.release(first.lease)
    now[0] -= 10_000_000  # a wall clock stepped back ten seconds
    second = await store.claim_next("o", 1000)
    assert second is not None
    assert second.lease.generation == 2
    assert second.lease.expires_at == START - 10_000_000 + 1_000_000


async def test_cancellation_is_honoured_before_any_change() -> None:
    store = shared(ManualClock())
    with trio.CancelScope() as scope:
        scope.cancel()
        await create(store, "t")
    assert scope.cancelled_caught
    assert await store.reap() == []
    assert await store.claim("t", "o", 1000) is NOT_FOUND


# -- trio clock ---------------------------------------------------------------------------------


async def test_trio_clock_drives_leases_and_ttl(autojump_clock: trio.testing.MockClock) -> None:
    store = shared(TrioClock(START))
    await create(store, "t", ttl_ms=10_000, policy=RetryPolicy([2000]))
    claimed = await store.claim("t", "o", 3000)
    assert isinstance(claimed, Claimed)
    await trio.sleep(2.999)
    assert isinstance(await store.worker_snapshot("t", claimed.lease), Snapshot)
    await trio.sleep(0.001)
    again = await store.claim_next("o", 3000)
    assert again is not None
    assert again.lease.generation == 2
    retry = await store.transition(
        "t",
        0,
        Event.retry_requested({"code": 1, "message": "m"}, None),
        WorkerAuthority(again.lease),
    )
    assert isinstance(retry, Transition)
    assert retry.snapshot.retry_at == START + 3_000_000 + 2_000_000
    await store.release(again.lease)
    assert await store.claim_next("o", 1000) is None
    await trio.sleep(2)
    due = await store.claim_next("o", 1000)
    assert due is not None
    await trio.sleep(5 - 0.001)
    assert await store.reap() == []
    await trio.sleep(0.001)
    assert await store.reap() == ["t"]
    assert await store.now() == START + 10_000_000


# -- scale --------------------------------------------------------------------------------------


async def test_claim_next_and_reap_scale() -> None:
    """claim_next and reap work from heaps: the order is exact and stale heap entries stay
    bounded (a structural check; speed itself is measured by the benchmarks, not here)."""
    clock = ManualClock()
    store = shared(clock, max_tasks=None, max_active_tasks_per_scope=None)
    n = 5_000
    keys = []
    for i in range(n):
        if i % 1000 == 0:
            clock.advance(1)
        task_id = f"task-{n - i:06d}"  # ids descend while creation times ascend
        created = await create(store, task_id)
        keys.append((created.task.created_at, task_id))
    claimed = []
    for _ in range(n):
        result = await store.claim_next("o", 60_000)
        assert result is not None
        claimed.append(result.snapshot.task.id)
        await store.renew(result.lease, 60_000)  # each renewal leaves a stale heap entry
    assert await store.claim_next("o", 60_000) is None
    assert claimed == [task_id for _, task_id in sorted(keys)]
    assert len(store._ready) + len(store._timed) <= 2 * n + 64
    clock.advance(60_000)
    reaped = await store.reap()
    assert reaped == sorted(task_id for _, task_id in keys)
