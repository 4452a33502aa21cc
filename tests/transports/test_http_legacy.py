"""Initialize-era sessions (2025-06-18, 2025-11-25) over Streamable HTTP, on real sockets.

The session rules (``Mcp-Session-Id`` issued at initialize, required after, 404 once unknown,
DELETE, the version header), era detection beside 2026-07-28 on the same endpoint, SSE with
event ids, priming and ``retry``, resumption with ``Last-Event-ID``, server-closed streams,
disconnection that is not cancellation, server-initiated requests answered by POST, the
standalone GET stream, the limits (sessions, idle expiry, requests in flight), the principal a
session is bound to, and that one session cannot reach another's state.
"""

from __future__ import annotations

import functools
import json
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

import attrs
import httpx
import pytest
import trio
from test_http import Raw, header

from tritask.cli import build_parser
from tritask.protocol.meta import CLIENT_CAPABILITIES_KEY, PROTOCOL_VERSION_KEY
from tritask.server import App, Context
from tritask.server.mrtr import InputRequired, elicitation
from tritask.transports.http import HttpOptions, HttpTransport, Unauthenticated, serve_http

V1125 = "2025-11-25"
V0618 = "2025-06-18"
NAME_FORM = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
SESSION_ID = re.compile(r"^[\x21-\x7e]+$")
EVENT_ID = re.compile(r"^(\d+)-(\d+)$")


# -- the app and the server ------------------------------------------------------------------------


class Probe:
    """What the tools tell the test, and what the test lets them do."""

    def __init__(self) -> None:
        self.started = trio.Event()
        self.release = trio.Event()
        self.cancelled = trio.Event()
        self.finished = trio.Event()


@pytest.fixture
def probe() -> Probe:
    return Probe()


@pytest.fixture
def app(make_app: Callable[..., App], probe: Probe) -> App:
    app = make_app(instructions="Legacy HTTP test server.")

    @app.tool()
    async def echo(text: str) -> str:
        """Echo."""
        return text

    @app.tool()
    async def steps(ctx: Context) -> str:
        """Progress 1 and 2 of 2 and a log line at each level."""
        await ctx.progress(1, 2)
        await ctx.log("debug", "debug line")
        await ctx.progress(2, 2)
        await ctx.log("error", "error line")
        return "done"

    @app.tool()
    async def ask_name(ctx: Context) -> str | InputRequired:
        """Ask the user's name (MRTR, bridged to elicitation/create in a legacy session)."""
        answer = ctx.input_response("who")
        if answer is None:
            return ctx.input_required({"who": elicitation("Your name?", NAME_FORM)})
        return f"{answer.get('action')}: {(answer.get('content') or {}).get('name')}"

    @app.tool()
    async def wait(ctx: Context) -> str:
        """Wait until the test releases it, recording cancellation."""
        probe.started.set()
        try:
            await probe.release.wait()
        except trio.Cancelled:
            probe.cancelled.set()
            raise
        finally:
            probe.finished.set()
        return "released"

    @app.tool()
    async def poll_me(ctx: Context) -> str:
        """Close the stream, then finish once released (SSE polling)."""
        await ctx.log("info", "before close")
        probe.started.set()
        closed = ctx.close_stream()
        await probe.release.wait()
        await ctx.log("info", "after close")
        probe.finished.set()
        return f"polled (closed={closed})"

    @app.tool()
    async def touch(ctx: Context, uri: str) -> str:
        """Announce an update of ``uri`` and a tool list change."""
        ctx.app.notify_resource_updated(uri)
        ctx.app.notify_tools_changed()
        return "touched"

    @app.resource("test://watched", mime_type="text/plain")
    async def watched() -> str:
        """A watched resource."""
        return "watched"

    return app


@attrs.frozen
class Event:
    id: str | None
    data: str | None
    retry: int | None
    event: str | None

    @property
    def message(self) -> Any:
        return json.loads(self.data) if self.data and self.data.strip() else None


def parse_block(lines: list[str]) -> Event | None:
    """One SSE event from its lines; ``None`` for a comment (keep-alive) block."""
    fields: dict[str, list[str]] = {}
    for line in lines:
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        fields.setdefault(name, []).append(value[1:] if value.startswith(" ") else value)
    if not fields:
        return None
    retry = fields.get("retry")
    return Event(
        id=fields["id"][-1] if "id" in fields else None,
        data="\n".join(fields["data"]) if "data" in fields else None,
        retry=int(retry[-1]) if retry else None,
        event=fields["event"][-1] if "event" in fields else None,
    )


def parse_events(text: str) -> list[Event]:
    events = []
    for block in text.split("\n\n"):
        if block.strip():
            event = parse_block(block.split("\n"))
            if event is not None:
                events.append(event)
    return events


