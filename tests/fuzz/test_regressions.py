"""One regression test per class of bad input the black-box fuzzer found (issue 18).

Each was a 500 / ``-32603`` answer, a traceback in the server log, a hang, or a task failed with
an internal error, for a request with a valid envelope. The fixture is the conformance app
(``examples/conformance_fixture.py``) on SQLite, served over Streamable HTTP on a real socket;
the last classes are checked on stdio too, where the answer is a line and not a status.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from stress.fuzz.eras import MODERN, TASKS_EXTENSION
from stress.fuzz.session import LogWatch
from tritask.cli import load_app
from tritask.jsonrpc import InvalidParams, Request
from tritask.server import App
from tritask.server.dispatcher import Dispatcher
from tritask.server.extension import ServeEnvironment
from tritask.server.mrtr import accepted_content
from tritask.transports.http import serve_http
from tritask.transports.stdio import serve_stdio

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "examples" / "conformance_fixture.py"
TASKS: dict[str, Any] = {"extensions": {TASKS_EXTENSION: {}}, "elicitation": {}}


class Server:
    """The fixture behind ``serve_http``; ``post`` sends raw text with valid headers."""

    def __init__(self, client: httpx.AsyncClient, url: str, logs: LogWatch) -> None:
        self.client = client
        self.url = url
        self.logs = logs
        self.ids = 0

    async def post(self, text: str, method: str, name: str | None = None) -> httpx.Response:
        _, headers = MODERN.request(0, method, {"name": name} if name else {}, {})
        return await self.client.post(self.url, content=text.encode(), headers=headers)

    async def call(
        self, method: str, params: dict[str, Any], caps: dict[str, Any] | None = None
    ) -> tuple[int, dict[str, Any]]:
        self.ids += 1
        message, headers = MODERN.request(self.ids, method, params, caps or {})
        response = await self.client.post(self.url, json=message, headers=headers)
        body: dict[str, Any] = response.json()
        return response.status_code, body

    async def task(self, task_id: str, *statuses: str) -> dict[str, Any]:
        for _ in range(300):
            _, body = await self.call("tasks/get", {"taskId": task_id}, TASKS)
            if body["result"]["status"] in statuses:
                result: dict[str, Any] = body["result"]
                return result
            await trio.sleep(0.02)
        raise AssertionError(f"task {task_id} never reached {statuses}: {body}")


@asynccontextmanager
async def fixture_server(tmp_path: Path) -> AsyncIterator[Server]:
    app = load_app(f"{FIXTURE}:app")
    env = ServeEnvironment(store_url=f"sqlite:{tmp_path / 'tasks.db'}")
    logs = LogWatch()
    logging.getLogger().addHandler(logs)
    try:
        async with app.running(env), trio.open_nursery() as nursery:
            urls = await nursery.start(functools.partial(serve_http, app, "127.0.0.1", 0))
            async with httpx.AsyncClient(timeout=30) as client:
                yield Server(client, urls[0] + "/mcp", logs)
            nursery.cancel_scope.cancel()
    finally:
        logging.getLogger().removeHandler(logs)
    assert logs.tracebacks == []


def envelope(params: str, method: str = "tools/call") -> str:
    meta = (
        '"_meta":{"io.modelcontextprotocol/protocolVersion":"2026-07-28",'
        '"io.modelcontextprotocol/clientCapabilities":'
        '{"extensions":{"io.modelcontextprotocol/tasks":{}}}}'
    )
    return f'{{"jsonrpc":"2.0","id":41,"method":"{method}","params":{{{params},{meta}}}}}'


# -- class 1: an argument the tool's function cannot take ------------------------------------------


async def test_an_unknown_argument_is_a_32602_and_never_a_task(tmp_path: Path) -> None:
    async with fixture_server(tmp_path) as server:
        status, body = await server.call(
            "tools/call", {"name": "greet", "arguments": {"seconds": None}}
        )
        assert status == 400
        assert body["error"]["message"] == "unknown argument 'seconds' for tool 'greet'"
        status, body = await server.call(
            "tools/call", {"name": "slow_compute", "arguments": {"secs": 1}}, TASKS
        )
        assert (status, body["error"]["code"]) == (400, -32602)  # decided before any task


# -- class 2: numbers no double holds, lone surrogates ---------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ('{"seconds":1e400}', "Parse error: the number 1e400 is beyond the range of a double"),
        ('{"seconds":' + "9" * 400 + "}", "Parse error: the integer 9999"),
        ('{"label":"\\ud800"}', "Parse error: a string holds a lone surrogate"),
    ],
)
async def test_json_the_server_could_not_answer_is_a_parse_error_with_the_id(
    tmp_path: Path, arguments: str, message: str
) -> None:
    async with fixture_server(tmp_path) as server:
        text = envelope(f'"name":"slow_compute","arguments":{arguments}')
        response = await server.post(text, "tools/call", "slow_compute")
        assert response.status_code == 400
        body = response.json()
        assert body["id"] == 41
        assert body["error"]["code"] == -32700
        assert body["error"]["message"].startswith(message)


async def test_on_stdio_the_parse_error_names_the_request_id() -> None:
    app = load_app(f"{FIXTURE}:app")
    to_server, server_in = trio.testing.memory_stream_pair()
    server_out, from_server = trio.testing.memory_stream_pair()
    async with app.running(ServeEnvironment(store_url="memory:")), trio.open_nursery() as nursery:
        nursery.start_soon(functools.partial(serve_stdio, app, stdin=server_in, stdout=server_out))
        text = envelope('"name":"greet","arguments":{"name":"\\udc00"}')
        await to_server.send_all(text.encode() + b"\n")
        with trio.fail_after(10):
            line = b""
            while not line.endswith(b"\n"):
                line += await from_server.receive_some(65536)
        answer = json.loads(line)
        assert answer["id"] == 41
        assert answer["error"]["code"] == -32700
        await to_server.send_eof()


# -- class 3: a malformed answer to a task's input request -----------------------------------------


def test_accepted_content_only_returns_an_accepted_object() -> None:
    assert accepted_content({"action": "accept", "content": {"ok": True}}) == {"ok": True}
    for answer in (
        {"action": "accept", "content": [1]},
        {"action": "accept", "content": "yes"},
        {"action": "accept"},
        {"action": "decline", "content": {"ok": True}},
        {"content": {"ok": True}},
        None,
    ):
        assert accepted_content(answer) is None, answer


async def test_a_task_given_a_malformed_answer_completes_instead_of_crashing(
    tmp_path: Path,
) -> None:
    async with fixture_server(tmp_path) as server:
        _, body = await server.call(
            "tools/call", {"name": "confirm_delete", "arguments": {}}, TASKS
        )
        task_id = body["result"]["taskId"]
        await server.task(task_id, "input_required")
        answer = {"confirm-delete": {"action": "accept", "content": [1]}}
        _, body = await server.call(
            "tasks/update", {"taskId": task_id, "inputResponses": answer}, TASKS
        )
        assert body["result"]["resultType"] == "complete"
        detail = await server.task(task_id, "completed", "failed")
        assert detail["status"] == "completed"
        assert detail["result"]["content"][0]["text"] == "Delete confirmed: false"


# -- class 4: an MRTR round that would start a task which cannot finish ----------------------------


async def test_input_responses_without_the_name_do_not_start_a_task(tmp_path: Path) -> None:
    async with fixture_server(tmp_path) as server:
        params = {"name": "test_tool_with_task", "arguments": {}, "inputResponses": {"x": {}}}
        _, body = await server.call("tools/call", params, TASKS)
        # Asked again (sync), instead of a task that fails with "returned a continuation".
        assert body["result"]["resultType"] == "input_required"
        assert list(body["result"]["inputRequests"]) == ["user_name"]
        named = {"user_name": {"action": "accept", "content": {"name": "Ada"}}}
        _, body = await server.call("tools/call", {**params, "inputResponses": named}, TASKS)
        detail = await server.task(body["result"]["taskId"], "completed", "failed")
        assert detail["result"]["content"][0]["text"] == "Hello, Ada; task completed"


# -- class 5: a tool that waits for input, called without the Tasks extension ----------------------


@pytest.mark.parametrize("tool", ["confirm_delete", "multi_input"])  # multi_input: a nursery
async def test_an_input_tool_called_without_tasks_is_a_32021(tmp_path: Path, tool: str) -> None:
    async with fixture_server(tmp_path) as server:
        status, body = await server.call("tools/call", {"name": tool, "arguments": {}})
        assert status == 400
        assert body["error"] == {
            "code": -32021,
            "message": f"Tool {tool} waits for input: it runs as a task only, and this request "
            f"did not declare {TASKS_EXTENSION}",
            "data": {"requiredCapabilities": {"extensions": {TASKS_EXTENSION: {}}}},
        }


# -- class 6: JSON-RPC errors raised in a tool's own nursery ---------------------------------------


async def test_a_task_whose_nursery_children_lack_a_capability_fails_with_32021(
    tmp_path: Path,
) -> None:
    async with fixture_server(tmp_path) as server:
        tasks_only: dict[str, Any] = {"extensions": {TASKS_EXTENSION: {}}}  # no elicitation
        _, body = await server.call(
            "tools/call", {"name": "multi_input", "arguments": {}}, tasks_only
        )
        detail = await server.task(body["result"]["taskId"], "failed", "completed")
        assert detail["status"] == "failed"
        assert detail["error"] == {
            "code": -32021,
            "message": "Missing required client capability",
            "data": {"requiredCapabilities": {"elicitation": {}}},
        }


async def test_a_direct_call_whose_nursery_children_raise_one_json_rpc_error_answers_it() -> None:
    app = App("groups", "1", state_key="regression-state-key-0123456789")

    @app.tool()
    async def fan_out(count: int = 2) -> str:
        """Each child refuses the same way."""

        async def child() -> None:
            raise InvalidParams("count is not allowed today")

        async with trio.open_nursery() as nursery:
            for _ in range(count):
                nursery.start_soon(child)
        return "unreachable"

    message, _ = MODERN.request(5, "tools/call", {"name": "fan_out", "arguments": {}}, {})
    response = await Dispatcher(app).handle_request(
        Request(id=5, method="tools/call", params=message["params"])
    )
    assert response["error"] == {"code": -32602, "message": "count is not allowed today"}


async def test_the_fuzzer_splits_sse_lines_only_at_cr_and_lf() -> None:
    """The legacy fuzzer's first flake: httpx's ``aiter_lines`` also splits at U+2028 and
    U+0085, which JSON carries raw inside a string, and so broke a tool's echoed text in two."""
    from stress.fuzz.drivers import _sse_lines

    body = 'id: 1\r\ndata: {"text": "a\u2028b\x85c"}\r\n\r\ndata: x\rdata: y\n'.encode()
    response = httpx.Response(200, content=body)
    lines = [line async for line in _sse_lines(response)]
    assert lines == ["id: 1", 'data: {"text": "a\u2028b\x85c"}', "", "data: x", "data: y"]


SLOW_COMPUTE = {
    "type": "object",
    "properties": {"seconds": {"type": "number", "default": 1}, "label": {"type": "string"}},
}


@st.composite
def direct_slow_compute_arguments(draw: st.DrawFn) -> Any:
    from stress.fuzz.strategies import arguments_for

    return arguments_for(draw, "slow_compute", SLOW_COMPUTE, task=False)


@settings(max_examples=600, database=None)
@given(direct_slow_compute_arguments())
def test_the_fuzzer_never_sends_a_direct_call_that_sleeps(arguments: Any) -> None:
    """The fuzzer's second flake: bending a direct call's arguments (a declared argument
    replaced by any JSON value) gave ``slow_compute`` ``{"seconds": 497}``, which the server
    rightly ran for 497 s, and the fuzzer took for a hang. Direct calls stay short; a task may
    be long."""
    from stress.fuzz.session import _short

    seconds = arguments.get("seconds") if isinstance(arguments, dict) else None
    if isinstance(seconds, int | float) and not isinstance(seconds, bool):
        assert _short(arguments), arguments  # what the fuzzer's ledger calls finishing at once
