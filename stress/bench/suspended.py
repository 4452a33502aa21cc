"""``bench suspended``: what idle waiting tasks cost a runner, suspended or held.

One side runs in a fresh process (``python -m stress.bench.suspended --side ...``) on a fresh
SQLite file and prints one JSON object:

* ``suspended``: N tasks, half in a durable one-hour ``ctx.sleep``, half waiting for input past
  ``suspend_input_after_ms``: every one is suspended (no attempt, lease or slot);
* ``held`` (the baseline): the same N tasks with suspension off: each attempt stays in the
  runner, waiting, and its lease is renewed.

Then the side idles for ``--seconds`` and measures exactly what the waiting costs: whether the
database changed during the window (``PRAGMA data_version`` seen from another connection) and
the runner's writing store calls, the runner's attempts and timers, trio tasks, Python objects
retained per task (``gc``), and RSS. Suspended tasks should cost no runner memory beyond their
store rows and no periodic writes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sqlite3
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import trio

from stress.wrappers import StoreProxy
from tritask.tasks.executor import Completed, ExecutionToken, Outcome
from tritask.tasks.model import new_task
from tritask.tasks.runner import Runner
from tritask.tasks.store import Action, Claimed, Lease, Store
from tritask.tasks.stores import open_store
from tritask.tasks.work import Work

__all__ = ["main"]


class _Writes(StoreProxy):
    """Counts the runner's store calls that commit something."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.calls: Counter[str] = Counter()

    async def renew(self, lease: Lease, lease_ms: int) -> Lease:
        self.calls["renew"] += 1
        return await super().renew(lease, lease_ms)

    async def release(self, lease: Lease) -> None:
        self.calls["release"] += 1
        await super().release(lease)

    async def transition(self, task_id: str, revision: int, event: Any, authority: Any) -> Any:
        self.calls["transition"] += 1
        return await super().transition(task_id, revision, event, authority)

    async def _settle(self, task_id: str, revision: int, event: Any, lease: Any) -> Any:
        self.calls["settle"] += 1
        return await super()._settle(task_id, revision, event, lease)

    async def _renew_all(self, owner_id: str, leases: Any, lease_ms: int) -> Any:
        self.calls["renew_all"] += 1
        return await super()._renew_all(owner_id, leases, lease_ms)

    async def _renew_owner(
        self, owner_id: str, leases: Any, revisions: Any, following: Any, lease_ms: int
    ) -> Any:
        self.calls["renew_owner"] += 1
        return await super()._renew_owner(owner_id, leases, revisions, following, lease_ms)

    async def claim_next(self, owner_id: str, lease_ms: int) -> Claimed | None:
        claimed = await super().claim_next(owner_id, lease_ms)
        if claimed is not None:
            self.calls["claim_next:claimed"] += 1
        return claimed


class _Waiting:
    """Even tasks sleep an hour, odd ones wait for an answer that never comes."""

    async def execute(self, work: Work, token: ExecutionToken, state: Any) -> Outcome:
        if work.input["n"] % 2 == 0:
            await token.sleep("nap", 3600)
        else:
            await token.await_input("ask", {"method": "elicitation/create"})
        return Completed({"content": [], "isError": False})


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _data_version(conn: sqlite3.Connection) -> int:
    return int(conn.execute("PRAGMA data_version").fetchone()[0])


async def _side(side: str, tasks: int, seconds: float, db: Path) -> dict[str, Any]:
    suspended = side == "suspended"
    async with open_store(
        f"sqlite:{db}",
        scope="shared",
        synchronous="NORMAL",
        max_tasks=None,
        max_active_tasks_per_scope=None,
    ) as inner:
        store = _Writes(inner)
        runner = Runner(
            store,
            executor=_Waiting(),
            recover=True,
            max_jobs=max(tasks, 1) if not suspended else 500,
            lease_ms=30_000,
            reap_interval_ms=None,
            max_runtime_ms=None,
            suspend_sleep_after_ms=1_000 if suspended else None,
            suspend_input_after_ms=200 if suspended else None,
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(runner.run)
            await trio.sleep(0.2)
            gc.collect()
            objects_before = len(gc.get_objects())
            rss_before = _rss_kib()
            runner_nursery = runner._nursery  # the runner's own tasks (its loops, attempts)
            assert runner_nursery is not None
            trio_before = len(runner_nursery.child_tasks)
            started = time.perf_counter()
            n = 0
            while n < tasks:
                batch = min(tasks - n, 500 if suspended else tasks)
                for _ in range(batch):
                    task_id = f"idle-{n}"
                    access = await store.authorize(None, Action.CREATE, task_id)
                    work = Work(idempotency_key=task_id, type="idle", input={"n": n})
                    task = new_task(task_id, 0, None, None)
                    await runner.create_task(task, work, access, stamp=True)
                    n += 1
                if suspended:  # let the batch suspend before the next fills the slots
                    with trio.fail_after(120):
                        while runner.statistics().jobs:  # noqa: ASYNC110 - no event for it
                            await trio.sleep(0.05)
            if not suspended:
                await trio.sleep(0.5)  # every attempt parked in its sleep or its wait
            setup_seconds = time.perf_counter() - started
            watcher = sqlite3.connect(db)
            version_before = _data_version(watcher)
            calls_before = Counter(store.calls)
            await trio.sleep(seconds)  # the idle window
            version_after = _data_version(watcher)
            watcher.close()
            calls = Counter(store.calls)
            calls.subtract(calls_before)
            gc.collect()
            stats = runner.statistics()
            figures = {
                "side": side,
                "tasks": tasks,
                "idleSeconds": seconds,
                "setupSeconds": round(setup_seconds, 3),
                "attempts": stats.jobs,
                "scheduledRetries": stats.scheduled_retries,
                "awaitingSlot": stats.awaiting_slot,
                "runnerTrioTasksBefore": trio_before,
                "runnerTrioTasks": len(runner_nursery.child_tasks),
                "databaseChangedDuringIdle": version_after != version_before,
                "writeCallsDuringIdle": sum(v for v in calls.values() if v > 0),
                "writeCallsByKind": {k: v for k, v in sorted(calls.items()) if v > 0},
                "retainedObjectsPerTask": round(
                    (len(gc.get_objects()) - objects_before) / max(tasks, 1), 3
                ),
                "rssGrowthKiB": _rss_kib() - rss_before,
                "dbBytes": sum(
                    path.stat().st_size
                    for path in db.parent.iterdir()
                    if path.name.startswith(db.name)
                ),
            }
            runner.stop()
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stress.bench.suspended")
    parser.add_argument("--side", choices=["suspended", "held"], required=True)
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "idle.db"
        figures = trio.run(_side, args.side, args.tasks, args.seconds, db)
    sys.stdout.write(json.dumps(figures, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
