"""``steps``: pipelines of durable steps through runners that crash at seeded points.

Each task runs ``steps`` durable steps (``token.step``); some also sleep durably (long enough to
suspend), some ask for input (answered after a seeded delay, often after the wait suspended),
some make one step ``at_most_once``. The plan kills the running *incarnation* (a Runner with
recovery over a store view that goes dead) at seeded points of seeded tasks: in the middle of a
step's body, after its side effect but before its commit, or just after its commit. A dead view
refuses every call, as a killed process would make none: the claims it held lapse and the next
incarnation recovers them.

Exact invariants (the harness reads the store at each kill, so it knows which steps were in
flight with no outcome recorded):

* every task completes, with exactly the value its steps compute (an interrupted
  ``at_most_once`` step is reconciled to a known value);
* each step's body ran ``1 +`` the number of kills that found it in flight without an outcome,
  and never after its outcome was recorded; an ``at_most_once`` body ran exactly once;
* each task's ledger holds one ``step_recorded`` per step it completed (``step_started`` for
  the ``at_most_once`` one), no retry, and its sleep woke no earlier than its wake instant;
* nothing of a dead incarnation is left running.

On the memory store with trio's MockClock and a seeded scheduler (the default), the report is
identical for a seed.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from typing import Any, Final

import attrs
import trio

from stress.common import Checks, Progress
from stress.wrappers import StoreProxy
from tritask.tasks.events import Event, EventKind
from tritask.tasks.executor import Completed, ExecutionToken, Outcome
from tritask.tasks.model import Snapshot, new_task, step_wake_at
from tritask.tasks.runner import Runner
from tritask.tasks.steps import Semantics, StepInterrupted
from tritask.tasks.store import Action, RequestAuthority, Store, Transition
from tritask.tasks.work import Work

__all__ = ["KINDS", "POINTS", "StepsParams", "run_steps"]

KINDS: Final = ("plain", "sleep", "input", "at_most_once")
POINTS: Final = ("mid", "uncommitted", "committed")
MODULUS: Final = 1_000_003
RECONCILED: Final = 424_242
SLEEP_S: Final = 30
INPUT_KEY: Final = "confirm"


class StoreDown(Exception):
    """What a dead incarnation's store view raises: its process is gone."""


def _not_store_down(record: logging.LogRecord) -> bool:
    """Drop the runner's logs of calls a dead incarnation made (a killed process logs none)."""
    exc = record.exc_info[1] if record.exc_info else None
    while exc is not None:
        if isinstance(exc, StoreDown):
            return False
        exc = exc.__context__
    return True


@attrs.frozen(kw_only=True)
class StepsParams:
    tasks: int = 24
    steps: int = 5
    kills: int = 8
    seed: int = 0
    lease_ms: int = 2_000
    timeout_ms: int = 3_600_000


