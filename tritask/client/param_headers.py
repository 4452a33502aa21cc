"""``x-mcp-header``: which tool arguments travel as ``Mcp-Param-*`` headers, and how.

Clients on Streamable HTTP MUST mirror the annotated arguments and MUST exclude a tool whose
annotations break the rules, so one malformed definition cannot make the client send headers
the server will refuse (or worse, headers an intermediary routes on). The rules (2026-07-28,
Streamable HTTP, "Custom Headers from Tool Parameters"):

- the value is a non-empty HTTP token (RFC 9110 ``tchar``), unique case-insensitively;
- it annotates a ``string``, ``integer`` or ``boolean`` property, never ``number``;
- that property is statically reachable from the root through ``properties`` keys only (not
  through ``items``, ``oneOf``/``anyOf``/``allOf``/``not``, ``if``/``then``/``else``, ``$ref``
  or ``$defs``), so the header's value is found at one exact path of the arguments;
- integer values stay within JavaScript's safe range.

Pure functions; the client calls them when it lists tools and when it calls one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final

from tritask.client.errors import ClientError
from tritask.client.model import ParamHeader
from tritask.jsonrpc import JSONValue
from tritask.protocol.headers import encode_header_value

ANNOTATION: Final = "x-mcp-header"
ALLOWED_TYPES: Final = frozenset({"string", "integer", "boolean"})
MAX_SAFE_INTEGER: Final = 2**53 - 1
_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_DATA_KEYWORDS: Final = frozenset({"const", "enum", "default", "examples"})
"""Keywords whose values are instances, not schemas: a key there is data, not an annotation."""


class InvalidAnnotation(ClientError):
    """The tool's ``x-mcp-header`` annotations break the rules; the reason says which."""


def declared_param_headers(schema: JSONValue) -> tuple[ParamHeader, ...]:
    """Every valid annotation of ``schema`` in document order; raises ``InvalidAnnotation``."""
    found: list[ParamHeader] = []
    if isinstance(schema, dict):
        _visit(schema, (), True, found)
    seen: dict[str, str] = {}
    for declared in found:
        folded = declared.header.lower()
        if folded in seen:
            raise InvalidAnnotation(
                f"x-mcp-header {declared.header!r} repeats {seen[folded]!r} (case-insensitively)"
            )
        seen[folded] = declared.header
    return tuple(found)


def _visit(
    node: Mapping[str, JSONValue], path: tuple[str, ...], reachable: bool, found: list[ParamHeader]
) -> None:
    for key, value in node.items():
        if key == ANNOTATION:
            found.append(_annotation(node, value, path, reachable))
        elif key == "properties" and isinstance(value, dict):
            for name, sub in value.items():
                if isinstance(sub, dict):
                    _visit(sub, (*path, name), reachable, found)
        elif key not in _DATA_KEYWORDS:
            _visit_any(value, found)


def _visit_any(value: JSONValue, found: list[ParamHeader]) -> None:
    """Any schema below a keyword other than ``properties`` is not statically reachable."""
    if isinstance(value, dict):
        _visit(value, ("?",), False, found)
    elif isinstance(value, list):
        for item in value:
            _visit_any(item, found)


def _annotation(
    node: Mapping[str, JSONValue], value: JSONValue, path: tuple[str, ...], reachable: bool
) -> ParamHeader:
    if not isinstance(value, str) or value == "":
        raise InvalidAnnotation("x-mcp-header must be a non-empty string")
    if not _TOKEN.match(value):
        raise InvalidAnnotation(f"x-mcp-header {value!r} is not an HTTP token")
    if not reachable or not path:
        raise InvalidAnnotation(
            f"x-mcp-header {value!r} is not on a property reachable through properties only"
        )
    kind = node.get("type")
    if not isinstance(kind, str) or kind not in ALLOWED_TYPES:
        raise InvalidAnnotation(
            f"x-mcp-header {value!r} annotates type {kind!r}; only string, integer and boolean"
        )
    return ParamHeader(value, path, kind)


def header_value(value: JSONValue, declared: ParamHeader) -> str | None:
    """The header text for an argument value (``None``: omit the header)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        if abs(value) > MAX_SAFE_INTEGER:
            raise ClientError(
                f"argument {'.'.join(declared.path)} = {value} is outside the safe integer "
                f"range of header Mcp-Param-{declared.header}"
            )
        return str(value)
    if isinstance(value, float) and value.is_integer() and declared.kind == "integer":
        return str(int(value))
    if isinstance(value, str):
        return value
    return None  # an object or array cannot be a header; the server judges the arguments


def param_header_pairs(
    declared: tuple[ParamHeader, ...], arguments: Mapping[str, JSONValue]
) -> list[tuple[str, str]]:
    """``(Mcp-Param-X, encoded value)`` for each annotated argument present in ``arguments``."""
    pairs: list[tuple[str, str]] = []
    for entry in declared:
        value: JSONValue = arguments
        for step in entry.path:
            value = value.get(step) if isinstance(value, dict) else None
        text = header_value(value, entry)
        if text is not None:
            pairs.append((f"Mcp-Param-{entry.header}", encode_header_value(text)))
    return pairs
