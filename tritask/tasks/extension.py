"""The Tasks extension (``io.modelcontextprotocol/tasks``, SEP-2663) on the server core.

It plugs in through the public extension API only: ``tasks/get|update|cancel``, an
``around_tool_call`` hook that decides per request whether a call becomes a task, the
``Mcp-Name`` rule for task methods, and the ``taskIds`` listen filter. Tool lookup,
authorization and argument validation have already happened, exactly as for a direct call,
before this hook stores anything. Initialize-era sessions see the same tasks through the
legacy hooks, rendered by :mod:`tritask.tasks.legacy`.
"""

from __future__ import annotations

import functools
import logging
import secrets
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, Final, Literal, TypeAlias

import attrs
import trio

from tritask.jsonrpc import InternalError, InvalidParams, JsonRpcError, JSONValue, is_json_value
from tritask.protocol.errors import RETRY_AFTER_KEY, MissingRequiredClientCapability
from tritask.protocol.meta import RequestMeta
from tritask.protocol.versions import LATEST_VERSION
from tritask.server import invocation
from tritask.server.app import App, ToolDef
from tritask.server.context import Context, NotInTask, Relay
from tritask.server.extension import (
    CallNext,
    ConfigurationError,
    Extension,
    MethodHandler,
    ServeEnvironment,
    ToolCall,
)
from tritask.server.hub import Hub, Subscription
from tritask.server.results import RetryLater
from tritask.server.session import Session
from tritask.tasks.changes import TaskChange
from tritask.tasks.executor import (
    Completed,
    ExecutionToken,
    Failed,
    Outcome,
    Retry,
    internal_error,
)
from tritask.tasks.legacy import LegacyTasks, TaskSupport
from tritask.tasks.model import (
    Snapshot,
    Task,
    create_task_result,
    detailed_task,
    new_task,
    revise,
)
from tritask.tasks.reducer import DuplicateInputKey
from tritask.tasks.runner import Runner, RunnerNotRunning
from tritask.tasks.steps import StepError, only_step_errors
from tritask.tasks.store import (
    Access,
    Action,
    CapacityExceeded,
    Concurrency,
    NotFound,
    Store,
    StoreError,
    Unauthorized,
    work_tool,
)
from tritask.tasks.stores import open_store
from tritask.tasks.work import Origin, RetryPolicy, Work, canonical_json, canonical_size

log = logging.getLogger("tritask.tasks")

EXTENSION_ID: Final = "io.modelcontextprotocol/tasks"
UNKNOWN_TASK: Final = "Unknown or inaccessible taskId"
_MISMATCH: Final = (
    "Tasks(store=..., runner=...): the runner runs on another store than the one given; pass "
    "Runner(store) for the same store, or the runner alone (its store is used)"
)
CONTINUATION: Final = (
    "Task worker returned a continuation; use ctx.await_input or finish MRTR before creating a task"
)
TASK_METHODS: Final = frozenset({"tasks/get", "tasks/update", "tasks/cancel"})
_READ_ATTEMPTS: Final = 4

Mode = Literal["sync", "optional", "required"]


class _Default:
    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT: Final = _Default()
"""Marks a ``TaskOptions`` field that falls back to the extension's setting."""


@attrs.frozen(kw_only=True)
class TaskOptions:
    """Per-call overrides chosen by a tool's policy."""

    ttl_ms: int | _Default | None = DEFAULT
    poll_interval_ms: int | _Default | None = DEFAULT
    status_message: str | _Default | None = DEFAULT
    retry_policy: RetryPolicy | _Default = DEFAULT


ConcurrencyKeyFn = Callable[[Mapping[str, JSONValue], Any], JSONValue]
"""``key(arguments, principal)``: the JSON value naming whose share of the limit a call uses."""


def _one_key(arguments: Mapping[str, JSONValue], principal: Any) -> JSONValue:
    return None


@attrs.frozen
class ConcurrencyLimit:
    """At most ``limit`` tasks of a tool run at once per value of ``key(arguments,
    principal)`` (default: one key, so ``limit`` for the whole tool), across every runner on
    the store: the store's claims enforce it. More wait queued, first in first out within a
    key; claims are fair across keys (the key with the fewest running goes first).

    ``Tasks(concurrency={"export": ConcurrencyLimit(2, key=lambda args, principal: principal)})``
    runs at most two exports per principal.
    """

    limit: int = attrs.field()
    key: ConcurrencyKeyFn = attrs.field(default=_one_key)

    @limit.validator
    def _check_limit(self, _attr: object, value: object) -> None:
        if type(value) is not int or value <= 0:
            raise ValueError("a concurrency limit must be a positive int")


Decision: TypeAlias = Mode | tuple[Mode, TaskOptions]
PolicyFn = Callable[[Mapping[str, JSONValue], Context], Decision | Awaitable[Decision]]
Policy: TypeAlias = Decision | PolicyFn
WorkBuilder = Callable[[str, str, dict[str, JSONValue], Context], Work]
IdGenerator = Callable[[], str]


#: Base-62 digits in ASCII order, so that comparing two encoded instants as text compares the
#: instants (and an id never starts with ``-``, which command lines read as an option).
_SORTABLE_DIGITS: Final = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_INSTANT_WIDTH: Final = 8  # 62**8 ms: until the year 8888


