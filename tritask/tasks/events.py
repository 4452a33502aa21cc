"""State-transition intents (``Event`` v1) and transition effects, with strict JSON codecs.

Events carry an id so a retried write is recognised (replayed) instead of applied twice; they are
plain JSON so every store persists them the same way.
"""

from __future__ import annotations

import base64
import enum
import hashlib
import json
import secrets
from typing import Any, Literal

import attrs
import orjson

from tritask.tasks._time import format_instant, parse_instant
from tritask.tasks.work import (
    MAX_DELAY_MS,
    CodecError,
    InvalidJSON,
    JSONObject,
    ensure_json,
    ensure_json_object,
    expect_keys,
)

__all__ = [
    "MAX_FINGERPRINT_CHARS",
    "MAX_STEP_KEY_CHARS",
    "MAX_STEP_OUTCOME_BYTES",
    "Effects",
    "Event",
    "EventKind",
    "InvalidEvent",
    "RetryEffect",
    "check_step_outcome",
    "completed_event",
    "derived_event_id",
    "effects_from_json",
    "effects_to_json",
    "is_step_error",
    "json_size",
    "new_event_id",
]

MAX_STEP_KEY_CHARS = 200
"""The longest step (or sleep) key, in characters."""
MAX_STEP_OUTCOME_BYTES = 65_536
"""The largest recorded step outcome (its JSON, UTF-8): bigger outcomes fail their step."""
MAX_FINGERPRINT_CHARS = 256


class InvalidEvent(ValueError):
    """An event whose id, kind or data break the rules of its kind."""


class EventKind(enum.StrEnum):
    INPUT_REQUESTED = "input_requested"
    INPUT_RESPONSES_ACCEPTED = "input_responses_accepted"
    RETRY_REQUESTED = "retry_requested"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    STEP_STARTED = "step_started"
    STEP_RECORDED = "step_recorded"
    SLEEP_SCHEDULED = "sleep_scheduled"
    SUSPENDED = "suspended"


def new_event_id() -> str:
    """18 random bytes, URL-safe base64 without padding (24 characters)."""
    return secrets.token_urlsafe(18)


def derived_event_id(task_id: str, kind: EventKind, key: str, generation: int | None = None) -> str:
    """A deterministic event id (24 characters) for the event of ``kind`` about ``key`` in
    ``task_id`` (and lease ``generation``, for events an attempt may make again).

    A resend of such an event after a lost acknowledgement carries the same id, so the store
    replays the first commit instead of applying it twice.
    """
    text = f"{task_id}\x00{kind.value}\x00{key}\x00{'' if generation is None else generation}"
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
    return base64.urlsafe_b64encode(digest[:18]).decode("ascii")


def json_size(value: Any) -> int:
    """The size in bytes of checked JSON ``value`` as compact UTF-8 text."""
    try:
        return len(orjson.dumps(value))
    except orjson.JSONEncodeError:  # a lone surrogate or a huge int: the standard library's
        return len(json.dumps(value, separators=(",", ":"), ensure_ascii=True))


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidEvent(message)


def _failure_data(data: JSONObject) -> None:
    _check(isinstance(data["error"], dict), "error must be a JSON object")
    message = data["statusMessage"]
    _check(message is None or isinstance(message, str), "statusMessage must be a string or null")


def _validate(kind: EventKind, data: JSONObject) -> None:
    if data.keys() != _DATA_KEY_SETS[kind]:
        # (The message is built only here: formatting it on every event cost as much as all
        # the checks below together.)
        keys = _DATA_KEYS[kind]
        raise InvalidEvent(f"{kind.value} data must have exactly the keys {list(keys)}")
    if kind is EventKind.INPUT_REQUESTED:
        key, request = data["key"], data["request"]
        _check(isinstance(key, str) and bool(key), "input key must be a non-empty string")
        _check(
            isinstance(request, dict)
            and isinstance(request.get("method"), str)
            and bool(request["method"]),
            "input request must be an object with a non-empty string method",
        )
    elif kind is EventKind.INPUT_RESPONSES_ACCEPTED:
        responses = data["responses"]
        _check(isinstance(responses, dict), "responses must be a JSON object")
        _check(all(responses), "response keys must be non-empty")
        _check(all(isinstance(v, dict) for v in responses.values()), "responses must be objects")
    elif kind in (EventKind.RETRY_REQUESTED, EventKind.FAILED):
        _failure_data(data)
    elif kind is EventKind.COMPLETED:
        _check(isinstance(data["result"], dict), "result must be a JSON object")
    elif kind is EventKind.SUSPENDED:
        # It names a sleep (a step key) or an input key, which has no length limit.
        key = data["key"]
        _check(isinstance(key, str) and bool(key), "a suspension key must be a non-empty string")
    elif kind in _STEP_KINDS:
        _step_key(data["key"])
        if kind is EventKind.SLEEP_SCHEDULED:
            delay = data["delayMs"]
            _check(
                type(delay) is int and 0 <= delay <= MAX_DELAY_MS,
                f"delayMs must be an int in 0..{MAX_DELAY_MS}",
            )
        else:
            fingerprint = data["fingerprint"]
            _check(
                isinstance(fingerprint, str) and 0 < len(fingerprint) <= MAX_FINGERPRINT_CHARS,
                f"a step fingerprint must be a string of 1..{MAX_FINGERPRINT_CHARS} characters",
            )
        if kind is EventKind.STEP_RECORDED:
            check_step_outcome(data["outcome"])


