"""The Store contract: the protocol every task store implements, its value types and errors.

The store is the authority: revisioned compare-and-set, event-id idempotency, claims with
fenced leases, ``retry_at``, TTL and input acceptance are all decided by the store on the store's
clock. Runners and the extension only ask.

Authority rules (reference 3.3):

* a :class:`RequestAuthority` with an ``update`` access may apply only
  ``input_responses_accepted``; a ``cancel`` access only ``cancelled``; anything else raises
  :class:`UnauthorizedAction`. A request transition from another scope or store, or on an expired
  task, gives :data:`NOT_FOUND`;
* a :class:`WorkerAuthority` may apply only ``input_requested``, ``retry_requested``, ``completed``,
  ``failed`` and the step events ``step_started``, ``step_recorded``, ``sleep_scheduled`` and
  ``suspended`` (otherwise :class:`UnauthorizedAction`); a forged, expired, other-task or
  other-store lease raises :class:`StaleLease`. Claims span scopes: worker authority belongs to
  the application, not to a principal.

Claims ignore TTL (reference 3.6): an expired task stays claimable until it is reaped, and
reaping is the only physical deletion.
"""

from __future__ import annotations

import enum
import json
from collections.abc import AsyncGenerator, Callable, Iterable
from types import TracebackType
from typing import (
    Any,
    Final,
    Literal,
    Protocol,
    Self,
    TypeGuard,
    final,
    runtime_checkable,
)

import attrs

from tritask.tasks.events import Effects, Event, EventKind, effects_from_json
from tritask.tasks.model import CorruptRecord, Snapshot, Task, TaskStatus
from tritask.tasks.reducer import DuplicateInputKey, StepKeyReused, StepLimitExceeded
from tritask.tasks.work import InvalidJSON, Work, canonical_json

__all__ = [
    "LEASE_LOST",
    "MAX_AUDIT_PAGE",
    "MAX_LIST_PAGE",
    "NOT_FOUND",
    "OPERATOR_ACTIONS",
    "QUEUED_MESSAGE",
    "REQUEST_KINDS",
    "SETTLE_KINDS",
    "SHARED_SCOPE_KEY",
    "UNAVAILABLE",
    "WORKER_KINDS",
    "Access",
    "Action",
    "AlreadyExists",
    "AuditFinding",
    "AuditPage",
    "Authority",
    "CapacityExceeded",
    "ClaimInfo",
    "Claimed",
    "Concurrency",
    "Conflict",
    "CorruptStore",
    "CreatesClaimed",
    "DatabaseBusy",
    "Deferred",
    "DuplicateInputKey",
    "EventIdReused",
    "InvalidRetryAvailability",
    "InvalidScope",
    "InvalidTask",
    "Lease",
    "LeaseLost",
    "LedgerEntry",
    "ListsTasks",
    "NotFound",
    "OffersChanges",
    "OwnerRenewal",
    "Queues",
    "Renewed",
    "RenewsLeases",
    "RenewsOwnerLease",
    "RequestAuthority",
    "Scope",
    "Settles",
    "SignalsQueue",
    "StaleLease",
    "StampsCreation",
    "StepKeyReused",
    "StepLimitExceeded",
    "Store",
    "StoreError",
    "StoredTask",
    "TaskCursor",
    "TaskInspection",
    "TaskListing",
    "TaskQuery",
    "Transition",
    "Unauthorized",
    "UnauthorizedAction",
    "Unavailable",
    "WorkerAuthority",
    "check_audit_page",
    "check_create_access",
    "check_limit",
    "check_operator_action",
    "check_owner",
    "check_owner_renewal",
    "check_positive_int",
    "check_positive_ms",
    "check_renewals",
    "check_submit",
    "check_task_query",
    "check_transition_arguments",
    "decode_ledger",
    "listing_page",
    "lists_tasks",
    "new_access",
    "offers_changes",
    "queues",
    "renews_leases",
    "renews_owner_lease",
    "require_scope",
    "resolve_scope",
    "settles",
    "signals_queue",
    "stamps_creation",
    "work_tool",
]


class Action(enum.StrEnum):
    CREATE = "create"
    GET = "get"
    UPDATE = "update"
    CANCEL = "cancel"


Scope = Literal["shared"] | Callable[[Any], object]
"""``"shared"`` (one scope for everyone: task ids become bearer credentials) or a function of the
request context returning a JSON value that identifies the principal/tenant."""

SHARED_SCOPE_KEY: Final = "null"
"""The canonical scope key every access carries under ``scope="shared"``."""

REQUEST_KINDS: Final = {
    Action.UPDATE: frozenset({EventKind.INPUT_RESPONSES_ACCEPTED}),
    Action.CANCEL: frozenset({EventKind.CANCELLED}),
}
WORKER_KINDS: Final = frozenset(
    {
        EventKind.INPUT_REQUESTED,
        EventKind.RETRY_REQUESTED,
        EventKind.COMPLETED,
        EventKind.FAILED,
        EventKind.STEP_STARTED,
        EventKind.STEP_RECORDED,
        EventKind.SLEEP_SCHEDULED,
        EventKind.SUSPENDED,
    }
)
SETTLE_KINDS: Final = frozenset({EventKind.RETRY_REQUESTED, EventKind.COMPLETED, EventKind.FAILED})
"""The worker events that end an attempt, the only ones :class:`Settles` accepts."""
MAX_AUDIT_PAGE: Final = 10_000
"""The largest page a durable store's ``audit(limit=...)`` checks in one call."""
MAX_LIST_PAGE: Final = 10_000
"""The largest page :meth:`ListsTasks.list_tasks` returns in one call."""
OPERATOR_ACTIONS: Final = frozenset({Action.GET, Action.UPDATE, Action.CANCEL})
"""The actions :meth:`ListsTasks.operator_access` grants (an operator never creates tasks)."""
QUEUED_MESSAGE: Final = "Queued: waiting for a free runner slot"
"""The status message of a task :meth:`Queues.submit` stored unclaimed (until its first claim)."""


