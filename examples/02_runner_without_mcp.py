"""The durable Runner inside a trio application, without MCP: a job queue with leases.

Run it: ``python examples/02_runner_without_mcp.py [PATH]``. Tasks, their work descriptors and
their results live in a SQLite file; an executor owned by the application does the work. The
first runner is stopped while a task is still running, as a crash or a deploy would; the second
runner, on the same file, recovers it and finishes it with the same idempotency key.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import trio
from tritask_sqlite import SqliteStore

from tritask import Completed, ExecutionToken, Runner, Work
from tritask.tasks.model import Snapshot, TaskStatus, new_task
from tritask.tasks.store import Action


class Operator:
    """Who acts on the store: the scope function below files every task under one tenant."""

    principal = {"tenant": "reports"}


class ReportExecutor:
    """Application-owned work: resolved on every claim, so any runner can finish it."""

    def __init__(self) -> None:
        self.runs: list[tuple[str, int]] = []
        self.started = trio.Event()
        self.hold = trio.Event()

    async def execute(self, work: Work, token: ExecutionToken, state: Any) -> Completed:
        self.runs.append((token.idempotency_key, token.generation))
        self.started.set()
        if len(self.runs) == 1:
            await self.hold.wait()  # the first attempt is still running when its runner stops
        rows = work.input["rows"]
        return Completed({"content": [{"type": "text", "text": f"report of {rows} rows"}]})


async def main(path: Path) -> None:
    executor = ReportExecutor()
    store = SqliteStore(path, scope=lambda ctx: ctx.principal["tenant"])
    async with store:
        access = await store.authorize(Operator(), Action.CREATE, "report-1")
        async with Runner(store, executor=executor, lease_ms=2_000) as first:
            task = new_task("report-1", 0, ttl_ms=None, poll_interval_ms=None)
            work = Work(idempotency_key="report-1", type="report", input={"rows": 1000})
            created = await first.create_task(task, work, access, stamp=True)
            print("1. stored and started:", created.task.status.value)
            await executor.started.wait()
        # Leaving the block stopped the first runner: its attempt was cancelled, its lease
        # released, and the task is still "working" in the file.
        get = await store.authorize(Operator(), Action.GET, "report-1")
        left = await store.get("report-1", get)
        assert isinstance(left, Snapshot) and left.task.status is TaskStatus.WORKING
        print("2. the first runner stopped; the task waits in", path.name)

        executor.hold.set()
        finished = trio.Event()
        second = Runner(store, executor=executor, recover=True, recovery_interval_ms=50)
        second.subscribe(
            lambda snapshot: finished.set() if snapshot.task.status.is_terminal else None
        )
        async with second:
            await finished.wait()
        done = await store.get("report-1", get)
        assert isinstance(done, Snapshot) and done.task.status is TaskStatus.COMPLETED
        print("3. recovered and completed:", done.task.result["content"][0]["text"])  # type: ignore[index]
        (first_key, first_generation), (second_key, second_generation) = executor.runs
        assert first_key == second_key == "report-1" and second_generation > first_generation
        print("4. same idempotency key, generation", first_generation, "then", second_generation)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        trio.run(main, Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as scratch:
            trio.run(main, Path(scratch) / "jobs.db")
