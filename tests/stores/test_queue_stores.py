"""The durable queue and concurrency keys on the SQL stores, beyond the contract: records written
by schema version 1 still decode after the migration, and a concurrency key holds across two
runners with store objects of their own (a SQLite file shared by two stores, one PostgreSQL
schema), which is what makes it hold across processes and hosts."""

from __future__ import annotations

import itertools
import sqlite3
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import trio
from postgres_support import SchemaFactory, connect, pg_schemas, postgres_dsn
from psycopg import sql
from tritask_postgres import PostgresStore, migrate
from tritask_postgres._migrations import load_migrations
from tritask_sqlite import SCHEMA_VERSION, SqliteStore
from tritask_sqlite.schema import APPLICATION_ID, migrations

from tritask.tasks.events import Event
from tritask.tasks.executor import Completed, ExecutionToken
from tritask.tasks.model import Snapshot, TaskStatus, initial_snapshot, new_task, snapshot_to_json
from tritask.tasks.runner import Runner
from tritask.tasks.store import (
    QUEUED_MESSAGE,
    UNAVAILABLE,
    Action,
    Claimed,
    Concurrency,
    Lease,
    Renewed,
    StaleLease,
    Store,
    WorkerAuthority,
)
from tritask.tasks.work import Work, canonical_json, stored_text
from tritask.testing.store_contract import START, ManualClock

__all__ = ["pg_schemas", "postgres_dsn"]

pytestmark = pytest.mark.contract("tasks-durable-store")

KEY = Concurrency(canonical_json(["export", "tenant-a"]), 2)


class _Anyone:
    principal = None


def v1_record(task_id: str) -> str:
    """A task's record as schema version 1 stored it (the record format did not change)."""
    task = new_task(task_id, START, 600_000, 100)
    work = Work(idempotency_key=task_id, type="job", input={"seconds": 0})
    return stored_text(snapshot_to_json(initial_snapshot(task, work)))


async def check_old_task(store: Store, task_id: str) -> None:
    """A task written before the queue existed reads, claims and settles as before."""
    access = await store.authorize(_Anyone(), Action.GET, task_id)
    old = await store.get(task_id, access)
    assert isinstance(old, Snapshot)
    assert (old.task.status, old.task.status_message) == (TaskStatus.WORKING, "Task accepted")
    assert old.task.created_at == START
    claimed = await store.claim_next("owner-1", 30_000)
    assert isinstance(claimed, Claimed)
    assert claimed.snapshot == old  # not a queued task: its record is left as it was
    assert claimed.lease.generation == 1
    done = await store.transition(
        task_id, 0, Event.completed({"v": 1}), WorkerAuthority(claimed.lease)
    )
    assert done.snapshot.task.status is TaskStatus.COMPLETED  # type: ignore[union-attr]


async def test_sqlite_records_of_schema_version_1_decode_after_the_migration(
    tmp_path: Path,
) -> None:
    path = tmp_path / "tasks.db"
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        for statement in migrations()[0].statements():
            conn.execute(statement)
        conn.execute(
            "INSERT INTO tritask_metadata (singleton, schema_version, store_id)"
            " VALUES (1, 1, '00000000-0000-4000-8000-000000000001')"
        )
        # Exactly the 14 columns version 1 had.
        conn.execute(
            "INSERT INTO tritask_tasks (task_id, record_version, record, scope, revision,"
            " status, created_at_us, expires_at_us, retry_at_us, claim_owner, claim_token,"
            " lease_generation, claim_expires_at_us, claim_epoch)"
            " VALUES (?, 3, ?, ?, 0, 'working', ?, ?, NULL, NULL, NULL, 0, NULL, NULL)",
            ("old-1", v1_record("old-1"), '{"value":null,"version":1}', START, START + 6 * 10**8),
        )
        conn.execute("COMMIT")
    finally:
        conn.close()
    async with SqliteStore(path, scope="shared", clock=lambda: START + 1000) as store:
        await check_old_task(store, "old-1")
    check = sqlite3.connect(path)
    try:
        assert check.execute("SELECT schema_version FROM tritask_metadata").fetchone() == (
            SCHEMA_VERSION,
        )
        assert check.execute(
            "SELECT queued_message, concurrency_key, concurrency_limit FROM tritask_tasks"
        ).fetchall() == [(None, None, None)]
    finally:
        check.close()


