"""The durable work descriptor (``Work`` v2 to v5), its ``RetryPolicy`` (v1), the W3C
``TraceContext`` and the creating request's ``Origin`` it may carry, and the JSON guards.

Work is what a runner re-executes after recovery, so it holds only JSON and is persisted whole;
the expanded retry delays travel with it so a configuration change never affects work in flight.
Its trace context (a request's ``_meta`` ``traceparent``/``tracestate``) travels with it too, so
a recovered attempt continues the trace its client started.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any, Final, TypeVar

import attrs
import orjson

__all__ = [
    "MAX_DELAY_MS",
    "MAX_TRACESTATE_CHARS",
    "TRACEPARENT_KEY",
    "TRACESTATE_KEY",
    "CodecError",
    "InvalidJSON",
    "JSONObject",
    "Origin",
    "RetryPolicy",
    "TraceContext",
    "Work",
    "canonical_json",
    "canonical_size",
    "canonical_text",
    "clone_json",
    "ensure_json",
    "ensure_json_object",
    "expect_keys",
    "stored_text",
]

JSONObject = dict[str, Any]
_T = TypeVar("_T")
MAX_DELAY_MS = 4_294_967_295
_MAX_DEPTH = 200


class InvalidJSON(ValueError):
    """A value that must be JSON is not (NaN, non-string keys, sets, tuples, objects...)."""


class CodecError(ValueError):
    """A persisted document failed strict decoding (unknown version, extra/missing keys, types)."""


def ensure_json(value: object, *, what: str = "value") -> Any:
    """Validate that ``value`` is plain JSON and return a deep copy the caller owns.

    Copying on the way in means a caller mutating its dict later cannot change a stored record.
    Scalar subclasses (``IntEnum``, ``StrEnum``) are normalised to the base type; nesting deeper
    than 200 levels is refused rather than risking a ``RecursionError``.
    """
    return _copy(value, what, 0)


_SCALARS = frozenset({str, int, bool, type(None)})
"""Exact types whose values are immutable JSON as they are (subclasses take the slow path)."""


def _copy(value: object, what: str, depth: int) -> Any:
    kind = type(value)
    if kind is dict:
        if not value:
            if depth > _MAX_DEPTH:
                raise InvalidJSON(f"{what} is nested more than {_MAX_DEPTH} levels deep")
            return {}
        if depth >= _MAX_DEPTH:
            raise InvalidJSON(f"{what} is nested more than {_MAX_DEPTH} levels deep")
        # Its items are at most _MAX_DEPTH deep: an empty container or a scalar among them is
        # within the limit and taken as it is (a new empty one), without a call of its own.
        deeper = depth + 1
        out: dict[str, Any] = {}
        for key, item in value.items():  # type: ignore[attr-defined]
            if type(key) is not str:
                key = _key(key, what)
            kind = type(item)
            if kind in _SCALARS:
                out[key] = item
            elif kind in _CONTAINER_TYPES and not item:
                out[key] = kind()  # an empty object or array: a new one, without a call
            else:
                out[key] = _copy(item, what, deeper)
        return out
    if kind is list:
        if not value:
            if depth > _MAX_DEPTH:
                raise InvalidJSON(f"{what} is nested more than {_MAX_DEPTH} levels deep")
            return []
        if depth >= _MAX_DEPTH:
            raise InvalidJSON(f"{what} is nested more than {_MAX_DEPTH} levels deep")
        deeper = depth + 1
        items: list[Any] = []
        for item in value:  # type: ignore[attr-defined]
            kind = type(item)
            if kind in _SCALARS:
                items.append(item)
            elif kind in _CONTAINER_TYPES and not item:
                items.append(kind())
            else:
                items.append(_copy(item, what, deeper))
        return items
    if kind in _SCALARS:
        if depth > _MAX_DEPTH:
            raise InvalidJSON(f"{what} is nested more than {_MAX_DEPTH} levels deep")
        return value
    return _copy_other(value, what, depth)


_CONTAINER_TYPES = frozenset({dict, list})


def _key(key: object, what: str) -> str:
    """An object key that is not exactly a ``str``: a subclass normalised, anything else refused."""
    if not isinstance(key, str):
        raise InvalidJSON(f"{what} has a non-string object key {key!r}")
    return str.__str__(key)


def _copy_other(value: object, what: str, depth: int) -> Any:
    """Floats and subclasses of the JSON types (normalised to the base type)."""
    if depth > _MAX_DEPTH:
        raise InvalidJSON(f"{what} is nested more than {_MAX_DEPTH} levels deep")
    if value is None:
        return None
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidJSON(f"{what} contains a non-finite number")
        return float(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, list):
        return [_copy(item, what, depth + 1) for item in value]
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidJSON(f"{what} has a non-string object key {key!r}")
            out[str.__str__(key)] = _copy(item, what, depth + 1)
        return out
    raise InvalidJSON(f"{what} contains a non-JSON {type(value).__name__}")


def ensure_json_object(value: object, *, what: str = "value") -> JSONObject:
    """Like :func:`ensure_json` but the top level must be a JSON object."""
    if type(value) is dict and not value:
        return {}  # (the usual empty field of a record: a new dict, without the walk)
    if not isinstance(value, dict):
        raise InvalidJSON(f"{what} must be a JSON object, not {type(value).__name__}")
    result: JSONObject = _copy(value, what, 0)
    return result


def canonical_json(value: object) -> str:
    """Sorted, compact JSON text: exact equality for JSON values (``1 != 1.0 != true``)."""
    return canonical_text(ensure_json(value))


def canonical_text(value: Any) -> str:
    """:func:`canonical_json` of a value that is already checked JSON (the output of
    :func:`ensure_json`, e.g. a field of a ``Work`` or an ``Event``): nothing is copied."""
    return _CANONICAL.encode(value)


_CANONICAL: Final = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)
"""What ``json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)`` builds
on every call, built once (an encoder keeps no state between ``encode`` calls)."""


def canonical_size(*values: Any) -> int:
    """The sum of the UTF-8 sizes of :func:`canonical_text` of each of ``values`` (checked
    JSON), from one encoding: the text of the list of them, less its brackets and commas."""
    if len(values) == 1:
        return len(canonical_text(values[0]).encode("utf-8"))
    return len(canonical_text(list(values)).encode("utf-8")) - len(values) - 1


def stored_text(value: Any) -> str:
    """Sorted, compact JSON text of checked JSON for a store to write (records, effects).

    orjson writes it (UTF-8, several times faster than the standard library); what orjson
    cannot encode exactly (a lone surrogate, an integer beyond 64 bits) the standard library
    writes with ASCII escapes, so the text is always valid UTF-8. The two encoders write equal
    values differently (``1e16`` or ``1e+16``), so compare decoded values, or texts from this
    function only, never its text with :func:`canonical_json`'s.
    """
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode("utf-8")
    except orjson.JSONEncodeError:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def clone_json(value: _T) -> _T:
    """A deep copy of a value that is already checked JSON (the output of :func:`ensure_json`,
    so containers are exactly ``dict`` and ``list``). Nothing is checked again: use it to hand
    out an owned value, never on anything that came from outside."""
    kind = type(value)
    if kind is dict:
        if not value:
            return {}  # type: ignore[return-value]  # (an empty field: no loop to run)
        out: dict[str, Any] = {}
        for key, item in value.items():  # type: ignore[attr-defined]
            kind = type(item)
            if kind is dict or kind is list:
                out[key] = clone_json(item) if item else kind()
            else:
                out[key] = item
        return out  # type: ignore[return-value]
    if kind is list:
        items: list[Any] = []
        for item in value:  # type: ignore[attr-defined]
            kind = type(item)
            if kind is dict or kind is list:
                items.append(clone_json(item) if item else kind())
            else:
                items.append(item)
        return items  # type: ignore[return-value]
    return value


def unchecked_evolve(record: _T, **changes: Any) -> _T:
    """A copy of a frozen attrs ``record`` with ``changes``, built without converters,
    validators or ``__attrs_post_init__``.

    Only for values the caller has already checked and owns (a store copying its own valid
    state to hand it out); every other construction goes through the class.
    """
    new = object.__new__(type(record))
    used = 0
    for field in type(record).__attrs_attrs__:  # type: ignore[attr-defined]
        name = field.name
        if name in changes:
            value = changes[name]
            used += 1
        else:
            value = getattr(record, name)
        object.__setattr__(new, name, value)
    if used != len(changes):
        raise TypeError(f"{type(record).__name__} has no fields among {sorted(changes)}")
    return new


def expect_keys(doc: object, keys: Iterable[str], what: str) -> Mapping[str, Any]:
    """Strict decoding helper: ``doc`` must be an object with exactly ``keys``."""
    if not isinstance(doc, dict):
        raise CodecError(f"{what} must be a JSON object")
    expected = set(keys)
    actual = set(doc)
    if actual != expected:
        extra = sorted(map(str, actual - expected))
        missing = sorted(expected - actual)
        raise CodecError(f"{what} has unexpected keys {extra} / missing keys {missing}")
    return doc


def _expect_version(doc: Mapping[str, Any], version: int, what: str) -> None:
    found = doc["version"]
    if not isinstance(found, int) or isinstance(found, bool) or found != version:
        raise CodecError(f"unsupported {what} version {found!r} (expected {version})")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _delays(value: Iterable[int]) -> tuple[int, ...]:
    if isinstance(value, str | bytes | Mapping):
        raise TypeError("delays_ms must be a sequence of ints")
    delays = tuple(value)
    for delay in delays:
        if not _is_int(delay):
            raise TypeError(f"a retry delay must be an int, not {type(delay).__name__}")
        if not 0 <= delay <= MAX_DELAY_MS:
            raise ValueError(f"retry delay {delay} is outside 0..{MAX_DELAY_MS} ms")
    return delays


def _count(n: object) -> int:
    if not _is_int(n):
        raise TypeError("the number of retries must be an int")
    assert isinstance(n, int)
    if n < 0:
        raise ValueError("the number of retries must be >= 0")
    return n


@attrs.frozen
class RetryPolicy:
    """An exact, finite list of retry delays in ms: ``delays_ms[n]`` is the wait after retry ``n``.

    The default (``none()``) never retries.
    """

    delays_ms: tuple[int, ...] = attrs.field(converter=_delays)

    @classmethod
    def none(cls) -> RetryPolicy:
        return cls(())

    @classmethod
    def fixed(cls, delay_ms: int, n: int) -> RetryPolicy:
        return cls([delay_ms] * _count(n))

    @classmethod
    def exponential(cls, initial_ms: int, n: int, max_delay_ms: int | None = None) -> RetryPolicy:
        """Doubling delays capped at ``max_delay_ms`` (and at the 32-bit maximum)."""
        if not _is_int(initial_ms) or (max_delay_ms is not None and not _is_int(max_delay_ms)):
            raise TypeError("delays must be ints")
        cap = MAX_DELAY_MS if max_delay_ms is None else max_delay_ms
        if max_delay_ms is not None and not 0 <= max_delay_ms <= MAX_DELAY_MS:
            raise ValueError(f"max_delay_ms must be within 0..{MAX_DELAY_MS}")
        if initial_ms > cap:
            raise ValueError("initial delay exceeds the maximum delay")
        delays: list[int] = []
        delay = initial_ms
        for _ in range(_count(n)):
            delays.append(delay)
            delay = min(delay * 2, cap)
        return cls(delays)

    def next_delay(self, retry_count: int) -> int | None:
        """The delay before retry ``retry_count + 1``, or ``None`` when the list is exhausted."""
        if not _is_int(retry_count) or retry_count < 0:
            raise ValueError("retry_count must be a non-negative int")
        if retry_count < len(self.delays_ms):
            return self.delays_ms[retry_count]
        return None

    def to_json(self) -> JSONObject:
        return {"version": 1, "delaysMs": list(self.delays_ms)}

    @classmethod
    def from_json(cls, doc: object) -> RetryPolicy:
        fields = expect_keys(doc, ("version", "delaysMs"), "retry policy")
        _expect_version(fields, 1, "retry policy")
        delays = fields["delaysMs"]
        if not isinstance(delays, list):
            raise CodecError("retry policy delaysMs must be a list")
        try:
            return cls(delays)
        except (TypeError, ValueError) as exc:
            raise CodecError(f"invalid retry policy: {exc}") from exc


# -- trace context -------------------------------------------------------------------------------

TRACEPARENT_KEY: Final = "traceparent"
TRACESTATE_KEY: Final = "tracestate"
MAX_TRACESTATE_CHARS: Final = 512
"""The W3C minimum a vendor must propagate; a longer ``tracestate`` is dropped, not cut."""

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_TRACESTATE = re.compile(r"[\x20-\x7e]*")
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16


def _traceparent(_inst: object, _attr: object, value: Any) -> None:
    if not isinstance(value, str):
        raise TypeError("traceparent must be a string")
    match = _TRACEPARENT.fullmatch(value)
    if match is None:
        raise ValueError(f"not a W3C traceparent: {value!r}")
    version, trace_id, span_id, _ = match.groups()
    if version == "ff" or trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        raise ValueError(f"invalid W3C traceparent: {value!r}")


def _tracestate(_inst: object, _attr: object, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        raise TypeError("tracestate must be a string or None")
    if len(value) > MAX_TRACESTATE_CHARS or _TRACESTATE.fullmatch(value) is None:
        raise ValueError("tracestate must be at most 512 printable ASCII characters")


@attrs.frozen
class TraceContext:
    """A validated W3C trace context: where the work's trace continues."""

    traceparent: str = attrs.field(validator=_traceparent)
    tracestate: str | None = attrs.field(default=None, validator=_tracestate)

    @property
    def trace_id(self) -> str:
        return self.traceparent[3:35]

    @property
    def span_id(self) -> str:
        return self.traceparent[36:52]

    def carrier(self) -> dict[str, str]:
        """The W3C text-map carrier (what a propagator extracts from)."""
        carrier = {TRACEPARENT_KEY: self.traceparent}
        if self.tracestate:
            carrier[TRACESTATE_KEY] = self.tracestate
        return carrier

    @classmethod
    def from_carrier(cls, carrier: Mapping[str, Any]) -> TraceContext | None:
        """The trace context of a request's ``_meta`` (or any W3C carrier), if it has a valid
        one. As W3C requires, an invalid ``traceparent`` is ignored (the trace starts anew)
        and an invalid ``tracestate`` is dropped; neither is an error of the request. A
        ``traceparent`` of a later version keeps its first four fields."""
        text = carrier.get(TRACEPARENT_KEY)
        if not isinstance(text, str):
            return None
        if len(text) > 55 and not text.startswith("00") and text[55] == "-":
            text = text[:55]
        try:
            parent = cls(text)
        except (TypeError, ValueError):
            return None
        state = carrier.get(TRACESTATE_KEY)
        try:
            if isinstance(state, str):
                return cls(parent.traceparent, state.strip() or None)
        except (TypeError, ValueError):
            pass
        return parent

    def to_json(self) -> JSONObject:
        return {"traceparent": self.traceparent, "tracestate": self.tracestate}

    @classmethod
    def from_json(cls, doc: object) -> TraceContext:
        fields = expect_keys(doc, ("traceparent", "tracestate"), "trace context")
        try:
            return cls(fields["traceparent"], fields["tracestate"])
        except (TypeError, ValueError) as exc:
            raise CodecError(f"invalid trace context: {exc}") from exc


