"""The initialize era (2025-06-18, 2025-11-25) on stdio and WebSocket: a session per connection.

Driven byte-exactly over memory streams, like ``test_stdio``: the lifecycle and version
negotiation, legacy result shapes, ``logging/setLevel``, subscriptions with their updates on the
connection, MRTR answered through server-initiated requests, progress, cancellation, and the
modern era still served statelessly on the same connection.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
from test_stdio import Peer, cancel, request, stdio_server
from test_websocket import client, receive, ws_server

from tritask.jsonrpc import dumps
from tritask.server.app import App
from tritask.server.context import Context
from tritask.server.legacy import MAX_INPUT_ROUNDS
from tritask.server.mrtr import InputRequired, elicitation, sampling

INFO = {"name": "legacy-test", "version": "2.0.0"}
NAME_FORM = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def build_app(events: list[str], started: trio.Event | None = None) -> App:
    app = App("legacy-test", "2.0.0", instructions="Try the tools.")

    @app.tool()
    async def echo(text: str) -> str:
        """Echo the text."""
        return text

    @app.tool()
    async def steps(ctx: Context) -> str:
        """Progress 1 and 2 of 2, and two log lines."""
        await ctx.progress(1, 2)
        await ctx.log("debug", "step one")
        await ctx.progress(2, 2)
        await ctx.log("warning", "step two")
        return "done"

    @app.tool()
    async def ask_name(ctx: Context) -> str | InputRequired:
        """Ask the user's name (MRTR), remembering a state across the round."""
        answer = ctx.input_response("who")
        if answer is None or ctx.request_state != {"round": 1}:
            return ctx.input_required({"who": elicitation("Your name?", NAME_FORM)}, {"round": 1})
        content = answer.get("content") or {}
        return f"{answer.get('action')}: {content.get('name')}"

    @app.tool()
    async def ask_model(ctx: Context) -> str | InputRequired:
        """Ask the client's model (needs the sampling capability)."""
        answer = ctx.input_response("q")
        if answer is None:
            question = {"role": "user", "content": {"type": "text", "text": "2+2?"}}
            return ctx.input_required({"q": sampling([question], 10)})
        return f"model said {answer['content']['text']}"

    @app.tool()
    async def block(ctx: Context) -> str:
        """Sleep until cancelled."""
        events.append("block started")
        if started is not None:
            started.set()
        try:
            await trio.sleep_forever()
        finally:
            events.append("block cancelled")

    @app.tool()
    async def touch(ctx: Context) -> str:
        """Signal a resource update and a tool list change."""
        ctx.app.notify_resource_updated("test://watched")
        ctx.app.notify_resource_updated("test://other")
        ctx.app.notify_tools_changed()
        return "touched"

    @app.resource("test://watched", mime_type="text/plain")
    async def watched() -> str:
        """A watched resource."""
        return "watched text"

    @app.prompt()
    async def greeting(name: str) -> str:
        """A greeting prompt."""
        return f"Hello {name}"

    @app.prompt()
    async def ask_topic(ctx: Context) -> str | InputRequired:
        """A prompt that asks which topic (MRTR)."""
        answer = ctx.input_response("topic")
        if answer is None:
            return ctx.input_required({"topic": elicitation("Topic?", NAME_FORM)})
        return f"About {(answer.get('content') or {}).get('name')}"

    @app.prompt()
    async def ask_forever(ctx: Context) -> InputRequired:
        """A prompt that never has enough input (MRTR without end)."""
        return ctx.input_required({"topic": elicitation("Topic?", NAME_FORM)})

    return app


def legacy(request_id: int | str, method: str, **params: Any) -> dict[str, Any]:
    message: dict[str, Any] = {"jsonrpc": "2.0", "id": request_id, "method": method}
    if params:
        message["params"] = params
    return message


def initialize(version: str = "2025-11-25", **capabilities: Any) -> dict[str, Any]:
    return legacy(
        0,
        "initialize",
        protocolVersion=version,
        capabilities=capabilities,
        clientInfo={"name": "t", "version": "1"},
    )


async def initialized_peer(peer: Peer, version: str = "2025-11-25", **caps: Any) -> dict[str, Any]:
    await peer.send(initialize(version, **caps))
    answer = await peer.receive()
    await peer.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
    return answer


