"""The plans PostgreSQL caches for the store's batch statements probe the primary key.

A prepared statement's generic plan is made once and kept until the table's statistics
change. Made on a new table (the first batches of a new store), ``task_id = ANY(ids)`` and
``EXISTS (... task_id = b.task_id)`` were planned as a scan of the whole table or a hash of all
its ids, and without an autovacuum run the plan kept scanning the table as it grew. These
tests make each statement's generic plan on a new, empty schema, as the store's first batches
do, and read it with ``EXPLAIN``.
"""

from __future__ import annotations

import pytest
import trio
from postgres_support import SchemaFactory, connect, pg_schemas, postgres_dsn  # noqa: F401
from test_postgres import LEASE_MS, assert_disconnected, create
from tritask_postgres import PostgresStore
from tritask_postgres._native import Statement
from tritask_postgres._store import _Queries

from tritask.tasks.store import Renewed
from tritask.testing.store_contract import ManualClock, by_tenant

pytestmark = pytest.mark.postgres

#: The statements that find tasks by a list of ids: the batch's (``settle_planned`` and
#: ``insert_many_admitted`` in its one round trip, ``lock_many`` and ``batch_counts`` in two).
BY_IDS = ("settle_planned", "insert_many_admitted", "lock_many", "batch_counts")
GROWN = 2_000


def generic_plan(dsn: str, stmt: Statement) -> str:
    """``EXPLAIN`` of the statement's generic plan (the one a connection caches)."""
    with connect(dsn) as conn:
        conn.execute("SET plan_cache_mode = force_generic_plan")
        conn.execute(b"PREPARE probe AS " + stmt.text)
        nulls = ", ".join(["NULL"] * len(stmt.names))
        lines = [row[0] for row in conn.execute(f"EXPLAIN EXECUTE probe({nulls})")]
    return "\n".join(lines)


@pytest.mark.parametrize("name", BY_IDS)
async def test_a_new_tables_generic_plan_probes_the_primary_key(
    pg_schemas: SchemaFactory,  # noqa: F811
    name: str,
) -> None:
    schema = await pg_schemas.migrated()
    stmt = getattr(_Queries(schema, injected_clock=False), name)
    plan = await trio.to_thread.run_sync(generic_plan, pg_schemas.dsn, stmt)
    assert "Seq Scan on tasks " not in plan, plan
    assert "Hashed SubPlan" not in plan and "hashed SubPlan" not in plan, plan
    assert "using tasks_pkey on tasks" in plan, plan


async def test_renew_all_locks_its_rows_by_the_primary_key(
    pg_schemas: SchemaFactory,  # noqa: F811
) -> None:
    """The heartbeat's lock of the owner's rows probes the key; its ``UPDATE`` then finds the
    rows by their owner (a scan on a new table: once per heartbeat, not per task)."""
    schema = await pg_schemas.migrated()
    stmt = _Queries(schema, injected_clock=False).renew_all
    plan = await trio.to_thread.run_sync(generic_plan, pg_schemas.dsn, stmt)
    locked, _, rest = plan.partition("CTE n")
    assert "CTE locked" in locked and rest, plan
    assert "Seq Scan on tasks " not in locked, plan
    assert "using tasks_pkey on tasks" in locked, plan


def scanned_rows(dsn: str, schema: str) -> int:
    """Rows of the schema's ``tasks`` read by sequential scans, as the statistics say."""
    with connect(dsn) as conn:
        found = conn.execute(
            "SELECT seq_tup_read FROM pg_stat_user_tables"
            " WHERE schemaname = %s AND relname = 'tasks'",
            (schema,),
        ).fetchone()
    assert found is not None
    return int(found[0])


def one_connection_store(
    schemas: SchemaFactory, schema: str, clock: ManualClock | None = None
) -> PostgresStore:
    """A store with one pooled connection: every statement runs under the plans its first
    executions made."""
    return PostgresStore(
        schemas.dsn,
        schema=schema,
        scope=by_tenant,
        clock=clock,
        pool_size=1,
        max_active_tasks_per_scope=None,
        application_name=f"plans-{schema}",
    )


