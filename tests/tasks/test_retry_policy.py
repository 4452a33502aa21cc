"""Retry policies end to end (reference 4.2, 5.3): exact store-clock deadlines, restart safety,
replayed acknowledgements, transient store failures, exhaustion, cancellation during backoff,
input replay across a retry, and what may (and may not) consume the policy.

Every test runs under ``MockClock`` with a ``MemoryStore`` on ``TrioClock``, so times are exact:
the store's clock reads ``START_US`` at trio time 0, and a commit sharing a clock reading with
the previous one is stamped 1 ms later (commit times strictly increase per task).
"""

from __future__ import annotations

from typing import Any, Self

import pytest
import trio
import trio.testing
from helpers import (
    ANONYMOUS,
    START_US,
    HookedStore,
    ScriptedExecutor,
    create_raw,
    no_hook,
    raw_snapshot,
    start_env,
    wait_stops,
)

from tritask.jsonrpc import InvalidParams
from tritask.server.results import ToolError
from tritask.tasks import TrioClock
from tritask.tasks import instrumentation as ins
from tritask.tasks.events import Event, EventKind, RetryEffect
from tritask.tasks.executor import Completed, ExecutionToken, Failed, Outcome, Retry
from tritask.tasks.extension import TaskOptions
from tritask.tasks.instrumentation import RecordingInstrumentation
from tritask.tasks.memory import MemoryStore
from tritask.tasks.model import Snapshot, TaskStatus, snapshot_to_json
from tritask.tasks.runner import EXECUTOR_FAILED, Runner
from tritask.tasks.store import (
    UNAVAILABLE,
    Action,
    Authority,
    Claimed,
    Conflict,
    DatabaseBusy,
    Deferred,
    NotFound,
    Transition,
)
from tritask.tasks.work import RetryPolicy, Work

pytestmark = pytest.mark.contract("tasks-retry-policy")

MS = 1000  # µs per millisecond on the store clock
ASK = {"method": "elicitation/create", "params": {"message": "Proceed?"}}
DONE: dict[str, Any] = {"content": [{"type": "text", "text": "done"}], "isError": False}
FAILED_CLOSED = {"code": -32603, "message": EXECUTOR_FAILED}


def error(n: int) -> dict[str, Any]:
    return {"code": -32000, "message": f"transient {n}"}


def memory_store() -> MemoryStore:
    return MemoryStore(scope="shared", clock=TrioClock(START_US))


def job(task_id: str, delays: list[int], **data: Any) -> Work:
    return Work(idempotency_key=task_id, type="job", input=data, retry_policy=RetryPolicy(delays))


def runner_for(store: Any, script: Any, **options: Any) -> tuple[Runner, ScriptedExecutor]:
    executor = ScriptedExecutor(script)
    options.setdefault("reap_interval_ms", None)
    options.setdefault("instrumentation", RecordingInstrumentation())
    return Runner(store, executor=executor, **options), executor


async def snapshot_of(store: Any, task_id: str) -> Snapshot:
    snapshot = await raw_snapshot(store, task_id)
    assert isinstance(snapshot, Snapshot), snapshot
    return snapshot


def kinds(store: MemoryStore, task_id: str) -> list[str]:
    return [entry.event.kind.value for entry in store.history(task_id)]


def attempt_times(executor: ScriptedExecutor, times: list[float]) -> list[float]:
    assert len(times) == len(executor.attempts)
    return [round(t, 6) for t in times]


