"""Helpers the SQLite store's test modules share (imported by bare name: pytest puts this
directory on ``sys.path``)."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import trio
from tritask_sqlite import SqliteStore

from tritask.tasks.model import Snapshot, new_task
from tritask.tasks.store import Action, Claimed
from tritask.tasks.work import Work
from tritask.testing.store_contract import tenant

A = tenant("tenant-a")
LEASE_MS = 30_000


@contextlib.contextmanager
def raw(path: str | Path) -> Iterator[sqlite3.Connection]:
    """A plain connection for inspecting or tampering with the file behind the store's back."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        yield conn
    finally:
        conn.close()


async def get(store: SqliteStore, task_id: str) -> Snapshot:
    snapshot = await store.get(task_id, await store.authorize(A, Action.GET, task_id))
    assert isinstance(snapshot, Snapshot), snapshot
    return snapshot


async def created_claimed(
    store: SqliteStore, task_id: str, work_input: dict[str, Any] | None = None
) -> Claimed:
    access = await store.authorize(A, Action.CREATE, task_id)
    task = new_task(task_id, 0, 60_000, 5)
    given = {"taskId": task_id, "n": [1, 2]} if work_input is None else work_input
    work = Work(idempotency_key=task_id, type="contract", input=given)
    return await store.create_claimed_stamped(task, work, access, "owner-1", LEASE_MS)


async def created_claimed_together(
    store: SqliteStore, task_ids: Iterable[str]
) -> dict[str, Claimed]:
    """``created_claimed`` for each id, all at once (so the store can batch them)."""
    claims: dict[str, Claimed] = {}

    async def make(task_id: str) -> None:
        claims[task_id] = await created_claimed(store, task_id)

    async with trio.open_nursery() as nursery:
        for task_id in task_ids:
            nursery.start_soon(make, task_id)
    return claims
