"""SqliteStore beyond the shared contract: durability, the on-disk format, boot epochs, processes
sharing one file, refusal of files it does not own, and cancellation of running queries.

Timed tests inject a ``ManualClock`` into the store (never ``MockClock`` autojump: the store's
work happens in real threads); tests of racing stores use the database clock.
"""

from __future__ import annotations

import functools
import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from hypothesis import example, given
from hypothesis import strategies as st
from sqlite_support import LEASE_MS, A, created_claimed, get, raw
from tritask_sqlite import (
    SCHEMA_VERSION,
    LedgerEntry,
    Migrated,
    SqliteStore,
    StoreLocked,
    StoreSchemaError,
    path_from_url,
)
from tritask_sqlite import migrate as sqlite_migrate
from tritask_sqlite.schema import APPLICATION_ID, migrations
from tritask_sqlite.store import _uuid4_text

from tritask.tasks.events import Effects, Event, RetryEffect
from tritask.tasks.model import Snapshot, TaskStatus, new_task, snapshot_to_json
from tritask.tasks.store import (
    NOT_FOUND,
    UNAVAILABLE,
    Action,
    Claimed,
    Concurrency,
    CorruptStore,
    DatabaseBusy,
    Lease,
    Renewed,
    RequestAuthority,
    Scope,
    StaleLease,
    Store,
    TaskQuery,
    Transition,
    WorkerAuthority,
)
from tritask.tasks.stores import open_store
from tritask.tasks.work import RetryPolicy, Work, canonical_json
from tritask.testing.store_contract import START, ManualClock, StoreContract, by_tenant, tenant

pytestmark = pytest.mark.contract("tasks-durable-store")

ASK = {"method": "elicitation/create", "params": {"message": "Confirm"}}
ERROR = {"code": -32000, "message": "transient"}
create = StoreContract.create
applied = StoreContract.applied


def sqlite_store(
    path: Path, clock: ManualClock | None = None, *, scope: Scope = by_tenant, **options: Any
) -> SqliteStore:
    return SqliteStore(path, scope=scope, clock=clock, **options)


async def claimed(
    store: SqliteStore, task_id: str, owner: str = "owner-1", ms: int = LEASE_MS
) -> Lease:
    result = await store.claim(task_id, owner, ms)
    assert isinstance(result, Claimed), result
    return result.lease


async def request(store: SqliteStore, action: Action, task_id: str) -> RequestAuthority:
    return RequestAuthority(await store.authorize(A, action, task_id))


async def busy_task(store: SqliteStore, task_id: str = "task-1") -> list[Transition]:
    """A task with a ledger of every effect shape: requested, answered, retry scheduled."""
    await create(store, task_id, policy=RetryPolicy([5000]))
    worker = WorkerAuthority(await claimed(store, task_id))
    asked = await applied(store, task_id, 0, Event.input_requested("a", ASK, id="ask-1"), worker)
    update = await request(store, Action.UPDATE, task_id)
    answer = Event.input_responses_accepted({"a": {"ok": True}}, id="answer-1")
    answered = await applied(store, task_id, 1, answer, update)
    retry = Event.retry_requested(ERROR, "again", id="retry-1")
    retried = await applied(store, task_id, 2, retry, worker)
    return [asked, answered, retried]


# -- durability -------------------------------------------------------------------------------


@pytest.mark.parametrize("exclusive", [False, True])
async def test_reopen_keeps_record_history_and_replay(tmp_path: Path, exclusive: bool) -> None:
    path, clock = tmp_path / "tasks.db", ManualClock()
    async with sqlite_store(path, clock, exclusive=exclusive) as store:
        commits = await busy_task(store)
        before = await get(store, "task-1")
        history = await store.history("task-1")
    assert [(e.revision, e.event.id) for e in history] == [
        (1, "ask-1"),
        (2, "answer-1"),
        (3, "retry-1"),
    ]
    assert [e.committed_at for e in history] == [c.committed_at for c in commits]
    assert [e.effects for e in history] == [c.effects for c in commits]
    clock.advance(1000)
    async with sqlite_store(path, clock, exclusive=exclusive) as store:
        assert await get(store, "task-1") == before
        assert await store.history("task-1") == history
        update = await request(store, Action.UPDATE, "task-1")
        answer = Event.input_responses_accepted({"a": {"ok": True}}, id="answer-1")
        replay = await store.transition("task-1", 0, answer, update)  # stale revision: replayed
        assert replay == Transition(
            outcome="duplicate",
            snapshot=before,
            effects=Effects(accepted_input_responses={"a": {"ok": True}}),
            event_revision=2,
            committed_at=commits[1].committed_at,
        )
        assert await store.history("task-1") == history
    with raw(path) as conn:
        (record,) = conn.execute("SELECT record FROM tritask_tasks").fetchone()
    assert json.loads(record)["version"] == 3


async def test_on_disk_format(tmp_path: Path) -> None:
    path, clock = tmp_path / "tasks.db", ManualClock()
    async with sqlite_store(path, clock) as store:
        commits = await busy_task(store)
        await create(store, "task-2", ttl_ms=None)
        lease = await claimed(store, "task-2")
        store_id, epoch = store.store_id, store.boot_epoch
    with raw(path) as conn:
        assert conn.execute("PRAGMA application_id").fetchone() == (APPLICATION_ID,)
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert conn.execute(
            "SELECT singleton, schema_version, store_id, boot_epoch FROM tritask_metadata"
        ).fetchall() == [(1, SCHEMA_VERSION, store_id, epoch)]
        tasks = conn.execute(
            "SELECT task_id, row_format, record_version, record, scope, revision, status,"
            " created_at_us, expires_at_us, retry_at_us, claim_owner, claim_token,"
            " lease_generation, claim_expires_at_us, claim_epoch FROM tritask_tasks"
            " ORDER BY task_id"
        ).fetchall()
        events = conn.execute(
            "SELECT task_id, event_id, row_format, event, event_kind, event_revision,"
            " committed_at_us, effects FROM tritask_task_events ORDER BY event_revision"
        ).fetchall()
    first, second = tasks
    record = json.loads(first[3])
    assert list(record) == [
        "acceptedInputResponses",
        "inputHistory",
        "lastFailure",
        "retryAt",
        "retryCount",
        "revision",
        "task",
        "version",
        "work",
    ]  # exactly the 9 keys, stored with sorted keys
    assert set(record["task"]) == {
        "id",
        "status",
        "statusMessage",
        "createdAt",
        "lastUpdatedAt",
        "ttlMs",
        "pollIntervalMs",
        "inputRequests",
        "result",
        "error",
        "usedInputKeys",
    }
    assert (record["version"], record["revision"], record["retryCount"]) == (3, 3, 1)
    retry_at = commits[2].committed_at + 5_000_000
    assert first[:3] == ("task-1", 1, 3)
    assert first[4] == '{"value":"tenant-a","version":1}'
    assert first[5:10] == (3, "working", START, START + 60_000_000, retry_at)
    assert first[10] == "owner-1" and len(first[11]) == 36
    assert first[12:] == (1, START + LEASE_MS * 1000, epoch)
    assert second[8] is None  # ttlMs null: never expires
    assert second[10:] == (lease.owner_id, lease.token, 1, lease.expires_at, epoch)
    assert [e[:3] + e[4:7] for e in events] == [
        ("task-1", "ask-1", 1, "input_requested", 1, commits[0].committed_at),
        ("task-1", "answer-1", 1, "input_responses_accepted", 2, commits[1].committed_at),
        ("task-1", "retry-1", 1, "retry_requested", 3, commits[2].committed_at),
    ]
    assert json.loads(events[0][3]) == {
        "version": 1,
        "id": "ask-1",
        "kind": "input_requested",
        "data": {"key": "a", "request": ASK},
    }
    assert [json.loads(e[7]) for e in events] == [
        {"version": 1, "kind": "none"},
        {"version": 1, "kind": "acceptedInputResponses", "responses": {"a": {"ok": True}}},
        {
            "version": 1,
            "kind": "retry",
            "retry": {
                "disposition": "scheduled",
                "retryAt": "2026-08-24T10:00:05.003Z",
                "delayMs": 5000,
                "retryCount": 1,
            },
        },
    ]
    assert commits[2].effects.retry == RetryEffect(
        disposition="scheduled", retry_at=retry_at, delay_ms=5000, retry_count=1
    )


