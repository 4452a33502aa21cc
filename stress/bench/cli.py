"""``python -m stress bench {core,tasks,scale,queue,idle,listen,soak,suspended}``: benchmarks with
their baselines."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import trio


def _positive(value: str) -> int:
    number = int(value)
    if number <= 0:
        raise argparse.ArgumentTypeError("expected a positive integer")
    return number


def _positive_float(value: str) -> float:
    number = float(value)
    if number <= 0:
        raise argparse.ArgumentTypeError("expected a positive number")
    return number


def register_bench(commands: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    bench = commands.add_parser("bench", help="benchmarks, each with its baseline in the same run")
    kinds = bench.add_subparsers(dest="bench_command", required=True)

    core = kinds.add_parser(
        "core", help="tools/call over Streamable HTTP: tritask vs mcp 2.3.0 (either era)"
    )
    common(core)
    core.add_argument("--concurrency", type=_positive, nargs="+", default=[1, 32])
    core.add_argument("--seconds", type=_positive_float, default=5.0, help="per measurement")
    core.add_argument("--warmup", type=float, default=1.0, help="seconds before measuring")
    core.add_argument("--repeats", type=_positive, default=3, help="alternating runs per side")
    core.add_argument(
        "--pin", action="store_true", help="pin the client to CPU 0 and the servers to CPU 1"
    )
    core.add_argument(
        "--mcp-json-response",
        action="store_true",
        help="run the mcp server with json_response=True (default: its SSE-capable default)",
    )
    core.add_argument(
        "--era",
        choices=["modern", "legacy"],
        default="modern",
        help="legacy: 2025-11-25 sessions on both servers, plus tritask modern in the same run",
    )
    core.set_defaults(handler=_handle_core)

    for name, helptext in (
        ("tasks", "tasks end to end over HTTP vs the store's raw commit limit"),
        ("scale", "the tasks benchmark with 1, 2 and 4 runner processes"),
    ):
        parser = kinds.add_parser(name, help=helptext)
        common(parser)
        parser.add_argument(
            "--store",
            default="memory:" if name == "tasks" else None,
            required=name == "scale",
            help="memory:, sqlite:PATH (sqlite:auto = a fresh temporary file), postgresql://...",
        )
        parser.add_argument("--tasks", type=_positive, default=2_000)
        parser.add_argument("--clients", type=_positive, default=16)
        parser.add_argument("--sqlite-synchronous", default="FULL", choices=["FULL", "NORMAL"])
        parser.add_argument("--pg-connections", type=_positive, default=4, help="raw loop")
        parser.add_argument(
            "--unlimited",
            action="store_true",
            help="the servers' stores without max_tasks and max_active_tasks_per_scope "
            "(default: the store's defaults, 10,000 and 100, as a user's server)",
        )
        if name == "scale":
            parser.add_argument("--processes", type=_positive, nargs="+", default=[1, 2, 4])
            parser.set_defaults(handler=_handle_scale)
        else:
            parser.add_argument("--no-raw", action="store_true", help="skip the raw-limit loop")
            parser.add_argument(
                "--no-memory",
                action="store_true",
                help="skip the memory-store rounds a durable store is compared with",
            )
            parser.add_argument(
                "--peer",
                choices=["fastmcp-tasks"],
                default=None,
                help="also drive this peer (fastmcp-tasks 4.1.4, memory://) in every round",
            )
            parser.add_argument(
                "--repeats",
                type=_positive,
                default=3,
                help="rounds of (tritask run, raw loop), interleaved; medians are reported",
            )
            parser.add_argument(
                "--against",
                default=None,
                metavar="CHECKOUT",
                help="also run each round's tritask side with the server of another checkout "
                "of tritask (e.g. a git worktree of the commit before a change): before and "
                "after side by side, on the same machine drift; memory:, sqlite:auto or "
                "postgresql:// without ?schema= (a fresh store per round)",
            )
            parser.add_argument(
                "--transport",
                choices=["http", "in-process"],
                default="http",
                help="in-process: the same app called through its dispatcher in this process "
                "(no HTTP), to see what the transport costs; the target is judged on http",
            )
            parser.set_defaults(handler=_handle_tasks)

    queue = kinds.add_parser(
        "queue", help="a burst of tasks queued beyond max_jobs: all accepted, RSS, drain rate"
    )
    common(queue)
    queue.add_argument("--store", default="sqlite:auto", help="sqlite:auto, sqlite:PATH, ...")
    queue.add_argument("--tasks", type=_positive, default=100_000)
    queue.add_argument("--checkpoint", type=_positive, default=1_000, help="the RSS baseline")
    queue.add_argument("--clients", type=_positive, default=32)
    queue.add_argument("--max-jobs", type=_positive, default=32)
    queue.add_argument("--sqlite-synchronous", default="FULL", choices=["FULL", "NORMAL"])
    queue.set_defaults(handler=_handle_queue)

    idle = kinds.add_parser(
        "idle", help="tasks sleeping inside their tools: the server's idle CPU and commits"
    )
    common(idle)
    idle.add_argument(
        "--store", default="sqlite:auto", help="sqlite:auto (a fresh file), sqlite:PATH, ..."
    )
    idle.add_argument(
        "--suspended",
        action="store_true",
        help="waiting tasks suspended (durable sleeps, input waits) vs held by their attempts:"
        " the same as `bench suspended` (--tasks 10000 --baseline-tasks 1000 --seconds 12)",
    )
    idle.add_argument("--tasks", type=_positive, default=None, help="20000 (--suspended: 10000)")
    idle.add_argument("--clients", type=_positive, default=16)
    idle.add_argument(
        "--seconds",
        type=_positive_float,
        default=None,
        help="measured window: 60 (--suspended: 12)",
    )
    idle.add_argument(
        "--settle-seconds", type=float, default=5.0, help="after every task runs, before the window"
    )
    idle.add_argument("--lease-ms", type=_positive, default=30_000)
    idle.add_argument("--sqlite-synchronous", default="FULL", choices=["FULL", "NORMAL"])
    idle.add_argument(
        "--baseline-tasks",
        type=int,
        default=None,
        help="tasks of the per-attempt-renewal baseline (0: none): 2000 (--suspended: 1000)",
    )
    idle.set_defaults(handler=_handle_idle)
    listen = kinds.add_parser(
        "listen", help="10,000 listen streams on one process: memory per stream, push delay"
    )
    common(listen)
    listen.add_argument("--streams", type=_positive, default=10_000)
    listen.add_argument(
        "--tasks", type=_positive, default=1_000, help="each watched by streams/tasks"
    )
    listen.add_argument(
        "--updates-per-second", type=_positive_float, default=50.0, help="answers (2 commits each)"
    )
    listen.add_argument("--baseline-streams", type=_positive, default=100)
    listen.set_defaults(handler=_handle_listen)

    soak = kinds.add_parser("soak", help="100k tasks on the memory store: RSS at 10k vs 100k")
    common(soak)
    soak.add_argument("--tasks", type=_positive, default=100_000)
    soak.add_argument("--checkpoint", type=_positive, default=10_000)
    soak.add_argument("--batch", type=_positive, default=500)
    soak.add_argument("--ttl-ms", type=_positive, default=1_000)
    soak.add_argument("--reap-interval-ms", type=_positive, default=200)
    soak.set_defaults(handler=_handle_soak)

    _add_suspended(kinds, common)


def _add_suspended(kinds: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    suspended = kinds.add_parser(
        "suspended",
        help="idle waiting tasks on SQLite: suspended (durable sleep, input) vs held attempts",
    )
    common(suspended)
    suspended.add_argument("--tasks", type=_positive, default=10_000)
    suspended.add_argument("--baseline-tasks", type=_positive, default=1_000)
    suspended.add_argument("--seconds", type=_positive_float, default=12.0, help="idle window")
    suspended.set_defaults(handler=_handle_suspended)


def _handle_suspended(args: argparse.Namespace) -> int:
    from stress.bench.benchmarks import SuspendedParams, bench_suspended

    params = SuspendedParams(
        tasks=args.tasks, baseline_tasks=args.baseline_tasks, seconds=args.seconds
    )
    return _run(args, lambda: bench_suspended(params))


def _run(args: argparse.Namespace, fn: Callable[[], Awaitable[dict[str, Any]]]) -> int:
    result = trio.run(fn)
    if args.json:
        sys.stdout.write(json.dumps(result, sort_keys=True) + "\n")
    else:
        _print(result)
    sys.stdout.flush()
    return 0 if result.get("ok", True) and result.get("errors", 0) == 0 else 1


def _print(result: dict[str, Any]) -> None:
    print(f"bench {result['name']}: {json.dumps(result['params'], sort_keys=True)}")
    print(f"  tritask:  {json.dumps(result['tritask'], sort_keys=True)}")
    print(f"  baseline: {json.dumps(result['baseline'], sort_keys=True)}")
    print(f"  ratio:    {json.dumps(result['ratio'], sort_keys=True)}")
    if "serverCpuRatio" in result:
        print(f"  server CPU, mcp/tritask: {json.dumps(result['serverCpuRatio'], sort_keys=True)}")
    if "ratioToModern" in result:
        print(f"  tritask modern: {json.dumps(result['tritaskModern'], sort_keys=True)}")
        print(f"  legacy/modern:  {json.dumps(result['ratioToModern'], sort_keys=True)}")
    print(f"  target met: {result['target_met']}")


def _handle_core(args: argparse.Namespace) -> int:
    from stress.bench.benchmarks import CoreParams, bench_core

    params = CoreParams(
        concurrency=tuple(args.concurrency),
        seconds=args.seconds,
        warmup_seconds=args.warmup,
        repeats=args.repeats,
        pin=args.pin,
        mcp_json_response=args.mcp_json_response,
        era=args.era,
    )
    return _run(args, lambda: bench_core(params))


def _tasks_params(args: argparse.Namespace, **extra: Any) -> Any:
    from stress.bench.benchmarks import TasksParams

    return TasksParams(
        store=args.store,
        tasks=args.tasks,
        clients=args.clients,
        sqlite_synchronous=args.sqlite_synchronous,
        pg_connections=args.pg_connections,
        unlimited=args.unlimited,
        **extra,
    )


def _handle_tasks(args: argparse.Namespace) -> int:
    from stress.bench.benchmarks import bench_tasks

    params = _tasks_params(
        args,
        raw=not args.no_raw,
        transport=args.transport,
        repeats=args.repeats,
        memory=not args.no_memory,
        peer=args.peer,
        against=args.against,
    )
    if params.against is not None:
        from stress.bench.benchmarks import check_against

        try:
            check_against(params)
        except ValueError as exc:
            print(f"bench tasks: error: {exc}", file=sys.stderr)
            return 2
    return _run(args, lambda: bench_tasks(params))


def _handle_scale(args: argparse.Namespace) -> int:
    from stress.bench.benchmarks import bench_scale

    params = _tasks_params(args, repeats=1)
    return _run(args, lambda: bench_scale(params, tuple(args.processes)))


def _handle_queue(args: argparse.Namespace) -> int:
    from stress.bench.benchmarks import QueueParams, bench_queue

    if args.checkpoint >= args.tasks:
        raise SystemExit("--checkpoint must be smaller than --tasks")
    params = QueueParams(
        store=args.store,
        tasks=args.tasks,
        checkpoint=args.checkpoint,
        clients=args.clients,
        max_jobs=args.max_jobs,
        sqlite_synchronous=args.sqlite_synchronous,
    )
    return _run(args, lambda: bench_queue(params))


def _handle_listen(args: argparse.Namespace) -> int:
    from stress.bench.listen import ListenParams, bench_listen

    params = ListenParams(
        streams=args.streams,
        tasks=args.tasks,
        updates_per_second=args.updates_per_second,
        baseline_streams=args.baseline_streams,
    )
    return _run(args, lambda: bench_listen(params))


def _handle_soak(args: argparse.Namespace) -> int:
    from stress.bench.benchmarks import SoakParams, bench_soak

    params = SoakParams(
        tasks=args.tasks,
        checkpoint=args.checkpoint,
        batch=args.batch,
        ttl_ms=args.ttl_ms,
        reap_interval_ms=args.reap_interval_ms,
    )
    return _run(args, lambda: bench_soak(params))


def _handle_idle(args: argparse.Namespace) -> int:
    from stress.bench.idle import bench_idle, main_params

    if args.suspended:
        args.tasks = 10_000 if args.tasks is None else args.tasks
        args.baseline_tasks = 1_000 if args.baseline_tasks is None else args.baseline_tasks
        args.seconds = 12.0 if args.seconds is None else args.seconds
        if args.baseline_tasks <= 0:
            raise SystemExit("bench idle --suspended: --baseline-tasks must be positive")
        return _handle_suspended(args)
    args.tasks = 20_000 if args.tasks is None else args.tasks
    args.baseline_tasks = 2_000 if args.baseline_tasks is None else args.baseline_tasks
    args.seconds = 60.0 if args.seconds is None else args.seconds
    params = main_params(args)
    return _run(args, lambda: bench_idle(params))
