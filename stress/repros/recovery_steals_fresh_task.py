"""A recovering runner claims a task in the gap between another runner's create and claim.

``Runner.create_task`` stores the task (``store.create``) and claims it (``store.claim``) in two
store calls. A freshly created task is claimable at once, so any runner with ``recover=True``
whose ``claim_next`` runs in that gap adopts it as *recovered* work: the creating runner's
``claim`` then answers ``UNAVAILABLE`` and it silently drops the task, and the adopter runs the
first attempt without the request context (``token.context is None``, ``token.recovered``).

With the Tasks extension this means a task-required tool registered ``restartable=False`` fails
with "not restartable; its work was lost in a restart" on a healthy cluster, and a first attempt
loses its client capabilities (``await_input`` checks) and progress/log stream. On one process
the runner's own recovery loop steals its own creations the same way (they then run with the
context, but are reported as ``source=recovery``): ``python -m stress bench tasks --store
sqlite:auto`` shows it as ``claim_next`` calls (about 8% of the tasks on the 2-core machine).

Run: ``python -m stress.repros.recovery_steals_fresh_task`` (exit status 1 = reproduced).
Fixed by stores that offer ``create_claimed`` (``CreatesClaimed``: create and claim in one
atomic step; memory, SQLite and PostgreSQL): the script now exits 0 and stays as a regression
check. A third-party store without ``create_claimed`` still has the gap.
"""

from __future__ import annotations

import sys
from typing import Any, cast

import trio

from stress.wrappers import StoreProxy
from tritask.tasks.executor import Completed, ExecutionToken, Outcome
from tritask.tasks.memory import MemoryStore
from tritask.tasks.model import new_task
from tritask.tasks.runner import Runner
from tritask.tasks.store import Action, Claimed, Deferred, NotFound, Unavailable
from tritask.tasks.work import Work

TASKS = 300
ROUND_TRIP = 0.002
"""A database round trip: the memory store answers at once, a SQL store does not."""


class _RemoteStore(StoreProxy):
    """The memory store as if it were across a network: ``claim`` takes a round trip."""

    async def claim(
        self, task_id: str, owner_id: str, lease_ms: int
    ) -> Claimed | Deferred | Unavailable | NotFound:
        await trio.sleep(ROUND_TRIP)
        return await self.inner.claim(task_id, owner_id, lease_ms)


class _Context:
    """Stands in for a request ``Context`` (only ``detach`` is used by the runner)."""

    def detach(self, **_: Any) -> _Context:
        return self


class _Recorder:
    def __init__(self) -> None:
        self.runs: list[tuple[str, bool, bool]] = []
        self.all_ran = trio.Event()

    async def execute(self, work: Work, token: ExecutionToken, state: Any) -> Outcome:
        self.runs.append((str(state), token.recovered, token.context is not None))
        if len(self.runs) == TASKS:
            self.all_ran.set()
        return Completed({"content": [], "isError": False})


async def main() -> int:
    store = _RemoteStore(
        MemoryStore(scope="shared", max_tasks=None, max_active_tasks_per_scope=None)
    )
    recorder = _Recorder()
    creator = Runner(
        store, executor=recorder, executor_state="creator", owner_id="creator", max_jobs=TASKS
    )
    recoverer = Runner(
        store,
        executor=recorder,
        executor_state="recoverer",
        owner_id="recoverer",
        recover=True,
        recovery_interval_ms=1,
        max_jobs=TASKS,
    )
    async with store, trio.open_nursery() as nursery:
        await nursery.start(creator.run)
        await nursery.start(recoverer.run)
        for n in range(TASKS):
            task_id = f"fresh-{n}"
            access = await store.authorize(None, Action.CREATE, task_id)
            task = new_task(task_id, await store.now(), None, None)
            work = Work(idempotency_key=task_id, type="noop", input={})
            await creator.create_task(task, work, access, context=cast(Any, _Context()))
        await recorder.all_ran.wait()
        creator.stop()
        recoverer.stop()
    stolen = [run for run in recorder.runs if run[0] == "recoverer"]
    print(f"{len(stolen)} of {TASKS} first attempts ran on the recovering runner", file=sys.stderr)
    print(
        f"  of which without their request context: {sum(1 for r in stolen if not r[2])}",
        file=sys.stderr,
    )
    return 1 if stolen else 0


if __name__ == "__main__":
    raise SystemExit(trio.run(main))