# -- errors -------------------------------------------------------------------------------------


class StoreError(Exception):
    """Base of the store contract's error reasons (``DuplicateInputKey`` comes from the reducer)."""


class Unauthorized(StoreError):
    """``authorize`` refused the request context (a scope function may raise it)."""


class UnauthorizedAction(StoreError):
    """The access or lease does not permit this operation or event kind."""


class AlreadyExists(StoreError):
    """A task with this id exists (expired tasks count until reaped)."""


CapacityLimit = Literal["max_tasks", "max_active_tasks_per_scope", "max_jobs"]
"""Which limit refused new work: the store's two (across every process), or a runner's own."""


class CapacityExceeded(StoreError):
    def __init__(self, limit: CapacityLimit) -> None:
        super().__init__(f"task capacity exceeded: {limit}")
        self.limit: CapacityLimit = limit


class StaleLease(StoreError):
    """The lease is forged, expired, superseded, or for another task or store."""


class EventIdReused(StoreError):
    """An event id already committed for this task was sent with a different event."""


class InvalidScope(StoreError):
    """The scope function returned a value that is not JSON."""


class InvalidTask(StoreError):
    """``create`` was given a task/work pair that is not a valid revision-0 record."""


class InvalidRetryAvailability(StoreError):
    """A persisted retry time could not be interpreted (SQL stores)."""


class CorruptStore(StoreError):
    """Persisted data failed decoding or validation; nothing is repaired."""

    def __init__(self, task_id: str, reason: str) -> None:
        super().__init__(f"corrupt record for task {task_id!r}: {reason}")
        self.task_id = task_id
        self.reason = reason


class DatabaseBusy(StoreError):
    """The database could not take the write slot in time (SQLite); safe to retry."""


# -- values -------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Access:
    """Opaque proof that ``authorize`` let one context do one action on one task id.

    Only stores create and read it; ``scope`` is the canonical JSON text of the scope value.
    """

    store_id: str
    action: Action
    task_id: str
    scope: str = attrs.field(repr=False)


@attrs.frozen(kw_only=True)
class Lease:
    """A fenced claim. Every field is part of its identity: renewal yields a new lease and a new
    claim a higher generation, so any older value is refused as stale."""

    store_id: str
    task_id: str
    owner_id: str
    token: str = attrs.field(repr=False)
    generation: int
    expires_at: int
    epoch: int = 0


@attrs.frozen
class RequestAuthority:
    access: Access


@attrs.frozen
class WorkerAuthority:
    lease: Lease


Authority = RequestAuthority | WorkerAuthority


@attrs.frozen(kw_only=True)
class Transition:
    """The result of a committed (or replayed, or no-op) event.

    ``event_revision`` is the revision the event produced (the current one when unchanged);
    for ``duplicate`` it, ``committed_at`` and ``effects`` are the original commit's.
    """

    outcome: Literal["applied", "unchanged", "duplicate"]
    snapshot: Snapshot
    effects: Effects
    event_revision: int
    committed_at: int


@attrs.frozen
class Conflict:
    """The expected revision was stale; ``snapshot`` is the current record."""

    snapshot: Snapshot


@attrs.frozen
class Claimed:
    snapshot: Snapshot
    lease: Lease


@attrs.frozen
class Deferred:
    """A retry is scheduled: claimable in ``remaining_ms`` (> 0, rounded up)."""

    remaining_ms: int


def _concurrency_key(_inst: object, _attr: object, value: Any) -> None:
    if not isinstance(value, str):
        raise TypeError("a concurrency key is canonical JSON text (use canonical_json(value))")
    try:
        canonical = canonical_json(json.loads(value))
    except (ValueError, InvalidJSON):
        canonical = None
    if canonical != value:
        raise ValueError(f"concurrency key {value!r} is not canonical JSON")


def _concurrency_limit(_inst: object, _attr: object, value: Any) -> None:
    if type(value) is not int or value <= 0:
        raise ValueError("a concurrency limit must be a positive int")


@attrs.frozen
class Concurrency:
    """At most ``limit`` tasks carrying ``key`` hold a live claim at once, across every runner
    on the store (the store's claims enforce it). ``key`` is canonical JSON text; the Tasks
    extension makes it ``[tool, key value]``, so tools never share a key by accident."""

    key: str = attrs.field(validator=_concurrency_key)
    limit: int = attrs.field(validator=_concurrency_limit)


@final
class NotFound(enum.Enum):
    """Unknown, other-scope, other-store and expired tasks are indistinguishable."""

    NOT_FOUND = "not_found"

    def __repr__(self) -> str:
        return "NOT_FOUND"


@final
class Unavailable(enum.Enum):
    """Terminal, without work, or claimed by a live lease."""

    UNAVAILABLE = "unavailable"

    def __repr__(self) -> str:
        return "UNAVAILABLE"


@final
class LeaseLost(enum.Enum):
    """A lease in a :meth:`RenewsLeases.renew_all` batch that was not renewed: forged,
    expired, superseded, released, for another owner, task or store, or a repeat of a task
    already renewed in the same batch (what a single ``renew`` would raise
    :class:`StaleLease` for)."""

    LEASE_LOST = "lease_lost"

    def __repr__(self) -> str:
        return "LEASE_LOST"


