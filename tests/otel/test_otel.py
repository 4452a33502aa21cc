"""The OpenTelemetry bridge against the SDK's in-memory exporters: one trace from the client's
``_meta`` trace context through the tool call, the creation, the attempt and its settle; a
recovered attempt (another runner, after a restart, on SQLite and PostgreSQL) in the same trace
with a link to the creation; the metrics; and nothing of it breaking execution.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    HistogramDataPoint,
    InMemoryMetricReader,
    NumberDataPoint,
)
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from postgres_support import SchemaFactory, pg_schemas, postgres_dsn
from tritask_postgres import PostgresStore
from tritask_sqlite import SqliteStore

from tritask.jsonrpc import JSONValue, Request
from tritask.otel import EXTENSION_ID, OpenTelemetry
from tritask.protocol.meta import CLIENT_CAPABILITIES_KEY, PROTOCOL_VERSION_KEY
from tritask.server.app import App
from tritask.server.context import Context
from tritask.server.dispatcher import Dispatcher
from tritask.server.results import RetryLater, ToolError
from tritask.tasks import TrioClock, parse_instant
from tritask.tasks.extension import EXTENSION_ID as TASKS_ID
from tritask.tasks.extension import Tasks
from tritask.tasks.instrumentation import LoggingInstrumentation
from tritask.tasks.memory import MemoryStore
from tritask.tasks.runner import Runner
from tritask.tasks.store import LEASE_LOST, OwnerRenewal, StaleLease, Store, TaskInspection
from tritask.tasks.work import RetryPolicy, TraceContext, Work
from tritask.testing.client import Client

__all__ = ["pg_schemas", "postgres_dsn"]  # the fixtures this module uses

START = parse_instant("2026-08-24T10:00:00.000Z")
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


@attrs.define
class Telemetry:
    spans: InMemorySpanExporter
    metrics: InMemoryMetricReader
    tracer_provider: TracerProvider
    meter_provider: MeterProvider

    def sink(self) -> OpenTelemetry:
        return OpenTelemetry(
            tracer_provider=self.tracer_provider, meter_provider=self.meter_provider
        )

    def finished(self, name: str | None = None) -> list[ReadableSpan]:
        spans = list(self.spans.get_finished_spans())
        return [s for s in spans if name is None or s.name == name]

    def one(self, name: str) -> ReadableSpan:
        (span,) = self.finished(name)
        return span

    def points(self, metric: str) -> list[tuple[dict[str, Any], Any]]:
        """``(attributes, value)`` of every point of ``metric`` (a sum's value, a histogram's
        count)."""
        data = self.metrics.get_metrics_data()
        found: list[tuple[dict[str, Any], Any]] = []
        for resource in data.resource_metrics if data else ():
            for scope in resource.scope_metrics:
                for item in scope.metrics:
                    if item.name != metric:
                        continue
                    for point in item.data.data_points:
                        value: float | None = None
                        if isinstance(point, HistogramDataPoint):
                            value = point.count
                        elif isinstance(point, NumberDataPoint):
                            value = point.value
                        found.append((dict(point.attributes or {}), value))
        return found


@pytest.fixture
def telemetry() -> Iterator[Telemetry]:
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    yield Telemetry(spans, reader, tracer_provider, meter_provider)
    tracer_provider.shutdown()
    meter_provider.shutdown()


def call(name: str, arguments: dict[str, JSONValue], **meta: JSONValue) -> Request:
    return Request(
        id=1,
        method="tools/call",
        params={
            "name": name,
            "arguments": arguments,
            "_meta": {
                PROTOCOL_VERSION_KEY: "2026-07-28",
                CLIENT_CAPABILITIES_KEY: {"extensions": {TASKS_ID: {}}},
                **meta,
            },
        },
    )


async def result_of(app: App, request: Request) -> dict[str, Any]:
    response = await Dispatcher(app).handle_request(request)
    assert "result" in response, response
    result: dict[str, Any] = response["result"]
    return result


async def work_of(store: MemoryStore, task_id: str) -> Work:
    inspection = await store.inspect_task(task_id)
    assert isinstance(inspection, TaskInspection)
    work = inspection.task.snapshot.work
    assert work is not None
    return work


def hex_id(value: int, width: int) -> str:
    return format(value, f"0{width}x")


def ids(span: ReadableSpan) -> tuple[str, str, str | None]:
    """(trace id, span id, parent span id) in hex."""
    context = span.get_span_context()
    assert context is not None
    parent = None if span.parent is None else hex_id(span.parent.span_id, 16)
    return hex_id(context.trace_id, 32), hex_id(context.span_id, 16), parent


def build_app(
    sink: OpenTelemetry,
    store: Store,
    runner: Runner,
    tracer_provider: TracerProvider,
    *,
    blocking: bool = False,
    started: trio.Event | None = None,
) -> App:
    """``work`` (in a span of its own; with ``blocking``, until cancelled), ``flaky`` (asks for
    one retry), ``sync`` (no task)."""
    tracer = tracer_provider.get_tracer("the-tool")
    flaky_seen: list[str | None] = []
    app = App(
        "otel-test",
        "0.0.1",
        extensions=[
            sink,
            Tasks(
                store=store,
                runner=runner,
                task_support={"work": "required", "flaky": "required"},
                retry_policies={"flaky": RetryPolicy([1000])},
            ),
        ],
    )

    @app.tool
    async def work(seconds: float = 1.0) -> str:
        """Works for a while inside a span of its own."""
        with tracer.start_as_current_span("tool.inner"):
            if started is not None:
                started.set()
            await trio.sleep(10**9 if blocking else seconds)
        return "worked"

    @app.tool
    async def flaky(ctx: Context) -> str:
        """Asks for a retry once."""
        if not flaky_seen:
            flaky_seen.append(ctx.task_id)
            raise RetryLater("not yet")
        return "second time lucky"

    @app.tool
    async def sync(text: str) -> str:
        """A plain tool call (no task)."""
        return text

    return app


async def test_one_trace_from_the_clients_context_through_create_attempt_and_settle(
    autojump_clock: trio.testing.MockClock, telemetry: Telemetry
) -> None:
    sink = telemetry.sink()
    store = MemoryStore(scope="shared", clock=TrioClock(START))
    runner = Runner(store, instrumentation=sink, reap_interval_ms=None, owner_id="runner-1")
    app = build_app(sink, store, runner, telemetry.tracer_provider)
    async with runner:
        created = await result_of(
            app, call("work", {"seconds": 2}, traceparent=TRACEPARENT, tracestate="vendor=v1")
        )
        task_id = created["taskId"]
        await trio.sleep(3)

    tool_call = telemetry.one("tools/call work")
    create = telemetry.one("tasks.create")
    attempt = telemetry.one("tasks.attempt")
    inner = telemetry.one("tool.inner")
    settle = telemetry.one("tasks.settle")
    # One trace, continued from the client's span, each span the child of the one before.
    assert ids(tool_call) == (CLIENT_TRACE, ids(tool_call)[1], CLIENT_SPAN)
    assert ids(create)[::2] == (CLIENT_TRACE, ids(tool_call)[1])
    assert ids(attempt)[::2] == (CLIENT_TRACE, ids(create)[1])
    assert ids(inner)[::2] == (CLIENT_TRACE, ids(attempt)[1])
    assert ids(settle)[::2] == (CLIENT_TRACE, ids(attempt)[1])
    assert {ids(span)[0] for span in telemetry.finished()} == {CLIENT_TRACE}
    assert telemetry.finished("tasks.store.transition") == []  # the attempt only settled

    assert tool_call.kind is SpanKind.SERVER
    assert dict(tool_call.attributes or {}) == {
        "mcp.method.name": "tools/call",
        "mcp.protocol.version": "2026-07-28",
        "gen_ai.tool.name": "work",
        "gen_ai.operation.name": "execute_tool",
        "jsonrpc.request.id": "1",
        "tritask.tool.name": "work",
        "tritask.task.id": task_id,
        "tritask.result.type": "task",
    }
    assert dict(create.attributes or {}) == {
        "tritask.task.id": task_id,
        "tritask.tool.name": "work",
        "tritask.work.type": "tools/call",
        "tritask.lease.generation": 1,
    }
    assert attempt.kind is SpanKind.CONSUMER
    assert dict(attempt.attributes or {}) == {
        "tritask.task.id": task_id,
        "tritask.tool.name": "work",
        "tritask.work.type": "tools/call",
        "tritask.attempt.source": "request",
        "tritask.attempt.recovered": False,
        "tritask.lease.generation": 1,
        "tritask.attempt.outcome": "completed",
        "tritask.store.outcome": "applied",
        "tritask.release.outcome": "ok",
    }
    assert attempt.links == ()
    assert dict(settle.attributes or {}) == {
        "tritask.event.kind": "completed",
        "tritask.authority": "worker",
        "tritask.transition.outcome": "applied",
        "tritask.transition.settle": True,
        "tritask.task.id": task_id,
        "tritask.expected_revision": 0,
    }
    # The work carries the creation's context, and the client's tracestate with it.
    work = await work_of(store, task_id)
    assert work.trace_context == TraceContext(f"00-{CLIENT_TRACE}-{ids(create)[1]}-01", "vendor=v1")
    assert work.to_json()["version"] == 5  # with the client's declaration (Work.origin)
    assert work.to_json()["traceContext"] == work.trace_context.to_json()

    assert telemetry.points("tritask.task.created") == [
        ({"tritask.tool.name": "work", "tritask.outcome": "created"}, 1)
    ]
    assert telemetry.points("tritask.task.attempts") == [
        (
            {
                "tritask.tool.name": "work",
                "tritask.attempt.source": "request",
                "tritask.attempt.outcome": "completed",
            },
            1,
        )
    ]
    assert telemetry.points("tritask.task.claim.duration") == [
        ({"tritask.attempt.source": "request"}, 1)
    ]
    assert telemetry.points("tritask.runner.jobs") == [({"tritask.tool.name": "work"}, 0)]
    assert telemetry.points("tritask.tool.call.duration") == [
        ({"tritask.tool.name": "work", "tritask.result.type": "task"}, 1)
    ]
    assert telemetry.points("tritask.store.transition.duration") == [
        (
            {
                "tritask.event.kind": "completed",
                "tritask.authority": "worker",
                "tritask.transition.outcome": "applied",
                "tritask.transition.settle": True,
            },
            1,
        )
    ]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def durable(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], Store]:
    """A factory of store objects on one durable store: each is what a (re)started process
    opens."""
    if request.param == "sqlite":
        path = tmp_path / "tasks.db"
        return lambda: SqliteStore(path, scope="shared", exclusive=True)
    schemas: SchemaFactory = request.getfixturevalue("pg_schemas")
    schema = await schemas.migrated()
    return lambda: PostgresStore(schemas.dsn, schema=schema, scope="shared", pool_size=2)


async def test_a_recovered_attempt_continues_the_trace_linked_to_the_creation(
    durable: Callable[[], Store], telemetry: Telemetry
) -> None:
    started = trio.Event()
    async with durable() as store:
        runner = Runner(store, instrumentation=telemetry.sink(), reap_interval_ms=None)
        app = build_app(
            telemetry.sink(), store, runner, telemetry.tracer_provider, blocking=True,
            started=started,
        )  # fmt: skip
        async with runner:
            created = await result_of(app, call("work", {"seconds": 0.1}, traceparent=TRACEPARENT))
            task_id = created["taskId"]
            with trio.fail_after(30):
                await started.wait()
        # The process stops mid-attempt (its runner lets the claim go); another one starts.
    first = telemetry.one("tasks.attempt")
    create = telemetry.one("tasks.create")
    assert dict(first.attributes or {})["tritask.attempt.outcome"] == "runner_stopped"

    async with durable() as store:
        sink = telemetry.sink()
        runner = Runner(store, instrumentation=sink, recover=True, reap_interval_ms=None)
        app = build_app(sink, store, runner, telemetry.tracer_provider)
        async with runner:
            with trio.fail_after(30):
                done = await Client.direct(app).wait_task(task_id)
            assert done["status"] == "completed"

    attempts = telemetry.finished("tasks.attempt")
    assert attempts[0] is first or ids(attempts[0]) == ids(first)
    recovered = attempts[1]
    # In the client's trace, a child of the creation (another process's span, found through
    # the persisted work), with a link to it marked as a recovery.
    assert ids(recovered)[::2] == (CLIENT_TRACE, ids(create)[1])
    [link] = recovered.links
    assert (hex_id(link.context.trace_id, 32), hex_id(link.context.span_id, 16)) == (
        CLIENT_TRACE,
        ids(create)[1],
    )
    assert dict(link.attributes or {}) == {"tritask.link.reason": "recovery"}
    attributes = dict(recovered.attributes or {})
    assert (
        attributes["tritask.attempt.source"],
        attributes["tritask.attempt.recovered"],
        attributes["tritask.lease.generation"],
        attributes["tritask.attempt.outcome"],
    ) == ("recovery", True, 2, "completed")
    # The recovery's claim and the settle are inside the recovered attempt.
    claim = telemetry.one("tasks.claim")
    assert ids(claim)[::2] == (CLIENT_TRACE, ids(recovered)[1])
    assert claim.start_time == recovered.start_time
    settle = telemetry.one("tasks.settle")
    assert ids(settle)[::2] == (CLIENT_TRACE, ids(recovered)[1])
    inner = telemetry.finished("tool.inner")
    assert [ids(span)[2] for span in inner] == [ids(first)[1], ids(recovered)[1]]

    assert telemetry.points("tritask.task.recoveries") == [
        ({"tritask.recovery.kind": "adopted"}, 1)
    ]
    assert sorted(
        (labels["tritask.attempt.source"], labels["tritask.attempt.outcome"], count)
        for labels, count in telemetry.points("tritask.task.attempts")
    ) == [("recovery", "completed", 1), ("request", "runner_stopped", 1)]


async def test_without_a_client_context_the_trace_starts_at_the_tool_call(
    autojump_clock: trio.testing.MockClock, telemetry: Telemetry
) -> None:
    sink = telemetry.sink()
    store = MemoryStore(scope="shared", clock=TrioClock(START))
    runner = Runner(store, instrumentation=sink, reap_interval_ms=None)
    app = build_app(sink, store, runner, telemetry.tracer_provider)
    async with runner:
        # An invalid traceparent is ignored, as W3C asks, and never fails the request.
        invalid = f"00-{'0' * 32}-{CLIENT_SPAN}-01"
        created = await result_of(app, call("work", {"seconds": 1}, traceparent=invalid))
        await trio.sleep(2)
        echoed = await result_of(app, call("sync", {"text": "hi"}, traceparent=TRACEPARENT))
    assert echoed["content"] == [{"type": "text", "text": "hi"}]
    roots = [span for span in telemetry.finished() if span.parent is None]
    assert [span.name for span in roots] == ["tools/call work"]
    trace_id = ids(roots[0])[0]
    assert trace_id != CLIENT_TRACE
    assert ids(telemetry.one("tasks.create"))[::2] == (trace_id, ids(roots[0])[1])
    work = await work_of(store, created["taskId"])
    assert work.trace_context is not None
    assert work.trace_context.trace_id == trace_id
    sync = telemetry.one("tools/call sync")
    assert ids(sync)[::2] == (CLIENT_TRACE, CLIENT_SPAN)
    assert dict(sync.attributes or {})["tritask.result.type"] == "complete"
    assert sync.status.status_code is StatusCode.UNSET


async def test_a_retry_is_a_second_attempt_with_its_claim_in_the_same_trace(
    autojump_clock: trio.testing.MockClock, telemetry: Telemetry
) -> None:
    sink = telemetry.sink()
    store = MemoryStore(scope="shared", clock=TrioClock(START))
    runner = Runner(store, instrumentation=sink, reap_interval_ms=None)
    app = build_app(sink, store, runner, telemetry.tracer_provider)
    async with runner:
        await result_of(app, call("flaky", {}, traceparent=TRACEPARENT))
        await trio.sleep(5)
    create = telemetry.one("tasks.create")
    first, second = telemetry.finished("tasks.attempt")
    for attempt in (first, second):
        assert ids(attempt)[::2] == (CLIENT_TRACE, ids(create)[1])
    assert [dict(a.attributes or {})["tritask.attempt.outcome"] for a in (first, second)] == [
        "retry",
        "completed",
    ]
    assert dict(second.attributes or {})["tritask.attempt.source"] == "retry"
    assert second.links == ()
    [event] = first.events
    assert event.name == "tasks.retry.scheduled"
    assert dict(event.attributes or {})["delay_ms"] == 1000
    assert ids(telemetry.one("tasks.claim"))[2] == ids(second)[1]
    settles = telemetry.finished("tasks.settle")
    assert [ids(s)[2] for s in settles] == [ids(first)[1], ids(second)[1]]
    assert [dict(s.attributes or {})["tritask.event.kind"] for s in settles] == [
        "retry_requested",
        "completed",
    ]
    assert telemetry.points("tritask.task.retries") == [({}, 1)]
    assert sorted(
        labels["tritask.attempt.source"]
        for labels, _ in telemetry.points("tritask.task.claim.duration")
    ) == ["request", "retry"]


async def test_the_bridge_is_not_advertised_and_must_enclose_the_other_extensions(
    telemetry: Telemetry,
) -> None:
    sink = telemetry.sink()
    app = App("otel-test", "0.0.1", extensions=[sink, Tasks(store=MemoryStore(scope="shared"))])
    assert EXTENSION_ID in app.extensions
    assert list(app.capabilities()["extensions"]) == [TASKS_ID]
    alone = App("otel-test", "0.0.1", extensions=[telemetry.sink()])
    assert "extensions" not in alone.capabilities()
    assert not alone.has_capability("extensions")
    with pytest.raises(ValueError, match="register OpenTelemetry before the other extensions"):
        App("otel-test", "0.0.1", extensions=[Tasks(store=MemoryStore(scope="shared")), sink])


class BrokenTracing:
    """A tracing sink whose every scope fails, on opening or on closing."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.events = 0

    def handle_event(self, name: str, measurements: Any, metadata: Any) -> None:
        self.events += 1

    @contextlib.contextmanager
    def _scope(self, value: Any) -> Iterator[Any]:
        if self.where == "open":
            raise RuntimeError("cannot open")
        yield value
        raise RuntimeError("cannot close")

    def creating(self, **creation: Any) -> contextlib.AbstractContextManager[Any]:
        return self._scope(creation["trace_context"])

    def attempt(self, **attempt: Any) -> contextlib.AbstractContextManager[Any]:
        return self._scope(None)


