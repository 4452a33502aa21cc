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

from tritask.testing.store_contract import by_tenant

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


async def test_claim_next_reads_the_key_claims_index_as_the_table_grows(
    pg_schemas: SchemaFactory,  # noqa: F811
) -> None:
    """``claim_next`` counts every key's live claims first. Planned on a nearly empty table,
    that count was a scan of the table, kept as the table grew: every claim read every
    task. One connection, so every statement runs under the plans the first claims made."""
    schema = await pg_schemas.migrated()
    name = f"plans-{schema}"
    store = PostgresStore(
        pg_schemas.dsn,
        schema=schema,
        scope=by_tenant,
        pool_size=1,
        max_active_tasks_per_scope=None,
        application_name=name,
    )
    async with store:
        for n in range(8):  # the plans are made here (a generic one after five executions)
            await create(store, f"early-{n}")
            assert await store.claim_next("worker", LEASE_MS) is not None

        async def creator(first: int) -> None:
            for n in range(first, GROWN, 16):
                await create(store, f"task-{n:04d}")

        async with trio.open_nursery() as nursery:
            for first in range(16):
                nursery.start_soon(creator, first)
        for _ in range(20):
            assert await store.claim_next("worker", LEASE_MS) is not None
    await assert_disconnected(pg_schemas.dsn, name)  # its statistics are flushed on exit
    read = await settled_scanned_rows(pg_schemas.dsn, schema)
    assert read < GROWN, f"{read} rows of tasks read by sequential scans"


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
