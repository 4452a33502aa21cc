"""Store wrappers used by the workloads: a delegating proxy, a network partition, faults, counts.

They wrap any :class:`~tritask.tasks.store.Store` through the protocol only, so the same
workloads run unchanged on the memory, SQLite and PostgreSQL stores.

Every optional capability of :mod:`tritask.tasks.store` (``create_claimed``, ``wakeups``,
``changes``, ``settle``, ``create_claimed_stamped``, ``submit``, ``listen_queue``, the operator
listing, ``renew_all``, ``renew_owner``) is offered by a wrapper exactly when its inner store's
class offers it: constructing a wrapper picks (and caches) a subclass of it with those methods
mixed in. So a wrapped store is detected as what it wraps, and a benchmark measures what a
user's server runs (before, a wrapper offered no ``changes()``, and the bench's runner ran
without the store's change feed). A wrapper changes what they do by overriding the hooks
(``_create_claimed``, ``_wakeups``, ``_changes``, ``_settle``, ``_create_claimed_stamped``,
``_renew_all``, ``_renew_owner``, ``_submit``), never the public names (that would offer them
unconditionally); one that must not offer ``renew_all`` or ``renew_owner`` (its ``renew``
models something a batch would bypass) sets ``batch_renewal = False``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncGenerator, Callable
from types import TracebackType
from typing import Any, ClassVar, Self, cast

import trio

from tritask.tasks.events import Event
from tritask.tasks.model import Snapshot, Task
from tritask.tasks.store import (
    Access,
    Action,
    Authority,
    Claimed,
    Concurrency,
    Conflict,
    CreatesClaimed,
    Deferred,
    Lease,
    LeaseLost,
    NotFound,
    OffersWakeups,
    OwnerRenewal,
    Renewed,
    Store,
    TaskInspection,
    TaskListing,
    TaskQuery,
    Transition,
    Unavailable,
    WorkerAuthority,
    lists_tasks,
    offers_changes,
    queues,
    renews_leases,
    renews_owner_lease,
    settles,
    signals_queue,
    stamps_creation,
)
from tritask.tasks.work import Work

__all__ = [
    "CAPABILITIES",
    "FAULTS",
    "ConflictRetryingStore",
    "CountingStore",
    "PartitionedStore",
    "StoreProxy",
    "capabilities",
]


def _class_offers(store: object, name: str) -> bool:
    return callable(getattr(type(store), name, None))


class _CreatingClaimed:
    """Mixed into a wrapper whose inner store offers ``create_claimed``."""

    async def create_claimed(
        self, task: Task, work: Work, access: Access, owner_id: str, lease_ms: int
    ) -> Claimed:
        return await cast(StoreProxy, self)._create_claimed(task, work, access, owner_id, lease_ms)


class _Waking:
    """Mixed into a wrapper whose inner store offers ``wakeups`` (``OffersWakeups``)."""

    def wakeups(self) -> AsyncGenerator[Any, None]:
        return cast(StoreProxy, self)._wakeups()


class _Announcing:
    """Mixed into a wrapper whose inner store offers ``changes`` (``OffersChanges``)."""

    def changes(self) -> AsyncGenerator[Any, None]:
        return cast(StoreProxy, self)._changes()


class _Settling:
    """Mixed into a wrapper whose inner store offers ``settle``."""

    async def settle(
        self, task_id: str, expected_revision: int, event: Event, lease: Lease
    ) -> Transition | Conflict | NotFound:
        return await cast(StoreProxy, self)._settle(task_id, expected_revision, event, lease)


class _StampingCreation:
    """Mixed into a wrapper whose inner store offers ``create_claimed_stamped``."""

    async def create_claimed_stamped(
        self, task: Task, work: Work, access: Access, owner_id: str, lease_ms: int
    ) -> Claimed:
        proxy = cast(StoreProxy, self)
        return await proxy._create_claimed_stamped(task, work, access, owner_id, lease_ms)


class _RenewingAll:
    """Mixed into a wrapper whose inner store offers ``renew_all``."""

    async def renew_all(
        self, owner_id: str, leases: list[Lease] | tuple[Lease, ...], lease_ms: int
    ) -> list[Renewed | LeaseLost]:
        return await cast(StoreProxy, self)._renew_all(owner_id, leases, lease_ms)


class _RenewingOwner:
    """Mixed into a wrapper whose inner store offers ``renew_owner``."""

    async def renew_owner(
        self,
        owner_id: str,
        leases: list[Lease] | tuple[Lease, ...],
        revisions: list[int] | tuple[int, ...],
        following: int | None,
        lease_ms: int,
    ) -> OwnerRenewal:
        proxy = cast(StoreProxy, self)
        return await proxy._renew_owner(owner_id, leases, revisions, following, lease_ms)


class _Queueing:
    """Mixed into a wrapper whose inner store offers ``submit`` (``Queues``)."""

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
        proxy = cast(StoreProxy, self)
        return await proxy._submit(task, work, access, owner_id, lease_ms, concurrency)


class _SignallingQueue:
    """Mixed into a wrapper whose inner store offers ``listen_queue`` (``SignalsQueue``)."""

    def listen_queue(self, callback: Callable[[], None]) -> Callable[[], None]:
        inner = cast(StoreProxy, self).inner
        assert signals_queue(inner)
        return inner.listen_queue(callback)


class _ListingTasks:
    """Mixed into a wrapper whose inner store offers the operator listing (``ListsTasks``)."""

    async def list_tasks(self, query: TaskQuery) -> TaskListing:
        inner = cast(StoreProxy, self).inner
        assert lists_tasks(inner)
        return await inner.list_tasks(query)

    async def inspect_task(self, task_id: str) -> TaskInspection | NotFound:
        inner = cast(StoreProxy, self).inner
        assert lists_tasks(inner)
        return await inner.inspect_task(task_id)

    async def operator_access(self, task_id: str, action: Action) -> Access | NotFound:
        inner = cast(StoreProxy, self).inner
        assert lists_tasks(inner)
        return await inner.operator_access(task_id, action)


CAPABILITIES: dict[str, Callable[[object], bool]] = {
    "CreatesClaimed": lambda store: _class_offers(store, "create_claimed"),
    "OffersWakeups": lambda store: _class_offers(store, "wakeups"),
    "OffersChanges": offers_changes,
    "Settles": settles,
    "StampsCreation": stamps_creation,
    "Queues": queues,
    "SignalsQueue": signals_queue,
    "ListsTasks": lists_tasks,
    "RenewsLeases": renews_leases,
    "RenewsOwnerLease": renews_owner_lease,
}
"""Each optional capability of :mod:`tritask.tasks.store`, detected on the store's class."""