@pytest.mark.parametrize(
    ("tamper", "reason"),
    [
        ("UPDATE tritask_tasks SET status = 'completed'", "status column"),
        ("UPDATE tritask_tasks SET revision = 7", "revision column"),
        ("UPDATE tritask_tasks SET retry_at_us = NULL", "retry_at_us column"),
        ('UPDATE tritask_tasks SET scope = \'{"version":1,"value": "tenant-a"}\'', "canonical"),
        ("UPDATE tritask_tasks SET record = json_remove(record, '$.lastFailure')", "keys"),
        ("UPDATE tritask_tasks SET record = json_set(record, '$.version', 5)", "version 5"),
    ],
)
async def test_projection_mismatch_is_corrupt(tmp_path: Path, tamper: str, reason: str) -> None:
    path, clock = tmp_path / "tasks.db", ManualClock()
    async with sqlite_store(path, clock) as store:
        await busy_task(store)
        access = await store.authorize(A, Action.GET, "task-1")
    with raw(path) as conn:
        conn.execute(tamper)
    async with sqlite_store(path, clock) as store:
        with pytest.raises(CorruptStore) as caught:
            await store.get("task-1", access)
        assert caught.value.task_id == "task-1"
        assert reason in caught.value.reason
        with pytest.raises(CorruptStore):
            await store.claim("task-1", "owner", LEASE_MS)
        page = await store.audit()
        assert page.checked == ("task-1",)
        assert [f.task_id for f in page.findings] == ["task-1"]


async def test_ledger_tampering_is_corrupt(tmp_path: Path) -> None:
    path, clock = tmp_path / "tasks.db", ManualClock()
    async with sqlite_store(path, clock) as store:
        await busy_task(store)
        await create(store, "task-2")
        assert (await store.audit()).findings == ()
    with raw(path) as conn:
        conn.execute("DELETE FROM tritask_task_events WHERE event_id = 'ask-1'")
    async with sqlite_store(path, clock) as store:
        with pytest.raises(CorruptStore, match="ledger row 1 has the wrong format or revision"):
            await store.history("task-1")
        update = await request(store, Action.UPDATE, "task-1")
        answer = Event.input_responses_accepted({"a": {"ok": True}}, id="answer-1")
        with pytest.raises(CorruptStore):  # replay validates the whole ledger
            await store.transition("task-1", 0, answer, update)
        page = await store.audit(limit=1)
        assert (page.checked, page.next_after) == (("task-1",), "task-1")
        assert [f.task_id for f in page.findings] == ["task-1"]
        page = await store.audit(limit=1, after=page.next_after)
        assert (page.checked, page.findings, page.next_after) == (("task-2",), (), "task-2")
        assert await store.audit(after="task-2") == attrs.evolve(page, checked=(), next_after=None)
        assert await store.integrity_check() == []


@pytest.mark.parametrize(
    ("tamper", "read"),
    [
        ("UPDATE tritask_tasks SET record = '{\"task\": {'", "task"),
        ("UPDATE tritask_tasks SET record = '{\"a\": 1} trailing'", "task"),
        ("UPDATE tritask_tasks SET scope = '{oops'", "task"),
        ("UPDATE tritask_task_events SET event = '{' WHERE event_id = 'ask-1'", "ledger"),
        ("UPDATE tritask_task_events SET effects = '{,}' WHERE event_id = 'ask-1'", "ledger"),
    ],
)
async def test_json_text_that_is_not_json_is_refused_on_read(
    tmp_path: Path, tamper: str, read: str
) -> None:
    """Schema 5 checks a JSON column's type and first character only (no json_valid on the
    hot path): text that starts like an object but is not JSON gets in, and every read that
    meets it refuses it with CorruptStore (the listing's tool filter too: SQLite's own JSON
    functions must not fail the page with malformed JSON first)."""
    path, clock = tmp_path / "tasks.db", ManualClock()
    async with sqlite_store(path, clock) as store:
        await busy_task(store)
        access = await store.authorize(A, Action.GET, "task-1")
    with raw(path) as conn:
        conn.execute(tamper)
    async with sqlite_store(path, clock) as store:
        if read == "task":
            with pytest.raises(CorruptStore) as caught:
                await store.get("task-1", access)
            assert caught.value.task_id == "task-1"
            with pytest.raises(CorruptStore):
                await store.list_tasks(TaskQuery())
            by_tool = TaskQuery(tool="job")  # the task has no tool: a readable record is left out
            if "SET record" in tamper:
                with pytest.raises(CorruptStore):
                    await store.list_tasks(by_tool)
            else:
                assert (await store.list_tasks(by_tool)).tasks == ()
            with pytest.raises(CorruptStore):
                await store.claim("task-1", "owner", LEASE_MS)
        else:
            with pytest.raises(CorruptStore, match="ledger"):
                await store.history("task-1")
        page = await store.audit()
        assert [f.task_id for f in page.findings] == ["task-1"]


#: A JSON array nested deeper than Python's recursion limit (the standard library's decoder
#: raises RecursionError on it, orjson does not; SQLite's json_valid() of schemas 1 to 4
#: refused anything nested 2,000 deep or more, schema 5 no longer parses it).
DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize(
    ("tamper", "read"),
    [
        ("UPDATE tritask_tasks SET scope = '{\"value\":' || :deep || ',\"version\":1}'", "task"),
        (
            "UPDATE tritask_tasks SET record"
            " = replace(record, '\"input\":{', '\"input\":{\"deep\":' || :deep || ',')",
            "task",
        ),
        (
            "UPDATE tritask_task_events SET event = '{\"data\":' || :deep || '}'"
            " WHERE event_id = 'ask-1'",
            "ledger",
        ),
        (
            "UPDATE tritask_task_events SET effects = '{\"a\":' || :deep || '}'"
            " WHERE event_id = 'ask-1'",
            "ledger",
        ),
    ],
)
async def test_json_nested_beyond_the_recursion_limit_is_refused_on_read(
    tmp_path: Path, tamper: str, read: str
) -> None:
    """JSON that starts with '{' and nests deeper than the decoder can recurse (a foreign
    writer's: tritask refuses input nested more than 200 deep) passes schema 5's CHECKs; every
    read refuses it with CorruptStore and audit reports it, instead of a RecursionError escaping
    the store (audit failing as a whole)."""
    path, clock = tmp_path / "tasks.db", ManualClock()
    async with sqlite_store(path, clock) as store:
        await busy_task(store)
        access = await store.authorize(A, Action.GET, "task-1")
    with raw(path) as conn:
        assert conn.execute(tamper, {"deep": DEEP}).rowcount == 1
    async with sqlite_store(path, clock) as store:
        if read == "task":
            with pytest.raises(CorruptStore) as caught:
                await store.get("task-1", access)
            assert caught.value.task_id == "task-1"
            with pytest.raises(CorruptStore):
                await store.list_tasks(TaskQuery())
            with pytest.raises(CorruptStore):
                await store.claim("task-1", "owner", LEASE_MS)
            if "SET scope" in tamper:
                with pytest.raises(CorruptStore):
                    await store.operator_access("task-1", Action.CANCEL)
        else:
            with pytest.raises(CorruptStore, match="ledger"):
                await store.history("task-1")
            with pytest.raises(CorruptStore, match="ledger"):
                await store.inspect_task("task-1")
        page = await store.audit()
        assert [f.task_id for f in page.findings] == ["task-1"]
        # The store is still usable after the refusal.
        await create(store, "task-2")
        assert (await get(store, "task-2")).task.id == "task-2"


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("tritask_tasks.record", "[]"),
        ("tritask_tasks.record", " {}"),
        ("tritask_tasks.record", b"{}"),
        ("tritask_tasks.scope", "null"),
        ("tritask_task_events.event", '"completed"'),
        ("tritask_task_events.effects", 1),
    ],
)
async def test_json_columns_refuse_what_is_not_object_text(
    tmp_path: Path, column: str, value: object
) -> None:
    """The CHECKs that stay in schema 5: TEXT, starting with '{' (a foreign writer cannot
    store a BLOB, a number or another JSON type)."""
    path = tmp_path / "tasks.db"
    async with sqlite_store(path, ManualClock()) as store:
        await busy_task(store)
    table, name = column.split(".")
    with raw(path) as conn, pytest.raises(sqlite3.IntegrityError, match="CHECK"):
        conn.execute(f"UPDATE {table} SET {name} = ?", (value,))


_STATUSES = ("working", "input_required", "completed", "failed", "cancelled")
_EVENT_KINDS = (
    "input_requested",
    "input_responses_accepted",
    "retry_requested",
    "completed",
    "failed",
    "cancelled",
    "step_started",
    "step_recorded",
    "sleep_scheduled",
    "suspended",
)


async def test_status_and_event_kind_checks_admit_exactly_the_known_values(
    tmp_path: Path,
) -> None:
    """Schema 6 writes these CHECKs as comparisons joined by OR: the same values as the IN
    lists of versions 1 to 5, nothing else (case and padding matter)."""
    path = tmp_path / "tasks.db"
    async with sqlite_store(path, ManualClock()) as store:
        await busy_task(store)
        await create(store, "task-2")
        done = await claimed(store, "task-2")
        await applied(store, "task-2", 0, Event.completed({}), WorkerAuthority(done))
    with raw(path) as conn:
        for value in _STATUSES:  # the claim columns make any status but these pass the CHECK
            conn.execute("SAVEPOINT s")
            conn.execute("UPDATE tritask_tasks SET status = ? WHERE task_id = 'task-2'", (value,))
            conn.execute("ROLLBACK TO s")
        for value in _EVENT_KINDS:
            conn.execute("SAVEPOINT s")
            conn.execute("UPDATE tritask_task_events SET event_kind = ?", (value,))
            conn.execute("ROLLBACK TO s")
        for table, column in (("tritask_tasks", "status"), ("tritask_task_events", "event_kind")):
            for bad in ("Completed", "completed ", "", "queued", 1):
                with pytest.raises(sqlite3.IntegrityError, match="CHECK"):
                    conn.execute(f"UPDATE {table} SET {column} = ?", (bad,))