async def iter_events(response: httpx.Response) -> AsyncIterator[Event]:
    lines: list[str] = []
    async for line in response.aiter_lines():
        if line:
            lines.append(line)
            continue
        event = parse_block(lines)
        lines = []
        if event is not None:
            yield event


def messages(events: list[Event]) -> list[Any]:
    return [event.message for event in events if event.message is not None]


class Server:
    def __init__(self, base: str, client: httpx.AsyncClient, app: App) -> None:
        self.url = base + "/mcp"
        self.client = client
        self.app = app
        parts = httpx.URL(base)
        self.host, self.port = parts.host, parts.port or 0

    async def request(
        self, method: str, headers: dict[str, str], content: bytes | None = None
    ) -> httpx.Response:
        return await self.client.request(method, self.url, headers=headers, content=content)


StartServer = Callable[..., Awaitable[Server]]


@pytest.fixture
async def start(http_server: Callable[..., Awaitable[str]], app: App) -> AsyncIterator[StartServer]:
    async with httpx.AsyncClient(timeout=10) as client:

        async def run(options: HttpOptions | None = None) -> Server:
            return Server(await http_server(app, options), client, app)

        yield run


@pytest.fixture
async def server(start: StartServer) -> Server:
    return await start(HttpOptions(sse_retry_ms=50))


def rpc(request_id: int | str | None, method: str, **params: Any) -> dict[str, Any]:
    message: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
    if request_id is not None:
        message["id"] = request_id
    if params:
        message["params"] = params
    return message


class Client:
    """A legacy client of one session: the headers it must send, and small helpers."""

    def __init__(self, server: Server, version: str = V1125, **extra_headers: str) -> None:
        self.server = server
        self.version = version
        self.session_id: str | None = None
        self.extra = extra_headers
        self.init_result: dict[str, Any] = {}

    def headers(self, **overrides: str | None) -> dict[str, str]:
        headers: dict[str, str | None] = {
            "content-type": "application/json",
            "accept": "application/json, text/event-stream",
            **self.extra,
        }
        if self.session_id is not None:
            headers["mcp-session-id"] = self.session_id
            headers["mcp-protocol-version"] = self.version
        headers.update(overrides)
        return {key: value for key, value in headers.items() if value is not None}

    async def post(self, message: Any, **overrides: str | None) -> httpx.Response:
        return await self.server.request(
            "POST", self.headers(**overrides), json.dumps(message).encode()
        )

    async def initialize(self, **capabilities: Any) -> httpx.Response:
        response = await self.post(
            rpc(
                0,
                "initialize",
                protocolVersion=self.version,
                capabilities=capabilities,
                clientInfo={"name": "legacy-http-test", "version": "1.0"},
            )
        )
        assert response.status_code == 200, response.text
        self.session_id = response.headers["mcp-session-id"]
        self.init_result = response.json()["result"]
        initialized = await self.post(rpc(None, "notifications/initialized"))
        assert initialized.status_code == 202, initialized.text
        return response

    async def call(self, request_id: int | str, tool: str, **params: Any) -> list[Event]:
        response = await self.post(rpc(request_id, "tools/call", name=tool, **params))
        assert response.status_code == 200, response.text
        assert response.headers["content-type"] == "text/event-stream"
        return parse_events(response.text)

    def stream(self, message: Any, **overrides: str | None) -> Any:
        return self.server.client.stream(
            "POST",
            self.server.url,
            headers=self.headers(**overrides),
            content=json.dumps(message).encode(),
        )

    def get(self, **overrides: str | None) -> Any:
        headers = self.headers(accept="text/event-stream", **overrides)
        del headers["content-type"]
        return self.server.client.stream("GET", self.server.url, headers=headers)

    async def delete(self) -> httpx.Response:
        headers = self.headers()
        del headers["content-type"]
        return await self.server.request("DELETE", headers)


async def connected(server: Server, version: str = V1125, **capabilities: Any) -> Client:
    client = Client(server, version)
    await client.initialize(**capabilities)
    return client


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    payload: dict[str, Any] = response.json()
    assert payload["jsonrpc"] == "2.0"
    error: dict[str, Any] = payload["error"]
    return error


# -- initialize and the session id -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("requested", "negotiated"),
    [(V1125, V1125), (V0618, V0618), ("2026-07-28", V1125), ("1999-01-01", V1125)],
)
async def test_initialize_opens_a_session(server: Server, requested: str, negotiated: str) -> None:
    client = Client(server, requested)
    response = await client.post(
        rpc(0, "initialize", protocolVersion=requested, capabilities={}, clientInfo={"name": "c"})
    )
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    session_id = response.headers["mcp-session-id"]
    assert SESSION_ID.match(session_id) and len(session_id) == 32
    assert response.json() == {
        "jsonrpc": "2.0",
        "id": 0,
        "result": {
            "protocolVersion": negotiated,
            "capabilities": {
                "logging": {},
                "resources": {"subscribe": True, "listChanged": True},
                "tools": {"listChanged": True},
            },
            "serverInfo": {"name": "test-app", "version": "0.0.1"},
            "instructions": "Legacy HTTP test server.",
        },
    }


