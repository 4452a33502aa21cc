"""The benchmarks: each measures tritask and its baseline in the same run.

Every result is one JSON object with ``name``, ``params``, ``tritask``, ``baseline``, ``ratio``
and ``target_met`` (plus ``machine`` and ``schemaVersion``). Servers run in their own processes
(:mod:`stress.bench.servers`); the load comes from :mod:`stress.bench.loadgen`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from stress.bench.loadgen import (
    LEGACY_VERSION,
    TASKS_ID,
    TOOL_CHECK,
    HttpConnection,
    McpRequest,
    run_load,
    summarize,
)
from stress.bench.peers import peer_argv
from stress.bench.raw import raw_limit
from stress.common import prepared_store_url
from tritask.server.dispatcher import Dispatcher
from tritask.tasks.stores import store_scheme

__all__ = [
    "CoreParams",
    "QueueParams",
    "ServerProcess",
    "SoakParams",
    "TasksParams",
    "bench_core",
    "bench_queue",
    "bench_scale",
    "bench_soak",
    "bench_tasks",
    "machine",
]

SCHEMA_VERSION = 1


def machine() -> dict[str, Any]:
    model = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "cpuModel": model,
        "python": platform.python_version(),
        "trio": trio.__version__,
        "platform": platform.platform(),
        "loadAverage": [round(x, 2) for x in os.getloadavg()],
    }


def _result(
    name: str,
    params: dict[str, Any],
    tritask: Any,
    baseline: Any,
    ratio: Any,
    target_met: bool | None,
    **extra: Any,
) -> dict[str, Any]:
    return {
        "schemaVersion": SCHEMA_VERSION,
        "name": name,
        "params": params,
        "tritask": tritask,
        "baseline": baseline,
        "ratio": ratio,
        "target_met": target_met,
        "machine": machine(),
        **extra,
    }


# -- server processes ---------------------------------------------------------------------------


@attrs.define(eq=False)
class ServerProcess:
    """A benchmark server in a child process; closing its stdin stops it."""

    process: trio.Process
    port: int

    @classmethod
    @asynccontextmanager
    async def start(
        cls,
        kind: str,
        *options: str,
        cpu: int | None = None,
        argv: list[str] | None = None,
        checkout: str | None = None,
    ) -> AsyncIterator[ServerProcess]:
        """``python -m stress.bench.servers KIND OPTIONS``, or ``argv`` (a peer's server);
        with ``checkout``, that checkout's server (its packages first on the path)."""
        if argv is None:
            argv = [sys.executable, "-m", "stress.bench.servers", kind, *options]
            if cpu is not None:
                argv += ["--cpu", str(cpu)]
        env, cwd = (None, None) if checkout is None else _checkout_environment(checkout)
        process = await trio.lowlevel.open_process(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, env=env, cwd=cwd
        )
        try:
            assert process.stdout is not None
            line = b""
            with trio.fail_after(60):
                while not line.endswith(b"\n"):
                    chunk = await process.stdout.receive_some(1)
                    if not chunk:
                        raise RuntimeError(f"benchmark server {kind} exited before it was ready")
                    line += chunk
            word, _, port = line.decode().strip().partition(" ")
            if word != "READY":
                raise RuntimeError(f"benchmark server {kind} said {line!r}")
            yield cls(process, int(port))
        finally:
            with trio.CancelScope(shield=True):
                if process.stdin is not None:
                    await process.stdin.aclose()
                with trio.move_on_after(15):
                    await process.wait()
                if process.returncode is None:
                    process.kill()
                    await process.wait()


def _checkout_environment(checkout: str) -> tuple[dict[str, str], str]:
    """The environment and directory in which ``python -m stress.bench.servers`` is the
    server of ``checkout``: its packages (``tritask``, ``stress``, the stores) first."""
    root = os.path.abspath(checkout)
    path = [root, os.path.join(root, "stores"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}, root


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process ``pid`` (all its threads), from ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pin_self(cpu: int | None) -> None:
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})


# -- bench core ---------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class CoreParams:
    concurrency: tuple[int, ...] = (1, 32)
    seconds: float = 5.0
    warmup_seconds: float = 1.0
    repeats: int = 3
    pin: bool = False
    mcp_json_response: bool = False
    ceiling: bool = True
    era: str = "modern"
    """``modern`` (2026-07-28, stateless) or ``legacy`` (2025-11-25 sessions, one per
    connection): tritask legacy vs the mcp server in legacy mode, beside tritask modern."""


ECHO = McpRequest("tools/call", {"name": "echo", "arguments": {"text": "hello"}}, name="echo")
LEGACY_ECHO = attrs.evolve(ECHO, name=None, era="legacy")


@attrs.frozen
class _Side:
    """One measured column: which server, which request, and (legacy) the session version."""

    server: str
    request: McpRequest
    session_version: str | None = None


