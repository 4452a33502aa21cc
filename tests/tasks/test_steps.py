"""Durable steps on the memory store under MockClock: recording and replay across attempts,
duplicate keys, fingerprints, at_most_once, caps, StepFailed, in-attempt retries and timeouts,
misuse, cancellation, durable sleep and suspension (for a sleep and for input)."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import pytest
import trio
import trio.testing
from helpers import (
    ANONYMOUS,
    START_US,
    HookedStore,
    ScriptedExecutor,
    create_raw,
    raw_snapshot,
    start_env,
    wait_stops,
)

from tritask.server.context import Context
from tritask.server.mrtr import elicitation
from tritask.tasks import TrioClock, format_instant
from tritask.tasks import instrumentation as ins
from tritask.tasks.events import MAX_STEP_OUTCOME_BYTES, Event
from tritask.tasks.executor import Completed, ExecutionToken, Retry
from tritask.tasks.instrumentation import RecordingInstrumentation
from tritask.tasks.memory import MemoryStore
from tritask.tasks.model import Snapshot, TaskStatus
from tritask.tasks.runner import Runner
from tritask.tasks.steps import (
    DuplicateStepKey,
    StepFailed,
    StepInterrupted,
    StepMisuse,
    step_fingerprint,
)
from tritask.tasks.store import Action, Store
from tritask.tasks.work import RetryPolicy, Work

DONE = {"content": [], "isError": False}
ERROR = {"code": -32000, "message": "again"}


def done(value: Any) -> Completed:
    return Completed({"content": [], "isError": False, "structuredContent": {"value": value}})


def make_runner(store: Store, script: Any, **options: Any) -> tuple[Runner, Any]:
    events = RecordingInstrumentation()
    executor = ScriptedExecutor(script)
    runner = Runner(
        store, executor=executor, instrumentation=events, reap_interval_ms=None, **options
    )
    return runner, events


def retry_work(task_id: str, delays: list[int]) -> Work:
    return Work(
        idempotency_key=task_id,
        type="job",
        input={"taskId": task_id},
        retry_policy=RetryPolicy(delays),
    )


async def final(store: MemoryStore, task_id: str, interval: float = 0.01) -> Snapshot:
    for _ in range(100_000):
        snapshot = await raw_snapshot(store, task_id)
        assert isinstance(snapshot, Snapshot)
        if snapshot.task.status.is_terminal:
            return snapshot
        await trio.sleep(interval)
    raise AssertionError("the task never finished")


def kinds(store: MemoryStore, task_id: str) -> list[str]:
    return [entry.event.kind.value for entry in store.history(task_id)]


async def test_a_step_is_recorded_once_and_replayed_by_every_later_attempt(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore(scope="shared", clock=TrioClock(START_US))
    runs: list[str] = []

    async def charge(amount: int, *, currency: str) -> dict[str, Any]:
        runs.append(f"charge {amount} {currency}")
        await trio.sleep(1)
        return {"charged": amount, "currency": currency}

    async def script(work: Work, token: ExecutionToken) -> Any:
        first = await token.step("charge", charge, 12, currency="EUR")
        second = await token.step("note", charge, 1, currency="USD")
        if token.generation < 3:
            return Retry(ERROR, "again")
        return done([first, second, token.step_key("charge")])

    runner, _ = make_runner(store, script)
    async with runner:
        await create_raw(store, runner, "t1", work=retry_work("t1", [100, 100]))
        snapshot = await final(store, "t1")
    assert runs == ["charge 12 EUR", "charge 1 USD"]  # each body ran once in three attempts
    assert snapshot.task.result is not None
    assert snapshot.task.result["structuredContent"] == {
        "value": [
            {"charged": 12, "currency": "EUR"},
            {"charged": 1, "currency": "USD"},
            "t1/charge",
        ]
    }
    assert snapshot.retry_count == 2
    assert snapshot.steps == {
        "charge": {
            "kind": "step",
            "fingerprint": step_fingerprint("charge", [12], {"currency": "EUR"}),
            "outcome": {"result": {"charged": 12, "currency": "EUR"}},
        },
        "note": {
            "kind": "step",
            "fingerprint": step_fingerprint("note", [1], {"currency": "USD"}),
            "outcome": {"result": {"charged": 1, "currency": "USD"}},
        },
    }
    assert kinds(store, "t1") == [
        "step_recorded",
        "step_recorded",
        "retry_requested",
        "retry_requested",
        "completed",
    ]


async def test_a_recovered_attempt_reruns_only_the_step_in_flight(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Runner 1 stops (as if killed) in the middle of step b; runner 2 recovers the task: a's
    body never runs again, b's runs once more, c's once."""
    store = MemoryStore(scope="shared", clock=TrioClock(START_US))
    runs: list[str] = []
    in_b = trio.Event()

    async def body(name: str) -> str:
        runs.append(name)
        if name == "b" and len(runs) == 2:
            in_b.set()
            await trio.sleep_forever()
        return name.upper()

    async def script(work: Work, token: ExecutionToken) -> Any:
        values = [await token.step(name, body, name) for name in ("a", "b", "c")]
        return done(values)

    first, _ = make_runner(store, script, lease_ms=3_000)
    async with first:
        await create_raw(store, first, "t1")
        await in_b.wait()
    second, _ = make_runner(store, script, recover=True, lease_ms=3_000)
    async with second:
        snapshot = await final(store, "t1")
    assert runs == ["a", "b", "b", "c"]
    assert snapshot.task.result is not None
    assert snapshot.task.result["structuredContent"] == {"value": ["A", "B", "C"]}
    assert kinds(store, "t1") == ["step_recorded"] * 3 + ["completed"]


