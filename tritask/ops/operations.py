"""What the operator commands do to a store, as functions of an opened store (no I/O).

Every read goes through the store's :class:`~tritask.tasks.store.ListsTasks` capability and
every write through the store contract, so the commands work on any store that offers it (the
three built-in ones do) and the store stays the authority: on its clock, its leases, its
compare-and-set. Tests call these functions on an in-process :class:`MemoryStore`; the CLI
calls them on a store opened from a URL.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import AsyncIterator

import attrs

from tritask.tasks.instrumentation import InstrumentationSink
from tritask.tasks.model import TaskStatus
from tritask.tasks.runner import Runner
from tritask.tasks.store import (
    MAX_LIST_PAGE,
    Action,
    ListsTasks,
    NotFound,
    Store,
    StoredTask,
    TaskInspection,
    TaskListing,
    TaskQuery,
    lists_tasks,
)

__all__ = [
    "CancelOutcome",
    "CancelReport",
    "NotAnOperatorStore",
    "StoreStatistics",
    "cancel_task",
    "collect_statistics",
    "inspect",
    "list_all",
    "list_page",
    "operator_store",
    "reap_expired",
]


class NotAnOperatorStore(TypeError):
    """The store does not offer the operator capability (``ListsTasks``)."""


def operator_store(store: Store) -> ListsTasks:
    """``store`` as the operator capability, or :class:`NotAnOperatorStore` naming the gap."""
    if not lists_tasks(store):
        raise NotAnOperatorStore(
            f"{type(store).__name__} does not offer the operator capability (list_tasks, "
            "inspect_task, operator_access: tritask.tasks.store.ListsTasks)"
        )
    return store


async def list_page(store: Store, query: TaskQuery) -> TaskListing:
    return await operator_store(store).list_tasks(query)


async def list_all(store: Store, query: TaskQuery) -> AsyncIterator[TaskListing]:
    """Every page of ``query`` in turn (``query.limit`` tasks a page), each its own read."""
    operator = operator_store(store)
    while True:
        page = await operator.list_tasks(query)
        yield page
        if page.next_after is None:
            return
        query = attrs.evolve(query, after=page.next_after)


async def inspect(store: Store, task_id: str) -> TaskInspection | NotFound:
    return await operator_store(store).inspect_task(task_id)


class CancelOutcome(enum.StrEnum):
    CANCELLED = "cancelled"
    ALREADY_TERMINAL = "already_terminal"
    NOT_FOUND = "not_found"
    EXPIRED = "expired"


@attrs.frozen(kw_only=True)
class CancelReport:
    task_id: str
    outcome: CancelOutcome
    status: TaskStatus | None
    revision: int | None


async def cancel_task(
    store: Store,
    task_id: str,
    *,
    runner: Runner | None = None,
    instrumentation: InstrumentationSink | None = None,
) -> CancelReport:
    """Cancel a task the way a client's ``tasks/cancel`` does, with operator authority.

    The access is the operator's (:meth:`ListsTasks.operator_access`, in the task's own scope);
    the commit is :meth:`Runner.cancel`'s: ``cancelled`` by compare-and-set on the store,
    recorded in its ledger and, on a store with wake-ups (PostgreSQL ``NOTIFY``), announced to
    the runner holding the attempt on any host, which stops it at once; other runners see it
    at their next heartbeat. ``runner`` is the process's own runner when it has one (an
    in-process operator: its local attempt is stopped before this returns); otherwise a runner
    that is never started commits it (it only needs the store for that).
    """
    operator = operator_store(store)
    before = await operator.inspect_task(task_id)
    if isinstance(before, NotFound):
        return CancelReport(
            task_id=task_id, outcome=CancelOutcome.NOT_FOUND, status=None, revision=None
        )
    if before.task.snapshot.task.status.is_terminal:
        return _report(task_id, CancelOutcome.ALREADY_TERMINAL, before.task)
    if before.task.expired:
        return _report(task_id, CancelOutcome.EXPIRED, before.task)
    access = await operator.operator_access(task_id, Action.CANCEL)
    if isinstance(access, NotFound):  # reaped meanwhile
        return CancelReport(
            task_id=task_id, outcome=CancelOutcome.NOT_FOUND, status=None, revision=None
        )
    committer = runner or Runner(
        store, reap_interval_ms=None, instrumentation=instrumentation, owner_id="tritask-operator"
    )
    snapshot = await committer.cancel(task_id, access)
    if isinstance(snapshot, NotFound):  # expired or reaped between the reads and the commit
        return CancelReport(
            task_id=task_id, outcome=CancelOutcome.NOT_FOUND, status=None, revision=None
        )
    status = snapshot.task.status
    outcome = (
        CancelOutcome.CANCELLED
        if status is TaskStatus.CANCELLED
        else CancelOutcome.ALREADY_TERMINAL
    )
    return CancelReport(task_id=task_id, outcome=outcome, status=status, revision=snapshot.revision)


def _not_found(task_id: str) -> CancelReport:
    return CancelReport(
        task_id=task_id, outcome=CancelOutcome.NOT_FOUND, status=None, revision=None
    )


def _report(task_id: str, outcome: CancelOutcome, task: StoredTask) -> CancelReport:
    snapshot = task.snapshot
    return CancelReport(
        task_id=task_id, outcome=outcome, status=snapshot.task.status, revision=snapshot.revision
    )


@attrs.frozen(kw_only=True)
class StoreStatistics:
    """What ``tritask tasks stats`` shows: counts and the tasks that need an operator's eye.

    Counted over pages of ``list_tasks``, each read on the store's clock (``now`` is the first
    page's): on a busy store the totals are a sum of close snapshots, not one.
    """

    now: int
    total: int
    by_status: dict[TaskStatus, int]
    by_tool: dict[str | None, dict[TaskStatus, int]]
    oldest_active: StoredTask | None
    expiring: tuple[StoredTask, ...]
    """Live claims of active tasks that end within the window: a heartbeat is overdue."""
    lapsed: tuple[StoredTask, ...]
    """Active tasks whose claim has ended without a release: the owner stopped or lost the
    database; recovery (a runner with ``recover=True``) adopts them."""
    retrying: int
    """Active tasks waiting for their ``retry_at``."""
    expired: int
    """Tasks past their TTL, deleted by the next reap."""


async def collect_statistics(store: Store, *, expiring_within_ms: int) -> StoreStatistics:
    if type(expiring_within_ms) is not int or expiring_within_ms < 0:
        raise ValueError("expiring_within_ms must be an int >= 0")
    by_status: Counter[TaskStatus] = Counter()
    by_tool: dict[str | None, Counter[TaskStatus]] = {}
    oldest: StoredTask | None = None
    expiring: list[StoredTask] = []
    lapsed: list[StoredTask] = []
    retrying = expired = total = 0
    now: int | None = None
    async for page in list_all(store, TaskQuery(limit=MAX_LIST_PAGE)):
        if now is None:
            now = page.now
        for task in page.tasks:
            status = task.snapshot.task.status
            total += 1
            by_status[status] += 1
            by_tool.setdefault(task.tool, Counter())[status] += 1
            expired += task.expired
            if status.is_terminal:
                continue
            if oldest is None:
                oldest = task  # pages come in creation order
            retry_at = task.snapshot.retry_at
            if retry_at is not None and retry_at > page.now:
                retrying += 1
            claim = task.claim
            if claim is None:
                continue
            if not claim.live:
                lapsed.append(task)
            elif claim.expires_at - page.now <= expiring_within_ms * 1000:
                expiring.append(task)
    assert now is not None  # list_all yields at least one page
    return StoreStatistics(
        now=now,
        total=total,
        by_status={status: by_status[status] for status in TaskStatus},
        by_tool={tool: dict(counts) for tool, counts in by_tool.items()},
        oldest_active=oldest,
        expiring=tuple(
            sorted(expiring, key=lambda t: (t.claim.expires_at if t.claim else 0, t.task_id))
        ),
        lapsed=tuple(lapsed),
        retrying=retrying,
        expired=expired,
    )


def _claim_end(task: StoredTask) -> tuple[int, str]:
    return (0 if task.claim is None else task.claim.expires_at, task.task_id)


async def reap_expired(store: Store) -> list[str]:
    """Reap until nothing expired is left (durable stores reap in batches); sorted ids."""
    reaped: list[str] = []
    while batch := await store.reap():
        reaped.extend(batch)
    return sorted(reaped)
