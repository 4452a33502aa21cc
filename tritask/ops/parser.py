"""The ``tritask tasks ...`` and ``tritask reap`` subcommands: arguments, store, output, exit.

Exit status: 0 on success; 1 when the command ran but the answer is "no" (no such task, a
task that cannot be cancelled) or the store failed; 2 for a usage error (a bad URL, a store
without the operator capability). Output goes to stdout (tables, or JSON with ``--json``);
diagnostics go to stderr as one line each.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from tritask.ops import operations as ops
from tritask.ops import render
from tritask.tasks._time import format_instant
from tritask.tasks.model import TaskStatus
from tritask.tasks.store import (
    MAX_LIST_PAGE,
    NotFound,
    Store,
    StoredTask,
    StoreError,
    TaskQuery,
)
from tritask.tasks.stores import UnknownStore, open_store, store_scheme
from tritask.tasks.work import InvalidJSON, canonical_json

__all__ = ["add_operator_commands", "open_operator_store", "parse_duration_ms", "run_on_store"]

_OPERATOR_OPTIONS: dict[str, dict[str, Any]] = {
    # Share the file, never take it over: an exclusive opener would advance the boot epoch
    # and so fence the claims of a server that is still running. Never create a new store.
    # A one-shot command needs no writer process (it is for a serving store's hot writes).
    "sqlite": {"exclusive": False, "create": False, "writer_process": False},
    "postgresql": {"pool_size": 2},
    "postgres": {"pool_size": 2},
}
_READ_ONLY_OPTIONS: dict[str, dict[str, Any]] = {
    # Read beside a running `tritask serve`, which holds the file exclusively: no lock, no
    # migration, no boot epoch, nothing written (tritask_sqlite's read_only opener).
    "sqlite": {"exclusive": False, "read_only": True},
}
"""Options of the built-in stores for an operator's process; other stores get only the
scope. The scope does not matter: operator reads span scopes, and a cancellation uses an
access in the task's own scope. Commands that only read (list, show, stats) open with
``_READ_ONLY_OPTIONS`` where a store has them."""

_STATUS_GROUPS: dict[str, frozenset[TaskStatus]] = {
    "active": frozenset({TaskStatus.WORKING, TaskStatus.INPUT_REQUIRED}),
    "terminal": frozenset({TaskStatus.COMPLETED, TaskStatus.FAILED, TaskStatus.CANCELLED}),
    **{status.value: frozenset({status}) for status in TaskStatus},
}
_ID_HELP = "the task id; one that starts with '-' goes after '--' (show --json -- -x1y2)"
_DURATION = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h|d)?")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, None: 1000}


def open_operator_store(url: str, *, writes: bool = True) -> Store:
    """The store behind ``url``, opened as an operator's process needs it (enter it).

    ``writes=False`` (the read-only commands) opens a SQLite file read-only, so it can be read
    while a server holds it."""
    scheme = store_scheme(url)
    chosen = _OPERATOR_OPTIONS if writes else {**_OPERATOR_OPTIONS, **_READ_ONLY_OPTIONS}
    options: dict[str, Any] = {"scope": "shared", **chosen.get(scheme, {})}
    return open_store(url, **options)


def parse_duration_ms(text: str) -> int:
    """``500ms``, ``30s``, ``10m``, ``2h``, ``7d`` (a bare number is seconds) in ms."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"not a duration: {text!r} (use e.g. 500ms, 30s, 10m, 2h, 7d)"
        )
    value = float(match[1]) * _UNIT_MS[match[2]]
    if not math.isfinite(value) or value > 10**15:
        raise argparse.ArgumentTypeError(f"duration {text!r} is too long")
    return int(value)


def _statuses(text: str) -> frozenset[TaskStatus]:
    found: set[TaskStatus] = set()
    for name in (part.strip() for part in text.split(",")):
        group = _STATUS_GROUPS.get(name)
        if group is None:
            choices = ", ".join(_STATUS_GROUPS)
            raise argparse.ArgumentTypeError(f"unknown status {name!r} (one of: {choices})")
        found |= group
    return frozenset(found)


