"""Wire shapes of 2026-07-28 as frozen attrs classes, and the converter for this version.

Handlers may return these classes or plain dicts; either way one converter turns them into
camelCase JSON with unset fields omitted and ``meta`` written as ``_meta``.
"""

from __future__ import annotations

import base64
from typing import Any, Literal, TypeAlias

import attrs
import cattrs
from cattrs.gen import make_dict_unstructure_fn, override

from tritask.jsonrpc import JSONValue


def _camel(name: str) -> str:
    if name == "meta":
        return "_meta"
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


@attrs.frozen(kw_only=True)
class Annotations:
    audience: tuple[str, ...] | None = None
    priority: float | None = None
    last_modified: str | None = None


@attrs.frozen(kw_only=True)
class TextContent:
    text: str
    type: Literal["text"] = "text"
    annotations: Annotations | None = None
    meta: dict[str, JSONValue] | None = None


@attrs.frozen(kw_only=True)
class ImageContent:
    data: str
    mime_type: str
    type: Literal["image"] = "image"
    annotations: Annotations | None = None
    meta: dict[str, JSONValue] | None = None

    @classmethod
    def from_bytes(cls, data: bytes, mime_type: str) -> ImageContent:
        return cls(data=base64.b64encode(data).decode("ascii"), mime_type=mime_type)


@attrs.frozen(kw_only=True)
class AudioContent:
    data: str
    mime_type: str
    type: Literal["audio"] = "audio"
    annotations: Annotations | None = None
    meta: dict[str, JSONValue] | None = None

    @classmethod
    def from_bytes(cls, data: bytes, mime_type: str) -> AudioContent:
        return cls(data=base64.b64encode(data).decode("ascii"), mime_type=mime_type)


@attrs.frozen(kw_only=True)
class TextResourceContents:
    uri: str
    text: str
    mime_type: str | None = None
    meta: dict[str, JSONValue] | None = None


@attrs.frozen(kw_only=True)
class BlobResourceContents:
    uri: str
    blob: str
    mime_type: str | None = None
    meta: dict[str, JSONValue] | None = None

    @classmethod
    def from_bytes(
        cls, uri: str, data: bytes, mime_type: str | None = None
    ) -> BlobResourceContents:
        return cls(uri=uri, blob=base64.b64encode(data).decode("ascii"), mime_type=mime_type)


ResourceContents: TypeAlias = TextResourceContents | BlobResourceContents


@attrs.frozen(kw_only=True)
class EmbeddedResource:
    resource: ResourceContents
    type: Literal["resource"] = "resource"
    annotations: Annotations | None = None
    meta: dict[str, JSONValue] | None = None


@attrs.frozen(kw_only=True)
class ResourceLink:
    uri: str
    name: str
    description: str | None = None
    mime_type: str | None = None
    type: Literal["resource_link"] = "resource_link"
    annotations: Annotations | None = None
    meta: dict[str, JSONValue] | None = None


Content: TypeAlias = TextContent | ImageContent | AudioContent | EmbeddedResource | ResourceLink


@attrs.frozen(kw_only=True)
class CallToolResult:
    content: tuple[Content, ...] = ()
    structured_content: dict[str, JSONValue] | None = None
    is_error: bool = False
    meta: dict[str, JSONValue] | None = None


@attrs.frozen(kw_only=True)
class PromptMessage:
    role: Literal["user", "assistant"]
    content: Content


@attrs.frozen(kw_only=True)
class GetPromptResult:
    messages: tuple[PromptMessage, ...]
    description: str | None = None
    meta: dict[str, JSONValue] | None = None


@attrs.frozen(kw_only=True)
class ReadResourceResult:
    contents: tuple[ResourceContents, ...]
    meta: dict[str, JSONValue] | None = None


def _make_converter() -> cattrs.Converter:
    converter = cattrs.Converter()

    def factory(cls: type[Any]) -> Any:
        overrides = {
            field.name: override(rename=_camel(field.name), omit_if_default=field.name != "type")
            for field in attrs.fields(cls)
        }
        return make_dict_unstructure_fn(cls, converter, **overrides)  # type: ignore[arg-type]

    converter.register_unstructure_hook_factory(attrs.has, factory)
    return converter


WIRE_2026_07_28: cattrs.Converter = _make_converter()
"""The one converter for the 2026-07-28 wire format."""


def to_wire(value: Any) -> Any:
    """Unstructure attrs wire objects (and containers of them) into JSON values."""
    return WIRE_2026_07_28.unstructure(value)


def text(value: str) -> TextContent:
    return TextContent(text=value)
