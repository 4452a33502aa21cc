"""Following a task: pushed states when the server grants a listen stream, polls otherwise.

A ``TaskHandle`` names one task. ``wait``/``result`` follow it to a terminal state, answering
its input requests through the client's handlers; ``updates`` yields every distinct state as
it arrives and answers nothing (answer with ``respond``). Both read states from a watch:

- When the client may listen, the watch opens ``subscriptions/listen`` with ``taskIds: [id]``
  and, if the acknowledgement grants that id, takes ``notifications/tasks`` (each a full
  DetailedTask) as they come. It reads the task once right after the acknowledgement, so a
  transition committed before the stream opened is never missed, whether or not the server
  sends a snapshot.
- Otherwise, or when the server refuses or ends the stream (and listening again fails), it
  polls ``tasks/get`` every ``pollIntervalMs`` (the server's latest suggestion) or the
  client's ``poll_interval``.
- A listened task that stays silent for ``guard`` seconds is read once with ``tasks/get`` and
  the stream reopened, so a push lost between hosts costs a delay, never a hang.

Two reports of the same state (a push and a poll) count once.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Callable, Mapping
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Final

import attrs
import trio

from tritask.client.errors import (
    ClientError,
    MethodNotFoundError,
    MissingCapabilityError,
    RpcError,
    TaskCancelled,
    TransportError,
    error_from,
)
from tritask.client.model import TaskState, ToolResult
from tritask.jsonrpc import JSONValue

if TYPE_CHECKING:
    from tritask.client.client import Client, Subscription

log = logging.getLogger("tritask.client")

LISTEN_GUARD_SECONDS: Final = 30.0
MAX_LISTEN_FAILURES: Final = 3
MIN_POLL_SECONDS: Final = 0.001


class TaskHandle:
    """One task of one server, reached through ``client``."""

    def __init__(
        self, client: Client, state: TaskState | None, *, task_id: str | None = None
    ) -> None:
        if state is None and task_id is None:
            raise ValueError("a TaskHandle needs a state or a task id")
        self.client = client
        self.task_id: str = state.task_id if state is not None else str(task_id)
        self.latest: TaskState | None = state
        """The most recent state this handle has seen."""
        self.answered: set[str] = set()
        """Input keys this handle has already answered (keys are never reused by a task)."""

    def __repr__(self) -> str:
        status = self.latest.status if self.latest is not None else "?"
        return f"<TaskHandle {self.task_id} {status}>"

    def _seen(self, state: TaskState) -> TaskState:
        if state.task_id != self.task_id:
            raise ClientError(f"expected task {self.task_id}, got {state.task_id}")
        self.latest = state
        return state

    async def status(self) -> TaskState:
        """The task now (``tasks/get``)."""
        raw = await self.client.request("tasks/get", {"taskId": self.task_id})
        return self._seen(TaskState.from_wire(raw))

    async def respond(self, key: str, response: Mapping[str, JSONValue]) -> None:
        """Answer one input request of the task (``tasks/update``)."""
        await self.respond_all({key: response})

    async def respond_all(self, responses: Mapping[str, Mapping[str, JSONValue]]) -> None:
        """Answer several input requests in one ``tasks/update``."""
        await self.client.request(
            "tasks/update",
            {"taskId": self.task_id, "inputResponses": {k: dict(v) for k, v in responses.items()}},
        )
        self.answered.update(responses)

    async def cancel(self) -> None:
        """Ask the server to cancel the task (an acknowledgement; the state follows)."""
        await self.client.request("tasks/cancel", {"taskId": self.task_id})

    async def wait(
        self,
        *,
        answer_inputs: bool = True,
        on_state: Callable[[TaskState], None] | None = None,
    ) -> TaskState:
        """Follow the task to a terminal state and return it.

        With ``answer_inputs`` each input request not yet answered goes to the client's
        handlers and the answers are sent with ``tasks/update``; ``on_state`` sees every
        distinct state on the way.
        """
        previous: TaskState | None = None
        async with _Watch(self) as watch:
            while True:
                state = self._seen(await watch.next())
                if state.same_as(previous):
                    continue
                previous = state
                if on_state is not None:
                    on_state(state)
                if state.terminal:
                    return state
                if answer_inputs and state.status == "input_required":
                    pending = {
                        key: request
                        for key, request in state.input_requests.items()
                        if key not in self.answered
                    }
                    if pending:
                        await self.respond_all(await self.client.answer(pending))
                        watch.poll_soon()

    async def result(
        self,
        *,
        answer_inputs: bool = True,
        on_state: Callable[[TaskState], None] | None = None,
    ) -> ToolResult:
        """The tool's result once the task completed (``is_error`` results included).

        A failed task raises the ``RpcError`` of its ``error`` (with ``task_id`` set); a
        cancelled one raises ``TaskCancelled``.
        """
        state = await self.wait(answer_inputs=answer_inputs, on_state=on_state)
        return outcome(state)

    async def updates(self) -> AsyncGenerator[TaskState, None]:
        """Every distinct state from now on, ending with the terminal one.

        Answers nothing: respond to ``input_required`` states with ``respond``. Leaving the
        loop early closes the listen stream when the generator is closed; use
        ``contextlib.aclosing(handle.updates())`` to close it at once.
        """
        previous: TaskState | None = None
        async with _Watch(self) as watch:
            while True:
                state = self._seen(await watch.next())
                if state.same_as(previous):
                    continue
                previous = state
                yield state
                if state.terminal:
                    return


def outcome(state: TaskState) -> ToolResult:
    """What a terminal task means to its caller: a result, or the exception it ended with."""
    if state.status == "completed":
        return ToolResult.from_result(state.result or {}, task_id=state.task_id)
    if state.status == "failed":
        raise error_from(state.error or {}, task_id=state.task_id)
    if state.status == "cancelled":
        raise TaskCancelled(state.task_id, state)
    raise ClientError(f"task {state.task_id} is not finished ({state.status})")


class _Watch:
    """Successive states of one task (see the module docstring)."""

    def __init__(self, handle: TaskHandle, guard: float = LISTEN_GUARD_SECONDS) -> None:
        self.handle = handle
        self.client = handle.client
        self.guard = guard
        self._subscription: Subscription | None = None
        self._stack: AsyncExitStack | None = None
        self._failures = 0
        self._poll_now = True

    async def __aenter__(self) -> _Watch:
        await self._listen()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._unlisten()

    def poll_soon(self) -> None:
        self._poll_now = True

    async def _listen(self) -> None:
        client = self.client
        if not (client.listen_for_tasks and client.tasks) or self._failures >= MAX_LISTEN_FAILURES:
            return
        stack = AsyncExitStack()
        try:
            subscription = await stack.enter_async_context(
                client.listen(task_ids=[self.handle.task_id])
            )
        except (MethodNotFoundError, MissingCapabilityError) as error:
            await stack.aclose()
            log.debug("no task listening (%s); polling", error)
            self._failures = MAX_LISTEN_FAILURES
            return
        except (RpcError, TransportError) as error:
            await stack.aclose()
            self._failures += 1
            log.debug("listen for task %s failed (%s)", self.handle.task_id, error)
            return
        if self.handle.task_id not in subscription.task_ids:
            await stack.aclose()
            log.debug("listen did not grant task %s; polling", self.handle.task_id)
            self._failures = MAX_LISTEN_FAILURES
            return
        self._subscription, self._stack = subscription, stack
        self._poll_now = True  # read once: whatever happened before the stream opened

    async def _unlisten(self) -> None:
        stack, self._stack, self._subscription = self._stack, None, None
        if stack is not None:
            await stack.aclose()

    async def next(self) -> TaskState:
        if self._poll_now:
            self._poll_now = False
            return await self.handle.status()
        subscription = self._subscription
        if subscription is None:
            await trio.sleep(self._interval())
            return await self.handle.status()
        with trio.move_on_after(self.guard):
            try:
                async for notification in subscription:
                    state = notification.task
                    if state is not None and state.task_id == self.handle.task_id:
                        self._failures = 0
                        return state
            except TransportError as error:
                log.debug("task listen stream failed: %s", error)
            self._failures += 1  # the stream ended or failed: listen again, a few times
        # Silent for `guard` seconds, or the stream ended: read the task, listen again.
        await self._unlisten()
        state = await self.handle.status()
        if not state.terminal:
            await self._listen()
            self._poll_now = False
        return state

    def _interval(self) -> float:
        latest = self.handle.latest
        if latest is not None and latest.poll_interval_ms is not None:
            return max(MIN_POLL_SECONDS, latest.poll_interval_ms / 1000)
        return max(MIN_POLL_SECONDS, self.client.poll_interval)


@attrs.define(eq=False)
class ToolCall:
    """A started ``tools/call``: its task, or the result the server gave at once."""

    name: str
    task: TaskHandle | None
    immediate: ToolResult | None

    @property
    def task_id(self) -> str | None:
        return self.task.task_id if self.task is not None else None

    async def status(self) -> TaskState | None:
        """The task now; ``None`` when the server answered at once (there is no task)."""
        return await self.task.status() if self.task is not None else None

    async def respond(self, key: str, response: Mapping[str, JSONValue]) -> None:
        if self.task is None:
            raise ClientError(f"{self.name} returned at once; there is no task to respond to")
        await self.task.respond(key, response)

    async def cancel(self) -> None:
        """Cancel the task (nothing to do for a call that already returned)."""
        if self.task is not None:
            await self.task.cancel()

    async def result(
        self,
        *,
        answer_inputs: bool = True,
        on_state: Callable[[TaskState], None] | None = None,
    ) -> ToolResult:
        if self.task is None:
            assert self.immediate is not None
            return self.immediate
        return await self.task.result(answer_inputs=answer_inputs, on_state=on_state)

    def updates(self) -> AsyncGenerator[TaskState, None]:
        """The task's states (nothing for a call that returned at once)."""
        return self.task.updates() if self.task is not None else _nothing()


async def _nothing() -> AsyncGenerator[TaskState, None]:
    return
    yield  # an async generator that yields nothing
