"""The raw limit of a store: a minimal loop of fenced durable commits straight on the database.

``commits`` is the number of durable commits tritask itself made per task in the same run (the
store writes its server counted: one per ``create_claimed(_stamped)``, applied ``transition``,
``release`` or ``settle`` that released, ...; reads such as ``now()`` commit nothing). With
settle-and-release and stamped creation that is 2: the insertion (created already claimed) and
the final event with the release. The loop does exactly as many, never fewer.

Per task it does what the store must at least do, and no more: one ``INSERT`` commit, then
``commits - 1`` fenced ``UPDATE … WHERE task_id = ? AND generation = ? AND owner = ?`` commits
(each checked for exactly one row), every one its own transaction, with the store's durability
settings, and through the store's own way of reaching the database, so the loop pays the same
per-statement cost and nothing else:

* SQLite: WAL, the same ``synchronous``, one connection, each commit one autocommitted
  statement (as the store's creation and planned settle are) in a ``trio.to_thread`` hop (the
  store's lane runs its statements in such hops too).
* PostgreSQL: the server's ``synchronous_commit``, ``connections`` concurrent connections,
  each statement autocommitted (one round trip per commit, the least there is) through the
  store's non-blocking libpq driver on the trio thread (``tritask_postgres._native``).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sqlite3
import tempfile
import time
import uuid
from typing import Any

import trio

from tritask.tasks.model import new_task, snapshot_to_json
from tritask.tasks.stores import store_scheme

__all__ = ["raw_limit", "raw_memory", "raw_postgres", "raw_sqlite"]

START = 1_787_565_600_000_000


def _document(task_id: str) -> str:
    """A JSON document the size of a real aggregate record."""
    from tritask.tasks.model import initial_snapshot
    from tritask.tasks.work import Work

    task = new_task(task_id, START, 3_600_000, 250)
    work = Work(idempotency_key=task_id, type="tools/call", input={"name": "noop", "arguments": {}})
    return json.dumps(snapshot_to_json(initial_snapshot(task, work)), separators=(",", ":"))


async def raw_sqlite(
    tasks: int, commits: int, *, synchronous: str = "FULL", path: str | None = None
) -> dict[str, Any]:
    owned = path is None
    if path is None:
        handle, path = tempfile.mkstemp(prefix="tritask-raw-", suffix=".db")
        os.close(handle)
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=5.0)
    try:
        conn.execute("PRAGMA busy_timeout = 5000")
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute(f"PRAGMA synchronous = {synchronous}")
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute(
            "CREATE TABLE IF NOT EXISTS raw_tasks (task_id TEXT PRIMARY KEY, owner TEXT,"
            " generation INTEGER NOT NULL, doc TEXT NOT NULL)"
        )
        lock = trio.Lock()
        doc = _document("raw")

        def insert(task_id: str) -> None:
            conn.execute(
                "INSERT INTO raw_tasks (task_id, owner, generation, doc) VALUES (?, ?, 0, ?)",
                (task_id, "raw", doc),
            )

        def fenced(task_id: str, generation: int) -> None:
            cursor = conn.execute(
                "UPDATE raw_tasks SET generation = generation + 1, doc = ?"
                " WHERE task_id = ? AND generation = ? AND owner = ?",
                (doc, task_id, generation, "raw"),
            )
            if cursor.rowcount != 1:
                raise RuntimeError("fenced update matched no row")

        prefix = uuid.uuid4().hex[:8]
        started = time.perf_counter()
        for n in range(tasks):
            task_id = f"{prefix}-{n}"
            async with lock:
                await trio.to_thread.run_sync(insert, task_id)
            for generation in range(commits - 1):
                async with lock:
                    await trio.to_thread.run_sync(fenced, task_id, generation)
        elapsed = time.perf_counter() - started
    finally:
        conn.close()
        if owned:
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(OSError):
                    os.unlink(path + suffix)
    return {
        "tasksPerSecond": round(tasks / elapsed, 1),
        "commitsPerSecond": round(tasks * commits / elapsed, 1),
        "seconds": round(elapsed, 4),
        "settings": {"journal_mode": "WAL", "synchronous": synchronous, "connections": 1},
    }


async def raw_postgres(
    dsn: str, tasks: int, commits: int, *, connections: int = 4
) -> dict[str, Any]:
    import psycopg

    native: Any = importlib.import_module("tritask_postgres._native")
    table = f"tritask_bench_raw_{uuid.uuid4().hex[:12]}"
    limiter = trio.CapacityLimiter(connections)
    conns = [
        await trio.to_thread.run_sync(
            lambda: psycopg.connect(dsn, autocommit=True, client_encoding="utf8")
        )
        for _ in range(connections)
    ]
    try:
        setup = conns[0]

        def create() -> str:
            setup.execute(
                f"CREATE TABLE {table} (task_id text PRIMARY KEY, owner text,"
                " generation bigint NOT NULL, doc jsonb NOT NULL)"
            )
            row = setup.execute("SHOW synchronous_commit").fetchone()
            return str(row[0]) if row else "?"

        synchronous_commit = await trio.to_thread.run_sync(create)
        sessions = [native.Session(conn, limiter) for conn in conns]
        insert = native.statement(
            f"INSERT INTO {table} (task_id, owner, generation, doc)"
            " VALUES (%(task_id)s, %(owner)s, 0, %(doc)s)"
        )
        fenced = native.statement(
            f"UPDATE {table} SET generation = generation + 1, doc = %(doc)s"
            " WHERE task_id = %(task_id)s AND generation = %(generation)s AND owner = %(owner)s"
        )
        doc = _document("raw")
        prefix = uuid.uuid4().hex[:8]
        counter = iter(range(tasks))

        async def worker(session: Any) -> None:
            for n in counter:
                task_id = f"{prefix}-{n}"
                await session.execute(insert, {"task_id": task_id, "owner": "raw", "doc": doc})
                for generation in range(commits - 1):
                    params = {"doc": doc, "task_id": task_id, "generation": generation}
                    done = await session.execute(fenced, {**params, "owner": "raw"})
                    if done.rowcount != 1:
                        raise RuntimeError("fenced update matched no row")

        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for session in sessions:
                nursery.start_soon(worker, session)
        elapsed = time.perf_counter() - started
        await trio.to_thread.run_sync(setup.execute, f"DROP TABLE {table}")
    finally:
        for conn in conns:
            conn.close()
    return {
        "tasksPerSecond": round(tasks / elapsed, 1),
        "commitsPerSecond": round(tasks * commits / elapsed, 1),
        "seconds": round(elapsed, 4),
        "settings": {
            "synchronous_commit": synchronous_commit,
            "connections": connections,
            "driver": "libpq non-blocking on the trio thread (the store's own)",
        },
    }


async def raw_memory(tasks: int) -> dict[str, Any]:
    """The memory store's own limit: its operations called directly, no runner, no HTTP."""
    from tritask.tasks.events import Event
    from tritask.tasks.memory import MemoryStore
    from tritask.tasks.store import (
        Action,
        Claimed,
        CreatesClaimed,
        WorkerAuthority,
        settles,
        stamps_creation,
    )
    from tritask.tasks.work import Work

    store = MemoryStore(scope="shared", max_tasks=None, max_active_tasks_per_scope=None)
    result = {"content": [], "isError": False}
    # Any store: the same operations the runner uses, the combined ones when offered.
    generic: Any = store
    stamped, settling = stamps_creation(generic), settles(generic)
    operations = [
        "authorize",
        "create_claimed_stamped" if stamped else "now, create(+claim)",
        "settle" if settling else "transition, release",
    ]
    started = time.perf_counter()
    async with store:
        for n in range(tasks):
            task_id = f"raw-{n}"
            access = await store.authorize(None, Action.CREATE, task_id)
            work = Work(idempotency_key=task_id, type="noop", input={})
            claimed: Any
            if stamped:
                task = new_task(task_id, 0, None, None)
                claimed = await generic.create_claimed_stamped(task, work, access, "raw", 30_000)
            else:
                task = new_task(task_id, await store.now(), None, None)
                if isinstance(generic, CreatesClaimed):
                    claimed = await generic.create_claimed(task, work, access, "raw", 30_000)
                else:
                    await store.create(task, work, access)
                    claimed = await store.claim(task_id, "raw", 30_000)
            assert isinstance(claimed, Claimed)
            event = Event.completed(result)
            if settling:
                await generic.settle(task_id, 0, event, claimed.lease)
            else:
                await store.transition(task_id, 0, event, WorkerAuthority(claimed.lease))
                await store.release(claimed.lease)
    elapsed = time.perf_counter() - started
    return {
        "tasksPerSecond": round(tasks / elapsed, 1),
        "seconds": round(elapsed, 4),
        "settings": {"operations": ", ".join(operations)},
    }


def _scratch_file_beside(url: str) -> str:
    """A new file in the store's own directory (so both loops write to the same disk)."""
    sqlite: Any = importlib.import_module("tritask_sqlite")
    directory = os.path.dirname(os.path.abspath(sqlite.path_from_url(url)))
    handle, path = tempfile.mkstemp(prefix="tritask-raw-", suffix=".db", dir=directory)
    os.close(handle)
    return path


async def raw_limit(
    url: str, tasks: int, commits: int, *, sqlite_synchronous: str, pg_connections: int
) -> dict[str, Any]:
    scheme = store_scheme(url)
    if scheme == "sqlite":
        path = _scratch_file_beside(url)
        try:
            return await raw_sqlite(tasks, commits, synchronous=sqlite_synchronous, path=path)
        finally:
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(OSError):
                    os.unlink(path + suffix)
    if scheme in ("postgresql", "postgres"):
        migrations: Any = importlib.import_module("tritask_postgres._migrations")
        dsn, _ = migrations.split_store_url(url)
        return await raw_postgres(dsn, tasks, commits, connections=pg_connections)
    return await raw_memory(tasks)