async def test_hot_statements_build_no_ephemeral_table(tmp_path: Path) -> None:
    """A constant IN list of more than two values, or an IN that drives an index seek, makes
    SQLite build an ephemeral table on every execution: the statements every task runs (and the
    CHECKs they evaluate) have none (schema 6; measured, about a tenth of the loop's work)."""
    from tritask_sqlite import store as module

    path = tmp_path / "tasks.db"
    async with sqlite_store(path, ManualClock()):
        pass
    with raw(path) as conn:
        for sql in (
            module._INSERT_TASK,
            module._INSERT_PLAIN,
            module._PLANNED_UPDATE,
            module._PLANNED_PLAIN,
            module._INSERT_EVENT,
        ):
            program = conn.execute(f"EXPLAIN {sql}", [None] * sql.count("?")).fetchall()
            assert "OpenEphemeral" not in {row[1] for row in program}, sql
        program = conn.execute(f"EXPLAIN {module._CAPACITY}", (None, 1, 1, "{}")).fetchall()
        assert "OpenEphemeral" not in {row[1] for row in program}


# -- boot epochs ------------------------------------------------------------------------------


async def test_exclusive_reopen_fences_and_reclaims_at_once(tmp_path: Path) -> None:
    path, clock = tmp_path / "tasks.db", ManualClock()
    async with sqlite_store(path, clock, exclusive=True) as store:
        first_epoch = store.boot_epoch
        await create(store, "task-1")
        old_access = await store.authorize(A, Action.GET, "task-1")
        old_cancel = await request(store, Action.CANCEL, "task-1")
        old = await claimed(store, "task-1")
        assert old.epoch == first_epoch
    # "crash": the claim was never released, and no time passes
    async with sqlite_store(path, clock, exclusive=True) as store:
        assert store.boot_epoch == first_epoch + 1
        assert await store.get("task-1", old_access) is NOT_FOUND
        assert await store.transition("task-1", 0, Event.cancelled(), old_cancel) is NOT_FOUND
        with pytest.raises(StaleLease):
            await store.worker_snapshot("task-1", old)
        with pytest.raises(StaleLease):
            await store.transition("task-1", 0, Event.completed({}), WorkerAuthority(old))
        with pytest.raises(StaleLease):
            await store.renew(old, LEASE_MS)
        with pytest.raises(StaleLease):
            await store.release(old)
        new = await store.claim_next("owner-2", LEASE_MS)
        assert new is not None
        assert (new.lease.generation, new.lease.epoch) == (2, first_epoch + 1)
        assert await store.claim("task-1", "owner-3", LEASE_MS) is UNAVAILABLE
        done = await applied(store, "task-1", 0, Event.completed({}), WorkerAuthority(new.lease))
        assert done.snapshot.task.status is TaskStatus.COMPLETED


async def test_shared_reopen_keeps_healthy_claims(tmp_path: Path) -> None:
    path, clock = tmp_path / "tasks.db", ManualClock()
    async with sqlite_store(path, clock) as first, sqlite_store(path, clock) as second:
        await create(first, "task-1")
        lease = await claimed(first, "task-1")
        access = await first.authorize(A, Action.GET, "task-1")
        assert second.boot_epoch == first.boot_epoch
        assert await second.claim("task-1", "owner-2", LEASE_MS) is UNAVAILABLE
        assert await second.claim_next("owner-2", LEASE_MS) is None
        assert isinstance(await second.worker_snapshot("task-1", lease), Snapshot)
    async with sqlite_store(path, clock) as third:
        assert third.boot_epoch == first.boot_epoch
        assert await third.claim("task-1", "owner-3", LEASE_MS) is UNAVAILABLE
        assert isinstance(await third.get("task-1", access), Snapshot)
        clock.advance(20_000)
        renewed = await third.renew(lease, LEASE_MS)
        clock.advance(20_000)  # past the first instance's deadline: renewed across instances
        assert await third.claim("task-1", "owner-3", LEASE_MS) is UNAVAILABLE
        await third.release(renewed)
        assert (await claimed(third, "task-1", "owner-3")).generation == 2


CRASHING_CHILD = """
import os, sys, trio
from tritask_sqlite import SqliteStore
from tritask.tasks.model import new_task
from tritask.tasks.store import Action, Claimed
from tritask.tasks.work import Work

async def main(path):
    store = SqliteStore(path, scope="shared", exclusive=True)
    await store.open()
    access = await store.authorize(None, Action.CREATE, "task-1")
    task = new_task("task-1", await store.now(), None, None)
    await store.create(task, Work.tool_call("task-1", "tool", {}), access)
    result = await store.claim("task-1", "child", 600_000)
    assert isinstance(result, Claimed)
    print(result.lease.generation, result.lease.epoch, flush=True)
    sys.stdin.readline()
    os._exit(0)  # a crash: no release, no close

trio.run(main, sys.argv[1])
"""


