"""Tasks on the memory store: required tools, tenant isolation, completion and cancellation.

Run it: ``python examples/07_tasks_memory.py``. It builds an app, opens a MemoryStore whose scope
is the caller's tenant, starts a Runner in its own nursery, and drives the Tasks methods as two
different tenants through the in-process test client.
"""

from __future__ import annotations

import trio

from tritask import App, MemoryStore, Runner, Tasks
from tritask.testing.client import Client, ClientError


async def main() -> None:
    release = trio.Event()
    started = trio.Event()

    app = App("example-07", "0.1.0")

    @app.tool()
    async def controlled_job(outcome: str = "complete") -> str:
        """Wait until the example releases the job, then finish."""
        started.set()
        await release.wait()
        return f"finished {outcome}"

    store = MemoryStore(scope=lambda ctx: ctx.principal["tenant"])
    async with store, Runner(store) as runner:
        app.add_extension(
            Tasks(
                store=store,
                runner=runner,
                task_support={"controlled_job": "required"},
                poll_interval_ms=10,
            )
        )
        tenant_a = Client.direct(app, principal={"tenant": "a"})
        tenant_b = Client.direct(app, principal={"tenant": "b"})

        # 1. A required tool without the Tasks declaration is refused with -32021.
        try:
            await tenant_a.request(
                "tools/call", {"name": "controlled_job", "arguments": {}}, capabilities={}
            )
            raise AssertionError("expected -32021")
        except ClientError as error:
            assert error.code == -32021, error
            print("1. without the declaration:", error.code, error.data)

        # 2. With the declaration the call becomes a task, stored before we hear of it.
        created = await tenant_a.call_tool("controlled_job")
        assert created["resultType"] == "task" and created["status"] == "working"
        task_id = created["taskId"]
        assert isinstance(task_id, str)
        print("2. created task", task_id)

        # 3. Tenant A sees it working; tenant B cannot tell it exists.
        await started.wait()
        assert (await tenant_a.get_task(task_id))["status"] == "working"
        try:
            await tenant_b.get_task(task_id)
            raise AssertionError("tenant b must not see tenant a's task")
        except ClientError as error:
            assert (error.code, error.message) == (-32602, "Unknown or inaccessible taskId")
            print("3. tenant b:", error.code, error.message)

        # 4. Release the worker: the task completes with the tool's own result inlined.
        release.set()
        done = await tenant_a.wait_task(task_id)
        assert done["status"] == "completed"
        result = done["result"]
        assert isinstance(result, dict)
        assert result["content"] == [{"type": "text", "text": "finished complete"}]
        print("4. completed:", result["content"])

        # 5. Cancel a running task: an empty acknowledgement, then the status is cancelled.
        release = trio.Event()
        started = trio.Event()
        second = await tenant_a.call_tool("controlled_job")
        second_id = second["taskId"]
        assert isinstance(second_id, str)
        await started.wait()
        ack = await tenant_a.cancel_task(second_id)
        assert {k: v for k, v in ack.items() if k != "_meta"} == {"resultType": "complete"}
        cancelled = await tenant_a.get_task(second_id)
        assert cancelled["status"] == "cancelled"
        assert cancelled["statusMessage"] == "Cancellation requested"
        print("5. cancelled:", cancelled["status"])
        assert runner.statistics().jobs == 0


if __name__ == "__main__":
    trio.run(main)
