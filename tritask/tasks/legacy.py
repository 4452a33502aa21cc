"""Tasks for initialize-era clients (2025-06-18, 2025-11-25): one store, a second rendering.

The durable tasks are exactly the 2026-07-28 ones: the same store, reducer, runner and
executor create, run, recover and expire them. What differs is how a legacy session sees them:

**A task tool waited for** (a legacy call without ``params.task``). A tool with a task policy
(``optional``, ``required``, or a callable that decides so) runs as a durable task and the
``tools/call`` waits for it, so a client that knows nothing of tasks still gets a plain
``CallToolResult``. While it waits:

- the worker's progress reaches the request through a :class:`~tritask.tasks.relay.RequestRelay`
  (the worker context stays detached; the relay goes inert with the request);
- ``ctx.await_input`` in the task (the task turns ``input_required``) becomes a server-initiated
  request on the waiting request's stream (``elicitation/create``, ``sampling/createMessage``,
  ``roots/list``, shaped for the session's version), and the answer goes to the task exactly as a
  ``tasks/update`` would deliver it;
- the client's ``notifications/cancelled`` for the call cancels the task; a client that merely
  goes away (connection closed, HTTP disconnect) leaves it running, as a durable task should.

The terminal state is the answer: ``completed`` gives its ``CallToolResult``, ``failed`` its
JSON-RPC error (a missing client capability is a tool error instead, as it is for a legacy
call without a task), ``cancelled`` a -32603 naming the task. A client that refuses an input
request (a JSON-RPC error) or cannot be asked (an undeclared capability, URL elicitation on
2025-06-18, a transport without server requests) gets a tool error with the reason, and the
task is cancelled: nobody else could ever answer it.

**The experimental tasks of 2025-11-25** (SEP-1686), for 2025-11-25 sessions whose client
declared ``capabilities.tasks`` at ``initialize`` (never 2025-06-18 nor 2026-07-28; a 2025-11-25
client that declared nothing is served as above, so a ``required`` tool still works for it):
``capabilities.tasks`` in ``InitializeResult``, ``execution.taskSupport`` in ``tools/list``,
``params.task`` on ``tools/call`` answered with ``CreateTaskResult``, and ``tasks/get``,
``tasks/result``, ``tasks/list``, ``tasks/cancel`` and ``notifications/tasks/status`` in that
version's shapes (``ttl``/``pollInterval`` in ms, ISO instants, the ``Task`` nested in
``CreateTaskResult`` and flat elsewhere). Decisions where the spec leaves room (see
``docs/architecture.md``):

- ``params.task`` on a ``forbidden`` tool is -32601 (the tools section's SHOULD), and so is a
  ``required`` tool called without it (its MUST; the Error Handling section's -32600 is a MAY).
  A tool with a callable policy is advertised ``optional`` and honours ``params.task`` whatever
  the callable decides.
- A tool result with ``isError: true`` stays ``completed``, as in the store and at 2026-07-28,
  although the 2025-11-25 text says such a task "should" reach ``failed``: the only client that
  drives this wire (the TypeScript SDK 1.32.2) fetches ``tasks/result`` for ``completed`` tasks
  only and reports a ``failed`` one as "Task X failed", so ``failed`` would hide the tool's
  error text from the model, while ``completed`` delivers it exactly as the call without a task
  would have.
- Scope: a session sees the tasks it created with ``params.task`` and nothing else (``tasks/get``,
  ``tasks/result``, ``tasks/cancel`` and ``tasks/list`` alike, so whatever ``tasks/get`` finds
  ``tasks/list`` lists), and the store's own scope applies on top. Tasks created for waited-for
  calls are not listed: the client never learnt their ids. After a restart a legacy-created task
  goes on as an ordinary durable task, visible to 2026-07-28 callers of its store scope.
"""

from __future__ import annotations

import base64
import binascii
import logging
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

import attrs
import trio

