"""Streamable HTTP over a real socket: admission, status mapping, SSE, cancellation, listen."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import h11
import httpx
import pytest
import trio

from tritask.protocol.meta import (
    CLIENT_CAPABILITIES_KEY,
    PROTOCOL_VERSION_KEY,
    SERVER_INFO_KEY,
    SUBSCRIPTION_ID_KEY,
)
from tritask.server import App, Context, Hub
from tritask.server.hub import Subscription
from tritask.transports.http import HttpOptions

V = "2026-07-28"
SERVER_INFO = {"name": "test-app", "version": "0.0.1"}
StartServer = Callable[..., Awaitable[str]]


def body(
    method: str,
    params: dict[str, Any] | None = None,
    *,
    request_id: str | int | None = 1,
    caps: dict[str, Any] | None = None,
    **meta_extra: Any,
) -> dict[str, Any]:
    message: dict[str, Any] = {
        "jsonrpc": "2.0",
        "method": method,
        "params": {
            **(params or {}),
            "_meta": {PROTOCOL_VERSION_KEY: V, CLIENT_CAPABILITIES_KEY: caps or {}, **meta_extra},
        },
    }
    if request_id is not None:
        message["id"] = request_id
    return message


def good_headers(message: dict[str, Any] | None = None) -> dict[str, str]:
    headers = {
        "content-type": "application/json",
        "accept": "application/json, text/event-stream",
        "mcp-protocol-version": V,
    }
    if message is not None:
        headers["mcp-method"] = message["method"]
        name = message["params"].get("name", message["params"].get("uri"))
        if name is not None:
            headers["mcp-name"] = name
    return headers


class Server:
    """A running server and an httpx client bound to it."""

    def __init__(self, base: str, client: httpx.AsyncClient, app: App) -> None:
        self.base = base
        self.url = base + "/mcp"
        self.client = client
        self.app = app
        host = urlsplit(base)
        self.host, self.port = host.hostname or "", host.port or 0

    async def post(
        self,
        message: Any,
        *,
        headers: dict[str, str | None] | None = None,
        raw: bytes | None = None,
        path: str = "/mcp",
    ) -> httpx.Response:
        merged: dict[str, str | None] = dict(
            good_headers(message if isinstance(message, dict) and "method" in message else None)
        )
        merged.update(headers or {})
        content = raw if raw is not None else json.dumps(message).encode()
        sent = {key: value for key, value in merged.items() if value is not None}
        return await self.client.post(self.base + path, content=content, headers=sent)

    async def assert_serving(self) -> None:
        """The server still answers a good request after whatever came before."""
        response = await self.post(body("server/discover", request_id="alive"))
        assert response.status_code == 200, response.text
        assert response.json()["result"]["resultType"] == "complete"


def error_body(response: httpx.Response, status: int, code: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    payload: dict[str, Any] = response.json()
    assert payload["jsonrpc"] == "2.0"
    assert payload["error"]["code"] == code, payload
    return payload


class Probe:
    """Shared state between a test and the tools it drives."""

    def __init__(self) -> None:
        self.started = trio.Event()
        self.cancelled = trio.Event()
        self.finished = False


@pytest.fixture
def probe() -> Probe:
    return Probe()


@pytest.fixture
def app(make_app: Callable[..., App], probe: Probe) -> App:
    app = make_app()

    @app.tool()
    async def echo(text: str) -> str:
        """Echo."""
        return text

    @app.tool()
    async def explode() -> str:
        """Fail with a secret."""
        raise RuntimeError("secret-hunter2")

    @app.tool()
    async def steps(ctx: Context, count: int = 3) -> str:
        """Report progress."""
        for index in range(1, count + 1):
            await ctx.progress(index, count)
        return "done"

    @app.tool()
    async def slow(seconds: float) -> str:
        """Sleep, then answer."""
        await trio.sleep(seconds)
        return "slept"

    @app.tool()
    async def hang() -> str:
        """Wait forever, recording cancellation."""
        probe.started.set()
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            probe.cancelled.set()
            raise
        finally:
            probe.finished = True
        raise AssertionError("unreachable")

    return app


@pytest.fixture
async def start(
    http_server: StartServer, app: App
) -> AsyncIterator[Callable[..., Awaitable[Server]]]:
    async with httpx.AsyncClient(timeout=10) as client:

        async def run(options: HttpOptions | None = None) -> Server:
            return Server(await http_server(app, options), client, app)

        yield run


@pytest.fixture
async def server(start: Callable[..., Awaitable[Server]]) -> Server:
    return await start()


# -- a tiny raw HTTP/1.1 client for what httpx will not do -----------------------------------------


class Raw:
    """One TCP connection driven with h11, so a test can stop sending half-way or hang up."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.conn = h11.Connection(h11.CLIENT)

    @classmethod
    async def connect(cls, server: Server) -> Raw:
        return cls(await trio.open_tcp_stream(server.host, server.port))

    async def _send(self, event: Any) -> None:
        data = self.conn.send(event)
        if data:
            await self.stream.send_all(data)

    async def start_request(
        self, server: Server, headers: dict[str, str], path: str = "/mcp"
    ) -> None:
        pairs = [("host", f"{server.host}:{server.port}"), *headers.items()]
        await self._send(h11.Request(method="POST", target=path, headers=pairs))

    async def send(self, data: bytes) -> None:
        await self._send(h11.Data(data=data))

    async def end(self) -> None:
        await self._send(h11.EndOfMessage())

    async def post(self, server: Server, message: dict[str, Any], **extra: str) -> None:
        data = json.dumps(message).encode()
        headers = {**good_headers(message), "content-length": str(len(data)), **extra}
        await self.start_request(server, headers)
        await self.send(data)
        await self.end()

    async def event(self) -> Any:
        while True:
            event = self.conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            self.conn.receive_data(await self.stream.receive_some(65536))

    async def response(self) -> h11.Response:
        event = await self.event()
        assert isinstance(event, h11.Response), event
        return event

    async def chunks(self) -> AsyncIterator[bytes]:
        while True:
            event = await self.event()
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return

    async def body(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    async def sse(self) -> AsyncIterator[tuple[str, Any]]:
        """``("comment", text)`` and ``("message", json)`` events until the stream ends."""
        buffer = b""
        async for chunk in self.chunks():
            buffer += chunk
            while b"\n\n" in buffer:
                block, buffer = buffer.split(b"\n\n", 1)
                yield parse_sse_block(block)
        assert buffer == b""

    async def aclose(self) -> None:
        await self.stream.aclose()


def parse_sse_block(block: bytes) -> tuple[str, Any]:
    lines = block.decode("utf-8").split("\n")
    if all(line.startswith(":") for line in lines):
        return "comment", "\n".join(line[1:].strip() for line in lines)
    data = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    assert [line for line in lines if not line.startswith("data: ")] == ["event: message"]
    return "message", json.loads("\n".join(data))


def parse_sse(text: str) -> list[tuple[str, Any]]:
    blocks = [block for block in text.encode().split(b"\n\n") if block]
    return [parse_sse_block(block) for block in blocks]


def header(response: h11.Response, name: str) -> str | None:
    for key, value in response.headers:
        if key.decode().lower() == name:
            return value.decode()
    return None


# -- the happy path --------------------------------------------------------------------------------


async def test_json_answer(server: Server) -> None:
    response = await server.post(body("tools/call", {"name": "echo", "arguments": {"text": "hi"}}))
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert "mcp-session-id" not in response.headers
    assert response.json() == {
        "jsonrpc": "2.0",
        "id": 1,
        "result": {
            "content": [{"type": "text", "text": "hi"}],
            "isError": False,
            "resultType": "complete",
            "_meta": {SERVER_INFO_KEY: SERVER_INFO},
        },
    }


async def test_session_id_is_ignored(server: Server) -> None:
    response = await server.post(
        body("server/discover"), headers={"mcp-session-id": "abc", "last-event-id": "7"}
    )
    assert response.status_code == 200
    assert "mcp-session-id" not in response.headers


# -- parse errors and envelopes --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "code", "message", "request_id"),
    [
        (b"{not json", -32700, "Parse error: the body is not valid JSON", None),
        (b"", -32700, "Parse error: the body is not valid JSON", None),
        (b"\xff\xfe{}", -32700, "Parse error: the body is not valid JSON", None),
        (b'{"a": NaN}', -32700, "Parse error: the body is not valid JSON", None),
        (
            b'[{"jsonrpc":"2.0","id":1,"method":"server/discover"}]',
            -32600,
            "Invalid request: batches are not supported; send one message",
            None,
        ),
        (b"[]", -32600, "Invalid request: batches are not supported; send one message", None),
        (b"3", -32600, "Invalid request: expected a JSON object", None),
        (b'"text"', -32600, "Invalid request: expected a JSON object", None),
        (b"null", -32600, "Invalid request: expected a JSON object", None),
        (
            b'{"jsonrpc":"1.0","id":7,"method":"x"}',
            -32600,
            'Invalid request: "jsonrpc" must be "2.0"',
            7,
        ),
        (
            b'{"jsonrpc":"2.0","id":"r","method":""}',
            -32600,
            'Invalid request: "method" must be a non-empty string',
            "r",
        ),
        (
            b'{"jsonrpc":"2.0","id":"r","result":{}}',
            -32600,
            "Invalid request: servers do not accept responses",
            "r",
        ),
        (
            b'{"jsonrpc":"2.0","id":1,"method":"x","params":[1]}',
            -32600,
            'Invalid request: "params" must be an object',
            1,
        ),
        (
            b'{"jsonrpc":"2.0","id":null,"method":"x"}',
            -32600,
            'Invalid request: "id" must be a string or an integer',
            None,
        ),
        (
            b'{"jsonrpc":"2.0","id":1.5,"method":"x"}',
            -32600,
            'Invalid request: "id" must be a string or an integer',
            None,
        ),
    ],
)
async def test_bad_bodies(
    server: Server, raw: bytes, code: int, message: str, request_id: Any
) -> None:
    response = await server.post(None, raw=raw, headers={"mcp-method": "x"})
    payload = error_body(response, 400, code)
    assert payload == {
        "jsonrpc": "2.0",
        "id": request_id,
        "error": {"code": code, "message": message},
    }
    await server.assert_serving()