def _non_empty_str(what: str) -> Any:
    def check(_inst: object, _attr: object, value: object) -> None:
        if not isinstance(value, str) or not value:
            raise ValueError(f"{what} must be a non-empty string")

    return check


def _work_input(value: object) -> JSONObject:
    return ensure_json_object(value, what="work input")


def _is_policy(_inst: object, _attr: object, value: object) -> None:
    if not isinstance(value, RetryPolicy):
        raise TypeError("retry_policy must be a RetryPolicy")


def _is_trace(_inst: object, _attr: object, value: Any) -> None:
    if value is not None and not isinstance(value, TraceContext):
        raise TypeError("trace_context must be a TraceContext or None")


def _is_tool(_inst: object, _attr: object, value: Any) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError("tool must be a non-empty string or None")


def _capabilities(value: object) -> JSONObject:
    if not isinstance(value, dict):
        raise InvalidJSON("client capabilities must be a JSON object")
    return ensure_json_object(value, what="client capabilities")


def _client_info(value: object) -> JSONObject | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidJSON("client info must be a JSON object or None")
    return ensure_json_object(value, what="client info")


@attrs.frozen(kw_only=True)
class Origin:
    """What the client that created a task declared in its request: the protocol version, its
    capabilities and client info, none of them secret. The extension persists it with default
    work, so an attempt resumed anywhere (after a restart, on another host, beyond
    ``max_queued_contexts``) sees the client as a request made here would. Neither
    ``ctx.auth`` nor the principal is part of it (docs/security.md: a persisted token would
    outlive its expiry and its revocation, and a principal is the application's value, which
    may carry credentials; a ``work_builder`` projects what of it to keep). Its JSON is checked
    and copied on the way in and never handed out: each read is a copy of its own, so the
    value stays immutable."""

    protocol_version: str = attrs.field(validator=_non_empty_str("protocol_version"))
    _capabilities: JSONObject = attrs.field(converter=_capabilities, alias="client_capabilities")
    _client_info: JSONObject | None = attrs.field(
        default=None, converter=_client_info, alias="client_info"
    )

    @property
    def client_capabilities(self) -> JSONObject:
        return clone_json(self._capabilities)

    @property
    def client_info(self) -> JSONObject | None:
        return clone_json(self._client_info)

    def size(self, *others: Any) -> int:
        """Its JSON's size in UTF-8 bytes (it counts against ``max_work_input_bytes``), plus
        that of each of ``others`` (checked JSON: the work's input), in one encoding."""
        return canonical_size(*others, self._capabilities, self._client_info)

    def to_json(self) -> JSONObject:
        return {
            "protocolVersion": self.protocol_version,
            "clientCapabilities": self.client_capabilities,
            "clientInfo": self.client_info,
        }

    def json_view(self) -> JSONObject:
        """:meth:`to_json` sharing this origin's JSON instead of copying it: for an encoder to
        read at once (a store writing its record), never to keep, mutate or hand out."""
        return {
            "protocolVersion": self.protocol_version,
            "clientCapabilities": self._capabilities,
            "clientInfo": self._client_info,
        }

    @classmethod
    def from_json(cls, doc: object) -> Origin:
        fields = expect_keys(doc, ("protocolVersion", "clientCapabilities", "clientInfo"), "origin")
        info = fields["clientInfo"]
        if info is not None and not isinstance(info, dict):
            raise CodecError("origin clientInfo must be an object or null")
        try:
            return cls(
                protocol_version=fields["protocolVersion"],
                client_capabilities=fields["clientCapabilities"],
                client_info=info,
            )
        except (TypeError, ValueError) as exc:
            raise CodecError(f"invalid origin: {exc}") from exc


