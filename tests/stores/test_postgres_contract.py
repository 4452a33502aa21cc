"""PostgresStore: the reusable store contract suite against a real PostgreSQL server.

Every store the suite makes gets its own freshly migrated schema (so two stores in one test are
distinct stores, as the suite requires). The suite's ``ManualClock`` is injected with
``clock=``: the store sends its readings where production SQL reads ``clock_timestamp()``,
which is what makes ``advance(ms)`` move "database time" exactly.
"""

from __future__ import annotations

import pytest
from postgres_support import SchemaFactory, pg_schemas, postgres_dsn
from tritask_postgres import PostgresStore

from tritask.tasks.store import Scope, Store
from tritask.testing.store_contract import ManualClock, StoreContract

__all__ = ["pg_schemas", "postgres_dsn"]  # the fixtures this module uses

pytestmark = [pytest.mark.postgres, pytest.mark.contract("tasks-durable-store")]


class TestPostgresStoreContract(StoreContract):
    @pytest.fixture(autouse=True)
    def _schemas(self, pg_schemas: SchemaFactory) -> None:
        self.schemas = pg_schemas

    async def make_store(
        self,
        *,
        scope: Scope,
        clock: ManualClock,
        max_tasks: int | None,
        max_active_tasks_per_scope: int | None,
    ) -> Store:
        return PostgresStore(
            self.schemas.dsn,
            schema=await self.schemas.migrated(),
            scope=scope,
            clock=clock,
            max_tasks=max_tasks,
            max_active_tasks_per_scope=max_active_tasks_per_scope,
            pool_size=4,
        )
