"""The Runner under MockClock: heartbeats, fencing and replacement, max runtime, reaping,
shutdown hygiene, store calls without caller-side timeouts, several nodes on one store,
retry deadlines, and the cancel token seen by thread work."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import trio
import trio.testing
from helpers import (
    ANONYMOUS,
    ELICIT_CAPS,
    START_US,
    TEST_STATE_KEY,
    UNKNOWN_TASK,
    Env,
    HookedStore,
    ScriptedExecutor,
    create_raw,
    raw_snapshot,
    request,
    start_env,
    wait_stops,
)

from tritask.server.app import App
from tritask.server.context import Context
from tritask.server.dispatcher import Dispatcher
from tritask.server.extension import ServeEnvironment
from tritask.server.mrtr import elicitation
from tritask.tasks import TrioClock, format_instant
from tritask.tasks import instrumentation as ins
from tritask.tasks.events import Event, EventKind
from tritask.tasks.executor import Completed, ExecutionToken, Retry, StaleAttempt
from tritask.tasks.extension import Tasks, ToolCallExecutor
from tritask.tasks.instrumentation import RecordingInstrumentation
from tritask.tasks.memory import MemoryStore
from tritask.tasks.model import Snapshot
from tritask.tasks.runner import Runner
from tritask.tasks.store import (
    NOT_FOUND,
    UNAVAILABLE,
    Action,
    Claimed,
    DatabaseBusy,
    Deferred,
    Lease,
    StaleLease,
    WorkerAuthority,
)
from tritask.tasks.work import RetryPolicy, Work

ASK = elicitation("Proceed?", {"type": "object", "properties": {"ok": {"type": "boolean"}}})


# -- heartbeats ---------------------------------------------------------------------------------


@pytest.mark.contract("tasks-recovery-claims")
async def test_heartbeats_keep_a_long_claim_alive_past_lease_ms(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env = await start_env(
        nursery, task_support={"long": "required"}, runner_options={"lease_ms": 3_000}
    )
    assert env.runner.heartbeat_ms == 1_000
    finished = trio.Event()

    @env.app.tool()
    async def long(ctx: Context) -> str:
        """Runs for 20 lease periods."""
        await trio.sleep(59.5)
        finished.set()
        return "long done"

    task_id = await env.create("long")
    for second in (10, 30, 59):
        await trio.sleep_until(second)
        # Well past lease_ms: nobody else can claim it, the claim was never re-granted.
        assert await env.memory.claim(task_id, "intruder", 1_000) is UNAVAILABLE
        assert await env.memory.claim_next("intruder", 1_000) is None
        assert (await env.get(task_id))["status"] == "working"
    await finished.wait()
    detail = await env.wait_status(task_id, "completed")
    assert detail["result"]["content"] == [{"type": "text", "text": "long done"}]
    claimed = [m for m, md in env.named(ins.LEASE_CLAIMED) if md["task_id"] == task_id]
    assert claimed == [{"generation": 1, "duration": 0.0}]
    renewed = [m["generation"] for m, md in env.named(ins.LEASE_RENEWED)]
    assert len(renewed) == 59 and set(renewed) == {1}
    assert env.named(ins.LEASE_LOST) == []
    assert env.history_kinds(task_id) == ["completed"]


@pytest.mark.contract("tasks-recovery-claims")
async def test_a_transient_renew_failure_does_not_crash_the_runner(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """Regression: a renew raising anything but StaleLease used to crash the runner's nursery."""
    failures = 0

    async def hook(op: str, args: tuple[Any, ...]) -> None:
        nonlocal failures
        await trio.lowlevel.checkpoint()
        if op == "renew" and failures < 2:
            failures += 1
            raise DatabaseBusy("database is busy")

    env = await start_env(
        nursery,
        task_support={"slow": "required"},
        store=lambda memory: HookedStore(memory, hook),
        runner_options={"lease_ms": 6_000, "heartbeat_ms": 1_000},
    )

    @env.app.tool()
    async def slow() -> str:
        """Outlives two failed heartbeats."""
        await trio.sleep(9.5)
        return "survived"

    task_id = await env.create("slow")
    detail = await env.wait_status(task_id, "completed", "failed")
    assert detail["status"] == "completed"
    assert detail["result"]["content"] == [{"type": "text", "text": "survived"}]
    assert failures == 2
    assert env.runner.running
    # The claim never changed hands: renewals resumed at generation 1 and nothing was lost.
    assert {m["generation"] for m, _ in env.named(ins.LEASE_RENEWED)} == {1}
    assert len(env.named(ins.LEASE_RENEWED)) == 7  # t = 3..9 s
    assert env.named(ins.LEASE_LOST) == []
    assert (await wait_stops(env.events, task_id))[0]["outcome"] == "completed"


