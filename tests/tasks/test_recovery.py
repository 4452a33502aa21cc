"""Recovery and claims (reference 5.3, 5.4, 7): recovering runners adopt unclaimed work, a
hard-killed runner's claims are reclaimed after their lease at a higher generation with the
same idempotency key, stale attempts are fenced, ``start_task`` is idempotent, a replaced
attempt that ignores cancellation is waited for, accepted input is replayed, and tools that
cannot be restarted fail clearly.

A "hard kill" is simulated by cancelling the nursery a runner runs in while its store wrapper
drops every ``release``: the claim stays behind exactly as a crashed process leaves it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Self

import pytest
import trio
import trio.testing
from helpers import (
    ANONYMOUS,
    ELICIT_CAPS,
    START_US,
    Env,
    HookedStore,
    ScriptedExecutor,
    no_hook,
    raw_snapshot,
    start_env,
    wait_stops,
)

from tritask.server.context import Context
from tritask.server.mrtr import elicitation
from tritask.tasks import TrioClock
from tritask.tasks import instrumentation as ins
from tritask.tasks.events import Event
from tritask.tasks.executor import Completed, ExecutionToken, Outcome, StaleAttempt
from tritask.tasks.instrumentation import RecordingInstrumentation
from tritask.tasks.memory import MemoryStore
from tritask.tasks.model import Snapshot, TaskStatus, new_task
from tritask.tasks.runner import NO_EXECUTOR, Runner
from tritask.tasks.store import (
    UNAVAILABLE,
    Action,
    Claimed,
    Deferred,
    Lease,
    NotFound,
    StaleLease,
    Store,
    Unavailable,
    WorkerAuthority,
)
from tritask.tasks.work import Work

pytestmark = pytest.mark.contract("tasks-recovery-claims")

DONE: dict[str, Any] = {"content": [{"type": "text", "text": "done"}], "isError": False}
ASK = {"method": "elicitation/create", "params": {"message": "Proceed?"}}
CONFIRM = elicitation("Confirm?", {"type": "object"})
OTHER = elicitation("Something else?", {"type": "object"})


class ClaimRecorder(HookedStore):
    """Keeps every lease the wrapped store granted through this wrapper."""

    def __init__(self, inner: Store, hook: Any = no_hook) -> None:
        super().__init__(inner, hook)
        self.leases: list[Lease] = []

    async def claim(
        self, task_id: str, owner_id: str, lease_ms: int
    ) -> Claimed | Deferred | Unavailable | NotFound:
        result = await super().claim(task_id, owner_id, lease_ms)
        if isinstance(result, Claimed):
            self.leases.append(result.lease)
        return result

    async def claim_next(self, owner_id: str, lease_ms: int) -> Claimed | None:
        result = await super().claim_next(owner_id, lease_ms)
        if result is not None:
            self.leases.append(result.lease)
        return result

    async def __aenter__(self) -> Self:
        return self


class NeverReleases(ClaimRecorder):
    """What a killed process leaves behind: once ``dead``, its releases never reach the store."""

    def __init__(self, inner: Store, *, dead: bool = True) -> None:
        super().__init__(inner)
        self.dead = dead

    async def release(self, lease: Lease) -> None:
        if not self.dead:
            return await super().release(lease)
        self.calls.append("release")
        await trio.lowlevel.checkpoint()


def memory_store() -> MemoryStore:
    return MemoryStore(scope="shared", clock=TrioClock(START_US))


async def create_unclaimed(store: Store, task_id: str, **data: Any) -> Snapshot:
    """Store a task the way a crashed creator leaves it: accepted, never claimed."""
    access = await store.authorize(ANONYMOUS, Action.CREATE, task_id)
    task = new_task(task_id, await store.now(), 3_600_000, 100)
    work = Work(idempotency_key=task_id, type="job", input={"task": task_id, **data})
    return await store.create(task, work, access)


async def snapshot_of(store: Store, task_id: str) -> Snapshot:
    snapshot = await raw_snapshot(store, task_id)
    assert isinstance(snapshot, Snapshot), snapshot
    return snapshot


def kinds(store: MemoryStore, task_id: str) -> list[str]:
    return [entry.event.kind.value for entry in store.history(task_id)]


async def start_killable(nursery: trio.Nursery, runner: Runner) -> trio.CancelScope:
    """Run ``runner`` in its own nursery; cancelling the returned scope kills it abruptly."""

    async def host(*, task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        async with trio.open_nursery() as inner:
            await inner.start(runner.run)
            task_status.started(inner.cancel_scope)

    scope: trio.CancelScope = await nursery.start(host)
    return scope


# -- adopting unclaimed work --------------------------------------------------------------------


@pytest.mark.parametrize("configured", [True, False])
async def test_a_fresh_recovering_runner_completes_unclaimed_work_in_creation_order(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, configured: bool
) -> None:
    memory = memory_store()
    for at, task_id in ((0.0, "b"), (0.5, "a"), (1.0, "c")):
        await trio.sleep_until(at)
        await create_unclaimed(memory, task_id)
    await trio.sleep_until(2.0)
    seen: list[tuple[str, int, bool, float, Work]] = []

    async def script(work: Work, token: ExecutionToken) -> Outcome:
        seen.append((token.task_id, token.generation, token.recovered, trio.current_time(), work))
        return Completed({**DONE, "structuredContent": {"key": token.idempotency_key}})

    events = RecordingInstrumentation()
    runner = Runner(
        memory,
        executor=ScriptedExecutor(script) if configured else None,
        recover=True,
        recovery_batch_size=2,
        recovery_interval_ms=1_000,
        reap_interval_ms=None,
        instrumentation=events,
    )
    await nursery.start(runner.run)
    await trio.sleep_until(10)
    starts = [(md["task_id"], md["source"]) for _, md in events.named(ins.JOB_START)]
    # Two per pass (the batch size), oldest first: b and a at 2 s; c when the first of them
    # frees its slot (a finished attempt claims queued work at once), not at the next tick.
    assert starts == [("b", "recovery"), ("a", "recovery"), ("c", "recovery")]
    claimed = [(md["task_id"], m["generation"]) for m, md in events.named(ins.LEASE_CLAIMED)]
    assert claimed == [("b", 1), ("a", 1), ("c", 1)]
    if configured:
        assert [s[:4] for s in seen] == [
            ("b", 1, True, 2.0),
            ("a", 1, True, 2.0),
            ("c", 1, True, 2.0),
        ]
        for task_id, _, _, _, work in seen:
            # The executor gets exactly the persisted work, keyed by the task id.
            assert work == (await snapshot_of(memory, task_id)).work
            assert work.idempotency_key == task_id
    for task_id in ("a", "b", "c"):
        snapshot = await snapshot_of(memory, task_id)
        if configured:
            assert snapshot.task.status is TaskStatus.COMPLETED
            assert snapshot.task.result == {**DONE, "structuredContent": {"key": task_id}}
        else:
            # Recovered work needs an executor; without one it fails clearly, once.
            assert snapshot.task.status is TaskStatus.FAILED
            assert snapshot.task.error == {"code": -32603, "message": NO_EXECUTOR}
            assert snapshot.task.status_message == NO_EXECUTOR
        assert len(memory.history(task_id)) == 1
    runner.stop()


# -- a hard-killed runner -----------------------------------------------------------------------


async def test_a_hard_killed_runners_work_is_reclaimed_after_its_lease_and_its_lease_is_fenced(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    memory = memory_store()
    dying = NeverReleases(memory)
    attempts: list[tuple[str, str, int, float]] = []

    async def script(work: Work, token: ExecutionToken) -> Outcome:
        attempts.append(
            (work.idempotency_key, token.idempotency_key, token.generation, trio.current_time())
        )
        if token.generation == 1:
            await trio.sleep_forever()  # in flight when its runner dies
        return Completed(DONE)

    runner_a = Runner(
        dying,
        executor=ScriptedExecutor(script),
        owner_id="runner-a",
        lease_ms=3_000,
        reap_interval_ms=None,
    )
    kill_a = await start_killable(nursery, runner_a)
    await create_unclaimed(memory, "t1")
    await runner_a.start_task("t1")
    await trio.sleep_until(0.5)
    kill_a.cancel()
    await runner_a.wait_stopped()
    (dead_lease,) = dying.leases
    assert (dead_lease.generation, dead_lease.expires_at) == (1, START_US + 3_000_000)
    assert dying.calls.count("release") == 1  # attempted, and lost with the process
    # The dead claim still blocks everyone until its deadline.
    assert await memory.claim("t1", "intruder", 1_000) is UNAVAILABLE

    store_b = ClaimRecorder(memory)
    events = RecordingInstrumentation()
    runner_b = Runner(
        store_b,
        executor=ScriptedExecutor(script),
        owner_id="runner-b",
        recover=True,
        lease_ms=3_000,
        recovery_interval_ms=500,
        reap_interval_ms=None,
        instrumentation=events,
    )
    await nursery.start(runner_b.run)
    await trio.sleep_until(2.999)
    assert store_b.leases == []  # ticks at 0.5 ... 2.5 s found nothing claimable
    await trio.sleep_until(4)
    (new_lease,) = store_b.leases
    assert new_lease.generation == 2
    assert new_lease.owner_id == "runner-b"
    # Same idempotency key on both attempts (work and token), at least once: two executions.
    assert attempts == [("t1", "t1", 1, 0.0), ("t1", "t1", 2, 3.0)]
    assert [md["source"] for _, md in events.named(ins.JOB_START)] == ["recovery"]
    done = await snapshot_of(memory, "t1")
    assert done.task.status is TaskStatus.COMPLETED
    assert kinds(memory, "t1") == ["completed"]

    # Anything still holding the dead runner's lease is refused by the store.
    failure = Event.failed({"code": -32603, "message": "late"}, "late")
    with pytest.raises(StaleLease):
        await memory.transition("t1", done.revision, failure, WorkerAuthority(dead_lease))
    with pytest.raises(StaleLease):
        await memory.worker_snapshot("t1", dead_lease)
    with pytest.raises(StaleLease):
        await memory.renew(dead_lease, 3_000)
    with pytest.raises(StaleLease):
        await memory.release(dead_lease)
    assert kinds(memory, "t1") == ["completed"]
    runner_b.stop()


# -- replacement of an attempt that ignores cancellation ----------------------------------------


@pytest.mark.parametrize(
    ("shield", "replacement"),
    [
        # exits at 3.7 s, while the generation-2 claim (3 s .. 6 s) lives: it runs the work
        (0.7, 2),
        (2.5, 2),
        # exits at 8 s, after the generation-2 claim lapsed: that claim is never used (its
        # renewal is refused), and the recovery pass claims generation 3 at once
        (5.0, 3),
    ],
)
@pytest.mark.contract("tasks-store-hardening")
async def test_a_replaced_attempt_that_shields_itself_is_waited_for_and_then_fenced(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, shield: float, replacement: int
) -> None:
    """Generation 1's heartbeat hangs in the store, so its lease lapses at 3 s and the runner's
    own recovery reclaims the task (generation 2). The old attempt ignores cancellation for a
    while (a trio shield: the analogue of a process trapping exits); the replacement starts
    only after it has exited. On its way out the old attempt is refused input and its result
    is dropped."""

    async def hook(op: str, args: tuple[Any, ...]) -> None:
        await trio.lowlevel.checkpoint()
        if op == "renew" and args[0].generation == 1:
            await trio.sleep_forever()

    memory = memory_store()
    store = ClaimRecorder(memory, hook)
    log: list[tuple[str, int, float]] = []

    async def script(work: Work, token: ExecutionToken) -> Outcome:
        generation = token.generation
        log.append(("start", generation, trio.current_time()))
        if generation == 1:
            with trio.CancelScope(shield=True):
                await trio.sleep(3 + shield)
                try:
                    await token.await_input("late", ASK)
                except StaleAttempt:
                    log.append(("input refused", generation, trio.current_time()))
            log.append(("exit", generation, trio.current_time()))
            return Completed({"content": [{"type": "text", "text": "late"}], "isError": False})
        log.append(("exit", generation, trio.current_time()))
        return Completed(DONE)

    events = RecordingInstrumentation()
    runner = Runner(
        store,
        executor=ScriptedExecutor(script),
        recover=True,
        lease_ms=3_000,
        recovery_interval_ms=500,
        reap_interval_ms=None,
        instrumentation=events,
    )
    await create_unclaimed(memory, "t1")
    await nursery.start(runner.run)
    await trio.sleep(15)
    exited = 3 + shield
    assert log == [
        ("start", 1, 0.0),
        ("input refused", 1, exited),
        ("exit", 1, exited),
        ("start", replacement, exited),
        ("exit", replacement, exited),
    ]
    assert [lease.generation for lease in store.leases] == list(range(1, replacement + 1))
    assert [m["generation"] for m, _ in events.named(ins.RECOVERY_RECLAIMED)] == [2]
    lost = [m["generation"] for m, _ in events.named(ins.LEASE_LOST)]
    assert lost == ([2] if replacement == 3 else [])
    stops = await wait_stops(events, "t1", 2)
    assert [(md["outcome"], md["store_outcome"], md["release_outcome"]) for md in stops] == [
        ("reclaimed", "not_settled", "error"),  # its lease had been superseded
        ("completed", "applied", "ok"),
    ]
    assert events.named(ins.FENCED_WRITE_REJECTED) == []  # the late result was never sent
    done = await snapshot_of(memory, "t1")
    assert done.task.result == DONE
    assert done.input_history == {}  # the refused request left no trace
    assert kinds(memory, "t1") == ["completed"]
    runner.stop()


# -- start_task after recovery ------------------------------------------------------------------


async def test_start_task_is_idempotent_after_recovery(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    memory = memory_store()
    release = trio.Event()

    async def script(work: Work, token: ExecutionToken) -> Outcome:
        await release.wait()
        return Completed(DONE)

    executor = ScriptedExecutor(script)
    events = RecordingInstrumentation()
    recovering = Runner(
        memory,
        executor=executor,
        recover=True,
        reap_interval_ms=None,
        instrumentation=events,
    )
    other = Runner(memory, executor=executor, reap_interval_ms=None, instrumentation=events)
    await create_unclaimed(memory, "t1")
    await nursery.start(recovering.run)
    await nursery.start(other.run)
    await trio.sleep(0.5)
    assert recovering.active_task_ids() == ["t1"]  # recovery won the race

    await recovering.start_task("t1")  # it already runs here: nothing happens
    await other.start_task("t1")  # held by a live claim elsewhere: nothing happens
    assert other.active_task_ids() == []
    assert len(executor.attempts) == 1

    release.set()
    await wait_stops(events, "t1")
    for runner in (recovering, other):
        await runner.start_task("t1")  # terminal: unavailable to everyone
    await trio.sleep(5)
    assert len(executor.attempts) == 1
    assert [m["generation"] for m, _ in events.named(ins.LEASE_CLAIMED)] == [1]
    assert [md["source"] for _, md in events.named(ins.JOB_START)] == ["recovery"]
    assert kinds(memory, "t1") == ["completed"]
    recovering.stop()
    other.stop()


# -- through the extension: input replay, key reuse, non-restartable tools ----------------------


async def _killable_env(nursery: trio.Nursery, **options: Any) -> tuple[Env, Callable[[], None]]:
    """The extension on runner A (lease 3 s), and a function that kills A: its nursery is
    cancelled and its releases are lost on the way out. See ``_recover``."""
    host = await nursery.start(_host)
    wrappers: list[NeverReleases] = []

    def wrap(memory: MemoryStore) -> Store:
        wrappers.append(NeverReleases(memory, dead=False))
        return wrappers[-1]

    env = await start_env(
        host, store=wrap, runner_options={"lease_ms": 3_000, "owner_id": "runner-a"}, **options
    )

    def kill() -> None:
        wrappers[0].dead = True
        host.cancel_scope.cancel()

    return env, kill


async def _host(*, task_status: trio.TaskStatus[trio.Nursery]) -> None:
    async with trio.open_nursery() as inner:
        task_status.started(inner)
        await trio.sleep_forever()


async def _recover(env: Env, nursery: trio.Nursery) -> Runner:
    """Runner B: a restarted process recovering on the same store, serving the same app."""
    runner = Runner(
        env.memory,
        owner_id="runner-b",
        recover=True,
        lease_ms=3_000,
        recovery_interval_ms=500,
        reap_interval_ms=None,
        instrumentation=env.events,
    )
    await nursery.start(runner.run)
    # The extension moves to B and B's store (A's was a wrapper of the same memory store);
    # store and runner must agree, so A is unwired first. B gets the app's ToolCallExecutor.
    env.tasks.runner = None
    env.tasks.store = env.memory
    env.tasks.runner = runner
    return runner


@pytest.mark.parametrize("same_request", [True, False])
async def test_accepted_input_survives_a_hard_kill_and_a_changed_request_is_refused(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, same_request: bool
) -> None:
    env, kill = await _killable_env(nursery, task_support={"confirm": "required"})
    attempts: list[tuple[str | None, float]] = []

    @env.app.tool()
    async def confirm(ctx: Context) -> str:
        """Asks once, then works for a long time."""
        attempts.append((ctx.idempotency_key, trio.current_time()))
        first = len(attempts) == 1
        answer = await ctx.await_input("confirm", CONFIRM if first or same_request else OTHER)
        if first:
            await trio.sleep_forever()  # killed after the answer was accepted
        return f"confirmed: {answer['action']} at {trio.current_time()}"

    task_id = await env.create("confirm", caps=ELICIT_CAPS)
    await env.wait_status(task_id, "input_required")
    update = {"taskId": task_id, "inputResponses": {"confirm": {"action": "accept"}}}
    await env.result("tasks/update", update, caps=ELICIT_CAPS)
    await trio.sleep_until(0.5)
    kill()
    await env.runner.wait_stopped()
    assert env.history_kinds(task_id) == ["input_requested", "input_responses_accepted"]

    runner_b = await _recover(env, nursery)
    detail = await env.wait_status(task_id, "completed", "failed")
    assert attempts == [(task_id, 0.0), (task_id, 3.0)]
    if same_request:
        # The recovered attempt got the persisted answer at once: no second request.
        assert detail["result"]["content"] == [{"type": "text", "text": "confirmed: accept at 3.0"}]
        last = "completed"
    else:
        message = "Input key 'confirm' was reused with a different request"
        assert detail["status"] == "failed"
        assert detail["error"] == {"code": -32603, "message": message}
        assert detail["statusMessage"] == message
        last = "failed"
    assert env.history_kinds(task_id) == ["input_requested", "input_responses_accepted", last]
    snapshot = await env.snapshot(task_id)
    assert snapshot.input_history == {"confirm": CONFIRM}
    runner_b.stop()


@pytest.mark.parametrize("stop", ["hard kill", "graceful stop"])
async def test_recovered_work_of_a_tool_that_is_not_restartable_fails_clearly(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, stop: str
) -> None:
    env, kill = await _killable_env(nursery, task_support={"export": "required"})
    runs: list[float] = []

    @env.app.tool(restartable=False)
    async def export(ctx: Context) -> str:
        """Holds request-only resources: it cannot be re-run from its work alone."""
        runs.append(trio.current_time())
        await trio.sleep(3_600)  # interrupted long before
        return "finished"

    task_id = await env.create("export")
    await trio.sleep_until(0.5)
    if stop == "hard kill":
        kill()  # the claim stays until its deadline (3 s)
    else:
        env.runner.stop()  # the claim is released: recovered at B's first tick (0.5 s)
    await env.runner.wait_stopped()

    runner_b = await _recover(env, nursery)
    detail = await env.wait_status(task_id, "failed")
    message = "Task tool export is not restartable; its work was lost in a restart"
    assert detail["error"] == {"code": -32603, "message": message}
    assert detail["statusMessage"] == message
    assert runs == [0.0]  # never re-run
    snapshot = await env.snapshot(task_id)
    recovered_at = 3.0 if stop == "hard kill" else 0.5
    assert snapshot.task.last_updated_at == START_US + int(recovered_at * 1_000_000)
    assert env.history_kinds(task_id) == ["failed"]
    starts = [md["source"] for _, md in env.named(ins.JOB_START)]
    assert starts == ["request", "recovery"]
    runner_b.stop()


@pytest.mark.parametrize(
    ("new_version", "message"),
    [
        ("renamed", "unknown argument 'width' for tool 'resize'"),
        ("explicit", "missing argument 'size' for tool 'resize'"),
    ],
)
async def test_recovered_work_that_no_longer_fits_its_tool_fails_naming_the_argument(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, new_version: str, message: str
) -> None:
    env, kill = await _killable_env(nursery, task_support={"resize": "required"})
    runs: list[str] = []

    async def resize_v1(width: int) -> str:
        """Version 1 takes a width."""
        runs.append(f"v1:{width}")
        await trio.sleep(3_600)  # interrupted long before
        return "resized"

    async def resize_v2(size: int) -> str:
        """Version 2 renamed it: stored v1 work cannot be called."""
        runs.append(f"v2:{size}")
        return "resized"

    env.app.add_tool(resize_v1, name="resize")
    task_id = await env.create("resize", {"width": 3})
    await trio.sleep_until(0.5)
    kill()
    await env.runner.wait_stopped()

    env.app.remove_tool("resize")
    if new_version == "renamed":
        env.app.add_tool(resize_v2, name="resize")
    else:  # an explicit schema that allows the old name but does not require the new one
        schema: dict[str, Any] = {"type": "object", "properties": {"size": {"type": "integer"}}}
        env.app.add_tool(resize_v2, name="resize", input_schema=schema)
    runner_b = await _recover(env, nursery)
    detail = await env.wait_status(task_id, "failed")
    expected = f"Task work does not fit tool resize: {message}"
    assert detail["error"]["code"] == -32602
    assert detail["error"]["message"] == expected
    assert detail["statusMessage"] == expected
    assert runs == ["v1:3"]  # version 2 never ran
    runner_b.stop()