class RecordingStore(HookedStore):
    """A ``HookedStore`` that also keeps every transition result and claim answer."""

    def __init__(self, inner: Any, hook: Any = no_hook) -> None:
        super().__init__(inner, hook)
        self.transitions: list[Transition | Conflict | NotFound] = []
        self.claims: list[tuple[float, Any]] = []

    async def transition(
        self, task_id: str, expected_revision: int, event: Event, authority: Authority
    ) -> Transition | Conflict | NotFound:
        result = await super().transition(task_id, expected_revision, event, authority)
        self.transitions.append(result)
        return result

    async def claim(self, task_id: str, owner_id: str, lease_ms: int) -> Any:
        result = await super().claim(task_id, owner_id, lease_ms)
        self.claims.append((round(trio.current_time(), 6), result))
        return result

    async def __aenter__(self) -> Self:
        return self

    def retry_effects(self) -> list[RetryEffect | None]:
        return [
            t.effects.retry
            for t in self.transitions
            if isinstance(t, Transition) and t.outcome != "unchanged"
        ]

    def claim_answers(self) -> list[tuple[float, str]]:
        def name(result: Any) -> str:
            if isinstance(result, Claimed):
                return f"claimed@{result.lease.generation}"
            if isinstance(result, Deferred):
                return f"deferred({result.remaining_ms})"
            return repr(result)

        return [(at, name(result)) for at, result in self.claims]


# -- exact boundaries ---------------------------------------------------------------------------


async def test_retry_at_is_commit_time_plus_delay_and_claims_follow_it_to_the_millisecond(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The reference's worked example: created at T, the retry commits at T + 1 ms (same clock
    reading), so a 60 s delay makes ``retry_at`` T + 60.001 s: a claim 1 ms earlier is deferred
    by exactly 1 ms, and the runner's next attempt starts exactly at ``retry_at``."""
    memory = memory_store()
    store = RecordingStore(memory)
    times: list[float] = []

    async def script(work: Work, token: ExecutionToken) -> Outcome:
        times.append(trio.current_time())
        if len(times) == 1:
            return Retry(error(1), "will retry")
        return Completed(DONE)

    runner, executor = runner_for(store, script)
    async with runner:
        await create_raw(store, runner, "t1", work=job("t1", [60_000]))
        await trio.testing.wait_all_tasks_blocked()
        snapshot = await snapshot_of(memory, "t1")
        assert snapshot.retry_count == 1
        assert snapshot.retry_at == START_US + 60_001 * MS
        assert snapshot.task.status is TaskStatus.WORKING
        assert snapshot.task.status_message == "Task accepted"  # retries are private
        assert snapshot.last_failure == {"error": error(1), "statusMessage": "will retry"}
        (effect,) = store.retry_effects()
        assert effect == RetryEffect(
            disposition="scheduled",
            retry_at=START_US + 60_001 * MS,
            delay_ms=60_000,
            retry_count=1,
        )
        retried = runner.instrumentation.named(ins.RETRY_SCHEDULED)  # type: ignore[union-attr]
        assert retried == [({"delay_ms": 60_000, "retry_count": 1}, {"task_id": "t1"})]

        await trio.sleep_until(60.0)  # retry_at - 1 ms on the store's clock
        assert await memory.claim("t1", "probe", 1_000) == Deferred(1)
        assert await memory.claim_next("probe", 1_000) is None
        assert len(times) == 1
        await trio.sleep_until(61)
        assert attempt_times(executor, times) == [0.0, 60.001]
        done = await snapshot_of(memory, "t1")
        assert done.task.status is TaskStatus.COMPLETED
        assert done.retry_count == 1 and done.retry_at is None
        assert done.task.last_updated_at == START_US + 60_001 * MS
    # The runner's own timer fired at the delay (60 s), the store deferred it by the 1 ms
    # commit step, and the claim at retry_at succeeded at generation 2.
    assert store.claim_answers() == [
        (0.0, "claimed@1"),
        (60.0, "deferred(1)"),
        (60.001, "claimed@2"),
    ]


