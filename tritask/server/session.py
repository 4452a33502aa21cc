"""``Session``: what an initialize-era (2025) client negotiated once, and what spans its requests.

2026-07-28 is stateless; the 2025 revisions are not. A legacy client says who it is and what it
can do once, at ``initialize``, and then relies on the server remembering it: the negotiated
version and capabilities, the logging threshold, its resource subscriptions, the requests it has
in flight (so ``notifications/cancelled`` can reach them) and the requests the *server* sent it
(``elicitation/create``, ``sampling/createMessage``, ``roots/list``) awaiting its answer.

A session knows no transport. Whoever carries it (a stdio or WebSocket connection, or the
HTTP session table) hands every server-to-client message an ``Emit``: the request's own stream
for messages related to a request, the session's standalone stream for the rest.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Final

import attrs
import trio

from tritask.jsonrpc import InvalidParams, JsonRpcError, JSONValue, RequestId
from tritask.protocol.meta import LOG_LEVELS

log = logging.getLogger("tritask.server")

CANCEL_NOTICE_SECONDS: Final = 1.0
"""How long telling the client that a server request was abandoned may take."""

Emit = Callable[[dict[str, JSONValue]], Awaitable[None]]


class ClientRequestFailed(JsonRpcError):
    """The client answered a server-initiated request with a JSON-RPC error.

    A ``tools/call`` ends as a tool error (``isError``); any other request (``prompts/get``,
    ``resources/read``) is answered ``-32600``, as a missing client capability is: the client
    withheld what the request needs, which is no internal error of the server's (issue 18's
    fuzzer, legacy era, found it answered ``-32603``).
    """

    code = -32600
    default_message = "The client refused the request"

    def __init__(self, error: Mapping[str, JSONValue]) -> None:
        code = error.get("code")
        message = error.get("message")
        super().__init__(
            f"The client answered with error {code}: {message}"
            if isinstance(message, str)
            else "The client answered with an error",
            {"clientError": dict(error)},
        )
        self.client_code = code if isinstance(code, int) else None


class SessionClosed(Exception):
    """The session ended while a server-initiated request was waiting for its answer."""


@attrs.define(eq=False)
class _Pending:
    """A server-to-client request awaiting the client's response."""

    done: trio.Event = attrs.field(factory=trio.Event)
    result: dict[str, JSONValue] | None = None
    error: dict[str, JSONValue] | None = None


@attrs.define(eq=False)
class _ClientRequest:
    scope: trio.CancelScope
    cancel_requested: bool = False