async def test_session_ids_are_distinct_and_the_version_header_is_accepted(server: Server) -> None:
    ids = set()
    for _ in range(5):
        client = Client(server, V0618, **{"mcp-protocol-version": V0618})
        await client.initialize()
        assert client.init_result["protocolVersion"] == V0618
        ids.add(client.session_id)
    assert len(ids) == 5


async def test_the_session_header_is_required_after_initialize(server: Server) -> None:
    client = await connected(server)
    missing = await client.post(rpc(1, "tools/list"), **{"mcp-session-id": None})
    error = error_of(missing, 400)
    assert error["message"] == (
        "Bad Request: the Mcp-Session-Id header is required (send initialize first)"
    )
    assert missing.json()["id"] == 1
    notification = await client.post(
        rpc(None, "notifications/initialized"), **{"mcp-session-id": None}
    )
    error_of(notification, 400)
    unknown = await client.post(rpc(2, "tools/list"), **{"mcp-session-id": "no-such-session"})
    assert error_of(unknown, 404) == {
        "code": -32600,
        "message": "Session not found: it ended, expired or was never opened here; "
        "send initialize again",
    }
    listed = await client.post(rpc(3, "tools/list"))
    assert listed.status_code == 200
    assert listed.headers["content-type"] == "application/json"
    assert listed.headers["mcp-session-id"] == client.session_id
    assert [tool["name"] for tool in listed.json()["result"]["tools"]][:2] == ["echo", "steps"]
    assert "resultType" not in listed.json()["result"]


async def test_delete_ends_the_session(server: Server) -> None:
    client = await connected(server)
    deleted = await client.delete()
    assert deleted.status_code == 200
    error_of(await client.post(rpc(1, "ping")), 404)
    error_of(await client.delete(), 404)
    async with client.get() as stream:
        assert stream.status_code == 404


async def test_the_version_header_after_initialize(server: Server) -> None:
    client = await connected(server, V0618)
    absent = await client.post(rpc(1, "ping"), **{"mcp-protocol-version": None})
    assert absent.json() == {"jsonrpc": "2.0", "id": 1, "result": {}}
    other_legacy = await client.post(rpc(2, "ping"), **{"mcp-protocol-version": V1125})
    assert other_legacy.json() == {"jsonrpc": "2.0", "id": 2, "result": {}}
    unsupported = await client.post(rpc(3, "ping"), **{"mcp-protocol-version": "2025-03-26"})
    assert unsupported.status_code == 400
    async with client.get(**{"mcp-protocol-version": "2025-03-26"}) as stream:
        assert stream.status_code == 400


async def test_ping_and_set_level_answer_exactly_empty(server: Server) -> None:
    client = await connected(server)
    for request_id, message in ((1, rpc(1, "ping")), (2, rpc(2, "logging/setLevel", level="info"))):
        response = await client.post(message)
        assert response.json() == {"jsonrpc": "2.0", "id": request_id, "result": {}}
    bad = await client.post(rpc(3, "logging/setLevel", level="loud"))
    assert bad.status_code == 200
    assert bad.json()["error"]["code"] == -32602


async def test_a_repeated_initialize_in_a_session_is_refused(server: Server) -> None:
    client = await connected(server)
    again = await client.post(rpc(9, "initialize", protocolVersion=V1125, capabilities={}))
    assert again.json()["error"] == {
        "code": -32600,
        "message": "This session is already initialized",
    }


async def test_bad_initialize_and_bad_bodies(server: Server) -> None:
    client = Client(server)
    no_version = await client.post(rpc(0, "initialize", capabilities={}))
    assert error_of(no_version, 400)["code"] == -32602
    assert "mcp-session-id" not in no_version.headers
    batch = await client.post([rpc(0, "initialize", protocolVersion=V1125)])
    error_of(batch, 400)
    response_without_session = await client.post({"jsonrpc": "2.0", "id": 0, "result": {}})
    error_of(response_without_session, 400)
    await connected(server)  # still serving


# -- the modern era on the same endpoint -----------------------------------------------------------


def modern(method: str, request_id: int = 1, **params: Any) -> dict[str, Any]:
    meta = {PROTOCOL_VERSION_KEY: "2026-07-28", CLIENT_CAPABILITIES_KEY: {}}
    return {
        "jsonrpc": "2.0",
        "id": request_id,
        "method": method,
        "params": {**params, "_meta": meta},
    }


