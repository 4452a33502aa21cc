"""A ``tritask serve`` subprocess of the conformance fixture on HTTP and WebSocket at once,
and the input handlers the client tests answer with."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import attrs
import trio
import trio.testing

from tritask.client import Client, InputRequest
from tritask.client._framed import FramedConnection
from tritask.client.stdio import read_lines

REPO = Path(__file__).resolve().parents[2]
FIXTURE = f"{REPO / 'examples' / 'conformance_fixture.py'}:app"
STDIO_COMMAND = [sys.executable, "-m", "tritask", "serve", FIXTURE, "--stdio", "--store", "memory:"]
_HTTP = re.compile(r"serving Streamable HTTP on (?P<url>http://\S+)")
_WS = re.compile(r"serving WebSocket on (?P<url>ws://\S+)")


@attrs.define
class Served:
    http: str
    ws: str
    stderr: list[str]


@contextmanager
def serve_fixture(timeout: float = 60.0) -> Iterator[Served]:
    """The fixture served by a real process; SIGINT at the end, and it must exit."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tritask",
            "serve",
            FIXTURE,
            "--http",
            "127.0.0.1:0",
            "--ws",
            "127.0.0.1:0",
            "--store",
            "memory:",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    assert process.stderr is not None
    lines: list[str] = []
    found: dict[str, str] = {}
    ready = threading.Event()

    def drain() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            lines.append(line)
            for key, pattern in (("http", _HTTP), ("ws", _WS)):
                match = pattern.search(line)
                if match:
                    found[key] = match.group("url")
            if len(found) == 2:
                ready.set()
        ready.set()

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    try:
        if not ready.wait(timeout) or len(found) != 2:
            raise RuntimeError("the fixture did not start:\n" + "".join(lines))
        yield Served(found["http"], found["ws"], lines)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        thread.join(timeout=5)


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
