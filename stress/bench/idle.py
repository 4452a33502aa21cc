"""``bench idle``: what tasks that sleep inside their tools cost a server while they sleep.

One server process (``python -m stress.bench.servers idle``) runs a tritask app whose
task-required ``nap`` tool sleeps for an hour, on the store named by ``--store`` (wrapped in
the write counter of :class:`stress.wrappers.CountingStore`), with ``max_jobs`` raised above the
number of tasks. The benchmark creates the tasks over HTTP, waits until every one of them runs,
lets the server settle, then measures a window of the server's idle life: its CPU time (from
``/proc``, every thread), its store commits (the counter: each successful write call is one
commit of a SQL store), its write system calls (``/proc/PID/io``) and its RSS. While tasks
sleep nothing else happens, so what the window shows is the runner's periodic cost: the lease
heartbeats, the recovery poll and the timers.

The baseline is the same server at ``baseline_tasks`` tasks with batch renewal switched off
(each attempt renews and re-reads its own task every heartbeat, as before ``renew_all``), so the
ratio is idle CPU per sleeping task, baseline over batch.

Target (issue 15): at 20,000 tasks on one SQLite server, CPU < 2% of a core and store commits
per second <= runners / heartbeat interval + 1.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs
import trio

from stress.bench.loadgen import TASKS_ID, HttpConnection, McpRequest

__all__ = ["IdleParams", "bench_idle", "idle_server"]

NAP_SECONDS = 3600.0
"""How long each task sleeps in its tool: longer than any run of the benchmark."""


# -- the server ---------------------------------------------------------------------------------


@attrs.frozen
class IdleApp:
    app: Any
    store: Any
    tasks: Any


def idle_app(
    store_url: str,
    options: Mapping[str, Any],
    *,
    max_jobs: int,
    lease_ms: int,
    per_attempt_renewal: bool,
) -> IdleApp:
    from stress.common import open_stress_store
    from stress.wrappers import CountingStore
    from tritask.server.app import App
    from tritask.tasks.extension import Tasks

    class PerAttemptCountingStore(CountingStore):
        batch_renewal = False

    counting = PerAttemptCountingStore if per_attempt_renewal else CountingStore
    store = counting(open_stress_store(store_url, mock_clock=False, **options))
    tasks = Tasks(
        store=store,
        scope="shared",
        task_support={"nap": "required"},
        runner_options={
            "max_jobs": max_jobs,
            "lease_ms": lease_ms,
            "owner_id": f"bench-idle-{os.getpid()}",
        },
    )
    app = App("bench-idle", "1.0.0", extensions=[tasks])
    collecting = _GcClock()
    gc.callbacks.append(collecting)

    @app.tool()
    async def nap(seconds: float) -> str:
        """Sleep inside the tool."""
        await trio.sleep(seconds)
        return "rested"

    @app.tool()
    async def bench_stats() -> dict[str, Any]:
        """What this process has done so far."""
        runner = tasks.runner
        return {
            "jobs": 0 if runner is None else runner.statistics().jobs,
            "heartbeatMs": None if runner is None else runner.heartbeat_ms,
            "writes": store.writes,
            "calls": dict(store.calls),
            "renewed": store.renewed,
            "renewal": _renewal(store),
            "pid": os.getpid(),
            "cpuSeconds": time.process_time(),
            "gcSeconds": collecting.seconds,
            "gcCollections": collecting.collections,
            # The SQLite store's writer process: its CPU is the server's too.
            "writerPid": getattr(getattr(store, "writer", None), "pid", None),
        }

    return IdleApp(app, store, tasks)


def _renewal(store: Any) -> str:
    """How the server's runner renews its leases: the store capability it uses."""
    from tritask.tasks.store import renews_leases, renews_owner_lease

    if renews_owner_lease(store):
        return "batch (renew_owner)"
    if renews_leases(store):
        return "batch (renew_all)"
    return "per attempt"


