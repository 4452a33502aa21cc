"""Clients of the three transports, as black boxes: a socket or a process, nothing in-process.

Each ``Driver`` sends one request and returns a ``Reply``: every JSON-RPC message received
for it (notifications and the final response, in order), the HTTP status where there is one,
and the framing problems seen (a body that is not JSON, an SSE stream without a final answer).
A ``subscriptions/listen`` request never ends by itself: the driver reads up to the
acknowledgement, then ends the stream as a client does (closes the HTTP response, or sends
``notifications/cancelled`` on stdio and WebSocket) and reports ``final=None``.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Final, Protocol

import attrs
import httpx
import trio
import trio_websocket

log = logging.getLogger("stress.fuzz")

REQUEST_TIMEOUT: Final = 10.0
"""A request unanswered for this long is a hang (a problem), not a slow answer."""
RESUMPTIONS: Final = 3
"""Resumptions of one answer's stream before it counts as unanswered."""
ACK: Final = "notifications/subscriptions/acknowledged"
SUBSCRIPTION_ID_KEY: Final = "io.modelcontextprotocol/subscriptionId"


@attrs.frozen
class Reply:
    status: int | None
    messages: tuple[dict[str, Any], ...]
    final: dict[str, Any] | None
    problems: tuple[str, ...] = ()
    body: bytes = b""
    session_id: str | None = None
    """The ``Mcp-Session-Id`` an HTTP answer named (the legacy era's ``initialize``)."""
    www_authenticate: str | None = None
    """The challenge of an HTTP refusal (the auth-on mode checks it)."""


Answer = Callable[[dict[str, Any]], Awaitable[None]]
"""Answers a server-initiated request (``elicitation/create``...) that arrived mid-request."""


def _server_request(frame: Any) -> bool:
    return isinstance(frame, dict) and "method" in frame and "id" in frame


def _encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _is_final(frame: Any, request_id: Any) -> bool:
    return (
        isinstance(frame, dict)
        and "method" not in frame
        and frame.get("id") == request_id
        and ("result" in frame or "error" in frame)
    )


def _acknowledges(frame: Any, request_id: Any) -> bool:
    if not isinstance(frame, dict) or frame.get("method") != ACK:
        return False
    params = frame.get("params")
    meta = params.get("_meta") if isinstance(params, dict) else None
    return isinstance(meta, dict) and meta.get(SUBSCRIPTION_ID_KEY) == request_id


_SSE_LINE_END: Final = re.compile(r"\r\n|\r|\n")


