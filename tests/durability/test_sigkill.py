"""Nothing lost: a real ``tritask serve`` on SQLite, SIGKILLed at random points and restarted.

Hundreds of tasks (some retrying, some waiting for input that is then given) run while the
server process is killed with SIGKILL several times and restarted on the same file. Afterwards
every task is terminal, no terminal state ever changed, every accepted input was used, retry
counts stayed within the policy, and every side effect is keyed by its idempotency key, so
repeats are visible and counted (at least once, never lost).
"""

from __future__ import annotations

import os
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import trio

from tritask.tasks.events import EventKind
from tritask.tasks.store import QUEUED_MESSAGE
from tritask.testing import ServeProcess
from tritask.testing.client import Client, ClientError, HttpTransport

HERE = Path(__file__).parent
APP = f"{HERE / 'kill_app.py'}:app"
TASKS = 240
KILLS = 4
SEED = 20261129

pytestmark = [pytest.mark.slow, pytest.mark.contract("tasks-recovery-claims")]


def kill_server(db: Path, log: Path, max_jobs: int) -> ServeProcess:
    env = {**os.environ, "TRITASK_KILL_LOG": str(log), "TRITASK_KILL_MAX_JOBS": str(max_jobs)}
    return ServeProcess(APP, store=f"sqlite:{db}", env=env, args=("--log-level", "WARNING"))


class Observer:
    """Polls every task, answers input, and checks terminal states never change."""

    def __init__(self, tasks: dict[str, str]) -> None:
        self.modes = tasks
        self.terminal: dict[str, dict[str, Any]] = {}
        self.answers: dict[str, str] = {}
        self.changed: list[str] = []
        self.queued: set[str] = set()
        """Tasks seen waiting queued (their status message says so)."""

    async def sweep(self, client: Client) -> None:
        for task_id, mode in self.modes.items():
            task = await client.get_task(task_id)
            status = task["status"]
            if task.get("statusMessage") == QUEUED_MESSAGE:
                self.queued.add(task_id)
            if status in ("completed", "failed", "cancelled"):
                seen = {k: task.get(k) for k in ("status", "result", "error")}
                first = self.terminal.setdefault(task_id, seen)
                if first != seen:
                    self.changed.append(task_id)
            elif status == "input_required" and mode == "input":
                requests = task.get("inputRequests")
                assert isinstance(requests, dict) and list(requests) == ["answer"], task
                value = f"value-{task_id}"
                self.answers[task_id] = value
                await client.update_task(
                    task_id, {"answer": {"action": "accept", "content": {"value": value}}}
                )


async def _sweep_until(observer: Observer, server: ServeProcess, deadline: float) -> None:
    """Sweep through the current server (once it is ready) until every task is terminal or
    ``deadline``."""
    # Shielded: a window that ends while the server boots kills it once it is ready (see
    # test_sigkill_steps.sweep_until for why).
    with trio.CancelScope(shield=True):
        await server.ready()
    transport = HttpTransport(server.url)
    client = Client(transport, capabilities={"elicitation": {}})
    try:
        while len(observer.terminal) < len(observer.modes) and trio.current_time() < deadline:
            try:
                await observer.sweep(client)
            except (ClientError, OSError, ConnectionError) as error:
                if server.returncode is not None:
                    return
                if isinstance(error, ClientError):
                    raise
            await trio.sleep(0.05)
    finally:
        await transport.aclose()


@pytest.mark.parametrize("max_jobs", [1_000, 8], ids=["all-running", "mostly-queued"])
async def test_sigkill_at_random_points_loses_nothing(tmp_path: Path, max_jobs: int) -> None:
    """With ``max_jobs`` 8 the 240 tasks are accepted all the same, and each kill lands on a
    server with 8 attempts running and the rest queued in the store."""
    rng = random.Random(SEED)
    db = tmp_path / "kill.db"
    log = tmp_path / "effects.log"
    async with kill_server(db, log, max_jobs) as server:
        transport = HttpTransport(server.url)
        client = Client(transport, capabilities={"elicitation": {}})
        modes: dict[str, str] = {}
        try:
            for index in range(TASKS):
                mode = ("complete", "retry", "input")[index % 3]
                created = await client.call_tool("job", {"mode": mode})
                assert created["resultType"] == "task", created
                task_id = created["taskId"]
                assert isinstance(task_id, str)
                modes[task_id] = mode
        finally:
            await transport.aclose()
        observer = Observer(modes)
        kills = 0
        while kills < KILLS:
            # The window starts as the server boots (see the sweep: it waits until ready).
            with trio.move_on_after(rng.uniform(0.3, 1.5)):
                await _sweep_until(observer, server, trio.current_time() + 60)
            await server.akill()
            kills += 1
            server.launch()
        await _sweep_until(observer, server, trio.current_time() + 120)
        assert await server.astop() == 0, server.stderr

    assert len(observer.terminal) == TASKS, f"{TASKS - len(observer.terminal)} tasks never ended"
    assert observer.changed == []
    if max_jobs < TASKS:  # most tasks waited queued, and none was refused
        assert len(observer.queued) > TASKS // 2, len(observer.queued)
    else:
        assert observer.queued == set()
    statuses = Counter(seen["status"] for seen in observer.terminal.values())
    assert statuses == {"completed": TASKS}, statuses
    for task_id, seen in observer.terminal.items():
        structured = seen["result"]["structuredContent"]
        assert structured["key"] == task_id
        assert structured["mode"] == modes[task_id]
        if modes[task_id] == "input":
            assert structured["answer"] == observer.answers[task_id] == f"value-{task_id}"

    lines = [line.split() for line in log.read_text().splitlines()]
    attempts = Counter(key for kind, key, _ in lines if kind == "attempt")
    effects = Counter(key for kind, key, _ in lines if kind == "effect")
    assert set(effects) == set(modes), "a completed task has no recorded effect"
    repeated = {key: count for key, count in effects.items() if count > 1}
    print(
        f"{kills} kills; attempts {sum(attempts.values())} for {TASKS} tasks; "
        f"effects repeated for {len(repeated)} tasks (at least once, keyed)"
    )

    from tritask_sqlite import SqliteStore

    async with SqliteStore(db, scope="shared") as store:
        for task_id, mode in modes.items():
            ledger = await store.history(task_id)
            kinds = [entry.event.kind for entry in ledger]
            terminal = [k for k in kinds if k in (EventKind.COMPLETED, EventKind.FAILED)]
            assert terminal == [EventKind.COMPLETED], (task_id, kinds)
            retries = kinds.count(EventKind.RETRY_REQUESTED)
            assert retries <= 3, (task_id, kinds)
            if mode == "retry":
                assert retries <= 2
            if mode == "input":
                assert kinds.count(EventKind.INPUT_REQUESTED) == 1, (task_id, kinds)
                assert kinds.count(EventKind.INPUT_RESPONSES_ACCEPTED) == 1, (task_id, kinds)
