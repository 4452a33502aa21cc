"""PostgreSQL group commit: the ``Batcher``'s rules, then the store's batches on a real server.

The batcher's rules are tested with a ``run_batch`` the test controls (an event it waits on),
so what happens while a batch runs is observed, not timed. The store tests run concurrent
creations and settles against PostgreSQL with one operation in the batch that must fail.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import attrs
import outcome
import pytest
import trio
import trio.testing
from postgres_support import SchemaFactory, pg_schemas, postgres_dsn  # noqa: F401
from test_postgres import row_locked
from tritask_postgres import PostgresStore
from tritask_postgres._batch import Batcher, Item

from tritask.tasks.events import Event
from tritask.tasks.model import new_task
from tritask.tasks.store import (
    Action,
    AlreadyExists,
    CapacityExceeded,
    Claimed,
    DatabaseBusy,
    StaleLease,
    TaskQuery,
    Transition,
)
from tritask.tasks.work import Work
from tritask.testing.store_contract import by_tenant, tenant

GUARD = 30
A, B, C = tenant("tenant-a"), tenant("tenant-b"), tenant("tenant-c")


class Controlled:
    """A ``run_batch`` that records each batch and waits for the test to release it."""

    def __init__(self) -> None:
        self.batches: list[list[Any]] = []
        self.release = trio.Event()
        self.entered = trio.Event()
        self.fail_alone: set[Any] = set()

    async def __call__(self, items: Sequence[Item]) -> None:
        self.batches.append([item.payload for item in items])
        self.entered.set()
        await self.release.wait()
        for item in items:
            if item.payload not in self.fail_alone:
                item.decide(outcome.Value(f"batched {item.payload}"))


def item(payload: Any) -> Item:
    async def alone() -> str:
        await trio.lowlevel.checkpoint()
        return f"alone {payload}"

    return Item(payload, alone)


async def test_submissions_behind_a_running_batch_form_the_next_one_and_wait_for_it() -> None:
    run = Controlled()
    batcher = Batcher(run, max_inflight=1)
    heard: dict[int, str] = {}

    async def submit(n: int) -> None:
        heard[n] = await batcher.submit(item(n))

    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(submit, 0)
            await run.entered.wait()
            for n in (1, 2, 3):  # in this order (trio runs new tasks in any order)
                nursery.start_soon(submit, n)
                await trio.testing.wait_all_tasks_blocked()
            assert run.batches == [[0]]
            assert heard == {}  # nobody hears anything before its batch is done
            run.release.set()
    assert run.batches == [[0], [1, 2, 3]]
    assert heard == {n: f"batched {n}" for n in range(4)}
    assert (batcher.batches, batcher.items, batcher.alone) == (2, 4, 0)


async def test_an_item_the_batch_could_not_decide_runs_alone() -> None:
    run = Controlled()
    run.fail_alone = {2}
    run.release.set()
    batcher = Batcher(run, max_inflight=1)
    heard: dict[int, str] = {}

    async def submit(n: int) -> None:
        heard[n] = await batcher.submit(item(n))

    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            for n in range(4):
                nursery.start_soon(submit, n)
                await trio.testing.wait_all_tasks_blocked()
    assert heard == {0: "batched 0", 1: "batched 1", 2: "alone 2", 3: "batched 3"}
    assert batcher.alone == 1


async def test_a_failing_batch_makes_every_item_run_alone() -> None:
    async def broken(items: Sequence[Item]) -> None:
        await trio.lowlevel.checkpoint()
        raise RuntimeError("the batch's transaction failed")

    batcher = Batcher(broken)
    assert await batcher.submit(item(7)) == "alone 7"


async def test_a_cancelled_queued_caller_is_withdrawn_and_the_queue_goes_on() -> None:
    run = Controlled()
    batcher = Batcher(run, max_inflight=1)
    heard: dict[int, str] = {}
    scope = trio.CancelScope()

    async def submit(n: int) -> None:
        heard[n] = await batcher.submit(item(n))

    async def cancellable() -> None:
        with scope:
            await batcher.submit(item(1))
        heard[1] = "cancelled" if scope.cancelled_caught else "not cancelled"

    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(submit, 0)
            await run.entered.wait()
            nursery.start_soon(cancellable)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(submit, 2)
            await trio.testing.wait_all_tasks_blocked()
            scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            assert heard == {1: "cancelled"}
            run.release.set()
    assert run.batches == [[0], [2]]
    assert heard == {0: "batched 0", 1: "cancelled", 2: "batched 2"}


async def test_a_cancelled_caller_in_a_running_batch_gets_its_outcome() -> None:
    run = Controlled()
    batcher = Batcher(run, max_inflight=1)
    heard: list[str] = []
    scope = trio.CancelScope()

    async def cancellable() -> None:
        with scope:
            heard.append(await batcher.submit(item(5)))  # the leader of its batch
            await trio.lowlevel.checkpoint()
        heard.append("cancelled" if scope.cancelled_caught else "not cancelled")

    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancellable)
            await run.entered.wait()
            scope.cancel()  # the batch is shielded: it belongs to everyone in it
            await trio.testing.wait_all_tasks_blocked()
            assert heard == []
            run.release.set()
    assert heard == ["batched 5", "cancelled"]


async def test_batches_run_side_by_side_up_to_max_inflight() -> None:
    run = Controlled()
    batcher = Batcher(run, max_inflight=2)
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(batcher.submit, item(0))
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(batcher.submit, item(1))
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(batcher.submit, item(2))
            await trio.testing.wait_all_tasks_blocked()
            assert run.batches == [[0], [1]]  # the third waits for one of the two
            run.release.set()
    assert run.batches == [[0], [1], [2]]


# -- on PostgreSQL ------------------------------------------------------------------------------

RESULT = {"content": [], "isError": False}


def unlimited(schemas: SchemaFactory, schema: str, **options: Any) -> PostgresStore:
    """Without limits, so that creations are batched too."""
    return PostgresStore(
        schemas.dsn,
        schema=schema,
        scope="shared",
        max_tasks=None,
        max_active_tasks_per_scope=None,
        **options,
    )


async def create_claimed(store: PostgresStore, task_id: str) -> Claimed:
    access = await store.authorize(None, Action.CREATE, task_id)
    work = Work(idempotency_key=task_id, type="batch", input={})
    return await store.create_claimed_stamped(
        new_task(task_id, 0, None, None), work, access, "owner", 60_000
    )


async def gather(calls: dict[str, Any]) -> dict[str, Any]:
    """Run the calls concurrently; each one's result or exception by name."""
    found: dict[str, Any] = {}

    async def one(name: str) -> None:
        try:
            found[name] = await calls[name]()
        except Exception as exc:
            found[name] = exc

    async with trio.open_nursery() as nursery:
        for name in calls:
            nursery.start_soon(one, name)
    return found


