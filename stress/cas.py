"""``cas``: W writers race compare-and-set transitions on each of T tasks (the Store contract).

Each task walks a chain of ``depth`` revisions. At revision ``r`` every writer is released at
once with its own event at expected revision ``r``:

* middle revisions race ``input_requested`` (worker lease, a distinct key per writer) or, when a
  request is outstanding, ``input_responses_accepted`` for it (request authority);
* the last revision races one terminal kind chosen from the seed for that task
  (``completed`` and ``failed`` under the lease, ``cancelled`` under a cancel access).

After each race the harness probes the store: the winner's event sent again replays the original
revision (``duplicate``), each loser's event sent again still conflicts (it left no trace), and
the winner's id with other content is refused (``EventIdReused``). After the chain, a fresh event
on the terminal task is ``unchanged``, and the ledger (``history(task_id)`` when the store has
one) must match the winners and the final snapshot exactly.

Every figure in ``invariants`` follows from the parameters alone (never from which writer won),
so runs with the same seed agree byte for byte on any store that is correct.
"""

from __future__ import annotations

import inspect
import itertools
import random
from collections import Counter
from typing import Any

import attrs
import trio

from stress.common import Checks, Progress, StressFailure
from tritask.tasks.events import Event, EventKind
from tritask.tasks.model import TaskStatus, new_task
from tritask.tasks.store import (
    Action,
    Authority,
    Claimed,
    Conflict,
    EventIdReused,
    Lease,
    NotFound,
    RequestAuthority,
    Store,
    Transition,
    WorkerAuthority,
)
from tritask.tasks.work import Work

__all__ = ["CasParams", "TaskPlan", "plan_tasks", "run_cas"]

CAS_OWNER = "stress-cas"
CAS_LEASE_MS = 600_000
FINAL_KINDS = ("completed", "failed", "cancelled")
ERROR = {"code": -32000, "message": "stress failure"}


@attrs.frozen(kw_only=True)
class CasParams:
    tasks: int = 25
    writers: int = 8
    depth: int = 4
    seed: int = 0
    timeout_ms: int = 30_000


@attrs.frozen
class TaskPlan:
    task_id: str
    steps: tuple[str, ...]
    """One entry per revision: ``request``, ``accept``, or the final kind."""


def plan_tasks(params: CasParams, prefix: str) -> list[TaskPlan]:
    rng = random.Random(params.seed)
    plans: list[TaskPlan] = []
    for n in range(params.tasks):
        steps: list[str] = []
        outstanding = 0
        for _ in range(params.depth - 1):
            if outstanding and rng.random() < 0.5:
                steps.append("accept")
                outstanding -= 1
            else:
                steps.append("request")
                outstanding += 1
        steps.append(rng.choice(FINAL_KINDS))
        plans.append(TaskPlan(f"{prefix}-cas-{n}", tuple(steps)))
    return plans


@attrs.define
class _Tally:
    attempts: int = 0
    applied: int = 0
    conflicts: int = 0
    unexpected: Counter[str] = attrs.field(factory=Counter)
    duplicates: int = 0
    loser_retries_conflicted: int = 0
    reuse_refused: int = 0
    late_unchanged: int = 0
    committed_events: int = 0
    ledger_checked: int = 0
    terminal: int = 0
    statuses: Counter[str] = attrs.field(factory=Counter)


async def _history(store: Store, task_id: str) -> list[tuple[Any, ...]] | None:
    method = getattr(store, "history", None)
    if method is None:
        return None
    value = method(task_id)
    if inspect.isawaitable(value):
        value = await value
    entries: list[tuple[Any, ...]] = []
    for item in value:
        if hasattr(item, "event") and hasattr(item, "revision"):
            entries.append((item.event, item.revision, item.committed_at))
        else:
            entries.append(tuple(item))
    return entries


def _writer_event(task_id: str, r: int, w: int, step: str, outstanding: list[str]) -> Event:
    event_id = f"{task_id}-r{r}-w{w}"
    if step == "request":
        request = {"method": "elicitation/create", "params": {"message": f"r{r} w{w}"}}
        return Event.input_requested(f"r{r}-w{w}", request, id=event_id)
    if step == "accept":
        return Event.input_responses_accepted(
            {outstanding[0]: {"action": "accept", "content": {"writer": w}}}, id=event_id
        )
    if step == "completed":
        result = {
            "content": [{"type": "text", "text": "stress complete"}],
            "structuredContent": {"taskId": task_id, "writer": w},
            "isError": False,
        }
        return Event.completed(result, id=event_id)
    if step == "failed":
        return Event.failed({**ERROR, "data": {"writer": w}}, f"writer {w}", id=event_id)
    return Event.cancelled(id=event_id)


def _reused(event: Event) -> Event:
    """Same id, other content (always a worker kind, so the lease may send it)."""
    if event.kind is EventKind.COMPLETED:
        return Event.failed(ERROR, "reused id", id=event.id)
    return Event.completed({"content": [], "isError": False, "reused": True}, id=event.id)