# -- replacement and fencing --------------------------------------------------------------------


@pytest.mark.contract("tasks-recovery-claims", "tasks-store-hardening")
async def test_stuck_attempt_is_torn_down_before_its_replacement_starts(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """The heartbeat of generation 1 hangs in the store, so its lease lapses; the runner's own
    recovery reclaims the task at generation 2, cancels the stuck attempt's scope, waits for it
    to exit, and only then starts the replacement. The old lease and input channel are fenced."""
    leases: list[Lease] = []

    async def hook(op: str, args: tuple[Any, ...]) -> None:
        await trio.lowlevel.checkpoint()
        if op == "renew":
            leases.append(args[0])
            if args[0].generation == 1:
                await trio.sleep_forever()

    env = await start_env(
        nursery,
        task_support={"job": "required"},
        store=lambda memory: HookedStore(memory, hook),
        runner_options={"lease_ms": 3_000, "recover": True, "recovery_interval_ms": 500},
    )
    log: list[tuple[str, int, float]] = []
    contexts: list[Context] = []

    @env.app.tool()
    async def job(ctx: Context) -> str:
        """The first attempt gets stuck; the replacement finishes."""
        attempt = len(contexts)
        contexts.append(ctx)
        log.append(("start", attempt, trio.current_time()))
        try:
            if attempt == 0:
                await trio.sleep_forever()
            return f"attempt {attempt} done"
        finally:
            log.append(("exit", attempt, trio.current_time()))

    task_id = await env.create("job", caps=ELICIT_CAPS)
    detail = await env.wait_status(task_id, "completed", "failed")
    assert detail["status"] == "completed"
    assert detail["result"]["content"] == [{"type": "text", "text": "attempt 1 done"}]
    # The lease (claimed at t=0 for 3 s) lapsed at t=3; the reclaim tore attempt 0 down first.
    assert log == [("start", 0, 0.0), ("exit", 0, 3.0), ("start", 1, 3.0), ("exit", 1, 3.0)]
    assert [m["generation"] for m, _ in env.named(ins.LEASE_CLAIMED)] == [1, 2]
    assert [m["generation"] for m, _ in env.named(ins.RECOVERY_RECLAIMED)] == [2]
    stopped = await wait_stops(env.events, task_id, 2)
    assert [(md["outcome"], md["release_outcome"]) for md in stopped] == [
        ("reclaimed", "error"),  # its lease was already superseded: releasing it is refused
        ("completed", "ok"),
    ]
    # Exactly one terminal commit.
    assert env.history_kinds(task_id) == ["completed"]

    # The replaced attempt is fenced: its input channel refuses, and its lease is stale.
    with pytest.raises(StaleAttempt):
        await contexts[0].await_input("late", ASK)
    old = leases[0]
    assert old.generation == 1
    snapshot = await env.snapshot(task_id)
    with pytest.raises(StaleLease):
        await env.memory.transition(
            task_id,
            snapshot.revision,
            Event.failed({"code": -32603, "message": "late"}, "late"),
            WorkerAuthority(old),
        )
    with pytest.raises(StaleLease):
        await env.memory.worker_snapshot(task_id, old)
    with pytest.raises(StaleLease):
        await env.memory.renew(old, 3_000)
    assert env.history_kinds(task_id) == ["completed"]
    assert (await env.get(task_id)) == detail


@pytest.mark.parametrize("late", ["result", "input"])
@pytest.mark.contract("tasks-recovery-claims", "tasks-store-hardening")
async def test_late_result_or_input_of_a_lapsed_attempt_is_fenced_across_runners(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, late: str
) -> None:
    """Runner A's renewals fail, its lease lapses and runner B reclaims the task at generation 2
    and completes it; A's attempt then finishes (or asks for input) and the store refuses it."""

    async def hook(op: str, args: tuple[Any, ...]) -> None:
        await trio.lowlevel.checkpoint()
        if op == "renew" and args[0].owner_id == "runner-a":
            raise DatabaseBusy("renewals of runner A keep failing")

    env = await start_env(
        nursery,
        task_support={"job": "required"},
        store=lambda memory: HookedStore(memory, hook),
        runner_options={"lease_ms": 3_000, "owner_id": "runner-a"},
    )
    events_b = RecordingInstrumentation()
    runner_b = Runner(
        env.memory,
        owner_id="runner-b",
        lease_ms=3_000,
        reap_interval_ms=None,
        instrumentation=events_b,
    )
    runner_b.set_default_executor(ToolCallExecutor(env.app))
    await nursery.start(runner_b.run)
    go = trio.Event()
    attempts: list[str] = []
    refused: list[BaseException] = []

    @env.app.tool()
    async def job(ctx: Context) -> str:
        """Attempt A waits for ``go``; attempt B completes at once."""
        attempts.append(ctx.idempotency_key or "")
        if len(attempts) == 1:
            await go.wait()
            if late == "input":
                try:
                    await ctx.await_input("late-key", ASK)
                except StaleAttempt as error:
                    refused.append(error)
                    raise
            return "from A"
        return "from B"

    task_id = await env.create("job", caps=ELICIT_CAPS)
    await trio.sleep_until(3.0)
    assert await runner_b.recover_once() == 1
    detail = await env.wait_status(task_id, "completed")
    assert detail["result"]["content"] == [{"type": "text", "text": "from B"}]
    assert attempts == [task_id, task_id]  # same idempotency key on every attempt
    go.set()
    (stop_a,) = await wait_stops(env.events, task_id)
    assert env.history_kinds(task_id) == ["completed"]  # exactly one terminal commit
    assert await env.get(task_id) == detail
    fenced = env.named(ins.FENCED_WRITE_REJECTED)
    if late == "result":
        assert [(m["generation"], md["event_kind"]) for m, md in fenced] == [(1, "completed")]
        assert refused == []
    else:
        # The stale lease cannot read the inbox, so the input request is refused before any
        # event is built; the failure the tool then reports is fenced by the store too.
        assert [type(error) for error in refused] == [StaleAttempt]
        assert [(m["generation"], md["event_kind"]) for m, md in fenced] == [(1, "failed")]
    assert stop_a["store_outcome"] == "error"
    assert stop_a["release_outcome"] == "error"
    b_claims = [m["generation"] for m, _ in events_b.named(ins.LEASE_CLAIMED)]
    assert b_claims == [2]
    runner_b.stop()


# -- max runtime --------------------------------------------------------------------------------


@pytest.mark.contract("tasks-extension-lifecycle")
async def test_max_runtime_fails_the_task_and_cancels_the_worker(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env = await start_env(
        nursery, task_support={"forever": "required"}, runner_options={"max_runtime_ms": 5_000}
    )
    cancelled_at: list[float] = []

    @env.app.tool()
    async def forever() -> str:
        """Never returns on its own."""
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            cancelled_at.append(trio.current_time())
            raise

    task_id = await env.create("forever")
    detail = await env.wait_status(task_id, "failed")
    assert detail["error"] == {"code": -32603, "message": "Task exceeded its maximum runtime"}
    assert detail["statusMessage"] == "Task exceeded its maximum runtime"
    assert detail["lastUpdatedAt"] == format_instant(START_US + 5_000_000)
    assert "result" not in detail
    assert cancelled_at == [5.0]
    assert await wait_stops(env.events, task_id) == [
        {
            "task_id": task_id,
            "outcome": "max_runtime",
            "store_outcome": "applied",
            "release_outcome": "ok",
            "source": "request",
            "tool": "forever",
        }
    ]
    assert env.history_kinds(task_id) == ["failed"]


async def test_a_stopped_attempt_that_shields_its_exit_is_not_heartbeated_any_more(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """The heartbeat belongs to the attempt: once the attempt is stopped (here: cancelled at
    2.5 s) no renewal happens, even while the worker takes 20 s to exit."""
    env = await start_env(
        nursery,
        task_support={"stubborn": "required"},
        runner_options={"lease_ms": 3_000, "heartbeat_ms": 1_000},
    )
    exited_at: list[float] = []

    @env.app.tool()
    async def stubborn() -> str:
        """Shields its cleanup from cancellation."""
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(20)
            exited_at.append(trio.current_time())

    task_id = await env.create("stubborn")
    await trio.sleep_until(2.5)
    await env.result("tasks/cancel", {"taskId": task_id})
    assert exited_at == [22.5]  # the cancel waits for the attempt to exit
    renewed = [md["task_id"] for _, md in env.named(ins.LEASE_RENEWED)]
    assert renewed == [task_id, task_id]  # at 1 s and 2 s, none after the stop
    assert [md["outcome"] for md in await wait_stops(env.events, task_id)] == ["cancelled"]


async def test_staggered_attempts_each_get_their_own_exact_runtime_limit(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """One timer serves every attempt: a limit shorter than the heartbeat, attempts started at
    different times, and each is stopped exactly max_runtime_ms after its own start."""
    env = await start_env(
        nursery,
        task_support={"forever": "required"},
        runner_options={"max_runtime_ms": 1_500, "lease_ms": 30_000},
    )
    cancelled_at: dict[str, float] = {}

    @env.app.tool()
    async def forever(ctx: Context) -> str:
        """Never returns on its own."""
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            assert ctx.task_id is not None
            cancelled_at[ctx.task_id] = trio.current_time()
            raise

    first = await env.create("forever")
    await trio.sleep_until(1.0)
    second = await env.create("forever")
    await trio.sleep_until(1.25)
    third = await env.create("forever")
    for task_id in (first, second, third):
        await env.wait_status(task_id, "failed")
    assert cancelled_at == {first: 1.5, second: 2.5, third: 2.75}
    assert env.named(ins.LEASE_RENEWED) == []  # all ended before their first heartbeat (10 s)


async def test_an_attempt_that_ends_before_its_first_heartbeat_never_renews(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env = await start_env(
        nursery, task_support={"short": "required"}, runner_options={"lease_ms": 3_000}
    )

    @env.app.tool()
    async def short() -> str:
        """Ends just before its first heartbeat is due."""
        await trio.sleep(0.999)
        return "done"

    task_id = await env.create("short")
    await env.wait_status(task_id, "completed")
    await trio.sleep(10)
    assert env.named(ins.LEASE_RENEWED) == []
    assert env.runner.statistics().jobs == 0


# -- reaping ------------------------------------------------------------------------------------


@pytest.mark.contract("tasks-extension-lifecycle")
async def test_reaping_happens_exactly_at_created_at_plus_ttl(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env = await start_env(
        nursery, task_support={"forever": "required"}, tasks_options={"ttl_ms": 5_000}
    )
    cancelled_at: list[float] = []

    @env.app.tool()
    async def forever() -> str:
        """Runs until stopped."""
        try:
            await trio.sleep_forever()
        finally:
            cancelled_at.append(trio.current_time())

    await trio.sleep_until(1.0)
    task_id = await env.create("forever")
    created = await env.get(task_id)
    assert created["createdAt"] == format_instant(START_US + 1_000_000)
    assert created["ttlMs"] == 5_000

    await trio.sleep_until(5.999)  # one millisecond before createdAt + ttlMs
    assert (await env.get(task_id))["status"] == "working"
    assert await env.runner.reap_once() == []
    assert env.runner.active_task_ids() == [task_id]

    await trio.sleep_until(6.0)  # the boundary instant counts as expired
    unknown = {"code": -32602, "message": UNKNOWN_TASK}
    assert await env.error("tasks/get", {"taskId": task_id}) == unknown
    assert await env.error("tasks/cancel", {"taskId": task_id}) == unknown
    assert cancelled_at == []  # expiry alone hides it; reaping deletes and stops it
    assert await env.runner.reap_once() == [task_id]
    assert cancelled_at == [6.0]
    assert env.runner.active_task_ids() == []
    assert [md["outcome"] for md in await wait_stops(env.events, task_id)] == ["expired"]
    assert await env.memory.claim(task_id, "anyone", 1_000) is NOT_FOUND
    assert env.memory.history(task_id) == []
    assert await env.error("tasks/get", {"taskId": task_id}) == unknown


@pytest.mark.contract("tasks-extension-lifecycle")
async def test_periodic_reaping_and_a_null_ttl_is_never_reaped(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    from tritask.tasks.extension import TaskOptions

    env = await start_env(
        nursery,
        task_support={
            "short": ("required", TaskOptions(ttl_ms=2_500)),
            "forever": ("required", TaskOptions(ttl_ms=None)),
        },
        runner_options={"reap_interval_ms": 1_000},
    )

    @env.app.tool()
    async def short() -> str:
        """Done at once."""
        return "short"

    @env.app.tool()
    async def forever() -> str:
        """Done at once, kept forever."""
        return "kept"

    short_id = await env.create("short")
    kept_id = await env.create("forever")
    assert (await env.get(kept_id))["ttlMs"] is None
    await trio.sleep(2.4)
    assert (await env.get(short_id))["status"] == "completed"
    await trio.sleep(0.7)  # the tick at t=3 s reaps it (expired since t=2.5 s)
    assert env.named(ins.TASKS_REAPED) == [({"count": 1}, {})]
    assert env.memory.history(short_id) == []
    autojump_clock.jump(10 * 365 * 24 * 3600)  # ten years later
    assert await env.runner.reap_once() == []
    assert (await env.get(kept_id))["status"] == "completed"
    assert len(env.named(ins.TASKS_REAPED)) == 1


# -- shutdown hygiene ---------------------------------------------------------------------------


def _count_tasks(task: trio.lowlevel.Task) -> int:
    return 1 + sum(
        _count_tasks(child) for nursery in task.child_nurseries for child in nursery.child_tasks
    )


@pytest.mark.contract("tasks-extension-lifecycle")
async def test_nothing_outlives_a_stopped_runner_and_every_lease_is_released(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore(scope="shared", clock=TrioClock(START_US))
    parked = trio.Event()

    async def script(work: Work, token: ExecutionToken) -> Any:
        kind = work.input["kind"]
        if kind == "running":
            await trio.sleep_forever()
        if kind == "parked":
            parked.set()
            await token.await_input("k", ASK)
        if kind == "retrying":
            return Retry({"code": -32000, "message": "again"}, "retrying")
        return Completed({"content": [], "isError": False})

    executor = ScriptedExecutor(script)
    events = RecordingInstrumentation()
    runner = Runner(
        store, executor=executor, instrumentation=events, reap_interval_ms=1_000, recover=True
    )
    root = trio.lowlevel.current_root_task()
    assert root is not None
    tasks_before = _count_tasks(root)
    threads_before = threading.active_count()
    generations: dict[str, int] = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        assert len(nursery.child_tasks) == 1
        for kind in ("running", "parked", "retrying", "done"):
            policy = RetryPolicy((60_000,)) if kind == "retrying" else RetryPolicy.none()
            work = Work(idempotency_key=kind, type="job", input={"kind": kind}, retry_policy=policy)
            await create_raw(store, runner, kind, work=work)
        await parked.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(runner.active_task_ids()) == ["parked", "running"]
        assert runner.statistics().scheduled_retries == 1
        assert _count_tasks(root) > tasks_before
        for task_id in ("running", "parked"):
            generations[task_id] = 1
        runner.stop()
        await runner.wait_stopped()
    assert len(nursery.child_tasks) == 0
    assert _count_tasks(root) == tasks_before
    assert threading.active_count() == threads_before
    assert runner.active_task_ids() == []
    assert runner.statistics().scheduled_retries == 0
    stopped = {md["task_id"]: md for _, md in events.named(ins.JOB_STOP)}
    assert stopped["running"]["outcome"] == "runner_stopped"
    assert stopped["parked"]["outcome"] == "runner_stopped"
    assert {md["release_outcome"] for md in stopped.values()} == {"ok"}
    # Every lease was released: a fresh owner claims immediately, at generation + 1.
    for task_id, generation in generations.items():
        claimed = await store.claim(task_id, "fresh-owner", 1_000)
        assert isinstance(claimed, Claimed), claimed
        assert claimed.lease.generation == generation + 1
    # The retrying task's lease was released too; only its retry deadline holds it back.
    deferred = await store.claim("retrying", "fresh-owner", 1_000)
    # (the retry was committed 1 ms after creation at the same clock reading: commit times
    # strictly increase per task)
    assert deferred == Deferred(60_001)
    await trio.sleep(60.001)
    claimed = await store.claim("retrying", "fresh-owner", 1_000)
    assert isinstance(claimed, Claimed) and claimed.lease.generation == 2
    snapshot = await raw_snapshot(store, "done")
    assert isinstance(snapshot, Snapshot) and snapshot.task.status == "completed"
    with pytest.raises(RuntimeError):
        await runner.run()


# -- the store is never timed out by its callers ------------------------------------------------


@pytest.mark.contract("tasks-store-hardening")
async def test_cancel_waits_for_the_authoritative_answer_of_a_slow_store(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    delay = 605.0

    async def hook(op: str, args: tuple[Any, ...]) -> None:
        await trio.lowlevel.checkpoint()
        if op == "transition" and args[2].kind is EventKind.CANCELLED:
            await trio.sleep(delay)

    env = await start_env(
        nursery, task_support={"forever": "required"}, store=lambda m: HookedStore(m, hook)
    )
    cancelled_at: list[float] = []

    @env.app.tool()
    async def forever() -> str:
        """Runs until cancelled."""
        try:
            await trio.sleep_forever()
        finally:
            cancelled_at.append(trio.current_time())

    task_id = await env.create("forever")
    started = trio.current_time()
    ack = await env.result("tasks/cancel", {"taskId": task_id})
    assert trio.current_time() - started == delay
    assert {k: v for k, v in ack.items() if k != "_meta"} == {"resultType": "complete"}
    # Commit first, then stop: the worker ran (and heartbeated) all through the slow commit.
    assert cancelled_at == [delay]
    assert len(env.named(ins.LEASE_RENEWED)) == 60
    detail = await env.get(task_id)
    assert detail["status"] == "cancelled"
    assert detail["statusMessage"] == "Cancellation requested"
    assert detail["lastUpdatedAt"] == format_instant(START_US + int(delay * 1_000_000))
    assert env.history_kinds(task_id) == ["cancelled"]
    assert [md["outcome"] for md in await wait_stops(env.events, task_id)] == ["cancelled"]


@pytest.mark.contract("tasks-store-hardening")
async def test_a_slow_store_delays_completion_without_any_timeout(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """A worker's settle waits for the store however long it takes (no caller-side deadline)."""

    async def hook(op: str, args: tuple[Any, ...]) -> None:
        await trio.lowlevel.checkpoint()
        if op == "transition" and args[2].kind is EventKind.COMPLETED:
            await trio.sleep(90)

    env = await start_env(
        nursery,
        task_support={"quick": "required"},
        store=lambda m: HookedStore(m, hook),
        runner_options={"lease_ms": 120_000},
    )

    @env.app.tool()
    async def quick() -> str:
        """Returns at once."""
        return "quick"

    task_id = await env.create("quick")
    await trio.sleep(89)
    assert (await env.get(task_id))["status"] == "working"
    detail = await env.wait_status(task_id, "completed")
    assert detail["lastUpdatedAt"] == format_instant(START_US + 90_000_000)
    assert env.history_kinds(task_id) == ["completed"]


# -- runner-level odds and ends -----------------------------------------------------------------


@pytest.mark.contract("tasks-extension-lifecycle")
async def test_runner_refuses_work_when_not_running_and_validates_options() -> None:
    store = MemoryStore(scope="shared")
    runner = Runner(store)
    from tritask.tasks.runner import RunnerNotRunning

    with pytest.raises(RunnerNotRunning):
        await create_raw(store, runner, "t1")
    for options in (
        {"lease_ms": 0},
        {"lease_ms": 1_000, "heartbeat_ms": 1_000},
        {"max_jobs": 0},
        {"owner_id": ""},
        {"recovery_batch_size": 0},
    ):
        with pytest.raises(ValueError):
            Runner(store, **options)
    assert ANONYMOUS.principal is None


# -- several runners on one store ---------------------------------------------------------------


async def _second_node(env: Env, nursery: trio.Nursery, **runner_kw: Any) -> tuple[App, Runner]:
    """Another process serving the same app on the same store, with its own runner."""
    runner = Runner(env.memory, owner_id="node-b", reap_interval_ms=None, **runner_kw)
    await nursery.start(runner.run)
    app = App("tasks-test", "0.1.0", state_key=TEST_STATE_KEY)
    app.tools = env.app.tools
    app.add_extension(Tasks(store=env.memory, runner=runner, task_support={}))
    return app, runner


@pytest.mark.contract("tasks-extension-lifecycle")
async def test_an_answer_accepted_by_another_node_reaches_the_worker_at_its_heartbeat(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env = await start_env(
        nursery, task_support={"confirm": "required"}, runner_options={"heartbeat_ms": 2_000}
    )

    @env.app.tool()
    async def confirm(ctx: Context) -> str:
        """Asks once."""
        answer = await ctx.await_input("ok", ASK)
        return f"answer {answer['action']} at {trio.current_time()}"

    task_id = await env.create("confirm", caps=ELICIT_CAPS)
    await env.wait_status(task_id, "input_required")
    app_b, _ = await _second_node(env, nursery)
    await trio.sleep_until(4.5)
    update = request(
        "tasks/update",
        {"taskId": task_id, "inputResponses": {"ok": {"action": "accept"}}},
        caps=ELICIT_CAPS,
    )
    response = await Dispatcher(app_b).handle_request(update)
    assert response["result"]["resultType"] == "complete"
    assert (await env.get(task_id))["status"] == "working"  # accepted by the store at once
    detail = await env.wait_status(task_id, "completed")
    # Node A's attempt got it from the store's inbox at its next heartbeat (t = 6 s).
    assert detail["result"]["content"] == [{"type": "text", "text": "answer accept at 6.0"}]
    assert env.history_kinds(task_id) == [
        "input_requested",
        "input_responses_accepted",
        "completed",
    ]


@pytest.mark.contract("tasks-extension-lifecycle")
async def test_a_cancel_through_another_node_stops_the_attempt_at_its_heartbeat(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    env = await start_env(
        nursery, task_support={"forever": "required"}, runner_options={"heartbeat_ms": 2_000}
    )
    stopped_at: list[float] = []

    @env.app.tool()
    async def forever() -> str:
        """Runs until stopped."""
        try:
            await trio.sleep_forever()
        finally:
            stopped_at.append(trio.current_time())

    task_id = await env.create("forever")
    app_b, _ = await _second_node(env, nursery)
    await trio.sleep_until(3.0)
    response = await Dispatcher(app_b).handle_request(request("tasks/cancel", {"taskId": task_id}))
    assert response["result"]["resultType"] == "complete"
    assert (await env.get(task_id))["status"] == "cancelled"
    assert stopped_at == []  # node B has no attempt to stop; node A learns at its heartbeat
    await trio.sleep_until(4.5)
    (stop,) = await wait_stops(env.events, task_id)
    assert stopped_at == [4.0]
    assert (stop["outcome"], stop["release_outcome"]) == ("cancelled", "ok")
    assert env.history_kinds(task_id) == ["cancelled"]


# -- the extension's own lifespan ---------------------------------------------------------------


@pytest.mark.contract("tasks-extension-lifecycle")
async def test_serving_lifespan_opens_and_fully_stops_its_store_and_runner(
    autojump_clock: trio.testing.MockClock,
) -> None:
    events = RecordingInstrumentation()
    tasks = Tasks(task_support={"forever": "required"}, runner_options={"instrumentation": events})
    app = App("tasks-test", "0.1.0", state_key=TEST_STATE_KEY, extensions=[tasks])
    stopped: list[float] = []

    @app.tool()
    async def forever() -> str:
        """Runs until the server stops."""
        try:
            await trio.sleep_forever()
        finally:
            stopped.append(trio.current_time())

    root = trio.lowlevel.current_root_task()
    assert root is not None
    before = _count_tasks(root)
    async with app.running(ServeEnvironment(store_url="memory:")):
        _, runner = tasks.parts()  # both open (InternalError otherwise)
        assert (runner.running,) == (True,)  # a tuple: mypy would keep the narrowing
        response = await Dispatcher(app).handle_request(
            request("tools/call", {"name": "forever", "arguments": {}})
        )
        task_id = response["result"]["taskId"]
        await trio.sleep(5)
        assert runner.active_task_ids() == [task_id]
    assert stopped == [5.0]
    assert _count_tasks(root) == before
    assert tasks.store is None and tasks.runner is None
    assert not runner.running
    assert [md["outcome"] for _, md in events.named(ins.JOB_STOP)] == ["runner_stopped"]
    assert [md["release_outcome"] for _, md in events.named(ins.JOB_STOP)] == ["ok"]


# -- retries and cooperative cancellation --------------------------------------------------------


@pytest.mark.contract("tasks-retry-policy")
async def test_retries_follow_the_store_deadline_exactly_then_exhaust(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore(scope="shared", clock=TrioClock(START_US))
    times: dict[str, list[float]] = {}

    async def script(work: Work, token: ExecutionToken) -> Any:
        attempts = times.setdefault(token.task_id, [])
        attempts.append(trio.current_time())
        if work.input["succeed_on"] == len(attempts):
            return Completed({"content": [], "isError": False})
        return Retry({"code": -32000, "message": f"try {len(attempts)}"}, f"retry {len(attempts)}")

    events = RecordingInstrumentation()
    async with Runner(
        store, executor=ScriptedExecutor(script), instrumentation=events, reap_interval_ms=None
    ) as runner:
        policy = RetryPolicy((1_000, 2_000))
        for task_id, succeed_on in (("recovers", 3), ("exhausts", 0)):
            work = Work(
                idempotency_key=task_id,
                type="job",
                input={"succeed_on": succeed_on},
                retry_policy=policy,
            )
            await create_raw(store, runner, task_id, work=work)
        await trio.sleep(10)
        # Each retry is due at commit time + delay on the store's clock (commits are +1 ms
        # monotonic when they share a clock reading with the previous one).
        assert times == {"recovers": [0.0, 1.001, 3.001], "exhausts": [0.0, 1.001, 3.001]}
        done = await raw_snapshot(store, "recovers")
        failed = await raw_snapshot(store, "exhausts")
        assert isinstance(done, Snapshot) and isinstance(failed, Snapshot)
        assert done.task.status == "completed" and done.retry_count == 2
        assert failed.task.status == "failed"
        assert failed.task.error == {"code": -32000, "message": "try 3"}
        assert failed.task.status_message == "retry 3"
        assert failed.retry_at is None
        assert [m["delay_ms"] for m, _ in events.named(ins.RETRY_SCHEDULED)] == [
            1_000,
            1_000,
            2_000,
            2_000,
        ]
        assert [kind for kind in (e.event.kind.value for e in store.history("exhausts"))] == [
            "retry_requested",
            "retry_requested",
            "retry_requested",
        ]
        sources = [md["source"] for _, md in events.named(ins.JOB_START)]
        assert sources == ["request", "request", "retry", "retry", "retry", "retry"]


@pytest.mark.contract("tasks-extension-lifecycle")
async def test_cancel_reaches_work_in_a_thread_through_the_token() -> None:
    """Real clock: a thread cannot be interrupted, so it polls the token the runner sets."""
    import time

    store = MemoryStore(scope="shared")
    seen: list[str] = []

    def blocking(token: ExecutionToken) -> str:
        deadline = time.monotonic() + 10
        while not token.cancelled and time.monotonic() < deadline:
            time.sleep(0.001)
        seen.append("cancelled" if token.cancelled else "timed out")
        return "thread done"

    started = trio.Event()

    async def script(work: Work, token: ExecutionToken) -> Any:
        started.set()
        text = await token.run_in_thread(blocking)
        return Completed({"content": [{"type": "text", "text": text}], "isError": False})

    events = RecordingInstrumentation()
    async with Runner(
        store, executor=ScriptedExecutor(script), instrumentation=events, reap_interval_ms=None
    ) as runner:
        await create_raw(store, runner, "threaded")
        await started.wait()
        access = await store.authorize(ANONYMOUS, Action.CANCEL, "threaded")
        with trio.fail_after(5):
            result = await runner.cancel("threaded", access)
        assert seen == ["cancelled"]  # cancel returned only after the thread saw the flag
        assert isinstance(result, Snapshot) and result.task.status == "cancelled"
    assert [md["outcome"] for _, md in events.named(ins.JOB_STOP)] == ["cancelled"]
    assert store.history("threaded")[-1].event.kind is EventKind.CANCELLED
    assert len(store.history("threaded")) == 1


# -- values crossing the runner and the store -----------------------------------------------------


async def test_what_callers_and_executors_keep_cannot_change_a_stored_task(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Every value is copied once where it crosses into the runtime: the work a caller hands to
    ``create_task``, the snapshot it gets back, the result an executor returns (and keeps) and
    the work it is given; mutating any of them afterwards changes nothing stored."""
    kept: list[dict[str, Any]] = []
    done = trio.Event()

    async def script(work: Work, token: ExecutionToken) -> Completed:
        work.input["arguments"]["n"].append("from the executor")
        result: dict[str, Any] = {"content": [{"type": "text", "text": "ok"}], "isError": False}
        kept.append(result)
        done.set()
        return Completed(result)

    store = MemoryStore(scope="shared", clock=TrioClock(START_US))
    events = RecordingInstrumentation()
    runner = Runner(store, executor=ScriptedExecutor(script), instrumentation=events)
    async with store, runner:
        arguments: dict[str, Any] = {"n": [1, 2]}
        work = Work(
            idempotency_key="t1", type="tools/call", input={"name": "x", "arguments": arguments}
        )
        created = await create_raw(store, runner, "t1", work=work)
        arguments["n"].append(3)
        work.input["name"] = "changed by the caller"
        assert created.work is not None
        created.work.input["arguments"]["n"].clear()
        await done.wait()
        (stop,) = await wait_stops(events, "t1")
        assert stop["outcome"] == "completed"
        kept[0]["content"].clear()
        kept[0]["isError"] = True
        stored = await raw_snapshot(store, "t1")
        assert isinstance(stored, Snapshot)
        assert stored.task.status.value == "completed"
        assert stored.task.result == {"content": [{"type": "text", "text": "ok"}], "isError": False}
        assert stored.work is not None
        assert stored.work.input == {"name": "x", "arguments": {"n": [1, 2]}}
