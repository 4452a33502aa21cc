"""Command line: ``python -m stress {cas,runner,steps,all,bench ...}`` (from a checkout).

With ``--json`` stdout carries exactly one JSON object and nothing else (logs go to stderr).
Exit status 0 only when every invariant held (benchmarks: when the run itself succeeded).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio
import trio.testing

from stress.common import (
    Checks,
    dump_report,
    make_report,
    open_stress_store,
    prepared_store_url,
    seed_trio_scheduler,
    task_prefix,
)
from stress.wrappers import FAULTS
from tritask.tasks.store import Store
from tritask.tasks.stores import store_scheme

__all__ = ["add_stress_command", "build_parser", "dump_report", "main", "run_stress"]

log = logging.getLogger("stress")

Workload = Callable[[Store, str, bool], Awaitable[tuple[Checks, dict[str, Any]]]]


def _positive(value: str) -> int:
    try:
        number = int(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError("expected a positive integer") from error
    if number <= 0:
        raise argparse.ArgumentTypeError("expected a positive integer")
    return number


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--seed", type=int, default=0, help="seed of the plan and task ids")
    parser.add_argument(
        "--log-level", default=os.environ.get("TRITASK_LOG_LEVEL", "WARNING"), help="stderr logs"
    )


def _stress_options(parser: argparse.ArgumentParser) -> None:
    _common(parser)
    parser.add_argument(
        "--store",
        default="memory:",
        help="memory:, sqlite:PATH or postgresql://... (default memory:)",
    )
    parser.add_argument("--timeout-ms", type=_positive, default=30_000, help="per phase")
    parser.add_argument(
        "--real-clock",
        action="store_true",
        help="memory store only: run on the real clock instead of trio's MockClock",
    )
    parser.add_argument("--fault", choices=sorted(FAULTS), help=argparse.SUPPRESS)


def _add_cas_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tasks", "-T", type=_positive, default=25)
    parser.add_argument("--writers", "-W", type=_positive, default=8)
    parser.add_argument("--depth", type=_positive, default=4, help="revisions raced per task")


def _add_runner_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", "-R", type=_positive, default=3)
    parser.add_argument("--batch", "-N", type=_positive, default=25, help="tasks per round")
    parser.add_argument("--lease-ms", type=_positive, default=1_000)
    parser.add_argument("--retry-delay-ms", type=_positive, default=20)


def _add_steps_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tasks", "-T", type=_positive, default=24)
    parser.add_argument("--steps", "-S", type=_positive, default=5, help="steps per task")
    parser.add_argument("--kills", "-K", type=_positive, default=8, help="planned crashes")
    parser.add_argument("--lease-ms", type=_positive, default=2_000)


def build_parser(prog: str = "python -m stress") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    commands = parser.add_subparsers(dest="stress_command", required=True)
    _register(commands)
    return parser


def add_stress_command(subparsers: Any) -> None:
    """Register ``stress`` on another CLI (``tritask stress ...``); sets ``args.handler``."""
    parser = subparsers.add_parser(
        "stress", help="deterministic stress workloads and benchmarks", description=__doc__
    )
    parser.set_defaults(log_level="WARNING")
    commands = parser.add_subparsers(dest="stress_command", required=True)
    _register(commands)


def _register(commands: Any) -> None:
    cas = commands.add_parser("cas", help="writers race compare-and-set on every task")
    _stress_options(cas)
    _add_cas_options(cas)
    cas.set_defaults(handler=_handle_cas)

    runner = commands.add_parser("runner", help="rounds of mixed-outcome tasks through Runners")
    _stress_options(runner)
    _add_runner_options(runner)
    runner.set_defaults(handler=_handle_runner)

    steps = commands.add_parser(
        "steps", help="pipelines of durable steps through runners that crash at seeded points"
    )
    _stress_options(steps)
    _add_steps_options(steps)
    steps.set_defaults(handler=_handle_steps, timeout_ms=3_600_000)

    both = commands.add_parser("all", help="cas, then runner, in one report")
    _stress_options(both)
    _add_cas_options(both)
    _add_runner_options(both)
    both.set_defaults(handler=_handle_all)

    from stress.bench.cli import register_bench
    from stress.fuzz.cli import register_fuzz

    register_bench(commands, _common)
    register_fuzz(commands, _common)


# -- running a workload ------------------------------------------------------------------------


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, str(level).upper(), logging.WARNING),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def run_stress(
    workload_name: str,
    workload: Workload,
    params: dict[str, Any],
    *,
    store_url: str,
    seed: int,
    real_clock: bool = False,
    fault: str | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Open the store, run ``workload`` under ``trio.run`` and build the report.

    On the memory store (unless ``real_clock``) the run uses ``MockClock(autojump_threshold=0)``
    and a seeded trio scheduler, which makes it fully deterministic.
    """
    mock = store_scheme(store_url) == "memory" and not real_clock
    params = {
        **params,
        "seed": seed,
        "store": store_scheme(store_url),
        "clock": "mock" if mock else "real",
    }
    if fault is not None:
        params["fault"] = fault
    prefix = task_prefix(seed, store_url)
    outcome: dict[str, Any] = {}

    async def main() -> None:
        if mock:
            seed_trio_scheduler(seed)
        async with prepared_store_url(store_url) as url:
            store: Store = open_stress_store(url, mock_clock=mock)
            if fault is not None:
                store = FAULTS[fault](store)
            async with store:
                checks, timings = await workload(store, prefix, progress)
        outcome["checks"], outcome["timings"] = checks, timings

    started = time.perf_counter()
    error: str | None = None
    if mock:
        seed_trio_scheduler(seed)
    try:
        trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0) if mock else None)
    except Exception as exc:
        log.exception("the %s workload crashed", workload_name)
        error = describe_error(exc)
    checks = outcome.get("checks") or Checks()
    timings = dict(outcome.get("timings") or {})
    timings["processSeconds"] = round(time.perf_counter() - started, 6)
    return make_report(f"tritask.stress.{workload_name}", params, checks, timings, error=error)


