"""The app ``test_stopped_server`` serves: one task that finishes, one that runs until stopped,
one that waits for input."""

from __future__ import annotations

import trio

from tritask import App, Context, Tasks, elicitation

app = App(
    "ops-app",
    "0.0.1",
    extensions=[Tasks(task_support={"echo": "required", "slow": "required", "ask": "required"})],
)


@app.tool
async def echo(text: str) -> str:
    """Returns the text."""
    return text


@app.tool
async def slow(seconds: float) -> str:
    """Sleeps, then returns."""
    await trio.sleep(seconds)
    return "slept"


@app.tool
async def ask(ctx: Context) -> str:
    """Waits for a confirmation."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    answer = await ctx.await_input("confirm", elicitation("Proceed?", schema))
    return str(answer)
