"""What the client raises: one class per JSON-RPC error code, and the failures around them.

A server's error object becomes the exception of its code, carrying the server's ``message``
and ``data`` unchanged (and the HTTP status when there was one), so an application can
``except MissingCapabilityError as error: error.required`` instead of comparing numbers.
Codes without a class of their own (application errors) become ``ServerError``.

Everything else the client can fail with is a ``ClientError`` too: the connection
(``TransportError``), a peer that broke the protocol (``ProtocolViolation``), a task that was
cancelled (``TaskCancelled``) and a tool definition the client must refuse (``ToolRejected``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Final

from tritask.jsonrpc import JSONValue


class ClientError(Exception):
    """Base class of every error raised by ``tritask.client``."""


class RpcError(ClientError):
    """The server answered with a JSON-RPC error object."""

    code: int
    default_code: ClassVar[int] = 0

    def __init__(
        self,
        message: str,
        data: JSONValue = None,
        *,
        code: int | None = None,
        http_status: int | None = None,
        method: str | None = None,
        task_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = self.default_code if code is None else code
        self.message = message
        self.data = data
        self.http_status = http_status
        self.method = method
        """The request method that failed (``None`` for a task's own error)."""
        self.task_id = task_id
        """Set when the error is the ``error`` of a failed task rather than of a request."""

    def __str__(self) -> str:
        where = f" (task {self.task_id})" if self.task_id else ""
        return f"{self.code}: {self.message}{where}"

    def to_error(self) -> dict[str, JSONValue]:
        """The error object as the server sent it."""
        error: dict[str, JSONValue] = {"code": self.code, "message": self.message}
        if self.data is not None:
            error["data"] = self.data
        return error


class ParseError(RpcError):
    default_code = -32700


class InvalidRequestError(RpcError):
    default_code = -32600


class MethodNotFoundError(RpcError):
    default_code = -32601


class InvalidParamsError(RpcError):
    """-32602: bad parameters, an unknown tool, an unknown or expired task, a missing resource."""

    default_code = -32602


class InternalError(RpcError):
    default_code = -32603


class HeaderMismatchError(RpcError):
    """-32020: an HTTP header disagreed with the body (a client bug, or a stale tool schema)."""

    default_code = -32020


class MissingCapabilityError(RpcError):
    """-32021: the request needed a client capability it did not declare."""

    default_code = -32021

    @property
    def required(self) -> dict[str, JSONValue]:
        """``data.requiredCapabilities`` (empty when the server omitted it)."""
        data = self.data
        required = data.get("requiredCapabilities") if isinstance(data, dict) else None
        return dict(required) if isinstance(required, dict) else {}


class UnsupportedVersionError(RpcError):
    """-32022: the server does not speak the requested protocol version."""

    default_code = -32022

    @property
    def supported(self) -> tuple[str, ...]:
        data = self.data
        versions = data.get("supported") if isinstance(data, dict) else None
        if not isinstance(versions, list):
            return ()
        return tuple(version for version in versions if isinstance(version, str))


class ServerError(RpcError):
    """A code without a class of its own (application-defined errors, retired codes)."""


ERROR_CLASSES: Final[Mapping[int, type[RpcError]]] = {
    cls.default_code: cls
    for cls in (
        ParseError,
        InvalidRequestError,
        MethodNotFoundError,
        InvalidParamsError,
        InternalError,
        HeaderMismatchError,
        MissingCapabilityError,
        UnsupportedVersionError,
    )
}


def error_from(
    error: JSONValue,
    *,
    http_status: int | None = None,
    method: str | None = None,
    task_id: str | None = None,
) -> RpcError:
    """The exception for a JSON-RPC error object; a malformed object is still reported."""
    if not isinstance(error, dict):
        return ServerError(
            f"malformed error object: {error!r}",
            code=-32603,
            http_status=http_status,
            method=method,
            task_id=task_id,
        )
    raw_code = error.get("code")
    code = raw_code if isinstance(raw_code, int) and not isinstance(raw_code, bool) else -32603
    raw_message = error.get("message")
    message = raw_message if isinstance(raw_message, str) else ""
    cls = ERROR_CLASSES.get(code, ServerError)
    return cls(
        message,
        error.get("data"),
        code=code,
        http_status=http_status,
        method=method,
        task_id=task_id,
    )


class TransportError(ClientError):
    """The connection failed, closed, or answered with something that is not JSON-RPC."""

    def __init__(self, message: str, *, http_status: int | None = None, body: str = "") -> None:
        super().__init__(message)
        self.http_status = http_status
        self.body = body
        """The start of a non-JSON-RPC HTTP response body, for diagnosis."""


class CancelledByServer(TransportError):
    """The server ended the request with ``notifications/cancelled`` (stdio, WebSocket)."""


class ProtocolViolation(ClientError):
    """The server sent something the protocol does not allow (reported, never guessed at)."""


class TaskCancelled(ClientError):
    """The task ended ``cancelled``; ``state`` is its final snapshot."""

    def __init__(self, task_id: str, state: object = None) -> None:
        super().__init__(f"task {task_id} was cancelled")
        self.task_id = task_id
        self.state = state


class ToolRejected(ClientError):
    """The tool's definition breaks a rule the client must enforce (an invalid x-mcp-header)."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"tool {name!r} is rejected: {reason}")
        self.name = name
        self.reason = reason


class InputNotHandled(ClientError):
    """The server asked for an input this client has no handler for."""

    def __init__(self, key: str, method: str) -> None:
        super().__init__(f"no handler for input request {key!r} ({method})")
        self.key = key
        self.method = method