@pytest.mark.parametrize(
    "method", ["initialize", "ping", "logging/setLevel", "resources/subscribe"]
)
async def test_enveloped_legacy_methods_stay_404_even_with_a_session(
    server: Server, method: str
) -> None:
    client = await connected(server)
    for session in (None, client.session_id):
        response = await client.post(
            modern(method),
            **{
                "mcp-session-id": session,
                "mcp-protocol-version": "2026-07-28",
                "mcp-method": method,
            },
        )
        assert error_of(response, 404)["code"] == -32601
        assert "mcp-session-id" not in response.headers


async def test_modern_requests_ignore_a_session_and_get_and_delete_without_one_are_405(
    server: Server,
) -> None:
    client = await connected(server)
    response = await client.post(
        modern("tools/call", name="echo", arguments={"text": "hi"}),
        **{"mcp-protocol-version": "2026-07-28", "mcp-method": "tools/call", "mcp-name": "echo"},
    )
    assert response.status_code == 200
    assert response.json()["result"]["resultType"] == "complete"
    assert "mcp-session-id" not in response.headers
    for method in ("GET", "DELETE"):
        plain = await server.request(method, {"accept": "text/event-stream"})
        assert plain.status_code == 405
        assert plain.headers["allow"] == "POST"


async def test_foreign_origin_is_refused_before_a_session_exists(start: StartServer) -> None:
    server = await start(HttpOptions(max_sessions=1))
    init = rpc(0, "initialize", protocolVersion=V1125, capabilities={})
    for foreign in ({"origin": "http://evil.example.com"}, {"host": "evil.example.com"}):
        response = await Client(server, **foreign).post(init)
        assert response.status_code == 403
        assert "mcp-session-id" not in response.headers
    # Had a refused request opened a session, the table (room for one) would be full now.
    await connected(server)
    assert (await Client(server).post(init)).status_code == 503


# -- SSE: event ids, priming, retry ----------------------------------------------------------------


async def test_tools_call_streams_with_priming_ids_and_headers(server: Server) -> None:
    client = await connected(server)
    response = await client.post(
        rpc(1, "tools/call", name="steps", arguments={}, _meta={"progressToken": "p1"})
    )
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream"
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-accel-buffering"] == "no"
    assert response.headers["mcp-session-id"] == client.session_id
    events = parse_events(response.text)
    priming = events[0]
    assert (priming.data, priming.retry, priming.event) == ("", 50, None)
    assert all(event.event == "message" for event in events[1:])
    assert messages(events) == [
        {
            "jsonrpc": "2.0",
            "method": "notifications/progress",
            "params": {"progressToken": "p1", "progress": 1, "total": 2},
        },
        {
            "jsonrpc": "2.0",
            "method": "notifications/message",
            "params": {"level": "debug", "data": "debug line"},
        },
        {
            "jsonrpc": "2.0",
            "method": "notifications/progress",
            "params": {"progressToken": "p1", "progress": 2, "total": 2},
        },
        {
            "jsonrpc": "2.0",
            "method": "notifications/message",
            "params": {"level": "error", "data": "error line"},
        },
        {
            "jsonrpc": "2.0",
            "id": 1,
            "result": {"content": [{"type": "text", "text": "done"}], "isError": False},
        },
    ]
    ids = [EVENT_ID.match(event.id or "") for event in events]
    assert all(ids)
    streams = {match.group(1) for match in ids if match}
    numbers = [int(match.group(2)) for match in ids if match]
    assert len(streams) == 1 and streams != {"0"}
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)


async def test_event_ids_are_unique_across_a_sessions_streams(server: Server) -> None:
    client = await connected(server)
    first = await client.call(1, "echo", arguments={"text": "a"})
    second = await client.call(2, "echo", arguments={"text": "b"})
    first_ids = [event.id for event in first]
    second_ids = [event.id for event in second]
    assert not set(first_ids) & set(second_ids)
    stream_of = {event_id.split("-")[0] for event_id in first_ids if event_id}
    assert len(stream_of) == 1
    assert stream_of != {event_id.split("-")[0] for event_id in second_ids if event_id}


async def test_a_2025_06_18_stream_has_no_priming_and_no_retry(server: Server) -> None:
    client = await connected(server, V0618)
    events = await client.call(1, "echo", arguments={"text": "x"})
    assert [event.retry for event in events] == [None]
    assert [event.message["result"]["content"][0]["text"] for event in events] == ["x"]
    assert EVENT_ID.match(events[0].id or "")
    with trio.fail_after(10):
        async with client.get() as stream:
            standalone = iter_events(stream)
            await client.call(2, "touch", arguments={"uri": "test://x"})
            first = await standalone.__anext__()
    assert first.retry is None
    assert first.message == {
        "jsonrpc": "2.0",
        "method": "notifications/tools/list_changed",
        "params": {},
    }
    assert (first.id or "").startswith("0-")


