"""Typed views of what a 2026-07-28 server returns, decoded at the boundary.

The client is strict where a wrong guess would mislead the application (a ``resultType`` it
does not know, a task without an id or with an unknown status, an input request without a
method) and lenient about optional fields a server may omit. Every value keeps the decoded
``raw`` JSON beside its typed fields, so nothing the server sent is lost.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Literal, TypeAlias

import attrs

from tritask.client.errors import ProtocolViolation
from tritask.jsonrpc import JSONValue
from tritask.protocol.meta import SERVER_INFO_KEY, SUBSCRIPTION_ID_KEY

TASKS_EXTENSION: Final = "io.modelcontextprotocol/tasks"
"""The Tasks extension identifier (SEP-2663)."""

TaskStatus: TypeAlias = Literal["working", "input_required", "completed", "failed", "cancelled"]
TASK_STATUSES: Final[frozenset[str]] = frozenset(
    {"working", "input_required", "completed", "failed", "cancelled"}
)
TERMINAL_STATUSES: Final[frozenset[str]] = frozenset({"completed", "failed", "cancelled"})
RESULT_TYPES: Final[frozenset[str]] = frozenset({"complete", "input_required", "task"})


def _dict(value: JSONValue, what: str) -> dict[str, JSONValue]:
    if not isinstance(value, dict):
        raise ProtocolViolation(f"{what} must be an object, got {type(value).__name__}")
    return value


def _optional_str(raw: Mapping[str, JSONValue], key: str, what: str) -> str | None:
    value = raw.get(key)
    if value is not None and not isinstance(value, str):
        raise ProtocolViolation(f"{what}.{key} must be a string")
    return value


def _optional_int(raw: Mapping[str, JSONValue], key: str, what: str) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolViolation(f"{what}.{key} must be an integer")
    return value


def result_type(result: Mapping[str, JSONValue]) -> str:
    """``resultType``, absent meaning ``complete`` (an older server); unknown values refused."""
    value = result.get("resultType", "complete")
    if value not in RESULT_TYPES:
        raise ProtocolViolation(f"unknown resultType {value!r}")
    return str(value)


@attrs.frozen
class ServerInfo:
    """A ``server/discover`` result."""

    supported_versions: tuple[str, ...]
    capabilities: dict[str, JSONValue]
    server_info: dict[str, JSONValue] | None
    instructions: str | None
    raw: dict[str, JSONValue]

    @classmethod
    def from_result(cls, raw: dict[str, JSONValue]) -> ServerInfo:
        versions = raw.get("supportedVersions")
        if not isinstance(versions, list) or not all(isinstance(v, str) for v in versions):
            raise ProtocolViolation("server/discover supportedVersions must be a list of strings")
        capabilities = raw.get("capabilities", {})
        meta = raw.get("_meta")
        info = meta.get(SERVER_INFO_KEY) if isinstance(meta, dict) else None
        if info is None:  # servers of the first 2026 drafts put it in the body
            info = raw.get("serverInfo")
        return cls(
            supported_versions=tuple(versions),
            capabilities=_dict(capabilities, "server/discover capabilities"),
            server_info=info if isinstance(info, dict) else None,
            instructions=_optional_str(raw, "instructions", "server/discover"),
            raw=raw,
        )

    @property
    def name(self) -> str | None:
        name = (self.server_info or {}).get("name")
        return name if isinstance(name, str) else None

    def has_extension(self, extension_id: str) -> bool:
        extensions = self.capabilities.get("extensions")
        return isinstance(extensions, dict) and isinstance(extensions.get(extension_id), dict)


@attrs.frozen
class ParamHeader:
    """An argument a tool asks to be mirrored into ``Mcp-Param-{header}`` (SEP-2243)."""

    header: str
    """The ``x-mcp-header`` value, as the server spelled it."""
    path: tuple[str, ...]
    """The chain of ``properties`` keys from the schema root to the argument."""
    kind: str
    """``string``, ``integer`` or ``boolean``."""


@attrs.frozen
class Tool:
    name: str
    description: str | None
    input_schema: dict[str, JSONValue]
    raw: dict[str, JSONValue]
    param_headers: tuple[ParamHeader, ...] = ()

    @property
    def title(self) -> str | None:
        title = self.raw.get("title")
        return title if isinstance(title, str) else None

    @property
    def output_schema(self) -> dict[str, JSONValue] | None:
        schema = self.raw.get("outputSchema")
        return schema if isinstance(schema, dict) else None


@attrs.frozen
class ToolResult:
    """A ``CallToolResult``: returned for tool errors too (``is_error``), never raised."""

    content: tuple[dict[str, JSONValue], ...]
    structured_content: dict[str, JSONValue] | None
    is_error: bool
    raw: dict[str, JSONValue]
    task_id: str | None = None
    """The task that produced it, when the server ran the call as a task."""

    @classmethod
    def from_result(cls, raw: dict[str, JSONValue], task_id: str | None = None) -> ToolResult:
        content = raw.get("content", [])
        if not isinstance(content, list) or not all(isinstance(c, dict) for c in content):
            raise ProtocolViolation("CallToolResult.content must be a list of objects")
        structured = raw.get("structuredContent")
        if structured is not None and not isinstance(structured, dict):
            raise ProtocolViolation("CallToolResult.structuredContent must be an object")
        is_error = raw.get("isError", False)
        if not isinstance(is_error, bool):
            raise ProtocolViolation("CallToolResult.isError must be a boolean")
        return cls(tuple(content), structured, is_error, raw, task_id)

    @property
    def text(self) -> str:
        """The text content items joined by newlines (what a terminal shows)."""
        return "\n".join(
            item["text"]
            for item in self.content
            if item.get("type") == "text" and isinstance(item.get("text"), str)
        )


@attrs.frozen
class InputRequest:
    """One entry of ``inputRequests``: what the server asks the client (or its user) for."""

    key: str
    method: str
    params: dict[str, JSONValue]
    task_id: str | None = None
    """The task that asks (input inside a task), or ``None`` for an MRTR round."""

    @classmethod
    def from_entry(cls, key: str, entry: JSONValue, task_id: str | None = None) -> InputRequest:
        request = _dict(entry, f"inputRequests[{key!r}]")
        method = request.get("method")
        if not isinstance(method, str) or not method:
            raise ProtocolViolation(f"inputRequests[{key!r}] has no method")
        params = request.get("params", {})
        return cls(key, method, _dict(params, f"inputRequests[{key!r}].params"), task_id)

    @property
    def message(self) -> str | None:
        """An elicitation's ``message`` (what to show the user)."""
        message = self.params.get("message")
        return message if isinstance(message, str) else None


