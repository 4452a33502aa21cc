"""The pure reducer: exact transitions, and hypothesis-driven invariants over event sequences."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tritask.tasks._time import MAX_INSTANT, format_instant, parse_instant
from tritask.tasks.events import Effects, Event, EventKind, RetryEffect
from tritask.tasks.model import (
    Snapshot,
    TaskStatus,
    initial_snapshot,
    new_task,
    snapshot_from_json,
    snapshot_to_json,
)
from tritask.tasks.reducer import DuplicateInputKey, Outcome, StepKeyReused, apply
from tritask.tasks.work import RetryPolicy, Work

pytestmark = pytest.mark.contract("tasks-store-hardening")

T0 = 1_787_565_600_000_000  # 2026-08-24T10:00:00.000Z
ERROR = {"code": -32000, "message": "boom"}
ASK = {"method": "elicitation/create", "params": {"message": "Confirm?"}}


def fresh(policy: RetryPolicy | None = None, work: bool = True) -> Snapshot:
    task = new_task("task-1", T0, 60_000, 5)
    descriptor = Work.tool_call("task-1", "tool", {"x": 1}, policy)
    snapshot = initial_snapshot(task, descriptor)
    return snapshot if work else attrs.evolve(snapshot, work=None)


def run(snapshot: Snapshot, *events: Event, step: int = 1000) -> Outcome:
    at = snapshot.task.last_updated_at
    outcome = Outcome(kind="unchanged", snapshot=snapshot, effects=Effects.none())
    for event in events:
        at += step
        outcome = apply(outcome.snapshot, event, at)
    return outcome


def test_completed() -> None:
    outcome = apply(fresh(), Event.completed({"content": []}), T0 + 1000)
    assert outcome.kind == "applied"
    assert outcome.effects == Effects.none()
    task = outcome.snapshot.task
    assert (task.status, task.status_message, task.result) == (
        TaskStatus.COMPLETED,
        None,
        {"content": []},
    )
    assert (outcome.snapshot.revision, task.last_updated_at) == (1, T0 + 1000)


def test_failed_and_cancelled() -> None:
    failed = apply(fresh(), Event.failed(ERROR, "it broke"), T0 + 5).snapshot.task
    assert (failed.status, failed.status_message, failed.error) == (
        TaskStatus.FAILED,
        "it broke",
        ERROR,
    )
    cancelled = apply(fresh(), Event.cancelled(), T0 + 5).snapshot.task
    assert (cancelled.status, cancelled.status_message) == (
        TaskStatus.CANCELLED,
        "Cancellation requested",
    )


def test_input_request_and_partial_answers() -> None:
    outcome = run(
        fresh(),
        Event.input_requested("a", ASK),
        Event.input_requested("b", {"method": "sampling/createMessage"}),
    )
    snapshot = outcome.snapshot
    assert snapshot.task.status is TaskStatus.INPUT_REQUIRED
    assert snapshot.task.input_requests == {"a": ASK, "b": {"method": "sampling/createMessage"}}
    assert snapshot.task.used_input_keys == {"a", "b"}
    partial = apply(
        snapshot, Event.input_responses_accepted({"a": {"ok": 1}, "zzz": {}}), T0 + 10_000
    )
    assert partial.kind == "applied"
    assert partial.effects == Effects(accepted_input_responses={"a": {"ok": 1}})
    assert partial.snapshot.task.status is TaskStatus.INPUT_REQUIRED
    assert partial.snapshot.task.input_requests == {"b": {"method": "sampling/createMessage"}}
    assert partial.snapshot.accepted_input_responses == {"a": {"ok": 1}}
    done = apply(partial.snapshot, Event.input_responses_accepted({"b": {}}), T0 + 11_000)
    assert done.snapshot.task.status is TaskStatus.WORKING
    assert done.snapshot.task.input_requests == {}
    assert done.snapshot.accepted_input_responses == {"a": {"ok": 1}, "b": {}}
    assert done.snapshot.input_history == {"a": ASK, "b": {"method": "sampling/createMessage"}}
    assert done.snapshot.revision == 4


def test_unmatched_answers_are_unchanged() -> None:
    snapshot = run(fresh(), Event.input_requested("a", ASK)).snapshot
    cases: list[dict[str, dict[str, object]]] = [{}, {"nope": {}}]
    for responses in cases:
        outcome = apply(snapshot, Event.input_responses_accepted(responses), T0 + 9000)
        assert outcome.kind == "unchanged"
        assert outcome.snapshot is snapshot
        assert outcome.effects == Effects(accepted_input_responses={})


def test_input_keys_are_unique_for_life() -> None:
    answered = run(
        fresh(),
        Event.input_requested("a", ASK),
        Event.input_responses_accepted({"a": {}}),
    ).snapshot
    with pytest.raises(DuplicateInputKey) as caught:
        apply(answered, Event.input_requested("a", ASK), T0 + 10_000)
    assert caught.value.key == "a"
    outstanding = run(fresh(), Event.input_requested("a", ASK)).snapshot
    with pytest.raises(DuplicateInputKey):
        apply(outstanding, Event.input_requested("a", {"method": "other"}), T0 + 10_000)


def test_retry_scheduling_then_exhaustion() -> None:
    snapshot = fresh(RetryPolicy([60_000]))
    first = apply(snapshot, Event.retry_requested(ERROR, "retrying"), T0 + 1000)
    assert first.kind == "applied"
    assert first.effects == Effects(
        retry=RetryEffect(
            disposition="scheduled", retry_at=T0 + 60_001_000, delay_ms=60_000, retry_count=1
        )
    )
    state = first.snapshot
    assert (state.retry_count, state.retry_at, state.task.status) == (
        1,
        T0 + 60_001_000,
        TaskStatus.WORKING,
    )
    assert state.task.status_message == "Task accepted"
    assert state.last_failure == {"error": ERROR, "statusMessage": "retrying"}
    second = apply(state, Event.retry_requested({"code": 2, "message": "again"}, None), T0 + 2000)
    assert second.effects == Effects(
        retry=RetryEffect(disposition="exhausted", retry_at=None, delay_ms=None, retry_count=1)
    )
    final = second.snapshot
    assert (final.task.status, final.task.error, final.task.status_message) == (
        TaskStatus.FAILED,
        {"code": 2, "message": "again"},
        None,
    )
    assert (final.retry_count, final.retry_at, final.revision) == (1, None, 2)


def test_zero_retry_exhaustion_is_atomic() -> None:
    for snapshot in (fresh(), fresh(work=False)):
        outcome = apply(snapshot, Event.retry_requested(ERROR, "nope"), T0 + 1)
        assert outcome.effects.retry == RetryEffect(
            disposition="exhausted", retry_at=None, delay_ms=None, retry_count=0
        )
        assert outcome.snapshot.task.status is TaskStatus.FAILED
        assert outcome.snapshot.last_failure == {"error": ERROR, "statusMessage": "nope"}


def test_retry_keeps_input_required() -> None:
    waiting = run(fresh(RetryPolicy([0])), Event.input_requested("a", ASK)).snapshot
    outcome = apply(waiting, Event.retry_requested(ERROR, None), T0 + 5000)
    assert outcome.snapshot.task.status is TaskStatus.INPUT_REQUIRED
    assert outcome.snapshot.retry_at == T0 + 5000


def test_terminal_clears_inputs_and_retry_at() -> None:
    waiting = run(
        fresh(RetryPolicy([10])),
        Event.retry_requested(ERROR, None),
        Event.input_requested("a", ASK),
    ).snapshot
    assert waiting.retry_at == T0 + 1000 + 10_000
    for event in (Event.cancelled(), Event.completed({}), Event.failed(ERROR, None)):
        final = apply(waiting, event, T0 + 60_000).snapshot
        assert final.task.input_requests == {}
        assert final.retry_at is None
        assert final.retry_count == 1
        assert final.task.used_input_keys == {"a"}


def test_terminal_is_absorbing() -> None:
    done = run(fresh(), Event.completed({"v": 1})).snapshot
    for event in (
        Event.cancelled(),
        Event.failed(ERROR, None),
        Event.completed({"v": 2}),
        Event.retry_requested(ERROR, None),
        Event.input_requested("a", ASK),
    ):
        outcome = apply(done, event, T0 + 99_000)
        assert (outcome.kind, outcome.snapshot, outcome.effects) == (
            "unchanged",
            done,
            Effects.none(),
        )


def test_commit_time_must_advance() -> None:
    with pytest.raises(ValueError, match="committed_at"):
        apply(fresh(), Event.cancelled(), T0)


# -- hypothesis: random event sequences ---------------------------------------------------------

keys = st.sampled_from(["a", "b", "c"])
objects = st.dictionaries(st.text(max_size=3), st.integers() | st.text(max_size=3), max_size=2)
event_strategy = st.one_of(
    st.builds(lambda k, m: Event.input_requested(k, {"method": m}), keys, st.sampled_from("xy")),
    st.builds(Event.input_responses_accepted, st.dictionaries(keys, objects, max_size=3)),
    st.builds(Event.retry_requested, st.just(ERROR), st.none() | st.text(max_size=3)),
    st.builds(Event.completed, objects),
    st.builds(Event.failed, st.just(ERROR), st.none() | st.text(max_size=3)),
    st.builds(Event.cancelled),
)


def check_invariants(snapshot: Snapshot) -> None:
    task = snapshot.task
    assert set(snapshot.input_history) == task.used_input_keys
    assert set(task.input_requests) <= task.used_input_keys
    assert not set(snapshot.accepted_input_responses) & set(task.input_requests)
    assert (task.status is TaskStatus.INPUT_REQUIRED) == bool(task.input_requests)
    if task.status.is_terminal:
        assert snapshot.retry_at is None
        assert task.input_requests == {}
    assert snapshot_from_json(snapshot_to_json(snapshot)) == snapshot


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 5000), max_size=3),
    st.lists(st.tuples(event_strategy, st.integers(1, 10**7)), max_size=14),
)
def test_random_sequences(delays: list[int], steps: list[tuple[Event, int]]) -> None:
    policy = RetryPolicy(delays)
    snapshot = fresh(policy)
    used: set[str] = set()
    terminal_at: Snapshot | None = None
    for event, gap in steps:
        at = snapshot.task.last_updated_at + gap
        before = snapshot
        duplicate = (
            event.kind is EventKind.INPUT_REQUESTED
            and event.data["key"] in used
            and not before.task.status.is_terminal
        )
        if duplicate:
            with pytest.raises(DuplicateInputKey):
                apply(before, event, at)
            continue
        outcome = apply(before, event, at)
        snapshot = outcome.snapshot
        check_invariants(snapshot)
        if terminal_at is not None:
            assert outcome.kind == "unchanged"
            assert snapshot == terminal_at
        if outcome.kind == "applied":
            assert snapshot.revision == before.revision + 1
            assert snapshot.task.last_updated_at == at
        else:
            assert snapshot is before
        expect_model(before, event, outcome, at, policy)
        used = set(snapshot.task.used_input_keys)
        if snapshot.task.status.is_terminal and terminal_at is None:
            terminal_at = snapshot


def expect_model(
    before: Snapshot, event: Event, outcome: Outcome, at: int, policy: RetryPolicy
) -> None:
    """An independent statement of the rules of reference 2.5 / 3.5."""
    after = outcome.snapshot
    data: dict[str, Any] = event.data
    if event.kind is EventKind.INPUT_RESPONSES_ACCEPTED:
        matched = {k: v for k, v in data["responses"].items() if k in before.task.input_requests}
        assert outcome.effects == Effects(accepted_input_responses=matched)
        assert outcome.kind == ("applied" if matched else "unchanged")
        assert after.accepted_input_responses == {**before.accepted_input_responses, **matched}
        return
    if before.task.status.is_terminal:
        assert outcome.kind == "unchanged"
        return
    assert outcome.kind == "applied"
    if event.kind is EventKind.INPUT_REQUESTED:
        assert after.task.input_requests[data["key"]] == data["request"]
        assert after.task.status is TaskStatus.INPUT_REQUIRED
    elif event.kind is EventKind.RETRY_REQUESTED:
        delay = policy.next_delay(before.retry_count)
        if delay is None:
            assert after.task.status is TaskStatus.FAILED
            assert outcome.effects.retry is not None
            assert outcome.effects.retry.disposition == "exhausted"
            assert after.retry_count == before.retry_count
        else:
            assert after.task.status is before.task.status
            assert after.retry_at == at + delay * 1000
            assert after.retry_count == before.retry_count + 1
    else:
        expected = {
            EventKind.COMPLETED: TaskStatus.COMPLETED,
            EventKind.FAILED: TaskStatus.FAILED,
            EventKind.CANCELLED: TaskStatus.CANCELLED,
        }[event.kind]
        assert after.task.status is expected


# -- hypothesis: step, sleep and suspension events ----------------------------------------------

step_keys = st.sampled_from(["a", "s", "t"])
fingerprints = st.sampled_from(["fp1", "fp2"])
step_outcomes = st.one_of(
    objects.map(lambda v: {"result": v}),
    st.just({"error": {"code": -32001, "message": "declined"}}),
)
step_event_strategy = st.one_of(
    event_strategy,
    st.builds(Event.input_requested, step_keys, st.just(ASK)),
    st.builds(Event.input_requested, step_keys, st.just(ASK)),
    st.builds(Event.step_started, step_keys, fingerprints),
    st.builds(Event.step_recorded, step_keys, fingerprints, step_outcomes),
    st.builds(
        Event.input_responses_accepted, st.dictionaries(step_keys, objects, min_size=1, max_size=2)
    ),
    st.builds(Event.sleep_scheduled, step_keys, st.integers(0, 10_000)),
    st.builds(Event.sleep_scheduled, step_keys, st.integers(3_000, 10_000)),
    st.builds(Event.suspended, step_keys | keys),
    st.builds(Event.suspended, step_keys),
    st.builds(Event.suspended, step_keys),
)
gaps = st.integers(1, 1_000_000) | st.integers(1, 10**7)


def expect_step_model(before: Snapshot, event: Event, at: int) -> Snapshot | type[Exception]:
    """An independent statement of the step rules: the next snapshot's steps and suspension
    (as ``(steps, suspended_key, suspended_until)`` on the returned snapshot's fields), the
    exception the event must raise, or ``before`` itself when nothing changes."""
    data: dict[str, Any] = event.data
    if before.task.status.is_terminal:
        return before
    key = str(data.get("key", ""))
    steps = before.steps
    inputs = before.task.used_input_keys
    if event.kind is EventKind.INPUT_REQUESTED and (key in steps or key in inputs):
        return DuplicateInputKey
    if event.kind is EventKind.STEP_STARTED:
        if key in steps or key in inputs:
            return StepKeyReused
        record: dict[str, Any] = {"kind": "step", "fingerprint": data["fingerprint"]}
        return attrs.evolve(before, steps={**steps, key: {**record, "outcome": None}})
    if event.kind is EventKind.STEP_RECORDED:
        existing = steps.get(key)
        if key in inputs or (
            existing is not None
            and (existing.get("outcome") is not None or existing != {
                "kind": "step", "fingerprint": data["fingerprint"], "outcome": None
            })
        ):  # fmt: skip
            return StepKeyReused
        record = {"kind": "step", "fingerprint": data["fingerprint"], "outcome": data["outcome"]}
        return attrs.evolve(before, steps={**steps, key: record})
    if event.kind is EventKind.SLEEP_SCHEDULED:
        if key in steps or key in inputs:
            return StepKeyReused
        wake = format_instant(at + data["delayMs"] * 1000)
        return attrs.evolve(before, steps={**steps, key: {"kind": "sleep", "wakeAt": wake}})
    if event.kind is EventKind.SUSPENDED:
        until = before.suspended_until
        if before.suspended_key is not None and (until is None or until > at):
            return before
        record_ = steps.get(key)
        if record_ is not None:
            if record_["kind"] != "sleep" or parse_instant(record_["wakeAt"]) <= at:
                return before
            wake_at = parse_instant(record_["wakeAt"])
            return attrs.evolve(before, suspended_key=key, suspended_until=wake_at)
        if key in before.task.input_requests:
            return attrs.evolve(before, suspended_key=key, suspended_until=None)
        return before
    return before  # other kinds: checked by test_random_sequences


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(step_event_strategy, gaps), max_size=16))
def test_random_step_sequences(steps: list[tuple[Event, int]]) -> None:
    """Step events follow their model; the reducer never changes its input (pure), raises
    only its own key errors, keeps every record invariant and the v4 round trip, clears a
    suspension on a terminal event or an answer, and claims are gated by available_at."""
    snapshot = fresh(RetryPolicy([1000, 1000]))
    for event, gap in steps:
        at = snapshot.task.last_updated_at + gap
        before = snapshot
        text = snapshot_to_json(before)
        expected = expect_step_model(before, event, at)
        if isinstance(expected, type):
            with pytest.raises(expected):
                apply(before, event, at)
            assert snapshot_to_json(before) == text
            continue
        outcome = apply(before, event, at)
        assert snapshot_to_json(before) == text  # the input snapshot is untouched
        snapshot = outcome.snapshot
        check_invariants(snapshot)
        if event.kind in _STEP_EVENT_KINDS:
            if expected is before:
                assert outcome.kind == "unchanged" and snapshot is before
            else:
                assert outcome.kind == "applied"
                assert (snapshot.steps, snapshot.suspended_key, snapshot.suspended_until) == (
                    expected.steps,
                    expected.suspended_key,
                    expected.suspended_until,
                )
                assert snapshot.task.status is before.task.status
                assert snapshot.retry_count == before.retry_count
        else:
            assert snapshot.steps == before.steps  # only step events record steps
        if snapshot.task.status.is_terminal:
            assert snapshot.suspended_key is None and snapshot.available_at is None
        elif snapshot.suspended_key is not None:  # claimable only from its end (input: never)
            end = MAX_INSTANT if snapshot.suspended_until is None else snapshot.suspended_until
            assert snapshot.available_at == max(end, snapshot.retry_at or 0)
        if (
            event.kind is EventKind.INPUT_RESPONSES_ACCEPTED
            and outcome.effects.accepted_input_responses
            and before.suspended_until is None
        ):
            assert snapshot.suspended_key is None  # an answer wakes an input suspension


_STEP_EVENT_KINDS = frozenset(
    {
        EventKind.STEP_STARTED,
        EventKind.STEP_RECORDED,
        EventKind.SLEEP_SCHEDULED,
        EventKind.SUSPENDED,
    }
)