NOT_FOUND: Final = NotFound.NOT_FOUND
UNAVAILABLE: Final = Unavailable.UNAVAILABLE
LEASE_LOST: Final = LeaseLost.LEASE_LOST


@attrs.frozen
class Renewed:
    """One lease of a :meth:`RenewsLeases.renew_all` batch, renewed.

    ``lease`` is the new value (the expiry the batch's one store instant plus ``lease_ms``;
    owner, task, generation and epoch unchanged; a fresh token, or the same one when the new
    expiry alone tells it apart, as on SQLite, whose batches extend one row per owner: the old
    value is now stale either way).
    ``revision`` is the task's revision at that instant: a runner that sees a revision it did
    not write re-reads the task (an answer or a cancellation committed elsewhere).
    """

    lease: Lease
    revision: int


@attrs.frozen
class OwnerRenewal:
    """The answer of :meth:`RenewsOwnerLease.renew_owner`: one value for the whole batch, so
    a heartbeat of thousands of attempts makes no object per attempt.

    ``expires_at`` is the owner lease's new expiry (the batch's one store instant plus
    ``lease_ms``): every lease of the batch not in ``lost`` now follows the owner lease and
    expires at it. ``None`` when the batch renewed nothing: then none of the batch's leases
    follows the owner lease any more, but an empty batch commits nothing, so claims that
    followed it before still do (and the caller keeps passing the expiry it had).
    ``lost`` are the indexes, ascending, of the batch's leases that were not renewed (what
    :data:`LEASE_LOST` says in a ``renew_all`` answer). ``changed`` are the indexes, ascending,
    of renewed leases whose task's revision is above the revision the caller gave for it: an
    answer or a cancellation committed elsewhere, which the caller re-reads.
    """

    expires_at: int | None
    lost: tuple[int, ...]
    changed: tuple[int, ...]


@attrs.frozen(kw_only=True)
class LedgerEntry:
    """One applied event as the ledger recorded it (a store's ``history(task_id)``)."""

    event: Event
    revision: int
    committed_at: int
    effects: Effects


@attrs.frozen(kw_only=True)
class AuditFinding:
    task_id: str
    reason: str


@attrs.frozen(kw_only=True)
class AuditPage:
    """One page of a durable store's ``audit()``: the ids checked, what failed, the next
    cursor (``None`` on the last page)."""

    checked: tuple[str, ...]
    findings: tuple[AuditFinding, ...]
    next_after: str | None


# -- operator values (the optional ListsTasks capability) -----------------------------------


def work_tool(work: Work | None) -> str | None:
    """The tool whose call created a task: the work's ``tool`` (set when a ``work_builder``
    shaped it), else the ``name`` of ``tools/call`` work (``None`` for other work)."""
    if work is None:
        return None
    if work.tool is not None:
        return work.tool
    if work.type != "tools/call":
        return None
    name = work.input.get("name")
    return name if isinstance(name, str) else None


@attrs.frozen(order=True)
class TaskCursor:
    """Where a listing page ended: tasks are listed by ``(created_at, task_id)``."""

    created_at: int
    task_id: str


def _statuses(value: Iterable[TaskStatus | str]) -> frozenset[TaskStatus]:
    if isinstance(value, str):
        raise TypeError("statuses must be a collection of statuses, not one string")
    return frozenset(TaskStatus(status) for status in value)


def _canonical_scope(_inst: object, _attr: object, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        raise TypeError("scope must be a scope key (canonical JSON text) or None")
    try:
        canonical = canonical_json(json.loads(value))
    except (ValueError, InvalidJSON):
        canonical = None
    if canonical != value:
        raise ValueError(f"scope {value!r} is not canonical JSON (use canonical_json(value))")


def _optional_instant(_inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and (type(value) is not int or value < 0):
        raise ValueError(f"{attr.name} must be an instant (int µs >= 0) or None")


def _page_limit(_inst: object, _attr: object, value: Any) -> None:
    if type(value) is not int or not 1 <= value <= MAX_LIST_PAGE:
        raise ValueError(f"limit must be an int in 1..{MAX_LIST_PAGE}")


def _optional_cursor(_inst: object, _attr: object, value: Any) -> None:
    if value is not None and not isinstance(value, TaskCursor):
        raise TypeError("after must be a TaskCursor (a listing's next_after) or None")


@attrs.frozen(kw_only=True)
class TaskQuery:
    """Which stored tasks an operator lists: every filter given must hold (empty: all tasks).

    ``statuses`` (any of them), ``tool`` (the creating tool's name, see :func:`work_tool`),
    ``scope`` (a scope key: the canonical JSON text of the scope value, ``"null"`` under
    ``scope="shared"``), ``created_before`` (µs, exclusive). Pages hold at most ``limit`` tasks
    in ``(created_at, task_id)`` order, starting after the cursor ``after``.
    """

    statuses: frozenset[TaskStatus] = attrs.field(default=frozenset(), converter=_statuses)
    tool: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(str))
    )
    scope: str | None = attrs.field(default=None, validator=_canonical_scope)
    created_before: int | None = attrs.field(default=None, validator=_optional_instant)
    limit: int = attrs.field(default=100, validator=_page_limit)
    after: TaskCursor | None = attrs.field(default=None, validator=_optional_cursor)

    def matches(self, task: StoredTask) -> bool:
        """The filters, as every store must apply them (the reference for SQL versions)."""
        created_at = task.snapshot.task.created_at
        return (
            (not self.statuses or task.snapshot.task.status in self.statuses)
            and (self.tool is None or task.tool == self.tool)
            and (self.scope is None or task.scope == self.scope)
            and (self.created_before is None or created_at < self.created_before)
            and (self.after is None or task.cursor > self.after)
        )


