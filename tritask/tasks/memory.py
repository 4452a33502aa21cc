"""``MemoryStore``: the volatile reference implementation of the Store contract.

Each operation checkpoints once (so trio cancellation is honoured) and then runs to completion
without awaiting, which makes it atomic under trio's cooperative scheduling.

Choices worth knowing:

* commit times: ``committed_at = max(now, last_updated_at + 1 ms)`` (parity with the reference
  memory store, and wire times keep their millisecond form when the clock is millisecond-aligned);
* ``claim_next`` keeps heaps with lazy invalidation: ``ready`` by ``(created_at, task_id)``
  (one heap for tasks without a concurrency key, one per key) and ``timed`` by the instant a
  task becomes claimable (retry due or lease expired), so a call costs O(log n) amortised
  (plus one look per key with ready tasks) instead of a scan; ``reap`` pops an expiry heap;
* it is a queue (:class:`~tritask.tasks.store.Queues`): a submitted task waits unclaimed, its
  status message :data:`~tritask.tasks.store.QUEUED_MESSAGE` until its first claim, and
  ``listen_queue`` callbacks hear of every commit that may make one claimable;
* ``renew_owner`` (:class:`~tritask.tasks.store.RenewsOwnerLease`) keeps, per owner, its
  latest batch and the owner lease's expiry; a claim follows it while it is the claim that
  batch renewed (the same object), so a claim left out, renewed alone or replaced has its own
  expiry again without any write;
* values crossing the boundary are copied both ways, so callers mutating a returned snapshot,
  event or effect cannot change the stored state (as with a real database).
"""

from __future__ import annotations

import heapq
import itertools
import secrets
from collections.abc import AsyncGenerator, Callable
from types import TracebackType
from typing import Any, Self

import attrs
import trio

from tritask.tasks._time import Clock, system_clock
from tritask.tasks.changes import ChangeFeed, TaskChange
from tritask.tasks.events import Effects, Event
from tritask.tasks.model import (
    CorruptRecord,
    Snapshot,
    Task,
    TaskStatus,
    clone_snapshot,
    clone_task,
    initial_snapshot,
    owned_task,
    owned_work,
    revise,
)
from tritask.tasks.reducer import apply
from tritask.tasks.store import (
    LEASE_LOST,
    NOT_FOUND,
    QUEUED_MESSAGE,
    REQUEST_KINDS,
    SETTLE_KINDS,
    UNAVAILABLE,
    WORKER_KINDS,
    Access,
    Action,
    AlreadyExists,
    Authority,
    CapacityExceeded,
    Claimed,
    ClaimInfo,
    Concurrency,
    Conflict,
    Deferred,
    EventIdReused,
    InvalidTask,
    Lease,
    LeaseLost,
    LedgerEntry,
    NotFound,
    OwnerRenewal,
    Renewed,
    RequestAuthority,
    Scope,
    StaleLease,
    StoredTask,
    TaskInspection,
    TaskListing,
    TaskQuery,
    Transition,
    UnauthorizedAction,
    Unavailable,
    WorkerAuthority,
    check_create_access,
    check_limit,
    check_operator_action,
    check_owner,
    check_owner_renewal,
    check_positive_ms,
    check_renewals,
    check_submit,
    check_task_query,
    check_transition_arguments,
    listing_page,
    new_access,
    require_scope,
)
from tritask.tasks.work import Work, canonical_json, canonical_text, clone_json, unchecked_evolve

__all__ = ["MemoryStore", "open_memory_store"]

_COMMIT_STEP_US = 1000
_READ_ACTIONS = frozenset({Action.GET, Action.UPDATE, Action.CANCEL})


def _stamped(task: Task, now: int) -> Task:
    """A new task stamped at ``now`` (anything else is left for ``create`` to refuse)."""
    if not isinstance(task, Task) or task.created_at != task.last_updated_at:
        return task
    try:
        return owned_task(task, created_at=now, last_updated_at=now)
    except (TypeError, ValueError) as exc:  # e.g. the TTL now ends past the last instant
        raise InvalidTask(str(exc)) from exc


