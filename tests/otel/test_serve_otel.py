"""``tritask serve --otel``: the bridge on SDK providers configured by the standard ``OTEL_*``
variables, exporting OTLP/HTTP to a collector (here a small HTTP server in the test that keeps
what it is sent), and one line when it cannot be configured.

A real ``tritask serve`` process takes a task call carrying a W3C trace context, runs it, and is
stopped with SIGINT; what it exported on the way is decoded with the OTLP protobuf classes.
"""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tritask.protocol.meta import CLIENT_CAPABILITIES_KEY, PROTOCOL_VERSION_KEY
from tritask.testing import ServeProcess
from tritask.testing.client import HttpTransport

APP = f"{Path(__file__).parents[1] / 'ops' / 'ops_app.py'}:app"
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
TASKS_ID = "io.modelcontextprotocol/tasks"
BLOCK_OPENTELEMETRY = """
import sys

class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ImportError(f"No module named {name!r} (blocked)")
        return None

sys.meta_path.insert(0, Blocked())
from tritask.cli import main
sys.exit(main(sys.argv[1:]))
"""


class Collector:
    """An OTLP/HTTP receiver: keeps each POSTed body by path, answers 200 with an empty body."""

    def __init__(self) -> None:
        self.bodies: dict[str, list[bytes]] = {}
        self.lock = threading.Lock()
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", "0"))
                body = self.rfile.read(length)
                with collector.lock:
                    collector.bodies.setdefault(self.path, []).append(body)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def spans(self) -> list[tuple[str, str, dict[str, Any], Any]]:
        """(resource service.name, span name, attributes, span) of every exported span."""
        found = []
        for body in self.bodies.get("/v1/traces", []):
            request = ExportTraceServiceRequest.FromString(body)
            for resource_spans in request.resource_spans:
                service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}[
                    "service.name"
                ]
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        attributes = {a.key: a.value for a in span.attributes}
                        found.append((service, span.name, attributes, span))
        return found

    def metric_names(self) -> set[str]:
        names = set()
        for body in self.bodies.get("/v1/metrics", []):
            request = ExportMetricsServiceRequest.FromString(body)
            for resource_metrics in request.resource_metrics:
                for scope_metrics in resource_metrics.scope_metrics:
                    names |= {metric.name for metric in scope_metrics.metrics}
        return names


@pytest.fixture
def collector() -> Iterator[Collector]:
    running = Collector()
    thread = threading.Thread(target=running.server.serve_forever, daemon=True)
    thread.start()
    yield running
    running.server.shutdown()
    running.server.server_close()
    thread.join(timeout=10)


