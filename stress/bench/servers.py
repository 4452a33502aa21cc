"""The server side of the benchmarks, each run in its own process.

``python -m stress.bench.servers KIND [options]`` binds a free loopback port, prints
``READY <port>`` on stdout and serves until its stdin closes (the benchmark holds the other end).

* ``core-tritask``: a tritask ``App`` with one trivial tool, ``serve_http``;
* ``core-mcp``: the same tool on ``mcp`` 2.3.0's ``MCPServer``, its ``streamable_http_app()``
  under hypercorn's trio worker with the same hypercorn settings as ``serve_http``;
* ``tasks``: a tritask app whose ``noop`` tool is task-required, a no-op executor, the store
  named by ``--store`` wrapped in a write counter, and a ``bench_stats`` tool the benchmark
  polls (completed jobs and store writes of this process);
* ``idle``: a task-required ``nap`` tool that sleeps inside the tool (see
  :mod:`stress.bench.idle`);
* ``listen``: a tritask app on the memory store whose ``step`` tool is task-required and asks
  ``rounds`` inputs in turn (so every ``tasks/update`` commits twice), served without a
  connection cap, for ``bench listen``'s thousands of open listen streams;
* ``soak``: not a server: runs the soak workload in-process and prints one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import resource
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs
import trio
import trio.testing

from tritask.server.context import Context  # at module level: tool annotations resolve here

log = logging.getLogger("stress.bench.servers")

TOOL_TEXT = "hello"


def _hypercorn_config(port: int) -> Any:
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("stress.bench.hypercorn")
    config.graceful_timeout = 5.0
    config.keep_alive_timeout = 75.0
    return config


async def _until_stdin_closes() -> None:
    stream = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    async with stream:
        while await stream.receive_some(4096):
            pass


def _ready(binds: list[str]) -> None:
    port = int(binds[0].rsplit(":", 1)[1])
    sys.stdout.write(f"READY {port}\n")
    sys.stdout.flush()


Serve = Callable[..., Awaitable[Any]]


async def _serve_until_eof(serve: Serve) -> None:
    shutdown = trio.Event()

    async def trigger() -> None:
        await shutdown.wait()

    async with trio.open_nursery() as nursery:
        binds = await nursery.start(lambda task_status: serve(trigger, task_status))
        _ready(binds)
        await _until_stdin_closes()
        shutdown.set()
        nursery.cancel_scope.deadline = trio.current_time() + 10


# -- core ---------------------------------------------------------------------------------------


async def core_tritask(args: argparse.Namespace) -> None:
    from tritask.server.app import App
    from tritask.transports.http import serve_http

    app = App("bench-core", "1.0.0")

    @app.tool()
    async def echo(text: str) -> str:
        """Return the text."""
        return text

    async def serve(trigger: Callable[[], Awaitable[None]], task_status: Any) -> None:
        await serve_http(app, "127.0.0.1", 0, shutdown_trigger=trigger, task_status=task_status)

    await _serve_until_eof(serve)


async def core_mcp(args: argparse.Namespace) -> None:
    from hypercorn.trio import serve as hypercorn_serve
    from mcp.server import MCPServer

    server: Any = MCPServer("bench-core", version="1.0.0", log_level="WARNING")

    async def echo(text: str) -> str:
        """Return the text."""
        return text

    server.tool()(echo)
    app = server.streamable_http_app(json_response=args.json_response, host="127.0.0.1")

    async def serve(trigger: Callable[[], Awaitable[None]], task_status: Any) -> None:
        await hypercorn_serve(
            app,
            _hypercorn_config(0),
            shutdown_trigger=trigger,
            task_status=task_status,
            mode="asgi",
        )

    await _serve_until_eof(serve)


async def core_ceiling(args: argparse.Namespace) -> None:
    """Not MCP: a fixed JSON answer from a bare ASGI app on the same hypercorn settings.

    It measures what hypercorn itself allows on this machine, the ceiling of both servers.
    """
    from hypercorn.trio import serve as hypercorn_serve

    body = (
        b'{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"hello"}],'
        b'"isError":false}}'
    )

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        while (await receive()).get("more_body"):
            pass
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def serve(trigger: Callable[[], Awaitable[None]], task_status: Any) -> None:
        await hypercorn_serve(
            app,
            _hypercorn_config(0),
            shutdown_trigger=trigger,
            task_status=task_status,
            mode="asgi",
        )

    await _serve_until_eof(serve)


# -- tasks --------------------------------------------------------------------------------------


class _NoopExecutor:
    async def execute(self, work: Any, token: Any, state: Any) -> Any:
        from tritask.tasks.executor import Completed

        return Completed({"content": [], "isError": False})


class _CountingSink:
    """Counts job stops; :meth:`wait_for` parks until ``n`` jobs have stopped."""

    def __init__(self) -> None:
        self.completed = 0
        self.other_stops = 0
        self._target: tuple[int, trio.Event] | None = None

    async def wait_for(self, stops: int) -> None:
        if self.completed + self.other_stops >= stops:
            return
        event = trio.Event()
        self._target = (stops, event)
        await event.wait()

    def handle_event(
        self, name: str, measurements: Mapping[str, float | int], metadata: Mapping[str, Any]
    ) -> None:
        if name == "tasks.runner.job.stop":
            if (
                metadata.get("outcome") == "completed"
                and metadata.get("store_outcome") == "applied"
            ):
                self.completed += 1
            else:
                self.other_stops += 1
            target = self._target
            if target is not None and self.completed + self.other_stops >= target[0]:
                target[1].set()


class _GatedExecutor:
    """Completes each task once the gate opens (``bench_open``): until then the runner's slots
    hold waiting attempts and every other task waits queued in the store."""

    def __init__(self) -> None:
        self.gate = trio.Event()

    async def execute(self, work: Any, token: Any, state: Any) -> Any:
        from tritask.tasks.executor import Completed

        await self.gate.wait()
        return Completed({"content": [], "isError": False})


def store_options(args: argparse.Namespace) -> dict[str, Any]:
    from tritask.tasks.stores import store_scheme

    scheme = store_scheme(args.store)
    options: dict[str, Any] = {}
    if getattr(args, "unlimited", False):
        options["max_tasks"] = None
        options["max_active_tasks_per_scope"] = None
    if scheme == "sqlite":
        options["synchronous"] = args.sqlite_synchronous
        options["exclusive"] = False
    return options


@attrs.frozen
class TasksApp:
    """The benchmark's application: a task-required ``noop`` tool with a no-op executor, the
    store (with its default limits unless ``options`` turn them off, as ``--unlimited`` does)
    wrapped in a write counter, and a ``bench_stats`` tool."""

    app: Any
    store: Any
    sink: _CountingSink


def tasks_app(
    store_url: str, options: Mapping[str, Any], max_jobs: int, executor: Any = None
) -> TasksApp:
    from stress.bench.idle import _GcClock
    from stress.common import open_stress_store
    from stress.wrappers import CountingStore
    from tritask.server.app import App
    from tritask.tasks.extension import Tasks

    store = CountingStore(
        open_stress_store(store_url, mock_clock=False, store_limits=True, **options)
    )
    collecting = _GcClock()
    gc.callbacks.append(collecting)
    sink = _CountingSink()
    tasks = Tasks(
        store=store,
        scope="shared",
        task_support={"noop": "required"},
        runner_options={
            "executor": executor or _NoopExecutor(),
            "instrumentation": sink,
            "max_jobs": max_jobs,
            "owner_id": f"bench-{os.getpid()}",
        },
    )
    app = App("bench-tasks", "1.0.0", extensions=[tasks])

    @app.tool()
    async def noop() -> str:
        """Do nothing (the benchmark's executor never even calls it)."""
        return "ok"

    @app.tool()
    async def bench_stats() -> dict[str, Any]:
        """What this process has done so far."""
        return {
            "completed": sink.completed,
            "otherStops": sink.other_stops,
            "writes": store.writes,
            "calls": dict(store.calls),
            "pid": os.getpid(),
            "cpuSeconds": time.process_time(),
            # This tool runs in the trio thread: its CPU time alone, the server's critical path
            # (the process time above also counts the SQLite lane's worker thread).
            "threadCpuSeconds": time.thread_time(),
            # Of which in the kernel (system calls: sockets, epoll, the WAL's writes).
            "threadSystemSeconds": resource.getrusage(resource.RUSAGE_THREAD).ru_stime,
            "monotonicSeconds": time.monotonic(),
            # The cyclic collector's wall time (in the trio thread: it runs where it allocates).
            "gcSeconds": collecting.seconds,
            "rssKiB": _current_rss_kib(),
            "peakRssKiB": _peak_rss_kib(),
            "jobs": len(tasks.runner.active_task_ids()) if tasks.runner is not None else 0,
            **_writer_stats(store),
        }

    return TasksApp(app, store, sink)


def _writer_stats(store: Any) -> dict[str, Any]:
    """The SQLite store's writer process (``tritask_sqlite``): its CPU, part of the server's
    (another process, so ``cpuSeconds`` does not count it), and what it wrote."""
    writer = getattr(store, "writer", None)
    if writer is None or writer.pid is None:
        return {}
    from stress.bench.benchmarks import process_cpu_seconds

    return {
        "writerCpuSeconds": process_cpu_seconds(writer.pid),
        "writerRssKiB": _rss_kib_of(writer.pid),
        "writerWritten": writer.written,
        "writerUndecided": writer.undecided,
        "writerBatches": writer.batches,
    }


async def tasks_server(args: argparse.Namespace) -> None:
    from tritask.server.extension import ServeEnvironment
    from tritask.transports.http import serve_http

    bench = tasks_app(args.store, store_options(args), args.max_jobs)

    async def serve(trigger: Callable[[], Awaitable[None]], task_status: Any) -> None:
        await serve_http(
            bench.app, "127.0.0.1", 0, shutdown_trigger=trigger, task_status=task_status
        )

    async with bench.store, bench.app.running(ServeEnvironment(store_url=args.store)):
        await _serve_until_eof(serve)


async def queue_server(args: argparse.Namespace) -> None:
    """The tasks server with a gated executor and a ``bench_open`` tool (``bench queue``)."""
    from tritask.server.app import App
    from tritask.server.extension import ServeEnvironment
    from tritask.transports.http import serve_http

    gated = _GatedExecutor()
    bench = tasks_app(args.store, store_options(args), args.max_jobs, gated)
    app: App = bench.app

    @app.tool()
    async def bench_open() -> str:
        """Open the gate: every waiting and queued task completes."""
        gated.gate.set()
        return "open"

    async def serve(trigger: Callable[[], Awaitable[None]], task_status: Any) -> None:
        await serve_http(
            bench.app, "127.0.0.1", 0, shutdown_trigger=trigger, task_status=task_status
        )

    async with bench.store, bench.app.running(ServeEnvironment(store_url=args.store)):
        await _serve_until_eof(serve)


# -- listen -------------------------------------------------------------------------------------


async def listen_server(args: argparse.Namespace) -> None:
    from tritask.server.app import App
    from tritask.server.extension import ServeEnvironment
    from tritask.server.mrtr import elicitation
    from tritask.tasks import MemoryStore, Tasks
    from tritask.transports._h11server import ServerConfig
    from tritask.transports.http import serve_http

    store = MemoryStore(scope="shared", max_tasks=None, max_active_tasks_per_scope=None)
    tasks = Tasks(
        store=store,
        task_support={"step": "required"},
        ttl_ms=None,
        runner_options={"max_jobs": args.max_jobs, "reap_interval_ms": None},
    )
    app = App("bench-listen", "1.0.0", extensions=[tasks])

    @app.tool()
    async def step(ctx: Context, rounds: int = 1) -> str:
        """Ask ``rounds`` inputs in turn, then finish."""
        for index in range(rounds):
            await ctx.await_input(f"r{index}", elicitation(f"Round {index}?", {"type": "object"}))
        return "done"

    async def serve(trigger: Callable[[], Awaitable[None]], task_status: Any) -> None:
        await serve_http(
            app,
            "127.0.0.1",
            0,
            shutdown_trigger=trigger,
            task_status=task_status,
            server_config=ServerConfig(max_connections=None),
        )

    async with store, app.running(ServeEnvironment(store_url="memory:")):
        await _serve_until_eof(serve)


# -- soak ---------------------------------------------------------------------------------------


def _peak_rss_kib() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def _rss_kib_of(pid: int | str) -> int | None:
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
    except (OSError, IndexError, ValueError):
        return None


def _current_rss_kib() -> int:
    rss = _rss_kib_of("self")
    return _peak_rss_kib() if rss is None else rss


async def soak(args: argparse.Namespace) -> None:
    """100k tasks through the memory store and one Runner, reaping on; RSS at checkpoints."""
    import json

    from stress.common import START_US
    from tritask.tasks import TrioClock
    from tritask.tasks.memory import MemoryStore
    from tritask.tasks.model import new_task
    from tritask.tasks.runner import Runner
    from tritask.tasks.store import Action
    from tritask.tasks.work import Work

    checkpoints = sorted({int(x) for x in args.checkpoints.split(",")} | {args.tasks})
    store = MemoryStore(
        scope="shared", clock=TrioClock(START_US), max_tasks=None, max_active_tasks_per_scope=None
    )
    sink = _CountingSink()
    runner = Runner(
        store,
        executor=_NoopExecutor(),
        owner_id="soak",
        max_jobs=args.batch,
        reap_interval_ms=args.reap_interval_ms,
        instrumentation=sink,
    )
    figures: dict[str, Any] = {"checkpoints": {}}
    wall = time.perf_counter()
    async with store, trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        created = 0
        while created < args.tasks:
            size = min(args.batch, args.tasks - created)
            for n in range(created, created + size):
                task_id = f"soak-{n}"
                access = await store.authorize(None, Action.CREATE, task_id)
                task = new_task(task_id, await store.now(), args.ttl_ms, None)
                work = Work(idempotency_key=task_id, type="soak", input={"n": n})
                await runner.create_task(task, work, access)
            created += size
            await sink.wait_for(created)
            await trio.sleep(args.pace_ms / 1000)
            if created in checkpoints:
                figures["checkpoints"][str(created)] = {
                    "peakRssKiB": _peak_rss_kib(),
                    "rssKiB": _current_rss_kib(),
                    "storedTasks": len(store._entries),
                    "wallSeconds": round(time.perf_counter() - wall, 3),
                }
        runner.stop()
    figures["completed"] = sink.completed
    figures["otherStops"] = sink.other_stops
    figures["wallSeconds"] = round(time.perf_counter() - wall, 3)
    sys.stdout.write(json.dumps(figures) + "\n")


async def _idle_server(args: argparse.Namespace) -> None:
    from stress.bench.idle import idle_server

    await idle_server(args)


# -- entry point --------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stress.bench.servers")
    parser.add_argument(
        "kind",
        choices=[
            "core-tritask",
            "core-mcp",
            "core-ceiling",
            "tasks",
            "queue",
            "idle",
            "listen",
            "soak",
        ],
    )
    parser.add_argument("--unlimited", action="store_true", help="no store limits")
    parser.add_argument("--cpu", type=int, default=None, help="pin this process to one CPU")
    parser.add_argument("--json-response", action="store_true", help="core-mcp: JSON mode")
    parser.add_argument("--store", default="memory:")
    parser.add_argument("--sqlite-synchronous", default="FULL")
    parser.add_argument("--max-jobs", type=int, default=4096)
    parser.add_argument("--tasks", type=int, default=100_000)
    parser.add_argument("--checkpoints", default="10000,100000")
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--ttl-ms", type=int, default=1_000)
    parser.add_argument("--pace-ms", type=int, default=100)
    parser.add_argument("--reap-interval-ms", type=int, default=200)
    parser.add_argument("--lease-ms", type=int, default=30_000, help="idle: the runner's lease")
    parser.add_argument(
        "--per-attempt-renewal",
        action="store_true",
        help="idle: each attempt renews its own lease (the store's renew_all unused)",
    )
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument("--profile", default=None, help="write cProfile statistics to this file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr)
    if args.cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.cpu})
    entry = {
        "core-tritask": core_tritask,
        "core-mcp": core_mcp,
        "core-ceiling": core_ceiling,
        "tasks": tasks_server,
        "queue": queue_server,
        "idle": _idle_server,
        "listen": listen_server,
    }
    if args.kind == "soak":
        trio.run(soak, args, clock=trio.testing.MockClock(autojump_threshold=0))
        return 0
    if args.profile:
        import cProfile

        with cProfile.Profile() as profile:
            trio.run(entry[args.kind], args)
        profile.dump_stats(args.profile)
        return 0
    trio.run(entry[args.kind], args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