# -- admission -------------------------------------------------------------------------------------


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/jsonx", "text/json"])
async def test_wrong_content_type(server: Server, content_type: str | None) -> None:
    response = await server.post(body("server/discover"), headers={"content-type": content_type})
    payload = error_body(response, 415, -32600)
    assert payload["error"]["message"] == "Content-Type must be application/json"
    assert payload["id"] is None
    await server.assert_serving()


async def test_content_type_parameters_are_allowed(server: Server) -> None:
    response = await server.post(
        body("server/discover"), headers={"content-type": "Application/JSON; charset=utf-8"}
    )
    assert response.status_code == 200


@pytest.mark.parametrize(
    "accept", ["", "application/json", "text/event-stream", "text/html", "application/*"]
)
async def test_accept_must_list_both(server: Server, accept: str) -> None:
    response = await server.post(body("server/discover"), headers={"accept": accept})
    payload = error_body(response, 406, -32600)
    assert payload["error"]["message"] == (
        "Accept must list application/json and text/event-stream"
    )
    await server.assert_serving()


async def test_missing_accept(server: Server) -> None:
    # httpx always sends an Accept header, so this one goes over a raw connection.
    message = body("server/discover")
    data = json.dumps(message).encode()
    headers = {**good_headers(message), "content-length": str(len(data))}
    del headers["accept"]
    raw = await Raw.connect(server)
    with trio.fail_after(5):
        await raw.start_request(server, headers)
        await raw.send(data)
        await raw.end()
        assert (await raw.response()).status_code == 406
        assert json.loads(await raw.body())["error"]["code"] == -32600
    await raw.aclose()
    await server.assert_serving()


