"""The dispatcher, called directly: validation order, result shaping, errors and gating."""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable, Mapping
from typing import Annotated, Any

import pytest
import trio

from tritask.jsonrpc import InvalidParams, JSONValue, Request, dumps
from tritask.protocol.headers import HeaderView
from tritask.protocol.meta import (
    CLIENT_CAPABILITIES_KEY,
    LOG_LEVEL_KEY,
    PROTOCOL_VERSION_KEY,
    SERVER_INFO_KEY,
)
from tritask.protocol.wire import CallToolResult, TextContent
from tritask.server import (
    App,
    Context,
    Extension,
    InputRequired,
    ToolError,
    elicitation,
    invocation,
    list_roots,
    sampling,
)
from tritask.server.dispatcher import Dispatcher

V = "2026-07-28"
SERVER_INFO = {"name": "test-app", "version": "0.0.1"}
EXT = "test.example/items"
SENTINEL = object()


def b64(text: str) -> str:
    return "=?base64?" + base64.b64encode(text.encode("utf-8")).decode("ascii") + "?="


def meta(caps: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    return {PROTOCOL_VERSION_KEY: V, CLIENT_CAPABILITIES_KEY: caps or {}, **extra}


def level_meta(level: str) -> dict[str, Any]:
    return {**meta(), LOG_LEVEL_KEY: level}


def headers(
    method: str | None,
    *,
    version: str | None = V,
    name: str | None = None,
    extra: tuple[tuple[str, str], ...] = (),
) -> HeaderView:
    pairs: list[tuple[str, str]] = []
    if version is not None:
        pairs.append(("MCP-Protocol-Version", version))
    if method is not None:
        pairs.append(("Mcp-Method", method))
    if name is not None:
        pairs.append(("Mcp-Name", name))
    pairs.extend(extra)
    return HeaderView.from_pairs(pairs)


class Recorder:
    """An ``emit`` that keeps what a handler streamed."""

    def __init__(self) -> None:
        self.messages: list[dict[str, JSONValue]] = []

    async def __call__(self, message: dict[str, JSONValue]) -> None:
        self.messages.append(message)

    def of(self, method: str) -> list[dict[str, JSONValue]]:
        return [m["params"] for m in self.messages if m["method"] == method]


async def call(
    app: App,
    method: str,
    params: dict[str, Any] | None = None,
    *,
    meta_: Any = SENTINEL,
    hv: HeaderView | None = None,
    request_id: str | int = 1,
    emit: Recorder | None = None,
    principal: Any = None,
) -> dict[str, Any]:
    body = dict(params or {})
    if meta_ is SENTINEL:
        body["_meta"] = meta()
    elif meta_ is not None:
        body["_meta"] = meta_
    return await Dispatcher(app).handle_request(
        Request(id=request_id, method=method, params=body),
        headers=hv,
        emit=emit,
        principal=principal,
    )


def error_of(response: dict[str, Any], code: int) -> dict[str, Any]:
    assert "result" not in response, response
    error: dict[str, Any] = response["error"]
    assert error["code"] == code, error
    return error


def result_of(response: dict[str, Any]) -> dict[str, Any]:
    assert "error" not in response, response
    result: dict[str, Any] = response["result"]
    assert result["_meta"][SERVER_INFO_KEY] == SERVER_INFO
    return result


class ItemsExtension(Extension):
    """A tiny extension with one negotiated method whose Mcp-Name mirrors ``itemId``."""

    id = EXT

    def methods(self) -> Mapping[str, Any]:
        return {"items/get": self._get, "items/ask": self._ask}

    def name_source(self, method: str) -> str | None:
        return "itemId" if method in self.methods() else None

    async def _get(self, params: dict[str, JSONValue], ctx: Context) -> dict[str, JSONValue]:
        item = params.get("itemId")
        if item != "known":
            raise InvalidParams("Unknown item", {"itemId": item})
        return {"itemId": item}

    async def _ask(self, params: dict[str, JSONValue], ctx: Context) -> dict[str, JSONValue]:
        asked = InputRequired({"q": elicitation("?", {"type": "object"})})
        return invocation.input_required_result(asked, ctx)


@pytest.fixture
def calls() -> list[str]:
    return []


@pytest.fixture
def app(make_app: Callable[..., App], calls: list[str]) -> App:
    app = make_app(instructions="Test instructions.", cache_ttl_ms=5000, cache_scope="public")

    @app.tool()
    async def echo(text: str) -> str:
        """Echo the text."""
        calls.append(f"echo:{text}")
        return text

    @app.tool()
    async def add(a: float, b: float) -> dict[str, float]:
        """Add two numbers."""
        calls.append("add")
        return {"sum": a + b}

    @app.tool()
    async def explode() -> str:
        """Fail with a secret in the exception."""
        raise RuntimeError("secret-db-password-hunter2")

    @app.tool()
    async def refuse(reason: str = "bad input") -> str:
        """Report a domain error."""
        raise ToolError(reason)

    @app.tool()
    async def with_meta() -> CallToolResult:
        """Return a result carrying its own _meta."""
        return CallToolResult(content=(TextContent(text="m"),), meta={"test.example/x": 1})

    @app.tool()
    async def regional(
        region: Annotated[str, {"x-mcp-header": "Region"}],
        count: Annotated[int, {"x-mcp-header": "Count"}] = 1,
    ) -> str:
        """A tool whose arguments are mirrored into Mcp-Param-* headers."""
        return f"{region}x{count}"

    @app.tool()
    async def steps(ctx: Context) -> str:
        """Report progress, including non-increasing values that must be dropped."""
        for value in (1, 1, 0.5, 2, 3):
            await ctx.progress(value, 3, f"at {value}")
        return "done"

    @app.tool()
    async def chatty(ctx: Context) -> str:
        """Log at several levels."""
        for level in ("debug", "info", "warning", "error"):
            await ctx.log(level, {"level": level}, logger="chatty")
        return "logged"

    @app.tool()
    async def ask(ctx: Context, kind: str = "form") -> Any:
        """Ask the client for input (MRTR)."""
        answer = ctx.input_response("answer")
        if answer is not None:
            return {"answer": answer, "state": ctx.request_state}
        if kind == "form":
            request = elicitation("Your name?", {"type": "object", "properties": {}})
        elif kind == "url":
            request = {
                "method": "elicitation/create",
                "params": {"mode": "url", "message": "Go", "url": "https://example.com"},
            }
        elif kind == "sampling":
            request = sampling([{"role": "user", "content": {"type": "text", "text": "hi"}}], 10)
        else:
            request = list_roots()
        return InputRequired({"answer": request}, {"attempt": 1, "kind": kind})

    @app.prompt()
    async def greet(name: str, style: str = "warm") -> str:
        """Greet someone."""
        return f"Greet {name}, {style}."

    @app.prompt(name="ask")
    async def ask_prompt(ctx: Context) -> Any:
        """A prompt that needs input first."""
        if ctx.input_response("answer") is None:
            return InputRequired({"answer": elicitation("?", {"type": "object"})}, "p")
        return "thanks"

    @app.resource("demo://readme", mime_type="text/plain")
    async def readme() -> str:
        """The readme."""
        return "read me"

    @app.resource("demo://items/{item}")
    async def item(item: str) -> str:
        """One item."""
        return f"item {item}"

    @app.resource("demo://ask")
    async def ask_resource(ctx: Context) -> Any:
        """A resource that needs input first."""
        if ctx.input_response("answer") is None:
            return InputRequired({"answer": list_roots()})
        return "answered"

    @app.completion("ref/prompt", "greet")
    async def complete_greet(argument: str, value: str, context: Any) -> list[str]:
        return [n for n in ("alice", "albert", "bob") if n.startswith(value)]

    @app.completion("ref/resource", "demo://items/{item}")
    async def complete_bad(argument: str, value: str, context: Any) -> Any:
        return InputRequired({"answer": elicitation("?", {"type": "object"})})

    app.add_extension(ItemsExtension())
    return app


# -- validation order (1.8.6) ------------------------------------------------------------------


async def test_missing_version_header_comes_first(app: App) -> None:
    # Step 4 precedes step 5: even a body without _meta gets -32020 when the header is absent.
    response = await call(app, "tools/list", meta_=None, hv=headers("tools/list", version=None))
    error = error_of(response, -32020)
    assert error["message"] == "The MCP-Protocol-Version header is required"
    assert response["id"] == 1


@pytest.mark.parametrize(
    ("meta_", "message"),
    [
        (
            None,
            f"params._meta is required and must carry {PROTOCOL_VERSION_KEY} "
            f"and {CLIENT_CAPABILITIES_KEY}",
        ),
        ({CLIENT_CAPABILITIES_KEY: {}}, f"params._meta is missing {PROTOCOL_VERSION_KEY}"),
        ({PROTOCOL_VERSION_KEY: V}, f"params._meta is missing {CLIENT_CAPABILITIES_KEY}"),
    ],
)
@pytest.mark.parametrize("with_headers", [True, False])
async def test_missing_meta_fields_are_invalid_params(
    app: App, meta_: dict[str, Any] | None, message: str, with_headers: bool
) -> None:
    # Step 5 precedes step 6: the present header "mismatches" the absent body version, but the
    # answer is still -32602.
    hv = headers("tools/list") if with_headers else None
    error = error_of(await call(app, "tools/list", meta_=meta_, hv=hv, request_id="r-1"), -32602)
    assert error["message"] == message


async def test_params_absent_entirely(app: App) -> None:
    response = await Dispatcher(app).handle_request(
        Request(id=3, method="server/discover"), headers=headers("server/discover")
    )
    assert error_of(response, -32602)["message"].startswith("params._meta is required")
    assert response["id"] == 3


async def test_header_version_differs_from_body_version(app: App) -> None:
    response = await call(
        app,
        "tools/list",
        meta_=meta() | {PROTOCOL_VERSION_KEY: "v999.0.0"},
        hv=headers("tools/list"),
    )
    error = error_of(response, -32020)
    assert error["message"] == (
        "The MCP-Protocol-Version header does not match "
        "params._meta io.modelcontextprotocol/protocolVersion"
    )


@pytest.mark.parametrize("method", ["tools/list", "no/such-method", "initialize"])
@pytest.mark.parametrize("with_headers", [True, False])
async def test_unsupported_version(app: App, method: str, with_headers: bool) -> None:
    # Step 7 precedes the method lookup (step 9).
    hv = headers(method, version="v999.0.0") if with_headers else None
    response = await call(app, method, meta_=meta() | {PROTOCOL_VERSION_KEY: "v999.0.0"}, hv=hv)
    error = error_of(response, -32022)
    assert error["message"] == "Unsupported protocol version; supported: 2026-07-28"
    assert error["data"] == {"supported": ["2026-07-28"], "requested": "v999.0.0"}


async def test_unsupported_version_beats_a_bad_optional_field(app: App) -> None:
    bad = level_meta("loud") | {PROTOCOL_VERSION_KEY: "2025-11-25"}
    error = error_of(await call(app, "tools/list", meta_=bad), -32022)
    assert error["data"] == {"supported": ["2026-07-28"], "requested": "2025-11-25"}
    error = error_of(await call(app, "tools/list", meta_=level_meta("loud")), -32602)
    assert error["message"].startswith(f"params._meta {LOG_LEVEL_KEY} must be one of")


@pytest.mark.parametrize(
    ("hv", "message"),
    [
        (headers(None), "The Mcp-Method header is required"),
        (headers("tools/call"), "The Mcp-Method header does not match the request method"),
        (headers("TOOLS/LIST"), "The Mcp-Method header does not match the request method"),
        (
            headers("tools/list", extra=(("mcp-method", "tools/list"),)),
            "Header Mcp-Method must not be repeated",
        ),
        (headers("tools/list\x01"), "Header Mcp-Method contains invalid characters"),
    ],
)
async def test_method_header_rules(app: App, hv: HeaderView, message: str) -> None:
    error = error_of(await call(app, "tools/list", hv=hv), -32020)
    assert error["message"] == message


async def test_method_header_checked_before_method_lookup(app: App) -> None:
    # Step 8 precedes step 9: an unknown method without Mcp-Method is a header mismatch.
    error_of(await call(app, "no/such-method", hv=headers(None)), -32020)
    error = error_of(await call(app, "no/such-method", hv=headers("no/such-method")), -32601)
    assert error["message"] == "Method not found: no/such-method"


async def test_method_header_accepts_sentinel_and_whitespace(app: App) -> None:
    result_of(await call(app, "tools/list", hv=headers(b64("tools/list"))))
    result_of(await call(app, "tools/list", hv=headers("  tools/list\t")))


@pytest.mark.parametrize(
    ("method", "params", "name", "message"),
    [
        (
            "tools/call",
            {"name": "echo", "arguments": {"text": "x"}},
            None,
            "The Mcp-Name header is required and must mirror params.name",
        ),
        (
            "tools/call",
            {"name": "echo", "arguments": {"text": "x"}},
            "add",
            "The Mcp-Name header does not match params.name",
        ),
        (
            "tools/call",
            {"name": "echo", "arguments": {"text": "x"}},
            "Echo",
            "The Mcp-Name header does not match params.name",
        ),
        (
            "prompts/get",
            {"name": "greet"},
            None,
            "The Mcp-Name header is required and must mirror params.name",
        ),
        (
            "resources/read",
            {"uri": "demo://readme"},
            "demo://other",
            "The Mcp-Name header does not match params.uri",
        ),
        (
            "resources/read",
            {"uri": "demo://items/✓"},
            "demo://items/✓",
            "Header Mcp-Name contains invalid characters",
        ),
        (
            "resources/read",
            {"uri": "demo://readme"},
            "=?base64?ZGVtbzovL3JlYWRtZQ?=",
            "Header Mcp-Name has an invalid base64 value",
        ),
        (
            "resources/read",
            {"uri": "demo://readme"},
            "=?base64?ZGVtbzovL3JlYW!tZQ==?=",
            "Header Mcp-Name has an invalid base64 value",
        ),
        (
            "tools/call",
            {"arguments": {}},
            "echo",
            "The Mcp-Name header is set but params.name is absent",
        ),
        ("tools/call", {"name": 7}, "7", "The Mcp-Name header does not match params.name"),
    ],
)
async def test_name_header_rules(
    app: App, method: str, params: dict[str, Any], name: str | None, message: str
) -> None:
    error = error_of(await call(app, method, params, hv=headers(method, name=name)), -32020)
    assert error["message"] == message


async def test_repeated_name_header(app: App) -> None:
    hv = headers("tools/call", name="echo", extra=(("mcp-name", "echo"),))
    params = {"name": "echo", "arguments": {"text": "x"}}
    error = error_of(await call(app, "tools/call", params, hv=hv), -32020)
    assert error["message"] == "Header Mcp-Name must not be repeated"


async def test_name_header_accepted_forms(app: App) -> None:
    params = {"name": "echo", "arguments": {"text": "hi"}}
    for name in ("echo", " echo ", b64("echo")):
        result = result_of(
            await call(app, "tools/call", params, hv=headers("tools/call", name=name))
        )
        assert result["content"] == [{"type": "text", "text": "hi"}]
    uri = "demo://items/✓"
    result = result_of(
        await call(app, "resources/read", {"uri": uri}, hv=headers("resources/read", name=b64(uri)))
    )
    assert result["contents"] == [{"uri": uri, "text": "item ✓"}]
    # Methods without a name source ignore a stray Mcp-Name (it is still well-formed).
    result_of(await call(app, "tools/list", hv=headers("tools/list", name="whatever")))


async def test_unknown_tool_with_matching_headers(app: App) -> None:
    response = await call(
        app, "tools/call", {"name": "nope", "arguments": {}}, hv=headers("tools/call", name="nope")
    )
    error = error_of(response, -32602)
    assert error == {"code": -32602, "message": "Unknown tool: nope", "data": {"name": "nope"}}


@pytest.mark.parametrize(
    ("arguments", "extra", "message"),
    [
        ({"region": "eu"}, (), "Header Mcp-Param-Region is required for argument 'region'"),
        (
            {"region": "eu"},
            (("Mcp-Param-Region", "us"),),
            "Header Mcp-Param-Region does not match argument 'region'",
        ),
        (
            {"region": "eu", "count": 2},
            (("Mcp-Param-Region", "eu"),),
            "Header Mcp-Param-Count is required for argument 'count'",
        ),
        (
            {"region": "eu"},
            (("Mcp-Param-Region", "eu"), ("Mcp-Param-Count", "1")),
            "Header Mcp-Param-Count is set but argument 'count' is absent",
        ),
        (
            {"region": "eu", "count": 2},
            (("Mcp-Param-Region", "eu"), ("Mcp-Param-Count", "3")),
            "Header Mcp-Param-Count does not match argument 'count'",
        ),
        (
            {"region": "eu", "count": 10**400},
            (("Mcp-Param-Region", "eu"), ("Mcp-Param-Count", "1")),
            "Header Mcp-Param-Count does not match argument 'count'",
        ),
    ],
)
async def test_param_header_rules(
    app: App, arguments: dict[str, Any], extra: tuple[tuple[str, str], ...], message: str
) -> None:
    params = {"name": "regional", "arguments": arguments}
    hv = headers("tools/call", name="regional", extra=extra)
    error = error_of(await call(app, "tools/call", params, hv=hv), -32020)
    assert error["message"] == message


async def test_param_headers_accepted(app: App) -> None:
    params = {"name": "regional", "arguments": {"region": "zürich", "count": 2}}
    extra = (("mcp-param-region", b64("zürich")), ("MCP-PARAM-COUNT", "2.0"))
    result = result_of(
        await call(
            app, "tools/call", params, hv=headers("tools/call", name="regional", extra=extra)
        )
    )
    assert result["content"] == [{"type": "text", "text": "zürichx2"}]
    # No headers (stdio): nothing to mirror.
    result = result_of(await call(app, "tools/call", params))
    assert result["content"] == [{"type": "text", "text": "zürichx2"}]


async def test_extension_capability_before_method_params(app: App) -> None:
    # Step 10 precedes step 11: an undeclared extension is -32021 before the unknown item -32602.
    params = {"itemId": "missing"}
    error = error_of(await call(app, "items/get", params), -32021)
    assert error["message"] == "Missing required client capability"
    assert error["data"] == {"requiredCapabilities": {"extensions": {EXT: {}}}}
    declared = meta({"extensions": {EXT: {}}})
    error = error_of(await call(app, "items/get", params, meta_=declared), -32602)
    assert error == {"code": -32602, "message": "Unknown item", "data": {"itemId": "missing"}}
    result = result_of(await call(app, "items/get", {"itemId": "known"}, meta_=declared))
    assert result["itemId"] == "known"


async def test_extension_name_source_is_checked(app: App) -> None:
    declared = meta({"extensions": {EXT: {}}})
    params = {"itemId": "known"}
    error = error_of(
        await call(app, "items/get", params, meta_=declared, hv=headers("items/get")), -32020
    )
    assert error["message"] == "The Mcp-Name header is required and must mirror params.itemId"
    hv = headers("items/get", name=b64("known"))
    assert result_of(await call(app, "items/get", params, meta_=declared, hv=hv))["itemId"] == (
        "known"
    )


class LenientItemsExtension(ItemsExtension):
    """The same methods, but a missing ``Mcp-Name`` is forgiven (the generic hook)."""

    def name_header_optional(self, method: str) -> bool:
        return method == "items/get"


async def test_extension_may_make_the_name_header_optional(make_app: Callable[..., App]) -> None:
    app = make_app()
    app.add_extension(LenientItemsExtension())
    declared = meta({"extensions": {EXT: {}}})
    params = {"itemId": "known"}
    bare = headers("items/get")
    assert result_of(await call(app, "items/get", params, meta_=declared, hv=bare))["itemId"] == (
        "known"
    )
    error = error_of(
        await call(app, "items/get", params, meta_=declared, hv=headers("items/get", name="x")),
        -32020,
    )
    assert error["message"] == "The Mcp-Name header does not match params.itemId"
    # Only the method the extension named is lenient; the rest of the rule is unchanged.
    error = error_of(
        await call(app, "items/ask", params, meta_=declared, hv=headers("items/ask")), -32020
    )
    assert error["message"] == "The Mcp-Name header is required and must mirror params.itemId"
    error = error_of(await call(app, "items/get", params, meta_=declared, hv=headers(None)), -32020)
    assert error["message"] == "The Mcp-Method header is required"


async def test_extension_settings_are_negotiated(app: App) -> None:
    declared = meta({"extensions": {EXT: {"mode": "fast"}}})
    error = error_of(await call(app, "items/get", {"itemId": "known"}, meta_=declared), -32602)
    assert error["message"] == f"The {EXT} extension defines no settings"


# -- unknown and removed methods ---------------------------------------------------------------


@pytest.mark.parametrize(
    "method",
    [
        "initialize",
        "ping",
        "logging/setLevel",
        "resources/subscribe",
        "resources/unsubscribe",
        "tasks/list",
        "tasks/result",
        "tasks/get",
        "notifications/initialized",
        "no/such-method",
        "",
    ],
)
@pytest.mark.parametrize("with_headers", [True, False])
async def test_unknown_and_removed_methods(app: App, method: str, with_headers: bool) -> None:
    hv = headers(method) if with_headers and method else None
    response = await call(app, method, hv=hv, request_id="abc")
    error = error_of(response, -32601)
    assert error == {"code": -32601, "message": f"Method not found: {method}"}
    assert response == {"jsonrpc": "2.0", "id": "abc", "error": error}


# -- capability gating ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "params"),
    [
        ("tools/list", {}),
        ("tools/call", {"name": "echo", "arguments": {"text": "x"}}),
        ("prompts/list", {}),
        ("prompts/get", {"name": "greet"}),
        ("resources/list", {}),
        ("resources/templates/list", {}),
        ("resources/read", {"uri": "demo://readme"}),
        ("completion/complete", {"ref": {"type": "ref/prompt", "name": "g"}, "argument": {}}),
    ],
)
async def test_empty_app_gates_methods(
    make_app: Callable[..., App], method: str, params: dict[str, Any]
) -> None:
    empty = make_app()
    error_of(await call(empty, method, params), -32601)
    discovered = result_of(await call(empty, "server/discover"))
    assert discovered["capabilities"] == {}