async def grow(store: PostgresStore, ttl_ms: int | None = 60_000) -> None:
    """``GROWN`` more tasks, queued, 16 creations at a time."""

    async def creator(first: int) -> None:
        for n in range(first, GROWN, 16):
            await create(store, f"task-{n:04d}", ttl_ms=ttl_ms)

    async with trio.open_nursery() as nursery:
        for first in range(16):
            nursery.start_soon(creator, first)


async def assert_no_table_scans(schemas: SchemaFactory, schema: str) -> None:
    """After the store closed: fewer rows of ``tasks`` read by sequential scans than one scan
    of the grown table would read."""
    await assert_disconnected(schemas.dsn, f"plans-{schema}")  # statistics flushed on exit
    read = await settled_scanned_rows(schemas.dsn, schema)
    assert read < GROWN, f"{read} rows of tasks read by sequential scans"


async def test_claim_next_reads_the_key_claims_index_as_the_table_grows(
    pg_schemas: SchemaFactory,  # noqa: F811
) -> None:
    """``claim_next`` counts every key's live claims first. Planned on a nearly empty table,
    that count was a scan of the table, kept as the table grew: every claim read every
    task (40,196 rows here)."""
    schema = await pg_schemas.migrated()
    async with one_connection_store(pg_schemas, schema) as store:
        for n in range(8):  # the plans are made here (a generic one after five executions)
            await create(store, f"early-{n}")
            assert await store.claim_next("worker", LEASE_MS) is not None
        await grow(store)
        for _ in range(20):
            assert await store.claim_next("worker", LEASE_MS) is not None
    await assert_no_table_scans(pg_schemas, schema)


async def test_renew_all_finds_its_rows_by_the_key_as_the_table_grows(
    pg_schemas: SchemaFactory,  # noqa: F811
) -> None:
    """The heartbeat's ``UPDATE`` found the owner's rows by a scan of the table, planned so
    on a new one and kept (20,144 rows here: a scan per heartbeat)."""
    schema = await pg_schemas.migrated()
    async with one_connection_store(pg_schemas, schema) as store:
        leases = []
        for n in range(8):
            await create(store, f"early-{n}")
            claimed = await store.claim_next("worker", LEASE_MS)
            assert claimed is not None
            leases.append(claimed.lease)
        for _ in range(8):
            renewed = await store.renew_all("worker", leases, LEASE_MS)
            leases = [result.lease for result in renewed if isinstance(result, Renewed)]
            assert len(leases) == 8
        await grow(store)
        for _ in range(10):
            renewed = await store.renew_all("worker", leases, LEASE_MS)
            leases = [result.lease for result in renewed if isinstance(result, Renewed)]
            assert len(leases) == 8
    await assert_no_table_scans(pg_schemas, schema)


async def test_reap_deletes_by_the_key_as_the_table_grows(
    pg_schemas: SchemaFactory,  # noqa: F811
) -> None:
    """``reap`` deleted its expired tasks with ``task_id = ANY(ids)``, planned on a new table
    as a scan of it and kept: every reap read every task (20,018 rows here)."""
    schema = await pg_schemas.migrated()
    clock = ManualClock()
    async with one_connection_store(pg_schemas, schema, clock) as store:

        async def reap_one(task_id: str) -> None:
            await create(store, task_id, ttl_ms=1_000)
            clock.advance(2_000)
            assert await store.reap() == [task_id]

        for n in range(8):
            await reap_one(f"early-{n}")
        await grow(store, ttl_ms=3_600_000)
        for n in range(10):
            await reap_one(f"late-{n}")
    await assert_no_table_scans(pg_schemas, schema)


async def settled_scanned_rows(dsn: str, schema: str) -> int:
    """``scanned_rows`` once two readings 0.2 s apart agree (the exited backends' statistics
    reach the view soon after they are gone)."""
    with trio.fail_after(5):
        before = -1
        while True:  # polling: the server announces no statistics
            read = await trio.to_thread.run_sync(scanned_rows, dsn, schema)
            if read == before:
                return read
            before = read
            await trio.sleep(0.2)
