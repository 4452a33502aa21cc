"""What the fuzz modules (``test_fuzz``: 2026-07-28, ``test_fuzz_legacy``: the initialize era)
share: the conformance fixture served on SQLite over each transport, in-process (HTTP,
WebSocket, HTTP behind OAuth) or as a ``tritask serve --stdio`` process, the server-log checks,
and the number of examples a run makes. Each module keeps its own promises (``assert_clean``).
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

from stress.fuzz.auth import Credentials, standard_faults
from stress.fuzz.drivers import HttpDriver, StdioDriver, WebSocketDriver, stdio_process, websocket
from stress.fuzz.session import LogWatch, tracebacks
from tritask.cli import load_app
from tritask.server.app import App
from tritask.server.extension import ServeEnvironment
from tritask.transports.http import serve_http
from tritask.transports.websocket import serve_websocket

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "examples" / "conformance_fixture.py"


def examples(bounded: int) -> int:
    """``bounded`` in the default profile; a chosen profile's ``max_examples`` otherwise
    (``--hypothesis-profile=fuzz-long``)."""
    if settings.get_current_profile_name() == "tritask":
        return bounded
    current = settings.default
    assert current is not None
    return int(current.max_examples)


def fixture(tmp_path: Path) -> tuple[App, ServeEnvironment]:
    """A fresh fixture app and the environment that runs it on ``tmp_path/tasks.db``."""
    return load_app(f"{FIXTURE}:app"), ServeEnvironment(store_url=sqlite_store(tmp_path))


def sqlite_store(tmp_path: Path) -> str:
    return f"sqlite:{tmp_path / 'tasks.db'}"


@asynccontextmanager
async def watched_logs() -> AsyncIterator[LogWatch]:
    """Every log record with a traceback, from the in-process server, while the block runs."""
    watch = LogWatch()
    root = logging.getLogger()
    root.addHandler(watch)
    try:
        yield watch
    finally:
        root.removeHandler(watch)


@asynccontextmanager
async def http_served(tmp_path: Path) -> AsyncIterator[tuple[HttpDriver, LogWatch]]:
    """The fixture on Streamable HTTP (``serve_http`` in this process), a driver of it, and
    its log's tracebacks."""
    app, env = fixture(tmp_path)
    async with watched_logs() as logs, app.running(env), trio.open_nursery() as nursery:
        urls = await nursery.start(functools.partial(serve_http, app, "127.0.0.1", 0))
        async with httpx.AsyncClient(timeout=None) as client:
            yield HttpDriver(client, urls[0] + "/mcp"), logs
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def websocket_served(tmp_path: Path) -> AsyncIterator[tuple[WebSocketDriver, LogWatch]]:
    """The fixture on WebSocket (``serve_websocket`` in this process), a driver of it, and
    its log's tracebacks."""
    app, env = fixture(tmp_path)
    async with watched_logs() as logs, app.running(env), trio.open_nursery() as nursery:
        url = await nursery.start(functools.partial(serve_websocket, app, "127.0.0.1", 0))
        async with websocket(url) as driver:
            yield driver, logs
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def stdio_served(tmp_path: Path) -> AsyncIterator[tuple[StdioDriver, list[bytes]]]:
    """``tritask serve <fixture> --stdio`` as a process (ended by EOF on its stdin), a driver
    of it, and its stderr (complete once the block has ended: see :func:`assert_clean_log`)."""
    command = [sys.executable, "-m", "tritask", "serve", f"{FIXTURE}:app", "--stdio"]
    command += ["--store", sqlite_store(tmp_path)]
    async with stdio_process(command, env=dict(os.environ)) as (driver, stderr):
        yield driver, stderr


def assert_clean_log(stderr: list[bytes]) -> None:
    """The stdio server's log: no traceback but the fixture's deliberate crash, and it shut
    down (it did not die)."""
    log_text = b"".join(stderr).decode("utf-8", "replace")
    found, expected = tracebacks(log_text)
    assert found == expected, log_text[-6000:]
    assert "tritask: shutting down" in log_text


@asynccontextmanager
async def oauth_served(
    tmp_path: Path,
) -> AsyncIterator[tuple[HttpDriver, Credentials, LogWatch]]:
    """The fixture on Streamable HTTP behind ``BearerAuth`` (a loopback authorization
    server), a driver of it, the credentials of the auth-on mode (refreshed tokens of one
    principal and the standard broken ones), and its log's tracebacks."""
    from tritask.auth import BearerAuth, JWTVerifier
    from tritask.testing.oauth import free_port, running_authorization_server
    from tritask.transports.http import HttpOptions

    app, env = fixture(tmp_path)
    port = free_port()
    resource = f"http://127.0.0.1:{port}/mcp"
    async with watched_logs() as logs, running_authorization_server() as server:
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
            async with httpx.AsyncClient(timeout=None) as client:
                yield HttpDriver(client, resource), Credentials(tokens, faults), logs
            nursery.cancel_scope.cancel()