async def _race(
    store: Store,
    task_id: str,
    revision: int,
    events: list[Event],
    authorities: list[Authority],
    tally: _Tally,
) -> list[Transition | Conflict | NotFound | BaseException]:
    results: list[Transition | Conflict | NotFound | BaseException] = [
        RuntimeError("writer did not run")
    ] * len(events)
    ready = trio.Event()
    go = trio.Event()
    waiting = len(events)

    async def writer(w: int) -> None:
        nonlocal waiting
        waiting -= 1
        if waiting == 0:
            ready.set()
        await go.wait()
        try:
            results[w] = await store.transition(task_id, revision, events[w], authorities[w])
        except Exception as exc:
            results[w] = exc

    async with trio.open_nursery() as nursery:
        for w in range(len(events)):
            nursery.start_soon(writer, w)
        await ready.wait()
        go.set()
    tally.attempts += len(events)
    return results


async def _run_task(
    store: Store, plan: TaskPlan, params: CasParams, tally: _Tally, checks: Checks
) -> None:
    task_id = plan.task_id
    create = await store.authorize(None, Action.CREATE, task_id)
    task = new_task(task_id, await store.now(), None, None)
    work = Work(idempotency_key=task_id, type="stress", input={"plan": list(plan.steps)})
    await store.create(task, work, create)
    claimed = await store.claim(task_id, CAS_OWNER, CAS_LEASE_MS)
    if not isinstance(claimed, Claimed):
        raise StressFailure(f"claiming {task_id} gave {claimed!r}")
    lease: Lease = claimed.lease
    worker = WorkerAuthority(lease)
    update = RequestAuthority(await store.authorize(None, Action.UPDATE, task_id))
    cancel = RequestAuthority(await store.authorize(None, Action.CANCEL, task_id))
    get_access = await store.authorize(None, Action.GET, task_id)

    outstanding: list[str] = []
    requested: list[str] = []
    answered: list[str] = []
    winners: list[tuple[Event, int, int]] = []
    for r, step in enumerate(plan.steps):
        authority: Authority = worker
        if step == "accept":
            authority = update
        elif step == "cancelled":
            authority = cancel
        events = [_writer_event(task_id, r, w, step, outstanding) for w in range(params.writers)]
        results = await _race(store, task_id, r, events, [authority] * len(events), tally)
        won = [w for w, res in enumerate(results) if isinstance(res, Transition)]
        for res in results:
            if isinstance(res, Transition):
                if res.outcome == "applied":
                    tally.applied += 1
                else:
                    tally.unexpected[f"transition:{res.outcome}"] += 1
            elif isinstance(res, Conflict):
                tally.conflicts += 1
                checks.check(
                    "losersSeeWinningRevision",
                    res.snapshot.revision == r + 1,
                    f"{task_id} r{r}: conflict at revision {res.snapshot.revision}",
                )
            elif isinstance(res, BaseException):
                tally.unexpected[type(res).__name__] += 1
            else:
                tally.unexpected["not_found"] += 1
        if not checks.check(
            "exactlyOneCommitPerRevision", len(won) == 1, f"{task_id} r{r}: {len(won)} commits"
        ):
            return
        w_win = won[0]
        first = results[w_win]
        assert isinstance(first, Transition)
        checks.check(
            "commitAdvancesRevisionByOne",
            first.event_revision == r + 1 and first.snapshot.revision == r + 1,
            f"{task_id} r{r}: committed revision {first.event_revision}",
        )
        winner = events[w_win]
        winners.append((winner, first.event_revision, first.committed_at))
        if step == "request":
            key = winner.data["key"]
            outstanding.append(key)
            requested.append(key)
        elif step == "accept":
            answered.append(outstanding.pop(0))

        # The winner's write, retried with the same event id, replays the original commit.
        replay = await store.transition(task_id, r, winner, authority)
        if (
            isinstance(replay, Transition)
            and replay.outcome == "duplicate"
            and replay.event_revision == first.event_revision
            and replay.committed_at == first.committed_at
        ):
            tally.duplicates += 1
        else:
            checks.check("duplicatesReplayOriginal", False, f"{task_id} r{r}: {replay!r}")
        # Each loser's write, retried, still conflicts: the first attempt left no trace.
        for w, event in enumerate(events):
            if w == w_win:
                continue
            again = await store.transition(task_id, r, event, authority)
            if isinstance(again, Conflict):
                tally.loser_retries_conflicted += 1
            else:
                checks.check("losersCommittedNothing", False, f"{task_id} r{r} w{w}: {again!r}")
        # The winner's id with other content is refused.
        try:
            reused = await store.transition(task_id, r + 1, _reused(winner), worker)
        except EventIdReused:
            tally.reuse_refused += 1
        else:
            checks.check("eventIdReuseRefused", False, f"{task_id} r{r}: {reused!r}")

    # A fresh event on the terminal task changes nothing.
    late = Event.completed({"content": [], "isError": False}, id=f"{task_id}-late")
    after = await store.transition(task_id, params.depth, late, worker)
    if (
        isinstance(after, Transition)
        and after.outcome == "unchanged"
        and after.snapshot.revision == params.depth
    ):
        tally.late_unchanged += 1
    else:
        checks.check("lateEventsUnchanged", False, f"{task_id}: {after!r}")

    snapshot = await store.get(task_id, get_access)
    if isinstance(snapshot, NotFound):
        checks.check("ledgerMatchesSnapshot", False, f"{task_id}: not found at the end")
        return
    final_kind = plan.steps[-1]
    status = snapshot.task.status
    tally.statuses[status.value] += 1
    if status.is_terminal:
        tally.terminal += 1
    last_at = winners[-1][2]
    checks.check(
        "ledgerMatchesSnapshot",
        snapshot.revision == params.depth
        and status == TaskStatus(final_kind)
        and snapshot.task.last_updated_at == last_at
        and set(snapshot.input_history) == set(requested)
        and set(snapshot.accepted_input_responses) == set(answered),
        f"{task_id}: revision {snapshot.revision}, status {status.value}",
    )
    history = await _history(store, task_id)
    if history is None:
        return
    tally.ledger_checked += 1
    tally.committed_events += len(history)
    revisions = [int(item[1]) for item in history]
    checks.check(
        "revisionsGapFree",
        revisions == list(range(1, params.depth + 1)),
        f"{task_id}: ledger revisions {revisions}",
    )
    checks.check(
        "ledgerMatchesWinners",
        [(e.id, rev, at) for e, rev, at in history] == [(e.id, rev, at) for e, rev, at in winners]
        and all(h[0] == w[0] for h, w in zip(history, winners, strict=False)),
        f"{task_id}: ledger differs from the committed winners",
    )
    times = [int(item[2]) for item in history]
    checks.check(
        "commitTimesIncrease",
        all(a < b for a, b in itertools.pairwise(times)),
        f"{task_id}: commit times {times}",
    )