@pytest.mark.parametrize("where", ["open", "close"])
async def test_a_failing_tracing_sink_never_changes_execution(
    autojump_clock: trio.testing.MockClock, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    sink = BrokenTracing(where)
    store = MemoryStore(scope="shared", clock=TrioClock(START))
    runner = Runner(store, instrumentation=sink, reap_interval_ms=None)
    app = App(
        "t", "1", extensions=[Tasks(store=store, runner=runner, task_support={"ok": "required"})]
    )

    @app.tool
    async def ok() -> str:
        """Returns."""
        return "fine"

    async with runner:
        created = await result_of(app, call("ok", {}, traceparent=TRACEPARENT))
        done = await Client.direct(app).wait_task(created["taskId"])
    assert done["status"] == "completed"
    assert sink.events >= 4
    assert f"instrumentation sink failed to {where} its creation scope" in caplog.text
    assert f"instrumentation sink failed to {where} its attempt scope" in caplog.text
    # The client's context is persisted even though the sink's scope failed.
    work = await work_of(store, created["taskId"])
    assert work.trace_context == TraceContext(TRACEPARENT)


async def test_the_logging_bridge_has_structured_fields(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    store = MemoryStore(scope="shared", clock=TrioClock(START))
    runner = Runner(
        store, instrumentation=LoggingInstrumentation(level=logging.INFO), reap_interval_ms=None
    )
    app = App(
        "t", "1", extensions=[Tasks(store=store, runner=runner, task_support={"ok": "required"})]
    )

    @app.tool
    async def ok() -> str:
        """Returns."""
        return "fine"

    with caplog.at_level(logging.INFO, logger="tritask.events"):
        async with runner:
            created = await result_of(app, call("ok", {}))
            await Client.direct(app).wait_task(created["taskId"])
    records = [r for r in caplog.records if r.name == "tritask.events"]
    by_event = {r.tritask["event"]: r for r in records}  # type: ignore[attr-defined]
    stop = by_event["tasks.runner.job.stop"]
    assert stop.tritask == {  # type: ignore[attr-defined]
        "event": "tasks.runner.job.stop",
        "duration": 0.0,
        "jobs": 0,
        "task_id": created["taskId"],
        "outcome": "completed",
        "store_outcome": "applied",
        "release_outcome": "ok",
        "source": "request",
        "tool": "ok",
    }
    assert stop.getMessage() == (
        f"tasks.runner.job.stop duration=0.0 jobs=0 task_id={created['taskId']} "
        "outcome=completed store_outcome=applied release_outcome=ok source=request tool=ok"
    )
    assert set(by_event) >= {"tasks.task.created", "tasks.lease.claimed", "tasks.store.transition"}


BLOCK_OPENTELEMETRY = """
import sys

class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ImportError(f"No module named {name!r} (blocked)")
        return None

sys.meta_path.insert(0, Blocked())
"""

WITHOUT_THE_EXTRA = (
    BLOCK_OPENTELEMETRY
    + """
import trio
import tritask, tritask.cli, tritask.ops.parser
from tritask import App, MemoryStore, Runner, Tasks
from tritask.testing.client import Client

async def main():
    store = MemoryStore(scope="shared")
    runner = Runner(store)
    tasks = Tasks(store=store, runner=runner, task_support={"ok": "required"})
    app = App("t", "1", extensions=[tasks])

    @app.tool
    async def ok() -> str:
        "Returns."
        return "fine"

    async with runner:
        client = Client.direct(app)
        created = await client.call_tool("ok", {})
        done = await client.wait_task(created["taskId"])
    print(done["status"])

trio.run(main)
try:
    import tritask.otel
except ImportError as error:
    print(error)
print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
"""
)


def test_tritask_works_without_opentelemetry() -> None:
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_THE_EXTRA], capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "completed",
        "tritask.otel needs the OpenTelemetry API: pip install 'tritask[otel]'",
        "[]",
    ]