@attrs.define(eq=False)
class Session:
    """One initialize-era session: an HTTP ``Mcp-Session-Id``, or one stdio/WebSocket link."""

    id: str
    protocol_version: str
    client_capabilities: dict[str, JSONValue]
    client_info: dict[str, JSONValue] | None = None
    principal: Any = None
    log_level: str | None = None
    """The ``logging/setLevel`` threshold; ``None`` until the client sets one."""
    initialized: bool = False
    """``notifications/initialized`` arrived."""
    resource_subscriptions: list[str] = attrs.field(factory=list)
    """URIs of ``resources/subscribe``. The standalone stream's hub filter shares this list."""
    standalone_filter: dict[str, JSONValue] = attrs.field(factory=dict)
    """Extra hub filter keys for the standalone stream (extensions add theirs)."""
    extension_state: dict[str, Any] = attrs.field(factory=dict)
    """Per-extension state that lives as long as the session (keyed by extension id)."""
    closed: bool = False
    _next_request_id: int = 0
    _pending: dict[RequestId, _Pending] = attrs.field(factory=dict)
    _client_requests: dict[RequestId, _ClientRequest] = attrs.field(factory=dict)

    # -- logging -------------------------------------------------------------------------

    def set_log_level(self, level: JSONValue) -> None:
        if not isinstance(level, str) or level not in LOG_LEVELS:
            raise InvalidParams(f"level must be one of: {', '.join(LOG_LEVELS)}")
        self.log_level = level

    def wants_log(self, level: str) -> bool:
        """Until the client sets a level the server may choose; it sends everything."""
        if level not in LOG_LEVELS:
            return False
        threshold = self.log_level
        return threshold is None or LOG_LEVELS.index(level) >= LOG_LEVELS.index(threshold)

    # -- resource subscriptions ----------------------------------------------------------

    def subscribe(self, uri: str) -> None:
        if uri not in self.resource_subscriptions:
            self.resource_subscriptions.append(uri)

    def unsubscribe(self, uri: str) -> None:
        if uri in self.resource_subscriptions:
            self.resource_subscriptions.remove(uri)

    # -- the client's requests in flight -------------------------------------------------

    @contextmanager
    def client_request(self, request_id: RequestId, scope: trio.CancelScope) -> Iterator[None]:
        """Make ``request_id`` cancellable by ``notifications/cancelled`` while inside."""
        entry = _ClientRequest(scope)
        self._client_requests[request_id] = entry
        try:
            yield
        finally:
            if self._client_requests.get(request_id) is entry:
                del self._client_requests[request_id]

    def cancel_client_request(self, request_id: JSONValue) -> bool:
        """Apply ``notifications/cancelled``; unknown or finished ids are ignored."""
        if isinstance(request_id, bool) or not isinstance(request_id, str | int):
            return False
        entry = self._client_requests.get(request_id)
        if entry is None:
            return False
        entry.cancel_requested = True
        entry.scope.cancel()
        return True

    def cancel_requested(self, request_id: RequestId | None) -> bool:
        """Whether the client explicitly cancelled ``request_id`` (not merely went away)."""
        if request_id is None:
            return False
        entry = self._client_requests.get(request_id)
        return entry is not None and entry.cancel_requested

    @property
    def requests_in_flight(self) -> int:
        return len(self._client_requests)

    # -- server-to-client requests -------------------------------------------------------

    async def request(
        self, method: str, params: dict[str, JSONValue], emit: Emit
    ) -> dict[str, JSONValue]:
        """Send ``method`` to the client on ``emit`` and wait for its answer.

        Raises :class:`ClientRequestFailed` when the client answers with an error and
        :class:`SessionClosed` when the session ends first. When the caller is cancelled the
        client is told with ``notifications/cancelled``, as the sender of an abandoned request
        SHOULD do.
        """
        if self.closed:
            raise SessionClosed(self.id)
        request_id = self._next_request_id
        self._next_request_id += 1
        pending = _Pending()
        self._pending[request_id] = pending
        try:
            await emit({"jsonrpc": "2.0", "id": request_id, "method": method, "params": params})
            await pending.done.wait()
        except trio.Cancelled:
            if not pending.done.is_set() and not self.closed:
                with trio.move_on_after(CANCEL_NOTICE_SECONDS) as notice:
                    notice.shield = True
                    await emit(
                        {
                            "jsonrpc": "2.0",
                            "method": "notifications/cancelled",
                            "params": {"requestId": request_id, "reason": "No longer needed"},
                        }
                    )
            raise
        finally:
            self._pending.pop(request_id, None)
        if pending.error is not None:
            raise ClientRequestFailed(pending.error)
        if pending.result is None:
            raise SessionClosed(self.id)
        return pending.result

    def resolve(self, message: Mapping[str, JSONValue]) -> bool:
        """Deliver a response the client sent; ``False`` when no request of ours has that id."""
        request_id = message.get("id")
        if isinstance(request_id, bool) or not isinstance(request_id, str | int):
            return False
        pending = self._pending.get(request_id)
        if pending is None or pending.done.is_set():
            return False
        error = message.get("error")
        result = message.get("result")
        if isinstance(error, dict):
            pending.error = error
        elif isinstance(result, dict):
            pending.result = result
        else:
            pending.error = {"code": -32600, "message": "The response carried no result object"}
        pending.done.set()
        return True

    @property
    def requests_pending(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        """End the session: waiting server requests fail, in-flight client requests stop."""
        self.closed = True
        for pending in self._pending.values():
            pending.done.set()
        for entry in self._client_requests.values():
            entry.scope.cancel()
