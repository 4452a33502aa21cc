"""Tasks are bound to the token's principal {iss, sub, client_id}.

Another subject (or the same subject through another client) gets exactly what an unknown
task id gets, for every task request and for listen; the owner with a refreshed token still
has the task; answering a task's input needs its tool's scopes; the raw token reaches no
store row, no ``Work``, no detached context and no log.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import trio

from auth.oauth_app import Endpoint, Probe, V, call, rpc, serve_protected
from tritask.server import App, Context
from tritask.tasks.executor import ExecutionToken, Outcome
from tritask.tasks.extension import ToolCallExecutor
from tritask.tasks.store import Action
from tritask.tasks.work import Work
from tritask.testing.oauth import TestAuthorizationServer

UNKNOWN = "an-id-nobody-ever-created-0123456"


def mint(server: TestAuthorizationServer, endpoint: Endpoint, **claims: Any) -> str:
    claims.setdefault("aud", endpoint.resource)
    claims.setdefault("scope", "mcp files:write")
    return server.mint(**claims)


async def create_task(endpoint: Endpoint, token: str) -> str:
    response = await endpoint.post(call("ask", tasks=True), token)
    assert response.status_code == 200, response.text
    result = response.json()["result"]
    assert result["resultType"] == "task"
    task_id: str = result["taskId"]
    return task_id


async def task_request(
    endpoint: Endpoint, token: str, method: str, task_id: str, **params: Any
) -> tuple[int, Any]:
    response = await endpoint.post(rpc(method, {"taskId": task_id, **params}, tasks=True), token)
    return response.status_code, response.json()


async def listen_ack(endpoint: Endpoint, token: str, task_ids: list[str]) -> Any:
    """The acknowledgement of a listen for ``task_ids`` (the first SSE event)."""
    message = rpc("subscriptions/listen", {"notifications": {"taskIds": task_ids}}, tasks=True)
    headers = {
        "content-type": "application/json",
        "accept": "application/json, text/event-stream",
        "mcp-protocol-version": V,
        "mcp-method": "subscriptions/listen",
        "authorization": f"Bearer {token}",
    }
    with trio.fail_after(10):
        async with endpoint.client.stream(
            "POST", endpoint.url, content=json.dumps(message).encode(), headers=headers
        ) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    return json.loads(line[5:])
    raise AssertionError("no acknowledgement")


ANSWER = {"confirm": {"action": "accept", "content": {}}}


@pytest.fixture
def probe() -> Probe:
    return Probe()


async def test_another_principal_gets_exactly_what_an_unknown_id_gets(
    auth_server: TestAuthorizationServer, probe: Probe
) -> None:
    async with serve_protected(auth_server, probe) as endpoint:
        alice = mint(auth_server, endpoint, sub="alice", client_id="cli")
        task_id = await create_task(endpoint, alice)
        status, owned = await task_request(endpoint, alice, "tasks/get", task_id)
        assert status == 200 and owned["result"]["taskId"] == task_id
        strangers = {
            "another subject": mint(auth_server, endpoint, sub="bob", client_id="cli"),
            "the same subject through another client": mint(
                auth_server, endpoint, sub="alice", client_id="other-cli"
            ),
        }
        for who, token in strangers.items():
            for method, params in (
                ("tasks/get", {}),
                ("tasks/update", {"inputResponses": ANSWER}),
                ("tasks/cancel", {}),
            ):
                theirs = await task_request(endpoint, token, method, task_id, **params)
                unknown = await task_request(endpoint, token, method, UNKNOWN, **params)
                assert theirs == unknown, (who, method)
                assert theirs[0] == 400
                assert theirs[1]["error"] == {
                    "code": -32602,
                    "message": "Unknown or inaccessible taskId",
                }
            theirs_ack = await listen_ack(endpoint, token, [task_id])
            unknown_ack = await listen_ack(endpoint, token, [UNKNOWN])
            assert theirs_ack == unknown_ack
            assert theirs_ack["params"]["notifications"] == {}
        # Nothing the strangers did reached the task: it still waits for its input.
        status, still = await task_request(endpoint, alice, "tasks/get", task_id)
        assert still["result"]["status"] == "input_required"
        # The owner, with a refreshed token (new jti, new exp), still has it.
        refreshed = mint(auth_server, endpoint, sub="alice", client_id="cli", exp_in=900)
        assert refreshed != alice
        ack = await listen_ack(endpoint, refreshed, [task_id])
        assert ack["params"]["notifications"] == {"taskIds": [task_id]}
        status, answered = await task_request(
            endpoint, refreshed, "tasks/update", task_id, inputResponses=ANSWER
        )
        assert (status, answered["result"]["resultType"]) == (200, "complete")
        with trio.fail_after(10):
            while True:
                _, done = await task_request(endpoint, refreshed, "tasks/get", task_id)
                if done["result"]["status"] == "completed":
                    break
                await trio.sleep(0.01)


async def test_updating_a_task_needs_its_tools_scopes(
    auth_server: TestAuthorizationServer, probe: Probe
) -> None:
    async with serve_protected(auth_server, probe) as endpoint:
        writer = mint(auth_server, endpoint, scope="mcp files:write")
        task_id = await create_task(endpoint, writer)
        reader = mint(auth_server, endpoint, scope="mcp")
        # get and cancel need only the server-wide scopes; update acts on the tool.
        status, seen = await task_request(endpoint, reader, "tasks/get", task_id)
        assert status == 200 and seen["result"]["status"] in ("working", "input_required")
        message = rpc("tasks/update", {"taskId": task_id, "inputResponses": ANSWER}, tasks=True)
        refused = await endpoint.post(message, reader)
        assert refused.status_code == 403
        assert refused.headers["www-authenticate"] == (
            f'Bearer error="insufficient_scope", scope="files:write mcp", '
            f'resource_metadata="{endpoint.metadata_url}", '
            'error_description="The access token lacks a scope this operation needs"'
        )
        status, ok = await task_request(
            endpoint, writer, "tasks/update", task_id, inputResponses=ANSWER
        )
        assert status == 200, ok
        # A broader scope (files:admin implies files:write) also may.
        second = await create_task(endpoint, writer)
        admin = mint(auth_server, endpoint, scope="mcp files:admin")
        status, ok = await task_request(
            endpoint, admin, "tasks/update", second, inputResponses=ANSWER
        )
        assert status == 200, ok
        third = await create_task(endpoint, writer)
        status, cancelled = await task_request(endpoint, reader, "tasks/cancel", third)
        assert (status, cancelled["result"]["resultType"]) == (200, "complete")
        _, gone = await task_request(endpoint, writer, "tasks/get", third)
        assert gone["result"]["status"] == "cancelled"


def export_builder(task_id: str, tool: str, arguments: dict[str, Any], ctx: Context) -> Work:
    """A custom descriptor: its own type, the tool under a key only its executor knows."""
    return Work(idempotency_key=task_id, type="export-job", input={"job": tool, "args": arguments})


class ExportExecutor:
    """Runs ``export-job`` work as the tool call it describes (the default executor's way)."""

    def __init__(self) -> None:
        self.app: App | None = None

    async def execute(self, work: Work, token: ExecutionToken, state: Any) -> Outcome:
        assert self.app is not None and work.type == "export-job"
        call = Work.tool_call(work.idempotency_key, work.input["job"], work.input["args"])
        return await ToolCallExecutor(self.app).execute(call, token, state)


@pytest.mark.parametrize("store", ["memory", "sqlite"])
async def test_updating_a_task_needs_its_tools_scopes_with_a_custom_work_builder(
    auth_server: TestAuthorizationServer, probe: Probe, tmp_path: Path, store: str
) -> None:
    """The creating tool is persisted with a builder's work (Work v4), so ``tasks/update``
    re-checks that tool's scopes whatever shape the builder gave the work; before, such a task
    needed only the server-wide scopes."""
    executor = ExportExecutor()
    options = {"work_builder": export_builder, "runner_options": {"executor": executor}}
    store_url = f"sqlite:///{tmp_path / 'tasks.db'}" if store == "sqlite" else None
    async with serve_protected(
        auth_server, probe, store_url=store_url, tasks_options=options
    ) as endpoint:
        executor.app = endpoint.app
        writer = mint(auth_server, endpoint, scope="mcp files:write")
        reader = mint(auth_server, endpoint, scope="mcp")
        task_id = await create_task(endpoint, writer)
        with trio.fail_after(10):
            await probe.asked.wait()
        tasks = endpoint.app.extensions["io.modelcontextprotocol/tasks"]
        stored = await tasks.store.get(  # type: ignore[attr-defined]
            task_id,
            await tasks.store.authorize(probe.contexts[0], Action.GET, task_id),  # type: ignore[attr-defined]
        )
        assert (stored.work.type, stored.work.tool) == ("export-job", "ask")
        assert stored.work.input == {"job": "ask", "args": {}}
        message = rpc("tasks/update", {"taskId": task_id, "inputResponses": ANSWER}, tasks=True)
        refused = await endpoint.post(message, reader)
        assert refused.status_code == 403, refused.text
        assert (
            'error="insufficient_scope", scope="files:write mcp"'
            in (refused.headers["www-authenticate"])
        )
        _, seen = await task_request(endpoint, reader, "tasks/get", task_id)
        assert seen["result"]["status"] == "input_required"
        status, ok = await task_request(
            endpoint, writer, "tasks/update", task_id, inputResponses=ANSWER
        )
        assert status == 200, ok
        with trio.fail_after(10):
            while True:
                _, done = await task_request(endpoint, writer, "tasks/get", task_id)
                if done["result"]["status"] == "completed":
                    break
                await trio.sleep(0.01)


async def test_the_raw_token_reaches_no_store_row_work_context_or_log(
    auth_server: TestAuthorizationServer,
    probe: Probe,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    database = tmp_path / "tasks.db"
    async with serve_protected(auth_server, probe, store_url=f"sqlite:///{database}") as endpoint:
        token = mint(auth_server, endpoint, sub="alice", client_id="cli")
        task_id = await create_task(endpoint, token)
        with trio.fail_after(10):
            await probe.asked.wait()
        worker = probe.contexts[0]
        assert worker.detached
        assert worker.auth is not None
        assert worker.auth.subject == "alice"
        assert worker.auth.raw_token() is None
        assert token not in repr(worker.auth)
        assert worker.principal == {"iss": auth_server.issuer, "sub": "alice", "client_id": "cli"}
        tasks = endpoint.app.extensions["io.modelcontextprotocol/tasks"]
        store = tasks.store  # type: ignore[attr-defined]
        access = await store.authorize(worker, Action.GET, task_id)
        snapshot = await store.get(task_id, access)
        assert token not in json.dumps(snapshot.work.to_json())
        status, _ = await task_request(
            endpoint, token, "tasks/update", task_id, inputResponses=ANSWER
        )
        assert status == 200
    rows: list[str] = []
    with sqlite3.connect(database) as connection:
        for (table,) in connection.execute("SELECT name FROM sqlite_master WHERE type='table'"):
            for row in connection.execute(f'SELECT * FROM "{table}"'):
                rows.append(repr(row))
    dump = "\n".join(rows)
    assert task_id in dump  # the rows were read
    signature = token.split(".")[-1]
    for text in (dump, database.read_bytes().decode("latin-1")):
        assert token not in text
        assert signature not in text
    logged = "\n".join(r.getMessage() + repr(r.args) for r in caplog.records)
    assert token not in logged and signature not in logged
    # The principal is what the store scopes by.
    assert '{"client_id":"cli","iss":"' + auth_server.issuer + '","sub":"alice"}' in dump


async def _legacy_exchange(
    endpoint: Endpoint, token: str, session: dict[str, str], message: dict[str, Any]
) -> list[Any]:
    """The messages of a legacy POST, up to its response or a server request."""
    headers = {
        **session,
        "content-type": "application/json",
        "accept": "application/json, text/event-stream",
        "authorization": f"Bearer {token}",
    }
    messages: list[Any] = []
    with trio.fail_after(10):
        async with endpoint.client.stream(
            "POST", endpoint.url, content=json.dumps(message).encode(), headers=headers
        ) as response:
            if response.headers["content-type"] == "application/json":
                return [json.loads(await response.aread())]
            async for line in response.aiter_lines():
                if line.startswith("data:") and line[5:].strip():
                    messages.append(json.loads(line[5:]))
                    if "method" in messages[-1] or messages[-1].get("id") == message["id"]:
                        break
    return messages


async def test_answering_through_a_legacy_session_needs_the_tools_scopes_too(
    auth_server: TestAuthorizationServer, probe: Probe
) -> None:
    # A 2025-11-25 session's tasks/result asks the client for the task's input and hands the
    # answer to the task: that acts on the tool as tasks/update does, so the same principal
    # with a token lacking the tool's scope must not get (nor answer) the input request.
    async with serve_protected(auth_server, probe) as endpoint:
        writer = mint(auth_server, endpoint, scope="mcp files:write")
        reader = mint(auth_server, endpoint, scope="mcp")
        initialize = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-11-25",
                "capabilities": {"elicitation": {}, "tasks": {"list": {}, "cancel": {}}},
                "clientInfo": {"name": "t", "version": "1"},
            },
        }
        opened = await endpoint.post(initialize, writer, modern=False)
        assert opened.status_code == 200, opened.text
        session = {
            "mcp-session-id": opened.headers["mcp-session-id"],
            "mcp-protocol-version": "2025-11-25",
        }
        create = {
            "jsonrpc": "2.0",
            "id": 2,
            "method": "tools/call",
            "params": {"name": "ask", "arguments": {}, "task": {}},
        }
        created = await _legacy_exchange(endpoint, writer, session, create)
        task_id = created[-1]["result"]["task"]["taskId"]
        with trio.fail_after(10):
            await probe.asked.wait()
        result = {
            "jsonrpc": "2.0",
            "id": 3,
            "method": "tasks/result",
            "params": {"taskId": task_id},
        }
        messages = await _legacy_exchange(endpoint, reader, session, result)
        assert [m.get("method") for m in messages] == [None], messages
        error = messages[0]["error"]
        assert error["code"] == -32600
        assert error["data"]["error"] == "insufficient_scope"
        assert error["data"]["scope"] == "files:write"
        got = {"jsonrpc": "2.0", "id": 4, "method": "tasks/get", "params": {"taskId": task_id}}
        (status,) = await _legacy_exchange(endpoint, reader, session, got)
        assert status["result"]["status"] == "input_required"
        # With the tool's scope, the same request is asked the input.
        asked = await _legacy_exchange(endpoint, writer, session, {**result, "id": 5})
        assert asked[-1]["method"] == "elicitation/create"