@pytest.mark.parametrize(
    "accept",
    [
        "*/*",
        "text/event-stream;q=0.5, application/json",
        "application/*, text/*",
    ],
)
async def test_accept_forms(server: Server, accept: str) -> None:
    response = await server.post(body("server/discover"), headers={"accept": accept})
    assert response.status_code == 200


@pytest.mark.parametrize("method", ["GET", "DELETE", "PUT", "PATCH"])
async def test_other_http_methods(server: Server, method: str) -> None:
    response = await server.client.request(method, server.url, headers=good_headers())
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    await server.assert_serving()


@pytest.mark.parametrize("path", ["/", "/mcpx", "/other", "/mcp/deeper"])
async def test_unknown_path(server: Server, path: str) -> None:
    response = await server.post(body("server/discover"), path=path)
    assert response.status_code == 404
    await server.assert_serving()


async def test_trailing_slash_is_the_same_endpoint(server: Server) -> None:
    assert (await server.post(body("server/discover"), path="/mcp/")).status_code == 200


@pytest.mark.parametrize(
    "host",
    ["evil.example.com", "evil.example.com:80", "127.0.0.1.evil.example.com", "localhost.evil"],
)
async def test_foreign_host_is_refused(server: Server, host: str) -> None:
    response = await server.post(
        body("server/discover"), headers={"host": host, "origin": "http://evil.example.com"}
    )
    payload = error_body(response, 403, -32600)
    assert payload == {
        "jsonrpc": "2.0",
        "id": None,
        "error": {"code": -32600, "message": "Host is not allowed"},
    }
    await server.assert_serving()