@pytest.mark.postgres
async def test_sqlite_claims_of_schema_version_3_stay_live_after_the_owner_lease_migration(
    tmp_path: Path,
) -> None:
    """A claim written by version 3 (its own expiry, no claim_follows column) is exactly as
    live after 0004_owner_leases: refused to others until its expiry, usable by its holder,
    renewed by a batch (then following the owner's row), claimable at the batch's expiry."""
    path = tmp_path / "tasks.db"
    token = "0123456789abcdef0123456789abcdef0123"
    expiry = START + 30_000_000
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        for migration in migrations()[:3]:
            for statement in migration.statements():
                conn.execute(statement)
        conn.execute(
            "INSERT INTO tritask_metadata (singleton, schema_version, store_id)"
            " VALUES (1, 3, '00000000-0000-4000-8000-000000000001')"
        )
        conn.execute(
            "INSERT INTO tritask_tasks (task_id, record_version, record, scope, revision,"
            " status, created_at_us, expires_at_us, retry_at_us, claim_owner, claim_token,"
            " lease_generation, claim_expires_at_us, claim_epoch)"
            " VALUES (?, 3, ?, ?, 0, 'working', ?, ?, NULL, 'owner-1', ?, 1, ?, 0)",
            (
                "old-1",
                v1_record("old-1"),
                '{"value":null,"version":1}',
                START,
                START + 6 * 10**8,
                token,
                expiry,
            ),
        )
        conn.execute("COMMIT")
    finally:
        conn.close()
    clock = ManualClock()
    async with SqliteStore(path, scope="shared", clock=clock) as store:
        assert store.boot_epoch == 0  # the epoch the claim was made in
        assert await store.claim("old-1", "owner-2", 30_000) is UNAVAILABLE
        lease = Lease(
            store_id=f"sqlite:{store.store_id}/0",
            task_id="old-1",
            owner_id="owner-1",
            token=token,
            generation=1,
            expires_at=expiry,
            epoch=0,
        )
        assert isinstance(await store.worker_snapshot("old-1", lease), Snapshot)
        clock.advance(10_000)
        (renewed,) = await store.renew_all("owner-1", [lease], 30_000)
        assert isinstance(renewed, Renewed)
        assert renewed.lease.expires_at == START + 40_000_000
        with pytest.raises(StaleLease):
            await store.worker_snapshot("old-1", lease)
        clock.advance(30_000 - 1)
        assert await store.claim("old-1", "owner-2", 30_000) is UNAVAILABLE
        clock.advance(1)
        adopted = await store.claim("old-1", "owner-2", 30_000)
        assert isinstance(adopted, Claimed) and adopted.lease.generation == 2
    check = sqlite3.connect(path)
    try:
        assert check.execute("SELECT schema_version FROM tritask_metadata").fetchone() == (
            SCHEMA_VERSION,
        )
        assert check.execute("SELECT claim_follows FROM tritask_tasks").fetchall() == [(0,)]
    finally:
        check.close()


async def test_postgres_records_of_schema_version_1_decode_after_the_migration(
    pg_schemas: SchemaFactory,
) -> None:
    schema = pg_schemas.name()
    first = load_migrations()[0]
    ident = sql.Identifier(schema)
    with connect(pg_schemas.dsn) as conn, conn.transaction():
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(ident))
        conn.execute(
            sql.SQL(
                "CREATE TABLE {}.schema_migrations (version integer PRIMARY KEY,"
                " name text NOT NULL, checksum text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"
            ).format(ident)
        )
        conn.execute(sql.SQL("SET LOCAL search_path TO {}").format(ident))
        conn.execute(first.sql.encode())
        conn.execute(
            "INSERT INTO schema_migrations (version, name, checksum) VALUES (1, %s, %s)",
            (first.name, first.checksum),
        )
        # Exactly the columns version 1 had.
        conn.execute(
            "INSERT INTO tasks (task_id, record, scope, revision, status, created_at_us,"
            " expires_at_us) VALUES ('old-1', %s::json, %s, 0, 'working', %s, %s)",
            (v1_record("old-1"), '{"value":null,"version":1}', START, START + 6 * 10**8),
        )
    result = await migrate(pg_schemas.dsn, schema=schema)
    assert result.applied == tuple(range(2, result.version + 1))
    async with PostgresStore(
        pg_schemas.dsn, schema=schema, scope="shared", clock=lambda: START + 1000
    ) as store:
        await check_old_task(store, "old-1")