@attrs.frozen(kw_only=True)
class ClaimInfo:
    """What an operator may know of a task's claim: never its token, which is the authority."""

    owner_id: str
    generation: int
    expires_at: int
    live: bool
    """Whether the claim still holds at the listing's ``now`` (the store decides: a SQLite
    claim of an earlier boot epoch is dead before it expires)."""


@attrs.frozen(kw_only=True)
class StoredTask:
    """One task as the store holds it: the record, its scope key, its lease bookkeeping."""

    snapshot: Snapshot
    scope: str
    generation: int
    """The lease generation: how many claims the task has had."""
    claim: ClaimInfo | None
    expired: bool
    """Its TTL has passed: requests no longer see it, and the next reap deletes it."""

    @property
    def task_id(self) -> str:
        return self.snapshot.task.id

    @property
    def tool(self) -> str | None:
        return work_tool(self.snapshot.work)

    @property
    def cursor(self) -> TaskCursor:
        return TaskCursor(self.snapshot.task.created_at, self.snapshot.task.id)


@attrs.frozen(kw_only=True)
class TaskListing:
    """One page of :meth:`ListsTasks.list_tasks`, read at the store's ``now``; ``next_after``
    is the cursor of the next page (``None`` on the last one)."""

    now: int
    tasks: tuple[StoredTask, ...]
    next_after: TaskCursor | None


@attrs.frozen(kw_only=True)
class TaskInspection:
    """One task with its whole ledger, read in one step at the store's ``now``."""

    now: int
    task: StoredTask
    ledger: tuple[LedgerEntry, ...]


def check_task_query(query: object) -> TaskQuery:
    if not isinstance(query, TaskQuery):
        raise TypeError("list_tasks needs a TaskQuery")
    return query


def check_operator_action(task_id: object, action: object) -> Action:
    """The arguments of :meth:`ListsTasks.operator_access`."""
    if not isinstance(task_id, str) or not task_id:
        raise ValueError("a non-empty task id is required")
    action = Action(action)  # type: ignore[arg-type]
    if action not in OPERATOR_ACTIONS:
        raise UnauthorizedAction(f"an operator access cannot {action.value} (get, update, cancel)")
    return action


def listing_page(now: int, query: TaskQuery, candidates: Iterable[StoredTask]) -> TaskListing:
    """A page from matching tasks in listing order, of which at most ``limit + 1`` are read:
    the extra one only tells whether another page follows."""
    tasks: list[StoredTask] = []
    more = False
    for task in candidates:
        if len(tasks) == query.limit:
            more = True
            break
        tasks.append(task)
    return TaskListing(now=now, tasks=tuple(tasks), next_after=tasks[-1].cursor if more else None)


# -- scope helpers ------------------------------------------------------------------------------


def require_scope(scope: object, *, store: str) -> Scope:
    """Validate a store's ``scope=`` option, refusing a missing one with a clear message."""
    if scope is None:
        raise TypeError(
            f"{store} requires scope=: a function (ctx) -> JSON value naming the principal or "
            "tenant that may see a task, or 'shared' to let every caller see every task (task "
            "ids then act as bearer credentials)"
        )
    if scope == "shared" or callable(scope):
        return scope
    raise TypeError(f"{store} scope must be 'shared' or a callable, not {scope!r}")


def resolve_scope(scope: Scope, ctx: object) -> str:
    """The canonical scope key for ``ctx`` (JSON text, so ``1`` and ``true`` never collide).

    :class:`Unauthorized` raised by the scope function propagates; a non-JSON value raises
    :class:`InvalidScope`.
    """
    if scope == "shared":
        return SHARED_SCOPE_KEY
    assert callable(scope)
    value = scope(ctx)
    try:
        return canonical_json(value)
    except InvalidJSON as exc:
        raise InvalidScope(f"the scope function returned a non-JSON value: {exc}") from None


def new_access(store_id: str, scope: Scope, ctx: object, action: Action, task_id: str) -> Access:
    """``authorize``'s answer: ``ctx``'s scope key for one action on one (non-empty) task id."""
    action = Action(action)
    if not isinstance(task_id, str) or not task_id:
        raise ValueError("a non-empty task id is required")
    return Access(
        store_id=store_id, action=action, task_id=task_id, scope=resolve_scope(scope, ctx)
    )


# -- argument checks shared by the stores --------------------------------------------------------


def check_limit(value: object, name: str) -> int | None:
    """A capacity limit option: a positive int, or ``None`` for unlimited."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be a positive int or None (unlimited)")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int or None (unlimited)")
    return value


def check_positive_int(value: object, name: str, *, unit: str = "") -> int:
    """A positive int (``unit`` completes the message, e.g. ``" of seconds"``)."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int{unit}")
    return value


def check_positive_ms(value: object, name: str) -> int:
    """A positive duration in milliseconds (``lease_ms`` and the stores' timeouts)."""
    return check_positive_int(value, name, unit=" of milliseconds")


def check_owner(value: object) -> str:
    """A claim's ``owner_id``: a non-empty string."""
    if not isinstance(value, str) or not value:
        raise ValueError("owner_id must be a non-empty string")
    return value


def check_create_access(access: object, store_id: str, task: object) -> Access:
    """What every ``create`` checks first: a create access, from this store, for this task."""
    if not isinstance(access, Access):
        raise TypeError("create needs an Access from authorize()")
    if (
        access.store_id != store_id
        or access.action is not Action.CREATE
        or access.task_id != getattr(task, "id", None)
    ):
        raise UnauthorizedAction("create needs a create access for this task from this store")
    return access