async def test_a_new_runner_neither_runs_a_retry_early_nor_loses_it(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """The retry's deadline lives in the store: runner A stops during the backoff; runner B
    (recovering) starts later and runs each task no earlier than its ``retry_at``."""
    memory = memory_store()
    times: dict[str, list[float]] = {}

    async def script(work: Work, token: ExecutionToken) -> Outcome:
        seen = times.setdefault(token.task_id, [])
        seen.append(round(trio.current_time(), 6))
        if len(seen) == 1:
            return Retry(error(1), None)
        return Completed(DONE)

    first, _ = runner_for(memory, script)
    async with first:
        for task_id in ("recovered", "started"):
            await create_raw(memory, first, task_id, work=job(task_id, [60_000]))
        await trio.sleep(1)
        assert first.statistics().scheduled_retries == 2
    # Runner A is gone with its timers; the store still knows both retries.
    assert times == {"recovered": [0.0], "started": [0.0]}
    for task_id in ("recovered", "started"):
        snapshot = await snapshot_of(memory, task_id)
        assert snapshot.retry_at == START_US + 60_001 * MS
        assert await memory.claim(task_id, "probe", 1_000) == Deferred(59_001)

    events = RecordingInstrumentation()
    second, _ = runner_for(
        memory, script, recover=True, recovery_interval_ms=1_000, instrumentation=events
    )
    await nursery.start(second.run)
    # An explicit start of a deferred task schedules exactly the store's remaining time.
    await second.start_task("started")
    assert second.active_task_ids() == []
    assert second.statistics().scheduled_retries == 1
    await trio.sleep_until(59.999)
    assert times == {"recovered": [0.0], "started": [0.0]}  # nothing ran early
    await trio.sleep_until(70)
    # "started" ran on its timer at retry_at; "recovered" at the first recovery tick after it
    # (ticks at 1, 2, ..., 61 s).
    assert times == {"recovered": [0.0, 61.0], "started": [0.0, 60.001]}
    starts = {md["task_id"]: md["source"] for _, md in events.named(ins.JOB_START)}
    assert starts == {"started": "retry", "recovered": "recovery"}
    for task_id in ("recovered", "started"):
        snapshot = await snapshot_of(memory, task_id)
        assert snapshot.task.status is TaskStatus.COMPLETED
        assert snapshot.retry_count == 1
        assert kinds(memory, task_id) == ["retry_requested", "completed"]
    second.stop()


async def test_zero_delay_retries_recheck_the_store_clock(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A zero delay is not "now" on the runner's clock: ``retry_at`` is the commit time, which
    the store stamps 1 ms after a same-reading update, so the immediate claim is deferred by
    1 ms and each retry starts exactly at its commit time."""
    memory = memory_store()
    store = RecordingStore(memory)
    times: list[float] = []

    async def script(work: Work, token: ExecutionToken) -> Outcome:
        times.append(trio.current_time())
        if len(times) < 3:
            return Retry(error(len(times)), None)
        return Completed(DONE)

    runner, executor = runner_for(store, script)
    async with runner:
        await create_raw(store, runner, "t1", work=job("t1", [0, 0]))
        await trio.sleep(1)
    assert attempt_times(executor, times) == [0.0, 0.001, 0.002]
    assert store.claim_answers() == [
        (0.0, "claimed@1"),
        (0.0, "deferred(1)"),
        (0.001, "claimed@2"),
        (0.001, "deferred(1)"),
        (0.002, "claimed@3"),
    ]
    assert [(e.retry_at, e.delay_ms) for e in store.retry_effects() if e is not None] == [
        (START_US + 1 * MS, 0),
        (START_US + 2 * MS, 0),
    ]
    events = runner.instrumentation.named(ins.RETRY_SCHEDULED)  # type: ignore[union-attr]
    assert [m["delay_ms"] for m, _ in events] == [0, 0]
    assert kinds(memory, "t1") == ["retry_requested", "retry_requested", "completed"]


async def test_a_retry_acknowledged_as_duplicate_rechecks_the_store_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The retry commit's acknowledgement is lost (the store committed, then the call failed);
    the runner resends the same event 3 s later and gets ``duplicate`` carrying the original
    effects (delay 5000 ms). Waiting that delay again would start the retry at 8 s; instead a
    duplicate schedules with delay 0 and the store defers the claim to the original
    ``retry_at`` (5.001 s)."""
    lost: list[float] = []

    async def hook(op: str, args: tuple[Any, ...]) -> None:
        await trio.lowlevel.checkpoint()

    memory = memory_store()

    class LosesOneAcknowledgement(RecordingStore):
        async def transition(
            self, task_id: str, expected_revision: int, event: Event, authority: Authority
        ) -> Transition | Conflict | NotFound:
            result = await super().transition(task_id, expected_revision, event, authority)
            if event.kind is EventKind.RETRY_REQUESTED and not lost:
                lost.append(trio.current_time())
                raise DatabaseBusy("connection lost after the commit")
            return result

    store = LosesOneAcknowledgement(memory, hook)
    times: list[float] = []

    async def script(work: Work, token: ExecutionToken) -> Outcome:
        times.append(trio.current_time())
        if len(times) == 1:
            return Retry(error(1), "again")
        return Completed(DONE)

    runner, executor = runner_for(store, script, release_retry_ms=3_000)
    async with runner:
        await create_raw(store, runner, "t1", work=job("t1", [5_000]))
        await trio.sleep(10)
    assert lost == [0.0]
    assert attempt_times(executor, times) == [0.0, 5.001]
    outcomes = [t.outcome for t in store.transitions if isinstance(t, Transition)]
    assert outcomes == ["applied", "duplicate", "applied"]
    applied, duplicate = store.transitions[:2]
    assert isinstance(applied, Transition) and isinstance(duplicate, Transition)
    # The replay carries the original commit: revision, commit time and effects.
    assert duplicate.event_revision == applied.event_revision == 1
    assert duplicate.committed_at == applied.committed_at == START_US + 1 * MS
    assert duplicate.effects == applied.effects
    events = runner.instrumentation
    assert isinstance(events, RecordingInstrumentation)
    assert [m["delay_ms"] for m, _ in events.named(ins.RETRY_SCHEDULED)] == [0]
    stops = [md["store_outcome"] for _, md in events.named(ins.JOB_STOP)]
    assert stops == ["duplicate", "applied"]
    assert store.claim_answers() == [
        (0.0, "claimed@1"),
        (3.0, "deferred(2001)"),
        (5.001, "claimed@2"),
    ]
    assert kinds(memory, "t1") == ["retry_requested", "completed"]  # committed exactly once


# -- transient store failures -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("failing", "delay", "expected_start"),
    [
        # release fails at 0 and 0.1 s and succeeds at 0.2 s; the retry is scheduled only then
        # (before, the task's own claim would make the retry's claim unavailable and the retry
        # would be dropped), with delay 0, so the store decides: due at once for a zero delay,
        # deferred to retry_at = 1.001 s otherwise.
        ("release", 0, 0.2),
        ("release", 1_000, 1.001),
        # the retry commit fails twice and lands at 0.2 s: retry_at = 0.2 + 1 s.
        ("transition", 1_000, 1.2),
        # the retry's claim at 1 s fails; it is tried again 0.1 s later (then due).
        ("claim", 1_000, 1.1),
    ],
)
async def test_transient_store_failures_neither_stop_the_runner_nor_lose_the_retry(
    autojump_clock: trio.testing.MockClock, failing: str, delay: int, expected_start: float
) -> None:
    calls: dict[str, int] = {}
    failures: list[tuple[str, float]] = []

    async def hook(op: str, args: tuple[Any, ...]) -> None:
        await trio.lowlevel.checkpoint()
        calls[op] = calls.get(op, 0) + 1
        if op != failing:
            return
        fail = {
            "release": calls[op] <= 2,
            "transition": calls[op] <= 2,
            "claim": calls[op] == 2,  # the first claim (at creation) succeeds
        }[op]
        if fail:
            failures.append((op, round(trio.current_time(), 6)))
            raise DatabaseBusy("database is locked")

    memory = memory_store()
    store = RecordingStore(memory, hook)
    times: list[float] = []

    async def script(work: Work, token: ExecutionToken) -> Outcome:
        times.append(trio.current_time())
        if len(times) == 1:
            return Retry(error(1), None)
        return Completed(DONE)

    runner, executor = runner_for(store, script)
    async with runner:
        await create_raw(store, runner, "t1", work=job("t1", [delay]))
        await trio.sleep(5)
        assert runner.running
        assert runner.statistics().scheduled_retries == 0
    assert attempt_times(executor, times) == [0.0, expected_start]
    assert len(failures) == (1 if failing == "claim" else 2)
    assert kinds(memory, "t1") == ["retry_requested", "completed"]
    done = await snapshot_of(memory, "t1")
    assert done.task.status is TaskStatus.COMPLETED and done.retry_count == 1
    events = runner.instrumentation
    assert isinstance(events, RecordingInstrumentation)
    stops = [(md["outcome"], md["release_outcome"]) for _, md in events.named(ins.JOB_STOP)]
    first_release = "error" if failing == "release" else "ok"
    assert stops == [("retry", first_release), ("completed", "ok")]
    # Every claim was released in the end: a fresh owner could claim (were it not terminal).
    assert await memory.claim("t1", "probe", 1_000) is UNAVAILABLE
    assert done.retry_at is None


# -- exhaustion ---------------------------------------------------------------------------------


@pytest.mark.parametrize("delays", [[], [1_000]])
async def test_exhaustion_fails_in_the_same_transition_with_the_executors_error(
    autojump_clock: trio.testing.MockClock, delays: list[int]
) -> None:
    memory = memory_store()
    store = RecordingStore(memory)

    async def script(work: Work, token: ExecutionToken) -> Outcome:
        n = len(executor.attempts)
        return Retry(error(n), f"gave up after {n}")

    runner, executor = runner_for(store, script)
    async with runner:
        await create_raw(store, runner, "t1", work=job("t1", delays))
        await trio.sleep(10)
    attempts = len(delays) + 1
    assert len(executor.attempts) == attempts
    failed = await snapshot_of(memory, "t1")
    assert failed.task.status is TaskStatus.FAILED
    # The last executor's error and message, committed by the retry_requested event itself.
    assert failed.task.error == error(attempts)
    assert failed.task.status_message == f"gave up after {attempts}"
    assert failed.last_failure == {
        "error": error(attempts),
        "statusMessage": f"gave up after {attempts}",
    }
    assert failed.retry_count == len(delays)  # the exhausting request consumes nothing
    assert failed.retry_at is None
    assert failed.revision == attempts
    assert kinds(memory, "t1") == ["retry_requested"] * attempts
    assert store.retry_effects()[-1] == RetryEffect(
        disposition="exhausted", retry_at=None, delay_ms=None, retry_count=len(delays)
    )
    events = runner.instrumentation
    assert isinstance(events, RecordingInstrumentation)
    assert len(events.named(ins.RETRY_SCHEDULED)) == len(delays)
    assert await memory.claim("t1", "probe", 1_000) is UNAVAILABLE


# -- cancellation during the backoff ------------------------------------------------------------


@pytest.mark.parametrize("through", ["the same runner", "another runner"])
async def test_cancelling_during_the_backoff_clears_retry_at_and_nothing_runs_again(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, through: str
) -> None:
    memory = memory_store()

    async def script(work: Work, token: ExecutionToken) -> Outcome:
        return Retry(error(1), "backing off")

    runner, executor = runner_for(memory, script)
    await nursery.start(runner.run)
    await create_raw(memory, runner, "t1", work=job("t1", [60_000, 60_000]))
    await trio.sleep(10)
    waiting = await snapshot_of(memory, "t1")
    assert waiting.retry_at == START_US + 60_001 * MS
    assert runner.statistics().scheduled_retries == 1

    canceller = runner
    if through == "another runner":
        canceller, _ = runner_for(memory, script)
        await nursery.start(canceller.run)
    access = await memory.authorize(ANONYMOUS, Action.CANCEL, "t1")
    cancelled = await canceller.cancel("t1", access)
    assert isinstance(cancelled, Snapshot)
    assert cancelled.task.status is TaskStatus.CANCELLED
    assert cancelled.retry_at is None
    assert cancelled.retry_count == 1  # history is kept; only the schedule is cleared
    expected_timers = 0 if through == "the same runner" else 1
    assert runner.statistics().scheduled_retries == expected_timers

    await trio.sleep(300)  # well past every delay: the other runner's timer found it terminal
    assert len(executor.attempts) == 1
    assert runner.statistics().scheduled_retries == 0
    final = await snapshot_of(memory, "t1")
    assert final.task.status is TaskStatus.CANCELLED and final.retry_at is None
    assert kinds(memory, "t1") == ["retry_requested", "cancelled"]
    assert await memory.claim("t1", "probe", 1_000) is UNAVAILABLE
    assert await memory.claim_next("probe", 1_000) is None
    runner.stop()
    canceller.stop()


# -- input across a retry -----------------------------------------------------------------------


async def test_accepted_input_replays_across_a_retry(
    autojump_clock: trio.testing.MockClock,
) -> None:
    memory = memory_store()
    answers: list[dict[str, Any]] = []

    async def script(work: Work, token: ExecutionToken) -> Outcome:
        answers.append(await token.await_input("confirm", ASK))
        if len(answers) == 1:
            return Retry(error(1), None)
        return Completed({"content": [], "structuredContent": answers[-1], "isError": False})

    runner, executor = runner_for(memory, script)
    async with runner:
        await create_raw(memory, runner, "t1", work=job("t1", [2_000]))
        await trio.sleep(1)
        parked = await snapshot_of(memory, "t1")
        assert parked.task.status is TaskStatus.INPUT_REQUIRED
        assert parked.task.input_requests == {"confirm": ASK}
        access = await memory.authorize(ANONYMOUS, Action.UPDATE, "t1")
        await runner.update("t1", {"confirm": {"action": "accept"}}, access)
        await trio.sleep(10)
    assert [generation for _, generation, _ in executor.attempts] == [1, 2]
    assert answers == [{"action": "accept"}, {"action": "accept"}]
    done = await snapshot_of(memory, "t1")
    assert done.task.status is TaskStatus.COMPLETED
    assert done.task.result == {
        "content": [],
        "structuredContent": {"action": "accept"},
        "isError": False,
    }
    assert kinds(memory, "t1") == [
        "input_requested",
        "input_responses_accepted",
        "retry_requested",
        "completed",
    ]


# -- what may consume the policy ----------------------------------------------------------------


async def test_a_plain_tool_never_consumes_the_retry_policy(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """Without a custom executor the default ToolCallExecutor runs the tool; whatever the tool
    does (raise, return a Retry object, return junk, raise a protocol error) is terminal at
    once, with the configured policy persisted but untouched."""
    names = ["crashes", "returns_retry", "returns_junk", "tool_error", "protocol_error"]
    env = await start_env(
        nursery,
        task_support=dict.fromkeys(names, "required"),
        tasks_options={"retry_policy": RetryPolicy([1_000, 1_000])},
    )
    app = env.app

    @app.tool()
    async def crashes() -> str:
        """Raises."""
        raise RuntimeError("boom")

    @app.tool()
    async def returns_retry() -> Any:
        """Returns what an executor would return to ask for a retry."""
        return Retry(error(1), "please retry")

    @app.tool()
    async def returns_junk() -> Any:
        """Returns something that is not a tool result."""
        return object()

    @app.tool()
    async def tool_error() -> str:
        """A domain error."""
        raise ToolError("try again later")

    @app.tool()
    async def protocol_error() -> str:
        """A JSON-RPC error."""
        raise InvalidParams("bad input")

    ids = {name: await env.create(name) for name in names}
    await trio.sleep(30)
    details = {name: await env.get(task_id) for name, task_id in ids.items()}
    assert {name: d["status"] for name, d in details.items()} == {
        "crashes": "failed",
        "returns_retry": "completed",  # an attrs value is just structured content to a tool
        "returns_junk": "failed",
        "tool_error": "completed",
        "protocol_error": "failed",
    }
    assert details["crashes"]["error"] == {"code": -32603, "message": "Task tool failed"}
    assert details["returns_junk"]["error"] == {
        "code": -32603,
        "message": "Tool returned an invalid result",
    }
    assert details["tool_error"]["result"]["isError"] is True
    assert details["protocol_error"]["error"] == {"code": -32602, "message": "bad input"}
    for name, task_id in ids.items():
        snapshot = await env.snapshot(task_id)
        assert snapshot.work is not None
        assert snapshot.work.retry_policy == RetryPolicy([1_000, 1_000]), name
        assert snapshot.retry_count == 0 and snapshot.retry_at is None, name
        assert len(env.history_kinds(task_id)) == 1, name
        assert "retry_requested" not in env.history_kinds(task_id), name
    assert env.named(ins.RETRY_SCHEDULED) == []
    assert len(env.named(ins.JOB_START)) == len(names)


class _NotJSON:
    pass


@pytest.mark.parametrize(
    "behaviour",
    [
        "raises",
        "raises_group",
        "returns_none",
        "returns_dict",
        "non_json_result",
        "retry_without_code",
        "retry_with_non_json_error",
        "failed_with_bad_message",
    ],
)
async def test_executor_exceptions_and_invalid_outcomes_fail_closed_without_consuming_retries(
    autojump_clock: trio.testing.MockClock, behaviour: str
) -> None:
    memory = memory_store()

    async def script(work: Work, token: ExecutionToken) -> Any:
        if behaviour == "raises":
            raise RuntimeError("secret executor detail")
        if behaviour == "raises_group":
            raise ExceptionGroup("secret group", [ValueError("secret executor detail")])
        if behaviour == "returns_none":
            return None
        if behaviour == "returns_dict":
            return {"retry": True}
        if behaviour == "non_json_result":
            return Completed({"content": [], "value": _NotJSON()})
        if behaviour == "retry_without_code":
            return Retry({"message": "no code"}, None)
        if behaviour == "retry_with_non_json_error":
            return Retry({"code": -32000, "message": "x", "data": float("nan")}, None)
        return Failed(error(1), 42)  # type: ignore[arg-type]

    runner, executor = runner_for(memory, script)
    async with runner:
        await create_raw(memory, runner, "t1", work=job("t1", [1_000, 1_000, 1_000]))
        await trio.sleep(30)
    assert len(executor.attempts) == 1
    failed = await snapshot_of(memory, "t1")
    assert failed.task.status is TaskStatus.FAILED
    assert failed.task.error == FAILED_CLOSED
    assert failed.task.status_message == EXECUTOR_FAILED
    assert failed.retry_count == 0 and failed.retry_at is None and failed.last_failure is None
    assert kinds(memory, "t1") == ["failed"]
    assert "secret" not in repr(snapshot_to_json(failed))
    events = runner.instrumentation
    assert isinstance(events, RecordingInstrumentation)
    assert events.named(ins.RETRY_SCHEDULED) == []
    assert [md["outcome"] for _, md in events.named(ins.JOB_STOP)] == ["failed"]


async def test_an_explicit_failure_is_terminal_even_with_delays_left(
    autojump_clock: trio.testing.MockClock,
) -> None:
    memory = memory_store()

    async def script(work: Work, token: ExecutionToken) -> Outcome:
        if len(executor.attempts) == 1:
            return Retry(error(1), None)
        return Failed({"code": -32001, "message": "permanent"}, "gave up for good")

    runner, executor = runner_for(memory, script)
    async with runner:
        await create_raw(memory, runner, "t1", work=job("t1", [1_000, 1_000, 1_000]))
        await trio.sleep(60)
    assert len(executor.attempts) == 2
    failed = await snapshot_of(memory, "t1")
    assert failed.task.status is TaskStatus.FAILED
    assert failed.task.error == {"code": -32001, "message": "permanent"}
    assert failed.task.status_message == "gave up for good"
    assert failed.retry_count == 1  # two delays were left, none used
    assert failed.retry_at is None
    assert kinds(memory, "t1") == ["retry_requested", "failed"]


# -- where policies come from -------------------------------------------------------------------


async def test_configured_policies_land_in_the_persisted_work_and_never_change_after(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """A work builder's own policy wins; otherwise the policy decision's TaskOptions, then
    ``retry_policies[tool]``, then ``retry_policy``. The persisted (expanded) list is what the
    runner follows, even after the configuration changes."""
    times: dict[str, list[float]] = {}

    async def script(work: Work, token: ExecutionToken) -> Outcome:
        seen = times.setdefault(work.input["name"], [])
        seen.append(round(trio.current_time(), 6))
        if len(seen) == 1:
            return Retry(error(1), None)
        return Completed(DONE)

    def builder(task_id: str, tool: str, arguments: dict[str, Any], ctx: Any) -> Work:
        own = RetryPolicy([7_000]) if tool == "own_policy" else RetryPolicy.none()
        return Work(
            idempotency_key=task_id,
            type="tools/call",
            input={"name": tool, "arguments": arguments},
            retry_policy=own,
        )

    names = ["global_default", "per_tool", "own_policy", "decided"]
    env = await start_env(
        nursery,
        task_support={
            "global_default": "required",
            "per_tool": "required",
            "own_policy": "required",
            "decided": ("required", TaskOptions(retry_policy=RetryPolicy.fixed(4_000, 1))),
        },
        tasks_options={
            "retry_policy": RetryPolicy.fixed(2_000, 2),
            "retry_policies": {"per_tool": RetryPolicy.exponential(3_000, 3, max_delay_ms=5_000)},
            "work_builder": builder,
        },
        runner_options={"executor": ScriptedExecutor(script)},
    )
    for name in names:

        async def tool() -> str:
            """Executed by the scripted executor only."""
            raise AssertionError("not called")

        env.app.add_tool(tool, name=name)
    ids = {name: await env.create(name) for name in names}
    await trio.testing.wait_all_tasks_blocked()
    # A configuration change now affects new work only.
    env.tasks.retry_policy = RetryPolicy([1])
    env.tasks.retry_policies = {}
    persisted = {}
    for name, task_id in ids.items():
        work = (await env.snapshot(task_id)).work
        assert work is not None
        persisted[name] = work.to_json()["retryPolicy"]
    assert persisted == {
        "global_default": {"version": 1, "delaysMs": [2_000, 2_000]},
        "per_tool": {"version": 1, "delaysMs": [3_000, 5_000, 5_000]},
        "own_policy": {"version": 1, "delaysMs": [7_000]},
        "decided": {"version": 1, "delaysMs": [4_000]},
    }
    await trio.sleep(20)
    # Each retry followed its persisted first delay (+ the 1 ms commit step).
    assert times == {
        "global_default": [0.0, 2.001],
        "per_tool": [0.0, 3.001],
        "own_policy": [0.0, 7.001],
        "decided": [0.0, 4.001],
    }
    for task_id in ids.values():
        assert (await env.get(task_id))["status"] == "completed"
    later = await env.create("global_default")
    work = (await env.snapshot(later)).work
    assert work is not None and work.retry_policy == RetryPolicy([1])
    await wait_stops(env.events, later)
