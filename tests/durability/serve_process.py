"""One real ``tritask serve`` process for the SIGKILL tests (shared by ``test_sigkill.py`` and
``test_sigkill_steps.py``; ``tests/durability`` is on ``sys.path`` as their directory)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping

import trio

URL_LINE = re.compile(r"serving Streamable HTTP on (http://\S+/mcp)")


class Server:
    """One ``tritask serve APP --store STORE`` process; its stderr is drained by a thread into
    a buffer (``lines``), where the serving line gives its URL."""

    def __init__(self, app: str, store: str, env: Mapping[str, str]) -> None:
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tritask",
                "serve",
                app,
                "--http",
                "127.0.0.1:0",
                "--store",
                store,
                "--log-level",
                "WARNING",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
        )
        self.pid = self.process.pid
        self.lines: list[str] = []
        self.url: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line)
            found = URL_LINE.search(line)
            if found and self.url is None:
                self.url = found.group(1)
                self._ready.set()
        self._ready.set()

    async def ready(self) -> str:
        await trio.to_thread.run_sync(self._ready.wait, 60)
        assert self.url is not None, "".join(self.lines)
        return self.url

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(30)

    def stop(self) -> int:
        self.process.send_signal(signal.SIGINT)
        return self.process.wait(30)