_MIXINS: dict[str, type] = {
    "CreatesClaimed": _CreatingClaimed,
    "OffersWakeups": _Waking,
    "OffersChanges": _Announcing,
    "Settles": _Settling,
    "StampsCreation": _StampingCreation,
    "Queues": _Queueing,
    "SignalsQueue": _SignallingQueue,
    "ListsTasks": _ListingTasks,
    "RenewsLeases": _RenewingAll,
    "RenewsOwnerLease": _RenewingOwner,
}

_BATCH_RENEWAL = ("RenewsLeases", "RenewsOwnerLease")


def capabilities(store: object) -> frozenset[str]:
    """The optional capabilities ``store``'s class offers (names of :data:`CAPABILITIES`)."""
    return frozenset(name for name, offers in CAPABILITIES.items() if offers(store))


class StoreProxy:
    """Delegates every Store operation to ``inner`` (and any other attribute, e.g. ``history``).

    Each optional capability is a method of the instance's class exactly when ``inner``'s
    class offers it (see the module docstring).
    """

    batch_renewal: ClassVar[bool] = True
    """Whether the wrapper offers ``renew_all`` and ``renew_owner`` when its inner store does."""

    _variants: ClassVar[dict[tuple[type, frozenset[str]], type]] = {}

    def __new__(cls, inner: Store, *args: Any, **kwargs: Any) -> Self:
        offered = capabilities(inner)
        if not cls.batch_renewal:
            offered -= frozenset(_BATCH_RENEWAL)
        key = (cls, offered)
        variant = StoreProxy._variants.get(key)
        if variant is None:
            mixins = tuple(mixin for name, mixin in _MIXINS.items() if name in offered)
            names = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
            variant = type(cls.__name__, (*mixins, cls), names) if mixins else cls
            StoreProxy._variants[key] = variant
        return cast(Self, object.__new__(variant))

    def __init__(self, inner: Store) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def now(self) -> int:
        return await self.inner.now()

    async def authorize(self, ctx: object, action: Action, task_id: str) -> Access:
        return await self.inner.authorize(ctx, action, task_id)

    async def create(self, task: Task, work: Work, access: Access) -> Snapshot:
        return await self.inner.create(task, work, access)

    async def get(self, task_id: str, access: Access) -> Snapshot | NotFound:
        return await self.inner.get(task_id, access)

    async def worker_snapshot(self, task_id: str, lease: Lease) -> Snapshot | NotFound:
        return await self.inner.worker_snapshot(task_id, lease)

    async def claim(
        self, task_id: str, owner_id: str, lease_ms: int
    ) -> Claimed | Deferred | Unavailable | NotFound:
        return await self.inner.claim(task_id, owner_id, lease_ms)

    async def claim_next(self, owner_id: str, lease_ms: int) -> Claimed | None:
        return await self.inner.claim_next(owner_id, lease_ms)

    async def renew(self, lease: Lease, lease_ms: int) -> Lease:
        return await self.inner.renew(lease, lease_ms)

    async def release(self, lease: Lease) -> None:
        await self.inner.release(lease)

    async def reap(self) -> list[str]:
        return await self.inner.reap()

    async def transition(
        self, task_id: str, expected_revision: int, event: Event, authority: Authority
    ) -> Transition | Conflict | NotFound:
        return await self.inner.transition(task_id, expected_revision, event, authority)

    async def _create_claimed(
        self, task: Task, work: Work, access: Access, owner_id: str, lease_ms: int
    ) -> Claimed:
        """What ``create_claimed`` does (offered only when ``inner`` offers it)."""
        inner = self.inner
        assert isinstance(inner, CreatesClaimed)
        return await inner.create_claimed(task, work, access, owner_id, lease_ms)

    def _wakeups(self) -> AsyncGenerator[Any, None]:
        """What ``wakeups`` does (offered only when ``inner`` offers it): ``inner``'s own
        iterator, so iterating costs what it costs unwrapped."""
        inner = self.inner
        assert isinstance(inner, OffersWakeups)
        return inner.wakeups()

    def _changes(self) -> AsyncGenerator[Any, None]:
        """What ``changes`` does (offered only when ``inner`` announces changes): ``inner``'s
        own iterator, so iterating costs what it costs unwrapped."""
        inner = self.inner
        assert offers_changes(inner)
        return inner.changes()

    async def _settle(
        self, task_id: str, expected_revision: int, event: Event, lease: Lease
    ) -> Transition | Conflict | NotFound:
        """What ``settle`` does (offered only when ``inner`` settles)."""
        inner = self.inner
        assert settles(inner)
        return await inner.settle(task_id, expected_revision, event, lease)

    async def _create_claimed_stamped(
        self, task: Task, work: Work, access: Access, owner_id: str, lease_ms: int
    ) -> Claimed:
        """What ``create_claimed_stamped`` does (offered only when ``inner`` stamps)."""
        inner = self.inner
        assert stamps_creation(inner)
        return await inner.create_claimed_stamped(task, work, access, owner_id, lease_ms)

    async def _renew_all(
        self, owner_id: str, leases: list[Lease] | tuple[Lease, ...], lease_ms: int
    ) -> list[Renewed | LeaseLost]:
        """What ``renew_all`` does (offered only when ``inner`` renews in batches)."""
        inner = self.inner
        assert renews_leases(inner)
        return await inner.renew_all(owner_id, leases, lease_ms)

    async def _renew_owner(
        self,
        owner_id: str,
        leases: list[Lease] | tuple[Lease, ...],
        revisions: list[int] | tuple[int, ...],
        following: int | None,
        lease_ms: int,
    ) -> OwnerRenewal:
        """What ``renew_owner`` does (offered only when ``inner`` offers it)."""
        inner = self.inner
        assert renews_owner_lease(inner)
        return await inner.renew_owner(owner_id, leases, revisions, following, lease_ms)

    async def _submit(
        self,
        task: Task,
        work: Work,
        access: Access,
        owner_id: str | None,
        lease_ms: int,
        concurrency: Concurrency | None,
    ) -> Claimed | Snapshot:
        """What ``submit`` does (offered only when ``inner`` queues)."""
        inner = self.inner
        assert queues(inner)
        return await inner.submit(
            task, work, access, owner_id=owner_id, lease_ms=lease_ms, concurrency=concurrency
        )

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def __aenter__(self) -> Self:
        await self.inner.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.inner.__aexit__(exc_type, exc, tb)


