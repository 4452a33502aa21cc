"""The app the durable-steps SIGKILL test serves: pipelines of steps whose bodies are logged.

Each step body appends ``begin`` when it starts, ``effect`` when it makes its side effect (keyed
by ``ctx.step_key``), then returns after a random pause: a SIGKILL can land before the effect,
between the effect and the step's commit, or after the commit. After every ``ctx.step`` returns
(a first run or a replay) the tool appends ``after``. Every line is fsynced to the log named by
``TRITASK_KILL_LOG`` before the code goes on, so the log's order is the real order.

Shapes: ``plain`` (only steps), ``sleep`` (a durable sleep in the middle, long enough to
suspend the task) and ``input`` (a question in the middle; waiting for it suspends the task).
"""

from __future__ import annotations

import os
import random
from typing import Any

import trio

from tritask import App, Context, RetryPolicy, Tasks, elicitation

LOG = os.environ.get("TRITASK_KILL_LOG", "steps-kill.log")
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"value": {"type": "string"}},
    "required": ["value"],
}
MODULUS = 1_000_003


def expected_value(steps: int) -> int:
    """What a pipeline of ``steps`` steps returns (each step folds its index into the value)."""
    value = 1
    for index in range(steps):
        value = (value * 31 + index + 7) % MODULUS
    return value


def _append(line: str) -> None:
    fd = os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


async def log(kind: str, task_id: str, key: str) -> None:
    await trio.to_thread.run_sync(_append, f"{kind} {task_id} {key} {os.getpid()}")


async def body(task_id: str, key: str, external_key: str, value: int, index: int) -> int:
    await log("begin", task_id, key)
    await trio.sleep(random.uniform(0.0, 0.12))  # mid-step
    assert external_key == f"{task_id}/{key}"
    await log("effect", task_id, key)  # the side effect, keyed by ctx.step_key
    await trio.sleep(random.uniform(0.0, 0.05))  # between the effect and its commit
    return (value * 31 + index + 7) % MODULUS


app = App("steps-kill-test", "0.1.0")


@app.tool()
async def pipeline(ctx: Context, steps: int, shape: str) -> dict[str, Any]:
    """Run ``steps`` durable steps (with a durable sleep or a question half-way)."""
    task_id = ctx.task_id
    assert task_id is not None
    value, answer = 1, None
    for index in range(steps):
        if index == steps // 2 and shape == "sleep":
            await ctx.sleep("cooldown", 0.8)
        if index == steps // 2 and shape == "input":
            response = await ctx.await_input("answer", elicitation("Value?", ANSWER_SCHEMA))
            answer = response["content"]["value"]
        key = f"step/{index}"
        value = await ctx.step(key, body, task_id, key, ctx.step_key(key), value, index)
        await log("after", task_id, key)
    return {"value": value, "answer": answer}


app.add_extension(
    Tasks(
        task_support={"pipeline": "required"},
        retry_policy=RetryPolicy.fixed(100, 3),
        poll_interval_ms=50,
        store_options={"max_tasks": 10_000, "max_active_tasks_per_scope": 10_000},
        runner_options={
            "lease_ms": 3_000,
            "recovery_interval_ms": 100,
            "max_jobs": 1_000,
            "suspend_sleep_after_ms": 200,
            "suspend_input_after_ms": 300,
        },
    )
)