class KillableStore(StoreProxy):
    """One incarnation's view of the store: every call fails once it is dead."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.dead = False

    def _alive(self) -> None:
        if self.dead:
            raise StoreDown("this incarnation was killed")

    async def now(self) -> int:
        self._alive()
        return await super().now()

    async def worker_snapshot(self, task_id: str, lease: Any) -> Any:
        self._alive()
        return await super().worker_snapshot(task_id, lease)

    async def claim(self, task_id: str, owner_id: str, lease_ms: int) -> Any:
        self._alive()
        return await super().claim(task_id, owner_id, lease_ms)

    async def claim_next(self, owner_id: str, lease_ms: int) -> Any:
        self._alive()
        return await super().claim_next(owner_id, lease_ms)

    async def renew(self, lease: Any, lease_ms: int) -> Any:
        self._alive()
        return await super().renew(lease, lease_ms)

    async def release(self, lease: Any) -> None:
        self._alive()
        await super().release(lease)

    async def transition(self, task_id: str, revision: int, event: Any, authority: Any) -> Any:
        self._alive()
        return await super().transition(task_id, revision, event, authority)

    async def _settle(self, task_id: str, revision: int, event: Any, lease: Any) -> Any:
        self._alive()
        return await super()._settle(task_id, revision, event, lease)


def expected_value(steps: int, interrupted_at: int | None) -> int:
    value = 1
    for index in range(steps):
        step = RECONCILED if index == interrupted_at else (value * 31 + index + 7) % MODULUS
        value = step
    return value


@attrs.define(eq=False)
class _Harness:
    params: StepsParams
    store: Store
    kinds: dict[str, str]
    kill_plan: dict[tuple[str, int], str]
    answer_delay: dict[str, float]
    incarnation: int = 0
    view: KillableStore | None = None
    kill_now: trio.Event = attrs.field(factory=trio.Event)
    fired: list[tuple[str, int, str]] = attrs.field(factory=list)
    runs: Counter[tuple[str, str]] = attrs.field(factory=Counter)
    effects: Counter[tuple[str, str]] = attrs.field(factory=Counter)
    expected_runs: Counter[tuple[str, str]] = attrs.field(factory=Counter)
    open_bodies: dict[tuple[str, str], int] = attrs.field(factory=dict)
    run_after_outcome: list[str] = attrs.field(factory=list)
    interrupted: dict[str, int] = attrs.field(factory=dict)
    woke_at: dict[str, int] = attrs.field(factory=dict)
    answered: set[str] = attrs.field(factory=set)

    def amo_index(self, task_id: str) -> int | None:
        return self.params.steps // 2 if self.kinds[task_id] == "at_most_once" else None

    async def kill(self, task_id: str, index: int, point: str) -> None:
        """Kill the current incarnation at this point (once per planned point)."""
        self.kill_plan.pop((task_id, index), None)
        self.fired.append((task_id, index, point))
        assert self.view is not None
        self.view.dead = True
        self.kill_now.set()
        await trio.sleep_forever()

    async def body(self, task_id: str, key: str, index: int, value: int) -> int:
        where = (task_id, key)
        record = await self._outcome(task_id, key)
        if record is not None:
            self.run_after_outcome.append(f"{task_id} {key}")
        self.runs[where] += 1
        self.open_bodies[where] = self.incarnation
        await trio.sleep(0.05)
        if self.kill_plan.get((task_id, index)) == "mid":
            await self.kill(task_id, index, "mid")
        self.effects[where] += 1  # the side effect, keyed by token.step_key(key)
        await trio.sleep(0.02)
        if self.kill_plan.get((task_id, index)) == "uncommitted":
            await self.kill(task_id, index, "uncommitted")
        return (value * 31 + index + 7) % MODULUS

    async def _outcome(self, task_id: str, key: str) -> Any:
        access = await self.store.authorize(None, Action.GET, task_id)
        snapshot = await self.store.get(task_id, access)
        assert isinstance(snapshot, Snapshot)
        record = snapshot.steps.get(key)
        return None if record is None or record.get("outcome") is None else record

    async def execute(self, work: Work, token: ExecutionToken, state: Any) -> Outcome:
        task_id = token.task_id
        kind = self.kinds[task_id]
        steps = self.params.steps
        value = 1
        for index in range(steps):
            if index == steps // 2 and kind == "sleep":
                await token.sleep("cooldown", SLEEP_S)
                self.woke_at.setdefault(task_id, await self.store.now())
            if index == steps // 2 and kind == "input":
                await token.await_input(INPUT_KEY, {"method": "elicitation/create"})
            key = f"step/{index}"
            semantics: Semantics = (
                "at_most_once" if index == self.amo_index(task_id) else "at_least_once"
            )
            try:
                value = await token.step(
                    key, self.body, task_id, key, index, value, semantics=semantics
                )
            except StepInterrupted:
                self.interrupted[task_id] = index
                value = RECONCILED
            self.open_bodies.pop((task_id, key), None)
            if self.kill_plan.get((task_id, index)) == "committed":
                await self.kill(task_id, index, "committed")
        return Completed({"content": [], "isError": False, "structuredContent": {"value": value}})

    async def account_kill(self) -> None:
        """At a kill: every body of this incarnation still open runs again if no outcome was
        recorded for it (an ``at_most_once`` one is interrupted instead)."""
        for (task_id, key), incarnation in list(self.open_bodies.items()):
            if incarnation != self.incarnation:
                continue
            del self.open_bodies[(task_id, key)]
            if await self._outcome(task_id, key) is None:
                if key == f"step/{self.amo_index(task_id)}":
                    self.interrupted.setdefault(task_id, -1)  # checked against the replay
                else:
                    self.expected_runs[(task_id, key)] += 1

    async def answer_inputs(self) -> None:
        """Answer each input task's question a seeded delay after it was asked."""
        while True:
            for task_id, kind in self.kinds.items():
                if kind != "input" or task_id in self.answered:
                    continue
                access = await self.store.authorize(None, Action.UPDATE, task_id)
                snapshot = await self.store.get(task_id, access)
                assert isinstance(snapshot, Snapshot)
                if INPUT_KEY not in snapshot.task.input_requests:
                    continue
                asked = snapshot.task.last_updated_at
                if await self.store.now() - asked < self.answer_delay[task_id] * 1_000_000:
                    continue
                answer = Event.input_responses_accepted({INPUT_KEY: {"action": "accept"}})
                result = await self.store.transition(
                    task_id, snapshot.revision, answer, RequestAuthority(access)
                )
                if isinstance(result, Transition):
                    self.answered.add(task_id)
            await trio.sleep(0.5)


