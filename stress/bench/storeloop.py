"""A store's hot path in one process, no HTTP: a steady measure for callgrind.

``python -m stress.bench.storeloop N [memory|sqlite|writer|postgresql://...]`` runs N tasks
through the store as the runner of ``bench tasks`` does, 16 at a time: ``submit`` claimed
(stamped, default limits), then ``settle`` with a completed result. ``memory`` is the memory
store; ``sqlite`` a fresh SQLite file (FULL) writing on its own connection; ``writer`` the same
with its writer process (``writer_process=True``, as ``tritask serve`` runs it); a PostgreSQL
URL a fresh schema there, dropped afterwards (the server's backends are not this process: its
count is the store's Python and libpq on the trio thread). It prints the CPU time per task of
this process (its threads, not the writer's) on stderr, and the writer's counts.

Under callgrind the instruction count per task is the difference between two runs divided by
the difference of their N (the start-up cancels out), steady whatever else the machine does,
and the writer process is not counted (valgrind does not follow children by default):

    valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python -m stress.bench.storeloop 300 writer
    valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python -m stress.bench.storeloop 1300 writer

(``python`` must be the interpreter itself, not a shim script.) On 2026-12-02 at f3a674a:
718.1k instructions per task for ``writer``, 598.5k for ``memory``. A PostgreSQL count (992.8k
at 4dee7c7, on an Intel Xeon) is of smaller batches than at full speed: valgrind slows this
process, not the server's backends, so fewer operations queue behind each round trip.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Final

import trio

from tritask.tasks.events import Event
from tritask.tasks.memory import MemoryStore
from tritask.tasks.model import new_task
from tritask.tasks.store import Action, Claimed, Store, queues, settles
from tritask.tasks.work import Work

CLIENTS: Final = 16
DONE: Final = {"content": [], "isError": False}


async def run(n: int, kind: str, folder: str) -> None:
    if kind.startswith(("postgresql:", "postgres:")):
        from stress.common import prepared_store_url
        from tritask.tasks.stores import open_store

        async with prepared_store_url(kind) as url:
            await loop(n, "postgresql", open_store(url, scope="shared"))
        return
    store: Store
    if kind == "memory":
        store = MemoryStore(scope="shared")
    else:
        from tritask_sqlite import SqliteStore

        path = os.path.join(folder, "loop.db")
        store = SqliteStore(path, scope="shared", writer_process=kind == "writer")
    await loop(n, kind, store)


async def loop(n: int, kind: str, store: Store) -> None:
    submitter = store
    assert queues(submitter), "the loop needs submit"
    settler = store
    assert settles(settler), "the loop needs settle"
    async with store:
        numbers = iter(range(n))

        async def client() -> None:
            for number in numbers:
                task_id = f"task-{number:07d}"
                access = await store.authorize(None, Action.CREATE, task_id)
                task = new_task(task_id, 0, 60_000, 5)
                work = Work(idempotency_key=task_id, type="noop", input={"n": number})
                claimed = await submitter.submit(
                    task, work, access, owner_id="loop", lease_ms=30_000
                )
                assert isinstance(claimed, Claimed), claimed
                done = Event.completed(DONE)
                await settler.settle(task_id, 0, done, claimed.lease)

        started = time.process_time()
        async with trio.open_nursery() as nursery:
            for _ in range(CLIENTS):
                nursery.start_soon(client)
        cpu = time.process_time() - started
        writer = getattr(store, "writer", None)
        counts = "" if writer is None else f", writer wrote {writer.written}"
        counts += "" if writer is None else f" and left {writer.undecided} undecided"
        print(f"{kind}: {cpu * 1e6 / max(n, 1):.1f} µs of CPU per task{counts}", file=sys.stderr)


def main(argv: list[str]) -> int:
    kinds = ("memory", "sqlite", "writer")
    url = len(argv) == 3 and argv[2].startswith(("postgresql:", "postgres:"))
    if len(argv) not in (2, 3) or (len(argv) == 3 and argv[2] not in kinds and not url):
        print(__doc__, file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as folder:
        trio.run(run, int(argv[1]), argv[2] if len(argv) == 3 else "writer", folder)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