from tritask.jsonrpc import (
    CustomError,
    InternalError,
    InvalidParams,
    JsonRpcError,
    JSONValue,
    MethodNotFound,
)
from tritask.protocol.auth import InsufficientScope
from tritask.protocol.legacy import legacy_result
from tritask.server.context import Context
from tritask.server.extension import CallNext, MethodHandler, ToolCall
from tritask.server.legacy import legacy_call_result, shape_input_request
from tritask.server.results import tool_error_result
from tritask.server.session import ClientRequestFailed, Session, SessionClosed
from tritask.tasks._time import format_instant
from tritask.tasks.model import Snapshot, Task, TaskStatus
from tritask.tasks.relay import RELATED_TASK_KEY, SESSION_FILTER_KEY, RequestRelay, SessionRelay
from tritask.tasks.runner import RunnerNotRunning
from tritask.tasks.store import NOT_FOUND, Action, NotFound, StoreError, Unauthorized

if TYPE_CHECKING:
    from tritask.server.app import ToolDef
    from tritask.tasks.extension import Tasks

log = logging.getLogger("tritask.tasks")

TASKS_VERSION: Final = "2025-11-25"
"""The only initialize-era revision with (experimental) tasks."""
STATUS_NOTIFICATION: Final = "notifications/tasks/status"
TASK_NOT_FOUND: Final = "Failed to retrieve task: Task not found"
MISSING_CAPABILITY_CODE: Final = -32021
CAPABILITIES: Final[dict[str, JSONValue]] = {
    "tasks": {"list": {}, "cancel": {}, "requests": {"tools": {"call": {}}}}
}
TaskSupport = str
"""``"forbidden"``, ``"optional"`` or ``"required"``: a tool's ``execution.taskSupport``."""


def speaks_tasks(session: Session) -> bool:
    """Whether ``session`` gets the experimental task protocol: 2025-11-25, and the client
    declared ``capabilities.tasks`` (a client that did not is served as one that knows
    nothing of tasks: its task tools are waited for, ``params.task`` is ignored)."""
    return session.protocol_version == TASKS_VERSION and isinstance(
        session.client_capabilities.get("tasks"), dict
    )


def render_task(task: Task) -> dict[str, JSONValue]:
    """The 2025-11-25 ``Task``: ``ttl`` and ``pollInterval`` in ms, no status payload."""
    rendered: dict[str, JSONValue] = {"taskId": task.id, "status": task.status.value}
    if task.status_message is not None:
        rendered["statusMessage"] = task.status_message
    rendered["createdAt"] = format_instant(task.created_at)
    rendered["lastUpdatedAt"] = format_instant(task.last_updated_at)
    rendered["ttl"] = task.ttl_ms
    if task.poll_interval_ms is not None:
        rendered["pollInterval"] = task.poll_interval_ms
    return rendered


def requested_ttl(value: JSONValue) -> int | None:
    """``params.task`` of a task-augmented request: ``{ttl?: ms}``; other members are ignored."""
    if not isinstance(value, dict):
        raise InvalidParams("params.task must be an object")
    if "ttl" not in value:
        return None
    ttl = value["ttl"]
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or ttl != int(ttl) or ttl <= 0:
        raise InvalidParams("params.task.ttl must be a positive whole number of milliseconds")
    return int(ttl)


def encode_cursor(position: int) -> str:
    return base64.urlsafe_b64encode(f"t{position}".encode()).decode().rstrip("=")


def decode_cursor(cursor: JSONValue, limit: int) -> int:
    """The position a ``tasks/list`` cursor names; anything not issued here is -32602."""
    if not isinstance(cursor, str) or not cursor or len(cursor) > 64:
        raise InvalidParams("Invalid cursor")
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode("ascii")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise InvalidParams("Invalid cursor") from None
    digits = text[1:]
    if not text.startswith("t") or not digits.isdigit() or not digits.isascii():
        raise InvalidParams("Invalid cursor")
    position = int(digits)
    if encode_cursor(position) != cursor or not 0 < position <= limit:
        raise InvalidParams("Invalid cursor")
    return position


def with_related_task(result: Mapping[str, JSONValue], task_id: str) -> dict[str, JSONValue]:
    shaped = dict(result)
    meta = shaped.get("_meta")
    merged: dict[str, JSONValue] = dict(meta) if isinstance(meta, dict) else {}
    merged[RELATED_TASK_KEY] = {"taskId": task_id}
    shaped["_meta"] = merged
    return shaped


