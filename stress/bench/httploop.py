"""Requests through tritask's HTTP server in one process: a steady measure for callgrind.

``python -m stress.bench.httploop N [echo|bare|floor]`` serves one keep-alive connection with
``_h11server``'s connection handler on one end of a socketpair and drives it from the other with
the load generator's ``tools/call`` (:meth:`McpRequest.encode`), N requests after a warm-up of
200, one at a time; it prints the CPU time per request (client included) on stderr. ``echo``
serves an ``App`` with an ``echo`` tool through ``HttpTransport``; ``bare`` a fixed JSON answer
from a bare ASGI app (the server alone); ``floor`` no server at all, a responder that reads and
writes the same answer (what the client and trio's sockets cost).

Under callgrind the instruction count per request is the difference between two runs divided by
the difference of their N (the start-up cancels out), steady whatever else the machine does:

    valgrind --tool=callgrind --callgrind-out-file=/dev/null python -m stress.bench.httploop 500
    valgrind --tool=callgrind --callgrind-out-file=/dev/null python -m stress.bench.httploop 2500

(``python`` must be the interpreter itself, not a shim script: valgrind does not follow
children by default.)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Final

import trio

from stress.bench.loadgen import McpRequest
from tritask.server.app import App
from tritask.transports import _h11server
from tritask.transports.http import HttpTransport

Message = MutableMapping[str, Any]
ECHO: Final = McpRequest(
    "tools/call", {"name": "echo", "arguments": {"text": "hello"}}, name="echo"
)
ANSWER: Final = (
    b'{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"hello"}],'
    b'"isError":false}}'
)
WARM_UP: Final = 200


async def bare_app(
    scope: MutableMapping[str, Any],
    receive: Callable[[], Awaitable[Message]],
    send: Callable[[Message], Awaitable[None]],
) -> None:
    while (await receive()).get("more_body"):
        pass
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": ANSWER})


async def floor(stream: trio.SocketStream) -> None:
    answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
    answer %= (len(ANSWER), ANSWER)
    while await stream.receive_some(65536):
        await stream.send_all(answer)


def echo_app() -> HttpTransport:
    app = App("bench-httploop", "1.0.0")

    @app.tool()
    async def echo(text: str) -> str:
        """Return the text."""
        return text

    return HttpTransport(app)


class Client:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = bytearray()

    async def call(self, request_id: int) -> bytes:
        await self.stream.send_all(ECHO.encode("127.0.0.1:1", "/mcp", request_id))
        buffer = self.buffer
        while True:
            end = buffer.find(b"\r\n\r\n")
            if end != -1:
                head = bytes(buffer[:end]).lower()
                start = head.find(b"content-length: ")
                if start == -1:
                    raise RuntimeError(f"no content-length in {head!r}")
                length = int(head[start + 16 :].split(b"\r\n", 1)[0])
                total = end + 4 + length
                if len(buffer) >= total:
                    response = bytes(buffer[:total])
                    del buffer[:total]
                    return response
            data = await self.stream.receive_some(65536)
            if not data:
                raise RuntimeError("the server closed the connection")
            buffer += data


async def run(requests: int, mode: str) -> float:
    """CPU seconds per request (client included) over ``requests`` requests."""
    left, right = trio.socket.socketpair()
    server_stream, client_stream = trio.SocketStream(left), trio.SocketStream(right)
    client = Client(client_stream)
    async with trio.open_nursery() as nursery:
        if mode == "floor":
            nursery.start_soon(floor, server_stream)
        else:
            app = echo_app() if mode == "echo" else bare_app
            server = _h11server._Server(app, _h11server.ServerConfig(lifespan=False))
            nursery.start_soon(server.connection, server_stream)
        first = await client.call(0)
        if not first.startswith(b"HTTP/1.1 200 "):
            raise RuntimeError(f"unexpected answer {first!r}")
        for n in range(WARM_UP):
            await client.call(n + 1)
        started = time.process_time()
        for n in range(requests):
            await client.call(WARM_UP + 1 + n)
        spent = time.process_time() - started
        await client_stream.aclose()
        nursery.cancel_scope.deadline = trio.current_time() + 2
    return spent / max(requests, 1)


def main(argv: list[str]) -> None:
    requests = int(argv[0]) if argv else 2000
    mode = argv[1] if len(argv) > 1 else "echo"
    if mode not in ("echo", "bare", "floor"):
        raise SystemExit(f"mode must be echo, bare or floor, not {mode!r}")
    per_request = trio.run(run, requests, mode)
    print(f"{requests} requests ({mode}): {per_request * 1e6:.1f} us of CPU each", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