async def test_gating_follows_registration(make_app: Callable[..., App]) -> None:
    app = make_app()
    error_of(await call(app, "tools/list"), -32601)

    async def late() -> str:
        """Registered late."""
        return "late"

    app.add_tool(late)
    assert [t["name"] for t in result_of(await call(app, "tools/list"))["tools"]] == ["late"]
    app.remove_tool("late")
    error_of(await call(app, "tools/list"), -32601)


# -- result shaping ------------------------------------------------------------------------------

CACHEABLE: list[tuple[str, dict[str, Any]]] = [
    ("server/discover", {}),
    ("tools/list", {}),
    ("prompts/list", {}),
    ("resources/list", {}),
    ("resources/templates/list", {}),
    ("resources/read", {"uri": "demo://readme"}),
]
NOT_CACHEABLE: list[tuple[str, dict[str, Any]]] = [
    ("tools/call", {"name": "echo", "arguments": {"text": "x"}}),
    ("prompts/get", {"name": "greet", "arguments": {"name": "Ann"}}),
    (
        "completion/complete",
        {
            "ref": {"type": "ref/prompt", "name": "greet"},
            "argument": {"name": "name", "value": "al"},
        },
    ),
]


@pytest.mark.parametrize(("method", "params"), CACHEABLE + NOT_CACHEABLE)
async def test_every_result_has_result_type_and_server_info(
    app: App, method: str, params: dict[str, Any]
) -> None:
    response = await call(app, method, params, request_id=f"id-{method}")
    assert response["jsonrpc"] == "2.0"
    assert response["id"] == f"id-{method}"
    result = result_of(response)
    assert result["resultType"] == "complete"


