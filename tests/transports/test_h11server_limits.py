"""Connection limits of the lean HTTP/1.1 server: the header-read timeout and the connection cap.

Real loopback sockets, and trio's clock frozen (``mock_clock``): nothing times out until the test
jumps the clock, so "not closed yet" and "closed once the timeout passed" are exact statements
about the server's timers, never measurements of speed. A wall-clock watchdog only guards
against a hang.
"""

from __future__ import annotations

import functools
import logging
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from tritask.cli import build_parser
from tritask.transports._h11server import ServerConfig, serve

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

HEADER_TIMEOUT = 2.0
PARTIAL_HEAD = b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appl"
REQUEST = b"GET /hello HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


class Served:
    """An ASGI app answering ``hello <n>``, counting what it served."""

    def __init__(self) -> None:
        self.count = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.count += 1
        body = b"hello %d" % self.count
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})


async def start(nursery: trio.Nursery, app: Any, **config: Any) -> tuple[str, int]:
    config.setdefault("lifespan", False)
    config.setdefault("header_timeout", HEADER_TIMEOUT)
    urls: list[str] = await nursery.start(
        functools.partial(serve, app, "127.0.0.1", 0, config=ServerConfig(**config))
    )
    host, port = urls[0].removeprefix("http://").rsplit(":", 1)
    return host, int(port)


@asynccontextmanager
async def wall_clock_limit(seconds: float = 60.0) -> AsyncIterator[None]:
    """``fail_after`` on the wall clock (trio's clock is frozen here): a hang fails the test."""
    done = threading.Event()

    async def watchdog() -> None:
        if not await trio.to_thread.run_sync(done.wait, seconds, abandon_on_cancel=True):
            raise AssertionError(f"not done after {seconds} s of real time")

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watchdog)
            yield
            nursery.cancel_scope.cancel()
    finally:
        done.set()  # the waiting thread ends now, not ``seconds`` later


async def read_until_closed(stream: trio.SocketStream) -> bytes:
    data = b""
    while chunk := await stream.receive_some(65536):
        data += chunk
    return data


class HalfOpen:
    """Connections that never finish a request head, each watched until the server closes it."""

    def __init__(self) -> None:
        self.closed: dict[int, bytes] = {}
        self.all_closed = trio.Event()
        self.count = 0

    async def open(self, nursery: trio.Nursery, address: tuple[str, int], send: bytes) -> None:
        index = self.count
        self.count += 1
        stream = await trio.open_tcp_stream(*address)
        if send:
            await stream.send_all(send)
        nursery.start_soon(self._watch, index, stream)

    async def _watch(self, index: int, stream: trio.SocketStream) -> None:
        async with stream:
            self.closed[index] = await read_until_closed(stream)
        if len(self.closed) == self.count:
            self.all_closed.set()


async def get(client: httpx.AsyncClient, url: str) -> str:
    response = await client.get(url)
    assert response.status_code == 200, response
    return response.text


async def get_alone(url: str, answers: list[str]) -> None:
    """A client of its own, on a connection of its own."""
    async with httpx.AsyncClient() as client:
        answers.append(await get(client, url))


