"""Push across hosts on PostgreSQL: every applied transition and reaped task is a ``NOTIFY`` on
the schema's ``changes`` channel; ``changes()`` merges them with the store's own commits.

Store level: two store objects on one schema. Process level: two real ``tritask serve``
processes on one schema; a listen stream on host A follows a task that host B runs to
``completed``, raw and through ``tritask.client``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import pytest
import trio
from fixture_process import serve_fixture
from postgres_support import SchemaFactory, pg_schemas, postgres_dsn
from postgres_support import connect as pg_connect
from tritask_postgres import PostgresStore
from tritask_postgres._changes import (
    change_payload,
    own_suffixes,
    parse_change,
    reaped_payload_sql,
)

from tritask.client import connect
from tritask.tasks.changes import RESYNC, TaskChange
from tritask.tasks.events import Event
from tritask.tasks.model import TaskStatus, new_task
from tritask.tasks.store import Action, Claimed, RequestAuthority, WorkerAuthority
from tritask.tasks.work import Work

__all__ = ["pg_schemas", "postgres_dsn"]

pytestmark = pytest.mark.postgres

ASK = {"method": "elicitation/create", "params": {"message": "Sure?"}}


class _Anyone:
    principal = None


def _store(schemas: SchemaFactory, schema: str, **options: Any) -> PostgresStore:
    return PostgresStore(schemas.dsn, schema=schema, scope="shared", **options)


async def _next(stream: AsyncGenerator[TaskChange, None], *, skip_resync: bool = True) -> Any:
    with trio.fail_after(10):
        while True:
            change = await anext(stream)
            if change.kind != "resync" or not skip_resync:
                return change


async def _listening(stream: AsyncGenerator[TaskChange, None]) -> None:
    """The local resync, then the one that says ``LISTEN`` is established."""
    assert await _next(stream, skip_resync=False) is RESYNC
    assert await _next(stream, skip_resync=False) is RESYNC


def test_payloads_are_bounded_and_decoded_strictly() -> None:
    longest = "t" * 256
    payload = change_payload(longest, 2**40, TaskStatus.INPUT_REQUIRED, "origin-a")
    assert len(payload.encode()) < 400
    assert parse_change(payload, "origin-b") == TaskChange(
        "changed", longest, 2**40, TaskStatus.INPUT_REQUIRED
    )
    assert parse_change(payload, "origin-a") is None  # our own: announced in process already
    for bad in (
        "",
        "[]",
        "not json",
        '{"v":2,"kind":"changed","taskId":"t","revision":1,"status":"working","origin":"x"}',
        '{"v":1,"kind":"changed","taskId":"","revision":1,"status":"working","origin":"x"}',
        '{"v":1,"kind":"changed","taskId":"t","revision":-1,"status":"working","origin":"x"}',
        '{"v":1,"kind":"changed","taskId":"t","revision":true,"status":"working","origin":"x"}',
        '{"v":1,"kind":"changed","taskId":"t","revision":1,"status":"done","origin":"x"}',
        '{"v":1,"kind":"resync","taskId":"t","origin":"x"}',
        json.dumps({"v": 1, "kind": "reaped", "taskId": "x" * 257, "origin": "x"}),
    ):
        assert parse_change(bad, "mine") is None, bad
    reaped = json.dumps({"v": 1, "kind": "reaped", "taskId": "t", "origin": "x"})
    assert parse_change(reaped, "mine") == TaskChange("reaped", "t")


def test_own_payloads_are_told_apart_by_their_suffix_only(postgres_dsn: str) -> None:
    """The listener drops this store object's own NOTIFYs by their ending, undecoded: both
    payload forms (the compact JSON of a change, PostgreSQL's text of a reaped task) end so,
    and no payload of another origin does, whatever its task id holds."""
    mine, theirs = "0a1b2c3d4e5f6071", "0a1b2c3d4e5f6072"
    own = own_suffixes(mine)
    tricky = f'x","origin":"{mine}"}}'  # a task id that quotes the suffix (escaped in JSON)
    for task_id in ("t", "t" * 256, tricky, 'q"}'):
        for status in TaskStatus:
            assert change_payload(task_id, 3, status, mine).encode().endswith(own)
            assert not change_payload(task_id, 3, status, theirs).encode().endswith(own)
            assert parse_change(change_payload(task_id, 3, status, theirs), mine) is not None
    with pg_connect(postgres_dsn) as conn:
        for task_id in ("t", tricky):
            for origin, ends in ((mine, True), (theirs, False)):
                query = "SELECT " + reaped_payload_sql("%(id)s::text", "%(origin)s::text")
                row = conn.execute(query, {"id": task_id, "origin": origin}).fetchone()
                assert row is not None
                payload = str(row[0])
                assert payload.encode().endswith(own) is ends, payload
                assert (parse_change(payload, mine) is None) is ends


async def test_changes_of_another_store_object_arrive_without_their_task(
    pg_schemas: SchemaFactory,
) -> None:
    schema = await pg_schemas.migrated()
    async with (
        _store(pg_schemas, schema) as here,
        _store(pg_schemas, schema) as there,
        _store(pg_schemas, schema, notify_changes=False) as quiet,
        aclosing(here.changes()) as stream,
    ):
        await _listening(stream)
        access = await there.authorize(_Anyone(), Action.CREATE, "task-1")
        task = new_task("task-1", await there.now(), 1_000, 100)
        work = Work(idempotency_key="task-1", type="job", input={})
        claimed = await there.create_claimed(task, work, access, "host-b", 30_000)
        assert isinstance(claimed, Claimed)
        worker = WorkerAuthority(claimed.lease)
        await there.transition("task-1", 0, Event.input_requested("k", ASK), worker)
        # Heard from the other host: id, revision and status, no task (read it yourself).
        change = await _next(stream)
        assert change == TaskChange("changed", "task-1", 1, TaskStatus.INPUT_REQUIRED)
        assert change.task is None
        # A commit of our own comes at once, with its task, and only once.
        update = RequestAuthority(await here.authorize(_Anyone(), Action.UPDATE, "task-1"))
        answer = Event.input_responses_accepted({"k": {"action": "accept"}})
        await here.transition("task-1", 1, answer, update)
        own = await _next(stream)
        assert own == TaskChange("changed", "task-1", 2, TaskStatus.WORKING)
        assert own.task is not None and own.task.status is TaskStatus.WORKING
        # A store with notify_changes=False tells nobody; the next change is the settle.
        cancel = RequestAuthority(await quiet.authorize(_Anyone(), Action.CANCEL, "task-1"))
        await quiet.transition("task-1", 2, Event.cancelled(), cancel)
        await there.settle("task-1", 3, Event.completed({"content": []}), claimed.lease)
        # (cancelled is terminal: the settle is unchanged and sends nothing either)
        await trio.sleep(1.5)
        assert await there.reap() == ["task-1"]
        assert await _next(stream) == TaskChange("reaped", "task-1")


async def test_a_listener_follows_across_two_serve_processes(
    pg_schemas: SchemaFactory,
) -> None:
    if not pg_schemas.dsn.startswith(("postgresql://", "postgres://")):
        pytest.skip("needs a URL DSN to build --store")
    schema = await pg_schemas.migrated()
    sep = "&" if "?" in pg_schemas.dsn else "?"
    url = f"{pg_schemas.dsn}{sep}schema={schema}"
    async with (
        serve_fixture(store=url, ws=False) as host_a,
        serve_fixture(store=url, ws=False) as host_b,
    ):
        a, b = host_a.url, host_b.url
        with trio.fail_after(20):  # below the client's 30 s listen guard: pushed, not polled
            async with connect(a) as on_a, connect(b) as on_b:
                # Host B runs the task; a raw listen stream on host A follows it.
                call = await on_b.start_tool("slow_compute", {"seconds": 2, "label": "B"})
                task_id = call.task_id
                assert task_id is not None
                statuses = []
                async with on_a.listen(task_ids=[task_id]) as stream:
                    assert stream.task_ids == (task_id,)
                    async for notification in stream:
                        state = notification.task
                        assert state is not None and state.task_id == task_id
                        statuses.append(state.status)
                        if state.terminal:
                            break
                assert statuses == ["working", "completed"]
                # The client follows a second task through A while B runs it.
                started = await on_b.start_tool("slow_compute", {"seconds": 2, "label": "B2"})
                assert started.task_id is not None
                result = await on_a.task(started.task_id).result()
                assert result.text == "Completed B2"
                assert result.task_id == started.task_id