def default_task_id() -> str:
    """The creation millisecond (the host's clock) in 8 base-62 digits that sort as it does,
    then 24 random bytes from ``secrets`` (192 bits, URL-safe base64): 40 characters.

    The random part alone makes the id unguessable, as it did alone before. Why the instant in
    front: a durable store keys the task's row and its ledger entries by the id in B-tree
    indexes; random ids put each group commit's new rows on pages all over those indexes, ids
    in creation order put them at the indexes' right edge. On SQLite (``bench tasks``, FULL)
    the server wrote 16.9 KB per task with random ids and 9.3 KB with these (7.8 against 4.2
    write calls) at 2,500 tasks in the file, 21.2 against 9.0 KB at 6,500
    (``docs/benchmarks-changelog.md``). The clock only orders ids roughly (hosts' clocks
    differ, a clock may step back): nothing relies on the order, and uniqueness is the random
    part's.
    """
    ms = time.time_ns() // 1_000_000
    digits = []
    for _ in range(_INSTANT_WIDTH):
        ms, digit = divmod(ms, 62)
        digits.append(_SORTABLE_DIGITS[digit])
    return "".join(reversed(digits)) + secrets.token_urlsafe(24)


def principal_scope(ctx: Any) -> JSONValue:
    """Default store scope: the caller's principal (JSON), so tenants never see each other."""
    principal = getattr(ctx, "principal", None)
    if not is_json_value(principal):
        raise Unauthorized("the principal is not JSON; configure Tasks(scope=...)")
    return principal


def _task_id_param(params: Mapping[str, JSONValue], limit: int) -> str:
    task_id = params.get("taskId")
    if not isinstance(task_id, str) or not task_id:
        raise InvalidParams("A non-empty taskId is required")
    if len(task_id.encode("utf-8")) > limit:
        raise InvalidParams(f"taskId is longer than {limit} bytes")
    return task_id


_MODES: Final[dict[str, Mode]] = {"sync": "sync", "optional": "optional", "required": "required"}
_TASK_SUPPORT: Final[dict[Mode, TaskSupport]] = {
    "sync": "forbidden",
    "optional": "optional",
    "required": "required",
}


_Memo: TypeAlias = dict[tuple[str, str], tuple[int, Task] | None]
"""One change's reads, by (store id, scope): the revision and task read, or ``None`` (gone)."""


_ACCESS_STATE: Final = f"{EXTENSION_ID}#access"
"""``subscription.state`` key of the stream's access to each task it watches (by task id)."""


def _watching(subscription: Subscription, task_id: str) -> bool:
    ids = subscription.accepted.get("taskIds")
    return isinstance(ids, list) and task_id in ids


def _only(error: BaseException, kind: type[Exception]) -> bool:
    """``error`` is a ``kind``, or a group (a tool's own nursery) holding nothing else."""
    if isinstance(error, BaseExceptionGroup):
        matched, rest = error.split(kind)
        return matched is not None and rest is None
    return isinstance(error, kind)


TOOL_OPTION: Final = "task"
"""The ``@app.tool`` keyword this extension reads: ``@app.tool(task="required")``."""
_POLICY_FORMS: Final = (
    "'sync', 'optional', 'required', a TaskOptions (required, with those options), "
    "(mode, TaskOptions) or a callable (params, ctx) -> decision"
)


def _declared(policy: object) -> Policy:
    """A policy given as ``@app.tool(task=...)``: ``TaskOptions(...)`` alone means required."""
    if isinstance(policy, TaskOptions):
        return ("required", policy)
    return policy  # type: ignore[return-value]  # checked by _invalid_policy at start


def _invalid_policy(policy: object) -> bool:
    if callable(policy):
        return False
    try:
        _normalise(policy)
    except InternalError:
        return True
    return False


_NO_OPTIONS: Final = TaskOptions()
"""A bare mode's options (a frozen value: one serves every call)."""


def _normalise(decision: object) -> tuple[Mode, TaskOptions]:
    if isinstance(decision, str) and decision in _MODES:
        return _MODES[decision], _NO_OPTIONS
    if isinstance(decision, tuple) and len(decision) == 2:
        mode, options = decision
        if isinstance(mode, str) and mode in _MODES and isinstance(options, TaskOptions):
            return _MODES[mode], options
    raise InternalError("Tasks policy returned an invalid decision")