async def test_300_half_open_connections_are_closed_at_the_header_timeout_while_others_are_served(
    nursery: trio.Nursery, mock_clock: trio.testing.MockClock
) -> None:
    app = Served()
    address = await start(nursery, app)
    url = f"http://{address[0]}:{address[1]}/hello"
    half_open = HalfOpen()
    async with wall_clock_limit():
        for index in range(300):  # every other one sends part of a head, the rest nothing
            await half_open.open(nursery, address, PARTIAL_HEAD if index % 2 else b"")
        async with httpx.AsyncClient() as client:
            # Served while all 300 are open: one client on one kept-alive connection, ten on
            # fresh connections of their own.
            served = [await get(client, url) for _ in range(10)]
            async with trio.open_nursery() as others:
                for _ in range(10):
                    others.start_soon(get_alone, url, served)
        assert sorted(served) == sorted(f"hello {n}" for n in range(1, 21))
        assert app.count == 20
        await trio.testing.wait_all_tasks_blocked()
        assert half_open.closed == {}  # trio's clock has not moved: no timer can have fired

        mock_clock.jump(HEADER_TIMEOUT - 0.01)
        await trio.testing.wait_all_tasks_blocked()
        assert half_open.closed == {}  # not before the timeout

        mock_clock.jump(0.02)  # past the header timeout, 73 s before the keep-alive timeout
        await half_open.all_closed.wait()
    silent = [half_open.closed[index] for index in range(0, 300, 2)]
    partial = [half_open.closed[index] for index in range(1, 300, 2)]
    assert silent == [b""] * 150  # nothing was asked: nothing is answered
    assert {data.split(b"\r\n", 1)[0] for data in partial} == {b"HTTP/1.1 408 Request Timeout"}
    assert all(b"\r\nconnection: close\r\n" in data for data in partial)
    # And the server still answers.
    async with httpx.AsyncClient() as client, wall_clock_limit():
        assert await get(client, url) == "hello 21"


async def test_a_trickled_head_is_closed_at_the_header_timeout_not_on_each_byte(
    nursery: trio.Nursery, mock_clock: trio.testing.MockClock
) -> None:
    address = await start(nursery, Served())
    async with wall_clock_limit(), await trio.open_tcp_stream(*address) as stream:
        for byte in REQUEST[:4]:  # one byte every 0.5 s: each arrives well within the timeout
            await stream.send_all(bytes([byte]))
            await trio.testing.wait_all_tasks_blocked()
            mock_clock.jump(0.5)
        assert trio.current_time() == HEADER_TIMEOUT  # the head began at the accept (time 0)
        mock_clock.jump(0.01)
        data = await read_until_closed(stream)
    assert data.startswith(b"HTTP/1.1 408 Request Timeout\r\n")


async def test_a_kept_alive_connection_gets_the_keep_alive_timeout_until_its_next_head_begins(
    nursery: trio.Nursery, mock_clock: trio.testing.MockClock
) -> None:
    address = await start(nursery, Served(), keep_alive_timeout=30.0)
    async with wall_clock_limit(), await trio.open_tcp_stream(*address) as stream:
        await stream.send_all(REQUEST)
        first = await stream.receive_some(65536)
        assert first.startswith(b"HTTP/1.1 200 OK\r\n") and first.endswith(b"hello 1")
        await trio.testing.wait_all_tasks_blocked()  # the cycle is over: the idle timer runs
        mock_clock.jump(HEADER_TIMEOUT * 5)  # idle between requests: the head timer is off
        await stream.send_all(REQUEST)
        second = await stream.receive_some(65536)
        assert second.endswith(b"hello 2")
        await stream.send_all(REQUEST[:10])  # the third head begins: its timer starts now
        await trio.testing.wait_all_tasks_blocked()
        mock_clock.jump(HEADER_TIMEOUT + 0.01)
        data = await read_until_closed(stream)
    assert data.startswith(b"HTTP/1.1 408 Request Timeout\r\n")


async def test_a_silent_kept_alive_connection_is_closed_at_the_keep_alive_timeout(
    nursery: trio.Nursery, mock_clock: trio.testing.MockClock
) -> None:
    address = await start(nursery, Served(), keep_alive_timeout=30.0)
    async with wall_clock_limit(), await trio.open_tcp_stream(*address) as stream:
        await stream.send_all(REQUEST)
        assert (await stream.receive_some(65536)).endswith(b"hello 1")
        await trio.testing.wait_all_tasks_blocked()  # the cycle is over: the idle timer runs
        mock_clock.jump(29.0)
        await trio.testing.wait_all_tasks_blocked()
        mock_clock.jump(1.01)
        assert await read_until_closed(stream) == b""


