"""The work descriptor through the extension (reference 4.1, 4.3): the default ``tools/call``
work keyed by the task id, the work builder as the security boundary (checked in the memory
store's records and in a SQLite file's bytes), refusals that store nothing, the input size
limit to the byte, and the executor receiving exactly the persisted Work on every claim.

(The ``Work`` v2 codec itself is covered in ``test_codecs.py``.)
"""

from __future__ import annotations

import functools
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from helpers import (
    TASKS_CAPS,
    TEST_STATE_KEY,
    ScriptedExecutor,
    all_strings,
    poll,
    request,
    start_env,
)
from tritask_sqlite import SqliteStore

from tritask.jsonrpc import JSONValue
from tritask.server.app import App
from tritask.server.context import Context
from tritask.server.dispatcher import Dispatcher
from tritask.tasks import instrumentation as ins
from tritask.tasks.events import effects_to_json
from tritask.tasks.executor import Completed, ExecutionToken, Outcome, Retry
from tritask.tasks.extension import Tasks
from tritask.tasks.instrumentation import RecordingInstrumentation
from tritask.tasks.model import Snapshot, snapshot_to_json
from tritask.tasks.runner import Runner
from tritask.tasks.store import Action, TaskQuery
from tritask.tasks.work import RetryPolicy, Work, canonical_json

pytestmark = pytest.mark.contract("tasks-work-descriptor")

SECRET = "bearer-7f3a-very-secret-credential"
PRINCIPAL = {"tenant": "acme", "token": SECRET}
DONE: dict[str, Any] = {"content": [{"type": "text", "text": "done"}], "isError": False}


def by_tenant(ctx: Any) -> JSONValue:
    """A scope that is itself a projection: the tenant, never the credential."""
    tenant: JSONValue = ctx.principal["tenant"]
    return tenant


def projecting_builder(task_id: str, tool: str, arguments: dict[str, Any], ctx: Context) -> Work:
    """The security boundary: persist the tenant the work needs, not the request's token."""
    return Work(
        idempotency_key=task_id,
        type="tools/call",
        input={
            "name": tool,
            "arguments": arguments,
            "principal": {"tenant": ctx.principal["tenant"]},
        },
    )


class Ids:
    def __init__(self) -> None:
        self.issued: list[str] = []

    def __call__(self) -> str:
        self.issued.append(f"task-{len(self.issued) + 1}")
        return self.issued[-1]


# -- the default work and what executors receive ------------------------------------------------


