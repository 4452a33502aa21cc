"""The stdio transport: in-process over trio memory streams, and once as a real subprocess.

In-process tests drive ``serve_stdio`` through ``memory_stream_one_way_pair`` streams, so every
byte the server writes is observed exactly; timed behaviour (the EOF grace period) runs under
``autojump_clock``. The subprocess test runs ``python -m tritask serve --stdio`` over pipes
with a generous absolute deadline.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio
import trio.testing
from transport_app import Probe
from transport_app import build_app as build_transport_app

from tritask.jsonrpc import dumps, loads
from tritask.server.app import App
from tritask.transports.stdio import serve_stdio

VERSION = "2026-07-28"
META = {
    "io.modelcontextprotocol/protocolVersion": VERSION,
    "io.modelcontextprotocol/clientCapabilities": {},
}
SUB = "io.modelcontextprotocol/subscriptionId"
SERVER_INFO = {"io.modelcontextprotocol/serverInfo": {"name": "stdio-test", "version": "1.0.0"}}


def request(request_id: int | str, method: str, **params: Any) -> dict[str, Any]:
    meta = dict(META)
    meta.update(params.pop("_meta", {}))
    return {
        "jsonrpc": "2.0",
        "id": request_id,
        "method": method,
        "params": {**params, "_meta": meta},
    }


def cancel(request_id: int | str) -> dict[str, Any]:
    return {
        "jsonrpc": "2.0",
        "method": "notifications/cancelled",
        "params": {"requestId": request_id, "reason": "test"},
    }


def build_app(probe: Probe) -> App:
    return build_transport_app(probe, "stdio-test")


class Peer:
    """The client end: writes lines to the server's stdin, reads lines from its stdout."""

    def __init__(self, to_server: trio.abc.SendStream, from_server: trio.abc.ReceiveStream):
        self.to_server = to_server
        self.from_server = from_server
        self.buffer = b""

    async def send(self, message: dict[str, Any]) -> None:
        await self.to_server.send_all(dumps(message).encode() + b"\n")

    async def send_raw(self, data: bytes) -> None:
        await self.to_server.send_all(data)

    async def receive_line(self) -> bytes | None:
        while b"\n" not in self.buffer:
            chunk = await self.from_server.receive_some()
            if not chunk:
                return None
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line

    async def receive(self) -> dict[str, Any]:
        with trio.fail_after(10):
            line = await self.receive_line()
        assert line is not None, "the server closed its output"
        value = loads(line)
        assert isinstance(value, dict)
        return value

    async def rest(self) -> list[dict[str, Any]]:
        """Everything written after the output end was closed."""
        out = []
        while (line := await self.receive_line()) is not None:
            out.append(loads(line))
        return out


@asynccontextmanager
async def stdio_server(
    app: App, **options: Any
) -> AsyncIterator[tuple[Peer, trio.abc.SendStream, trio.Event]]:
    """Run ``serve_stdio`` on memory streams; yields the peer, the server's stdout, and done."""
    stdin_send, stdin_receive = trio.testing.memory_stream_one_way_pair()
    stdout_send, stdout_receive = trio.testing.memory_stream_one_way_pair()
    done = trio.Event()

    async def run() -> None:
        await serve_stdio(app, stdin=stdin_receive, stdout=stdout_send, **options)
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        yield Peer(stdin_send, stdout_receive), stdout_send, done
        nursery.cancel_scope.cancel()


async def test_call_tool_round_trip() -> None:
    async with stdio_server(build_app(Probe())) as (peer, _, _):
        await peer.send(request(1, "tools/call", name="echo", arguments={"text": "hi"}))
        assert await peer.receive() == {
            "jsonrpc": "2.0",
            "id": 1,
            "result": {
                "content": [{"type": "text", "text": "hi"}],
                "isError": False,
                "resultType": "complete",
                "_meta": SERVER_INFO,
            },
        }


