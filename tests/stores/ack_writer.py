"""A process that writes tasks as fast as it can and prints each write once it was told of it.

``python ack_writer.py sqlite PATH`` or ``python ack_writer.py postgresql DSN SCHEMA``: 32
concurrent workers each create a task claimed (``create_claimed_stamped``) and settle it
(``settle`` with a completed event), printing ``created ID`` after the creation returned and
``settled ID`` after the settle returned, until the process is killed (SIGKILL, which is the
point). The store's group commit batches these concurrent operations; a line is printed only
after the caller heard of its write, so every printed line names an acknowledged write.
"""

from __future__ import annotations

import sys
import uuid
from typing import Any

import trio

from tritask.tasks.events import Event
from tritask.tasks.model import new_task
from tritask.tasks.store import Action
from tritask.tasks.work import Work

WORKERS = 32


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def _worker(store: Any, run: str, index: int) -> None:
    n = 0
    while True:
        task_id = f"ack-{run}-{index}-{n}"
        n += 1
        access = await store.authorize(None, Action.CREATE, task_id)
        work = Work(idempotency_key=task_id, type="ack", input={"n": n})
        claimed = await store.create_claimed_stamped(
            new_task(task_id, 0, None, None), work, access, f"writer-{index}", 60_000
        )
        _say(f"created {task_id}")
        done = await store.settle(
            task_id, 0, Event.completed({"content": [], "isError": False}), claimed.lease
        )
        assert done.outcome == "applied", done
        _say(f"settled {task_id}")


def _open(argv: list[str]) -> Any:
    options: dict[str, Any] = {"scope": "shared", "max_tasks": None}
    options["max_active_tasks_per_scope"] = None
    if argv[0] == "sqlite":
        from tritask_sqlite import SqliteStore

        return SqliteStore(argv[1], **options)
    from tritask_postgres import PostgresStore

    return PostgresStore(argv[1], schema=argv[2], **options)


async def main(argv: list[str]) -> None:
    run = uuid.uuid4().hex[:8]  # task ids never repeat across the runs on one database
    async with _open(argv) as store, trio.open_nursery() as nursery:
        for index in range(WORKERS):
            nursery.start_soon(_worker, store, run, index)
        _say("ready")


if __name__ == "__main__":
    trio.run(main, sys.argv[1:])
