"""stdio for the client: launch the server as a child process, one JSON-RPC message per line.

The child's stdout carries only MCP messages; its stderr is passed through (or redirected) so
its logs never mix with the protocol. Closing the client closes the child's stdin, which a
server takes as the end of the session (the spec says it SHOULD then exit promptly); a child
that is still running after ``shutdown_timeout`` is terminated, then killed.
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from typing import Final

import trio

from tritask.client._framed import DEFAULT_BUFFER, FramedConnection
from tritask.client.errors import TransportError
from tritask.protocol.lines import LineSplitter, Oversize

log = logging.getLogger("tritask.client")

DEFAULT_MAX_LINE_BYTES: Final = 64 * 1024 * 1024
_CHUNK: Final = 65536


async def read_lines(
    stream: trio.abc.ReceiveStream, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
) -> AsyncIterator[bytes]:
    """Non-empty lines of ``stream``; an oversize line is skipped without being buffered."""
    splitter = LineSplitter(max_line_bytes)
    while True:
        chunk = await stream.receive_some(_CHUNK)
        lines = splitter.feed(chunk) if chunk else splitter.end()
        for line in lines:
            if isinstance(line, Oversize):
                log.warning("skipping a line longer than %d bytes from the server", max_line_bytes)
            else:
                yield line
        if not chunk:
            return


@asynccontextmanager
async def open_stdio(
    command: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    stderr: int | None = None,
    shutdown_timeout: float = 5.0,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    buffer: int = DEFAULT_BUFFER,
) -> AsyncIterator[FramedConnection]:
    """Run ``command`` and speak MCP on its stdin/stdout.

    ``stderr`` is passed to the child as is (``None`` inherits ours, ``subprocess.DEVNULL``
    silences it). ``env`` replaces the environment when given (default: ours).
    """
    argv = list(command)
    if not argv:
        raise ValueError("an empty command")
    try:
        process = await trio.lowlevel.open_process(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=dict(env) if env is not None else None,
            cwd=cwd,
        )
    except OSError as error:
        raise TransportError(f"cannot start {argv[0]!r}: {error}") from error
    assert process.stdin is not None and process.stdout is not None
    stdin, stdout = process.stdin, process.stdout

    async def send_text(text: str) -> None:
        await stdin.send_all(text.encode("utf-8") + b"\n")

    connection = FramedConnection(
        send_text, description=f"stdio:{os.path.basename(argv[0])}", buffer=buffer
    )
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(connection.run, read_lines(stdout, max_line_bytes))
            try:
                yield connection
            finally:
                with trio.CancelScope(shield=True):
                    await _close_stdin(stdin)
                    with trio.move_on_after(shutdown_timeout):
                        await process.wait()
                nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await _reap(process, argv[0])


async def _close_stdin(stdin: trio.abc.SendStream) -> None:
    with suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        await stdin.aclose()


async def _reap(process: trio.Process, name: str) -> None:
    if process.returncode is None:
        log.info("%s did not exit after stdin closed; terminating it", name)
        process.terminate()
        with trio.move_on_after(2):
            await process.wait()
    if process.returncode is None:
        process.kill()
        await process.wait()
    for stream in (process.stdin, process.stdout):
        if stream is not None:
            await stream.aclose()
