"""Shared builders for the Tasks runtime tests.

``start_env`` wires an ``App`` + ``Tasks`` + ``MemoryStore(clock=TrioClock(...))`` + ``Runner``
and starts the runner in the caller's nursery, so under ``MockClock(autojump_threshold=0)``
(pytest-trio's ``autojump_clock`` fixture) leases, TTLs, heartbeats and runtimes are exact.
Requests declare Tasks per request in ``_meta`` (2026-07-28 is stateless).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Awaitable, Callable, Mapping
from types import SimpleNamespace
from typing import Any, Self, TypeVar

import attrs
import trio

from tritask.jsonrpc import JSONValue, Request
from tritask.protocol.meta import CLIENT_CAPABILITIES_KEY, PROTOCOL_VERSION_KEY
from tritask.server.app import App
from tritask.server.context import Emit
from tritask.server.dispatcher import Dispatcher
from tritask.tasks import TrioClock, format_instant, parse_instant
from tritask.tasks.events import Event
from tritask.tasks.executor import Completed, ExecutionToken, Outcome
from tritask.tasks.extension import EXTENSION_ID, Tasks
from tritask.tasks.instrumentation import JOB_STOP, RecordingInstrumentation
from tritask.tasks.memory import MemoryStore
from tritask.tasks.model import Snapshot, TaskStatus, new_task
from tritask.tasks.runner import Runner
from tritask.tasks.store import (
    Access,
    Action,
    Authority,
    Claimed,
    Conflict,
    Deferred,
    Lease,
    NotFound,
    Scope,
    Store,
    Transition,
    Unavailable,
)
from tritask.tasks.work import Work

T = TypeVar("T")

VERSION = "2026-07-28"
TEST_STATE_KEY = "tritask-test-state-key-0123456789"
START_US = parse_instant("2026-08-24T10:00:00.000Z")
TASKS_CAPS: dict[str, JSONValue] = {"extensions": {EXTENSION_ID: {}}}
ELICIT_CAPS: dict[str, JSONValue] = {"extensions": {EXTENSION_ID: {}}, "elicitation": {}}
UNKNOWN_TASK = "Unknown or inaccessible taskId"
ISO_MS = r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$"
DONE: dict[str, Any] = {"content": [{"type": "text", "text": "done"}], "isError": False}
"""A tool result: one text block, ``done``."""


def by_principal(ctx: Any) -> JSONValue:
    """A store scope: one tenant per principal."""
    principal: JSONValue = ctx.principal
    return principal


# -- requests -----------------------------------------------------------------------------------


def meta(
    *, tasks: bool = True, caps: Mapping[str, JSONValue] | None = None, **extra: JSONValue
) -> dict[str, JSONValue]:
    """``params._meta`` of one request; ``tasks`` declares the extension for this request only."""
    capabilities = dict(caps) if caps is not None else (dict(TASKS_CAPS) if tasks else {})
    return {PROTOCOL_VERSION_KEY: VERSION, CLIENT_CAPABILITIES_KEY: capabilities, **extra}


def request(
    method: str,
    params: Mapping[str, JSONValue] | None = None,
    *,
    id: str | int = 1,
    tasks: bool = True,
    caps: Mapping[str, JSONValue] | None = None,
    meta_extra: Mapping[str, JSONValue] | None = None,
) -> Request:
    body: dict[str, JSONValue] = dict(params or {})
    body["_meta"] = meta(tasks=tasks, caps=caps, **dict(meta_extra or {}))
    return Request(id=id, method=method, params=body)


def body(method: str, params: Mapping[str, JSONValue] | None = None, **kw: Any) -> bytes:
    """The JSON body of ``request(...)`` (for HTTP tests)."""
    req = request(method, params, **kw)
    return json.dumps(
        {"jsonrpc": "2.0", "id": req.id, "method": req.method, "params": req.params}
    ).encode()


def http_headers(
    method: str,
    *,
    name: str | None = None,
    names: tuple[str, ...] = (),
    version: str = VERSION,
) -> list[tuple[str, str]]:
    """Streamable HTTP request headers; ``names`` sends ``Mcp-Name`` several times."""
    headers = [
        ("content-type", "application/json"),
        ("accept", "application/json, text/event-stream"),
        ("mcp-protocol-version", version),
        ("mcp-method", method),
    ]
    for value in (name,) if name is not None else names:
        headers.append(("mcp-name", value))
    return headers


class Recorder:
    """An ``emit`` that keeps every message a handler streamed."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self._changed = trio.Event()

    async def __call__(self, message: dict[str, JSONValue]) -> None:
        self.messages.append(message)
        self._changed.set()
        self._changed = trio.Event()
        await trio.lowlevel.checkpoint()

    def of(self, method: str) -> list[dict[str, Any]]:
        return [m["params"] for m in self.messages if m.get("method") == method]

    async def wait_for(self, count: int, *, limit: float = 60.0) -> list[dict[str, Any]]:
        """Wait (on trio's clock) until at least ``count`` messages have been streamed."""
        with trio.fail_after(limit):
            while len(self.messages) < count:
                await self._changed.wait()
        return self.messages