async def run_cas(
    store: Store, params: CasParams, prefix: str, *, progress: bool = False
) -> tuple[Checks, dict[str, Any]]:
    """Run the workload on an opened store; returns the checks and the timings."""
    checks = Checks()
    tally = _Tally()
    plans = plan_tasks(params, prefix)
    bar = Progress("cas", len(plans), enabled=progress)
    started = trio.current_time()
    wall = _wall()

    async def one(plan: TaskPlan) -> None:
        await _run_task(store, plan, params, tally, checks)
        bar.advance()

    try:
        with trio.fail_after(params.timeout_ms / 1000):
            async with trio.open_nursery() as nursery:
                for plan in plans:
                    nursery.start_soon(one, plan)
    finally:
        bar.close()
    per_revision = params.tasks * params.depth
    checks.figure("tasks", params.tasks)
    checks.figure("writersPerTask", params.writers)
    checks.figure("revisionsPerTask", params.depth)
    checks.figure("attempts", tally.attempts)
    checks.figure("applied", tally.applied)
    checks.figure("conflicts", tally.conflicts)
    checks.figure("unexpected", dict(sorted(tally.unexpected.items())))
    checks.figure("duplicatesReplayed", tally.duplicates)
    checks.figure("loserRetriesConflicted", tally.loser_retries_conflicted)
    checks.figure("eventIdReuseRefused", tally.reuse_refused)
    checks.figure("lateEventsUnchanged", tally.late_unchanged)
    checks.figure("ledgerTasksChecked", tally.ledger_checked)
    checks.figure("committedEvents", tally.committed_events)
    checks.figure("terminalTasks", tally.terminal)
    checks.figure("finalStatuses", dict(sorted(tally.statuses.items())))
    expected_statuses = Counter(plan.steps[-1] for plan in plans)
    checks.check(
        "casExactlyOneWinnerPerRevision",
        tally.applied == per_revision
        and tally.conflicts == per_revision * (params.writers - 1)
        and not tally.unexpected,
        f"applied {tally.applied}, conflicts {tally.conflicts}, "
        f"unexpected {dict(tally.unexpected)}",
    )
    checks.check("duplicatesReplayOriginal", tally.duplicates == per_revision)
    checks.check(
        "losersCommittedNothing",
        tally.loser_retries_conflicted == per_revision * (params.writers - 1),
    )
    checks.check("eventIdReuseRefused", tally.reuse_refused == per_revision)
    checks.check("lateEventsUnchanged", tally.late_unchanged == params.tasks)
    checks.check(
        "allTasksTerminalWithPlannedStatus",
        tally.terminal == params.tasks and tally.statuses == expected_statuses,
        f"statuses {dict(tally.statuses)} != planned {dict(expected_statuses)}",
    )
    if tally.ledger_checked:
        checks.check(
            "casOneCommittedEventPerRevision",
            tally.ledger_checked == params.tasks and tally.committed_events == per_revision,
            f"{tally.committed_events} ledger events for {per_revision} revisions",
        )
    elapsed = _wall() - wall
    timings = {
        "wallSeconds": round(elapsed, 6),
        "trioSeconds": round(trio.current_time() - started, 6),
        "transitionsPerSecond": round(tally.attempts / elapsed, 1) if elapsed > 0 else None,
    }
    return checks, timings


def _wall() -> float:
    import time

    return time.perf_counter()
