"""The pure reducer: ``apply(snapshot, event, committed_at) -> Outcome``.

No clock, no store, no trio. Every store runs this same function inside its own atomic step, so
all adapters agree on the state machine by construction.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from tritask.tasks.events import Effects, Event, EventKind, RetryEffect
from tritask.tasks.model import CANCELLED_MESSAGE, Snapshot, TaskStatus, revise

__all__ = ["DuplicateInputKey", "Effects", "Outcome", "RetryEffect", "apply"]


class DuplicateInputKey(ValueError):
    """An input key was requested twice; keys are unique for a task's whole life."""

    def __init__(self, key: str) -> None:
        super().__init__(f"input key {key!r} was already used by this task")
        self.key = key


@attrs.frozen(kw_only=True)
class Outcome:
    """``applied`` (a new snapshot at revision + 1) or ``unchanged`` (the input snapshot)."""

    kind: Literal["applied", "unchanged"]
    snapshot: Snapshot
    effects: Effects


def apply(snapshot: Snapshot, event: Event, committed_at: int) -> Outcome:
    """Apply ``event`` to ``snapshot`` as if committed at ``committed_at`` (µs).

    ``committed_at`` must be later than the task's ``last_updated_at``: stores make commit times
    strictly increase per task. Raises :class:`DuplicateInputKey` on input key reuse.

    The new snapshot is built with :func:`~tritask.tasks.model.revise`: what the event brings
    is checked and copied, every record invariant is checked on the result, and unchanged
    fields are shared with ``snapshot`` (values: stores copy what they hand out).
    """
    if not isinstance(committed_at, int) or committed_at <= snapshot.task.last_updated_at:
        raise ValueError("committed_at must be an int after the task's last update")
    kind = event.kind
    if kind is EventKind.INPUT_RESPONSES_ACCEPTED:
        return _accept(snapshot, event, committed_at)
    if snapshot.task.status.is_terminal:
        return _unchanged(snapshot)
    if kind is EventKind.INPUT_REQUESTED:
        return _request_input(snapshot, event, committed_at)
    if kind is EventKind.RETRY_REQUESTED:
        return _retry(snapshot, event, committed_at)
    if kind is EventKind.COMPLETED:
        task = _settle(TaskStatus.COMPLETED, None, result=event.data["result"])
    elif kind is EventKind.FAILED:
        message = event.data["statusMessage"]
        task = _settle(TaskStatus.FAILED, message, error=event.data["error"])
    else:
        task = _settle(TaskStatus.CANCELLED, CANCELLED_MESSAGE)
    return _applied(snapshot, committed_at, _NO_EFFECTS, task, retry_at=None)


_NO_EFFECTS = Effects.none()


def _unchanged(snapshot: Snapshot, effects: Effects | None = None) -> Outcome:
    return Outcome(kind="unchanged", snapshot=snapshot, effects=effects or _NO_EFFECTS)


def _applied(
    snapshot: Snapshot,
    committed_at: int,
    effects: Effects,
    task_changes: dict[str, Any],
    **changes: Any,
) -> Outcome:
    """The task with ``task_changes`` (updated at ``committed_at``) in the next revision."""
    task = revise(snapshot.task, last_updated_at=committed_at, **task_changes)
    new = revise(snapshot, task=task, revision=snapshot.revision + 1, **changes)
    return Outcome(kind="applied", snapshot=new, effects=effects)


def _settle(
    status: TaskStatus,
    message: str | None,
    *,
    result: object = None,
    error: object = None,
) -> dict[str, Any]:
    """The changes that make a task terminal: outstanding input requests are cleared."""
    return {
        "status": status,
        "status_message": message,
        "input_requests": {},
        "result": result,
        "error": error,
    }


def _request_input(snapshot: Snapshot, event: Event, committed_at: int) -> Outcome:
    key: str = event.data["key"]
    request = event.data["request"]
    task = snapshot.task
    if key in task.used_input_keys:
        raise DuplicateInputKey(key)
    changes = {
        "status": TaskStatus.INPUT_REQUIRED,
        "input_requests": {**task.input_requests, key: request},
        "used_input_keys": task.used_input_keys | {key},
    }
    history = {**snapshot.input_history, key: request}
    return _applied(snapshot, committed_at, _NO_EFFECTS, changes, input_history=history)


def _accept(snapshot: Snapshot, event: Event, committed_at: int) -> Outcome:
    """Take only the outstanding keys; unknown, answered or never-issued keys are ignored."""
    task = snapshot.task
    responses = event.data["responses"]
    matched = {k: v for k, v in responses.items() if k in task.input_requests}
    if not matched:
        return _unchanged(snapshot, Effects(accepted_input_responses={}))
    remaining = {k: v for k, v in task.input_requests.items() if k not in matched}
    changes = {
        "status": TaskStatus.INPUT_REQUIRED if remaining else TaskStatus.WORKING,
        "input_requests": remaining,
    }
    inbox = {**snapshot.accepted_input_responses, **matched}
    effects = Effects(accepted_input_responses=matched)
    return _applied(snapshot, committed_at, effects, changes, accepted_input_responses=inbox)


def _retry(snapshot: Snapshot, event: Event, committed_at: int) -> Outcome:
    """Schedule the next delay, or fail atomically when the policy is exhausted."""
    error, message = event.data["error"], event.data["statusMessage"]
    failure = {"error": error, "statusMessage": message}
    policy = snapshot.work.retry_policy if snapshot.work is not None else None
    delay = None if policy is None else policy.next_delay(snapshot.retry_count)
    if delay is None:
        effect = RetryEffect(
            disposition="exhausted",
            retry_at=None,
            delay_ms=None,
            retry_count=snapshot.retry_count,
        )
        return _applied(
            snapshot,
            committed_at,
            Effects(retry=effect),
            _settle(TaskStatus.FAILED, message, error=error),
            retry_at=None,
            last_failure=failure,
        )
    retry_at = committed_at + delay * 1000
    count = snapshot.retry_count + 1
    effect = RetryEffect(
        disposition="scheduled", retry_at=retry_at, delay_ms=delay, retry_count=count
    )
    return _applied(
        snapshot,
        committed_at,
        Effects(retry=effect),
        {},
        retry_count=count,
        retry_at=retry_at,
        last_failure=failure,
    )
