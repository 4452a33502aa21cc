"""One runner process on a PostgreSQL schema, for the multi-process tests.

``python pg_runner_process.py DSN SCHEMA OWNER LOG`` runs a recovering Runner whose executor
logs every attempt (``attempt TASK GENERATION OWNER``) and every effect (``effect TASK OWNER``),
fsynced, until SIGINT/SIGTERM (or SIGKILL, which is the point).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import trio
from tritask_postgres import PostgresStore

from tritask.tasks.executor import Completed, ExecutionToken
from tritask.tasks.runner import Runner
from tritask.tasks.work import Work


def _append(path: str, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


class LoggingExecutor:
    def __init__(self, owner: str, log: str) -> None:
        self.owner = owner
        self.log = log

    async def execute(self, work: Work, token: ExecutionToken, state: Any) -> Completed:
        line = f"attempt {token.task_id} {token.generation} {self.owner}"
        await trio.to_thread.run_sync(_append, self.log, line)
        await trio.sleep(float(work.input.get("seconds", 0.5)))
        await trio.to_thread.run_sync(_append, self.log, f"effect {token.task_id} {self.owner}")
        return Completed({"content": [{"type": "text", "text": f"done by {self.owner}"}]})


async def main(dsn: str, schema: str, owner: str, log: str) -> None:
    async with PostgresStore(
        dsn, schema=schema, scope="shared", max_active_tasks_per_scope=None
    ) as store:
        runner = Runner(
            store,
            executor=LoggingExecutor(owner, log),
            recover=True,
            owner_id=owner,
            lease_ms=2_000,
            recovery_interval_ms=250,
            max_jobs=100,
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(runner.run)
            print(f"ready {owner}", flush=True)
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    break
            runner.stop()


if __name__ == "__main__":
    dsn, schema, owner, log = sys.argv[1:5]
    trio.run(main, dsn, schema, owner, log)
