"""Two runners on one PostgreSQL database: a task started on host A finishes on host B.

Run it: ``python examples/10_tasks_postgres.py [DSN]`` (default ``postgresql://127.0.0.1:5432/
test``, or ``TRITASK_POSTGRES_DSN``). It migrates a fresh schema, serves the same app from two
"hosts" (two stores, two runners), starts a task on A, takes A away mid-task, and shows B
adopting the work within milliseconds (LISTEN/NOTIFY, no polling) at a higher lease
generation, with the same idempotency key; then it drops the schema.
"""

from __future__ import annotations

import os
import secrets
import sys
from typing import Any

import psycopg
import trio
from psycopg import sql
from tritask_postgres import PostgresStore, migrate

from tritask import App, Completed, ExecutionToken, Runner, Tasks, Work
from tritask.testing.client import Client


class ReportExecutor:
    """Host A's attempt is held until A goes away; host B's finishes."""

    def __init__(self, host: str, log: list[tuple[str, str, int]]) -> None:
        self.host = host
        self.log = log
        self.started = trio.Event()

    async def execute(self, work: Work, token: ExecutionToken, state: Any) -> Completed:
        self.log.append((self.host, work.idempotency_key, token.generation))
        self.started.set()
        if self.host == "A":
            await trio.sleep_forever()
        return Completed(
            {"content": [{"type": "text", "text": f"report built on host {self.host}"}]}
        )


def build_app() -> tuple[App, Tasks]:
    app = App("example-10", "0.1.0")

    @app.tool()
    async def build_report(name: str) -> str:
        """Build a report (executed by the hosts' executors)."""
        raise RuntimeError("build_report runs only through an executor")

    tasks = Tasks(task_support={"build_report": "required"}, poll_interval_ms=20)
    app.add_extension(tasks)
    return app, tasks


async def main(dsn: str) -> None:
    schema = f"tritask_example_10_{secrets.token_hex(4)}"
    await migrate(dsn, schema=schema)
    print("1. migrated schema", schema)
    log: list[tuple[str, str, int]] = []
    executor_a, executor_b = ReportExecutor("A", log), ReportExecutor("B", log)
    app_a, tasks_a = build_app()
    app_b, tasks_b = build_app()
    try:
        async with (
            PostgresStore(dsn, schema=schema, scope="shared") as store_a,
            PostgresStore(dsn, schema=schema, scope="shared") as store_b,
            Runner(store_b, executor=executor_b, recover=True, recovery_interval_ms=600_000) as b,
        ):
            tasks_a.store, tasks_b.store, tasks_b.runner = store_a, store_b, b
            async with Runner(store_a, executor=executor_a, owner_id="host-a") as a:
                tasks_a.runner = a
                created = await Client.direct(app_a).call_tool("build_report", {"name": "q3"})
                task_id = created["taskId"]
                assert isinstance(task_id, str)
                await executor_a.started.wait()
                print("2. host A started task", task_id, "at generation", log[0][2])
                tasks_a.runner = None
            print("3. host A went away mid-task (its attempt stopped, its lease released)")
            with trio.fail_after(30):
                await executor_b.started.wait()
            print("4. host B adopted it at generation", log[-1][2], "(woken by NOTIFY)")
            done = await Client.direct(app_b).wait_task(task_id, poll_seconds=0.02)
            assert done["status"] == "completed", done
            print("5. completed:", done["result"]["content"][0]["text"])
            (_, key_a, generation_a), (_, key_b, generation_b) = log
            assert key_a == key_b == task_id and generation_b > generation_a
            tasks_b.runner = None
    finally:
        await trio.to_thread.run_sync(_drop, dsn, schema)
    print("6. dropped schema", schema)


def _drop(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


if __name__ == "__main__":
    default = os.environ.get("TRITASK_POSTGRES_DSN", "postgresql://127.0.0.1:5432/test")
    trio.run(main, sys.argv[1] if len(sys.argv) > 1 else default)
