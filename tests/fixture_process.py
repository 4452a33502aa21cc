"""``tritask serve`` of the conformance fixture as a real process, on HTTP and WebSocket at
once (shared by tests/client and tests/interop; tests/ is on sys.path through its conftest)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import attrs

REPO = Path(__file__).resolve().parents[1]
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
def serve_fixture(
    timeout: float = 60.0, *, store: str = "memory:", ws: bool = True
) -> Iterator[Served]:
    """The fixture served by a real process; SIGINT at the end, and it must exit.

    ``store`` is its ``--store`` URL; without ``ws`` it serves HTTP only (``Served.ws`` is "").
    """
    wanted = 2 if ws else 1
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tritask",
            "serve",
            FIXTURE,
            "--http",
            "127.0.0.1:0",
            *(["--ws", "127.0.0.1:0"] if ws else []),
            "--store",
            store,
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
            if len(found) == wanted:
                ready.set()
        ready.set()

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    try:
        if not ready.wait(timeout) or len(found) != wanted:
            raise RuntimeError("the fixture did not start:\n" + "".join(lines))
        yield Served(found["http"], found.get("ws", ""), lines)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        thread.join(timeout=5)
