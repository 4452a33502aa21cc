"""Persisted formats: Event v1, Work v2, RetryPolicy v1, aggregate record v3, effects v1.

Round trips go through real JSON text; every mutation of a valid document (extra key, missing
key, wrong type, wrong version) is refused with the codec error and nothing else.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import json
from collections.abc import Callable
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tritask.jsonrpc import loads
from tritask.tasks.events import (
    MAX_FINGERPRINT_CHARS,
    MAX_STEP_KEY_CHARS,
    Effects,
    Event,
    EventKind,
    InvalidEvent,
    RetryEffect,
    effects_from_json,
    effects_to_json,
)
from tritask.tasks.model import (
    CorruptRecord,
    Snapshot,
    Task,
    TaskStatus,
    create_task_result,
    detailed_task,
    initial_snapshot,
    new_task,
    record_text,
    snapshot_from_json,
    snapshot_json_view,
    snapshot_to_json,
    task_wire_base,
)
from tritask.tasks.reducer import DuplicateInputKey, StepKeyReused, apply
from tritask.tasks.work import (
    MAX_DELAY_MS,
    CodecError,
    InvalidJSON,
    Origin,
    RetryPolicy,
    TraceContext,
    Work,
    canonical_json,
    canonical_size,
    canonical_text,
    clone_json,
    ensure_json,
    stored_text,
)

HARDENING = pytest.mark.contract("tasks-store-hardening")
DESCRIPTOR = pytest.mark.contract("tasks-work-descriptor")
T0 = 1_787_565_600_000_000  # 2026-08-24T10:00:00.000Z

# -- strategies ---------------------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**60), max_value=2**60)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
json_objects = st.dictionaries(st.text(max_size=5), json_values, max_size=4)
names = st.text(min_size=1, max_size=8)
requests = st.fixed_dictionaries({"method": names}, optional={"params": json_objects})
errors = st.fixed_dictionaries({"code": st.integers(-33000, 0), "message": st.text(max_size=8)})
messages = st.none() | st.text(max_size=8)
policies = st.lists(st.integers(0, MAX_DELAY_MS), max_size=4).map(RetryPolicy)
traces = st.sampled_from(
    [None, TraceContext("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "a=1")]
)
origins = st.builds(
    lambda version, caps, info: Origin(
        protocol_version=version, client_capabilities=caps, client_info=info
    ),
    names,
    json_objects,
    st.none() | json_objects,
)
works = st.builds(
    lambda key, kind, data, policy, trace, tool, origin: Work(
        idempotency_key=key,
        type=kind,
        input=data,
        retry_policy=policy,
        trace_context=trace,
        tool=tool,
        origin=origin,
    ),
    names,
    names,
    json_objects,
    policies,
    traces,
    st.none() | names,
    st.none() | origins,  # versions 2 to 5
)
event_ids = st.none() | names
input_keys = st.sampled_from(["a", "b", "c"])
step_keys = st.sampled_from(["s", "t", "a"])
step_outcomes = st.one_of(
    json_values.map(lambda v: {"result": v}),
    errors.map(lambda e: {"error": e}),
)


def events(keys: st.SearchStrategy[str] = input_keys) -> st.SearchStrategy[Event]:
    return st.one_of(
        st.builds(lambda k, r, i: Event.input_requested(k, r, id=i), keys, requests, event_ids),
        st.builds(
            lambda r, i: Event.input_responses_accepted(r, id=i),
            st.dictionaries(keys | names, json_objects, max_size=3),
            event_ids,
        ),
        st.builds(lambda e, m, i: Event.retry_requested(e, m, id=i), errors, messages, event_ids),
        st.builds(lambda r, i: Event.completed(r, id=i), json_objects, event_ids),
        st.builds(lambda e, m, i: Event.failed(e, m, id=i), errors, messages, event_ids),
        st.builds(lambda i: Event.cancelled(id=i), event_ids),
        st.builds(lambda k, f, i: Event.step_started(k, f, id=i), step_keys, names, event_ids),
        st.builds(
            lambda k, f, o, i: Event.step_recorded(k, f, o, id=i),
            step_keys,
            names,
            step_outcomes,
            event_ids,
        ),
        st.builds(
            lambda k, d, i: Event.sleep_scheduled(k, d, id=i),
            step_keys,
            st.integers(0, MAX_DELAY_MS),
            event_ids,
        ),
        st.builds(lambda k, i: Event.suspended(k, id=i), step_keys | keys, event_ids),
    )


@st.composite
def snapshots(draw: st.DrawFn) -> Snapshot:
    """Reachable records: a fresh task driven through the reducer by random events."""
    task_id = draw(names)
    created = draw(st.integers(0, 2 * 10**15)) // 1000 * 1000
    task = new_task(
        task_id,
        created,
        draw(st.none() | st.integers(1, 10**9)),
        draw(st.none() | st.integers(1, 10**4)),
        draw(messages),
    )
    work = Work(
        idempotency_key=task_id,
        type=draw(names),
        input=draw(json_objects),
        retry_policy=draw(policies),
    )
    snapshot = initial_snapshot(task, work)
    now = created
    for event in draw(st.lists(events(), max_size=8)):
        now += draw(st.integers(1, 10**9))
        try:
            snapshot = apply(snapshot, event, now).snapshot
        except (DuplicateInputKey, StepKeyReused):
            continue
    return snapshot


def effects_values() -> st.SearchStrategy[Effects]:
    scheduled = st.builds(
        lambda at, delay, count: RetryEffect(
            disposition="scheduled", retry_at=at, delay_ms=delay, retry_count=count
        ),
        st.integers(0, 2 * 10**15),
        st.integers(0, MAX_DELAY_MS),
        st.integers(1, 100),
    )
    exhausted = st.builds(
        lambda count: RetryEffect(
            disposition="exhausted", retry_at=None, delay_ms=None, retry_count=count
        ),
        st.integers(0, 100),
    )
    return st.one_of(
        st.just(Effects.none()),
        st.dictionaries(names, json_objects, max_size=3).map(
            lambda r: Effects(accepted_input_responses=r)
        ),
        (scheduled | exhausted).map(lambda r: Effects(retry=r)),
    )


def through_text(doc: Any) -> Any:
    return json.loads(json.dumps(doc, allow_nan=False))


# -- mutations ----------------------------------------------------------------------------------

WRONG_TYPES: list[Any] = [True, 1.5, [{"x": 1}]]


def fixed_key_objects(doc: dict[str, Any], nested: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Paths of the objects in ``doc`` whose key set is fixed by the schema."""
    paths: list[tuple[str, ...]] = [()]
    for path in nested:
        parts = tuple(path.split("."))
        node: Any = doc
        for part in parts:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            paths.append(parts)
    return paths