class _GcClock:
    """A ``gc.callbacks`` entry: the wall time spent in the cyclic collector, by generation."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = [0, 0, 0]
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started
            self.collections[info["generation"]] += 1


async def idle_server(args: argparse.Namespace) -> None:
    from stress.bench.servers import _serve_until_eof, store_options
    from tritask.server.extension import ServeEnvironment
    from tritask.transports.http import serve_http

    bench = idle_app(
        args.store,
        store_options(args),
        max_jobs=args.max_jobs,
        lease_ms=args.lease_ms,
        per_attempt_renewal=args.per_attempt_renewal,
    )

    async def serve(trigger: Callable[[], Awaitable[None]], task_status: Any) -> None:
        await serve_http(
            bench.app, "127.0.0.1", 0, shutdown_trigger=trigger, task_status=task_status
        )

    async with bench.store, bench.app.running(ServeEnvironment(store_url=args.store)):
        await _serve_until_eof(serve)


# -- the benchmark ------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class IdleParams:
    store: str = "sqlite:auto"
    tasks: int = 20_000
    clients: int = 16
    seconds: float = 60.0
    """The measured window (the default heartbeat is 10 s: six of them)."""
    settle_seconds: float = 5.0
    """Between the last task starting and the window opening."""
    lease_ms: int = 30_000
    sqlite_synchronous: str = "FULL"
    baseline_tasks: int = 2_000
    """The per-attempt-renewal baseline's task count (0: no baseline)."""


NAP = McpRequest(
    "tools/call",
    {"name": "nap", "arguments": {"seconds": NAP_SECONDS}},
    name="nap",
    capabilities={"extensions": {TASKS_ID: {}}},
)
STATS = McpRequest("tools/call", {"name": "bench_stats", "arguments": {}}, name="bench_stats")


def _get(task_id: str) -> McpRequest:
    return McpRequest(
        "tasks/get", {"taskId": task_id}, name=task_id, capabilities={"extensions": {TASKS_ID: {}}}
    )


async def _stats(port: int) -> dict[str, Any]:
    """The server's figures, on a connection of its own (an idle keep-alive one may be closed
    by the server during the window)."""
    conn = await HttpConnection.connect("127.0.0.1", port)
    try:
        status, message = await conn.call(STATS)
    finally:
        await conn.aclose()
    if status != 200 or "result" not in message:
        raise RuntimeError(f"bench_stats failed: {status} {message}")
    structured: dict[str, Any] = message["result"]["structuredContent"]
    return structured


def _proc_io(pid: int) -> dict[str, int]:
    """``/proc/PID/io`` (write system calls, bytes written to storage); empty if unreadable."""
    try:
        with open(f"/proc/{pid}/io") as io:
            pairs = (line.split(":", 1) for line in io if ":" in line)
            return {name.strip(): int(value) for name, value in pairs}
    except (OSError, ValueError):
        return {}


def _rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