def describe_error(exc: BaseException) -> str:
    """The distinct leaf errors of a (possibly grouped) exception, without the cancellations."""
    leaves: list[str] = []

    def walk(error: BaseException) -> None:
        if isinstance(error, BaseExceptionGroup):
            for inner in error.exceptions:
                walk(inner)
        elif not isinstance(error, trio.Cancelled):
            text = f"{type(error).__name__}: {error}".rstrip(": ")
            if text not in leaves:
                leaves.append(text)

    walk(exc)
    return "; ".join(leaves) or type(exc).__name__


def _print_text(report: dict[str, Any]) -> None:
    inv = report["invariants"]
    params = report["params"]
    print(f"{report['workload']}: {params}")
    for name, value in inv.items():
        if name not in ("checks", "failures"):
            print(f"  {name}: {value}")
    for name, passed in inv.get("checks", {}).items():
        print(f"  [{'ok' if passed else 'FAIL'}] {name}")
    for failure in inv.get("failures", []):
        print(f"  failure: {failure}")
    print(f"  timings: {report['timings']}")
    print(f"Invariants: {'passed' if report['ok'] else 'failed'}")


def _emit(report: dict[str, Any], as_json: bool) -> int:
    if as_json:
        dump_report(report)
    else:
        _print_text(report)
    return 0 if report["ok"] else 1


def _cas_workload(args: argparse.Namespace) -> tuple[dict[str, Any], Workload]:
    from stress.cas import CasParams, run_cas

    params = CasParams(
        tasks=args.tasks,
        writers=args.writers,
        depth=args.depth,
        seed=args.seed,
        timeout_ms=args.timeout_ms,
    )

    async def workload(store: Store, prefix: str, progress: bool) -> tuple[Checks, dict[str, Any]]:
        return await run_cas(store, params, prefix, progress=progress)

    shown = {"tasks": args.tasks, "writers": args.writers, "depth": args.depth}
    return {**shown, "timeoutMs": args.timeout_ms}, workload


def _runner_workload(args: argparse.Namespace) -> tuple[dict[str, Any], Workload]:
    from stress.runner_soak import RunnerParams, run_runner

    params = RunnerParams(
        rounds=args.rounds,
        tasks=args.batch,
        seed=args.seed,
        timeout_ms=args.timeout_ms,
        lease_ms=args.lease_ms,
        retry_delay_ms=args.retry_delay_ms,
    )

    async def workload(store: Store, prefix: str, progress: bool) -> tuple[Checks, dict[str, Any]]:
        return await run_runner(store, params, prefix, progress=progress)

    shown = {
        "rounds": args.rounds,
        "batch": args.batch,
        "leaseMs": args.lease_ms,
        "retryDelayMs": args.retry_delay_ms,
        "timeoutMs": args.timeout_ms,
    }
    return shown, workload


def _steps_workload(args: argparse.Namespace) -> tuple[dict[str, Any], Workload]:
    from stress.steps_soak import StepsParams, run_steps

    params = StepsParams(
        tasks=args.tasks,
        steps=args.steps,
        kills=args.kills,
        seed=args.seed,
        lease_ms=args.lease_ms,
        timeout_ms=args.timeout_ms,
    )

    async def workload(store: Store, prefix: str, progress: bool) -> tuple[Checks, dict[str, Any]]:
        return await run_steps(store, params, prefix, progress=progress)

    shown = {
        "tasks": args.tasks,
        "steps": args.steps,
        "kills": args.kills,
        "leaseMs": args.lease_ms,
        "timeoutMs": args.timeout_ms,
    }
    return shown, workload


def _run_args(
    name: str, args: argparse.Namespace, params: dict[str, Any], workload: Workload
) -> dict[str, Any]:
    return run_stress(
        name,
        workload,
        params,
        store_url=args.store,
        seed=args.seed,
        real_clock=args.real_clock,
        fault=args.fault,
        progress=not args.json,
    )


def _handle_cas(args: argparse.Namespace) -> int:
    params, workload = _cas_workload(args)
    return _emit(_run_args("cas", args, params, workload), args.json)


def _handle_runner(args: argparse.Namespace) -> int:
    params, workload = _runner_workload(args)
    return _emit(_run_args("runner", args, params, workload), args.json)


def _handle_steps(args: argparse.Namespace) -> int:
    params, workload = _steps_workload(args)
    return _emit(_run_args("steps", args, params, workload), args.json)


def _handle_all(args: argparse.Namespace) -> int:
    cas_params, cas = _cas_workload(args)
    runner_params, runner = _runner_workload(args)
    reports = {
        "cas": _run_args("cas", args, cas_params, cas),
        "runner": _run_args("runner", args, runner_params, runner),
    }
    combined = {
        "schemaVersion": 1,
        "workload": "tritask.stress.all",
        "ok": all(r["ok"] for r in reports.values()),
        "params": {name: r["params"] for name, r in reports.items()},
        "invariants": {name: r["invariants"] for name, r in reports.items()},
        "timings": {name: r["timings"] for name, r in reports.items()},
    }
    if args.json:
        dump_report(combined)
    else:
        for report in reports.values():
            _print_text(report)
    return 0 if combined["ok"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _configure_logging(args.log_level)
    handler: Callable[[argparse.Namespace], int] = args.handler
    return int(handler(args))