@pytest.mark.parametrize(
    ("requested", "negotiated"),
    [
        ("2025-11-25", "2025-11-25"),
        ("2025-06-18", "2025-06-18"),
        ("2026-07-28", "2025-11-25"),
        ("2024-11-05", "2025-11-25"),
    ],
)
async def test_initialize_negotiates_and_derives_capabilities(
    requested: str, negotiated: str
) -> None:
    async with stdio_server(build_app([])) as (peer, _, _):
        answer = await initialized_peer(peer, requested)
        assert answer == {
            "jsonrpc": "2.0",
            "id": 0,
            "result": {
                "protocolVersion": negotiated,
                "capabilities": {
                    "logging": {},
                    "prompts": {"listChanged": True},
                    "resources": {"subscribe": True, "listChanged": True},
                    "tools": {"listChanged": True},
                },
                "serverInfo": INFO,
                "instructions": "Try the tools.",
            },
        }


async def test_legacy_results_have_no_modern_fields_and_ping_is_empty() -> None:
    async with stdio_server(build_app([])) as (peer, _, _):
        await peer.send(legacy("p0", "ping"))  # allowed before initialize
        assert await peer.receive() == {"jsonrpc": "2.0", "id": "p0", "result": {}}
        await initialized_peer(peer)
        await peer.send(legacy(1, "tools/call", name="echo", arguments={"text": "hi"}))
        assert await peer.receive() == {
            "jsonrpc": "2.0",
            "id": 1,
            "result": {"content": [{"type": "text", "text": "hi"}], "isError": False},
        }
        await peer.send(legacy(2, "ping", _meta={"progressToken": 1}))
        assert await peer.receive() == {"jsonrpc": "2.0", "id": 2, "result": {}}
        await peer.send(legacy(3, "resources/read", uri="test://missing"))
        assert await peer.receive() == {
            "jsonrpc": "2.0",
            "id": 3,
            "error": {
                "code": -32002,
                "message": "Resource not found",
                "data": {"uri": "test://missing"},
            },
        }
        await peer.send(legacy(4, "prompts/get", name="greeting", arguments={"name": "Ada"}))
        answer = await peer.receive()
        assert answer["result"] == {
            "description": "A greeting prompt.",
            "messages": [{"role": "user", "content": {"type": "text", "text": "Hello Ada"}}],
        }
        for index, method in enumerate(("server/discover", "subscriptions/listen", "nope/x")):
            await peer.send(legacy(10 + index, method))
            assert (await peer.receive())["error"] == {
                "code": -32601,
                "message": f"Method not found: {method}",
            }
        await peer.send(legacy(20, "initialize", protocolVersion="2025-11-25", capabilities={}))
        assert (await peer.receive())["error"] == {
            "code": -32600,
            "message": "This session is already initialized",
        }


async def test_tools_list_is_legacy_shaped() -> None:
    async with stdio_server(build_app([])) as (peer, _, _):
        await initialized_peer(peer)
        await peer.send(legacy(1, "tools/list"))
        result = (await peer.receive())["result"]
        assert set(result) == {"tools"}
        assert result["tools"][0] == {
            "name": "echo",
            "description": "Echo the text.",
            "inputSchema": {
                "type": "object",
                "properties": {"text": {"type": "string"}},
                "required": ["text"],
                "additionalProperties": False,
            },
        }


async def test_modern_requests_stay_stateless_beside_a_legacy_session() -> None:
    async with stdio_server(build_app([])) as (peer, _, _):
        await initialized_peer(peer)
        await peer.send(request(1, "tools/call", name="echo", arguments={"text": "x"}))
        answer = await peer.receive()
        assert answer["result"]["resultType"] == "complete"
        await peer.send(request(2, "initialize"))
        assert (await peer.receive())["error"]["code"] == -32601


async def test_progress_and_logging_follow_the_session_level() -> None:
    async with stdio_server(build_app([])) as (peer, _, _):
        await initialized_peer(peer)
        await peer.send(legacy(1, "logging/setLevel", level="bogus"))
        assert (await peer.receive())["error"]["code"] == -32602
        await peer.send(legacy(2, "logging/setLevel", level="info"))
        assert await peer.receive() == {"jsonrpc": "2.0", "id": 2, "result": {}}
        await peer.send(legacy(3, "tools/call", name="steps", _meta={"progressToken": "t"}))
        received = [await peer.receive() for _ in range(4)]
        assert received == [
            {
                "jsonrpc": "2.0",
                "method": "notifications/progress",
                "params": {"progressToken": "t", "progress": 1, "total": 2},
            },
            {
                "jsonrpc": "2.0",
                "method": "notifications/progress",
                "params": {"progressToken": "t", "progress": 2, "total": 2},
            },
            {
                "jsonrpc": "2.0",
                "method": "notifications/message",
                "params": {"level": "warning", "data": "step two"},
            },
            {
                "jsonrpc": "2.0",
                "id": 3,
                "result": {"content": [{"type": "text", "text": "done"}], "isError": False},
            },
        ]