def _core_sides(params: CoreParams) -> dict[str, _Side]:
    if params.era == "legacy":
        sides = {
            "tritask": _Side("tritask", LEGACY_ECHO, LEGACY_VERSION),
            "tritaskModern": _Side("tritask", ECHO),
            "mcp": _Side("mcp", LEGACY_ECHO, LEGACY_VERSION),
        }
    elif params.era == "modern":
        sides = {"tritask": _Side("tritask", ECHO), "mcp": _Side("mcp", ECHO)}
    else:
        raise ValueError(f"unknown era {params.era!r}: 'modern' or 'legacy'")
    if params.ceiling:
        sides["ceiling"] = _Side("ceiling", ECHO)
    return sides


def _median_cpu(repeats: list[dict[str, Any]]) -> float | None:
    """The server's CPU time per request, median of the repeats: unlike requests/s it hardly
    moves when other work shares the machine."""
    values = [r["serverCpuUs"] for r in repeats if r["serverCpuUs"] is not None]
    return round(statistics.median(values), 1) if values else None


async def bench_core(params: CoreParams) -> dict[str, Any]:
    """Synchronous ``tools/call`` of a trivial tool: tritask vs ``mcp`` 2.3.0, same client.

    At ``era="legacy"`` every connection is a 2025-11-25 client with a session of its own
    (opened before the measurement), on both servers; tritask's modern figures are measured in
    the same run, on the same server process.
    """
    pinned = params.pin and (os.cpu_count() or 1) >= 2
    server_cpu = 1 if pinned else None
    _pin_self(0 if pinned else None)
    mcp_options = ["--json-response"] if params.mcp_json_response else []
    sides = _core_sides(params)
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {
        side: {c: [] for c in params.concurrency} for side in sides
    }
    async with (
        ServerProcess.start("core-tritask", cpu=server_cpu) as tritask_server,
        ServerProcess.start("core-mcp", *mcp_options, cpu=server_cpu) as mcp_server,
        ServerProcess.start("core-ceiling", cpu=server_cpu) as ceiling_server,
    ):
        servers = {"tritask": tritask_server, "mcp": mcp_server, "ceiling": ceiling_server}
        ports = {key: server.port for key, server in servers.items()}
        for repeat in range(params.repeats):
            for concurrency in params.concurrency:
                order = tuple(sides) if repeat % 2 == 0 else tuple(reversed(sides))
                for name in order:
                    side = sides[name]
                    pid = servers[side.server].process.pid
                    cpu_before = process_cpu_seconds(pid)
                    result = await run_load(
                        "127.0.0.1",
                        ports[side.server],
                        side.request,
                        concurrency=concurrency,
                        seconds=params.seconds,
                        warmup_seconds=params.warmup_seconds,
                        check=TOOL_CHECK,
                        session_version=side.session_version,
                    )
                    cpu_after = process_cpu_seconds(pid)
                    cpu_us = (
                        None
                        if cpu_before is None or cpu_after is None or not result.sent
                        else (cpu_after - cpu_before) * 1e6 / result.sent
                    )
                    runs[name][concurrency].append(
                        {
                            "serverCpuUs": cpu_us,
                            "requestsPerSecond": result.requests_per_second,
                            "requests": result.requests,
                            "errors": result.errors,
                            "latencies": result.latencies,
                        }
                    )
    figures: dict[str, dict[str, Any]] = {name: {} for name in sides}
    for name, by_concurrency in runs.items():
        for concurrency, repeats in by_concurrency.items():
            latencies = [x for r in repeats for x in r["latencies"]]
            figures[name][f"c{concurrency}"] = {
                "requestsPerSecond": round(
                    statistics.median(r["requestsPerSecond"] for r in repeats), 1
                ),
                "requestsPerSecondRuns": [round(r["requestsPerSecond"], 1) for r in repeats],
                "requests": sum(r["requests"] for r in repeats),
                "errors": sum(r["errors"] for r in repeats),
                "serverCpuUsPerRequest": _median_cpu(repeats),
                **summarize(latencies),
            }

    def ratios(numerator: str, denominator: str) -> dict[str, float]:
        return {
            key: round(
                figures[numerator][key]["requestsPerSecond"]
                / max(figures[denominator][key]["requestsPerSecond"], 1e-9),
                3,
            )
            for key in figures[numerator]
        }

    ratio = ratios("tritask", "mcp")
    cpu_ratio: dict[str, float | None] = {}
    for key, figure in figures["tritask"].items():
        ours, theirs = figure["serverCpuUsPerRequest"], figures["mcp"][key]["serverCpuUsPerRequest"]
        cpu_ratio[key] = round(theirs / ours, 3) if ours and theirs else None
    errors = sum(v["errors"] for side in figures.values() for v in side.values())
    # mcp's server CPU time per request over tritask's (descriptive: the target is requests/s)
    extra: dict[str, Any] = {"serverCpuRatio": cpu_ratio}
    if params.ceiling:
        extra["hypercornCeiling"] = figures["ceiling"]
    legacy = params.era == "legacy"
    if legacy:
        extra["tritaskModern"] = figures["tritaskModern"]
        extra["ratioToModern"] = ratios("tritask", "tritaskModern")
    mode = f"json_response={params.mcp_json_response}"
    return _result(
        "core",
        {
            **attrs.asdict(params),
            "tool": "echo",
            "client": "raw HTTP/1.1 keep-alive over trio sockets (stress.bench.loadgen)",
            "mcpServer": f"mcp 2.3.0 MCPServer.streamable_http_app({mode}) on hypercorn's trio "
            + ("worker, legacy sessions" if legacy else "worker"),
            "sessions": "one 2025-11-25 session per connection" if legacy else None,
            "pinned": {"client": 0, "servers": 1} if pinned else None,
            "target": "tritask >= 2x mcp requests/s at every concurrency"
            + (" (both in legacy mode)" if legacy else ""),
        },
        figures["tritask"],
        figures["mcp"],
        ratio,
        errors == 0 and all(value >= 2.0 for value in ratio.values()),
        errors=errors,
        **extra,
    )


