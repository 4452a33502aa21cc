"""``tritask serve`` of the conformance fixture as a real process, on HTTP and WebSocket at
once (shared by tests/client, tests/interop and tests/stores; tests/ is on sys.path through its
conftest)."""

from __future__ import annotations

import sys
from pathlib import Path

from tritask.testing import ServeProcess

REPO = Path(__file__).resolve().parents[1]
FIXTURE = f"{REPO / 'examples' / 'conformance_fixture.py'}:app"
STDIO_COMMAND = [sys.executable, "-m", "tritask", "serve", FIXTURE, "--stdio", "--store", "memory:"]


def serve_fixture(*, store: str = "memory:", ws: bool = True) -> ServeProcess:
    """The fixture served by a real process (``with`` or ``async with`` starts it; SIGINT at
    the end). ``store`` is its ``--store`` URL; without ``ws`` it serves HTTP only."""
    return ServeProcess(FIXTURE, store=store, transports=("http", "ws") if ws else ("http",))
