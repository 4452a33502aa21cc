"""A small HTTP/1.1 keep-alive client over trio sockets: the load generator of the benchmarks.

Both servers of a comparison are driven by this same client, so its own cost (a few system
calls and one ``json.loads`` per request) weighs the same on each side. It speaks only what the
benchmarks need: ``POST`` with ``Content-Length``, and responses framed by ``Content-Length`` or
chunked transfer coding, as JSON or as an SSE stream whose last ``data:`` line is the answer.

Requests are of either era. A 2026-07-28 request carries the ``_meta`` envelope and the
routing headers; an initialize-era (2025-11-25) one carries neither, but the ``Mcp-Session-Id``
and ``MCP-Protocol-Version`` of the session its connection opened with :meth:`HttpConnection.
open_session` (``initialize``, then ``notifications/initialized``), as the SDK clients do.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any, Final

import attrs
import trio

__all__ = [
    "LEGACY_VERSION",
    "META",
    "TOOL_CHECK",
    "HttpConnection",
    "LoadResult",
    "McpRequest",
    "percentile",
    "run_load",
    "summarize",
]

PROTOCOL_VERSION: Final = "2026-07-28"
LEGACY_VERSION: Final = "2025-11-25"
CLIENT_INFO: Final = {"name": "tritask-bench", "version": "1"}
TASKS_ID: Final = "io.modelcontextprotocol/tasks"
META: Final = {
    "io.modelcontextprotocol/protocolVersion": PROTOCOL_VERSION,
    "io.modelcontextprotocol/clientCapabilities": {},
    "io.modelcontextprotocol/clientInfo": CLIENT_INFO,
}


class HttpError(Exception):
    """The server closed the connection or answered something this client cannot read."""


@attrs.frozen
class McpRequest:
    """One request: the JSON-RPC body plus, at 2026-07-28, the mirrored routing headers.

    ``era="legacy"`` makes it an initialize-era message: no ``_meta`` envelope and no
    ``Mcp-Method``/``Mcp-Name``, but the connection's session headers (none on the
    ``initialize`` itself). ``notification`` drops the id.
    """

    method: str
    params: Mapping[str, Any]
    name: str | None = None
    capabilities: Mapping[str, Any] = attrs.field(factory=dict)
    era: str = "modern"
    notification: bool = False

    def message_params(self) -> dict[str, Any]:
        """The request's ``params``, with its ``_meta`` envelope at 2026-07-28."""
        if self.era == "legacy":
            return dict(self.params)
        meta = {**META, "io.modelcontextprotocol/clientCapabilities": dict(self.capabilities)}
        return {**self.params, "_meta": meta}

    def encode(
        self, host: str, path: str, request_id: int, session: tuple[str, str] | None = None
    ) -> bytes:
        """The HTTP request; ``session`` is a legacy connection's (session id, version)."""
        message: dict[str, Any] = {"jsonrpc": "2.0"}
        if not self.notification:
            message["id"] = request_id
        message["method"] = self.method
        message["params"] = self.message_params()
        body = json.dumps(message, separators=(",", ":")).encode()
        lines = [
            f"POST {path} HTTP/1.1",
            f"Host: {host}",
            "Content-Type: application/json",
            "Accept: application/json, text/event-stream",
        ]
        if self.era == "legacy":
            if session is not None:
                lines.append(f"Mcp-Session-Id: {session[0]}")
                lines.append(f"MCP-Protocol-Version: {session[1]}")
        else:
            lines.append(f"MCP-Protocol-Version: {PROTOCOL_VERSION}")
            lines.append(f"Mcp-Method: {self.method}")
            if self.name is not None:
                lines.append(f"Mcp-Name: {self.name}")
        lines.append(f"Content-Length: {len(body)}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def initialize_request(version: str = LEGACY_VERSION) -> McpRequest:
    return McpRequest(
        "initialize",
        {"protocolVersion": version, "capabilities": {}, "clientInfo": CLIENT_INFO},
        era="legacy",
    )


INITIALIZED: Final = McpRequest("notifications/initialized", {}, era="legacy", notification=True)


class HttpConnection:
    """One keep-alive connection; requests on it are sequential."""

    def __init__(self, stream: trio.SocketStream, host: str, port: int, path: str = "/mcp") -> None:
        self.stream = stream
        self.host = f"{host}:{port}"
        self._address = (host, port)
        self.path = path
        self._buffer = bytearray()
        self._next_id = 0
        self._closing = False
        self.reconnects = 0
        self.session: tuple[str, str] | None = None
        """A legacy session's (``Mcp-Session-Id``, negotiated version), once opened."""
        self.headers: dict[bytes, bytes] = {}
        """The headers of the last response (names lower-cased)."""

    @classmethod
    async def connect(cls, host: str, port: int, path: str = "/mcp") -> HttpConnection:
        stream = await trio.open_tcp_stream(host, port)
        return cls(stream, host, port, path)

    async def _reconnect(self) -> None:
        """The server ends keep-alive after a number of requests (hypercorn: 1000)."""
        await self.stream.aclose()
        self.stream = await trio.open_tcp_stream(*self._address)
        self._buffer.clear()
        self._closing = False
        self.reconnects += 1

    async def aclose(self) -> None:
        await self.stream.aclose()

    async def open_session(self, version: str = LEGACY_VERSION) -> None:
        """``initialize`` and ``notifications/initialized``: the legacy requests that follow on
        this connection belong to the session the server opened."""
        status, message = await self.call(initialize_request(version))
        session_id = self.headers.get(b"mcp-session-id")
        result = message.get("result")
        if status != 200 or not isinstance(result, dict) or session_id is None:
            raise HttpError(f"initialize was answered {status} {message} without a session")
        self.session = (session_id.decode("latin-1"), str(result["protocolVersion"]))
        status, _ = await self.call(INITIALIZED)
        if status != 202:
            raise HttpError(f"notifications/initialized was answered {status}")

    async def _fill(self) -> None:
        data = await self.stream.receive_some(65536)
        if not data:
            raise HttpError("the server closed the connection")
        self._buffer += data

    async def _read_until(self, marker: bytes) -> bytes:
        while True:
            index = self._buffer.find(marker)
            if index != -1:
                chunk = bytes(self._buffer[:index])
                del self._buffer[: index + len(marker)]
                return chunk
            await self._fill()

    async def _read_exactly(self, size: int) -> bytes:
        while len(self._buffer) < size:
            await self._fill()
        chunk = bytes(self._buffer[:size])
        del self._buffer[:size]
        return chunk

    async def call(self, request: McpRequest) -> tuple[int, dict[str, Any]]:
        """Send ``request`` and return ``(status, JSON-RPC response object)``."""
        self._next_id += 1
        if self._closing:
            await self._reconnect()
        await self.stream.send_all(
            request.encode(self.host, self.path, self._next_id, self.session)
        )
        head = await self._read_until(b"\r\n\r\n")
        status_line, _, header_block = head.partition(b"\r\n")
        try:
            status = int(status_line.split(b" ", 2)[1])
        except (IndexError, ValueError) as error:
            raise HttpError(f"bad status line {status_line!r}") from error
        headers: dict[bytes, bytes] = {}
        for line in header_block.split(b"\r\n"):
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        self.headers = headers
        if headers.get(b"connection", b"").lower() == b"close":
            self._closing = True
        if b"content-length" in headers:
            body = await self._read_exactly(int(headers[b"content-length"]))
        elif headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            parts = []
            while True:
                size = int((await self._read_until(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await self._read_until(b"\r\n")
                    break
                parts.append(await self._read_exactly(size))
                await self._read_exactly(2)
            body = b"".join(parts)
        else:
            raise HttpError("a response without Content-Length or chunked coding")
        if headers.get(b"content-type", b"").startswith(b"text/event-stream"):
            datas = [line[5:].strip() for line in body.splitlines() if line.startswith(b"data:")]
            if not datas:
                raise HttpError("an event stream without data")
            body = datas[-1]
        try:
            message = json.loads(body) if body else {}
        except ValueError as error:
            raise HttpError(f"a body that is not JSON ({status})") from error
        return status, message


def percentile(values: list[float], fraction: float) -> float:
    """Nearest-rank percentile of ``values`` (``fraction`` in 0..1)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(fraction * len(ordered) + 0.5)))
    return ordered[rank - 1]


@attrs.define
class LoadResult:
    requests: int
    errors: int
    seconds: float
    latencies: list[float]
    sent: int = 0
    """Every request answered, the warm-up's included (what the server's CPU time covers)."""

    @property
    def requests_per_second(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0


def summarize(latencies: list[float]) -> dict[str, float]:
    """Latency figures in milliseconds."""
    if not latencies:
        return {}
    return {
        "meanMs": round(statistics.fmean(latencies) * 1000, 4),
        "p50Ms": round(percentile(latencies, 0.50) * 1000, 4),
        "p99Ms": round(percentile(latencies, 0.99) * 1000, 4),
    }


Check = Callable[[int, dict[str, Any]], bool]


def echo_ok(status: int, message: dict[str, Any]) -> bool:
    """The echo tool answered ``hello`` without a tool error."""
    result = message.get("result") or {}
    content = result.get("content") or []
    return bool(content) and content[0].get("text") == "hello" and not result.get("isError")


TOOL_CHECK: Final[Check] = echo_ok


async def run_load(
    host: str,
    port: int,
    request: McpRequest,
    *,
    concurrency: int,
    seconds: float | None = None,
    total: int | None = None,
    warmup_seconds: float = 0.0,
    check: Check | None = None,
    session_version: str | None = None,
) -> LoadResult:
    """Drive ``concurrency`` keep-alive connections for ``seconds`` (or ``total`` requests).

    Latencies are kept only for requests started after the warm-up. With ``session_version``
    each connection first opens a legacy session of its own at that version (one client per
    connection), outside the measurement.
    """
    connections = [await HttpConnection.connect(host, port) for _ in range(concurrency)]
    latencies: list[float] = []
    errors = 0
    count = 0
    remaining = total
    sent = 0
    measured_start: float | None = None

    async def worker(conn: HttpConnection) -> None:
        nonlocal errors, count, remaining, measured_start, sent
        while True:
            if remaining is not None:
                if remaining <= 0:
                    return
                remaining -= 1
            started = time.perf_counter()
            if stop_at is not None and started >= stop_at:
                return
            status, message = await conn.call(request)
            finished = time.perf_counter()
            sent += 1
            ok = status == 200 and "result" in message and (check is None or check(status, message))
            if started >= measure_from:
                if measured_start is None:
                    measured_start = started
                count += 1
                latencies.append(finished - started)
                if not ok:
                    errors += 1

    try:
        if session_version is not None:
            for conn in connections:
                await conn.open_session(session_version)
        begin = time.perf_counter()
        measure_from = begin + warmup_seconds
        stop_at = None if seconds is None else measure_from + seconds
        async with trio.open_nursery() as nursery:
            for conn in connections:
                nursery.start_soon(worker, conn)
    finally:
        for conn in connections:
            with trio.CancelScope(shield=True):
                await conn.aclose()
    end = time.perf_counter()
    elapsed = end - (measured_start if measured_start is not None else begin)
    return LoadResult(
        requests=count, errors=errors, seconds=elapsed, latencies=latencies, sent=sent
    )
