"""Issue 18's black-box fuzzer on every transport, against the conformance fixture on SQLite.

Valid 2026-07-28 envelopes with generated parameters for every method (``stress.fuzz``), sent
through a real socket or a real process: Streamable HTTP (``serve_http``), stdio (``python -m
tritask serve examples/conformance_fixture.py:app --stdio``) and WebSocket
(``serve_websocket``). The bounded run here takes a few seconds per transport; a longer one::

    python -m pytest tests/fuzz --hypothesis-profile=fuzz-long

(any profile but the default sets the number of examples per transport to its
``max_examples``). ``python -m stress fuzz`` runs thousands of requests against a ``tritask
serve`` process and prints the figures.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import trio
from hypothesis import settings

from stress.fuzz import Fuzzer
from stress.fuzz.drivers import HttpDriver, stdio_process, websocket
from stress.fuzz.run import fuzz
from stress.fuzz.session import LogWatch, tracebacks
from tritask.cli import load_app
from tritask.server.extension import ServeEnvironment
from tritask.transports.http import serve_http
from tritask.transports.websocket import serve_websocket

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "examples" / "conformance_fixture.py"
BOUNDED = 150


def examples() -> int:
    """``BOUNDED`` in the default profile; a chosen profile's ``max_examples`` otherwise."""
    if settings.get_current_profile_name() == "tritask":
        return BOUNDED
    current = settings.default
    assert current is not None
    return int(current.max_examples)


@asynccontextmanager
async def watched_logs() -> AsyncIterator[LogWatch]:
    watch = LogWatch()
    root = logging.getLogger()
    root.addHandler(watch)
    try:
        yield watch
    finally:
        root.removeHandler(watch)


def assert_clean(fuzzer: Fuzzer) -> None:
    report = fuzzer.ledger.report()
    assert report["violations"] == [], report
    assert report["requests"] >= BOUNDED
    assert set(report["methods"]) >= {
        "tools/call",
        "tasks/get",
        "tasks/update",
        "tasks/cancel",
        "resources/read",
        "prompts/get",
        "completion/complete",
        "subscriptions/listen",
    }, report
    assert report["tasksCreated"] > 0, report
    assert report["tasksFailedInternalUnexpected"] == 0, report


async def test_fuzz_streamable_http(tmp_path: Path) -> None:
    app = load_app(f"{FIXTURE}:app")
    env = ServeEnvironment(store_url=f"sqlite:{tmp_path / 'tasks.db'}")
    async with watched_logs() as logs, app.running(env), trio.open_nursery() as nursery:
        urls = await nursery.start(functools.partial(serve_http, app, "127.0.0.1", 0))
        async with httpx.AsyncClient(timeout=None) as client:
            fuzzer = Fuzzer(HttpDriver(client, urls[0] + "/mcp"))
            await fuzz(fuzzer, examples=examples())
        nursery.cancel_scope.cancel()
    assert_clean(fuzzer)
    assert logs.tracebacks == []


async def test_fuzz_websocket(tmp_path: Path) -> None:
    app = load_app(f"{FIXTURE}:app")
    env = ServeEnvironment(store_url=f"sqlite:{tmp_path / 'tasks.db'}")
    async with watched_logs() as logs, app.running(env), trio.open_nursery() as nursery:
        url = await nursery.start(functools.partial(serve_websocket, app, "127.0.0.1", 0))
        async with websocket(url) as driver:
            fuzzer = Fuzzer(driver)
            await fuzz(fuzzer, examples=examples())
            assert driver.problems == []
        nursery.cancel_scope.cancel()
    assert_clean(fuzzer)
    assert logs.tracebacks == []


async def test_fuzz_stdio_process(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "tritask", "serve", f"{FIXTURE}:app", "--stdio"]
    command += ["--store", f"sqlite:{tmp_path / 'tasks.db'}"]
    async with stdio_process(command, env=dict(os.environ)) as (driver, stderr):
        fuzzer = Fuzzer(driver)
        await fuzz(fuzzer, examples=examples())
        assert driver.problems == []
    log_text = b"".join(stderr).decode("utf-8", "replace")
    assert_clean(fuzzer)
    found, expected = tracebacks(log_text)
    assert found == expected, log_text[-6000:]
    assert "tritask: shutting down" in log_text
