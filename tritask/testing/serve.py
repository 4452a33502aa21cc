"""``tritask serve`` as a real process, for tests of an app as it is deployed.

A test that must see a real process (its signals, its exit code, a store reopened after a
SIGKILL, what it logs) starts one with :class:`ServeProcess`::

    from tritask.testing import ServeProcess

    async with ServeProcess("myapp.py:app", store=f"sqlite:{tmp_path / 'tasks.db'}") as server:
        ...  # talk to server.url
        await server.arestart(signal.SIGKILL)  # the same command again, on the same store
        ...
        assert await server.astop() == 0, server.stderr

or, where no trio loop runs (a module-scoped pytest fixture), ``with ServeProcess(...)``.

Why it is built this way:

* **Ready means reported.** ``tritask serve`` prints ``tritask: serving Streamable HTTP on
  URL`` (and ``... WebSocket on URL``) once each listener is bound; the process is ready when
  every requested transport has printed its line. Nothing sleeps or polls a port: a thread
  reads stderr line by line and sets an event, and a process that exits first ends the wait
  at once.
* **It never hangs.** Starting has a timeout (``start_timeout``), stopping too
  (``stop_timeout``, then SIGKILL); each failure raises :class:`ServeError`, whose message ends
  with everything the process wrote on stderr, since that is what explains it.
* **It always ends the process.** Leaving the block stops it (SIGINT, then SIGKILL past
  ``stop_timeout``); a cancelled async operation SIGKILLs it before the cancellation goes on,
  so no test leaves a server behind.
* **A thread, not a trio task, reads stderr**, so one process can outlive several trio runs
  (a module-scoped pytest fixture shared by trio tests) and serve sync code alike; the async
  methods wait for it in a worker thread, the sync ones block.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Final, TypeVar

import trio

__all__ = ["TRANSPORTS", "ServeError", "ServeProcess"]

_T = TypeVar("_T")

_REPORTS: Final[Mapping[str, re.Pattern[str]]] = {
    "http": re.compile(r"tritask: serving Streamable HTTP on (?P<url>http://\S+)"),
    "ws": re.compile(r"tritask: serving WebSocket on (?P<url>ws://\S+)"),
}
_FLAGS: Final[Mapping[str, str]] = {"http": "--http", "ws": "--ws"}
TRANSPORTS: Final = tuple(_REPORTS)
"""What :class:`ServeProcess` can serve: ``"http"`` (``--http``) and ``"ws"`` (``--ws``). A
stdio server has no URL to report: a client starts it itself (``connect([command, ...])``)."""


class ServeError(RuntimeError):
    """The process did not report its URLs within the start timeout, exited before it did, or
    did not exit within the stop timeout. ``stderr`` is what it wrote; the message ends with it.
    """

    def __init__(self, message: str, stderr: str) -> None:
        super().__init__(f"{message}; its stderr:\n{stderr}" if stderr else f"{message}")
        self.stderr = stderr


class _Incarnation:
    """One started process and the thread that reads its stderr into ``lines``."""

    def __init__(
        self,
        command: Sequence[str],
        cwd: Path | None,
        env: Mapping[str, str],
        wanted: Sequence[str],
    ) -> None:
        self.wanted = tuple(wanted)
        self.process = subprocess.Popen(
            command,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            encoding="utf-8",
            errors="replace",
            env=dict(env),
        )
        self.lines: list[str] = []
        self.urls: dict[str, str] = {}
        self.reported = threading.Event()
        """Set once every wanted transport has reported its URL, or at the end of stderr."""
        self.reader = threading.Thread(
            target=self._read, name=f"tritask-serve-{self.process.pid}", daemon=True
        )
        self.reader.start()

    def _read(self) -> None:
        stream = self.process.stderr
        assert stream is not None
        try:
            for line in stream:
                self.lines.append(line)
                for name in self.wanted:
                    found = _REPORTS[name].search(line)
                    if found is not None and name not in self.urls:
                        self.urls[name] = found.group("url")
                if len(self.urls) == len(self.wanted):
                    self.reported.set()
        except (OSError, ValueError):  # the pipe was closed under the reader: it is over
            pass
        finally:
            self.reported.set()

    @property
    def stderr(self) -> str:
        return "".join(list(self.lines))

    def end(self) -> None:
        """After the exit: let the reader take the last lines, then close the pipe."""
        self.reader.join(timeout=10)
        if self.process.stderr is not None and not self.reader.is_alive():
            self.process.stderr.close()


class ServeProcess:
    """``python -m tritask serve APP --http HOST:0 [--ws HOST:0] --store STORE *ARGS``.

    ``transports`` are served on ephemeral ports of ``host`` (the URLs are read from stderr,
    never guessed); ``env`` is the process's whole environment (default: this process's);
    ``cwd`` is where ``APP`` is resolved from. Nothing runs until :meth:`start`,
    :meth:`astart`, ``with`` or ``async with``; :meth:`restart` runs the same command again
    (same store: what survives is what the store kept).
    """

    def __init__(
        self,
        app: str,
        *,
        store: str = "memory:",
        transports: Sequence[str] = ("http",),
        env: Mapping[str, str] | None = None,
        args: Sequence[str] = (),
        cwd: str | os.PathLike[str] | None = None,
        host: str = "127.0.0.1",
        start_timeout: float = 60.0,
        stop_timeout: float = 30.0,
    ) -> None:
        unknown = [name for name in transports if name not in _REPORTS]
        if unknown or not transports or len(set(transports)) != len(transports):
            raise ValueError(
                f"transports must be distinct names among {', '.join(TRANSPORTS)}, not "
                f"{tuple(transports)!r}"
            )
        self.transports: tuple[str, ...] = tuple(transports)
        self.command: tuple[str, ...] = (
            sys.executable,
            "-m",
            "tritask",
            "serve",
            app,
            *(word for name in self.transports for word in (_FLAGS[name], f"{host}:0")),
            "--store",
            store,
            *args,
        )
        self.env: Mapping[str, str] | None = env
        self.cwd = None if cwd is None else Path(cwd)
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self._current: _Incarnation | None = None
        self._deadline = 0.0

    # -- what it is now ------------------------------------------------------------------

    @property
    def process(self) -> subprocess.Popen[str]:
        """The current process (the latest one started)."""
        return self._started().process

    @property
    def pid(self) -> int:
        return self._started().process.pid

    @property
    def returncode(self) -> int | None:
        """The exit code of the current process; ``None`` while it runs."""
        return self._started().process.poll()

    @property
    def urls(self) -> Mapping[str, str]:
        """The URL each transport reported, by transport name."""
        return dict(self._started().urls)

    @property
    def url(self) -> str:
        """The Streamable HTTP endpoint (``http://127.0.0.1:PORT/mcp``)."""
        return self._reported("http")

    @property
    def ws_url(self) -> str:
        """The WebSocket URL (``ws://127.0.0.1:PORT``)."""
        return self._reported("ws")

    @property
    def stderr(self) -> str:
        """What the current process has written on stderr so far."""
        return "" if self._current is None else self._current.stderr

    def __repr__(self) -> str:
        if self._current is None:
            return f"<ServeProcess {self.command[4]!r} not started>"
        code = self._current.process.poll()
        state = "running" if code is None else f"exited {code}"
        return f"<ServeProcess {self.command[4]!r} pid {self.pid} {state}>"

    # -- sync ----------------------------------------------------------------------------

    def launch(self) -> None:
        """Start the process without waiting for it (then :meth:`wait_ready` or :meth:`ready`;
        a test that must be able to kill it while it boots uses this)."""
        if self._current is not None and self._current.process.poll() is None:
            raise RuntimeError(f"{self!r} is running: stop it before starting it again")
        env = os.environ if self.env is None else self.env
        self._deadline = time.monotonic() + self.start_timeout
        self._current = _Incarnation(self.command, self.cwd, env, self.transports)

    def wait_ready(self) -> None:
        """Block until every transport reported its URL; :class:`ServeError` (the process
        killed) past ``start_timeout`` since it was launched, or if it exited first."""
        current = self._started()
        current.reported.wait(max(0.0, self._deadline - time.monotonic()))
        self._check_ready(current)

    def start(self) -> None:
        """:meth:`launch`, then :meth:`wait_ready`."""
        self.launch()
        self.wait_ready()

    def stop(self, sig: signal.Signals = signal.SIGINT) -> int:
        """Send ``sig`` (unless it already exited) and wait for the exit; its exit code
        (``-9`` after SIGKILL). Past ``stop_timeout`` it is killed and :class:`ServeError`
        raised."""
        current = self._started()
        if current.process.poll() is None:
            current.process.send_signal(sig)
        try:
            code = current.process.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            current.process.kill()
            current.process.wait()
            current.end()
            raise ServeError(
                f"{self!r} did not exit within {self.stop_timeout}s of {sig.name}; killed it",
                current.stderr,
            ) from None
        current.end()
        return code

    def terminate(self) -> int:
        """:meth:`stop` with SIGTERM."""
        return self.stop(signal.SIGTERM)

    def kill(self) -> int:
        """:meth:`stop` with SIGKILL: nothing is released, as in a crash."""
        return self.stop(signal.SIGKILL)

    def restart(self, sig: signal.Signals = signal.SIGINT) -> int:
        """:meth:`stop` with ``sig``, then :meth:`start` the same command; the stopped one's
        exit code (its pid was :attr:`pid` before)."""
        code = self.stop(sig)
        self.start()
        return code

    def close(self) -> None:
        """End the process whatever its state (SIGINT, SIGKILL past ``stop_timeout``); never
        raises, and does nothing if it never started or already ended."""
        if self._current is None:
            return
        with contextlib.suppress(ServeError):  # it was killed; the error is for stop()
            self.stop()

    def __enter__(self) -> ServeProcess:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # -- async (trio): the waits run in a worker thread; a cancellation SIGKILLs -----------

    async def ready(self) -> None:
        """:meth:`wait_ready` without blocking the trio loop."""
        await self._in_thread(self.wait_ready)

    async def astart(self) -> None:
        """:meth:`launch`, then :meth:`ready`."""
        self.launch()
        await self.ready()

    async def astop(self, sig: signal.Signals = signal.SIGINT) -> int:
        """:meth:`stop` without blocking the trio loop."""
        return await self._in_thread(self.stop, sig)

    async def aterminate(self) -> int:
        return await self.astop(signal.SIGTERM)

    async def akill(self) -> int:
        return await self.astop(signal.SIGKILL)

    async def arestart(self, sig: signal.Signals = signal.SIGINT) -> int:
        """:meth:`restart` without blocking the trio loop."""
        code = await self.astop(sig)
        await self.astart()
        return code

    async def aclose(self) -> None:
        """:meth:`close` without blocking the trio loop (at once with SIGKILL if cancelled)."""
        if self._current is not None:
            await self._in_thread(self.close)

    async def __aenter__(self) -> ServeProcess:
        await self.astart()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    # -- inside ---------------------------------------------------------------------------

    def _started(self) -> _Incarnation:
        if self._current is None:
            raise RuntimeError(f"{self!r}: start it first")
        return self._current

    def _reported(self, transport: str) -> str:
        current = self._started()
        if transport not in self.transports:
            raise RuntimeError(f"{self!r} does not serve {transport!r} ({self.transports})")
        url = current.urls.get(transport)
        if url is None:
            raise RuntimeError(f"{self!r} has not reported its {transport} URL yet")
        return url

    def _check_ready(self, current: _Incarnation) -> None:
        if len(current.urls) == len(current.wanted):
            return
        missing = ", ".join(name for name in current.wanted if name not in current.urls)
        if not current.reported.is_set():
            current.process.kill()
            current.process.wait()
            current.end()
            raise ServeError(
                f"{self!r} reported no URL for {missing} within {self.start_timeout}s; killed it",
                current.stderr,
            )
        # The end of stderr: the process is exiting (or closed stderr, and is killed).
        try:
            code = current.process.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            current.process.kill()
            code = current.process.wait()
        current.end()
        raise ServeError(
            f"{self!r} exited with code {code} before it reported a URL for {missing}",
            current.stderr,
        )

    def _kill_now(self) -> None:
        if self._current is not None and self._current.process.poll() is None:
            self._current.process.kill()
            self._current.process.wait()

    async def _in_thread(self, function: Callable[..., _T], *args: object) -> _T:
        try:
            return await trio.to_thread.run_sync(function, *args, abandon_on_cancel=True)
        except trio.Cancelled:
            # The abandoned thread ends with the process: its wait returns, stderr ends.
            self._kill_now()
            raise
