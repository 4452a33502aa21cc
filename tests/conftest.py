"""Shared fixtures for the whole test suite (keep this small and generic)."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
from hypothesis import settings

from tritask.server.app import App
from tritask.transports.http import HttpOptions, serve_http

# Hypothesis's per-example deadline is a timed assertion: on a loaded 2-CPU machine an
# example can take longer than 200 ms without anything being wrong. Speed is measured by the
# benchmarks, never by the tests.
settings.register_profile("tritask", deadline=None)
# A longer fuzz run (issue 18): ``pytest tests/fuzz --hypothesis-profile=fuzz-long``. The fuzz
# tests run a bounded number of examples under the default profile and ``max_examples`` of
# any other, per transport.
settings.register_profile("fuzz-long", deadline=None, max_examples=2000)
settings.load_profile("tritask")

TEST_STATE_KEY = "tritask-test-state-key-0123456789"


@pytest.fixture
def make_app() -> Callable[..., App]:
    """A factory of fresh ``App`` instances with a fixed request-state key (no random key)."""

    def factory(name: str = "test-app", version: str = "0.0.1", **kwargs: Any) -> App:
        kwargs.setdefault("state_key", TEST_STATE_KEY)
        return App(name, version, **kwargs)

    return factory


@pytest.fixture
def http_server(nursery: trio.Nursery) -> Callable[..., Awaitable[str]]:
    """``await http_server(app, options)`` serves ``app`` on a free loopback port.

    The server runs in the test's nursery (stopped when the test ends); the base URL
    (``http://127.0.0.1:PORT``, without the MCP path) is returned.
    """

    async def start(app: App, options: HttpOptions | None = None) -> str:
        urls: list[str] = await nursery.start(
            functools.partial(serve_http, app, "127.0.0.1", 0, options=options)
        )
        return urls[0]

    return start
