"""PostgreSQL group commit at its edges: one caller's refused parameter, two hosts batching the
same ids (creations or settles) in opposite orders, text that the batch's ``text[]`` arrays
must carry exactly, a connection lost or ended after the ``COMMIT``, the order of a batch's
``NOTIFY``s, and one batch of every kind of work under a limit it fills partway.

Each test forms its batches deterministically: a first batch is held (by a lock another
connection holds) while the callers of the next one queue behind it in a known order.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import psycopg
import pytest
import trio
import trio.testing
from postgres_support import SchemaFactory, connect, pg_schemas, postgres_dsn  # noqa: F401
from psycopg import sql
from test_postgres_batch import GUARD, RESULT, create_claimed, unlimited
from tritask_postgres import PostgresStore
from tritask_postgres._changes import change_payload
from tritask_postgres._native import COMMIT, Result, Session, Statement
from tritask_postgres._store import CAPACITY_LOCK_CLASS
from tritask_postgres._wakeups import WakeupKind, notify_payload

from tritask.tasks.events import Event
from tritask.tasks.model import TaskStatus, new_task
from tritask.tasks.store import (
    Action,
    CapacityExceeded,
    Claimed,
    Conflict,
    NotFound,
    RequestAuthority,
    StoredTask,
    TaskInspection,
    Transition,
    WorkerAuthority,
)
from tritask.tasks.work import Work
from tritask.testing.store_contract import by_tenant, tenant


@contextlib.contextmanager
def held(
    dsn: str, query: sql.Composed | sql.SQL, params: tuple[Any, ...] = (), *, commit: bool = True
) -> Iterator[None]:
    """Run ``query`` in a transaction on another connection, kept open until the block ends
    (then committed, or rolled back)."""
    with connect(dsn) as conn, conn.transaction():
        conn.execute(query, params)
        yield
        if not commit:
            raise psycopg.Rollback


async def submit(
    store: PostgresStore, task_id: str, owner: str = "owner", input: Any = None
) -> Claimed:
    access = await store.authorize(None, Action.CREATE, task_id)
    work = Work(idempotency_key=task_id, type="batch", input={} if input is None else input)
    made = await store.submit(
        new_task(task_id, 0, None, None), work, access, owner_id=owner, lease_ms=60_000
    )
    assert isinstance(made, Claimed)
    return made


async def stored(store: PostgresStore, task_id: str) -> StoredTask:
    inspection = await store.inspect_task(task_id)
    assert isinstance(inspection, TaskInspection), (task_id, inspection)
    return inspection.task


async def queued_behind(
    nursery: trio.Nursery, first: Any, calls: list[tuple[str, Any]], found: dict[str, Any]
) -> None:
    """Start ``first`` (it leads a batch of its own, held by the test), then each call in turn,
    so that they queue behind it in this order and form the next batch together."""

    async def one(name: str, call: Any) -> None:
        try:
            found[name] = await call()
        except Exception as exc:
            found[name] = exc

    nursery.start_soon(one, "first", first)
    await trio.testing.wait_all_tasks_blocked()
    for name, call in calls:
        nursery.start_soon(one, name, call)
        await trio.testing.wait_all_tasks_blocked()


@contextlib.asynccontextmanager
async def batched_behind(
    dsn: str,
    schema: str,
    store: PostgresStore,
    hold: str,
    lease: Any,
    calls: list[tuple[str, Any]],
    found: dict[str, Any],
) -> AsyncIterator[None]:
    """``calls`` queued, in order, behind the settle of task ``hold`` (``lease``), whose row
    another connection keeps locked until the block ends: they form the next batch together.
    The block runs while that batch waits for the row."""
    lock = sql.SQL("SELECT 1 FROM {}.tasks WHERE task_id = {} FOR UPDATE").format(
        sql.Identifier(schema), sql.Literal(hold)
    )
    first = functools.partial(store.settle, hold, 0, Event.completed(RESULT), lease)
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            with held(dsn, lock):
                await queued_behind(nursery, first, calls, found)
                yield


async def test_a_parameter_refused_before_sending_fails_only_its_own_creation(
    pg_schemas: SchemaFactory,  # noqa: F811
) -> None:
    """Under limits a batch sends its admitted creations in its second round trip. An owner id
    with a NUL is refused by the client before anything is sent (as psycopg refuses it): that
    caller gets the refusal, as it would alone, and the others in its batch are created; the
    refusal is no "outcome unknown" for the whole batch."""
    schema = await pg_schemas.migrated()
    store = PostgresStore(
        pg_schemas.dsn,
        schema=schema,
        scope="shared",
        max_tasks=1000,
        max_active_tasks_per_scope=None,
    )
    async with store:
        assert store._batcher is not None
        found: dict[str, Any] = {}
        calls = [
            (f"c{n}", functools.partial(submit, store, f"c{n}", "bad\x00owner" if n == 2 else "o"))
            for n in range(5)
        ]
        lock = sql.SQL("SELECT pg_advisory_xact_lock(%s, hashtext(%s))")
        with trio.fail_after(GUARD):
            async with trio.open_nursery() as nursery:
                with held(pg_schemas.dsn, lock, (CAPACITY_LOCK_CLASS, schema)):
                    await queued_behind(
                        nursery, functools.partial(submit, store, "first"), calls, found
                    )
                    batches = store._batcher.batches
        assert store._batcher.batches == batches + 2  # the held one, then the five together
        assert isinstance(found["c2"], psycopg.DataError), found["c2"]
        for name in ("first", "c0", "c1", "c3", "c4"):
            assert isinstance(found[name], Claimed), (name, found[name])
            assert not isinstance(await store.inspect_task(name), NotFound)
        assert isinstance(await store.inspect_task("c2"), NotFound)


async def waiting_on_a_transaction(dsn: str, schema: str, count: int) -> None:
    """Until ``count`` statements on ``schema`` wait for another transaction to end."""
    query = (
        "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
        " WHERE l.locktype = 'transactionid' AND NOT l.granted"
        " AND strpos(a.query, %s) > 0"
    )
    while True:
        with connect(dsn) as conn:
            row = conn.execute(query, (f'"{schema}".tasks',)).fetchone()
        if row is not None and row[0] >= count:
            return
        await trio.sleep(0.01)


async def test_two_hosts_batching_the_same_new_ids_in_opposite_orders_do_not_deadlock(
    pg_schemas: SchemaFactory,  # noqa: F811
) -> None:
    """Two stores on one database each batch creations of the same 40 new ids, one in
    ascending order, the other descending, and both batches run at once: they meet at an id
    whose insertion a third transaction holds, uncommitted, until both wait for it. Whichever
    inserts an id first gets it, the other caller finds it exists, and neither batch waits for
    the other in a cycle (PostgreSQL would end one batch with a deadlock after deadlock_timeout,
    and its callers would all run alone)."""
    schema = await pg_schemas.migrated()
    ids = [f"id{n:02}" for n in range(40)]
    async with unlimited(pg_schemas, schema) as one, unlimited(pg_schemas, schema) as two:
        assert one._batcher is not None and two._batcher is not None
        holds = {
            store: await create_claimed(store, f"hold-{n}") for n, store in enumerate((one, two))
        }
        found: dict[PostgresStore, dict[str, Any]] = {one: {}, two: {}}
        t = sql.Identifier(schema)
        middle = sql.SQL(
            "CREATE TEMPORARY TABLE m ON COMMIT DROP AS SELECT * FROM {}.tasks"
            " WHERE task_id = 'hold-0'; UPDATE m SET task_id = 'id20';"
            " INSERT INTO {}.tasks SELECT * FROM m"
        ).format(t, t)
        lock = sql.SQL("SELECT 1 FROM {}.tasks WHERE task_id IN ('hold-0', 'hold-1') FOR UPDATE")
        with trio.fail_after(GUARD):
            async with trio.open_nursery() as nursery:
                with held(pg_schemas.dsn, middle, commit=False):
                    with held(pg_schemas.dsn, lock.format(t)):
                        for store, order in ((one, ids), (two, ids[::-1])):
                            lease = holds[store].lease
                            first = functools.partial(
                                store.settle, lease.task_id, 0, Event.completed(RESULT), lease
                            )
                            calls = [(i, functools.partial(submit, store, i)) for i in order]
                            await queued_behind(nursery, first, calls, found[store])
                    await waiting_on_a_transaction(pg_schemas.dsn, schema, 2)  # both at id20
        for store in (one, two):
            assert isinstance(found[store]["first"], Transition)
        for task_id in ids:
            made = sorted(type(found[store][task_id]).__name__ for store in (one, two))
            assert made == ["AlreadyExists", "Claimed"], (task_id, made)
        assert (one._batcher.alone, two._batcher.alone) == (0, 0)  # no batch was rolled back


STRANGE = [
    'quote"d',
    "back\\slash",
    "\\",
    '"',
    '\\"',
    "com,ma",
    "{braces}",
    "{",
    "}",
    "NULL",
    "null",
    " spaced ",
    "\t\n\r",
    "é ü 漢字 🎉",
    "\u200b\ufeff",
    "x" * 256,
    "🎉" * 64,  # 256 bytes
]


async def test_text_in_the_batch_arrays_arrives_exactly(
    pg_schemas: SchemaFactory,  # noqa: F811
) -> None:
    """Task ids, owners and JSON with quotes, backslashes, commas, braces, the word NULL,
    spaces, control characters and non-ASCII text go through the batch's one-array-per-column
    statements (creations, locks, ledger reads, writes) and come back exactly."""
    schema = await pg_schemas.migrated()
    async with unlimited(pg_schemas, schema) as store:
        assert store._batcher is not None
        value = {"s": STRANGE, "big": '\\"{,}' * 5_000, "n": [None, 1, -2.5, True]}
        found: dict[str, Any] = {}
        calls = [
            (task_id, functools.partial(submit, store, task_id, f"owner {task_id}", value))
            for task_id in STRANGE
        ]
        hold = await create_claimed(store, "hold")
        async with batched_behind(pg_schemas.dsn, schema, store, "hold", hold.lease, calls, found):
            pass
        assert store._batcher.alone == 0
        for task_id in STRANGE:
            made = found[task_id]
            assert isinstance(made, Claimed), (task_id, made)
            assert made.lease.owner_id == f"owner {task_id}"
            task = await stored(store, task_id)
            assert task.snapshot == made.snapshot
            assert task.snapshot.work is not None
            assert task.snapshot.work.input == value
        results = {task_id: {"content": [{"type": "text", "text": task_id}]} for task_id in STRANGE}
        settled: dict[str, Any] = {}
        settles: list[tuple[str, Any]] = [
            (
                task_id,
                functools.partial(
                    store.settle,
                    task_id,
                    0,
                    Event.completed({**results[task_id], "isError": False}),
                    found[task_id].lease,
                ),
            )
            for task_id in STRANGE
        ]
        other = await create_claimed(store, "hold2")
        async with batched_behind(
            pg_schemas.dsn, schema, store, "hold2", other.lease, settles, settled
        ):
            pass
        assert store._batcher.alone == 0
        for task_id in STRANGE:
            answer = settled[task_id]
            assert isinstance(answer, Transition) and answer.outcome == "applied", (task_id, answer)
            task = await stored(store, task_id)
            assert task.snapshot == answer.snapshot
            assert task.snapshot.task.result == {**results[task_id], "isError": False}
            history = await store.history(task_id)
            assert [entry.event.kind.value for entry in history] == ["completed"]


async def test_a_settle_left_out_of_a_batch_whose_commit_is_unknown_runs_alone(
    pg_schemas: SchemaFactory,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A second settle of one task is left out of its batch and runs alone after it. When the
    batch's connection is lost once its ``COMMIT`` was sent, the operations in it get that error
    (their outcome is unknown), but the one left out was never sent: it still runs alone and
    gets its own answer (here the first settle had committed, so a duplicate)."""
    schema = await pg_schemas.migrated()
    async with unlimited(pg_schemas, schema) as store:
        assert store._batcher is not None
        hold = await create_claimed(store, "hold")
        made = await create_claimed(store, "s")
        pipeline = Session.pipeline

        async def lost_after_commit(
            self: Session, *calls: tuple[Statement, Mapping[str, object] | None]
        ) -> list[Result]:
            done = await pipeline(self, *calls)
            ids = [(p or {}).get("ids") for stmt, p in calls if stmt is store._q.write_many]
            if any(isinstance(i, list) and "s" in i for i in ids):
                raise psycopg.OperationalError("the connection was lost")  # after the COMMIT
            return done

        monkeypatch.setattr(Session, "pipeline", lost_after_commit)
        event = Event.completed(RESULT)
        found: dict[str, Any] = {}
        calls = [
            (name, functools.partial(store.settle, "s", 0, event, made.lease))
            for name in ("s1", "s2")
        ]
        async with batched_behind(pg_schemas.dsn, schema, store, "hold", hold.lease, calls, found):
            pass
        assert isinstance(found["s1"], psycopg.OperationalError), found["s1"]
        assert isinstance(found["s2"], Transition), found["s2"]
        assert found["s2"].outcome == "duplicate"
        assert store._batcher.alone == 1
        assert (await stored(store, "s")).snapshot.task.status.value == "completed"


