"""The SQLite store's writer process (``writer_process=True``): what it writes is exactly what
the store's own connection writes; what it cannot write is decided by the store; a writer that
dies, hangs or answers nonsense loses nothing and decides nothing twice.

The contract suite also runs with the writer (``TestSqliteStoreWriterContract``); these tests
drive the paths it takes: claimed creations and planned settles.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from sqlite_support import LEASE_MS, created_claimed, created_claimed_together, get, raw
from tritask_sqlite import SqliteStore, _writer, _writer_child, open_store

from tritask.tasks.events import Event
from tritask.tasks.model import TaskStatus
from tritask.tasks.store import (
    AlreadyExists,
    CapacityExceeded,
    StaleLease,
    Transition,
)
from tritask.testing.store_contract import START, ManualClock, by_tenant

pytestmark = [
    pytest.mark.contract("tasks-durable-store"),
    pytest.mark.skipif(sys.platform == "win32", reason="the writer is POSIX-only"),
]

DONE = {"content": [], "isError": False}


def dump(path: str | Path) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """Every task row and ledger row of the file, in a stable order (tokens blanked: they are
    random per store)."""
    with raw(path) as conn:
        tasks = conn.execute(
            "SELECT task_id, record_version, record, scope, revision, status, created_at_us,"
            " expires_at_us, retry_at_us, claim_owner, lease_generation, claim_expires_at_us,"
            " queued_message, concurrency_key, concurrency_limit, claim_follows,"
            " claim_token IS NULL FROM tritask_tasks ORDER BY task_id"
        ).fetchall()
        events = conn.execute(
            "SELECT task_id, event_id, event, event_kind, event_revision, committed_at_us,"
            " effects FROM tritask_task_events ORDER BY task_id, event_revision"
        ).fetchall()
    return tasks, events


async def workload(store: SqliteStore, clock: ManualClock) -> list[object]:
    """Creations and settles, some concurrent, some the writer must leave to the store."""
    results: list[object] = []
    first = await created_claimed(store, "task-0")
    results.append(first.snapshot)
    claims = await created_claimed_together(store, (f"task-{n}" for n in range(1, 9)))
    results.extend(claims[f"task-{n}"].snapshot for n in range(1, 9))
    clock.advance(5)
    settled: dict[str, object] = {}

    async def settle(task_id: str) -> None:
        done = Event.completed({**DONE, "structuredContent": {"id": task_id}}, id=f"done-{task_id}")
        settled[task_id] = await store.settle(task_id, 0, done, claims[task_id].lease)

    async with trio.open_nursery() as nursery:
        for n in range(1, 9):
            nursery.start_soon(settle, f"task-{n}")
    results.extend(settled[f"task-{n}"] for n in range(1, 9))
    with pytest.raises(AlreadyExists):  # the writer leaves it undecided; the store decides
        await created_claimed(store, "task-1")
    failed = Event.failed({"code": -32000, "message": "no"}, "no", id="failed-0")
    clock.advance(LEASE_MS + 1)  # the claim of task-0 has lapsed: past the plan's deadline
    with pytest.raises(StaleLease):
        await store.settle("task-0", 0, failed, first.lease)
    results.append(await get(store, "task-0"))
    return results


async def test_the_writer_writes_exactly_what_the_store_writes(tmp_path: Path) -> None:
    outcomes = {}
    dumps = {}
    for writer in (False, True):
        clock = ManualClock()
        path = tmp_path / f"writer-{writer}.db"
        async with SqliteStore(path, scope=by_tenant, clock=clock, writer_process=writer) as store:
            assert (store.writer is not None) is writer
            outcomes[writer] = await workload(store, clock)
            if store.writer is not None:
                # 9 creations and 8 settles written; the duplicate and the lapsed settle not
                assert (store.writer.written, store.writer.undecided) == (17, 2)
        dumps[writer] = dump(path)
    assert outcomes[True] == outcomes[False]
    assert dumps[True] == dumps[False]
    tasks, events = dumps[True]
    assert [row[5] for row in tasks] == ["working"] + ["completed"] * 8
    assert len(events) == 8


async def test_limits_are_decided_by_the_store(tmp_path: Path) -> None:
    async with SqliteStore(
        tmp_path / "tasks.db",
        scope=by_tenant,
        clock=ManualClock(),
        max_tasks=2,
        writer_process=True,
    ) as store:
        assert store.writer is not None
        await created_claimed(store, "a")
        await created_claimed(store, "b")
        with pytest.raises(CapacityExceeded, match="max_tasks"):
            await created_claimed(store, "c")
        assert (store.writer.written, store.writer.undecided) == (2, 1)
    async with SqliteStore(
        tmp_path / "scoped.db",
        scope=by_tenant,
        clock=ManualClock(),
        max_active_tasks_per_scope=1,
        writer_process=True,
    ) as store:
        await created_claimed(store, "a")
        with pytest.raises(CapacityExceeded, match="max_active_tasks_per_scope"):
            await created_claimed(store, "b")


async def test_the_url_form_turns_it_on_and_the_child_exits_with_the_store(tmp_path: Path) -> None:
    store = open_store(f"sqlite:{tmp_path / 'tasks.db'}")
    async with store:
        writer = store.writer
        assert writer is not None and writer.pid is not None
        pid = writer.pid
        process = writer._process
        assert process is not None and process.poll() is None
    assert process.poll() == 0
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    async with open_store(f"sqlite:{tmp_path / 'tasks.db'}", writer_process=False) as plain:
        assert plain.writer is None
    async with open_store(f"sqlite:{tmp_path / 'tasks.db'}", read_only=True) as read_only:
        assert read_only.writer is None


async def test_the_child_ignores_sigterm_and_sigint_until_the_store_closes(
    tmp_path: Path,
) -> None:
    """A service manager signals the whole process group; the store, not the signal, ends
    the child, after the batches it has sent."""
    async with SqliteStore(tmp_path / "tasks.db", scope=by_tenant, writer_process=True) as store:
        writer = store.writer
        assert writer is not None and writer.pid is not None
        os.kill(writer.pid, signal.SIGTERM)
        os.kill(writer.pid, signal.SIGINT)
        await trio.sleep(0.1)
        await created_claimed(store, "task-1")
        assert store.writer is writer and writer.written == 1


async def test_a_killed_writer_loses_nothing_and_the_store_goes_on(tmp_path: Path) -> None:
    async with SqliteStore(tmp_path / "tasks.db", scope=by_tenant, writer_process=True) as store:
        writer = store.writer
        assert writer is not None and writer.pid is not None
        first = await created_claimed(store, "task-0")
        os.kill(writer.pid, signal.SIGKILL)
        claims = await created_claimed_together(store, (f"task-{n}" for n in range(1, 21)))
        assert store.writer is None and writer.broken is not None
        done = Event.completed(DONE, id="done-0")
        result = await store.settle("task-0", 0, done, first.lease)
        assert isinstance(result, Transition) and result.outcome == "applied"
        tasks, events = dump(store.path)
        assert [row[0] for row in tasks] == sorted(["task-0", *claims])
        assert len(events) == 1


# -- a writer that commits and dies before it answers --------------------------------------

DYING_CHILD = textwrap.dedent(
    """
    import importlib.util, os, sys
    spec = importlib.util.spec_from_file_location("child", {child!r})
    child = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(child)
    answers = 0
    send = child._send_frame

    def dying_send(sock, value):
        global answers
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], bytes):
            answers += 1
            if answers == int(os.environ["WRITER_DIES_AT"]):
                os._exit(3)  # committed; the answer is never sent
        send(sock, value)

    child._send_frame = dying_send
    sys.exit(child.main(sys.argv))
    """
)


@pytest.fixture
def dying_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "dying_child.py"
    script.write_text(DYING_CHILD.format(child=_writer.CHILD))
    monkeypatch.setattr(_writer, "CHILD", str(script))


@pytest.mark.usefixtures("dying_child")
async def test_a_creation_committed_by_a_writer_that_died_is_not_made_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WRITER_DIES_AT", "1")
    clock = ManualClock()
    async with SqliteStore(
        tmp_path / "tasks.db", scope=by_tenant, clock=clock, writer_process=True
    ) as store:
        writer = store.writer
        assert writer is not None
        claimed = await created_claimed(store, "task-1")  # not AlreadyExists
        assert writer.broken is not None and store.writer is None
        assert claimed.snapshot == await get(store, "task-1")
        with raw(store.path) as conn:
            assert conn.execute("SELECT claim_token FROM tritask_tasks").fetchall() == [
                (claimed.lease.token,)
            ]
        done = Event.completed(DONE, id="done-1")
        result = await store.settle("task-1", 0, done, claimed.lease)
        assert isinstance(result, Transition) and result.outcome == "applied"


@pytest.mark.usefixtures("dying_child")
async def test_a_settle_committed_by_a_writer_that_died_is_applied_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WRITER_DIES_AT", "2")
    clock = ManualClock()
    changes: list[object] = []
    async with SqliteStore(
        tmp_path / "tasks.db", scope=by_tenant, clock=clock, writer_process=True
    ) as store:
        claimed = await created_claimed(store, "task-1")
        feed = store.changes()
        clock.advance(3)
        done = Event.completed(DONE, id="done-1")
        result = await store.settle("task-1", 0, done, claimed.lease)
        assert store.writer is None
        assert isinstance(result, Transition)
        assert (result.outcome, result.committed_at) == ("applied", START + 3000)
        assert result.snapshot.task.status is TaskStatus.COMPLETED
        assert await get(store, "task-1") == result.snapshot
        [entry] = await store.history("task-1")
        assert (entry.event, entry.committed_at) == (done, START + 3000)
        changes.append(await feed.__anext__())  # announced once, by the store
        await feed.aclose()
    assert len(changes) == 1


# -- the queue: cancellation, ordering --------------------------------------------------------


async def test_a_cancelled_caller_withdraws_a_queued_item_and_waits_for_a_sent_one(
    tmp_path: Path,
) -> None:
    path = tmp_path / "plain.db"
    with raw(path) as conn:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("CREATE TABLE t (n INTEGER PRIMARY KEY)")
    writer = _writer.WriterProcess(
        str(path),
        busy_timeout_ms=5000,
        synchronous="FULL",
        statements=["INSERT INTO t (n) VALUES (?)"],
    )
    await writer.start()
    try:
        assert writer.pid is not None
        os.kill(writer.pid, signal.SIGSTOP)  # the first batch is sent and not answered
        results: dict[int, object] = {}

        async def write(n: int, scope: trio.CancelScope) -> None:
            with scope:
                results[n] = await writer.run([(0, (n,), _writer_child.CHECK_NONE)])
            if scope.cancelled_caught:
                results.setdefault(n, "cancelled")

        scopes = {n: trio.CancelScope() for n in (1, 2)}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(write, 1, scopes[1])
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(write, 2, scopes[2])
            await trio.testing.wait_all_tasks_blocked()
            scopes[2].cancel()  # queued: withdrawn, never written
            scopes[1].cancel()  # sent: waits, shielded, and gets its answer
            await trio.sleep(0.05)
            assert 1 not in results
            os.kill(writer.pid, signal.SIGCONT)
        assert results == {1: True, 2: "cancelled"}
        assert (writer.written, writer.undecided) == (1, 0)
        with raw(path) as conn:
            assert conn.execute("SELECT n FROM t").fetchall() == [(1,)]
        # A failing statement leaves its item undecided and the batch goes on.
        assert await writer.run([(0, (1,), _writer_child.CHECK_NONE)]) is False
        assert await writer.run([(0, (3,), _writer_child.CHECK_ONE_ROW)]) is True
    finally:
        if writer.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(writer.pid, signal.SIGCONT)
        await writer.aclose()


async def test_a_writer_that_cannot_open_the_database_is_not_used(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "rollback.db"
    with raw(path) as conn:  # a rollback journal: the child refuses it
        conn.execute("CREATE TABLE t (n INTEGER)")
    writer = _writer.WriterProcess(
        str(path), busy_timeout_ms=100, synchronous="FULL", statements=["SELECT 1"]
    )
    with pytest.raises(_writer.WriterUnavailable, match="not in WAL mode"):
        await writer.start()
    assert writer._process is not None and writer._process.returncode == 1


async def test_a_store_whose_writer_cannot_start_writes_on_its_own_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-such-python"))
    async with SqliteStore(tmp_path / "tasks.db", scope=by_tenant, writer_process=True) as store:
        assert store.writer is None
        claimed = await created_claimed(store, "task-1")
        done = Event.completed(DONE, id="done-1")
        result = await store.settle("task-1", 0, done, claimed.lease)
        assert isinstance(result, Transition) and result.outcome == "applied"
    assert any(
        "cannot start the writer process" in record.getMessage() and record.levelname == "WARNING"
        for record in caplog.records
    )
