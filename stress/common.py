"""What every stress workload shares: the report shape, seeded ids, store opening, progress.

A report is one JSON object (``schemaVersion`` 1):

* ``ok``: every invariant held;
* ``params``: what was asked for (sizes, seed, store scheme);
* ``invariants``: exact figures and named checks. On the memory store under
  ``trio.testing.MockClock`` they are byte-identical for the same seed, so they never contain
  wall times, random tokens or anything the scheduler could reorder;
* ``timings``: wall-clock figures, descriptive only: they never decide ``ok``.
"""

from __future__ import annotations

import importlib
import json
import random
import sys
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, Final, TextIO

import trio

from tritask.tasks import TrioClock
from tritask.tasks.store import Store
from tritask.tasks.stores import open_store, store_scheme

__all__ = [
    "SCHEMA_VERSION",
    "START_US",
    "Checks",
    "Progress",
    "StressFailure",
    "dump_report",
    "make_report",
    "open_stress_store",
    "prepared_store_url",
    "seed_trio_scheduler",
    "task_prefix",
]

SCHEMA_VERSION: Final = 1
START_US: Final = 1_787_565_600_000_000
"""2026-08-24T10:00:00.000Z: where the memory store's trio-driven clock starts."""


class StressFailure(Exception):
    """A workload could not finish a phase (a timeout or an unexpected store answer)."""


class Checks:
    """Named pass/fail checks plus the exact figures they were computed from."""

    def __init__(self) -> None:
        self.figures: dict[str, Any] = {}
        self.checks: dict[str, bool] = {}
        self.failures: list[str] = []

    def figure(self, name: str, value: Any) -> None:
        self.figures[name] = value

    def check(self, name: str, passed: bool, detail: str = "") -> bool:
        """Record a check; an earlier failure of the same name is never overwritten."""
        self.checks[name] = self.checks.get(name, True) and bool(passed)
        if not passed and len(self.failures) < 20:
            self.failures.append(f"{name}: {detail}" if detail else name)
        return bool(passed)

    @property
    def ok(self) -> bool:
        return all(self.checks.values())

    def to_json(self) -> dict[str, Any]:
        return {
            **self.figures,
            "checks": dict(sorted(self.checks.items())),
            "failures": list(self.failures),
        }


def make_report(
    workload: str,
    params: Mapping[str, Any],
    checks: Checks,
    timings: Mapping[str, Any],
    *,
    error: str | None = None,
) -> dict[str, Any]:
    invariants = checks.to_json()
    if error is not None:
        invariants["error"] = error
    return {
        "schemaVersion": SCHEMA_VERSION,
        "workload": workload,
        "ok": checks.ok and error is None and bool(checks.checks),
        "params": dict(params),
        "invariants": invariants,
        "timings": dict(timings),
    }


def dump_report(report: Mapping[str, Any], stream: TextIO | None = None) -> None:
    """Exactly one JSON object and a newline (sorted keys, so equal reports are equal bytes)."""
    out = stream or sys.stdout
    out.write(json.dumps(report, sort_keys=True, separators=(",", ":")) + "\n")
    out.flush()


def task_prefix(seed: int, store_url: str) -> str:
    """Task ids come from the seed; on a persistent store a run salt keeps reruns apart."""
    rng = random.Random(seed)
    prefix = f"s{seed}-{rng.getrandbits(32):08x}"
    if store_scheme(store_url) != "memory":
        prefix += f"-{time.time_ns() % 10**12:012d}"
    return prefix


def seed_trio_scheduler(seed: int) -> None:
    """Make trio's own scheduling coin flips follow the seed (must run inside ``trio.run``).

    Trio reverses each scheduling batch with probability 1/2 from a module-level
    ``random.Random``; seeding it makes the interleaving, and so the whole run, reproducible.
    """
    core = getattr(trio, "_core", None)
    run_module = getattr(core, "_run", None)
    rng = getattr(run_module, "_r", None)
    if isinstance(rng, random.Random):
        rng.seed(seed)


def open_stress_store(
    url: str, *, mock_clock: bool, store_limits: bool = False, **options: Any
) -> Store:
    """Open the store under test with a shared scope and, unless ``store_limits``, no capacity
    limits (``options`` may still set them).

    The stress workloads and the benchmarks that hold more tasks than the defaults allow
    (``bench idle``, ``bench queue``) run without limits; ``bench tasks`` runs with the store's
    defaults (``store_limits``), as a user's server does, so it measures the admission checks
    too. The memory store follows trio's clock (``TrioClock``), so it is deterministic under
    ``MockClock``; other stores keep their own (database) clock.
    """
    options.setdefault("scope", "shared")
    if store_scheme(url) == "memory":
        if not store_limits:
            options.setdefault("max_tasks", None)
            options.setdefault("max_active_tasks_per_scope", None)
        if mock_clock:
            options.setdefault("clock", TrioClock(START_US))
        return open_store(url, **options)
    if store_limits:
        return open_store(url, **options)
    limits = {"max_tasks": None, "max_active_tasks_per_scope": None}
    try:
        return open_store(url, **{**limits, **options})
    except TypeError:
        return open_store(url, **options)


@asynccontextmanager
async def prepared_store_url(url: str) -> AsyncIterator[str]:
    """A store URL ready to open: PostgreSQL gets a fresh, migrated schema, dropped afterwards.

    A URL that already names ``?schema=`` is migrated (idempotent) and kept.
    """
    if store_scheme(url) not in ("postgresql", "postgres"):
        yield url
        return
    migrate: Any = importlib.import_module("tritask_postgres").migrate

    parts = urllib.parse.urlsplit(url)
    pairs = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    if any(key == "schema" for key, _ in pairs):
        await migrate(url)
        yield url
        return
    schema = f"tritask_stress_{uuid.uuid4().hex[:12]}"
    query = urllib.parse.urlencode([*pairs, ("schema", schema)])
    prepared = urllib.parse.urlunsplit(parts._replace(query=query))
    await migrate(prepared)
    try:
        yield prepared
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(_drop_schema, urllib.parse.urlunsplit(parts), schema)


def _drop_schema(dsn: str, schema: str) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


class Progress:
    """A one-line progress bar on stderr, shown only when stderr is a terminal."""

    def __init__(self, label: str, total: int, *, enabled: bool) -> None:
        self.label = label
        self.total = max(total, 1)
        self.done = 0
        self.enabled = enabled and sys.stderr.isatty()
        self._last = 0.0

    def advance(self, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.monotonic()
        if self.done < self.total and now - self._last < 0.1:
            return
        self._last = now
        width = 30
        filled = width * min(self.done, self.total) // self.total
        bar = "#" * filled + "-" * (width - filled)
        sys.stderr.write(f"\r{self.label} [{bar}] {self.done}/{self.total}")
        if self.done >= self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.done < self.total:
            sys.stderr.write("\n")
            sys.stderr.flush()