async def test_concurrent_creations_and_settles_share_batches_and_fail_alone(
    pg_schemas: SchemaFactory,  # noqa: F811
) -> None:
    schema = await pg_schemas.migrated()
    async with unlimited(pg_schemas, schema) as store:
        claimed = {f"t{n}": await create_claimed(store, f"t{n}") for n in range(12)}
        assert store._batcher is not None
        before = (store._batcher.batches, store._batcher.items)
        wrong = attrs.evolve(claimed["t3"].lease, token="00000000-0000-4000-8000-000000000000")
        calls: dict[str, Any] = {
            name: functools.partial(
                store.settle,
                name,
                0,
                Event.completed(RESULT),
                wrong if name == "t3" else claim.lease,
            )
            for name, claim in claimed.items()
        }
        calls["again-t5"] = functools.partial(create_claimed, store, "t5")
        for n in range(12, 20):
            calls[f"t{n}"] = functools.partial(create_claimed, store, f"t{n}")
        with trio.fail_after(GUARD):
            found = await gather(calls)
        batches = store._batcher.batches - before[0]
        items = store._batcher.items - before[1]
        assert isinstance(found["t3"], StaleLease)
        assert isinstance(found["again-t5"], AlreadyExists)
        for n in (*range(3), *range(4, 12)):
            assert isinstance(found[f"t{n}"], Transition), found[f"t{n}"]
            assert found[f"t{n}"].outcome == "applied"
        for n in range(12, 20):
            assert isinstance(found[f"t{n}"], Claimed), found[f"t{n}"]
        assert items == len(calls)
        assert batches < items  # they did share batches
        for n in (*range(3), *range(4, 12)):
            inspection = await store.inspect_task(f"t{n}")
            assert inspection.task.snapshot.task.status.value == "completed"  # type: ignore[union-attr]
        untouched = await store.inspect_task("t3")
        assert untouched.task.snapshot.task.status.value == "working"  # type: ignore[union-attr]
        assert untouched.task.claim is not None  # type: ignore[union-attr]


async def test_a_lock_timeout_in_a_batch_reaches_only_its_own_caller(
    pg_schemas: SchemaFactory,  # noqa: F811
) -> None:
    schema = await pg_schemas.migrated()
    async with unlimited(pg_schemas, schema, lock_timeout_ms=200) as store:
        claimed = {f"t{n}": await create_claimed(store, f"t{n}") for n in range(6)}
        assert store._batcher is not None
        calls = {
            name: functools.partial(store.settle, name, 0, Event.completed(RESULT), claim.lease)
            for name, claim in claimed.items()
        }
        with row_locked(pg_schemas.dsn, schema, "t2"), trio.fail_after(GUARD):
            found = await gather(calls)
        assert isinstance(found["t2"], DatabaseBusy)
        for name in ("t0", "t1", "t3", "t4", "t5"):
            assert isinstance(found[name], Transition) and found[name].outcome == "applied"
        assert store._batcher.alone >= 1
        settled = await store.settle("t2", 0, Event.completed(RESULT), claimed["t2"].lease)
        assert settled.outcome == "applied"  # type: ignore[union-attr]