def check_submit(
    owner_id: object, lease_ms: object, concurrency: object
) -> tuple[str | None, int, Concurrency | None]:
    """The arguments of :meth:`Queues.submit` (``owner_id`` ``None``: queue it)."""
    owner = None if owner_id is None else check_owner(owner_id)
    lease = check_positive_ms(lease_ms, "lease_ms")
    if concurrency is not None and not isinstance(concurrency, Concurrency):
        raise TypeError("concurrency must be a Concurrency or None")
    return owner, lease, concurrency


def check_audit_page(limit: object, after: object) -> None:
    """The arguments of a durable store's ``audit(limit=..., after=...)``."""
    if type(limit) is not int or not 1 <= limit <= MAX_AUDIT_PAGE:
        raise ValueError(f"limit must be an int in 1..{MAX_AUDIT_PAGE}")
    if after is not None and not isinstance(after, str):
        raise TypeError("after must be a task id or None")


def check_transition_arguments(
    expected_revision: object, event: object, operation: str = "transition"
) -> None:
    """The arguments every ``transition`` (and ``settle``) checks before touching the store."""
    if not isinstance(expected_revision, int) or isinstance(expected_revision, bool):
        raise TypeError("expected_revision must be an int")
    if expected_revision < 0:
        raise ValueError("expected_revision must be >= 0")
    if not isinstance(event, Event):
        raise TypeError(f"{operation} needs an Event")


def check_renewals(
    owner_id: object, leases: object, lease_ms: object
) -> tuple[str, list[Lease], int]:
    """The arguments of :meth:`RenewsLeases.renew_all`: an owner, a sequence of leases (a
    list or tuple, so its order is the answer's), a positive ``lease_ms``."""
    owner_id = check_owner(owner_id)
    lease_ms = check_positive_ms(lease_ms, "lease_ms")
    if not isinstance(leases, list | tuple):
        raise TypeError("renew_all needs a list or tuple of leases")
    for lease in leases:
        if not isinstance(lease, Lease):
            raise TypeError("renew_all needs a list or tuple of leases")
    return owner_id, list(leases), lease_ms


def check_owner_renewal(
    owner_id: object, leases: object, revisions: object, following: object, lease_ms: object
) -> tuple[str, list[Lease], list[int], int | None, int]:
    """The arguments of :meth:`RenewsOwnerLease.renew_owner`: an owner, a sequence of leases
    and one of revisions (lists or tuples of the same length, so indexes are the answer's), the
    owner lease's expiry as the caller holds it (an instant, or ``None``), a positive
    ``lease_ms``."""
    owner_id = check_owner(owner_id)
    lease_ms = check_positive_ms(lease_ms, "lease_ms")
    if not isinstance(leases, list | tuple) or not all(isinstance(x, Lease) for x in leases):
        raise TypeError("renew_owner needs a list or tuple of leases")
    if not isinstance(revisions, list | tuple) or len(revisions) != len(leases):
        raise TypeError("renew_owner needs a list or tuple of revisions, one per lease")
    for revision in revisions:
        if type(revision) is not int or revision < 0:
            raise TypeError("a revision is an int >= 0")
    if following is not None and type(following) is not int:
        raise TypeError("following is the owner lease's expiry (an int) or None")
    return owner_id, list(leases), list(revisions), following, lease_ms


def decode_ledger(snapshot: Snapshot, rows: Iterable[tuple[Any, ...]]) -> list[LedgerEntry]:
    """A persisted ledger decoded and validated against itself and the task's record.

    For stores that keep each applied event as a row of ``(event_id, row_format, event JSON
    text, event_kind, revision, committed_at, effects JSON text)``, in revision order. Any
    disagreement raises :class:`CorruptStore` (nothing is repaired).
    """
    task = snapshot.task
    entries: list[LedgerEntry] = []
    previous = task.created_at
    try:
        for expected, (event_id, row_format, text, kind, revision, at, effects) in enumerate(
            rows, 1
        ):
            if row_format != 1 or type(revision) is not int or revision != expected:
                raise CorruptRecord(f"ledger row {expected} has the wrong format or revision")
            event = Event.from_json(json.loads(text))
            if event.id != event_id or event.kind.value != kind:
                raise CorruptRecord(f"ledger row {expected} disagrees with its event")
            if type(at) is not int or at <= previous:
                raise CorruptRecord("ledger commit times do not strictly increase")
            previous = at
            entries.append(
                LedgerEntry(
                    event=event,
                    revision=revision,
                    committed_at=at,
                    effects=effects_from_json(json.loads(effects)),
                )
            )
        if len(entries) != snapshot.revision:
            raise CorruptRecord(
                f"the ledger holds {len(entries)} events for revision {snapshot.revision}"
            )
        if entries and entries[-1].committed_at != task.last_updated_at:
            raise CorruptRecord("the last ledger commit time is not lastUpdatedAt")
    # CorruptRecord and CodecError are ValueErrors; RecursionError: JSON nested deeper than the
    # standard library's decoder recurses (a store that does not check JSON on writes keeps it).
    except (ValueError, TypeError, RecursionError) as exc:
        raise CorruptStore(task.id, f"ledger: {exc}") from exc
    return entries


# -- optional capabilities --------------------------------------------------------------------


@runtime_checkable
class CreatesClaimed(Protocol):
    """A store that can create a task and claim it in one atomic step.

    Runners use it when offered, so no other runner's ``claim_next`` can adopt a task between
    its creation and its first claim; without it they call ``create`` then ``claim``.
    """

    async def create_claimed(
        self, task: Task, work: Work, access: Access, owner_id: str, lease_ms: int
    ) -> Claimed: ...