def otel_environment(**variables: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TRITASK_"))}
    return {**base, **variables}


async def test_serve_otel_exports_the_trace_of_a_task_and_its_metrics(
    collector: Collector,
) -> None:
    env = otel_environment(
        OTEL_EXPORTER_OTLP_ENDPOINT=collector.url,
        OTEL_SERVICE_NAME="ops-under-test",
        OTEL_RESOURCE_ATTRIBUTES="deployment.environment=test",
        OTEL_BSP_SCHEDULE_DELAY="50",
    )
    served = ServeProcess(APP, env=env, args=("--otel", "--log-level", "WARNING"))
    async with served:
        transport = HttpTransport(served.url)
        try:
            meta = {
                PROTOCOL_VERSION_KEY: "2026-07-28",
                CLIENT_CAPABILITIES_KEY: {"extensions": {TASKS_ID: {}}},
                "traceparent": TRACEPARENT,
            }
            created = await transport.send(
                {
                    "jsonrpc": "2.0",
                    "id": 7,
                    "method": "tools/call",
                    "params": {"name": "echo", "arguments": {"text": "hi"}, "_meta": meta},
                }
            )
            result = created["result"]
            assert isinstance(result, dict) and result["resultType"] == "task"
            task_id = result["taskId"]
            status = "working"
            with trio.fail_after(60):
                while status == "working":
                    got = await transport.send(
                        {
                            "jsonrpc": "2.0",
                            "id": 8,
                            "method": "tasks/get",
                            "params": {"taskId": task_id, "_meta": meta},
                        }
                    )
                    detail = got["result"]
                    assert isinstance(detail, dict)
                    status = str(detail["status"])
                    await trio.sleep(0.05)
            assert status == "completed"
        finally:
            await transport.aclose()
        assert await served.astop() == 0, served.stderr
    assert "tritask: OpenTelemetry on (traces=otlp_proto_http, metrics=otlp_proto_http)" in (
        served.stderr
    )

    spans = collector.spans()
    by_name = {name: (service, attributes, span) for service, name, attributes, span in spans}
    assert {"tools/call echo", "tasks.create", "tasks.attempt", "tasks.settle"} <= set(by_name)
    # One trace, continued from the client's span; the service named by OTEL_SERVICE_NAME.
    assert {span.trace_id.hex() for _, _, _, span in spans} == {CLIENT_TRACE}
    assert {service for service, _, _, _ in spans} == {"ops-under-test"}
    tool_call = by_name["tools/call echo"][2]
    assert tool_call.parent_span_id.hex() == CLIENT_SPAN
    create = by_name["tasks.create"][2]
    attempt = by_name["tasks.attempt"][2]
    assert create.parent_span_id == tool_call.span_id
    assert attempt.parent_span_id == create.span_id
    assert by_name["tasks.settle"][2].parent_span_id == attempt.span_id
    assert by_name["tasks.attempt"][1]["tritask.task.id"].string_value == task_id
    assert by_name["tasks.attempt"][1]["tritask.attempt.outcome"].string_value == "completed"
    # The final metric export happens at shutdown.
    assert {"tritask.task.created", "tritask.task.attempts", "tritask.tool.call.duration"} <= (
        collector.metric_names()
    )


def serve_command(*extra: str) -> list[str]:
    return [sys.executable, "-m", "tritask", "serve", APP, "--stdio", "--store", "memory:", *extra]


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        (
            {"OTEL_TRACES_EXPORTER": "zipkin"},
            "tritask: --otel: OTEL_TRACES_EXPORTER='zipkin': no installed package provides the "
            "'zipkin' traces exporter; installed: console, otlp_proto_http, or 'none'",
        ),
        (
            {"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "otlp",
             "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            "tritask: --otel: OTEL_METRICS_EXPORTER='otlp': no installed package provides the "
            "'otlp_proto_grpc' metrics exporter (the otlp exporter comes with the extra: pip "
            "install 'tritask[otel]'); installed: console, otlp_proto_http, or 'none'",
        ),
        (
            {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
            "tritask: --otel: OTEL_EXPORTER_OTLP_PROTOCOL='http/json' is not one of "
            "http/protobuf, grpc",
        ),
    ],
    ids=["unknown-exporter", "otlp-grpc-not-installed", "unknown-protocol"],
)  # fmt: skip
def test_an_exporter_that_cannot_be_used_is_one_line(
    variables: dict[str, str], expected: str
) -> None:
    done = subprocess.run(
        serve_command("--otel"), env=otel_environment(**variables), stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [expected]


def test_serve_otel_without_the_extra_is_one_line() -> None:
    done = subprocess.run(
        [sys.executable, "-c", BLOCK_OPENTELEMETRY, "serve", APP, "--stdio", "--store",
         "memory:", "--otel"],
        env=otel_environment(), stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "tritask: --otel: tritask.otel needs the OpenTelemetry API: pip install 'tritask[otel]'"
    ]


def test_serve_without_otel_never_imports_it() -> None:
    code = BLOCK_OPENTELEMETRY.replace("sys.exit(main(sys.argv[1:]))", "main(sys.argv[1:])")
    done = subprocess.run(
        [sys.executable, "-c", code, "serve", APP, "--stdio", "--store", "memory:"],
        env=otel_environment(), input="", capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "tritask: serving stdio" in done.stderr