async def test_progress_notifications_precede_the_result() -> None:
    async with stdio_server(build_app(Probe())) as (peer, _, _):
        await peer.send(
            request("p", "tools/call", name="steps", arguments={}, _meta={"progressToken": "tok"})
        )
        assert await peer.receive() == {
            "jsonrpc": "2.0",
            "method": "notifications/progress",
            "params": {"progressToken": "tok", "progress": 1, "total": 2, "message": "half"},
        }
        assert await peer.receive() == {
            "jsonrpc": "2.0",
            "method": "notifications/progress",
            "params": {"progressToken": "tok", "progress": 2, "total": 2},
        }
        response = await peer.receive()
        assert response["id"] == "p"
        assert response["result"]["content"] == [{"type": "text", "text": "done"}]


async def test_cancelled_notification_stops_the_handler_and_silences_its_id() -> None:
    probe = Probe()
    async with stdio_server(build_app(probe)) as (peer, stdout, done):
        await peer.send(request(7, "tools/call", name="block", arguments={}))
        with trio.fail_after(10):
            await probe.started.wait()
        await peer.send(cancel(7))
        with trio.fail_after(10):
            await probe.saw_cancelled.wait()
        # cancelling an unknown id (and this one again) is ignored
        await peer.send(cancel(7))
        await peer.send(cancel("nope"))
        await peer.send(request(8, "tools/call", name="echo", arguments={"text": "after"}))
        response = await peer.receive()
        assert response["id"] == 8
        assert response["result"]["content"] == [{"type": "text", "text": "after"}]
        await peer.to_server.aclose()
        with trio.fail_after(10):
            await done.wait()
        await stdout.aclose()
        assert await peer.rest() == []


async def test_listen_acknowledges_tags_and_ends_with_result_then_cancelled() -> None:
    app = build_app(Probe())
    async with stdio_server(app) as (peer, _, _):
        await peer.send(
            request(
                5,
                "subscriptions/listen",
                notifications={"toolsListChanged": True, "promptsListChanged": True},
            )
        )
        # the app has no prompts, so only the tools flag is honoured
        assert await peer.receive() == {
            "jsonrpc": "2.0",
            "method": "notifications/subscriptions/acknowledged",
            "params": {"_meta": {SUB: 5}, "notifications": {"toolsListChanged": True}},
        }
        app.notify_tools_changed()
        assert await peer.receive() == {
            "jsonrpc": "2.0",
            "method": "notifications/tools/list_changed",
            "params": {"_meta": {SUB: 5}},
        }
        # a request-scoped call in between is answered normally, never on the listen stream
        await peer.send(request(6, "tools/call", name="echo", arguments={"text": "x"}))
        assert (await peer.receive())["id"] == 6
        app.hub.close()
        assert await peer.receive() == {
            "jsonrpc": "2.0",
            "id": 5,
            "result": {"_meta": {SUB: 5, **SERVER_INFO}, "resultType": "complete"},
        }
        assert await peer.receive() == {
            "jsonrpc": "2.0",
            "method": "notifications/cancelled",
            "params": {"requestId": 5, "reason": "The server closed the subscription"},
        }


async def test_listen_cancelled_by_the_client_just_ends() -> None:
    app = build_app(Probe())
    async with stdio_server(app) as (peer, stdout, done):
        await peer.send(
            request("L", "subscriptions/listen", notifications={"toolsListChanged": True})
        )
        assert (await peer.receive())["method"] == "notifications/subscriptions/acknowledged"
        assert app.hub.subscriber_count == 1
        await peer.send(cancel("L"))
        await peer.send(request(2, "tools/call", name="echo", arguments={"text": "y"}))
        assert (await peer.receive())["id"] == 2
        assert app.hub.subscriber_count == 0
        app.notify_tools_changed()
        await peer.to_server.aclose()
        with trio.fail_after(10):
            await done.wait()
        await stdout.aclose()
        assert await peer.rest() == []