@runtime_checkable
class OffersWakeups(Protocol):
    """A store that can push hints when work appears or changes elsewhere (PostgreSQL NOTIFY).

    ``wakeups()`` returns an async iterator of hints with ``kind`` (``"resync"``, ``"created"``,
    ``"retry_scheduled"``, ``"released"``, ``"input_accepted"``, ``"cancelled"``), ``task_id``,
    ``due_at`` (store µs, for retries) and ``local`` (this store object made the commit). A hint
    is never the authority: runners re-ask the store, and keep polling as the safety net.
    """

    def wakeups(self) -> AsyncGenerator[Any, None]: ...


@runtime_checkable
class OffersChanges(Protocol):
    """A store that announces every committed change of its tasks, by any writer on any host.

    ``changes()`` returns an async iterator of :class:`~tritask.tasks.changes.TaskChange`: one
    ``changed`` (task id, revision, status) for every applied transition or settle, one
    ``reaped`` for every task ``reap`` deleted, and ``resync`` first and whenever changes may
    have been lost (a reconnect, an iteration that fell behind its bounded buffer). A change
    committed through this store object carries the committed snapshot; one heard from
    elsewhere (PostgreSQL ``NOTIFY``) does not, and whoever renders it reads the task through
    the store with its own access, so scope rules hold. Changes of one task committed by one
    store object arrive in revision order; changes heard from elsewhere may interleave with
    them, so consumers keep the highest revision they rendered and skip anything older.

    The runner consumes it and hands each change to :meth:`Runner.watch` callbacks (the Tasks
    extension pushes ``notifications/tasks`` from them). Without it, listeners hear only of
    the transitions their own runner applies. Detected on the store's class
    (:func:`offers_changes`), for the reason given under :class:`Settles`.
    """

    def changes(self) -> AsyncGenerator[Any, None]: ...


@runtime_checkable
class Settles(Protocol):
    """A store that can apply an attempt's final worker event and release its claim atomically.

    ``settle(task_id, expected_revision, event, lease)`` is
    ``transition(task_id, expected_revision, event, WorkerAuthority(lease))`` followed, in the
    same atomic step and only when that returns a :class:`Transition` (``applied``,
    ``unchanged`` or ``duplicate``), by ``release(lease)``. A :class:`Conflict`, ``NOT_FOUND``
    or an error changes nothing and keeps the claim. ``event.kind`` must be one of
    :data:`SETTLE_KINDS` (``input_requested`` does not end an attempt): any other kind raises
    :class:`UnauthorizedAction`. The runner uses it when offered, which saves the separate
    ``release`` commit of every attempt.

    A resend after a lost acknowledgement stays idempotent: when the claim is gone but no later
    claim was made (the task's lease generation is still ``lease.generation``, in the same store
    and boot epoch) and ``event.id`` is in the ledger with exactly this event, the answer is the
    original commit's ``duplicate``, as a plain transition's would be; every other use of a
    lease that is not the live claim raises :class:`StaleLease`.

    Runners detect it on the store's *class* (:func:`settles`), not through ``__getattr__``
    forwarding: a wrapper that overrides ``transition`` or ``release`` must not have them
    bypassed by a combined operation it never saw; a wrapper offers ``settle`` by defining it.
    """

    async def settle(
        self, task_id: str, expected_revision: int, event: Event, lease: Lease
    ) -> Transition | Conflict | NotFound: ...


@runtime_checkable
class StampsCreation(Protocol):
    """A store that stamps a new task with its own clock in the step that creates it.

    ``create_claimed_stamped`` is ``create_claimed`` except that the stored task's
    ``createdAt`` and ``lastUpdatedAt`` are the store clock's reading inside the creating step;
    the given task's two (equal) instants are placeholders and are ignored, and its TTL counts
    from the stamped instant. Callers then need no ``now()`` round trip before creating, and
    ``createdAt`` is exactly the store's time of creation. Detected on the store's class
    (:func:`stamps_creation`), for the reason given under :class:`Settles`.
    """

    async def create_claimed_stamped(
        self, task: Task, work: Work, access: Access, owner_id: str, lease_ms: int
    ) -> Claimed: ...


@runtime_checkable
class Queues(Protocol):
    """A store that is a queue: creation never needs a free runner slot.

    ``submit(task, work, access, owner_id=..., lease_ms=..., concurrency=...)`` creates the
    task as :meth:`Store.create` does (the same checks and limits, in one atomic step), stamped
    with the store's clock as :class:`StampsCreation` says, and then, in that same step:

    * with an ``owner_id``, claims it for that owner at generation 1 and returns
      :class:`Claimed`, unless its ``concurrency`` key is full (``limit`` live claims) or holds
      claimable tasks submitted earlier (first in first out within a key);
    * otherwise stores it *queued* and returns its :class:`Snapshot`: ``working``, revision 0,
      status message :data:`QUEUED_MESSAGE`. The given status message is kept aside and becomes
      the task's again at its first claim (``claim`` or ``claim_next``, by any runner), without
      a new revision: nothing happened to the task, it only started.

    A queued task is an ordinary stored task: ``get``, ``transition`` (cancel), TTL and ``reap``
    apply to it as to any other.

    Concurrency keys bind every claim of a store that offers this capability: a task whose key
    has ``limit`` live claims is not claimable (``claim`` answers ``UNAVAILABLE``, ``claim_next``
    passes it over), and ``claim_next`` takes, among the claimable tasks, one whose key has the
    fewest live claims (a task without a key counts as none), the oldest by
    ``(created_at, task_id)`` among those: first in first out within a key, fair across keys.
    Without keys this is exactly the plain ``claim_next`` order. Detected on the store's class
    (:func:`queues`), for the reason given under :class:`Settles`.
    """

    async def submit(
        self,
        task: Task,
        work: Work,
        access: Access,
        *,
        owner_id: str | None,
        lease_ms: int,
        concurrency: Concurrency | None = None,
    ) -> Claimed | Snapshot: ...


