"""``tritask migrate --store URL``: bring a task store's schema to this tritask's version.

Stores are found by URL scheme through the ``tritask.stores`` entry points, like ``serve`` does;
a store whose package exports ``async def migrate(url, **options)`` has an explicit migration
step (PostgreSQL: the application owns the schema, and every host's store refuses to start on a
mismatch until it runs; SQLite: an existing file is migrated now instead of at its next serving
open, which the read-only operator commands wait for). Stores without one (``memory:``) have
nothing to do here, which is not an error.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Awaitable, Callable
from importlib.metadata import entry_points
from typing import Any

import trio

from tritask.tasks.stores import UnknownStore, store_scheme

__all__ = ["add_migrate_command", "migrate_store", "run_migrate"]

Migrate = Callable[..., Awaitable[object]]


def _store_migrate(url: str) -> Migrate | None:
    """The ``migrate`` function of the package that serves ``url``, if it has one."""
    scheme = store_scheme(url)
    for entry in entry_points(group="tritask.stores"):
        if entry.name == scheme:
            module = importlib.import_module(entry.module)
            migrate: Migrate | None = getattr(module, "migrate", None)
            return migrate
    available = sorted({entry.name for entry in entry_points(group="tritask.stores")})
    raise UnknownStore(f"no store for {scheme!r} URLs; installed: {', '.join(available)}")


def _describe(result: object) -> str:
    schema = getattr(result, "schema", None)
    version = getattr(result, "version", None)
    applied: tuple[int, ...] = tuple(getattr(result, "applied", ()))
    where = f"schema {schema!r}" if schema else "the store"
    if applied:
        steps = ", ".join(f"{v:04d}" for v in applied)
        return f"tritask: migrated {where} to version {version} (applied {steps})"
    return f"tritask: {where} is up to date (version {version})"


async def migrate_store(url: str, **options: Any) -> str:
    """Run the store's migrations for ``url``; return a one-line report."""
    migrate = _store_migrate(url)
    if migrate is None:
        return f"tritask: {store_scheme(url)}: stores have no separate migration step"
    return _describe(await migrate(url, **options))


def run_migrate(args: argparse.Namespace) -> int:
    """The ``migrate`` subcommand's handler (the CLI calls ``args.handler(args)``)."""
    if not args.store:
        print("tritask: migrate needs --store URL (or TRITASK_STORE)", file=sys.stderr)
        return 2
    options: dict[str, Any] = {}
    if args.schema is not None:
        options["schema"] = args.schema
    try:
        report = trio.run(lambda: migrate_store(args.store, **options))
    except (UnknownStore, ValueError) as exc:
        print(f"tritask: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # the database said no: report it without a traceback
        print(f"tritask: migrate failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(report, file=sys.stderr)
    return 0


def add_migrate_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``tritask migrate`` on the CLI's subcommands."""
    parser = subparsers.add_parser(
        "migrate",
        help="apply the task store's schema migrations",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--store",
        default=os.environ.get("TRITASK_STORE"),
        help="task store URL, e.g. postgresql://host/db (default: $TRITASK_STORE)",
    )
    parser.add_argument(
        "--schema",
        default=None,
        help="PostgreSQL schema (default tritask; a ?schema= in the URL works too)",
    )
    parser.add_argument("--log-level", default=os.environ.get("TRITASK_LOG_LEVEL", "INFO"))
    parser.set_defaults(handler=run_migrate)