async def test_default_work_is_the_tool_call_keyed_by_the_task_id_and_every_claim_gets_it(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """Initial claim (request), then a retry on a new runner (recovered claim): both attempts
    receive the persisted Work exactly, and nothing of the request besides it."""
    received: list[tuple[Work, ExecutionToken]] = []

    async def script(work: Work, token: ExecutionToken) -> Outcome:
        received.append((work, token))
        if len(received) == 1:
            return Retry({"code": -32000, "message": "later"}, None)
        return Completed(DONE)

    executor = ScriptedExecutor(script)
    env = await start_env(
        nursery,
        task_support={"echo": "required"},
        tasks_options={"retry_policy": RetryPolicy([5_000])},
        runner_options={"executor": executor},
    )

    @env.app.tool()
    async def echo(text: str, n: int = 1) -> str:
        """Executed by the scripted executor only."""
        raise AssertionError("not called")

    task_id = await env.create("echo", {"text": "hi", "n": 3}, principal=PRINCIPAL)
    await trio.sleep(1)
    env.runner.stop()  # during the backoff
    await env.runner.wait_stopped()
    persisted = (await env.snapshot(task_id)).work
    assert persisted is not None
    assert persisted.to_json() == {
        "version": 5,
        "idempotencyKey": task_id,
        "type": "tools/call",
        "input": {"name": "echo", "arguments": {"text": "hi", "n": 3}},
        "retryPolicy": {"version": 1, "delaysMs": [5_000]},
        "traceContext": None,
        "tool": None,
        "origin": {
            "protocolVersion": "2026-07-28",
            "clientCapabilities": TASKS_CAPS,
            "clientInfo": None,
        },
    }

    recovering = Runner(
        env.memory,
        executor=executor,
        recover=True,
        reap_interval_ms=None,
        instrumentation=env.events,
    )
    await nursery.start(recovering.run)
    await trio.sleep(10)
    assert (await env.get(task_id))["status"] == "completed"
    (first, first_token), (second, second_token) = received
    assert first == second == persisted
    assert first.to_json() == second.to_json() == persisted.to_json()
    assert (first_token.generation, first_token.recovered) == (1, False)
    assert (second_token.generation, second_token.recovered) == (2, True)
    assert first_token.idempotency_key == second_token.idempotency_key == task_id
    # Only the accepting process had a (detached) request context; the recovered claim has
    # the Work alone.
    assert first_token.context is not None and first_token.context.detached
    assert second_token.context is None
    assert [md["source"] for _, md in env.named(ins.JOB_START)] == ["request", "recovery"]
    recovering.stop()


# -- the work builder is the security boundary ---------------------------------------------------


async def test_a_work_builder_persists_only_its_projection_in_the_memory_store(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env = await start_env(
        nursery,
        task_support={"export": "required"},
        scope=by_tenant,
        tasks_options={"work_builder": projecting_builder},
    )
    principals: list[Any] = []

    @env.app.tool()
    async def export(ctx: Context, document: str) -> str:
        """The first attempt is stopped; the recovered one finishes."""
        principals.append(ctx.principal)
        if len(principals) == 1:
            await trio.sleep_forever()
        return f"exported {document} for {ctx.principal['tenant']}"

    task_id = await env.create("export", {"document": "q3"}, principal=PRINCIPAL)
    await trio.sleep(1)
    env.runner.stop()
    await env.runner.wait_stopped()
    recovering = Runner(env.memory, recover=True, reap_interval_ms=None, instrumentation=env.events)
    env.tasks.runner = recovering  # wires the app's ToolCallExecutor
    await nursery.start(recovering.run)
    detail = await env.wait_status(task_id, "completed", principal=PRINCIPAL)
    assert detail["result"]["content"] == [{"type": "text", "text": "exported q3 for acme"}]
    # The accepting process's attempt saw the request's principal; the recovered attempt sees
    # only what the builder persisted.
    assert principals == [PRINCIPAL, {"tenant": "acme"}]

    snapshot = await env.snapshot(task_id, ctx=_Ctx(PRINCIPAL))
    assert snapshot.work is not None
    assert snapshot.work.input == {
        "name": "export",
        "arguments": {"document": "q3"},
        "principal": {"tenant": "acme"},
    }
    stored = [
        json.dumps(snapshot_to_json(snapshot)),
        *(json.dumps(entry.event.to_json()) for entry in env.memory.history(task_id)),
        repr(env.events.events),
    ]
    for text in stored:
        assert SECRET not in text
    assert SECRET not in all_strings(snapshot_to_json(snapshot))
    recovering.stop()


class _Ctx:
    def __init__(self, principal: Any) -> None:
        self.principal = principal


async def test_a_work_builder_persists_only_its_projection_in_a_sqlite_file(
    tmp_path: Path,
) -> None:
    """Real clock and the database clock: nothing anywhere in the database directory (the
    file, its WAL and lock files), open or closed, contains the credential."""
    path = tmp_path / "tasks.db"
    app = App("work-test", "0.1.0", state_key=TEST_STATE_KEY)
    finished = trio.Event()

    @app.tool()
    async def export(ctx: Context, document: str) -> str:
        """Exports."""
        finished.set()
        return f"exported {document} for {ctx.principal['tenant']}"

    async with (
        SqliteStore(path, scope=by_tenant, exclusive=True) as store,
        Runner(store, reap_interval_ms=None) as runner,
    ):
        tasks = Tasks(
            store=store,
            runner=runner,
            task_support={"export": "required"},
            work_builder=projecting_builder,
        )
        app.add_extension(tasks)
        call = request("tools/call", {"name": "export", "arguments": {"document": "q3"}})
        response = await Dispatcher(app).handle_request(call, principal=PRINCIPAL)
        task_id = response["result"]["taskId"]
        access = await store.authorize(_Ctx(PRINCIPAL), Action.GET, task_id)

        async def completed() -> Snapshot | None:
            snapshot = await store.get(task_id, access)
            assert isinstance(snapshot, Snapshot)
            return snapshot if snapshot.task.status == "completed" else None

        with trio.fail_after(30):
            await finished.wait()
            snapshot = await poll(completed)
        assert snapshot.work is not None
        assert snapshot.work.input["principal"] == {"tenant": "acme"}
        ledger = await store.history(task_id)
        assert [entry.event.kind.value for entry in ledger] == ["completed"]
        for entry in ledger:
            assert SECRET not in json.dumps(effects_to_json(entry.effects))
        open_bytes = await trio.to_thread.run_sync(_directory_bytes, tmp_path)
        assert SECRET.encode() not in open_bytes
    closed_bytes = await trio.to_thread.run_sync(_directory_bytes, tmp_path)
    assert SECRET.encode() not in closed_bytes
    # (the data itself is there: the projection, the arguments and the result)
    assert b'"tenant":"acme"' in closed_bytes
    assert b"exported q3 for acme" in closed_bytes
    with sqlite3.connect(path) as conn:
        (scope,) = conn.execute("SELECT scope FROM tritask_tasks").fetchone()
        assert json.loads(scope) == {"version": 1, "value": "acme"}
    conn.close()


async def _stopped(events: RecordingInstrumentation, task_id: str) -> bool | None:
    await trio.lowlevel.checkpoint()
    return any(md["task_id"] == task_id for _, md in events.named(ins.JOB_STOP)) or None


def _directory_bytes(directory: Path) -> bytes:
    return b"".join(path.read_bytes() for path in sorted(directory.iterdir()) if path.is_file())


# -- refusals store nothing ----------------------------------------------------------------------


def _bad_builders() -> dict[str, Any]:
    def mismatched_key(task_id: str, tool: str, arguments: dict[str, Any], ctx: Context) -> Work:
        return Work(idempotency_key=task_id + "-x", type="tools/call", input={"name": tool})

    def raises(task_id: str, tool: str, arguments: dict[str, Any], ctx: Context) -> Work:
        raise KeyError("builder bug")

    def not_work(task_id: str, tool: str, arguments: dict[str, Any], ctx: Context) -> Any:
        return {"idempotencyKey": task_id}

    return {"mismatched_key": mismatched_key, "raises": raises, "not_work": not_work}


async def test_refused_creations_store_nothing_and_the_input_limit_is_exact_to_the_byte(
    tmp_path: Path,
) -> None:
    path = tmp_path / "tasks.db"
    empty = len(canonical_json({"name": "pad", "arguments": {"padding": ""}}).encode("utf-8"))
    limit = empty + 10
    ids = Ids()
    builders = _bad_builders()

    def builder(task_id: str, tool: str, arguments: dict[str, Any], ctx: Context) -> Work:
        bad = builders.get(str(arguments.get("padding")))
        if bad is not None:
            result: Work = bad(task_id, tool, arguments, ctx)
            return result
        return Work.tool_call(task_id, tool, arguments)

    app = App("work-test", "0.1.0", state_key=TEST_STATE_KEY)

    @app.tool()
    async def pad(padding: str) -> str:
        """Pads."""
        return "padded"

    events = RecordingInstrumentation()
    async with (
        SqliteStore(path, scope="shared", exclusive=True) as store,
        Runner(store, reap_interval_ms=None, instrumentation=events) as runner,
    ):
        app.add_extension(
            Tasks(
                store=store,
                runner=runner,
                task_support={"pad": "required"},
                work_builder=builder,
                max_work_input_bytes=limit,
                id_generator=ids,
            )
        )

        async def call(padding: str) -> dict[str, Any]:
            message = request("tools/call", {"name": "pad", "arguments": {"padding": padding}})
            response: dict[str, Any] = await Dispatcher(app).handle_request(message)
            return response

        outcomes = {}
        for label, padding in (
            ("mismatched_key", "mismatched_key"),
            ("raises", "raises"),
            ("not_work", "not_work"),
            ("one byte over", "é" * 5 + "x"),  # 11 bytes (é is 2 bytes in UTF-8)
            ("at the limit", "é" * 5),  # 10 bytes
            ("ascii at the limit", "x" * 10),
        ):
            outcomes[label] = await call(padding)
        with trio.fail_after(30):
            for task_id in ("task-5", "task-6"):
                await poll(functools.partial(_stopped, events, task_id))

    errors = {label: r.get("error") for label, r in outcomes.items()}
    assert errors == {
        "mismatched_key": {
            "code": -32603,
            "message": "Task work idempotency key must match its task id",
        },
        "raises": {"code": -32603, "message": "Task work builder failed"},
        "not_work": {"code": -32603, "message": "Task work builder must return a Work"},
        "one byte over": {"code": -32602, "message": f"Task input is larger than {limit} bytes"},
        "at the limit": None,
        "ascii at the limit": None,
    }
    assert SECRET not in json.dumps(outcomes)
    assert ids.issued == [f"task-{n}" for n in range(1, 7)]
    assert outcomes["at the limit"]["result"]["taskId"] == "task-5"
    with sqlite3.connect(path) as conn:
        stored = [row[0] for row in conn.execute("SELECT task_id FROM tritask_tasks ORDER BY 1")]
        ledger = [row[0] for row in conn.execute("SELECT task_id FROM tritask_task_events")]
    conn.close()
    assert stored == ["task-5", "task-6"]  # the four refused ids were never written
    assert sorted(ledger) == ["task-5", "task-6"]


# -- what the client declared: persisted with default work (Work v5's origin) -------------------


@pytest.mark.parametrize("persist_origin", [True, False])
async def test_a_resumed_attempt_sees_the_client_as_the_creating_request_declared_it(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, persist_origin: bool
) -> None:
    """An attempt recovered by another runner (its context rebuilt from the work, as on another
    host) sees the protocol version, client capabilities and client info the first attempt got
    from the request; the principal and ``ctx.auth`` stay the request's (not persisted). With
    ``persist_origin=False`` (a rolling upgrade) the work is version 2, as earlier releases
    wrote it, and the rebuilt context knows nothing of the client."""
    env = await start_env(
        nursery,
        task_support={"probe": "required"},
        tasks_options={"persist_origin": persist_origin},
    )
    seen: list[Context] = []

    @env.app.tool()
    async def probe(ctx: Context) -> str:
        """The first attempt is stopped; the recovered one finishes."""
        seen.append(ctx)
        if len(seen) == 1:
            await trio.sleep_forever()
        return "done"

    caps: dict[str, JSONValue] = {**TASKS_CAPS, "elicitation": {"form": {}}, "sampling": {}}
    info: dict[str, JSONValue] = {"name": "client", "version": "9"}
    task_id = await env.create(
        "probe",
        caps=caps,
        principal={"user": "alice"},
        meta_extra={"io.modelcontextprotocol/clientInfo": info},
    )
    await trio.sleep(1)
    env.runner.stop()
    await env.runner.wait_stopped()
    recovering = Runner(env.memory, recover=True, reap_interval_ms=None, instrumentation=env.events)
    env.tasks.runner = recovering  # wires the app's ToolCallExecutor
    await nursery.start(recovering.run)
    await env.wait_status(task_id, "completed")
    first, resumed = seen
    assert [md["source"] for _, md in env.named(ins.JOB_START)] == ["request", "recovery"]
    if not persist_origin:
        work = (await env.snapshot(task_id)).work
        assert work is not None and work.to_json()["version"] == 2
        assert (first.client_capabilities, resumed.client_capabilities) == (caps, {})
        assert resumed.client_info is None
        recovering.stop()
        return
    for ctx in (first, resumed):
        assert ctx.detached
        assert (ctx.protocol_version, ctx.client_capabilities, ctx.client_info) == (
            "2026-07-28",
            caps,
            info,
        )
        assert ctx.has_capability("elicitation") and ctx.has_capability("sampling")
    assert (first.principal, resumed.principal) == ({"user": "alice"}, None)
    assert resumed.auth is None
    # The rebuilt context owns its copy: changing it changes nothing stored.
    resumed.meta.client_capabilities["roots"] = {}
    work = (await env.snapshot(task_id)).work
    assert work is not None and work.origin is not None
    assert work.origin.client_capabilities == caps
    recovering.stop()


async def test_what_the_client_declared_counts_against_the_work_input_limit(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """The persisted declaration comes from the client, so it is bounded with the input: the
    input ``{"arguments":{},"name":"echo"}`` (30 bytes), the capabilities (51 bytes for the
    extension alone) and the client info (``null``, 4 bytes) make 85 bytes."""
    env = await start_env(
        nursery, task_support={"echo": "required"}, tasks_options={"max_work_input_bytes": 85}
    )

    @env.app.tool()
    async def echo() -> str:
        """Returns."""
        return "echoed"

    at_the_limit = await env.create("echo")
    await env.wait_status(at_the_limit, "completed")
    larger = {**TASKS_CAPS, "experimental": {}}  # 18 bytes more
    error = await env.error("tools/call", {"name": "echo", "arguments": {}}, caps=larger)
    assert error == {"code": -32602, "message": "Task input is larger than 85 bytes"}
    listing = await env.memory.list_tasks(TaskQuery())
    assert [task.task_id for task in listing.tasks] == [at_the_limit]
