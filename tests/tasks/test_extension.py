"""The Tasks extension end to end through the dispatcher: creation, detail, update, cancel,
policies, errors, limits, the detached worker context, parked input and tenant isolation."""

from __future__ import annotations

import base64
import json
import re
import string
import time
from collections.abc import Mapping
from typing import Any

import pytest
import trio
import trio.testing
from helpers import (
    ELICIT_CAPS,
    ISO_MS,
    START_US,
    TASKS_CAPS,
    UNKNOWN_TASK,
    Env,
    by_principal,
    start_env,
    wait_stops,
)

from tritask.jsonrpc import InvalidParams, JSONValue
from tritask.protocol.meta import SERVER_INFO_KEY
from tritask.server.context import Context
from tritask.server.mrtr import InputRequired, elicitation
from tritask.server.results import ToolError
from tritask.tasks import instrumentation as ins
from tritask.tasks._time import format_instant
from tritask.tasks.extension import (
    CONTINUATION,
    EXTENSION_ID,
    TaskOptions,
    ToolCallExecutor,
    default_task_id,
)
from tritask.tasks.runner import Runner
from tritask.tasks.store import QUEUED_MESSAGE
from tritask.tasks.work import Work

pytestmark = pytest.mark.contract("tasks-extension-lifecycle")

SERVER_INFO = {"name": "tasks-test", "version": "0.1.0"}
ACK = {"resultType": "complete", "_meta": {SERVER_INFO_KEY: SERVER_INFO}}
REQUIRED_TASKS: dict[str, Any] = {"requiredCapabilities": {"extensions": {EXTENSION_ID: {}}}}
CONFIRM = elicitation(
    "Confirm delete",
    {"type": "object", "properties": {"confirmed": {"type": "boolean"}}, "required": ["confirmed"]},
)


INVALID_DECISION = {"code": -32603, "message": "Tasks policy returned an invalid decision"}


def unknown() -> dict[str, Any]:
    return {"code": -32602, "message": UNKNOWN_TASK}


class CountingIds:
    """An id generator that remembers what it handed out."""

    def __init__(self) -> None:
        self.issued: list[str] = []

    def __call__(self) -> str:
        self.issued.append(f"task-{len(self.issued) + 1}")
        return self.issued[-1]


async def basic_env(nursery: trio.Nursery, **kw: Any) -> Env:
    env = await start_env(
        nursery,
        task_support={
            "slow": "optional",
            "greet": "sync",
            "failing": "required",
            "crashing": "required",
            "continuation": "required",
            "invalid": "required",
        },
        **kw,
    )
    app = env.app

    @app.tool()
    async def slow(seconds: float = 1.0, label: str = "x") -> str:
        """Sleeps, then reports."""
        await trio.sleep(seconds)
        return f"Completed {label}"

    @app.tool()
    async def greet(name: str = "World") -> str:
        """Says hello."""
        return f"Hello, {name}!"

    @app.tool()
    async def failing() -> str:
        """A domain error."""
        raise ToolError("Actionable task failure")

    @app.tool()
    async def crashing() -> str:
        """A crash with a secret."""
        raise RuntimeError("private task crash detail")

    @app.tool()
    async def continuation() -> Any:
        """Returns an ordinary MRTR continuation."""
        return InputRequired({"user_name": CONFIRM}, "private-request-state-xyz")

    @app.tool()
    async def invalid() -> Any:
        """Returns something that is not a tool result."""
        return object()

    return env


# -- creation and detail shapes -----------------------------------------------------------------