@pytest.mark.parametrize("count", [1, 40])
async def test_settle_replays_and_the_claim_is_released_in_a_batch(
    pg_schemas: SchemaFactory,  # noqa: F811
    count: int,
) -> None:
    """A settle sent again after its batch committed replays as a duplicate."""
    schema = await pg_schemas.migrated()
    async with unlimited(pg_schemas, schema) as store:
        claimed = [await create_claimed(store, f"r{n}") for n in range(count)]
        events = [Event.completed(RESULT) for _ in claimed]
        first = await gather(
            {
                c.lease.task_id: functools.partial(store.settle, c.lease.task_id, 0, e, c.lease)
                for c, e in zip(claimed, events, strict=True)
            }
        )
        again = await gather(
            {
                c.lease.task_id: functools.partial(store.settle, c.lease.task_id, 0, e, c.lease)
                for c, e in zip(claimed, events, strict=True)
            }
        )
        for c in claimed:
            name = c.lease.task_id
            assert first[name].outcome == "applied"
            assert again[name].outcome == "duplicate"
            assert again[name].event_revision == first[name].event_revision
            assert (await store.inspect_task(name)).task.claim is None  # type: ignore[union-attr]


@pytest.mark.parametrize("ttl_ms", [None, 1, 60_000, 86_400_000])
async def test_a_created_task_is_exactly_what_the_database_stores(
    pg_schemas: SchemaFactory,  # noqa: F811
    ttl_ms: int | None,
) -> None:
    """The snapshot a creation returns (the caller's own, stamped, when the stored text is the
    one it prepared) equals the stored record decoded from the database."""
    schema = await pg_schemas.migrated()
    async with unlimited(pg_schemas, schema) as store:
        for stamped in (True, False):
            task_id = f"exact-{stamped}"
            access = await store.authorize(None, Action.CREATE, task_id)
            work = Work(idempotency_key=task_id, type="batch", input={"x": [1, "é", None]})
            task = new_task(task_id, 0 if stamped else await store.now(), ttl_ms, 250)
            if stamped:
                made = await store.create_claimed_stamped(task, work, access, "owner", 60_000)
            else:
                made = await store.create_claimed(task, work, access, "owner", 60_000)
            inspection = await store.inspect_task(task_id)
            assert inspection.task.snapshot == made.snapshot  # type: ignore[union-attr]
            if stamped:
                assert made.snapshot.task.created_at > 0
            settled = await store.settle(task_id, 0, Event.completed(RESULT), made.lease)
            assert settled.outcome == "applied"  # type: ignore[union-attr]


async def submit_as(store: PostgresStore, ctx: object, task_id: str) -> Claimed:
    access = await store.authorize(ctx, Action.CREATE, task_id)
    work = Work(idempotency_key=task_id, type="batch", input={})
    made = await store.submit(
        new_task(task_id, 0, None, None), work, access, owner_id="owner", lease_ms=60_000
    )
    assert isinstance(made, Claimed)
    return made