@pytest.mark.parametrize(("method", "params"), CACHEABLE)
async def test_cacheable_results_carry_ttl_and_scope(
    app: App, method: str, params: dict[str, Any]
) -> None:
    result = result_of(await call(app, method, params))
    assert result["ttlMs"] == 5000
    assert result["cacheScope"] == "public"


@pytest.mark.parametrize(("method", "params"), NOT_CACHEABLE)
async def test_other_results_carry_no_cache_fields(
    app: App, method: str, params: dict[str, Any]
) -> None:
    result = result_of(await call(app, method, params))
    assert "ttlMs" not in result
    assert "cacheScope" not in result


async def test_default_cache_fields(make_app: Callable[..., App]) -> None:
    result = result_of(await call(make_app(), "server/discover"))
    assert (result["ttlMs"], result["cacheScope"]) == (0, "private")


async def test_discover(app: App) -> None:
    result = result_of(await call(app, "server/discover"))
    assert result == {
        "supportedVersions": ["2026-07-28"],
        "capabilities": {
            "tools": {"listChanged": True},
            "prompts": {"listChanged": True},
            "resources": {"listChanged": True, "subscribe": True},
            "completions": {},
            "extensions": {EXT: {}},
        },
        "instructions": "Test instructions.",
        "ttlMs": 5000,
        "cacheScope": "public",
        "resultType": "complete",
        "_meta": {SERVER_INFO_KEY: SERVER_INFO},
    }


