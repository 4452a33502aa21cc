"""Instrumentation: bounded, payload-free events about jobs, leases and store transitions.

A sink never receives work input, results, errors, access values or input responses: only ids,
tool names, counts, durations and outcome names. Sink failures are logged and swallowed, so
observability can never break execution. Durations are measured on trio's clock, in seconds
(deterministic under ``MockClock``). The catalogue (names, fields, units) is in
``docs/operations.md``.

A sink that also offers :class:`TracesTasks` wraps a task's creation and each of its attempts
in a scope of its own (the OpenTelemetry bridge, :mod:`tritask.otel`, opens spans there), so
what runs inside (the tool, its store transitions) is inside that scope.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Final, Protocol, TypeGuard, TypeVar, runtime_checkable

import attrs

from tritask.tasks.work import TraceContext

T = TypeVar("T")

log = logging.getLogger("tritask.instrumentation")

TASK_CREATED: Final = "tasks.task.created"
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
        TASK_CREATED,
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


@runtime_checkable
class TracesTasks(Protocol):
    """A sink that wraps a task's creation and each attempt in a scope (a trace span).

    ``creating(...)`` is entered around the creation of a task, before the store sees it; it
    yields the trace context to persist with the work (its own span's, so attempts become its
    children), or the one it was given. ``attempt(...)`` is entered around one whole attempt,
    in the attempt's own trio task: the executor, its store transitions and the release run
    inside it. ``claim_duration`` is how long the claim that started a retry or a recovery
    took (``None`` for the request's own attempt, whose claim is part of the creation).

    Detected on the sink's class (:func:`traces_tasks`). A scope that fails to open or close
    is logged and skipped; it never changes what the runner does, nor an exception it raises.
    """

    def creating(
        self, *, task_id: str, tool: str | None, work_type: str, trace_context: TraceContext | None
    ) -> AbstractContextManager[TraceContext | None]: ...

    def attempt(
        self,
        *,
        task_id: str,
        generation: int,
        source: str,
        tool: str | None,
        work_type: str,
        trace_context: TraceContext | None,
        claim_duration: float | None,
    ) -> AbstractContextManager[None]: ...


def traces_tasks(sink: object) -> TypeGuard[TracesTasks]:
    kind = type(sink)
    return callable(getattr(kind, "creating", None)) and callable(getattr(kind, "attempt", None))


@contextlib.contextmanager
def _guarded(what: str, open_scope: Any, fallback: T) -> Iterator[T]:
    """A sink's scope whose own failures are logged and swallowed: the body's outcome (its
    value, its exception, its cancellation) is never changed by the sink."""
    try:
        scope = open_scope()
        value = scope.__enter__()
    except Exception:
        log.exception("instrumentation sink failed to open its %s scope", what)
        yield fallback
        return
    try:
        yield value
    except BaseException as error:
        try:
            scope.__exit__(type(error), error, error.__traceback__)
        except BaseException as raised:
            if raised is not error:
                log.exception("instrumentation sink failed to close its %s scope", what)
        raise
    try:
        scope.__exit__(None, None, None)
    except Exception:
        log.exception("instrumentation sink failed to close its %s scope", what)


def creating_scope(
    sink: InstrumentationSink | None,
    *,
    task_id: str,
    tool: str | None,
    work_type: str,
    trace_context: TraceContext | None,
) -> AbstractContextManager[TraceContext | None]:
    """The sink's creation scope, or one that yields ``trace_context`` unchanged."""
    if sink is None or not traces_tasks(sink):
        return contextlib.nullcontext(trace_context)
    tracing = sink
    return _guarded(
        "creation",
        lambda: tracing.creating(
            task_id=task_id, tool=tool, work_type=work_type, trace_context=trace_context
        ),
        trace_context,
    )


def attempt_scope(sink: InstrumentationSink | None, **attempt: Any) -> AbstractContextManager[None]:
    """The sink's attempt scope (see :meth:`TracesTasks.attempt`), or none."""
    if sink is None or not traces_tasks(sink):
        return contextlib.nullcontext()
    tracing = sink
    return _guarded("attempt", lambda: tracing.attempt(**attempt), None)


@attrs.define
class LoggingInstrumentation:
    """Bridge to :mod:`logging`: one line per event, with structured fields.

    The message reads ``name key=value ...``; the record also carries the fields as
    ``record.tritask`` (a dict: ``event`` plus every measurement and metadata field), for
    formatters that write JSON. Records logged inside an attempt (the tool's own) are inside
    its trace span when the OpenTelemetry bridge runs, so a logging integration that stamps
    trace ids puts them on those records.
    """

    logger: logging.Logger = attrs.field(factory=lambda: logging.getLogger("tritask.events"))
    level: int = logging.DEBUG

    def handle_event(
        self, name: str, measurements: Mapping[str, float | int], metadata: Mapping[str, Any]
    ) -> None:
        if self.logger.isEnabledFor(self.level):
            merged = {**measurements, **metadata}
            fields = " ".join(f"{k}={v}" for k, v in merged.items())
            self.logger.log(
                self.level, "%s %s", name, fields, extra={"tritask": {"event": name, **merged}}
            )


@attrs.define
class FanOut:
    """Several sinks as one: every event to each (a failing one does not stop the others),
    and the scopes of those that trace, nested in order."""

    sinks: Sequence[InstrumentationSink]

    def handle_event(
        self, name: str, measurements: Mapping[str, float | int], metadata: Mapping[str, Any]
    ) -> None:
        for sink in self.sinks:
            emit(sink, name, measurements, metadata)

    @contextlib.contextmanager
    def creating(self, **creation: Any) -> Iterator[TraceContext | None]:
        trace: TraceContext | None = creation.pop("trace_context")
        with contextlib.ExitStack() as stack:
            for sink in self.sinks:
                trace = stack.enter_context(creating_scope(sink, trace_context=trace, **creation))
            yield trace

    @contextlib.contextmanager
    def attempt(self, **attempt: Any) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for sink in self.sinks:
                stack.enter_context(attempt_scope(sink, **attempt))
            yield


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