def _is_origin(_inst: object, _attr: object, value: Any) -> None:
    if value is not None and not isinstance(value, Origin):
        raise TypeError("origin must be an Origin or None")


_WORK_V2_KEYS: Final = ("version", "idempotencyKey", "type", "input", "retryPolicy")
_WORK_V3_KEYS: Final = (*_WORK_V2_KEYS, "traceContext")
_WORK_V4_KEYS: Final = (*_WORK_V3_KEYS, "tool")
_WORK_V5_KEYS: Final = (*_WORK_V4_KEYS, "origin")
_WORK_KEYS: Final = {2: _WORK_V2_KEYS, 3: _WORK_V3_KEYS, 4: _WORK_V4_KEYS, 5: _WORK_V5_KEYS}


@attrs.frozen(kw_only=True)
class Work:
    """What to execute for a task. ``idempotency_key`` equals the task id and stays stable across
    attempts, so external effects can be de-duplicated.

    The builder of a Work is the security boundary: persist only stable identity, never a
    request context or credentials. ``trace_context`` is the W3C trace the work continues (the
    runner sets it from the creating request's ``_meta``). ``tool`` is the name of the tool
    whose call created a task whose work a custom ``work_builder`` shaped (the extension sets
    it; the default descriptor names its tool in its input): what a later request on the task
    must be authorized for (the tool's ``required_scopes``) must not depend on the builder.

    ``origin`` is what the creating request's client declared (:class:`Origin`), which the
    extension persists with default work.

    Codec: version 2 without a trace context, tool or origin (so records written before they
    existed and records without them are the same bytes), version 3 with a trace context,
    version 4 with a tool (and a trace context or ``null``), version 5 with an origin (and a
    trace context and a tool, each or ``null``); every version decodes, each strictly.
    """

    idempotency_key: str = attrs.field(validator=_non_empty_str("idempotency_key"))
    type: str = attrs.field(validator=_non_empty_str("type"))
    input: JSONObject = attrs.field(converter=_work_input)
    retry_policy: RetryPolicy = attrs.field(factory=RetryPolicy.none, validator=_is_policy)
    trace_context: TraceContext | None = attrs.field(default=None, validator=_is_trace)
    tool: str | None = attrs.field(default=None, validator=_is_tool)
    origin: Origin | None = attrs.field(default=None, validator=_is_origin)

    @classmethod
    def tool_call(
        cls,
        task_id: str,
        name: str,
        arguments: Mapping[str, Any],
        retry_policy: RetryPolicy | None = None,
    ) -> Work:
        """The default descriptor for a task-augmented ``tools/call``."""
        return cls(
            idempotency_key=task_id,
            type="tools/call",
            input={"name": name, "arguments": dict(arguments)},
            retry_policy=RetryPolicy.none() if retry_policy is None else retry_policy,
        )

    def to_json(self) -> JSONObject:
        return self._document(ensure_json(self.input), share=False)

    def json_view(self) -> JSONObject:
        """:meth:`to_json` sharing this work's JSON (its input, its origin's) instead of
        copying it: the same value, for an encoder to read at once (a store writing its
        record), never to keep, mutate or hand out. The work is a value, so the view is too
        for as long as it is read."""
        return self._document(self.input, share=True)

    def _document(self, work_input: JSONObject, *, share: bool) -> JSONObject:
        doc: JSONObject = {
            "version": 2,
            "idempotencyKey": self.idempotency_key,
            "type": self.type,
            "input": work_input,
            "retryPolicy": self.retry_policy.to_json(),
        }
        trace = self.trace_context
        if self.origin is not None:
            doc["version"] = 5
            doc["traceContext"] = None if trace is None else trace.to_json()
            doc["tool"] = self.tool
            doc["origin"] = self.origin.json_view() if share else self.origin.to_json()
        elif self.tool is not None:
            doc["version"] = 4
            doc["traceContext"] = None if trace is None else trace.to_json()
            doc["tool"] = self.tool
        elif trace is not None:
            doc["version"] = 3
            doc["traceContext"] = trace.to_json()
        return doc

    @classmethod
    def from_json(cls, doc: object) -> Work:
        version = doc.get("version") if isinstance(doc, dict) else None
        if not _is_int(version) or version not in _WORK_KEYS:
            raise CodecError(f"unsupported work version {version!r} (expected 2 to 5)")
        fields = expect_keys(doc, _WORK_KEYS[version], "work")
        policy = RetryPolicy.from_json(fields["retryPolicy"])
        trace = None
        if version == 3 or (version >= 4 and fields["traceContext"] is not None):
            trace = TraceContext.from_json(fields["traceContext"])
        tool = None
        if version == 4 or (version == 5 and fields["tool"] is not None):
            # Version 4 exists for the tool: without one the work is written as 2 or 3.
            tool = fields["tool"]
            if not isinstance(tool, str) or not tool:
                raise CodecError(f"work version {version} needs its tool (a non-empty string)")
        origin = Origin.from_json(fields["origin"]) if version == 5 else None
        try:
            return cls(
                idempotency_key=fields["idempotencyKey"],
                type=fields["type"],
                input=fields["input"],
                retry_policy=policy,
                trace_context=trace,
                tool=tool,
                origin=origin,
            )
        except (TypeError, ValueError) as exc:
            raise CodecError(f"invalid work: {exc}") from exc
