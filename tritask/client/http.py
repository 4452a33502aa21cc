"""Streamable HTTP for the client, on httpx (its trio backend: httpcore runs on trio itself).

One POST per request, answered with JSON or an SSE stream scoped to that request; leaving the
exchange early closes the response, which is how HTTP cancels a request at 2026-07-28. The
client builds the MCP headers; this module adds ``Content-Type``, ``Accept`` and the
``Authorization`` value the application's hook supplies, merging case-insensitively so a header
is never sent twice.

Authorization: before each request the hook is called with ``None`` and may return a header
value (``"Bearer …"``) or ``None``; on a 401, or a 403 carrying ``WWW-Authenticate``, it is
called again with the challenge and, if it returns a different value, the request is sent once
more. :class:`tritask.client.oauth.ClientCredentials` is such a hook for the client-credentials
grant (discovery from the challenge, step-up on 403).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Final, TypeAlias

import attrs
import httpx

from tritask.client._sse import DEFAULT_MAX_BYTES, SseDecoder
from tritask.client.errors import ProtocolViolation, TransportError
from tritask.client.transport import Exchange, Transport
from tritask.jsonrpc import JSONValue, dumps, loads

log = logging.getLogger("tritask.client")

ACCEPT: Final = "application/json, text/event-stream"
_BODY_EXCERPT: Final = 2000


@attrs.frozen
class AuthChallenge:
    """What the server said when it refused the credentials (or their absence)."""

    http_status: int
    www_authenticate: str | None
    body: str
    url: str | None = None
    """The endpoint that refused (to find its metadata when the challenge names none)."""


Authorizer: TypeAlias = Callable[[AuthChallenge | None], Awaitable[str | None]]
"""``await authorizer(None)`` before a request; ``await authorizer(challenge)`` after a 401."""


def static_authorization(value: str) -> Authorizer:
    """An ``Authorizer`` that always supplies the same header value."""

    async def authorize(challenge: AuthChallenge | None) -> str | None:
        return value

    return authorize


def _merge(*layers: Mapping[str, str]) -> dict[str, str]:
    """Later layers win; names compare case-insensitively and keep the last spelling."""
    merged: dict[str, tuple[str, str]] = {}
    for layer in layers:
        for name, value in layer.items():
            merged[name.lower()] = (name, value)
    return dict(merged.values())


class HttpTransport(Transport):
    """A Streamable HTTP endpoint; use as ``async with HttpTransport(url) as transport``."""

    mirrors_headers = True

    def __init__(
        self,
        url: str,
        *,
        headers: Mapping[str, str] | None = None,
        authorizer: Authorizer | None = None,
        connect_timeout: float = 30.0,
        max_message_bytes: int = DEFAULT_MAX_BYTES,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.url = url
        self.headers = dict(headers or {})
        self.authorizer = authorizer
        self.max_message_bytes = max_message_bytes
        self._owned = client is None
        # No read timeout: a listen stream is quiet for as long as nothing changes. Callers
        # bound their waits with trio's own timeouts instead.
        self._client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=connect_timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=20),
            follow_redirects=False,
        )

    @property
    def description(self) -> str:
        return self.url

    async def __aenter__(self) -> HttpTransport:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._owned:
            await self._client.aclose()

    @asynccontextmanager
    async def exchange(
        self, message: dict[str, JSONValue], headers: Mapping[str, str]
    ) -> AsyncIterator[Exchange]:
        body = dumps(message).encode("utf-8")
        response = await self._send(body, headers)
        try:
            yield _HttpExchange(response, self.max_message_bytes)
        finally:
            await response.aclose()

    async def notify(self, message: dict[str, JSONValue], headers: Mapping[str, str]) -> None:
        response = await self._send(dumps(message).encode("utf-8"), headers)
        try:
            if response.status_code != 202:
                text = (await response.aread())[:_BODY_EXCERPT].decode("utf-8", "replace")
                log.warning("notification got HTTP %s: %s", response.status_code, text)
        except httpx.HTTPError as error:
            raise TransportError(f"HTTP request failed: {error}") from error
        finally:
            await response.aclose()

    async def _send(self, body: bytes, headers: Mapping[str, str]) -> httpx.Response:
        base = {"Content-Type": "application/json", "Accept": ACCEPT}
        credential = await self.authorizer(None) if self.authorizer is not None else None
        response = await self._post(body, base, headers, credential)
        if self.authorizer is None or not _challenged(response):
            return response
        try:
            text = (await response.aread())[:_BODY_EXCERPT].decode("utf-8", "replace")
        except httpx.HTTPError as error:
            raise TransportError(f"HTTP request failed: {error}") from error
        finally:
            await response.aclose()
        challenge = AuthChallenge(
            response.status_code, response.headers.get("www-authenticate"), text, self.url
        )
        renewed = await self.authorizer(challenge)
        if renewed is None or renewed == credential:
            return await self._post(body, base, headers, credential)
        return await self._post(body, base, headers, renewed)

    async def _post(
        self,
        body: bytes,
        base: Mapping[str, str],
        headers: Mapping[str, str],
        credential: str | None,
    ) -> httpx.Response:
        auth = {"Authorization": credential} if credential is not None else {}
        request = self._client.build_request(
            "POST", self.url, content=body, headers=_merge(base, self.headers, headers, auth)
        )
        try:
            return await self._client.send(request, stream=True)
        except httpx.HTTPError as error:
            raise TransportError(f"HTTP request to {self.url} failed: {error}") from error


def _challenged(response: httpx.Response) -> bool:
    if response.status_code == 401:
        return True
    return response.status_code == 403 and "www-authenticate" in response.headers


class _HttpExchange:
    def __init__(self, response: httpx.Response, max_bytes: int) -> None:
        self.response = response
        self.http_status: int | None = response.status_code
        self.max_bytes = max_bytes
        content_type = response.headers.get("content-type", "")
        self._kind = content_type.split(";", 1)[0].strip().lower()
        self._frames: deque[str] = deque()
        self._decoder = SseDecoder(max_bytes)
        self._chunks = response.aiter_bytes()
        self._finished = False

    async def receive(self) -> dict[str, JSONValue]:
        if self._kind == "text/event-stream":
            return await self._next_event()
        if self._finished:
            raise TransportError("the JSON response carried a single message")
        self._finished = True
        body = await self._read_body()
        if self._kind != "application/json":
            raise self._not_json_rpc(body)
        try:
            frame = loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise self._not_json_rpc(body) from None
        if not isinstance(frame, dict) or ("result" not in frame and "error" not in frame):
            raise self._not_json_rpc(body)
        return frame

    async def _next_event(self) -> dict[str, JSONValue]:
        while True:
            while not self._frames:
                if self._finished:
                    raise TransportError(
                        "the SSE stream ended before the response", http_status=self.http_status
                    )
                try:
                    chunk = await self._chunks.__anext__()
                except StopAsyncIteration:
                    self._finished = True
                    self._frames.extend(self._decoder.finish())
                    continue
                except httpx.HTTPError as error:
                    self._finished = True
                    raise TransportError(f"the SSE stream failed: {error}") from error
                self._frames.extend(self._decoder.feed(chunk))
            data = self._frames.popleft()
            if not data.strip():
                continue  # a priming event with empty data
            try:
                frame = loads(data)
            except (ValueError, UnicodeDecodeError, RecursionError) as error:
                raise ProtocolViolation(f"an SSE event is not JSON: {data[:200]!r}") from error
            if not isinstance(frame, dict):
                raise ProtocolViolation("an SSE event is not a JSON-RPC message")
            return frame

    async def _read_body(self) -> bytes:
        body = bytearray()
        try:
            async for chunk in self._chunks:
                body += chunk
                if len(body) > self.max_bytes:
                    raise ProtocolViolation(f"the response exceeds {self.max_bytes} bytes")
        except httpx.HTTPError as error:
            raise TransportError(f"reading the response failed: {error}") from error
        return bytes(body)

    def _not_json_rpc(self, body: bytes) -> TransportError:
        text = body[:_BODY_EXCERPT].decode("utf-8", "replace")
        return TransportError(
            f"HTTP {self.http_status} ({self._kind or 'no content type'}) is not a JSON-RPC "
            f"response",
            http_status=self.http_status,
            body=text,
        )