async def test_create_task_result_is_flat_and_get_resolves_immediately(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env = await basic_env(nursery)
    created = await env.result("tools/call", {"name": "slow", "arguments": {"label": "flat"}})
    task_id = created["taskId"]
    assert created == {
        "resultType": "task",
        "taskId": task_id,
        "status": "working",
        "statusMessage": "Task accepted",
        "createdAt": "2026-08-24T10:00:00.000Z",
        "lastUpdatedAt": "2026-08-24T10:00:00.000Z",
        "ttlMs": 3_600_000,
        "pollIntervalMs": 250,
        "_meta": {SERVER_INFO_KEY: SERVER_INFO},
    }
    legacy = ("result", "error", "inputRequests", "requestState", "ttl", "pollInterval", "task")
    assert not set(legacy) & set(created)
    assert re.match(ISO_MS, created["createdAt"])

    # Durable before the response: an immediate get resolves, with no payload yet.
    detail = await env.get(task_id)
    assert detail == {**{k: v for k, v in created.items()}, "resultType": "complete"}

    done = await env.wait_status(task_id, "completed")
    assert done == {
        "resultType": "complete",
        "taskId": task_id,
        "status": "completed",
        "createdAt": "2026-08-24T10:00:00.000Z",
        "lastUpdatedAt": "2026-08-24T10:00:01.000Z",
        "ttlMs": 3_600_000,
        "pollIntervalMs": 250,
        "result": {
            "content": [{"type": "text", "text": "Completed flat"}],
            "isError": False,
            "resultType": "complete",
            "_meta": {SERVER_INFO_KEY: SERVER_INFO},
        },
        "_meta": {SERVER_INFO_KEY: SERVER_INFO},
    }
    assert "io.modelcontextprotocol/related-task" not in json.dumps(done)
    assert await env.get(task_id) == done  # settled: repeated gets are identical
    # The same call made synchronously returns exactly the inlined result.
    direct = await env.result(
        "tools/call", {"name": "slow", "arguments": {"label": "flat"}}, tasks=False
    )
    assert direct == done["result"]


SORTABLE = string.digits + string.ascii_uppercase + string.ascii_lowercase


def id_instant_ms(task_id: str) -> int:
    """The millisecond a default task id's first 8 characters encode (base 62)."""
    ms = 0
    for char in task_id[:8]:
        ms = ms * 62 + SORTABLE.index(char)
    return ms


async def test_task_ids_carry_192_bits_and_are_url_safe(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env = await basic_env(nursery)
    before = time.time_ns() // 1_000_000
    ids = {await env.create("slow", {"seconds": 0}) for _ in range(40)}
    ids |= {default_task_id() for _ in range(200)}
    after = time.time_ns() // 1_000_000
    assert len(ids) == 240
    for task_id in ids:
        assert re.fullmatch(r"[A-Za-z0-9]{8}[A-Za-z0-9_-]{32}", task_id)
        assert len(base64.urlsafe_b64decode(task_id[8:])) == 24  # 192 bits
        assert before <= id_instant_ms(task_id) <= after


def test_task_ids_sort_in_creation_order_by_the_millisecond() -> None:
    """The 8-character prefix is the creation millisecond in base-62 digits that sort in
    ASCII order, so ids of later milliseconds compare greater as plain text (what a store's
    B-tree index compares)."""
    assert "".join(sorted(SORTABLE)) == SORTABLE
    made = []
    for _ in range(5):
        made.append(default_task_id())
        start = time.time_ns() // 1_000_000
        while time.time_ns() // 1_000_000 == start:  # the next millisecond
            pass
    assert sorted(made) == made
    instants = [id_instant_ms(task_id) for task_id in made]
    assert instants == sorted(set(instants))


async def test_sync_and_optional_policies_and_the_legacy_task_hint_is_ignored(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env = await basic_env(nursery)
    hint = {"ttl": 100, "pollInterval": 1}
    sync = await env.result("tools/call", {"name": "greet", "arguments": {}, "task": hint})
    assert sync == {
        "content": [{"type": "text", "text": "Hello, World!"}],
        "isError": False,
        "resultType": "complete",
        "_meta": {SERVER_INFO_KEY: SERVER_INFO},
    }
    # optional + no declaration: synchronous, even with the legacy hint
    direct = await env.result(
        "tools/call", {"name": "slow", "arguments": {"seconds": 0}, "task": hint}, tasks=False
    )
    assert direct["content"] == [{"type": "text", "text": "Completed x"}]
    assert "taskId" not in direct
    # optional + declaration: a task, and the hint changes nothing about it
    created = await env.result(
        "tools/call", {"name": "slow", "arguments": {"seconds": 0}, "task": hint}
    )
    assert created["resultType"] == "task"
    assert created["ttlMs"] == 3_600_000 and created["pollIntervalMs"] == 250


async def test_required_tool_without_declaration_is_refused_and_nothing_is_stored(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    ids = CountingIds()
    env = await basic_env(nursery, tasks_options={"id_generator": ids})
    error = await env.error("tools/call", {"name": "failing", "arguments": {}}, tasks=False)
    assert error == {
        "code": -32021,
        "message": "Missing required client capability",
        "data": REQUIRED_TASKS,
    }
    assert ids.issued == []
    assert env.runner.statistics().started == 0


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"seconds": 0, "secs": 1}, "unknown argument 'secs' for tool 'slow'"),
        ({"label": "x", "ctx": None}, "unknown argument 'ctx' for tool 'slow'"),
    ],
)
async def test_arguments_the_tool_cannot_take_never_create_a_task(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
    arguments: dict[str, Any],
    message: str,
) -> None:
    ids = CountingIds()
    env = await basic_env(nursery, tasks_options={"id_generator": ids})
    error = await env.error("tools/call", {"name": "slow", "arguments": arguments})
    assert error == {
        "code": -32602,
        "message": message,
        "data": {"tool": "slow", "unknown": [message.split("'")[1]]},
    }
    assert ids.issued == []
    assert env.runner.statistics().started == 0
    # A schema error is an isError result, decided before the task too.
    result = await env.result("tools/call", {"name": "slow", "arguments": {"seconds": "1"}})
    assert result["resultType"] == "complete" and result["isError"] is True
    assert ids.issued == []


# -- outcomes -----------------------------------------------------------------------------------


