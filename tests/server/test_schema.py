"""Input schemas: derivation from annotations, user schemas checked at registration, validation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal, Optional, Union

import jsonschema
import pytest

from tritask.server import App, Context
from tritask.server.app import json_schema_for
from tritask.server.schema import compile_validator, type_schema, validation_errors


@pytest.mark.parametrize(
    ("annotation", "schema"),
    [
        (str, {"type": "string"}),
        (int, {"type": "integer"}),
        (float, {"type": "number"}),
        (bool, {"type": "boolean"}),
        (type(None), {"type": "null"}),
        (Any, {}),
        (list, {"type": "array"}),
        (list[int], {"type": "array", "items": {"type": "integer"}}),
        (set[str], {"type": "array", "items": {"type": "string"}}),
        (frozenset[str], {"type": "array", "items": {"type": "string"}}),
        (tuple[int, ...], {"type": "array", "items": {"type": "integer"}}),
        (
            tuple[int, str],
            {
                "type": "array",
                "prefixItems": [{"type": "integer"}, {"type": "string"}],
                "items": False,
                "minItems": 2,
                "maxItems": 2,
            },
        ),
        (dict, {"type": "object"}),
        (dict[str, float], {"type": "object", "additionalProperties": {"type": "number"}}),
        (Literal["a", "b"], {"enum": ["a", "b"]}),
        (Literal[1, 2], {"enum": [1, 2]}),
        (int | None, {"type": ["integer", "null"]}),
        (Optional[str], {"type": ["string", "null"]}),  # noqa: UP045
        (
            list[int] | None,
            {"type": ["array", "null"], "items": {"type": "integer"}},
        ),
        (Literal["a"] | None, {"anyOf": [{"enum": ["a"]}, {"type": "null"}]}),
        (int | str, {"anyOf": [{"type": "integer"}, {"type": "string"}]}),
        (
            Union[int, str, None],  # noqa: UP007
            {"anyOf": [{"type": "integer"}, {"type": "string"}, {"type": "null"}]},
        ),
        (Annotated[int, "How many"], {"type": "integer", "description": "How many"}),
        (
            Annotated[int, {"minimum": 0, "maximum": 9}, "Digit"],
            {"type": "integer", "minimum": 0, "maximum": 9, "description": "Digit"},
        ),
        (
            dict[str, list[Annotated[str, {"format": "email"}]]],
            {
                "type": "object",
                "additionalProperties": {
                    "type": "array",
                    "items": {"type": "string", "format": "email"},
                },
            },
        ),
    ],
)
def test_type_schema(annotation: Any, schema: dict[str, Any]) -> None:
    assert type_schema(annotation) == schema
    assert json_schema_for(annotation) == schema


@pytest.mark.parametrize("annotation", [object, bytes, complex, Context])
def test_unsupported_annotations_are_refused(annotation: Any) -> None:
    with pytest.raises(TypeError, match="cannot derive a JSON schema"):
        type_schema(annotation)


def test_signature_schema(make_app: Callable[..., App]) -> None:
    app = make_app()

    @app.tool()
    async def search(
        ctx: Context,
        query: Annotated[str, "What to look for"],
        limit: int = 10,
        tags: list[str] | None = None,
        exact: bool = False,
        mode: Literal["fast", "full"] = "fast",
        since: float | None = 1.5,
        note: str | None = None,
    ) -> str:
        """Search things.

        Longer text that is not part of the description.
        """
        return ""

    tool = app.tools["search"]
    assert tool.description == "Search things."
    assert tool.context_param == "ctx"
    assert tool.input_schema == {
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "What to look for"},
            "limit": {"type": "integer", "default": 10},
            "tags": {"type": ["array", "null"], "items": {"type": "string"}, "default": None},
            "exact": {"type": "boolean", "default": False},
            "mode": {"enum": ["fast", "full"], "default": "fast"},
            "since": {"type": ["number", "null"], "default": 1.5},
            "note": {"type": ["string", "null"], "default": None},
        },
        "required": ["query"],
        "additionalProperties": False,
    }


def test_context_detection_and_no_arguments(make_app: Callable[..., App]) -> None:
    app = make_app()

    async def untyped_ctx(ctx) -> str:  # type: ignore[no-untyped-def]
        """Context by name."""
        return ""

    async def renamed(context: Context, *args: Any, **kwargs: Any) -> str:
        """Context by annotation; var-args are not arguments."""
        return ""

    assert app.add_tool(untyped_ctx).input_schema == {
        "type": "object",
        "properties": {},
        "additionalProperties": False,
    }
    assert app.add_tool(untyped_ctx).context_param == "ctx"
    # **kwargs takes any name: no additionalProperties: false.
    assert app.add_tool(renamed).input_schema == {"type": "object", "properties": {}}
    assert app.tools["renamed"].context_param == "context"


def test_explicit_schema_is_kept(make_app: Callable[..., App]) -> None:
    app = make_app()
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}}

    @app.tool(input_schema=schema, description="Explicit.")
    async def explicit(n: int) -> int:
        return n

    assert app.tools["explicit"].input_schema == schema


@pytest.mark.parametrize(
    ("schema", "error"),
    [
        ({"type": "string"}, ValueError),
        ({}, ValueError),
        ({"properties": {}}, ValueError),
        ({"type": ["object", "null"]}, ValueError),
        ({"type": "object", "properties": {"a": {"type": "nosuchtype"}}}, jsonschema.SchemaError),
        ({"type": "object", "properties": {"a": {"minimum": "zero"}}}, jsonschema.SchemaError),
        ({"type": "object", "required": "a"}, jsonschema.SchemaError),
        ({"type": "object", "properties": []}, jsonschema.SchemaError),
    ],
)
def test_invalid_user_schema_is_rejected_at_registration(
    make_app: Callable[..., App], schema: dict[str, Any], error: type[Exception]
) -> None:
    app = make_app()

    async def tool(a: Any = None) -> str:
        """A tool."""
        return ""

    with pytest.raises(error):
        app.add_tool(tool, input_schema=schema)
    assert app.tools == {}


@pytest.mark.parametrize(
    ("name", "description"),
    [("has space", "d"), ("x" * 65, "d"), ("ünï", "d"), ("a:b", "d"), ("ok", None)],
)
def test_bad_tool_registration(
    make_app: Callable[..., App], name: str, description: str | None
) -> None:
    app = make_app()

    async def nodoc() -> str:
        return ""

    with pytest.raises(ValueError):
        app.add_tool(nodoc, name=name, description=description)


def test_sync_functions_are_refused(make_app: Callable[..., App]) -> None:
    def sync() -> str:
        """Not async."""
        return ""

    with pytest.raises(TypeError, match="must be an async function"):
        make_app().add_tool(sync)  # type: ignore[arg-type]


def test_validation_errors_are_readable_and_bounded() -> None:
    validator = compile_validator(
        {
            "type": "object",
            "properties": {
                "n": {"type": "integer", "minimum": 1},
                "mail": {"type": "string", "format": "email"},
                "items": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["n"],
            "additionalProperties": False,
        }
    )
    assert validation_errors(validator, {"n": 1, "mail": "a@b.example", "items": []}) == []
    assert validation_errors(validator, {"n": 0, "mail": "nope", "items": ["a", 2]}) == [
        "items/1: 2 is not of type 'string'",
        "mail: 'nope' is not a 'email'",
        "n: 0 is less than the minimum of 1",
    ]
    many = {f"extra{i}": i for i in range(30)}
    errors = validation_errors(validator, many)
    assert len(errors) <= 10
    assert all(len(message) <= len("arguments: ") + 200 for message in errors)


def test_validation_of_deeply_nested_arguments_does_not_crash() -> None:
    validator = compile_validator(
        {
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/n"}},
            "$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
        }
    )
    deep: Any = []
    for _ in range(5000):
        deep = [deep]
    errors = validation_errors(validator, {"a": deep})
    assert errors in ([], ["arguments could not be validated"])


def test_fixed_tuple_schema_validates_each_position() -> None:
    validator = compile_validator(
        {"type": "object", "properties": {"pair": type_schema(tuple[int, str])}}
    )
    assert validation_errors(validator, {"pair": [1, "a"]}) == []
    assert validation_errors(validator, {"pair": [1, 2]}) == ["pair/1: 2 is not of type 'string'"]
    assert validation_errors(validator, {"pair": [1, "a", "b"]}) == [
        "pair: Expected at most 2 items but found 1 extra: 'b'",
        "pair: [1, 'a', 'b'] is too long",
    ]
    assert validation_errors(validator, {"pair": [1]}) == ["pair: [1] is too short"]
