"""Interop: the official ``mcp`` 2.3.0 Python client, in mode ``"2026-07-28"``, under trio.

Every scenario runs twice: against tritask over Streamable HTTP (``serve_http`` in the test's
nursery on a free loopback port) and over stdio (the client launches
``python -m tritask serve tests/interop/interop_app.py:app --stdio`` itself). The client is
used through its public API only: ``Client(..., mode="2026-07-28")``, ``list_*``,
``call_tool``, ``read_resource``, ``get_prompt``, ``listen`` and ``elicitation_callback``,
which drives the MRTR rounds by itself.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import mcp_types as types
import pytest
import trio
from interop_app import NAME_SCHEMA, build_app
from mcp import Client, StdioServerParameters
from mcp.client import ClientRequestContext
from mcp.client.subscriptions import SubscriptionLost, ToolsListChanged

from tritask.transports.http import serve_http

APP_PATH = Path(__file__).with_name("interop_app.py")
SERVER_INFO = {
    "io.modelcontextprotocol/serverInfo": {"name": "tritask-interop", "version": "1.2.3"}
}

pytestmark = pytest.mark.parametrize("transport", ["http", "stdio"])


@asynccontextmanager
async def connect(transport: str, tmp_path: Path, **options: Any) -> AsyncIterator[Client]:
    """A connected 2026-07-28 client, against a fresh server on ``transport``."""
    async with trio.open_nursery() as nursery:
        if transport == "http":
            binds: list[str] = await nursery.start(
                functools.partial(serve_http, build_app(), "127.0.0.1", 0)
            )
            server: Any = binds[0] + "/mcp"
        else:
            server = StdioServerParameters(
                command=sys.executable,
                args=["-m", "tritask", "serve", f"{APP_PATH}:app", "--stdio", "--store", "memory:"],
                cwd=tmp_path,
                # The SDK's default environment drops PYTHONPATH: the server would import
                # whichever tritask is installed, not the one under test.
                env=dict(os.environ),
            )
        options.setdefault("mode", "2026-07-28")
        async with Client(server, **options) as client:
            yield client
        nursery.cancel_scope.cancel()


async def test_lists_and_calls_tools(transport: str, tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with connect(transport, tmp_path) as client:
            assert client.protocol_version == "2026-07-28"
            listed = await client.list_tools()
            assert [tool.name for tool in listed.tools] == [
                "add",
                "steps",
                "greet",
                "wait",
                "cancelled_waits",
                "touch_tools",
                "end_subscriptions",
            ]
            assert listed.tools[0].input_schema == {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            }
            result = await client.call_tool("add", {"a": 2, "b": 40})
            assert result.is_error is False
            assert result.structured_content == {"sum": 42}
            assert result.content == [types.TextContent(type="text", text='{"sum":42}')]
            assert result.meta == SERVER_INFO


async def test_auto_mode_discovers_the_server(transport: str, tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with connect(transport, tmp_path, mode="auto") as client:
            assert client.protocol_version == "2026-07-28"
            assert client.server_info == types.Implementation(
                name="tritask-interop", version="1.2.3"
            )
            assert client.instructions == "Interop fixture."
            assert client.server_capabilities == types.ServerCapabilities(
                tools=types.ToolsCapability(list_changed=True),
                prompts=types.PromptsCapability(list_changed=True),
                resources=types.ResourcesCapability(subscribe=True, list_changed=True),
            )


async def test_progress_reaches_the_callback(transport: str, tmp_path: Path) -> None:
    seen: list[tuple[float, float | None, str | None]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append((progress, total, message))

    with trio.fail_after(60):
        async with connect(transport, tmp_path) as client:
            result = await client.call_tool("steps", {"count": 3}, progress_callback=on_progress)
    assert result.content == [types.TextContent(type="text", text="3 steps")]
    assert seen == [(1, 3, "step 1"), (2, 3, "step 2"), (3, 3, "step 3")]


async def test_reads_resources(transport: str, tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with connect(transport, tmp_path) as client:
            resources = await client.list_resources()
            assert [(str(r.uri), r.name, r.mime_type) for r in resources.resources] == [
                ("interop://readme", "readme", "text/plain")
            ]
            templates = await client.list_resource_templates()
            assert [t.uri_template for t in templates.resource_templates] == [
                "interop://items/{item}"
            ]
            readme = await client.read_resource("interop://readme")
            assert readme.contents == [
                types.TextResourceContents(
                    uri="interop://readme", mime_type="text/plain", text="tritask interop fixture"
                )
            ]
            item = await client.read_resource("interop://items/widget")
            assert item.contents == [
                types.TextResourceContents(
                    uri="interop://items/widget",
                    mime_type="application/json",
                    text='{"item": "widget"}',
                )
            ]


async def test_gets_prompts(transport: str, tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with connect(transport, tmp_path) as client:
            prompts = await client.list_prompts()
            assert [
                (p.name, [(a.name, a.required) for a in p.arguments or []]) for p in prompts.prompts
            ] == [("review", [("language", True), ("code", True)])]
            prompt = await client.get_prompt("review", {"language": "python", "code": "x = 1"})
    assert prompt.description == "Ask for a code review."
    assert prompt.messages == [
        types.PromptMessage(
            role="user",
            content=types.TextContent(type="text", text="Review this python code:\nx = 1"),
        )
    ]


async def test_mrtr_elicitation_round_trip(transport: str, tmp_path: Path) -> None:
    asked: list[types.ElicitRequestParams] = []

    async def elicit(
        context: ClientRequestContext, params: types.ElicitRequestParams
    ) -> types.ElicitResult:
        asked.append(params)
        if len(asked) == 1:
            return types.ElicitResult(action="accept", content={"name": "Ada"})
        return types.ElicitResult(action="decline")

    with trio.fail_after(60):
        async with connect(transport, tmp_path, elicitation_callback=elicit) as client:
            accepted = await client.call_tool("greet", {"greeting": "Hi"})
            declined = await client.call_tool("greet", {})
    assert accepted.content == [types.TextContent(type="text", text="Hi, Ada (round 2)")]
    assert declined.content == [types.TextContent(type="text", text="Hello, stranger (round 2)")]
    assert len(asked) == 2
    assert isinstance(asked[0], types.ElicitRequestFormParams)
    assert asked[0].message == "What is your name?"
    assert asked[0].requested_schema == NAME_SCHEMA


async def test_listen_receives_list_changes(transport: str, tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with connect(transport, tmp_path) as client:
            async with client.listen(tools_list_changed=True, prompts_list_changed=True) as sub:
                assert sub.honored == types.SubscriptionFilter(
                    tools_list_changed=True, prompts_list_changed=True
                )
                touched = await client.call_tool("touch_tools", {})
                assert touched.content == [types.TextContent(type="text", text="touched")]
                async for event in sub:
                    assert event == ToolsListChanged()
                    break
            # the stream was ended by the client; the connection keeps working
            assert (await client.call_tool("add", {"a": 1, "b": 1})).structured_content == {
                "sum": 2
            }


async def test_server_side_teardown_ends_the_listen_stream(transport: str, tmp_path: Path) -> None:
    events: list[object] = []
    with trio.fail_after(60):
        async with connect(transport, tmp_path) as client:
            async with client.listen(tools_list_changed=True) as sub:
                await client.call_tool("end_subscriptions", {})
                try:
                    async for event in sub:
                        events.append(event)
                    ending = "graceful"
                except SubscriptionLost as lost:
                    assert lost.__cause__ is None  # settled by the server's cancel, not a drop
                    ending = "lost"
            # the connection outlives the subscription
            added = await client.call_tool("add", {"a": 2, "b": 2})
    assert events == []
    assert added.structured_content == {"sum": 4}
    if transport == "http":
        assert ending == "graceful"
    else:
        # On stdio tritask sends the graceful result and then notifications/cancelled for the
        # listen id. mcp 2.3.0 settles the result in a separate task, while its read loop takes
        # a server-sent cancel as an abrupt loss, so when the two lines arrive back to back it
        # occasionally (a few percent of runs) reports SubscriptionLost: a client-side race.
        assert ending in ("graceful", "lost")


async def test_abandoned_call_is_cancelled_on_the_server(transport: str, tmp_path: Path) -> None:
    started = trio.Event()

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        started.set()

    with trio.fail_after(60):
        async with connect(transport, tmp_path) as client:
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(
                        functools.partial(
                            client.call_tool, "wait", {}, progress_callback=on_progress
                        )
                    )
                    await started.wait()
                    scope.cancel()
            assert scope.cancelled_caught
            # the client's cancel (notifications/cancelled on stdio, closing the stream on
            # HTTP) reaches the tool; poll through the same connection until it has counted
            while True:
                count = await client.call_tool("cancelled_waits", {})
                if count.content == [types.TextContent(type="text", text="1")]:
                    break
                assert count.content == [types.TextContent(type="text", text="0")]