async def test_crashed_exclusive_owner_is_fenced_by_the_next(tmp_path: Path) -> None:
    path = tmp_path / "tasks.db"
    child = await trio.lowlevel.open_process(
        [sys.executable, "-c", CRASHING_CHILD, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        output = b""
        with trio.fail_after(60):
            while not output.endswith(b"\n"):
                chunk = await child.stdout.receive_some()
                assert chunk, "the child exited early"
                output += chunk
        generation, epoch = map(int, output.split())
        assert generation == 1
        for exclusive in (True, False):
            with pytest.raises(StoreLocked, match="locked by another process"):
                await SqliteStore(path, scope="shared", exclusive=exclusive).open()
        await child.stdin.send_all(b"go\n")
        assert await child.wait() == 0
    finally:
        if child.returncode is None:
            child.kill()
        with trio.CancelScope(shield=True):
            await child.wait()
    async with SqliteStore(path, scope="shared", exclusive=True) as store:
        assert store.boot_epoch == epoch + 1
        result = await store.claim("task-1", "successor", 1000)  # 10 minutes before the lease ends
        assert isinstance(result, Claimed)
        assert result.lease.generation == 2


async def test_second_exclusive_opener_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "tasks.db"
    async with sqlite_store(path, exclusive=True) as owner:
        with pytest.raises(StoreLocked, match="exclusive store needs it to itself"):
            await sqlite_store(path, exclusive=True).open()
        with pytest.raises(StoreLocked, match="open exclusively"):
            await sqlite_store(path).open()
        assert isinstance(await owner.now(), int)
    async with sqlite_store(path) as shared:
        with pytest.raises(StoreLocked):
            await sqlite_store(path, exclusive=True).open()
        async with sqlite_store(path):
            assert isinstance(await shared.now(), int)
    async with sqlite_store(path, exclusive=True) as again:
        assert again.boot_epoch == owner.boot_epoch + 1


# -- processes and threads sharing one file ---------------------------------------------------


async def test_competing_claimers_on_one_file(tmp_path: Path) -> None:
    path = tmp_path / "tasks.db"
    async with sqlite_store(path) as left, sqlite_store(path) as right:
        ids = [f"task-{n:02d}" for n in range(20)]
        for task_id in ids:
            await create(left, task_id)
        results: dict[str, list[object]] = {task_id: [] for task_id in ids}

        async def claim(store: SqliteStore, task_id: str) -> None:
            results[task_id].append(await store.claim(task_id, repr(store), LEASE_MS))

        async with trio.open_nursery() as nursery:
            for task_id in ids:
                nursery.start_soon(claim, left, task_id)
                nursery.start_soon(claim, right, task_id)
        for outcomes in results.values():
            assert sorted(type(r).__name__ for r in outcomes) == ["Claimed", "Unavailable"]

        more = [f"next-{n:02d}" for n in range(20)]
        for task_id in more:
            await create(right, task_id, tenant("tenant-b"))
        taken: dict[str, list[str]] = {"left": [], "right": []}

        async def drain(store: SqliteStore, name: str) -> None:
            while (result := await store.claim_next(name, LEASE_MS)) is not None:
                taken[name].append(result.snapshot.task.id)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain, left, "left")
            nursery.start_soon(drain, right, "right")
        assert sorted(taken["left"] + taken["right"]) == more


def _task_scans(store: SqliteStore) -> list[str]:
    """Every statement the store's connection runs that reads the tasks table from now on."""
    seen: list[str] = []
    conn = store._conn
    assert conn is not None
    conn.set_trace_callback(
        lambda text: seen.append(text) if "FROM tritask_tasks" in text else None
    )
    return seen


async def test_claim_next_remembers_finding_nothing_until_something_can_change(
    tmp_path: Path,
) -> None:
    """A recovering runner asks every second; with every active task claimed, the store
    answers from memory until a claim can lapse, a write of its own or another connection's
    commit could have freed a task."""
    path = tmp_path / "tasks.db"
    clock = ManualClock()
    async with sqlite_store(path, clock) as store, sqlite_store(path, clock) as other:
        await create(store, "task-1")
        await create(store, "task-2")
        first = await claimed(store, "task-1", ms=10_000)
        await claimed(store, "task-2", ms=20_000)
        scans = _task_scans(store)
        assert await store.claim_next("recoverer", LEASE_MS) is None
        # The claim queries, then the instant the first claim lapses.
        queries = len(scans)
        assert queries >= 2 and "min(CASE" in scans[-1]
        for _ in range(3):
            assert await store.claim_next("recoverer", LEASE_MS) is None
        assert len(scans) == queries
        # Renewing and claiming free nothing: still answered from memory.
        renewed = await store.renew_all("owner-1", [first], 10_000)
        assert isinstance(renewed[0], Renewed)
        queries = len(scans)  # the renewal reads its owner's claims itself
        assert await store.claim_next("recoverer", LEASE_MS) is None
        assert len(scans) == queries
        # The first claim ended at +10 s (its renewal moved it to +10 s as well: no time
        # passed); at that instant the store looks again.
        clock.advance(10_000)
        adopted = await store.claim_next("recoverer", LEASE_MS)
        assert adopted is not None and adopted.lease.task_id == "task-1"
        assert await store.claim_next("recoverer", LEASE_MS) is None
        # A write of this store object that frees a task: found at once.
        await store.release(adopted.lease)
        again = await store.claim_next("recoverer", LEASE_MS)
        assert again is not None and again.lease.task_id == "task-1"
        assert await store.claim_next("recoverer", LEASE_MS) is None
        # Another connection's commit: found at once too.
        await create(other, "task-3")
        third = await store.claim_next("recoverer", LEASE_MS)
        assert third is not None and third.lease.task_id == "task-3"


async def test_claim_next_memory_covers_a_retry_falling_due(tmp_path: Path) -> None:
    clock = ManualClock()
    async with sqlite_store(tmp_path / "tasks.db", clock) as store:
        await create(store, "task-1", policy=RetryPolicy([5000]))
        lease = await claimed(store, "task-1")
        await store.settle("task-1", 0, Event.retry_requested(ERROR, "again"), lease)
        retry_at = (await get(store, "task-1")).retry_at
        assert retry_at is not None
        assert await store.claim_next("recoverer", LEASE_MS) is None
        clock.advance((retry_at - await store.now()) // 1000 - 1)
        assert await store.claim_next("recoverer", LEASE_MS) is None
        clock.advance(1)
        due = await store.claim_next("recoverer", LEASE_MS)
        assert due is not None and (due.lease.task_id, due.lease.generation) == ("task-1", 2)


async def test_concurrent_first_open_installs_once(tmp_path: Path) -> None:
    """Stores starting together on a new file: one installs, none fails (switching a new file
    to WAL reports SQLITE_BUSY at once to the losers of that race; they retry)."""
    for round_ in range(8):
        path = tmp_path / f"fresh-{round_}.db"
        stores = [sqlite_store(path) for _ in range(6)]
        async with trio.open_nursery() as nursery:
            for store in stores:
                nursery.start_soon(store.open)
        try:
            assert len({store.store_id for store in stores}) == 1
            with raw(path) as conn:
                assert conn.execute("SELECT count(*) FROM tritask_metadata").fetchone() == (1,)
        finally:
            for store in stores:
                await store.aclose()


async def test_opening_waits_for_a_writer_holding_a_new_file(tmp_path: Path) -> None:
    """SQLite refuses the switch to WAL at once, without its busy handler, while another
    connection holds a write lock on a new file: the store retries within busy_timeout."""
    path = tmp_path / "new.db"
    with raw(path) as conn:
        conn.execute("BEGIN IMMEDIATE")
        store = sqlite_store(path, busy_timeout_ms=10_000)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.open)
            await trio.sleep(0.2)  # the store tries (and is refused) meanwhile
            assert store.store_id == ""
            conn.execute("ROLLBACK")
    try:
        assert store.store_id != ""
        await create(store, "task-1")
        assert isinstance(await get(store, "task-1"), Snapshot)
    finally:
        await store.aclose()


async def test_database_busy_when_another_writer_holds_the_file(tmp_path: Path) -> None:
    path = tmp_path / "tasks.db"
    async with sqlite_store(path, busy_timeout_ms=50) as store:
        await create(store, "task-1")
        with raw(path) as conn:
            conn.execute("BEGIN IMMEDIATE")
            with pytest.raises(DatabaseBusy):
                await store.claim("task-1", "owner", LEASE_MS)
            assert isinstance(await get(store, "task-1"), Snapshot)  # WAL readers proceed
            conn.execute("ROLLBACK")
        assert isinstance(await store.claim("task-1", "owner", LEASE_MS), Claimed)


# -- time -------------------------------------------------------------------------------------


async def test_renewal_keeps_a_claim_alive_past_its_first_deadline(tmp_path: Path) -> None:
    clock = ManualClock()
    async with sqlite_store(tmp_path / "tasks.db", clock) as store:
        await create(store, "task-1")
        first = await claimed(store, "task-1", ms=1000)
        clock.advance(800)
        renewed = await store.renew(first, 1000)
        assert renewed.expires_at == START + 1_800_000
        clock.advance(400)  # past the first deadline
        assert await store.claim("task-1", "owner-2", 1000) is UNAVAILABLE
        assert await store.claim_next("owner-2", 1000) is None
        assert isinstance(await store.worker_snapshot("task-1", renewed), Snapshot)
        with pytest.raises(StaleLease):
            await store.worker_snapshot("task-1", first)
        clock.advance(600)
        with pytest.raises(StaleLease):
            await store.worker_snapshot("task-1", renewed)
        again = await store.claim_next("owner-2", 1000)
        assert again is not None
        assert again.lease.generation == 2


async def test_ttl_reaped_at_the_exact_instant_with_its_ledger(tmp_path: Path) -> None:
    path, clock = tmp_path / "tasks.db", ManualClock()
    async with sqlite_store(path, clock, reap_batch_size=2) as store:
        await busy_task(store, "task-0")  # ttl 60 s, with a ledger
        for n in range(1, 4):
            await create(store, f"task-{n}", ttl_ms=60_000)
        await create(store, "forever", ttl_ms=None)
        clock.advance(59_999)
        assert await store.reap() == []
        clock.advance(1)
        assert await store.reap() == ["task-0", "task-1"]
        assert await store.reap() == ["task-2", "task-3"]
        assert await store.reap() == []
        assert await store.history("task-0") == []
        clock.advance(10**9)
        assert await store.reap() == []
        assert (await get(store, "forever")).task.ttl_ms is None
    with raw(path) as conn:
        assert conn.execute("SELECT count(*) FROM tritask_task_events").fetchone() == (0,)
        assert conn.execute("SELECT task_id FROM tritask_tasks").fetchall() == [("forever",)]


async def test_reap_drops_the_lease_rows_of_dead_owners_and_no_other(tmp_path: Path) -> None:
    """A runner that dies leaves its owner lease row (schema 4) behind. ``reap`` drops a row
    once it has expired and no claim follows it, and keeps every other: a live owner's, and a
    dead owner's while one of its claims still follows it (expired, claimed by nobody since),
    whose decoded expiry, and so its fencing, must stay exactly the lease its holder has."""
    path, clock = tmp_path / "tasks.db", ManualClock()

    def owner_rows() -> list[tuple[str, int]]:
        with raw(path) as conn:
            rows = conn.execute(
                "SELECT owner_id, lease_expires_at_us FROM tritask_owner_leases ORDER BY owner_id"
            ).fetchall()
            return [(owner, expiry) for owner, expiry in rows]

    async with sqlite_store(path, clock) as store:
        for n in range(4):
            await create(store, f"task-{n}", ttl_ms=None)
        dead = [await claimed(store, f"task-{n}", "dead") for n in range(3)]
        live = await claimed(store, "task-3", "live")
        clock.advance(1000)
        dead = [
            r.lease for r in await store.renew_all("dead", dead, 1000) if isinstance(r, Renewed)
        ]
        (renewed,) = await store.renew_all("live", [live], LEASE_MS)
        assert isinstance(renewed, Renewed) and len(dead) == 3
        live = renewed.lease
        dead_expiry = START + 2_000_000
        assert owner_rows() == [("dead", dead_expiry), ("live", live.expires_at)]
        assert await store.reap() == []
        assert owner_rows() == [("dead", dead_expiry), ("live", live.expires_at)]
        # "dead" stops renewing. Its row expires; its claims still follow it.
        clock.advance(1000)
        assert await store.reap() == []
        assert [row[0] for row in owner_rows()] == ["dead", "live"]
        heir = await claimed(store, "task-0", "heir")  # no longer follows the dead row
        assert heir.generation == 2
        await store.release(dead[1])  # an expired lease nobody took is still its holder's
        assert await store.reap() == []
        assert [row[0] for row in owner_rows()] == ["dead", "live"]
        # task-2 still follows the dead row: its claim is exactly the lease "dead" holds.
        inspection = await store.inspect_task("task-2")
        assert inspection is not NOT_FOUND and inspection.task.claim is not None
        claim = inspection.task.claim
        assert (claim.owner_id, claim.expires_at, claim.live) == ("dead", dead_expiry, False)
        clock.advance(10**6)  # long after: the row stays as long as a claim follows it
        assert await store.reap() == []
        assert [row[0] for row in owner_rows()] == ["dead", "live"]
        await store.release(dead[2])  # exactly the claim: its expiry is still the row's
        # The live owner's row has expired too by now, and nothing follows it any more once
        # its task is released: both go; renewing afterwards writes a row again.
        await store.release(live)
        assert await store.reap() == []
        assert owner_rows() == []
        again = await claimed(store, "task-3", "live")
        clock.advance(1000)
        (renewed,) = await store.renew_all("live", [again], LEASE_MS)
        assert isinstance(renewed, Renewed)
        assert owner_rows() == [("live", renewed.lease.expires_at)]
        assert isinstance(await store.worker_snapshot("task-3", renewed.lease), Snapshot)


async def test_reap_keeps_a_followed_owner_row_whose_claims_are_live(tmp_path: Path) -> None:
    """A live owner's row is never dropped while it is followed, however often reap runs
    between its heartbeats, and each heartbeat's leases stay live to their exact expiry."""
    path, clock = tmp_path / "tasks.db", ManualClock()
    async with sqlite_store(path, clock) as store:
        await create(store, "task-1")
        lease = await claimed(store, "task-1", ms=1000)
        for beat in range(4):
            clock.advance(999)  # 1 ms before the lease's end
            assert await store.reap() == []
            assert isinstance(await store.worker_snapshot("task-1", lease), Snapshot)
            assert await store.claim("task-1", "owner-2", 1000) is UNAVAILABLE
            (renewed,) = await store.renew_all("owner-1", [lease], 1000)
            assert isinstance(renewed, Renewed), beat
            lease = renewed.lease
        clock.advance(1000)
        assert await store.reap() == []  # expired but followed: kept, the claim lapses as is
        with raw(path) as conn:
            assert conn.execute("SELECT owner_id FROM tritask_owner_leases").fetchall() == [
                ("owner-1",)
            ]
        adopted = await store.claim("task-1", "owner-2", 1000)
        assert isinstance(adopted, Claimed) and adopted.lease.generation == 2
        assert await store.reap() == []
        with raw(path) as conn:
            assert conn.execute("SELECT owner_id FROM tritask_owner_leases").fetchall() == []


async def test_database_clock(tmp_path: Path) -> None:
    async with sqlite_store(tmp_path / "tasks.db") as store:
        now = await store.now()
        assert now % 1000 == 0
        assert abs(now - time.time_ns() // 1000) < 5_000_000
        created = await create(store, "task-1")
        assert abs(created.task.created_at - now) < 5_000_000
        lease = await claimed(store, "task-1")
        assert lease.expires_at - LEASE_MS * 1000 >= now
        done = await applied(store, "task-1", 0, Event.completed({}), WorkerAuthority(lease))
        assert done.committed_at > created.task.created_at


# -- files the store does not own -------------------------------------------------------------


async def test_refuses_a_newer_schema_version(tmp_path: Path) -> None:
    path = tmp_path / "tasks.db"
    async with sqlite_store(path) as store:
        await create(store, "task-1")
    with raw(path) as conn:
        conn.execute("UPDATE tritask_metadata SET schema_version = ?", (SCHEMA_VERSION + 1,))
    before = path.read_bytes()
    for exclusive in (False, True):
        with pytest.raises(StoreSchemaError, match=r"newer than this tritask_sqlite supports"):
            await sqlite_store(path, exclusive=exclusive).open()
    assert path.read_bytes() == before


async def test_refuses_a_foreign_sqlite_file(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    with raw(path) as conn:
        conn.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
        conn.execute("INSERT INTO users (name) VALUES ('ada')")
    before = path.read_bytes()
    with pytest.raises(StoreSchemaError, match=r"another application .*tables: users"):
        await sqlite_store(path, exclusive=True).open()
    assert path.read_bytes() == before
    with raw(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("delete",)


async def test_refuses_a_file_that_is_not_sqlite(tmp_path: Path) -> None:
    path = tmp_path / "notes.db"
    path.write_bytes(b"these are my notes, not a database\n" * 200)
    before = path.read_bytes()
    with pytest.raises(StoreSchemaError, match="not an SQLite database"):
        await sqlite_store(path).open()
    assert path.read_bytes() == before


async def test_refuses_a_tritask_file_without_metadata(tmp_path: Path) -> None:
    path = tmp_path / "tasks.db"
    async with sqlite_store(path):
        pass
    with raw(path) as conn:
        conn.execute("DROP TABLE tritask_metadata")
    before = path.read_bytes()
    with pytest.raises(StoreSchemaError, match="no tritask_metadata table"):
        await sqlite_store(path).open()
    assert path.read_bytes() == before


def test_migrations_are_packaged_and_numbered() -> None:
    shipped = migrations()
    assert [m.version for m in shipped] == list(range(1, SCHEMA_VERSION + 1))
    assert shipped[0].name == "0001_initial.sql"
    assert any("CREATE TABLE tritask_task_events" in s for s in shipped[0].statements())


# -- cancellation -----------------------------------------------------------------------------

ENDLESS = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) SELECT count(*) FROM n"


async def test_cancel_interrupts_a_running_query(tmp_path: Path) -> None:
    async with sqlite_store(tmp_path / "tasks.db", ManualClock()) as store:
        await create(store, "task-1")

        def endless_write(conn: sqlite3.Connection, now: int) -> object:
            conn.execute(
                "UPDATE tritask_tasks SET claim_owner = 'x', claim_token = ?,"
                " lease_generation = 9, claim_expires_at_us = 1, claim_epoch = 0",
                ("0" * 36,),
            )
            return conn.execute(ENDLESS).fetchone()

        started = time.monotonic()
        with trio.move_on_after(0.2) as scope:
            await store._transact(endless_write, write=True)
        assert scope.cancelled_caught
        assert time.monotonic() - started < 5
        with trio.move_on_after(0.1) as scope:
            await store._call(lambda conn: conn.execute(ENDLESS).fetchone())
        assert scope.cancelled_caught
        # the connection is usable and the interrupted write was rolled back
        assert not await store._call(lambda conn: conn.in_transaction)
        lease = await claimed(store, "task-1")
        assert lease.generation == 1


async def test_cancelled_before_the_hop_does_nothing(tmp_path: Path) -> None:
    async with sqlite_store(tmp_path / "tasks.db", ManualClock()) as store:
        await create(store, "task-1")
        with trio.CancelScope() as scope:
            scope.cancel()
            await store.claim("task-1", "owner", LEASE_MS)
        assert (await claimed(store, "task-1")).generation == 1


# -- options, URLs, lifecycle -----------------------------------------------------------------


@pytest.mark.parametrize(("synchronous", "level"), [("FULL", 2), ("normal", 1)])
async def test_connection_settings(tmp_path: Path, synchronous: str, level: int) -> None:
    path = tmp_path / "tasks.db"
    async with sqlite_store(path, synchronous=synchronous, busy_timeout_ms=1234) as store:

        def settings(conn: sqlite3.Connection) -> list[object]:
            names = ("synchronous", "busy_timeout", "foreign_keys", "journal_mode")
            return [conn.execute(f"PRAGMA {name}").fetchone()[0] for name in names]

        assert await store._call(settings) == [level, 1234, 1, "wal"]


def test_option_validation(tmp_path: Path) -> None:
    path = tmp_path / "tasks.db"
    for bad in ("", ":memory:"):
        with pytest.raises(ValueError, match="in-memory database is not durable"):
            SqliteStore(bad, scope="shared")
    with pytest.raises(TypeError, match="requires scope="):
        SqliteStore(path)
    with pytest.raises(ValueError, match="synchronous"):
        SqliteStore(path, scope="shared", synchronous="OFF")
    for option in ("busy_timeout_ms", "reap_batch_size", "max_tasks"):
        with pytest.raises(ValueError, match=option):
            SqliteStore(path, scope="shared", **{option: 0})  # type: ignore[arg-type]
    assert not path.exists()  # construction does no I/O


def test_store_urls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert path_from_url("sqlite:tasks.db") == "tasks.db"
    assert path_from_url("sqlite:data/tasks.db") == "data/tasks.db"
    assert path_from_url("sqlite:/var/lib/tasks.db") == "/var/lib/tasks.db"
    assert path_from_url("sqlite:///var/lib/tasks.db") == "/var/lib/tasks.db"
    assert path_from_url("SQLITE:tasks.db") == "tasks.db"
    for url in ("sqlite:", "sqlite::memory:", "sqlite://host/tasks.db", "memory:"):
        with pytest.raises(ValueError):
            path_from_url(url)
    monkeypatch.chdir(tmp_path)
    store = open_store("sqlite:tasks.db")
    assert isinstance(store, Store)  # the runtime-checkable protocol
    assert isinstance(store, SqliteStore)
    assert store.path == os.path.realpath(tmp_path / "tasks.db")


async def test_open_store_defaults_to_exclusive(tmp_path: Path) -> None:
    async with open_store(f"sqlite://{tmp_path}/tasks.db") as store:
        assert isinstance(store, SqliteStore)
        assert store.boot_epoch == 1
        with pytest.raises(StoreLocked):
            await open_store(f"sqlite:{tmp_path}/tasks.db").__aenter__()


async def test_lifecycle(tmp_path: Path) -> None:
    store = sqlite_store(tmp_path / "tasks.db")
    with pytest.raises(trio.ClosedResourceError, match="not open"):
        await store.now()
    async with store:
        with pytest.raises(RuntimeError, match="opens once"):
            await store.open()
        assert isinstance(await store.now(), int)
    with pytest.raises(trio.ClosedResourceError, match="closed"):
        await store.claim("task-1", "owner", LEASE_MS)
    await store.aclose()  # idempotent
    async with sqlite_store(tmp_path / "tasks.db", exclusive=True):
        pass  # the first store's lock was released


async def test_history_entries(tmp_path: Path) -> None:
    async with sqlite_store(tmp_path / "tasks.db", ManualClock()) as store:
        assert await store.history("missing") == []
        await create(store, "task-1")
        assert await store.history("task-1") == []
        lease = await claimed(store, "task-1")
        done = await applied(
            store, "task-1", 0, Event.completed({}, id="d"), WorkerAuthority(lease)
        )
        assert await store.history("task-1") == [
            LedgerEntry(
                event=Event.completed({}, id="d"),
                revision=1,
                committed_at=done.committed_at,
                effects=Effects.none(),
            )
        ]


# -- the planned settle -----------------------------------------------------------------------


class PlannedWrites:
    """Counts the settles written from a plan (the store's fast path); ``tried`` counts the
    attempts, which write nothing when the stored row is not the planned one."""

    def __init__(self, store: SqliteStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        self.tried = 0
        write = store._write_planned

        def counted(*args: Any) -> bool:
            self.tried += 1
            written: bool = write(*args)
            self.count += written
            return written

        monkeypatch.setattr(store, "_write_planned", counted)


async def test_a_planned_settle_stores_exactly_what_it_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = ManualClock()
    async with sqlite_store(tmp_path / "tasks.db", clock) as store:
        planned = PlannedWrites(store, monkeypatch)
        claimed_ = await created_claimed(store, "task-1")
        clock.advance(7)
        done = Event.completed({"content": [], "isError": False}, id="done-1")
        result = await store.settle("task-1", 0, done, claimed_.lease)
        assert planned.count == 1
        assert isinstance(result, Transition)
        assert (result.outcome, result.event_revision) == ("applied", 1)
        assert result.committed_at == START + 7000
        stored = await get(store, "task-1")  # decoded strictly from the file
        assert stored == result.snapshot
        assert stored.task.status is TaskStatus.COMPLETED
        assert stored.task.last_updated_at == START + 7000
        [entry] = await store.history("task-1")
        assert (entry.event, entry.revision, entry.committed_at) == (done, 1, START + 7000)
        assert entry.effects == result.effects
        # the claim was released in the same write, and a resend replays the original
        with raw(store.path) as conn:
            assert conn.execute(
                "SELECT claim_owner, claim_token, claim_expires_at_us, claim_epoch"
                " FROM tritask_tasks"
            ).fetchall() == [(None, None, None, None)]
        again = await store.settle("task-1", 0, done, claimed_.lease)
        assert isinstance(again, Transition)
        assert (again.outcome, again.event_revision, again.committed_at) == (
            "duplicate",
            1,
            START + 7000,
        )
        assert planned.count == 1


async def test_a_changed_row_is_decided_in_the_transaction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rewritten behind the store's back (same JSON, other text): no plan is used."""
    async with sqlite_store(tmp_path / "tasks.db", ManualClock()) as store:
        planned = PlannedWrites(store, monkeypatch)
        claimed_ = await created_claimed(store, "task-1")
        with raw(store.path) as conn:
            (record,) = conn.execute("SELECT record FROM tritask_tasks").fetchone()
            spaced = json.dumps(json.loads(record), indent=1, sort_keys=True)
            conn.execute("UPDATE tritask_tasks SET record = ?", (spaced,))
        done = Event.completed({"content": [], "isError": False})
        result = await store.settle("task-1", 0, done, claimed_.lease)
        assert (planned.tried, planned.count) == (1, 0)  # tried, wrote nothing, then decided
        assert isinstance(result, Transition)
        assert result.outcome == "applied"
        assert await get(store, "task-1") == result.snapshot


async def test_an_event_id_already_in_the_ledger_stops_the_planned_settle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ledger holds the event id (written behind the store's back) while the row is the
    planned-on one: the one statement writes neither the entry nor the row, and the
    transaction then finds the ledger inconsistent with the row."""
    async with sqlite_store(tmp_path / "tasks.db", ManualClock()) as store:
        planned = PlannedWrites(store, monkeypatch)
        claimed_ = await created_claimed(store, "task-1")
        with raw(store.path) as conn:
            conn.execute(
                "INSERT INTO tritask_task_events (task_id, event_id, event, event_kind,"
                " event_revision, committed_at_us, effects) VALUES (?, ?, ?, ?, ?, ?, ?)",
                ("task-1", "done-1", '{"kind":"failed"}', "failed", 7, 0, "{}"),
            )
        done = Event.completed({"content": [], "isError": False}, id="done-1")
        with pytest.raises(CorruptStore, match="ledger row 1"):
            await store.settle("task-1", 0, done, claimed_.lease)
        assert (planned.tried, planned.count) == (1, 0)
        with raw(store.path) as conn:
            rows = conn.execute(
                "SELECT event_id, event_revision FROM tritask_task_events"
            ).fetchall()
        assert rows == [("done-1", 7)]
        assert await get(store, "task-1") == claimed_.snapshot


async def test_a_ledger_failure_after_the_planned_row_write_undoes_it_and_replays_the_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The planned settle writes the row, then its ledger entry: when the entry fails after the
    row was written (here a ledger row at the new revision, written behind the store's back),
    the row must not commit without it. The whole batch is rolled back and the operation
    before it in the same batch runs again and commits; the settle fails alone."""
    async with sqlite_store(tmp_path / "tasks.db", ManualClock()) as store:
        planned = PlannedWrites(store, monkeypatch)
        claimed_ = await created_claimed(store, "task-1")
        with raw(store.path) as conn:
            conn.execute(
                "INSERT INTO tritask_task_events (task_id, event_id, event, event_kind,"
                " event_revision, committed_at_us, effects) VALUES (?, ?, ?, ?, ?, ?, ?)",
                ("task-1", "other-1", '{"kind":"failed"}', "failed", 1, 0, "{}"),
            )
        lane = store._lane
        assert lane is not None
        gate = threading.Event()
        held = trio.Event()

        def hold(_conn: sqlite3.Connection) -> None:
            trio.from_thread.run_sync(held.set, trio_token=token)
            gate.wait(10)

        token = trio.lowlevel.current_trio_token()
        done = Event.completed({"content": [], "isError": False}, id="done-1")
        failures: list[BaseException] = []

        async def settle() -> None:
            try:
                await store.settle("task-1", 0, done, claimed_.lease)
            except sqlite3.IntegrityError as exc:
                failures.append(exc)

        replays = lane.replays
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(lane.run, hold))  # the lane is busy: both queue
            await held.wait()
            nursery.start_soon(created_claimed, store, "task-2")
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(settle)
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
        assert len(failures) == 1
        assert (planned.tried, planned.count) == (1, 0)
        assert lane.replays == replays + 1  # the creation ran again after the rollback
        assert await get(store, "task-1") == claimed_.snapshot  # the row was not written
        assert (await get(store, "task-2")).revision == 0  # the creation committed
        with raw(store.path) as conn:
            rows = conn.execute(
                "SELECT task_id, event_id FROM tritask_task_events ORDER BY task_id"
            ).fetchall()
            (claim,) = conn.execute(
                "SELECT claim_token FROM tritask_tasks WHERE task_id = 'task-1'"
            ).fetchone()
        assert rows == [("task-1", "other-1")]
        assert claim == claimed_.lease.token


async def test_the_planned_settle_leaves_the_schema_alone(tmp_path: Path) -> None:
    """It needs no object of its own (no view or trigger, TEMP or not): the file's schema is
    the migrations' alone."""
    async with sqlite_store(tmp_path / "tasks.db", ManualClock()) as store:
        claimed_ = await created_claimed(store, "task-1")
        done = Event.completed({"content": [], "isError": False})
        result = await store.settle("task-1", 0, done, claimed_.lease)
        assert isinstance(result, Transition) and result.outcome == "applied"
        with raw(store.path) as conn:
            names = {name for (name,) in conn.execute("SELECT name FROM sqlite_master").fetchall()}
            temp = conn.execute("SELECT count(*) FROM sqlite_temp_master").fetchone()
        assert not any("planned" in name for name in names)
        assert temp == (0,)


async def test_a_planned_settle_still_checks_the_lease_under_the_reservation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = ManualClock()
    async with sqlite_store(tmp_path / "tasks.db", clock) as store:
        planned = PlannedWrites(store, monkeypatch)
        claimed_ = await created_claimed(store, "task-1")
        clock.advance(LEASE_MS)  # the claim expires exactly now
        with pytest.raises(StaleLease):
            await store.settle("task-1", 0, Event.failed(ERROR, "late"), claimed_.lease)
        assert planned.count == 0
        assert (await get(store, "task-1")).revision == 0


async def test_a_renewed_claim_settles_without_a_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with sqlite_store(tmp_path / "tasks.db", ManualClock()) as store:
        planned = PlannedWrites(store, monkeypatch)
        claimed_ = await created_claimed(store, "task-1")
        renewed = await store.renew(claimed_.lease, LEASE_MS)
        with pytest.raises(StaleLease):
            await store.settle("task-1", 0, Event.failed(ERROR, "old"), claimed_.lease)
        result = await store.settle("task-1", 0, Event.failed(ERROR, "new"), renewed)
        assert isinstance(result, Transition)
        assert result.snapshot.task.status is TaskStatus.FAILED
        assert planned.count == 0


def stored_record(path: str) -> str:
    with raw(Path(path)) as conn:
        (record,) = conn.execute("SELECT record FROM tritask_tasks").fetchone()
    assert isinstance(record, str)
    return record


def canonical_record(snapshot: Snapshot) -> str:
    document = snapshot_to_json(snapshot)
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


async def test_a_stamped_creation_stores_the_canonical_record(tmp_path: Path) -> None:
    clock = ManualClock()
    clock.advance(1234)
    async with sqlite_store(tmp_path / "tasks.db", clock) as store:
        claimed_ = await created_claimed(store, "task-1")
        assert claimed_.snapshot.task.created_at == START + 1_234_000
        assert stored_record(store.path) == canonical_record(claimed_.snapshot)
        assert await get(store, "task-1") == claimed_.snapshot


@pytest.mark.parametrize(
    "value",
    [
        {"text": "naïve ☃ 𝄞", "float": 1e16, "tiny": 5e-324, "neg": -0.0},
        {"big": 2**64, "negative": -(2**70)},  # beyond orjson: written by the stdlib encoder
        {"lone": "\ud800"},  # a lone surrogate cannot be UTF-8: written escaped
    ],
)
async def test_records_keep_every_json_value_exactly(tmp_path: Path, value: Any) -> None:
    """Whichever encoder writes a record, reading it gives back the same value and types."""
    async with sqlite_store(tmp_path / "tasks.db", ManualClock()) as store:
        claimed_ = await created_claimed(store, "task-1", value)
        done = Event.completed({"content": [], "isError": False, "structuredContent": value})
        result = await store.settle("task-1", 0, done, claimed_.lease)
        assert isinstance(result, Transition) and result.outcome == "applied"
        stored = await get(store, "task-1")
        assert stored == result.snapshot
        exact = functools.partial(json.dumps, sort_keys=True)  # 1 vs 1.0, -0.0, big ints
        assert stored.work is not None
        assert exact(stored.work.input) == exact(value)
        assert exact(stored.task.result) == exact(done.data["result"])
        json.loads(stored_record(store.path))  # valid JSON text


async def test_a_stamp_marker_inside_the_input_falls_back_to_encoding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The marker is random per creation; forced to collide, the record is encoded whole."""
    fixed = uuid.UUID("00000000-0000-4000-8000-000000000000")
    monkeypatch.setattr(uuid, "uuid4", lambda: fixed)
    async with sqlite_store(tmp_path / "tasks.db", ManualClock()) as store:
        marker = f"tritask-stamp-{fixed}"
        claimed_ = await created_claimed(store, "task-1", {"x": marker})
        assert stored_record(store.path) == canonical_record(claimed_.snapshot)
        stored = await get(store, "task-1")
        assert stored.work is not None and stored.work.input == {"x": marker}
        assert stored.task.created_at == START


# -- schema 2: durable steps ----------------------------------------------------------------------


async def test_a_schema_1_store_migrates_to_steps_keeping_its_tasks_and_ledger(
    tmp_path: Path,
) -> None:
    """A file written by schema 1 (rows copied into a file built by 0001 alone) opens with
    schema 2: its task and ledger read exactly as before, and the task then records steps."""
    clock = ManualClock()
    current = tmp_path / "current.db"
    async with sqlite_store(current, clock) as store:
        commits = await busy_task(store)
        access = await store.authorize(A, Action.GET, "task-1")
        before = await store.get("task-1", access)
        ledger = await store.history("task-1")
    old = tmp_path / "old.db"
    with raw(current) as source, raw(old) as target:
        target.execute("BEGIN")
        target.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        for statement in migrations()[0].statements():
            target.execute(statement)
        store_id, epoch = source.execute(
            "SELECT store_id, boot_epoch FROM tritask_metadata"
        ).fetchone()
        target.execute(
            "INSERT INTO tritask_metadata (singleton, schema_version, store_id, boot_epoch)"
            " VALUES (1, 1, ?, ?)",
            (store_id, epoch),
        )
        for table in ("tritask_tasks", "tritask_task_events"):
            # The columns schema 1 has (later schemas add some).
            names = ", ".join(r[1] for r in target.execute(f"PRAGMA table_info({table})"))
            rows = source.execute(f"SELECT {names} FROM {table}").fetchall()
            marks = ", ".join("?" * len(rows[0]))
            target.executemany(f"INSERT INTO {table} ({names}) VALUES ({marks})", rows)
        target.execute("COMMIT")
        assert target.execute("SELECT record_version FROM tritask_tasks").fetchall() == [(3,)]
    async with sqlite_store(old, clock) as store:
        assert await store.get("task-1", access) == before == commits[-1].snapshot
        assert await store.history("task-1") == ledger
        await clock_advance(clock, LEASE_MS + 10)
        worker = WorkerAuthority(await claimed(store, "task-1"))
        step = Event.step_recorded("charge", "fp", {"result": {"id": "re_1"}})
        recorded = await applied(store, "task-1", 3, step, worker)
        assert [e.event.kind.value for e in await store.history("task-1")][-1] == "step_recorded"
    with raw(old) as conn:
        assert conn.execute("SELECT schema_version FROM tritask_metadata").fetchone() == (
            SCHEMA_VERSION,
        )
        version, record = conn.execute(
            "SELECT record_version, record FROM tritask_tasks"
        ).fetchone()
    assert version == 4
    assert json.loads(record) == snapshot_to_json(recorded.snapshot)
    assert json.loads(record)["steps"] == {
        "charge": {"kind": "step", "fingerprint": "fp", "outcome": {"result": {"id": "re_1"}}}
    }


async def clock_advance(clock: ManualClock, ms: int) -> None:
    clock.advance(ms)
    await trio.lowlevel.checkpoint()


@given(st.integers(min_value=0, max_value=2**128 - 1))
@example(0)
@example(2**128 - 1)
def test_claim_tokens_are_the_text_of_version_4_uuids(bits: int) -> None:
    """A new task's claim token is formatted without building a ``uuid.UUID``: the same text."""
    assert _uuid4_text(bits) == str(uuid.UUID(int=bits, version=4))


# -- schema 5: lean rows --------------------------------------------------------------------------


async def every_kind_of_task(store: SqliteStore, clock: ManualClock) -> None:
    """Tasks in every status, with ledgers, a step, following claims and their owner lease,
    a queued task and claimed and queued tasks of a concurrency key."""
    await create(store, "completed")
    lease = await claimed(store, "completed")
    await applied(store, "completed", 0, Event.completed({"v": 1}), WorkerAuthority(lease))
    await create(store, "failed")
    lease = await claimed(store, "failed")
    await applied(store, "failed", 0, Event.failed(ERROR, "no"), WorkerAuthority(lease))
    await create(store, "cancelled")
    cancel = await request(store, Action.CANCEL, "cancelled")
    await applied(store, "cancelled", 0, Event.cancelled(id="cancel-1"), cancel)
    await busy_task(store, "retrying")  # asked, answered, retry scheduled: working, retry_at
    await create(store, "asking")
    lease = await claimed(store, "asking")
    await applied(
        store, "asking", 0, Event.input_requested("a", ASK, id="ask-2"), WorkerAuthority(lease)
    )
    await create(store, "stepping")
    stepping = await claimed(store, "stepping")
    step = Event.step_recorded("charge", "fp", {"result": {"id": "re_1"}}, id="step-1")
    await applied(store, "stepping", 0, step, WorkerAuthority(stepping))
    await create(store, "running")
    running = await claimed(store, "running")
    renewed = await store.renew_all("owner-1", [stepping, running], LEASE_MS)
    assert all(isinstance(r, Renewed) for r in renewed)  # both follow owner-1's lease row
    key = Concurrency(canonical_json(["export", "tenant-a"]), 1)
    for task_id, owner in (("keyed", "owner-2"), ("keyed-queued", "owner-2"), ("queued", None)):
        access = await store.authorize(A, Action.CREATE, task_id)
        work = Work(idempotency_key=task_id, type="job", input={"n": 1})
        await store.submit(
            new_task(task_id, START, 60_000, 5),
            work,
            access,
            owner_id=owner,
            lease_ms=LEASE_MS,
            concurrency=None if task_id == "queued" else key,
        )
    clock.advance(1)


def dump(path: Path) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of the store's tables, rowids included."""
    with raw(path) as conn:
        return {
            table: conn.execute(f"SELECT rowid, * FROM {table} ORDER BY rowid").fetchall()
            for table in ("tritask_tasks", "tritask_task_events")
        } | {
            "tritask_owner_leases": conn.execute(
                "SELECT * FROM tritask_owner_leases ORDER BY owner_id"
            ).fetchall()
        }


async def reads(store: SqliteStore) -> list[object]:
    ids = [t.task_id for t in (await store.list_tasks(TaskQuery())).tasks]
    found: list[object] = [ids, await store.list_tasks(TaskQuery()), await store.audit()]
    for task_id in ids:
        found += [
            await store.get(task_id, await store.authorize(A, Action.GET, task_id)),
            await store.history(task_id),
            await store.inspect_task(task_id),
        ]
    return found


async def operator(*args: str) -> Any:
    done = await trio.run_process(
        [sys.executable, "-m", "tritask", "tasks", *args, "--json"],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        env={k: v for k, v in os.environ.items() if k != "TRITASK_STORE"},
    )
    assert done.returncode == 0, done.stderr.decode()
    return _timeless(json.loads(done.stdout))


def _timeless(value: Any) -> Any:
    """An operator answer without what depends on the real clock at the command's run."""
    if isinstance(value, dict):
        return {k: _timeless(v) for k, v in value.items() if k not in ("now", "ageMs")}
    if isinstance(value, list):
        return [_timeless(v) for v in value]
    return value


def begin_older_schema(
    target: sqlite3.Connection, source: sqlite3.Connection, version: int
) -> None:
    """Begin, on the empty file ``target``, ``source``'s store as schema ``version`` wrote it:
    migrations 1 to ``version`` and the metadata row (``source``'s store id and boot epoch),
    in a transaction left open for the caller's rows."""
    target.execute("PRAGMA journal_mode = WAL")
    target.execute("BEGIN")
    target.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    for migration in migrations()[:version]:
        for statement in migration.statements():
            target.execute(statement)
    store_id, boot_epoch = source.execute(
        "SELECT store_id, boot_epoch FROM tritask_metadata"
    ).fetchone()
    target.execute(
        "INSERT INTO tritask_metadata (singleton, schema_version, store_id, boot_epoch)"
        " VALUES (1, ?, ?, ?)",
        (version, store_id, boot_epoch),
    )


async def test_a_schema_4_store_migrates_to_lean_rows_with_identical_reads(
    tmp_path: Path,
) -> None:
    """A file written by schema 4 (every row copied into a file built by 0001-0004) migrates to
    5 (``tritask migrate``): the same rows and rowids, the schema of a new file (keys, indexes
    but the unused one, the ledger's cascading foreign key), identical reads through the store
    and through the operator commands."""
    clock = ManualClock()
    current = tmp_path / "current.db"
    async with sqlite_store(current, clock) as store:
        await every_kind_of_task(store, clock)
        before = await reads(store)
    rows = dump(current)
    assert {row[7] for row in rows["tritask_tasks"]} == {  # status
        "working",
        "input_required",
        "completed",
        "failed",
        "cancelled",
    }
    assert len(rows["tritask_owner_leases"]) == 1
    old = tmp_path / "old.db"
    with raw(current) as source, raw(old) as target:
        begin_older_schema(target, source, 4)
        for table, copied in rows.items():
            names = [r[1] for r in source.execute(f"PRAGMA table_info({table})")]
            select = "rowid, *" if table != "tritask_owner_leases" else "*"
            columns = ", ".join((["rowid"] if select != "*" else []) + names)
            marks = ", ".join("?" * len(copied[0]))
            target.executemany(f"INSERT INTO {table} ({columns}) VALUES ({marks})", copied)
        target.execute("COMMIT")
        (committed,) = target.execute(
            "SELECT sql FROM sqlite_master WHERE name = 'tritask_task_events_committed'"
        ).fetchone()
        assert committed is not None
        assert (
            "json_valid(record)"
            in target.execute(
                "SELECT sql FROM sqlite_master WHERE name = 'tritask_tasks'"
            ).fetchone()[0]
        )
    # The upgrade step the read-only commands ask for (a serving open would migrate as well).
    for report in (
        "migrated the store to version 6 (applied 0005, 0006)",
        "the store is up to date",
    ):
        done = await trio.run_process(
            [sys.executable, "-m", "tritask", "migrate", "--store", f"sqlite:{old}"],
            capture_stderr=True,
            check=False,
            env={k: v for k, v in os.environ.items() if k != "TRITASK_STORE"},
        )
        assert (done.returncode, report in done.stderr.decode()) == (0, True), done.stderr
    assert dump(old) == rows
    async with sqlite_store(old, clock) as store:
        assert await reads(store) == before
        assert await store.integrity_check() == []
    for command in (["list"], ["stats"], ["show", "stepping"], ["show", "retrying"]):
        assert await operator(*command, "--store", f"sqlite:{old}") == await operator(
            *command, "--store", f"sqlite:{current}"
        )
    with raw(old) as conn, raw(current) as fresh:
        schema_sql = "SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY name"
        assert conn.execute(schema_sql).fetchall() == fresh.execute(schema_sql).fetchall()
        assert conn.execute("SELECT schema_version FROM tritask_metadata").fetchone() == (
            SCHEMA_VERSION,
        )
        assert conn.execute("PRAGMA foreign_key_list(tritask_task_events)").fetchall() == [
            (0, 0, "tritask_tasks", "task_id", "task_id", "NO ACTION", "CASCADE", "NONE")
        ]
        assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    async with sqlite_store(old, clock) as store:
        clock.advance(61_000)  # every task's TTL: reaping deletes the ledgers too (cascade)
        assert len(await store.reap()) == len(rows["tritask_tasks"])
    with raw(old) as conn:
        assert conn.execute("SELECT count(*) FROM tritask_task_events").fetchone() == (0,)


async def test_migrate_refuses_what_it_cannot_migrate(tmp_path: Path) -> None:
    """``tritask migrate --store sqlite:PATH`` makes no new file, takes no options, and is
    refused while a server holds the file exclusively (nothing is written)."""
    missing = tmp_path / "missing.db"
    with pytest.raises(StoreSchemaError, match="no such file"):
        await sqlite_migrate(f"sqlite:{missing}")
    assert not missing.exists()
    path = tmp_path / "tasks.db"
    with pytest.raises(ValueError, match="take no options"):
        await sqlite_migrate(f"sqlite:{path}", schema="x")
    async with sqlite_store(path, exclusive=True):
        with pytest.raises(StoreLocked):
            await sqlite_migrate(f"sqlite:{path}")
    assert await sqlite_migrate(f"sqlite:{path}") == Migrated(SCHEMA_VERSION, ())


async def test_a_schema_4_row_the_lean_checks_refuse_fails_the_migration_untouched(
    tmp_path: Path,
) -> None:
    """A row that schema 4's CHECKs admitted (json_valid: a record with a leading space, which
    schema 4 also reads) but schema 5's refuse (its first character must be '{') fails the
    rebuild: the open is refused with StoreSchemaError naming the migration, the transaction is
    rolled back (still version 4, the old tables, every row as it was) instead of a bare
    sqlite3.IntegrityError from the middle of a migration."""
    clock = ManualClock()
    current, old = tmp_path / "current.db", tmp_path / "old.db"
    async with sqlite_store(current, clock) as store:
        await busy_task(store)
        await create(store, "other")
    with raw(current) as source, raw(old) as target:
        begin_older_schema(target, source, 4)
        for table in ("tritask_tasks", "tritask_task_events"):
            rows = source.execute(f"SELECT * FROM {table} ORDER BY rowid").fetchall()
            marks = ", ".join("?" * len(rows[0]))
            target.executemany(f"INSERT INTO {table} VALUES ({marks})", rows)
        target.execute("UPDATE tritask_tasks SET record = ' ' || record WHERE task_id = 'other'")
        target.execute("COMMIT")
    before = dump(old)
    with pytest.raises(StoreSchemaError, match=r"0005_lean_rows\.sql failed \(CHECK constraint"):
        await sqlite_store(old, clock).open()
    assert dump(old) == before
    with raw(old) as conn:
        assert conn.execute("SELECT schema_version FROM tritask_metadata").fetchone() == (4,)
        assert conn.execute(
            "SELECT count(*) FROM sqlite_master WHERE name = 'tritask_task_events_committed'"
        ).fetchone() == (1,)
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        conn.execute("UPDATE tritask_tasks SET record = ltrim(record) WHERE task_id = 'other'")
    async with sqlite_store(old, clock) as store:  # repaired: it migrates
        assert (await store.audit()).findings == ()
        assert (await get(store, "other")).task.id == "other"