def node_at(doc: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        doc = doc[part]
    return doc


@st.composite
def mutated(draw: st.DrawFn, doc: dict[str, Any], nested: tuple[str, ...]) -> dict[str, Any]:
    """One schema-breaking change at the top level or inside a fixed-key sub-object."""
    doc = copy.deepcopy(doc)
    path = draw(st.sampled_from(fixed_key_objects(doc, nested)))
    target = node_at(doc, path)
    keys = sorted(target)
    choices = ["extra"] + (["missing", "wrong_type"] if keys else [])
    if "version" in target:
        choices.append("version")
    match draw(st.sampled_from(choices)):
        case "extra":
            target[draw(st.text(max_size=6).filter(lambda k: k not in target))] = draw(json_values)
        case "missing":
            del target[draw(st.sampled_from(keys))]
        case "wrong_type":
            target[draw(st.sampled_from(keys))] = draw(st.sampled_from(WRONG_TYPES))
        case _:
            target["version"] = draw(
                st.sampled_from([target["version"] + 1, 0, -1, str(target["version"]), None])
            )
    return doc


RECORD_NESTED = ("task", "work", "work.retryPolicy", "lastFailure", "suspended")
EVENT_NESTED = ("data",)
EFFECT_NESTED = ("retry",)


def check_refused(decode: Callable[[Any], Any], doc: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        decode(doc)


# -- JSON guard ---------------------------------------------------------------------------------


class Colour(enum.StrEnum):
    RED = "red"


class Level(enum.IntEnum):
    HIGH = 3


@pytest.mark.parametrize(
    "value",
    [
        float("nan"),
        float("inf"),
        {1: "x"},
        {"a": {1, 2}},
        (1, 2),
        b"bytes",
        object(),
        {"nested": [{"deep": float("-inf")}]},
    ],
)
@HARDENING
def test_ensure_json_refuses_non_json(value: object) -> None:
    with pytest.raises(InvalidJSON):
        ensure_json(value)


@HARDENING
def test_ensure_json_copies_and_normalises() -> None:
    original = {"list": [1, {"k": "v"}], "colour": Colour.RED, "level": Level.HIGH}
    copied = ensure_json(original)
    assert copied == {"list": [1, {"k": "v"}], "colour": "red", "level": 3}
    assert type(copied["colour"]) is str
    assert type(copied["level"]) is int
    original["list"][1]["k"] = "changed"  # type: ignore[index]
    assert copied["list"][1] == {"k": "v"}


@HARDENING
def test_ensure_json_refuses_deep_nesting() -> None:
    value: Any = []
    for _ in range(300):
        value = [value]
    with pytest.raises(InvalidJSON, match="nested"):
        ensure_json(value)


@pytest.mark.parametrize("empty", [{}, [], 1])
@pytest.mark.parametrize("wrap", [lambda inner: [inner], lambda inner: {"k": inner}])
@HARDENING
def test_ensure_json_depth_limit_is_exact(empty: object, wrap: Callable[[object], object]) -> None:
    """200 levels of containers around an empty one (or a scalar) are JSON, 201 are not; an
    empty container or a scalar is taken without a call of its own, at the same limit."""

    def nest(levels: int) -> object:
        value = copy.deepcopy(empty)
        for _ in range(levels):
            value = wrap(value)
        return value

    assert ensure_json(nest(200)) == nest(200)
    assert clone_json(nest(200)) == nest(200)
    with pytest.raises(InvalidJSON, match="nested more than 200 levels deep"):
        ensure_json(nest(201))


def _shares_containers(a: object, b: object) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a is b or any(_shares_containers(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return a is b or any(_shares_containers(x, y) for x, y in zip(a, b, strict=True))
    return False


@given(json_values)
@HARDENING
def test_ensure_json_and_clone_json_copy_exactly(value: object) -> None:
    for copied in (ensure_json(value), clone_json(value)):
        assert canonical_json(copied) == canonical_json(value)
        assert not _shares_containers(copied, value)


@given(st.lists(json_values, min_size=1, max_size=4))
@HARDENING
def test_canonical_size_is_the_sum_of_the_texts(values: list[object]) -> None:
    expected = sum(len(canonical_text(value).encode("utf-8")) for value in values)
    assert canonical_size(*values) == expected


@HARDENING
def test_ensure_json_normalises_keys_and_refuses_others_at_depth() -> None:
    class Key(str):
        pass

    copied = ensure_json({"a": [{Key("k"): []}]})
    assert copied == {"a": [{"k": []}]}
    assert [type(key) for key in copied["a"][0]] == [str]
    with pytest.raises(InvalidJSON, match="non-string object key 1"):
        ensure_json({"a": [{"b": {}, 1: "x"}]})


@HARDENING
def test_canonical_json_distinguishes_numbers_and_bools() -> None:
    assert canonical_json({"b": 1, "a": [True]}) == '{"a":[true],"b":1}'
    assert canonical_json(1) != canonical_json(1.0)
    assert canonical_json(1) != canonical_json(True)


# -- RetryPolicy --------------------------------------------------------------------------------


@DESCRIPTOR
def test_retry_policy_constructors() -> None:
    assert RetryPolicy.none().delays_ms == ()
    assert RetryPolicy([1, 2]).delays_ms == (1, 2)
    assert RetryPolicy.fixed(250, 3).delays_ms == (250, 250, 250)
    assert RetryPolicy.exponential(100, 5, max_delay_ms=450).delays_ms == (100, 200, 400, 450, 450)
    assert RetryPolicy.exponential(1, 4).delays_ms == (1, 2, 4, 8)
    assert RetryPolicy.exponential(2**31, 3).delays_ms == (2**31, MAX_DELAY_MS, MAX_DELAY_MS)
    assert RetryPolicy([0, MAX_DELAY_MS]).delays_ms == (0, MAX_DELAY_MS)


@DESCRIPTOR
def test_retry_policy_refuses_invalid() -> None:
    with pytest.raises(ValueError, match="exceeds the maximum"):
        RetryPolicy.exponential(500, 3, max_delay_ms=450)
    with pytest.raises(ValueError, match="outside"):
        RetryPolicy([MAX_DELAY_MS + 1])
    with pytest.raises(ValueError, match="outside"):
        RetryPolicy([-1])
    with pytest.raises(TypeError):
        RetryPolicy([True])
    with pytest.raises(TypeError):
        RetryPolicy([1.0])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=">= 0"):
        RetryPolicy.fixed(1, -1)


@DESCRIPTOR
def test_next_delay() -> None:
    policy = RetryPolicy([10, 20])
    assert [policy.next_delay(n) for n in range(3)] == [10, 20, None]
    assert RetryPolicy.none().next_delay(0) is None


@DESCRIPTOR
def test_retry_policy_exact_json() -> None:
    assert RetryPolicy([5, 6]).to_json() == {"version": 1, "delaysMs": [5, 6]}
    assert RetryPolicy.from_json({"version": 1, "delaysMs": [5, 6]}) == RetryPolicy([5, 6])


@DESCRIPTOR
@settings(max_examples=60)
@given(policies)
def test_retry_policy_round_trip(policy: RetryPolicy) -> None:
    assert RetryPolicy.from_json(through_text(policy.to_json())) == policy


@DESCRIPTOR
@settings(max_examples=60)
@given(st.data())
def test_retry_policy_mutations_refused(data: st.DataObject) -> None:
    doc = data.draw(policies).to_json()
    check_refused(RetryPolicy.from_json, data.draw(mutated(doc, ())), CodecError)


# -- Work ---------------------------------------------------------------------------------------


@DESCRIPTOR
def test_work_tool_call_exact_json() -> None:
    work = Work.tool_call("task-1", "greet", {"name": "Ada"}, RetryPolicy([100]))
    assert work.to_json() == {
        "version": 2,
        "idempotencyKey": "task-1",
        "type": "tools/call",
        "input": {"name": "greet", "arguments": {"name": "Ada"}},
        "retryPolicy": {"version": 1, "delaysMs": [100]},
    }
    assert Work.tool_call("t", "n", {}).retry_policy == RetryPolicy.none()


@DESCRIPTOR
@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"idempotency_key": ""}, ValueError),
        ({"type": ""}, ValueError),
        ({"input": {"x": float("nan")}}, InvalidJSON),
        ({"input": ["not", "an", "object"]}, InvalidJSON),
        ({"input": {"x": object()}}, InvalidJSON),
        ({"retry_policy": [1, 2]}, TypeError),
        ({"tool": ""}, ValueError),
        ({"tool": 1}, ValueError),
        ({"origin": {"protocolVersion": "2026-07-28"}}, TypeError),
    ],
)
def test_work_refuses_invalid(changes: dict[str, Any], error: type[Exception]) -> None:
    fields: dict[str, Any] = {"idempotency_key": "k", "type": "t", "input": {}} | changes
    with pytest.raises(error):
        Work(**fields)


