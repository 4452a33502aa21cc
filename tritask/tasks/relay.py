"""Progress relays: how a detached task worker reports to the legacy client waiting for it.

A task's worker context is detached (:meth:`tritask.server.context.Context.detach`): it outlives
the request that created it and keeps nothing of it, so by itself its ``ctx.progress`` goes
nowhere. An initialize-era client, though, keeps waiting for its task tool and asked for
progress with the request's ``progressToken``. The worker gets a *relay* instead of the
request: the only thing it can do is report progress, and it turns inert once there is no one
left to report to, so a worker (or the runner's copy of its context) never holds a stream or a
session.

- :class:`RequestRelay` sends on the waiting request's own stream. The request closes it when
  it ends (answered, cancelled, or its client gone). A send that stalls (a client that stopped
  reading) is given up after ``send_seconds`` and closes the relay: a durable task must never
  hang on a notification nobody reads.
- :class:`SessionRelay` serves a 2025-11-25 task-augmented call, whose request was answered at
  once with ``CreateTaskResult``: the creating request's token stays valid for the task's
  lifetime, so progress goes to the session's standalone stream through the app's hub (which
  never blocks). It holds the session weakly and stops once the session is closed.

Both drop values that do not increase (progress MUST increase; a retried attempt starts again
from its own first step).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Final

import trio

from tritask.jsonrpc import JSONValue, RequestId, notification_message
from tritask.server.session import Emit, Session

if TYPE_CHECKING:
    from tritask.server.hub import Hub

__all__ = ["PROGRESS", "RELATED_TASK_KEY", "SESSION_FILTER_KEY", "RequestRelay", "SessionRelay"]

PROGRESS: Final = "notifications/progress"
RELATED_TASK_KEY: Final = "io.modelcontextprotocol/related-task"
SESSION_FILTER_KEY: Final = "legacyTaskSession"
"""Hub filter key of a 2025-11-25 session's standalone stream: the session id (a list of one)."""
SEND_SECONDS: Final = 5.0


def progress_params(
    token: RequestId, progress: float, total: float | None, message: str | None
) -> dict[str, JSONValue]:
    params: dict[str, JSONValue] = {"progressToken": token, "progress": progress}
    if total is not None:
        params["total"] = total
    if message is not None:
        params["message"] = message
    return params


class _Increasing:
    def __init__(self) -> None:
        self._last: float | None = None

    def admit(self, progress: float) -> bool:
        if self._last is not None and progress <= self._last:
            return False
        self._last = progress
        return True


class RequestRelay:
    """Progress to the stream of the request waiting for the task; inert once closed."""

    def __init__(self, emit: Emit, token: RequestId, *, send_seconds: float = SEND_SECONDS) -> None:
        self._emit: Emit | None = emit
        self._token = token
        self._send_seconds = send_seconds
        self._increasing = _Increasing()
        self._sending: set[trio.CancelScope] = set()

    @property
    def closed(self) -> bool:
        return self._emit is None

    async def progress(self, progress: float, total: float | None, message: str | None) -> None:
        emit = self._emit
        if emit is None or not self._increasing.admit(progress):
            return
        params = progress_params(self._token, progress, total, message)
        with trio.CancelScope(deadline=trio.current_time() + self._send_seconds) as scope:
            self._sending.add(scope)
            try:
                await emit(notification_message(PROGRESS, params))
            except Exception:  # the stream is gone: so is anyone to report to
                self.close()
            finally:
                self._sending.discard(scope)
        if scope.cancelled_caught:  # stalled, or closed meanwhile
            self.close()

    def close(self) -> None:
        """The request is gone: drop its stream and abandon a send in progress."""
        self._emit = None
        for scope in list(self._sending):
            scope.cancel()


class SessionRelay:
    """Progress of a task-augmented call to its session's standalone stream, via the hub."""

    def __init__(self, hub: Hub, session: Session, token: RequestId, task_id: str) -> None:
        self._hub = hub
        self._session = weakref.ref(session)
        self._selector: dict[str, JSONValue] = {SESSION_FILTER_KEY: [session.id]}
        self._token = token
        self._meta: dict[str, JSONValue] = {RELATED_TASK_KEY: {"taskId": task_id}}
        self._increasing = _Increasing()

    @property
    def closed(self) -> bool:
        session = self._session()
        return session is None or session.closed

    async def progress(self, progress: float, total: float | None, message: str | None) -> None:
        if self.closed or not self._increasing.admit(progress):
            return
        params = progress_params(self._token, progress, total, message)
        params["_meta"] = dict(self._meta)
        self._hub.publish(PROGRESS, params, self._selector)
