"""The input handlers the client tests answer with, and a client on in-process stdio."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio
import trio.testing

from tritask.client import Client, InputRequest
from tritask.client._framed import FramedConnection
from tritask.client.stdio import read_lines


@attrs.define
class Answers:
    """Input handlers that answer from a script and remember every request they saw."""

    content: Mapping[str, Any] = attrs.field(factory=lambda: {"name": "Alice", "confirm": True})
    action: str = "accept"
    seen: list[InputRequest] = attrs.field(factory=list)

    async def elicit(self, request: InputRequest) -> dict[str, Any]:
        self.seen.append(request)
        schema = request.params.get("requestedSchema") or {}
        wanted = schema.get("properties") or {}
        return {
            "action": self.action,
            "content": {key: value for key, value in self.content.items() if key in wanted},
        }

    async def sample(self, request: InputRequest) -> dict[str, Any]:
        self.seen.append(request)
        return {
            "role": "assistant",
            "content": {"type": "text", "text": "Paris"},
            "model": "test-model",
            "stopReason": "endTurn",
        }


@asynccontextmanager
async def stdio_in_process(app: Any, **options: Any) -> AsyncIterator[Client]:
    """A ``Client`` on a ``FramedConnection`` wired to ``serve_stdio(app)`` by memory streams."""
    from tritask.transports.stdio import serve_stdio

    to_server_send, to_server_receive = trio.testing.memory_stream_one_way_pair()
    to_client_send, to_client_receive = trio.testing.memory_stream_one_way_pair()

    async def send_text(text: str) -> None:
        await to_server_send.send_all(text.encode("utf-8") + b"\n")

    async def serve() -> None:
        await serve_stdio(app, stdin=to_server_receive, stdout=to_client_send, grace_seconds=0)
        await to_client_send.aclose()  # the server is done: the client reads EOF

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        connection = FramedConnection(send_text, description="in-process stdio")
        await nursery.start(connection.run, read_lines(to_client_receive))
        yield Client(connection, **options)
        await to_server_send.aclose()