def test_importing_tritask_does_not_import_opentelemetry() -> None:
    code = (
        "import sys, tritask, tritask.cli; print([m for m in sys.modules if 'opentelemetry' in m])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]"


class FencedStore(MemoryStore):
    """A store on which every worker commit is refused as stale, and every renewal too."""

    async def settle(self, *args: Any, **kwargs: Any) -> Any:
        raise StaleLease("fenced")

    async def renew(self, *args: Any, **kwargs: Any) -> Any:
        raise StaleLease("lost")

    async def renew_all(self, owner_id: str, leases: Any, lease_ms: int) -> Any:
        await trio.lowlevel.checkpoint()
        return [LEASE_LOST] * len(leases)

    async def renew_owner(
        self, owner_id: str, leases: Any, revisions: Any, following: Any, lease_ms: int
    ) -> Any:
        await trio.lowlevel.checkpoint()
        return OwnerRenewal(None, tuple(range(len(leases))), ())


async def test_losses_fencing_expirations_and_tool_errors_are_counted(
    autojump_clock: trio.testing.MockClock, telemetry: Telemetry
) -> None:
    sink = telemetry.sink()
    store = FencedStore(scope="shared", clock=TrioClock(START))
    runner = Runner(store, instrumentation=sink, reap_interval_ms=None, lease_ms=3000)
    app = build_app(sink, store, runner, telemetry.tracer_provider)

    @app.tool
    async def broken() -> str:
        """Fails as a tool."""
        raise ToolError("no can do")

    async with runner:
        quick = await result_of(app, call("work", {"seconds": 0.5}, traceparent=TRACEPARENT))
        slow = await result_of(app, call("work", {"seconds": 30}))
        failed = await result_of(app, call("broken", {}))
        await trio.sleep(5)  # the slow attempt's first heartbeat (1 s) finds its lease gone
        await trio.sleep(3600)
        assert sorted(await runner.reap_once()) == sorted([quick["taskId"], slow["taskId"]])
    assert failed["isError"] is True
    broken_span = telemetry.one("tools/call broken")
    assert broken_span.status.status_code is StatusCode.ERROR
    assert dict(broken_span.attributes or {})["error.type"] == "tool_error"
    # A stale lease ends the attempt's commit at once: one refusal, not a retried one.
    assert telemetry.points("tritask.store.fenced_writes") == [
        ({"tritask.event.kind": "completed"}, 1)
    ]
    assert telemetry.points("tritask.lease.lost") == [({}, 1)]
    assert telemetry.points("tritask.task.expirations") == [({}, 2)]
    stopped = {
        labels["tritask.attempt.outcome"]: count
        for labels, count in telemetry.points("tritask.task.attempts")
    }
    assert stopped == {"completed": 1, "stale_lease": 1}
    fenced = next(
        span
        for span in telemetry.finished("tasks.attempt")
        if dict(span.attributes or {})["tritask.attempt.outcome"] == "completed"
    )
    assert [event.name for event in fenced.events] == ["tasks.fenced_write.rejected"]