async def test_a_batch_notifies_once_per_operation_in_order_after_its_commit(
    pg_schemas: SchemaFactory,  # noqa: F811
) -> None:
    """A batch of queued creations sends each one's ``created`` wake-up in the batch's order
    (their rows go in in task-id order), and a batch of settles each one's change in task-id
    order (their lock order); nothing is heard of either before its batch's ``COMMIT``."""
    schema = await pg_schemas.migrated()
    async with unlimited(pg_schemas, schema) as store:
        assert store._batcher is not None and store._changes_channel is not None
        origin = store._origin
        claimed = {name: await create_claimed(store, name) for name in ("c0", "c1", "c2")}
        hold = await create_claimed(store, "hold")
        with connect(pg_schemas.dsn) as listener:
            for channel in (store._channel, store._changes_channel):
                listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
            queued = ["q3", "q1", "q2"]
            settles = ["c2", "c0", "c1"]
            found: dict[str, Any] = {}
            calls: list[tuple[str, Any]] = [
                (name, functools.partial(queue_one, store, name)) for name in queued
            ]
            calls += [
                (
                    name,
                    functools.partial(
                        store.settle, name, 0, Event.completed(RESULT), claimed[name].lease
                    ),
                )
                for name in settles
            ]
            async with batched_behind(
                pg_schemas.dsn, schema, store, "hold", hold.lease, calls, found
            ):
                heard = [(n.channel, n.payload) for n in listener.notifies(timeout=0.2)]
                assert heard == []  # the batch waits for the held row
            heard = [(n.channel, n.payload) for n in listener.notifies(timeout=1, stop_after=7)]
        assert store._batcher.alone == 0
        for name in settles:
            assert found[name].outcome == "applied"
        created = [notify_payload(WakeupKind.CREATED, name, origin) for name in queued]
        changes = [
            change_payload(name, 1, TaskStatus.COMPLETED, origin)
            for name in ("hold", *sorted(settles))
        ]
        assert (
            heard
            == [
                (store._changes_channel, changes[0]),  # the held batch
                *((store._channel, payload) for payload in created),
                *((store._changes_channel, payload) for payload in changes[1:]),
            ]
        )