# -- a concurrency key across two runners -------------------------------------------------------


class KeyedRecorder:
    """An executor counting how many attempts of each key run at once (in this process)."""

    def __init__(self) -> None:
        self.running: Counter[str] = Counter()
        self.peak: Counter[str] = Counter()
        self.done: list[str] = []
        self.owners: dict[str, str] = {}
        self.all_done = trio.Event()

    async def execute(self, work: Work, token: ExecutionToken, state: Any) -> Completed:
        key = str(work.input["key"])
        self.running[key] += 1
        self.peak[key] = max(self.peak[key], self.running[key])
        self.owners[token.task_id] = str(state)
        try:
            await trio.sleep(float(work.input["seconds"]))
        finally:
            self.running[key] -= 1
        self.done.append(token.task_id)
        if len(self.done) == 20:
            self.all_done.set()
        return Completed({"content": []})


async def run_keyed_tasks(stores: tuple[Store, Store]) -> KeyedRecorder:
    """Two runners (four slots each), one per store; 16 tasks of one key (limit 2) and four
    without a key, created alternately through both, all at once."""
    recorder = KeyedRecorder()
    runners = [
        Runner(
            store,
            executor=recorder,
            executor_state=f"runner-{n}",
            recover=True,
            recovery_interval_ms=50,
            reap_interval_ms=None,
            max_jobs=4,
        )
        for n, store in enumerate(stores)
    ]
    ids = itertools.count()
    async with runners[0], runners[1]:

        async def submit(runner: Runner, keyed: bool) -> None:
            task_id = f"task-{next(ids):02d}"
            access = await runner.store.authorize(_Anyone(), Action.CREATE, task_id)
            key = KEY.key if keyed else "none"
            work = Work(idempotency_key=task_id, type="job", input={"key": key, "seconds": 0.05})
            snapshot = await runner.create_task(
                new_task(task_id, 0, 600_000, 100),
                work,
                access,
                stamp=True,
                concurrency=KEY if keyed else None,
            )
            assert snapshot.task.status is TaskStatus.WORKING

        async with trio.open_nursery() as clients:
            for n in range(20):
                clients.start_soon(submit, runners[n % 2], n % 5 != 4)
        with trio.fail_after(60):
            await recorder.all_done.wait()
            # Each attempt's result is committed after its executor returns.
            while any(runner.statistics().jobs for runner in runners):  # noqa: ASYNC110
                await trio.sleep(0.01)
    return recorder


def check_keyed_run(recorder: KeyedRecorder) -> None:
    assert sorted(recorder.done) == [f"task-{n:02d}" for n in range(20)]  # each once
    assert recorder.peak[KEY.key] == 2  # the limit, reached and never passed
    assert set(recorder.owners.values()) == {"runner-0", "runner-1"}


async def test_a_concurrency_key_holds_across_two_sqlite_stores_on_one_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "tasks.db"
    options: dict[str, Any] = {"max_tasks": None, "max_active_tasks_per_scope": None}
    async with (
        SqliteStore(path, scope="shared", **options) as one,
        SqliteStore(path, scope="shared", **options) as two,
    ):
        check_keyed_run(await run_keyed_tasks((one, two)))
        queued = await one.authorize(_Anyone(), Action.GET, "task-19")
        last = await one.get("task-19", queued)
        assert isinstance(last, Snapshot)
        assert last.task.status is TaskStatus.COMPLETED
        assert last.task.status_message != QUEUED_MESSAGE


@pytest.mark.postgres
async def test_a_concurrency_key_holds_across_two_postgres_stores(
    pg_schemas: SchemaFactory,
) -> None:
    schema = await pg_schemas.migrated()
    options: dict[str, Any] = {
        "schema": schema,
        "scope": "shared",
        "max_tasks": None,
        "max_active_tasks_per_scope": None,
    }
    async with (
        PostgresStore(pg_schemas.dsn, **options) as one,
        PostgresStore(pg_schemas.dsn, **options) as two,
    ):
        check_keyed_run(await run_keyed_tasks((one, two)))
