"""The ``bench tasks --peer fastmcp-tasks`` server: FastMCP 4.1.4 with fastmcp-tasks 4.1.4.

Run by the pinned virtualenv's Python (``tests/interop/fastmcp-tasks-requirements.txt``, made
under ``.cache/venvs/`` by :func:`stress.bench.peers.fastmcp_python`), never by the project's:
``python peer_fastmcp.py`` binds a free loopback port, prints ``READY <port>`` and serves until
its stdin closes, like :mod:`stress.bench.servers`. It offers what the ``tasks`` benchmark
needs: a task-required ``noop`` tool on the SEP-2663 tasks extension with Docket's in-memory
backend (``memory://``, its single-process default), and a ``bench_stats`` tool answering
the same fields as tritask's (completed tasks, this process's CPU seconds). Docket's worker
concurrency is raised from its default of 10 to ``--concurrency`` (default 64), so the worker
does not limit a benchmark of 16 clients.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

COMPLETED = [0]


def build(concurrency: int) -> Any:
    fastmcp: Any = importlib.import_module("fastmcp")
    fastmcp_tasks: Any = importlib.import_module("fastmcp_tasks")
    mcp = fastmcp.FastMCP("bench-tasks-peer")
    mcp.add_extension(fastmcp_tasks.TasksExtension(url="memory://", concurrency=concurrency))

    tasks: Any = importlib.import_module("fastmcp.utilities.tasks")

    # fastmcp is not installed beside the project: its decorator is typed here by hand.
    tool: Callable[..., Callable[[Callable[..., Any]], Callable[..., Any]]] = mcp.tool

    @tool(task=tasks.TaskConfig(mode="required"))
    async def noop() -> str:
        """Do nothing (as the tritask side's no-op executor)."""
        COMPLETED[0] += 1
        return "ok"

    @tool()
    async def bench_stats() -> dict[str, Any]:
        """What this process has done so far (the fields tritask's bench_stats answers)."""
        return {
            "completed": COMPLETED[0],
            "otherStops": 0,
            "writes": 0,
            "calls": {},
            "pid": os.getpid(),
            "cpuSeconds": time.process_time(),
            "threadCpuSeconds": time.thread_time(),  # the event loop's thread
            "monotonicSeconds": time.monotonic(),
        }

    return mcp


async def serve(concurrency: int) -> None:
    uvicorn: Any = importlib.import_module("uvicorn")
    app = build(concurrency).http_app(path="/mcp")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    # The benchmark keeps its stats connection idle while the clients run (as for hypercorn
    # in stress.bench.servers: 75 s), so uvicorn's 5 s keep-alive default would close it.
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_keep_alive=75)
    server = uvicorn.Server(config)
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        if serving.done():
            serving.result()
            raise SystemExit("the peer server stopped before it started")
        await asyncio.sleep(0.01)
    sys.stdout.write(f"READY {port}\n")
    sys.stdout.flush()
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.buffer.read)  # until the benchmark closes it
    server.should_exit = True
    await serving


def main() -> None:
    parser = argparse.ArgumentParser(prog="peer_fastmcp.py")
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    asyncio.run(serve(args.concurrency))


if __name__ == "__main__":
    main()