def _own_effects(effects: Effects) -> Effects:
    """Effects a caller may keep: without accepted responses they hold no mutable JSON."""
    responses = effects.accepted_input_responses
    if responses is None:
        return effects
    return unchecked_evolve(effects, accepted_input_responses=clone_json(responses))


def _event_text(event: Event) -> str:
    """``canonical_json(event.to_json())`` of an event whose data is already checked JSON."""
    doc = {"version": 1, "id": event.id, "kind": event.kind.value, "data": event.data}
    return canonical_text(doc)


@attrs.frozen
class _Seen:
    """The original commit of an event id, replayed verbatim for a duplicate. ``event`` is the
    store's own copy: its canonical text is only needed when the id comes back."""

    event: Event
    event_revision: int
    committed_at: int
    effects: Effects


@attrs.define(eq=False)
class _Entry:
    serial: int
    snapshot: Snapshot
    scope: str
    claim: Lease | None = None
    following: Lease | None = None
    """The claim as ``renew_owner`` last renewed it: it follows its owner's lease while it is
    still ``claim`` (the same object) and ``follow_serial`` is the owner's latest batch."""
    follow_serial: int = 0
    generation: int = 0
    sched: int = 0
    concurrency: Concurrency | None = None
    queued: bool = False
    """Submitted unclaimed: the first claim gives the task ``start_message`` back."""
    start_message: str | None = None
    seen: dict[str, _Seen] = attrs.field(factory=dict)
    history: list[LedgerEntry] = attrs.field(factory=list)

    @property
    def active(self) -> bool:
        return not self.snapshot.task.status.is_terminal

    def expired(self, now: int) -> bool:
        expires_at = self.snapshot.task.expires_at
        return expires_at is not None and now >= expires_at


