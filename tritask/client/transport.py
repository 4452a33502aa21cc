"""The client's view of a transport: one *exchange* per request.

Every 2026-07-28 transport carries, for each request the client sends, a sequence of frames
ending with that request's response: notifications about it (progress, log messages, a listen
stream's notifications) and then the result or error. Over Streamable HTTP an exchange is one
POST and its response (JSON, or an SSE stream scoped to the request); over stdio and WebSocket
the frames of all requests share one connection and are demultiplexed by request id,
``progressToken`` and the listen ``subscriptionId`` (see ``tritask.client._framed``).

Leaving an exchange before its response arrived cancels the request, in the transport's own
way: closing the HTTP response stream, or ``notifications/cancelled`` on a framed connection.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from typing import Protocol

from tritask.jsonrpc import JSONValue


class Exchange(Protocol):
    """The frames that answer one request, in order."""

    http_status: int | None
    """The HTTP status of the response (``None`` off HTTP)."""

    async def receive(self) -> dict[str, JSONValue]:
        """The next frame; ``TransportError`` when the stream ends before the response."""
        ...


class Transport(abc.ABC):
    """How the client reaches one server."""

    mirrors_headers: bool = False
    """True for Streamable HTTP: requests carry ``Mcp-Method``, ``Mcp-Name``, ``Mcp-Param-*``."""

    @abc.abstractmethod
    def exchange(
        self, message: dict[str, JSONValue], headers: Mapping[str, str]
    ) -> AbstractAsyncContextManager[Exchange]:
        """Send ``message`` (a request) and read the frames that answer it."""

    @abc.abstractmethod
    async def notify(self, message: dict[str, JSONValue], headers: Mapping[str, str]) -> None:
        """Send a notification (no answer is expected)."""

    @property
    def description(self) -> str:
        return type(self).__name__
