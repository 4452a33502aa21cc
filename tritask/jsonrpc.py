"""JSON-RPC 2.0: one message in, one message out, and the error object.

This room knows nothing about MCP. It parses exactly one message (batches are refused, as
MCP 2026-07-28 forbids them), shapes responses, and defines the error type every other room
raises. Messages never leak internals: the error's ``message`` is what the client sees, and
anything private stays in the server log.
"""

from __future__ import annotations

import json
import math
import re
import sys
from typing import Any, ClassVar, Final, TypeAlias

import attrs
import orjson

JSONValue: TypeAlias = Any
"""A value that survives ``json.dumps``/``json.loads`` unchanged (checked where it matters)."""

RequestId: TypeAlias = str | int

JSONRPC_VERSION: Final = "2.0"


class JsonRpcError(Exception):
    """An error that becomes a JSON-RPC error object.

    The class carries the code, so ``raise InvalidParams("...")`` is all a handler writes.
    """

    code: ClassVar[int] = -32603
    default_message: ClassVar[str] = "Internal error"

    def __init__(self, message: str | None = None, data: JSONValue = None) -> None:
        self.message = message if message is not None else self.default_message
        self.data = data
        super().__init__(self.message)

    def to_error(self) -> dict[str, JSONValue]:
        error: dict[str, JSONValue] = {"code": self.code, "message": self.message}
        if self.data is not None:
            error["data"] = self.data
        return error


class ParseError(JsonRpcError):
    code = -32700
    default_message = "Parse error"


class InvalidRequest(JsonRpcError):
    code = -32600
    default_message = "Invalid request"


class MethodNotFound(JsonRpcError):
    code = -32601
    default_message = "Method not found"


class InvalidParams(JsonRpcError):
    code = -32602
    default_message = "Invalid params"


class InternalError(JsonRpcError):
    code = -32603
    default_message = "Internal error"


class CustomError(JsonRpcError):
    """An error with an application-chosen code (e.g. an authorization refusal)."""

    def __init__(self, code: int, message: str, data: JSONValue = None) -> None:
        super().__init__(message, data)
        self.code = code  # type: ignore[misc]


@attrs.frozen
class Request:
    id: RequestId
    method: str
    params: dict[str, JSONValue] | None = None


@attrs.frozen
class Notification:
    method: str
    params: dict[str, JSONValue] | None = None


@attrs.frozen
class Response:
    """A received response (only clients and tests see these)."""

    id: RequestId | None
    result: dict[str, JSONValue] | None = None
    error: dict[str, JSONValue] | None = None


Message: TypeAlias = Request | Notification


class MessageError(JsonRpcError):
    """A parse failure that still knows the request id, when it could be read."""

    def __init__(self, cause: JsonRpcError, request_id: RequestId | None) -> None:
        super().__init__(cause.message, cause.data)
        self.code = cause.code  # type: ignore[misc]
        self.request_id = request_id


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


#: A run of 19 digits is what orjson might read wrongly: it reads an integer beyond 64 bits as
#: a float. Found by mapping every ASCII digit to ``0`` (ten times faster than a regular
#: expression on text full of timestamps); in UTF-8 no other byte is an ASCII digit.
_DIGITS_TO_ZERO: Final = bytes.maketrans(b"123456789", b"000000000")
_LONG_DIGITS: Final = b"0" * 19


def _has_long_digit_run(data: bytes | str) -> bool:
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    return _LONG_DIGITS in raw.translate(_DIGITS_TO_ZERO)


_UNDECIDED: Final = object()


def _orjson_first(data: bytes | str) -> JSONValue:
    """orjson's value where it is known to agree with the standard library, else ``_UNDECIDED``.

    Never for text with a run of 19 digits (orjson would read an integer beyond 64 bits as a
    float); anything orjson refuses is left to the standard library, which decides.
    """
    if not _has_long_digit_run(data):
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
    return _UNDECIDED


def loads(data: bytes | str) -> JSONValue:
    """Strict JSON: no NaN/Infinity, UTF-8 only.

    The answer (value or error) is the standard library's. orjson, several times faster, is
    asked first when it is known to agree: never for text with a run of 19 digits (an integer
    beyond 64 bits would come back a float), and anything it refuses (NaN, a lone surrogate,
    an overflowing float, a syntax error) goes to the standard library, which decides.
    """
    value = _orjson_first(data)
    if value is not _UNDECIDED:
        return value
    text = bytes(data).decode("utf-8") if isinstance(data, bytes | bytearray) else data
    return json.loads(text, parse_constant=_reject_constant)


class UnrepresentableJSON(ValueError):
    """Valid JSON syntax this server refuses from a peer: it could not answer it faithfully.

    The text is valid JSON, so the request id can be read: it is kept in ``request_id`` and
    the parse error echoes it (a client waiting for that id gets its answer).
    """

    request_id: RequestId | None = None


#: The largest finite double. An integer beyond it becomes ``inf`` in every peer that reads
#: numbers as doubles (JavaScript does), and ``float(n)`` raises for it in Python.
_MAX_DOUBLE: Final = sys.float_info.max
_SURROGATE_ESCAPE: Final = re.compile(r"\\u[dD][89a-fA-F]")
_RAW_SURROGATE: Final = re.compile("[\ud800-\udfff]")  # only in text handed in as str


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise UnrepresentableJSON(f"the number {text[:40]} is beyond the range of a double")
    return value


def _double_range_int(text: str) -> int:
    value = int(text)
    if len(text) > 300 and abs(value) > _MAX_DOUBLE:
        raise UnrepresentableJSON(f"the integer {text[:40]}... is beyond the range of a double")
    return value