@pytest.mark.parametrize(
    "host", ["localhost", "LOCALHOST:{port}", "127.0.0.1:{port}", "[::1]:{port}"]
)
async def test_loopback_host_is_accepted(server: Server, host: str) -> None:
    response = await server.post(
        body("server/discover"), headers={"host": host.format(port=server.port)}
    )
    assert response.status_code == 200


async def test_any_host_when_not_restricted(start: Callable[..., Awaitable[Server]]) -> None:
    server = await start(HttpOptions(allowed_hosts=None))
    response = await server.post(body("server/discover"), headers={"host": "mcp.example.com"})
    assert response.status_code == 200


@pytest.mark.parametrize(
    "origin",
    [
        "http://evil.example.com",
        "https://evil.example.com:443",
        "null",
        "http://localhost.evil.example.com",
        "file://",
        "http://localhost/path",
        "ftp://localhost",
    ],
)
async def test_foreign_origin_is_refused(server: Server, origin: str) -> None:
    response = await server.post(body("server/discover"), headers={"origin": origin})
    payload = error_body(response, 403, -32600)
    assert payload["error"]["message"] == "Origin is not allowed"
    assert payload["id"] is None
    await server.assert_serving()


@pytest.mark.parametrize(
    "origin",
    ["http://localhost", "http://localhost:3000", "https://127.0.0.1:8443", "http://[::1]:5173"],
)
async def test_loopback_origin_is_accepted(server: Server, origin: str) -> None:
    response = await server.post(body("server/discover"), headers={"origin": origin})
    assert response.status_code == 200


async def test_origin_allow_list(start: Callable[..., Awaitable[Server]]) -> None:
    server = await start(HttpOptions(allowed_origins=("https://app.example.com",)))
    allowed = await server.post(
        body("server/discover"), headers={"origin": "https://app.example.com"}
    )
    assert allowed.status_code == 200
    for origin in (
        "http://localhost:3000",
        "https://app.example.com:444",
        "https://APP.example.com/",
    ):
        refused = await server.post(body("server/discover"), headers={"origin": origin})
        assert error_body(refused, 403, -32600)["error"]["message"] == "Origin is not allowed"
    assert (await server.post(body("server/discover"))).status_code == 200  # no Origin at all


# -- body limits -----------------------------------------------------------------------------------

LIMIT = 1024


async def test_body_over_limit_with_content_length(start: Callable[..., Awaitable[Server]]) -> None:
    server = await start(HttpOptions(max_body_bytes=LIMIT))
    message = body("tools/call", {"name": "echo", "arguments": {"text": "x" * (2 * LIMIT)}})
    response = await server.post(message)
    payload = error_body(response, 413, -32600)
    assert payload == {
        "jsonrpc": "2.0",
        "id": None,
        "error": {"code": -32600, "message": f"Body exceeds {LIMIT} bytes"},
    }
    await server.assert_serving()


