"""Runners on PostgreSQL: wake-ups, cross-host cancellation, and three processes with a SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import trio
from postgres_support import SchemaFactory, pg_schemas, postgres_dsn
from tritask_postgres import PostgresStore

from tritask.tasks.events import Event, EventKind
from tritask.tasks.executor import Completed, ExecutionToken
from tritask.tasks.model import Snapshot, TaskStatus, new_task
from tritask.tasks.runner import Runner
from tritask.tasks.store import Action, Claimed, StaleLease, WorkerAuthority
from tritask.tasks.work import Work

__all__ = ["pg_schemas", "postgres_dsn"]

pytestmark = [pytest.mark.postgres, pytest.mark.contract("tasks-recovery-claims")]

HERE = Path(__file__).parent


class _Anyone:
    principal = None


def store(schemas: SchemaFactory, schema: str, **options: Any) -> PostgresStore:
    options.setdefault("max_active_tasks_per_scope", None)
    return PostgresStore(schemas.dsn, schema=schema, scope="shared", **options)


async def create(store: PostgresStore, task_id: str, seconds: float = 0.0) -> None:
    access = await store.authorize(_Anyone(), Action.CREATE, task_id)
    task = new_task(task_id, await store.now(), 600_000, 100)
    work = Work(idempotency_key=task_id, type="job", input={"seconds": seconds})
    await store.create(task, work, access)


class Recorder:
    def __init__(self) -> None:
        self.started: dict[str, trio.Event] = {}
        self.cancelled: dict[str, trio.Event] = {}
        self.done: list[str] = []
        self.finished: dict[str, trio.Event] = {}

    def event(self, table: dict[str, trio.Event], task_id: str) -> trio.Event:
        return table.setdefault(task_id, trio.Event())

    async def execute(self, work: Work, token: ExecutionToken, state: Any) -> Completed:
        self.event(self.started, token.task_id).set()
        try:
            await trio.sleep(float(work.input["seconds"]))
        except trio.Cancelled:
            self.event(self.cancelled, token.task_id).set()
            raise
        self.done.append(token.task_id)
        self.event(self.finished, token.task_id).set()
        return Completed({"content": []})


async def test_a_new_task_wakes_a_runner_on_another_host(pg_schemas: SchemaFactory) -> None:
    """No polling: the runner polls every 10 minutes, yet adopts the task at once (NOTIFY)."""
    schema = await pg_schemas.migrated()
    recorder = Recorder()
    async with store(pg_schemas, schema) as host_a, store(pg_schemas, schema) as host_b:
        runner = Runner(host_b, executor=recorder, recover=True, recovery_interval_ms=600_000)
        async with runner:
            await trio.sleep(0.5)  # the first recovery pass (empty) is over; now only NOTIFY
            await create(host_a, "woken", seconds=0)
            with trio.fail_after(30):
                await recorder.event(recorder.started, "woken").wait()
                await recorder.event(recorder.finished, "woken").wait()


async def test_cancel_on_host_a_stops_the_attempt_on_host_b(pg_schemas: SchemaFactory) -> None:
    """``tasks/cancel`` served by A commits first; B's attempt stops long before a heartbeat."""
    schema = await pg_schemas.migrated()
    recorder = Recorder()
    async with store(pg_schemas, schema) as host_a, store(pg_schemas, schema) as host_b:
        runner_b = Runner(
            host_b, executor=recorder, recover=True, lease_ms=600_000, recovery_interval_ms=100
        )
        runner_a = Runner(host_a, recover=False, lease_ms=600_000)
        async with runner_b, runner_a:
            await create(host_a, "long", seconds=3600)
            with trio.fail_after(30):
                await recorder.event(recorder.started, "long").wait()
            access = await host_a.authorize(_Anyone(), Action.CANCEL, "long")
            snapshot = await runner_a.cancel("long", access)
            assert isinstance(snapshot, Snapshot)
            assert snapshot.task.status == TaskStatus.CANCELLED
            # Heartbeats come every 200 s here: only the cancellation notification can do it.
            with trio.fail_after(30):
                await recorder.event(recorder.cancelled, "long").wait()
                while runner_b.statistics().jobs:  # noqa: ASYNC110 (the runner's own state)
                    await trio.sleep(0.01)
            assert recorder.done == []
            history = await host_a.history("long")
            assert [entry.event.kind for entry in history] == [EventKind.CANCELLED]