class ToolCallExecutor:
    """The default executor: re-runs ``tools/call`` work by tool name from the app registry.

    Through the server's tool-invocation pipeline (``tritask.server.invocation``): the
    persisted arguments are checked against the tool's argument contract again, then the tool
    runs exactly as a direct call would, without the request-only steps.

    This makes every task tool restartable out of the box (at least once: a tool reads
    ``ctx.idempotency_key`` to deduplicate its side effects). A tool registered with
    ``restartable=False`` fails clearly when its work is recovered instead of hanging.
    """

    def __init__(self, app: App) -> None:
        self.app = app

    async def execute(self, work: Work, token: ExecutionToken, state: Any) -> Outcome:
        if work.type != "tools/call":
            return Failed(internal_error(f"No executor for work type {work.type!r}"))
        name = work.input.get("name")
        arguments = work.input.get("arguments", {})
        tool = self.app.tools.get(name) if isinstance(name, str) else None
        if tool is None or not isinstance(arguments, dict):
            message = "Task work names a tool this server does not have"
            return Failed(internal_error(message), message)
        if token.context is None and not tool.restartable:
            message = f"Task tool {tool.name} is not restartable; its work was lost in a restart"
            return Failed(internal_error(message), message)
        ctx = token.context or self._recovered_context(work, token)
        try:
            prepared = invocation.prepare_tool_call(self.app, tool.name, arguments, work.input)
        except JsonRpcError as error:
            # Work stored for an older version of the tool (or built by a work builder) that
            # its function cannot take: say which argument, never a TypeError from the call.
            message = f"Task work does not fit tool {tool.name}: {error.message}"
            return Failed({**error.to_error(), "message": message}, message)
        if not isinstance(prepared, ToolCall):
            return Completed(invocation.shape(self.app, prepared))
        try:
            result = await invocation.run_tool(prepared, ctx)
        except DuplicateInputKey as error:
            message = f"Input key {error.key!r} was reused with a different request"
            return Failed(internal_error(message), message)
        except StepError as error:
            return Failed(error.to_error(), str(error))
        except ExceptionGroup as group:
            step_error = only_step_errors(group)
            if step_error is None:
                log.exception("task tool %s raised (task %s)", tool.name, token.task_id)
                return Failed(internal_error("Task tool failed"), "Task tool failed")
            return Failed(step_error.to_error(), str(step_error))
        except JsonRpcError as error:
            return Failed(error.to_error(), error.message)
        except RetryLater as error:
            return Retry(internal_error(str(error)), str(error))
        except Exception:
            log.exception("task tool %s raised (task %s)", tool.name, token.task_id)
            return Failed(internal_error("Task tool failed"), "Task tool failed")
        if result.get("resultType", "complete") in ("input_required", "task"):
            return Failed(internal_error(CONTINUATION), CONTINUATION)
        return Completed(result)

    def _recovered_context(self, work: Work, token: ExecutionToken) -> Context:
        """A detached context rebuilt from the persisted work alone (after a restart, on
        another host, beyond ``max_queued_contexts``): the client as the creating request
        declared it when the work has its :class:`~tritask.tasks.work.Origin` (default work),
        the principal a ``work_builder`` projected into the input if any, never ``ctx.auth``
        (docs/security.md says why)."""
        origin = work.origin
        if origin is None:
            meta = RequestMeta(protocol_version=LATEST_VERSION, client_capabilities={})
        else:
            meta = RequestMeta(
                protocol_version=origin.protocol_version,
                client_capabilities=origin.client_capabilities,
                client_info=origin.client_info,
            )
        return Context(
            app=self.app,
            method="tools/call",
            meta=meta,
            principal=work.input.get("principal"),
            transport="task",
            extensions={EXTENSION_ID: {}},
            input_provider=token._input,
            task_id=token.task_id,
            idempotency_key=token.idempotency_key,
        )


def _origin(ctx: Context) -> Origin:
    """What the creating request's client declared, which default work persists so that a
    resumed attempt sees the client as a request made here would. Never ``ctx.auth`` nor the
    principal (docs/security.md); a ``work_builder`` decides alone what its work keeps."""
    meta = ctx.meta
    return Origin(
        protocol_version=meta.protocol_version,
        client_capabilities=meta.client_capabilities,
        client_info=meta.client_info,
    )