@runtime_checkable
class SignalsQueue(Protocol):
    """A store that tells the runners of this process when queued work may be claimable.

    ``listen_queue(callback)`` calls ``callback()`` (in the trio thread, synchronously, so it
    must only schedule work) after each commit of this store object that makes queued work
    claimable: a task stored unclaimed (queued), a claim on a task with a concurrency key
    released or settled (a slot of its key freed). It returns a function
    that unsubscribes. A signal is a hint, never the authority: runners still ask the store.
    Stores shared across processes add their own channel (PostgreSQL ``NOTIFY``, see
    :class:`OffersWakeups`); others are polled across processes.
    """

    def listen_queue(self, callback: Callable[[], None]) -> Callable[[], None]: ...


@runtime_checkable
class ListsTasks(Protocol):
    """A store that lets an operator see and act on every task it holds, across scopes.

    This is operator authority: whoever holds the store object (and so its database) may use
    it. It is never reachable from a request: the Tasks extension serves ``tasks/*`` through
    :meth:`Store.authorize` only, and nothing in the MCP surface lists tasks. ``tritask tasks``
    (list, show, stats, cancel) is built on it.

    * ``list_tasks(query)`` pages through the stored tasks matching a :class:`TaskQuery`, in
      ``(created_at, task_id)`` order, expired-but-unreaped ones included (flagged), read on
      the store's clock in one consistent step per page;
    * ``inspect_task(task_id)`` reads one task and its whole ledger in one step
      (``NOT_FOUND`` only when the store holds no such task: expiry does not hide it);
    * ``operator_access(task_id, action)`` is an :class:`Access` for ``get``, ``update`` or
      ``cancel`` in the task's own scope (``NOT_FOUND`` when the store holds no such task), so
      an operator's cancellation is the same compare-and-set transition, recorded in the same
      ledger, announced by the same wake-ups, as a client's ``tasks/cancel``: the store stays
      the authority and no row is written behind its back.

    Detected on the store's class (:func:`lists_tasks`), for the reason given under
    :class:`Settles`.
    """

    async def list_tasks(self, query: TaskQuery) -> TaskListing: ...

    async def inspect_task(self, task_id: str) -> TaskInspection | NotFound: ...

    async def operator_access(self, task_id: str, action: Action) -> Access | NotFound: ...


@runtime_checkable
class RenewsLeases(Protocol):
    """A store that renews many leases of one owner in one atomic step (one commit).

    ``renew_all(owner_id, leases, lease_ms)`` answers, in the order of ``leases``, what
    ``renew(lease, lease_ms)`` would have for each of them, all decided at one store instant
    ``now``: a :class:`Renewed` (the new lease expires at ``now + lease_ms``, a value other
    than the old one, which is then stale, and the task's revision) where ``lease`` is exactly
    the task's live claim and its
    ``owner_id`` is ``owner_id``; :data:`LEASE_LOST` for anything else (a stale generation or
    token, an expired lease, a released claim, a deleted task, another store or owner). A lost
    lease changes nothing and never affects the others: an expired lease is not revived even if
    nobody claimed the task since. A task is renewed at most once per call: after the first
    lease that renews it, any other lease for the same task in the batch is lost (it is stale
    by then, as it would be for a second ``renew``). A lease of the owner left out of the batch
    keeps exactly the expiry it had. An empty batch commits nothing.

    Runners renew all their attempts' leases with one call per heartbeat when the store offers
    it, so idle cost is proportional to runners, not to running tasks; without it each attempt
    renews its own lease. Detected on the store's class (:func:`renews_leases`), for the reason
    given under :class:`Settles`.
    """

    async def renew_all(
        self, owner_id: str, leases: list[Lease] | tuple[Lease, ...], lease_ms: int
    ) -> list[Renewed | LeaseLost]: ...


