"""A tool's task policy declared beside it (``@app.tool(task=...)``), and what start refuses.

The Tasks extension reads ``task=`` from ``ToolDef.options`` (the server's extension API, the
option it claims in ``Extension.tool_options``), exactly as a third-party extension would.
``App.running()`` checks the configuration before opening anything: unknown tool names in
``task_support``/``retry_policies``, a policy given both ways differently, an option no
extension reads, a store and a runner that disagree.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, cast

import pytest
import trio
import trio.testing

from tritask import App, Context, MemoryStore, RetryPolicy, Runner, TaskOptions, Tasks, TrioClock
from tritask.jsonrpc import JSONValue
from tritask.server import ConfigurationError, Extension, ServeEnvironment
from tritask.testing.client import Client, ClientError

START_US = 1_800_000_000_000_000
MISSING_TASKS = {
    "code": -32021,
    "message": "Missing required client capability",
    "data": {"requiredCapabilities": {"extensions": {"io.modelcontextprotocol/tasks": {}}}},
}


def error_of(error: ClientError) -> dict[str, Any]:
    return {"code": error.code, "message": error.message, "data": error.data}


def memory() -> MemoryStore:
    return MemoryStore(scope="shared", clock=TrioClock(START_US))


def policy_app(tasks: Tasks) -> App:
    app = App("policy", "1.0", extensions=[tasks])

    @app.tool(task="required")
    async def export(ctx: Context) -> str:
        """Always a task."""
        return f"exported by {ctx.task_id}"

    @app.tool(task="optional")
    async def maybe() -> str:
        """A task when the client speaks tasks."""
        return "maybe done"

    @app.tool(task=TaskOptions(ttl_ms=5_000, status_message="Queued"))
    async def short_lived() -> str:
        """A task (required) with its own ttl and status message."""
        return "short"

    def by_size(params: Mapping[str, JSONValue], ctx: Context) -> str:
        arguments = params.get("arguments")
        big = isinstance(arguments, dict) and arguments.get("size") == "big"
        return "required" if big else "sync"

    @app.tool(task=by_size)
    async def sized(size: str) -> str:
        """A task only when it is big."""
        return f"{size} done"

    @app.tool
    async def plain() -> str:
        """Never a task."""
        return "plain"

    return app


async def test_the_policy_declared_beside_the_tool_decides(
    autojump_clock: trio.testing.MockClock,
) -> None:
    tasks = Tasks(store=memory(), poll_interval_ms=10)
    app = policy_app(tasks)
    speaks = Client.direct(app)
    silent = Client.direct(app, tasks=False)
    async with app.running():
        created = await speaks.call_tool("export")
        assert (created["resultType"], created["status"]) == ("task", "working")
        done = await speaks.wait_task(str(created["taskId"]))
        assert done["status"] == "completed"
        result = done["result"]
        assert isinstance(result, dict)
        assert (result["content"], result["isError"]) == (
            [{"type": "text", "text": f"exported by {created['taskId']}"}],
            False,
        )
        with pytest.raises(ClientError) as refused:
            await silent.call_tool("export")
        assert error_of(refused.value) == MISSING_TASKS

        assert (await speaks.call_tool("maybe"))["resultType"] == "task"
        direct = await silent.call_tool("maybe")
        assert (direct["resultType"], direct["content"]) == (
            "complete",
            [{"type": "text", "text": "maybe done"}],
        )

        short = await speaks.call_tool("short_lived")
        assert (short["ttlMs"], short["statusMessage"]) == (5_000, "Queued")
        with pytest.raises(ClientError) as also_refused:
            await silent.call_tool("short_lived")
        assert error_of(also_refused.value) == MISSING_TASKS

        assert (await speaks.call_tool("sized", {"size": "big"}))["resultType"] == "task"
        small = await speaks.call_tool("sized", {"size": "small"})
        assert small["content"] == [{"type": "text", "text": "small done"}]
        assert (await speaks.call_tool("plain"))["resultType"] == "complete"

    # What 2025-11-25 clients read as execution.taskSupport comes from the same policy.
    support = {name: tasks.task_support_of(tool) for name, tool in app.tools.items()}
    assert support == {
        "export": "required",
        "maybe": "optional",
        "short_lived": "required",
        "sized": "optional",
        "plain": "forbidden",
    }
    assert app.tools["export"].options == {"task": "required"}
    assert app.tools["plain"].options == {}


async def test_a_tuple_policy_and_task_support_keep_working_side_by_side(
    autojump_clock: trio.testing.MockClock,
) -> None:
    retries = RetryPolicy([1_000])
    tasks = Tasks(store=memory(), task_support={"legacy_way": "required"})
    app = App("both", "1.0", extensions=[tasks])

    @app.tool(task=("optional", TaskOptions(retry_policy=retries, ttl_ms=7_000)))
    async def new_way() -> str:
        """Optional, with its options."""
        return "new"

    @app.tool
    async def legacy_way() -> str:
        """Required through Tasks(task_support=...)."""
        return "old"

    client = Client.direct(app)
    async with app.running():
        assert (await client.call_tool("new_way"))["ttlMs"] == 7_000
        assert (await client.call_tool("legacy_way"))["resultType"] == "task"
        silent = Client.direct(app, tasks=False)
        assert (await silent.call_tool("new_way"))["content"] == [{"type": "text", "text": "new"}]


def configured(tasks: Tasks, **tool_options: Any) -> App:
    app = App("checked", "1.0", extensions=[tasks])

    @app.tool(**tool_options)
    async def export_report() -> str:
        """Export."""
        return ""

    @app.tool
    async def sync_ledger() -> str:
        """Sync."""
        return ""

    return app


KNOWN = "known: 'export_report', 'sync_ledger'"


@pytest.mark.parametrize(
    ("tasks", "tool_options", "message"),
    [
        (
            Tasks(task_support={"exprt_report": "required"}),
            {},
            "Tasks(task_support=...): tool 'exprt_report' is unknown (did you mean "
            f"'export_report'?); {KNOWN}",
        ),
        (
            Tasks(retry_policies={"billing": RetryPolicy([1])}),
            {},
            f"Tasks(retry_policies=...): tool 'billing' is unknown; {KNOWN}",
        ),
        (
            Tasks(task_support=cast(Any, {"export_report": "sometimes"})),
            {},
            "Tasks(task_support=...): the policy of tool 'export_report' is 'sometimes'; "
            "expected 'sync', 'optional', 'required', a TaskOptions (required, with those "
            "options), (mode, TaskOptions) or a callable (params, ctx) -> decision",
        ),
        (
            Tasks(),
            {"task": "requried"},
            "tool 'export_report': @app.tool(task='requried') is not a task policy; expected "
            "'sync', 'optional', 'required', a TaskOptions (required, with those options), "
            "(mode, TaskOptions) or a callable (params, ctx) -> decision",
        ),
        (
            Tasks(task_support={"export_report": "optional"}),
            {"task": "required"},
            "tool 'export_report' declares its task policy twice, differently: "
            "@app.tool(task='required') and Tasks(task_support={'export_report': 'optional'}); "
            "keep one",
        ),
        (
            Tasks(retry_policies={"export_report": RetryPolicy([5])}),
            {"task": TaskOptions(retry_policy=RetryPolicy([1]))},
            "tool 'export_report' declares its retry policy twice, differently: in "
            "@app.tool(task=TaskOptions(retry_policy=...)) and in Tasks(retry_policies=...); "
            "keep one",
        ),
        (
            Tasks(),
            {"tsk": "required"},
            "tool 'export_report': the @app.tool keyword 'tsk' is unknown (did you mean "
            "'task'?); known: 'annotations', 'description', 'input_schema', 'meta', 'name', "
            "'output_schema', 'required_scopes', 'restartable', 'task', 'title'",
        ),
    ],
    ids=[
        "unknown-task-support",
        "unknown-retry-policy",
        "invalid-task-support",
        "invalid-decorator",
        "both-ways",
        "retry-both-ways",
        "unknown-option",
    ],
)
async def test_start_refuses_what_cannot_be_served_before_opening_anything(
    tasks: Tasks, tool_options: dict[str, Any], message: str
) -> None:
    opened: list[str] = []

    class Opens(Extension):
        id = "test.example/opens"

        @asynccontextmanager
        async def lifespan(self, app: App, env: ServeEnvironment) -> AsyncIterator[None]:
            opened.append("opened")
            yield

    app = configured(tasks, **tool_options)
    app.add_extension(Opens())
    with pytest.raises(ConfigurationError) as refused:
        async with app.running():
            raise AssertionError("must not start")
    assert str(refused.value) == message
    assert opened == []
    assert tasks.store is None and tasks.runner is None  # no store opened, no runner started
    with pytest.raises(ConfigurationError):
        app.check()


async def test_the_same_policy_given_both_ways_is_accepted() -> None:
    policy = RetryPolicy([1_000])
    tasks = Tasks(
        task_support={"export_report": "required"}, retry_policies={"export_report": policy}
    )
    app = configured(tasks, task="required")
    app.check()
    same_retry = configured(
        Tasks(retry_policies={"export_report": policy}),
        task=TaskOptions(retry_policy=RetryPolicy([1_000])),
    )
    same_retry.check()


def test_an_option_without_any_extension_names_no_reader() -> None:
    app = App("bare", "1.0")

    @app.tool(task="required")
    async def export() -> str:
        """Export."""
        return ""

    with pytest.raises(ConfigurationError) as refused:
        app.check()
    assert str(refused.value) == (
        "tool 'export': the @app.tool keyword 'task' is unknown; known: 'annotations', "
        "'description', 'input_schema', 'meta', 'name', 'output_schema', 'required_scopes', "
        "'restartable', 'title'"
    )


async def test_a_store_and_a_runner_that_disagree_are_refused() -> None:
    first, second = memory(), memory()
    mismatch = (
        "Tasks(store=..., runner=...): the runner runs on another store than the one given; "
        "pass Runner(store) for the same store, or the runner alone (its store is used)"
    )
    with pytest.raises(ValueError) as refused:
        Tasks(store=first, runner=Runner(second))
    assert str(refused.value) == mismatch

    agreed = Tasks(store=first, runner=Runner(first))
    assert agreed.store is first
    runner_only = Tasks(runner=Runner(second))
    assert runner_only.store is second  # the runner's store: never a second, opened one
    with pytest.raises(ValueError) as switched:
        runner_only.store = first
    assert str(switched.value) == mismatch
    with pytest.raises(ValueError) as rewired:
        agreed.runner = Runner(second)
    assert str(rewired.value) == mismatch
    assert agreed.runner is not None and agreed.runner.store is first
    agreed.runner = None
    agreed.store = second
    agreed.runner = Runner(second)
    assert agreed.store is second
