"""``tritask tasks list|show|cancel|stats`` and ``tritask reap`` as real processes, on SQLite and
PostgreSQL: what they show is what the store holds, and a cancellation reaches the attempt that a
runner in another process is running (PostgreSQL: at once, by its wake-up; SQLite: at the
runner's next heartbeat).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from postgres_support import SchemaFactory, pg_schemas, postgres_dsn
from tritask_postgres import PostgresStore
from tritask_sqlite import SqliteStore

from tritask.tasks import format_instant
from tritask.tasks import instrumentation as ins
from tritask.tasks.events import Event
from tritask.tasks.executor import Completed, ExecutionToken
from tritask.tasks.instrumentation import RecordingInstrumentation
from tritask.tasks.model import TaskStatus, new_task
from tritask.tasks.runner import Runner
from tritask.tasks.store import (
    Action,
    Claimed,
    ListsTasks,
    Store,
    TaskInspection,
    WorkerAuthority,
    lists_tasks,
)
from tritask.tasks.work import RetryPolicy, Work

__all__ = ["pg_schemas", "postgres_dsn"]

ERROR = {"code": -32000, "message": "upstream down", "data": {"secret": "s3cr3t"}}


@attrs.define
class Target:
    """One store kind: its URL for the CLI, and how the test opens the same store."""

    kind: str
    url: str
    make: Any

    def store(self) -> Store:
        store: Store = self.make()
        return store


def _principal(ctx: Any) -> Any:
    return ctx


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def target(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    if request.param == "sqlite":
        path = tmp_path / "tasks.db"
        return Target(
            "sqlite",
            f"sqlite:{path}",
            lambda: SqliteStore(path, scope=_principal, exclusive=False),
        )
    schemas: SchemaFactory = request.getfixturevalue("pg_schemas")
    schema = await schemas.migrated()
    return Target(
        "postgres",
        f"{schemas.dsn}?schema={schema}",
        lambda: PostgresStore(schemas.dsn, schema=schema, scope=_principal, pool_size=2),
    )


async def tritask(*argv: str) -> subprocess.CompletedProcess[bytes]:
    return await trio.run_process(
        [sys.executable, "-m", "tritask", *argv],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        env={**os.environ, "TRITASK_STORE": "memory:"},
    )


async def cli_json(target: Target, *argv: str, code: int = 0) -> Any:
    done = await tritask(*argv, "--store", target.url, "--json")
    assert done.returncode == code, done.stderr.decode()
    return json.loads(done.stdout)


async def create(
    store: Store, task_id: str, ctx: str, tool: str, *, ttl_ms: int | None = 3_600_000
) -> None:
    access = await store.authorize(ctx, Action.CREATE, task_id)
    task = new_task(task_id, await store.now(), ttl_ms, 100)
    work = Work.tool_call(task_id, tool, {"q": "private"}, RetryPolicy([60_000]))
    await store.create(task, work, access)


def operator(store: Store) -> ListsTasks:
    assert lists_tasks(store)
    return store


async def test_every_command_against_the_store(target: Target) -> None:
    async with target.store() as store:
        await create(store, "task-a", "alice", "echo")
        await trio.sleep(0.002)
        await create(store, "task-b", "bob", "slow")
        await trio.sleep(0.002)
        await create(store, "task-c", "alice", "echo")
        await create(store, "task-x", "carol", "echo", ttl_ms=1)
        claim = await store.claim("task-b", "host-1", 600_000)
        assert isinstance(claim, Claimed)
        retry = Event.retry_requested(ERROR, "retrying")
        await store.transition("task-b", 0, retry, WorkerAuthority(claim.lease))
        done = await store.claim("task-c", "host-2", 600_000)
        assert isinstance(done, Claimed)
        await store.transition("task-c", 0, Event.completed({"ok": 1}), WorkerAuthority(done.lease))
        await store.release(done.lease)
        inspected = await operator(store).inspect_task("task-b")
        assert isinstance(inspected, TaskInspection)

    listing = await cli_json(target, "tasks", "list")
    assert [t["taskId"] for t in listing["tasks"]][:3] == ["task-a", "task-b", "task-c"]
    b = listing["tasks"][1]
    snapshot = inspected.task.snapshot
    assert b == {
        "taskId": "task-b",
        "status": "working",
        "statusMessage": "Task accepted",  # a retry keeps it; lastFailure has the reason
        "tool": "slow",
        "workType": "tools/call",
        "scope": "bob",
        "createdAt": format_instant(snapshot.task.created_at),
        "lastUpdatedAt": format_instant(snapshot.task.last_updated_at),
        "expiresAt": format_instant(snapshot.task.created_at + 3_600_000_000),
        "expired": False,
        "revision": 1,
        "retryCount": 1,
        "retryAt": format_instant(snapshot.retry_at),  # type: ignore[arg-type]
        "leaseGeneration": 1,
        "lease": {
            "owner": "host-1",
            "generation": 1,
            "expiresAt": format_instant(claim.lease.expires_at),
            "live": True,
        },
        "inputRequests": [],
        "steps": 0,
        "suspended": None,
    }
    assert [t["taskId"] for t in listing["tasks"] if t["expired"]] == ["task-x"]

    async def ids(*argv: str) -> list[str]:
        return [t["taskId"] for t in (await cli_json(target, "tasks", "list", *argv))["tasks"]]

    assert await ids("--tool", "echo", "--status", "working") == ["task-a", "task-x"]
    assert await ids("--scope", '"bob"', "--older-than", "1h") == []
    assert await ids("--limit", "1", "--all") == ["task-a", "task-b", "task-c", "task-x"]

    shown = await cli_json(target, "tasks", "show", "task-b")
    assert shown["lastFailure"] == {
        "statusMessage": "retrying",
        "error": {"code": -32000, "message": "upstream down"},
    }
    [entry] = shown["ledger"]
    assert entry["kind"] == "retry_requested"
    assert entry["retry"] == {
        "disposition": "scheduled",
        "retryAt": format_instant(snapshot.retry_at),  # type: ignore[arg-type]
        "delayMs": 60_000,
        "retryCount": 1,
    }
    assert "s3cr3t" not in json.dumps(shown) and "private" not in json.dumps(shown)
    missing = await tritask("tasks", "show", "nope", "--store", target.url)
    assert (missing.returncode, missing.stdout) == (1, b"")
    assert missing.stderr.decode().strip() == "tritask: no task nope in this store"

    stats = await cli_json(target, "tasks", "stats", "--expiring-within", "20m")
    assert stats["total"] == 4
    assert stats["byStatus"] == {
        "working": 3,
        "input_required": 0,
        "completed": 1,
        "failed": 0,
        "cancelled": 0,
    }
    assert stats["oldestActive"]["taskId"] == "task-a"
    assert [t["taskId"] for t in stats["leasesExpiring"]] == ["task-b"]
    assert (stats["retrying"], stats["expired"]) == (1, 1)

    cancelled = await cli_json(target, "tasks", "cancel", "task-a")
    assert cancelled == {
        "taskId": "task-a",
        "outcome": "cancelled",
        "status": "cancelled",
        "revision": 1,
    }
    again = await cli_json(target, "tasks", "cancel", "task-c", code=1)
    assert again["outcome"] == "already_terminal"

    assert await cli_json(target, "reap") == {"reaped": ["task-x"], "count": 1}
    assert await ids() == ["task-a", "task-b", "task-c"]

    async with target.store() as store:
        after = await operator(store).inspect_task("task-a")
        assert isinstance(after, TaskInspection)
        assert after.task.snapshot.task.status is TaskStatus.CANCELLED
        assert [(e.revision, e.event.kind.value) for e in after.ledger] == [(1, "cancelled")]


class Blocking:
    """An executor whose attempts run until they are cancelled."""

    def __init__(self) -> None:
        self.started = trio.Event()
        self.cancelled = trio.Event()

    async def execute(self, work: Work, token: ExecutionToken, state: Any) -> Completed:
        self.started.set()
        try:
            await trio.sleep_forever()
        finally:
            self.cancelled.set()


async def test_cancel_reaches_the_attempt_a_runner_in_another_process_runs(
    target: Target,
) -> None:
    # PostgreSQL: the runner would next look at the task in 200 s (its heartbeat); the
    # cancellation's NOTIFY wakes it at once. SQLite: its next heartbeat (1 s) sees it.
    lease_ms = 600_000 if target.kind == "postgres" else 3_000
    executor = Blocking()
    events = RecordingInstrumentation()
    async with target.store() as store:
        runner = Runner(
            store,
            executor=executor,
            lease_ms=lease_ms,
            reap_interval_ms=None,
            instrumentation=events,
        )
        async with runner:
            access = await store.authorize("dave", Action.CREATE, "long")
            task = new_task("long", await store.now(), None, None)
            await runner.create_task(
                task, Work(idempotency_key="long", type="job", input={}), access
            )
            with trio.fail_after(30):
                await executor.started.wait()
            started = trio.current_time()
            cancel = await tritask("tasks", "cancel", "long", "--store", target.url)
            assert cancel.returncode == 0, cancel.stderr.decode()
            assert cancel.stdout.decode() == "cancelled task long (revision 1)\n"
            with trio.fail_after(30):
                await executor.cancelled.wait()
            waited = trio.current_time() - started
            assert waited < runner.heartbeat_ms / 1000 + 30
            if target.kind == "postgres":
                assert waited < 60 < runner.heartbeat_ms / 1000
        stops = [md for _, md in events.named(ins.JOB_STOP) if md["task_id"] == "long"]
        assert [md["outcome"] for md in stops] == ["cancelled"]
        inspection = await operator(store).inspect_task("long")
        assert isinstance(inspection, TaskInspection)
        assert [e.event.kind.value for e in inspection.ledger] == ["cancelled"]


async def test_sqlite_refusals_leave_no_file_behind(tmp_path: Path) -> None:
    missing = tmp_path / "missing.db"
    listed = await tritask("tasks", "list", "--store", f"sqlite:{missing}")
    assert listed.returncode == 1
    assert listed.stderr.decode().strip() == (
        f"tritask: StoreSchemaError: no tritask store at {str(missing)!r}: no such file"
    )
    assert not missing.exists()
    path = tmp_path / "served.db"
    async with SqliteStore(path, scope="shared", exclusive=True):  # what tritask serve holds
        # Reading opens the file read-only beside its holder; writing needs it.
        listed = await tritask("tasks", "list", "--store", f"sqlite:{path}")
        locked = await tritask("tasks", "cancel", "t1", "--store", f"sqlite:{path}")
    assert (listed.returncode, listed.stdout.decode()) == (0, "no tasks match\n")
    assert locked.returncode == 1
    assert "is locked by another process" in locked.stderr.decode()
    unknown = await tritask("tasks", "list", "--store", "nosuch:thing")
    assert unknown.returncode == 2
    assert "no store for 'nosuch' URLs" in unknown.stderr.decode()


@pytest.mark.postgres
async def test_postgres_needs_migrate_first(pg_schemas: SchemaFactory) -> None:
    url = f"{pg_schemas.dsn}?schema={pg_schemas.name()}"
    refused = await tritask("tasks", "list", "--store", url)
    assert refused.returncode == 1
    assert "migrate" in refused.stderr.decode()
    migrated = await tritask("migrate", "--store", url)
    assert migrated.returncode == 0, migrated.stderr.decode()
    listed = await tritask("tasks", "list", "--store", url, "--json")
    assert listed.returncode == 0, listed.stderr.decode()
    assert json.loads(listed.stdout)["tasks"] == []