async def test_tools_list_shape(app: App) -> None:
    tools = result_of(await call(app, "tools/list"))["tools"]
    assert [tool["name"] for tool in tools] == [
        "echo",
        "add",
        "explode",
        "refuse",
        "with_meta",
        "regional",
        "steps",
        "chatty",
        "ask",
    ]
    assert tools[0] == {
        "name": "echo",
        "description": "Echo the text.",
        "inputSchema": {
            "type": "object",
            "properties": {"text": {"type": "string"}},
            "required": ["text"],
            "additionalProperties": False,
        },
    }


async def test_cursor_is_refused(app: App) -> None:
    error = error_of(await call(app, "tools/list", {"cursor": "abc"}), -32602)
    assert error["message"] == "Invalid cursor: this server returns complete lists"


async def test_handler_meta_is_merged_with_server_info(app: App) -> None:
    result = result_of(await call(app, "tools/call", {"name": "with_meta"}))
    assert result["_meta"] == {"test.example/x": 1, SERVER_INFO_KEY: SERVER_INFO}
    assert result["content"] == [{"type": "text", "text": "m"}]


# -- tools/call outcomes -------------------------------------------------------------------------


async def test_tool_call_success(app: App) -> None:
    result = result_of(
        await call(app, "tools/call", {"name": "add", "arguments": {"a": 1, "b": 2}})
    )
    assert result == {
        "content": [{"type": "text", "text": '{"sum":3}'}],
        "structuredContent": {"sum": 3},
        "isError": False,
        "resultType": "complete",
        "_meta": {SERVER_INFO_KEY: SERVER_INFO},
    }