async def _incarnations(
    harness: _Harness, store: Store, ids: list[str], params: StepsParams
) -> bool:
    """Run incarnations until every task is terminal; ``True`` when the deadline passed."""

    async def finished() -> bool:
        for task_id in ids:
            access = await store.authorize(None, Action.GET, task_id)
            snapshot = await store.get(task_id, access)
            if not isinstance(snapshot, Snapshot) or not snapshot.task.status.is_terminal:
                return False
        return True

    with trio.move_on_after(params.timeout_ms / 1000) as deadline:
        async with trio.open_nursery() as outer:
            outer.start_soon(harness.answer_inputs)
            while not await finished():
                harness.incarnation += 1
                harness.kill_now = trio.Event()
                view = KillableStore(store)
                harness.view = view
                runner = Runner(
                    view,
                    executor=harness,
                    recover=True,
                    owner_id=f"incarnation-{harness.incarnation}",
                    lease_ms=params.lease_ms,
                    recovery_interval_ms=250,
                    reap_interval_ms=None,
                    max_jobs=params.tasks,
                    max_runtime_ms=None,
                    suspend_sleep_after_ms=5_000,
                    suspend_input_after_ms=2_000,
                    release_retry_ms=50,
                )
                async with trio.open_nursery() as inner:
                    inner.start_soon(runner.run)
                    while not harness.kill_now.is_set() and not await finished():
                        with trio.move_on_after(1):
                            await harness.kill_now.wait()
                    if harness.kill_now.is_set():
                        inner.cancel_scope.cancel()  # the process is gone
                    else:
                        runner.stop()
                if harness.kill_now.is_set():
                    # Nothing of the dead incarnation runs any more: what it left unrecorded
                    # is what the next one must run again.
                    await harness.account_kill()
            outer.cancel_scope.cancel()
    return deadline.cancelled_caught


def _plan(params: StepsParams, prefix: str, rng: random.Random) -> tuple[Any, ...]:
    ids = [f"{prefix}-steps-{n}" for n in range(params.tasks)]
    kinds = {task_id: KINDS[n % len(KINDS)] for n, task_id in enumerate(ids)}
    points = [(task_id, index) for task_id in ids for index in range(params.steps)]
    chosen = rng.sample(points, min(params.kills, len(points)))
    kill_plan = {where: rng.choice(POINTS) for where in chosen}
    answer_delay = {task_id: rng.choice([0.5, 1.0, 4.0, 8.0]) for task_id in ids}
    return ids, kinds, kill_plan, answer_delay


