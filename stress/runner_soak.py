"""``runner``: R rounds of N tasks through real Runners, with outcomes chosen by the seed.

Kinds (each round covers every kind at least once when N allows):

* ``complete``: the executor returns a result;
* ``tool_error``: a ``CallToolResult`` with ``isError`` (the task still completes);
* ``fail``: ``Failed`` (terminal ``failed``);
* ``retry``: ``Retry`` once or twice (a small fixed ``RetryPolicy``), then a result;
* ``input``: ``await_input`` on the token, answered by ``runner.update``;
* ``cancel``: the attempt hangs until ``runner.cancel`` stops it;
* ``lease_loss``: runner A's heartbeat for the task hangs (a partition) while its attempt is
  stuck; once the lease has expired, runner B (``recover_once``) reclaims the task and completes
  it; then the partition heals and A's late attempt must be fenced off.

Runner A holds the whole batch live at once (every first attempt waits for a common "go"), so
``max_jobs`` is sized to the batch and ``peakJobs`` must reach it. Invariants come from the
runners' ``RecordingInstrumentation``, their ``statistics()``, the store's final snapshots and a
count of the trio tasks under the harness nursery before and after every round.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any, Final

import attrs
import trio

from stress.common import Checks, Progress, StressFailure
from stress.wrappers import PartitionedStore
from tritask.tasks import instrumentation as ins
from tritask.tasks.executor import Completed, ExecutionToken, Failed, Outcome, Retry
from tritask.tasks.instrumentation import RecordingInstrumentation
from tritask.tasks.model import Snapshot, TaskStatus, new_task
from tritask.tasks.runner import Runner
from tritask.tasks.store import Action, NotFound, Store
from tritask.tasks.work import JSONObject, RetryPolicy, Work

__all__ = ["KINDS", "RunnerParams", "TaskSpec", "plan_round", "run_runner"]

KINDS: Final = ("complete", "tool_error", "fail", "retry", "input", "cancel", "lease_loss")
EXPECTED_STATUS: Final = {
    "complete": TaskStatus.COMPLETED,
    "tool_error": TaskStatus.COMPLETED,
    "fail": TaskStatus.FAILED,
    "retry": TaskStatus.COMPLETED,
    "input": TaskStatus.COMPLETED,
    "cancel": TaskStatus.CANCELLED,
    "lease_loss": TaskStatus.COMPLETED,
}
ERROR: Final = {"code": -32000, "message": "stress failure"}
INPUT_KEY: Final = "confirm"
INPUT_REQUEST: Final = {"method": "elicitation/create", "params": {"message": "Proceed?"}}


@attrs.frozen(kw_only=True)
class RunnerParams:
    rounds: int = 3
    tasks: int = 25
    seed: int = 0
    timeout_ms: int = 30_000
    lease_ms: int = 1_000
    retry_delay_ms: int = 20
    kinds: tuple[str, ...] = KINDS


@attrs.frozen
class TaskSpec:
    task_id: str
    kind: str
    retries: int = 0


def plan_round(
    params: RunnerParams, prefix: str, round_no: int, rng: random.Random
) -> list[TaskSpec]:
    kinds = list(params.kinds)
    rng.shuffle(kinds)
    chosen = [kinds[n] if n < len(kinds) else rng.choice(params.kinds) for n in range(params.tasks)]
    specs = []
    for n, kind in enumerate(chosen):
        retries = rng.randint(1, 2) if kind == "retry" else 0
        specs.append(TaskSpec(f"{prefix}-run-{round_no}-{n}", kind, retries))
    return specs


def _result(text: str, **structured: Any) -> JSONObject:
    return {
        "content": [{"type": "text", "text": text}],
        "structuredContent": structured,
        "isError": False,
    }


@attrs.define(eq=False)
class _Round:
    specs: dict[str, TaskSpec]
    go: trio.Event = attrs.field(factory=trio.Event)
    all_ready: trio.Event = attrs.field(factory=trio.Event)
    ready: int = 0
    running: dict[str, trio.Event] = attrs.field(factory=dict)
    healed: dict[str, trio.Event] = attrs.field(factory=dict)
    attempts: Counter[str] = attrs.field(factory=Counter)


class _Executor:
    """One executor for both runners; ``state`` names the runner ("A" or "B")."""

    def __init__(self) -> None:
        self.round: _Round | None = None

    async def execute(self, work: Work, token: ExecutionToken, state: Any) -> Outcome:
        rnd = self.round
        if rnd is None or token.task_id not in rnd.specs:
            return Failed(ERROR, "unknown stress task")
        spec = rnd.specs[token.task_id]
        if state == "B":
            return Completed(_result("recovered", by="B", kind=spec.kind))
        rnd.attempts[spec.task_id] += 1
        attempt = rnd.attempts[spec.task_id]
        if attempt == 1:
            rnd.ready += 1
            if rnd.ready == len(rnd.specs):
                rnd.all_ready.set()
            await rnd.go.wait()
        kind = spec.kind
        if kind == "tool_error":
            return Completed(
                {"content": [{"type": "text", "text": "tool said no"}], "isError": True}
            )
        if kind == "fail":
            return Failed(ERROR, "stress failure")
        if kind == "retry" and attempt <= spec.retries:
            return Retry(ERROR, f"attempt {attempt} failed")
        if kind == "input":
            answer = await token.await_input(INPUT_KEY, INPUT_REQUEST)
            return Completed(_result("answered", by="A", answer=answer))
        if kind == "cancel":
            rnd.running[spec.task_id].set()
            await trio.sleep_forever()
        if kind == "lease_loss":
            await rnd.healed[spec.task_id].wait()
            return Completed(_result("late", by="A-late"))
        return Completed(_result("done", by="A", attempt=attempt))


def _pending(round_no: int, specs: list[TaskSpec], watch: _Watch, executor: _Executor) -> str:
    """Which tasks of a timed-out round were not terminal, and what they last looked like."""
    rnd = executor.round
    stuck = []
    for spec in specs:
        snapshot = watch.latest.get(spec.task_id)
        status = "unseen" if snapshot is None else snapshot.task.status.value
        if snapshot is None or not snapshot.task.status.is_terminal:
            attempts = 0 if rnd is None else rnd.attempts[spec.task_id]
            stuck.append(f"{spec.task_id} {spec.kind} {status} attempts={attempts}")
    return f"round {round_no} timed out; not terminal: " + "; ".join(stuck[:8])


def _descendants(nursery: trio.Nursery) -> int:
    count = 0
    for task in nursery.child_tasks:
        count += 1
        for child in task.child_nurseries:
            count += _descendants(child)
    return count


@attrs.define
class _Watch:
    """Runner listeners: the latest snapshot per task, and events for awaited states."""

    latest: dict[str, Snapshot] = attrs.field(factory=dict)
    waiting: dict[tuple[str, str], trio.Event] = attrs.field(factory=dict)

    def __call__(self, snapshot: Snapshot) -> None:
        task = snapshot.task
        current = self.latest.get(task.id)
        if current is None or current.revision < snapshot.revision:
            self.latest[task.id] = snapshot
        status = self.latest[task.id].task.status
        for key in ((task.id, status.value), (task.id, "terminal" if status.is_terminal else "")):
            event = self.waiting.pop(key, None)
            if event is not None:
                event.set()

    async def wait_for(self, task_id: str, state: str) -> None:
        snapshot = self.latest.get(task_id)
        if snapshot is not None:
            status = snapshot.task.status
            if status.value == state or (state == "terminal" and status.is_terminal):
                return
        event = self.waiting.setdefault((task_id, state), trio.Event())
        await event.wait()


async def _wait_idle(runner: Runner) -> None:
    while True:
        stats = runner.statistics()
        if stats.jobs == 0 and stats.scheduled_retries == 0 and stats.awaiting_slot == 0:
            return
        await trio.sleep(0.001)


def _stop_key(kind: str, runner: str, outcome: str, store_outcome: str) -> str:
    if kind == "lease_loss" and runner == "A":
        fenced = outcome == "stale_lease" or (outcome == "completed" and store_outcome == "error")
        return "A:fenced" if fenced else f"A:unfenced:{outcome}:{store_outcome}"
    return f"{runner}:{outcome}:{store_outcome}"


def _expected_stops(spec: TaskSpec) -> Iterable[str]:
    if spec.kind in ("complete", "tool_error", "input"):
        return ["A:completed:applied"]
    if spec.kind == "fail":
        return ["A:failed:applied"]
    if spec.kind == "retry":
        return ["A:retry:applied"] * spec.retries + ["A:completed:applied"]
    if spec.kind == "cancel":
        return ["A:cancelled:not_settled"]
    return ["A:fenced", "B:completed:applied"]


def _expected_transitions(spec: TaskSpec) -> Iterable[str]:
    if spec.kind in ("complete", "tool_error", "lease_loss"):
        return ["completed:worker:applied"]
    if spec.kind == "fail":
        return ["failed:worker:applied"]
    if spec.kind == "retry":
        return ["retry_requested:worker:applied"] * spec.retries + ["completed:worker:applied"]
    if spec.kind == "input":
        return [
            "input_requested:worker:applied",
            "input_responses_accepted:request:applied",
            "completed:worker:applied",
        ]
    return ["cancelled:request:applied"]


async def run_runner(
    store: Store,
    params: RunnerParams,
    prefix: str,
    *,
    progress: bool = False,
) -> tuple[Checks, dict[str, Any]]:
    checks = Checks()
    rng = random.Random(params.seed)
    executor = _Executor()
    sink_a, sink_b = RecordingInstrumentation(), RecordingInstrumentation()
    watch = _Watch()
    partitioned = PartitionedStore(store)
    runner_a = Runner(
        partitioned,
        executor=executor,
        executor_state="A",
        owner_id="stress-runner-a",
        lease_ms=params.lease_ms,
        max_jobs=params.tasks,
        reap_interval_ms=None,
        instrumentation=sink_a,
    )
    runner_b = Runner(
        store,
        executor=executor,
        executor_state="B",
        owner_id="stress-runner-b",
        lease_ms=params.lease_ms,
        max_jobs=params.tasks,
        reap_interval_ms=None,
        instrumentation=sink_b,
    )
    runner_a.subscribe(watch)
    runner_b.subscribe(watch)
    all_specs: list[TaskSpec] = []
    tasks_before: list[int] = []
    tasks_after: list[int] = []
    bar = Progress("runner", params.rounds * params.tasks, enabled=progress)
    wall = time.perf_counter()
    trio_started = trio.current_time()

    async with trio.open_nursery() as harness:
        await harness.start(runner_a.run)
        await harness.start(runner_b.run)
        try:
            for round_no in range(params.rounds):
                specs = plan_round(params, prefix, round_no, rng)
                all_specs.extend(specs)
                tasks_before.append(_descendants(harness))
                with trio.move_on_after(params.timeout_ms / 1000) as deadline:
                    await _one_round(
                        store, partitioned, runner_a, runner_b, executor, watch, specs, params, bar
                    )
                if deadline.cancelled_caught:
                    checks.check(
                        "roundsFinishInTime", False, _pending(round_no, specs, watch, executor)
                    )
                    break
                checks.check("roundsFinishInTime", True)
                tasks_after.append(_descendants(harness))
        finally:
            bar.close()
            runner_a.stop()
            runner_b.stop()
    tasks_at_end = _descendants(harness)
    elapsed = time.perf_counter() - wall

    # -- invariants -----------------------------------------------------------------------
    get_snapshots = {}
    for spec in all_specs:
        access = await store.authorize(None, Action.GET, spec.task_id)
        get_snapshots[spec.task_id] = await store.get(spec.task_id, access)
    statuses: Counter[str] = Counter()
    wrong_status = []
    for spec in all_specs:
        snap = get_snapshots[spec.task_id]
        status = "not_found" if isinstance(snap, NotFound) else snap.task.status.value
        statuses[status] += 1
        if status != EXPECTED_STATUS[spec.kind].value:
            wrong_status.append(f"{spec.task_id} ({spec.kind}) is {status}")
    kinds = Counter(spec.kind for spec in all_specs)
    checks.figure("rounds", params.rounds)
    checks.figure("tasksPerRound", params.tasks)
    checks.figure("plannedKinds", dict(sorted(kinds.items())))
    checks.figure("finalStatuses", dict(sorted(statuses.items())))
    checks.check(
        "runnerAllTasksTerminalWithExpectedStatus", not wrong_status, "; ".join(wrong_status[:5])
    )
    for spec in all_specs:
        snap = get_snapshots[spec.task_id]
        if isinstance(snap, NotFound) or snap.task.result is None:
            continue
        result = snap.task.result
        if spec.kind == "tool_error":
            checks.check("toolErrorsCompleteWithIsError", result.get("isError") is True)
        elif spec.kind == "lease_loss":
            by = (result.get("structuredContent") or {}).get("by")
            checks.check(
                "leaseLossResultFromRecoveryRunner", by == "B", f"{spec.task_id}: result by {by}"
            )
        elif spec.kind == "input":
            answer = (result.get("structuredContent") or {}).get("answer")
            checks.check("inputAnswerDelivered", answer == {"action": "accept"})

    kind_of = {spec.task_id: spec.kind for spec in all_specs}
    starts = {"A": sink_a.named(ins.JOB_START), "B": sink_b.named(ins.JOB_START)}
    stops = {"A": sink_a.named(ins.JOB_STOP), "B": sink_b.named(ins.JOB_STOP)}
    expected_jobs = sum(len(list(_expected_stops(spec))) for spec in all_specs)
    started = sum(len(v) for v in starts.values())
    stopped = sum(len(v) for v in stops.values())
    checks.figure("expectedJobs", expected_jobs)
    checks.figure("started", started)
    checks.figure("stopped", stopped)
    checks.figure(
        "jobsPerRunner",
        {name: {"started": len(starts[name]), "stopped": len(stops[name])} for name in ("A", "B")},
    )
    observed_stops: Counter[str] = Counter()
    for name, events in stops.items():
        for _, meta in events:
            observed_stops[
                _stop_key(
                    kind_of.get(meta["task_id"], "?"), name, meta["outcome"], meta["store_outcome"]
                )
            ] += 1
    planned_stops = Counter(key for spec in all_specs for key in _expected_stops(spec))
    checks.figure("stopOutcomes", dict(sorted(observed_stops.items())))
    checks.check(
        "runnerStopOutcomesAsPlanned",
        observed_stops == planned_stops,
        f"observed {dict(observed_stops)} planned {dict(planned_stops)}",
    )
    balanced = started == stopped == expected_jobs
    for name in ("A", "B"):
        per_task_starts = Counter(meta["task_id"] for _, meta in starts[name])
        per_task_stops = Counter(meta["task_id"] for _, meta in stops[name])
        balanced = balanced and per_task_starts == per_task_stops
    checks.check("runnerEventsBalanced", balanced, f"started {started} stopped {stopped}")
    sources = Counter(f"{name}:{meta['source']}" for name in ("A", "B") for _, meta in starts[name])
    checks.figure("startSources", dict(sorted(sources.items())))
    checks.check(
        "recoveryStartsOnlyOnB",
        sources.get("B:recovery", 0) == kinds.get("lease_loss", 0)
        and sum(v for k, v in sources.items() if k.startswith("B:")) == kinds.get("lease_loss", 0),
    )
    drained = True
    for name, runner in (("A", runner_a), ("B", runner_b)):
        stats = runner.statistics()
        if stops[name]:
            drained = drained and stops[name][-1][0]["jobs"] == 0
        drained = drained and stats.jobs == 0 and stats.awaiting_slot == 0
        drained = drained and stats.scheduled_retries == 0
    checks.check("runnerDrained", drained)
    stats_a = runner_a.statistics()
    checks.figure("peakJobs", {"A": stats_a.peak_jobs, "B": runner_b.statistics().peak_jobs})
    checks.check(
        "peakJobsReachedBatch",
        stats_a.peak_jobs == params.tasks,
        f"peak {stats_a.peak_jobs} < batch {params.tasks}",
    )

    transitions: Counter[str] = Counter()
    others: Counter[str] = Counter()
    for name, sink in (("A", sink_a), ("B", sink_b)):
        for _, meta in sink.named(ins.STORE_TRANSITION):
            if name == "A" and kind_of.get(meta["task_id"]) == "lease_loss":
                continue  # A's late settle is fenced: whether it even reached the store varies
            key = f"{meta['event_kind']}:{meta['authority']}:{meta['outcome']}"
            if meta["outcome"] == "applied":
                transitions[key] += 1
            else:
                others[key] += 1
    planned_transitions = Counter(key for spec in all_specs for key in _expected_transitions(spec))
    checks.figure("appliedTransitions", dict(sorted(transitions.items())))
    checks.figure("otherTransitions", dict(sorted(others.items())))
    checks.check(
        "runnerTransitionsApplied",
        transitions == planned_transitions,
        f"observed {dict(transitions)} planned {dict(planned_transitions)}",
    )
    # A worker may have to follow a conflict (a request changed the revision under it); any
    # other non-applied outcome would be a runner or store fault.
    checks.check(
        "runnerOnlyConflictsFollowed",
        all(key.endswith(":conflict") for key in others),
        f"non-applied outcomes {dict(others)}",
    )
    lost = len(sink_a.named(ins.LEASE_LOST)) + len(sink_a.named(ins.FENCED_WRITE_REJECTED))
    checks.check(
        "lateAttemptsFenced",
        lost >= kinds.get("lease_loss", 0),
        f"{lost} lease-lost/fenced events for {kinds.get('lease_loss', 0)} partitions",
    )
    retries = len(sink_a.named(ins.RETRY_SCHEDULED))
    checks.figure("retriesScheduled", retries)
    checks.check(
        "retriesAsPlanned",
        retries == sum(spec.retries for spec in all_specs),
    )
    checks.figure("trioTasksBeforeRounds", tasks_before)
    checks.figure("trioTasksAfterRounds", tasks_after)
    checks.figure("trioTasksAtEnd", tasks_at_end)
    checks.check(
        "noLeakedTrioTasks",
        tasks_before == tasks_after and tasks_at_end == 0,
        f"before {tasks_before} after {tasks_after} end {tasks_at_end}",
    )
    durations = [m["duration"] for events in stops.values() for m, _ in events]
    timings = {
        "wallSeconds": round(elapsed, 6),
        "trioSeconds": round(trio.current_time() - trio_started, 6),
        "jobsPerSecond": round(stopped / elapsed, 1) if elapsed > 0 else None,
        "observedJobSeconds": round(sum(durations), 6),
    }
    return checks, timings


async def _one_round(
    store: Store,
    partitioned: PartitionedStore,
    runner_a: Runner,
    runner_b: Runner,
    executor: _Executor,
    watch: _Watch,
    specs: list[TaskSpec],
    params: RunnerParams,
    bar: Progress,
) -> None:
    rnd = _Round({spec.task_id: spec for spec in specs})
    executor.round = rnd
    for spec in specs:
        if spec.kind == "cancel":
            rnd.running[spec.task_id] = trio.Event()
        elif spec.kind == "lease_loss":
            rnd.healed[spec.task_id] = trio.Event()
            partitioned.cut(spec.task_id)
    for spec in specs:
        policy = RetryPolicy.fixed(params.retry_delay_ms, spec.retries)
        work = Work(
            idempotency_key=spec.task_id,
            type="stress",
            input={"kind": spec.kind},
            retry_policy=policy,
        )
        access = await store.authorize(None, Action.CREATE, spec.task_id)
        task = new_task(spec.task_id, await store.now(), None, None)
        await runner_a.create_task(task, work, access)
    await rnd.all_ready.wait()
    rnd.go.set()

    async def drive(spec: TaskSpec) -> None:
        if spec.kind == "input":
            await watch.wait_for(spec.task_id, TaskStatus.INPUT_REQUIRED.value)
            access = await store.authorize(None, Action.UPDATE, spec.task_id)
            answer = {INPUT_KEY: {"action": "accept"}}
            result = await runner_a.update(spec.task_id, answer, access)
            if isinstance(result, NotFound):
                raise StressFailure(f"update of {spec.task_id} found no task")
        elif spec.kind == "cancel":
            await rnd.running[spec.task_id].wait()
            access = await store.authorize(None, Action.CANCEL, spec.task_id)
            if isinstance(await runner_a.cancel(spec.task_id, access), NotFound):
                raise StressFailure(f"cancel of {spec.task_id} found no task")
        await watch.wait_for(spec.task_id, "terminal")
        bar.advance()

    async with trio.open_nursery() as nursery:
        for spec in specs:
            if spec.kind != "lease_loss":
                nursery.start_soon(drive, spec)

    lost = [spec for spec in specs if spec.kind == "lease_loss"]
    if lost:
        # Everything else is terminal, so only the partitioned tasks can be claimable: once
        # their leases expire, runner B adopts exactly them.
        adopted = 0
        while adopted < len(lost):
            adopted += await runner_b.recover_once()
            if adopted < len(lost):
                await trio.sleep(params.lease_ms / 10_000)
        for spec in lost:
            await watch.wait_for(spec.task_id, "terminal")
        await _wait_idle(runner_b)
        for spec in lost:
            partitioned.heal(spec.task_id)
            rnd.healed[spec.task_id].set()
            bar.advance()
    await _wait_idle(runner_a)
    await _wait_idle(runner_b)
    executor.round = None
