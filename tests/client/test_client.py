"""The client against in-process tritask apps: over a real HTTP socket (``serve_http`` on a
free port) and over stdio framing (``serve_stdio`` on memory streams)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
from client_support import Answers, stdio_in_process

from tritask import App, Context
from tritask.client import (
    AuthChallenge,
    Client,
    HttpTransport,
    InputNotHandled,
    InvalidParamsError,
    MissingCapabilityError,
    Progress,
    ToolRejected,
    connect,
)
from tritask.server.mrtr import InputRequired, elicitation
from tritask.transports.http import HttpOptions, Unauthenticated

NAME_FORM = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def build_app(make_app: Callable[..., App], events: dict[str, trio.Event]) -> App:
    app = make_app("client-tests", "1.0.0")

    @app.tool(
        input_schema={
            "type": "object",
            "properties": {
                "region": {"type": "string", "x-mcp-header": "Region"},
                "query": {"type": "string"},
            },
            "required": ["region", "query"],
        }
    )
    async def execute(region: str, query: str) -> str:
        """Mirrors region into Mcp-Param-Region."""
        return f"{query} in {region}"

    @app.tool(
        input_schema={
            "type": "object",
            "properties": {"score": {"type": "number", "x-mcp-header": "Score"}},
        }
    )
    async def broken(score: float = 0) -> str:
        """An annotation on a number: clients must refuse this tool over HTTP."""
        return "called"

    @app.tool()
    async def steps(ctx: Context) -> str:
        """Reports progress 1, 2, 3 of 3."""
        for step in (1, 2, 3):
            await ctx.progress(step, 3, f"step {step}")
        return "stepped"

    @app.tool()
    async def hang() -> str:
        """Waits until cancelled."""
        events["started"].set()
        try:
            await trio.sleep_forever()
        finally:
            events["cancelled"].set()

    @app.tool()
    async def two_rounds(ctx: Context) -> str | InputRequired:
        """Asks for a name, then for a second name, carrying the first in requestState."""
        first = ctx.input_response("first")
        if ctx.request_state is None:
            return ctx.input_required({"first": elicitation("First?", NAME_FORM)}, state="r1")
        if ctx.request_state == "r1" and first is not None:
            name = first["content"]["name"]
            return ctx.input_required(
                {"second": elicitation("Second?", NAME_FORM)}, state=f"r2:{name}"
            )
        second = ctx.input_response("second")
        assert second is not None and isinstance(ctx.request_state, str)
        return f"{ctx.request_state[3:]} and {second['content']['name']}"

    return app


@pytest.fixture
def events() -> dict[str, trio.Event]:
    return {"started": trio.Event(), "cancelled": trio.Event()}


@pytest.fixture
def app(make_app: Callable[..., App], events: dict[str, trio.Event]) -> App:
    return build_app(make_app, events)


Connect = Callable[..., Any]


@pytest.fixture(params=["http", "stdio"])
def connected(
    request: pytest.FixtureRequest, app: App, http_server: Callable[..., Awaitable[str]]
) -> Connect:
    """``async with connected(**options) as client`` over the parametrized transport."""

    @asynccontextmanager
    async def open_client(**options: Any) -> AsyncIterator[Client]:
        if request.param == "http":
            url = await http_server(app) + "/mcp"
            async with connect(url, **options) as client:
                yield client
        else:
            async with stdio_in_process(app, **options) as client:
                await client.discover()
                yield client

    return open_client


async def test_mrtr_rounds_reach_the_handler(connected: Connect) -> None:
    answers = Answers()
    names = iter(["Ada", "Grace"])

    async def elicit(request: Any) -> dict[str, Any]:
        answers.seen.append(request)
        return {"action": "accept", "content": {"name": next(names)}}

    async with connected(elicitation=elicit) as client:
        result = await client.call_tool("two_rounds")
    assert result.text == "Ada and Grace"
    assert [(r.key, r.message, r.task_id) for r in answers.seen] == [
        ("first", "First?", None),
        ("second", "Second?", None),
    ]


async def test_an_input_without_a_handler_is_not_guessed(connected: Connect) -> None:
    # Without a handler the client does not declare elicitation, so the server may not ask.
    async with connected() as client:
        assert "elicitation" not in client.capabilities
        with pytest.raises(MissingCapabilityError) as raised:
            await client.call_tool("two_rounds")
    assert raised.value.required == {"elicitation": {}}


async def test_undeclared_handler_is_reported(connected: Connect) -> None:
    async with connected(capabilities={"elicitation": {}}) as client:
        with pytest.raises(InputNotHandled) as raised:
            await client.call_tool("two_rounds")
    assert (raised.value.key, raised.value.method) == ("first", "elicitation/create")


async def test_progress_of_a_sync_call(connected: Connect) -> None:
    seen: list[Progress] = []
    async with connected() as client:
        result = await client.call_tool("steps", on_progress=seen.append)
    assert result.text == "stepped"
    assert seen == [
        Progress(1.0, 3.0, "step 1"),
        Progress(2.0, 3.0, "step 2"),
        Progress(3.0, 3.0, "step 3"),
    ]


async def test_leaving_a_call_cancels_it_on_the_server(
    connected: Connect, events: dict[str, trio.Event]
) -> None:
    async with connected() as client:
        with trio.move_on_after(30) as scope:
            async with trio.open_nursery() as nursery:

                async def call() -> None:
                    await client.call_tool("hang")

                nursery.start_soon(call)
                await events["started"].wait()
                nursery.cancel_scope.cancel()
        assert not scope.cancelled_caught
        with trio.fail_after(10):
            await events["cancelled"].wait()
        # The connection is still good for the next request.
        assert (await client.call_tool("steps")).text == "stepped"


async def test_errors_carry_the_server_message_and_data(connected: Connect) -> None:
    async with connected() as client:
        with pytest.raises(InvalidParamsError) as raised:
            await client.call_tool("nope")
    error = raised.value
    assert (error.code, error.message, error.data) == (
        -32602,
        "Unknown tool: nope",
        {"name": "nope"},
    )
    assert error.method == "tools/call"


async def test_listen_for_list_changes(connected: Connect, app: App) -> None:
    async with connected() as client:
        with trio.fail_after(30):
            async with client.listen(tools_list_changed=True, prompts_list_changed=True) as sub:
                assert sub.accepted == {"toolsListChanged": True}
                app.notify_tools_changed()
                notification = await sub.__anext__()
    assert notification.method == "notifications/tools/list_changed"
    assert notification.subscription_id == sub.id


async def test_param_headers_over_http(
    app: App, http_server: Callable[..., Awaitable[str]]
) -> None:
    url = await http_server(app) + "/mcp"
    async with connect(url) as client:
        # The tool was not listed yet: the client lists tools to learn its headers first.
        result = await client.call_tool("execute", {"region": "eu-north ✓", "query": "q"})
        assert result.text == "q in eu-north ✓"
        assert [tool.name for tool in await client.list_tools()] == [
            "execute",
            "steps",
            "hang",
            "two_rounds",
        ]
        reason = "x-mcp-header 'Score' annotates type 'number'; only string, integer and boolean"
        assert client.rejected_tools == {"broken": reason}
        with pytest.raises(ToolRejected, match="'broken' is rejected"):
            await client.call_tool("broken", {"score": 1.5})


async def test_a_changed_annotation_is_relisted_after_a_mismatch(
    app: App, http_server: Callable[..., Awaitable[str]]
) -> None:
    url = await http_server(app) + "/mcp"
    async with connect(url) as client:
        await client.list_tools()
        app.remove_tool("execute")

        @app.tool(
            "execute",
            input_schema={
                "type": "object",
                "properties": {
                    "region": {"type": "string"},
                    "query": {"type": "string", "x-mcp-header": "Query"},
                },
                "required": ["region", "query"],
            },
        )
        async def execute_v2(region: str, query: str) -> str:
            """Now mirrors query instead."""
            return f"v2 {query}"

        assert (await client.call_tool("execute", {"region": "r", "query": "q"})).text == "v2 q"
        assert [h.header for h in client._tools["execute"].param_headers] == ["Query"]


async def test_the_authorizer_hook(
    make_app: Callable[..., App],
    events: dict[str, trio.Event],
    http_server: Callable[..., Awaitable[str]],
) -> None:
    app = build_app(make_app, events)
    seen: list[str | None] = []

    async def authenticate(headers: Any) -> str:
        value = headers.get("authorization")
        seen.append(value)
        if value != "Bearer fresh":
            raise Unauthenticated()
        return "alice"

    url = await http_server(app, HttpOptions(authenticate=authenticate)) + "/mcp"
    challenges: list[AuthChallenge | None] = []
    token = "Bearer stale"

    async def authorizer(challenge: AuthChallenge | None) -> str | None:
        nonlocal token
        challenges.append(challenge)
        if challenge is not None:
            token = "Bearer fresh"
        return token

    async with HttpTransport(url, authorizer=authorizer) as transport:
        client = Client(transport)
        await client.discover()
        assert (await client.call_tool("steps")).text == "stepped"
    assert seen[:3] == ["Bearer stale", "Bearer fresh", "Bearer fresh"]
    assert challenges[0] is None
    assert challenges[1] is not None and challenges[1].http_status == 401
    assert all(c is None for c in challenges[2:])


async def test_a_version_the_server_names_is_retried(connected: Connect) -> None:
    async with connected(protocol_version="2025-12-01") as client:
        assert client.protocol_version == "2026-07-28"