@pytest.mark.parametrize(
    ("arguments", "text"),
    [
        ({"a": "x", "b": 2}, "Invalid arguments for tool add: a: 'x' is not of type 'number'"),
        ({"a": 1}, "Invalid arguments for tool add: arguments: 'b' is a required property"),
        (
            None,
            "Invalid arguments for tool add: arguments: 'a' is a required property; "
            "arguments: 'b' is a required property",
        ),
    ],
)
async def test_invalid_arguments_are_an_is_error_result(
    app: App, calls: list[str], arguments: Any, text: str
) -> None:
    params: dict[str, Any] = {"name": "add"}
    if arguments is not None:
        params["arguments"] = arguments
    result = result_of(await call(app, "tools/call", params))
    assert result["isError"] is True
    assert result["resultType"] == "complete"
    assert result["content"] == [{"type": "text", "text": text}]
    assert calls == []  # the tool never ran


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({}, "tools/call requires a non-empty string params.name"),
        ({"name": ""}, "tools/call requires a non-empty string params.name"),
        ({"name": ["echo"]}, "tools/call requires a non-empty string params.name"),
        ({"name": "echo", "arguments": ["x"]}, "tools/call params.arguments must be an object"),
        ({"name": "echo", "arguments": "x"}, "tools/call params.arguments must be an object"),
    ],
)
async def test_bad_tool_call_params(app: App, params: dict[str, Any], message: str) -> None:
    error = error_of(await call(app, "tools/call", params), -32602)
    assert error["message"] == message


