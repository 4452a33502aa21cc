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
from tritask_postgres._native import Statement
from tritask_postgres._store import _Queries

pytestmark = pytest.mark.postgres

#: The statements that find tasks by a list of ids: the batch's (``settle_planned`` and
#: ``insert_many_admitted`` in its one round trip, ``lock_many`` and ``batch_counts`` in two).
BY_IDS = ("settle_planned", "insert_many_admitted", "lock_many", "batch_counts")


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