async def test_mrtr_input_becomes_a_server_request_answered_by_the_client() -> None:
    async with stdio_server(build_app([])) as (peer, _, _):
        await initialized_peer(peer, "2025-11-25", elicitation={})
        await peer.send(legacy(7, "tools/call", name="ask_name", arguments={}))
        server_request = await peer.receive()
        assert server_request == {
            "jsonrpc": "2.0",
            "id": 0,
            "method": "elicitation/create",
            "params": {"mode": "form", "message": "Your name?", "requestedSchema": NAME_FORM},
        }
        await peer.send(
            {"jsonrpc": "2.0", "id": 0, "result": {"action": "accept", "content": {"name": "Ada"}}}
        )
        assert await peer.receive() == {
            "jsonrpc": "2.0",
            "id": 7,
            "result": {"content": [{"type": "text", "text": "accept: Ada"}], "isError": False},
        }


async def test_elicitation_drops_mode_for_2025_06_18() -> None:
    async with stdio_server(build_app([])) as (peer, _, _):
        await initialized_peer(peer, "2025-06-18", elicitation={})
        await peer.send(legacy(1, "tools/call", name="ask_name", arguments={}))
        server_request = await peer.receive()
        assert server_request["params"] == {"message": "Your name?", "requestedSchema": NAME_FORM}


async def test_an_undeclared_capability_is_a_tool_error_and_a_client_error_too() -> None:
    async with stdio_server(build_app([])) as (peer, _, _):
        await initialized_peer(peer, "2025-11-25", elicitation={})
        await peer.send(legacy(1, "tools/call", name="ask_model", arguments={}))
        answer = await peer.receive()
        assert answer == {
            "jsonrpc": "2.0",
            "id": 1,
            "result": {
                "content": [{"type": "text", "text": "Missing required client capability"}],
                "isError": True,
            },
        }
        await peer.send(legacy(2, "tools/call", name="ask_name", arguments={}))
        server_request = await peer.receive()
        await peer.send(
            {"jsonrpc": "2.0", "id": server_request["id"], "error": {"code": -1, "message": "no"}}
        )
        answer = await peer.receive()
        assert answer["result"] == {
            "content": [{"type": "text", "text": "The client answered with error -1: no"}],
            "isError": True,
        }


async def test_a_client_error_answering_a_prompts_input_is_not_an_internal_error() -> None:
    """Issue 18 (legacy fuzzer): the client's refusal was answered -32603 Internal error."""
    async with stdio_server(build_app([])) as (peer, _, _):
        await initialized_peer(peer, "2025-11-25", elicitation={})
        await peer.send(legacy(3, "prompts/get", name="ask_topic"))
        server_request = await peer.receive()
        assert server_request["method"] == "elicitation/create"
        await peer.send(
            {"jsonrpc": "2.0", "id": server_request["id"], "error": {"code": -1, "message": "no"}}
        )
        assert await peer.receive() == {
            "jsonrpc": "2.0",
            "id": 3,
            "error": {
                "code": -32600,
                "message": "The client answered with error -1: no",
                "data": {"clientError": {"code": -1, "message": "no"}},
            },
        }
        await peer.send(legacy(4, "ping"))
        assert await peer.receive() == {"jsonrpc": "2.0", "id": 4, "result": {}}


