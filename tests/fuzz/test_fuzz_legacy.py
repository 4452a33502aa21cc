"""Issue 18's fuzzer in the initialize era (2025-06-18, 2025-11-25) on every transport.

A ``LegacyEra`` session: ``initialize`` with a generated version and capabilities, then
``notifications/initialized``; on HTTP every later request carries ``Mcp-Session-Id`` and
``MCP-Protocol-Version``, and the SSE answers of ``tools/call`` carry the server's own
requests (``elicitation/create``...), which the fuzzer answers with generated results and
errors. Same promises as the modern era: no 5xx, no ``-32603`` (but the fixture's deliberate
``protocol_error_job``), no other traceback in the log, the server still answers (``ping``).
"""

from __future__ import annotations

import functools
import os
import random
import sys
from pathlib import Path

import httpx
import trio
from hypothesis import settings
from test_fuzz import FIXTURE, oauth_served, watched_logs

from stress.fuzz import Fuzzer
from stress.fuzz.auth import DEFAULT_EVERY
from stress.fuzz.drivers import HttpDriver, stdio_process, websocket
from stress.fuzz.eras import LegacyEra, legacy_era
from stress.fuzz.run import fuzz
from stress.fuzz.session import tracebacks
from tritask.cli import load_app
from tritask.server.extension import ServeEnvironment
from tritask.transports.http import serve_http
from tritask.transports.websocket import serve_websocket

BOUNDED = 60


def examples() -> int:
    if settings.get_current_profile_name() == "tritask":
        return BOUNDED
    current = settings.default
    assert current is not None
    return int(current.max_examples)


def era() -> LegacyEra:
    return legacy_era(random.randrange(2**32))


def assert_clean(fuzzer: Fuzzer) -> None:
    report = fuzzer.ledger.report()
    context = (fuzzer.era.name, report)
    assert report["violations"] == [], context
    assert report["requests"] >= BOUNDED, context
    assert set(report["methods"]) >= {
        "initialize",
        "tools/call",
        "ping",
        "logging/setLevel",
        "resources/subscribe",
        "resources/unsubscribe",
        "resources/read",
        "prompts/get",
        "completion/complete",
    }, context
    assert report["tasksCreated"] == 0, context
    if isinstance(fuzzer.era, LegacyEra) and fuzzer.era.capabilities:  # the server asked
        assert any(method.startswith("(server) ") for method in report["methods"]), context


async def test_fuzz_legacy_streamable_http(tmp_path: Path) -> None:
    app = load_app(f"{FIXTURE}:app")
    env = ServeEnvironment(store_url=f"sqlite:{tmp_path / 'tasks.db'}")
    async with watched_logs() as logs, app.running(env), trio.open_nursery() as nursery:
        urls = await nursery.start(functools.partial(serve_http, app, "127.0.0.1", 0))
        async with httpx.AsyncClient(timeout=None) as client:
            fuzzer = Fuzzer(HttpDriver(client, urls[0] + "/mcp"), era())
            await fuzz(fuzzer, examples=examples())
            assert isinstance(fuzzer.era, LegacyEra) and fuzzer.era.session_id
        nursery.cancel_scope.cancel()
    assert_clean(fuzzer)
    assert logs.tracebacks == []


async def test_fuzz_legacy_websocket(tmp_path: Path) -> None:
    app = load_app(f"{FIXTURE}:app")
    env = ServeEnvironment(store_url=f"sqlite:{tmp_path / 'tasks.db'}")
    async with watched_logs() as logs, app.running(env), trio.open_nursery() as nursery:
        url = await nursery.start(functools.partial(serve_websocket, app, "127.0.0.1", 0))
        async with websocket(url) as driver:
            fuzzer = Fuzzer(driver, era())
            await fuzz(fuzzer, examples=examples())
            assert driver.problems == []
        nursery.cancel_scope.cancel()
    assert_clean(fuzzer)
    assert logs.tracebacks == []


async def test_fuzz_legacy_stdio_process(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "tritask", "serve", f"{FIXTURE}:app", "--stdio"]
    command += ["--store", f"sqlite:{tmp_path / 'tasks.db'}"]
    async with stdio_process(command, env=dict(os.environ)) as (driver, stderr):
        fuzzer = Fuzzer(driver, era())
        await fuzz(fuzzer, examples=examples())
        assert driver.problems == []
    log_text = b"".join(stderr).decode("utf-8", "replace")
    assert_clean(fuzzer)
    found, expected = tracebacks(log_text)
    assert found == expected, log_text[-6000:]
    assert "tritask: shutting down" in log_text


async def test_fuzz_legacy_streamable_http_with_oauth(tmp_path: Path) -> None:
    """The auth-on mode in a legacy session: initialize, every request and every answer to
    the server's own requests authenticated; every 7th generated request refused."""
    async with (
        watched_logs() as logs,
        oauth_served(tmp_path) as (url, credentials),
        httpx.AsyncClient(timeout=None) as client,
    ):
        fuzzer = Fuzzer(HttpDriver(client, url), era(), credentials=credentials)
        await fuzz(fuzzer, examples=examples())
        assert isinstance(fuzzer.era, LegacyEra) and fuzzer.era.session_id
    assert_clean(fuzzer)
    assert logs.tracebacks == []
    assert sum(credentials.refused.values()) >= examples() // DEFAULT_EVERY - 1
