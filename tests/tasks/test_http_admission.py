"""Streamable HTTP admission for the task methods (real socket via ``serve_http`` on port 0):
a present ``Mcp-Name`` must mirror ``params.taskId``, literally or in the base64 sentinel form;
a missing one is forgiven (tritask routes by store, and FastMCP 4.1.4 + fastmcp-tasks omit it)."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
import trio
from helpers import UNKNOWN_TASK, Env, body, http_headers, start_env

pytestmark = pytest.mark.contract("tasks-extension-http-admission")

METHODS = ("tasks/get", "tasks/update", "tasks/cancel")
UNICODE_ID = "task/with unicode ✓"


def sentinel(text: str) -> str:
    return "=?base64?" + base64.b64encode(text.encode("utf-8")).decode("ascii") + "?="


def params_for(method: str, task_id: str | None) -> dict[str, Any]:
    params: dict[str, Any] = {} if task_id is None else {"taskId": task_id}
    if method == "tasks/update":
        params["inputResponses"] = {"nothing": {"action": "accept"}}
    return params


@pytest.fixture
async def served(
    nursery: trio.Nursery, http_server: Callable[..., Any]
) -> AsyncIterator[tuple[Env, httpx.AsyncClient, str]]:
    env = await start_env(nursery, task_support={"gated": "required"})
    release = trio.Event()

    @env.app.tool()
    async def gated() -> str:
        """Waits for the test."""
        await release.wait()
        return "released"

    url = (await http_server(env.app)) + "/mcp"
    async with httpx.AsyncClient(timeout=10) as client:
        yield env, client, url
    release.set()


async def post(
    client: httpx.AsyncClient,
    url: str,
    method: str,
    params: dict[str, Any],
    *,
    tasks: bool = True,
    **header_kw: Any,
) -> tuple[int, dict[str, Any]]:
    response = await client.post(
        url,
        content=body(method, params, tasks=tasks),
        headers=http_headers(method, **header_kw),
    )
    assert response.headers["content-type"] == "application/json"
    payload: dict[str, Any] = response.json()
    return response.status_code, payload


def error(code: int, message: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": 1, "error": {"code": code, "message": message}}


@pytest.mark.parametrize("method", METHODS)
async def test_task_methods_check_a_present_mcp_name(
    served: tuple[Env, httpx.AsyncClient, str], method: str
) -> None:
    _, client, url = served
    params = params_for(method, "some-task")
    # No header at all: admitted, so the request reaches the task lookup.
    assert await post(client, url, method, params) == (400, error(-32602, UNKNOWN_TASK))
    assert await post(client, url, method, params, name="other-task") == (
        400,
        error(-32020, "The Mcp-Name header does not match params.taskId"),
    )
    assert await post(client, url, method, params, names=("some-task", "some-task")) == (
        400,
        error(-32020, "Header Mcp-Name must not be repeated"),
    )
    assert await post(client, url, method, params, names=("some-task", "other")) == (
        400,
        error(-32020, "Header Mcp-Name must not be repeated"),
    )
    assert await post(client, url, method, params, name="=?base64?@@@@?=") == (
        400,
        error(-32020, "Header Mcp-Name has an invalid base64 value"),
    )
    assert await post(client, url, method, params, name=sentinel("other-task")) == (
        400,
        error(-32020, "The Mcp-Name header does not match params.taskId"),
    )
    # Header admission comes before the capability check: no declaration, still -32020 ...
    assert await post(client, url, method, params, name="other-task", tasks=False) == (
        400,
        error(-32020, "The Mcp-Name header does not match params.taskId"),
    )
    # ... and an admitted request without the header still needs the declaration.
    status, payload = await post(client, url, method, params, tasks=False)
    assert (status, payload["error"]["code"]) == (400, -32021)
    # No taskId in the body: a header then has nothing to mirror.
    assert await post(client, url, method, params_for(method, None), name="x") == (
        400,
        error(-32020, "The Mcp-Name header is set but params.taskId is absent"),
    )


@pytest.mark.parametrize("method", METHODS)
async def test_a_correct_header_reaches_the_unknown_task_answer(
    served: tuple[Env, httpx.AsyncClient, str], method: str
) -> None:
    _, client, url = served
    unknown = error(-32602, UNKNOWN_TASK)
    literal = params_for(method, "no-such-task")
    assert await post(client, url, method, literal, name="no-such-task") == (400, unknown)
    # Non-ASCII ids travel in the base64 sentinel form.
    encoded = params_for(method, UNICODE_ID)
    assert await post(client, url, method, encoded, name=sentinel(UNICODE_ID)) == (400, unknown)
    # Admitted, but undeclared: the capability error, still before any lookup.
    status, payload = await post(client, url, method, literal, name="no-such-task", tasks=False)
    assert status == 400 and payload["error"]["code"] == -32021
    # No taskId at all (and no header): the parameter error.
    assert await post(client, url, method, params_for(method, None)) == (
        400,
        error(-32602, "A non-empty taskId is required"),
    )


async def test_a_real_task_over_http_with_literal_and_sentinel_headers(
    served: tuple[Env, httpx.AsyncClient, str],
) -> None:
    env, client, url = served
    status, created = await post(
        client, url, "tools/call", {"name": "gated", "arguments": {}}, name="gated"
    )
    assert status == 200
    task_id = created["result"]["taskId"]
    assert created["result"]["resultType"] == "task"

    status, got = await post(client, url, "tasks/get", {"taskId": task_id}, name=task_id)
    assert status == 200 and got["result"]["status"] == "working"
    status, again = await post(
        client, url, "tasks/get", {"taskId": task_id}, name=sentinel(task_id)
    )
    assert (status, again) == (200, got)
    status, bare = await post(client, url, "tasks/get", {"taskId": task_id})
    assert (status, bare) == (200, got)

    update = params_for("tasks/update", task_id)
    status, ack = await post(client, url, "tasks/update", update, name=task_id)
    assert status == 200 and ack["result"]["resultType"] == "complete"
    status, ack = await post(
        client, url, "tasks/cancel", {"taskId": task_id}, name=sentinel(task_id)
    )
    assert status == 200 and ack["result"]["resultType"] == "complete"
    assert "taskId" not in ack["result"]
    status, cancelled = await post(client, url, "tasks/get", {"taskId": task_id}, name=task_id)
    assert status == 200
    assert cancelled["result"]["status"] == "cancelled"
    assert cancelled["result"]["statusMessage"] == "Cancellation requested"
    assert env.history_kinds(task_id) == ["cancelled"]


@pytest.mark.parametrize("method", ["tasks/list", "tasks/result"])
async def test_removed_methods_are_404_over_http(
    served: tuple[Env, httpx.AsyncClient, str], method: str
) -> None:
    _, client, url = served
    status, payload = await post(client, url, method, {"taskId": "t"})
    assert (status, payload) == (404, error(-32601, f"Method not found: {method}"))


async def test_a_crashing_task_fails_over_http_with_200_on_get(
    nursery: trio.Nursery, http_server: Callable[..., Any]
) -> None:
    env = await start_env(nursery, task_support={"boom": "required"})

    @env.app.tool()
    async def boom() -> str:
        """Crashes."""
        raise RuntimeError("private task crash detail")

    url = (await http_server(env.app)) + "/mcp"
    async with httpx.AsyncClient(timeout=10) as client:
        status, created = await post(
            client, url, "tools/call", {"name": "boom", "arguments": {}}, name="boom"
        )
        assert status == 200
        task_id = created["result"]["taskId"]
        with trio.fail_after(5):
            while True:
                status, got = await post(
                    client, url, "tasks/get", {"taskId": task_id}, name=task_id
                )
                if got["result"]["status"] != "working":
                    break
                await trio.sleep(0.01)
    # The task failed; the get itself succeeded (the failure is task data, not a protocol error).
    assert status == 200
    assert got["result"]["error"] == {"code": -32603, "message": "Task tool failed"}
    assert "private task crash detail" not in str(got)


@pytest.mark.parametrize(
    ("limit", "status"), [("max_tasks", 503), ("max_active_tasks_per_scope", 429)]
)
async def test_a_store_limit_refusal_is_retryable_with_retry_after(
    nursery: trio.Nursery, http_server: Callable[..., Any], limit: str, status: int
) -> None:
    """Capacity refusals are not server failures: 503 (the server's limit) or 429 (the
    principal's), with Retry-After, and the same JSON-RPC error as before (-32603)."""
    env = await start_env(
        nursery,
        task_support={"gated": "required"},
        store_options={limit: 1},
        runner_options={"max_jobs": 1},
    )
    release = trio.Event()

    @env.app.tool()
    async def gated() -> str:
        """Waits for the test."""
        await release.wait()
        return "released"

    url = (await http_server(env.app)) + "/mcp"
    call = {"name": "gated", "arguments": {}}
    async with httpx.AsyncClient(timeout=10) as client:
        code, first = await post(client, url, "tools/call", call, name="gated")
        assert (code, first["result"]["status"]) == (200, "working")
        response = await client.post(
            url, content=body("tools/call", call), headers=http_headers("tools/call", name="gated")
        )
        assert response.status_code == status
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"] == {
            "code": -32603,
            "message": "Task capacity exhausted",
            "data": {"retryable": True, "limit": limit, "retryAfterSeconds": 1},
        }
    release.set()


async def test_beyond_max_jobs_a_call_is_accepted_queued_over_http(
    served: tuple[Env, httpx.AsyncClient, str],
) -> None:
    env, client, url = served
    call = {"name": "gated", "arguments": {}}
    slots = env.runner.max_jobs
    for _ in range(slots + 3):
        code, created = await post(client, url, "tools/call", call, name="gated")
        assert code == 200
        assert created["result"]["resultType"] == "task"
    assert len(env.runner.active_task_ids()) == slots
    assert env.runner.statistics().queued == 3
    assert created["result"]["statusMessage"] == "Queued: waiting for a free runner slot"