async def test_past_the_connection_cap_clients_wait_and_are_served_when_a_slot_frees(
    nursery: trio.Nursery, mock_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    app = Served()
    address = await start(nursery, app, max_connections=3)
    half_open = HalfOpen()
    async with wall_clock_limit():
        for _ in range(3):
            await half_open.open(nursery, address, b"")
        waiting = [await trio.open_tcp_stream(*address) for _ in range(2)]  # the backlog holds them
        for stream in waiting:
            await stream.send_all(REQUEST)
        await trio.testing.wait_all_tasks_blocked()
        assert app.count == 0  # not accepted, so not served
        assert half_open.closed == {}
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert "3 connections open (max_connections): not accepting until one closes" in warnings

        mock_clock.jump(HEADER_TIMEOUT + 0.01)  # the silent three time out and free their slots
        await half_open.all_closed.wait()
        answers = []
        for stream in waiting:  # accepted after the jump: their own head timers start then
            answers.append(await stream.receive_some(65536))
            await stream.aclose()
    assert sorted(answer.rsplit(b"\r\n", 1)[1] for answer in answers) == [b"hello 1", b"hello 2"]
    assert half_open.closed == {0: b"", 1: b"", 2: b""}


async def test_a_slot_is_given_back_by_every_kind_of_close(
    nursery: trio.Nursery, mock_clock: trio.testing.MockClock
) -> None:
    app = Served()
    address = await start(nursery, app, max_connections=1)
    async with wall_clock_limit():
        for ending in ("client closes", "bad request", "served then closed", "timeout"):
            async with await trio.open_tcp_stream(*address) as stream:
                if ending == "bad request":
                    await stream.send_all(b"NOT HTTP\r\n\r\n")
                    assert (await read_until_closed(stream)).startswith(b"HTTP/1.1 400 ")
                elif ending == "served then closed":
                    await stream.send_all(REQUEST[:-2] + b"Connection: close\r\n\r\n")
                    assert (await read_until_closed(stream)).endswith(b"hello 1")
                elif ending == "timeout":
                    await trio.testing.wait_all_tasks_blocked()
                    mock_clock.jump(HEADER_TIMEOUT + 0.01)
                    assert await read_until_closed(stream) == b""
        # The one slot is free again: a client is served.
        async with await trio.open_tcp_stream(*address) as stream:
            await stream.send_all(REQUEST)
            assert (await stream.receive_some(65536)).endswith(b"hello 2")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"header_timeout": 0}, "header_timeout must be > 0"),
        ({"keep_alive_timeout": -1.0}, "keep_alive_timeout must be > 0"),
        ({"header_timeout": float("nan")}, "header_timeout must be > 0"),
        ({"max_connections": 0}, "max_connections must be >= 1 or None"),
    ],
)
def test_limits_are_checked(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerConfig(**options)


def test_the_cli_flags_parse_and_refuse_nonsense(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["serve", "--header-timeout", "0.5", "--max-connections", "7"])
    assert (args.header_timeout, args.max_connections) == (0.5, 7)
    args = build_parser().parse_args(["serve", "--max-connections", "0"])
    assert (args.header_timeout, args.max_connections) == (5.0, None)
    for bad in (
        ["--header-timeout", "0"],
        ["--header-timeout", "inf"],
        ["--max-connections", "-1"],
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *bad])
    assert "must be" in capsys.readouterr().err


async def test_tritask_serve_applies_the_header_timeout() -> None:
    command = [sys.executable, "-m", "tritask", "serve", "--http", "127.0.0.1:0"]
    command += ["--store", "memory:", "--header-timeout", "0.5", "--max-connections", "10"]
    async with trio.open_nursery() as nursery:
        process: trio.Process = await nursery.start(
            functools.partial(trio.run_process, command, stderr=subprocess.PIPE, check=False)
        )
        try:
            with trio.fail_after(60):  # a hang guard, not a measurement
                assert process.stderr is not None
                seen = b""
                while b"/mcp\n" not in seen:
                    chunk = await process.stderr.receive_some(4096)
                    assert chunk, seen
                    seen += chunk
                port = int(seen.split(b"http://127.0.0.1:", 1)[1].split(b"/", 1)[0])
                async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
                    await stream.send_all(PARTIAL_HEAD)
                    data = await read_until_closed(stream)
            assert data.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
        finally:
            process.send_signal(signal.SIGINT)