async def test_the_session_log_level_filters_notifications(server: Server) -> None:
    client = await connected(server)
    await client.post(rpc(1, "logging/setLevel", level="warning"))
    events = await client.call(2, "steps", arguments={})
    logs = [
        m["params"]["data"] for m in messages(events) if m.get("method") == "notifications/message"
    ]
    assert logs == ["error line"]


# -- server-initiated requests answered by POST ----------------------------------------------------


async def test_an_elicitation_is_asked_on_the_call_stream_and_answered_by_post(
    server: Server,
) -> None:
    client = await connected(server, elicitation={})
    with trio.fail_after(10):
        async with client.stream(rpc(1, "tools/call", name="ask_name", arguments={})) as response:
            events = iter_events(response)
            priming = await events.__anext__()
            assert priming.data == ""
            asked = (await events.__anext__()).message
            assert asked == {
                "jsonrpc": "2.0",
                "id": 0,
                "method": "elicitation/create",
                "params": {"mode": "form", "message": "Your name?", "requestedSchema": NAME_FORM},
            }
            answer = {
                "jsonrpc": "2.0",
                "id": 0,
                "result": {"action": "accept", "content": {"name": "Ada"}},
            }
            accepted = await client.post(answer)
            assert accepted.status_code == 202
            assert accepted.content == b""
            final = (await events.__anext__()).message
            assert final["result"]["content"] == [{"type": "text", "text": "accept: Ada"}]
            with pytest.raises(StopAsyncIteration):
                await events.__anext__()


async def test_a_2025_06_18_elicitation_has_no_mode(server: Server) -> None:
    client = await connected(server, V0618, elicitation={})
    with trio.fail_after(10):
        async with client.stream(rpc(1, "tools/call", name="ask_name", arguments={})) as response:
            events = iter_events(response)
            asked = (await events.__anext__()).message
            assert asked["params"] == {"message": "Your name?", "requestedSchema": NAME_FORM}
            await client.post({"jsonrpc": "2.0", "id": 0, "result": {"action": "decline"}})
            final = (await events.__anext__()).message
            assert final["result"]["content"][0]["text"] == "decline: None"


async def test_without_the_capability_the_tool_reports_an_error(server: Server) -> None:
    client = await connected(server)
    events = await client.call(1, "ask_name", arguments={})
    result = events[-1].message["result"]
    assert result["isError"] is True


# -- cancellation and disconnection ----------------------------------------------------------------


async def test_notifications_cancelled_stops_the_request(server: Server, probe: Probe) -> None:
    client = await connected(server)
    with trio.fail_after(10):
        async with client.stream(rpc(7, "tools/call", name="wait", arguments={})) as response:
            events = iter_events(response)
            await events.__anext__()  # priming
            await probe.started.wait()
            cancel = rpc(None, "notifications/cancelled", requestId=7, reason="changed my mind")
            assert (await client.post(cancel)).status_code == 202
            await probe.cancelled.wait()
            rest = [event async for event in events]
    assert rest == []  # no response for a cancelled request


async def test_disconnection_is_not_cancellation_and_the_result_is_replayed(
    server: Server, probe: Probe
) -> None:
    client = await connected(server)
    raw = await Raw.connect(server)  # type: ignore[arg-type]
    message = json.dumps(rpc(1, "tools/call", name="wait", arguments={})).encode()
    with trio.fail_after(10):
        headers = {**client.headers(), "content-length": str(len(message))}
        await raw.start_request(server, headers)  # type: ignore[arg-type]
        await raw.send(message)
        await raw.end()
        response = await raw.response()
        assert header(response, "content-type") == "text/event-stream"
        first = b""
        async for chunk in raw.chunks():
            first += chunk
            if b"\n\n" in first:
                break
        priming = parse_events(first.decode())[0]
        await probe.started.wait()
    await raw.aclose()
    await trio.sleep(0.1)
    assert not probe.cancelled.is_set()
    probe.release.set()
    with trio.fail_after(5):
        await probe.finished.wait()
    assert not probe.cancelled.is_set()
    with trio.fail_after(10):
        async with client.get(**{"last-event-id": priming.id}) as resumed:
            assert resumed.status_code == 200
            replay = [event async for event in iter_events(resumed)]
    assert messages(replay) == [
        {
            "jsonrpc": "2.0",
            "id": 1,
            "result": {"content": [{"type": "text", "text": "released"}], "isError": False},
        }
    ]
    # Re-primed after the replay, so a later resumption from there skips nothing.
    assert replay[-1].data == "" and replay[-1].retry == 50