# -- the environment ----------------------------------------------------------------------------


@attrs.define(eq=False)
class Env:
    app: App
    tasks: Tasks
    store: Store
    memory: MemoryStore
    runner: Runner
    events: RecordingInstrumentation
    clock: TrioClock
    _ids: itertools.count[int] = attrs.field(factory=lambda: itertools.count(1))

    async def call(
        self,
        method: str,
        params: Mapping[str, JSONValue] | None = None,
        *,
        tasks: bool = True,
        caps: Mapping[str, JSONValue] | None = None,
        principal: Any = None,
        emit: Emit | None = None,
        cancel_scope: trio.CancelScope | None = None,
        id: str | int | None = None,
        meta_extra: Mapping[str, JSONValue] | None = None,
    ) -> dict[str, Any]:
        """The response message (result or error) of one in-process request."""
        req = request(
            method,
            params,
            id=next(self._ids) if id is None else id,
            tasks=tasks,
            caps=caps,
            meta_extra=meta_extra,
        )
        response: dict[str, Any] = await Dispatcher(self.app).handle_request(
            req, principal=principal, emit=emit, cancel_scope=cancel_scope
        )
        return response

    async def result(self, method: str, params: Mapping[str, Any] | None = None, **kw: Any) -> Any:
        response = await self.call(method, params, **kw)
        assert "error" not in response, response
        return response["result"]

    async def error(
        self, method: str, params: Mapping[str, Any] | None = None, **kw: Any
    ) -> dict[str, Any]:
        response = await self.call(method, params, **kw)
        assert "result" not in response, response
        error: dict[str, Any] = response["error"]
        return error

    async def create(self, tool: str, arguments: Mapping[str, Any] | None = None, **kw: Any) -> str:
        """Call ``tool`` expecting a ``CreateTaskResult``; returns the task id."""
        result = await self.result(
            "tools/call", {"name": tool, "arguments": dict(arguments or {})}, **kw
        )
        assert result["resultType"] == "task", result
        task_id: str = result["taskId"]
        return task_id

    async def get(self, task_id: str, **kw: Any) -> dict[str, Any]:
        result: dict[str, Any] = await self.result("tasks/get", {"taskId": task_id}, **kw)
        return result

    async def wait_status(
        self, task_id: str, *statuses: str, interval: float = 0.01, limit: int = 100_000, **kw: Any
    ) -> dict[str, Any]:
        """Poll ``tasks/get`` until the task is in one of ``statuses``."""

        async def probe() -> dict[str, Any] | None:
            detail = await self.get(task_id, **kw)
            return detail if detail["status"] in statuses else None

        return await poll(probe, interval=interval, limit=limit)

    async def snapshot(self, task_id: str, ctx: Any = None) -> Snapshot:
        """The store's record through a get access (``ctx`` defaults to an anonymous caller)."""
        access = await self.memory.authorize(
            ctx or SimpleNamespace(principal=None), Action.GET, task_id
        )
        snapshot = await self.memory.get(task_id, access)
        assert isinstance(snapshot, Snapshot), snapshot
        return snapshot

    def history_kinds(self, task_id: str) -> list[str]:
        return [entry.event.kind.value for entry in self.memory.history(task_id)]

    def named(self, name: str) -> list[tuple[dict[str, float | int], dict[str, Any]]]:
        return self.events.named(name)

    def now_iso(self) -> str:
        return format_instant(self.clock())


async def wait_stops(
    events: RecordingInstrumentation, task_id: str, count: int = 1
) -> list[dict[str, Any]]:
    """The job-stop metadata of ``task_id`` once ``count`` attempts have stopped.

    A status change is visible as soon as it is committed, a moment before the attempt has
    released its lease and emitted its stop event; this waits on checkpoints only, so trio's
    clock does not move.
    """
    for _ in range(100_000):
        found = [md for _, md in events.named(JOB_STOP) if md["task_id"] == task_id]
        if len(found) >= count:
            return found
        await trio.lowlevel.checkpoint()
    raise AssertionError(f"task {task_id} never stopped {count} time(s)")


