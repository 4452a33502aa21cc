"""Cancel racing completion: one immutable terminal state, whatever the interleaving."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
import trio
import trio.lowlevel
import trio.testing
from helpers import Env, start_env

from tritask.server.context import Context
from tritask.tasks import instrumentation as ins

pytestmark = pytest.mark.contract("tasks-extension-races")

ACK = {"resultType": "complete"}


def _bare(result: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in result.items() if key != "_meta"}


async def _racing_env(nursery: trio.Nursery) -> tuple[Env, dict[str, int]]:
    env = await start_env(nursery, task_support={"racer": "required"})
    returned: dict[str, int] = {}

    @env.app.tool()
    async def racer(ctx: Context, n: int, pattern: list[int] | None = None) -> str:
        """Checkpoints ``n`` times (``pattern``: extra sleeps of zero per step), then returns."""
        for step in range(n):
            await trio.lowlevel.checkpoint()
            for _ in range((pattern or [])[step] if pattern and step < len(pattern) else 0):
                await trio.lowlevel.checkpoint()
        assert ctx.task_id is not None
        returned[ctx.task_id] = returned.get(ctx.task_id, 0) + 1
        return f"raced {n}"

    return env, returned


async def _until_idle(env: Env, task_id: str) -> None:
    """Let the attempt finish (release, stop event) without moving the clock."""
    for _ in range(10_000):
        if task_id not in env.runner.active_task_ids() and any(
            md["task_id"] == task_id for _, md in env.named(ins.JOB_STOP)
        ):
            return
        await trio.lowlevel.checkpoint()
    raise AssertionError(f"task {task_id} never went idle")


async def _race_once(
    env: Env, returned: dict[str, int], worker_steps: int, cancel_steps: int, **kw: Any
) -> tuple[str, str]:
    started = trio.current_time()
    task_id = await env.create("racer", {"n": worker_steps, **kw})
    for _ in range(cancel_steps):
        await trio.lowlevel.checkpoint()
    ack = await env.result("tasks/cancel", {"taskId": task_id})
    assert _bare(ack) == ACK
    # tasks/cancel answers once the authoritative state is terminal (the commit came first).
    detail = await env.get(task_id)
    assert detail["status"] in ("completed", "cancelled"), detail
    await _until_idle(env, task_id)

    # Exactly one terminal event was ever committed; nothing resurrects it afterwards.
    kinds = env.history_kinds(task_id)
    assert kinds == [detail["status"]], (worker_steps, cancel_steps, kinds)
    if detail["status"] == "completed":
        assert detail["result"]["content"] == [{"type": "text", "text": f"raced {worker_steps}"}]
        assert detail["result"]["isError"] is False
        assert "statusMessage" not in detail
        assert returned[task_id] == 1
    else:
        assert detail["statusMessage"] == "Cancellation requested"
        assert "result" not in detail and "error" not in detail
    assert detail["lastUpdatedAt"] >= detail["createdAt"]

    # A cancel after terminal is an idempotent acknowledgement; tasks/get is unchanged.
    again = await env.result("tasks/cancel", {"taskId": task_id})
    assert _bare(again) == ACK
    assert await env.get(task_id) == detail
    assert await env.get(task_id) == detail
    assert env.history_kinds(task_id) == kinds
    (stop,) = [md for _, md in env.named(ins.JOB_STOP) if md["task_id"] == task_id]
    if detail["status"] == "cancelled":
        assert stop["outcome"] == "cancelled"
        # A worker result that lost the race was either never sent or refused as a no-op.
        assert stop["store_outcome"] in ("not_settled", "unchanged")
    else:
        assert (stop["outcome"], stop["store_outcome"]) == ("completed", "applied")
    assert trio.current_time() == started  # no timer was needed for any of it
    return task_id, detail["status"]


async def test_cancel_racing_completion_every_interleaving(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env, returned = await _racing_env(nursery)
    outcomes: dict[str, list[tuple[int, int]]] = {"completed": [], "cancelled": []}
    for worker_steps, cancel_steps in itertools.product(range(8), range(10)):
        _, status = await _race_once(env, returned, worker_steps, cancel_steps)
        outcomes[status].append((worker_steps, cancel_steps))
    # The sweep really exercised both winners (80 races in all).
    assert sum(map(len, outcomes.values())) == 80
    assert outcomes["completed"] and outcomes["cancelled"]
    # Monotone in the obvious directions: an instant worker beats a slow cancel, and vice versa.
    assert (0, 9) in outcomes["completed"]
    assert (7, 0) in outcomes["cancelled"]


async def test_cancel_racing_completion_seeded_random_interleavings(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env, returned = await _racing_env(nursery)
    rng = random.Random(20260728)
    seen: set[str] = set()
    for _ in range(60):
        worker_steps = rng.randrange(0, 12)
        pattern = [rng.randrange(0, 3) for _ in range(worker_steps)]
        _, status = await _race_once(
            env, returned, worker_steps, rng.randrange(0, 16), pattern=pattern
        )
        seen.add(status)
    assert seen == {"completed", "cancelled"}


async def test_concurrent_cancels_and_completion_commit_one_terminal_event(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env, _ = await _racing_env(nursery)
    statuses: set[str] = set()
    for worker_steps in range(12):
        task_id = await env.create("racer", {"n": worker_steps})
        acks: list[dict[str, Any]] = []

        async def cancel(delay: int, task_id: str = task_id, acks: list[Any] = acks) -> None:
            for _ in range(delay):
                await trio.lowlevel.checkpoint()
            acks.append(_bare(await env.result("tasks/cancel", {"taskId": task_id})))

        async with trio.open_nursery() as racing:
            for delay in (0, 2, 5):
                racing.start_soon(cancel, delay)
        assert acks == [ACK, ACK, ACK]
        await _until_idle(env, task_id)
        detail = await env.get(task_id)
        statuses.add(detail["status"])
        assert env.history_kinds(task_id) == [detail["status"]]
        assert await env.get(task_id) == detail
    assert statuses <= {"completed", "cancelled"}
    assert "cancelled" in statuses


@pytest.mark.parametrize("terminal", ["completed", "cancelled", "failed"])
async def test_cancel_after_terminal_is_an_idempotent_ack(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, terminal: str
) -> None:
    env = await start_env(nursery, task_support={"job": "required"})
    release = trio.Event()

    @env.app.tool()
    async def job(mode: str) -> str:
        """Completes, fails, or waits to be cancelled."""
        if mode == "failed":
            raise RuntimeError("boom")
        if mode == "cancelled":
            await release.wait()
        return "finished"

    task_id = await env.create("job", {"mode": terminal})
    await trio.sleep(1)
    if terminal == "cancelled":
        assert _bare(await env.result("tasks/cancel", {"taskId": task_id})) == ACK
    detail = await env.wait_status(task_id, terminal)
    snapshot = await env.snapshot(task_id)
    await trio.sleep(5)  # later, so a (wrong) second commit would move lastUpdatedAt
    for _ in range(3):
        assert _bare(await env.result("tasks/cancel", {"taskId": task_id})) == ACK
        assert await env.get(task_id) == detail
    assert await env.snapshot(task_id) == snapshot
    assert env.history_kinds(task_id) == [terminal]
    cancels = [md for _, md in env.named(ins.STORE_TRANSITION) if md["event_kind"] == "cancelled"]
    expected = ["applied"] if terminal == "cancelled" else []
    assert [md["outcome"] for md in cancels] == [*expected, "unchanged", "unchanged", "unchanged"]
    release.set()