@attrs.define(eq=False)
class SessionTasks:
    """The tasks one 2025-11-25 session created with ``params.task``, in creation order."""

    positions: dict[str, int] = attrs.field(factory=dict)
    """Task id to its position (1, 2, ...): a cursor names a position, so forgetting an expired
    task never shifts the pages after it."""
    next_position: int = 1

    def add(self, task_id: str) -> None:
        self.positions[task_id] = self.next_position
        self.next_position += 1

    def forget(self, task_id: str) -> None:
        self.positions.pop(task_id, None)


@attrs.define(eq=False)
class _Watch:
    """One follower's view of the snapshots the local runner applies to its task."""

    changed: trio.Event = attrs.field(factory=trio.Event)
    latest: Snapshot | None = None

    def offer(self, snapshot: Snapshot) -> None:
        if self.latest is None or snapshot.revision > self.latest.revision:
            self.latest = snapshot
            self.changed.set()

    async def next(self, poll_seconds: float) -> Snapshot | None:
        """The newest offered snapshot, or ``None`` after ``poll_seconds`` (then read the store)."""
        with trio.move_on_after(poll_seconds):
            await self.changed.wait()
        self.changed = trio.Event()
        latest, self.latest = self.latest, None
        return latest


@attrs.define(eq=False)
class _Follow:
    """What following one task learnt besides its state."""

    refusal: str | None = None
    """Why the client could not give the task its input (the task was cancelled for it)."""
    answered: set[str] = attrs.field(factory=set)