async def poll(
    probe: Callable[[], Awaitable[T | None]], *, interval: float = 0.01, limit: int = 100_000
) -> T:
    """Call ``probe`` until it returns something other than ``None`` (sleeping ``interval``)."""
    for _ in range(limit):
        value = await probe()
        if value is not None:
            return value
        await trio.sleep(interval)
    raise AssertionError("poll: condition never held")


async def start_env(
    nursery: trio.Nursery,
    *,
    task_support: Mapping[str, Any] | None = None,
    store: Store | Callable[[MemoryStore], Store] | None = None,
    scope: Scope = "shared",
    store_options: Mapping[str, Any] | None = None,
    runner_options: Mapping[str, Any] | None = None,
    tasks_options: Mapping[str, Any] | None = None,
    app: App | None = None,
    clock: TrioClock | None = None,
) -> Env:
    """Build app + Tasks + MemoryStore(TrioClock) + Runner; start the runner in ``nursery``.

    ``store`` may wrap the memory store (``lambda memory: Wrapper(memory)``).
    """
    clock = clock or TrioClock(START_US)
    memory = MemoryStore(scope=scope, clock=clock, **dict(store_options or {}))
    wrapped: Store = store(memory) if callable(store) else (store or memory)
    events = RecordingInstrumentation()
    options = {"reap_interval_ms": None, **dict(runner_options or {})}
    options.setdefault("instrumentation", events)
    runner = Runner(wrapped, **options)
    await nursery.start(runner.run)
    app = app or App("tasks-test", "0.1.0", state_key=TEST_STATE_KEY)
    tasks = Tasks(
        store=wrapped, runner=runner, task_support=task_support, **dict(tasks_options or {})
    )
    app.add_extension(tasks)
    return Env(
        app=app,
        tasks=tasks,
        store=wrapped,
        memory=memory,
        runner=runner,
        events=events,
        clock=clock,
    )


# -- runner-level helpers -------------------------------------------------------------------------

ANONYMOUS = SimpleNamespace(principal=None)


async def create_raw(
    store: Store,
    runner: Runner,
    task_id: str,
    *,
    work: Work | None = None,
    ttl_ms: int | None = 3_600_000,
    ctx: Any = ANONYMOUS,
) -> Snapshot:
    """Create and start a task on ``runner`` without the extension (work type ``job``)."""
    access = await store.authorize(ctx, Action.CREATE, task_id)
    task = new_task(task_id, await store.now(), ttl_ms, 100)
    work = work or Work(idempotency_key=task_id, type="job", input={"taskId": task_id})
    return await runner.create_task(task, work, access)


async def raw_snapshot(store: Store, task_id: str, ctx: Any = ANONYMOUS) -> Snapshot | NotFound:
    access = await store.authorize(ctx, Action.GET, task_id)
    return await store.get(task_id, access)


JobFn = Callable[[Work, ExecutionToken], Awaitable[Outcome]]


@attrs.define
class ScriptedExecutor:
    """A ``WorkExecutor`` running ``script(work, token)``; records every attempt."""

    script: JobFn
    attempts: list[tuple[str, int, bool]] = attrs.field(factory=list)

    async def execute(self, work: Work, token: ExecutionToken, state: Any) -> Outcome:
        self.attempts.append((token.task_id, token.generation, token.recovered))
        return await self.script(work, token)


# -- store wrappers -------------------------------------------------------------------------------

Hook = Callable[[str, tuple[Any, ...]], Awaitable[None]]


