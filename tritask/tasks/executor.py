"""The execution boundary: what a runner asks an executor to do, and what it may answer.

A ``WorkExecutor`` is application-owned and resolved on every claim (the first one and every
recovered one), so work survives the process that accepted it. Only an explicit ``Retry``
consumes the retry policy; exceptions, invalid answers and cancellation fail closed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar, runtime_checkable

import attrs
import trio

from tritask.tasks.work import JSONObject, Work, ensure_json_object

if TYPE_CHECKING:
    from tritask.server.context import Context

T = TypeVar("T")


@attrs.frozen
class Completed:
    """The work finished; ``result`` is the task's result (a ``CallToolResult`` for tools)."""

    result: JSONObject


@attrs.frozen
class Failed:
    """The work failed for good (terminal even when retry delays remain)."""

    error: JSONObject
    message: str | None = None


@attrs.frozen
class Retry:
    """Ask for the next delay of the work's retry policy (fails the task when exhausted)."""

    error: JSONObject
    message: str | None = None


Outcome = Completed | Failed | Retry


def internal_error(message: str) -> JSONObject:
    return {"code": -32603, "message": message}


def validate_outcome(value: object) -> Outcome:
    """Admit only well-formed JSON outcomes; anything else is an executor failure."""
    if isinstance(value, Completed):
        return Completed(ensure_json_object(value.result, what="result"))
    if isinstance(value, Failed | Retry):
        error = ensure_json_object(value.error, what="error")
        if not isinstance(error.get("code"), int) or not isinstance(error.get("message"), str):
            raise TypeError("an error must be a JSON-RPC error object {code, message, data?}")
        if value.message is not None and not isinstance(value.message, str):
            raise TypeError("a status message must be a string or None")
        return type(value)(error, value.message)
    raise TypeError(f"an executor returned {type(value).__name__}, not Completed/Failed/Retry")


class TaskCancelled(Exception):
    """Raised by ``ExecutionToken.raise_if_cancelled`` in cooperative (thread) code."""


class StaleAttempt(Exception):
    """This attempt was replaced (reclaimed, cancelled, timed out); it may not act any more."""


@runtime_checkable
class InputChannel(Protocol):
    async def await_input(self, key: str, request: JSONObject) -> JSONObject: ...

    async def step(
        self,
        key: str,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        *,
        fingerprint: str | None = None,
        timeout_s: float | None = None,
        retry: Sequence[int] = (),
        semantics: Literal["at_least_once", "at_most_once"] = "at_least_once",
        thread: bool = False,
    ) -> Any: ...

    async def sleep(self, key: str, seconds: float) -> None: ...

    def step_key(self, key: str) -> str: ...


@attrs.define(eq=False)
class ExecutionToken:
    """One attempt's identity and cooperative cancellation flag.

    The runner cancels the attempt's trio cancel scope, which stops async work at its next
    checkpoint; code running in a thread cannot be interrupted, so it polls ``cancelled``
    (a flag the runner sets first). The flag is a plain attribute that only ever goes from
    false to true: one attribute store and load are atomic between threads, so it needs no
    lock (a ``threading.Event`` per attempt cost more than the rest of the token).
    """

    task_id: str
    idempotency_key: str
    generation: int
    recovered: bool
    context: Context | None = None
    _input: InputChannel | None = attrs.field(default=None, repr=False)
    _cancelled: bool = attrs.field(default=False, repr=False)

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        self._cancelled = True

    def raise_if_cancelled(self) -> None:
        if self._cancelled:
            raise TaskCancelled(self.task_id)

    async def await_input(self, key: str, request: JSONObject) -> JSONObject:
        """Park until ``tasks/update`` answers ``request`` (see the runner's inbox rules)."""
        if self._input is None:
            raise StaleAttempt(self.task_id)
        return await self._input.await_input(key, request)

    async def step(
        self,
        key: str,
        fn: Callable[..., Any],
        *args: Any,
        fingerprint: str | None = None,
        timeout_s: float | None = None,
        retry: Sequence[int] = (),
        semantics: Literal["at_least_once", "at_most_once"] = "at_least_once",
        thread: bool = False,
        **kwargs: Any,
    ) -> Any:
        """A durable step of this task (see ``Context.step``)."""
        if self._input is None:
            raise StaleAttempt(self.task_id)
        return await self._input.step(
            key,
            fn,
            args,
            kwargs,
            fingerprint=fingerprint,
            timeout_s=timeout_s,
            retry=retry,
            semantics=semantics,
            thread=thread,
        )

    async def sleep(self, key: str, seconds: float) -> None:
        """A durable sleep of this task (see ``Context.sleep``)."""
        if self._input is None:
            raise StaleAttempt(self.task_id)
        await self._input.sleep(key, seconds)

    def step_key(self, key: str) -> str:
        """``task_id/key``: a stable idempotency key for the external call of step ``key``."""
        if self._input is None:
            raise StaleAttempt(self.task_id)
        return self._input.step_key(key)

    async def run_in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking ``fn(token, *args)`` in a thread; it should poll ``token.cancelled``."""
        return await trio.to_thread.run_sync(fn, self, *args)


@runtime_checkable
class WorkExecutor(Protocol):
    """Executes work descriptors; state is rebuilt by the application, never persisted."""

    async def execute(self, work: Work, token: ExecutionToken, state: Any) -> Outcome: ...


@attrs.define
class RoutingExecutor:
    """Dispatch by ``work.type`` to one executor per type (e.g. tools plus custom jobs)."""

    routes: dict[str, WorkExecutor]

    async def execute(self, work: Work, token: ExecutionToken, state: Any) -> Outcome:
        executor = self.routes.get(work.type)
        if executor is None:
            return Failed(internal_error(f"No executor for work type {work.type!r}"))
        return await executor.execute(work, token, state)
