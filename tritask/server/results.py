"""Turning what handlers return into wire results."""

from __future__ import annotations

import base64
from typing import Any

import attrs

from tritask.jsonrpc import JSONValue, dumps, is_json_value
from tritask.protocol import wire


class ToolError(Exception):
    """Raise from a tool to report a domain error: the call completes with ``isError: true``.

    The message is shown to the client, so write it for them; other exceptions become a safe
    -32603 with the details kept in the server log.
    """


class RetryLater(ToolError):
    """Raise from a tool for a transient failure ("the export service is down, try again").

    Inside a task it asks the runtime for the next delay of the tool's retry policy (the task
    fails when the policy is exhausted, or has none); outside a task there is nobody to retry,
    so the call completes like any ``ToolError``, with ``isError: true`` and this message.
    """


class InvalidResult(TypeError):
    """A handler returned something that cannot go on the wire."""


_CONTENT_TYPES = (
    wire.TextContent,
    wire.ImageContent,
    wire.AudioContent,
    wire.EmbeddedResource,
    wire.ResourceLink,
)


def _content_item(item: Any) -> dict[str, JSONValue]:
    if isinstance(item, _CONTENT_TYPES):
        value = wire.to_wire(item)
        assert isinstance(value, dict)
        return value
    if isinstance(item, str):
        return {"type": "text", "text": item}
    if isinstance(item, dict) and isinstance(item.get("type"), str) and is_json_value(item):
        return item
    raise InvalidResult(f"not a content item: {type(item).__name__}")


def tool_result(value: Any) -> dict[str, JSONValue]:
    """Normalise a tool's return value to a ``CallToolResult`` object."""
    if isinstance(value, wire.CallToolResult):
        result = wire.to_wire(value)
        assert isinstance(result, dict)
        result.setdefault("content", [])
        result["isError"] = value.is_error
        return result
    if value is None:
        return {"content": [], "isError": False}
    if isinstance(value, str):
        return {"content": [{"type": "text", "text": value}], "isError": False}
    if isinstance(value, _CONTENT_TYPES):
        return {"content": [_content_item(value)], "isError": False}
    if isinstance(value, list | tuple) and all(
        isinstance(item, _CONTENT_TYPES) or (isinstance(item, dict) and "type" in item)
        for item in value
    ):
        return {"content": [_content_item(item) for item in value], "isError": False}
    if isinstance(value, dict):
        if not is_json_value(value):
            raise InvalidResult("tool result is not JSON")
        if "content" in value and isinstance(value["content"], list):
            result = dict(value)
            result["content"] = [_content_item(item) for item in value["content"]]
            result.setdefault("isError", False)
            return result
        return {
            "content": [{"type": "text", "text": dumps(value)}],
            "structuredContent": value,
            "isError": False,
        }
    if attrs.has(type(value)):
        structured = wire.to_wire(value)
        if isinstance(structured, dict) and is_json_value(structured):
            return tool_result(structured)
    if is_json_value(value):
        return {"content": [{"type": "text", "text": dumps(value)}], "isError": False}
    raise InvalidResult(f"a tool returned a {type(value).__name__}, which is not JSON")


def tool_error_result(message: str) -> dict[str, JSONValue]:
    return {"content": [{"type": "text", "text": message}], "isError": True}


def prompt_result(value: Any, description: str | None) -> dict[str, JSONValue]:
    if isinstance(value, wire.GetPromptResult):
        shaped: dict[str, JSONValue] = wire.to_wire(value)
        return shaped
    if isinstance(value, str):
        messages: list[Any] = [{"role": "user", "content": {"type": "text", "text": value}}]
    elif isinstance(value, wire.PromptMessage):
        messages = [wire.to_wire(value)]
    elif isinstance(value, list | tuple):
        messages = []
        for item in value:
            if isinstance(item, wire.PromptMessage):
                messages.append(wire.to_wire(item))
            elif isinstance(item, str):
                messages.append({"role": "user", "content": {"type": "text", "text": item}})
            elif isinstance(item, dict) and is_json_value(item):
                messages.append(item)
            else:
                raise InvalidResult("prompt messages must be PromptMessage, str or dict")
    elif isinstance(value, dict) and "messages" in value and is_json_value(value):
        return dict(value)
    else:
        raise InvalidResult(f"a prompt returned a {type(value).__name__}")
    result: dict[str, JSONValue] = {"messages": messages}
    if description:
        result["description"] = description
    return result


def resource_contents(value: Any, uri: str, mime_type: str | None) -> list[dict[str, JSONValue]]:
    """Normalise a resource handler's return value to ``contents`` entries."""

    def entry(item: Any) -> dict[str, JSONValue]:
        if isinstance(item, wire.TextResourceContents | wire.BlobResourceContents):
            result = wire.to_wire(item)
            assert isinstance(result, dict)
            return result
        if isinstance(item, str):
            content: dict[str, JSONValue] = {"uri": uri, "text": item}
        elif isinstance(item, bytes | bytearray):
            content = {"uri": uri, "blob": base64.b64encode(bytes(item)).decode("ascii")}
        elif isinstance(item, dict) and "uri" in item and is_json_value(item):
            return item
        else:
            raise InvalidResult(f"a resource returned a {type(item).__name__}")
        if mime_type:
            content["mimeType"] = mime_type
        return content

    if isinstance(value, wire.ReadResourceResult):
        return [entry(item) for item in value.contents]
    if isinstance(value, list | tuple):
        return [entry(item) for item in value]
    return [entry(value)]
