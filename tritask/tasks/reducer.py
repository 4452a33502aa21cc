"""The pure reducer: ``apply(snapshot, event, committed_at) -> Outcome``.

No clock, no store, no trio. Every store runs this same function inside its own atomic step, so
all adapters agree on the state machine by construction.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from tritask.tasks._time import MAX_INSTANT, format_instant
from tritask.tasks.events import Effects, Event, EventKind, RetryEffect, json_size
from tritask.tasks.model import CANCELLED_MESSAGE, Snapshot, TaskStatus, revise, step_wake_at

__all__ = [
    "MAX_STEPS_PER_TASK",
    "MAX_TASK_STEP_BYTES",
    "DuplicateInputKey",
    "Effects",
    "Outcome",
    "RetryEffect",
    "StepKeyReused",
    "StepLimitExceeded",
    "apply",
]

MAX_STEPS_PER_TASK = 1_000
"""The most step and sleep keys one task may record."""
MAX_TASK_STEP_BYTES = 1_048_576
"""The most JSON (UTF-8 bytes) one task's recorded steps may hold together."""


class DuplicateInputKey(ValueError):
    """An input key was requested twice; keys are unique for a task's whole life."""

    def __init__(self, key: str) -> None:
        super().__init__(f"input key {key!r} was already used by this task")
        self.key = key


class StepKeyReused(ValueError):
    """A step or sleep key was recorded again (or used by an input, or by the other kind)."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"step key {key!r} {reason}")
        self.key = key


class StepLimitExceeded(ValueError):
    """Recording this step would pass a task's limits (:data:`MAX_STEPS_PER_TASK` keys,
    :data:`MAX_TASK_STEP_BYTES` of JSON): nothing is recorded, and retrying cannot help."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"step {key!r}: {reason}")
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
    strictly increase per task. Raises :class:`DuplicateInputKey` on input key reuse,
    :class:`StepKeyReused` on step key reuse and :class:`StepLimitExceeded` past a task's step
    limits. A step event on a terminal task changes nothing (a late step is refused).

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
    if kind is EventKind.STEP_STARTED or kind is EventKind.STEP_RECORDED:
        return _step(snapshot, event, committed_at)
    if kind is EventKind.SLEEP_SCHEDULED:
        return _sleep(snapshot, event, committed_at)
    if kind is EventKind.SUSPENDED:
        return _suspend(snapshot, event, committed_at)
    if kind is EventKind.COMPLETED:
        task = _settle(TaskStatus.COMPLETED, None, result=event.data["result"])
    elif kind is EventKind.FAILED:
        message = event.data["statusMessage"]
        task = _settle(TaskStatus.FAILED, message, error=event.data["error"])
    else:
        task = _settle(TaskStatus.CANCELLED, CANCELLED_MESSAGE)
    return _applied(snapshot, committed_at, _NO_EFFECTS, task, **_ENDED)


_ENDED = {"retry_at": None, "suspended_key": None, "suspended_until": None}
"""The snapshot changes of a task that became terminal: no retry, no suspension."""
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
    if key in task.used_input_keys or key in snapshot.steps:
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
    extra: dict[str, Any] = {}
    if snapshot.suspended_key is not None and snapshot.suspended_until is None:
        # An answer wakes a task suspended for input: claimable again at once.
        extra = {"suspended_key": None, "suspended_until": None}
    return _applied(
        snapshot, committed_at, effects, changes, accepted_input_responses=inbox, **extra
    )


def _check_steps(key: str, steps: dict[str, Any]) -> None:
    if len(steps) > MAX_STEPS_PER_TASK:
        raise StepLimitExceeded(key, f"a task may record at most {MAX_STEPS_PER_TASK} steps")
    size = json_size(steps)
    if size > MAX_TASK_STEP_BYTES:
        raise StepLimitExceeded(
            key, f"a task's steps may hold at most {MAX_TASK_STEP_BYTES} bytes of JSON ({size})"
        )


def _new_key(snapshot: Snapshot, key: str) -> None:
    if key in snapshot.task.used_input_keys:
        raise StepKeyReused(key, "is already an input key of this task")


def _step(snapshot: Snapshot, event: Event, committed_at: int) -> Outcome:
    """Record a step's start marker or its outcome (once per key for the task's life)."""
    key: str = event.data["key"]
    fingerprint: str = event.data["fingerprint"]
    existing = snapshot.steps.get(key)
    if event.kind is EventKind.STEP_STARTED:
        if existing is not None:
            raise StepKeyReused(key, "was already used by this task")
        _new_key(snapshot, key)
        record = {"kind": "step", "fingerprint": fingerprint, "outcome": None}
    else:
        if existing is not None and (
            existing["kind"] != "step"
            or existing["outcome"] is not None
            or existing["fingerprint"] != fingerprint
        ):
            raise StepKeyReused(key, "was already recorded by this task")
        if existing is None:
            _new_key(snapshot, key)
        record = {"kind": "step", "fingerprint": fingerprint, "outcome": event.data["outcome"]}
    steps = {**snapshot.steps, key: record}
    _check_steps(key, steps)
    return _applied(snapshot, committed_at, _NO_EFFECTS, {}, steps=steps)


def _sleep(snapshot: Snapshot, event: Event, committed_at: int) -> Outcome:
    """Record a durable sleep's wake instant: the commit time (store clock) plus its delay."""
    key: str = event.data["key"]
    if key in snapshot.steps:
        raise StepKeyReused(key, "was already used by this task")
    _new_key(snapshot, key)
    wake_at = min(committed_at + event.data["delayMs"] * 1000, MAX_INSTANT)
    steps = {**snapshot.steps, key: {"kind": "sleep", "wakeAt": format_instant(wake_at)}}
    _check_steps(key, steps)
    return _applied(snapshot, committed_at, _NO_EFFECTS, {}, steps=steps)


def _suspend(snapshot: Snapshot, event: Event, committed_at: int) -> Outcome:
    """Suspend until sleep ``key`` is due, or until input ``key`` is answered.

    Nothing changes when there is nothing to wait for (the sleep is due, the input was
    answered or never requested) or the task is still suspended; the record of a sleep
    suspension that is over is replaced.
    """
    key: str = event.data["key"]
    current = snapshot.suspended_until
    if snapshot.suspended_key is not None and (current is None or current > committed_at):
        return _unchanged(snapshot)  # still suspended (a sleep that is over no longer counts)
    record = snapshot.steps.get(key)
    until: int | None
    if record is not None:
        until = step_wake_at(record)
        if until is None or until <= committed_at:
            return _unchanged(snapshot)
    elif key in snapshot.task.input_requests:
        until = None
    else:
        return _unchanged(snapshot)
    return _applied(
        snapshot, committed_at, _NO_EFFECTS, {}, suspended_key=key, suspended_until=until
    )


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
            last_failure=failure,
            **_ENDED,
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