class PartitionedStore(StoreProxy):
    """One runner's view of the store in which lease renewals of chosen tasks hang.

    It models a runner cut off from the database (or a stuck heartbeat): the renewal waits
    until :meth:`heal`, by which time the lease has expired and another runner may own the task.
    Cuts are per task, so it never offers ``renew_all`` (a batch would renew past the cut):
    its runner renews each lease alone.
    """

    batch_renewal: ClassVar[bool] = False

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self._cut: dict[str, trio.Event] = {}

    def cut(self, task_id: str) -> None:
        self._cut.setdefault(task_id, trio.Event())

    def heal(self, task_id: str) -> None:
        event = self._cut.pop(task_id, None)
        if event is not None:
            event.set()

    async def renew(self, lease: Lease, lease_ms: int) -> Lease:
        event = self._cut.get(lease.task_id)
        if event is not None:
            await event.wait()
        return await self.inner.renew(lease, lease_ms)


class ConflictRetryingStore(StoreProxy):
    """A deliberately broken wrapper: it "helpfully" retries a conflicting write at the current
    revision, so racing writers all commit. Used to prove that the harness catches it."""

    async def transition(
        self, task_id: str, expected_revision: int, event: Event, authority: Authority
    ) -> Transition | Conflict | NotFound:
        result = await self.inner.transition(task_id, expected_revision, event, authority)
        if isinstance(result, Conflict) and not result.snapshot.task.status.is_terminal:
            return await self.inner.transition(task_id, result.snapshot.revision, event, authority)
        return result

    async def _settle(
        self, task_id: str, expected_revision: int, event: Event, lease: Lease
    ) -> Transition | Conflict | NotFound:
        result = await super()._settle(task_id, expected_revision, event, lease)
        if isinstance(result, Conflict) and not result.snapshot.task.status.is_terminal:
            return await super()._settle(task_id, result.snapshot.revision, event, lease)
        return result


