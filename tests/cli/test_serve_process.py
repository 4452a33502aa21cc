"""``tritask.testing.ServeProcess``: a real ``tritask serve``, ready once it reported its URLs.

Each test starts real processes of a two-tool app written to ``tmp_path``: the URLs it
reports answer, a SIGKILL restart is a new process on the same store, the block's end stops
it, and a process that exits, stalls or is cancelled before it is ready is an error with its
stderr, never a hang and never a process left behind.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

import pytest
import trio
import trio_websocket

from tritask.client import connect
from tritask.testing import ServeError, ServeProcess

APP = '''
from tritask import App

app = App("serve-process", "1.0.0", state_key="serve-process-state-key-0123456789")

@app.tool()
async def echo(text: str) -> str:
    """Returns its text."""
    return text
'''

STALLS = """
import sys, time
print("booting slowly", file=sys.stderr, flush=True)
time.sleep(600)
"""
"""An app module that never finishes loading."""


def write_app(tmp_path: Path, source: str = APP) -> str:
    path = tmp_path / "served_app.py"
    path.write_text(source)
    return f"{path}:app"


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def tool_names(target: str) -> list[str]:
    with trio.fail_after(30):
        async with connect(target) as client:
            return [tool.name for tool in await client.list_tools()]


async def test_a_sigkill_restart_is_a_new_process_on_the_same_store(tmp_path: Path) -> None:
    db = tmp_path / "tasks.db"
    server = ServeProcess(write_app(tmp_path), store=f"sqlite:{db}", transports=("http", "ws"))
    async with server:
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/mcp", server.url), server.stderr
        assert server.ws_url.startswith("ws://127.0.0.1:")
        assert set(server.urls) == {"http", "ws"}
        for target in (server.url, server.ws_url):
            assert await tool_names(target) == ["echo"]
        first = server.pid
        assert server.returncode is None
        assert await server.arestart(signal.SIGKILL) == -signal.SIGKILL
        assert server.pid != first and gone(first)
        # The second process could open the file the killed one held exclusively.
        for target in (server.url, server.ws_url):
            assert await tool_names(target) == ["echo"]
        assert await server.akill() == -signal.SIGKILL
    assert gone(server.pid)


def test_the_block_stops_the_process_at_its_end(tmp_path: Path) -> None:
    with ServeProcess(write_app(tmp_path)) as server:
        assert trio.run(tool_names, server.url) == ["echo"]
        first = server.pid
        assert server.restart(signal.SIGTERM) == 0, server.stderr  # graceful
        assert server.pid != first and gone(first)
        assert trio.run(tool_names, server.url) == ["echo"]
        pid = server.pid
    assert server.returncode == 0, server.stderr  # SIGINT: a graceful exit
    assert gone(pid)
    assert "tritask: shutting down" in server.stderr


async def test_a_process_that_exits_before_it_reports_is_an_error_with_its_stderr(
    tmp_path: Path,
) -> None:
    missing = tmp_path / "missing.py"
    with pytest.raises(ServeError) as failed:
        async with ServeProcess(f"{missing}:app"):
            raise AssertionError("must not be ready")
    assert "exited with code 1 before it reported a URL for http" in str(failed.value)
    assert failed.value.stderr == f"tritask: no such file: {missing}\n"
    assert str(failed.value).endswith(failed.value.stderr)


def test_a_start_timeout_kills_the_process_and_shows_its_stderr(tmp_path: Path) -> None:
    # The stall comes before tritask is even imported (Python runs sitecustomize at start-up),
    # so the short timeout is not a race with a loaded machine's import time.
    (tmp_path / "sitecustomize.py").write_text(STALLS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    server = ServeProcess(write_app(tmp_path), env=env, start_timeout=2)
    with pytest.raises(ServeError) as failed:
        server.start()
    assert "reported no URL for http within 2s; killed it" in str(failed.value)
    assert "booting slowly" in failed.value.stderr
    assert server.returncode == -signal.SIGKILL


async def test_a_cancelled_start_kills_the_process(tmp_path: Path) -> None:
    server = ServeProcess(write_app(tmp_path, STALLS))
    with trio.move_on_after(1) as scope:
        async with server:
            raise AssertionError("must not be ready")
    assert scope.cancelled_caught
    assert server.returncode == -signal.SIGKILL
    assert gone(server.pid)


def test_transports_are_checked_before_anything_runs() -> None:
    for transports in ((), ("http", "http"), ("stdio",)):
        with pytest.raises(ValueError, match="transports must be distinct names among http, ws"):
            ServeProcess("app.py:app", transports=transports)
    with pytest.raises(RuntimeError, match="start it first"):
        ServeProcess("app.py:app").url  # noqa: B018


async def test_sigint_stops_a_websocket_server_gracefully_closing_its_connections(
    tmp_path: Path,
) -> None:
    server = ServeProcess(write_app(tmp_path), transports=("http", "ws"))
    async with server:
        assert await tool_names(server.ws_url) == ["echo"]
        with trio.fail_after(30):
            async with trio_websocket.open_websocket_url(server.ws_url) as ws:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(server.astop, signal.SIGINT)
                    with pytest.raises(trio_websocket.ConnectionClosed) as closed:
                        await ws.get_message()
                reason = closed.value.reason
                assert (
                    reason is not None and reason.code == 1001
                )  # going away, not a cut connection
        assert server.returncode == 0, server.stderr
    assert "tritask: shutting down" in server.stderr
    # The WebSocket transport stopped by itself: the 10 s forced cancellation was not needed.
    assert "did not stop" not in server.stderr, server.stderr