# -- bench tasks --------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class TasksParams:
    store: str = "memory:"
    tasks: int = 2_000
    clients: int = 16
    processes: int = 1
    sqlite_synchronous: str = "FULL"
    pg_connections: int = 4
    raw: bool = True
    transport: str = "http"
    repeats: int = 3
    memory: bool = True
    peer: str | None = None
    """bench tasks: interleaved rounds of (tritask, raw loop, tritask on the memory store, the
    peer); bench scale runs one each."""
    unlimited: bool = False
    """The servers' stores without limits; by default they have the store's defaults
    (``max_tasks`` 10,000, ``max_active_tasks_per_scope`` 100), as a user's server has."""
    against: str | None = None
    """Another checkout of tritask whose server runs each round's tritask side too (``bench
    tasks`` on SQLite or the memory store): a change measured side by side with the code
    before it, both seeing the same drift of the machine."""


#: ``bench tasks`` targets (issue 15): a durable store against the raw per-task-commit loop and
#: against the memory store of the same run, and against the peer on durable SQLite.
TASKS_TARGETS: dict[str, dict[str, float]] = {
    "sqlite": {"raw": 1.0, "memory": 0.8, "peer": 5.0},
    "postgresql": {"memory": 0.6},
}


NOOP = McpRequest(
    "tools/call",
    {"name": "noop", "arguments": {}},
    name="noop",
    capabilities={"extensions": {TASKS_ID: {}}},
)
STATS = McpRequest("tools/call", {"name": "bench_stats", "arguments": {}}, name="bench_stats")


def _get(task_id: str) -> McpRequest:
    return McpRequest(
        "tasks/get",
        {"taskId": task_id},
        name=task_id,
        capabilities={"extensions": {TASKS_ID: {}}},
    )


async def _stats(conn: HttpConnection) -> dict[str, Any]:
    status, message = await conn.call(STATS)
    if status != 200 or "result" not in message:
        raise RuntimeError(f"bench_stats failed: {status} {message}")
    structured: dict[str, Any] = message["result"]["structuredContent"]
    return structured


def _fresh_store_url(url: str, workdir: str, name: str = "bench.db") -> str:
    """``sqlite:`` with no path (or ``sqlite:auto``) gets a fresh file in a temporary folder."""
    if store_scheme(url) == "sqlite" and url in ("sqlite:", "sqlite:auto"):
        return f"sqlite:{os.path.join(workdir, name)}"
    return url


