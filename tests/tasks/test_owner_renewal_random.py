"""Runner-level owner lease renewal under random interleavings (memory store, MockClock):
attempts that record durable steps, sleep, suspend in durable sleeps and resume, with commits,
batches and releases delayed at random across heartbeats and batches failing transiently now
and then. The delays stay within the lease's budget (3 s lease, 1 s heartbeat: at most one
batch in three fails, a commit or renewal waits at most 0.4 s, a batch 0.5 s), so no claim can
really lapse: no lease may be lost and no write refused, and every task completes."""

from __future__ import annotations

import random
from typing import Any

import pytest
import trio
import trio.testing
from helpers import DONE, ScriptedExecutor, create_job, status_of, unlimited_memory_store
from test_owner_renewal import OwnerHookedStore

from tritask.tasks import instrumentation as ins
from tritask.tasks.executor import Completed, ExecutionToken, Outcome
from tritask.tasks.instrumentation import RecordingInstrumentation
from tritask.tasks.model import TaskStatus
from tritask.tasks.runner import Runner
from tritask.tasks.store import DatabaseBusy
from tritask.tasks.work import Work


@pytest.mark.parametrize("seed", range(10))
async def test_random_interleavings_lose_no_lease(
    seed: int, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    rng = random.Random(seed)
    failed_last = 2

    async def hook(op: str, args: tuple[Any, ...]) -> None:
        nonlocal failed_last
        await trio.lowlevel.checkpoint()
        if op == "renew_owner":
            if failed_last >= 2 and rng.random() < 0.15:
                failed_last = 0
                raise DatabaseBusy("transient")
            failed_last += 1
            if rng.random() < 0.3:
                await trio.sleep(rng.uniform(0, 0.5))
        elif op in ("transition", "release", "worker_snapshot", "renew") and rng.random() < 0.3:
            await trio.sleep(rng.uniform(0, 0.4))

    store = OwnerHookedStore(unlimited_memory_store(), hook)
    events = RecordingInstrumentation()

    async def body(value: int, pause: float) -> int:
        await trio.sleep(pause)
        return value + 1

    async def script(work: Work, token: ExecutionToken) -> Outcome:
        plan = random.Random(f"{seed}/{token.task_id}")
        value = 0
        for n in range(plan.randrange(2, 9)):
            kind = plan.random()
            if kind < 0.5:
                value = await token.step(f"s{n}", body, value, plan.uniform(0, 0.7))
            elif kind < 0.75:
                await trio.sleep(plan.uniform(0, 1.5))
            elif kind < 0.9:
                await token.sleep(f"z{n}", plan.uniform(0, 0.3))
            else:
                await token.sleep(f"z{n}", plan.uniform(2.5, 4))  # suspends, resumes later
        return Completed(DONE)

    runner = Runner(
        store,
        executor=ScriptedExecutor(script),
        lease_ms=3_000,
        max_jobs=50,
        reap_interval_ms=None,
        suspend_sleep_after_ms=2_000,
        instrumentation=events,
    )
    await nursery.start(runner.run)
    ids = [f"t{n:02}" for n in range(30)]
    for task_id in ids:
        await create_job(store, runner, task_id)
        await trio.sleep(rng.uniform(0, 0.4))
    await trio.sleep(600)  # virtual time: far past the last task's end
    for task_id in ids:
        assert await status_of(store, task_id) is TaskStatus.COMPLETED, task_id
    for task_id in ids:
        stops = [md["outcome"] for _, md in events.named(ins.JOB_STOP) if md["task_id"] == task_id]
        assert stops[-1] == "completed", (task_id, stops)
    assert events.named(ins.LEASE_LOST) == []
    assert events.named(ins.FENCED_WRITE_REJECTED) == []
    outcomes = {md["outcome"] for _, md in events.named(ins.JOB_STOP)}
    assert outcomes <= {"completed", "suspended"}, outcomes
    assert store.calls.count("renew_owner") > 3
    runner.stop()
