"""The built-in demo app served by ``tritask serve`` without an APP argument.

It exists to show a newcomer what tritask is for in one minute, so every tool is one of the
things a durable task does: a required task that reports progress, one that stops to ask for
confirmation mid-task, one whose transient failures are retried on an exact schedule, and one
ordinary synchronous tool beside them. The README shows how to call each.
"""

from __future__ import annotations

from collections import Counter

import trio

from tritask.server.app import App
from tritask.server.context import Context
from tritask.server.mrtr import accepted_content, elicitation
from tritask.server.results import RetryLater
from tritask.tasks.extension import TaskOptions, Tasks
from tritask.tasks.work import RetryPolicy

CONFIRM = {
    "type": "object",
    "properties": {"confirm": {"type": "boolean", "description": "Go ahead?"}},
    "required": ["confirm"],
}

FETCH_RETRIES = RetryPolicy([500, 1_000, 2_000])
"""``flaky_fetch`` is retried after 0.5 s, 1 s and 2 s, then fails for good."""


def build_demo_app() -> App:
    app = App(
        "tritask-demo",
        "0.1.0",
        instructions=(
            "A demo of durable tasks: export_report runs as a task with progress, "
            "deploy asks for confirmation inside its task, flaky_fetch is retried on a "
            "schedule; echo and countdown are ordinary tools."
        ),
    )
    attempts: Counter[str] = Counter()

    @app.tool
    async def echo(text: str) -> str:
        """Echo the text back (an ordinary synchronous tool)."""
        return text

    @app.tool
    async def countdown(ctx: Context, seconds: int = 3) -> str:
        """Count down without a task: progress streams on the request itself."""
        seconds = max(0, min(seconds, 600))
        for step in range(seconds):
            await ctx.progress(step, seconds, f"{seconds - step} left")
            await trio.sleep(1)
        await ctx.progress(seconds, seconds)
        return "liftoff"

    @app.tool(task="required")
    async def export_report(ctx: Context, quarter: str = "Q3", seconds: int = 5) -> dict[str, str]:
        """Export a quarterly report; always runs as a durable task, reporting progress."""
        steps = max(1, min(seconds, 600))
        for step in range(steps):
            await ctx.progress(step, steps, f"exporting {quarter}: {steps - step} s left")
            await trio.sleep(1)  # cancellable: tasks/cancel stops it for real
        await ctx.progress(steps, steps, "done")
        return {
            "quarter": quarter,
            "file": f"report-{quarter}.csv",
            "key": str(ctx.idempotency_key),
        }

    @app.tool(task="required")
    async def deploy(ctx: Context, service: str = "web") -> str:
        """Deploy a service after asking for confirmation inside the task."""
        answer = await ctx.await_input(
            "confirm", elicitation(f"Deploy {service} to production?", CONFIRM)
        )
        content = accepted_content(answer)  # the answer is client input: never trust its shape
        if content is None or content.get("confirm") is not True:
            return f"deployment of {service} called off"
        await trio.sleep(1)
        return f"{service} deployed"

    @app.tool(task=("optional", TaskOptions(retry_policy=FETCH_RETRIES)))
    async def flaky_fetch(ctx: Context, source: str = "orders", failures: int = 2) -> str:
        """Fetch from a flaky source: the first `failures` attempts fail and are retried."""
        key = ctx.idempotency_key or source
        attempts[key] += 1
        if attempts[key] <= failures:
            raise RetryLater(f"{source} is unavailable (attempt {attempts[key]}), retrying")
        return f"fetched {source} after {attempts[key]} attempts"

    @app.prompt
    async def greeting(name: str) -> str:
        """Greet someone by name."""
        return f"Please greet {name} warmly."

    @app.resource("demo://readme", mime_type="text/plain")
    async def readme() -> str:
        """What this server is."""
        return "tritask demo server: durable MCP tasks on trio"

    # Each task tool declares its policy beside it (@app.tool(task=...)); the extension reads it.
    app.add_extension(Tasks(poll_interval_ms=500))
    return app