_STEP_KINDS = frozenset(
    {
        EventKind.STEP_STARTED,
        EventKind.STEP_RECORDED,
        EventKind.SLEEP_SCHEDULED,
        EventKind.SUSPENDED,
    }
)


def _step_key(key: object) -> None:
    _check(
        isinstance(key, str) and 0 < len(key) <= MAX_STEP_KEY_CHARS,
        f"a step key must be a string of 1..{MAX_STEP_KEY_CHARS} characters",
    )


def is_step_error(error: object) -> bool:
    """A step's recorded error: a JSON-RPC error object ``{code, message, data?}``."""
    return (
        isinstance(error, dict)
        and type(error.get("code")) is int
        and isinstance(error.get("message"), str)
        and set(error) <= {"code", "message", "data"}
    )


def check_step_outcome(outcome: object) -> None:
    """A step outcome is ``{"result": JSON}`` or ``{"error": {code, message, data?}}``, at most
    :data:`MAX_STEP_OUTCOME_BYTES` of JSON (raises :class:`InvalidEvent`)."""
    _check(
        isinstance(outcome, dict) and (set(outcome) == {"result"} or set(outcome) == {"error"}),
        'a step outcome must be {"result": ...} or {"error": {...}}',
    )
    assert isinstance(outcome, dict)
    if "error" in outcome:
        _check(is_step_error(outcome["error"]), "a step error must be {code, message, data?}")
    size = json_size(outcome)
    _check(
        size <= MAX_STEP_OUTCOME_BYTES,
        f"a step outcome is limited to {MAX_STEP_OUTCOME_BYTES} bytes of JSON, not {size}",
    )


_DATA_KEYS: dict[EventKind, tuple[str, ...]] = {
    EventKind.INPUT_REQUESTED: ("key", "request"),
    EventKind.INPUT_RESPONSES_ACCEPTED: ("responses",),
    EventKind.RETRY_REQUESTED: ("error", "statusMessage"),
    EventKind.COMPLETED: ("result",),
    EventKind.FAILED: ("error", "statusMessage"),
    EventKind.CANCELLED: (),
    EventKind.STEP_STARTED: ("key", "fingerprint"),
    EventKind.STEP_RECORDED: ("key", "fingerprint", "outcome"),
    EventKind.SLEEP_SCHEDULED: ("key", "delayMs"),
    EventKind.SUSPENDED: ("key",),
}
_DATA_KEY_SETS: dict[EventKind, frozenset[str]] = {
    kind: frozenset(keys) for kind, keys in _DATA_KEYS.items()
}


def _kind(value: str) -> EventKind:
    if type(value) is EventKind:
        return value
    try:
        return EventKind(value)
    except ValueError:
        raise InvalidEvent(f"unknown event kind {value!r}") from None


def _data(value: object) -> JSONObject:
    try:
        return ensure_json_object(value, what="event data")
    except InvalidJSON as exc:
        raise InvalidEvent(str(exc)) from exc


def _event_id(_inst: object, _attr: object, value: Any) -> None:
    _check(isinstance(value, str) and bool(value), "event id must be a non-empty string")