async def _idle_run(
    params: IdleParams, url: str, tasks: int, *, per_attempt: bool
) -> dict[str, Any]:
    from stress.bench.benchmarks import ServerProcess, process_cpu_seconds

    options = [
        "--store",
        url,
        "--sqlite-synchronous",
        params.sqlite_synchronous,
        "--max-jobs",
        str(tasks + 64),
        "--lease-ms",
        str(params.lease_ms),
    ]
    if per_attempt:
        options.append("--per-attempt-renewal")
    if os.environ.get("TRITASK_BENCH_PROFILE") and not per_attempt:
        options += ["--profile", os.environ["TRITASK_BENCH_PROFILE"]]
    async with ServerProcess.start("idle", *options) as server:
        pid = server.process.pid
        created: list[str] = []
        failures: list[str] = []
        counter = iter(range(tasks))

        async def client() -> None:
            conn = await HttpConnection.connect("127.0.0.1", server.port)
            try:
                for _ in counter:
                    status, message = await conn.call(NAP)
                    result = message.get("result") or {}
                    if status == 200 and result.get("resultType") == "task":
                        created.append(str(result["taskId"]))
                    elif len(failures) < 5:
                        failures.append(f"{status} {message.get('error')}")
            finally:
                await conn.aclose()

        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(params.clients):
                nursery.start_soon(client)
        creation_seconds = time.perf_counter() - started
        with trio.move_on_after(max(60.0, tasks / 50)):
            while True:  # polling another process: no event to wait for
                if (await _stats(server.port))["jobs"] >= len(created):
                    break
                await trio.sleep(0.25)
        await trio.sleep(params.settle_seconds)
        before = await _stats(server.port)
        writer_pid = before.get("writerPid")
        writer_before = None if writer_pid is None else process_cpu_seconds(writer_pid)
        cpu_before = process_cpu_seconds(pid)
        io_before = _proc_io(pid)
        window_start = time.perf_counter()
        await trio.sleep(params.seconds)
        cpu_after = process_cpu_seconds(pid)
        writer_after = None if writer_pid is None else process_cpu_seconds(writer_pid)
        io_after = _proc_io(pid)
        window = time.perf_counter() - window_start
        after = await _stats(server.port)
        rss = _rss_kib(pid)
        sample = created[:: max(1, len(created) // 10)][:10]
        statuses = []
        conn = await HttpConnection.connect("127.0.0.1", server.port)
        for task_id in sample:
            status, message = await conn.call(_get(task_id))
            if status == 200 and "result" in message:
                statuses.append(message["result"]["status"])
        await conn.aclose()
    cpu = None
    if cpu_before is not None and cpu_after is not None:
        cpu = cpu_after - cpu_before
        if writer_before is not None and writer_after is not None:
            cpu += writer_after - writer_before
    calls = {
        name: value - before["calls"].get(name, 0)
        for name, value in after["calls"].items()
        if value != before["calls"].get(name, 0)
    }
    commits = after["writes"] - before["writes"]
    heartbeat_s = float(after["heartbeatMs"]) / 1000
    syscw = io_after.get("syscw", 0) - io_before.get("syscw", 0)
    written = io_after.get("write_bytes", 0) - io_before.get("write_bytes", 0)
    return {
        "tasks": tasks,
        "created": len(created),
        "runningAtStart": before["jobs"],
        "runningAtEnd": after["jobs"],
        "renewal": after.get("renewal", "per attempt" if per_attempt else "batch"),
        "creationSeconds": round(creation_seconds, 3),
        "windowSeconds": round(window, 3),
        "heartbeatSeconds": heartbeat_s,
        "serverCpuFractionOfCore": None if cpu is None else round(cpu / window, 5),
        "serverCpuMsPerTaskPerMinute": (
            None if cpu is None else round(cpu * 1000 / max(tasks, 1) * 60 / window, 5)
        ),
        "storeCommitsPerSecond": round(commits / window, 4),
        "storeCommits": commits,
        "storeCalls": calls,
        "leasesRenewed": after["renewed"] - before["renewed"],
        "gcSecondsInWindow": round(after["gcSeconds"] - before["gcSeconds"], 4),
        "gcCollectionsInWindow": [
            a - b for a, b in zip(after["gcCollections"], before["gcCollections"], strict=True)
        ],
        "writeSyscallsPerSecond": round(syscw / window, 2),
        "storageBytesWrittenPerSecond": round(written / window, 1),
        "serverRssKiB": rss,
        "sampleStatuses": sorted(set(statuses)),
        "failures": failures,
    }


async def bench_idle(params: IdleParams) -> dict[str, Any]:
    from stress.bench.benchmarks import _fresh_store_url, _result
    from stress.common import prepared_store_url
    from tritask.tasks.stores import store_scheme

    with tempfile.TemporaryDirectory(prefix="tritask-bench-idle-") as workdir:
        async with prepared_store_url(_fresh_store_url(params.store, workdir, "idle.db")) as url:
            tritask = await _idle_run(params, url, params.tasks, per_attempt=False)
        baseline = None
        if params.baseline_tasks:
            fresh = _fresh_store_url(params.store, workdir, "idle-baseline.db")
            async with prepared_store_url(fresh) as url:
                baseline = await _idle_run(params, url, params.baseline_tasks, per_attempt=True)
    runners = 1
    commit_limit = runners / tritask["heartbeatSeconds"] + 1
    cpu = tritask["serverCpuFractionOfCore"]
    ok = (
        tritask["created"] == params.tasks
        and tritask["runningAtStart"] == params.tasks
        and tritask["runningAtEnd"] == params.tasks
        and tritask["sampleStatuses"] == ["working"]
    )
    ratio = None
    if baseline is not None and cpu:
        per_task = baseline["serverCpuMsPerTaskPerMinute"]
        if per_task is not None:
            ratio = round(per_task / max(tritask["serverCpuMsPerTaskPerMinute"], 1e-9), 2)
    target_met = (
        ok and cpu is not None and cpu < 0.02 and tritask["storeCommitsPerSecond"] <= commit_limit
    )
    return _result(
        "idle",
        {
            **attrs.asdict(params),
            "store": store_scheme(params.store),
            "runners": runners,
            "napSeconds": NAP_SECONDS,
            "target": "server CPU < 2% of a core and store commits/s <= runners / heartbeat + 1",
            "commitLimitPerSecond": round(commit_limit, 4),
            "ratio": "idle CPU per sleeping task: baseline (per-attempt renewal) / batch",
        },
        tritask,
        baseline,
        ratio,
        target_met,
        ok=ok,
    )


def main_params(args: argparse.Namespace) -> IdleParams:
    return IdleParams(
        store=args.store,
        tasks=args.tasks,
        clients=args.clients,
        seconds=args.seconds,
        settle_seconds=args.settle_seconds,
        lease_ms=args.lease_ms,
        sqlite_synchronous=args.sqlite_synchronous,
        baseline_tasks=args.baseline_tasks,
    )
