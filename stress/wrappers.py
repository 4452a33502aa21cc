"""Store wrappers used by the workloads: a delegating proxy, a network partition, faults, counts.

They wrap any :class:`~tritask.tasks.store.Store` through the protocol only, so the same
workloads run unchanged on the memory, SQLite and PostgreSQL stores.

The optional capabilities runners detect on the store's *class* (``settle``,
``create_claimed_stamped``, ``renew_all``, ``renew_owner``, ``submit``, ``listen_queue``) are
offered by a wrapper exactly when its inner store offers them: constructing a wrapper picks (and
caches) a subclass of it with those methods mixed in. A wrapper changes what they do by
overriding the hooks ``_settle``, ``_create_claimed_stamped``, ``_renew_all``, ``_renew_owner``
and ``_submit``, never the public names (that would offer them unconditionally); one that must
not offer ``renew_all`` or ``renew_owner`` (its ``renew`` models something a batch would
bypass) sets ``batch_renewal = False``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
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
    Deferred,
    Lease,
    LeaseLost,
    NotFound,
    OwnerRenewal,
    Renewed,
    Store,
    Transition,
    Unavailable,
    WorkerAuthority,
    queues,
    renews_leases,
    renews_owner_lease,
    settles,
    signals_queue,
    stamps_creation,
)
from tritask.tasks.work import Work

__all__ = ["FAULTS", "ConflictRetryingStore", "CountingStore", "PartitionedStore", "StoreProxy"]


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


class StoreProxy:
    """Delegates every Store operation to ``inner`` (and any other attribute, e.g. ``history``).

    ``settle``, ``create_claimed_stamped`` and ``renew_all`` are methods of the instance's class
    only when ``inner``'s class offers them (see the module docstring).
    """

    batch_renewal: ClassVar[bool] = True
    """Whether the wrapper offers ``renew_all`` and ``renew_owner`` when its inner store does."""

    _variants: ClassVar[dict[tuple[type, bool, bool, bool, bool, bool, bool], type]] = {}

    def __new__(cls, inner: Store, *args: Any, **kwargs: Any) -> Self:
        settling, stamping = settles(inner), stamps_creation(inner)
        renewing = cls.batch_renewal and renews_leases(inner)
        owning = cls.batch_renewal and renews_owner_lease(inner)
        queueing, signalling = queues(inner), signals_queue(inner)
        key = (cls, settling, stamping, renewing, owning, queueing, signalling)
        variant = StoreProxy._variants.get(key)
        if variant is None:
            mixins: tuple[type, ...] = ()
            if settling:
                mixins += (_Settling,)
            if stamping:
                mixins += (_StampingCreation,)
            if renewing:
                mixins += (_RenewingAll,)
            if owning:
                mixins += (_RenewingOwner,)
            if queueing:
                mixins += (_Queueing,)
            if signalling:
                mixins += (_SignallingQueue,)
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

    _FORWARDED_WRITES = ("create_claimed",)
    """Optional writes reached through ``__getattr__`` (detected on the instance)."""

    @property
    def writes(self) -> int:
        return sum(self.calls[name] for name in (*self.WRITES, *self.OPTIONAL_WRITES))

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.inner, name)
        if name not in self._FORWARDED_WRITES:
            return attribute

        async def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return await attribute(*args, **kwargs)

        return counted

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