async def test_unknown_tool(app: App) -> None:
    error = error_of(await call(app, "tools/call", {"name": "nope"}), -32602)
    assert error == {"code": -32602, "message": "Unknown tool: nope", "data": {"name": "nope"}}


async def test_tool_error_is_an_is_error_result(app: App) -> None:
    result = result_of(
        await call(app, "tools/call", {"name": "refuse", "arguments": {"reason": "no such city"}})
    )
    assert result["isError"] is True
    assert result["content"] == [{"type": "text", "text": "no such city"}]
    assert result["resultType"] == "complete"


async def test_tool_error_inside_a_nursery_is_still_an_is_error_result(
    make_app: Callable[..., App],
) -> None:
    app = make_app()

    @app.tool()
    async def nested() -> str:
        """Raise a domain error from a child task (trio wraps it in an ExceptionGroup)."""

        async def fail() -> None:
            raise ToolError("inner domain error")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fail)
        return "unreachable"

    @app.tool()
    async def mixed() -> str:
        """A ToolError beside a crash is a crash: -32603."""

        async def fail_domain() -> None:
            raise ToolError("domain")

        async def crash() -> None:
            raise RuntimeError("secret crash detail")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fail_domain)
            nursery.start_soon(crash)
        return "unreachable"

    result = result_of(await call(app, "tools/call", {"name": "nested"}))
    assert result["isError"] is True
    assert result["content"] == [{"type": "text", "text": "inner domain error"}]
    response = await call(app, "tools/call", {"name": "mixed"})
    assert error_of(response, -32603) == {"code": -32603, "message": "Internal error"}


async def test_handler_exception_is_a_safe_internal_error(
    app: App, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="tritask.server")
    response = await call(app, "tools/call", {"name": "explode"}, request_id=42)
    assert response == {
        "jsonrpc": "2.0",
        "id": 42,
        "error": {"code": -32603, "message": "Internal error"},
    }
    assert "hunter2" not in dumps(response)
    assert "handler for tools/call (id 42) raised" in caplog.text
    assert "secret-db-password-hunter2" in caplog.text