def input_requests(raw: JSONValue, task_id: str | None = None) -> dict[str, InputRequest]:
    if raw is None:
        return {}
    entries = _dict(raw, "inputRequests")
    return {key: InputRequest.from_entry(key, entry, task_id) for key, entry in entries.items()}


@attrs.frozen
class TaskState:
    """A task as ``tasks/get`` or ``notifications/tasks`` describes it (a DetailedTask)."""

    task_id: str
    status: TaskStatus
    status_message: str | None
    created_at: str | None
    last_updated_at: str | None
    ttl_ms: int | None
    poll_interval_ms: int | None
    input_requests: Mapping[str, InputRequest]
    result: dict[str, JSONValue] | None
    error: dict[str, JSONValue] | None
    raw: dict[str, JSONValue]

    @classmethod
    def from_wire(cls, raw: dict[str, JSONValue]) -> TaskState:
        task_id = raw.get("taskId")
        if not isinstance(task_id, str) or not task_id:
            raise ProtocolViolation("a task must carry a non-empty taskId")
        status = raw.get("status")
        if status not in TASK_STATUSES:
            raise ProtocolViolation(f"task {task_id} has an unknown status {status!r}")
        result = raw.get("result")
        error = raw.get("error")
        return cls(
            task_id=task_id,
            status=status,
            status_message=_optional_str(raw, "statusMessage", "task"),
            created_at=_optional_str(raw, "createdAt", "task"),
            last_updated_at=_optional_str(raw, "lastUpdatedAt", "task"),
            ttl_ms=_optional_int(raw, "ttlMs", "task"),
            poll_interval_ms=_optional_int(raw, "pollIntervalMs", "task"),
            input_requests=input_requests(raw.get("inputRequests"), task_id),
            result=None if result is None else _dict(result, "task result"),
            error=None if error is None else _dict(error, "task error"),
            raw=raw,
        )

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES

    def same_as(self, other: TaskState | None) -> bool:
        """Equal apart from ``_meta`` (two reports of one state, e.g. push and poll)."""
        if other is None:
            return False
        return _without_meta(self.raw) == _without_meta(other.raw)