async def test_bad_lines_get_jsonrpc_errors_and_responses_are_ignored() -> None:
    async with stdio_server(build_app(Probe())) as (peer, _, _):
        await peer.send_raw(b"{not json\n")
        assert await peer.receive() == {
            "jsonrpc": "2.0",
            "id": None,
            "error": {"code": -32700, "message": "Parse error: the message is not valid JSON"},
        }
        await peer.send_raw(b"\xff\xfe\n")
        assert (await peer.receive())["error"]["code"] == -32700
        await peer.send({"jsonrpc": "1.0", "id": 3, "method": "tools/list"})
        assert await peer.receive() == {
            "jsonrpc": "2.0",
            "id": 3,
            "error": {"code": -32600, "message": 'Invalid request: "jsonrpc" must be "2.0"'},
        }
        await peer.send_raw(b"[]\n")
        assert await peer.receive() == {
            "jsonrpc": "2.0",
            "id": None,
            "error": {
                "code": -32600,
                "message": "Invalid request: batches are not supported; send one message",
            },
        }
        # a response from the client, and blank lines, produce nothing
        await peer.send({"jsonrpc": "2.0", "id": 99, "result": {}})
        await peer.send_raw(b"\n  \r\n")
        await peer.send(request(4, "tools/call", name="echo", arguments={"text": "ok"}))
        assert (await peer.receive())["id"] == 4


async def test_duplicate_in_flight_id_is_refused() -> None:
    probe = Probe()
    async with stdio_server(build_app(probe)) as (peer, _, _):
        await peer.send(request(1, "tools/call", name="block", arguments={}))
        with trio.fail_after(10):
            await probe.started.wait()
        await peer.send(request(1, "tools/call", name="echo", arguments={"text": "dup"}))
        assert await peer.receive() == {
            "jsonrpc": "2.0",
            "id": 1,
            "error": {
                "code": -32600,
                "message": "Invalid request: this id is already in use by a running request",
            },
        }
        probe.release.set()
        response = await peer.receive()
        assert response["id"] == 1
        assert response["result"]["content"] == [{"type": "text", "text": "released"}]


async def test_oversize_line_is_refused_and_skipped_without_buffering() -> None:
    async with stdio_server(build_app(Probe()), max_line_bytes=256) as (peer, _, _):
        # the long line arrives in several writes; the tail is skipped up to its newline
        await peer.send_raw(b'{"jsonrpc":"2.0","id":1,"method":"x","params":{"pad":"')
        for _ in range(5):
            await peer.send_raw(b"a" * 200)
        await peer.send_raw(b'"}}\n')
        assert await peer.receive() == {
            "jsonrpc": "2.0",
            "id": None,
            "error": {"code": -32600, "message": "Invalid request: message exceeds 256 bytes"},
        }
        await peer.send(request(2, "tools/call", name="echo", arguments={"text": "fits"}))
        response = await peer.receive()
        assert response["id"] == 2
        assert response["result"]["content"] == [{"type": "text", "text": "fits"}]


async def test_eof_exits_after_in_flight_requests_answer(autojump_clock: Any) -> None:
    probe = Probe()
    async with stdio_server(build_app(probe), grace_seconds=1.0) as (peer, stdout, done):
        await peer.send(request(1, "tools/call", name="block", arguments={}))
        await peer.send(
            request(2, "subscriptions/listen", notifications={"toolsListChanged": True})
        )
        assert (await peer.receive())["method"] == "notifications/subscriptions/acknowledged"
        await probe.started.wait()
        await peer.to_server.aclose()
        await trio.sleep(0.5)
        probe.release.set()
        await done.wait()
        await stdout.aclose()
        rest = await peer.rest()
        # the call answered within the grace period; the listen stream ended silently
        assert [message["id"] for message in rest] == [1]
        assert rest[0]["result"]["content"] == [{"type": "text", "text": "released"}]


async def test_eof_cancels_requests_still_running_after_the_grace_period(
    autojump_clock: Any,
) -> None:
    probe = Probe()
    async with stdio_server(build_app(probe), grace_seconds=1.0) as (peer, stdout, done):
        await peer.send(request(1, "tools/call", name="block", arguments={}))
        await probe.started.wait()
        await peer.to_server.aclose()
        start = trio.current_time()
        await done.wait()
        assert trio.current_time() - start == 1.0
        assert probe.saw_cancelled.is_set()
        await stdout.aclose()
        assert await peer.rest() == []