@DESCRIPTOR
def test_work_owns_its_input() -> None:
    arguments = {"items": [1, 2]}
    work = Work.tool_call("t", "n", arguments)
    arguments["items"].append(3)
    assert work.input == {"name": "n", "arguments": {"items": [1, 2]}}


@DESCRIPTOR
@settings(max_examples=60)
@given(works)
def test_work_round_trip(work: Work) -> None:
    assert Work.from_json(through_text(work.to_json())) == work


@DESCRIPTOR
@settings(max_examples=100)
@given(st.data())
def test_work_mutations_refused(data: st.DataObject) -> None:
    doc = data.draw(works).to_json()
    nested = ("retryPolicy", "traceContext", "origin")
    check_refused(Work.from_json, data.draw(mutated(doc, nested)), CodecError)


@DESCRIPTOR
@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"protocol_version": ""}, ValueError),
        ({"client_capabilities": None}, InvalidJSON),
        ({"client_capabilities": {"x": float("nan")}}, InvalidJSON),
        ({"client_info": ["not", "an", "object"]}, InvalidJSON),
    ],
)
def test_origin_refuses_invalid(changes: dict[str, Any], error: type[Exception]) -> None:
    fields: dict[str, Any] = {"protocol_version": "v", "client_capabilities": {}} | changes
    with pytest.raises(error):
        Origin(**fields)