async def test_tool_error_completes_with_is_error(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env = await basic_env(nursery)
    task_id = await env.create("failing")
    detail = await env.wait_status(task_id, "completed", "failed")
    assert detail["status"] == "completed"
    assert detail["result"]["isError"] is True
    assert detail["result"]["content"] == [{"type": "text", "text": "Actionable task failure"}]
    assert "error" not in detail


async def test_crash_fails_with_internal_error_and_leaks_nothing(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env = await basic_env(nursery)
    task_id = await env.create("crashing")
    detail = await env.wait_status(task_id, "completed", "failed")
    assert detail["status"] == "failed"
    assert detail["error"] == {"code": -32603, "message": "Task tool failed"}
    assert detail["statusMessage"] == "Task tool failed"
    assert "result" not in detail
    assert "private task crash detail" not in json.dumps(detail)
    snapshot = await env.snapshot(task_id)
    assert "private task crash detail" not in repr(snapshot)
    assert "private task crash detail" not in repr(env.events.events)


async def test_worker_returning_a_continuation_fails_without_leaking_request_state(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env = await basic_env(nursery)
    task_id = await env.create("continuation", caps=ELICIT_CAPS)
    detail = await env.wait_status(task_id, "failed")
    assert detail["error"] == {"code": -32603, "message": CONTINUATION}
    assert CONTINUATION.startswith("Task worker returned a continuation")
    assert "private-request-state-xyz" not in json.dumps(detail)
    assert "requestState" not in json.dumps(detail)


async def test_worker_continuation_needing_an_undeclared_capability_fails_with_32021(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env = await basic_env(nursery)
    task_id = await env.create("continuation")  # Tasks declared, elicitation not
    detail = await env.wait_status(task_id, "failed")
    assert detail["error"] == {
        "code": -32021,
        "message": "Missing required client capability",
        "data": {"requiredCapabilities": {"elicitation": {}}},
    }


async def test_invalid_tool_result_is_a_stable_failure(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env = await basic_env(nursery)
    task_id = await env.create("invalid")
    detail = await env.wait_status(task_id, "failed")
    assert detail["error"] == {"code": -32603, "message": "Tool returned an invalid result"}
    assert await env.get(task_id) == detail


# -- the task methods ---------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["tasks/get", "tasks/update", "tasks/cancel"])
async def test_task_methods_need_the_declaration_before_any_lookup(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, method: str
) -> None:
    env = await basic_env(nursery)
    real = await env.create("slow")
    cases: list[dict[str, Any]] = [{"taskId": "bogus"}, {"taskId": real}, {}, {"taskId": ""}]
    for params in cases:
        if method == "tasks/update":
            params = {**params, "inputResponses": {"k": {}}}
        error = await env.error(method, params, tasks=False)
        assert error == {
            "code": -32021,
            "message": "Missing required client capability",
            "data": REQUIRED_TASKS,
        }
    assert (await env.get(real))["status"] == "working"


@pytest.mark.parametrize("method", ["tasks/list", "tasks/result"])
async def test_removed_v1_methods_are_not_found(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, method: str
) -> None:
    env = await basic_env(nursery)
    task_id = await env.create("slow")
    error = await env.error(method, {"taskId": task_id})
    assert error == {"code": -32601, "message": f"Method not found: {method}"}


@pytest.mark.parametrize("method", ["tasks/get", "tasks/update", "tasks/cancel"])
async def test_task_id_validation_and_unknown_ids(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, method: str
) -> None:
    env = await basic_env(nursery)
    extra: dict[str, Any] = {"inputResponses": {"k": {}}} if method == "tasks/update" else {}
    required = {"code": -32602, "message": "A non-empty taskId is required"}
    too_long = {"code": -32602, "message": "taskId is longer than 256 bytes"}
    cases: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({}, required),
        ({"taskId": ""}, required),
        ({"taskId": 7}, required),
        ({"taskId": None}, required),
        ({"taskId": ["a"]}, required),
        ({"taskId": "x" * 257}, too_long),
        ({"taskId": "✓" * 86}, too_long),  # 86 characters, 258 bytes
        ({"taskId": "x" * 256}, unknown()),  # at the limit: valid, just unknown
        ({"taskId": "✓" * 85}, unknown()),  # 255 bytes
        ({"taskId": "no-such-task"}, unknown()),
    ]
    for params, expected in cases:
        assert await env.error(method, {**params, **extra}) == expected, params


@pytest.mark.parametrize(
    ("responses", "message"),
    [
        (None, "tasks/update requires an inputResponses object"),
        ([], "tasks/update requires an inputResponses object"),
        ("yes", "tasks/update requires an inputResponses object"),
        (3, "tasks/update requires an inputResponses object"),
        ({"": {"action": "accept"}}, "inputResponses is invalid"),
        ({"k": 1}, "inputResponses is invalid"),
        ({"k": "accept"}, "inputResponses is invalid"),
        ({"k": [{"action": "accept"}]}, "inputResponses is invalid"),
        ({"k": None}, "inputResponses is invalid"),
        ({"ok": {}, "k": True}, "inputResponses is invalid"),
    ],
)
async def test_malformed_input_responses_are_refused_exactly(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
    responses: Any,
    message: str,
) -> None:
    env = await basic_env(nursery)
    task_id = await env.create("slow")
    before = await env.snapshot(task_id)
    params: dict[str, Any] = {"taskId": task_id}
    if responses is not None:
        params["inputResponses"] = responses
    assert await env.error("tasks/update", params) == {"code": -32602, "message": message}
    # ...even for an unknown task: the shape is checked before the lookup.
    params["taskId"] = "no-such-task"
    assert await env.error("tasks/update", params) == {"code": -32602, "message": message}
    assert await env.snapshot(task_id) == before


async def test_scope_isolation_is_indistinguishable_from_unknown(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env = await basic_env(nursery, scope=by_principal)
    task_id = await env.create("slow", {"seconds": 30}, principal="tenant-a")
    responses = {"inputResponses": {"k": {"action": "accept"}}}
    for method, extra in (("tasks/get", {}), ("tasks/update", responses), ("tasks/cancel", {})):
        foreign = await env.call(method, {"taskId": task_id, **extra}, principal="tenant-b")
        bogus = await env.call(method, {"taskId": "bogus-id", **extra}, principal="tenant-b")
        assert foreign["error"] == bogus["error"] == unknown()
        anonymous = await env.call(method, {"taskId": task_id, **extra})
        assert anonymous["error"] == unknown()
    # The owner still sees it, untouched by the foreign cancel.
    detail = await env.get(task_id, principal="tenant-a")
    assert detail["status"] == "working"
    assert env.history_kinds(task_id) == []
    assert (await env.wait_status(task_id, "completed", principal="tenant-a", interval=1))[
        "result"
    ]["content"] == [{"type": "text", "text": "Completed x"}]


# -- policies and options -----------------------------------------------------------------------


async def test_policy_function_sync_for_the_first_mrtr_round_then_required(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    seen: list[tuple[bool, str]] = []

    def policy(params: Mapping[str, JSONValue], ctx: Context) -> str:
        seen.append((ctx.input_responses is not None, str(params.get("name"))))
        return "required" if ctx.input_responses else "sync"

    def builder(task_id: str, tool: str, arguments: dict[str, JSONValue], ctx: Context) -> Work:
        # The answer of the finished MRTR round becomes part of the durable work.
        answer = ctx.input_response("user_name") or {}
        content = answer.get("content")
        name = content.get("name") if isinstance(content, dict) else None
        return Work.tool_call(task_id, tool, {**arguments, "name": name})

    env = await start_env(
        nursery,
        task_support={"test_tool_with_task": policy},
        tasks_options={"work_builder": builder},
    )

    @env.app.tool()
    async def test_tool_with_task(ctx: Context, name: str | None = None) -> Any:
        """Asks for a name (MRTR), then greets inside a task."""
        if name is None:
            asked = elicitation("Your name?", {"type": "object"})
            return InputRequired({"user_name": asked}, "tasks-composition-round-1")
        return f"Hello, {name}; task completed"

    first = await env.result(
        "tools/call", {"name": "test_tool_with_task", "arguments": {}}, caps=ELICIT_CAPS
    )
    assert first["resultType"] == "input_required"
    assert list(first["inputRequests"]) == ["user_name"]
    state = first["requestState"]
    second = await env.result(
        "tools/call",
        {
            "name": "test_tool_with_task",
            "arguments": {},
            "inputResponses": {"user_name": {"action": "accept", "content": {"name": "Ada"}}},
            "requestState": state,
        },
        caps=ELICIT_CAPS,
    )
    assert second["resultType"] == "task"
    detail = await env.wait_status(second["taskId"], "completed")
    assert detail["result"]["content"] == [{"type": "text", "text": "Hello, Ada; task completed"}]
    assert seen == [(False, "test_tool_with_task"), (True, "test_tool_with_task")]
    work = (await env.snapshot(second["taskId"])).work
    assert work is not None
    assert work.input == {"name": "test_tool_with_task", "arguments": {"name": "Ada"}}


async def test_async_policy_options_override_ttl_poll_and_message(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    async def policy(params: Mapping[str, JSONValue], ctx: Context) -> Any:
        await trio.lowlevel.checkpoint()
        return ("required", TaskOptions(ttl_ms=60_000, poll_interval_ms=5, status_message="Queued"))

    env = await start_env(
        nursery,
        task_support={
            "custom": policy,
            "bare": (
                "optional",
                TaskOptions(ttl_ms=None, poll_interval_ms=None, status_message=None),
            ),
        },
    )

    @env.app.tool()
    async def custom() -> str:
        """Custom options."""
        await trio.sleep(1)
        return "custom"

    @env.app.tool()
    async def bare() -> str:
        """Null options."""
        await trio.sleep(1)
        return "bare"

    custom_task = await env.result("tools/call", {"name": "custom", "arguments": {}})
    assert (custom_task["ttlMs"], custom_task["pollIntervalMs"], custom_task["statusMessage"]) == (
        60_000,
        5,
        "Queued",
    )
    bare_task = await env.result("tools/call", {"name": "bare", "arguments": {}})
    assert bare_task["ttlMs"] is None
    assert "pollIntervalMs" not in bare_task and "statusMessage" not in bare_task
    assert set(bare_task) == {
        "resultType",
        "taskId",
        "status",
        "createdAt",
        "lastUpdatedAt",
        "ttlMs",
        "_meta",
    }
    detail = await env.get(custom_task["taskId"])
    assert detail["statusMessage"] == "Queued" and detail["pollIntervalMs"] == 5


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (lambda p, c: "sometimes", INVALID_DECISION),
        (lambda p, c: ("required", {"ttl_ms": 5}), INVALID_DECISION),
        (lambda p, c: ("later", TaskOptions()), INVALID_DECISION),
        (lambda p, c: 1 / 0, {"code": -32603, "message": "Tasks policy raised"}),
        ("never", INVALID_DECISION),
    ],
)
async def test_bad_policies_fail_closed_and_store_nothing(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
    policy: Any,
    expected: dict[str, Any],
) -> None:
    ids = CountingIds()
    env = await start_env(
        nursery, task_support={"tool": policy}, tasks_options={"id_generator": ids}
    )

    @env.app.tool()
    async def tool() -> str:
        """Never runs."""
        raise AssertionError("must not run")

    assert await env.error("tools/call", {"name": "tool", "arguments": {}}) == expected
    assert ids.issued == []


async def test_policy_may_refuse_with_its_own_json_rpc_error(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    def policy(params: Mapping[str, JSONValue], ctx: Context) -> str:
        raise InvalidParams("label is required for tasks", {"argument": "label"})

    env = await start_env(nursery, task_support={"tool": policy})

    @env.app.tool()
    async def tool() -> str:
        """Never runs."""
        return "no"

    assert await env.error("tools/call", {"name": "tool", "arguments": {}}) == {
        "code": -32602,
        "message": "label is required for tasks",
        "data": {"argument": "label"},
    }


async def test_work_builder_key_mismatch_and_oversized_input_store_nothing(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    ids = CountingIds()

    def builder(task_id: str, tool: str, arguments: dict[str, JSONValue], ctx: Context) -> Work:
        key = "other-key" if arguments.get("mismatch") else task_id
        call = {"name": tool, "arguments": arguments}
        return Work(idempotency_key=key, type="tools/call", input=call)

    env = await start_env(
        nursery,
        task_support={"tool": "required"},
        tasks_options={"id_generator": ids, "work_builder": builder, "max_work_input_bytes": 200},
    )

    @env.app.tool()
    async def tool(mismatch: bool = False, padding: str = "") -> str:
        """Echo."""
        return "ok"

    mismatch = await env.error("tools/call", {"name": "tool", "arguments": {"mismatch": True}})
    assert mismatch == {
        "code": -32603,
        "message": "Task work idempotency key must match its task id",
    }
    big = await env.error("tools/call", {"name": "tool", "arguments": {"padding": "p" * 200}})
    assert big == {"code": -32602, "message": "Task input is larger than 200 bytes"}
    assert ids.issued == ["task-1", "task-2"]
    for task_id in ids.issued:
        assert await env.error("tasks/get", {"taskId": task_id}) == unknown()
    ok = await env.create("tool", {"padding": "p" * 100})
    assert ok == "task-3"


# -- capacity -----------------------------------------------------------------------------------


async def test_beyond_max_jobs_a_task_waits_queued_then_runs(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    ids = CountingIds()
    env = await basic_env(
        nursery, runner_options={"max_jobs": 1}, tasks_options={"id_generator": ids}
    )
    first = await env.create("slow", {"seconds": 10, "label": "one"})
    second = await env.create("slow", {"seconds": 1, "label": "two"})
    assert ids.issued == [first, second] == ["task-1", "task-2"]
    queued = await env.get(second)
    assert (queued["status"], queued["statusMessage"]) == ("working", QUEUED_MESSAGE)
    assert (await env.get(first))["statusMessage"] == "Task accepted"
    assert env.runner.active_task_ids() == [first]
    assert env.runner.statistics().queued == 1
    created = [md["outcome"] for _, md in env.named(ins.TASK_CREATED)]
    assert created == ["created", "queued"]
    await env.wait_status(first, "completed", interval=0.5)
    await wait_stops(env.events, first)
    # The freed slot takes the queued task at once (no poll, no time passes): it starts
    # with its own request context, and its status message is the one it was created with.
    stopped_at = trio.current_time()
    while second not in env.runner.active_task_ids():
        await trio.lowlevel.checkpoint()
    assert trio.current_time() == stopped_at
    assert (await env.get(second))["statusMessage"] == "Task accepted"
    done = await env.wait_status(second, "completed", interval=0.5)
    assert done["result"]["content"] == [{"type": "text", "text": "Completed two"}]
    starts = [(md["task_id"], md["source"]) for _, md in env.named(ins.JOB_START)]
    assert starts == [(first, "request"), (second, "queue")]
    assert env.runner.statistics().queued == 0


async def test_a_queued_task_is_cancelled_and_expires_without_ever_running(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env = await basic_env(
        nursery,
        runner_options={"max_jobs": 1},
        tasks_options={"ttl_ms": 60_000},
    )
    running = await env.create("slow", {"seconds": 120})
    cancelled = await env.create("slow", {"seconds": 1, "label": "cancelled"})
    expiring = await env.create("slow", {"seconds": 1, "label": "expiring"})
    assert (await env.get(cancelled))["statusMessage"] == QUEUED_MESSAGE
    assert await env.result("tasks/cancel", {"taskId": cancelled}) == ACK
    assert (await env.get(cancelled))["status"] == "cancelled"
    # Answers to a queued task are not its own: nothing is waiting for them.
    update = {"taskId": expiring, "inputResponses": {"k": {"action": "accept"}}}
    assert await env.result("tasks/update", update) == ACK
    await trio.sleep(61)  # past the TTL of all three; the first still runs
    assert await env.error("tasks/get", {"taskId": expiring}) == unknown()
    assert await env.error("tasks/get", {"taskId": cancelled}) == unknown()
    await env.runner.reap_once()
    assert env.memory.history(expiring) == []
    starts = [md["task_id"] for _, md in env.named(ins.JOB_START)]
    assert starts == [running]  # neither queued task ever ran


async def test_two_hundred_tasks_at_once_on_four_slots_all_complete(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env = await basic_env(
        nursery,
        runner_options={"max_jobs": 4},
        store_options={"max_tasks": None, "max_active_tasks_per_scope": None},
    )
    ids: list[str] = []

    async def submit(label: int) -> None:
        ids.append(await env.create("slow", {"seconds": 1, "label": str(label)}))

    async with trio.open_nursery() as clients:
        for label in range(200):
            clients.start_soon(submit, label)
    assert len(set(ids)) == 200  # none refused
    for task_id in ids:
        detail = await env.wait_status(task_id, "completed", interval=0.5)
        assert detail["status"] == "completed"
    assert env.runner.statistics().peak_jobs == 4
    starts = [md["task_id"] for _, md in env.named(ins.JOB_START)]
    assert sorted(starts) == sorted(ids)  # each ran exactly once
    # First in first out: queued tasks start in (createdAt, taskId) order (the first four
    # took the free slots as they were created).
    created = {task_id: (await env.snapshot(task_id)).task.created_at for task_id in ids}
    queued = starts[4:]
    assert queued == sorted(queued, key=lambda task_id: (created[task_id], task_id))


async def test_a_signal_with_nothing_queued_does_not_queue_the_creations_after_it(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # A queue signal (a store wake-up, a resync) makes the runner believe claimable work may
    # wait. Its drain is still asking the store when creations arrive with slots free: each
    # must be created already claimed (create, settle: two writes) unless older work waits,
    # never stored queued and drained with claim_next (three writes) behind work that does
    # not exist. Before the fix every creation made during the drain was queued.
    env = await basic_env(
        nursery,
        runner_options={"max_jobs": 4, "recover": True, "recovery_interval_ms": 3_600_000},
    )
    await trio.sleep(1)  # the first recovery pass is over
    inner = env.memory.claim_next
    calls: list[str] = []
    gate = trio.Event()

    async def claim_next(owner_id: str, lease_ms: int) -> Any:
        calls.append(owner_id)
        if len(calls) == 1:
            await gate.wait()  # one of the signal's drain claims (one per free slot), in flight
        return await inner(owner_id, lease_ms)

    env.memory.claim_next = claim_next  # type: ignore[method-assign]
    env.memory._signal()  # nothing is queued
    await trio.testing.wait_all_tasks_blocked()  # one claim per free slot; three answered
    assert len(calls) == 4
    ids = [await env.create("slow", {"seconds": 1, "label": str(n)}) for n in range(3)]
    gate.set()
    for task_id in ids:
        await env.wait_status(task_id, "completed", interval=0.5)
    created = [md["outcome"] for _, md in env.named(ins.TASK_CREATED)]
    assert created == ["created", "created", "created"]
    starts = [(md["task_id"], md["source"]) for _, md in env.named(ins.JOB_START)]
    assert starts == [(task_id, "request") for task_id in ids]
    # Only the drain's four claims (one per free slot, one still in flight holding its slot):
    # the three that found nothing corrected the belief at
    # once (not when the one in flight returned), so no creation was queued or had to ask.
    assert len(calls) == 4
    assert env.runner.statistics().queued == 0
    for task_id in ids:
        assert (await env.snapshot(task_id)).task.status_message != QUEUED_MESSAGE


@pytest.mark.parametrize("limit", ["max_tasks", "max_active_tasks_per_scope"])
async def test_store_limits_refuse_without_storing(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, limit: str
) -> None:
    ids = CountingIds()
    env = await basic_env(
        nursery,
        store_options={limit: 1},
        tasks_options={"id_generator": ids},
        scope=by_principal,
    )
    first = await env.create("slow", {"seconds": 10}, principal="a")
    error = await env.error("tools/call", {"name": "slow", "arguments": {}}, principal="a")
    assert error == {
        "code": -32603,
        "message": "Task capacity exhausted",
        "data": {"retryable": True, "limit": limit, "retryAfterSeconds": 1},
    }
    assert await env.error("tasks/get", {"taskId": "task-2"}, principal="a") == unknown()
    assert env.runner.active_task_ids() == [first]
    await env.wait_status(first, "completed", principal="a", interval=0.5)
    # A finished task is no longer active, but it still counts toward max_tasks.
    response = await env.call("tools/call", {"name": "slow", "arguments": {}}, principal="a")
    if limit == "max_tasks":
        assert response["error"]["data"] == {
            "retryable": True,
            "limit": "max_tasks",
            "retryAfterSeconds": 1,
        }
    else:
        assert response["result"]["taskId"] == "task-3"


# -- the detached worker context ----------------------------------------------------------------


async def test_worker_gets_a_detached_context(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env = await start_env(nursery, task_support={"probe": "required"})
    seen: list[Context] = []
    proceed = trio.Event()

    @env.app.tool()
    async def probe(ctx: Context, secret: str = "") -> str:
        """Records its context."""
        seen.append(ctx)
        await proceed.wait()
        await ctx.progress(1, 2, "ignored")  # no stream, no token: a silent no-op
        await ctx.log("error", "ignored")
        return "probed"

    caps = {**TASKS_CAPS, "elicitation": {"form": {}}}
    request_scope = trio.CancelScope()
    client_info = {"name": "client", "version": "9"}
    created = await env.result(
        "tools/call",
        {"name": "probe", "arguments": {"secret": "s3cr3t-argument"}},
        caps=caps,
        principal={"user": "alice"},
        cancel_scope=request_scope,
        id="request-77",
        meta_extra={
            "progressToken": "progress-1",
            "io.modelcontextprotocol/logLevel": "debug",
            "io.modelcontextprotocol/clientInfo": client_info,
        },
    )
    task_id = created["taskId"]
    request_scope.cancel()  # the request is over; its cancellation must not reach the worker
    await trio.sleep(1)
    (ctx,) = seen
    assert ctx.request_id is None
    assert ctx.transport == "task" and ctx.detached
    assert ctx.meta.progress_token is None
    assert ctx.meta.log_level is None
    assert ctx.meta.raw == {}
    assert ctx.params == {}
    assert ctx.cancel_scope is None and not ctx.cancelled
    assert ctx.input_responses is None and ctx.request_state is None
    assert ctx.principal == {"user": "alice"}
    assert ctx.client_capabilities == caps
    assert ctx.client_info == client_info
    assert ctx.protocol_version == "2026-07-28"
    assert ctx.extensions == {EXTENSION_ID: {}}
    assert ctx.method == "tools/call"
    assert ctx.task_id == task_id and ctx.idempotency_key == task_id
    proceed.set()
    detail = await env.wait_status(task_id, "completed")
    assert detail["result"]["content"] == [{"type": "text", "text": "probed"}]
    # The durable work is the tool call and what the client declared (Work v5's origin, for
    # a context rebuilt elsewhere): no principal, no other metadata, no request identity.
    work = (await env.snapshot(task_id)).work
    assert work is not None
    assert work.to_json() == {
        "version": 5,
        "idempotencyKey": task_id,
        "type": "tools/call",
        "input": {"name": "probe", "arguments": {"secret": "s3cr3t-argument"}},
        "retryPolicy": {"version": 1, "delaysMs": []},
        "traceContext": None,
        "tool": None,
        "origin": {
            "protocolVersion": "2026-07-28",
            "clientCapabilities": caps,
            "clientInfo": client_info,
        },
    }


# -- parked input -------------------------------------------------------------------------------


async def _input_env(nursery: trio.Nursery, **kw: Any) -> Env:
    env = await start_env(
        nursery,
        task_support={"multi_input": "optional", "confirm_delete": "optional", "reuse": "required"},
        **kw,
    )

    @env.app.tool()
    async def multi_input(ctx: Context) -> str:
        """Two concurrent inputs."""
        answers: dict[str, Any] = {}

        async def ask(key: str) -> None:
            answers[key] = await ctx.await_input(
                key, elicitation(f"Value for {key}?", {"type": "object"})
            )

        async with trio.open_nursery() as both:
            both.start_soon(ask, "first-input")
            both.start_soon(ask, "second-input")
        first = answers["first-input"]["content"]["value"]
        second = answers["second-input"]["content"]["value"]
        return f"Inputs received: {first}, {second}"

    @env.app.tool()
    async def confirm_delete(ctx: Context) -> dict[str, Any]:
        """One input, replayable."""
        answer = await ctx.await_input("confirm-delete", CONFIRM)
        return {"confirmation": answer}

    @env.app.tool()
    async def reuse(ctx: Context, same: bool = False) -> str:
        """Asks twice under one key."""
        await ctx.await_input("k", elicitation("First?", {"type": "object"}))
        request = elicitation("First?" if same else "Second?", {"type": "object"})
        again = await ctx.await_input("k", request)
        return f"again: {again['action']}"

    return env


def _accept(value: str) -> dict[str, Any]:
    return {"action": "accept", "content": {"value": value}}


async def test_partial_answers_keep_the_rest_parked(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env = await _input_env(nursery)
    task_id = await env.create("multi_input", caps=ELICIT_CAPS)
    parked = await env.wait_status(task_id, "input_required")
    await trio.sleep(0.5)
    parked = await env.get(task_id)
    assert parked["inputRequests"] == {
        "first-input": elicitation("Value for first-input?", {"type": "object"}),
        "second-input": elicitation("Value for second-input?", {"type": "object"}),
    }
    revision = (await env.snapshot(task_id)).revision
    assert revision == 2

    # Unknown or never-issued keys are ignored: success, no change.
    ack = await env.result(
        "tasks/update", {"taskId": task_id, "inputResponses": {"nope": _accept("z")}}
    )
    assert ack == ACK
    assert (await env.snapshot(task_id)).revision == revision

    assert (
        await env.result(
            "tasks/update", {"taskId": task_id, "inputResponses": {"first-input": _accept("a")}}
        )
        == ACK
    )
    partial = await env.get(task_id)
    assert partial["status"] == "input_required"
    assert list(partial["inputRequests"]) == ["second-input"]
    # Answering it again changes nothing (already answered keys are ignored).
    assert (
        await env.result(
            "tasks/update", {"taskId": task_id, "inputResponses": {"first-input": _accept("X")}}
        )
        == ACK
    )
    assert (await env.get(task_id)) == partial

    assert (
        await env.result(
            "tasks/update", {"taskId": task_id, "inputResponses": {"second-input": _accept("b")}}
        )
        == ACK
    )
    done = await env.wait_status(task_id, "completed")
    assert done["result"]["content"] == [{"type": "text", "text": "Inputs received: a, b"}]
    assert "inputRequests" not in done
    kinds = env.history_kinds(task_id)
    assert kinds == [
        "input_requested",
        "input_requested",
        "input_responses_accepted",
        "input_responses_accepted",
        "completed",
    ]


async def test_update_resumes_with_the_answer(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env = await _input_env(nursery)
    task_id = await env.create("confirm_delete", caps=ELICIT_CAPS)
    parked = await env.wait_status(task_id, "input_required")
    assert parked["inputRequests"] == {"confirm-delete": CONFIRM}
    assert parked["statusMessage"] == "Task accepted"
    answer = {"action": "accept", "content": {"confirmed": True}}
    update = {"taskId": task_id, "inputResponses": {"confirm-delete": answer}}
    assert await env.result("tasks/update", update) == ACK
    done = await env.wait_status(task_id, "completed")
    assert done["result"]["structuredContent"] == {"confirmation": answer}
    assert "inputRequests" not in done


@pytest.mark.parametrize("same", [False, True])
async def test_an_input_key_is_never_reused_with_a_different_request(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, same: bool
) -> None:
    env = await _input_env(nursery)
    task_id = await env.create("reuse", {"same": same}, caps=ELICIT_CAPS)
    await env.wait_status(task_id, "input_required")
    update = {"taskId": task_id, "inputResponses": {"k": {"action": "accept"}}}
    assert await env.result("tasks/update", update) == ACK
    detail = await env.wait_status(task_id, "completed", "failed")
    if same:
        # The same request under the same key replays the accepted answer.
        assert detail["result"]["content"] == [{"type": "text", "text": "again: accept"}]
    else:
        message = "Input key 'k' was reused with a different request"
        assert detail["error"] == {"code": -32603, "message": message}
        assert detail["statusMessage"] == message
    assert env.history_kinds(task_id) == [
        "input_requested",
        "input_responses_accepted",
        "completed" if same else "failed",
    ]


@pytest.mark.parametrize("answered_before_recovery", [True, False])
@pytest.mark.contract("tasks-recovery-claims")
async def test_accepted_input_is_replayed_after_recovery_without_a_new_request(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, answered_before_recovery: bool
) -> None:
    env = await _input_env(nursery)
    task_id = await env.create("confirm_delete", caps=ELICIT_CAPS)
    await env.wait_status(task_id, "input_required")
    env.runner.stop()  # the first runner goes away while the task waits for input
    await env.runner.wait_stopped()
    answer = {"action": "accept", "content": {"confirmed": False}}
    update = {"taskId": task_id, "inputResponses": {"confirm-delete": answer}}
    if answered_before_recovery:
        assert await env.result("tasks/update", update) == ACK  # accepted by the store alone
        assert (await env.get(task_id))["status"] == "working"

    recovering = Runner(env.memory, recover=True, reap_interval_ms=None, instrumentation=env.events)
    recovering.set_default_executor(ToolCallExecutor(env.app))
    await nursery.start(recovering.run)
    if not answered_before_recovery:
        # The recovered attempt re-attaches to the outstanding request: no new event.
        await trio.sleep(5)
        assert (await env.get(task_id))["inputRequests"] == {"confirm-delete": CONFIRM}
        assert env.history_kinds(task_id) == ["input_requested"]
        assert await env.result("tasks/update", update) == ACK
    done = await env.wait_status(task_id, "completed")
    assert done["result"]["structuredContent"] == {"confirmation": answer}
    assert env.history_kinds(task_id) == [
        "input_requested",
        "input_responses_accepted",
        "completed",
    ]
    starts = [md["source"] for _, md in env.named(ins.JOB_START) if md["task_id"] == task_id]
    assert starts == ["request", "recovery"]
    recovering.stop()


async def test_time_fields_are_store_clock_iso(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env = await basic_env(nursery)
    await trio.sleep(1.5)
    task_id = await env.create("slow", {"seconds": 2.25})
    done = await env.wait_status(task_id, "completed", interval=0.25)
    assert done["createdAt"] == format_instant(START_US + 1_500_000)
    assert done["lastUpdatedAt"] == format_instant(START_US + 3_750_000)
    (stop,) = await wait_stops(env.events, task_id)
    assert stop["outcome"] == "completed"