async def test_a_tool_closes_its_stream_and_the_result_comes_on_the_resumed_get(
    server: Server, probe: Probe
) -> None:
    client = await connected(server)
    with trio.fail_after(10):
        posted = await client.post(rpc(1, "tools/call", name="poll_me", arguments={}))
        events = parse_events(posted.text)
        assert events[0].data == "" and events[0].retry == 50
        assert not any(m.get("id") == 1 for m in messages(events))
        last = events[-1].id
        async with client.get(**{"last-event-id": last}) as resumed:
            assert resumed.status_code == 200
            stream = iter_events(resumed)
            probe.release.set()
            replay = [event async for event in stream]
    texts = [
        m["params"]["data"] for m in messages(replay) if m.get("method") == "notifications/message"
    ]
    assert "after close" in texts
    assert messages(replay)[-1]["result"]["content"][0]["text"] == "polled (closed=True)"


async def test_close_stream_is_a_no_op_for_2025_06_18(server: Server, probe: Probe) -> None:
    client = await connected(server, V0618)
    probe.release.set()
    events = await client.call(1, "poll_me", arguments={})
    assert messages(events)[-1]["result"]["content"][0]["text"] == "polled (closed=False)"


async def test_an_unknown_last_event_id_is_400(server: Server) -> None:
    client = await connected(server)
    for bad in ("99-1", "garbage", "1-999999"):
        async with client.get(**{"last-event-id": bad}) as response:
            assert response.status_code == 400


# -- the standalone GET stream ---------------------------------------------------------------------


async def test_the_standalone_stream_carries_list_changes_and_subscribed_updates(
    server: Server,
) -> None:
    client = await connected(server)
    subscribed = await client.post(rpc(1, "resources/subscribe", uri="test://watched"))
    assert subscribed.json() == {"jsonrpc": "2.0", "id": 1, "result": {}}
    with trio.fail_after(10):
        async with client.get() as stream:
            assert stream.status_code == 200
            assert stream.headers["content-type"] == "text/event-stream"
            events = iter_events(stream)
            priming = await events.__anext__()
            assert priming.data == "" and (priming.id or "").startswith("0-")
            async with client.get() as second:
                assert second.status_code == 409
            await client.call(2, "touch", arguments={"uri": "test://other"})
            await client.call(3, "touch", arguments={"uri": "test://watched"})
            got = [(await events.__anext__()).message for _ in range(3)]
    assert got == [
        {"jsonrpc": "2.0", "method": "notifications/tools/list_changed", "params": {}},
        {
            "jsonrpc": "2.0",
            "method": "notifications/resources/updated",
            "params": {"uri": "test://watched"},
        },
        {"jsonrpc": "2.0", "method": "notifications/tools/list_changed", "params": {}},
    ]


async def test_the_standalone_stream_resumes_and_a_resumption_is_never_409(
    server: Server,
) -> None:
    client = await connected(server)
    with trio.fail_after(10):
        async with client.get() as stream:
            events = iter_events(stream)
            priming = await events.__anext__()
            await client.call(1, "touch", arguments={"uri": "test://x"})
            seen = await events.__anext__()
            assert seen.message["method"] == "notifications/tools/list_changed"
            # While this stream is still open, a resumption from the priming id takes over.
            async with client.get(**{"last-event-id": priming.id}) as resumed:
                assert resumed.status_code == 200
                replayed = iter_events(resumed)
                assert (await replayed.__anext__()).message == seen.message
                assert (await replayed.__anext__()).data == ""  # re-primed
                # The displaced connection ends.
                assert [event async for event in events] == []


# -- limits, expiry and the principal --------------------------------------------------------------


async def test_sessions_are_bounded_in_number(start: StartServer) -> None:
    server = await start(HttpOptions(max_sessions=2))
    first = await connected(server)
    await connected(server)
    refused = await Client(server).post(
        rpc(0, "initialize", protocolVersion=V1125, capabilities={})
    )
    error = error_of(refused, 503)
    assert refused.headers["retry-after"] == "30"
    assert error["message"] == (
        "Too many sessions: this server holds at most 2; retry in 30 s "
        "(MCP 2026-07-28 clients need no session)"
    )
    assert (await first.delete()).status_code == 200
    await connected(server)


async def test_an_idle_session_expires(start: StartServer) -> None:
    server = await start(HttpOptions(session_idle_seconds=0.2))
    client = await connected(server)
    assert (await client.post(rpc(1, "ping"))).status_code == 200
    await trio.sleep(0.3)
    error_of(await client.post(rpc(2, "ping")), 404)


async def test_an_open_stream_keeps_a_session_alive(start: StartServer) -> None:
    server = await start(HttpOptions(session_idle_seconds=0.2))
    client = await connected(server)
    with trio.fail_after(10):
        async with client.get() as stream:
            assert stream.status_code == 200
            await trio.sleep(0.4)
            assert (await client.post(rpc(1, "ping"))).status_code == 200