@DESCRIPTOR
def test_origin_is_immutable_and_hands_out_copies() -> None:
    caps: dict[str, Any] = {"elicitation": {"form": {}}}
    origin = Origin(protocol_version="v", client_capabilities=caps, client_info={"name": "c"})
    caps["sampling"] = {}
    given = origin.client_capabilities
    given["roots"] = {}
    assert origin.client_capabilities == {"elicitation": {"form": {}}}
    assert origin.size() == len('{"elicitation":{"form":{}}}') + len('{"name":"c"}')


# -- Event --------------------------------------------------------------------------------------


@HARDENING
def test_event_exact_json() -> None:
    event = Event.input_requested("confirm", {"method": "elicitation/create"}, id="ev-1")
    assert event.to_json() == {
        "version": 1,
        "id": "ev-1",
        "kind": "input_requested",
        "data": {"key": "confirm", "request": {"method": "elicitation/create"}},
    }
    assert Event.cancelled(id="c").to_json() == {
        "version": 1,
        "id": "c",
        "kind": "cancelled",
        "data": {},
    }
    assert Event.completed({}, "positional-id").id == "positional-id"
    assert Event.retry_requested({"code": 1, "message": "m"}, None, id="r").data == {
        "error": {"code": 1, "message": "m"},
        "statusMessage": None,
    }


@HARDENING
def test_event_default_id_is_random_urlsafe() -> None:
    first, second = Event.cancelled(), Event.cancelled()
    assert len(first.id) == 24
    assert first.id != second.id
    assert set(first.id) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


@HARDENING
@pytest.mark.parametrize(
    "build",
    [
        lambda: Event.input_requested("", {"method": "m"}),
        lambda: Event.input_requested("k", {"method": ""}),
        lambda: Event.input_requested("k", {"params": {}}),
        lambda: Event.input_responses_accepted({"": {}}),
        lambda: Event.input_responses_accepted({"k": "not an object"}),  # type: ignore[dict-item]
        lambda: Event.retry_requested("oops", None),  # type: ignore[arg-type]
        lambda: Event.failed({"code": 1}, 5),  # type: ignore[arg-type]
        lambda: Event.completed({"x": float("nan")}),
        lambda: Event.completed({"x": {1, 2}}),
        lambda: Event.cancelled(id=""),
        lambda: Event("id", "unknown_kind", {}),
        lambda: Event("id", EventKind.CANCELLED, {"extra": 1}),
        lambda: Event("id", EventKind.COMPLETED, {}),
    ],
)
def test_event_validation(build: Callable[[], Event]) -> None:
    with pytest.raises(InvalidEvent):
        build()