async def queue_one(store: PostgresStore, task_id: str) -> Any:
    access = await store.authorize(None, Action.CREATE, task_id)
    work = Work(idempotency_key=task_id, type="batch", input={})
    return await store.submit(
        new_task(task_id, 0, None, None), work, access, owner_id=None, lease_ms=60_000
    )


async def test_a_connection_the_server_ends_once_the_commit_was_sent_is_an_unknown_outcome(
    pg_schemas: SchemaFactory,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server that ends the connection (``FATAL``: an administrator's or a crash's shutdown)
    while a batch's ``COMMIT`` is on its way may have committed it first (a backend terminated
    while it waits for synchronous replication has committed locally). Its error has a
    sqlstate, but it is no refused statement: the batch's callers get it, as each would alone,
    instead of running again (a creation would then find its own task: AlreadyExists)."""
    schema = await pg_schemas.migrated()
    async with unlimited(pg_schemas, schema) as store:
        assert store._batcher is not None
        hold = await create_claimed(store, "hold")
        pipeline = Session.pipeline
        armed: set[Session] = set()

        async def ended_after_commit(
            self: Session, *calls: tuple[Statement, Mapping[str, object] | None]
        ) -> list[Result]:
            done = await pipeline(self, *calls)
            ids = [(p or {}).get("ids") for stmt, p in calls if stmt is store._q.insert_many]
            mine = any(isinstance(i, list) and "n0" in i for i in ids)
            if calls[-1][0] is COMMIT and (mine or self in armed):
                # The COMMIT in the creations' own round trip (a batch of one round trip) or
                # in the one after it.
                armed.discard(self)
                raise psycopg.errors.AdminShutdown("terminating connection")  # committed
            if mine:
                armed.add(self)
            return done

        monkeypatch.setattr(Session, "pipeline", ended_after_commit)
        found: dict[str, Any] = {}
        calls = [(f"n{n}", functools.partial(submit, store, f"n{n}")) for n in range(4)]
        async with batched_behind(pg_schemas.dsn, schema, store, "hold", hold.lease, calls, found):
            pass
        for n in range(4):
            assert isinstance(found[f"n{n}"], psycopg.errors.AdminShutdown), found[f"n{n}"]
            assert not isinstance(await store.inspect_task(f"n{n}"), NotFound)  # committed
        assert store._batcher.alone == 0


async def test_one_batch_of_every_kind_under_limits_answers_each_caller_its_own(
    pg_schemas: SchemaFactory,  # noqa: F811
) -> None:
    """One batch under max_tasks holding settles that apply, one with a stale revision, one
    whose event is already in the ledger (it replays and releases the claim: a statement of its
    own), a second settle of a task (left out, it runs alone after) and creations that fill the
    store partway: the creations are admitted in queue order up to the limit and exactly the
    ones beyond it are refused, and every settle gets its own answer."""
    schema = await pg_schemas.migrated()
    store = PostgresStore(
        pg_schemas.dsn,
        schema=schema,
        scope="shared",
        max_tasks=9,
        max_active_tasks_per_scope=None,
    )
    async with store:
        assert store._batcher is not None
        made = {name: await submit(store, name) for name in ("hold", "a", "b", "c", "r", "d")}
        done = Event.completed(RESULT)
        early = await store.transition("r", 0, done, WorkerAuthority(made["r"].lease))
        assert isinstance(early, Transition) and early.outcome == "applied"
        calls: list[tuple[str, Any]] = [
            (
                "b",
                functools.partial(store.settle, "b", 0, Event.completed(RESULT), made["b"].lease),
            ),
            ("n0", functools.partial(submit, store, "n0")),
            ("a", functools.partial(store.settle, "a", 0, done, made["a"].lease)),
            (
                "c",
                functools.partial(store.settle, "c", 3, Event.completed(RESULT), made["c"].lease),
            ),
            ("n1", functools.partial(submit, store, "n1")),
            ("r", functools.partial(store.settle, "r", 0, done, made["r"].lease)),
            ("a-again", functools.partial(store.settle, "a", 0, done, made["a"].lease)),
            ("n2", functools.partial(submit, store, "n2")),
            ("n3", functools.partial(submit, store, "n3")),
            (
                "d",
                functools.partial(store.settle, "d", 0, Event.completed(RESULT), made["d"].lease),
            ),
            ("n4", functools.partial(submit, store, "n4")),
        ]
        found: dict[str, Any] = {}
        lease = made["hold"].lease
        async with batched_behind(pg_schemas.dsn, schema, store, "hold", lease, calls, found):
            batches = store._batcher.batches
        assert store._batcher.batches == batches + 2
        assert store._batcher.alone == 1  # a-again
        for name in ("b", "a", "d"):
            assert isinstance(found[name], Transition) and found[name].outcome == "applied"
        assert isinstance(found["c"], Conflict)
        assert isinstance(found["r"], Transition) and found["r"].outcome == "duplicate"
        assert found["r"].event_revision == early.event_revision
        assert isinstance(found["a-again"], Transition)
        assert found["a-again"].outcome == "duplicate"
        for name in ("n0", "n1", "n2"):  # 6 tasks before, room for 3
            assert isinstance(found[name], Claimed), (name, found[name])
        for name in ("n3", "n4"):
            assert isinstance(found[name], CapacityExceeded), (name, found[name])
            assert isinstance(await store.inspect_task(name), NotFound)
        assert (await stored(store, "r")).claim is None
        assert (await stored(store, "c")).claim is not None
        assert await store.history("c") == []


async def test_two_hosts_settling_the_same_tasks_in_opposite_orders_do_not_deadlock(
    pg_schemas: SchemaFactory,  # noqa: F811
) -> None:
    """Two stores on one database each settle the same 40 tasks (a settle and its resend on
    another host), one in ascending order, the other descending, meeting at a task another
    transaction holds locked. Both lock in task-id order, so neither waits for the other in a
    cycle: each task is applied once and replayed once, and no batch was rolled back."""
    schema = await pg_schemas.migrated()
    ids = [f"id{n:02}" for n in range(40)]
    async with unlimited(pg_schemas, schema) as one, unlimited(pg_schemas, schema) as two:
        assert one._batcher is not None and two._batcher is not None
        claimed = {task_id: await create_claimed(one, task_id) for task_id in ids}
        holds = {
            store: await create_claimed(store, f"hold-{n}") for n, store in enumerate((one, two))
        }
        events = {task_id: Event.completed(RESULT) for task_id in ids}
        found: dict[PostgresStore, dict[str, Any]] = {one: {}, two: {}}
        t = sql.Identifier(schema)
        middle = sql.SQL("SELECT 1 FROM {}.tasks WHERE task_id = 'id20' FOR UPDATE").format(t)
        lock = sql.SQL("SELECT 1 FROM {}.tasks WHERE task_id IN ('hold-0', 'hold-1') FOR UPDATE")
        with trio.fail_after(GUARD):
            async with trio.open_nursery() as nursery:
                with held(pg_schemas.dsn, middle):
                    with held(pg_schemas.dsn, lock.format(t)):
                        for store, order in ((one, ids), (two, ids[::-1])):
                            lease = holds[store].lease
                            first = functools.partial(
                                store.settle, lease.task_id, 0, Event.completed(RESULT), lease
                            )
                            calls = [
                                (
                                    i,
                                    functools.partial(
                                        store.settle, i, 0, events[i], claimed[i].lease
                                    ),
                                )
                                for i in order
                            ]
                            await queued_behind(nursery, first, calls, found[store])
                    await waiting_on_a_transaction(pg_schemas.dsn, schema, 2)  # both at id20
        for task_id in ids:
            outcomes = sorted(found[store][task_id].outcome for store in (one, two))
            assert outcomes == ["applied", "duplicate"], (task_id, outcomes)
        # No batch was rolled back: what ran alone is one's planned settles of the tasks two
        # settled first (their rows were no longer the ones one inserted).
        assert one._batcher.alone == one.planned_missed
        assert two._batcher.alone == two.planned_missed == 0


A, B, C = tenant("tenant-a"), tenant("tenant-b"), tenant("tenant-c")


async def test_creations_under_limits_in_one_round_trip_get_the_verdicts_of_their_order(
    pg_schemas: SchemaFactory,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch of creations under both limits with no id twice is one round trip: its statement
    gives each creation, in queue order, the verdict ``_admit`` gives it in the batch of two
    round trips. An existing id is refused as such; a creation refused by its scope's limit does
    not count against max_tasks; once max_tasks refuses one, it refuses every later one."""
    schema = await pg_schemas.migrated()
    store = PostgresStore(
        pg_schemas.dsn,
        schema=schema,
        scope=by_tenant,
        max_tasks=6,
        max_active_tasks_per_scope=3,
    )
    one_trips: list[int] = []
    run_one_trip = PostgresStore._run_one_trip

    async def counted(self: PostgresStore, planned: Any, free: Any, limited: Any) -> None:
        one_trips.append(len(limited))
        await run_one_trip(self, planned, free, limited)

    monkeypatch.setattr(PostgresStore, "_run_one_trip", counted)

    async def create(ctx: object, task_id: str) -> Claimed:
        access = await store.authorize(ctx, Action.CREATE, task_id)
        work = Work(idempotency_key=task_id, type="batch", input={})
        made = await store.submit(
            new_task(task_id, 0, None, None), work, access, owner_id="o", lease_ms=60_000
        )
        assert isinstance(made, Claimed)
        return made

    async with store:
        assert store._batcher is not None
        await create(A, "x")  # active in A: A has room for two more
        order = [(A, "a0"), (B, "b0"), (A, "x"), (A, "a1"), (A, "a2"), (B, "b1"), (B, "b2")]
        order.append((C, "c0"))
        calls = [(task_id, functools.partial(create, ctx, task_id)) for ctx, task_id in order]
        found: dict[str, Any] = {}
        lock = sql.SQL("SELECT pg_advisory_xact_lock(%s, hashtext(%s))")
        with trio.fail_after(GUARD):
            async with trio.open_nursery() as nursery:
                with held(pg_schemas.dsn, lock, (CAPACITY_LOCK_CLASS, schema)):
                    await queued_behind(
                        nursery, functools.partial(create, C, "first"), calls, found
                    )
        assert one_trips == [1, 1, len(order)]  # "x", then "first", then the eight together
        assert store._batcher.alone == 0
        verdicts = {
            name: type(o).__name__ if not isinstance(o, CapacityExceeded) else o.limit
            for name, o in found.items()
        }
        assert verdicts == {
            "first": "Claimed",
            "a0": "Claimed",
            "b0": "Claimed",
            "x": "AlreadyExists",
            "a1": "Claimed",
            "a2": "max_active_tasks_per_scope",
            "b1": "Claimed",  # the sixth task
            "b2": "max_tasks",
            "c0": "max_tasks",
        }
        for name, o in found.items():
            if isinstance(o, Claimed):
                assert (await stored(store, name)).snapshot == o.snapshot