def _has_surrogate(value: JSONValue) -> bool:
    if isinstance(value, str):
        return not value.isascii() and any(0xD800 <= ord(c) <= 0xDFFF for c in value)
    if isinstance(value, list):
        return any(_has_surrogate(item) for item in value)
    if isinstance(value, dict):
        return any(_has_surrogate(key) or _has_surrogate(item) for key, item in value.items())
    return False


def loads_wire(data: bytes | str) -> JSONValue:
    """``loads`` for what a peer sends: also refuses what the server could not answer.

    A number beyond the range of a double (``1e400`` reads as ``inf``, which no JSON can carry
    back; a 400-digit integer overflows ``float()`` in any tool that takes a number) and a lone
    surrogate escape (``"\\ud800"``: no UTF-8 can encode the reply that echoes it) raise
    ``UnrepresentableJSON``. orjson refuses all three itself, so the fast path is unchanged and
    only text the standard library decides is checked. Stored records keep using ``loads``:
    a value that was accepted once always decodes again.
    """
    value = _orjson_first(data)
    if value is not _UNDECIDED:
        return value
    text = bytes(data).decode("utf-8") if isinstance(data, bytes | bytearray) else data
    try:
        value = json.loads(
            text,
            parse_constant=_reject_constant,
            parse_float=_finite_float,
            parse_int=_double_range_int,
        )
        if (_SURROGATE_ESCAPE.search(text) or _RAW_SURROGATE.search(text)) and _has_surrogate(
            value
        ):
            raise UnrepresentableJSON("a string holds a lone surrogate (not a Unicode character)")
    except UnrepresentableJSON as error:
        lenient = loads(text)
        raw_id = lenient.get("id") if isinstance(lenient, dict) else None
        error.request_id = raw_id if _valid_id(raw_id) else None
        raise
    return value


_ENCODER: Final = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)
"""What ``json.dumps`` builds on every call with these options (it keeps one only for the
defaults); its configuration is all it holds, each ``encode`` starts afresh."""


def dumps(value: JSONValue) -> str:
    """Compact JSON with no embedded newlines (stdio frames are one line)."""
    return _ENCODER.encode(value)


def _valid_id(value: object) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    return isinstance(value, str)


def parse_message(data: bytes | str) -> Message:
    """Parse one JSON-RPC request or notification.

    Raises ``MessageError`` carrying -32700 (not JSON) or -32600 (not one valid message),
    with the request id when the envelope exposed one, so the error can echo it.
    """
    return message_from_value(load_message(data))


def load_message(data: bytes | str) -> JSONValue:
    """The JSON value of a message body, or ``MessageError`` -32700 (for a caller that looks
    at the value before deciding how to read it, as the HTTP era detection does)."""
    try:
        return loads_wire(data)
    except UnrepresentableJSON as exc:
        raise MessageError(ParseError(f"Parse error: {exc}"), exc.request_id) from exc
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise MessageError(ParseError("Parse error: the body is not valid JSON"), None) from exc


def message_from_value(value: JSONValue) -> Message:
    if isinstance(value, list):
        raise MessageError(
            InvalidRequest("Invalid request: batches are not supported; send one message"), None
        )
    if not isinstance(value, dict):
        raise MessageError(InvalidRequest("Invalid request: expected a JSON object"), None)
    raw_id = value.get("id")
    request_id: RequestId | None = raw_id if _valid_id(raw_id) else None
    if value.get("jsonrpc") != JSONRPC_VERSION:
        raise MessageError(InvalidRequest('Invalid request: "jsonrpc" must be "2.0"'), request_id)
    method = value.get("method")
    if not isinstance(method, str) or not method:
        if "result" in value or "error" in value:
            raise MessageError(
                InvalidRequest("Invalid request: servers do not accept responses"), request_id
            )
        raise MessageError(
            InvalidRequest('Invalid request: "method" must be a non-empty string'), request_id
        )
    params = value.get("params")
    if params is not None and not isinstance(params, dict):
        raise MessageError(
            InvalidRequest('Invalid request: "params" must be an object'), request_id
        )
    if "id" in value:
        if request_id is None:
            raise MessageError(
                InvalidRequest('Invalid request: "id" must be a string or an integer'), None
            )
        return Request(id=request_id, method=method, params=params)
    return Notification(method=method, params=params)


def result_message(request_id: RequestId, result: dict[str, JSONValue]) -> dict[str, JSONValue]:
    return {"jsonrpc": JSONRPC_VERSION, "id": request_id, "result": result}


def error_message(
    request_id: RequestId | None, error: JsonRpcError | dict[str, JSONValue]
) -> dict[str, JSONValue]:
    body = error.to_error() if isinstance(error, JsonRpcError) else error
    return {"jsonrpc": JSONRPC_VERSION, "id": request_id, "error": body}


def notification_message(
    method: str, params: dict[str, JSONValue] | None = None
) -> dict[str, JSONValue]:
    message: dict[str, JSONValue] = {"jsonrpc": JSONRPC_VERSION, "method": method}
    if params is not None:
        message["params"] = params
    return message


def is_json_value(value: object, _depth: int = 0) -> bool:
    """True when ``value`` is made only of JSON types (finite floats, str keys)."""
    if _depth > 200:
        return False
    if value is None or isinstance(value, bool | str | int):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list | tuple):
        return all(is_json_value(item, _depth + 1) for item in value)
    if isinstance(value, dict):
        return all(
            isinstance(key, str) and is_json_value(item, _depth + 1) for key, item in value.items()
        )
    return False