async def run_steps(
    store: Store, params: StepsParams, prefix: str, *, progress: bool = False
) -> tuple[Checks, dict[str, Any]]:
    rng = random.Random(params.seed)
    ids, kinds, kill_plan, answer_delay = _plan(params, prefix, rng)
    planned = dict(kill_plan)
    harness = _Harness(params, store, kinds, kill_plan, answer_delay)
    checks = Checks()
    checks.figure("plannedKinds", dict(sorted(Counter(kinds.values()).items())))
    checks.figure("plannedKills", dict(sorted(Counter(planned.values()).items())))
    for task_id in ids:
        access = await store.authorize(None, Action.CREATE, task_id)
        task = new_task(task_id, await store.now(), None, None)
        work = Work(idempotency_key=task_id, type="steps", input={"taskId": task_id})
        await store.create(task, work, access)
    bar = Progress("steps", params.tasks, enabled=progress)
    started = trio.current_time()
    timed_out = False
    runner_log = logging.getLogger("tritask.runner")
    runner_log.addFilter(_not_store_down)
    try:
        timed_out = await _incarnations(harness, store, ids, params)
    finally:
        runner_log.removeFilter(_not_store_down)
    bar.advance(params.tasks)

    bar.close()
    checks.check("finishesInTime", not timed_out, f"after {params.timeout_ms} ms")
    checks.figure("incarnations", harness.incarnation)
    checks.figure("killsFired", dict(sorted(Counter(p for _, _, p in harness.fired).items())))
    # A planned kill inside an at_most_once body that an earlier kill interrupted never fires:
    # that body never runs again.
    fired = {(task_id, index) for task_id, index, _ in harness.fired}
    unfired = sorted(
        where
        for where in planned
        if where not in fired and harness.interrupted.get(where[0]) != where[1]
    )
    checks.figure("killsSkippedInInterruptedSteps", len(planned) - len(fired) - len(unfired))
    checks.check("everyPlannedKillFired", not unfired, str(unfired[:3]))

    statuses: Counter[str] = Counter()
    wrong_values: list[str] = []
    ledger_problems: list[str] = []
    for task_id in ids:
        access = await store.authorize(None, Action.GET, task_id)
        snapshot = await store.get(task_id, access)
        assert isinstance(snapshot, Snapshot)
        statuses[snapshot.task.status.value] += 1
        amo = harness.amo_index(task_id)
        interrupted = harness.interrupted.get(task_id)
        expected = expected_value(params.steps, interrupted if amo is not None else None)
        result = snapshot.task.result or {}
        if result.get("structuredContent") != {"value": expected}:
            wrong_values.append(f"{task_id}: {result} != {expected}")
        history = getattr(store, "history", None)
        if history is not None:
            ledger = history(task_id)
            if not isinstance(ledger, list):
                ledger = await ledger
            kinds_seen = [entry.event.kind for entry in ledger]
            recorded = [
                e.event.data["key"] for e in ledger if e.event.kind is EventKind.STEP_RECORDED
            ]
            wanted = [f"step/{i}" for i in range(params.steps) if i != interrupted]
            if sorted(recorded) != sorted(wanted) or EventKind.RETRY_REQUESTED in kinds_seen:
                ledger_problems.append(f"{task_id}: {[k.value for k in kinds_seen]}")
            if amo is not None and kinds_seen.count(EventKind.STEP_STARTED) != 1:
                ledger_problems.append(f"{task_id}: at_most_once started marker")
        if kinds[task_id] == "sleep":
            wake = step_wake_at(snapshot.steps["cooldown"])
            if wake is None or harness.woke_at.get(task_id, 0) < wake:
                ledger_problems.append(
                    f"{task_id}: woke at {harness.woke_at.get(task_id)} < {wake}"
                )
    checks.figure("finalStatuses", dict(sorted(statuses.items())))
    checks.check("everyTaskCompleted", statuses == Counter({"completed": len(ids)}), str(statuses))
    checks.check("exactValues", not wrong_values, "; ".join(wrong_values[:3]))
    checks.check("ledgers", not ledger_problems, "; ".join(ledger_problems[:3]))

    wrong_runs = []
    for task_id in ids:
        for index in range(params.steps):
            key = f"step/{index}"
            where = (task_id, key)
            if harness.interrupted.get(task_id) == index:
                want = 1  # the body ran once; its replay was interrupted, never run again
            else:
                want = 1 + harness.expected_runs[where]
            if harness.runs[where] != want:
                wrong_runs.append(f"{task_id} {key}: ran {harness.runs[where]}, expected {want}")
    checks.figure("bodyRuns", sum(harness.runs.values()))
    checks.figure("bodiesRunAgain", sum(harness.expected_runs.values()))
    checks.figure("effects", sum(harness.effects.values()))
    checks.figure("interrupted", len(harness.interrupted))
    checks.check("bodyRunsExact", not wrong_runs, "; ".join(wrong_runs[:3]))
    checks.check(
        "noBodyAfterItsOutcome",
        not harness.run_after_outcome,
        "; ".join(harness.run_after_outcome[:3]),
    )
    checks.check(
        "effectsAtMostRuns",
        all(harness.effects[w] <= harness.runs[w] for w in harness.runs),
    )
    timings = {"mockSeconds": round(trio.current_time() - started, 3)}
    return checks, timings
