"""HTTP header mirroring rules of 2026-07-28 (SEP-2243): pure functions, no I/O.

A transport hands in the raw header list; these functions decide whether the headers agree
with the body. Values may be sent as ``=?base64?<standard base64>?=``; anything without that
exact wrapper is literal. Optional whitespace around a value is ignored.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterable, Mapping
from decimal import Decimal, InvalidOperation
from typing import Any, Final

import attrs

from tritask.jsonrpc import JSONValue
from tritask.protocol.errors import HeaderMismatch

PROTOCOL_VERSION_HEADER: Final = "mcp-protocol-version"
METHOD_HEADER: Final = "mcp-method"
NAME_HEADER: Final = "mcp-name"
PARAM_HEADER_PREFIX: Final = "mcp-param-"

CORE_NAME_SOURCES: Final[Mapping[str, str]] = {
    "tools/call": "name",
    "prompts/get": "name",
    "resources/read": "uri",
}
"""Which body parameter ``Mcp-Name`` mirrors, per method (extensions add their own)."""

_SENTINEL = re.compile(r"^=\?base64\?(.*)\?=$", re.DOTALL)
_BASE64 = re.compile(r"^[A-Za-z0-9+/]*={0,2}$")
_PARAM_NAME = re.compile(r"^[A-Za-z0-9-]+$")


@attrs.frozen
class HeaderView:
    """Case-insensitive, repeat-aware view of request headers."""

    _values: Mapping[str, tuple[str, ...]]

    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[str | bytes, str | bytes]]) -> HeaderView:
        collected: dict[str, list[str]] = {}
        for raw_name, raw_value in pairs:
            name = raw_name.decode("latin-1") if isinstance(raw_name, bytes) else raw_name
            value = raw_value.decode("latin-1") if isinstance(raw_value, bytes) else raw_value
            collected.setdefault(name.lower(), []).append(value)
        return cls({key: tuple(values) for key, values in collected.items()})

    def get_all(self, name: str) -> tuple[str, ...]:
        return self._values.get(name.lower(), ())

    def get(self, name: str) -> str | None:
        values = self.get_all(name)
        return values[0] if values else None

    def names(self) -> Iterable[str]:
        return self._values.keys()


def decode_header_value(raw: str, header: str) -> str:
    """Trim optional whitespace and undo the base64 sentinel, refusing malformed values."""
    value = raw.strip(" \t")
    if not _printable_ascii(value):
        # Control characters and non-ASCII travel only inside the base64 sentinel.
        raise HeaderMismatch(f"Header {header} contains invalid characters")
    match = _SENTINEL.match(value)
    if match is None:
        return value
    encoded = match.group(1)
    if not _BASE64.match(encoded) or len(encoded) % 4 != 0:
        raise HeaderMismatch(f"Header {header} has an invalid base64 value")
    try:
        return base64.b64decode(encoded, validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError) as exc:
        raise HeaderMismatch(f"Header {header} has an invalid base64 value") from exc


def needs_encoding(value: str) -> bool:
    if value != value.strip(" \t") or _SENTINEL.match(value):
        return True
    return not _printable_ascii(value)


def _printable_ascii(value: str) -> bool:
    """Every character is in 0x20..0x7E (``isprintable`` excludes controls and DEL)."""
    return value.isascii() and value.isprintable()


def encode_header_value(value: str) -> str:
    """The form a client sends: literal when safe ASCII, else the base64 sentinel."""
    if not needs_encoding(value):
        return value
    return "=?base64?" + base64.b64encode(value.encode("utf-8")).decode("ascii") + "?="


def single_header(headers: HeaderView, name: str) -> str | None:
    values = headers.get_all(name)
    if len(values) > 1:
        raise HeaderMismatch(f"Header {_display(name)} must not be repeated")
    if not values:
        return None
    raw = values[0]
    if _printable_ascii(raw) and not raw.startswith(("=?", " ", "\t")) and raw[-1:] not in " \t":
        return raw  # the common case: nothing to trim, refuse or decode
    return decode_header_value(raw, _display(name))


def _display(name: str) -> str:
    return "-".join(part.capitalize() if part != "mcp" else "Mcp" for part in name.split("-"))


def check_protocol_version_present(headers: HeaderView) -> str:
    """Step 4: the version header must be present on every POST."""
    value = single_header(headers, PROTOCOL_VERSION_HEADER)
    if value is None or value == "":
        raise HeaderMismatch("The MCP-Protocol-Version header is required")
    return value


def check_protocol_version_matches(headers: HeaderView, body_version: str) -> None:
    """Step 6: the header must equal the ``_meta`` version."""
    value = single_header(headers, PROTOCOL_VERSION_HEADER)
    if value != body_version:
        raise HeaderMismatch(
            "The MCP-Protocol-Version header does not match "
            "params._meta io.modelcontextprotocol/protocolVersion"
        )


def check_method(headers: HeaderView, method: str) -> None:
    value = single_header(headers, METHOD_HEADER)
    if value is None:
        raise HeaderMismatch("The Mcp-Method header is required")
    if value != method:
        raise HeaderMismatch("The Mcp-Method header does not match the request method")


def check_name(
    headers: HeaderView, params: Mapping[str, Any], source: str | None, *, required: bool = True
) -> None:
    """``Mcp-Name`` must mirror the parameter named by ``source`` when the body has it.

    With ``required=False`` a missing header is accepted (the body alone routes the request);
    a header that is present must still be well-formed and mirror the body exactly, so a
    proxy that routes on it can never be told something the server then disagrees with.
    """
    value = single_header(headers, NAME_HEADER)
    if source is None:
        return
    body = params.get(source)
    if body is None:
        if value is not None:
            raise HeaderMismatch(f"The Mcp-Name header is set but params.{source} is absent")
        return
    if value is None:
        if not required:
            return
        raise HeaderMismatch(f"The Mcp-Name header is required and must mirror params.{source}")
    if not isinstance(body, str) or value != body:
        raise HeaderMismatch(f"The Mcp-Name header does not match params.{source}")


def param_headers(input_schema: Mapping[str, Any]) -> dict[str, tuple[str, str | None]]:
    """Map ``Mcp-Param-*`` suffixes (lower-case) to (argument name, JSON type) for a tool."""
    result: dict[str, tuple[str, str | None]] = {}
    properties = input_schema.get("properties")
    if not isinstance(properties, dict):
        return result
    for argument, schema in properties.items():
        if not isinstance(schema, dict):
            continue
        suffix = schema.get("x-mcp-header")
        if isinstance(suffix, str) and _PARAM_NAME.match(suffix):
            kind = schema.get("type")
            result[suffix.lower()] = (argument, kind if isinstance(kind, str) else None)
    return result


def check_params(
    headers: HeaderView,
    arguments: Mapping[str, JSONValue],
    declared: Mapping[str, tuple[str, str | None]],
) -> None:
    """Declared ``Mcp-Param-*`` headers must be present exactly when the argument is."""
    for suffix, (argument, kind) in declared.items():
        header = PARAM_HEADER_PREFIX + suffix
        value = single_header(headers, header)
        body = arguments.get(argument)
        if body is None:
            if value is not None:
                raise HeaderMismatch(
                    f"Header {_display(header)} is set but argument {argument!r} is absent"
                )
            continue
        if value is None:
            raise HeaderMismatch(f"Header {_display(header)} is required for argument {argument!r}")
        if not _same(value, body, kind):
            raise HeaderMismatch(f"Header {_display(header)} does not match argument {argument!r}")


def _same(header: str, body: JSONValue, kind: str | None) -> bool:
    if isinstance(body, bool):
        return header == ("true" if body else "false")
    if isinstance(body, int):
        # Exact: a float round trip would overflow on huge integers and merge neighbours.
        try:
            number = Decimal(header)
        except InvalidOperation:
            return False
        return number.is_finite() and number == body
    if isinstance(body, float):
        try:
            return float(header) == body
        except ValueError:
            return False
    if isinstance(body, str):
        return header == body
    return False