class LostReleaseStore(StoreProxy):
    """A deliberately broken wrapper: ``release`` reports success without releasing, and
    ``settle`` applies the event but keeps the claim (the release inside it is lost)."""

    async def release(self, lease: Lease) -> None:
        await trio.lowlevel.checkpoint()

    async def _settle(
        self, task_id: str, expected_revision: int, event: Event, lease: Lease
    ) -> Transition | Conflict | NotFound:
        return await self.inner.transition(
            task_id, expected_revision, event, WorkerAuthority(lease)
        )


FAULTS: dict[str, type[StoreProxy]] = {
    "cas-retry-conflicts": ConflictRetryingStore,
    "lost-release": LostReleaseStore,
}
"""``--fault NAME``: wrap the store under test in a known-broken wrapper."""


class CountingStore(StoreProxy):
    """Counts the store calls that write (the durable commits of a SQL store)."""

    WRITES = ("create", "claim", "claim_next", "renew", "release", "transition", "reap")
    """Each successful call of these is one durable commit on a SQL store."""

    renewed: int
    """Leases renewed by ``renew_all`` or ``renew_owner`` (each call that renewed any is one
    commit)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.calls: Counter[str] = Counter()
        self.renewed = 0

    OPTIONAL_WRITES = (
        "create_claimed",
        "create_claimed_stamped",
        "settle",
        "renew_all",
        "renew_owner",
        "submit",
    )
    """Optional store operations that write, counted when the inner store offers them (a
    ``settle`` when it answers a ``Transition``: it then released the claim, a write even when
    the event itself was ``unchanged`` or a ``duplicate``)."""

    @property
    def writes(self) -> int:
        return sum(self.calls[name] for name in (*self.WRITES, *self.OPTIONAL_WRITES))

    async def create(self, task: Task, work: Work, access: Access) -> Snapshot:
        self.calls["create"] += 1
        return await self.inner.create(task, work, access)

    async def claim(
        self, task_id: str, owner_id: str, lease_ms: int
    ) -> Claimed | Deferred | Unavailable | NotFound:
        self.calls["claim"] += 1
        return await self.inner.claim(task_id, owner_id, lease_ms)

    async def claim_next(self, owner_id: str, lease_ms: int) -> Claimed | None:
        result = await self.inner.claim_next(owner_id, lease_ms)
        if result is not None:
            self.calls["claim_next"] += 1
        return result

    async def renew(self, lease: Lease, lease_ms: int) -> Lease:
        self.calls["renew"] += 1
        return await self.inner.renew(lease, lease_ms)

    async def release(self, lease: Lease) -> None:
        self.calls["release"] += 1
        await self.inner.release(lease)

    async def transition(
        self, task_id: str, expected_revision: int, event: Event, authority: Authority
    ) -> Transition | Conflict | NotFound:
        result = await self.inner.transition(task_id, expected_revision, event, authority)
        if isinstance(result, Transition) and result.outcome == "applied":
            self.calls["transition"] += 1
        return result

    async def reap(self) -> list[str]:
        reaped = await self.inner.reap()
        if reaped:
            self.calls["reap"] += 1
        return reaped

    async def _settle(
        self, task_id: str, expected_revision: int, event: Event, lease: Lease
    ) -> Transition | Conflict | NotFound:
        result = await super()._settle(task_id, expected_revision, event, lease)
        if isinstance(result, Transition):
            self.calls["settle"] += 1
        return result

    async def _renew_all(
        self, owner_id: str, leases: list[Lease] | tuple[Lease, ...], lease_ms: int
    ) -> list[Renewed | LeaseLost]:
        results = await super()._renew_all(owner_id, leases, lease_ms)
        renewed = sum(1 for result in results if isinstance(result, Renewed))
        if renewed:
            self.calls["renew_all"] += 1
            self.renewed += renewed
        return results

    async def _renew_owner(
        self,
        owner_id: str,
        leases: list[Lease] | tuple[Lease, ...],
        revisions: list[int] | tuple[int, ...],
        following: int | None,
        lease_ms: int,
    ) -> OwnerRenewal:
        answer = await super()._renew_owner(owner_id, leases, revisions, following, lease_ms)
        renewed = len(leases) - len(answer.lost)
        if renewed:
            self.calls["renew_owner"] += 1
            self.renewed += renewed
        return answer

    async def _submit(
        self,
        task: Task,
        work: Work,
        access: Access,
        owner_id: str | None,
        lease_ms: int,
        concurrency: Concurrency | None,
    ) -> Claimed | Snapshot:
        self.calls["submit"] += 1
        return await super()._submit(task, work, access, owner_id, lease_ms, concurrency)

    async def _create_claimed_stamped(
        self, task: Task, work: Work, access: Access, owner_id: str, lease_ms: int
    ) -> Claimed:
        self.calls["create_claimed_stamped"] += 1
        return await super()._create_claimed_stamped(task, work, access, owner_id, lease_ms)

    async def _create_claimed(
        self, task: Task, work: Work, access: Access, owner_id: str, lease_ms: int
    ) -> Claimed:
        self.calls["create_claimed"] += 1
        return await super()._create_claimed(task, work, access, owner_id, lease_ms)
