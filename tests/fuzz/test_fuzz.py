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
from stress.fuzz.auth import DEFAULT_EVERY, Credentials, standard_faults
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


@asynccontextmanager
async def oauth_served(
    tmp_path: Path,
) -> AsyncIterator[tuple[str, Credentials]]:
    """The fixture behind ``BearerAuth`` (a loopback authorization server), with credentials
    for the auth-on mode: refreshed tokens of one principal and the standard broken ones."""
    from tritask.auth import BearerAuth, JWTVerifier
    from tritask.testing.oauth import free_port, running_authorization_server
    from tritask.transports.http import HttpOptions

    app = load_app(f"{FIXTURE}:app")
    env = ServeEnvironment(store_url=f"sqlite:{tmp_path / 'tasks.db'}")
    port = free_port()
    resource = f"http://127.0.0.1:{port}/mcp"
    async with running_authorization_server() as server:
        auth = BearerAuth(
            resource=resource,
            authorization_servers=[server.issuer],
            verifier=JWTVerifier(server.issuer, f"{server.issuer}/jwks"),
            required_scopes=["mcp"],
        )
        tokens = [server.mint(aud=resource, sub="fuzzer", exp_in=3600) for _ in range(3)]
        faults = standard_faults(
            server.mint(aud=resource, exp_in=-600), server.mint(aud="https://elsewhere/mcp")
        )
        serve = functools.partial(
            serve_http, app, "127.0.0.1", port, options=HttpOptions(auth=auth)
        )
        async with app.running(env), trio.open_nursery() as nursery:
            await nursery.start(serve)
            yield resource, Credentials(tokens, faults)
            nursery.cancel_scope.cancel()


async def test_fuzz_streamable_http_with_oauth(tmp_path: Path) -> None:
    """The auth-on mode: every request authenticated, every 7th generated one refused."""
    async with (
        watched_logs() as logs,
        oauth_served(tmp_path) as (url, credentials),
        httpx.AsyncClient(timeout=None) as client,
    ):
        fuzzer = Fuzzer(HttpDriver(client, url), credentials=credentials)
        await fuzz(fuzzer, examples=examples())
    assert_clean(fuzzer)
    assert logs.tracebacks == []
    assert sum(credentials.refused.values()) >= examples() // DEFAULT_EVERY - 1
    assert len(credentials.refused) == len(credentials.faults)