async def test_eof_with_nothing_in_flight_returns_immediately() -> None:
    async with stdio_server(build_app(Probe())) as (peer, _, done):
        await peer.send_raw(dumps(request(1, "tools/list")).encode())  # no trailing newline
        await peer.to_server.aclose()
        response = await peer.receive()
        assert [tool["name"] for tool in response["result"]["tools"]] == ["echo", "steps", "block"]
        with trio.fail_after(10):
            await done.wait()


async def test_subprocess_serves_stdio_over_pipes(tmp_path: Path) -> None:
    stderr_path = tmp_path / "stderr.txt"
    with stderr_path.open("wb") as stderr:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "tritask", "serve", "--stdio", "--store", "memory:"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            cwd=tmp_path,
        )
    assert process.stdin is not None and process.stdout is not None
    peer = Peer(process.stdin, process.stdout)
    receive = functools.partial(_receive_slowly, peer)
    try:
        with trio.fail_after(60):
            await peer.send(request(1, "server/discover"))
            discovered = await receive()
            assert discovered["id"] == 1
            assert discovered["result"]["supportedVersions"] == [VERSION]
            await peer.send(request(2, "tools/call", name="echo", arguments={"text": "héllo"}))
            assert await receive() == {
                "jsonrpc": "2.0",
                "id": 2,
                "result": {
                    "content": [{"type": "text", "text": "héllo"}],
                    "isError": False,
                    "resultType": "complete",
                    "_meta": {
                        "io.modelcontextprotocol/serverInfo": {
                            "name": "tritask-demo",
                            "version": "0.1.0",
                        }
                    },
                },
            }
            await peer.send(request(3, "tools/call", name="countdown", arguments={"seconds": 60}))
            await peer.send_raw(b"garbage\n")
            assert (await receive())["error"]["code"] == -32700
            await peer.send(cancel(3))
            await peer.send(request(4, "tools/list"))
            assert (await receive())["id"] == 4
            await process.stdin.aclose()
            # EOF must end the process promptly; the bound only catches a hang (the CLI
            # once waited out its 10 s shutdown deadline here)
            with trio.fail_after(9):
                assert await peer.rest() == []
                assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert b"tritask: serving stdio" in stderr_path.read_bytes()


NOISY_APP = """
from tritask.server.app import App

app = App("noisy", "1.0.0", state_key="noisy-state-key-0123456789")


@app.tool()
async def shout() -> str:
    \"\"\"Print to stdout, which must not reach the protocol stream.\"\"\"
    print("stray output", flush=True)
    return "shouted"
"""


async def test_stray_prints_go_to_stderr_not_the_protocol_stream(tmp_path: Path) -> None:
    (tmp_path / "noisy_app.py").write_text(NOISY_APP)
    stderr_path = tmp_path / "stderr.txt"
    with stderr_path.open("wb") as stderr:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "tritask", "serve", "noisy_app.py:app", "--stdio"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            cwd=tmp_path,
        )
    assert process.stdin is not None and process.stdout is not None
    peer = Peer(process.stdin, process.stdout)
    try:
        with trio.fail_after(60):
            await peer.send(request(1, "tools/call", name="shout", arguments={}))
            await process.stdin.aclose()
            # every line on stdout is a JSON-RPC message: the print went elsewhere
            messages = await peer.rest()
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert [message["id"] for message in messages] == [1]
    assert messages[0]["result"]["content"] == [{"type": "text", "text": "shouted"}]
    assert b"stray output" in stderr_path.read_bytes()


async def _receive_slowly(peer: Peer) -> dict[str, Any]:
    """Like ``Peer.receive`` with the caller's (process-sized) deadline."""
    line = await peer.receive_line()
    assert line is not None, "the server closed its output"
    value = loads(line)
    assert isinstance(value, dict)
    return value