@pytest.mark.parametrize(
    ("max_tasks", "max_active"), [(None, 3), (4, None), (8, 3)], ids=["active", "total", "both"]
)
async def test_creations_under_limits_are_admitted_by_their_batch_as_one_at_a_time(
    pg_schemas: SchemaFactory,  # noqa: F811
    max_tasks: int | None,
    max_active: int | None,
) -> None:
    """Creations under limits share a batch (one capacity lock and one count for all) and are
    admitted in turn, each counting against the next: an existing id is refused as such even
    when the store is full, an id twice in the batch is created once, and no limit is
    passed."""
    schema = await pg_schemas.migrated()
    store = PostgresStore(
        pg_schemas.dsn,
        schema=schema,
        scope=by_tenant,
        max_tasks=max_tasks,
        max_active_tasks_per_scope=max_active,
    )
    async with store:
        await submit_as(store, A, "existing")
        assert store._batcher is not None
        before = (store._batcher.batches, store._batcher.items)
        calls: dict[str, Any] = {
            "existing": functools.partial(submit_as, store, A, "existing"),
            "twice-1": functools.partial(submit_as, store, C, "twice"),
            "twice-2": functools.partial(submit_as, store, C, "twice"),
        }
        for n in range(6):
            calls[f"a{n}"] = functools.partial(submit_as, store, A, f"a{n}")
            calls[f"b{n}"] = functools.partial(submit_as, store, B, f"b{n}")
        with trio.fail_after(GUARD):
            found = await gather(calls)
        assert store._batcher.batches - before[0] < store._batcher.items - before[1] == len(calls)
        assert store._batcher.alone == 0  # every one was decided by its batch
        assert isinstance(found["existing"], AlreadyExists)
        twice = [found["twice-1"], found["twice-2"]]
        if max_tasks is None or max_tasks > 7:  # room for all that max_active admits
            assert sorted(type(o).__name__ for o in twice) == ["AlreadyExists", "Claimed"]
        else:  # the first of the two may find the store full; never both created
            assert sum(isinstance(o, Claimed) for o in twice) <= 1
        made = {name for name, o in found.items() if isinstance(o, Claimed)}
        refused = [o for o in found.values() if isinstance(o, CapacityExceeded)]
        for name, o in found.items():
            assert isinstance(o, Claimed | AlreadyExists | CapacityExceeded), (name, o)
        per_tenant = {p: sum(name.startswith(p) for name in made) for p in "ab"}
        if max_active is not None:  # "existing" is one of A's
            assert per_tenant == {"a": max_active - 1, "b": max_active}
        if max_tasks is not None and max_active is None:
            assert len(made) == max_tasks - 1  # "existing" is one of them
            assert {exc.limit for exc in refused} == {"max_tasks"}
        elif max_tasks is None:
            assert {exc.limit for exc in refused} == {"max_active_tasks_per_scope"}
        already = sum(isinstance(o, AlreadyExists) for o in found.values())
        assert len(made) + len(refused) + already == len(calls)
        stored = (await store.list_tasks(TaskQuery(limit=100))).tasks
        ids = {o.lease.task_id for o in found.values() if isinstance(o, Claimed)}
        assert sorted(t.snapshot.task.id for t in stored) == sorted({"existing", *ids})


async def test_one_statement_per_kind_keeps_each_outcome_its_own(
    pg_schemas: SchemaFactory,  # noqa: F811
) -> None:
    """A batch writes its creations and its applied settles with one statement each; every
    caller still gets its own outcome: a settle sent twice at once applies once (the second
    runs after the batch and replays as a duplicate), a stale revision is a conflict that
    writes nothing, an id created twice at once is created once."""
    schema = await pg_schemas.migrated()
    async with unlimited(pg_schemas, schema) as store:
        claimed = {f"s{n}": await create_claimed(store, f"s{n}") for n in range(8)}
        assert store._batcher is not None
        done = Event.completed(RESULT)
        calls: dict[str, Any] = {
            name: functools.partial(store.settle, name, 0, Event.completed(RESULT), claim.lease)
            for name, claim in claimed.items()
        }
        calls["s1"] = functools.partial(store.settle, "s1", 0, done, claimed["s1"].lease)
        calls["s1-again"] = functools.partial(store.settle, "s1", 0, done, claimed["s1"].lease)
        calls["s2"] = functools.partial(
            store.settle, "s2", 5, Event.completed(RESULT), claimed["s2"].lease
        )
        calls["twice-1"] = functools.partial(create_claimed, store, "twice")
        calls["twice-2"] = functools.partial(create_claimed, store, "twice")
        for n in range(6):
            calls[f"c{n}"] = functools.partial(create_claimed, store, f"c{n}")
        alone = store._batcher.alone
        with trio.fail_after(GUARD):
            found = await gather(calls)
        # The second settle of s1 runs alone after its batch when both are in one batch.
        assert store._batcher.alone - alone <= 1
        ones = sorted(found[name].outcome for name in ("s1", "s1-again"))
        assert ones == ["applied", "duplicate"]
        assert found["s1"].event_revision == found["s1-again"].event_revision == 1
        assert type(found["s2"]).__name__ == "Conflict"
        for name in ("s0", *(f"s{n}" for n in range(3, 8))):
            assert isinstance(found[name], Transition) and found[name].outcome == "applied"
            inspection = await store.inspect_task(name)
            assert inspection.task.snapshot.task.status.value == "completed"  # type: ignore[union-attr]
            assert inspection.task.claim is None  # type: ignore[union-attr]
            assert [entry.event.kind.value for entry in await store.history(name)] == ["completed"]
        conflicted = await store.inspect_task("s2")
        assert conflicted.task.snapshot.task.status.value == "working"  # type: ignore[union-attr]
        assert await store.history("s2") == []
        twice = sorted(type(found[name]).__name__ for name in ("twice-1", "twice-2"))
        assert twice == ["AlreadyExists", "Claimed"]
        for n in range(6):
            made = found[f"c{n}"]
            assert isinstance(made, Claimed)
            inspection = await store.inspect_task(f"c{n}")
            assert inspection.task.snapshot == made.snapshot  # type: ignore[union-attr]
            assert inspection.task.claim is not None  # type: ignore[union-attr]
