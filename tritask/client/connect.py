"""``connect``: one entry point for the three transports.

The target says which: ``http://`` and ``https://`` are Streamable HTTP, ``ws://`` and
``wss://`` WebSocket, anything else a command that starts a stdio server (a string is split
like a shell would, a sequence is the argv as is).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

from tritask.client.client import Client
from tritask.client.http import Authorizer, HttpTransport, static_authorization
from tritask.client.stdio import open_stdio
from tritask.client.transport import Transport
from tritask.client.websocket import open_websocket


def transport_kind(target: str | Sequence[str]) -> str:
    """``http``, ``websocket`` or ``stdio``."""
    if isinstance(target, str):
        scheme = target.split(":", 1)[0].lower()
        if scheme in ("http", "https"):
            return "http"
        if scheme in ("ws", "wss"):
            return "websocket"
    return "stdio"


@asynccontextmanager
async def open_transport(
    target: str | Sequence[str],
    *,
    headers: Mapping[str, str] | None = None,
    auth: Authorizer | str | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    stderr: int | None = None,
) -> AsyncIterator[Transport]:
    """The transport for ``target``, open for the duration of the block."""
    authorizer = static_authorization(auth) if isinstance(auth, str) else auth
    kind = transport_kind(target)
    if kind == "http":
        assert isinstance(target, str)
        async with HttpTransport(target, headers=headers, authorizer=authorizer) as http:
            yield http
    elif kind == "websocket":
        assert isinstance(target, str)
        async with open_websocket(target, headers=headers, authorizer=authorizer) as ws:
            yield ws
    else:
        argv = shlex.split(target) if isinstance(target, str) else list(target)
        async with open_stdio(argv, env=env, cwd=cwd, stderr=stderr) as stdio:
            yield stdio


@asynccontextmanager
async def connect(
    target: str | Sequence[str],
    *,
    headers: Mapping[str, str] | None = None,
    auth: Authorizer | str | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    stderr: int | None = None,
    discover: bool = True,
    **options: Any,
) -> AsyncIterator[Client]:
    """``async with connect(url_or_command) as client:`` a ``Client`` on the right transport.

    ``auth`` is a fixed ``Authorization`` value or an ``Authorizer`` hook (HTTP: before each
    request and after a 401; WebSocket: at the handshake). ``env``, ``cwd`` and ``stderr``
    apply to a stdio server's process. With ``discover`` (the default) the client sends
    ``server/discover`` first and settles the protocol version (``client.server`` holds the
    answer). Other keyword arguments go to ``Client`` (input handlers, ``tasks``, …).
    """
    async with AsyncExitStack() as stack:
        transport = await stack.enter_async_context(
            open_transport(target, headers=headers, auth=auth, env=env, cwd=cwd, stderr=stderr)
        )
        client = Client(transport, **options)
        if discover:
            await client.discover()
        yield client
