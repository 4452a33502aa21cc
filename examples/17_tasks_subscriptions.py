"""Watching several tasks on one listen stream: an answer, a cancellation, two results.

Run it: ``python examples/17_tasks_subscriptions.py``. It serves an app with three task tools
over Streamable HTTP on a free loopback port, connects the tritask client, starts one task of
each, and opens a single ``subscriptions/listen`` with their ``taskIds``. Every state change is
printed as its ``notifications/tasks`` arrives: when ``deploy`` asks for confirmation the
client answers with ``tasks/update``, and it cancels ``watch_queue`` (which would run forever)
with ``tasks/cancel``. The stream shows each task to its terminal state.

``python examples/17_tasks_subscriptions.py ws`` runs the same story over WebSocket.
"""

from __future__ import annotations

import functools
import sys

import trio

from tritask import App, Context, Tasks, elicitation
from tritask.client import TaskHandle, TaskState, connect
from tritask.server.extension import ServeEnvironment
from tritask.transports.http import serve_http
from tritask.transports.websocket import serve_websocket

CONFIRM = {
    "type": "object",
    "properties": {"confirm": {"type": "boolean", "description": "Go ahead?"}},
    "required": ["confirm"],
}


def build_app() -> App:
    app = App("subscriptions-walkthrough", "1.0.0")

    @app.tool
    async def build_report(quarter: str = "Q3") -> str:
        """Build a report (a short task)."""
        await trio.sleep(0.3)
        return f"report {quarter} ready"

    @app.tool
    async def deploy(ctx: Context, service: str = "web") -> str:
        """Deploy after a confirmation asked inside the task."""
        answer = await ctx.await_input(
            "confirm", elicitation(f"Deploy {service} to production?", CONFIRM)
        )
        confirmed = answer.get("action") == "accept" and (answer.get("content") or {}).get(
            "confirm"
        )
        return f"{service} deployed" if confirmed else f"{service} not deployed"

    @app.tool
    async def watch_queue() -> str:
        """Watch a queue until cancelled."""
        await trio.sleep_forever()

    app.add_extension(
        Tasks(
            task_support={
                "build_report": "required",
                "deploy": "required",
                "watch_queue": "required",
            },
            poll_interval_ms=200,
        )
    )
    return app


def describe(name: str, state: TaskState) -> str:
    line = f"{name}: {state.status}"
    if state.input_requests:
        asked = ", ".join(request.message or key for key, request in state.input_requests.items())
        line += f" (asks: {asked})"
    if state.status == "completed" and state.result is not None:
        texts = [item.get("text") for item in state.result.get("content", [])]
        line += " -> " + " ".join(str(text) for text in texts)
    return line


async def main(transport: str) -> None:
    app = build_app()
    async with app.running(ServeEnvironment(store_url="memory:")), trio.open_nursery() as nursery:
        if transport == "ws":
            url = await nursery.start(functools.partial(serve_websocket, app, "127.0.0.1", 0))
        else:
            binds = await nursery.start(functools.partial(serve_http, app, "127.0.0.1", 0))
            url = binds[0] + "/mcp"
        # The client answers deploy's question itself (below), so it declares elicitation
        # without a handler: a task may only ask for what its creating request declared.
        async with connect(url, capabilities={"elicitation": {}}) as client:
            # 1. Start one task of each tool; each call returns as soon as its task is stored.
            calls = {
                "build_report": await client.start_tool("build_report", {"quarter": "Q4"}),
                "deploy": await client.start_tool("deploy", {"service": "api"}),
                "watch_queue": await client.start_tool("watch_queue"),
            }
            tasks: dict[str, TaskHandle] = {}
            names: dict[str, str] = {}
            for name, call in calls.items():
                assert call.task is not None, f"{name} should have become a task"
                tasks[call.task.task_id] = call.task
                names[call.task.task_id] = name
            print(f"1. started {len(tasks)} tasks")

            # 2. One listen stream for all of them; each state change prints as it arrives.
            async with client.listen(task_ids=list(tasks)) as subscription:
                assert sorted(subscription.task_ids) == sorted(tasks)
                print(f"2. listening to {len(subscription.task_ids)} tasks")
                shown: dict[str, str] = {}
                final: dict[str, str] = {}
                cancel_sent = False
                async for notification in subscription:
                    state = notification.task
                    if state is None:
                        continue
                    name = names[state.task_id]
                    line = describe(name, state)
                    if shown.get(name) == line:
                        continue  # the same state twice (the snapshot after the ack, a push)
                    shown[name] = line
                    print("   ", line)
                    handle = tasks[state.task_id]
                    if state.status == "input_required" and "confirm" not in handle.answered:
                        # 3. Answer the question inside the task with tasks/update.
                        answer = {"action": "accept", "content": {"confirm": True}}
                        await handle.respond("confirm", answer)
                        print("3. answered deploy's confirmation")
                    if name == "watch_queue" and state.status == "working" and not cancel_sent:
                        # 4. Cancel the task that would run forever with tasks/cancel.
                        cancel_sent = True
                        await handle.cancel()
                        print("4. asked to cancel watch_queue")
                    if state.terminal:
                        final[name] = state.status
                    if len(final) == len(calls):
                        break
            print("5. terminal:", ", ".join(f"{name} {final[name]}" for name in calls))
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    trio.run(main, sys.argv[1] if len(sys.argv) > 1 else "http")