@runtime_checkable
class RenewsOwnerLease(Protocol):
    """A store that renews every lease of one owner by extending one owner lease, and answers
    with one value (:class:`OwnerRenewal`), not one per lease.

    ``renew_owner(owner_id, leases, revisions, following, lease_ms)`` decides, at one store
    instant ``now`` and in one atomic step (one commit), which leases of the batch are renewed.
    A claim renewed by it *follows* the owner lease of ``owner_id`` from then on: its store,
    task, owner, token, generation and epoch stay exactly the lease's, its expiry is the owner
    lease's, ``now + lease_ms`` (every renewed claim of a batch gets the same one, the
    answer's ``expires_at``). So the caller keeps the lease it holds and knows the exact live
    claim as that lease with ``expires_at`` set to the last answer's; it passes the held lease
    and that expiry (``following``; ``None`` when nothing of its follows) to the next batch.
    The expiry to pass is the last one a batch that renewed something answered; a batch that
    answered ``None`` (empty, or every lease lost) does not reset it for claims outside it.

    A lease of the batch is renewed when it is its task's live claim (at ``now``) and its
    ``owner_id`` is ``owner_id``: its store, task, owner, token, generation and epoch are the
    claim's, and either the claim follows the owner lease and ``following`` is exactly the
    owner lease's current expiry (the lease's own ``expires_at`` is not looked at: the claim
    has none), or the claim does not follow it and the lease is exactly the claim, expiry
    included (a claim made or renewed alone since the last batch). Anything else is lost, as in
    :meth:`RenewsLeases.renew_all`: a stale generation or token, an expired claim (an owner
    lease that lapsed loses every claim that follows it; an expired claim is not revived),
    a released claim, a deleted task, another store or owner, a ``following`` that is not the
    owner lease's expiry, a lease of a task that an earlier lease of the batch is for (only the
    first lease of each task counts, renewed or lost). A lost lease changes nothing and never
    affects the others.

    A claim that follows the owner lease and is not renewed by the batch (left out, or lost)
    keeps exactly the expiry it had, as its own, and no longer follows it; so does a claim
    renewed alone (``renew``, with a fresh token as always). ``revisions[i]`` is the revision
    the caller knows of the task of ``leases[i]``: a renewed lease whose task is at a higher
    revision is in ``changed``. An empty batch commits nothing and answers
    ``OwnerRenewal(None, (), ())``.

    Unlike ``renew`` and ``renew_all``, a renewal here keeps the token: the held lease with its
    old expiry is stale once the expiry moved, and the same claim renewed to the same instant
    (a batch at the claim's own instant) is simply the same value. Runners use it in
    preference to ``renew_all`` when the store offers it: a heartbeat then makes no object per
    attempt. Detected on the store's class (:func:`renews_owner_lease`), for the reason given
    under :class:`Settles`.
    """

    async def renew_owner(
        self,
        owner_id: str,
        leases: list[Lease] | tuple[Lease, ...],
        revisions: list[int] | tuple[int, ...],
        following: int | None,
        lease_ms: int,
    ) -> OwnerRenewal: ...


def _class_offers(store: object, name: str) -> bool:
    return callable(getattr(type(store), name, None))


def offers_changes(store: object) -> TypeGuard[OffersChanges]:
    """Whether ``store``'s class offers :class:`OffersChanges`."""
    return _class_offers(store, "changes")


def settles(store: object) -> TypeGuard[Settles]:
    """Whether ``store``'s class offers :class:`Settles`."""
    return _class_offers(store, "settle")


def stamps_creation(store: object) -> TypeGuard[StampsCreation]:
    """Whether ``store``'s class offers :class:`StampsCreation`."""
    return _class_offers(store, "create_claimed_stamped")


def renews_leases(store: object) -> TypeGuard[RenewsLeases]:
    """Whether ``store``'s class offers :class:`RenewsLeases`."""
    return _class_offers(store, "renew_all")


def renews_owner_lease(store: object) -> TypeGuard[RenewsOwnerLease]:
    """Whether ``store``'s class offers :class:`RenewsOwnerLease`."""
    return _class_offers(store, "renew_owner")


def queues(store: object) -> TypeGuard[Queues]:
    """Whether ``store``'s class offers :class:`Queues`."""
    return _class_offers(store, "submit")


def signals_queue(store: object) -> TypeGuard[SignalsQueue]:
    """Whether ``store``'s class offers :class:`SignalsQueue`."""
    return _class_offers(store, "listen_queue")


def lists_tasks(store: object) -> TypeGuard[ListsTasks]:
    """Whether ``store``'s class offers :class:`ListsTasks` (all three of its methods)."""
    return all(
        _class_offers(store, name) for name in ("list_tasks", "inspect_task", "operator_access")
    )


# -- the protocol -------------------------------------------------------------------------------


@runtime_checkable
class Store(Protocol):
    """The contract every task store implements. All operations are atomic on the store."""

    async def now(self) -> int:
        """The store's clock (µs). Leases, ``retry_at`` and TTLs are decided against it."""
        ...

    async def authorize(self, ctx: object, action: Action, task_id: str) -> Access:
        """The only place a request context crosses into the store: derive its scope."""
        ...

    async def create(self, task: Task, work: Work, access: Access) -> Snapshot:
        """Persist a task and its work at revision 0, checking limits in the same step."""
        ...

    async def get(self, task_id: str, access: Access) -> Snapshot | NotFound:
        """Read through a get/update/cancel access; other scope or expired gives ``NOT_FOUND``."""
        ...

    async def worker_snapshot(self, task_id: str, lease: Lease) -> Snapshot | NotFound:
        """Read through an exact, live lease (raises :class:`StaleLease`)."""
        ...

    async def claim(
        self, task_id: str, owner_id: str, lease_ms: int
    ) -> Claimed | Deferred | Unavailable | NotFound:
        """Claim one task: terminal/no work/live claim → ``UNAVAILABLE``; retry pending or
        suspended (``snapshot.available_at`` in the future) → ``Deferred``; else a new lease at
        the next generation."""
        ...

    async def claim_next(self, owner_id: str, lease_ms: int) -> Claimed | None:
        """Claim the first claimable task by ``(created_at, task_id)``; ``None`` when none is."""
        ...

    async def renew(self, lease: Lease, lease_ms: int) -> Lease:
        """Extend a live claim to ``now + lease_ms``; the old lease value becomes stale."""
        ...

    async def release(self, lease: Lease) -> None:
        """Clear a matching (possibly expired) claim so the task is claimable at once."""
        ...

    async def reap(self) -> list[str]:
        """Delete whole expired aggregates (including active ones); return their ids."""
        ...

    async def transition(
        self, task_id: str, expected_revision: int, event: Event, authority: Authority
    ) -> Transition | Conflict | NotFound:
        """Compare-and-set application of ``event`` (reference 3.4)."""
        ...

    async def aclose(self) -> None: ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...
