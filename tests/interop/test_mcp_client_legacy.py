"""Interop: the official ``mcp`` 2.3.0 Python client in ``mode="legacy"`` (the initialize era).

The same client as :mod:`test_mcp_client`, forced into the initialize handshake, as hosts on
the SDK's legacy mode use it. Every scenario runs against tritask over Streamable HTTP
(``serve_http`` in the test's nursery on a free loopback port: a session with
``Mcp-Session-Id``) and over stdio (the client launches ``python -m tritask serve
tests/interop/legacy_app.py:app --stdio``: the process is the session). The app is one tool
implementation for both eras: the MRTR tool ``greet`` must reach this client as a
server-initiated ``elicitation/create``, and the task tools ``report`` and ``hold`` run as
durable tasks that the request waits for. ``mcp`` 2.3.0 has no 2025-11-25 tasks client; the
experimental task protocol is driven by the TypeScript SDK (:mod:`test_ts_sdk`).
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
from interop_app import NAME_SCHEMA
from legacy_app import build_legacy_app
from mcp import Client, MCPError, StdioServerParameters
from mcp.client import ClientRequestContext

from tritask.server.extension import ServeEnvironment
from tritask.transports.http import serve_http

APP_PATH = Path(__file__).with_name("legacy_app.py")
TOOLS = [
    "add",
    "steps",
    "greet",
    "wait",
    "cancelled_waits",
    "touch_tools",
    "end_subscriptions",
    "tally",
    "report",
    "release",
    "hold",
    "cancelled_holds",
]

pytestmark = [
    pytest.mark.parametrize("transport", ["http", "stdio"]),
    # ping, logging/setLevel and resources/subscribe are gone from 2026-07-28: the client warns
    # on every use, and this module uses them on purpose
    pytest.mark.filterwarnings("ignore::mcp.shared.exceptions.MCPDeprecationWarning"),
]


@asynccontextmanager
async def connect(transport: str, tmp_path: Path, **options: Any) -> AsyncIterator[Client]:
    """A connected legacy client, against a fresh server on ``transport``."""
    async with trio.open_nursery() as nursery:
        if transport == "http":
            app = build_legacy_app()
            async with app.running(ServeEnvironment(store_url="memory:")):
                binds: list[str] = await nursery.start(
                    functools.partial(serve_http, app, "127.0.0.1", 0)
                )
                async with Client(binds[0] + "/mcp", mode="legacy", **options) as client:
                    yield client
                nursery.cancel_scope.cancel()
        else:
            server = StdioServerParameters(
                command=sys.executable,
                args=["-m", "tritask", "serve", f"{APP_PATH}:app", "--stdio", "--store", "memory:"],
                cwd=tmp_path,
                # the client passes only PATH, HOME and a few more by default; PYTHONPATH
                # makes the server import this checkout's tritask
                env=dict(os.environ),
            )
            async with Client(server, mode="legacy", **options) as client:
                yield client


def text(result: types.CallToolResult) -> str:
    return "".join(block.text for block in result.content if isinstance(block, types.TextContent))


async def test_initialize_negotiates_2025_11_25(transport: str, tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with connect(transport, tmp_path) as client:
            assert client.protocol_version == "2025-11-25"
            assert client.server_info == types.Implementation(
                name="tritask-interop", version="1.2.3"
            )
            assert client.instructions == "Interop fixture."
            capabilities = client.server_capabilities
            assert capabilities is not None
            assert capabilities.tools == types.ToolsCapability(list_changed=True)
            assert capabilities.prompts == types.PromptsCapability(list_changed=True)
            assert capabilities.resources == types.ResourcesCapability(
                subscribe=True, list_changed=True
            )
            assert capabilities.logging == types.LoggingCapability()
            # the client declared no tasks: the experimental task protocol is not offered
            assert capabilities.tasks is None
            assert await client.send_ping() == types.EmptyResult()
            assert await client.set_logging_level("info") == types.EmptyResult()


async def test_lists_and_calls_tools(transport: str, tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with connect(transport, tmp_path) as client:
            listed = await client.list_tools()
            assert [tool.name for tool in listed.tools] == TOOLS
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
            # a legacy result has no 2026 server stamp
            assert result.meta is None
            with pytest.raises(MCPError) as unknown:
                await client.call_tool("no_such_tool", {})
            assert unknown.value.error.code == -32602


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
            assert await client.subscribe_resource("interop://readme") == types.EmptyResult()
            assert await client.unsubscribe_resource("interop://readme") == types.EmptyResult()


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


async def test_progress_reaches_the_callback(transport: str, tmp_path: Path) -> None:
    seen: list[tuple[float, float | None, str | None]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append((progress, total, message))

    with trio.fail_after(60):
        async with connect(transport, tmp_path) as client:
            result = await client.call_tool("steps", {"count": 3}, progress_callback=on_progress)
    assert result.content == [types.TextContent(type="text", text="3 steps")]
    assert seen == [(1, 3, "step 1"), (2, 3, "step 2"), (3, 3, "step 3")]


async def test_tool_input_becomes_an_elicitation_request(transport: str, tmp_path: Path) -> None:
    """``greet`` returns MRTR ``input_required``; this client sees ``elicitation/create``."""
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
    assert all(isinstance(params, types.ElicitRequestFormParams) for params in asked)
    assert [params.message for params in asked] == ["What is your name?"] * 2
    forms = [params for params in asked if isinstance(params, types.ElicitRequestFormParams)]
    assert [params.requested_schema for params in forms] == [NAME_SCHEMA] * 2


async def test_task_tool_call_waits_for_the_task(transport: str, tmp_path: Path) -> None:
    """A tool with a task policy: the legacy request waits for the durable task's result."""
    seen: list[tuple[float, float | None, str | None]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append((progress, total, message))

    with trio.fail_after(60):
        async with connect(transport, tmp_path) as client:
            result = await client.call_tool("report", {"parts": 2}, progress_callback=on_progress)
    assert result.is_error is False
    assert result.content == [types.TextContent(type="text", text="report of 2 parts, in a task")]
    assert seen == [(1, 2, "part 1"), (2, 2, "part 2")]


async def abandon_after_progress(client: Client, tool: str) -> None:
    """Call ``tool``, and cancel the call once its first progress notification arrives."""
    started = trio.Event()

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        started.set()

    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                functools.partial(client.call_tool, tool, {}, progress_callback=on_progress)
            )
            await started.wait()
            scope.cancel()
    assert scope.cancelled_caught


async def count_until_one(client: Client, tool: str) -> None:
    """Poll the counting tool through the same session until the server has counted one."""
    while True:
        count = await client.call_tool(tool, {})
        if text(count) == "1":
            return
        assert text(count) == "0"
        await trio.sleep(0.01)


@pytest.mark.parametrize(
    ("tool", "counter"), [("wait", "cancelled_waits"), ("hold", "cancelled_holds")]
)
async def test_abandoned_call_is_cancelled_on_the_server(
    transport: str, tmp_path: Path, tool: str, counter: str
) -> None:
    """The client's ``notifications/cancelled`` cancels the tool, and the task of a task tool."""
    with trio.fail_after(60):
        async with connect(transport, tmp_path) as client:
            await abandon_after_progress(client, tool)
            await count_until_one(client, counter)
            # the session outlives the cancelled call
            added = await client.call_tool("add", {"a": 2, "b": 2})
    assert added.structured_content == {"sum": 4}
