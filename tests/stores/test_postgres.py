"""PostgresStore beyond the shared contract: migrations, server-side cancellation, LISTEN/NOTIFY
wake-ups, stores on several "hosts" (separate store objects, each with its own pool) racing for
the same rows, database time, and data that fails closed.

Racing and wake-up tests use the database clock; tests that need to move time inject a
``ManualClock`` (never trio's autojump clock: the store works in real threads).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import psycopg
import pytest
import trio
from postgres_support import SchemaFactory, connect, pg_schemas, postgres_dsn
from psycopg import sql
from tritask_postgres import (
    SCHEMA_VERSION,
    LedgerEntry,
    PostgresStore,
    StoreSchemaError,
    Wakeup,
    WakeupKind,
    migrate,
)
from tritask_postgres import _migrations as migrations
from tritask_postgres._migrations import Migration, redact_dsn, split_store_url

from tritask.migrate import add_migrate_command, run_migrate
from tritask.tasks.events import Effects, Event
from tritask.tasks.model import Snapshot, TaskStatus, new_task
from tritask.tasks.store import (
    NOT_FOUND,
    UNAVAILABLE,
    Action,
    AlreadyExists,
    CapacityExceeded,
    Claimed,
    Conflict,
    CorruptStore,
    DatabaseBusy,
    Deferred,
    EventIdReused,
    Lease,
    RequestAuthority,
    Scope,
    StaleLease,
    Transition,
    WorkerAuthority,
)
from tritask.tasks.stores import open_store
from tritask.tasks.work import RetryPolicy, Work
from tritask.testing.store_contract import START, ManualClock, StoreContract, by_tenant, tenant

__all__ = ["pg_schemas", "postgres_dsn"]  # the fixtures this module uses

pytestmark = pytest.mark.postgres

A, B = tenant("tenant-a"), tenant("tenant-b")
ASK = {"method": "elicitation/create", "params": {"message": "Confirm"}}
ERROR = {"code": -32000, "message": "transient"}
LEASE_MS = 30_000
create = StoreContract.create


def pg_store(
    schemas: SchemaFactory,
    schema: str,
    *,
    scope: Scope = by_tenant,
    clock: ManualClock | None = None,
    **options: Any,
) -> PostgresStore:
    return PostgresStore(schemas.dsn, schema=schema, scope=scope, clock=clock, **options)


async def claimed(store: PostgresStore, task_id: str, owner: str = "owner-1") -> Lease:
    result = await store.claim(task_id, owner, LEASE_MS)
    assert isinstance(result, Claimed), result
    return result.lease


def with_query(dsn: str, query: str) -> str:
    return f"{dsn}{'&' if '?' in dsn else '?'}{query}"


def activity(dsn: str, application_name: str) -> list[tuple[Any, ...]]:
    """``(pid, state, wait_event_type, query)`` of the store's backends."""
    with connect(dsn) as conn:
        return conn.execute(
            "SELECT pid, state, wait_event_type, query FROM pg_stat_activity"
            " WHERE application_name = %s ORDER BY pid",
            (application_name,),
        ).fetchall()


async def assert_disconnected(dsn: str, application_name: str) -> None:
    """The backends of ``application_name`` exit (asynchronously, after the client closed)."""
    with trio.fail_after(5):
        while True:  # polling: the server announces no backend exits
            if not await trio.to_thread.run_sync(activity, dsn, application_name):
                return
            await trio.sleep(0.01)


@contextlib.contextmanager
def row_locked(dsn: str, schema: str, task_id: str) -> Any:
    """Hold ``FOR UPDATE`` on a task row from another connection until the block ends."""
    with connect(dsn) as conn, conn.transaction():
        conn.execute(
            sql.SQL("SELECT 1 FROM {}.tasks WHERE task_id = %s FOR UPDATE").format(
                sql.Identifier(schema)
            ),
            (task_id,),
        )
        yield conn


def raw_execute(dsn: str, query: sql.Composed, params: tuple[Any, ...] = ()) -> None:
    with connect(dsn) as conn:
        conn.execute(query, params)


# -- migrations ---------------------------------------------------------------------------------


async def test_migrate_fresh_then_idempotent(pg_schemas: SchemaFactory) -> None:
    schema = pg_schemas.name()
    first = await migrate(pg_schemas.dsn, schema=schema)
    every = tuple(range(1, SCHEMA_VERSION + 1))
    assert (first.schema, first.version, first.applied) == (schema, SCHEMA_VERSION, every)
    again = await migrate(pg_schemas.dsn, schema=schema)
    assert (again.version, again.applied) == (SCHEMA_VERSION, ())
    with connect(pg_schemas.dsn) as conn:
        tables = {
            row[0]
            for row in conn.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
                (schema,),
            ).fetchall()
        }
        store_id = conn.execute(
            sql.SQL("SELECT store_id::text FROM {}.store_metadata").format(sql.Identifier(schema))
        ).fetchone()
    assert tables == {"schema_migrations", "store_metadata", "tasks", "task_events", "task_counts"}
    assert store_id is not None
    async with pg_store(pg_schemas, schema) as store:
        assert store.store_id == store_id[0]
        assert (await create(store, "task-1")).revision == 0


async def test_store_refuses_a_missing_schema(pg_schemas: SchemaFactory) -> None:
    schema = pg_schemas.name()
    store = pg_store(pg_schemas, schema)
    with pytest.raises(StoreSchemaError) as caught:
        await store.open()
    message = str(caught.value)
    assert f"schema {schema!r} is not installed" in message
    assert f"run `tritask migrate --store {redact_dsn(pg_schemas.dsn)} --schema {schema}`" in (
        message
    )


@pytest.mark.contract("tasks-durable-store")
async def test_store_refuses_a_newer_schema(pg_schemas: SchemaFactory) -> None:
    schema = await pg_schemas.migrated()
    raw_execute(
        pg_schemas.dsn,
        sql.SQL(
            "INSERT INTO {}.schema_migrations (version, name, checksum) VALUES (%s, 'x', 'x')"
        ).format(sql.Identifier(schema)),
        (SCHEMA_VERSION + 1,),
    )
    with pytest.raises(
        StoreSchemaError, match=r"newer than this tritask supports .*: upgrade tritask"
    ):
        await pg_store(pg_schemas, schema).open()
    with pytest.raises(StoreSchemaError, match="upgrade tritask"):
        await migrate(pg_schemas.dsn, schema=schema)


