"""The Task value, the private aggregate record (``Snapshot`` v4, v3 still read and written when a
task has no steps), and their codecs and wire shapes.

Every construction validates: a ``Snapshot`` that exists satisfies all record invariants, so the
reducer, the stores and the decoders cannot produce (or accept) an impossible state.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs

from tritask.tasks._time import MAX_INSTANT, format_instant, parse_instant
from tritask.tasks.events import MAX_FINGERPRINT_CHARS, MAX_STEP_KEY_CHARS, is_step_error
from tritask.tasks.work import (
    CodecError,
    JSONObject,
    Work,
    clone_json,
    ensure_json,
    ensure_json_object,
    expect_keys,
    stored_text,
)

__all__ = [
    "CANCELLED_MESSAGE",
    "DEFAULT_STATUS_MESSAGE",
    "INTERNAL_ERROR",
    "CorruptRecord",
    "Snapshot",
    "Task",
    "TaskStatus",
    "clone_snapshot",
    "create_task_result",
    "detailed_task",
    "initial_snapshot",
    "is_step_record",
    "new_task",
    "owned_task",
    "owned_work",
    "record_text",
    "record_version",
    "revise",
    "snapshot_from_json",
    "snapshot_json_view",
    "snapshot_to_json",
    "step_wake_at",
    "task_wire_base",
]

DEFAULT_STATUS_MESSAGE = "Task accepted"
CANCELLED_MESSAGE = "Cancellation requested"
INTERNAL_ERROR: JSONObject = {"code": -32603, "message": "Internal error"}
MAX_TASK_ID_BYTES = 256


class CorruptRecord(CodecError):
    """A record (decoded or constructed) breaks the aggregate invariants; ``reason`` says which."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class TaskStatus(enum.StrEnum):
    WORKING = "working"
    INPUT_REQUIRED = "input_required"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        # Identity, not set membership: an Enum's __hash__ is Python code, and this is hot.
        return (
            self is TaskStatus.COMPLETED
            or self is TaskStatus.FAILED
            or self is TaskStatus.CANCELLED
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require(condition: bool, reason: str) -> None:
    if not condition:
        raise CorruptRecord(reason)


def _instant(value: object, what: str) -> None:
    _require(_is_int(value) and 0 <= value <= MAX_INSTANT, f"{what} is not an instant")  # type: ignore[operator]


def _optional_positive(value: object, what: str) -> None:
    _require(value is None or (_is_int(value) and value > 0), f"{what} must be a positive int")  # type: ignore[operator]


def is_input_request(value: object) -> bool:
    """An input request is a JSON object with a non-empty string ``method``."""
    return (
        isinstance(value, dict) and isinstance(value.get("method"), str) and bool(value["method"])
    )


def _requests(value: object) -> dict[str, JSONObject]:
    requests = ensure_json_object(value, what="input requests")
    for key, request in requests.items():
        _require(bool(key), "input request keys must be non-empty")
        _require(is_input_request(request), f"input request {key!r} needs a non-empty method")
    return requests


def _optional_object(value: object) -> JSONObject | None:
    return None if value is None else ensure_json_object(value)


def _used_keys(value: object) -> frozenset[str]:
    if type(value) is frozenset and not value:
        return value  # (a new task's: nothing to check)
    if isinstance(value, str | bytes) or not isinstance(value, set | frozenset | list | tuple):
        raise TypeError("used_input_keys must be a set of strings")
    keys = frozenset(value)
    _require(all(isinstance(k, str) and k for k in keys), "used input keys must be non-empty")
    return keys


def _status(value: str) -> TaskStatus:
    return value if type(value) is TaskStatus else TaskStatus(value)


@attrs.frozen(kw_only=True)
class Task:
    """The protocol-visible task. Instants are µs ints; ``ttl_ms=None`` means never reaped."""

    id: str
    status: TaskStatus = attrs.field(converter=_status)
    status_message: str | None
    created_at: int
    last_updated_at: int
    ttl_ms: int | None
    poll_interval_ms: int | None
    input_requests: dict[str, JSONObject] = attrs.field(factory=dict, converter=_requests)
    result: JSONObject | None = attrs.field(default=None, converter=_optional_object)
    error: JSONObject | None = attrs.field(default=None, converter=_optional_object)
    used_input_keys: frozenset[str] = attrs.field(default=frozenset(), converter=_used_keys)

    def __attrs_post_init__(self) -> None:
        # Fast path: a sufficient condition for every check below, in one expression (this runs
        # on every transition). Anything it does not vouch for gets the full, explained checks.
        status, message, requests = self.status, self.status_message, self.input_requests
        created, updated, ttl, poll = (
            self.created_at,
            self.last_updated_at,
            self.ttl_ms,
            self.poll_interval_ms,
        )
        if (
            type(self.id) is str
            and 0 < len(self.id.encode()) <= MAX_TASK_ID_BYTES
            and (message is None or type(message) is str)
            and type(created) is int
            and type(updated) is int
            and 0 <= created <= updated <= MAX_INSTANT
            and (ttl is None or (type(ttl) is int and ttl > 0))
            and (poll is None or (type(poll) is int and poll > 0))
            and (not requests) == (status is not TaskStatus.INPUT_REQUIRED)
            and (self.result is not None) == (status is TaskStatus.COMPLETED)
            and (self.error is None or status is TaskStatus.FAILED)
            and (message is None or status is not TaskStatus.COMPLETED)
            and (not requests or requests.keys() <= self.used_input_keys)
        ):
            return
        self._check()

    def _check(self) -> None:
        _require(
            isinstance(self.id, str)
            and bool(self.id)
            and len(self.id.encode()) <= MAX_TASK_ID_BYTES,
            "task id must be 1..256 bytes",
        )
        _require(
            self.status_message is None or isinstance(self.status_message, str),
            "statusMessage must be a string or null",
        )
        _instant(self.created_at, "createdAt")
        _instant(self.last_updated_at, "lastUpdatedAt")
        _require(self.last_updated_at >= self.created_at, "lastUpdatedAt precedes createdAt")
        _optional_positive(self.ttl_ms, "ttlMs")
        _optional_positive(self.poll_interval_ms, "pollIntervalMs")
        waiting = self.status is TaskStatus.INPUT_REQUIRED
        _require(
            bool(self.input_requests) == waiting,
            "input_required needs outstanding requests and only it may have them",
        )
        _require(
            (self.result is not None) == (self.status is TaskStatus.COMPLETED),
            "exactly completed tasks carry a result",
        )
        _require(
            self.error is None or self.status is TaskStatus.FAILED,
            "only failed tasks carry an error",
        )
        _require(
            self.status is not TaskStatus.COMPLETED or self.status_message is None,
            "completed tasks carry no statusMessage",
        )
        _require(
            set(self.input_requests) <= self.used_input_keys,
            "outstanding input keys must be used keys",
        )

    @property
    def expires_at(self) -> int | None:
        """The instant from which the task counts as expired (``None``: never)."""
        return None if self.ttl_ms is None else self.created_at + self.ttl_ms * 1000


def new_task(
    task_id: str,
    created_at: int,
    ttl_ms: int | None,
    poll_interval_ms: int | None,
    status_message: str | None = DEFAULT_STATUS_MESSAGE,
) -> Task:
    """A freshly accepted task: ``working``, last updated at its creation."""
    return Task(
        id=task_id,
        status=TaskStatus.WORKING,
        status_message=status_message,
        created_at=created_at,
        last_updated_at=created_at,
        ttl_ms=ttl_ms,
        poll_interval_ms=poll_interval_ms,
    )


def _failure(value: object) -> JSONObject | None:
    if value is None:
        return None
    failure = ensure_json_object(value, what="last failure")
    _require(set(failure) == {"error", "statusMessage"}, "lastFailure needs error, statusMessage")
    _require(isinstance(failure["error"], dict), "lastFailure error must be an object")
    message = failure["statusMessage"]
    _require(message is None or isinstance(message, str), "lastFailure statusMessage type")
    return failure


def _history(value: object) -> dict[str, JSONObject]:
    history = ensure_json_object(value, what="input history")
    _require(all(is_input_request(r) for r in history.values()), "history holds requests")
    return history


def _inbox(value: object) -> dict[str, JSONObject]:
    inbox = ensure_json_object(value, what="accepted input responses")
    _require(all(isinstance(r, dict) for r in inbox.values()), "responses must be objects")
    return inbox


def is_step_record(value: object) -> bool:
    """A recorded step ``{"kind": "step", "fingerprint", "outcome": null | {result} | {error}}``
    (``outcome`` null: an ``at_most_once`` step that started and has no outcome yet) or a
    durable sleep ``{"kind": "sleep", "wakeAt": ISO instant}``."""
    if not isinstance(value, dict):
        return False
    kind = value.get("kind")
    if kind == "sleep":
        if set(value) != {"kind", "wakeAt"} or not isinstance(value["wakeAt"], str):
            return False
        try:
            parse_instant(value["wakeAt"])
        except ValueError:
            return False
        return True
    if kind != "step" or set(value) != {"kind", "fingerprint", "outcome"}:
        return False
    fingerprint, outcome = value["fingerprint"], value["outcome"]
    if not isinstance(fingerprint, str) or not 0 < len(fingerprint) <= MAX_FINGERPRINT_CHARS:
        return False
    if outcome is None:
        return True
    if not isinstance(outcome, dict):
        return False
    if set(outcome) == {"result"}:
        return True
    # Exactly what a step_recorded event admits, so every decoded outcome replays.
    return set(outcome) == {"error"} and is_step_error(outcome["error"])


def _steps(value: object) -> dict[str, JSONObject]:
    steps = ensure_json_object(value, what="steps")
    for key, record in steps.items():
        _require(
            0 < len(key) <= MAX_STEP_KEY_CHARS,
            f"step keys must have 1..{MAX_STEP_KEY_CHARS} characters",
        )
        _require(is_step_record(record), f"step {key!r} is not a step or sleep record")
    return steps


def step_wake_at(record: JSONObject) -> int | None:
    """The wake instant of a sleep record (``None`` for a step)."""
    if record.get("kind") != "sleep":
        return None
    return parse_instant(record["wakeAt"])


def _optional_key(value: object) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise CorruptRecord("suspendedKey must be a non-empty string or None")
    return value


def _is_task(_inst: object, _attr: object, value: Any) -> None:
    if not isinstance(value, Task):
        raise CorruptRecord("task must be a Task")


def _is_work(_inst: object, _attr: object, value: Any) -> None:
    if value is not None and not isinstance(value, Work):
        raise CorruptRecord("work must be a Work or None")


@attrs.frozen(kw_only=True)
class Snapshot:
    """The revisioned aggregate record (v4): the task plus the private bookkeeping that makes
    retries, input replay, steps, suspension and fencing durable.

    ``steps`` maps each step or sleep key to its record (see :func:`is_step_record`).
    ``suspended_key`` names what a suspended task waits for: a sleep (``suspended_until`` is
    its wake instant) or an outstanding input request (``suspended_until`` is ``None``: until
    answered). :attr:`available_at` is when the task may be claimed again.
    """

    task: Task = attrs.field(validator=_is_task)
    work: Work | None = attrs.field(validator=_is_work)
    revision: int
    retry_count: int = 0
    retry_at: int | None = None
    last_failure: JSONObject | None = attrs.field(default=None, converter=_failure)
    input_history: dict[str, JSONObject] = attrs.field(factory=dict, converter=_history)
    accepted_input_responses: dict[str, JSONObject] = attrs.field(factory=dict, converter=_inbox)
    steps: dict[str, JSONObject] = attrs.field(factory=dict, converter=_steps)
    suspended_key: str | None = attrs.field(default=None, converter=_optional_key)
    suspended_until: int | None = None

    @property
    def available_at(self) -> int | None:
        """The instant before which no claim may take the task (``None``: no such instant):
        the later of ``retry_at`` and a suspension's end (an input suspension has none, so
        :data:`MAX_INSTANT` until the input is answered). Stores project it as ``retry_at``."""
        if self.suspended_key is None:
            return self.retry_at
        until = MAX_INSTANT if self.suspended_until is None else self.suspended_until
        return until if self.retry_at is None else max(self.retry_at, until)

    def __attrs_post_init__(self) -> None:
        # Fast path: a sufficient condition for every check below in the common case (no
        # retries, no input), in one expression. Anything else gets the full checks.
        task, retry_count, revision = self.task, self.retry_count, self.revision
        if (
            type(retry_count) is int
            and retry_count == 0
            and type(revision) is int
            and revision >= 0
            and self.retry_at is None
            and self.last_failure is None
            and (self.work is None or self.work.idempotency_key == task.id)
            and not self.input_history
            and not self.accepted_input_responses
            and not task.used_input_keys
            and not task.input_requests
            and not self.steps
            and self.suspended_key is None
            and self.suspended_until is None
        ):
            return
        self._check()

    def _check(self) -> None:
        task = self.task
        terminal = task.status.is_terminal
        _require(_is_int(self.revision) and self.revision >= 0, "revision must be an int >= 0")
        _require(
            _is_int(self.retry_count) and self.retry_count >= 0, "retryCount must be an int >= 0"
        )
        delays = 0 if self.work is None else len(self.work.retry_policy.delays_ms)
        _require(self.retry_count <= delays, "retryCount exceeds the retry policy")
        _require(self.retry_count <= self.revision, "retryCount exceeds the revision")
        _require(
            self.work is None or self.work.idempotency_key == task.id,
            "work idempotency key differs from the task id",
        )
        if self.retry_at is not None:
            _instant(self.retry_at, "retryAt")
            _require(self.retry_count > 0, "retryAt without retry history")
            _require(not terminal, "retryAt on a terminal task")
            _require(self.last_failure is not None, "retryAt without a failure")
        _require(
            terminal or self.retry_count == 0 or self.retry_at is not None,
            "a retried active task needs a retryAt",
        )
        _require(
            self.retry_count == 0 or self.last_failure is not None,
            "retry history without a last failure",
        )
        if self.last_failure is not None and self.retry_count == 0:
            _require(
                task.status is TaskStatus.FAILED
                and task.error == self.last_failure["error"]
                and task.status_message == self.last_failure["statusMessage"],
                "a failure without retries is only valid as zero-retry exhaustion",
            )
        _require(set(self.input_history) == task.used_input_keys, "history keys != used keys")
        _require(
            all(self.input_history[k] == r for k, r in task.input_requests.items()),
            "outstanding requests differ from their history",
        )
        inbox = set(self.accepted_input_responses)
        _require(inbox <= task.used_input_keys, "inbox keys were never requested")
        _require(not inbox & set(task.input_requests), "inbox keys are still outstanding")
        _require(
            not self.steps.keys() & task.used_input_keys, "a key names both a step and an input"
        )
        key, until = self.suspended_key, self.suspended_until
        if until is not None:
            _instant(until, "suspendedUntil")
        if key is None:
            _require(until is None, "suspendedUntil without a suspendedKey")
        else:
            _require(not terminal, "a terminal task is not suspended")
            record = self.steps.get(key)
            if record is not None:
                _require(
                    until is not None and step_wake_at(record) == until,
                    "a sleep suspension ends at its sleep's wake instant",
                )
            else:
                _require(
                    until is None and key in task.input_requests,
                    "a suspension names a sleep or an outstanding input request",
                )


_Record = TypeVar("_Record", Task, Snapshot, Work)


_Plan = tuple[Any, Any, "attrs.Attribute[Any]", Callable[[object, object], None]]
"""How :func:`revise` sets one field: its converter, its validator, the field, its setter."""


def _slot_setters(cls: type) -> dict[str, Callable[[object, object], None]]:
    """Each attrs field's slot setter (``object.__setattr__`` works on a frozen class too, but
    a member descriptor's ``__set__`` costs half as much)."""
    return {
        field.name: cls.__dict__[field.name].__set__
        for field in cls.__attrs_attrs__  # type: ignore[attr-defined]
    }


def _plans(cls: type) -> dict[str, _Plan]:
    setters = _slot_setters(cls)
    return {
        field.name: (field.converter, field.validator, field, setters[field.name])
        for field in cls.__attrs_attrs__  # type: ignore[attr-defined]
    }


_PLANS: dict[type, dict[str, _Plan]] = {cls: _plans(cls) for cls in (Task, Snapshot, Work)}


def revise(record: _Record, **changes: Any) -> _Record:
    """``attrs.evolve`` for a valid ``Task``, ``Snapshot`` or ``Work`` that checks only what
    changes.

    The changed fields go through their converters and validators (new JSON is checked and
    copied), then every invariant of the class is checked again on the result. Unchanged fields
    were checked when ``record`` was built and are shared with it, JSON included: both are
    values, and whoever hands one out to a caller copies it first (:func:`clone_snapshot`).
    """
    cls = type(record)
    plans = _PLANS[cls]
    new: _Record = _SHALLOW[cls](record)
    for name, value in changes.items():
        plan = plans.get(name)
        if plan is None:
            raise TypeError(f"{cls.__name__} has no fields {sorted(changes.keys() - plans.keys())}")
        converter, validator, field, setter = plan
        if converter is not None:
            value = converter(value)
        if validator is not None:
            validator(new, field, value)
        setter(new, value)
    if cls is not Work:
        new.__attrs_post_init__()  # type: ignore[attr-defined]  # (Task and Snapshot have one)
    return new


def owned_task(task: Task, **changes: Any) -> Task:
    """A checked copy of a caller's task (with ``changes``): its JSON is checked and copied,
    its invariants checked again (the caller may have mutated its containers since)."""
    json = {"input_requests": task.input_requests, "result": task.result, "error": task.error}
    return revise(task, **{**json, **changes})


def owned_work(work: Work) -> Work:
    """A checked copy of a caller's work (its input checked and copied)."""
    return revise(work, input=work.input)


def clone_snapshot(snapshot: Snapshot) -> Snapshot:
    """A copy of a valid snapshot with JSON of its own, so mutating it cannot reach the original.

    Nothing is checked again (the snapshot is valid by construction): this is how a store hands
    out its state.
    """
    clone: Snapshot = _CLONE_SNAPSHOT(snapshot)
    return clone


def clone_task(task: Task) -> Task:
    """:func:`clone_snapshot` for the task alone (its public state: what clients are shown)."""
    clone: Task = _CLONE_TASK(task)
    return clone


def _copier(cls: type, json_fields: frozenset[str], nested: Mapping[str, str]) -> Any:
    """A function ``record -> copy`` for ``cls``, generated from its attrs fields (as attrs
    generates ``__init__``): every field set in one straight run of slot stores, the JSON
    fields (``json_fields``) deep-copied, the ``nested`` ones (field -> copier name) copied by
    that copier, the rest shared (immutable). Nothing is checked: ``record`` is valid."""
    setters = _slot_setters(cls)
    namespace: dict[str, Any] = {
        "_new": object.__new__,
        "_cls": cls,
        "_json": clone_json,
        **{f"_set_{name}": setter for name, setter in setters.items()},
    }
    lines = ["def copy(r):", "    new = _new(_cls)"]
    for name in setters:
        value = f"r.{name}"
        if name in json_fields:
            # (an empty object, the usual JSON field, is copied without a call of Python)
            value = f"None if (v := r.{name}) is None else _json(v) if v else v.copy()"
        elif name in nested:
            value = f"None if (v := r.{name}) is None else {nested[name]}(v)"
        lines.append(f"    _set_{name}(new, {value})")
    lines.append("    return new")
    namespace.update((copier, globals()[copier]) for copier in nested.values())
    exec("\n".join(lines), namespace)  # the source is built above from field names only
    return namespace["copy"]


_TASK_JSON = frozenset({"input_requests", "result", "error"})
_WORK_JSON = frozenset({"input"})
_SNAPSHOT_JSON = frozenset({"last_failure", "input_history", "accepted_input_responses", "steps"})
_SHALLOW: dict[type, Any] = {cls: _copier(cls, frozenset(), {}) for cls in (Task, Snapshot, Work)}
"""Per class: a copy sharing every field (what :func:`revise` starts from)."""
_CLONE_TASK = _copier(Task, _TASK_JSON, {})
_CLONE_WORK = _copier(Work, _WORK_JSON, {})
_CLONE_SNAPSHOT = _copier(Snapshot, _SNAPSHOT_JSON, {"task": "_CLONE_TASK", "work": "_CLONE_WORK"})


def initial_snapshot(task: Task, work: Work) -> Snapshot:
    """The revision-0 record a store creates; the task must be freshly accepted."""
    _require(task.status is TaskStatus.WORKING, "a new task must be working")
    _require(not task.used_input_keys, "a new task has no input history")
    _require(task.last_updated_at == task.created_at, "a new task was never updated")
    _require(isinstance(work, Work), "a new task needs its Work")
    return Snapshot(task=task, work=work, revision=0)


# -- codec (aggregate record v3 and v4) ---------------------------------------------------------

_RECORD_KEYS = (
    "version",
    "revision",
    "task",
    "work",
    "retryCount",
    "retryAt",
    "lastFailure",
    "inputHistory",
    "acceptedInputResponses",
)
_RECORD_KEYS_V4 = (*_RECORD_KEYS, "steps", "suspended")
_TASK_KEYS = (
    "id",
    "status",
    "statusMessage",
    "createdAt",
    "lastUpdatedAt",
    "ttlMs",
    "pollIntervalMs",
    "inputRequests",
    "result",
    "error",
    "usedInputKeys",
)


def _task_to_json(task: Task, json: Callable[[Any], Any]) -> JSONObject:
    return {
        "id": task.id,
        "status": task.status.value,
        "statusMessage": task.status_message,
        "createdAt": format_instant(task.created_at),
        "lastUpdatedAt": format_instant(task.last_updated_at),
        "ttlMs": task.ttl_ms,
        "pollIntervalMs": task.poll_interval_ms,
        "inputRequests": json(task.input_requests),
        "result": json(task.result),
        "error": json(task.error),
        "usedInputKeys": sorted(task.used_input_keys),
    }


def record_version(snapshot: Snapshot) -> int:
    """The version :func:`snapshot_to_json` writes ``snapshot`` in (3 or 4)."""
    return 4 if snapshot.steps or snapshot.suspended_key is not None else 3


def snapshot_to_json(snapshot: Snapshot) -> JSONObject:
    """The persisted form, instants as ISO text, the task with exactly 11 keys: v3 (9 keys)
    for a task without steps or suspension, exactly as before steps existed (so older code
    still reads it), else v4 (11 keys: ``steps`` and ``suspended``)."""
    return _snapshot_document(snapshot, ensure_json, share=False)


def snapshot_json_view(snapshot: Snapshot) -> JSONObject:
    """:func:`snapshot_to_json` sharing the snapshot's JSON instead of copying it: an equal
    value, for an encoder to read at once (a store writing its record: the copies were most
    of the cost of encoding one), never to keep, mutate or hand out."""
    return _snapshot_document(snapshot, _shared, share=True)


def record_text(snapshot: Snapshot) -> str:
    """The stored text of a snapshot's record: ``stored_text(snapshot_to_json(snapshot))``,
    the same text, without copying its JSON first."""
    return stored_text(_snapshot_document(snapshot, _shared, share=True))


def _shared(value: Any) -> Any:
    return value


def _snapshot_document(
    snapshot: Snapshot, json: Callable[[Any], Any], *, share: bool
) -> JSONObject:
    work = snapshot.work
    doc: JSONObject = {
        "version": 3,
        "revision": snapshot.revision,
        "task": _task_to_json(snapshot.task, json),
        "work": None if work is None else work.json_view() if share else work.to_json(),
        "retryCount": snapshot.retry_count,
        "retryAt": None if snapshot.retry_at is None else format_instant(snapshot.retry_at),
        "lastFailure": json(snapshot.last_failure),
        "inputHistory": json(snapshot.input_history),
        "acceptedInputResponses": json(snapshot.accepted_input_responses),
    }
    if record_version(snapshot) == 4:
        doc["version"] = 4
        doc["steps"] = json(snapshot.steps)
        until = snapshot.suspended_until
        doc["suspended"] = (
            None
            if snapshot.suspended_key is None
            else {
                "key": snapshot.suspended_key,
                "until": None if until is None else format_instant(until),
            }
        )
    return doc


def _typed(value: object, kinds: type | tuple[type, ...], what: str) -> Any:
    """Strict type check for decoding (a bool is never accepted as an int)."""
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise CorruptRecord(f"{what} has the wrong type")
    return value


def _optional_int(value: object, what: str) -> int | None:
    return None if value is None else int(_typed(value, int, what))


def _decode_instant(value: object, what: str) -> int:
    try:
        return parse_instant(_typed(value, str, what))
    except ValueError as exc:
        raise CorruptRecord(f"{what} is not an ISO-8601 instant") from exc


def _task_from_json(doc: object) -> Task:
    fields = expect_keys(doc, _TASK_KEYS, "task")
    used = _typed(fields["usedInputKeys"], list, "usedInputKeys")
    _require(all(isinstance(k, str) for k in used), "usedInputKeys must hold strings")
    _require(used == sorted(set(used)), "usedInputKeys must be sorted and unique")
    message = fields["statusMessage"]
    _require(message is None or isinstance(message, str), "statusMessage has the wrong type")
    _typed(fields["id"], str, "id")
    status = _typed(fields["status"], str, "status")
    _require(status in TaskStatus._value2member_map_, "unknown task status")
    return Task(
        id=fields["id"],
        status=TaskStatus(status),
        status_message=message,
        created_at=_decode_instant(fields["createdAt"], "createdAt"),
        last_updated_at=_decode_instant(fields["lastUpdatedAt"], "lastUpdatedAt"),
        ttl_ms=_optional_int(fields["ttlMs"], "ttlMs"),
        poll_interval_ms=_optional_int(fields["pollIntervalMs"], "pollIntervalMs"),
        input_requests=_typed(fields["inputRequests"], dict, "inputRequests"),
        result=fields["result"],
        error=fields["error"],
        used_input_keys=frozenset(used),
    )


def snapshot_from_json(doc: object) -> Snapshot:
    """Strictly decode a v3 or v4 record; any deviation raises :class:`CorruptRecord`."""
    try:
        version = doc.get("version") if isinstance(doc, dict) else None
        if not _is_int(version) or version not in (3, 4):
            raise CorruptRecord(f"unsupported record version {version!r}")
        fields = expect_keys(doc, _RECORD_KEYS if version == 3 else _RECORD_KEYS_V4, "record")
        retry_at = fields["retryAt"]
        work = fields["work"]
        steps: Any = {}
        key: Any = None
        until: int | None = None
        if version == 4:
            steps = _typed(fields["steps"], dict, "steps")
            suspended = fields["suspended"]
            if suspended is not None:
                found = expect_keys(suspended, ("key", "until"), "suspended")
                key = _typed(found["key"], str, "suspended key")
                if found["until"] is not None:
                    until = _decode_instant(found["until"], "suspended until")
            _require(bool(steps) or key is not None, "a v4 record without steps or suspension")
        return Snapshot(
            task=_task_from_json(fields["task"]),
            work=None if work is None else Work.from_json(work),
            revision=_typed(fields["revision"], int, "revision"),
            retry_count=_typed(fields["retryCount"], int, "retryCount"),
            retry_at=None if retry_at is None else _decode_instant(retry_at, "retryAt"),
            last_failure=_typed(fields["lastFailure"], (dict, type(None)), "lastFailure"),
            input_history=_typed(fields["inputHistory"], dict, "inputHistory"),
            accepted_input_responses=_typed(
                fields["acceptedInputResponses"], dict, "acceptedInputResponses"
            ),
            steps=steps,
            suspended_key=key,
            suspended_until=until,
        )
    except CorruptRecord:
        raise
    except (ValueError, TypeError) as exc:
        raise CorruptRecord(str(exc)) from exc


# -- wire projections ---------------------------------------------------------------------------


def task_wire_base(task: Task) -> JSONObject:
    """The base fields every wire shape shares; ``ttlMs`` is always present (``null`` allowed)."""
    base: JSONObject = {"taskId": task.id, "status": task.status.value}
    if task.status_message is not None:
        base["statusMessage"] = task.status_message
    base["createdAt"] = format_instant(task.created_at)
    base["lastUpdatedAt"] = format_instant(task.last_updated_at)
    base["ttlMs"] = task.ttl_ms
    if task.poll_interval_ms is not None:
        base["pollIntervalMs"] = task.poll_interval_ms
    return base


def create_task_result(task: Task) -> JSONObject:
    """The flat ``CreateTaskResult``: base fields plus ``resultType: "task"``, never a payload."""
    return {"resultType": "task", **task_wire_base(task)}


def _wire_error(error: Mapping[str, Any] | None) -> JSONObject:
    if error is not None and _is_int(error.get("code")) and isinstance(error.get("message"), str):
        return ensure_json_object(error)
    return dict(INTERNAL_ERROR)


def detailed_task(task: Task) -> JSONObject:
    """The ``tasks/get`` body without ``resultType`` (callers add it): base plus status payload.

    A failed task whose error is missing or not a JSON-RPC error object shows the safe
    ``-32603 Internal error`` instead, so a malformed error never reaches the wire.
    """
    detail = task_wire_base(task)
    if task.status is TaskStatus.INPUT_REQUIRED:
        detail["inputRequests"] = ensure_json(task.input_requests)
    elif task.status is TaskStatus.COMPLETED:
        detail["result"] = ensure_json(task.result)
    elif task.status is TaskStatus.FAILED:
        detail["error"] = _wire_error(task.error)
    return detail