class HookedStore:
    """Delegates to a store, awaiting ``hook(operation, args)`` before each call.

    Tests use it to delay or block one operation (a slow transition, a stuck renew) while
    the store itself stays the authority.
    """

    def __init__(self, inner: Store, hook: Hook) -> None:
        self.inner = inner
        self.hook = hook
        self.calls: list[str] = []

    async def _before(self, op: str, *args: Any) -> None:
        self.calls.append(op)
        await self.hook(op, args)

    async def now(self) -> int:
        return await self.inner.now()

    async def authorize(self, ctx: object, action: Action, task_id: str) -> Access:
        await self._before("authorize", ctx, action, task_id)
        return await self.inner.authorize(ctx, action, task_id)

    async def create(self, task: Any, work: Work, access: Access) -> Snapshot:
        await self._before("create", task, work, access)
        return await self.inner.create(task, work, access)

    async def get(self, task_id: str, access: Access) -> Snapshot | NotFound:
        await self._before("get", task_id, access)
        return await self.inner.get(task_id, access)

    async def worker_snapshot(self, task_id: str, lease: Lease) -> Snapshot | NotFound:
        await self._before("worker_snapshot", task_id, lease)
        return await self.inner.worker_snapshot(task_id, lease)

    async def claim(
        self, task_id: str, owner_id: str, lease_ms: int
    ) -> Claimed | Deferred | Unavailable | NotFound:
        await self._before("claim", task_id, owner_id, lease_ms)
        return await self.inner.claim(task_id, owner_id, lease_ms)

    async def claim_next(self, owner_id: str, lease_ms: int) -> Claimed | None:
        await self._before("claim_next", owner_id, lease_ms)
        return await self.inner.claim_next(owner_id, lease_ms)

    async def renew(self, lease: Lease, lease_ms: int) -> Lease:
        await self._before("renew", lease, lease_ms)
        return await self.inner.renew(lease, lease_ms)

    async def release(self, lease: Lease) -> None:
        await self._before("release", lease)
        await self.inner.release(lease)

    async def reap(self) -> list[str]:
        await self._before("reap")
        return await self.inner.reap()

    async def transition(
        self, task_id: str, expected_revision: int, event: Event, authority: Authority
    ) -> Transition | Conflict | NotFound:
        await self._before("transition", task_id, expected_revision, event, authority)
        return await self.inner.transition(task_id, expected_revision, event, authority)

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def no_hook(op: str, args: tuple[Any, ...]) -> None:
    await trio.lowlevel.checkpoint()


class MortalStore(HookedStore):
    """``HookedStore`` over a memory store whose process can be killed: once ``dead`` is set,
    nothing it sends reaches the store any more (its releases, transitions and renewal batches
    fail as a killed process's would). ``memory`` is the store itself, for the renewal methods
    a subclass offers."""

    def __init__(self, inner: MemoryStore, hook: Hook = no_hook) -> None:
        super().__init__(inner, hook)
        self.memory = inner
        self.dead = False

    async def _reach(self) -> None:
        """Raise as a killed process's call would, if ``dead``."""
        if self.dead:
            await trio.lowlevel.checkpoint()
            raise OSError("the process is gone")

    async def release(self, lease: Lease) -> None:
        await self._reach()
        await super().release(lease)

    async def transition(self, *args: Any) -> Any:
        await self._reach()
        return await super().transition(*args)


def unlimited_memory_store() -> MemoryStore:
    """A shared-scope memory store on trio's clock with no capacity limits."""
    return MemoryStore(
        scope="shared",
        clock=TrioClock(START_US),
        max_tasks=None,
        max_active_tasks_per_scope=None,
    )


async def create_job(store: Store, runner: Runner, task_id: str) -> None:
    """Create (through ``runner``) a one-hour ``job`` task whose input names it."""
    access = await store.authorize(ANONYMOUS, Action.CREATE, task_id)
    task = new_task(task_id, await store.now(), 3_600_000, 100)
    work = Work(idempotency_key=task_id, type="job", input={"taskId": task_id})
    await runner.create_task(task, work, access)


async def status_of(store: Store, task_id: str) -> TaskStatus:
    access = await store.authorize(ANONYMOUS, Action.GET, task_id)
    snapshot = await store.get(task_id, access)
    assert isinstance(snapshot, Snapshot)
    return snapshot.task.status


def sleeper(seconds: float, result: dict[str, Any] = DONE) -> ScriptedExecutor:
    """An executor whose every attempt sleeps ``seconds`` and then completes with ``result``."""

    async def script(work: Work, token: ExecutionToken) -> Outcome:
        await trio.sleep(seconds)
        return Completed(result)

    return ScriptedExecutor(script)


def all_strings(value: Any) -> list[str]:
    """Every string (keys and values) inside a nested JSON-ish value, plus reprs of the rest."""
    found: list[str] = []
    if isinstance(value, str):
        found.append(value)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            found.extend(all_strings(key))
            found.extend(all_strings(item))
    elif isinstance(value, list | tuple | set | frozenset):
        for item in value:
            found.extend(all_strings(item))
    else:
        found.append(repr(value))
    return found