@HARDENING
@settings(max_examples=100)
@given(events(names))
def test_event_round_trip(event: Event) -> None:
    assert Event.from_json(through_text(event.to_json())) == event


@HARDENING
@settings(max_examples=150)
@given(st.data())
def test_event_mutations_refused(data: st.DataObject) -> None:
    doc = data.draw(events()).to_json()
    check_refused(Event.from_json, data.draw(mutated(doc, EVENT_NESTED)), CodecError)


# -- Effects ------------------------------------------------------------------------------------


@HARDENING
def test_effects_exact_json() -> None:
    assert effects_to_json(Effects.none()) == {"version": 1, "kind": "none"}
    assert effects_to_json(Effects(accepted_input_responses={"k": {"a": 1}})) == {
        "version": 1,
        "kind": "acceptedInputResponses",
        "responses": {"k": {"a": 1}},
    }
    scheduled = RetryEffect(
        disposition="scheduled", retry_at=T0 + 60_001_000, delay_ms=60_000, retry_count=1
    )
    assert effects_to_json(Effects(retry=scheduled)) == {
        "version": 1,
        "kind": "retry",
        "retry": {
            "disposition": "scheduled",
            "retryAt": "2026-08-24T10:01:00.001Z",
            "delayMs": 60_000,
            "retryCount": 1,
        },
    }


@HARDENING
def test_effects_validation() -> None:
    with pytest.raises(ValueError, match="not both"):
        Effects(
            accepted_input_responses={},
            retry=RetryEffect(disposition="exhausted", retry_at=None, delay_ms=None, retry_count=0),
        )
    with pytest.raises(ValueError, match="needs retry_at"):
        RetryEffect(disposition="scheduled", retry_at=None, delay_ms=1, retry_count=1)
    with pytest.raises(ValueError, match="no retry_at"):
        RetryEffect(disposition="exhausted", retry_at=1, delay_ms=None, retry_count=1)


@HARDENING
@settings(max_examples=80)
@given(effects_values())
def test_effects_round_trip(effects: Effects) -> None:
    assert effects_from_json(through_text(effects_to_json(effects))) == effects


@HARDENING
@settings(max_examples=100)
@given(st.data())
def test_effects_mutations_refused(data: st.DataObject) -> None:
    doc = effects_to_json(data.draw(effects_values()))
    check_refused(effects_from_json, data.draw(mutated(doc, EFFECT_NESTED)), CodecError)


# -- aggregate record v3 ------------------------------------------------------------------------


def sample_snapshot() -> Snapshot:
    task = new_task("task-9", T0, 60_000, 5)
    work = Work.tool_call("task-9", "confirm_delete", {"path": "/tmp/x"}, RetryPolicy([1000]))
    snapshot = initial_snapshot(task, work)
    request = {"method": "elicitation/create", "params": {"message": "Confirm delete"}}
    steps = [
        Event.input_requested("confirmation", request, id="e1"),
        Event.input_requested("second", {"method": "elicitation/create"}, id="e2"),
        Event.input_responses_accepted({"confirmation": {"action": "accept"}}, id="e3"),
    ]
    for offset, event in enumerate(steps, start=1):
        snapshot = apply(snapshot, event, T0 + offset * 1000).snapshot
    return snapshot


@DESCRIPTOR
def test_snapshot_exact_json() -> None:
    doc = snapshot_to_json(sample_snapshot())
    assert doc == {
        "version": 3,
        "revision": 3,
        "task": {
            "id": "task-9",
            "status": "input_required",
            "statusMessage": "Task accepted",
            "createdAt": "2026-08-24T10:00:00.000Z",
            "lastUpdatedAt": "2026-08-24T10:00:00.003Z",
            "ttlMs": 60_000,
            "pollIntervalMs": 5,
            "inputRequests": {"second": {"method": "elicitation/create"}},
            "result": None,
            "error": None,
            "usedInputKeys": ["confirmation", "second"],
        },
        "work": {
            "version": 2,
            "idempotencyKey": "task-9",
            "type": "tools/call",
            "input": {"name": "confirm_delete", "arguments": {"path": "/tmp/x"}},
            "retryPolicy": {"version": 1, "delaysMs": [1000]},
        },
        "retryCount": 0,
        "retryAt": None,
        "lastFailure": None,
        "inputHistory": {
            "confirmation": {
                "method": "elicitation/create",
                "params": {"message": "Confirm delete"},
            },
            "second": {"method": "elicitation/create"},
        },
        "acceptedInputResponses": {"confirmation": {"action": "accept"}},
    }
    assert snapshot_from_json(doc) == sample_snapshot()


