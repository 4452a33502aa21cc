"""A crash in the middle of group commits loses nothing that was acknowledged.

A writer process (``ack_writer.py``) runs 32 concurrent creators and settlers on one store, so
the store batches their operations into shared commits, and prints each write only after its
caller was told of it. The test SIGKILLs it mid-stream, several times on the same database,
then checks that every acknowledged creation exists and every acknowledged settle is
completed, with its ledger entry. Writes that were not acknowledged may or may not be there.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
from postgres_support import SchemaFactory, pg_schemas, postgres_dsn  # noqa: F401
from tritask_postgres import PostgresStore, migrate
from tritask_sqlite import SqliteStore

from tritask.tasks.events import EventKind
from tritask.tasks.store import TaskInspection

HERE = Path(__file__).parent
WRITER = HERE / "ack_writer.py"
KILLS = 3
ACKS_BEFORE_KILL = 400  # settles acknowledged before each kill

pytestmark = [pytest.mark.slow]


def _kill_after_acks(argv: list[str]) -> tuple[set[str], set[str]]:
    """Run the writer until it acknowledged ``ACKS_BEFORE_KILL`` settles, then SIGKILL it."""
    process = subprocess.Popen(
        [sys.executable, str(WRITER), *argv], stdout=subprocess.PIPE, text=True
    )
    created: set[str] = set()
    settled: set[str] = set()
    try:
        assert process.stdout is not None
        for line in process.stdout:
            word, _, task_id = line.strip().partition(" ")
            if word == "created":
                created.add(task_id)
            elif word == "settled":
                settled.add(task_id)
                if len(settled) >= ACKS_BEFORE_KILL:
                    break
    finally:
        process.kill()  # SIGKILL: mid-batch, with operations queued and running
        process.wait(30)
        if process.stdout is not None:
            process.stdout.close()
    assert len(settled) >= ACKS_BEFORE_KILL, "the writer stopped before it was killed"
    return created, settled


async def _check(store: Any, created: set[str], settled: set[str]) -> None:
    async with store:
        for task_id in sorted(created):
            ledger = await store.history(task_id)
            inspection = await store.inspect_task(task_id)
            assert isinstance(inspection, TaskInspection), (task_id, "acknowledged, then lost")
            kinds = [entry.event.kind for entry in ledger]
            if task_id in settled:
                assert kinds == [EventKind.COMPLETED], (task_id, kinds)
                assert inspection.task.snapshot.task.status.value == "completed"
                assert inspection.task.claim is None
            else:
                assert kinds in ([], [EventKind.COMPLETED]), (task_id, kinds)


async def test_sigkill_mid_batch_loses_no_acknowledged_write_on_sqlite(tmp_path: Path) -> None:
    db = tmp_path / "acks.db"
    created: set[str] = set()
    settled: set[str] = set()
    for _ in range(KILLS):
        more_created, more_settled = await trio.to_thread.run_sync(
            _kill_after_acks, ["sqlite", str(db)]
        )
        created |= more_created
        settled |= more_settled
    await _check(SqliteStore(db, scope="shared"), created, settled)


async def test_sigkill_mid_batch_loses_no_acknowledged_write_on_postgresql(
    postgres_dsn: str,  # noqa: F811
    pg_schemas: SchemaFactory,  # noqa: F811
) -> None:
    schema = pg_schemas.name()
    await migrate(postgres_dsn, schema=schema)
    created: set[str] = set()
    settled: set[str] = set()
    for _ in range(KILLS):
        more_created, more_settled = await trio.to_thread.run_sync(
            _kill_after_acks, ["postgresql", postgres_dsn, schema]
        )
        created |= more_created
        settled |= more_settled
    await _check(PostgresStore(postgres_dsn, schema=schema, scope="shared"), created, settled)