def _median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of the round with the median tasks/s (the lower middle one for an even
    count), with every round's tasks/s beside them."""
    ranked = sorted(rounds, key=lambda figures: float(figures["tasksPerSecond"]))
    median = ranked[(len(ranked) - 1) // 2]
    return {**median, "roundsTasksPerSecond": [figures["tasksPerSecond"] for figures in rounds]}


async def _tasks_run(params: TasksParams, url: str, checkout: str | None = None) -> dict[str, Any]:
    """Create ``tasks`` tasks over HTTP through ``processes`` servers (of ``checkout``, if
    given); wait for all completed."""
    options = ["--store", url, "--sqlite-synchronous", params.sqlite_synchronous]
    if params.unlimited:
        options.append("--unlimited")
    if os.environ.get("TRITASK_BENCH_PROFILE") and checkout is None:
        options += ["--profile", os.environ["TRITASK_BENCH_PROFILE"]]
    async with _servers(params.processes, options, checkout) as servers:
        return await _drive_tasks(params, servers)


async def _peer_run(params: TasksParams) -> dict[str, Any]:
    """The same load generator against the peer's server (one process)."""
    assert params.peer is not None
    argv = peer_argv(params.peer)
    async with ServerProcess.start("peer", argv=argv) as server:
        return await _drive_tasks(params, [server])


async def _drive_tasks(params: TasksParams, servers: list[ServerProcess]) -> dict[str, Any]:
    """The clients' side of a tasks run: create, then wait until every task completed."""
    ports = [server.port for server in servers]
    stat_conns = [await HttpConnection.connect("127.0.0.1", port) for port in ports]
    before = [await _stats(conn) for conn in stat_conns]
    created: list[str] = []
    latencies: list[float] = []
    failures: list[str] = []
    counter = iter(range(params.tasks))

    async def client(index: int) -> None:
        conn = await HttpConnection.connect("127.0.0.1", ports[index % len(ports)])
        try:
            for _ in counter:
                started = time.perf_counter()
                status, message = await conn.call(NOOP)
                latencies.append(time.perf_counter() - started)
                result = message.get("result") or {}
                if status == 200 and result.get("resultType") == "task":
                    created.append(str(result["taskId"]))
                elif len(failures) < 5:
                    failures.append(f"{status} {message.get('error')}")
        finally:
            await conn.aclose()

    started = time.perf_counter()
    client_cpu = time.process_time()
    async with trio.open_nursery() as nursery:
        for index in range(params.clients):
            nursery.start_soon(client, index)
    created_at = time.perf_counter()
    deadline = trio.current_time() + max(60.0, params.tasks / 20)
    while True:
        now = [await _stats(conn) for conn in stat_conns]
        done = sum(n["completed"] - b["completed"] for n, b in zip(now, before, strict=True))
        stops = sum(n["otherStops"] - b["otherStops"] for n, b in zip(now, before, strict=True))
        if done + stops >= len(created) or trio.current_time() > deadline:
            break
        await trio.sleep(0.005)
    finished = time.perf_counter()
    client_cpu = time.process_time() - client_cpu
    server_cpu = sum(n["cpuSeconds"] - b["cpuSeconds"] for n, b in zip(now, before, strict=True))
    writer = _writer_figures(before, now)
    server_cpu += writer["writer_cpu"]
    thread_cpu, thread_busy = _thread_figures(before, now)
    writes = sum(n["writes"] - b["writes"] for n, b in zip(now, before, strict=True))
    calls: dict[str, int] = {}
    for n, b in zip(now, before, strict=True):
        for name, value in n["calls"].items():
            calls[name] = calls.get(name, 0) + value - b["calls"].get(name, 0)
    sample = created[:: max(1, len(created) // 10)][:10]
    statuses = []
    for task_id in sample:
        for conn in stat_conns:
            status, message = await conn.call(_get(task_id))
            if status == 200 and "result" in message:
                statuses.append(message["result"]["status"])
                break
    for conn in stat_conns:
        await conn.aclose()
    return {
        **_task_figures(done, len(created), stops, (started, created_at, finished), latencies),
        **_store_figures(done, writes, calls),
        "serverCpuMsPerTask": _per_task_ms(server_cpu, done),
        "writerCpuMsPerTask": (
            None if writer["written"] is None else _per_task_ms(writer["writer_cpu"], done)
        ),
        "writerWritten": writer["written"],
        "writerUndecided": writer["undecided"],
        "writerBatches": writer["batches"],
        "serverThreadCpuMsPerTask": None if thread_cpu is None else _per_task_ms(thread_cpu, done),
        "serverThreadBusy": thread_busy,
        # The cyclic collector's time, and the kernel's part of the event-loop thread's CPU.
        "serverGcMsPerTask": _seconds_ms_per_task("gcSeconds", before, now, done),
        "serverThreadSystemMsPerTask": _seconds_ms_per_task(
            "threadSystemSeconds", before, now, done
        ),
        "loadGeneratorCpuMsPerTask": _per_task_ms(client_cpu, done),
        "sampleStatuses": sorted(set(statuses)),
        "failures": failures,
    }


def _seconds_ms_per_task(
    key: str, before: list[dict[str, Any]], now: list[dict[str, Any]], done: int
) -> float | None:
    """The servers' counter of seconds ``key`` between two readings, per task (``None`` when a
    server does not report it: another checkout's, the peer)."""
    if any(key not in stats for stats in (*before, *now)):
        return None
    seconds = sum(n[key] - b[key] for n, b in zip(now, before, strict=True))
    return _per_task_ms(seconds, done)


def _writer_figures(before: list[dict[str, Any]], now: list[dict[str, Any]]) -> dict[str, Any]:
    """The SQLite writer processes' CPU seconds, items written and left undecided, and the
    batches they were sent in, between two readings (``None`` counts: no server has one)."""
    figures: dict[str, Any] = {
        "writer_cpu": 0.0,
        "written": None,
        "undecided": None,
        "batches": None,
    }
    names = (
        ("written", "writerWritten"),
        ("undecided", "writerUndecided"),
        ("batches", "writerBatches"),
    )
    for n, b in zip(now, before, strict=True):
        if n.get("writerCpuSeconds") is None or b.get("writerCpuSeconds") is None:
            continue
        figures["writer_cpu"] += n["writerCpuSeconds"] - b["writerCpuSeconds"]
        for key, name in names:
            figures[key] = (figures[key] or 0) + n[name] - b[name]
    return figures


def _thread_figures(
    before: list[dict[str, Any]], now: list[dict[str, Any]]
) -> tuple[float | None, float | None]:
    """The servers' event-loop threads between two readings: their CPU seconds (summed) and
    the mean fraction of each server's own elapsed time they spent on a CPU (the rest they
    waited: for I/O, a commit, the GIL). ``None`` when a server does not report them.

    Why: a server's process time counts its worker threads too, so it cannot tell a trio
    thread that is busy all the time from one that waits a third of it."""
    keys = ("threadCpuSeconds", "monotonicSeconds")
    if not all(key in stats for stats in (*before, *now) for key in keys):
        return None, None
    spans = [
        (
            n["threadCpuSeconds"] - b["threadCpuSeconds"],
            n["monotonicSeconds"] - b["monotonicSeconds"],
        )
        for n, b in zip(now, before, strict=True)
    ]
    cpu = sum(used for used, _ in spans)
    if any(elapsed <= 0 for _, elapsed in spans):
        return cpu, None
    return cpu, round(sum(used / elapsed for used, elapsed in spans) / len(spans), 3)


def _per_task_ms(seconds: float, tasks: int) -> float:
    return round(seconds * 1000 / max(tasks, 1), 3)


def _task_figures(
    done: int,
    created: int,
    stops: int,
    times: tuple[float, float, float],
    latencies: list[float],
) -> dict[str, Any]:
    """The figures both transports report: ``times`` is (started, all created, all done)."""
    started, created_at, finished = times
    elapsed = finished - started
    return {
        "tasksPerSecond": round(done / elapsed, 1) if elapsed > 0 else 0.0,
        "completed": done,
        "created": created,
        "otherStops": stops,
        "seconds": round(elapsed, 4),
        "creationSeconds": round(created_at - started, 4),
        "creationLatency": summarize(latencies),
    }


def _store_figures(done: int, writes: int, calls: dict[str, int]) -> dict[str, Any]:
    return {"storeWritesPerTask": round(writes / max(done, 1), 3), "storeCalls": calls}


async def _tasks_in_process(params: TasksParams, url: str) -> dict[str, Any]:
    """The same application and clients in this process, calling the dispatcher directly.

    No HTTP, no sockets, no second process: what is left is the Tasks runtime and the store,
    so comparing with the HTTP figure tells what the transport costs per task. CPU is this
    process's (clients included: they only build a request object per call).
    """
    from stress.bench.servers import store_options, tasks_app
    from tritask.jsonrpc import Request
    from tritask.server.extension import ServeEnvironment

    args = argparse.Namespace(
        store=url, sqlite_synchronous=params.sqlite_synchronous, unlimited=params.unlimited
    )
    options = store_options(args)
    bench = tasks_app(url, options, 4096)
    created: list[str] = []
    latencies: list[float] = []
    failures: list[str] = []
    async with bench.store, bench.app.running(ServeEnvironment(store_url=url)):
        dispatcher = Dispatcher(bench.app)
        counter = iter(range(params.tasks))

        async def client() -> None:
            for n in counter:
                request = Request(id=n, method=NOOP.method, params=NOOP.message_params())
                started = time.perf_counter()
                message = await dispatcher.handle_request(request, principal=None)
                latencies.append(time.perf_counter() - started)
                result = message.get("result") or {}
                if isinstance(result, dict) and result.get("resultType") == "task":
                    created.append(str(result["taskId"]))
                elif len(failures) < 5:
                    failures.append(str(message.get("error")))

        started = time.perf_counter()
        cpu = time.process_time()
        async with trio.open_nursery() as nursery:
            for _ in range(params.clients):
                nursery.start_soon(client)
        created_at = time.perf_counter()
        with trio.move_on_after(max(60.0, params.tasks / 20)):
            await bench.sink.wait_for(len(created))
        finished = time.perf_counter()
        cpu = time.process_time() - cpu
        done, stops = bench.sink.completed, bench.sink.other_stops
        writes, calls = bench.store.writes, dict(bench.store.calls)
    return {
        **_task_figures(done, len(created), stops, (started, created_at, finished), latencies),
        **_store_figures(done, writes, calls),
        "cpuMsPerTask": _per_task_ms(cpu, done),
        "sampleStatuses": ["completed"] if done == len(created) == params.tasks else [],
        "failures": failures,
    }


@asynccontextmanager
async def _servers(
    count: int, options: Sequence[str], checkout: str | None = None
) -> AsyncIterator[list[ServerProcess]]:
    async with _servers_from(count, list(options), checkout) as servers:
        yield servers


@asynccontextmanager
async def _servers_from(
    count: int, options: list[str], checkout: str | None
) -> AsyncIterator[list[ServerProcess]]:
    if count == 0:
        yield []
        return
    async with (
        ServerProcess.start("tasks", *options, checkout=checkout) as first,
        _servers_from(count - 1, options, checkout) as rest,
    ):
        yield [first, *rest]


async def bench_tasks(params: TasksParams) -> dict[str, Any]:
    """End to end over HTTP vs the store's raw limit and vs the memory store, in the same run.

    ``repeats`` rounds, each a tritask run on a fresh store (``sqlite:auto``: a new file per
    round; an explicit ``sqlite:PATH`` is reused), then the raw loop on a fresh file or table,
    then (for a durable store) the same benchmark on the memory store, then the peer (``peer``,
    e.g. ``fastmcp-tasks``) under the same load generator, interleaved so that every side sees
    the same drift of the machine (a virtual disk's fsync time moves by a third from one minute
    to the next, and other work on a shared machine comes and goes). The figures are those of
    the median round of each side; each ratio is of two medians.
    """
    runs: list[dict[str, Any]] = []
    raws: list[dict[str, Any]] = []
    memories: list[dict[str, Any]] = []
    peers: list[dict[str, Any]] = []
    againsts: list[dict[str, Any]] = []
    scheme = store_scheme(params.store)
    durable = scheme in ("sqlite", "postgresql", "postgres")
    family = "postgresql" if scheme in ("postgresql", "postgres") else scheme
    if params.against is not None:
        check_against(params)
    with tempfile.TemporaryDirectory(prefix="tritask-bench-") as workdir:
        for round_ in range(params.repeats):
            fresh = _fresh_store_url(params.store, workdir, f"bench-{round_}.db")
            async with prepared_store_url(fresh) as url:
                if params.transport == "in-process":
                    runs.append(await _tasks_in_process(params, url))
                else:
                    runs.append(await _tasks_run(params, url))
            if params.against is not None:
                other = _fresh_store_url(params.store, workdir, f"against-{round_}.db")
                async with prepared_store_url(other) as other_url:
                    againsts.append(await _tasks_run(params, other_url, params.against))
            if params.raw:
                commits = max(1, round(runs[-1]["storeWritesPerTask"]))
                raw = await raw_limit(
                    fresh,
                    params.tasks,
                    commits,
                    sqlite_synchronous=params.sqlite_synchronous,
                    pg_connections=params.pg_connections,
                )
                raws.append({**raw, "commitsPerTask": commits})
            if durable and params.memory:
                if params.transport == "in-process":
                    memories.append(await _tasks_in_process(params, "memory:"))
                else:
                    memories.append(await _tasks_run(params, "memory:"))
            if params.peer is not None:
                peers.append(await _peer_run(params))
    tritask = _median_round(runs)
    baseline = _median_round(raws) if raws else None
    memory = _median_round(memories) if memories else None
    peer = _median_round(peers) if peers else None
    against = _median_round(againsts) if againsts else None

    def over(other: dict[str, Any] | None) -> float | None:
        if other is None:
            return None
        ours, theirs = float(tritask["tasksPerSecond"]), float(other["tasksPerSecond"])
        return round(ours / max(theirs, 1e-9), 3)

    ratio = over(baseline)
    ratios = {"raw": ratio, "memory": over(memory), "peer": over(peer)}
    ok = all(
        run["completed"] == params.tasks and run["sampleStatuses"] == ["completed"] for run in runs
    )
    targets: dict[str, Any] = {}
    for side, wanted in TASKS_TARGETS.get(family, {}).items():
        got = ratios[side]
        targets[side] = {
            "ratio": got,
            "target": wanted,
            "met": None if got is None else got >= wanted,
        }
    target_met = None
    if durable and params.transport == "http":  # the targets are end to end over HTTP
        store_targets = [targets[side] for side in ("raw", "memory") if side in targets]
        if all(target["met"] is not None for target in store_targets):
            target_met = ok and all(target["met"] for target in store_targets)
    descriptions = {
        "sqlite": "tritask >= 1.0x the raw per-task-commit loop and >= 0.8x the memory store"
        " (same run); >= 5x fastmcp-tasks (memory://) with --peer fastmcp-tasks",
        "postgresql": "tritask >= 0.6x the memory store (same run)",
    }
    return _result(
        "tasks",
        {
            **attrs.asdict(params),
            "store": scheme,
            "executor": "no-op WorkExecutor",
            "target": descriptions.get(family),
        },
        tritask,
        baseline,
        ratio,
        target_met,
        ok=ok,
        memory=memory,
        ratioToMemory=ratios["memory"],
        peer=peer,
        ratioToPeer=ratios["peer"],
        against=against,
        ratioToAgainst=over(against),
        targets=targets,
    )


def check_against(params: TasksParams) -> None:
    """``--against`` needs a checkout with the benchmark's server, a store each round can
    start fresh, and the HTTP transport. A PostgreSQL URL without ``?schema=`` gets a fresh
    schema per round, migrated by this checkout: a checkout that cannot read that schema
    version fails to open it, and the benchmark stops with its error."""
    assert params.against is not None
    scheme = store_scheme(params.store)
    server = os.path.join(params.against, "stress", "bench", "servers.py")
    if not os.path.isfile(server):
        raise ValueError(f"--against {params.against!r}: no stress/bench/servers.py there")
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(params.store).query)
    fresh = (
        scheme == "memory"
        or params.store in ("sqlite:", "sqlite:auto")
        or (scheme in ("postgresql", "postgres") and "schema" not in query)
    )
    if not fresh:
        raise ValueError(
            "--against runs on memory:, sqlite:auto (a fresh file per round) or a"
            " postgresql:// URL without ?schema= (a fresh schema per round)"
        )
    if params.transport != "http":
        raise ValueError("--against compares servers: it needs --transport http")


async def bench_scale(
    params: TasksParams, process_counts: Sequence[int] = (1, 2, 4)
) -> dict[str, Any]:
    """The tasks benchmark with 1, 2 and 4 runner processes on one database."""
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="tritask-bench-") as workdir:
        for count in process_counts:
            async with prepared_store_url(_fresh_store_url(params.store, workdir)) as url:
                runs[str(count)] = await _tasks_run(attrs.evolve(params, processes=count), url)
    base = runs[str(process_counts[0])]["tasksPerSecond"]
    speedup = {key: round(run["tasksPerSecond"] / max(base, 1e-9), 3) for key, run in runs.items()}
    ok = all(run["completed"] == params.tasks for run in runs.values())
    return _result(
        "scale",
        {
            **attrs.asdict(params),
            "store": store_scheme(params.store),
            "processCounts": list(process_counts),
            "target": None,
        },
        {key: run for key, run in runs.items() if key != str(process_counts[0])},
        runs[str(process_counts[0])],
        speedup,
        None,
        ok=ok,
    )


# -- bench queue --------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class QueueParams:
    store: str = "sqlite:auto"
    tasks: int = 100_000
    checkpoint: int = 1_000
    clients: int = 32
    max_jobs: int = 32
    sqlite_synchronous: str = "FULL"


OPEN = McpRequest("tools/call", {"name": "bench_open", "arguments": {}}, name="bench_open")


async def _submit(
    port: int, clients: int, count: int, created: list[str], failures: list[str]
) -> float:
    """``count`` task creations as fast as ``clients`` connections go; the seconds it took."""
    counter = iter(range(count))

    async def client() -> None:
        conn = await HttpConnection.connect("127.0.0.1", port)
        try:
            for _ in counter:
                status, message = await conn.call(NOOP)
                result = message.get("result") or {}
                if status == 200 and result.get("resultType") == "task":
                    created.append(str(result["taskId"]))
                else:
                    failures.append(f"{status} {message.get('error')}")
        finally:
            await conn.aclose()

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(clients):
            nursery.start_soon(client)
    return time.perf_counter() - started


async def bench_queue(params: QueueParams) -> dict[str, Any]:
    """``tasks`` creations as fast as the clients go to one server whose tasks wait for a gate:
    ``max_jobs`` attempts wait in the runner and the rest queued in the store. The server's RSS
    at ``checkpoint`` and at ``tasks`` queued, then the gate opens and the queue drains."""
    with tempfile.TemporaryDirectory(prefix="tritask-bench-") as workdir:
        fresh = _fresh_store_url(params.store, workdir, "queue.db")
        async with prepared_store_url(fresh) as url:
            options = [
                "--store",
                url,
                "--sqlite-synchronous",
                params.sqlite_synchronous,
                "--max-jobs",
                str(params.max_jobs),
                "--unlimited",
            ]
            async with ServerProcess.start("queue", *options) as server:

                async def stats() -> dict[str, Any]:
                    # A connection of its own each time: the server closes idle ones, and
                    # the submission of 100,000 tasks takes longer than its idle timeout.
                    conn = await HttpConnection.connect("127.0.0.1", server.port)
                    try:
                        return await _stats(conn)
                    finally:
                        await conn.aclose()

                created: list[str] = []
                failures: list[str] = []
                first = await _submit(
                    server.port, params.clients, params.checkpoint, created, failures
                )
                early = await stats()
                rest = await _submit(
                    server.port, params.clients, params.tasks - params.checkpoint, created, failures
                )
                late = await stats()
                conn = await HttpConnection.connect("127.0.0.1", server.port)
                try:
                    status, opened = await conn.call(OPEN)
                    if status != 200 or "result" not in opened:
                        raise RuntimeError(f"bench_open failed: {status} {opened}")
                    drain_started = time.perf_counter()
                    deadline = trio.current_time() + max(120.0, params.tasks / 50)
                    while True:
                        now = await _stats(conn)
                        finished = now["completed"] + now["otherStops"] - early["otherStops"]
                        if finished >= len(created) or trio.current_time() > deadline:
                            break
                        await trio.sleep(0.05)
                    drain_seconds = time.perf_counter() - drain_started
                finally:
                    await conn.aclose()
    accepted = len(created)
    completed = int(now["completed"])
    submit_seconds = first + rest
    ratio = round(late["rssKiB"] / max(early["rssKiB"], 1), 3)
    ok = accepted == params.tasks and not failures and completed == params.tasks
    return _result(
        "queue",
        {
            **attrs.asdict(params),
            "store": store_scheme(params.store),
            "target": "all accepted; server RSS at tasks queued < 2x at checkpoint queued",
        },
        {
            "queued": params.tasks,
            "rssKiB": late["rssKiB"],
            "peakRssKiB": late["peakRssKiB"],
            "runningAtCheckpoint": late["jobs"],
            "accepted": accepted,
            "refused": len(failures),
            "submitPerSecond": round(accepted / max(submit_seconds, 1e-9), 1),
            "drainSeconds": round(drain_seconds, 3),
            "drainPerSecond": round(completed / max(drain_seconds, 1e-9), 1),
            "completed": completed,
            "storeWritesPerTask": round((now["writes"] - early["writes"]) / max(accepted, 1), 3),
            # The SQLite writer process's CPU is the server's too (its RSS is reported alone:
            # the target is about the serving process, which holds what grows with tasks).
            "serverCpuMsPerTask": _per_task_ms(
                now["cpuSeconds"] + (now.get("writerCpuSeconds") or 0.0), completed
            ),
            "writerRssKiB": now.get("writerRssKiB"),
            "writerWritten": now.get("writerWritten"),
            "writerUndecided": now.get("writerUndecided"),
            "failures": failures[:5],
        },
        {"queued": params.checkpoint, "rssKiB": early["rssKiB"], "jobs": early["jobs"]},
        ratio,
        ok and ratio < 2.0,
        ok=ok,
        errors=len(failures),
    )


# -- bench soak ---------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class SoakParams:
    tasks: int = 100_000
    checkpoint: int = 10_000
    batch: int = 500
    ttl_ms: int = 1_000
    reap_interval_ms: int = 200


async def bench_soak(params: SoakParams) -> dict[str, Any]:
    """100k tasks through the memory store with reaping; peak RSS at 10k vs 100k tasks."""
    argv = [
        sys.executable,
        "-m",
        "stress.bench.servers",
        "soak",
        "--tasks",
        str(params.tasks),
        "--checkpoints",
        str(params.checkpoint),
        "--batch",
        str(params.batch),
        "--ttl-ms",
        str(params.ttl_ms),
        "--reap-interval-ms",
        str(params.reap_interval_ms),
    ]
    done = await trio.run_process(argv, capture_stdout=True, capture_stderr=False)
    figures: dict[str, Any] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    points = figures["checkpoints"]
    early = points[str(params.checkpoint)]
    late = points[str(params.tasks)]
    ratio = round(late["peakRssKiB"] / max(early["peakRssKiB"], 1), 4)
    ok = figures["completed"] == params.tasks
    return _result(
        "soak",
        {**attrs.asdict(params), "store": "memory", "target": "peak RSS growth < 10%"},
        {
            "at": params.tasks,
            **late,
            "tasksPerSecond": round(params.tasks / figures["wallSeconds"], 1),
        },
        {"at": params.checkpoint, **early},
        ratio,
        ok and ratio < 1.10,
        ok=ok,
        completed=figures["completed"],
    )


# -- bench suspended ----------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class SuspendedParams:
    tasks: int = 10_000
    baseline_tasks: int = 1_000
    seconds: float = 12.0


async def _suspended_side(side: str, tasks: int, seconds: float) -> dict[str, Any]:
    argv = [
        sys.executable,
        "-m",
        "stress.bench.suspended",
        "--side",
        side,
        "--tasks",
        str(tasks),
        "--seconds",
        str(seconds),
    ]
    done = await trio.run_process(argv, capture_stdout=True, capture_stderr=False)
    figures: dict[str, Any] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return figures


async def bench_suspended(params: SuspendedParams) -> dict[str, Any]:
    """Idle waiting tasks on SQLite: suspended (sleeping durably or waiting for input) vs held
    by their attempts; each side in a fresh process, measured over an idle window."""
    suspended = await _suspended_side("suspended", params.tasks, params.seconds)
    held = await _suspended_side("held", params.baseline_tasks, params.seconds)
    free = (
        suspended["attempts"] == 0
        and suspended["scheduledRetries"] == 0
        and suspended["awaitingSlot"] == 0
        and suspended["runnerTrioTasks"] == suspended["runnerTrioTasksBefore"]
        and suspended["writeCallsDuringIdle"] == 0
        and not suspended["databaseChangedDuringIdle"]
        and suspended["retainedObjectsPerTask"] < 1
    )
    ratio = {
        "retainedObjectsPerTask": round(
            held["retainedObjectsPerTask"] / max(suspended["retainedObjectsPerTask"], 0.001), 1
        ),
        "heldWriteCallsDuringIdle": held["writeCallsDuringIdle"],
    }
    return _result(
        "suspended",
        {
            **attrs.asdict(params),
            "store": "sqlite",
            "target": "suspended tasks hold no attempt, timer or trio task, retain < 1 Python "
            "object each, and make no write during the idle window",
        },
        suspended,
        held,
        ratio,
        free,
    )