class LegacyTasks:
    """The initialize-era rendering of one :class:`~tritask.tasks.extension.Tasks`."""

    follow_poll_seconds: float = 1.0
    """How often a waiting request re-reads the store (local transitions wake it at once; this
    catches a task run, answered or cancelled by another process)."""
    cancel_seconds: float = 5.0
    """How long cancelling a task for a legacy client may take (the attempt must exit)."""
    page_size: int = 50
    max_session_tasks: int = 10_000
    """Task-augmented tasks one session may hold at a time (expired ones do not count)."""

    def __init__(self, tasks: Tasks) -> None:
        self.tasks = tasks
        self._watches: dict[str, set[_Watch]] = {}
        self._asking: dict[str, set[str]] = {}
        self._owners: weakref.WeakValueDictionary[str, Session] = weakref.WeakValueDictionary()
        """Task id to the 2025-11-25 session that created it (for status notifications)."""
        self._methods: dict[str, MethodHandler] = {
            "tasks/get": self._get,
            "tasks/result": self._result,
            "tasks/list": self._list,
            "tasks/cancel": self._cancel,
        }

    # -- extension hooks -----------------------------------------------------------------

    def session_opened(self, session: Session) -> None:
        if speaks_tasks(session):
            session.standalone_filter[SESSION_FILTER_KEY] = [session.id]

    def capabilities(self, session: Session) -> dict[str, JSONValue]:
        return dict(CAPABILITIES) if speaks_tasks(session) else {}

    def methods(self, session: Session) -> Mapping[str, MethodHandler]:
        return self._methods if speaks_tasks(session) else {}

    def tool_fields(self, tool: ToolDef, session: Session) -> dict[str, JSONValue]:
        if not speaks_tasks(session):
            return {}
        return {"execution": {"taskSupport": self.tasks.task_support_of(tool)}}

    def observe(self, snapshot: Snapshot) -> None:
        """Every transition the local runner applies: wake followers, tell the owner session."""
        task = snapshot.task
        watches = self._watches.get(task.id)
        if watches:
            for watch in watches:
                watch.offer(snapshot)
        if not self._owners:
            return
        session = self._owners.get(task.id)
        if session is None:
            return
        app = self.tasks.app
        if not session.closed and app is not None and app.hub.subscriber_count:
            app.hub.publish(
                STATUS_NOTIFICATION, render_task(task), {SESSION_FILTER_KEY: [session.id]}
            )
        if task.status.is_terminal:
            self._owners.pop(task.id, None)

    # -- tools/call ----------------------------------------------------------------------

    async def tool_call(
        self, call: ToolCall, ctx: Context, call_next: CallNext
    ) -> dict[str, JSONValue]:
        session = ctx.session
        assert session is not None
        support = self.tasks.task_support_of(call.tool)
        experimental = speaks_tasks(session)
        if experimental and "task" in call.params:
            ttl = requested_ttl(call.params["task"])
            if support == "forbidden":
                raise MethodNotFound(
                    f"Tool {call.tool.name} does not support task augmentation "
                    "(taskSupport: 'forbidden'); call it without params.task"
                )
            _, options = await self.tasks.decide(call, ctx)
            return await self._create_augmented(call, ctx, session, options, ttl)
        if experimental and support == "required":
            raise MethodNotFound(
                f"Tool {call.tool.name} requires task augmentation (taskSupport: 'required'); "
                "call it with params.task"
            )
        mode, options = await self.tasks.decide(call, ctx)
        if mode == "sync":
            return await call_next(call, ctx)
        return await self._run_and_wait(call, ctx, session, options)

    async def _create_augmented(
        self, call: ToolCall, ctx: Context, session: Session, options: Any, ttl: int | None
    ) -> dict[str, JSONValue]:
        owned = self._session_tasks(session)
        if len(owned.positions) >= self.max_session_tasks:
            await self._prune(owned, ctx)
            if len(owned.positions) >= self.max_session_tasks:
                raise InternalError(
                    f"This session holds {self.max_session_tasks} tasks; let some finish and "
                    "expire first",
                    {"retryable": True},
                )
        task_id = self.tasks.new_task_id()
        token = ctx.meta.progress_token
        app = self.tasks.app
        relay = None
        if token is not None and app is not None:
            relay = SessionRelay(app.hub, session, token, task_id)
        self._owners[task_id] = session
        try:
            snapshot = await self.tasks.create_snapshot(
                call, ctx, options, task_id, requested_ttl_ms=ttl, relay=relay
            )
        except BaseException:
            self._owners.pop(task_id, None)
            raise
        owned.add(task_id)
        return {"task": render_task(snapshot.task)}

    async def _run_and_wait(
        self, call: ToolCall, ctx: Context, session: Session, options: Any
    ) -> dict[str, JSONValue]:
        task_id = self.tasks.new_task_id()
        token, emit = ctx.meta.progress_token, ctx.emit
        relay = RequestRelay(emit, token) if token is not None and emit is not None else None
        try:
            await self.tasks.create_snapshot(call, ctx, options, task_id, relay=relay)
            follow = _Follow()
            try:
                final = await self._follow(task_id, ctx, follow, related=False)
            except BaseException:  # trio.Cancelled, possibly in a group from _follow's nursery
                if session.cancel_requested(ctx.request_id):
                    log.debug("legacy client cancelled the call of task %s", task_id)
                    await self._cancel_task(task_id, ctx)
                raise
        finally:
            if relay is not None:
                relay.close()
        if isinstance(final, NotFound):
            raise InternalError(f"Task {task_id} expired before it finished", {"taskId": task_id})
        return self._outcome(final.task, follow)

    def _outcome(self, task: Task, follow: _Follow) -> dict[str, JSONValue]:
        """What the call would have answered: its result, its error, or why it has none."""
        if task.status is TaskStatus.COMPLETED:
            assert task.result is not None
            return legacy_call_result(legacy_result(task.result))
        if task.status is TaskStatus.FAILED:
            error = task.error or {}
            code, message = error.get("code"), error.get("message")
            if isinstance(code, bool) or not isinstance(code, int) or not isinstance(message, str):
                raise InternalError("Internal error")
            if code == MISSING_CAPABILITY_CODE:
                return tool_error_result(message)
            raise CustomError(code, message, error.get("data"))
        if follow.refusal is not None:
            return tool_error_result(follow.refusal)
        raise CustomError(-32603, f"Task {task.id} was cancelled", {"taskId": task.id})

    # -- following a task to its end -----------------------------------------------------

    async def _follow(
        self, task_id: str, ctx: Context, follow: _Follow, *, related: bool
    ) -> Snapshot | NotFound:
        """Wait until the task is terminal (or gone), asking the client for its input meanwhile.

        The local runner's transitions wake the wait at once; the store is re-read every
        ``follow_poll_seconds`` for what happens elsewhere. Each outstanding input request is
        asked once at a time across all followers of the task.
        """
        store, _ = self.tasks.parts()
        try:
            access = await store.authorize(ctx, Action.GET, task_id)
        except Unauthorized:
            return NOT_FOUND
        watch = _Watch()
        watches = self._watches.setdefault(task_id, set())
        watches.add(watch)
        refused: frozenset[str] | None = None
        try:
            async with trio.open_nursery() as nursery:
                snapshot = await store.get(task_id, access)
                while True:
                    if isinstance(snapshot, NotFound) or snapshot.task.status.is_terminal:
                        nursery.cancel_scope.cancel()
                        return snapshot
                    if snapshot.task.input_requests and ctx.auth is not None:
                        # Answering acts on the task's tool, as tasks/update does: the
                        # token must carry that tool's scopes to be asked at all.
                        needed = self.tasks.creating_tool_scopes(snapshot)
                        if not ctx.auth.has_scopes(needed):
                            refused = needed
                            nursery.cancel_scope.cancel()
                            break
                    for key, request in snapshot.task.input_requests.items():
                        if key not in follow.answered and self._claim(task_id, key):
                            nursery.start_soon(
                                self._ask, task_id, key, request, ctx, follow, related
                            )
                    newer = await watch.next(self.follow_poll_seconds)
                    if newer is None:
                        snapshot = await store.get(task_id, access)
                    elif newer.revision > snapshot.revision:
                        snapshot = newer
            assert refused is not None  # the loop is left only by return or this break
            raise InsufficientScope(refused)
        finally:
            watches.discard(watch)
            if not watches:
                self._watches.pop(task_id, None)

    def _claim(self, task_id: str, key: str) -> bool:
        asking = self._asking.setdefault(task_id, set())
        if key in asking:
            return False
        asking.add(key)
        return True

    def _release(self, task_id: str, key: str) -> None:
        asking = self._asking.get(task_id)
        if asking is not None:
            asking.discard(key)
            if not asking:
                del self._asking[task_id]

    async def _ask(
        self,
        task_id: str,
        key: str,
        request: JSONValue,
        ctx: Context,
        follow: _Follow,
        related: bool,
    ) -> None:
        """Ask the client for one input of the task and give the task its answer."""
        session, emit = ctx.session, ctx.emit
        assert session is not None
        try:
            if emit is None:
                await self._refuse(
                    task_id, ctx, follow, "This transport cannot carry server-initiated requests"
                )
                return
            try:
                method, params = shape_input_request(request, session)
            except JsonRpcError as error:
                await self._refuse(task_id, ctx, follow, error.message)
                return
            if related:
                meta = params.get("_meta")
                merged: dict[str, JSONValue] = dict(meta) if isinstance(meta, dict) else {}
                merged[RELATED_TASK_KEY] = {"taskId": task_id}
                params["_meta"] = merged
            try:
                answer = await session.request(method, params, emit)
            except ClientRequestFailed as error:
                await self._refuse(task_id, ctx, follow, error.message)
                return
            except SessionClosed:
                return  # the client went away: the task waits for an answer from elsewhere
            store, runner = self.tasks.parts()
            try:
                access = await store.authorize(ctx, Action.UPDATE, task_id)
            except Unauthorized:
                return
            await runner.update(task_id, {key: answer}, access)
            follow.answered.add(key)
        finally:
            self._release(task_id, key)

    async def _refuse(self, task_id: str, ctx: Context, follow: _Follow, reason: str) -> None:
        follow.refusal = reason
        await self._cancel_task(task_id, ctx)

    async def _cancel_task(self, task_id: str, ctx: Context) -> None:
        """Cancel for a legacy client, even from a cancelled request (bounded, shielded)."""
        store, runner = self.tasks.parts()
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + self.cancel_seconds
            try:
                access = await store.authorize(ctx, Action.CANCEL, task_id)
                await runner.cancel(task_id, access)
            except (Unauthorized, StoreError, RunnerNotRunning) as error:
                log.warning("cancelling task %s for a legacy client failed: %s", task_id, error)
        if scope.cancelled_caught:
            log.warning("cancelling task %s took longer than %ss", task_id, self.cancel_seconds)

    # -- the 2025-11-25 task methods -------------------------------------------------------

    def _session_tasks(self, session: Session) -> SessionTasks:
        state = session.extension_state.get(self.tasks.id)
        if not isinstance(state, SessionTasks):
            state = SessionTasks()
            session.extension_state[self.tasks.id] = state
        return state

    async def _owned(self, params: Mapping[str, JSONValue], ctx: Context) -> Snapshot:
        """The session's own task named by ``params.taskId`` (-32602 for any other)."""
        task_id = params.get("taskId")
        limit = self.tasks.max_task_id_bytes
        if not isinstance(task_id, str) or not task_id:
            raise InvalidParams("A non-empty taskId is required")
        if len(task_id.encode("utf-8")) > limit:
            raise InvalidParams(f"taskId is longer than {limit} bytes")
        assert ctx.session is not None
        owned = self._session_tasks(ctx.session)
        if task_id not in owned.positions:
            raise InvalidParams(TASK_NOT_FOUND)
        snapshot = await self.tasks.lookup(task_id, ctx, Action.GET)
        if snapshot is None:
            owned.forget(task_id)
            raise InvalidParams(TASK_NOT_FOUND)
        return snapshot

    async def _get(self, params: dict[str, JSONValue], ctx: Context) -> dict[str, JSONValue]:
        snapshot = await self._owned(params, ctx)
        return render_task(snapshot.task)

    async def _result(self, params: dict[str, JSONValue], ctx: Context) -> dict[str, JSONValue]:
        snapshot = await self._owned(params, ctx)
        task_id = snapshot.task.id
        follow = _Follow()
        final = await self._follow(task_id, ctx, follow, related=True)
        if isinstance(final, NotFound):
            assert ctx.session is not None
            self._session_tasks(ctx.session).forget(task_id)
            raise InvalidParams(TASK_NOT_FOUND)
        return with_related_task(self._outcome(final.task, follow), task_id)

    async def _list(self, params: dict[str, JSONValue], ctx: Context) -> dict[str, JSONValue]:
        assert ctx.session is not None
        owned = self._session_tasks(ctx.session)
        start = 1
        if params.get("cursor") is not None:
            start = decode_cursor(params["cursor"], owned.next_position)
        tasks: list[JSONValue] = []
        next_cursor: str | None = None
        for task_id, position in list(owned.positions.items()):
            if position < start:
                continue
            if len(tasks) == self.page_size:
                next_cursor = encode_cursor(position)
                break
            snapshot = await self.tasks.lookup(task_id, ctx, Action.GET)
            if snapshot is None:
                owned.forget(task_id)
                continue
            tasks.append(render_task(snapshot.task))
        result: dict[str, JSONValue] = {"tasks": tasks}
        if next_cursor is not None:
            result["nextCursor"] = next_cursor
        return result

    async def _cancel(self, params: dict[str, JSONValue], ctx: Context) -> dict[str, JSONValue]:
        snapshot = await self._owned(params, ctx)
        task = snapshot.task
        if not task.status.is_terminal:
            _, runner = self.tasks.parts()
            store = self.tasks.store
            assert store is not None
            try:
                access = await store.authorize(ctx, Action.CANCEL, task.id)
            except Unauthorized:
                raise InvalidParams(TASK_NOT_FOUND) from None
            cancelled = await runner.cancel(task.id, access)
            if isinstance(cancelled, NotFound):
                raise InvalidParams(TASK_NOT_FOUND)
            task = cancelled.task
            if task.status is TaskStatus.CANCELLED:
                return render_task(task)
        raise InvalidParams(f"Cannot cancel task: already in terminal status '{task.status.value}'")

    async def _prune(self, owned: SessionTasks, ctx: Context) -> None:
        for task_id in list(owned.positions):
            if await self.tasks.lookup(task_id, ctx, Action.GET) is None:
                owned.forget(task_id)