async def test_declared_length_refused_before_the_body_is_sent(
    start: Callable[..., Awaitable[Server]],
) -> None:
    server = await start(HttpOptions(max_body_bytes=LIMIT))
    raw = await Raw.connect(server)
    headers = {**good_headers(), "mcp-method": "x", "content-length": str(100 * 1024 * 1024)}
    with trio.fail_after(5):
        await raw.start_request(server, headers)
        await raw.send(b'{"jsonrpc":')  # a few bytes of a 100 MiB body, then nothing more
        response = await raw.response()
        assert response.status_code == 413
        assert json.loads(await raw.body())["error"]["message"] == f"Body exceeds {LIMIT} bytes"
    await raw.aclose()
    await server.assert_serving()


async def test_chunked_body_over_limit(start: Callable[..., Awaitable[Server]]) -> None:
    server = await start(HttpOptions(max_body_bytes=LIMIT))
    raw = await Raw.connect(server)
    headers = {**good_headers(), "mcp-method": "x", "transfer-encoding": "chunked"}
    with trio.fail_after(5):
        await raw.start_request(server, headers)
        await raw.send(b" " * (LIMIT // 2))
        await raw.send(b" " * (LIMIT // 2 + 1))  # one byte over; the rest is never sent
        response = await raw.response()
        assert response.status_code == 413
        assert json.loads(await raw.body())["error"]["code"] == -32600
    await raw.aclose()
    await server.assert_serving()


async def test_chunked_body_within_limit(start: Callable[..., Awaitable[Server]]) -> None:
    server = await start(HttpOptions(max_body_bytes=LIMIT))
    data = json.dumps(body("server/discover")).encode()
    raw = await Raw.connect(server)
    with trio.fail_after(5):
        await raw.start_request(
            server,
            {**good_headers(), "mcp-method": "server/discover", "transfer-encoding": "chunked"},
        )
        for index in range(0, len(data), 7):
            await raw.send(data[index : index + 7])
        await raw.end()
        response = await raw.response()
        assert response.status_code == 200
        assert json.loads(await raw.body())["result"]["resultType"] == "complete"
    await raw.aclose()


# -- notifications ---------------------------------------------------------------------------------


async def test_notification_is_accepted_without_a_body(server: Server) -> None:
    message = body("notifications/cancelled", {"requestId": 1}, request_id=None)
    response = await server.post(message)
    assert response.status_code == 202
    assert response.content == b""


async def test_notification_needs_the_version_header(server: Server) -> None:
    message = body("notifications/whatever", request_id=None)
    response = await server.post(message, headers={"mcp-protocol-version": None})
    payload = error_body(response, 400, -32020)
    assert payload["id"] is None
    assert payload["error"]["message"] == "The MCP-Protocol-Version header is required"
    await server.assert_serving()


# -- JSON-RPC errors and their statuses ------------------------------------------------------------


async def test_unknown_method_is_404(server: Server) -> None:
    response = await server.post(body("no/such", request_id="u"))
    payload = error_body(response, 404, -32601)
    assert payload == {
        "jsonrpc": "2.0",
        "id": "u",
        "error": {"code": -32601, "message": "Method not found: no/such"},
    }


@pytest.mark.parametrize(
    "method",
    ["initialize", "ping", "logging/setLevel", "resources/subscribe", "tasks/list", "tasks/result"],
)
async def test_removed_methods_are_404(server: Server, method: str) -> None:
    error_body(await server.post(body(method)), 404, -32601)


async def test_invalid_params_is_400(server: Server) -> None:
    response = await server.post(body("tools/call", {"name": "nope"}, request_id=9))
    payload = error_body(response, 400, -32602)
    assert payload["id"] == 9
    assert payload["error"] == {
        "code": -32602,
        "message": "Unknown tool: nope",
        "data": {"name": "nope"},
    }


async def test_internal_error_is_500_without_secrets(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    response = await server.post(body("tools/call", {"name": "explode"}, request_id=5))
    payload = error_body(response, 500, -32603)
    assert payload == {
        "jsonrpc": "2.0",
        "id": 5,
        "error": {"code": -32603, "message": "Internal error"},
    }
    assert "hunter2" not in response.text
    assert "secret-hunter2" in caplog.text
    await server.assert_serving()


async def test_header_errors_are_400(server: Server) -> None:
    message = body("tools/call", {"name": "echo", "arguments": {"text": "x"}})
    missing = await server.post(message, headers={"mcp-protocol-version": None})
    assert error_body(missing, 400, -32020)["error"]["message"] == (
        "The MCP-Protocol-Version header is required"
    )
    wrong_name = await server.post(message, headers={"mcp-name": "other"})
    assert error_body(wrong_name, 400, -32020)["error"]["message"] == (
        "The Mcp-Name header does not match params.name"
    )
    wrong_method = await server.post(message, headers={"mcp-method": "tools/list"})
    error_body(wrong_method, 400, -32020)
    bad_base64 = await server.post(message, headers={"mcp-name": "=?base64?!!!!?="})
    error_body(bad_base64, 400, -32020)
    encoded = await server.post(message, headers={"mcp-name": "=?base64?ZWNobw==?="})
    assert encoded.status_code == 200
    await server.assert_serving()


async def test_version_errors_are_400(server: Server) -> None:
    message = body("server/discover")
    message["params"]["_meta"][PROTOCOL_VERSION_KEY] = "v999.0.0"
    mismatch = await server.post(message)
    error_body(mismatch, 400, -32020)
    unsupported = await server.post(message, headers={"mcp-protocol-version": "v999.0.0"})
    payload = error_body(unsupported, 400, -32022)
    assert payload["error"]["data"] == {"supported": [V], "requested": "v999.0.0"}
    del message["params"]["_meta"]
    error_body(await server.post(message), 400, -32602)


async def test_missing_capability_is_400(server: Server, app: App) -> None:
    @app.tool()
    async def ask(ctx: Context) -> Any:
        """Ask."""
        return ctx.input_required({"a": {"method": "sampling/createMessage", "params": {}}})

    payload = error_body(await server.post(body("tools/call", {"name": "ask"})), 400, -32021)
    assert payload["error"]["data"] == {"requiredCapabilities": {"sampling": {}}}


# -- streaming -------------------------------------------------------------------------------------


async def test_progress_streams_before_the_final_response(server: Server) -> None:
    message = body("tools/call", {"name": "steps", "arguments": {"count": 3}}, progressToken="p")
    response = await server.post(message)
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream"
    assert response.headers["x-accel-buffering"] == "no"
    assert response.headers["cache-control"] == "no-cache"
    events = parse_sse(response.text)
    assert [kind for kind, _ in events] == ["message"] * 4
    notifications = [payload for _, payload in events[:3]]
    assert notifications == [
        {
            "jsonrpc": "2.0",
            "method": "notifications/progress",
            "params": {"progressToken": "p", "progress": index, "total": 3},
        }
        for index in (1, 2, 3)
    ]
    final = events[3][1]
    assert final["id"] == 1
    assert final["result"]["content"] == [{"type": "text", "text": "done"}]


async def test_no_progress_token_means_plain_json(server: Server) -> None:
    response = await server.post(body("tools/call", {"name": "steps"}))
    assert response.headers["content-type"] == "application/json"


async def test_keepalive_comment_on_a_long_call(start: Callable[..., Awaitable[Server]]) -> None:
    server = await start(HttpOptions(keepalive_seconds=0.05))
    with trio.fail_after(5):
        response = await server.post(
            body("tools/call", {"name": "slow", "arguments": {"seconds": 0.3}})
        )
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream"
    events = parse_sse(response.text)
    assert events[0] == ("comment", "keep-alive")
    assert all(kind == "comment" for kind, _ in events[:-1])
    assert events[-1][0] == "message"
    assert events[-1][1]["result"]["content"] == [{"type": "text", "text": "slept"}]


async def test_quick_call_gets_no_keepalive(start: Callable[..., Awaitable[Server]]) -> None:
    server = await start(HttpOptions(keepalive_seconds=5))
    response = await server.post(body("tools/call", {"name": "slow", "arguments": {"seconds": 0}}))
    assert response.headers["content-type"] == "application/json"


async def test_client_disconnect_cancels_the_handler(server: Server, probe: Probe) -> None:
    raw = await Raw.connect(server)
    with trio.fail_after(5):
        await raw.post(server, body("tools/call", {"name": "hang"}))
        await probe.started.wait()
    assert not probe.cancelled.is_set()
    await raw.aclose()
    with trio.fail_after(2):
        await probe.cancelled.wait()
    assert probe.finished
    await server.assert_serving()


async def test_disconnect_during_a_stream_cancels_the_handler(
    start: Callable[..., Awaitable[Server]], probe: Probe
) -> None:
    server = await start(HttpOptions(keepalive_seconds=0.05))
    raw = await Raw.connect(server)
    with trio.fail_after(5):
        await raw.post(server, body("tools/call", {"name": "hang"}))
        response = await raw.response()
        assert header(response, "content-type") == "text/event-stream"
        events = raw.sse()
        assert await events.__anext__() == ("comment", "keep-alive")
    await raw.aclose()
    with trio.fail_after(2):
        await probe.cancelled.wait()
    await server.assert_serving()


# -- subscriptions/listen --------------------------------------------------------------------------


async def test_listen_stream(server: Server, app: App) -> None:
    raw = await Raw.connect(server)
    listen = body(
        "subscriptions/listen",
        {"notifications": {"toolsListChanged": True, "promptsListChanged": True}},
        request_id="sub-1",
    )
    with trio.fail_after(5):
        await raw.post(server, listen)
        response = await raw.response()
        assert response.status_code == 200
        assert header(response, "content-type") == "text/event-stream"
        assert header(response, "x-accel-buffering") == "no"
        events = raw.sse()
        kind, ack = await events.__anext__()
        # The app has tools but no prompts: only toolsListChanged is granted.
        assert (kind, ack) == (
            "message",
            {
                "jsonrpc": "2.0",
                "method": "notifications/subscriptions/acknowledged",
                "params": {
                    "_meta": {SUBSCRIPTION_ID_KEY: "sub-1"},
                    "notifications": {"toolsListChanged": True},
                },
            },
        )

        async def added() -> str:
            """Added while listening."""
            return ""

        app.add_tool(added)
        kind, changed = await events.__anext__()
        assert (kind, changed) == (
            "message",
            {
                "jsonrpc": "2.0",
                "method": "notifications/tools/list_changed",
                "params": {"_meta": {SUBSCRIPTION_ID_KEY: "sub-1"}},
            },
        )
        app.hub.close()
        kind, final = await events.__anext__()
        assert (kind, final) == (
            "message",
            {
                "jsonrpc": "2.0",
                "id": "sub-1",
                "result": {
                    "resultType": "complete",
                    "_meta": {SUBSCRIPTION_ID_KEY: "sub-1", SERVER_INFO_KEY: SERVER_INFO},
                },
            },
        )
        with pytest.raises(StopAsyncIteration):
            await events.__anext__()
    await raw.aclose()
    await server.assert_serving()


async def test_closing_a_listen_stream_unsubscribes(
    server: Server, app: App, monkeypatch: pytest.MonkeyPatch
) -> None:
    unsubscribed = trio.Event()
    close_subscription = Hub.close_subscription

    def recording_close(hub: Hub, subscription: Subscription) -> None:
        close_subscription(hub, subscription)
        unsubscribed.set()

    monkeypatch.setattr(Hub, "close_subscription", recording_close)
    raw = await Raw.connect(server)
    listen = body("subscriptions/listen", {"notifications": {"toolsListChanged": True}})
    with trio.fail_after(5):
        await raw.post(server, listen)
        await raw.response()
        assert (await raw.sse().__anext__())[1]["method"] == (
            "notifications/subscriptions/acknowledged"
        )
        assert app.hub.subscriber_count == 1
    await raw.aclose()
    with trio.fail_after(2):
        await unsubscribed.wait()
    assert app.hub.subscriber_count == 0


async def test_listen_with_bad_filter_is_400(server: Server) -> None:
    response = await server.post(body("subscriptions/listen", {"notifications": []}))
    error_body(response, 400, -32602)
    response = await server.post(
        body("subscriptions/listen", {"notifications": {"toolsListChanged": "yes"}})
    )
    assert error_body(response, 400, -32602)["error"]["message"] == (
        "notifications.toolsListChanged must be a boolean"
    )