async def test_a_prompt_that_never_stops_asking_is_an_invalid_request() -> None:
    """After MAX_INPUT_ROUNDS answered rounds the request is refused -32600, not -32603."""
    async with stdio_server(build_app([])) as (peer, _, _):
        await initialized_peer(peer, "2025-11-25", elicitation={})
        await peer.send(legacy(3, "prompts/get", name="ask_forever"))
        asked = 0
        while True:
            message = await peer.receive()
            if message.get("id") == 3 and "method" not in message:
                break
            assert message["method"] == "elicitation/create"
            asked += 1
            answer = {"action": "accept", "content": {"name": "again"}}
            await peer.send({"jsonrpc": "2.0", "id": message["id"], "result": answer})
        assert asked == MAX_INPUT_ROUNDS + 1
        assert message == {
            "jsonrpc": "2.0",
            "id": 3,
            "error": {
                "code": -32600,
                "message": f"The request still needed input after {MAX_INPUT_ROUNDS} rounds; "
                "giving up",
            },
        }


async def test_cancelled_notification_cancels_the_tool_and_silences_its_id() -> None:
    events: list[str] = []
    started = trio.Event()
    async with stdio_server(build_app(events, started)) as (peer, _, _):
        await initialized_peer(peer)
        await peer.send(legacy(5, "tools/call", name="block", arguments={}))
        await started.wait()
        await peer.send(cancel(5))
        await peer.send(legacy(6, "ping"))
        assert await peer.receive() == {"jsonrpc": "2.0", "id": 6, "result": {}}
        assert events == ["block started", "block cancelled"]


async def test_subscribed_updates_and_list_changes_reach_the_connection() -> None:
    async with stdio_server(build_app([])) as (peer, _, _):
        await initialized_peer(peer)
        await peer.send(legacy(1, "resources/subscribe", uri="test://watched"))
        assert await peer.receive() == {"jsonrpc": "2.0", "id": 1, "result": {}}
        await peer.send(legacy(2, "tools/call", name="touch", arguments={}))
        received = [await peer.receive() for _ in range(3)]
        expected = [
            {
                "jsonrpc": "2.0",
                "method": "notifications/resources/updated",
                "params": {"uri": "test://watched"},
            },
            {"jsonrpc": "2.0", "method": "notifications/tools/list_changed", "params": {}},
            {
                "jsonrpc": "2.0",
                "id": 2,
                "result": {"content": [{"type": "text", "text": "touched"}], "isError": False},
            },
        ]
        assert sorted(received, key=dumps) == sorted(expected, key=dumps)
        await peer.send(legacy(3, "resources/unsubscribe", uri="test://watched"))
        assert await peer.receive() == {"jsonrpc": "2.0", "id": 3, "result": {}}


async def test_websocket_connections_each_have_their_own_legacy_session() -> None:
    """The same engine frames WebSocket: each connection is one session, isolated."""
    async with ws_server(build_app([])) as url, client(url) as first, client(url) as second:
        await first.send_message(dumps(initialize("2025-06-18", elicitation={})))
        assert (await receive(first))["result"]["protocolVersion"] == "2025-06-18"
        await first.send_message(dumps(legacy(1, "logging/setLevel", level="error")))
        assert await receive(first) == {"jsonrpc": "2.0", "id": 1, "result": {}}
        # The second connection has no session: legacy requests there get no session state.
        await second.send_message(dumps(legacy(1, "tools/call", name="steps")))
        assert (await receive(second))["error"]["code"] == -32602
        await second.send_message(dumps(initialize("2025-11-25")))
        assert (await receive(second))["result"]["protocolVersion"] == "2025-11-25"
        await second.send_message(dumps(legacy(2, "tools/call", name="steps")))
        logs = [await receive(second) for _ in range(3)]
        assert [message.get("params", {}).get("data") for message in logs[:2]] == [
            "step one",
            "step two",
        ]
        # The first session's level (error) hides both lines; only the result comes.
        await first.send_message(dumps(legacy(2, "tools/call", name="steps")))
        assert (await receive(first))["id"] == 2
        # A server request of one session cannot be answered from the other.
        await first.send_message(dumps(legacy(3, "tools/call", name="ask_name", arguments={})))
        asked = await receive(first)
        assert asked["method"] == "elicitation/create"
        await second.send_message(
            dumps({"jsonrpc": "2.0", "id": asked["id"], "result": {"action": "decline"}})
        )
        await second.send_message(dumps(legacy(4, "ping")))
        assert await receive(second) == {"jsonrpc": "2.0", "id": 4, "result": {}}
        await first.send_message(
            dumps({"jsonrpc": "2.0", "id": asked["id"], "result": {"action": "cancel"}})
        )
        assert (await receive(first))["result"]["content"][0]["text"] == "cancel: None"