# -- prompts, resources, completion --------------------------------------------------------------


async def test_prompts(app: App) -> None:
    result = result_of(
        await call(app, "prompts/get", {"name": "greet", "arguments": {"name": "Al"}})
    )
    assert result["messages"] == [
        {"role": "user", "content": {"type": "text", "text": "Greet Al, warm."}}
    ]
    assert result["description"] == "Greet someone."
    listed = result_of(await call(app, "prompts/list"))["prompts"]
    assert listed[0] == {
        "name": "greet",
        "description": "Greet someone.",
        "arguments": [{"name": "name", "required": True}, {"name": "style", "required": False}],
    }


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"name": "nope"}, "Unknown prompt: nope"),
        ({"name": "greet"}, "Missing required prompt arguments: name"),
        ({"name": "greet", "arguments": {"name": "a", "x": "y"}}, "Unknown prompt arguments: x"),
        (
            {"name": "greet", "arguments": {"name": 1}},
            "prompts/get params.arguments must map names to strings",
        ),
        ({}, "prompts/get requires a non-empty string params.name"),
    ],
)
async def test_bad_prompt_requests(app: App, params: dict[str, Any], message: str) -> None:
    assert error_of(await call(app, "prompts/get", params), -32602)["message"] == message


async def test_resources(app: App) -> None:
    result = result_of(await call(app, "resources/read", {"uri": "demo://readme"}))
    assert result["contents"] == [
        {"uri": "demo://readme", "text": "read me", "mimeType": "text/plain"}
    ]
    error = error_of(await call(app, "resources/read", {"uri": "demo://missing"}), -32602)
    assert error == {
        "code": -32602,
        "message": "Resource not found",
        "data": {"uri": "demo://missing"},
    }
    listed = result_of(await call(app, "resources/templates/list"))["resourceTemplates"]
    assert listed == [
        {"uriTemplate": "demo://items/{item}", "name": "item", "description": "One item."}
    ]


async def test_completion(app: App) -> None:
    params = {
        "ref": {"type": "ref/prompt", "name": "greet"},
        "argument": {"name": "name", "value": "al"},
    }
    result = result_of(await call(app, "completion/complete", params))
    assert result["completion"] == {"values": ["alice", "albert"], "hasMore": False}


# -- MRTR: input_required only where allowed, only for declared capabilities -------------------


@pytest.mark.parametrize(
    ("method", "params", "caps"),
    [
        ("tools/call", {"name": "ask"}, {"elicitation": {}}),
        ("prompts/get", {"name": "ask"}, {"elicitation": {}}),
        ("resources/read", {"uri": "demo://ask"}, {"roots": {}}),
    ],
)
async def test_input_required_on_mrtr_methods(
    app: App, method: str, params: dict[str, Any], caps: dict[str, Any]
) -> None:
    result = result_of(await call(app, method, params, meta_=meta(caps)))
    assert result["resultType"] == "input_required"
    assert set(result["inputRequests"]) == {"answer"}
    assert "ttlMs" not in result and "cacheScope" not in result


async def test_input_required_is_never_sent_elsewhere(app: App) -> None:
    params = {
        "ref": {"type": "ref/resource", "uri": "demo://items/{item}"},
        "argument": {"name": "item", "value": ""},
    }
    response = await call(app, "completion/complete", params, meta_=meta({"elicitation": {}}))
    error_of(response, -32603)
    declared = meta({"elicitation": {}, "extensions": {EXT: {}}})
    response = await call(app, "items/ask", {"itemId": "known"}, meta_=declared)
    error = error_of(response, -32603)
    assert error["message"] == "items/ask cannot answer with input_required"


@pytest.mark.parametrize(
    ("kind", "caps", "required"),
    [
        ("form", {}, {"elicitation": {}}),
        ("form", {"sampling": {}, "roots": {}}, {"elicitation": {}}),
        ("url", {"elicitation": {}}, {"elicitation": {"url": {}}}),
        ("url", {"elicitation": {"form": {}}}, {"elicitation": {"url": {}}}),
        ("form", {"elicitation": {"url": {}}}, {"elicitation": {"form": {}}}),
        ("sampling", {"elicitation": {}}, {"sampling": {}}),
        ("roots", {"sampling": {}}, {"roots": {}}),
    ],
)
async def test_input_request_for_undeclared_capability(
    app: App, kind: str, caps: dict[str, Any], required: dict[str, Any]
) -> None:
    params = {"name": "ask", "arguments": {"kind": kind}}
    error = error_of(await call(app, "tools/call", params, meta_=meta(caps)), -32021)
    assert error == {
        "code": -32021,
        "message": "Missing required client capability",
        "data": {"requiredCapabilities": required},
    }


@pytest.mark.parametrize(
    ("kind", "caps"),
    [
        ("form", {"elicitation": {}}),
        ("form", {"elicitation": {"form": {}}}),
        ("url", {"elicitation": {"form": {}, "url": {}}}),
        ("sampling", {"sampling": {}}),
        ("roots", {"roots": {}}),
    ],
)
async def test_input_request_for_declared_capability(
    app: App, kind: str, caps: dict[str, Any]
) -> None:
    params = {"name": "ask", "arguments": {"kind": kind}}
    result = result_of(await call(app, "tools/call", params, meta_=meta(caps)))
    assert result["resultType"] == "input_required"
    assert isinstance(result["requestState"], str)


