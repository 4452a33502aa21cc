"""Fuzzing the HTTP transport and the decoders in front of it.

Client garbage must never produce a 5xx, never hang, and never stop the server from answering
the next good request. The fast half drives the ASGI app directly with a fake receive/send (many
examples); the slow half posts to a real hypercorn socket (few examples, one server, driven from a
worker thread through ``trio.from_thread`` so Hypothesis can reuse the running server).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import attrs
import httpx
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tritask.jsonrpc import InvalidParams, MessageError, Notification, Request, parse_message
from tritask.protocol.headers import encode_header_value
from tritask.protocol.meta import CLIENT_CAPABILITIES_KEY, PROTOCOL_VERSION_KEY, parse_request_meta
from tritask.server import App, Context, InputRequired, elicitation
from tritask.transports.http import HttpOptions, HttpTransport

V = "2026-07-28"
STATE_KEY = "fuzz-state-key-0123456789abcdef"
FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ERROR_STATUSES = {400, 401, 403, 404, 405, 406, 413, 415}


def build_app() -> App:
    app = App("fuzz", "1", state_key=STATE_KEY)

    @app.tool()
    async def echo(text: str) -> str:
        """Echo."""
        return text

    @app.tool()
    async def add(a: float, b: float) -> dict[str, float]:
        """Add."""
        return {"sum": a + b}

    @app.tool()
    async def regional(
        region: Annotated[str, {"x-mcp-header": "Region"}],
        count: Annotated[int, {"x-mcp-header": "Count"}] = 1,
    ) -> str:
        """Mirrored arguments."""
        return f"{region}{count}"

    @app.tool()
    async def ask(ctx: Context) -> Any:
        """MRTR."""
        if ctx.input_response("q") is None:
            return InputRequired({"q": elicitation("?", {"type": "object"})}, {"n": 1})
        return "ok"

    @app.tool()
    async def steps(ctx: Context) -> str:
        """Progress."""
        await ctx.progress(1, 2)
        await ctx.progress(2, 2)
        return "done"

    @app.prompt()
    async def greet(name: str) -> str:
        """Greet."""
        return f"hi {name}"

    @app.resource("demo://readme")
    async def readme() -> str:
        """Readme."""
        return "readme"

    @app.resource("demo://items/{item}")
    async def item(item: str) -> str:
        """Item."""
        return item

    @app.completion("ref/prompt", "greet")
    async def complete(argument: str, value: str, context: Any) -> list[str]:
        return ["alice"]

    return app


APP = build_app()
TRANSPORT = HttpTransport(APP, HttpOptions(max_body_bytes=64 * 1024))


# -- an in-memory ASGI client ----------------------------------------------------------------------


@attrs.frozen
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes


async def asgi(
    transport: HttpTransport,
    *,
    method: str = "POST",
    path: str = "/mcp",
    headers: list[tuple[bytes, bytes]],
    chunks: list[bytes],
) -> Reply:
    messages = [
        {"type": "http.request", "body": chunk, "more_body": index < len(chunks) - 1}
        for index, chunk in enumerate(chunks or [b""])
    ]
    pending = iter(messages)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        message = next(pending, None)
        if message is None:
            await trio.sleep_forever()  # the client stays connected
        assert message is not None
        return message

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode("utf-8", "surrogateescape"),
        "query_string": b"",
        "headers": headers,
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }
    with trio.fail_after(5):
        await transport(scope, receive, send)  # type: ignore[arg-type]
    assert sent, "the app returned without answering (hypercorn would send a 500)"
    start, *rest = sent
    assert start["type"] == "http.response.start"
    assert rest and all(message["type"] == "http.response.body" for message in rest)
    assert not rest[-1].get("more_body", False), "the response never ended"
    assert all(message.get("more_body", False) for message in rest[:-1])
    response_headers = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    return Reply(start["status"], response_headers, b"".join(m.get("body", b"") for m in rest))


def good_headers(method: str | None = None, name: str | None = None) -> list[tuple[bytes, bytes]]:
    headers = [
        (b"host", b"127.0.0.1:8000"),
        (b"content-type", b"application/json"),
        (b"accept", b"application/json, text/event-stream"),
        (b"mcp-protocol-version", V.encode()),
    ]
    if method is not None:
        headers.append((b"mcp-method", encode_header_value(method).encode()))
    if name is not None:
        headers.append((b"mcp-name", encode_header_value(name).encode()))
    return headers


def meta() -> dict[str, Any]:
    return {PROTOCOL_VERSION_KEY: V, CLIENT_CAPABILITIES_KEY: {"elicitation": {}}}


GOOD = json.dumps(
    {"jsonrpc": "2.0", "id": 1, "method": "server/discover", "params": {"_meta": meta()}}
).encode()


def check_reply(reply: Reply) -> None:
    """Whatever the client sent: no 5xx, and every JSON answer is a well-formed message."""
    assert reply.status < 500, reply
    content_type = reply.headers.get("content-type", "")
    if reply.status == 202:
        assert reply.body == b""
        return
    if content_type == "application/json":
        message = json.loads(reply.body)
        assert message["jsonrpc"] == "2.0"
        assert isinstance(message.get("id"), str | int | None)
        assert not isinstance(message.get("id"), bool)
        if reply.status == 200:
            assert "result" in message or message["error"]["code"] not in (-32602, -32603)
        else:
            assert reply.status in ERROR_STATUSES, reply
            assert isinstance(message["error"]["code"], int)
            assert isinstance(message["error"]["message"], str)
    elif content_type == "text/event-stream":
        assert reply.status == 200
        assert reply.headers["x-accel-buffering"] == "no"
        blocks = [block for block in reply.body.split(b"\n\n") if block]
        final = json.loads(blocks[-1].split(b"data: ", 1)[1])
        assert "result" in final or "error" in final
        assert (
            "result" not in final
            or final["result"].get("resultType") == "complete"
            or (final["result"].get("resultType") == "input_required")
        )
    else:
        assert reply.status in ERROR_STATUSES, reply


async def still_serving() -> None:
    reply = await asgi(TRANSPORT, headers=good_headers("server/discover"), chunks=[GOOD])
    assert reply.status == 200
    assert json.loads(reply.body)["result"]["resultType"] == "complete"


# -- strategies ------------------------------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(10**400), max_value=10**400)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=15,
)

METHODS = [
    "server/discover",
    "tools/list",
    "tools/call",
    "prompts/list",
    "prompts/get",
    "resources/list",
    "resources/read",
    "resources/templates/list",
    "completion/complete",
    "initialize",
    "tasks/get",
    "notifications/cancelled",
]
NAMES = [
    "echo",
    "add",
    "regional",
    "ask",
    "steps",
    "greet",
    "nope",
    "demo://readme",
    "demo://items/✓",
]

valid_ids = st.integers() | st.text(max_size=10)
bad_ids = st.none() | st.floats() | st.booleans() | st.lists(st.integers(), max_size=1)
tweaked_metas = st.builds(
    lambda extra: {**meta(), **extra},
    st.dictionaries(
        st.sampled_from(
            [
                "io.modelcontextprotocol/logLevel",
                "progressToken",
                PROTOCOL_VERSION_KEY,
                CLIENT_CAPABILITIES_KEY,
                "io.modelcontextprotocol/clientInfo",
            ]
        ),
        json_values | st.sampled_from(["info", "p", V, "v999.0.0"]),
        min_size=1,
        max_size=2,
    ),
)
params = st.fixed_dictionaries(
    {},
    optional={
        "name": st.sampled_from(NAMES) | json_values,
        "uri": st.sampled_from(NAMES) | json_values,
        "arguments": st.fixed_dictionaries(
            {},
            optional={
                "text": json_scalars,
                "a": json_scalars,
                "b": json_scalars,
                "region": json_scalars,
                "count": json_scalars,
                "name": json_scalars,
            },
        )
        | json_values,
        "requestState": json_values,
        "inputResponses": json_values,
        "cursor": json_values,
        "ref": json_values | st.just({"type": "ref/prompt", "name": "greet"}),
        "argument": json_values | st.just({"name": "name", "value": "a"}),
        "notifications": json_values,
    },
)


def one_in(draw: st.DrawFn, n: int) -> bool:
    """True about once in ``n`` draws (integers are biased towards bounds; this is not)."""
    return draw(st.sampled_from([False] * (n - 1) + [True]))


@st.composite
def rpc_messages(draw: st.DrawFn) -> tuple[dict[str, Any], list[tuple[bytes, bytes]]]:
    """Mostly well-formed envelopes (so the dispatcher is reached), sometimes broken ones."""
    broken = one_in(draw, 10)
    message: dict[str, Any] = {"jsonrpc": draw(json_scalars) if broken else "2.0"}
    method = draw(st.text(max_size=20)) if one_in(draw, 10) else draw(st.sampled_from(METHODS))
    message["method"] = method
    if not method.startswith("notifications/"):
        message["id"] = draw(bad_ids if broken else valid_ids)
    body_params = draw(params)
    if method in ("tools/call", "prompts/get") and not one_in(draw, 4):
        body_params["name"] = draw(st.sampled_from(NAMES))
    if method == "resources/read" and not one_in(draw, 4):
        body_params["uri"] = draw(st.sampled_from(NAMES))
    if not one_in(draw, 10):
        body_params["_meta"] = meta() if not one_in(draw, 3) else draw(tweaked_metas)
    elif not one_in(draw, 2):
        body_params["_meta"] = draw(json_values)
    message["params"] = body_params
    name = body_params.get("name", body_params.get("uri"))
    mirrored = name if isinstance(name, str) and not one_in(draw, 5) else None
    headers = good_headers(method, mirrored)
    arguments = body_params.get("arguments")
    for arg in ("region", "count"):
        if isinstance(arguments, dict) and arg in arguments and not one_in(draw, 5):
            value = arguments[arg]
            text = value if isinstance(value, str) else json.dumps(value)
            headers.append((f"mcp-param-{arg}".encode(), encode_header_value(text).encode()))
    return message, headers


HEADER_NAMES = [
    b"host",
    b"origin",
    b"content-type",
    b"accept",
    b"content-length",
    b"mcp-protocol-version",
    b"mcp-method",
    b"mcp-name",
    b"mcp-param-region",
    b"mcp-param-count",
    b"mcp-session-id",
]


# -- fast ASGI-level fuzz --------------------------------------------------------------------------


@FAST
@given(st.binary(max_size=300))
async def test_arbitrary_bytes(data: bytes) -> None:
    check_reply(await asgi(TRANSPORT, headers=good_headers("x"), chunks=[data]))
    await still_serving()


@FAST
@given(json_values)
async def test_arbitrary_json_values(value: Any) -> None:
    check_reply(
        await asgi(TRANSPORT, headers=good_headers("x"), chunks=[json.dumps(value).encode()])
    )
    await still_serving()


@FAST
@given(rpc_messages(), st.integers(min_value=1, max_value=4))
async def test_arbitrary_requests(
    case: tuple[dict[str, Any], list[tuple[bytes, bytes]]], pieces: int
) -> None:
    message, headers = case
    data = json.dumps(message).encode()
    size = max(1, len(data) // pieces)
    chunks = [data[i : i + size] for i in range(0, len(data), size)]
    check_reply(await asgi(TRANSPORT, headers=headers, chunks=chunks))
    await still_serving()


@FAST
@given(
    st.lists(st.tuples(st.sampled_from(HEADER_NAMES), st.binary(max_size=40)), max_size=6),
    st.sampled_from([b"server/discover", b"tools/call"]),
)
async def test_arbitrary_header_values(extra: list[tuple[bytes, bytes]], method: bytes) -> None:
    names = {name for name, _ in extra}
    message = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": method.decode(),
        "params": {"name": "echo", "arguments": {"text": "x"}, "_meta": meta()},
    }
    base = [(n, v) for n, v in good_headers(method.decode(), "echo") if n not in names]
    check_reply(await asgi(TRANSPORT, headers=base + extra, chunks=[json.dumps(message).encode()]))
    await still_serving()


@FAST
@given(
    st.sampled_from(["GET", "POST", "DELETE", "PUT", "OPTIONS", "HEAD"]) | st.text(max_size=8),
    st.sampled_from(["/mcp", "/mcp/", "/", ""]) | st.text(max_size=20),
)
async def test_arbitrary_methods_and_paths(method: str, path: str) -> None:
    reply = await asgi(
        TRANSPORT, method=method, path=path, headers=good_headers("server/discover"), chunks=[GOOD]
    )
    assert reply.status < 500
    if path.rstrip("/") != "/mcp":
        assert reply.status == 404
    elif method.upper() != "POST":
        assert reply.status == 405
        assert reply.headers["allow"] == "POST"
    await still_serving()


@settings(max_examples=50, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=200), min_size=1, max_size=6))
async def test_chunked_bodies_respect_the_limit(chunks: list[bytes]) -> None:
    small = HttpTransport(APP, HttpOptions(max_body_bytes=256))
    reply = await asgi(small, headers=good_headers("x"), chunks=chunks)
    check_reply(reply)
    if sum(len(chunk) for chunk in chunks) > 256:
        assert reply.status == 413


# -- decoders: only the documented errors ----------------------------------------------------------


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_parse_message_only_raises_message_error(data: bytes) -> None:
    try:
        message = parse_message(data)
    except MessageError as error:
        assert error.code in (-32700, -32600)
        assert error.request_id is None or isinstance(error.request_id, str | int)
        return
    assert isinstance(message, Request | Notification)
    try:
        parse_request_meta(message.params)
    except InvalidParams as error:
        assert error.code == -32602


@settings(max_examples=300, deadline=None)
@given(
    json_values
    | st.builds(
        lambda p, m, i: {"jsonrpc": "2.0", "method": m, "id": i, "params": p},
        json_values,
        json_values,
        json_values,
    )
)
def test_parse_message_of_json_values(value: Any) -> None:
    try:
        message = parse_message(json.dumps(value))
    except MessageError as error:
        # -32700 only for a number no double can hold, which the wire refuses (issue 18).
        assert error.code == (-32700 if beyond_doubles(value) else -32600), error.message
        return
    assert isinstance(message, Request | Notification)
    assert isinstance(message.method, str) and message.method
    assert message.params is None or isinstance(message.params, dict)


def beyond_doubles(value: Any) -> bool:
    if isinstance(value, int) and not isinstance(value, bool):
        return abs(value) > sys.float_info.max
    if isinstance(value, list):
        return any(beyond_doubles(item) for item in value)
    if isinstance(value, dict):
        return any(beyond_doubles(item) for item in value.values())
    return False


def test_parse_message_of_deep_nesting() -> None:
    for data in (b"[" * 100_000, b'{"a":' * 100_000, b"[" * 900 + b"]" * 900):
        try:
            parse_message(data)
        except MessageError as error:
            assert error.code in (-32700, -32600)


# -- a few examples against a real socket ----------------------------------------------------------

REAL = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    database=None,
)
FUZZED_HEADERS = [
    "origin",
    "content-type",
    "accept",
    "mcp-protocol-version",
    "mcp-method",
    "mcp-name",
]
# What an HTTP client can put on the wire (h11 refuses surrounding whitespace).
printable = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=30).map(
    str.strip
)


async def test_real_socket_fuzz(http_server: Callable[..., Awaitable[str]]) -> None:
    app = build_app()
    base = await http_server(app, HttpOptions(max_body_bytes=4096))
    url = base + "/mcp"
    port = int(base.rsplit(":", 1)[1])

    async with httpx.AsyncClient(timeout=5) as client:

        async def post(content: bytes, headers: dict[str, str]) -> httpx.Response:
            with trio.fail_after(5):
                return await client.post(url, content=content, headers=headers)

        async def garbage(data: bytes) -> None:
            with trio.fail_after(5):
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                await stream.send_all(data)
                await stream.aclose()

        async def alive() -> None:
            headers = {k.decode(): v.decode() for k, v in good_headers("server/discover")}
            del headers["host"]
            response = await post(GOOD, headers)
            assert response.status_code == 200

        counts = {"posts": 0, "garbage": 0}

        def examples() -> None:
            @REAL
            @given(
                rpc_messages() | st.binary(max_size=200),
                st.dictionaries(st.sampled_from(FUZZED_HEADERS), printable, max_size=3),
            )
            def post_example(
                case: tuple[dict[str, Any], list[tuple[bytes, bytes]]] | bytes,
                extra: dict[str, str],
            ) -> None:
                if isinstance(case, bytes):
                    content, pairs = case, good_headers("tools/call", "echo")
                else:
                    content, pairs = json.dumps(case[0]).encode(), case[1]
                headers = {k.decode(): v.decode("latin-1") for k, v in pairs if k != b"host"}
                headers.update(extra)
                response = trio.from_thread.run(post, content, headers)
                check_reply(Reply(response.status_code, dict(response.headers), response.content))
                trio.from_thread.run(alive)
                counts["posts"] += 1

            @REAL
            @given(st.binary(min_size=1, max_size=300))
            def garbage_example(data: bytes) -> None:
                trio.from_thread.run(garbage, data)
                trio.from_thread.run(alive)
                counts["garbage"] += 1

            post_example()
            garbage_example()

        await trio.to_thread.run_sync(examples)
        await alive()
    assert counts["posts"] >= 10 and counts["garbage"] >= 10