class MemoryStore:
    """The in-process store. ``scope`` is required; limits accept ``None`` for unlimited.

    ``clock`` returns µs; use :class:`tritask.tasks._time.TrioClock` to follow trio's clock.
    """

    def __init__(
        self,
        *,
        scope: Scope | None = None,
        clock: Clock = system_clock,
        max_tasks: int | None = 10_000,
        max_active_tasks_per_scope: int | None = 100,
    ) -> None:
        self._scope = require_scope(scope, store="MemoryStore")
        if not callable(clock):
            raise TypeError("clock must be a zero-argument callable returning µs")
        self._clock = clock
        self._max_tasks = check_limit(max_tasks, "max_tasks")
        self._max_active = check_limit(max_active_tasks_per_scope, "max_active_tasks_per_scope")
        self._id = secrets.token_urlsafe(16)
        self._entries: dict[str, _Entry] = {}
        self._active: dict[str, int] = {}
        self._ready: list[tuple[int, str, int, int]] = []
        # Ready tasks with a concurrency key wait in a heap of their key's; claims by key.
        self._key_ready: dict[str, list[tuple[int, str, int, int]]] = {}
        self._key_claims: dict[str, set[str]] = {}
        self._queue_listeners: list[Callable[[], None]] = []
        self._timed: list[tuple[int, str, int, int]] = []
        self._expiry: list[tuple[int, str, int]] = []
        self._items = 0
        """Heap items pushed since the last compaction (an upper bound of the heaps' sizes)."""
        self._serials = itertools.count(1)
        # renew_owner: each owner's latest batch (its serial) and the owner lease's expiry.
        self._owners: dict[str, tuple[int, int]] = {}
        self._batch_serials = itertools.count(1)
        self._closed = False
        self._feed = ChangeFeed()

    def __repr__(self) -> str:
        return f"<MemoryStore tasks={len(self._entries)}>"

    # -- lifecycle ----------------------------------------------------------------------------

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()
        self._closed = True
        self._feed.close()

    def changes(self) -> AsyncGenerator[TaskChange, None]:
        """Every change committed through this store from now on (``OffersChanges``): each
        applied transition with its snapshot, in commit order, and each reaped task."""
        return self._feed.changes()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def _enter(self) -> int:
        """Checkpoint, then read the clock: everything after runs without yielding."""
        await trio.lowlevel.checkpoint()
        if self._closed:
            raise trio.ClosedResourceError("the store is closed")
        now = self._clock()
        if not isinstance(now, int) or isinstance(now, bool):
            raise TypeError("the store clock must return an int of microseconds")
        return now

    async def now(self) -> int:
        return await self._enter()

    # -- requests -----------------------------------------------------------------------------

    async def authorize(self, ctx: object, action: Action, task_id: str) -> Access:
        await self._enter()
        return new_access(self._id, self._scope, ctx, action, task_id)

    async def create(self, task: Task, work: Work, access: Access) -> Snapshot:
        now = await self._enter()
        return clone_snapshot(self._insert(task, work, access, now).snapshot)

    async def create_claimed(
        self, task: Task, work: Work, access: Access, owner_id: str, lease_ms: int
    ) -> Claimed:
        """``create`` and ``claim`` in one atomic step (no runner can adopt it in between)."""
        now = await self._enter()
        owner_id, lease_ms = check_owner(owner_id), check_positive_ms(lease_ms, "lease_ms")
        return self._grant(self._insert(task, work, access, now), owner_id, lease_ms, now)

    async def create_claimed_stamped(
        self, task: Task, work: Work, access: Access, owner_id: str, lease_ms: int
    ) -> Claimed:
        """``create_claimed`` with ``createdAt``/``lastUpdatedAt`` read from the store's clock."""
        now = await self._enter()
        owner_id, lease_ms = check_owner(owner_id), check_positive_ms(lease_ms, "lease_ms")
        stamped = _stamped(task, now)
        entry = self._insert(stamped, work, access, now, owned=stamped is not task)
        return self._grant(entry, owner_id, lease_ms, now)

    async def submit(
        self,
        task: Task,
        work: Work,
        access: Access,
        *,
        owner_id: str | None,
        lease_ms: int,
        concurrency: Concurrency | None = None,
    ) -> Claimed | Snapshot:
        """Create (stamped), then claim for ``owner_id`` when a slot of its key is free, else
        queue it (see :class:`~tritask.tasks.store.Queues`)."""
        now = await self._enter()
        owner_id, lease_ms, concurrency = check_submit(owner_id, lease_ms, concurrency)
        stamped = _stamped(task, now)
        claim = owner_id is not None and (
            concurrency is None
            or (
                self._running(concurrency.key, now) < concurrency.limit
                and self._key_head(concurrency.key) is None
            )
        )
        queued = stamped
        if not claim and isinstance(stamped, Task):
            queued = revise(stamped, status_message=QUEUED_MESSAGE)
        entry = self._insert(
            queued, work, access, now, owned=stamped is not task, concurrency=concurrency
        )
        if claim:
            assert owner_id is not None
            return self._grant(entry, owner_id, lease_ms, now)
        entry.queued = True
        entry.start_message = stamped.status_message
        self._signal()
        return clone_snapshot(entry.snapshot)

    def listen_queue(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback()`` after each commit that may make a task claimable."""
        listeners = self._queue_listeners
        listeners.append(callback)
        return lambda: listeners.remove(callback) if callback in listeners else None

    def _signal(self) -> None:
        for callback in list(self._queue_listeners):
            callback()

    def _insert(
        self,
        task: Task,
        work: Work,
        access: Access,
        now: int,
        *,
        owned: bool = False,
        concurrency: Concurrency | None = None,
    ) -> _Entry:
        """Store a checked copy of the caller's task and work (``owned``: the task already is
        one, made by ``_stamped``)."""
        check_create_access(access, self._id, task)
        try:
            if isinstance(task, Task) and isinstance(work, Work):
                task, work = (task if owned else owned_task(task)), owned_work(work)
            snapshot = initial_snapshot(task, work)
        except (CorruptRecord, TypeError, ValueError) as exc:
            raise InvalidTask(str(exc)) from exc
        if task.id in self._entries:
            raise AlreadyExists(task.id)
        if self._max_tasks is not None and len(self._entries) >= self._max_tasks:
            raise CapacityExceeded("max_tasks")
        active = self._active.get(access.scope, 0)
        if self._max_active is not None and active >= self._max_active:
            raise CapacityExceeded("max_active_tasks_per_scope")
        entry = _Entry(
            serial=next(self._serials),
            snapshot=snapshot,
            scope=access.scope,
            concurrency=concurrency,
        )
        self._entries[task.id] = entry
        self._active[access.scope] = active + 1
        expires_at = snapshot.task.expires_at
        if expires_at is not None:
            heapq.heappush(self._expiry, (expires_at, task.id, entry.serial))
        self._reschedule(entry, now)
        return entry

    async def get(self, task_id: str, access: Access) -> Snapshot | NotFound:
        now = await self._enter()
        entry = self._request_entry(task_id, access, now, _READ_ACTIONS)
        return NOT_FOUND if entry is None else clone_snapshot(entry.snapshot)

    def _request_entry(
        self, task_id: str, access: Access, now: int, allowed: frozenset[Action]
    ) -> _Entry | None:
        """Visibility first (``None``: absent, other store/scope, expired), then the action."""
        if not isinstance(access, Access):
            raise TypeError("request authority needs an Access from authorize()")
        entry = self._entries.get(task_id)
        if (
            entry is None
            or access.store_id != self._id
            or access.scope != entry.scope
            or entry.expired(now)
        ):
            return None
        if access.task_id != task_id or access.action not in allowed:
            raise UnauthorizedAction(f"a {access.action.value} access cannot do this")
        return entry

    # -- workers ------------------------------------------------------------------------------

    def _check_lease(self, entry: _Entry, lease: Lease, now: int) -> None:
        if not isinstance(lease, Lease) or entry.claim != lease or now >= lease.expires_at:
            raise StaleLease("the lease is not the live claim of this task")

    async def worker_snapshot(self, task_id: str, lease: Lease) -> Snapshot | NotFound:
        now = await self._enter()
        entry = self._entries.get(task_id)
        if entry is None:
            return NOT_FOUND
        self._check_lease(entry, lease, now)
        return clone_snapshot(entry.snapshot)

    def _eligibility(self, entry: _Entry, now: int) -> Deferred | Unavailable | None:
        """Reference 3.6 order; ``None`` means claimable now."""
        snapshot = entry.snapshot
        if snapshot.task.status.is_terminal or snapshot.work is None:
            return UNAVAILABLE
        available_at = snapshot.available_at
        if available_at is not None and available_at > now:
            return Deferred(-(-(available_at - now) // 1000))
        if entry.claim is not None and now < entry.claim.expires_at:
            return UNAVAILABLE
        concurrency = entry.concurrency
        if concurrency is not None and self._running(concurrency.key, now) >= concurrency.limit:
            return UNAVAILABLE
        return None

    def _running(self, key: str, now: int) -> int:
        """How many tasks of concurrency key ``key`` hold a live claim at ``now``."""
        claimed = self._key_claims.get(key)
        if not claimed:
            return 0
        count = 0
        for task_id in claimed:
            claim = self._entries[task_id].claim
            if claim is not None and now < claim.expires_at:
                count += 1
        return count

    def _key_head(self, key: str) -> _Entry | None:
        """The oldest ready task of ``key`` (stale heap items dropped), if any."""
        heap = self._key_ready.get(key)
        while heap:
            entry = self._live(*heap[0][1:])
            if entry is not None:
                return entry
            heapq.heappop(heap)
        if heap is not None:
            del self._key_ready[key]
        return None

    def _grant(self, entry: _Entry, owner_id: str, lease_ms: int, now: int) -> Claimed:
        if entry.queued:
            entry.queued = False
            task = entry.snapshot.task
            if task.status is TaskStatus.WORKING and task.status_message == QUEUED_MESSAGE:
                started = revise(task, status_message=entry.start_message)
                entry.snapshot = revise(entry.snapshot, task=started)
        concurrency = entry.concurrency
        if concurrency is not None:
            self._key_claims.setdefault(concurrency.key, set()).add(entry.snapshot.task.id)
        entry.generation += 1
        lease = Lease(
            store_id=self._id,
            task_id=entry.snapshot.task.id,
            owner_id=owner_id,
            token=secrets.token_urlsafe(32),
            generation=entry.generation,
            expires_at=now + lease_ms * 1000,
        )
        entry.claim = lease
        self._reschedule(entry, now)
        return Claimed(clone_snapshot(entry.snapshot), lease)

    async def claim(
        self, task_id: str, owner_id: str, lease_ms: int
    ) -> Claimed | Deferred | Unavailable | NotFound:
        now = await self._enter()
        owner_id, lease_ms = check_owner(owner_id), check_positive_ms(lease_ms, "lease_ms")
        entry = self._entries.get(task_id)
        if entry is None:
            return NOT_FOUND
        verdict = self._eligibility(entry, now)
        return self._grant(entry, owner_id, lease_ms, now) if verdict is None else verdict

    async def claim_next(self, owner_id: str, lease_ms: int) -> Claimed | None:
        now = await self._enter()
        owner_id, lease_ms = check_owner(owner_id), check_positive_ms(lease_ms, "lease_ms")
        while self._timed and self._timed[0][0] <= now:
            _, task_id, serial, sched = heapq.heappop(self._timed)
            entry = self._live(task_id, serial, sched)
            if entry is not None:
                self._push_ready(entry, (entry.snapshot.task.created_at, task_id, serial, sched))
        while True:
            entry = self._next_ready(now)
            if entry is None:
                return None
            if self._eligibility(entry, now) is None:
                return self._grant(entry, owner_id, lease_ms, now)
            self._reschedule(entry, now)  # the clock went backwards: wait again

    def _next_ready(self, now: int) -> _Entry | None:
        """The ready task to claim next: fewest live claims of its key first (no key: none),
        then the oldest; keys at their limit are passed over."""
        best: tuple[int, int, str] | None = None
        chosen: _Entry | None = None
        while self._ready:
            entry = self._live(*self._ready[0][1:])
            if entry is not None:
                best, chosen = (0, *self._ready[0][:2]), entry
                break
            heapq.heappop(self._ready)
        for key in list(self._key_ready):
            head = self._key_head(key)
            if head is None:
                continue
            assert head.concurrency is not None
            running = self._running(key, now)
            if running >= head.concurrency.limit:
                continue
            rank = (running, head.snapshot.task.created_at, head.snapshot.task.id)
            if best is None or rank < best:
                best, chosen = rank, head
        if chosen is not None:
            concurrency = chosen.concurrency
            heap = self._ready if concurrency is None else self._key_ready[concurrency.key]
            heapq.heappop(heap)
        return chosen

    def _push_ready(self, entry: _Entry, item: tuple[int, str, int, int]) -> None:
        concurrency = entry.concurrency
        if concurrency is None:
            heapq.heappush(self._ready, item)
        else:
            heapq.heappush(self._key_ready.setdefault(concurrency.key, []), item)

    async def renew(self, lease: Lease, lease_ms: int) -> Lease:
        now = await self._enter()
        lease_ms = check_positive_ms(lease_ms, "lease_ms")
        entry = self._lease_entry(lease)
        self._check_lease(entry, lease, now)
        # A fresh token too: the old value must go stale even if the expiry happens to repeat.
        renewed = attrs.evolve(
            lease, token=secrets.token_urlsafe(32), expires_at=now + lease_ms * 1000
        )
        entry.claim = renewed
        self._reschedule(entry, now)
        return renewed

    async def renew_all(
        self, owner_id: str, leases: list[Lease] | tuple[Lease, ...], lease_ms: int
    ) -> list[Renewed | LeaseLost]:
        """Renew every lease that is its task's live claim and ``owner_id``'s, in one step."""
        now = await self._enter()
        owner_id, batch, lease_ms = check_renewals(owner_id, leases, lease_ms)
        expires_at = now + lease_ms * 1000
        results: list[Renewed | LeaseLost] = []
        for lease in batch:
            entry = self._entries.get(lease.task_id) if lease.store_id == self._id else None
            if (
                entry is None
                or lease.owner_id != owner_id
                or entry.claim != lease
                or now >= lease.expires_at
            ):
                results.append(LEASE_LOST)
                continue
            renewed = attrs.evolve(lease, token=secrets.token_urlsafe(32), expires_at=expires_at)
            entry.claim = renewed
            self._reschedule(entry, now)
            results.append(Renewed(renewed, entry.snapshot.revision))
        return results

    async def renew_owner(
        self,
        owner_id: str,
        leases: list[Lease] | tuple[Lease, ...],
        revisions: list[int] | tuple[int, ...],
        following: int | None,
        lease_ms: int,
    ) -> OwnerRenewal:
        """Renew every lease of ``owner_id`` that is its task's live claim by extending its
        owner lease, in one step (:class:`~tritask.tasks.store.RenewsOwnerLease`)."""
        now = await self._enter()
        owner_id, batch, known, following, lease_ms = check_owner_renewal(
            owner_id, leases, revisions, following, lease_ms
        )
        if not batch:
            return OwnerRenewal(None, (), ())
        expires_at = now + lease_ms * 1000
        previous = self._owners.get(owner_id)
        serial = next(self._batch_serials)
        seen: set[str] = set()  # only the first lease of a task counts
        renewed = False
        lost: list[int] = []
        changed: list[int] = []
        for index, lease in enumerate(batch):
            entry = self._entries.get(lease.task_id) if lease.store_id == self._id else None
            claim = None if entry is None else entry.claim
            repeat = lease.task_id in seen
            seen.add(lease.task_id)
            if (
                entry is None
                or claim is None
                or repeat
                or lease.owner_id != owner_id
                or now >= claim.expires_at
            ):
                lost.append(index)
                continue
            follows = (
                previous is not None
                and entry.following is claim
                and entry.follow_serial == previous[0]
            )
            if follows:
                assert previous is not None
                matches = following == previous[1] and claim == attrs.evolve(
                    lease, expires_at=claim.expires_at
                )
            else:
                matches = claim == lease
            if not matches:
                lost.append(index)
                continue
            renewed = True
            entry.claim = entry.following = attrs.evolve(claim, expires_at=expires_at)
            entry.follow_serial = serial
            self._reschedule(entry, now)
            if entry.snapshot.revision > known[index]:
                changed.append(index)
        # Claims that followed the previous batch and are not in this one keep their expiry
        # as their own: they no longer match this batch's serial.
        if renewed:
            self._owners[owner_id] = (serial, expires_at)
            return OwnerRenewal(expires_at, tuple(lost), tuple(changed))
        self._owners.pop(owner_id, None)
        return OwnerRenewal(None, tuple(lost), ())

    async def release(self, lease: Lease) -> None:
        now = await self._enter()
        entry = self._lease_entry(lease)
        if entry.claim != lease:
            raise StaleLease("the lease does not match the task's claim")
        self._unclaim(entry, now)

    def _unclaim(self, entry: _Entry, now: int) -> None:
        """Clear the claim: the task (or another of its key) may be claimable now."""
        entry.claim = None
        if entry.concurrency is not None:
            self._key_claims.get(entry.concurrency.key, set()).discard(entry.snapshot.task.id)
        self._reschedule(entry, now)
        if entry.concurrency is not None:
            self._signal()  # a slot of its key freed: a queued task of the key may start

    def _lease_entry(self, lease: Lease) -> _Entry:
        if not isinstance(lease, Lease) or lease.store_id != self._id:
            raise StaleLease("the lease is not from this store")
        entry = self._entries.get(lease.task_id)
        if entry is None:
            raise StaleLease("the leased task no longer exists")
        return entry

    # -- transitions --------------------------------------------------------------------------

    async def transition(
        self, task_id: str, expected_revision: int, event: Event, authority: Authority
    ) -> Transition | Conflict | NotFound:
        now = await self._enter()
        check_transition_arguments(expected_revision, event)
        entry = self._entries.get(task_id)
        if entry is None:
            return NOT_FOUND
        if isinstance(authority, RequestAuthority):
            allowed = frozenset(a for a, kinds in REQUEST_KINDS.items() if event.kind in kinds)
            if self._request_entry(task_id, authority.access, now, allowed) is None:
                return NOT_FOUND
        elif isinstance(authority, WorkerAuthority):
            self._check_lease(entry, authority.lease, now)
            if event.kind not in WORKER_KINDS:
                raise UnauthorizedAction(f"a worker lease cannot apply {event.kind.value}")
        else:
            raise TypeError("authority must be RequestAuthority or WorkerAuthority")
        return self._apply(entry, expected_revision, event, now)

    async def settle(
        self, task_id: str, expected_revision: int, event: Event, lease: Lease
    ) -> Transition | Conflict | NotFound:
        """A worker's final event and the release of its claim in one atomic step."""
        now = await self._enter()
        check_transition_arguments(expected_revision, event)
        entry = self._entries.get(task_id)
        if entry is None:
            return NOT_FOUND
        if event.kind not in SETTLE_KINDS:
            raise UnauthorizedAction(f"settle cannot apply {event.kind.value}")
        try:
            self._check_lease(entry, lease, now)
        except StaleLease:
            replay = self._released_replay(entry, lease, event)
            if replay is None:
                raise
            return replay
        result = self._apply(entry, expected_revision, event, now)
        if isinstance(result, Transition):
            self._unclaim(entry, now)
        return result

    def _released_replay(self, entry: _Entry, lease: object, event: Event) -> Transition | None:
        """The resend of a settle that committed and released (no later claim was made)."""
        if (
            not isinstance(lease, Lease)
            or lease.store_id != self._id
            or lease.task_id != entry.snapshot.task.id
            or entry.claim is not None
            or entry.generation != lease.generation
        ):
            return None
        seen = entry.seen.get(event.id)
        if seen is None or _event_text(seen.event) != canonical_json(event.to_json()):
            return None
        return self._duplicate(entry, seen)

    @staticmethod
    def _duplicate(entry: _Entry, seen: _Seen) -> Transition:
        return Transition(
            outcome="duplicate",
            snapshot=clone_snapshot(entry.snapshot),
            effects=_own_effects(seen.effects),
            event_revision=seen.event_revision,
            committed_at=seen.committed_at,
        )

    def _apply(
        self, entry: _Entry, expected_revision: int, event: Event, now: int
    ) -> Transition | Conflict:
        """Replay check, then the revision check, then the reducer (authority already checked)."""
        # The store's own checked copy of the caller's event: the reducer's input, the ledger
        # entry and what a resend with the same id is compared with.
        event = Event(event.id, event.kind, event.data)
        seen = entry.seen.get(event.id)
        if seen is not None:
            if _event_text(seen.event) != _event_text(event):
                raise EventIdReused(event.id)
            return self._duplicate(entry, seen)
        if entry.snapshot.revision != expected_revision:
            return Conflict(clone_snapshot(entry.snapshot))

        committed_at = max(now, entry.snapshot.task.last_updated_at + _COMMIT_STEP_US)
        outcome = apply(entry.snapshot, event, committed_at)
        if outcome.kind == "unchanged":
            return Transition(
                outcome="unchanged",
                snapshot=clone_snapshot(entry.snapshot),
                effects=_own_effects(outcome.effects),
                event_revision=entry.snapshot.revision,
                committed_at=committed_at,
            )
        was_active = entry.active
        entry.snapshot = outcome.snapshot
        revision = outcome.snapshot.revision
        entry.history.append(
            LedgerEntry(
                event=event,
                revision=revision,
                committed_at=committed_at,
                effects=outcome.effects,
            )
        )
        entry.seen[event.id] = _Seen(event, revision, committed_at, outcome.effects)
        if was_active and not entry.active:
            self._deactivate(entry.scope)
        self._reschedule(entry, now)
        if self._feed.active:
            snapshot = outcome.snapshot
            self._feed.announce(TaskChange.of(snapshot, clone_task(snapshot.task)))
        return Transition(
            outcome="applied",
            snapshot=clone_snapshot(outcome.snapshot),
            effects=_own_effects(outcome.effects),
            event_revision=revision,
            committed_at=committed_at,
        )

    # -- expiry -------------------------------------------------------------------------------

    async def reap(self) -> list[str]:
        now = await self._enter()
        reaped: list[str] = []
        while self._expiry and self._expiry[0][0] <= now:
            _, task_id, serial = heapq.heappop(self._expiry)
            entry = self._entries.get(task_id)
            if entry is None or entry.serial != serial:
                continue
            del self._entries[task_id]
            if entry.active:
                self._deactivate(entry.scope)
            if entry.concurrency is not None:
                self._key_claims.get(entry.concurrency.key, set()).discard(task_id)
            reaped.append(task_id)
        reaped.sort()
        self._feed.announce_reaped(reaped)
        return reaped

    # -- audit --------------------------------------------------------------------------------

    def history(self, task_id: str) -> list[LedgerEntry]:
        """The ledger of a live task (every applied event with its revision, commit time and
        effects), in revision order: the SQL stores' ``history``, without awaiting.

        Unknown and reaped tasks have no history (reaping deletes the whole aggregate).
        """
        entry = self._entries.get(task_id)
        if entry is None:
            return []
        return [
            attrs.evolve(item, event=attrs.evolve(item.event), effects=attrs.evolve(item.effects))
            for item in entry.history
        ]

    # -- operators (ListsTasks) ---------------------------------------------------------------

    def _stored(self, entry: _Entry, now: int) -> StoredTask:
        claim = entry.claim
        return StoredTask(
            snapshot=clone_snapshot(entry.snapshot),
            scope=entry.scope,
            generation=entry.generation,
            claim=None
            if claim is None
            else ClaimInfo(
                owner_id=claim.owner_id,
                generation=claim.generation,
                expires_at=claim.expires_at,
                live=now < claim.expires_at,
            ),
            expired=entry.expired(now),
        )

    async def list_tasks(self, query: TaskQuery) -> TaskListing:
        """A page of every task held, across scopes (an operator's read: a scan, in order)."""
        now = await self._enter()
        query = check_task_query(query)
        ordered = sorted(
            self._entries.values(),
            key=lambda e: (e.snapshot.task.created_at, e.snapshot.task.id),
        )
        matching = (
            stored
            for stored in (self._stored(entry, now) for entry in ordered)
            if query.matches(stored)
        )
        return listing_page(now, query, matching)

    async def inspect_task(self, task_id: str) -> TaskInspection | NotFound:
        now = await self._enter()
        entry = self._entries.get(task_id)
        if entry is None:
            return NOT_FOUND
        return TaskInspection(
            now=now, task=self._stored(entry, now), ledger=tuple(self.history(task_id))
        )

    async def operator_access(self, task_id: str, action: Action) -> Access | NotFound:
        await self._enter()
        action = check_operator_action(task_id, action)
        entry = self._entries.get(task_id)
        if entry is None:
            return NOT_FOUND
        return Access(store_id=self._id, action=action, task_id=task_id, scope=entry.scope)

    # -- scheduling ---------------------------------------------------------------------------

    def _deactivate(self, scope: str) -> None:
        remaining = self._active[scope] - 1
        if remaining:
            self._active[scope] = remaining
        else:
            del self._active[scope]

    def _live(self, task_id: str, serial: int, sched: int) -> _Entry | None:
        entry = self._entries.get(task_id)
        if entry is None or entry.serial != serial or entry.sched != sched:
            return None
        return entry

    def _reschedule(self, entry: _Entry, now: int) -> None:
        """Record where the task waits for ``claim_next``; older heap items become stale."""
        entry.sched += 1
        snapshot = entry.snapshot
        if snapshot.task.status.is_terminal or snapshot.work is None:
            return
        wake = max(snapshot.available_at or 0, 0 if entry.claim is None else entry.claim.expires_at)
        item = (snapshot.task.id, entry.serial, entry.sched)
        if wake > now:
            heapq.heappush(self._timed, (wake, *item))
        else:
            self._push_ready(entry, (snapshot.task.created_at, *item))
        self._items += 1
        if self._items > 2 * len(self._entries) + 64:
            self._compact()

    def _compact(self) -> None:
        def live(heap: list[tuple[int, str, int, int]]) -> list[tuple[int, str, int, int]]:
            kept = [i for i in heap if self._live(*i[1:]) is not None]
            heapq.heapify(kept)
            return kept

        self._ready = live(self._ready)
        self._timed = live(self._timed)
        self._key_ready = {k: h for k, h in ((k, live(h)) for k, h in self._key_ready.items()) if h}
        self._items = len(self._ready) + len(self._timed) + sum(map(len, self._key_ready.values()))


def open_memory_store(url: str, **options: Any) -> MemoryStore:
    """The ``tritask.stores`` factory for the URL ``memory:``.

    Unlike the ``MemoryStore`` constructor, the URL form defaults ``scope`` to ``"shared"`` (one
    process, one principal: the ``tritask serve`` default); pass ``scope=`` to isolate tenants.
    """
    if url != "memory:":
        raise ValueError(f"the memory store only opens the URL 'memory:', not {url!r}")
    options.setdefault("scope", "shared")
    return MemoryStore(**options)