@attrs.frozen
class Event:
    """An intent to change one task. Build it with the kind constructors; the id defaults to
    :func:`new_event_id` and is the idempotency key of the write."""

    id: str = attrs.field(validator=_event_id)
    kind: EventKind = attrs.field(converter=_kind)
    data: JSONObject = attrs.field(converter=_data)

    def __attrs_post_init__(self) -> None:
        _validate(self.kind, self.data)

    @classmethod
    def input_requested(cls, key: str, request: JSONObject, id: str | None = None) -> Event:
        return cls(_id(id), EventKind.INPUT_REQUESTED, {"key": key, "request": request})

    @classmethod
    def input_responses_accepted(
        cls, responses: dict[str, JSONObject], id: str | None = None
    ) -> Event:
        return cls(_id(id), EventKind.INPUT_RESPONSES_ACCEPTED, {"responses": responses})

    @classmethod
    def retry_requested(
        cls, error: JSONObject, status_message: str | None, id: str | None = None
    ) -> Event:
        data = {"error": error, "statusMessage": status_message}
        return cls(_id(id), EventKind.RETRY_REQUESTED, data)

    @classmethod
    def completed(cls, result: JSONObject, id: str | None = None) -> Event:
        return cls(_id(id), EventKind.COMPLETED, {"result": result})

    @classmethod
    def failed(cls, error: JSONObject, status_message: str | None, id: str | None = None) -> Event:
        return cls(_id(id), EventKind.FAILED, {"error": error, "statusMessage": status_message})

    @classmethod
    def cancelled(cls, id: str | None = None) -> Event:
        return cls(_id(id), EventKind.CANCELLED, {})

    @classmethod
    def step_started(cls, key: str, fingerprint: str, id: str | None = None) -> Event:
        data = {"key": key, "fingerprint": fingerprint}
        return cls(_id(id), EventKind.STEP_STARTED, data)

    @classmethod
    def step_recorded(
        cls, key: str, fingerprint: str, outcome: JSONObject, id: str | None = None
    ) -> Event:
        """``outcome`` is ``{"result": JSON}`` or ``{"error": {code, message, data?}}``."""
        data = {"key": key, "fingerprint": fingerprint, "outcome": outcome}
        return cls(_id(id), EventKind.STEP_RECORDED, data)

    @classmethod
    def sleep_scheduled(cls, key: str, delay_ms: int, id: str | None = None) -> Event:
        """A durable sleep: the reducer records the wake instant, commit time + ``delay_ms``."""
        return cls(_id(id), EventKind.SLEEP_SCHEDULED, {"key": key, "delayMs": delay_ms})

    @classmethod
    def suspended(cls, key: str, id: str | None = None) -> Event:
        """End the attempt until sleep ``key`` is due or input ``key`` is answered."""
        return cls(_id(id), EventKind.SUSPENDED, {"key": key})

    def to_json(self) -> JSONObject:
        return {
            "version": 1,
            "id": self.id,
            "kind": self.kind.value,
            "data": ensure_json(self.data),
        }

    def json_view(self) -> JSONObject:
        """:meth:`to_json` sharing the event's data instead of copying it: the same value, for
        an encoder to read at once (a store writing its ledger), never to keep or mutate."""
        return {"version": 1, "id": self.id, "kind": self.kind.value, "data": self.data}

    @classmethod
    def from_json(cls, doc: object) -> Event:
        fields = expect_keys(doc, ("version", "id", "kind", "data"), "event")
        version = fields["version"]
        if not isinstance(version, int) or isinstance(version, bool) or version != 1:
            raise CodecError(f"unsupported event version {version!r}")
        if not isinstance(fields["kind"], str):
            raise CodecError("event kind must be a string")
        try:
            return cls(fields["id"], fields["kind"], fields["data"])
        except (TypeError, ValueError) as exc:
            raise CodecError(f"invalid event: {exc}") from exc


def _id(value: str | None) -> str:
    return new_event_id() if value is None else value


_SET_ID, _SET_KIND, _SET_DATA = (Event.__dict__[name].__set__ for name in ("id", "kind", "data"))


def completed_event(result: JSONObject) -> Event:
    """``Event.completed(result)`` for a result the caller has just checked and copied (the
    output of :func:`~tritask.tasks.work.ensure_json_object`) and hands over: the event holds
    it as it is instead of walking and copying it a second time (the runner's settle of a
    validated outcome). Everything else is checked as the constructor checks it."""
    event: Event = object.__new__(Event)
    _SET_ID(event, new_event_id())
    _SET_KIND(event, EventKind.COMPLETED)
    data = {"result": result}
    _validate(EventKind.COMPLETED, data)
    _SET_DATA(event, data)
    return event


# -- effects ------------------------------------------------------------------------------------


