"""Instrumentation: bounded, payload-free events about jobs, leases and store transitions.

A sink never receives work input, results, errors, access values or input responses: only ids,
counts, durations and outcome names. Sink failures are logged and swallowed, so observability
can never break execution. Durations are measured on trio's clock (deterministic under
``MockClock``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Final, Protocol, runtime_checkable

import attrs

log = logging.getLogger("tritask.instrumentation")

JOB_START: Final = "tasks.runner.job.start"
JOB_STOP: Final = "tasks.runner.job.stop"
STORE_TRANSITION: Final = "tasks.store.transition"
LEASE_CLAIMED: Final = "tasks.lease.claimed"
LEASE_RENEWED: Final = "tasks.lease.renewed"
LEASE_LOST: Final = "tasks.lease.lost"
RETRY_SCHEDULED: Final = "tasks.retry.scheduled"
RECOVERY_RECLAIMED: Final = "tasks.recovery.reclaimed"
FENCED_WRITE_REJECTED: Final = "tasks.fenced_write.rejected"
TASKS_REAPED: Final = "tasks.reaped"

EVENT_NAMES: Final = frozenset(
    {
        JOB_START,
        JOB_STOP,
        STORE_TRANSITION,
        LEASE_CLAIMED,
        LEASE_RENEWED,
        LEASE_LOST,
        RETRY_SCHEDULED,
        RECOVERY_RECLAIMED,
        FENCED_WRITE_REJECTED,
        TASKS_REAPED,
    }
)


@runtime_checkable
class InstrumentationSink(Protocol):
    def handle_event(
        self, name: str, measurements: Mapping[str, float | int], metadata: Mapping[str, Any]
    ) -> None: ...


def emit(
    sink: InstrumentationSink | None,
    name: str,
    measurements: Mapping[str, float | int],
    metadata: Mapping[str, Any],
) -> None:
    if sink is None:
        return
    try:
        sink.handle_event(name, measurements, metadata)
    except Exception:
        log.exception("instrumentation sink failed on %s", name)


@attrs.define
class LoggingInstrumentation:
    """Bridge to :mod:`logging`: one structured line per event."""

    logger: logging.Logger = attrs.field(factory=lambda: logging.getLogger("tritask.events"))
    level: int = logging.DEBUG

    def handle_event(
        self, name: str, measurements: Mapping[str, float | int], metadata: Mapping[str, Any]
    ) -> None:
        if self.logger.isEnabledFor(self.level):
            fields = " ".join(f"{k}={v}" for k, v in {**measurements, **metadata}.items())
            self.logger.log(self.level, "%s %s", name, fields)


@attrs.define
class RecordingInstrumentation:
    """Keeps every event in memory (tests and the stress harness use it)."""

    events: list[tuple[str, dict[str, float | int], dict[str, Any]]] = attrs.field(factory=list)

    def handle_event(
        self, name: str, measurements: Mapping[str, float | int], metadata: Mapping[str, Any]
    ) -> None:
        self.events.append((name, dict(measurements), dict(metadata)))

    def named(self, name: str) -> list[tuple[dict[str, float | int], dict[str, Any]]]:
        return [(m, md) for n, m, md in self.events if n == name]