def _start(dsn: str, schema: str, owner: str, log: Path) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, str(HERE / "pg_runner_process.py"), dsn, schema, owner, str(log)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line.strip() == f"ready {owner}", (line, process.stderr.read() if process.stderr else "")
    return process


@pytest.mark.slow
async def test_three_runner_processes_one_killed(pg_schemas: SchemaFactory, tmp_path: Path) -> None:
    """Kill one of three runner processes mid-work: its tasks are reclaimed by the others
    after the lease at a higher generation; a commit with a dead lease is refused; no task is
    lost or finished twice."""
    schema = await pg_schemas.migrated()
    log = tmp_path / "attempts.log"
    owners = ["runner-1", "runner-2", "runner-3"]
    processes = {owner: _start(pg_schemas.dsn, schema, owner, log) for owner in owners}
    task_ids = [f"job-{n:03d}" for n in range(60)]
    try:
        async with store(pg_schemas, schema) as admin:
            for task_id in task_ids:
                await create(admin, task_id, seconds=1.5)
            # A lease held by a "process" that then dies: taken here at creation, never renewed.
            access = await admin.authorize(_Anyone(), Action.CREATE, "doomed")
            doomed = await admin.create_claimed(
                new_task("doomed", await admin.now(), 600_000, 100),
                Work(idempotency_key="doomed", type="job", input={"seconds": 0.1}),
                access,
                "dead-owner",
                1_000,
            )
            assert isinstance(doomed, Claimed)

            def attempts_by(owner: str) -> int:
                if not log.exists():
                    return 0
                return sum(1 for line in log.read_text().splitlines() if line.endswith(owner))

            with trio.fail_after(60):
                while attempts_by("runner-1") < 3:  # noqa: ASYNC110 (another process's log)
                    await trio.sleep(0.05)
            processes["runner-1"].send_signal(signal.SIGKILL)
            processes["runner-1"].wait(30)

            with trio.fail_after(120):
                while True:
                    statuses = []
                    for task_id in [*task_ids, "doomed"]:
                        access = await admin.authorize(_Anyone(), Action.GET, task_id)
                        snapshot = await admin.get(task_id, access)
                        assert isinstance(snapshot, Snapshot)
                        statuses.append(snapshot.task.status)
                    if all(status.is_terminal for status in statuses):
                        break
                    await trio.sleep(0.2)
            assert set(statuses) == {TaskStatus.COMPLETED}

            with pytest.raises(StaleLease):
                await admin.transition(
                    "doomed", 1, Event.completed({"late": True}), WorkerAuthority(doomed.lease)
                )
            histories = {task_id: await admin.history(task_id) for task_id in task_ids}
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
        for process in processes.values():
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()

    lines = [line.split() for line in log.read_text().splitlines()]
    attempts = [(task, int(gen), owner) for kind, task, gen, owner in
                (line for line in lines if line[0] == "attempt")]  # fmt: skip
    killed = {task: gen for task, gen, owner in attempts if owner == "runner-1"}
    assert killed, "runner-1 attempted nothing before it was killed"
    for task, generation in killed.items():
        later = [g for t, g, owner in attempts if t == task and owner != "runner-1"]
        if not any(line == ["effect", task, "runner-1"] for line in lines):
            assert later and min(later) > generation, (task, generation, later)
    for task_id, history in histories.items():
        kinds = [entry.event.kind for entry in history]
        assert kinds == [EventKind.COMPLETED], (task_id, kinds)
        assert [entry.revision for entry in history] == [1]
    finishers = Counter(task for kind, task, *_ in lines if kind == "effect")
    assert set(finishers) == set(task_ids) | {"doomed"}
    repeated = {task: count for task, count in finishers.items() if count > 1}
    print(f"effects repeated after the kill (at least once, keyed): {repeated}")