class Tasks(Extension):
    """``io.modelcontextprotocol/tasks``: durable tasks around selected tools."""

    id = EXTENSION_ID
    tool_options = frozenset({TOOL_OPTION})

    def __init__(
        self,
        *,
        store: Store | None = None,
        runner: Runner | None = None,
        task_support: Mapping[str, Policy] | None = None,
        ttl_ms: int | None = 3_600_000,
        poll_interval_ms: int | None = 250,
        status_message: str | None = "Task accepted",
        work_builder: WorkBuilder | None = None,
        retry_policy: RetryPolicy | None = None,
        retry_policies: Mapping[str, RetryPolicy] | None = None,
        id_generator: IdGenerator = default_task_id,
        max_task_id_bytes: int = 256,
        max_work_input_bytes: int | None = 262_144,
        max_task_ids: int = 100,
        scope: Any = principal_scope,
        store_options: Mapping[str, Any] | None = None,
        runner_options: Mapping[str, Any] | None = None,
        concurrency: Mapping[str, ConcurrencyLimit] | None = None,
        retry_after_s: int = 1,
        persist_origin: bool = True,
    ) -> None:
        if ttl_ms is not None and ttl_ms <= 0:
            raise ValueError("ttl_ms must be a positive integer or None (never expires)")
        if poll_interval_ms is not None and poll_interval_ms <= 0:
            raise ValueError("poll_interval_ms must be a positive integer or None")
        if store is not None and runner is not None and runner.store is not store:
            raise ValueError(_MISMATCH)
        self.concurrency = dict(concurrency or {})
        for name, rule in self.concurrency.items():
            if not isinstance(rule, ConcurrencyLimit):
                raise TypeError(f"concurrency[{name!r}] must be a ConcurrencyLimit")
        if type(retry_after_s) is not int or retry_after_s < 0:
            raise ValueError("retry_after_s must be an int >= 0 (seconds)")
        self.retry_after_s = retry_after_s
        if not isinstance(persist_origin, bool):
            raise TypeError("persist_origin must be a bool")
        # Default work keeps what the client declared (Work v5's origin) for a context rebuilt
        # elsewhere; False writes the work of earlier releases (version 2), which hosts of a
        # release before Work v5 can read: a rolling upgrade turns it on once all are upgraded.
        self.persist_origin = persist_origin
        self._store = store
        self._runner: Runner | None = None
        self._unwire: Callable[[], None] | None = None
        self.task_support: dict[str, Policy] = dict(task_support or {})
        self.ttl_ms = ttl_ms
        self.poll_interval_ms = poll_interval_ms
        self.status_message = status_message
        self.work_builder = work_builder
        self.retry_policy = retry_policy or RetryPolicy.none()
        self.retry_policies = dict(retry_policies or {})
        self.id_generator = id_generator
        self.max_task_id_bytes = max_task_id_bytes
        self.max_work_input_bytes = max_work_input_bytes
        self.max_task_ids = max_task_ids
        self.scope = scope
        self.store_options = dict(store_options or {})
        self.runner_options = dict(runner_options or {})
        self._app: App | None = None
        self._opening: weakref.WeakKeyDictionary[Context, dict[str, Access]] = (
            weakref.WeakKeyDictionary()
        )
        """The access each listen request was granted to each task it may watch, from its
        filter (:meth:`subscription_filter`) to its opening (:meth:`subscription_opened`)."""
        self.runner = runner
        self._methods: dict[str, MethodHandler] = {
            "tasks/get": self._get,
            "tasks/update": self._update,
            "tasks/cancel": self._cancel,
        }
        self.legacy = LegacyTasks(self)
        """The initialize-era rendering (waited-for task tools, 2025-11-25 ``tasks/*``)."""

    # -- wiring --------------------------------------------------------------------------

    @property
    def store(self) -> Store | None:
        """The store tasks are kept in (the runner's store, when a runner was given)."""
        if self._store is None and self._runner is not None:
            return self._runner.store
        return self._store

    @store.setter
    def store(self, store: Store | None) -> None:
        if store is not None and self._runner is not None and self._runner.store is not store:
            raise ValueError(_MISMATCH)
        self._store = store

    @property
    def runner(self) -> Runner | None:
        return self._runner

    @runner.setter
    def runner(self, runner: Runner | None) -> None:
        """Switch runners (e.g. after a restart in-process); the new one is wired to the app.

        A runner on another store than ``store`` is refused (``ValueError``): tasks would be
        created in one store and executed, recovered and reaped from the other.
        """
        if runner is not None and self._store is not None and runner.store is not self._store:
            raise ValueError(_MISMATCH)
        if self._unwire is not None:
            self._unwire()
            self._unwire = None
        self._runner = runner
        if runner is not None and self._app is not None:
            self._unwire = self._wire(self._app, runner)

    def attached(self, app: App) -> None:
        self._app = app
        if self._runner is not None and self._unwire is None:
            self._unwire = self._wire(app, self._runner)

    def _wire(self, app: App, runner: Runner) -> Callable[[], None]:
        runner.set_default_executor(ToolCallExecutor(app))
        unsubscribe = runner.subscribe(self.legacy.observe)
        unwatch = runner.watch(self._on_change)

        def unwire() -> None:
            unsubscribe()
            unwatch()

        return unwire

    @property
    def app(self) -> App | None:
        return self._app

    # -- push: notifications/tasks on listen streams ---------------------------------------

    def _on_change(self, change: TaskChange) -> None:
        """A committed change of some task (from the runner's :meth:`Runner.watch`): queue it
        on every listen stream watching that task. Never blocks: each stream renders it in its
        own task, with its own access (:meth:`_render`)."""
        app = self._app
        if app is None or not app.hub.subscriber_count:
            return  # nobody listening (the usual case): build nothing
        hub = app.hub
        if change.kind == "resync":
            # Changes may have been lost: every watched task is read again by its streams.
            for task_id in hub.entries("taskIds"):
                self._publish_task(hub, task_id, None)
        elif change.task_id is not None:
            self._publish_task(hub, change.task_id, change)

    def _publish_task(self, hub: Hub, task_id: str, change: TaskChange | None) -> None:
        memo: _Memo = {}

        async def render(subscription: Subscription, ctx: Any) -> dict[str, JSONValue] | None:
            return await self._render(task_id, change, memo, subscription, ctx)

        hub.publish(
            "notifications/tasks",
            {},
            {"taskIds": [task_id]},
            key=("notifications/tasks", task_id),
            render=render,
        )

    def subscription_opened(self, subscription: Subscription, ctx: Context) -> None:
        """Queue each watched task's current state: the first thing the stream sends after
        its acknowledgement (read when sent, so no change committed meanwhile is missed)."""
        accesses = self._opening.pop(ctx, {})
        ids = subscription.accepted.get("taskIds")
        if not isinstance(ids, list):
            return
        subscription.state[EXTENSION_ID] = {}
        # The stream outlives its request and renders with its detached context, which keeps
        # none of the request's params or _meta: a scope function reading them would give
        # another scope later. Keep the access the request itself was granted instead.
        subscription.state[_ACCESS_STATE] = {
            task_id: accesses[task_id]
            for task_id in ids
            if isinstance(task_id, str) and task_id in accesses
        }
        for task_id in ids:
            if isinstance(task_id, str):
                subscription.push(
                    "notifications/tasks",
                    {},
                    key=("notifications/tasks", task_id),
                    render=functools.partial(self._render, task_id, None, None),
                )

    async def _render(
        self,
        task_id: str,
        change: TaskChange | None,
        memo: _Memo | None,
        subscription: Subscription,
        ctx: Any,
    ) -> dict[str, JSONValue] | None:
        """The ``notifications/tasks`` params of ``change`` for one stream, or ``None``.

        Each stream sends each task's revisions in increasing order, never one twice: the
        revision it sent last is kept in ``subscription.state``. A change committed in this
        process carries its task (sent as it is: every revision, in order); one heard from
        another host (or a resync, ``change is None``) is read through the store with this
        stream's own access, so scope and expiry rules hold, and ``memo`` shares that read
        between the streams of one scope. A task that is gone (reaped, expired) is dropped
        from the stream, which ends when it has nothing left to listen for.
        """
        if not _watching(subscription, task_id):
            return None  # forgotten meanwhile
        sent: dict[str, int] = subscription.state.setdefault(EXTENSION_ID, {})
        last = sent.get(task_id, -1)
        if change is not None and change.kind == "reaped":
            self._forget(subscription, task_id)
            return None
        if change is not None and change.revision is not None and change.revision <= last:
            return None
        if change is not None and change.task is not None and change.revision is not None:
            task, revision = change.task, change.revision
        else:
            access = subscription.state.get(_ACCESS_STATE, {}).get(task_id)
            found, gone = await self._read_retrying(task_id, memo, ctx, access)
            if gone:
                self._forget(subscription, task_id)
                return None
            if found is None:
                return None
            revision, task = found
        if revision <= sent.get(task_id, -1):
            return None
        sent[task_id] = revision
        return detailed_task(task)

    async def _read_retrying(
        self, task_id: str, memo: _Memo | None, ctx: Any, access: Access | None = None
    ) -> tuple[tuple[int, Task] | None, bool]:
        """:meth:`_read`, retried a few times when the store fails (a busy database, a lost
        connection): the change may be the task's last, so it must not be dropped lightly."""
        for attempt in range(_READ_ATTEMPTS):
            try:
                return await self._read(task_id, memo, ctx, access)
            except StoreError as error:
                if attempt + 1 == _READ_ATTEMPTS:
                    log.warning("listen: reading task %s failed, skipped: %s", task_id, error)
                    break
                await trio.sleep(0.05 * 2**attempt)
        return None, False

    async def _read(
        self, task_id: str, memo: _Memo | None, ctx: Any, access: Access | None = None
    ) -> tuple[tuple[int, Task] | None, bool]:
        """The task's revision and state through the store with ``access`` (the stream's,
        granted at its opening) or else ``ctx``'s (``memo`` shares one read between the
        streams of one scope); ``(None, True)`` when it is gone."""
        store, _ = self.parts()
        if access is None:
            try:
                access = await store.authorize(ctx, Action.GET, task_id)
            except Unauthorized:
                return None, True
        memo_key = (access.store_id, access.scope)
        if memo is not None and memo_key in memo:
            read = memo[memo_key]
        else:
            found = await store.get(task_id, access)
            read = None if isinstance(found, NotFound) else (found.revision, found.task)
            if memo is not None:
                memo[memo_key] = read
        return read, read is None

    def _forget(self, subscription: Subscription, task_id: str) -> None:
        subscription.state.get(EXTENSION_ID, {}).pop(task_id, None)
        subscription.state.get(_ACCESS_STATE, {}).pop(task_id, None)
        if self._app is not None:
            self._app.hub.forget(subscription, "taskIds", task_id)

    @asynccontextmanager
    async def lifespan(self, app: App, env: ServeEnvironment) -> AsyncIterator[None]:
        """Open the store named by the serve environment and run a recovering runner."""
        async with AsyncExitStack() as stack:
            opened_store = self.store is None
            opened_runner = self.runner is None
            if self.store is None:
                url = env.store_url or "memory:"
                store = open_store(url, **{"scope": self.scope, **self.store_options})
                await stack.enter_async_context(store)
                self.store = store
                stack.callback(setattr, self, "store", None)
            if self.runner is None:
                runner = Runner(self.store, recover=True, **self.runner_options)
                nursery = await stack.enter_async_context(trio.open_nursery())
                await nursery.start(runner.run)
                stack.callback(runner.stop)
                self.runner = runner
                stack.callback(setattr, self, "runner", None)
            log.info(
                "tasks: store %s, runner %s",
                "opened" if opened_store else "given",
                "started" if opened_runner else "given",
            )
            yield

    def parts(self) -> tuple[Store, Runner]:
        """The store and runner in use (-32603 when the extension is not running)."""
        if self.store is None or self.runner is None:
            raise InternalError("Tasks store or runner is not configured")
        return self.store, self.runner

    # -- extension hooks -----------------------------------------------------------------

    def methods(self) -> Mapping[str, MethodHandler]:
        return self._methods

    def name_source(self, method: str) -> str | None:
        return "taskId" if method in TASK_METHODS else None

    def name_header_optional(self, method: str) -> bool:
        """``tasks/*`` without ``Mcp-Name`` is served (a different one is still -32020).

        SEP-2663 has clients mirror ``taskId`` so that a load balancer can pin a task to the
        instance holding it. tritask routes by store, not by instance: any process reaches any
        task, so the header tells us nothing the body does not. FastMCP 4.1.4 with
        fastmcp-tasks 4.1.4 omits it, and its users should not fail for that.
        """
        return method in TASK_METHODS

    def legacy_session_opened(self, session: Session) -> None:
        self.legacy.session_opened(session)

    def legacy_capabilities(self, session: Session) -> dict[str, JSONValue]:
        return self.legacy.capabilities(session)

    def legacy_methods(self, session: Session) -> Mapping[str, MethodHandler]:
        return self.legacy.methods(session)

    def legacy_tool_fields(self, tool: ToolDef, session: Session) -> dict[str, JSONValue]:
        return self.legacy.tool_fields(tool, session)

    async def around_tool_call(
        self, call: ToolCall, ctx: Context, call_next: CallNext
    ) -> dict[str, JSONValue]:
        if ctx.session is not None:
            # An initialize-era session never negotiates the extension (and never gets -32021).
            return await self.legacy.tool_call(call, ctx, call_next)
        mode, options = await self.decide(call, ctx)
        negotiated = ctx.negotiated(EXTENSION_ID)
        if mode == "sync":
            return await call_next(call, ctx)
        if mode == "optional" and not negotiated:
            try:
                return await call_next(call, ctx)
            except (NotInTask, ExceptionGroup) as error:
                # An optional tool that waits for input can only finish as a task: this
                # request needed the extension it did not declare (not a server failure).
                if not _only(error, NotInTask):
                    raise
                raise MissingRequiredClientCapability(
                    {"extensions": {EXTENSION_ID: {}}},
                    f"Tool {call.tool.name} waits for input: it runs as a task only, and this "
                    f"request did not declare {EXTENSION_ID}",
                ) from error
        if not negotiated:
            raise MissingRequiredClientCapability({"extensions": {EXTENSION_ID: {}}})
        snapshot = await self.create_snapshot(call, ctx, options, self.new_task_id())
        return create_task_result(snapshot.task)

    def policy_of(self, tool: ToolDef) -> Policy:
        """The tool's policy: ``@app.tool(task=...)``, else ``task_support``, else sync."""
        if TOOL_OPTION in tool.options:
            return _declared(tool.options[TOOL_OPTION])
        return self.task_support.get(tool.name, "sync")

    def task_support_of(self, tool: ToolDef) -> TaskSupport:
        """A tool's ``execution.taskSupport`` for clients that read it (a callable: optional)."""
        policy = self.policy_of(tool)
        if callable(policy):
            return "optional"
        try:
            mode, _ = _normalise(policy)
        except InternalError:
            return "forbidden"  # the call itself reports the invalid policy
        return _TASK_SUPPORT[mode]

    async def decide(self, call: ToolCall, ctx: Context) -> tuple[Mode, TaskOptions]:
        """The tool's policy for this call: its mode and per-call options."""
        policy = self.policy_of(call.tool)
        if callable(policy):
            try:
                decision = policy(call.params, ctx)
                if isinstance(decision, Awaitable):
                    decision = await decision
            except JsonRpcError:
                raise
            except Exception as error:
                log.exception("task policy for %s raised", call.tool.name)
                raise InternalError("Tasks policy raised") from error
            return _normalise(decision)
        return _normalise(policy)

    def check(self, app: App) -> None:
        """At start: every tool named by ``task_support``/``retry_policies`` exists, each
        policy is well formed, and no tool gets its policy both ways with different values."""
        known = app.tools
        for mapping in ("task_support", "retry_policies"):
            for name in getattr(self, mapping):
                if name not in known:
                    raise ConfigurationError.unknown(f"Tasks({mapping}=...): tool", name, known)
        for name, policy in self.task_support.items():
            if _invalid_policy(policy):
                raise ConfigurationError(
                    f"Tasks(task_support=...): the policy of tool {name!r} is {policy!r}; "
                    f"expected {_POLICY_FORMS}"
                )
        for tool in known.values():
            if TOOL_OPTION not in tool.options:
                continue
            declared = tool.options[TOOL_OPTION]
            if _invalid_policy(_declared(declared)):
                raise ConfigurationError(
                    f"tool {tool.name!r}: @app.tool(task={declared!r}) is not a task policy; "
                    f"expected {_POLICY_FORMS}"
                )
            if tool.name in self.task_support and self.task_support[tool.name] != declared:
                raise ConfigurationError(
                    f"tool {tool.name!r} declares its task policy twice, differently: "
                    f"@app.tool(task={declared!r}) and Tasks(task_support={{{tool.name!r}: "
                    f"{self.task_support[tool.name]!r}}}); keep one"
                )
            options = declared if isinstance(declared, TaskOptions) else None
            if isinstance(declared, tuple) and len(declared) == 2:
                options = declared[1]
            if (
                options is not None
                and isinstance(options.retry_policy, RetryPolicy)
                and tool.name in self.retry_policies
                and self.retry_policies[tool.name] != options.retry_policy
            ):
                raise ConfigurationError(
                    f"tool {tool.name!r} declares its retry policy twice, differently: in "
                    f"@app.tool(task=TaskOptions(retry_policy=...)) and in "
                    f"Tasks(retry_policies=...); keep one"
                )

    def new_task_id(self) -> str:
        task_id = self.id_generator()
        if not isinstance(task_id, str) or not task_id:
            raise InternalError("Task id generator returned an invalid id")
        if len(task_id.encode("utf-8")) > self.max_task_id_bytes:
            raise InternalError("Task id generator returned an invalid id")
        return task_id

    async def create_snapshot(
        self,
        call: ToolCall,
        ctx: Context,
        options: TaskOptions,
        task_id: str,
        *,
        requested_ttl_ms: int | None = None,
        relay: Relay | None = None,
    ) -> Snapshot:
        """Store the call as a task and start it; the worker gets ``ctx`` detached.

        ``requested_ttl_ms`` is a client's wish (2025-11-25 ``params.task.ttl``): granted up to
        the configured ttl. ``relay`` is the worker's only link to a request waiting for it.
        """
        store, runner = self.parts()
        retry_policy = (
            options.retry_policy
            if isinstance(options.retry_policy, RetryPolicy)
            else self.retry_policies.get(call.tool.name, self.retry_policy)
        )
        built = self.work_builder is not None
        if self.work_builder is not None:
            try:
                work = self.work_builder(task_id, call.tool.name, dict(call.arguments), ctx)
            except JsonRpcError:
                raise
            except Exception as error:
                log.exception("work builder failed for %s", call.tool.name)
                raise InternalError("Task work builder failed") from error
            if not isinstance(work, Work):
                raise InternalError("Task work builder must return a Work")
            if work.tool != call.tool.name:
                # Persisted with the work: later requests on the task are authorized for this
                # tool's scopes whatever shape the builder gave the work (creating_tool_scopes).
                work = revise(work, tool=call.tool.name)
            if work.retry_policy == RetryPolicy.none() and retry_policy != RetryPolicy.none():
                work = attrs.evolve(work, retry_policy=retry_policy)
        else:
            work = Work.tool_call(task_id, call.tool.name, dict(call.arguments), retry_policy)
            if self.persist_origin:
                work = revise(work, origin=_origin(ctx))
        if work.idempotency_key != task_id:
            raise InternalError("Task work idempotency key must match its task id")
        if self.max_work_input_bytes is not None:
            # Work.tool_call has just checked and copied the input: no second check needed.
            if built:
                size = len(canonical_json(work.input).encode("utf-8"))
                if work.origin is not None:
                    size += work.origin.size()
            elif work.origin is not None:
                size = work.origin.size(work.input)  # (one encoding of the three)
            else:
                size = canonical_size(work.input)
            if size > self.max_work_input_bytes:
                raise InvalidParams(f"Task input is larger than {self.max_work_input_bytes} bytes")
        ttl = self.ttl_ms if isinstance(options.ttl_ms, _Default) else options.ttl_ms
        if requested_ttl_ms is not None:
            ttl = requested_ttl_ms if ttl is None else min(ttl, requested_ttl_ms)
        poll = (
            self.poll_interval_ms
            if isinstance(options.poll_interval_ms, _Default)
            else options.poll_interval_ms
        )
        message = (
            self.status_message
            if isinstance(options.status_message, _Default)
            else options.status_message
        )
        try:
            access = await store.authorize(ctx, Action.CREATE, task_id)
        except Unauthorized as error:
            raise InternalError("Task creation was not authorized") from error
        except StoreError as error:
            log.error("task authorization failed: %s", error)
            raise InternalError("Task authorization failed") from error
        # createdAt is a placeholder: the runner has the store stamp it at creation, in the
        # creating step itself when the store offers that (no separate now() round trip).
        task = new_task(task_id, 0, ttl, poll, message)
        concurrency = self._concurrency(call, ctx)
        try:
            snapshot = await runner.create_task(
                task,
                work,
                access,
                context=ctx.detach(task_id=task_id, idempotency_key=task_id, relay=relay),
                stamp=True,
                concurrency=concurrency,
            )
        except CapacityExceeded as error:
            # Retryable: a client that waits and sends the call again is served (HTTP 429
            # for a per-principal limit, 503 for the server's, both with Retry-After).
            data: dict[str, JSONValue] = {
                "retryable": True,
                "limit": str(error.limit),
                RETRY_AFTER_KEY: self.retry_after_s,
            }
            raise InternalError("Task capacity exhausted", data) from error
        except (StoreError, RunnerNotRunning) as error:
            log.error("task creation failed: %s", error)
            raise InternalError("Task creation failed") from error
        return snapshot

    def _concurrency(self, call: ToolCall, ctx: Context) -> Concurrency | None:
        """The call's concurrency key, from the tool's :class:`ConcurrencyLimit`."""
        rule = self.concurrency.get(call.tool.name)
        if rule is None:
            return None
        try:
            value = rule.key(call.arguments, ctx.principal)
            key = canonical_json([call.tool.name, value])
        except JsonRpcError:
            raise
        except Exception as error:
            log.exception("concurrency key for %s failed", call.tool.name)
            raise InternalError("Task concurrency key failed") from error
        return Concurrency(key, rule.limit)

    async def subscription_filter(
        self, requested: Mapping[str, JSONValue], ctx: Context
    ) -> dict[str, JSONValue]:
        if "taskIds" not in requested:
            return {}
        if not ctx.negotiated(EXTENSION_ID):
            raise MissingRequiredClientCapability({"extensions": {EXTENSION_ID: {}}})
        ids = requested["taskIds"]
        if not isinstance(ids, list):
            raise InvalidParams("subscriptions/listen taskIds must be a list")
        if len(ids) > self.max_task_ids:
            raise InvalidParams(f"taskIds must contain at most {self.max_task_ids} entries")
        for task_id in ids:
            if not isinstance(task_id, str) or not task_id:
                raise InvalidParams("taskIds must contain non-empty strings")
            if len(task_id.encode("utf-8")) > self.max_task_id_bytes:
                raise InvalidParams(
                    f"taskIds entries must be at most {self.max_task_id_bytes} bytes"
                )
        accesses: dict[str, Access] = {}
        for task_id in dict.fromkeys(ids):
            access = await self._visible(task_id, ctx)
            if access is not None:
                accesses[task_id] = access
        self._opening[ctx] = accesses  # for subscription_opened, with the same context
        return {"taskIds": list(accesses)} if accesses else {}

    async def _visible(self, task_id: str, ctx: Context) -> Access | None:
        """The access ``ctx`` has to the task, if it may see it."""
        store, _ = self.parts()
        try:
            access = await store.authorize(ctx, Action.GET, task_id)
        except Unauthorized:
            return None
        snapshot = await store.get(task_id, access)
        return None if isinstance(snapshot, NotFound) else access

    async def lookup(self, task_id: str, ctx: Context, action: Action) -> Snapshot | None:
        """The task if ``ctx``'s caller may see it (``None`` for unknown or out of scope)."""
        store, _ = self.parts()
        try:
            access = await store.authorize(ctx, action, task_id)
        except Unauthorized:
            return None
        snapshot = await store.get(task_id, access)
        return None if isinstance(snapshot, NotFound) else snapshot

    # -- task methods --------------------------------------------------------------------

    async def _get(self, params: dict[str, JSONValue], ctx: Context) -> dict[str, JSONValue]:
        task_id = _task_id_param(params, self.max_task_id_bytes)
        snapshot = await self.lookup(task_id, ctx, Action.GET)
        if snapshot is None:
            raise InvalidParams(UNKNOWN_TASK)
        return {"resultType": "complete", **detailed_task(snapshot.task)}

    async def _update(self, params: dict[str, JSONValue], ctx: Context) -> dict[str, JSONValue]:
        task_id = _task_id_param(params, self.max_task_id_bytes)
        responses = params.get("inputResponses")
        if not isinstance(responses, dict):
            raise InvalidParams("tasks/update requires an inputResponses object")
        if not all(
            isinstance(key, str) and key and isinstance(value, dict)
            for key, value in responses.items()
        ) or not is_json_value(responses):
            raise InvalidParams("inputResponses is invalid")
        store, runner = self.parts()
        try:
            access = await store.authorize(ctx, Action.UPDATE, task_id)
        except Unauthorized:
            raise InvalidParams(UNKNOWN_TASK) from None
        if ctx.auth is not None:
            # Answering a task's input acts on its tool: the token must still carry the
            # scopes that tool needs (one read, only for OAuth-protected requests).
            snapshot = await store.get(task_id, access)
            if isinstance(snapshot, NotFound):
                raise InvalidParams(UNKNOWN_TASK)
            ctx.require_scopes(*self.creating_tool_scopes(snapshot))
        result = await runner.update(task_id, responses, access)
        if isinstance(result, NotFound):
            raise InvalidParams(UNKNOWN_TASK)
        return {"resultType": "complete"}

    def creating_tool_scopes(self, snapshot: Snapshot) -> frozenset[str]:
        """The ``required_scopes`` of the tool whose call created the task.

        Its name is persisted with the work (:func:`~tritask.tasks.store.work_tool`: the
        default descriptor's input, or the ``tool`` this extension sets on a ``work_builder``'s
        work). A task whose work names no tool (one created before work version 4 by a custom
        builder, or not by a tool call) needs only the server-wide scopes.
        """
        name = work_tool(snapshot.work)
        tool = self._app.tools.get(name) if self._app is not None and name is not None else None
        return tool.required_scopes if tool is not None else frozenset()

    async def _cancel(self, params: dict[str, JSONValue], ctx: Context) -> dict[str, JSONValue]:
        task_id = _task_id_param(params, self.max_task_id_bytes)
        store, runner = self.parts()
        try:
            access = await store.authorize(ctx, Action.CANCEL, task_id)
        except Unauthorized:
            raise InvalidParams(UNKNOWN_TASK) from None
        result = await runner.cancel(task_id, access)
        if isinstance(result, NotFound):
            raise InvalidParams(UNKNOWN_TASK)
        return {"resultType": "complete"}


def await_input(
    ctx: Context, key: str, request: dict[str, JSONValue]
) -> Awaitable[dict[str, JSONValue]]:
    """``tritask.await_input(ctx, key, request)``: the function form of ``ctx.await_input``."""
    return ctx.await_input(key, request)
