"""SqliteStore runs the whole reusable Store contract suite, one fresh database file per store."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from tritask_sqlite import SqliteStore

from tritask.tasks.store import DatabaseBusy, Scope, Store
from tritask.testing.store_contract import ManualClock, StoreContract

pytestmark = [
    pytest.mark.contract("tasks-durable-store"),
    pytest.mark.contract("tasks-store-hardening"),
]


class TestSqliteStoreContract(StoreContract):
    #: The store's writer process (the ``sqlite:`` URL form's default); off in code by default.
    writer_process = False

    @pytest.fixture(autouse=True)
    def _database_dir(self, tmp_path: Path) -> None:
        self._dir = tmp_path
        self._names = itertools.count(1)

    async def make_store(
        self,
        *,
        scope: Scope,
        clock: ManualClock,
        max_tasks: int | None,
        max_active_tasks_per_scope: int | None,
    ) -> Store:
        return SqliteStore(
            self._dir / f"store-{next(self._names)}.db",
            scope=scope,
            clock=clock,
            max_tasks=max_tasks,
            max_active_tasks_per_scope=max_active_tasks_per_scope,
            writer_process=self.writer_process,
        )

    def retryable(self, exc: BaseException) -> bool:
        return isinstance(exc, DatabaseBusy)


class TestSqliteStoreWriterContract(TestSqliteStoreContract):
    """The same contract with the writer process in the path (as ``tritask serve`` runs it):
    creations and planned settles committed by the child, everything else on the store's
    connection, both on one file."""

    writer_process = True