async def test_duplicate_keys_in_one_attempt_fail_the_task(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore(scope="shared", clock=TrioClock(START_US))

    async def one() -> int:
        return 1

    async def script(work: Work, token: ExecutionToken) -> Any:
        await token.step("same", one)
        with pytest.raises(DuplicateStepKey):
            await token.step("same", one)
        with pytest.raises(DuplicateStepKey):
            await token.sleep("same", 1)
        async with trio.open_nursery() as nursery:  # in parallel too
            nursery.start_soon(token.step, "p", one)
            nursery.start_soon(token.step, "q", one)
        with pytest.raises(DuplicateStepKey):
            await token.step("q", one)
        return await token.step("same", one)  # raises: fails the task

    runner, _ = make_runner(store, script)
    async with runner:
        await create_raw(store, runner, "t1")
        snapshot = await final(store, "t1")
    assert snapshot.task.status is TaskStatus.FAILED
    assert snapshot.task.error == {
        "code": -32603,
        "message": "step key 'same' is used twice in one attempt of this task",
    }
    assert sorted(snapshot.steps) == ["p", "q", "same"]


async def test_an_input_key_is_refused_as_a_step_or_sleep_key_before_any_body_runs(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A key already used by an input (answered in this attempt, or in an earlier one) is
    refused by ctx.step and ctx.sleep at once: the step's body never runs."""
    store = MemoryStore(scope="shared", clock=TrioClock(START_US))
    runs: list[str] = []

    async def charge() -> int:
        runs.append("charge")
        return 1

    async def script(work: Work, token: ExecutionToken) -> Any:
        await token.await_input("a", {"method": "elicitation/create"})
        if token.generation == 1:
            with pytest.raises(DuplicateStepKey):
                await token.step("a", charge)
            with pytest.raises(DuplicateStepKey):
                await token.sleep("a", 1)
            return Retry(ERROR, "again")
        return await token.step("a", charge)  # replayed input first, then the step: refused

    runner, _ = make_runner(store, script)
    async with runner:
        await create_raw(store, runner, "t1", work=retry_work("t1", [100]))
        await trio.sleep(1)
        access = await store.authorize(ANONYMOUS, Action.UPDATE, "t1")
        await runner.update("t1", {"a": {"action": "accept"}}, access)
        snapshot = await final(store, "t1")
    assert runs == []
    assert snapshot.task.error == {
        "code": -32603,
        "message": "step key 'a' is used twice in one attempt of this task",
    }
    assert snapshot.steps == {}
    assert snapshot.retry_count == 1


async def test_a_changed_fingerprint_fails_the_task_naming_the_key(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore(scope="shared", clock=TrioClock(START_US))
    runs: list[int] = []

    async def load(order: int) -> int:
        runs.append(order)
        return order * 2

    async def script(work: Work, token: ExecutionToken) -> Any:
        await token.step("load", load, token.generation)  # other arguments on the replay
        return Retry(ERROR, "again")

    runner, _ = make_runner(store, script)
    async with runner:
        await create_raw(store, runner, "t1", work=retry_work("t1", [100, 100]))
        snapshot = await final(store, "t1")
    recorded = step_fingerprint("load", [1], {})
    given = step_fingerprint("load", [2], {})
    assert runs == [1]
    assert snapshot.task.status is TaskStatus.FAILED
    assert snapshot.task.error == {
        "code": -32603,
        "message": f"step 'load' was recorded with fingerprint {recorded} but is replayed with "
        f"{given}: the task's code or arguments changed (pass fingerprint= to pin it)",
    }
    assert snapshot.retry_count == 1


async def test_an_explicit_fingerprint_replays_despite_other_arguments(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore(scope="shared", clock=TrioClock(START_US))
    runs: list[object] = []

    async def load(handle: object) -> str:
        runs.append(handle)
        return "loaded"

    async def script(work: Work, token: ExecutionToken) -> Any:
        value = await token.step("load", load, object(), fingerprint="order-7")
        if token.generation == 1:
            return Retry(ERROR, "again")
        return done(value)

    runner, _ = make_runner(store, script)
    async with runner:
        await create_raw(store, runner, "t1", work=retry_work("t1", [100]))
        snapshot = await final(store, "t1")
    assert len(runs) == 1
    assert snapshot.task.result is not None
    assert snapshot.task.result["structuredContent"] == {"value": "loaded"}
    assert snapshot.steps["load"]["fingerprint"] == "order-7"


async def test_arguments_that_are_not_json_need_a_fingerprint(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore(scope="shared", clock=TrioClock(START_US))

    async def load(handle: object) -> str:
        raise AssertionError("never runs")

    async def script(work: Work, token: ExecutionToken) -> Any:
        with pytest.raises(TypeError, match="pass fingerprint= to name them"):
            await token.step("load", load, object())
        return done("ok")

    runner, _ = make_runner(store, script)
    async with runner:
        await create_raw(store, runner, "t1")
        snapshot = await final(store, "t1")
    assert snapshot.task.status is TaskStatus.COMPLETED
    assert snapshot.steps == {}


async def test_step_failed_is_recorded_and_raised_again_identically(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore(scope="shared", clock=TrioClock(START_US))
    runs: list[int] = []
    caught: list[tuple[int, str, Any, str | None]] = []

    async def refund() -> None:
        runs.append(1)
        raise StepFailed("card declined", code=-32001, data={"decline": "insufficient_funds"})

    async def script(work: Work, token: ExecutionToken) -> Any:
        try:
            await token.step("refund", refund)
        except StepFailed as failed:
            caught.append((failed.code, failed.message, failed.data, failed.key))
        if token.generation == 1:
            return Retry(ERROR, "again")
        return await token.step("refund-again", refund)  # uncaught: fails the task with it

    runner, _ = make_runner(store, script)
    async with runner:
        await create_raw(store, runner, "t1", work=retry_work("t1", [100]))
        snapshot = await final(store, "t1")
    error = {"code": -32001, "message": "card declined", "data": {"decline": "insufficient_funds"}}
    assert caught == [(-32001, "card declined", {"decline": "insufficient_funds"}, "refund")] * 2
    assert runs == [1, 1]  # refund once, refund-again once
    assert snapshot.steps["refund"]["outcome"] == {"error": error}
    assert snapshot.task.status is TaskStatus.FAILED
    assert snapshot.task.error == error


async def test_a_step_failed_in_an_executors_nursery_fails_the_task_with_its_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Steps a WorkExecutor runs side by side: the group trio raises, holding only the step's
    StepFailed, fails the task with that step's error (as it does for a tool), not as an
    executor crash; a group holding anything else is still an executor failure."""
    store = MemoryStore(scope="shared", clock=TrioClock(START_US))

    async def declined() -> None:
        raise StepFailed("card declined", code=-32001)

    async def fine() -> int:
        return 1

    async def crash() -> None:
        raise RuntimeError("boom")

    async def script(work: Work, token: ExecutionToken) -> Any:
        second = crash if token.task_id == "t2" else fine
        async with trio.open_nursery() as nursery:
            nursery.start_soon(token.step, "charge", declined)
            nursery.start_soon(token.step, "other", second)
        return done("never")

    runner, _ = make_runner(store, script)
    async with runner:
        await create_raw(store, runner, "t1")
        await create_raw(store, runner, "t2")
        failed = await final(store, "t1")
        crashed = await final(store, "t2")
    assert failed.task.status is TaskStatus.FAILED
    assert failed.task.error == {"code": -32001, "message": "card declined"}
    assert crashed.task.status is TaskStatus.FAILED
    assert crashed.task.error is not None
    assert crashed.task.error["message"] == "Durable task executor failed"


async def test_at_most_once_commits_a_marker_and_an_interrupted_step_is_reported(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore(scope="shared", clock=TrioClock(START_US))
    runs: list[int] = []
    entered = trio.Event()
    seen: list[str] = []

    async def charge() -> str:
        runs.append(1)
        entered.set()
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def script(work: Work, token: ExecutionToken) -> Any:
        try:
            await token.step("charge", charge, semantics="at_most_once")
        except StepInterrupted as interrupted:
            seen.append(str(interrupted))
            return done("reconciled")
        raise AssertionError("unreachable")

    first, _ = make_runner(store, script, lease_ms=3_000)
    async with first:
        await create_raw(store, first, "t1")
        await entered.wait()
        snapshot = await raw_snapshot(store, "t1")
        assert isinstance(snapshot, Snapshot)
        assert snapshot.steps == {
            "charge": {
                "kind": "step",
                "fingerprint": step_fingerprint("charge", [], {}),
                "outcome": None,
            }
        }
    second, _ = make_runner(store, script, recover=True, lease_ms=3_000)
    async with second:
        snapshot = await final(store, "t1")
    assert runs == [1]  # the body never ran again
    assert seen == [
        "step 'charge' (at_most_once) started in an earlier attempt that ended before "
        "recording its outcome; its effect is unknown"
    ]
    assert snapshot.task.result is not None
    assert snapshot.task.result["structuredContent"] == {"value": "reconciled"}
    assert kinds(store, "t1") == ["step_started", "completed"]


async def test_an_oversized_or_non_json_outcome_fails_fast_without_a_retry(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore(scope="shared", clock=TrioClock(START_US))
    runs: list[str] = []

    async def big() -> str:
        runs.append("big")
        return "x" * MAX_STEP_OUTCOME_BYTES

    async def odd() -> object:
        runs.append("odd")
        return {1, 2}

    async def script(work: Work, token: ExecutionToken) -> Any:
        name = work.input["taskId"]
        await token.step("out", big if name == "big" else odd)
        return done("never")

    runner, _ = make_runner(store, script)
    async with runner:
        for name in ("big", "odd"):
            await create_raw(
                store,
                runner,
                name,
                work=attrs_evolve_input(retry_work(name, [100, 100]), name),
            )
        big_task, odd_task = await final(store, "big"), await final(store, "odd")
    assert runs == ["big", "odd"]
    size = MAX_STEP_OUTCOME_BYTES + len('{"result":""}')
    assert big_task.task.error == {
        "code": -32603,
        "message": f"step 'out': its result is {size} bytes of JSON; a step outcome is limited "
        f"to {MAX_STEP_OUTCOME_BYTES} (store large data elsewhere, record its key)",
    }
    assert odd_task.task.error == {
        "code": -32603,
        "message": "step 'out': its result is not JSON (the result of step 'out' contains a "
        "non-JSON set)",
    }
    for snapshot in (big_task, odd_task):
        assert snapshot.retry_count == 0
        assert snapshot.steps == {}
        assert kinds(store, snapshot.task.id) == ["failed"]


async def test_an_oversized_step_failed_fails_fast_without_a_retry(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A StepFailed whose recorded error would pass the outcome limit is refused like an
    oversized result: StepTooLarge names the key, nothing is recorded, no retry is used."""
    store = MemoryStore(scope="shared", clock=TrioClock(START_US))
    runs: list[str] = []

    async def declined() -> None:
        runs.append("declined")
        raise StepFailed("card declined", data="x" * MAX_STEP_OUTCOME_BYTES)

    async def script(work: Work, token: ExecutionToken) -> Any:
        await token.step("charge", declined)
        return done("never")

    runner, _ = make_runner(store, script)
    async with runner:
        await create_raw(store, runner, "t1", work=retry_work("t1", [100, 100]))
        snapshot = await final(store, "t1")
    assert runs == ["declined"]
    size = MAX_STEP_OUTCOME_BYTES + len(
        '{"error":{"code":-32603,"message":"card declined","data":""}}'
    )
    assert snapshot.task.error == {
        "code": -32603,
        "message": f"step 'charge': its error is {size} bytes of JSON; a step outcome is "
        f"limited to {MAX_STEP_OUTCOME_BYTES} (store large data elsewhere, record its key)",
    }
    assert snapshot.retry_count == 0
    assert snapshot.steps == {}
    assert kinds(store, "t1") == ["failed"]


def attrs_evolve_input(work: Work, name: str) -> Work:
    return Work(
        idempotency_key=name,
        type="job",
        input={"taskId": name},
        retry_policy=work.retry_policy,
    )


async def test_in_attempt_retries_and_timeouts(autojump_clock: trio.testing.MockClock) -> None:
    store = MemoryStore(scope="shared", clock=TrioClock(START_US))
    tries: list[float] = []

    async def flaky() -> str:
        tries.append(trio.current_time())
        if len(tries) == 1:
            await trio.sleep(10)  # times out after 2 s
        if len(tries) == 2:
            raise ConnectionError("reset")
        return "third time"

    async def script(work: Work, token: ExecutionToken) -> Any:
        value = await token.step("call", flaky, timeout_s=2, retry=[100, 300])
        with contextlib.suppress(trio.TooSlowError):
            await token.step("never", flaky, timeout_s=1, retry=[])
        return done(value)

    runner, _ = make_runner(store, script)
    start = trio.current_time()
    async with runner:
        await create_raw(store, runner, "t1")
        snapshot = await final(store, "t1")
    offsets = [round(t - start, 3) for t in tries[:3]]
    assert offsets == [0.0, 2.1, 2.4]
    assert snapshot.task.result is not None
    assert snapshot.task.result["structuredContent"] == {"value": "third time"}
    assert sorted(snapshot.steps) == ["call", "never"]  # the fourth try returned at once


async def test_context_calls_inside_a_step_body_are_refused(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore(scope="shared", clock=TrioClock(START_US))
    refused: list[str] = []

    async def script(work: Work, token: ExecutionToken) -> Any:
        async def outer() -> str:
            async def inner() -> str:
                return "inner"

            for call in (
                functools.partial(token.step, "inner", inner),
                functools.partial(token.sleep, "nap", 1),
                functools.partial(token.await_input, "ask", {"method": "elicitation/create"}),
            ):
                try:
                    await call()
                except StepMisuse as misuse:
                    refused.append(str(misuse).split(":")[0])
            return "outer"

        return done(await token.step("outer", outer))

    runner, _ = make_runner(store, script)
    async with runner:
        await create_raw(store, runner, "t1")
        snapshot = await final(store, "t1")
    assert refused == [
        "ctx.step inside the body of step 'outer'",
        "ctx.sleep inside the body of step 'outer'",
        "await_input inside the body of step 'outer'",
    ]
    assert snapshot.task.status is TaskStatus.COMPLETED
    assert sorted(snapshot.steps) == ["outer"]


async def test_cancel_is_committed_first_then_the_running_step_is_cancelled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore(scope="shared", clock=TrioClock(START_US))
    entered = trio.Event()
    exits: list[str] = []

    async def slow() -> str:
        entered.set()
        try:
            await trio.sleep_forever()
        finally:
            snapshot = await_nothing()
            exits.append(snapshot)
        raise AssertionError("unreachable")

    def await_nothing() -> str:
        return "cancelled"

    async def script(work: Work, token: ExecutionToken) -> Any:
        await token.step("slow", slow)
        return done("never")

    runner, events = make_runner(store, script)
    async with runner:
        await create_raw(store, runner, "t1")
        await entered.wait()
        access = await store.authorize(ANONYMOUS, Action.CANCEL, "t1")
        result = await runner.cancel("t1", access)
        assert isinstance(result, Snapshot)
    assert exits == ["cancelled"]
    assert result.task.status is TaskStatus.CANCELLED
    assert kinds(store, "t1") == ["cancelled"]
    assert result.steps == {}
    assert [md["outcome"] for _, md in events.named(ins.JOB_STOP)] == ["cancelled"]


async def test_a_late_step_commit_on_a_terminal_task_is_refused(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore(scope="shared", clock=TrioClock(START_US))
    claimed = await create_lease(store, "t1")
    access = await store.authorize(ANONYMOUS, Action.CANCEL, "t1")
    from tritask.tasks.store import RequestAuthority, Transition, WorkerAuthority

    cancelled = await store.transition("t1", 0, Event.cancelled(), RequestAuthority(access))
    assert isinstance(cancelled, Transition)
    late = Event.step_recorded("a", "fp", {"result": 1})
    refused = await store.transition("t1", 1, late, WorkerAuthority(claimed))
    assert isinstance(refused, Transition)
    assert refused.outcome == "unchanged"
    assert refused.snapshot.steps == {}
    assert kinds(store, "t1") == ["cancelled"]


async def create_lease(store: MemoryStore, task_id: str) -> Any:
    from tritask.tasks.model import new_task
    from tritask.tasks.store import Claimed

    access = await store.authorize(ANONYMOUS, Action.CREATE, task_id)
    work = Work(idempotency_key=task_id, type="job", input={})
    await store.create(new_task(task_id, await store.now(), None, None), work, access)
    result = await store.claim(task_id, "owner", 30_000)
    assert isinstance(result, Claimed)
    return result.lease


# -- durable sleep and suspension ---------------------------------------------------------------


async def test_a_short_sleep_stays_in_the_attempt_and_replays_what_is_left(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore(scope="shared", clock=TrioClock(START_US))
    woke: list[float] = []

    async def script(work: Work, token: ExecutionToken) -> Any:
        await token.sleep("nap", 3)
        woke.append(trio.current_time())
        if token.generation == 1:
            return Retry(ERROR, "again")
        return done("rested")

    runner, events = make_runner(store, script)
    start = trio.current_time()
    async with runner:
        await create_raw(store, runner, "t1", work=retry_work("t1", [100]))
        snapshot = await final(store, "t1")
    # The replay after the retry finds the sleep due and does not sleep again.
    assert [round(t - start, 3) for t in woke] == [3.001, 3.101]
    assert snapshot.steps == {
        "nap": {"kind": "sleep", "wakeAt": format_instant(START_US + 1000 + 3_000_000)}
    }
    assert kinds(store, "t1") == ["sleep_scheduled", "retry_requested", "completed"]
    assert [md["outcome"] for _, md in events.named(ins.JOB_STOP)] == ["retry", "completed"]


async def test_a_long_sleep_suspends_and_any_runner_resumes_it_at_the_wake_instant(
    autojump_clock: trio.testing.MockClock,
) -> None:
    clock = TrioClock(START_US)
    store = MemoryStore(scope="shared", clock=clock)
    runs: list[str] = []
    woke: list[int] = []

    async def load() -> str:
        runs.append("load")
        return "loaded"

    async def script(work: Work, token: ExecutionToken) -> Any:
        value = await token.step("load", load)
        await token.sleep("cooldown", 1800)
        woke.append(clock())
        return done(value)

    first, first_events = make_runner(store, script, suspend_sleep_after_ms=5_000)
    async with first:
        await create_raw(store, first, "t1")
        await wait_stops(first_events, "t1")
        assert first.active_task_ids() == []
        snapshot = await raw_snapshot(store, "t1")
        assert isinstance(snapshot, Snapshot)
        wake_at = START_US + 2000 + 1_800_000_000
        assert (snapshot.task.status, snapshot.retry_count) == (TaskStatus.WORKING, 0)
        assert (snapshot.suspended_key, snapshot.suspended_until) == ("cooldown", wake_at)
        assert snapshot.available_at == wake_at
    assert [md["outcome"] for _, md in first_events.named(ins.JOB_STOP)] == ["suspended"]
    # Nobody holds it: another runner (recovering) claims it exactly when it is due.
    second, second_events = make_runner(store, script, recover=True, recovery_interval_ms=500)
    async with second:
        snapshot = await final(store, "t1", interval=1.0)
    assert runs == ["load"]
    assert len(woke) == 1 and 0 <= woke[0] - wake_at <= 500_000
    assert snapshot.task.result is not None
    assert snapshot.retry_count == 0
    assert (snapshot.suspended_key, snapshot.suspended_until) == (None, None)
    assert kinds(store, "t1") == ["step_recorded", "sleep_scheduled", "suspended", "completed"]
    assert [md["source"] for _, md in second_events.named(ins.JOB_STOP)] == ["recovery"]


async def test_a_runner_without_recovery_resumes_its_own_suspended_sleep_exactly(
    autojump_clock: trio.testing.MockClock,
) -> None:
    clock = TrioClock(START_US)
    store = MemoryStore(scope="shared", clock=clock)
    woke: list[int] = []

    async def script(work: Work, token: ExecutionToken) -> Any:
        await token.sleep("cooldown", 60)
        woke.append(clock())
        return done("ok")

    runner, events = make_runner(store, script, suspend_sleep_after_ms=1_000)
    async with runner:
        await create_raw(store, runner, "t1")
        snapshot = await final(store, "t1")
    wake_at = START_US + 1000 + 60_000_000
    assert woke == [wake_at]
    assert snapshot.task.status is TaskStatus.COMPLETED
    assert [md["outcome"] for _, md in events.named(ins.JOB_STOP)] == ["suspended", "completed"]


async def test_waiting_for_input_suspends_and_an_answer_resumes_the_task(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env = await start_env(
        nursery,
        task_support={"refund": "optional"},
        runner_options={"suspend_input_after_ms": 10_000},
    )
    runs: list[str] = []

    async def load(order: str) -> dict[str, Any]:
        runs.append(f"load {order}")
        return {"order": order, "amount": 30}

    @env.app.tool(name="refund", description="Refund an order")
    async def refund(ctx: Context, order: str) -> str:
        invoice = await ctx.step("load", load, order)
        answer = await ctx.await_input(
            "confirm",
            elicitation("Refund?", {"type": "object", "properties": {"ok": {"type": "boolean"}}}),
        )
        return f"{invoice['order']} {invoice['amount']} {answer}"

    caps: dict[str, Any] = {"extensions": {"io.modelcontextprotocol/tasks": {}}, "elicitation": {}}
    task_id = await env.create("refund", {"order": "A-1"}, caps=caps)
    await env.wait_status(task_id, "input_required", caps=caps)
    await trio.sleep(10)
    await wait_stops(env.events, task_id)  # suspended after 10 s: no attempt holds it
    assert env.runner.active_task_ids() == []
    snapshot = await env.snapshot(task_id)
    assert (snapshot.suspended_key, snapshot.suspended_until) == ("confirm", None)
    assert snapshot.task.status is TaskStatus.INPUT_REQUIRED
    answer = {"action": "accept", "content": {"ok": True}}
    await env.result(
        "tasks/update", {"taskId": task_id, "inputResponses": {"confirm": answer}}, caps=caps
    )
    detail = await env.wait_status(task_id, "completed", caps=caps)
    assert detail["result"]["content"][0]["text"] == (
        "A-1 30 {'action': 'accept', 'content': {'ok': True}}"
    )
    assert runs == ["load A-1"]
    assert env.history_kinds(task_id) == [
        "step_recorded",
        "input_requested",
        "suspended",
        "input_responses_accepted",
        "completed",
    ]
    stops = await wait_stops(env.events, task_id, 2)
    assert [md["outcome"] for md in stops] == ["suspended", "completed"]


async def test_suspended_tasks_keep_at_most_max_queued_contexts_request_contexts(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """A suspended task holds no runner memory beyond a bounded number of request contexts:
    the first two suspended here resume with theirs (the principal), the others with a context
    rebuilt from their work, as on another host (the client's capabilities, persisted with the
    work, but no principal: default work does not persist it); none is kept once all end."""
    env = await start_env(
        nursery,
        task_support={"ask": "optional"},
        runner_options={"suspend_input_after_ms": 1_000, "max_queued_contexts": 2},
    )

    @env.app.tool(name="ask", description="Ask, then say whether the request's context is kept")
    async def ask(ctx: Context, n: int) -> str:
        await ctx.await_input("ok", elicitation("Ok?", {"type": "object"}))
        return f"{n} {ctx.has_capability('elicitation')} {ctx.principal}"

    caps: dict[str, Any] = {"extensions": {"io.modelcontextprotocol/tasks": {}}, "elicitation": {}}
    ids = []
    for n in range(4):
        ids.append(await env.create("ask", {"n": n}, caps=caps, principal="alice"))
        await env.wait_status(ids[-1], "input_required", caps=caps)
        await trio.sleep(1.5)  # suspended, in this order
        await wait_stops(env.events, ids[-1])
    assert env.runner.active_task_ids() == []
    texts = []
    for task_id in ids:
        answer = {"action": "accept", "content": {}}
        await env.result(
            "tasks/update", {"taskId": task_id, "inputResponses": {"ok": answer}}, caps=caps
        )
        detail = await env.wait_status(task_id, "completed", caps=caps)
        texts.append(detail["result"]["content"][0]["text"])
    assert texts == ["0 True alice", "1 True alice", "2 True None", "3 True None"]
    assert env.runner._contexts == {}


async def test_an_answer_through_another_runner_resumes_a_task_suspended_for_input(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Runner A suspends the task; the answer reaches the store through runner B (another
    host, no recovery loop): B claims the task at once and the replay gets the answer."""
    store = MemoryStore(scope="shared", clock=TrioClock(START_US))
    runs: list[int] = []

    async def load() -> int:
        runs.append(1)
        return 41

    async def script(work: Work, token: ExecutionToken) -> Any:
        value = await token.step("load", load)
        answer = await token.await_input("confirm", {"method": "elicitation/create"})
        return done([value, answer, token.recovered])

    first, first_events = make_runner(store, script, suspend_input_after_ms=1_000)
    second, second_events = make_runner(store, script)
    async with first, second:
        await create_raw(store, first, "t1")
        await trio.sleep(1.5)
        assert first.active_task_ids() == [] == second.active_task_ids()
        snapshot = await raw_snapshot(store, "t1")
        assert isinstance(snapshot, Snapshot)
        assert snapshot.suspended_key == "confirm"
        access = await store.authorize(ANONYMOUS, Action.UPDATE, "t1")
        answered = await second.update("t1", {"confirm": {"action": "accept"}}, access)
        assert isinstance(answered, Snapshot)
        assert answered.suspended_key is None and answered.available_at is None
        snapshot = await final(store, "t1")
    assert runs == [1]
    assert snapshot.task.result is not None
    assert snapshot.task.result["structuredContent"] == {"value": [41, {"action": "accept"}, False]}
    assert [md["outcome"] for _, md in first_events.named(ins.JOB_STOP)] == ["suspended"]
    assert [md["outcome"] for _, md in second_events.named(ins.JOB_STOP)] == ["completed"]


@pytest.mark.parametrize("answered_by", ["the suspending runner", "another runner"])
async def test_an_answer_while_the_task_is_suspending_still_resumes_it(
    autojump_clock: trio.testing.MockClock, answered_by: str
) -> None:
    """The answer arrives after the suspension is committed but before the suspending
    attempt has released its claim (neither runner recovers): the task resumes at once."""
    store = MemoryStore(scope="shared", clock=TrioClock(START_US))
    releasing = trio.Event()
    release_may_go = trio.Event()

    async def hook(op: str, args: tuple[Any, ...]) -> None:
        if op == "release" and not release_may_go.is_set():
            releasing.set()
            await release_may_go.wait()
        await trio.lowlevel.checkpoint()

    async def script(work: Work, token: ExecutionToken) -> Any:
        answer = await token.await_input("confirm", {"method": "elicitation/create"})
        return done(answer)

    first, first_events = make_runner(
        HookedStore(store, hook), script, suspend_input_after_ms=1_000
    )
    second, _ = make_runner(store, script)
    answerer = first if answered_by == "the suspending runner" else second
    async with first, second:
        await create_raw(store, first, "t1")
        await releasing.wait()  # suspended in the store, its claim not yet released
        snapshot = await raw_snapshot(store, "t1")
        assert isinstance(snapshot, Snapshot) and snapshot.suspended_key == "confirm"
        access = await store.authorize(ANONYMOUS, Action.UPDATE, "t1")
        answered = await answerer.update("t1", {"confirm": {"action": "accept"}}, access)
        assert isinstance(answered, Snapshot) and answered.suspended_key is None
        await trio.sleep(1)
        release_may_go.set()
        snapshot = await final(store, "t1")
    assert snapshot.task.status is TaskStatus.COMPLETED
    assert snapshot.task.result is not None
    assert snapshot.task.result["structuredContent"] == {"value": {"action": "accept"}}
    # The suspending runner claims it again after its release (the other's claim found it held).
    assert [md["outcome"] for _, md in first_events.named(ins.JOB_STOP)] == [
        "suspended",
        "completed",
    ]


async def test_a_long_input_key_suspends_and_resumes_like_any_other(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Input keys have no length limit (step and sleep keys do: 200 characters): a wait on a
    300-character key suspends, and the answer resumes the task."""
    store = MemoryStore(scope="shared", clock=TrioClock(START_US))
    key = "q" * 300

    async def script(work: Work, token: ExecutionToken) -> Any:
        return done(await token.await_input(key, {"method": "elicitation/create"}))

    runner, events = make_runner(store, script, suspend_input_after_ms=1_000)
    async with runner:
        await create_raw(store, runner, "t1")
        await trio.sleep(2)
        snapshot = await raw_snapshot(store, "t1")
        assert isinstance(snapshot, Snapshot)
        assert (snapshot.task.status, snapshot.suspended_key) == (TaskStatus.INPUT_REQUIRED, key)
        access = await store.authorize(ANONYMOUS, Action.UPDATE, "t1")
        await runner.update("t1", {key: {"action": "accept"}}, access)
        snapshot = await final(store, "t1")
    assert snapshot.task.status is TaskStatus.COMPLETED
    assert [md["outcome"] for _, md in events.named(ins.JOB_STOP)] == ["suspended", "completed"]


async def test_an_answer_on_a_full_runner_resumes_the_task_when_a_slot_frees(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The answer to a suspended task reaches a runner whose slots are all taken (one slot,
    no recovery): the task resumes as soon as the slot is free."""
    store = MemoryStore(scope="shared", clock=TrioClock(START_US))
    busy_may_end = trio.Event()

    async def script(work: Work, token: ExecutionToken) -> Any:
        if work.input["taskId"] == "busy":
            await busy_may_end.wait()
            return done("busy")
        return done(await token.await_input("confirm", {"method": "elicitation/create"}))

    runner, events = make_runner(store, script, max_jobs=1, suspend_input_after_ms=1_000)
    async with runner:
        await create_raw(store, runner, "t1")
        await trio.sleep(2)
        assert runner.active_task_ids() == []  # suspended
        await create_raw(store, runner, "busy")
        access = await store.authorize(ANONYMOUS, Action.UPDATE, "t1")
        answered = await runner.update("t1", {"confirm": {"action": "accept"}}, access)
        assert isinstance(answered, Snapshot) and answered.available_at is None
        await trio.sleep(5)
        assert runner.active_task_ids() == ["busy"]
        busy_may_end.set()
        snapshot = await final(store, "t1")
    assert snapshot.task.status is TaskStatus.COMPLETED
    assert snapshot.task.result is not None
    assert snapshot.task.result["structuredContent"] == {"value": {"action": "accept"}}
    assert [(md["task_id"], md["outcome"]) for _, md in events.named(ins.JOB_STOP)] == [
        ("t1", "suspended"),
        ("busy", "completed"),
        ("t1", "completed"),
    ]


async def test_max_runtime_counts_running_time_only(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An attempt may run 5 s; the task sleeps 60 s and waits 60 s for an answer, suspended,
    and completes: suspended time is no attempt's running time, and no retry is used."""
    store = MemoryStore(scope="shared", clock=TrioClock(START_US))

    async def script(work: Work, token: ExecutionToken) -> Any:
        await token.sleep("cooldown", 60)
        answer = await token.await_input("confirm", {"method": "elicitation/create"})
        return done(answer)

    runner, events = make_runner(
        store,
        script,
        max_runtime_ms=5_000,
        suspend_sleep_after_ms=1_000,
        suspend_input_after_ms=1_000,
    )
    async with runner:
        await create_raw(store, runner, "t1", work=retry_work("t1", []))
        await trio.sleep(120)
        snapshot = await raw_snapshot(store, "t1")
        assert isinstance(snapshot, Snapshot)
        assert (snapshot.task.status, snapshot.suspended_key) == (
            TaskStatus.INPUT_REQUIRED,
            "confirm",
        )
        access = await store.authorize(ANONYMOUS, Action.UPDATE, "t1")
        await runner.update("t1", {"confirm": {"ok": True}}, access)
        snapshot = await final(store, "t1")
    assert snapshot.task.status is TaskStatus.COMPLETED
    assert snapshot.retry_count == 0
    assert [md["outcome"] for _, md in events.named(ins.JOB_STOP)] == [
        "suspended",
        "suspended",
        "completed",
    ]


async def test_the_operator_view_shows_steps_and_suspension_but_no_outcome(
    autojump_clock: trio.testing.MockClock,
) -> None:
    from tritask.ops.render import inspection_json, task_json
    from tritask.tasks.store import TaskInspection

    store = MemoryStore(scope="shared", clock=TrioClock(START_US))

    async def secret() -> str:
        return "card 4242 4242 4242 4242"

    async def declined() -> None:
        raise StepFailed("declined for card 4242")

    async def script(work: Work, token: ExecutionToken) -> Any:
        await token.step("charge", secret)
        with pytest.raises(StepFailed):
            await token.step("refund", declined)
        await token.sleep("cooldown", 600)
        return done("never")

    runner, events = make_runner(store, script)
    async with runner:
        await create_raw(store, runner, "t1")
        await wait_stops(events, "t1")
        inspection = await store.inspect_task("t1")
        assert isinstance(inspection, TaskInspection)
        wake = format_instant(START_US + 3000 + 600_000_000)
        shown = task_json(inspection.task)
        assert (shown["steps"], shown["suspended"]) == (3, {"key": "cooldown", "until": wake})
        ledger = inspection_json(inspection)["ledger"]
        assert [(row["kind"], row.get("key"), row.get("outcome")) for row in ledger] == [
            ("step_recorded", "charge", "result"),
            ("step_recorded", "refund", "error"),
            ("sleep_scheduled", "cooldown", None),
            ("suspended", "cooldown", None),
        ]
        assert "4242" not in json_text(inspection_json(inspection))
        access = await store.authorize(ANONYMOUS, Action.CANCEL, "t1")
        await runner.cancel("t1", access)


def json_text(value: Any) -> str:
    import json

    return json.dumps(value)


async def test_a_recovering_runner_resumes_each_of_its_suspended_sleeps_at_its_instant(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Recovery polls only every 100 s here; the runner still wakes at each wake instant."""
    clock = TrioClock(START_US)
    store = MemoryStore(scope="shared", clock=clock)
    woke: dict[str, int] = {}

    async def script(work: Work, token: ExecutionToken) -> Any:
        await token.sleep("nap", work.input["seconds"])
        woke[token.task_id] = clock()
        return done("ok")

    runner, _ = make_runner(store, script, recover=True, recovery_interval_ms=100_000)
    async with runner:
        for name, seconds in (("late", 90), ("soon", 30), ("mid", 60)):
            work = Work(idempotency_key=name, type="job", input={"seconds": seconds})
            await create_raw(store, runner, name, work=work)
        for name in ("late", "soon", "mid"):
            await final(store, name, interval=1.0)
    wakes = {}
    for name in ("late", "soon", "mid"):
        snapshot = await raw_snapshot(store, name)
        assert isinstance(snapshot, Snapshot)
        wakes[name] = step_wake_at_of(snapshot)
    for name in ("late", "soon", "mid"):
        assert 0 <= woke[name] - wakes[name] < 10_000, (name, woke[name] - wakes[name])


def step_wake_at_of(snapshot: Snapshot) -> int:
    from tritask.tasks.model import step_wake_at

    wake = step_wake_at(snapshot.steps["nap"])
    assert wake is not None
    return wake


async def test_a_sync_step_runs_in_a_thread_and_sees_the_cancel_flag() -> None:
    """Real clock: a thread cannot be interrupted, so the step's body polls ctx.cancelled;
    cancel commits first, the flag is set, the runner waits for the thread, nothing is recorded."""
    import threading
    import time

    from helpers import start_env

    ran: list[str] = []
    entered = threading.Event()

    def blocking_refund(ctx: Context, amount: int) -> str:
        ran.append(f"refund {amount} in {threading.current_thread().name != 'MainThread'}")
        entered.set()
        deadline = time.monotonic() + 10
        while not ctx.cancelled and time.monotonic() < deadline:
            time.sleep(0.001)
        ran.append("saw the cancel" if ctx.cancelled else "timed out")
        return "late"

    def quick(amount: int) -> int:
        return amount * 2

    async def async_double(amount: int) -> int:
        ran.append("async body")  # never: a coroutine function is refused for a thread
        return amount * 2

    async with trio.open_nursery() as nursery:
        env = await start_env(nursery, task_support={"pay": "required", "double": "required"})

        @env.app.tool(name="double", description="Double in a thread")
        async def double(ctx: Context, amount: int) -> str:
            value = await ctx.step("double", quick, amount, thread=True)
            with pytest.raises(TypeError, match="must be async"):
                await ctx.step("not-async", quick, amount)
            with pytest.raises(TypeError, match="thread=True runs a sync function"):
                await ctx.step("async-in-thread", async_double, amount, thread=True)
            return str(value)

        @env.app.tool(name="pay", description="Pay in a thread")
        async def pay(ctx: Context, amount: int) -> str:
            return str(
                await ctx.step(
                    "refund", blocking_refund, ctx, amount, thread=True, fingerprint="refund"
                )
            )

        doubled = await env.create("double", {"amount": 21})
        detail = await env.wait_status(doubled, "completed")
        assert detail["result"]["content"][0]["text"] == "42"
        task_id = await env.create("pay", {"amount": 5})
        await trio.to_thread.run_sync(entered.wait, 10)
        access = await env.memory.authorize(ANONYMOUS, Action.CANCEL, task_id)
        with trio.fail_after(10):
            result = await env.runner.cancel(task_id, access)
        assert isinstance(result, Snapshot) and result.task.status is TaskStatus.CANCELLED
        assert ran == ["refund 5 in True", "saw the cancel"]  # returned only after the thread
        assert (await env.snapshot(task_id)).steps == {}
        assert env.history_kinds(task_id) == ["cancelled"]
        nursery.cancel_scope.cancel()


def test_step_events_refuse_bad_keys_outcomes_and_oversized_results() -> None:
    from tritask.tasks.events import InvalidEvent

    with pytest.raises(InvalidEvent, match="step key"):
        Event.step_recorded("", "fp", {"result": 1})
    with pytest.raises(InvalidEvent, match="step key"):
        Event.sleep_scheduled("k" * 201, 10)
    with pytest.raises(InvalidEvent, match="fingerprint"):
        Event.step_started("k", "")
    with pytest.raises(InvalidEvent, match="step outcome must be"):
        Event.step_recorded("k", "fp", {"result": 1, "error": {"code": 1, "message": "x"}})
    with pytest.raises(InvalidEvent, match="step error"):
        Event.step_recorded("k", "fp", {"error": {"code": "1", "message": "x"}})
    with pytest.raises(InvalidEvent, match="limited to 65536 bytes"):
        Event.step_recorded("k", "fp", {"result": "x" * MAX_STEP_OUTCOME_BYTES})
    with pytest.raises(InvalidEvent, match="delayMs"):
        Event.sleep_scheduled("k", -1)
    fits = Event.step_recorded("k", "fp", {"result": "x" * (MAX_STEP_OUTCOME_BYTES - 13)})
    assert Event.from_json(fits.to_json()) == fits