async def test_mrtr_round_trip(app: App) -> None:
    caps = meta({"elicitation": {}})
    first = result_of(await call(app, "tools/call", {"name": "ask"}, meta_=caps, request_id=1))
    assert first["inputRequests"] == {
        "answer": {
            "method": "elicitation/create",
            "params": {
                "mode": "form",
                "message": "Your name?",
                "requestedSchema": {"type": "object", "properties": {}},
            },
        }
    }
    answer = {"action": "accept", "content": {"name": "Ann"}}
    retry = {
        "name": "ask",
        "inputResponses": {"answer": answer},
        "requestState": first["requestState"],
    }
    second = result_of(await call(app, "tools/call", retry, meta_=caps, request_id=2))
    assert second["resultType"] == "complete"
    assert second["structuredContent"] == {
        "answer": answer,
        "state": {"attempt": 1, "kind": "form"},
    }


async def test_mrtr_state_is_bound(app: App) -> None:
    caps = meta({"elicitation": {}})
    state = result_of(await call(app, "tools/call", {"name": "ask"}, meta_=caps, principal="ann"))[
        "requestState"
    ]
    invalid = {"code": -32602, "message": "requestState is invalid or has expired"}
    # Another principal.
    retry = {"name": "ask", "requestState": state, "inputResponses": {}}
    assert error_of(await call(app, "tools/call", retry, meta_=caps, principal="bob"), -32602) == (
        invalid
    )
    # Another tool.
    other = {"name": "echo", "arguments": {"text": "x"}, "requestState": state}
    assert error_of(await call(app, "tools/call", other, meta_=caps, principal="ann"), -32602) == (
        invalid
    )
    # Another method with the same name.
    prompt = {"name": "ask", "requestState": state}
    assert error_of(
        await call(app, "prompts/get", prompt, meta_=caps, principal="ann"), -32602
    ) == (invalid)
    # Tampered.
    tampered = {"name": "ask", "requestState": state[:-2] + ("AA" if state[-2:] != "AA" else "BB")}
    assert error_of(
        await call(app, "tools/call", tampered, meta_=caps, principal="ann"), -32602
    ) == (invalid)
    # Not a string.
    weird = {"name": "ask", "requestState": {"s": 1}}
    assert error_of(await call(app, "tools/call", weird, meta_=caps), -32602) == invalid
    # The right caller gets through.
    ok = result_of(await call(app, "tools/call", retry, meta_=caps, principal="ann"))
    assert ok["resultType"] == "input_required"  # no answer yet: asked again


async def test_request_state_ignored_outside_mrtr_methods(app: App) -> None:
    result_of(await call(app, "tools/list", {"requestState": "garbage"}))


@pytest.mark.parametrize("responses", [[], "x", {"": {}}, 3])
async def test_bad_input_responses(app: App, responses: Any) -> None:
    params = {"name": "ask", "inputResponses": responses}
    error = error_of(await call(app, "tools/call", params, meta_=meta({"elicitation": {}})), -32602)
    assert error["message"] == "inputResponses must be an object keyed by input request key"


# -- request-scoped notifications ----------------------------------------------------------------


async def test_progress_only_with_token_and_increasing(app: App) -> None:
    emit = Recorder()
    result_of(await call(app, "tools/call", {"name": "steps"}, emit=emit))
    assert emit.messages == []
    result_of(
        await call(app, "tools/call", {"name": "steps"}, meta_=meta(progressToken="p1"), emit=emit)
    )
    assert emit.of("notifications/progress") == [
        {"progressToken": "p1", "progress": 1, "total": 3, "message": "at 1"},
        {"progressToken": "p1", "progress": 2, "total": 3, "message": "at 2"},
        {"progressToken": "p1", "progress": 3, "total": 3, "message": "at 3"},
    ]
    assert all(m["jsonrpc"] == "2.0" and "id" not in m for m in emit.messages)


async def test_progress_without_emit_is_harmless(app: App) -> None:
    result = result_of(
        await call(app, "tools/call", {"name": "steps"}, meta_=meta(progressToken=7))
    )
    assert result["content"] == [{"type": "text", "text": "done"}]


async def test_logging_only_with_log_level(app: App) -> None:
    emit = Recorder()
    result_of(await call(app, "tools/call", {"name": "chatty"}, emit=emit))
    assert emit.messages == []
    result_of(
        await call(
            app,
            "tools/call",
            {"name": "chatty"},
            meta_=level_meta("info"),
            emit=emit,
        )
    )
    assert emit.of("notifications/message") == [
        {"level": "info", "data": {"level": "info"}, "logger": "chatty"},
        {"level": "warning", "data": {"level": "warning"}, "logger": "chatty"},
        {"level": "error", "data": {"level": "error"}, "logger": "chatty"},
    ]
    emit = Recorder()
    result_of(
        await call(
            app,
            "tools/call",
            {"name": "chatty"},
            meta_=level_meta("error"),
            emit=emit,
        )
    )
    assert [p["level"] for p in emit.of("notifications/message")] == ["error"]