@pytest.mark.parametrize("kind", ["completed", "failed"])
async def test_a_planned_settle_stores_what_it_answers(
    pg_schemas: SchemaFactory,  # noqa: F811
    kind: str,
) -> None:
    """A settle of a task this store created claimed is planned before its batch: what it
    answers is what is stored (the record, its commit instant in the ledger, the claim
    cleared). One whose row another host changed meanwhile (a cancellation) wrote nothing and
    runs alone, with the answer it would have had alone."""
    schema = await pg_schemas.migrated()
    async with unlimited(pg_schemas, schema) as store:
        made = await create_claimed(store, "planned")
        other = await create_claimed(store, "cancelled")
        if kind == "completed":
            event = Event.completed(RESULT)
        else:
            event = Event.failed({"code": -1, "message": "no"}, "failed")
        settled = await store.settle("planned", 0, event, made.lease)
        assert store.planned_missed == 0 and store._batcher is not None
        assert store._batcher.alone == 0
        assert isinstance(settled, Transition) and settled.outcome == "applied"
        row = await stored(store, "planned")
        assert row.snapshot == settled.snapshot and row.claim is None
        assert settled.snapshot.task.last_updated_at == settled.committed_at
        (entry,) = await store.history("planned")
        assert (entry.revision, entry.committed_at) == (1, settled.committed_at)
        assert entry.event == event and entry.effects == settled.effects
        again = await store.settle("planned", 0, event, made.lease)  # the resend replays
        assert isinstance(again, Transition) and again.outcome == "duplicate"
        async with unlimited(pg_schemas, schema) as host:  # another host cancels it
            access = RequestAuthority(await host.authorize(None, Action.CANCEL, "cancelled"))
            cancel = await host.transition("cancelled", 0, Event.cancelled(), access)
        assert isinstance(cancel, Transition) and cancel.outcome == "applied"
        late = await store.settle("cancelled", 0, event, other.lease)
        assert store.planned_missed == 1  # planned on the row as created, which was cancelled
        assert isinstance(late, Conflict) and late.snapshot == cancel.snapshot
        assert [e.event.kind.value for e in await store.history("cancelled")] == ["cancelled"]