def _without_meta(raw: Mapping[str, JSONValue]) -> dict[str, JSONValue]:
    return {key: value for key, value in raw.items() if key not in ("_meta", "resultType")}


@attrs.frozen
class Progress:
    """A ``notifications/progress`` for a request this client sent."""

    progress: float
    total: float | None
    message: str | None

    @classmethod
    def from_params(cls, params: Mapping[str, JSONValue]) -> Progress | None:
        progress = params.get("progress")
        if isinstance(progress, bool) or not isinstance(progress, int | float):
            return None
        total = params.get("total")
        message = params.get("message")
        return cls(
            float(progress),
            float(total)
            if isinstance(total, int | float) and not isinstance(total, bool)
            else None,
            message if isinstance(message, str) else None,
        )


@attrs.frozen
class Notification:
    """A notification the server sent (on a listen stream, or about a request)."""

    method: str
    params: dict[str, JSONValue]

    @property
    def subscription_id(self) -> Any:
        meta = self.params.get("_meta")
        return meta.get(SUBSCRIPTION_ID_KEY) if isinstance(meta, dict) else None

    @property
    def task(self) -> TaskState | None:
        """The task of a ``notifications/tasks`` (``None`` for other notifications)."""
        if self.method != "notifications/tasks":
            return None
        return TaskState.from_wire(self.params)


@attrs.frozen
class PromptResult:
    messages: tuple[dict[str, JSONValue], ...]
    description: str | None
    raw: dict[str, JSONValue]

    @classmethod
    def from_result(cls, raw: dict[str, JSONValue]) -> PromptResult:
        messages = raw.get("messages", [])
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ProtocolViolation("GetPromptResult.messages must be a list of objects")
        return cls(tuple(messages), _optional_str(raw, "description", "prompt"), raw)


@attrs.frozen
class ResourceResult:
    contents: tuple[dict[str, JSONValue], ...]
    raw: dict[str, JSONValue]

    @classmethod
    def from_result(cls, raw: dict[str, JSONValue]) -> ResourceResult:
        contents = raw.get("contents", [])
        if not isinstance(contents, list) or not all(isinstance(c, dict) for c in contents):
            raise ProtocolViolation("ReadResourceResult.contents must be a list of objects")
        return cls(tuple(contents), raw)

    @property
    def text(self) -> str:
        return "\n".join(
            item["text"] for item in self.contents if isinstance(item.get("text"), str)
        )


@attrs.frozen
class Completion:
    values: tuple[str, ...]
    total: int | None
    has_more: bool

    @classmethod
    def from_result(cls, raw: dict[str, JSONValue]) -> Completion:
        completion = _dict(raw.get("completion"), "CompleteResult.completion")
        values = completion.get("values", [])
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise ProtocolViolation("completion.values must be a list of strings")
        has_more = completion.get("hasMore", False)
        return cls(
            tuple(values),
            _optional_int(completion, "total", "completion"),
            bool(has_more) if isinstance(has_more, bool) else False,
        )
