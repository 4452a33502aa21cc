"""The app the SIGKILL test serves: a durable executor whose side effects are keyed and logged.

Every attempt and every effect is appended (and fsynced) to the log named by
``TRITASK_KILL_LOG`` before the executor answers, so the test can count repeats: recovery is at
least once, never lost.
"""

from __future__ import annotations

import os
import random
from typing import Any

import trio

from tritask import App, Completed, ExecutionToken, Retry, RetryPolicy, Tasks, Work, elicitation

LOG = os.environ.get("TRITASK_KILL_LOG", "kill.log")
MAX_JOBS = int(os.environ.get("TRITASK_KILL_MAX_JOBS", "1000"))
"""Below the number of tasks, most of them wait queued in the store when a kill lands."""
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"value": {"type": "string"}},
    "required": ["value"],
}


def _append(line: str) -> None:
    fd = os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _attempts(key: str) -> int:
    try:
        with open(LOG, encoding="utf-8") as log:
            return sum(1 for line in log if line.split()[:2] == ["attempt", key])
    except FileNotFoundError:
        return 0


class DurableExecutor:
    """complete: finish; retry: ask for a retry on the first two attempts; input: ask first."""

    async def execute(self, work: Work, token: ExecutionToken, state: Any) -> Completed | Retry:
        key = work.idempotency_key
        mode = work.input["arguments"]["mode"]
        previous = await trio.to_thread.run_sync(_attempts, key)
        await trio.to_thread.run_sync(_append, f"attempt {key} {os.getpid()}")
        await trio.sleep(random.uniform(0.0, 0.3))
        answer = None
        if mode == "retry" and previous < 2:
            return Retry({"code": -32603, "message": "transient"}, "retrying")
        if mode == "input":
            response = await token.await_input("answer", elicitation("Value?", ANSWER_SCHEMA))
            answer = response["content"]["value"]
        await trio.to_thread.run_sync(_append, f"effect {key} {os.getpid()}")
        return Completed(
            {
                "content": [{"type": "text", "text": f"done {key}"}],
                "structuredContent": {"key": key, "mode": mode, "answer": answer},
                "isError": False,
            }
        )


app = App("kill-test", "0.1.0")


@app.tool()
async def job(mode: str) -> str:
    """A durable job (executed by DurableExecutor)."""
    raise RuntimeError("job runs only through its executor")


app.add_extension(
    Tasks(
        task_support={"job": "required"},
        retry_policy=RetryPolicy.fixed(100, 3),
        poll_interval_ms=50,
        store_options={"max_tasks": 10_000, "max_active_tasks_per_scope": 10_000},
        runner_options={
            "executor": DurableExecutor(),
            "lease_ms": 3_000,
            "recovery_interval_ms": 100,
            "max_jobs": MAX_JOBS,
        },
    )
)
