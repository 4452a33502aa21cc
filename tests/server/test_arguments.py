"""The tool-argument contract: the schema a tool advertises and the arguments it takes agree.

Every case here was a ``TypeError`` from ``fn(**arguments)`` before the contract (a 500 on a
direct call, a failed task after one was created), found by the black-box fuzzer of issue 18.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from tritask.jsonrpc import Request
from tritask.protocol.meta import CLIENT_CAPABILITIES_KEY, PROTOCOL_VERSION_KEY
from tritask.server import App, Context
from tritask.server.dispatcher import Dispatcher

V = "2026-07-28"


async def call_tool(app: App, name: str, arguments: Any) -> dict[str, Any]:
    params = {
        "name": name,
        "arguments": arguments,
        "_meta": {PROTOCOL_VERSION_KEY: V, CLIENT_CAPABILITIES_KEY: {}},
    }
    response: dict[str, Any] = await Dispatcher(app).handle_request(
        Request(id=7, method="tools/call", params=params)
    )
    return response


def text_of(response: dict[str, Any]) -> tuple[bool, str]:
    assert "error" not in response, response
    result = response["result"]
    return result["isError"], result["content"][0]["text"]


def error_of(response: dict[str, Any]) -> dict[str, Any]:
    assert "result" not in response, response
    error: dict[str, Any] = response["error"]
    return error


@pytest.fixture
def app(make_app: Callable[..., App]) -> App:
    app = make_app()

    @app.tool()
    async def greet(name: str = "World") -> str:
        """Greet."""
        return f"Hello, {name}!"

    @app.tool()
    async def whoami(ctx: Context, label: str = "") -> str:
        """Has a context parameter, which is not a wire argument."""
        return f"{label}:{ctx.method}"

    @app.tool()
    async def anything(ctx: Context, first: int = 0, **rest: Any) -> str:
        """Takes any extra name."""
        return json.dumps({"first": first, "rest": rest}, sort_keys=True)

    @app.tool(input_schema={"type": "object", "properties": {"name": {"type": "string"}}})
    async def lenient(name: str = "x") -> str:
        """An explicit schema that allows extras; the function takes none."""
        return name

    @app.tool(input_schema={"type": "object", "properties": {"name": {"type": "string"}}})
    async def lenient_kwargs(**arguments: Any) -> str:
        """An explicit schema that allows extras; the function takes them all."""
        return json.dumps(arguments, sort_keys=True)

    @app.tool(
        input_schema={
            "type": "object",
            "properties": {"name": {"type": "string"}},
            "additionalProperties": False,
        }
    )
    async def strict_kwargs(**arguments: Any) -> str:
        """An explicit schema that forbids extras, on a **kwargs function."""
        return json.dumps(arguments, sort_keys=True)

    @app.tool(input_schema={"type": "object", "properties": {"size": {"type": "integer"}}})
    async def underspecified(size: int) -> str:
        """An explicit schema that does not require what the function requires."""
        return str(size)

    return app


def test_generated_schemas_say_whether_extras_are_taken(app: App) -> None:
    assert app.tools["greet"].input_schema == {
        "type": "object",
        "properties": {"name": {"type": "string", "default": "World"}},
        "additionalProperties": False,
    }
    assert app.tools["whoami"].input_schema["additionalProperties"] is False
    assert "additionalProperties" not in app.tools["anything"].input_schema


async def test_an_unknown_argument_is_refused_naming_it(app: App) -> None:
    error = error_of(await call_tool(app, "greet", {"seconds": None}))
    assert error == {
        "code": -32602,
        "message": "unknown argument 'seconds' for tool 'greet'",
        "data": {"tool": "greet", "unknown": ["seconds"]},
    }


async def test_several_unknown_arguments_are_named_in_order(app: App) -> None:
    error = error_of(await call_tool(app, "greet", {"b": 1, "name": "x", "a": 2}))
    assert error["code"] == -32602
    assert error["message"] == "unknown arguments 'b', 'a' for tool 'greet'"


async def test_unknown_names_are_bounded_in_the_message(app: App) -> None:
    arguments = {f"x{index}": index for index in range(15)}
    arguments["y" * 500] = 0
    error = error_of(await call_tool(app, "greet", arguments))
    assert error["message"] == (
        "unknown arguments 'x0', 'x1', 'x2', 'x3', 'x4', 'x5', 'x6', 'x7', 'x8', 'x9' "
        "and 6 more for tool 'greet'"
    )
    assert len(error["data"]["unknown"]) == 10


async def test_unknown_names_are_refused_before_schema_errors(app: App) -> None:
    # A schema error alone stays an isError result, as every schema error does.
    is_error, text = text_of(await call_tool(app, "greet", {"name": 5}))
    assert is_error is True
    assert text == "Invalid arguments for tool greet: name: 5 is not of type 'string'"
    error = error_of(await call_tool(app, "greet", {"name": 5, "nme": "x"}))
    assert error["message"] == "unknown argument 'nme' for tool 'greet'"


async def test_the_context_parameter_is_not_a_wire_argument(app: App) -> None:
    error = error_of(await call_tool(app, "whoami", {"ctx": "forged"}))
    assert error["message"] == "unknown argument 'ctx' for tool 'whoami'"
    assert text_of(await call_tool(app, "whoami", {"label": "a"})) == (False, "a:tools/call")
    # Not even **kwargs can take it: the context would collide with it.
    error = error_of(await call_tool(app, "anything", {"ctx": 1}))
    assert error["message"] == "unknown argument 'ctx' for tool 'anything'"


async def test_a_kwargs_function_receives_every_extra(app: App) -> None:
    response = await call_tool(app, "anything", {"first": 2, "zeta": [1], "alpha": None})
    assert text_of(response) == (False, '{"first": 2, "rest": {"alpha": null, "zeta": [1]}}')


async def test_an_explicit_schema_that_allows_extras_decides(app: App) -> None:
    # Dropped for a function that cannot take them, passed to one that takes **kwargs.
    assert text_of(await call_tool(app, "lenient", {"name": "n", "extra": 1})) == (False, "n")
    response = await call_tool(app, "lenient_kwargs", {"name": "n", "extra": 1})
    assert text_of(response) == (False, '{"extra": 1, "name": "n"}')


async def test_an_explicit_schema_that_forbids_extras_refuses_them_as_a_schema_error(
    app: App,
) -> None:
    is_error, text = text_of(await call_tool(app, "strict_kwargs", {"name": "n", "extra": 1}))
    assert is_error is True
    assert text == (
        "Invalid arguments for tool strict_kwargs: arguments: Additional properties are not "
        "allowed ('extra' was unexpected)"
    )


async def test_a_parameter_the_explicit_schema_does_not_require_is_refused_when_missing(
    app: App,
) -> None:
    error = error_of(await call_tool(app, "underspecified", {}))
    assert error == {
        "code": -32602,
        "message": "missing argument 'size' for tool 'underspecified'",
        "data": {"tool": "underspecified", "missing": ["size"]},
    }
    assert text_of(await call_tool(app, "underspecified", {"size": 3})) == (False, "3")


def test_registration_refuses_an_explicit_schema_the_function_cannot_take(
    make_app: Callable[..., App],
) -> None:
    app = make_app()

    async def resize(width: int) -> str:
        """Resize."""
        return ""

    schema: dict[str, Any] = {"type": "object", "properties": {"width": {}, "height": {}}}
    with pytest.raises(ValueError, match="input_schema declares 'height', which the function"):
        app.add_tool(resize, input_schema=schema)
    schema = {"type": "object", "properties": {"width": {}}, "required": ["depth"]}
    with pytest.raises(ValueError, match="declares 'depth'"):
        app.add_tool(resize, input_schema=schema)

    async def with_ctx(ctx: Context) -> str:
        """The context parameter cannot be advertised."""
        return ""

    with pytest.raises(ValueError, match="declares 'ctx'"):
        app.add_tool(with_ctx, input_schema={"type": "object", "properties": {"ctx": {}}})
    assert app.tools == {}


def test_registration_refuses_positional_only_parameters(make_app: Callable[..., App]) -> None:
    async def positional(width: int, /) -> str:
        """Cannot be called by keyword."""
        return ""

    with pytest.raises(TypeError, match="parameter 'width' is positional-only"):
        make_app().add_tool(positional)