async def test_requests_in_flight_are_bounded_and_ids_unique(
    start: StartServer, probe: Probe
) -> None:
    server = await start(HttpOptions(max_session_requests=1))
    client = await connected(server)
    with trio.fail_after(10):
        async with client.stream(rpc(1, "tools/call", name="wait", arguments={})) as running:
            await probe.started.wait()
            duplicate = await client.post(
                rpc(1, "tools/call", name="echo", arguments={"text": "x"})
            )
            assert error_of(duplicate, 400)["message"] == (
                "Invalid request: this id is already in use by a running request"
            )
            over = await client.post(rpc(2, "tools/call", name="echo", arguments={"text": "x"}))
            assert error_of(over, 429)["message"] == (
                "Too many requests in flight in this session (at most 1)"
            )
            probe.release.set()
            assert messages([event async for event in iter_events(running)])[-1]["id"] == 1


async def test_a_session_is_bound_to_its_principal(start: StartServer) -> None:
    async def authenticate(headers: Any) -> str:
        token = headers.get("authorization")
        if token is None:
            raise Unauthenticated()
        return str(token)

    server = await start(HttpOptions(authenticate=authenticate))
    alice = Client(server, authorization="alice")
    await alice.initialize()
    mallory = Client(server, authorization="mallory")
    mallory.session_id = alice.session_id
    error_of(await mallory.post(rpc(1, "ping")), 404)
    error_of(await mallory.delete(), 404)
    async with mallory.get() as stream:
        assert stream.status_code == 404
    nobody = Client(server)
    nobody.session_id = alice.session_id
    assert (await nobody.post(rpc(1, "ping"))).status_code == 401
    assert (await alice.post(rpc(2, "ping"))).json()["result"] == {}


# -- one session cannot reach another's state ------------------------------------------------------


async def test_sessions_are_isolated(server: Server) -> None:
    first = await connected(server, elicitation={})
    second = await connected(server, elicitation={})
    assert first.session_id != second.session_id
    await first.post(rpc(1, "logging/setLevel", level="error"))
    await second.post(rpc(1, "logging/setLevel", level="debug"))
    await first.post(rpc(2, "resources/subscribe", uri="test://watched"))
    with trio.fail_after(10):
        async with first.stream(rpc(3, "tools/call", name="ask_name", arguments={})) as asking:
            asked = iter_events(asking)
            await asked.__anext__()  # priming
            assert (await asked.__anext__()).message["id"] == 0
            # The same request id in flight in the other session, and its answer to "id 0"
            # (it has no such request) does not reach the first session's question.
            await second.post(
                {
                    "jsonrpc": "2.0",
                    "id": 0,
                    "result": {"action": "accept", "content": {"name": "Eve"}},
                }
            )
            second_logs = [
                m["params"]["data"]
                for m in messages(await second.call(3, "steps", arguments={}))
                if m.get("method") == "notifications/message"
            ]
            assert second_logs == ["debug line", "error line"]
            first_logs = [
                m["params"]["data"]
                for m in messages(await first.call(4, "steps", arguments={}))
                if m.get("method") == "notifications/message"
            ]
            assert first_logs == ["error line"]
            async with first.get() as first_stream, second.get() as second_stream:
                first_events = iter_events(first_stream)
                second_events = iter_events(second_stream)
                await first_events.__anext__()
                await second_events.__anext__()
                await second.call(5, "touch", arguments={"uri": "test://watched"})
                assert (await first_events.__anext__()).message[
                    "method"
                ] == "notifications/resources/updated"
                assert (await first_events.__anext__()).message[
                    "method"
                ] == "notifications/tools/list_changed"
                assert (await second_events.__anext__()).message[
                    "method"
                ] == "notifications/tools/list_changed"
                # The second session never subscribed: the next thing it sees is the next change.
                await second.call(6, "touch", arguments={"uri": "test://elsewhere"})
                assert (await second_events.__anext__()).message[
                    "method"
                ] == "notifications/tools/list_changed"
            await first.post(
                {
                    "jsonrpc": "2.0",
                    "id": 0,
                    "result": {"action": "accept", "content": {"name": "Ada"}},
                }
            )
            final = (await asked.__anext__()).message
            assert final["result"]["content"][0]["text"] == "accept: Ada"


# -- shutdown --------------------------------------------------------------------------------------


async def test_shutdown_ends_standalone_streams(app: App) -> None:
    stop = trio.Event()
    async with trio.open_nursery() as nursery, httpx.AsyncClient(timeout=10) as http:
        urls = await nursery.start(
            functools.partial(serve_http, app, "127.0.0.1", 0, shutdown_trigger=stop.wait)
        )
        server = Server(urls[0], http, app)
        client = await connected(server)
        with trio.fail_after(10):
            async with client.get() as stream:
                events = iter_events(stream)
                await events.__anext__()
                stop.set()
                assert [event async for event in events] == []


