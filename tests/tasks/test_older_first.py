"""``Runner._older_first``: a creation with a free slot, while the runner believes the store may
hold claimable work it has not asked for, asks the store first (``claim_next``).

What it guarantees: older claimable work is started first, in the store's order (first in,
first out), one claim at a time while it finds work and a slot is free; a ``claim_next`` that
finds nothing corrects the belief at once, so the new task is created already claimed and the
creations after it ask the store nothing; when the older work takes the last free slot the new
task is stored queued (it waits behind the older work, never ahead of it); a store failure
leaves the belief, logs, and queues the task, which still runs.

The belief is made to last exactly while a creation arrives: a queue signal starts the
runner's drain, whose claims (one per parallel claimer) are held in ``claim_next`` by a gate,
so they neither answer nor correct the belief; the slots beyond them are free for the creation.
No clock is read by any assertion.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing
from helpers import Env, start_env

from tritask.tasks import instrumentation as ins
from tritask.tasks.model import new_task
from tritask.tasks.runner import _PARALLEL_CLAIMS
from tritask.tasks.store import QUEUED_MESSAGE, Action
from tritask.tasks.work import Work

pytestmark = pytest.mark.contract("tasks-extension-lifecycle")

FREE = 3
"""Slots free for the creation while the drain's claims hold theirs."""


class HeldDrain:
    """``claim_next`` of the memory store, counted; the first ``held`` calls (the drain's) wait
    for ``gate``; ``fail_at`` (a call number) raises instead of claiming."""

    def __init__(self, env: Env, held: int, fail_at: int | None = None) -> None:
        self.inner = env.memory.claim_next
        self.held = held
        self.fail_at = fail_at
        self.gate = trio.Event()
        self.calls = 0
        self.found: list[str | None] = []
        env.memory.claim_next = self  # type: ignore[method-assign]

    async def __call__(self, owner_id: str, lease_ms: int) -> Any:
        self.calls += 1
        number = self.calls
        if number <= self.held:
            await self.gate.wait()
        if number == self.fail_at:
            raise RuntimeError("the store is unavailable")
        claimed = await self.inner(owner_id, lease_ms)
        if number > self.held:
            self.found.append(None if claimed is None else claimed.snapshot.task.id)
        return claimed


async def env_with_held_drain(
    nursery: trio.Nursery, fail_at: int | None = None
) -> tuple[Env, HeldDrain]:
    env = await start_env(
        nursery,
        task_support={"slow": "optional"},
        runner_options={
            "max_jobs": _PARALLEL_CLAIMS + FREE,
            "recover": True,
            "recovery_interval_ms": 3_600_000,
        },
    )

    @env.app.tool()
    async def slow(label: str) -> str:
        """Sleeps, then reports."""
        await trio.sleep(1)
        return f"Completed {label}"

    await trio.sleep(1)  # the first recovery pass is over
    held = HeldDrain(env, _PARALLEL_CLAIMS, fail_at)
    env.memory._signal()  # the runner now believes claimable work may wait, and drains
    await trio.testing.wait_all_tasks_blocked()
    assert held.calls == _PARALLEL_CLAIMS  # every drain claim is in flight, held
    assert env.runner.statistics().jobs == 0
    return env, held


async def store_elsewhere(env: Env, task_ids: list[str]) -> None:
    """Claimable tasks this runner has not seen (another host's), each older than the next
    and than anything created after them (the store's order is ``(createdAt, id)``)."""
    for task_id in task_ids:
        ctx = SimpleNamespace(principal=None)
        access = await env.memory.authorize(ctx, Action.CREATE, task_id)
        task = new_task(task_id, env.clock(), 3_600_000, 250)
        await env.memory.create(task, Work.tool_call(task_id, "slow", {"label": task_id}), access)
        await trio.sleep(0.001)


def starts(env: Env) -> list[tuple[str, str]]:
    return [(md["task_id"], md["source"]) for _, md in env.named(ins.JOB_START)]


def outcomes(env: Env) -> dict[str, str]:
    return {md["task_id"]: md["outcome"] for _, md in env.named(ins.TASK_CREATED)}


@pytest.mark.parametrize("older", [0, 1, 2])
async def test_a_creation_takes_older_work_first_then_its_own_slot(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, older: int
) -> None:
    env, held = await env_with_held_drain(nursery)
    waiting = [f"older-{n}" for n in range(older)]
    await store_elsewhere(env, waiting)
    new = await env.create("slow", {"label": "new"})
    # One claim per older task, in order, then one that finds nothing: the belief is
    # corrected there, and the new task is created already claimed, after the older work.
    assert held.found == [*waiting, None]
    assert starts(env) == [*((task_id, "recovery") for task_id in waiting), (new, "request")]
    assert outcomes(env) == {new: "created"}
    assert (await env.snapshot(new)).task.status_message != QUEUED_MESSAGE
    # The belief is gone: the next creation (a slot is still free) asks the store nothing.
    if older < FREE - 1:
        after = await env.create("slow", {"label": "after"})
        assert held.calls == _PARALLEL_CLAIMS + older + 1
        assert outcomes(env)[after] == "created"
        assert starts(env)[-1] == (after, "request")
    held.gate.set()
    for task_id in [*waiting, new]:
        await env.wait_status(task_id, "completed", interval=0.5)
    assert env.runner.statistics().queued == 0


async def test_older_work_taking_the_last_free_slot_queues_the_creation_behind_it(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env, held = await env_with_held_drain(nursery)
    waiting = [f"older-{n}" for n in range(FREE + 1)]
    await store_elsewhere(env, waiting)
    new = await env.create("slow", {"label": "new"})
    # Exactly one claim per free slot (no call once none is free), FIFO; the new task waits.
    assert held.found == waiting[:FREE]
    assert starts(env) == [(task_id, "recovery") for task_id in waiting[:FREE]]
    assert outcomes(env) == {new: "queued"}
    assert (await env.snapshot(new)).task.status_message == QUEUED_MESSAGE
    held.gate.set()  # the drain's claims now answer: the rest, oldest first
    for task_id in [*waiting, new]:
        await env.wait_status(task_id, "completed", interval=0.5)
    # The older task left waiting starts before the new one, which kept its request context.
    assert starts(env)[FREE:] == [(waiting[FREE], "recovery"), (new, "queue")]


async def test_a_store_failure_before_a_creation_queues_it_and_it_still_runs(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    env, held = await env_with_held_drain(nursery, fail_at=_PARALLEL_CLAIMS + 1)
    with caplog.at_level(logging.ERROR, logger="tritask"):
        new = await env.create("slow", {"label": "new"})
    assert "claiming queued work before a creation failed" in caplog.text
    assert outcomes(env) == {new: "queued"}
    assert starts(env) == []
    held.gate.set()  # the belief was left: the drain looks again and takes the queued task
    await env.wait_status(new, "completed", interval=0.5)
    assert starts(env) == [(new, "queue")]  # with the request context it was created with