@DESCRIPTOR
@settings(max_examples=120)
@given(snapshots())
def test_snapshot_round_trip(snapshot: Snapshot) -> None:
    doc = through_text(snapshot_to_json(snapshot))
    # v3 (9 keys) unless the task has steps or a suspension: v4 adds "steps" and "suspended".
    uses_steps = bool(snapshot.steps) or snapshot.suspended_key is not None
    assert (doc["version"], len(doc)) == ((4, 11) if uses_steps else (3, 9))
    assert len(doc["task"]) == 11
    assert snapshot_from_json(doc) == snapshot


# What orjson cannot write (an integer beyond 64 bits, a lone surrogate) and what it writes
# differently from the standard library (exponents, non-ASCII text): stored_text falls back.
wide_scalars = (
    scalars
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.sampled_from([2**64, -(2**63) - 1, 1e16, -0.0, 5e-324, 1.7976931348623157e308])
    | st.text(alphabet=st.characters(blacklist_categories=()), max_size=4)
)
wide_json = st.recursive(
    wide_scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
wide_objects = st.dictionaries(st.text(max_size=5), wide_json, max_size=4)


@st.composite
def wide_snapshots(draw: st.DrawFn) -> Snapshot:
    """Reachable records with any work (versions 2 to 5) and any JSON in it and in the result."""
    snapshot = draw(snapshots())
    base = snapshot.work
    assert base is not None
    work = draw(works)
    work = attrs.evolve(
        work,
        idempotency_key=snapshot.task.id,
        input=draw(wide_objects),
        retry_policy=base.retry_policy,  # the retry count is within it
        origin=None
        if work.origin is None
        else Origin(
            protocol_version=work.origin.protocol_version,
            client_capabilities=draw(wide_objects),
            client_info=draw(st.none() | wide_objects),
        ),
    )
    snapshot = attrs.evolve(snapshot, work=work)
    if not snapshot.task.status.is_terminal and draw(st.booleans()):
        now = snapshot.task.last_updated_at + 1000
        snapshot = apply(snapshot, Event.completed(draw(wide_objects)), now).snapshot
    return snapshot


@DESCRIPTOR
@settings(max_examples=300)
@given(wide_snapshots())
def test_record_text_is_the_stored_text_of_the_record(snapshot: Snapshot) -> None:
    """The stores' encoding without copies (views sharing the snapshot's JSON) writes exactly
    the text of the copied document, which decodes to exactly the same value and snapshot."""
    copied = snapshot_to_json(snapshot)
    assert snapshot_json_view(snapshot) == copied
    assert snapshot.work is None or snapshot.work.json_view() == snapshot.work.to_json()
    text = record_text(snapshot)
    assert text == stored_text(copied)
    reference = json.dumps(copied, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    assert canonical_json(loads(text)) == canonical_json(json.loads(reference))
    assert snapshot_from_json(loads(text)) == snapshot


@given(events(names), wide_objects)
def test_event_json_view_is_its_json(event: Event, data: dict[str, Any]) -> None:
    assert event.json_view() == event.to_json()
    wide = Event.completed(data, id=event.id)
    assert stored_text(wide.json_view()) == stored_text(wide.to_json())


@DESCRIPTOR
@settings(max_examples=200)
@given(st.data())
def test_snapshot_mutations_refused(data: st.DataObject) -> None:
    doc = snapshot_to_json(data.draw(snapshots()))
    check_refused(snapshot_from_json, data.draw(mutated(doc, RECORD_NESTED)), CorruptRecord)


@st.composite
def broken_step_record(draw: st.DrawFn, doc: dict[str, Any]) -> dict[str, Any]:
    """One change to a recorded step of a v4 record that no event could have made: an extra,
    missing or mistyped key in a record, its outcome or its error, an empty or oversized
    fingerprint, an oversized key."""
    doc = copy.deepcopy(doc)
    steps = doc["steps"]
    key = draw(st.sampled_from(sorted(steps)))
    record = steps[key]
    targets: list[tuple[dict[str, Any], tuple[str, ...]]] = [(record, tuple(record))]
    outcome = record.get("outcome")
    if isinstance(outcome, dict):
        targets.append((outcome, ()))  # its one key's value may be any JSON, not missing
        if "error" in outcome:
            targets.append((outcome["error"], ("code", "message")))
    target, required = draw(st.sampled_from(targets))
    choices = ["extra", "long_key"]
    if required:
        choices += ["missing", "wrong_type"]
    if record["kind"] == "step":
        choices += ["empty_fingerprint", "long_fingerprint"]
    match draw(st.sampled_from(choices)):
        case "extra":
            extra = draw(st.text(max_size=6).filter(lambda k: k not in target))
            target[extra] = draw(json_values)
        case "missing":
            del target[draw(st.sampled_from(required))]
        case "wrong_type":
            target[draw(st.sampled_from(required))] = draw(st.sampled_from(WRONG_TYPES))
        case "empty_fingerprint":
            record["fingerprint"] = ""
        case "long_fingerprint":
            record["fingerprint"] = "f" * (MAX_FINGERPRINT_CHARS + 1)
        case _:
            steps["k" * (MAX_STEP_KEY_CHARS + 1)] = copy.deepcopy(record)
    return doc


@DESCRIPTOR
@settings(max_examples=200)
@given(st.data())
def test_step_record_mutations_refused(data: st.DataObject) -> None:
    """The decoder admits exactly the step records the event rules admit (so every recorded
    outcome replays): anything else in a v4 record is a CorruptRecord."""
    doc = snapshot_to_json(data.draw(snapshots().filter(lambda s: bool(s.steps))))
    check_refused(snapshot_from_json, data.draw(broken_step_record(doc)), CorruptRecord)


@DESCRIPTOR
@settings(max_examples=100)
@given(snapshots().filter(lambda s: bool(s.steps)))
def test_decoded_step_records_replay(snapshot: Snapshot) -> None:
    """Every step record a v4 record decodes to is one an event could have recorded."""
    for key, record in snapshot_from_json(through_text(snapshot_to_json(snapshot))).steps.items():
        if record["kind"] == "step":
            outcome = record["outcome"]
            if outcome is None:
                Event.step_started(key, record["fingerprint"])
            else:
                Event.step_recorded(key, record["fingerprint"], outcome)
        else:
            assert set(record) == {"kind", "wakeAt"}


@DESCRIPTOR
@settings(max_examples=60)
@given(st.data())
def test_decoders_only_raise_codec_errors(data: st.DataObject) -> None:
    """Arbitrary replacement values anywhere in a fixed-key object: decode or CodecError."""
    decoders: list[tuple[Callable[[Any], Any], dict[str, Any], tuple[str, ...]]] = [
        (snapshot_from_json, snapshot_to_json(data.draw(snapshots())), RECORD_NESTED),
        (Event.from_json, data.draw(events()).to_json(), EVENT_NESTED),
        (Work.from_json, data.draw(works).to_json(), ("retryPolicy",)),
        (effects_from_json, effects_to_json(data.draw(effects_values())), EFFECT_NESTED),
    ]
    for decode, doc, nested in decoders:
        path = data.draw(st.sampled_from(fixed_key_objects(doc, nested)))
        target = node_at(doc, path)
        if target:
            target[data.draw(st.sampled_from(sorted(target)))] = data.draw(json_values)
        with contextlib.suppress(CodecError):
            decode(doc)
    for decode in (snapshot_from_json, Event.from_json, Work.from_json, effects_from_json):
        with contextlib.suppress(CodecError):
            decode(data.draw(json_values))


def valid_doc() -> dict[str, Any]:
    return snapshot_to_json(sample_snapshot())


def retried_doc() -> dict[str, Any]:
    snapshot = sample_snapshot()
    failure = Event.retry_requested({"code": 1, "message": "busy"}, "again", id="r1")
    return snapshot_to_json(apply(snapshot, failure, T0 + 10_000).snapshot)


def edit(doc: dict[str, Any], change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    change(doc)
    return doc


@DESCRIPTOR
@pytest.mark.parametrize(
    ("doc", "reason"),
    [
        (edit(valid_doc(), lambda d: d.update(version=2)), "unsupported record version"),
        (edit(retried_doc(), lambda d: d.update(retryCount=2)), "exceeds the retry policy"),
        (edit(retried_doc(), lambda d: d.update(revision=0)), "exceeds the revision"),
        (edit(valid_doc(), lambda d: d.update(retryAt="2026-08-24T10:00:01.000Z")), "retryAt"),
        (edit(retried_doc(), lambda d: d.update(retryAt=None)), "needs a retryAt"),
        (
            edit(valid_doc(), lambda d: d.update(lastFailure={"error": {}, "statusMessage": None})),
            "zero-retry exhaustion",
        ),
        (edit(valid_doc(), lambda d: d["inputHistory"].pop("second")), "history keys"),
        (
            edit(valid_doc(), lambda d: d["task"]["inputRequests"].update(second={"method": "x"})),
            "differ from their history",
        ),
        (
            edit(valid_doc(), lambda d: d["acceptedInputResponses"].update(nope={})),
            "never requested",
        ),
        (
            edit(valid_doc(), lambda d: d["acceptedInputResponses"].update(second={})),
            "still outstanding",
        ),
        (edit(valid_doc(), lambda d: d["work"].update(idempotencyKey="other")), "idempotency key"),
        (
            edit(valid_doc(), lambda d: d["task"].update(usedInputKeys=["second", "confirmation"])),
            "sorted",
        ),
        (edit(valid_doc(), lambda d: d["task"].update(status="working")), "outstanding requests"),
        (
            edit(valid_doc(), lambda d: d["task"].update(lastUpdatedAt="2026-08-23T10:00:00.000Z")),
            "precedes",
        ),
        (edit(valid_doc(), lambda d: d["task"].update(ttlMs=0)), "ttlMs"),
        (edit(valid_doc(), lambda d: d["task"].update(id="x" * 257)), "1..256 bytes"),
    ],
)
def test_snapshot_invariants(doc: dict[str, Any], reason: str) -> None:
    with pytest.raises(CorruptRecord, match=reason):
        snapshot_from_json(doc)


@DESCRIPTOR
def test_initial_snapshot_requires_fresh_task() -> None:
    task = new_task("t", T0, None, None)
    work = Work.tool_call("t", "n", {})
    assert initial_snapshot(task, work) == Snapshot(task=task, work=work, revision=0)
    with pytest.raises(CorruptRecord, match="working"):
        initial_snapshot(attrs.evolve(task, status=TaskStatus.CANCELLED), work)
    with pytest.raises(CorruptRecord, match="never updated"):
        initial_snapshot(attrs.evolve(task, last_updated_at=T0 + 1), work)
    with pytest.raises(CorruptRecord, match="idempotency key"):
        initial_snapshot(task, Work.tool_call("other", "n", {}))


# -- wire projections ---------------------------------------------------------------------------


@HARDENING
def test_create_task_result_shape() -> None:
    task = new_task("task-17", T0, 60_000, 5)
    assert create_task_result(task) == {
        "resultType": "task",
        "taskId": "task-17",
        "status": "working",
        "statusMessage": "Task accepted",
        "createdAt": "2026-08-24T10:00:00.000Z",
        "lastUpdatedAt": "2026-08-24T10:00:00.000Z",
        "ttlMs": 60_000,
        "pollIntervalMs": 5,
    }
    bare = new_task("t", T0 + 1, None, None, status_message=None)
    assert task_wire_base(bare) == {
        "taskId": "t",
        "status": "working",
        "createdAt": "2026-08-24T10:00:00.000001Z",
        "lastUpdatedAt": "2026-08-24T10:00:00.000001Z",
        "ttlMs": None,
    }


@HARDENING
def test_detailed_task_payloads() -> None:
    base = new_task("t", T0, 1000, None)
    waiting = attrs.evolve(
        base,
        status=TaskStatus.INPUT_REQUIRED,
        input_requests={"k": {"method": "elicitation/create"}},
        used_input_keys={"k"},
    )
    assert detailed_task(waiting)["inputRequests"] == {"k": {"method": "elicitation/create"}}
    done = attrs.evolve(base, status=TaskStatus.COMPLETED, status_message=None, result={"c": []})
    assert detailed_task(done) == {
        "taskId": "t",
        "status": "completed",
        "createdAt": "2026-08-24T10:00:00.000Z",
        "lastUpdatedAt": "2026-08-24T10:00:00.000Z",
        "ttlMs": 1000,
        "result": {"c": []},
    }
    failed = attrs.evolve(base, status=TaskStatus.FAILED, error={"code": -32000, "message": "x"})
    assert detailed_task(failed)["error"] == {"code": -32000, "message": "x"}
    internal = {"code": -32603, "message": "Internal error"}
    assert detailed_task(attrs.evolve(failed, error=None))["error"] == internal
    assert detailed_task(attrs.evolve(failed, error={"message": "no code"}))["error"] == internal
    cancelled = attrs.evolve(
        base, status=TaskStatus.CANCELLED, status_message="Cancellation requested"
    )
    detail = detailed_task(cancelled)
    assert detail["statusMessage"] == "Cancellation requested"
    assert set(detail) == {
        "taskId",
        "status",
        "statusMessage",
        "createdAt",
        "lastUpdatedAt",
        "ttlMs",
    }


@HARDENING
@pytest.mark.parametrize(
    "changes",
    [
        {"id": ""},
        {"status": TaskStatus.INPUT_REQUIRED},
        {"status": TaskStatus.COMPLETED},
        {"result": {"x": 1}},
        {"error": {"code": 1, "message": "m"}},
        {"poll_interval_ms": 0},
        {"created_at": -1},
        {"input_requests": {"k": {"method": "m"}}},
    ],
)
def test_task_invariants(changes: dict[str, Any]) -> None:
    with pytest.raises(CorruptRecord):
        attrs.evolve(new_task("t", T0, None, None), **changes)


@HARDENING
def test_task_validates_json_payloads() -> None:
    with pytest.raises(InvalidJSON):
        Task(
            id="t",
            status=TaskStatus.COMPLETED,
            status_message=None,
            created_at=T0,
            last_updated_at=T0,
            ttl_ms=None,
            poll_interval_ms=None,
            result={"x": float("nan")},
        )