def _scope(text: str) -> str:
    try:
        return canonical_json(json.loads(text))
    except (ValueError, InvalidJSON) as error:
        raise argparse.ArgumentTypeError(
            f"--scope takes the scope value as JSON (e.g. '\"alice\"', or null for the shared "
            f"scope): {error}"
        ) from None


def _limit(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_LIST_PAGE:
        raise argparse.ArgumentTypeError(f"--limit must be an integer in 1..{MAX_LIST_PAGE}")
    return value


def _task_id(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("a task id is required")
    return text


# -- running a command on a store --------------------------------------------------------------


def _fail(message: str, status: int) -> int:
    print(f"tritask: {message}", file=sys.stderr)
    return status


Operation = Callable[[argparse.Namespace, Store], Awaitable[int]]


def _run(args: argparse.Namespace) -> int:
    """The CLI's handler: open the store, run the command's operation on it, and turn every
    failure into one line."""
    operation: Operation = args.operation

    async def main() -> int:
        store = open_operator_store(args.store, writes=args.writes)
        async with store:
            ops.operator_store(store)  # refuse a store without the capability first
            return await operation(args, store)

    try:
        return trio.run(main)
    except (UnknownStore, ops.NotAnOperatorStore) as error:
        return _fail(str(error), 2)
    except StoreError as error:
        return _fail(f"{type(error).__name__}: {error}", 1)
    except (ValueError, TypeError) as error:  # a URL or option the store refused
        return _fail(f"{args.store}: {error}", 2)
    except Exception as error:  # the database said no (connection refused, permissions...)
        return _fail(f"{type(error).__name__}: {error}", 1)


def _print(text: str) -> None:
    print(text, flush=True)


# -- the commands ------------------------------------------------------------------------------


async def _list(args: argparse.Namespace, store: Store) -> int:
    created_before = None
    if args.older_than is not None:
        created_before = max(0, await store.now() - args.older_than * 1000)
    statuses: frozenset[TaskStatus] = (
        frozenset().union(*args.status) if args.status else frozenset()
    )
    query = TaskQuery(
        statuses=statuses,
        tool=args.tool,
        scope=args.scope,
        created_before=created_before,
        limit=MAX_LIST_PAGE if args.all else args.limit,
    )
    tasks: list[StoredTask] = []
    now: int | None = None
    truncated = False
    if args.all:
        async for page in ops.list_all(store, query):
            now = page.now if now is None else now
            tasks.extend(page.tasks)
    else:
        page = await ops.list_page(store, query)
        now, tasks, truncated = page.now, list(page.tasks), page.next_after is not None
    assert now is not None
    if args.json:
        _print(
            render.dumps(
                {
                    "now": format_instant(now),
                    "tasks": [render.task_json(task) for task in tasks],
                    "truncated": truncated,
                }
            )
        )
        return 0
    if not tasks:
        _print("no tasks match")
        return 0
    _print(render.tasks_table(tasks, now))
    count = f"{len(tasks)} task{'s' if len(tasks) != 1 else ''}"
    _print(f"{count}; more match (raise --limit, or --all)" if truncated else count)
    return 0


async def _show(args: argparse.Namespace, store: Store) -> int:
    inspection = await ops.inspect(store, args.task_id)
    if isinstance(inspection, NotFound):
        return _fail(f"no task {args.task_id} in this store", 1)
    _print(
        render.dumps(render.inspection_json(inspection))
        if args.json
        else render.inspection_text(inspection)
    )
    return 0


async def _cancel(args: argparse.Namespace, store: Store) -> int:
    report = await ops.cancel_task(store, args.task_id)
    _print(render.dumps(render.cancel_json(report)) if args.json else render.cancel_text(report))
    return 0 if report.status is TaskStatus.CANCELLED else 1


async def _stats(args: argparse.Namespace, store: Store) -> int:
    window = args.expiring_within
    stats = await ops.collect_statistics(store, expiring_within_ms=window)
    _print(
        render.dumps(render.statistics_json(stats, window))
        if args.json
        else render.statistics_text(stats, window)
    )
    return 0


async def _reap(args: argparse.Namespace, store: Store) -> int:
    reaped = await ops.reap_expired(store)
    if args.json:
        _print(render.dumps(render.reap_json(reaped)))
    else:
        _print(f"reaped {len(reaped)} expired task{'s' if len(reaped) != 1 else ''}")
        for task_id in reaped:
            _print(f"  {task_id}")
    return 0


async def run_on_store(argv: Sequence[str], store: Store) -> int:
    """Run one operator command (``["tasks", "list", "--json"]``) on an open store, in this
    process: how a memory store, which lives in its process, is operated (and tested). Its
    ``--store`` is ignored; output goes to ``sys.stdout``; store errors propagate."""
    parser = argparse.ArgumentParser(prog="tritask")
    add_operator_commands(parser.add_subparsers(dest="command", required=True), "memory:")
    args = parser.parse_args(list(argv))
    ops.operator_store(store)
    operation: Operation = args.operation
    return await operation(args, store)


# -- argparse ----------------------------------------------------------------------------------


def add_operator_commands(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser], default_store: str
) -> None:
    """Register ``tritask tasks ...`` and ``tritask reap`` (``default_store``: serve's)."""
    store = argparse.ArgumentParser(add_help=False)
    store.add_argument(
        "--store",
        default=os.environ.get("TRITASK_STORE", default_store),
        help=f"task store URL: sqlite:PATH, postgresql://..., memory: (default $TRITASK_STORE, "
        f"else {default_store}, what tritask serve uses)",
    )
    store.add_argument("--json", action="store_true", help="JSON on stdout, for scripts")
    store.add_argument("--log-level", default=os.environ.get("TRITASK_LOG_LEVEL", "WARNING"))

    tasks = subparsers.add_parser(
        "tasks",
        help="list, inspect, cancel and count the tasks of a store (operators)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = tasks.add_subparsers(dest="tasks_command", required=True, metavar="COMMAND")

    listing = commands.add_parser(
        "list", parents=[store], help="list stored tasks, oldest first (read-only)"
    )
    listing.add_argument(
        "--status",
        type=_statuses,
        action="append",
        metavar="STATUS[,STATUS]",
        help="working, input_required, completed, failed, cancelled, or active / terminal "
        "(repeatable)",
    )
    listing.add_argument("--tool", help="only tasks of this tool")
    listing.add_argument(
        "--scope", type=_scope, metavar="JSON", help="only tasks of this scope value (JSON)"
    )
    listing.add_argument(
        "--older-than",
        type=parse_duration_ms,
        metavar="DURATION",
        help="only tasks created longer ago than this (30s, 10m, 2h, 7d)",
    )
    listing.add_argument("--limit", type=_limit, default=100, help="at most this many (100)")
    listing.add_argument("--all", action="store_true", help="every matching task, page by page")
    listing.set_defaults(handler=_run, operation=_list, writes=False)

    show = commands.add_parser(
        "show", parents=[store], help="one task: record, lease, retries, input keys, ledger"
    )
    show.add_argument("task_id", type=_task_id, metavar="ID", help=_ID_HELP)
    show.set_defaults(handler=_run, operation=_show, writes=False)

    cancel = commands.add_parser(
        "cancel",
        parents=[store],
        help="cancel a task (writes: the same transition as tasks/cancel; exit 0 when it is "
        "cancelled)",
    )
    cancel.add_argument("task_id", type=_task_id, metavar="ID", help=_ID_HELP)
    cancel.set_defaults(handler=_run, operation=_cancel, writes=True)

    stats = commands.add_parser(
        "stats",
        parents=[store],
        help="counts by status and tool, oldest active task, leases about to expire",
    )
    stats.add_argument(
        "--expiring-within",
        type=parse_duration_ms,
        default=10_000,
        metavar="DURATION",
        help="count live leases ending within this (default 10s)",
    )
    stats.set_defaults(handler=_run, operation=_stats, writes=False)

    reap = subparsers.add_parser(
        "reap",
        parents=[store],
        help="delete every task past its TTL (writes; runners also reap on their own)",
    )
    reap.set_defaults(handler=_run, operation=_reap, writes=True)
