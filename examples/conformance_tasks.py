"""The Tasks fixture tools of the conformance suite, attached to the conformance app.

``greet`` is sync; ``slow_compute``, ``confirm_delete`` and ``multi_input`` are optional tasks;
``failing_job`` and ``protocol_error_job`` are required tasks; ``test_tool_with_task`` finishes
an MRTR round synchronously and becomes a required task on the final round.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import trio

from tritask import App, Context, Tasks, ToolError, Work, accepted_content, elicitation

USER_NAME_KEY = "user_name"

NAME_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "description": "Your name"}},
    "required": ["name"],
}
CONFIRM_SCHEMA = {
    "type": "object",
    "properties": {"confirm": {"type": "boolean", "description": "Confirm"}},
    "required": ["confirm"],
}


def _answered_name(ctx: Context) -> str | None:
    content = accepted_content(ctx.input_response(USER_NAME_KEY))
    name = content.get("name") if content else None
    return name if isinstance(name, str) else None


def _mrtr_policy(params: Mapping[str, Any], ctx: Context) -> Literal["required", "sync"]:
    """Sync for the MRTR round that asks for a name; a required task once it is answered.

    Only an answer that carries a name (or a name in the arguments) makes the task: a task
    started without one would ask again, and a task cannot answer ``input_required``.
    """
    arguments = params.get("arguments")
    named = isinstance(arguments, dict) and isinstance(arguments.get("name"), str)
    if params.get("inputResponses") and (named or _answered_name(ctx) is not None):
        return "required"
    return "sync"


def _work_builder(task_id: str, tool: str, arguments: dict[str, Any], ctx: Context) -> Work:
    """Project the MRTR answer into the durable work so a restarted worker still has it."""
    if tool == "test_tool_with_task":
        name = _answered_name(ctx)
        if name is not None:
            arguments = {**arguments, "name": name}
    return Work.tool_call(task_id, tool, arguments)


def install_tasks(app: App) -> Tasks:
    @app.tool()
    async def greet(name: str = "World") -> str:
        """Greet someone (always synchronous)."""
        return f"Hello, {name}!"

    @app.tool()
    async def slow_compute(seconds: float = 1, label: str = "") -> str:
        """Sleep for the given seconds, then report completion (a task when declared)."""
        await trio.sleep(max(0.0, float(seconds)))
        return f"Completed {label}"

    @app.tool()
    async def failing_job() -> str:
        """A task that ends with a tool error after about a second."""
        await trio.sleep(1)
        raise ToolError("The task job failed")

    @app.tool()
    async def protocol_error_job() -> str:
        """A task whose worker crashes: the task fails with a protocol error."""
        raise RuntimeError("private task crash detail")

    @app.tool()
    async def confirm_delete(ctx: Context, filename: str = "file.txt") -> str:
        """Ask for confirmation inside the task before deleting a file."""
        response = await ctx.await_input(
            "confirm-delete", elicitation(f"Delete {filename}?", CONFIRM_SCHEMA)
        )
        content = accepted_content(response)  # the answer is client input: never trust its shape
        confirmed = content is not None and content.get("confirm") is True
        return f"Delete confirmed: {str(confirmed).lower()}"

    @app.tool()
    async def multi_input(ctx: Context) -> str:
        """Ask two questions at once inside the task."""
        answers: dict[str, str] = {}

        async def ask(key: str, message: str) -> None:
            response = await ctx.await_input(key, elicitation(message, NAME_SCHEMA))
            content = accepted_content(response) or {}
            answers[key] = str(content.get("name", response.get("action")))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, "first-input", "First input?")
            nursery.start_soon(ask, "second-input", "Second input?")
        return f"Inputs received: {answers['first-input']}, {answers['second-input']}"

    @app.tool(
        input_schema={"type": "object", "properties": {"name": {"type": "string"}}},
    )
    async def test_tool_with_task(ctx: Context, name: str | None = None) -> Any:
        """Gather a name with MRTR, then finish as a task."""
        if name is None:
            return ctx.input_required(
                {USER_NAME_KEY: elicitation("What is your name?", NAME_SCHEMA)},
                state="tasks-composition-round-1",
            )
        return f"Hello, {name}; task completed"

    tasks = Tasks(
        task_support={
            "slow_compute": "optional",
            "failing_job": "required",
            "protocol_error_job": "required",
            "confirm_delete": "optional",
            "multi_input": "optional",
            "test_tool_with_task": _mrtr_policy,
        },
        poll_interval_ms=100,
        work_builder=_work_builder,
    )
    app.add_extension(tasks)
    return tasks
