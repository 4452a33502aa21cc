"""Exact, restart-safe retries: a WorkExecutor asks for a retry; a new runner honours it.

Run it: ``python examples/09_tasks_retry.py``. Time is trio's ``MockClock`` and the memory store
follows it, so the run is deterministic and the 60-second backoff passes instantly. The retry
time is decided by the store when the retry is committed; a runner started afterwards reads it
from the store and neither runs the work early nor forgets it.
"""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

from tritask import App, Completed, ExecutionToken, MemoryStore, Retry, RetryPolicy, Runner, Tasks
from tritask.tasks import TrioClock, format_instant, parse_instant
from tritask.tasks.model import Snapshot
from tritask.tasks.store import Action, Deferred
from tritask.tasks.work import Work
from tritask.testing.client import Client

START = parse_instant("2026-08-25T10:00:00.000Z")


class ExportExecutor:
    """Owns execution of ``flaky_export`` work: the first attempt asks for a retry."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    async def execute(self, work: Work, token: ExecutionToken, state: Any) -> Completed | Retry:
        self.calls.append((work.idempotency_key, token.generation))
        if len(self.calls) == 1:
            return Retry(
                {"code": -32603, "message": "Export service is temporarily unavailable"},
                "Export will retry",
            )
        report = work.input["arguments"]["report"]
        return Completed({"content": [{"type": "text", "text": f"exported {report}"}]})


class _Anyone:
    principal = None


async def main() -> None:
    app = App("example-09", "0.1.0")

    @app.tool()
    async def flaky_export(report: str) -> str:
        """Export a report (executed by the ExportExecutor, never directly)."""
        raise RuntimeError("flaky_export runs only through its executor")

    executor = ExportExecutor()
    store = MemoryStore(scope="shared", clock=TrioClock(START))
    tasks = Tasks(
        store=store,
        task_support={"flaky_export": "required"},
        retry_policy=RetryPolicy([60_000]),
        poll_interval_ms=5,
    )
    app.add_extension(tasks)
    client = Client.direct(app)

    async with store:
        async with Runner(store, executor=executor, recover=True) as first:
            tasks.runner = first
            created = await client.call_tool("flaky_export", {"report": "q3"})
            task_id = created["taskId"]
            assert isinstance(task_id, str)
            await trio.sleep(0.01)
        access = await store.authorize(_Anyone(), Action.GET, task_id)
        snapshot = await store.get(task_id, access)
        assert isinstance(snapshot, Snapshot)
        assert snapshot.retry_count == 1
        retry_at = snapshot.retry_at
        assert retry_at is not None
        print("1. attempt 1 asked for a retry; retry_at =", format_instant(retry_at))
        assert snapshot.work is not None
        assert snapshot.work.retry_policy == RetryPolicy([60_000])

        # A probe claim on the store's clock: not before retry_at, and nothing ran early.
        probe = await store.claim(task_id, "probe", 1_000)
        assert isinstance(probe, Deferred), probe
        print("2. a fresh claim is deferred by", probe.remaining_ms, "ms")
        assert len(executor.calls) == 1

        async with Runner(store, executor=executor, recover=True, recovery_interval_ms=5) as second:
            tasks.runner = second
            done = await client.wait_task(task_id, poll_seconds=1)
        assert done["status"] == "completed", done
        print("3. attempt 2 completed:", done["result"])
        assert len(executor.calls) == 2
        assert executor.calls[0][0] == executor.calls[1][0] == task_id
        assert executor.calls[1][1] > executor.calls[0][1]
        final = await store.get(task_id, access)
        assert isinstance(final, Snapshot)
        assert final.retry_count == 1 and final.retry_at is None
        print("4. retry_count 1, retry_at cleared, executor ran twice with one idempotency key")


if __name__ == "__main__":
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
