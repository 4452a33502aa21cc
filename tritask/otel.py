"""OpenTelemetry for tritask: traces and metrics of tool calls, tasks, attempts and the store.

``pip install 'tritask[otel]'`` (the OpenTelemetry API; configure an SDK and exporters as usual).
One object is both the app extension (the ``tools/call`` span) and the runner's
instrumentation sink (task, attempt and store spans, and the metrics)::

    otel = OpenTelemetry()  # the global tracer and meter providers, or pass your own
    app = App("name", "1.0", extensions=[otel, Tasks(runner_options={"instrumentation": otel})])

Register it first: extensions wrap tool calls in registration order, and its ``tools/call``
span must enclose the task's creation. The trace of a task:

* ``tools/call NAME`` (server kind): a child of the W3C trace context in the request's
  ``_meta`` (``traceparent``/``tracestate``), else of the current context;
* ``tasks.create``: its child, around the store's creation (and first claim); its context is
  what the runner persists with the work (``Work`` v3), so every attempt of the task is its
  child, also on another host and after a restart;
* ``tasks.attempt`` (consumer kind): one per attempt, the executor's own spans and log records
  inside it; a retry's or recovery's attempt starts with its ``tasks.claim``; a recovered
  attempt also carries a span link to the creation marked ``tritask.link.reason=recovery``;
* ``tasks.settle`` and ``tasks.store.transition``: the attempt's final event (with the release
  of its claim) and its other transitions, as children of the span that made them.

This module imports the OpenTelemetry API; nothing else in tritask imports this module, so
tritask without the extra never needs it. The catalogue of spans, attributes and metrics is in
``docs/operations.md``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Final

try:
    from opentelemetry import context as otel_context
    from opentelemetry import metrics, trace
    from opentelemetry.trace import Link, SpanKind, Status, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError as error:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(
        "tritask.otel needs the OpenTelemetry API: pip install 'tritask[otel]'"
    ) from error

from tritask.jsonrpc import JsonRpcError, JSONValue
from tritask.server.extension import CallNext, Extension, ToolCall
from tritask.tasks import instrumentation as ins
from tritask.tasks.work import TraceContext

if TYPE_CHECKING:
    from tritask.server.app import App
    from tritask.server.context import Context

__all__ = ["EXTENSION_ID", "ConfiguredTelemetry", "OpenTelemetry", "configure_from_environment"]

EXTENSION_ID: Final = "dev.tritask/opentelemetry"
INSTRUMENTATION_NAME: Final = "tritask"
_PROPAGATOR: Final = TraceContextTextMapPropagator()
_FAILED_OUTCOMES: Final = frozenset({"failed", "max_runtime"})
_FAILED_TRANSITIONS: Final = frozenset({"error", "conflict", "not_found"})


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("tritask")
    except metadata.PackageNotFoundError:  # pragma: no cover - a checkout never installed
        return "0"


def _attributes(values: Mapping[str, object]) -> dict[str, Any]:
    """OpenTelemetry attributes without the ``None`` values it refuses."""
    return {key: value for key, value in values.items() if value is not None}


def _ns_ago(seconds: float) -> int:
    return time.time_ns() - max(0, round(seconds * 1e9))


class OpenTelemetry(Extension):
    """The app extension and instrumentation sink (see the module docstring)."""

    id = EXTENSION_ID
    advertised = False

    def __init__(
        self,
        *,
        tracer_provider: trace.TracerProvider | None = None,
        meter_provider: metrics.MeterProvider | None = None,
    ) -> None:
        version = _version()
        self._tracer = trace.get_tracer(
            INSTRUMENTATION_NAME, version, tracer_provider=tracer_provider
        )
        meter = metrics.get_meter(INSTRUMENTATION_NAME, version, meter_provider=meter_provider)
        self._tool_calls = meter.create_histogram(
            "tritask.tool.call.duration", unit="s", description="tools/call, by tool and result"
        )
        self._created = meter.create_counter(
            "tritask.task.created", unit="{task}", description="task creations, by tool"
        )
        self._attempts = meter.create_counter(
            "tritask.task.attempts",
            unit="{attempt}",
            description="ended attempts, by tool, source and outcome",
        )
        self._attempt_duration = meter.create_histogram(
            "tritask.task.attempt.duration", unit="s", description="attempt durations"
        )
        self._jobs = meter.create_up_down_counter(
            "tritask.runner.jobs", unit="{attempt}", description="attempts running"
        )
        self._claims = meter.create_histogram(
            "tritask.task.claim.duration", unit="s", description="claim latency, by source"
        )
        self._lost = meter.create_counter(
            "tritask.lease.lost", unit="{lease}", description="claims lost at a renewal"
        )
        self._recoveries = meter.create_counter(
            "tritask.task.recoveries", unit="{task}", description="tasks taken over by recovery"
        )
        self._retries = meter.create_counter(
            "tritask.task.retries", unit="{retry}", description="retries scheduled"
        )
        self._expirations = meter.create_counter(
            "tritask.task.expirations", unit="{task}", description="expired tasks reaped"
        )
        self._fenced = meter.create_counter(
            "tritask.store.fenced_writes",
            unit="{write}",
            description="worker writes the store refused for a stale lease",
        )
        self._transitions = meter.create_histogram(
            "tritask.store.transition.duration", unit="s", description="store transitions"
        )
        self._open_attempts: dict[int, str] = {}
        """Span id -> task id of the attempt spans this sink has open."""
        self._handlers: dict[str, Callable[[Mapping[str, float | int], Mapping[str, Any]], None]]
        self._handlers = {
            ins.TASK_CREATED: self._on_created,
            ins.LEASE_CLAIMED: self._on_claimed,
            ins.RECOVERY_RECLAIMED: self._on_reclaimed,
            ins.JOB_START: self._on_start,
            ins.JOB_STOP: self._on_stop,
            ins.STORE_TRANSITION: self._on_transition,
            ins.RETRY_SCHEDULED: self._on_retry,
            ins.LEASE_LOST: self._on_lost,
            ins.FENCED_WRITE_REJECTED: self._on_fenced,
            ins.TASKS_REAPED: self._on_reaped,
        }

    # -- the extension: tools/call ----------------------------------------------------------

    def attached(self, app: App) -> None:
        if next(iter(app.extensions)) != self.id:
            raise ValueError(
                "register OpenTelemetry before the other extensions: extensions wrap tool "
                "calls in registration order, and its tools/call span must enclose them"
            )

    async def around_tool_call(
        self, call: ToolCall, ctx: Context, call_next: CallNext
    ) -> dict[str, JSONValue]:
        trace_context = TraceContext.from_carrier(ctx.meta.raw)
        parent = None if trace_context is None else _PROPAGATOR.extract(trace_context.carrier())
        name = call.tool.name
        started = time.perf_counter()
        result_type = "error"
        try:
            with self._tracer.start_as_current_span(
                f"tools/call {name}",
                context=parent,
                kind=SpanKind.SERVER,
                attributes=_attributes(
                    {
                        "mcp.method.name": "tools/call",
                        "mcp.protocol.version": ctx.protocol_version,
                        "gen_ai.tool.name": name,
                        "gen_ai.operation.name": "execute_tool",
                        "jsonrpc.request.id": None
                        if ctx.request_id is None
                        else str(ctx.request_id),
                        "tritask.tool.name": name,
                    }
                ),
            ) as span:
                try:
                    result = await call_next(call, ctx)
                except JsonRpcError as error:
                    span.set_attribute("rpc.jsonrpc.error_code", error.code)
                    span.set_attribute("error.type", str(error.code))
                    raise
                result_type = str(result.get("resultType", "complete"))
                if result_type == "task" and isinstance(result.get("taskId"), str):
                    span.set_attribute("tritask.task.id", str(result["taskId"]))
                if result.get("isError") is True:
                    result_type = "tool_error"
                    span.set_attribute("error.type", "tool_error")
                    span.set_status(Status(StatusCode.ERROR, "the tool reported an error"))
                span.set_attribute("tritask.result.type", result_type)
                return result
        finally:
            self._tool_calls.record(
                time.perf_counter() - started,
                {"tritask.tool.name": name, "tritask.result.type": result_type},
            )

    # -- the sink: scopes -----------------------------------------------------------------

    @contextlib.contextmanager
    def creating(
        self, *, task_id: str, tool: str | None, work_type: str, trace_context: TraceContext | None
    ) -> Iterator[TraceContext | None]:
        parent = None  # the current context: the tools/call span, when there is one
        if not trace.get_current_span().get_span_context().is_valid and trace_context is not None:
            parent = _PROPAGATOR.extract(trace_context.carrier())
        with self._tracer.start_as_current_span(
            "tasks.create",
            context=parent,
            attributes=_attributes(
                {
                    "tritask.task.id": task_id,
                    "tritask.tool.name": tool,
                    "tritask.work.type": work_type,
                }
            ),
        ) as span:
            carrier: dict[str, str] = {}
            _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
            yield TraceContext.from_carrier(carrier) or trace_context

    @contextlib.contextmanager
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
    ) -> Iterator[None]:
        # Always an explicit parent: the attempt's task inherits whatever context spawned it.
        parent = otel_context.Context()
        links: list[Link] = []
        if trace_context is not None:
            parent = _PROPAGATOR.extract(trace_context.carrier(), context=parent)
            created = trace.get_current_span(parent).get_span_context()
            if source == "recovery" and created.is_valid:
                links.append(Link(created, {"tritask.link.reason": "recovery"}))
        start = None if claim_duration is None else _ns_ago(claim_duration)
        with self._tracer.start_as_current_span(
            "tasks.attempt",
            context=parent,
            kind=SpanKind.CONSUMER,
            attributes=_attributes(
                {
                    "tritask.task.id": task_id,
                    "tritask.tool.name": tool,
                    "tritask.work.type": work_type,
                    "tritask.attempt.source": source,
                    "tritask.attempt.recovered": source == "recovery",
                    "tritask.lease.generation": generation,
                }
            ),
            links=links,
            start_time=start,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            if claim_duration is not None and start is not None:
                claim = self._tracer.start_span(
                    "tasks.claim",
                    attributes=_attributes(
                        {
                            "tritask.task.id": task_id,
                            "tritask.attempt.source": source,
                            "tritask.lease.generation": generation,
                        }
                    ),
                    start_time=start,
                )
                claim.end(end_time=start + round(claim_duration * 1e9))
            key = span.get_span_context().span_id
            self._open_attempts[key] = task_id
            try:
                yield
            finally:
                self._open_attempts.pop(key, None)

    # -- the sink: events -----------------------------------------------------------------

    def handle_event(
        self, name: str, measurements: Mapping[str, float | int], metadata: Mapping[str, Any]
    ) -> None:
        handler = self._handlers.get(name)
        if handler is not None:
            handler(measurements, metadata)

    def _child(
        self, name: str, duration: float, attributes: Mapping[str, Any], *, failed: str = ""
    ) -> None:
        """A span for what just took ``duration``, as a child of the current span; only inside
        a recording span (an attempt, a creation, a tool call), never a root of its own."""
        if not trace.get_current_span().is_recording():
            return
        end = time.time_ns()
        span = self._tracer.start_span(
            name, attributes=attributes, start_time=end - max(0, round(duration * 1e9))
        )
        if failed:
            span.set_status(Status(StatusCode.ERROR, failed))
        span.end(end_time=end)

    @staticmethod
    def _on_current_span(name: str, fields: Mapping[str, Any]) -> None:
        span = trace.get_current_span()
        if span.is_recording():
            span.add_event(name, _attributes(fields))

    def _on_created(self, m: Mapping[str, float | int], md: Mapping[str, Any]) -> None:
        outcome = md.get("outcome")
        self._created.add(
            1, _attributes({"tritask.tool.name": md.get("tool"), "tritask.outcome": outcome})
        )
        span = trace.get_current_span()
        if outcome == "error" and span.is_recording():
            span.set_status(Status(StatusCode.ERROR, "the task was not created"))

    def _on_claimed(self, m: Mapping[str, float | int], md: Mapping[str, Any]) -> None:
        source = md.get("source")
        self._claims.record(
            float(m.get("duration", 0.0)), _attributes({"tritask.attempt.source": source})
        )
        if source == "recovery":
            self._recoveries.add(1, {"tritask.recovery.kind": "adopted"})
        span = trace.get_current_span()
        if source == "request" and span.is_recording():  # the creation's own claim
            span.set_attribute("tritask.lease.generation", int(m.get("generation", 0)))

    def _on_reclaimed(self, m: Mapping[str, float | int], md: Mapping[str, Any]) -> None:
        self._recoveries.add(1, {"tritask.recovery.kind": "reclaimed"})

    def _on_start(self, m: Mapping[str, float | int], md: Mapping[str, Any]) -> None:
        self._jobs.add(1, _attributes({"tritask.tool.name": md.get("tool")}))

    def _on_stop(self, m: Mapping[str, float | int], md: Mapping[str, Any]) -> None:
        outcome = str(md.get("outcome"))
        tool = _attributes({"tritask.tool.name": md.get("tool")})
        labels = {
            **tool,
            **_attributes({"tritask.attempt.source": md.get("source")}),
            "tritask.attempt.outcome": outcome,
        }
        self._jobs.add(-1, tool)
        self._attempts.add(1, labels)
        self._attempt_duration.record(float(m.get("duration", 0.0)), labels)
        span = trace.get_current_span()
        if self._open_attempts.get(span.get_span_context().span_id) != md.get("task_id"):
            return  # not inside this task's attempt span (a runner without the scope)
        span.set_attribute("tritask.attempt.outcome", outcome)
        span.set_attribute("tritask.store.outcome", str(md.get("store_outcome")))
        span.set_attribute("tritask.release.outcome", str(md.get("release_outcome")))
        if outcome in _FAILED_OUTCOMES:
            span.set_status(Status(StatusCode.ERROR, f"the attempt ended {outcome}"))

    def _on_transition(self, m: Mapping[str, float | int], md: Mapping[str, Any]) -> None:
        settle = bool(md.get("settle"))
        outcome = str(md.get("outcome"))
        labels = _attributes(
            {
                "tritask.event.kind": md.get("event_kind"),
                "tritask.authority": md.get("authority"),
                "tritask.transition.outcome": outcome,
                "tritask.transition.settle": settle,
            }
        )
        duration = float(m.get("duration", 0.0))
        self._transitions.record(duration, labels)
        self._child(
            "tasks.settle" if settle else "tasks.store.transition",
            duration,
            {
                **labels,
                **_attributes(
                    {
                        "tritask.task.id": md.get("task_id"),
                        "tritask.expected_revision": md.get("expected_revision"),
                    }
                ),
            },
            failed=f"the transition ended {outcome}" if outcome in _FAILED_TRANSITIONS else "",
        )

    def _on_retry(self, m: Mapping[str, float | int], md: Mapping[str, Any]) -> None:
        self._retries.add(1)
        self._on_current_span(ins.RETRY_SCHEDULED, {**m, **md})

    def _on_lost(self, m: Mapping[str, float | int], md: Mapping[str, Any]) -> None:
        self._lost.add(1)

    def _on_fenced(self, m: Mapping[str, float | int], md: Mapping[str, Any]) -> None:
        self._fenced.add(1, _attributes({"tritask.event.kind": md.get("event_kind")}))
        self._on_current_span(ins.FENCED_WRITE_REJECTED, {**m, **md})

    def _on_reaped(self, m: Mapping[str, float | int], md: Mapping[str, Any]) -> None:
        self._expirations.add(int(m.get("count", 0)))


# -- tritask serve --otel: SDK providers from the standard OTEL_* variables ------------------

_EXPORTER_GROUPS: Final = {
    "traces": ("OTEL_TRACES_EXPORTER", "opentelemetry_traces_exporter"),
    "metrics": ("OTEL_METRICS_EXPORTER", "opentelemetry_metrics_exporter"),
}
_OTLP_PROTOCOLS: Final = {"http/protobuf": "otlp_proto_http", "grpc": "otlp_proto_grpc"}


class TelemetryConfigurationError(Exception):
    """``OTEL_*`` names an exporter or protocol that cannot be used (one-line message)."""


class ConfiguredTelemetry:
    """The bridge on SDK providers built by :func:`configure_from_environment`.

    ``install(app)`` registers the bridge first among the app's extensions and makes it the
    instrumentation of the runners the app's Tasks extensions start; ``shutdown()`` flushes and
    stops the exporters (``tritask serve`` calls it on its way out).
    """

    def __init__(
        self, bridge: OpenTelemetry, shutdowns: list[Callable[[], object]], exporters: list[str]
    ) -> None:
        self.bridge = bridge
        self.exporters = exporters
        """``"traces=otlp_proto_http"``-style names of what was configured (for the log)."""
        self._shutdowns = shutdowns

    def install(self, app: App) -> None:
        from tritask.tasks.extension import Tasks
        from tritask.tasks.instrumentation import FanOut

        app.add_extension(self.bridge, first=True)
        for extension in app.extensions.values():
            if not isinstance(extension, Tasks):
                continue
            if extension.runner is not None:
                # A runner the application built: its instrumentation is the application's.
                continue
            existing = extension.runner_options.get("instrumentation")
            extension.runner_options["instrumentation"] = (
                self.bridge if existing is None else FanOut([existing, self.bridge])
            )

    def shutdown(self) -> None:
        for shutdown in self._shutdowns:
            shutdown()


def _exporter_names(variable: str, environ: Mapping[str, str]) -> list[str]:
    text = environ.get(variable, "otlp").strip() or "otlp"
    names = [name.strip() for name in text.split(",") if name.strip()]
    return [] if names == ["none"] else names


def _exporter(signal: str, name: str, environ: Mapping[str, str]) -> tuple[str, Callable[[], Any]]:
    from importlib import metadata

    variable, group = _EXPORTER_GROUPS[signal]
    resolved = name
    if name == "otlp":
        protocol = (
            environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL")
            or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or "http/protobuf"
        )
        if protocol not in _OTLP_PROTOCOLS:
            raise TelemetryConfigurationError(
                f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not one of "
                f"{', '.join(_OTLP_PROTOCOLS)}"
            )
        resolved = _OTLP_PROTOCOLS[protocol]
    found = {entry.name: entry for entry in metadata.entry_points(group=group)}
    entry = found.get(resolved)
    if entry is None:
        hint = (
            " (the otlp exporter comes with the extra: pip install 'tritask[otel]')"
            if name == "otlp"
            else ""
        )
        raise TelemetryConfigurationError(
            f"{variable}={name!r}: no installed package provides the {resolved!r} {signal} "
            f"exporter{hint}; installed: {', '.join(sorted(found)) or 'none'}, or 'none'"
        )
    return resolved, entry.load()


def configure_from_environment(environ: Mapping[str, str] | None = None) -> ConfiguredTelemetry:
    """SDK tracer and meter providers as the standard ``OTEL_*`` variables say, and the bridge.

    ``OTEL_SDK_DISABLED=true`` gives the bridge on the no-op API providers. Exporters come from
    ``OTEL_TRACES_EXPORTER`` and ``OTEL_METRICS_EXPORTER`` (comma-separated names from the
    ``opentelemetry_*_exporter`` entry points, ``otlp`` by default, ``none`` for none; ``otlp``
    follows ``OTEL_EXPORTER_OTLP_[SIGNAL_]PROTOCOL``, ``http/protobuf`` by default). Everything
    else is read by the SDK itself: ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES``, the
    sampler (``OTEL_TRACES_SAMPLER``), the batch processor (``OTEL_BSP_*``), the export interval
    (``OTEL_METRIC_EXPORT_INTERVAL``) and each exporter's endpoint and headers
    (``OTEL_EXPORTER_OTLP_*``). The providers are not made global: only tritask's telemetry
    goes to them. Needs ``tritask[otel]`` (the SDK); raises ``TelemetryConfigurationError``
    for an exporter that is not installed.
    """
    import os

    environ = os.environ if environ is None else environ
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ConfiguredTelemetry(OpenTelemetry(), [], [])
    try:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as error:
        raise ImportError(
            f"the OpenTelemetry SDK is missing: pip install 'tritask[otel]' ({error})"
        ) from error
    span_exporters = [
        _exporter("traces", n, environ) for n in _exporter_names("OTEL_TRACES_EXPORTER", environ)
    ]
    metric_exporters = [
        _exporter("metrics", n, environ) for n in _exporter_names("OTEL_METRICS_EXPORTER", environ)
    ]
    resource = Resource.create()  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "tritask"}))
    tracer_provider = TracerProvider(resource=resource)
    for _, span_exporter in span_exporters:
        tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter()))
    readers: list[MetricReader] = [
        PeriodicExportingMetricReader(metric_exporter()) for _, metric_exporter in metric_exporters
    ]
    meter_provider = MeterProvider(resource=resource, metric_readers=readers)
    bridge = OpenTelemetry(tracer_provider=tracer_provider, meter_provider=meter_provider)
    names = [f"traces={name}" for name, _ in span_exporters]
    names += [f"metrics={name}" for name, _ in metric_exporters]
    return ConfiguredTelemetry(bridge, [tracer_provider.shutdown, meter_provider.shutdown], names)