def _check_effect(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@attrs.frozen(kw_only=True)
class RetryEffect:
    """What a ``retry_requested`` event did: scheduled the next attempt, or exhausted the list."""

    disposition: Literal["scheduled", "exhausted"]
    retry_at: int | None
    delay_ms: int | None
    retry_count: int

    def __attrs_post_init__(self) -> None:
        _check_effect(_is_int(self.retry_count) and self.retry_count >= 0, "retry_count")
        if self.disposition == "scheduled":
            _check_effect(_is_int(self.retry_at), "a scheduled retry needs retry_at")
            _check_effect(
                _is_int(self.delay_ms) and 0 <= self.delay_ms <= MAX_DELAY_MS,  # type: ignore[operator]
                "a scheduled retry needs delay_ms",
            )
            _check_effect(self.retry_count > 0, "a scheduled retry counts at least one retry")
        elif self.disposition == "exhausted":
            _check_effect(
                self.retry_at is None and self.delay_ms is None,
                "an exhausted retry has no retry_at or delay_ms",
            )
        else:
            raise ValueError(f"unknown retry disposition {self.disposition!r}")


def _optional_responses(value: object) -> JSONObject | None:
    return None if value is None else ensure_json_object(value, what="accepted responses")


def _is_retry(_inst: object, _attr: object, value: Any) -> None:
    _check_effect(value is None or isinstance(value, RetryEffect), "retry must be a RetryEffect")


@attrs.frozen(kw_only=True)
class Effects:
    """Side information of one transition, replayed verbatim for a duplicate event.

    At most one field is set: accepted responses (an update, possibly ``{}`` when nothing
    matched) or a retry disposition.
    """

    accepted_input_responses: JSONObject | None = attrs.field(
        default=None, converter=_optional_responses
    )
    retry: RetryEffect | None = attrs.field(default=None, validator=_is_retry)

    def __attrs_post_init__(self) -> None:
        _check_effect(
            self.accepted_input_responses is None or self.retry is None,
            "effects carry accepted responses or a retry, not both",
        )

    @classmethod
    def none(cls) -> Effects:
        return cls()


def effects_to_json(effects: Effects) -> JSONObject:
    """Effects codec v1 (as persisted by the SQL stores)."""
    if effects.accepted_input_responses is not None:
        return {
            "version": 1,
            "kind": "acceptedInputResponses",
            "responses": ensure_json(effects.accepted_input_responses),
        }
    if effects.retry is not None:
        retry = effects.retry
        return {
            "version": 1,
            "kind": "retry",
            "retry": {
                "disposition": retry.disposition,
                "retryAt": None if retry.retry_at is None else format_instant(retry.retry_at),
                "delayMs": retry.delay_ms,
                "retryCount": retry.retry_count,
            },
        }
    return {"version": 1, "kind": "none"}


_EFFECT_KEYS = {
    "none": ("version", "kind"),
    "acceptedInputResponses": ("version", "kind", "responses"),
    "retry": ("version", "kind", "retry"),
}


def _decode_retry(doc: object) -> RetryEffect:
    fields = expect_keys(doc, ("disposition", "retryAt", "delayMs", "retryCount"), "retry effect")
    retry_at: Any = fields["retryAt"]
    if retry_at is not None:
        retry_at = parse_instant(retry_at)
    for key in ("delayMs", "retryCount"):
        value = fields[key]
        if value is not None and not _is_int(value):
            raise CodecError(f"retry effect {key} must be an int")
    if fields["disposition"] not in ("scheduled", "exhausted"):
        raise CodecError("unknown retry disposition")
    return RetryEffect(
        disposition=fields["disposition"],
        retry_at=retry_at,
        delay_ms=fields["delayMs"],
        retry_count=fields["retryCount"],
    )


def effects_from_json(doc: object) -> Effects:
    """Strictly decode effects v1; any deviation raises :class:`CodecError`."""
    if not isinstance(doc, dict):
        raise CodecError("effects must be a JSON object")
    kind = doc.get("kind")
    if not isinstance(kind, str) or kind not in _EFFECT_KEYS:
        raise CodecError(f"unknown effects kind {kind!r}")
    fields = expect_keys(doc, _EFFECT_KEYS[kind], "effects")
    version = fields["version"]
    if not _is_int(version) or version != 1:
        raise CodecError(f"unsupported effects version {version!r}")
    try:
        if kind == "acceptedInputResponses":
            responses = fields["responses"]
            if not isinstance(responses, dict) or not all(
                isinstance(v, dict) for v in responses.values()
            ):
                raise CodecError("accepted responses must map keys to objects")
            return Effects(accepted_input_responses=responses)
        if kind == "retry":
            return Effects(retry=_decode_retry(fields["retry"]))
        return Effects.none()
    except CodecError:
        raise
    except (TypeError, ValueError) as exc:
        raise CodecError(f"invalid effects: {exc}") from exc