async def _sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The lines of an SSE body, ended by CR, LF or CRLF only (the SSE grammar).

    Not ``aiter_lines``: it also splits at U+2028, U+0085 and the like, which JSON carries
    unescaped inside strings (a tool echoing generated text broke its event in two).
    """
    buffer = ""
    async for chunk in response.aiter_text():
        text = buffer + chunk
        held = ""
        if text.endswith("\r"):  # maybe the first half of a CRLF split across chunks
            text, held = text[:-1], "\r"
        *lines, buffer = _SSE_LINE_END.split(text)
        buffer += held
        for line in lines:
            yield line
    if buffer.rstrip("\r"):
        yield buffer.rstrip("\r")


class Driver(Protocol):
    name: str

    async def send(
        self,
        message: dict[str, Any],
        headers: dict[str, str],
        *,
        listen: bool = False,
        answer: Answer | None = None,
    ) -> Reply: ...

    async def notify(self, message: dict[str, Any], headers: dict[str, str]) -> int | None:
        """Send a message that gets no JSON-RPC answer; the HTTP status where there is one."""
        ...


# -- Streamable HTTP --------------------------------------------------------------------------


class HttpDriver:
    """POSTs to ``url`` with httpx; reads JSON answers and SSE streams."""

    name = "http"

    def __init__(self, client: httpx.AsyncClient, url: str) -> None:
        self.client = client
        self.url = url

    async def send(
        self,
        message: dict[str, Any],
        headers: dict[str, str],
        *,
        listen: bool = False,
        answer: Answer | None = None,
    ) -> Reply:
        request_id = message.get("id")
        with trio.fail_after(REQUEST_TIMEOUT):
            async with self.client.stream(
                "POST", self.url, content=_encode(message), headers=headers
            ) as response:
                kind = response.headers.get("content-type", "").split(";")[0].strip()
                session_id = response.headers.get("mcp-session-id")
                challenge = response.headers.get("www-authenticate")
                if kind != "text/event-stream":
                    body = await response.aread()
                    reply = self._plain(response.status_code, kind, body, request_id)
                else:
                    reply = await self._events(response, request_id, listen, answer, headers)
                return attrs.evolve(reply, session_id=session_id, www_authenticate=challenge)

    def _plain(self, status: int, kind: str, body: bytes, request_id: Any) -> Reply:
        if status == 202 and not body:
            return Reply(status, (), None)
        if kind != "application/json":
            return Reply(status, (), None, (f"content-type {kind!r}",), body)
        try:
            frame = json.loads(body)
        except ValueError:
            return Reply(status, (), None, ("the body is not JSON",), body)
        final = frame if isinstance(frame, dict) else None
        problems = () if final is not None and "jsonrpc" in final else ("not a JSON-RPC message",)
        return Reply(status, (frame,), final, problems, body)

    async def _events(
        self,
        response: httpx.Response,
        request_id: Any,
        listen: bool,
        answer: Answer | None,
        headers: dict[str, str],
        resumptions: int = RESUMPTIONS,
    ) -> Reply:
        """Read an SSE answer; a stream the server closed before the answer (a 2025-11-25
        tool polled, ``Context.close_stream``) is resumed with ``GET`` and ``Last-Event-ID``."""
        messages: list[dict[str, Any]] = []
        problems: list[str] = []
        status = response.status_code
        last_id = None
        data: list[str] = []
        async for line in _sse_lines(response):
            if line.startswith("id:"):
                last_id = line[3:].strip()
            if line.startswith("data:"):
                data.append(line[5:].lstrip(" "))
                continue
            if line or not data:
                continue
            if data == [""]:  # a priming event (2025-11-25): an id and a retry, no message
                data = []
                continue
            try:
                frame = json.loads("\n".join(data))
            except ValueError:
                problems.append(f"an SSE event is not JSON: {chr(10).join(data)[:120]!r}")
                frame = None
            data = []
            if not isinstance(frame, dict):
                continue
            messages.append(frame)
            if answer is not None and _server_request(frame):
                await answer(frame)  # POSTed while this stream stays open, as a client does
                continue
            if _is_final(frame, request_id):
                return Reply(status, tuple(messages), frame, tuple(problems))
            if listen and _acknowledges(frame, request_id):
                return Reply(status, tuple(messages), None, tuple(problems))
        if last_id is None or resumptions <= 0 or "mcp-session-id" not in headers:
            problems.append("the SSE stream ended without a final answer")
            return Reply(status, tuple(messages), None, tuple(problems))
        resume = {
            "accept": "text/event-stream",
            "last-event-id": last_id,
            **{k: v for k, v in headers.items() if k.startswith("mcp-") or k == "authorization"},
        }
        async with self.client.stream("GET", self.url, headers=resume) as resumed:
            kind = resumed.headers.get("content-type", "").split(";")[0].strip()
            if kind != "text/event-stream":
                body = await resumed.aread()
                problems.append(f"the resumption was answered {resumed.status_code} {kind!r}")
                return Reply(resumed.status_code, tuple(messages), None, tuple(problems), body)
            rest = await self._events(resumed, request_id, listen, answer, headers, resumptions - 1)
        return attrs.evolve(
            rest, messages=tuple(messages) + rest.messages, problems=tuple(problems) + rest.problems
        )

    async def notify(self, message: dict[str, Any], headers: dict[str, str]) -> int | None:
        with trio.fail_after(REQUEST_TIMEOUT):
            response = await self.client.post(self.url, content=_encode(message), headers=headers)
        return response.status_code


# -- message transports (stdio, WebSocket) ----------------------------------------------------


class MessageDriver:
    """One connection carrying one JSON-RPC message per frame; answers matched by id."""

    name = "messages"

    def __init__(self) -> None:
        self._waiting: dict[Any, trio.MemorySendChannel[dict[str, Any]]] = {}
        self.unmatched: list[Any] = []
        """Frames that answer no request of ours (notifications of other streams...)."""
        self.problems: list[str] = []
        self.closed = trio.Event()

    async def write(self, data: bytes) -> None:
        raise NotImplementedError

    def received(self, frame: str | bytes) -> None:
        try:
            value = json.loads(frame)
        except ValueError:
            self.problems.append(f"a frame is not JSON: {frame[:80]!r}")
            return
        target = None
        if isinstance(value, dict):
            if "method" not in value:
                target = value.get("id")
            else:
                params = value.get("params")
                meta = params.get("_meta") if isinstance(params, dict) else None
                if isinstance(meta, dict):
                    target = meta.get(SUBSCRIPTION_ID_KEY)
        channel = self._waiting.get(target) if isinstance(target, int | str) else None
        if channel is None and _server_request(value) and len(self._waiting) == 1:
            # The fuzzer has one request in flight: a server-initiated request belongs to it.
            channel = next(iter(self._waiting.values()))
        elif channel is None and target is None and "error" in value and len(self._waiting) == 1:
            # An error with a null id (a frame the server could not read) answers the one
            # request in flight; the check reports it if it should have named the id.
            channel = next(iter(self._waiting.values()))
            value = {**value, "_nullId": True}
        if channel is None:
            self.unmatched.append(value)
            return
        try:
            channel.send_nowait(value)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            self.unmatched.append(value)

    async def send(
        self,
        message: dict[str, Any],
        headers: dict[str, str],
        *,
        listen: bool = False,
        answer: Answer | None = None,
    ) -> Reply:
        request_id = message["id"]
        send_channel, receive_channel = trio.open_memory_channel[dict[str, Any]](1000)
        self._waiting[request_id] = send_channel
        messages: list[dict[str, Any]] = []
        try:
            await self.write(_encode(message))
            with trio.fail_after(REQUEST_TIMEOUT):
                async for frame in receive_channel:
                    messages.append(frame)
                    if answer is not None and _server_request(frame):
                        await answer(frame)
                        continue
                    if frame.pop("_nullId", False):
                        return Reply(
                            None,
                            tuple(messages),
                            {**frame, "id": request_id},
                            ("an error answered with id null",),
                        )
                    if _is_final(frame, request_id):
                        return Reply(None, tuple(messages), frame)
                    if listen and _acknowledges(frame, request_id):
                        cancel = {
                            "jsonrpc": "2.0",
                            "method": "notifications/cancelled",
                            "params": {"requestId": request_id, "reason": "fuzzer is done"},
                        }
                        await self.write(_encode(cancel))
                        return Reply(None, tuple(messages), None)
        finally:
            del self._waiting[request_id]
        return Reply(None, tuple(messages), None, ("the connection closed",))

    async def notify(self, message: dict[str, Any], headers: dict[str, str]) -> int | None:
        await self.write(_encode(message))
        return None

    def lost(self) -> None:
        for channel in self._waiting.values():
            channel.close()
        self.closed.set()


class StdioDriver(MessageDriver):
    """A ``tritask serve ... --stdio`` process: lines on its stdin and stdout."""

    name = "stdio"

    def __init__(self, process: trio.Process) -> None:
        super().__init__()
        self.process = process

    async def write(self, data: bytes) -> None:
        assert self.process.stdin is not None
        await self.process.stdin.send_all(data + b"\n")

    async def read_loop(self) -> None:
        assert self.process.stdout is not None
        buffer = b""
        try:
            while chunk := await self.process.stdout.receive_some(65536):
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.strip():
                        self.received(line)
        finally:
            self.lost()


class WebSocketDriver(MessageDriver):
    name = "websocket"

    def __init__(self, connection: trio_websocket.WebSocketConnection) -> None:
        super().__init__()
        self.connection = connection

    async def write(self, data: bytes) -> None:
        await self.connection.send_message(data.decode("utf-8"))

    async def read_loop(self) -> None:
        try:
            while True:
                self.received(await self.connection.get_message())
        except trio_websocket.ConnectionClosed:
            pass
        finally:
            self.lost()


@asynccontextmanager
async def websocket(url: str) -> AsyncIterator[WebSocketDriver]:
    async with (
        trio_websocket.open_websocket_url(url, subprotocols=["mcp"]) as connection,
        trio.open_nursery() as nursery,
    ):
        driver = WebSocketDriver(connection)
        nursery.start_soon(driver.read_loop)
        yield driver
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def stdio_process(
    command: list[str], env: dict[str, str] | None = None
) -> AsyncIterator[tuple[StdioDriver, list[bytes]]]:
    """Start ``command`` (a stdio server) and drive it; yields the driver and its stderr."""
    import subprocess

    stderr: list[bytes] = []
    async with trio.open_nursery() as nursery:
        process = await trio.lowlevel.open_process(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        driver = StdioDriver(process)

        async def collect() -> None:
            assert process.stderr is not None
            while chunk := await process.stderr.receive_some(65536):
                stderr.append(bytes(chunk))

        nursery.start_soon(collect)
        nursery.start_soon(driver.read_loop)
        try:
            yield driver, stderr
        finally:
            assert process.stdin is not None
            with trio.move_on_after(10) as waited:
                await process.stdin.aclose()  # EOF: the server stops on its own
                await process.wait()
            if waited.cancelled_caught:
                process.kill()
                await process.wait()
