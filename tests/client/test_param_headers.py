"""``x-mcp-header`` rules the client enforces, and the headers it derives from arguments."""

from __future__ import annotations

from typing import Any

import pytest

from tritask.client.errors import ClientError
from tritask.client.model import ParamHeader
from tritask.client.param_headers import (
    InvalidAnnotation,
    declared_param_headers,
    param_header_pairs,
)


def prop(kind: Any, header: Any) -> dict[str, Any]:
    return {"type": kind, "x-mcp-header": header}


def schema(**properties: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties}


def test_valid_annotations_top_level_and_nested() -> None:
    declared = declared_param_headers(
        schema(
            region=prop("string", "Region"),
            limit=prop("integer", "Limit"),
            options={"type": "object", "properties": {"dry": prop("boolean", "Dry-Run")}},
            query={"type": "string"},
        )
    )
    assert declared == (
        ParamHeader("Region", ("region",), "string"),
        ParamHeader("Limit", ("limit",), "integer"),
        ParamHeader("Dry-Run", ("options", "dry"), "boolean"),
    )


@pytest.mark.parametrize(
    ("properties", "reason"),
    [
        ({"v": prop("string", "")}, "non-empty"),
        ({"v": prop("string", 7)}, "non-empty string"),
        ({"v": prop("string", "My Region")}, "not an HTTP token"),
        ({"v": prop("string", "Region:1")}, "not an HTTP token"),
        ({"v": prop("string", "Région")}, "not an HTTP token"),
        ({"v": prop("string", "Region\t1")}, "not an HTTP token"),
        ({"v": prop("number", "Score")}, "annotates type 'number'"),
        ({"v": prop("object", "Data")}, "annotates type 'object'"),
        ({"v": prop("array", "Items")}, "annotates type 'array'"),
        ({"v": prop("null", "Nil")}, "annotates type 'null'"),
        ({"v": prop(["string", "null"], "Maybe")}, "annotates type"),
        ({"a": prop("string", "MyField"), "b": prop("string", "myfield")}, "repeats 'MyField'"),
        ({"v": {"type": "array", "items": prop("string", "Item")}}, "reachable through properties"),
        ({"v": {"anyOf": [prop("string", "Either")]}}, "reachable through properties"),
    ],
)
def test_invalid_annotations(properties: dict[str, Any], reason: str) -> None:
    with pytest.raises(InvalidAnnotation, match=reason):
        declared_param_headers(schema(**properties))


def test_annotations_outside_properties_chains_are_invalid() -> None:
    with pytest.raises(InvalidAnnotation, match="reachable"):
        declared_param_headers({"type": "object", "x-mcp-header": "Root"})
    with pytest.raises(InvalidAnnotation, match="reachable"):
        declared_param_headers(
            {"type": "object", "$defs": {"id": prop("string", "Id")}, "properties": {}}
        )


def test_data_keywords_are_not_annotations() -> None:
    declared = declared_param_headers(
        schema(v={"type": "object", "default": {"x-mcp-header": "not a schema"}})
    )
    assert declared == ()
    # A property *named* x-mcp-header is a property, not an annotation.
    assert declared_param_headers(schema(**{"x-mcp-header": {"type": "string"}})) == ()


def test_header_values_are_converted_and_encoded() -> None:
    declared = declared_param_headers(
        schema(
            region=prop("string", "Region"),
            count=prop("integer", "Count"),
            on=prop("boolean", "On"),
            text=prop("string", "Text"),
            empty=prop("string", "Empty"),
            gone=prop("string", "Gone"),
            nested={"type": "object", "properties": {"deep": prop("string", "Deep")}},
        )
    )
    pairs = param_header_pairs(
        declared,
        {
            "region": "us-west1",
            "count": -7,
            "on": False,
            "text": "Hello, 世界",
            "empty": "",
            "gone": None,
            "nested": {"deep": " padded "},
        },
    )
    assert pairs == [
        ("Mcp-Param-Region", "us-west1"),
        ("Mcp-Param-Count", "-7"),
        ("Mcp-Param-On", "false"),
        ("Mcp-Param-Text", "=?base64?SGVsbG8sIOS4lueVjA==?="),
        ("Mcp-Param-Empty", ""),
        ("Mcp-Param-Deep", "=?base64?IHBhZGRlZCA=?="),
    ]
    assert param_header_pairs(declared, {}) == []
    sentinel = param_header_pairs(declared, {"region": "=?base64?literal?="})
    assert sentinel == [("Mcp-Param-Region", "=?base64?PT9iYXNlNjQ/bGl0ZXJhbD89?=")]


def test_integers_outside_the_safe_range_are_refused() -> None:
    declared = declared_param_headers(schema(count=prop("integer", "Count")))
    assert param_header_pairs(declared, {"count": 2**53 - 1}) == [
        ("Mcp-Param-Count", str(2**53 - 1))
    ]
    assert param_header_pairs(declared, {"count": 42.0}) == [("Mcp-Param-Count", "42")]
    with pytest.raises(ClientError, match="outside the safe integer range"):
        param_header_pairs(declared, {"count": 2**53})