async def test_store_refuses_an_older_schema_until_migrated(
    pg_schemas: SchemaFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    schema = await pg_schemas.migrated()
    shipped = migrations.load_migrations()
    upgrade = Migration(len(shipped) + 1, "status_index", "CREATE INDEX ON tasks (status);")
    monkeypatch.setattr(migrations, "load_migrations", lambda: (*shipped, upgrade))
    with pytest.raises(StoreSchemaError) as caught:
        await pg_store(pg_schemas, schema).open()
    assert f"is at version {len(shipped)}, this tritask needs {upgrade.version}" in str(
        caught.value
    )
    assert "run `tritask migrate --store" in str(caught.value)
    result = await migrate(pg_schemas.dsn, schema=schema)
    assert result.applied == (upgrade.version,)
    async with pg_store(pg_schemas, schema) as store:
        await create(store, "task-1")


async def test_changed_migration_is_refused(pg_schemas: SchemaFactory) -> None:
    schema = await pg_schemas.migrated()
    raw_execute(
        pg_schemas.dsn,
        sql.SQL("UPDATE {}.schema_migrations SET checksum = 'edited'").format(
            sql.Identifier(schema)
        ),
    )
    with pytest.raises(StoreSchemaError, match="differs from the shipped file"):
        await migrate(pg_schemas.dsn, schema=schema)


async def test_concurrent_migrations_apply_once(pg_schemas: SchemaFactory) -> None:
    schema = pg_schemas.name()
    results: list[tuple[int, ...]] = []

    async def run() -> None:
        results.append((await migrate(pg_schemas.dsn, schema=schema)).applied)

    async with trio.open_nursery() as nursery:
        for _ in range(6):
            nursery.start_soon(run)
    assert sorted(results) == [(), (), (), (), (), tuple(range(1, SCHEMA_VERSION + 1))]
    async with pg_store(pg_schemas, schema) as store:
        await create(store, "task-1")


async def test_passwords_stay_out_of_messages(pg_schemas: SchemaFactory) -> None:
    assert redact_dsn("postgresql://u:s3cret@db:5432/x?sslmode=require") == (
        "postgresql://u@db:5432/x?sslmode=require"
    )
    assert redact_dsn("postgresql://:s3cret@db/x") == "postgresql://db/x"
    assert redact_dsn("postgresql://db/x?password=s3cret&user=u") == "postgresql://db/x?user=u"
    assert redact_dsn("host=db password=s3cret") == "postgresql://..."
    schema = pg_schemas.name()
    store = PostgresStore(
        with_query(pg_schemas.dsn, "password=s3cret"), schema=schema, scope="shared"
    )
    with pytest.raises(StoreSchemaError) as caught:
        await store.open()
    assert "s3cret" not in str(caught.value)
    assert "s3cret" not in repr(store)


def test_schema_names_and_urls() -> None:
    assert split_store_url("postgresql://db/x?schema=s1&sslmode=require") == (
        "postgresql://db/x?sslmode=require",
        "s1",
    )
    assert split_store_url("postgresql://db/x") == ("postgresql://db/x", None)
    for bad in ("", "1abc", "a-b", "a" * 56, 'x"; drop'):
        with pytest.raises(ValueError, match="schema"):
            PostgresStore("postgresql://db/x", schema=bad, scope="shared")
    with pytest.raises(ValueError, match="contradicts"):
        PostgresStore("postgresql://db/x?schema=s1", schema="s2", scope="shared")
    with pytest.raises(TypeError, match="requires scope="):
        PostgresStore("postgresql://db/x")
    with pytest.raises(ValueError, match="pool_size"):
        PostgresStore("postgresql://db/x", scope="shared", pool_size=0)
    with pytest.raises(RuntimeError, match="open the store first"):
        PostgresStore("postgresql://db/x", scope="shared").wakeups()


async def test_store_urls_open_through_the_entry_points(pg_schemas: SchemaFactory) -> None:
    schema = await pg_schemas.migrated()
    for scheme in ("postgresql", "postgres"):
        url = with_query(pg_schemas.dsn, f"schema={schema}")
        url = scheme + url[url.index(":") :]
        store = open_store(url, scope="shared")
        assert isinstance(store, PostgresStore)
        assert store.schema == schema
        async with store:
            await create(store, f"task-{scheme}")


def test_migrate_command(pg_schemas: SchemaFactory, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="tritask")
    add_migrate_command(parser.add_subparsers(dest="command", required=True))
    schema = pg_schemas.name()

    def run(*argv: str) -> tuple[int, str]:
        args = parser.parse_args(["migrate", *argv])
        assert args.handler is run_migrate
        code = args.handler(args)
        return code, capsys.readouterr().err

    store = ["--store", pg_schemas.dsn, "--schema", schema]
    steps = ", ".join(f"{v:04d}" for v in range(1, SCHEMA_VERSION + 1))
    migrated = (
        f"tritask: migrated schema {schema!r} to version {SCHEMA_VERSION} (applied {steps})\n"
    )
    assert run(*store) == (0, migrated)
    assert run(*store) == (
        0,
        f"tritask: schema {schema!r} is up to date (version {SCHEMA_VERSION})\n",
    )
    url_form = with_query(pg_schemas.dsn, f"schema={schema}")
    assert run("--store", url_form)[0] == 0
    assert run("--store", "memory:") == (
        0,
        "tritask: memory: stores have no separate migration step\n",
    )
    code, err = run("--store", "nosuch://x")
    assert code == 2
    assert "no store for 'nosuch'" in err
    code, err = run("--store", pg_schemas.dsn, "--schema", "bad-name")
    assert code == 2
    assert "schema must be an identifier" in err


def test_tritask_migrate_through_the_cli(
    pg_schemas: SchemaFactory, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tritask import cli

    commands = next(
        action
        for action in cli.build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    if "migrate" not in commands.choices:  # until tritask/cli.py registers it itself
        monkeypatch.setattr(cli, "_extra_commands", add_migrate_command, raising=False)
    schema = pg_schemas.name()
    assert cli.main(["migrate", "--store", with_query(pg_schemas.dsn, f"schema={schema}")]) == 0
    assert f"migrated schema {schema!r} to version {SCHEMA_VERSION}" in capsys.readouterr().err
    monkeypatch.setenv("TRITASK_STORE", pg_schemas.dsn)
    assert cli.main(["migrate", "--schema", schema]) == 0
    assert "is up to date" in capsys.readouterr().err


# -- cancellation ---------------------------------------------------------------------------------


async def test_cancelled_call_is_cancelled_on_the_server(pg_schemas: SchemaFactory) -> None:
    schema = await pg_schemas.migrated()
    app = f"tritask-cancel-{schema}"
    dsn = pg_schemas.dsn
    async with pg_store(
        pg_schemas, schema, pool_size=1, application_name=app, lock_timeout_ms=60_000
    ) as store:
        await create(store, "task-1")
        [(pid, state, _, _)] = activity(dsn, app)
        assert state == "idle"
        with row_locked(dsn, schema, "task-1") as holder:
            async with trio.open_nursery() as nursery:
                waiting = trio.CancelScope()

                async def blocked_claim() -> None:
                    with waiting:
                        await store.claim("task-1", "owner-1", LEASE_MS)

                nursery.start_soon(blocked_claim)
                for _ in range(200):  # until the store's query waits for the row lock
                    rows = await trio.to_thread.run_sync(activity, dsn, app)
                    if rows and rows[0][1:3] == ("active", "Lock"):
                        break
                    await trio.sleep(0.01)
                else:
                    pytest.fail(f"the claim never waited for the lock: {rows}")
                started = time.monotonic()
                waiting.cancel()
            assert waiting.cancelled_caught
            assert time.monotonic() - started < 2
            # cancel_safe completed before the call returned: the server stopped the query
            assert [row[:2] for row in activity(dsn, app)] == [(pid, "idle")]
            blockers = holder.execute(
                "SELECT count(*) FROM pg_locks WHERE NOT granted AND pid = %s", (pid,)
            ).fetchone()
            assert blockers == (0,)
        lease = await claimed(store, "task-1")  # same connection, still usable
        assert lease.generation == 1
        assert [row[:2] for row in activity(dsn, app)] == [(pid, "idle")]


async def test_lock_timeout_is_database_busy(pg_schemas: SchemaFactory) -> None:
    schema = await pg_schemas.migrated()
    async with pg_store(pg_schemas, schema, pool_size=1, lock_timeout_ms=100) as store:
        await create(store, "task-1")
        with row_locked(pg_schemas.dsn, schema, "task-1"), pytest.raises(DatabaseBusy):
            await store.claim("task-1", "owner-1", LEASE_MS)
        assert isinstance(await store.claim("task-1", "owner-1", LEASE_MS), Claimed)


async def test_a_killed_pooled_connection_is_replaced(pg_schemas: SchemaFactory) -> None:
    schema = await pg_schemas.migrated()
    app = f"tritask-kill-{schema}"
    async with pg_store(pg_schemas, schema, pool_size=1, application_name=app) as store:
        await create(store, "task-1")
        [(pid, _, _, _)] = activity(pg_schemas.dsn, app)
        with connect(pg_schemas.dsn) as conn:
            conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        await assert_disconnected(pg_schemas.dsn, app)
        get = await store.authorize(A, Action.GET, "task-1")
        assert isinstance(await store.get("task-1", get), Snapshot)
        [(new_pid, _, _, _)] = activity(pg_schemas.dsn, app)
        assert new_pid != pid


# -- wake-ups -------------------------------------------------------------------------------------


def _threads_in_psycopg() -> list[str]:
    """Names of threads (other than trio's) currently executing psycopg code."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    found = []
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue
        current: Any = frame
        while current is not None:
            if "psycopg" in current.f_code.co_filename:
                found.append(names.get(ident, str(ident)))
                break
            current = current.f_back
    return found


@contextlib.asynccontextmanager
async def subscribed(store: PostgresStore) -> AsyncIterator[AsyncGenerator[Wakeup, None]]:
    """A subscription whose first item (RESYNC: listening) has been consumed."""
    wakeups = store.wakeups()
    try:
        first = await wakeups.__anext__()
        assert first == Wakeup(kind=WakeupKind.RESYNC, task_id=None)
        yield wakeups
    finally:
        await wakeups.aclose()


async def next_wakeup(wakeups: AsyncIterator[Wakeup], seconds: float = 5) -> Wakeup:
    with trio.fail_after(seconds):
        return await wakeups.__anext__()


async def test_wakeup_arrives_without_polling_or_a_thread(
    pg_schemas: SchemaFactory,
) -> None:
    schema = await pg_schemas.migrated()
    listener, creator = pg_store(pg_schemas, schema), pg_store(pg_schemas, schema)
    async with listener, creator, subscribed(listener) as wakeups:
        await create(creator, "warm-up")  # the creator's first connection is not measured
        assert await next_wakeup(wakeups) == Wakeup(WakeupKind.CREATED, "warm-up")
        latencies = []

        async def create_soon(task_id: str, started: list[float], check_threads: bool) -> None:
            await trio.sleep(0.05)  # the listener is parked in wait_readable by now
            if check_threads:
                baseline = threading.active_count()
                await trio.sleep(0.2)
                assert threading.active_count() == baseline
                assert _threads_in_psycopg() == []
            started.append(time.perf_counter())
            await create(creator, task_id)

        for n in range(20):
            started: list[float] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(create_soon, f"task-{n}", started, n == 0)
                wakeup = await next_wakeup(wakeups)
                latencies.append(time.perf_counter() - started[0])
            assert wakeup == Wakeup(WakeupKind.CREATED, f"task-{n}", local=False)
        # Descriptive only (speed is the benchmarks' business): the wake-ups above arrived with
        # no polling at all, each naming exactly the task another store created.
        print(f"create → wake-up latency: median {statistics.median(latencies) * 1000:.2f} ms")


async def test_wakeup_kinds_and_cross_host_cancel(pg_schemas: SchemaFactory) -> None:
    schema = await pg_schemas.migrated()
    worker, api = pg_store(pg_schemas, schema), pg_store(pg_schemas, schema)
    async with worker, api, subscribed(worker) as wakeups:
        # created: heard by its own store too, marked local
        await create(worker, "task-1")
        assert await next_wakeup(wakeups) == Wakeup(WakeupKind.CREATED, "task-1", local=True)
        lease = await claimed(worker, "task-1")
        # another host cancels: the worker's host hears it and can stop the attempt at once
        cancel = RequestAuthority(await api.authorize(A, Action.CANCEL, "task-1"))
        assert isinstance(await api.transition("task-1", 0, Event.cancelled(), cancel), Transition)
        assert await next_wakeup(wakeups) == Wakeup(WakeupKind.CANCELLED, "task-1")
        snapshot = await worker.worker_snapshot("task-1", lease)
        assert isinstance(snapshot, Snapshot)
        assert snapshot.task.status is TaskStatus.CANCELLED
        await worker.release(lease)  # terminal: releasing wakes nobody

        await create(api, "task-2", policy=RetryPolicy([5000]))
        assert await next_wakeup(wakeups) == Wakeup(WakeupKind.CREATED, "task-2")
        worker_auth = WorkerAuthority(await claimed(worker, "task-2"))
        await worker.transition("task-2", 0, Event.input_requested("a", ASK), worker_auth)
        update = RequestAuthority(await api.authorize(A, Action.UPDATE, "task-2"))
        answer = Event.input_responses_accepted({"a": {"ok": True}})
        assert isinstance(await api.transition("task-2", 1, answer, update), Transition)
        assert await next_wakeup(wakeups) == Wakeup(WakeupKind.INPUT_ACCEPTED, "task-2")
        retry = await worker.transition(
            "task-2", 2, Event.retry_requested(ERROR, None), worker_auth
        )
        assert isinstance(retry, Transition)
        due = retry.snapshot.retry_at
        assert await next_wakeup(wakeups) == Wakeup(
            WakeupKind.RETRY_SCHEDULED, "task-2", due_at=due, local=True
        )
        await worker.release(worker_auth.lease)
        assert await next_wakeup(wakeups) == Wakeup(
            WakeupKind.RELEASED, "task-2", due_at=due, local=True
        )
        # no-ops and worker results that leave nothing to do send nothing
        stale_answer = Event.input_responses_accepted({"a": {}})
        result = await api.transition("task-2", 3, stale_answer, update)
        assert isinstance(result, Transition)
        assert result.outcome == "unchanged"
        # created already claimed: nothing for other runners to recover, so no wake-up
        access = await api.authorize(A, Action.CREATE, "task-3")
        task = new_task("task-3", await api.now(), 60_000, None)
        work = Work(idempotency_key="task-3", type="t", input={})
        await api.create_claimed(task, work, access, "creator", LEASE_MS)
        await create(api, "task-4")
        assert await next_wakeup(wakeups) == Wakeup(WakeupKind.CREATED, "task-4")


async def test_wakeups_resync_after_losing_the_connection(pg_schemas: SchemaFactory) -> None:
    schema = await pg_schemas.migrated()
    app = f"tritask-resync-{schema}"
    store = pg_store(pg_schemas, schema, application_name=app)
    async with store, subscribed(store) as wakeups:
        with connect(pg_schemas.dsn) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE application_name = %s",
                (f"{app}-listen",),
            )
        assert await next_wakeup(wakeups) == Wakeup(WakeupKind.RESYNC, None)
        await create(store, "task-1")
        assert await next_wakeup(wakeups) == Wakeup(WakeupKind.CREATED, "task-1", local=True)


async def test_closing_the_store_ends_its_wakeups(pg_schemas: SchemaFactory) -> None:
    schema = await pg_schemas.migrated()
    app = f"tritask-close-{schema}"
    store = pg_store(pg_schemas, schema, application_name=app)
    received: list[Wakeup] = []
    async with store:

        async def consume(task_status: trio.TaskStatus[None]) -> None:
            wakeups = store.wakeups()
            received.append(await wakeups.__anext__())
            task_status.started()
            async for wakeup in wakeups:
                received.append(wakeup)

        async with trio.open_nursery() as nursery:
            await nursery.start(consume)
            with trio.fail_after(5):
                await store.aclose()
    assert received == [Wakeup(WakeupKind.RESYNC, None)]
    await assert_disconnected(pg_schemas.dsn, f"{app}-listen")


# -- several hosts --------------------------------------------------------------------------------


@pytest.mark.contract("tasks-durable-store")
async def test_competing_claimers_across_stores_one_wins_per_task(
    pg_schemas: SchemaFactory,
) -> None:
    schema = await pg_schemas.migrated()
    hosts = [pg_store(pg_schemas, schema, pool_size=4) for _ in range(2)]
    async with hosts[0], hosts[1]:
        task_ids = [f"task-{n:02d}" for n in range(20)]
        for task_id in task_ids:
            await create(hosts[0], task_id, B)
        results: dict[str, list[object]] = {task_id: [] for task_id in task_ids}

        async def claim(host: int, task_id: str, worker: int) -> None:
            owner = f"host-{host}-worker-{worker}"
            results[task_id].append(await hosts[host].claim(task_id, owner, LEASE_MS))

        async with trio.open_nursery() as nursery:
            for task_id in task_ids:
                for host in (0, 1):
                    for worker in (0, 1):
                        nursery.start_soon(claim, host, task_id, worker)
        for task_id, outcomes in results.items():
            wins = [r for r in outcomes if isinstance(r, Claimed)]
            assert len(wins) == 1, (task_id, outcomes)
            assert outcomes.count(UNAVAILABLE) == 3
            assert wins[0].lease.generation == 1
        # the winner's lease works on the other host's store object too: same schema, same store
        win = next(r for r in results["task-00"] if isinstance(r, Claimed))
        other = hosts[1] if win.lease.owner_id.startswith("host-0") else hosts[0]
        assert isinstance(await other.worker_snapshot("task-00", win.lease), Snapshot)


@pytest.mark.contract("tasks-durable-store")
async def test_claim_next_hands_out_distinct_tasks_under_contention(
    pg_schemas: SchemaFactory,
) -> None:
    schema = await pg_schemas.migrated()
    hosts = [pg_store(pg_schemas, schema, pool_size=5, max_active_tasks_per_scope=None)]
    hosts.append(pg_store(pg_schemas, schema, pool_size=5, max_active_tasks_per_scope=None))
    async with hosts[0], hosts[1]:
        for n in range(40):
            await create(hosts[n % 2], f"task-{n:02d}")
        taken: list[str] = []

        async def worker(host: PostgresStore, name: str) -> None:
            while (result := await host.claim_next(name, LEASE_MS)) is not None:
                taken.append(result.snapshot.task.id)

        async with trio.open_nursery() as nursery:
            for n in range(10):
                nursery.start_soon(worker, hosts[n % 2], f"worker-{n}")
        assert sorted(taken) == [f"task-{n:02d}" for n in range(40)]
        assert await hosts[0].claim_next("late", LEASE_MS) is None


async def test_create_claimed_is_never_adopted_by_another_host(pg_schemas: SchemaFactory) -> None:
    schema = await pg_schemas.migrated()
    api, recoverer = (pg_store(pg_schemas, schema, pool_size=5) for _ in range(2))
    async with api, recoverer:
        adopted: list[str] = []
        leases: list[Lease] = []
        done = trio.Event()

        async def recover() -> None:
            while not done.is_set():
                result = await recoverer.claim_next("recoverer", LEASE_MS)
                if result is not None:
                    adopted.append(result.snapshot.task.id)

        async def create_claimed(n: int) -> None:
            task_id = f"task-{n:02d}"
            access = await api.authorize(A, Action.CREATE, task_id)
            task = new_task(task_id, await api.now(), 60_000, None)
            work = Work(idempotency_key=task_id, type="t", input={})
            leases.append((await api.create_claimed(task, work, access, "creator", LEASE_MS)).lease)

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(recover)
            async with trio.open_nursery() as creators:
                for n in range(30):
                    creators.start_soon(create_claimed, n)
            done.set()
        assert adopted == []
        assert sorted(lease.task_id for lease in leases) == [f"task-{n:02d}" for n in range(30)]
        assert {lease.generation for lease in leases} == {1}


@pytest.mark.parametrize("limit", ["max_active_tasks_per_scope", "max_tasks"])
async def test_capacity_race_across_stores_admits_exactly_the_limit(
    pg_schemas: SchemaFactory, limit: str
) -> None:
    schema = await pg_schemas.migrated()
    options: dict[str, Any] = {"max_tasks": None, "max_active_tasks_per_scope": None}
    options[limit] = 5
    hosts = [pg_store(pg_schemas, schema, pool_size=10, **options) for _ in range(2)]
    async with hosts[0], hosts[1]:
        outcomes: list[object] = []

        async def attempt(n: int) -> None:
            ctx = A if limit == "max_active_tasks_per_scope" else tenant(f"t-{n}")
            try:
                outcomes.append(await create(hosts[n % 2], f"task-{n:02d}", ctx))
            except CapacityExceeded as exc:
                outcomes.append(exc)

        async with trio.open_nursery() as nursery:
            for n in range(20):
                nursery.start_soon(attempt, n)
        created = [o for o in outcomes if isinstance(o, Snapshot)]
        refused = [o for o in outcomes if isinstance(o, CapacityExceeded)]
        assert len(created) == 5
        assert [exc.limit for exc in refused] == [limit] * 15


async def test_concurrent_transitions_across_stores_commit_exactly_one(
    pg_schemas: SchemaFactory,
) -> None:
    schema = await pg_schemas.migrated()
    hosts = [pg_store(pg_schemas, schema, pool_size=5) for _ in range(2)]
    async with hosts[0], hosts[1]:
        await create(hosts[0], "task-1")
        worker = WorkerAuthority(await claimed(hosts[0], "task-1"))
        results: list[object] = []

        async def write(n: int) -> None:
            event = Event.input_requested(f"key-{n}", ASK)
            results.append(await hosts[n % 2].transition("task-1", 0, event, worker))

        async with trio.open_nursery() as nursery:
            for n in range(10):
                nursery.start_soon(write, n)
        applied = [r for r in results if isinstance(r, Transition)]
        assert len(applied) == 1
        assert sum(isinstance(r, Conflict) for r in results) == 9
        [entry] = await hosts[1].history("task-1")
        assert (entry.revision, entry.committed_at) == (1, applied[0].committed_at)
        assert entry.event.data["key"] in applied[0].snapshot.task.used_input_keys


# -- database time --------------------------------------------------------------------------------


async def test_database_clock_decides_leases(pg_schemas: SchemaFactory) -> None:
    schema = await pg_schemas.migrated()
    async with pg_store(pg_schemas, schema) as store:
        first, second = await store.now(), await store.now()
        assert abs(first - time.time_ns() // 1000) < 5_000_000
        assert second > first
        await create(store, "task-1")
        result = await store.claim("task-1", "owner-1", 300)
        assert isinstance(result, Claimed)
        lease = result.lease
        assert first < lease.expires_at - 300_000 <= await store.now()
        assert await store.claim("task-1", "owner-2", 300) is UNAVAILABLE
        await trio.sleep(0.4)
        again = await store.claim_next("owner-2", LEASE_MS)
        assert again is not None
        assert again.lease.generation == 2
        with pytest.raises(StaleLease):
            await store.renew(lease, 300)


async def test_claim_next_breaks_ties_in_code_point_order(pg_schemas: SchemaFactory) -> None:
    schema = await pg_schemas.migrated()
    ids = ["task-b", "task-B", "task-a", "task-é", "task-Z", "task-_"]
    async with pg_store(pg_schemas, schema, clock=ManualClock(), scope="shared") as store:
        for task_id in ids:  # all created at the same instant
            await create(store, task_id)
        order = []
        while (result := await store.claim_next("owner", LEASE_MS)) is not None:
            order.append(result.snapshot.task.id)
        assert order == sorted(ids)  # Python's order, whatever the database's locale
        page = await store.audit(limit=3, after="task-Z")
        assert page.checked == tuple(sorted(i for i in ids if i > "task-Z")[:3])


@pytest.mark.contract("tasks-durable-store")
async def test_renewal_keeps_a_claim_past_its_first_deadline(pg_schemas: SchemaFactory) -> None:
    schema = await pg_schemas.migrated()
    async with pg_store(pg_schemas, schema) as store:
        await create(store, "task-1")
        result = await store.claim("task-1", "owner-1", 400)
        assert isinstance(result, Claimed)
        await trio.sleep(0.2)
        renewed = await store.renew(result.lease, 400)
        await trio.sleep(0.3)  # past the first deadline, inside the renewed one
        assert await store.now() > result.lease.expires_at
        assert await store.claim("task-1", "owner-2", 400) is UNAVAILABLE
        assert await store.claim_next("owner-2", 400) is None
        assert isinstance(await store.worker_snapshot("task-1", renewed), Snapshot)


@pytest.mark.contract("tasks-durable-store")
async def test_reopen_keeps_record_history_and_replay(pg_schemas: SchemaFactory) -> None:
    schema = await pg_schemas.migrated()
    clock = ManualClock()
    async with pg_store(pg_schemas, schema, clock=clock) as first:
        await create(first, "task-1", policy=RetryPolicy([1000]))
        lease = await claimed(first, "task-1")
        retry = Event.retry_requested(ERROR, "again", id="retry-1")
        original = await first.transition("task-1", 0, retry, WorkerAuthority(lease))
        assert isinstance(original, Transition)
        history = await first.history("task-1")
    clock.advance(5)
    async with pg_store(pg_schemas, schema, clock=clock) as second:  # a restart, or another host
        assert second.store_id == lease.store_id
        assert isinstance(await second.worker_snapshot("task-1", lease), Snapshot)
        replay = await second.transition("task-1", 0, retry, WorkerAuthority(lease))
        assert replay == Transition(
            outcome="duplicate",
            snapshot=original.snapshot,
            effects=original.effects,
            event_revision=1,
            committed_at=original.committed_at,
        )
        assert await second.history("task-1") == history
        get = await second.authorize(A, Action.GET, "task-1")
        assert await second.get("task-1", get) == original.snapshot


async def test_commit_times_step_one_microsecond(pg_schemas: SchemaFactory) -> None:
    schema = await pg_schemas.migrated()
    clock = ManualClock()
    async with pg_store(pg_schemas, schema, clock=clock) as store:
        await create(store, "task-1")
        worker = WorkerAuthority(await claimed(store, "task-1"))
        first = await store.transition("task-1", 0, Event.input_requested("a", ASK), worker)
        second = await store.transition("task-1", 1, Event.input_requested("b", ASK), worker)
        assert isinstance(first, Transition)
        assert isinstance(second, Transition)
        assert (first.committed_at, second.committed_at) == (START + 1, START + 2)


# -- storage --------------------------------------------------------------------------------------


async def test_ledger_records_applied_events_only(pg_schemas: SchemaFactory) -> None:
    schema = await pg_schemas.migrated()
    clock = ManualClock()
    async with pg_store(pg_schemas, schema, clock=clock) as store:
        await create(store, "task-1", policy=RetryPolicy([1000]))
        worker = WorkerAuthority(await claimed(store, "task-1"))
        asked = Event.input_requested("a", ASK, id="ask")
        first = await store.transition("task-1", 0, asked, worker)
        assert isinstance(first, Transition)
        assert (await store.transition("task-1", 0, asked, worker)).outcome == "duplicate"  # type: ignore[union-attr]
        clock.advance(10)
        update = RequestAuthority(await store.authorize(A, Action.UPDATE, "task-1"))
        answer = Event.input_responses_accepted({"a": {"v": 1}, "zzz": {}}, id="answer")
        second = await store.transition("task-1", 1, answer, update)
        assert isinstance(second, Transition)
        unknown = Event.input_responses_accepted({"zzz": {}})
        assert (await store.transition("task-1", 2, unknown, update)).outcome == "unchanged"  # type: ignore[union-attr]
        assert await store.history("task-1") == [
            LedgerEntry(event=asked, revision=1, committed_at=first.committed_at,
                        effects=Effects.none()),
            LedgerEntry(event=answer, revision=2, committed_at=second.committed_at,
                        effects=Effects(accepted_input_responses={"a": {"v": 1}})),
        ]  # fmt: skip
        assert await store.history("nope") == []
        page = await store.audit()
        assert (page.checked, page.findings, page.next_after) == (("task-1",), (), None)


async def test_values_round_trip_exactly(pg_schemas: SchemaFactory) -> None:
    schema = await pg_schemas.migrated()
    scope_value = {"org": "ünï\u0000code", "n": 1.0}
    async with pg_store(pg_schemas, schema, scope=lambda ctx: ctx) as store:
        await create(store, "task-1", scope_value)
        worker = WorkerAuthority(await claimed(store, "task-1"))
        result = {"big": 10**30, "float": 1e100, "tiny": 5e-324, "neg": -0.0, "nul": "a\u0000b",
                  "emoji": "🦀", "nested": [{"x": [1, 2.5, None, True]}],
                  "lone": "\ud800 and \udfff", "exp": 1e16}  # fmt: skip
        event = Event.completed(result)
        done = await store.transition("task-1", 0, event, worker)
        assert isinstance(done, Transition)
        get = await store.authorize(scope_value, Action.GET, "task-1")
        snapshot = await store.get("task-1", get)
        assert snapshot == done.snapshot
        assert isinstance(snapshot, Snapshot)
        stored = snapshot.task.result
        assert stored == result
        assert stored is not None
        assert type(stored["big"]) is int
        assert type(stored["float"]) is float
        other = await store.authorize({"org": "ünï\u0000code", "n": 1}, Action.GET, "task-1")
        assert await store.get("task-1", other) is NOT_FOUND  # 1 and 1.0 are different scopes
        # the event's resend is recognised, also when the ledger's text was written by another
        # encoder (an earlier version's: spacing, escapes and 1e+16 for 1e16 may differ)
        for _ in range(2):
            replay = await store.transition("task-1", 0, event, worker)
            assert isinstance(replay, Transition)
            assert (replay.outcome, replay.event_revision) == ("duplicate", 1)
            old_text = json.dumps(event.to_json(), indent=1)
            raw_execute(
                pg_schemas.dsn,
                sql.SQL("UPDATE {}.task_events SET event = %s::json").format(
                    sql.Identifier(schema)
                ),
                (old_text,),
            )
        changed = Event.completed({**result, "exp": 1e15}, id=event.id)
        with pytest.raises(EventIdReused):
            await store.transition("task-1", 0, changed, worker)


@pytest.mark.contract("tasks-durable-store")
async def test_corrupt_rows_fail_closed(pg_schemas: SchemaFactory) -> None:
    schema = await pg_schemas.migrated()
    tasks = sql.SQL("{}.tasks").format(sql.Identifier(schema))
    async with pg_store(pg_schemas, schema) as store:
        for task_id in ("task-1", "task-2", "task-3"):
            await create(store, task_id)
        raw_execute(
            pg_schemas.dsn,
            sql.SQL("UPDATE {} SET status = 'completed' WHERE task_id = 'task-1'").format(tasks),
        )
        raw_execute(
            pg_schemas.dsn,
            sql.SQL("""UPDATE {} SET record = '{{"version": 9}}' WHERE task_id = 'task-2'""")
            .format(tasks),
        )  # fmt: skip
        for task_id, reason in (("task-1", "projection status"), ("task-2", "undecodable")):
            get = await store.authorize(A, Action.GET, task_id)
            with pytest.raises(CorruptStore, match=reason) as caught:
                await store.get(task_id, get)
            assert caught.value.task_id == task_id
            with pytest.raises(CorruptStore):
                await store.claim(task_id, "owner", LEASE_MS)
        page = await store.audit(limit=2)
        assert page.checked == ("task-1", "task-2")
        assert [f.task_id for f in page.findings] == ["task-1", "task-2"]
        assert page.next_after == "task-2"
        rest = await store.audit(limit=2, after=page.next_after)
        assert (rest.checked, rest.findings, rest.next_after) == (("task-3",), (), None)


async def test_reap_works_in_bounded_batches(pg_schemas: SchemaFactory) -> None:
    schema = await pg_schemas.migrated()
    clock = ManualClock()
    async with pg_store(pg_schemas, schema, clock=clock, reap_batch_size=3) as store:
        for n in range(7):
            await create(store, f"task-{6 - n}", ttl_ms=1000)  # expiry order differs from ids
            clock.advance(1)
        await create(store, "keep", ttl_ms=None)
        clock.advance(60_000)
        batches = [await store.reap() for _ in range(4)]
        assert batches == [["task-4", "task-5", "task-6"], ["task-1", "task-2", "task-3"],
                           ["task-0"], []]  # fmt: skip
        get = await store.authorize(A, Action.GET, "keep")
        assert isinstance(await store.get("keep", get), Snapshot)


# -- schema 1 rows through migrations 0002 (steps) and 0003 (queue) ----------------------------


def _copy_schema_1_rows(dsn: str, source: str, target: str) -> None:
    """Copy the store id and every task and ledger row of ``source`` into ``target`` (a schema
    built by 0001 alone), with only the columns schema 1 has: rows as schema 1 wrote them."""
    with connect(dsn) as conn, conn.transaction():
        (store_id,) = conn.execute(
            sql.SQL("SELECT store_id FROM {}.store_metadata").format(sql.Identifier(source))
        ).fetchone() or (None,)
        conn.execute(
            sql.SQL("UPDATE {}.store_metadata SET store_id = %s").format(sql.Identifier(target)),
            (store_id,),
        )
        for table in ("tasks", "task_events"):
            names = [
                str(row[0])
                for row in conn.execute(
                    "SELECT column_name FROM information_schema.columns"
                    " WHERE table_schema = %s AND table_name = %s ORDER BY ordinal_position",
                    (target, table),
                )
            ]
            columns = sql.SQL(", ").join(sql.Identifier(n) for n in names)
            conn.execute(
                sql.SQL("INSERT INTO {}.{} ({}) SELECT {} FROM {}.{}").format(
                    sql.Identifier(target),
                    sql.Identifier(table),
                    columns,
                    columns,
                    sql.Identifier(source),
                    sql.Identifier(table),
                )
            )


async def test_schema_1_rows_survive_the_steps_and_queue_migrations(
    pg_schemas: SchemaFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows written under schema 1 (a retried task with an answered input, a task waiting for
    input, a completed task) read back exactly after ``migrate`` applies 0002 to 0004; the
    tasks then record steps and suspend (the ledger's widened kind check, the v4 record, the
    claim projection) and the queue columns of the old rows are NULL."""
    clock = ManualClock()
    current = await pg_schemas.migrated()
    async with pg_store(pg_schemas, current, clock=clock) as store:
        await create(store, "task-1", policy=RetryPolicy([5000]))
        worker = WorkerAuthority(await claimed(store, "task-1"))
        await store.transition("task-1", 0, Event.input_requested("a", ASK, id="ask-1"), worker)
        update = RequestAuthority(await store.authorize(A, Action.UPDATE, "task-1"))
        answer = Event.input_responses_accepted({"a": {"ok": True}}, id="answer-1")
        await store.transition("task-1", 1, answer, update)
        await store.transition("task-1", 2, Event.retry_requested(ERROR, "again"), worker)
        await create(store, "task-2")
        worker_2 = WorkerAuthority(await claimed(store, "task-2"))
        await store.transition("task-2", 0, Event.input_requested("q", ASK), worker_2)
        await create(store, "task-3")
        worker_3 = WorkerAuthority(await claimed(store, "task-3"))
        await store.settle("task-3", 0, Event.completed({"done": 1}), worker_3.lease)
        ids = ("task-1", "task-2", "task-3")
        before = {}
        for task_id in ids:
            got = await store.get(task_id, await store.authorize(A, Action.GET, task_id))
            before[task_id] = (got, await store.history(task_id))
    old = pg_schemas.name()
    shipped = migrations.load_migrations()
    assert [m.version for m in shipped] == [1, 2, 3, 4]
    assert [m.name for m in shipped] == ["initial", "steps", "queue", "task_counts"]
    with monkeypatch.context() as patched:
        patched.setattr(migrations, "load_migrations", lambda: shipped[:1])
        assert (await migrate(pg_schemas.dsn, schema=old)).applied == (1,)
    await trio.to_thread.run_sync(_copy_schema_1_rows, pg_schemas.dsn, current, old)
    with pytest.raises(StoreSchemaError, match="this tritask needs 4"):
        await pg_store(pg_schemas, old, clock=clock).open()
    assert (await migrate(pg_schemas.dsn, schema=old)).applied == (2, 3, 4)
    async with pg_store(pg_schemas, old, clock=clock) as store:
        for task_id in ids:
            got = await store.get(task_id, await store.authorize(A, Action.GET, task_id))
            assert (got, await store.history(task_id)) == before[task_id]
        assert (await store.audit()).findings == ()
        clock.advance(LEASE_MS + 10)
        worker = WorkerAuthority(await claimed(store, "task-1"))
        step = Event.step_recorded("charge", "fp", {"result": {"id": "re_1"}}, id="step-1")
        recorded = await store.transition("task-1", 3, step, worker)
        assert isinstance(recorded, Transition) and recorded.outcome == "applied"
        assert recorded.snapshot.steps == {
            "charge": {"kind": "step", "fingerprint": "fp", "outcome": {"result": {"id": "re_1"}}}
        }
        worker_2 = WorkerAuthority(await claimed(store, "task-2"))
        suspended = await store.transition("task-2", 1, Event.suspended("q"), worker_2)
        assert isinstance(suspended, Transition) and suspended.outcome == "applied"
        await store.release(worker_2.lease)
        assert isinstance(await store.claim("task-2", "owner-2", LEASE_MS), Deferred)
        update = RequestAuthority(await store.authorize(A, Action.UPDATE, "task-2"))
        answered = await store.transition(
            "task-2", 2, Event.input_responses_accepted({"q": {"yes": True}}), update
        )
        assert isinstance(answered, Transition) and answered.snapshot.suspended_key is None
        resumed = await store.claim("task-2", "owner-2", LEASE_MS)
        assert isinstance(resumed, Claimed)
        assert resumed.snapshot.accepted_input_responses == {"q": {"yes": True}}
        kinds = [e.event.kind.value for e in await store.history("task-2")]
        assert kinds == ["input_requested", "suspended", "input_responses_accepted"]
    with connect(pg_schemas.dsn) as conn:
        rows = conn.execute(
            sql.SQL(
                "SELECT task_id, record_format, record::text, queued_message, concurrency_key"
                " FROM {}.tasks ORDER BY task_id"
            ).format(sql.Identifier(old))
        ).fetchall()
    assert [(r[0], r[1], r[3], r[4]) for r in rows] == [(t, 3, None, None) for t in ids]
    assert json.loads(rows[0][2])["version"] == 4
    assert json.loads(rows[0][2])["steps"] == recorded.snapshot.steps
    assert json.loads(rows[2][2])["version"] == 3  # untouched: still as schema 1 wrote it


async def test_a_schema_3_store_migrates_to_task_counts_with_identical_reads(
    pg_schemas: SchemaFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tasks in every status written at schema 3 (claimed, queued, waiting for input,
    completed, failed, cancelled, one past its TTL) read back exactly after ``migrate``
    applies 0004, which seeds ``task_counts`` with them; from then on the triggers keep the
    count that ``max_tasks`` admits against: creations add, ``reap`` subtracts."""
    clock = ManualClock()
    schema = pg_schemas.name()
    shipped = migrations.load_migrations()
    ids = ("claimed", "queued", "input", "completed", "failed", "cancelled", "expiring")
    with monkeypatch.context() as patched:
        patched.setattr(migrations, "load_migrations", lambda: shipped[:3])
        assert (await migrate(pg_schemas.dsn, schema=schema)).applied == (1, 2, 3)
        async with pg_store(
            pg_schemas, schema, clock=clock, max_tasks=None, max_active_tasks_per_scope=None
        ) as store:
            for task_id in ids:
                if task_id != "queued":
                    await create(store, task_id, ttl_ms=1_000 if task_id == "expiring" else None)
            access = await store.authorize(A, Action.CREATE, "queued")
            work = Work(idempotency_key="queued", type="contract", input={})
            queued = await store.submit(
                new_task("queued", 0, None, None), work, access, owner_id=None, lease_ms=LEASE_MS
            )
            assert isinstance(queued, Snapshot)
            await claimed(store, "claimed")
            lease = await claimed(store, "input")
            await store.transition(
                "input", 0, Event.input_requested("a", ASK), WorkerAuthority(lease)
            )
            lease = await claimed(store, "completed")
            await store.settle("completed", 0, Event.completed({"done": 1}), lease)
            lease = await claimed(store, "failed")
            await store.settle("failed", 0, Event.failed(ERROR, "no"), lease)
            cancel = RequestAuthority(await store.authorize(A, Action.CANCEL, "cancelled"))
            await store.transition("cancelled", 0, Event.cancelled(), cancel)
            before = {}
            for task_id in ids:
                got = await store.get(task_id, await store.authorize(A, Action.GET, task_id))
                before[task_id] = (
                    got,
                    await store.history(task_id),
                    await store.inspect_task(task_id),
                )
            statuses = {task_id: before[task_id][0].task.status.value for task_id in ids}  # type: ignore[union-attr]
            assert sorted(set(statuses.values())) == [
                "cancelled", "completed", "failed", "input_required", "working"
            ]  # fmt: skip
    with pytest.raises(StoreSchemaError, match="this tritask needs 4"):
        await pg_store(pg_schemas, schema, clock=clock).open()
    assert (await migrate(pg_schemas.dsn, schema=schema)).applied == (4,)

    def counts() -> list[tuple[Any, ...]]:
        with connect(pg_schemas.dsn) as conn:
            return conn.execute(
                sql.SQL(
                    "SELECT count(*), sum(tasks)::bigint, (SELECT count(*) FROM {}.tasks)"
                    " FROM {}.task_counts"
                ).format(sql.Identifier(schema), sql.Identifier(schema))
            ).fetchall()

    assert await trio.to_thread.run_sync(counts) == [(16, len(ids), len(ids))]
    async with pg_store(pg_schemas, schema, clock=clock, max_tasks=len(ids) + 1) as store:
        for task_id in ids:
            got = await store.get(task_id, await store.authorize(A, Action.GET, task_id))
            after = (got, await store.history(task_id), await store.inspect_task(task_id))
            assert after == before[task_id]
        assert (await store.audit()).findings == ()
        await create(store, "one-more")
        with pytest.raises(CapacityExceeded) as refused:
            await create(store, "too-many")
        assert refused.value.limit == "max_tasks"
        assert await trio.to_thread.run_sync(counts) == [(16, len(ids) + 1, len(ids) + 1)]
        clock.advance(1_000)
        assert await store.reap() == ["expiring"]
        assert await trio.to_thread.run_sync(counts) == [(16, len(ids), len(ids))]
        await create(store, "room-again")
        assert await trio.to_thread.run_sync(counts) == [(16, len(ids) + 1, len(ids) + 1)]


async def test_task_counts_are_seeded_exactly_whatever_the_default_isolation(
    pg_schemas: SchemaFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """0004 seeds ``task_counts`` with ``count(*)`` after ``LOCK TABLE tasks``, which waits for
    the writers in flight: the count must see what they committed meanwhile. On a database or
    role whose ``default_transaction_isolation`` is ``repeatable read`` the migration's snapshot
    would be its first statement's, taken before the lock, and the count one short for good
    (``max_tasks`` admitting one task too many forever): ``migrate`` runs at READ COMMITTED."""
    schema = pg_schemas.name()
    shipped = migrations.load_migrations()
    with monkeypatch.context() as patched:
        patched.setattr(migrations, "load_migrations", lambda: shipped[:3])
        assert (await migrate(pg_schemas.dsn, schema=schema)).applied == (1, 2, 3)
        async with pg_store(
            pg_schemas, schema, max_tasks=None, max_active_tasks_per_scope=None
        ) as store:
            await create(store, "first")
    ident = sql.Identifier(schema)
    writer = psycopg.Connection.connect(pg_schemas.dsn, connect_timeout=5)  # in a transaction
    migrator = connect(pg_schemas.dsn)
    try:
        migrator.execute("SET default_transaction_isolation = 'repeatable read'")
        # A host of the previous release inserting a task, not yet committed.
        writer.execute(
            sql.SQL(
                "INSERT INTO {}.tasks SELECT (jsonb_populate_record(t,"
                " jsonb_build_object('task_id', 'second'))).* FROM {}.tasks t"
                " WHERE task_id = 'first'"
            ).format(ident, ident)
        )
        (migrator_pid,) = migrator.execute("SELECT pg_backend_pid()").fetchone() or (None,)
        outcome: list[object] = []
        thread = threading.Thread(
            target=lambda: outcome.append(migrations.migrate_connection(migrator, schema))
        )
        thread.start()
        with connect(pg_schemas.dsn) as watcher:
            for _ in range(500):  # until the migration waits for the writer's lock
                waiting = watcher.execute(
                    "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s",
                    (migrator_pid,),
                ).fetchone()
                if waiting is not None and waiting[0]:
                    break
                await trio.sleep(0.01)
            else:
                raise AssertionError("the migration never waited for the writer")
        writer.commit()
        await trio.to_thread.run_sync(thread.join)
        assert [getattr(r, "applied", r) for r in outcome] == [(4,)]
    finally:
        writer.close()
        migrator.close()
    with connect(pg_schemas.dsn) as conn:
        counted = conn.execute(
            sql.SQL(
                "SELECT sum(tasks)::bigint, (SELECT count(*) FROM {}.tasks) FROM {}.task_counts"
            ).format(ident, ident)
        ).fetchone()
    assert counted == (2, 2)


async def test_task_counts_stay_exact_across_hosts_and_every_writing_path(
    pg_schemas: SchemaFactory,
) -> None:
    """The sum of ``task_counts`` is ``count(*)`` of ``tasks`` after every path that writes
    tasks, run concurrently by two hosts (one limited, one not: different backends, so different
    count rows or the same one, whichever their pids give): creations one by one and in batches
    (stamped and claimed, and not), creations refused (an existing id, in a batch
    beside admitted ones; ``max_tasks``), status changes (settle, cancel), reaping of expired
    tasks (their ledgers go by cascade) and a ``TRUNCATE``."""
    schema = await pg_schemas.migrated()
    clock = ManualClock()
    ident = sql.Identifier(schema)

    def counted() -> tuple[Any, ...]:
        with connect(pg_schemas.dsn) as conn:
            found = conn.execute(
                sql.SQL(
                    "SELECT sum(tasks)::bigint, (SELECT count(*) FROM {}.tasks) FROM {}.task_counts"
                ).format(ident, ident)
            ).fetchone()
        assert found is not None
        return tuple(found)

    limited = pg_store(
        pg_schemas,
        schema,
        clock=clock,
        max_tasks=70,
        max_active_tasks_per_scope=None,
        reap_batch_size=7,
    )
    free = pg_store(
        pg_schemas, schema, clock=clock, max_tasks=None, max_active_tasks_per_scope=None
    )
    async with limited, free:
        made: list[str] = []
        refused: list[str] = []

        async def make(store: PostgresStore, task_id: str, ttl_ms: int | None) -> None:
            try:
                if task_id.endswith("-claimed"):
                    access = await store.authorize(A, Action.CREATE, task_id)
                    work = Work(idempotency_key=task_id, type="contract", input={})
                    task = new_task(task_id, await store.now(), ttl_ms, 5)
                    await store.create_claimed_stamped(task, work, access, "owner-1", LEASE_MS)
                else:
                    await create(store, task_id, ttl_ms=ttl_ms)
            except (AlreadyExists, CapacityExceeded) as exc:
                refused.append(type(exc).__name__)
            else:
                made.append(task_id)

        async with trio.open_nursery() as nursery:
            for n in range(40):
                for host, store in (("l", limited), ("f", free)):
                    suffix = "-claimed" if n % 3 == 0 else ""
                    ttl = 1_000 if n % 2 else None
                    nursery.start_soon(make, store, f"{host}{n}{suffix}", ttl)
                    nursery.start_soon(make, store, f"both{n}{suffix}", ttl)  # one host wins
        assert len(made) == len(set(made)) and len(made) + len(refused) == 160
        assert {"AlreadyExists", "CapacityExceeded"} <= set(refused)  # both refusals happened
        rows = len(made)
        assert await trio.to_thread.run_sync(counted) == (rows, rows)
        # Settles and cancellations change statuses, not the number of tasks.
        lease = await claimed(free, "f1")
        assert isinstance(await limited.settle("f1", 0, Event.completed({}), lease), Transition)
        cancel = RequestAuthority(await limited.authorize(A, Action.CANCEL, "f2"))
        await limited.transition("f2", 0, Event.cancelled(), cancel)
        assert await trio.to_thread.run_sync(counted) == (rows, rows)
        clock.advance(2_000)  # the odd ones expire: both hosts reap them at once
        reaped: list[list[str]] = []

        async def reap(store: PostgresStore) -> None:
            while batch := await store.reap():
                reaped.append(batch)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reap, limited)
            nursery.start_soon(reap, free)
        gone = sorted(task_id for batch in reaped for task_id in batch)
        assert len(gone) == len(set(gone)) > 0
        assert await trio.to_thread.run_sync(counted) == (rows - len(gone), rows - len(gone))
    with connect(pg_schemas.dsn) as conn:
        conn.execute(sql.SQL("TRUNCATE {}.tasks CASCADE").format(ident))
    assert await trio.to_thread.run_sync(counted) == (0, 0)
