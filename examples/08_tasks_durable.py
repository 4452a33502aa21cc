"""Durable tasks on SQLite: stop everything mid-task, reopen, and the work finishes.

Run it: ``python examples/08_tasks_durable.py [DIR]``. A ``work_builder`` projects only the
stable identity the work needs to resume (the tenant), never the request's credentials; the
store and runner are stopped while the work is in flight; a new store (exclusive: the boot epoch
advances, fencing the old claims) and a new runner recover it at once, with the same work and
the same idempotency key.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import trio
from tritask_sqlite import SqliteStore

from tritask import App, Completed, Context, ExecutionToken, Runner, Tasks, Work
from tritask.testing.client import Client

SECRET = "secret-bearer-token-7f3a"


class ExportExecutor:
    """Runs ``durable_export`` work; the first runner's attempt is held until it is stopped."""

    def __init__(self) -> None:
        self.started = trio.Event()
        self.hold = True
        self.attempts: list[tuple[str, int, dict[str, Any]]] = []

    async def execute(self, work: Work, token: ExecutionToken, state: Any) -> Completed:
        self.attempts.append((work.idempotency_key, token.generation, work.input))
        self.started.set()
        if self.hold:
            await trio.sleep_forever()  # in flight when the runner stops: its scope is cancelled
        token.raise_if_cancelled()
        return Completed(
            {
                "content": [{"type": "text", "text": "exported"}],
                "structuredContent": {
                    "document": work.input["arguments"]["document"],
                    "tenant": work.input["principal"]["tenant"],
                    "idempotencyKey": work.idempotency_key,
                },
                "isError": False,
            }
        )


def work_builder(task_id: str, tool: str, arguments: dict[str, Any], ctx: Context) -> Work:
    """The security boundary: persist the tenant, not the request's credentials."""
    return Work(
        idempotency_key=task_id,
        type="tools/call",
        input={
            "name": tool,
            "arguments": arguments,
            "principal": {"tenant": ctx.principal["tenant"]},
        },
    )


def _assert_secret_not_stored(directory: Path) -> None:
    for path in directory.iterdir():
        assert SECRET.encode() not in path.read_bytes(), f"a credential reached {path.name}"


def build_app(executor: ExportExecutor) -> tuple[App, Tasks]:
    app = App("example-08", "0.1.0")

    @app.tool()
    async def durable_export(document: str) -> str:
        """Export a document durably (executed by the ExportExecutor)."""
        raise RuntimeError("durable_export runs only through its executor")

    tasks = Tasks(
        task_support={"durable_export": "required"},
        work_builder=work_builder,
        ttl_ms=60_000,
        poll_interval_ms=5,
    )
    app.add_extension(tasks)
    return app, tasks


async def main(directory: Path) -> None:
    db = directory / "tasks.db"
    executor = ExportExecutor()
    app, tasks = build_app(executor)
    principal = {"tenant": "tenant-a", "token": SECRET}
    client = Client.direct(app, principal=principal)

    def scope(ctx: Any) -> str:
        return str(ctx.principal["tenant"])

    store_options: dict[str, Any] = {"scope": scope, "exclusive": True}
    async with SqliteStore(db, **store_options) as store:
        tasks.store = store
        async with Runner(store, executor=executor, recover=True, lease_ms=30_000) as runner:
            tasks.runner = runner
            created = await client.call_tool("durable_export", {"document": "quarterly-report"})
            task_id = created["taskId"]
            assert isinstance(task_id, str)
            await executor.started.wait()
            key, generation, persisted = executor.attempts[0]
            assert key == task_id
            assert persisted == {
                "name": "durable_export",
                "arguments": {"document": "quarterly-report"},
                "principal": {"tenant": "tenant-a"},
            }
            print("1. task", task_id, "started at generation", generation)
            tasks.runner = None
        tasks.store = None
        print("2. runner and store stopped while the work was in flight")
    await trio.to_thread.run_sync(_assert_secret_not_stored, directory)
    print("3. the request's credential is in none of the store's files")

    executor.hold = False
    async with SqliteStore(db, **store_options) as store:
        tasks.store = store
        async with Runner(
            store, executor=executor, recover=True, recovery_interval_ms=10
        ) as runner:
            tasks.runner = runner
            done = await client.wait_task(task_id, poll_seconds=0.01)
            tasks.runner = None
        tasks.store = None
    assert done["status"] == "completed", done
    result = done["result"]
    assert isinstance(result, dict)
    assert result["structuredContent"] == {
        "document": "quarterly-report",
        "tenant": "tenant-a",
        "idempotencyKey": task_id,
    }
    recovered_key, recovered_generation, recovered_input = executor.attempts[-1]
    assert (recovered_key, recovered_input) == (task_id, persisted)
    assert recovered_generation > generation
    print(
        "4. recovered at generation",
        recovered_generation,
        "and completed:",
        result["structuredContent"],
    )


if __name__ == "__main__":
    if len(sys.argv) > 1:
        trio.run(main, Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            trio.run(main, Path(tmp))