async def test_inline_without_a_running_transport(app: App) -> None:
    """Mounted under an ASGI host that runs no lifespan, the work runs in the request."""
    transport = HttpTransport(app)
    assert transport.legacy._nursery is None
    sent: list[dict[str, Any]] = []

    async def call(headers: list[tuple[bytes, bytes]], body: bytes) -> list[dict[str, Any]]:
        sent.clear()
        chunks = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if chunks:
                return chunks.pop()
            await trio.sleep_forever()
            raise AssertionError

        async def send(message: MutableMapping[str, Any]) -> None:
            sent.append(dict(message))

        scope = {"type": "http", "method": "POST", "path": "/mcp", "headers": headers}
        await transport(scope, receive, send)
        return list(sent)

    base = [
        (b"host", b"127.0.0.1"),
        (b"content-type", b"application/json"),
        (b"accept", b"application/json, text/event-stream"),
    ]
    init = json.dumps(rpc(0, "initialize", protocolVersion=V1125, capabilities={})).encode()
    with trio.fail_after(10):
        reply = await call(base, init)
    session = dict(reply[0]["headers"])[b"mcp-session-id"]
    called = json.dumps(rpc(1, "tools/call", name="echo", arguments={"text": "inline"})).encode()
    with trio.fail_after(10):
        reply = await call([*base, (b"mcp-session-id", session)], called)
    body = b"".join(message.get("body", b"") for message in reply[1:])
    assert messages(parse_events(body.decode()))[-1]["result"]["content"][0]["text"] == "inline"


# -- the command line ----------------------------------------------------------------------------


def test_the_session_flags_parse_and_refuse_nonsense(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["serve", "--max-sessions", "3", "--session-idle", "60"])
    assert (args.max_sessions, args.session_idle) == (3, 60.0)
    args = build_parser().parse_args(["serve"])
    assert (args.max_sessions, args.session_idle) == (10_000, 1800.0)
    for bad in (["--max-sessions", "0"], ["--max-sessions", "x"], ["--session-idle", "0"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *bad])
    assert "must be" in capsys.readouterr().err


async def test_tritask_serve_applies_the_session_limit() -> None:
    command = [sys.executable, "-m", "tritask", "serve", "--http", "127.0.0.1:0"]
    command += ["--store", "memory:", "--max-sessions", "1"]
    init = json.dumps(rpc(0, "initialize", protocolVersion=V1125, capabilities={})).encode()
    headers = {"content-type": "application/json", "accept": "application/json, text/event-stream"}
    async with trio.open_nursery() as nursery:
        process: trio.Process = await nursery.start(
            functools.partial(trio.run_process, command, stderr=subprocess.PIPE, check=False)
        )
        try:
            with trio.fail_after(60):  # a hang guard, not a measurement
                assert process.stderr is not None
                seen = b""
                while b"/mcp\n" not in seen:
                    chunk = await process.stderr.receive_some(4096)
                    assert chunk, seen
                    seen += chunk
                url = seen.split(b"on ", 1)[1].split(b"\n", 1)[0].decode()
                async with httpx.AsyncClient(timeout=10) as http:
                    first = await http.post(url, content=init, headers=headers)
                    second = await http.post(url, content=init, headers=headers)
            assert first.status_code == 200 and "mcp-session-id" in first.headers
            assert second.status_code == 503
            assert "at most 1" in second.json()["error"]["message"]
        finally:
            process.send_signal(signal.SIGINT)


# -- under hypercorn -------------------------------------------------------------------------------


async def test_a_session_under_hypercorn_survives_a_disconnect(app: App, probe: Probe) -> None:
    """No request-watch extension there: the transport watches ``receive()`` itself."""
    async with trio.open_nursery() as nursery, httpx.AsyncClient(timeout=10) as http:
        urls = await nursery.start(
            functools.partial(serve_http, app, "127.0.0.1", 0, server="hypercorn")
        )
        server = Server(urls[0], http, app)
        client = await connected(server)
        with trio.fail_after(10):
            async with client.stream(rpc(1, "tools/call", name="wait", arguments={})) as response:
                priming = await iter_events(response).__anext__()
                await probe.started.wait()
        probe.release.set()
        with trio.fail_after(10):
            await probe.finished.wait()
            async with client.get(**{"last-event-id": priming.id}) as resumed:
                replay = [event async for event in iter_events(resumed)]
        assert not probe.cancelled.is_set()
        assert messages(replay)[0]["result"]["content"][0]["text"] == "released"
        assert (await client.delete()).status_code == 200
        nursery.cancel_scope.cancel()
