"""``PostgresStore``: the Store contract on PostgreSQL, for runners on many hosts.

Every operation is one transaction (or a share of a batch's) on one pooled connection, its
statements sent from the trio thread through libpq's non-blocking API (see ``_native``). It
decides on the database's clock: ``clock_timestamp()`` read *after* the row lock, so a call
that waited for a lock never judges a lease or a retry deadline by a time from before the
wait.

* Transitions lock the row (``FOR UPDATE``), then read the clock and the event ledger in a new
  statement (a new READ COMMITTED snapshot, so a replay committed while we waited is seen), check
  authority, replay an already-committed event id *before* comparing revisions, run the shared
  reducer in Python, and write the record, its projections and the ledger row in one statement.
  ``settle`` is the same transaction for a worker's final event, its write also clearing the
  claim (a ``duplicate`` or ``unchanged`` answer clears it too).
* Group commit: concurrent creations (without a concurrency key) and settles share one
  transaction on one connection, two pipelined round trips for the whole batch, each operation
  still decided alone and each caller answered only after the commit (see ``_batch`` and
  ``_run_batch``). Under limits the batch takes the capacity lock once and admits its
  creations in turn from one count (``_admit``).
* ``create_claimed_stamped`` inserts in one statement that reads the clock and formats it into
  the record's ``createdAt``/``lastUpdatedAt`` itself, so stamping costs no extra round trip.
* ``claim_next`` takes the oldest claimable task by ``(created_at, task_id)`` with
  ``FOR UPDATE SKIP LOCKED``, so concurrent claimers on any host get distinct tasks.
* Leases are fenced: owner, random UUID token, generation (+1 on every claim) and exact expiry.
* Limits are counted under a transaction-scoped advisory lock keyed on the schema, in a
  statement that starts after the lock is granted (its snapshot includes the previous holder's
  insert; a batch's creations: one lock and one count for all). The number of tasks is the sum
  of ``task_counts``, which triggers keep in every inserting and deleting transaction (schema
  4), so counting costs the same at any size. With both limits unlimited, creation takes no
  lock.
* Commits that make work appear or change a running attempt send ``NOTIFY`` in the same
  transaction; ``wakeups()`` delivers them (see ``_wakeups``).
* Every read decodes and validates the aggregate record and checks that the projection columns
  agree with it; a mismatch raises :class:`~tritask.tasks.store.CorruptStore`. Nothing is
  repaired.

Time in tests: ``clock=`` replaces the database clock with a function (µs) whose reading is sent
as a query parameter where production SQL calls ``clock_timestamp()``. It exists for the
contract suite's deterministic time travel only; production leaves it unset.
"""

from __future__ import annotations

import copy
import functools
import secrets
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Final, NoReturn, Self, TypeVar

import attrs
import outcome
import psycopg
import trio
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from tritask.jsonrpc import loads
from tritask.tasks._time import MAX_INSTANT, Clock, format_instant
from tritask.tasks.changes import ChangeFeed, TaskChange
from tritask.tasks.events import (
    Effects,
    Event,
    EventKind,
    effects_from_json,
    effects_to_json,
)
from tritask.tasks.model import (
    CorruptRecord,
    Snapshot,
    Task,
    TaskStatus,
    clone_snapshot,
    initial_snapshot,
    record_text,
    revise,
    snapshot_from_json,
    snapshot_json_view,
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
    AuditFinding,
    AuditPage,
    Authority,
    CapacityExceeded,
    Claimed,
    ClaimInfo,
    Concurrency,
    Conflict,
    CorruptStore,
    DatabaseBusy,
    Deferred,
    EventIdReused,
    InvalidTask,
    Lease,
    LeaseLost,
    LedgerEntry,
    NotFound,
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
    check_audit_page,
    check_create_access,
    check_limit,
    check_operator_action,
    check_owner,
    check_positive_int,
    check_positive_ms,
    check_renewals,
    check_submit,
    check_task_query,
    check_transition_arguments,
    decode_ledger,
    listing_page,
    new_access,
    require_scope,
)
from tritask.tasks.work import CodecError, JSONObject, Work, canonical_json, stored_text
from tritask_postgres._batch import Batcher, Item
from tritask_postgres._changes import change_payload, listen_changes, reaped_payload_sql
from tritask_postgres._migrations import check_schema, redact_dsn, resolve_schema
from tritask_postgres._native import COMMIT, Result, Session, Statement, statement
from tritask_postgres._pool import ConnectionPool
from tritask_postgres._wakeups import Wakeup, WakeupKind, listen, notify_payload

__all__ = ["AuditFinding", "AuditPage", "LedgerEntry", "PostgresStore", "open_store"]

T = TypeVar("T")
Conn = psycopg.Connection[Any]

CAPACITY_LOCK_CLASS: Final = 0x74726361
"""First key of the capacity advisory lock ('trca'); the second is ``hashtext(schema)``."""
_COMMIT_STEP_US: Final = 1
#: The settles ``_plan_settle`` plans: terminal, so the reducer's outcome depends on the commit
#: time only through the task's ``lastUpdatedAt`` (a retry's due time depends on it too).
_PLANNED_KINDS: Final = frozenset({EventKind.COMPLETED, EventKind.FAILED})
_MAX_BIGINT: Final = 2**63 - 1
_READ_ACTIONS: Final = frozenset({Action.GET, Action.UPDATE, Action.CANCEL})
_ACTIVE: Final = "('working', 'input_required')"
_ACTIVE_STATUSES: Final = frozenset({"working", "input_required"})
_BUSY_ERRORS: Final = (
    psycopg.errors.LockNotAvailable,
    psycopg.errors.DeadlockDetected,
    psycopg.errors.SerializationFailure,
    psycopg.errors.QueryCanceled,  # our statement_timeout (trio's own cancels become Cancelled)
)
#: What makes a batch's first round trip fail as a whole (the transaction is then rolled back
#: and each item runs alone): a server error on any statement, or a lost connection.
_BATCH_ERRORS: Final = (psycopg.Error,)
#: Decoded records remembered for the settles that follow their creation (``_remember``).
_KNOWN_LIMIT: Final = 1024
_CLOCK_SQL: Final = "(extract(epoch FROM clock_timestamp()) * 1000000)::bigint"
_INSTANT_SQL: Final = (
    "(to_char(to_timestamp(n.now / 1000000) AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.')"
    " || CASE WHEN mod(n.now, 1000) = 0 THEN lpad((mod(n.now, 1000000) / 1000)::text, 3, '0')"
    " ELSE lpad(mod(n.now, 1000000)::text, 6, '0') END || 'Z')"
)
"""``n.now`` (µs, within 1970..9999) as :func:`tritask.tasks._time.format_instant` writes it:
milliseconds when whole, else microseconds."""

_COLUMNS: Final = (
    "t.task_id, t.record::text, t.scope, t.revision, t.status, t.created_at_us, "
    "t.expires_at_us, t.retry_at_us, t.claim_owner, t.claim_token::text, t.lease_generation, "
    "t.claim_expires_at_us, t.queued_message, t.concurrency_key, t.concurrency_limit"
)


def _each_row(ids: str, columns: str, *, lock: bool) -> str:
    """SQL selecting the rows of the task ids in the ``text[]`` parameter ``ids``, in task-id
    order (the column's ``"C"`` collation), one primary-key probe per id (``FOR UPDATE`` each
    with ``lock``, in that order, so two batches never wait for each other in opposite orders).

    Why not ``WHERE t.task_id = ANY(ids)`` or ``EXISTS``: a prepared statement's generic plan
    is made once, on its first executions, and kept until the table's statistics change. On
    a new table those executions saw a few pages, for which a scan of the whole table (or a
    hash of all its ids) is the cheaper plan, and without an autovacuum run in between the
    plan kept scanning the table as it grew: two scans per batch, 4.4 million rows read for
    6,000 tasks in one ``bench tasks`` round. A ``LATERAL`` subquery with ``LIMIT`` is never
    pulled up into a join nor hashed: it is one probe of the index or one scan per id, and
    the probe is the cheaper on a table never vacuumed (the planner assumes at least ten
    pages) and on any table of more than a few pages. (On a vacuumed table of a page or two a
    scan per id may be planned; the next statistics make the plan again.)"""
    return (
        f"SELECT {columns} FROM (SELECT w.id FROM unnest({ids}::text[]) AS w(id)"
        ' ORDER BY w.id COLLATE "C") w CROSS JOIN LATERAL (SELECT * FROM {t} r'
        " WHERE r.task_id = w.id LIMIT 1" + (" FOR UPDATE" if lock else "") + ") t"
    )


KEY_LOCK_CLASS: Final = 0x74726B79
"""First key of the concurrency-key advisory lock ('trky'); the second is ``hashtext(schema)``.
Every claim that may grant a task with a concurrency key takes it, then counts the key's live
claims in a statement of its own (whose snapshot includes the previous holder's claim): one lock
for all keys, so two claimers never wait for each other in opposite orders."""


def _scope_text(key: str) -> str:
    """The persisted scope: the reference's versioned wrapper, as canonical JSON text.

    ``key`` is already canonical JSON, so this equals ``canonical_json({"version": 1,
    "value": ...})`` and text equality stays JSON equality.
    """
    return '{"value":' + key + ',"version":1}'


def _stamp_pieces(document: JSONObject) -> list[str]:
    """A new record's stored JSON text (sorted keys, compact) cut where its task's ``createdAt`` and
    ``lastUpdatedAt`` go: the inserting statement joins the three pieces with its clock's
    instant (sent as three text parameters: as ``text[]`` elements every quote in the JSON would
    need escaping).

    The cut marks are random, so the record's own data cannot contain them (checked).
    """
    task = document["task"]
    assert isinstance(task, dict)
    while True:
        mark = secrets.token_hex(16)
        text = stored_text({**document, "task": {**task, "createdAt": mark, "lastUpdatedAt": mark}})
        pieces = text.split(f'"{mark}"')
        if len(pieces) == 3:
            return pieces


def _bigint(us: int | None) -> int | None:
    """Instants beyond PostgreSQL's bigint (year 294,000) are stored as "never"."""
    return None if us is None else min(us, _MAX_BIGINT)


@attrs.frozen
class _Row:
    """One decoded, validated ``tasks`` row."""

    snapshot: Snapshot
    scope: str
    claim_owner: str | None
    claim_token: str | None
    generation: int
    claim_expires_at: int | None
    queued_message: str | None = None
    """The JSON text of the status message the first claim gives back (queued tasks only)."""
    concurrency: Concurrency | None = None

    @property
    def task_id(self) -> str:
        return self.snapshot.task.id

    def expired(self, now: int) -> bool:
        expires_at = self.snapshot.task.expires_at
        return expires_at is not None and now >= expires_at


def _inserted(result: Result, task_id: str, stamp: bool) -> tuple[str, int, int | None]:
    """An insertion's outcome: the stored record's text, the creation instant and the claim's
    expiry (``None`` without a claim); raises when the id exists."""
    row = result.fetchone()
    assert row is not None
    inserted, expires_at, created_at, now, _, stored = row
    if inserted != 1:
        if stamp and not 0 <= now <= MAX_INSTANT:
            raise InvalidTask("the store clock is outside the instants a task can hold")
        raise AlreadyExists(task_id)
    return stored, int(created_at), None if expires_at is None else int(expires_at)


def _many(items: Sequence[Item], result: Result) -> list[tuple[Item, outcome.Outcome[Any]]]:
    """The outcomes of a batch's stamped creations from their ``insert_many`` result: a row
    per inserted task after the clock; a creation without one was not inserted. An id twice
    in the batch had one row: the first creation of it gets the row, the next one finds it
    exists, as it would coming after it."""
    rows = result.rows
    now = rows[0][0]
    found = {row[1]: row for row in rows if row[1] is not None}
    outcomes: list[tuple[Item, outcome.Outcome[Any]]] = []
    for item in items:
        task_id = item.payload.task_id
        row = found.pop(task_id, None)
        if row is not None:
            _, _, created_at, expires_at, stored, _ = row
            value = (stored, int(created_at), None if expires_at is None else int(expires_at))
            outcomes.append((item, outcome.Value(value)))
        elif not 0 <= now <= MAX_INSTANT:
            error = InvalidTask("the store clock is outside the instants a task can hold")
            outcomes.append((item, outcome.Error(error)))
        else:
            outcomes.append((item, outcome.Error(AlreadyExists(task_id))))
    return outcomes


def _admitted(items: Sequence[Item], result: Result) -> list[tuple[Item, outcome.Outcome[Any]]]:
    """The outcomes of a batch's creations under limits from their ``insert_many_admitted``
    result: one row per creation, in order, with its verdict (``_admit``'s, made in SQL) and,
    when it was inserted, its row."""
    outcomes: list[tuple[Item, outcome.Outcome[Any]]] = []
    for item, (now, task_id, created_at, expires_at, stored, _, verdict) in zip(
        items, result.rows, strict=True
    ):
        error: Exception
        if task_id != item.payload.task_id:
            raise CorruptStore(task_id, "the batch's creations came back out of order")
        if verdict == "ok" and stored is not None:
            value = (stored, int(created_at), None if expires_at is None else int(expires_at))
            outcomes.append((item, outcome.Value(value)))
            continue
        if verdict == "max_tasks":
            error = CapacityExceeded("max_tasks")
        elif verdict == "max_active":
            error = CapacityExceeded("max_active_tasks_per_scope")
        elif verdict == "ok" and not 0 <= now <= MAX_INSTANT:
            error = InvalidTask("the store clock is outside the instants a task can hold")
        else:
            error = AlreadyExists(task_id)
        outcomes.append((item, outcome.Error(error)))
    return outcomes


def _one(item: Item, result: Result) -> list[tuple[Item, outcome.Outcome[Any]]]:
    """The outcome of a creation inserted by its own statement."""
    insert = item.payload
    return [(item, outcome.capture(_inserted, result, insert.task_id, insert.stamp))]


@attrs.frozen
class _Insert:
    """A creation in a batch: its one statement. ``limited``: admitted by the batch under the
    capacity lock first (see ``PostgresStore._admit``)."""

    stmt: Statement
    params: dict[str, Any]
    stamp: bool
    limited: bool = False

    @property
    def task_id(self) -> str:
        task_id: str = self.params["task_id"]
        return task_id

    @property
    def scope(self) -> str:
        scope: str = self.params["scope"]
        return scope


class _RolledBack(Exception):
    """A batch's transaction failed before its commit: nothing of it was committed."""


#: The sqlstates with which the server ends a connection (administrator or crash shutdown);
#: class 08 is the connection's own failure.
_CONNECTION_ENDED: Final = frozenset({"57P01", "57P02", "57P03"})


def _connection_ended(exc: psycopg.Error) -> bool:
    """Whether ``exc`` ended the connection (a ``FATAL`` error) rather than refused a
    statement: sent while a ``COMMIT`` was on its way, that transaction may have committed
    first (a backend terminated while it waits for synchronous replication has committed
    locally), so its outcome is unknown."""
    sqlstate = exc.sqlstate
    return (
        exc.diag.severity_nonlocalized in ("FATAL", "PANIC")
        or sqlstate in _CONNECTION_ENDED
        or (sqlstate is not None and sqlstate.startswith("08"))
    )


class _Unknown(Exception):
    """A batch's connection failed after its ``COMMIT`` was sent."""

    def __init__(self, error: psycopg.Error) -> None:
        super().__init__(str(error))
        self.error = error


async def _commit_pipelined(
    session: Session, calls: Sequence[tuple[Statement, Mapping[str, object] | None]]
) -> list[Result]:
    """A batch's last round trip: ``calls`` with the ``COMMIT`` behind them. ``_RolledBack``
    when nothing was committed (the server refused a statement, or the client a parameter,
    text with a NUL, before sending anything); ``_Unknown`` when the connection failed or was
    ended with the ``COMMIT`` on its way."""
    try:
        return await session.pipeline(*calls, (COMMIT, None))
    except psycopg.Error as exc:
        if (exc.sqlstate is not None and not _connection_ended(exc)) or (
            exc.sqlstate is None and isinstance(exc, psycopg.DataError)
        ):
            raise _RolledBack from exc
        raise _Unknown(exc) from exc


@attrs.frozen
class _Settle:
    """A settle in a batch: what ``_decide`` needs."""

    task_id: str
    expected_revision: int
    event: Event
    event_json: str
    lease: Lease


@attrs.frozen
class _Planned:
    """A settle planned before its batch (``PostgresStore._plan_settle``): the remembered
    record it applies to, the new snapshot as of ``floor`` (its ``lastUpdatedAt`` becomes the
    commit instant), the new record cut where that instant goes, and its NOTIFY payloads."""

    record: str
    new: Snapshot
    effects: Effects
    head: str
    tail: str
    floor: int
    released: str | None
    change: str | None


@attrs.frozen
class _Plan:
    """A transition decided on its locked row: ``answer``, after ``final`` (the statement that
    writes it and ends the transaction) when there is one. ``written``: ``final`` must report
    exactly one written ledger row, or the row changed under its lock."""

    answer: Transition | Conflict | NotFound
    final: tuple[Statement, dict[str, Any]] | None = None
    written: bool = False

    def finish(self, done: Result) -> Transition | Conflict | NotFound:
        """The answer, once ``final`` ran (``done`` is its result)."""
        if self.written:
            row = done.fetchone()
            if row is None or row[0] != 1:
                answer = self.answer
                task_id = answer.snapshot.task.id if isinstance(answer, Transition) else ""
                raise CorruptStore(task_id, "the locked row changed under its lock")
        return self.answer


def _decode_row(values: tuple[Any, ...], known: dict[str, Snapshot] | None = None) -> _Row:
    """Decode and validate a row. ``known``: snapshots this store decoded from record texts
    it wrote (see ``PostgresStore._remember``); a record equal to one of them byte for byte is
    that snapshot (decoding is a function of the text), taken out so it is handed out once."""
    (
        task_id,
        record,
        scope,
        revision,
        status,
        created_at,
        expires_at,
        retry_at,
        owner,
        token,
        generation,
        claim_expires_at,
        queued_message,
        concurrency_key,
        concurrency_limit,
    ) = values

    def corrupt(reason: str) -> NoReturn:
        raise CorruptStore(task_id, reason)

    snapshot = None if known is None else known.pop(record, None)
    if snapshot is None:
        try:
            snapshot = snapshot_from_json(loads(record))
        except (CorruptRecord, CodecError, ValueError, TypeError) as exc:
            corrupt(f"undecodable record: {exc}")
    task = snapshot.task
    if task.id != task_id:
        corrupt("the record's task id differs from its row")
    projections = {
        "revision": (revision, snapshot.revision),
        "status": (status, task.status.value),
        "created_at_us": (created_at, task.created_at),
        "expires_at_us": (expires_at, _bigint(task.expires_at)),
        "retry_at_us": (retry_at, snapshot.available_at),
    }
    for column, (stored, expected) in projections.items():
        if stored != expected:
            corrupt(f"projection {column} disagrees with the record")
    claimed = (owner, token, claim_expires_at)
    if any(v is None for v in claimed) and any(v is not None for v in claimed):
        corrupt("partial claim columns")
    if owner is not None and (not owner or generation <= 0):
        corrupt("a claim without an owner or a generation")
    if not (scope.startswith('{"value":') and scope.endswith(',"version":1}')):
        corrupt("the scope is not a version 1 scope document")
    if queued_message is not None:
        try:
            message = loads(queued_message)
        except ValueError:
            corrupt("queued_message is not JSON")
        if message is not None and not isinstance(message, str):
            corrupt("queued_message is not a status message")
    concurrency = None
    if concurrency_key is not None or concurrency_limit is not None:
        try:
            concurrency = Concurrency(concurrency_key, concurrency_limit)
        except (TypeError, ValueError):
            corrupt("the concurrency columns are not a key and a limit")
    return _Row(
        snapshot,
        scope,
        owner,
        token,
        generation,
        claim_expires_at,
        queued_message,
        concurrency,
    )


_LEDGER_COLUMNS: Final = (
    "task_id, event_id, row_format, event::text, event_kind, event_revision, committed_at_us,"
    " effects::text"
)


def _validate_ledger(row: _Row, rows: list[tuple[Any, ...]]) -> list[LedgerEntry]:
    """The task's whole ledger (rows of ``_LEDGER_COLUMNS``), validated against itself and the
    record."""
    return decode_ledger(row.snapshot, (values[1:] for values in rows))


_SCOPE_HEAD: Final = '{"value":'
_SCOPE_TAIL: Final = ',"version":1}'


def _scope_key(row: _Row) -> str:
    """The scope key of a decoded row (its scope text is checked to be the wrapper)."""
    return row.scope[len(_SCOPE_HEAD) : -len(_SCOPE_TAIL)]


def _same_event(stored: str, event_json: str, event: Event) -> bool:
    """Whether the ledger's event text means ``event`` (``event_json``: its text as this
    version writes it). Equal texts decide at once; otherwise the stored text is decoded and
    compared exactly, since another encoder (an earlier version) may have written it."""
    if stored == event_json:
        return True
    try:
        return canonical_json(loads(stored)) == canonical_json(event.to_json())
    except ValueError:
        return False


def _deferred_ms(retry_at: int, now: int) -> int:
    return -(-(retry_at - now) // 1000)


def _lease_expiry(now: int, lease_ms: int) -> int:
    return min(now + lease_ms * 1000, _MAX_BIGINT)


class PostgresStore:
    """The PostgreSQL store. ``scope`` is required; limits accept ``None`` for unlimited.

    Options: ``schema`` (default ``tritask``; also ``?schema=`` in the URL), ``pool_size``
    connections (default 10, each used by one call at a time), ``max_tasks`` (10,000)
    and ``max_active_tasks_per_scope`` (100), ``reap_batch_size`` (500 per ``reap`` call),
    ``lock_timeout_ms`` (5,000: a row lock not granted in time raises ``DatabaseBusy``),
    ``statement_timeout_ms`` (15,000), ``connect_timeout_s`` and ``application_name`` (shown
    in ``pg_stat_activity``; the listener adds ``-listen``), which default to the DSN's values,
    else 10 s and ``tritask``. ``notify_changes`` (default true) sends every applied
    transition and reaped task as a ``NOTIFY`` on the schema's ``changes`` channel, so listen
    streams on other hosts hear of them (``changes()``); false saves that ``NOTIFY`` when no
    other host serves listeners. ``clock`` is a test hook (see the module docstring):
    production reads time from the database.

    The schema must have been migrated (``tritask migrate --store ...``); entering the store
    checks its version and refuses a mismatch. Connect directly or through a session-pooling
    proxy: the store sets session timeouts and ``wakeups()`` needs ``LISTEN``, which
    transaction pooling (PgBouncer's ``pool_mode=transaction``) does not support.
    """

    def __init__(
        self,
        dsn: str,
        *,
        scope: Scope | None = None,
        schema: str | None = None,
        pool_size: int = 10,
        max_tasks: int | None = 10_000,
        max_active_tasks_per_scope: int | None = 100,
        reap_batch_size: int = 500,
        lock_timeout_ms: int = 5_000,
        statement_timeout_ms: int = 15_000,
        connect_timeout_s: int | None = None,
        application_name: str | None = None,
        clock: Clock | None = None,
        notify_changes: bool = True,
    ) -> None:
        self._scope = require_scope(scope, store="PostgresStore")
        if not isinstance(notify_changes, bool):
            raise TypeError("notify_changes must be a bool")
        if not isinstance(dsn, str):
            raise TypeError("dsn must be a libpq URL or conninfo string")
        self._conninfo, self._schema = resolve_schema(dsn, schema)
        self._display = redact_dsn(dsn)
        self._pool_size = check_positive_int(pool_size, "pool_size")
        self._max_tasks = check_limit(max_tasks, "max_tasks")
        self._max_active = check_limit(max_active_tasks_per_scope, "max_active_tasks_per_scope")
        self._reap_batch = check_positive_int(reap_batch_size, "reap_batch_size")
        self._lock_timeout_ms = check_positive_ms(lock_timeout_ms, "lock_timeout_ms")
        self._statement_timeout_ms = check_positive_ms(statement_timeout_ms, "statement_timeout_ms")
        from_dsn = conninfo_to_dict(self._conninfo)
        if connect_timeout_s is None:
            connect_timeout_s = int(from_dsn.get("connect_timeout") or 10)
        self._connect_timeout_s = check_positive_int(
            connect_timeout_s, "connect_timeout_s", unit=" of seconds"
        )
        if application_name is None:
            application_name = str(from_dsn.get("application_name") or "tritask")
        if not isinstance(application_name, str):
            raise TypeError("application_name must be a string")
        self._application_name = application_name
        if clock is not None and not callable(clock):
            raise TypeError("clock must be a zero-argument callable returning µs")
        self._clock = clock
        self._origin = secrets.token_hex(8)
        self._channel = f"{self._schema}.wakeups"
        self._changes_channel = f"{self._schema}.changes" if notify_changes else None
        self._feed = ChangeFeed()
        self._store_id: str | None = None
        self._pool: ConnectionPool | None = None
        self._batcher: Batcher | None = None
        self._known: dict[str, Snapshot] = {}
        self._claimed: dict[str, tuple[str, Lease, bool]] = {}
        #: Planned settles whose row was no longer the remembered one: they ran alone.
        self.planned_missed = 0
        self._listeners: set[Conn] = set()
        self._closed = False
        self._q = _Queries(self._schema, clock is not None)

    def __repr__(self) -> str:
        return f"<PostgresStore {self._display} schema={self._schema}>"

    @property
    def schema(self) -> str:
        return self._schema

    @property
    def store_id(self) -> str:
        """The schema's persisted UUID (empty until opened): accesses and leases carry it, so
        every store object on this schema, on any host, accepts them."""
        return self._store_id or ""

    # -- lifecycle ----------------------------------------------------------------------------

    def _connect_kwargs(self, suffix: str = "") -> dict[str, Any]:
        return {
            "connect_timeout": self._connect_timeout_s,
            "application_name": self._application_name + suffix,
        }

    def _setup(self, conn: Conn) -> None:
        conn.execute(
            "SELECT set_config('lock_timeout', %s, false),"
            " set_config('statement_timeout', %s, false)",
            (f"{self._lock_timeout_ms}ms", f"{self._statement_timeout_ms}ms"),
        )

    async def open(self) -> Self:
        """Connect and check the schema version (``async with`` calls it)."""
        if self._pool is not None or self._closed:
            raise RuntimeError("a PostgresStore is opened once")
        pool = ConnectionPool(
            self._conninfo,
            size=self._pool_size,
            connect_kwargs=self._connect_kwargs(),
            setup=self._setup,
        )
        try:
            self._store_id = await pool.run_sync(
                lambda conn: check_schema(conn, self._display, self._schema)
            )
        except BaseException:
            await pool.aclose()
            raise
        self._pool = pool
        self._batcher = Batcher(self._run_batch)
        return self

    async def aclose(self) -> None:
        self._closed = True
        self._feed.close()
        for conn in list(self._listeners):
            trio.lowlevel.notify_closing(conn.fileno())
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.aclose()
        else:
            await trio.lowlevel.checkpoint()

    async def __aenter__(self) -> Self:
        return await self.open()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def _opened(self) -> tuple[ConnectionPool, str]:
        if self._closed:
            raise trio.ClosedResourceError("the store is closed")
        if self._pool is None or self._store_id is None:
            raise RuntimeError("open the store first: async with PostgresStore(...) as store")
        return self._pool, self._store_id

    async def _run(self, fn: Callable[[Session], Awaitable[T]]) -> T:
        """One transaction on one pooled connection; lock waits and timeouts become
        ``DatabaseBusy``."""
        pool, _ = self._opened()
        try:
            return await pool.run(fn)
        except _BUSY_ERRORS as exc:
            raise DatabaseBusy(f"PostgreSQL: {type(exc).__name__}") from exc

    def _params(self, **params: Any) -> dict[str, Any]:
        if self._clock is not None:
            now = self._clock()
            if not isinstance(now, int) or isinstance(now, bool):
                raise TypeError("the store clock must return an int of microseconds")
            params["now"] = now
        return params

    def _payload(self, kind: WakeupKind, task_id: str, due_at: int | None = None) -> str:
        return notify_payload(kind, task_id, self._origin, due_at)

    # -- clock and requests -------------------------------------------------------------------

    async def now(self) -> int:
        return await self._run(self._clock_now)

    async def authorize(self, ctx: object, action: Action, task_id: str) -> Access:
        await trio.lowlevel.checkpoint()
        _, store_id = self._opened()
        return new_access(store_id, self._scope, ctx, action, task_id)

    async def create(self, task: Task, work: Work, access: Access) -> Snapshot:
        snapshot, _ = await self._create(task, work, access, None)
        return snapshot

    async def create_claimed(
        self, task: Task, work: Work, access: Access, owner_id: str, lease_ms: int
    ) -> Claimed:
        """``create`` and the first claim in one transaction: no runner on any host can adopt
        the task in between. It sends no ``created`` wake-up: there is nothing to recover."""
        claim = (check_owner(owner_id), check_positive_ms(lease_ms, "lease_ms"))
        snapshot, lease = await self._create(task, work, access, claim)
        assert lease is not None
        return Claimed(snapshot, lease)

    async def create_claimed_stamped(
        self, task: Task, work: Work, access: Access, owner_id: str, lease_ms: int
    ) -> Claimed:
        """``create_claimed`` with ``createdAt``/``lastUpdatedAt`` (and so the TTL) read from
        the database clock by the inserting statement, after the capacity lock when limits are
        set: the given task's two instants are placeholders. Still one statement without
        limits (the record's instants are formatted by that statement)."""
        claim = (check_owner(owner_id), check_positive_ms(lease_ms, "lease_ms"))
        snapshot, lease = await self._create(task, work, access, claim, stamp=True)
        assert lease is not None
        return Claimed(snapshot, lease)

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
        """Create (stamped by the inserting statement) and claim for ``owner_id`` when its key
        allows, else store it queued with a ``created`` wake-up for every runner (see
        :class:`~tritask.tasks.store.Queues`). One statement unless limits or a key are
        checked first (under their advisory locks)."""
        owner, lease_ms, concurrency = check_submit(owner_id, lease_ms, concurrency)
        claim = None if owner is None else (owner, lease_ms)
        snapshot, lease = await self._create(
            task, work, access, claim, stamp=True, queue=True, concurrency=concurrency
        )
        return snapshot if lease is None else Claimed(snapshot, lease)

    async def _create(
        self,
        task: Task,
        work: Work,
        access: Access,
        claim: tuple[str, int] | None,
        *,
        stamp: bool = False,
        queue: bool = False,
        concurrency: Concurrency | None = None,
    ) -> tuple[Snapshot, Lease | None]:
        _, store_id = self._opened()
        check_create_access(access, store_id, task)
        try:
            initial = initial_snapshot(task, work)
            snapshots = {False: initial}
            # Views of the records' JSON (sharing the snapshots'), read once by the encoder.
            documents = {False: snapshot_json_view(initial)}
            if queue and (claim is None or concurrency is not None):  # it may be queued
                queued = revise(initial, task=revise(initial.task, status_message=QUEUED_MESSAGE))
                snapshots[True] = queued
                documents[True] = snapshot_json_view(queued)
        except (CorruptRecord, TypeError, ValueError) as exc:
            raise InvalidTask(str(exc)) from exc
        # With a claim and a key, whether it is claimed is decided under the key lock.
        decide = queue and claim is not None and concurrency is not None

        records: dict[bool, dict[str, str]] = {}

        def record(queued: bool) -> dict[str, str]:
            """The insert's record parameters (made once per form: queued or not)."""
            if queued not in records:
                document = documents[queued]
                if stamp:
                    head, middle, tail = _stamp_pieces(document)
                    records[queued] = {"head": head, "middle": middle, "tail": tail}
                else:
                    records[queued] = {"record": stored_text(document)}
            return records[queued]

        token = None if claim is None else str(uuid.uuid4())
        base = self._params(
            task_id=task.id,
            scope=_scope_text(access.scope),
            status=task.status.value,
            created_at=task.created_at,
            expires_at=_bigint(task.expires_at),
            ttl_us=None if task.ttl_ms is None else task.ttl_ms * 1000,
            channel=self._channel,
            lock_class=CAPACITY_LOCK_CLASS,
            key_lock_class=KEY_LOCK_CLASS,
            schema=self._schema,
            max_tasks=self._max_tasks or 0,
            max_active=self._max_active or 0,
            key=None if concurrency is None else concurrency.key,
            limit=None if concurrency is None else concurrency.limit,
        )

        def params(claimed: bool) -> dict[str, Any]:
            """The insert's parameters: claimed by ``claim``, or not (queued with ``queue``)."""
            owner, lease_ms = claim if claimed and claim is not None else (None, 0)
            queued = queue and not claimed
            return {
                **base,
                **record(queued),
                "owner": owner,
                "token": token if claimed else None,
                "lease_us": min(lease_ms * 1000, _MAX_BIGINT),
                "payload": None if claimed else self._payload(WakeupKind.CREATED, task.id),
                "queued": stored_text(task.status_message) if queued else None,
            }

        limited = self._max_tasks is not None or self._max_active is not None
        inserting = self._q.insert_stamped if stamp else self._q.insert

        async def insert(
            session: Session, claimed: bool, commit: bool
        ) -> tuple[str, int, int | None]:
            """The stored record's text, the creation instant and the claim's expiry (``None``
            without a claim); raises when the id exists."""
            return _inserted(
                await session.execute(inserting, params(claimed), commit=commit), task.id, stamp
            )

        async def run(session: Session) -> tuple[str, int, int | None]:
            if not limited and not decide:
                return await insert(session, claim is not None, False)  # one statement
            async with session.transaction():
                if limited:
                    # One round trip for BEGIN, the capacity lock and the counts, in a
                    # statement of their own that starts after the lock is granted, so its
                    # snapshot includes the previous lock holder's insert.
                    _, counted = await session.pipeline(
                        (self._q.capacity_lock, base), (self._q.capacity_counts, base)
                    )
                    row = counted.fetchone()
                    assert row is not None
                    exists, total, active = row
                    if exists:
                        raise AlreadyExists(task.id)
                    if self._max_tasks is not None and total >= self._max_tasks:
                        raise CapacityExceeded("max_tasks")
                    if self._max_active is not None and active >= self._max_active:
                        raise CapacityExceeded("max_active_tasks_per_scope")
                claimed = claim is not None
                if decide:
                    _, counted = await session.pipeline(
                        (self._q.key_lock, base), (self._q.key_room, base)
                    )
                    room = counted.fetchone()
                    assert room is not None and concurrency is not None
                    running, waiting = room
                    claimed = running < concurrency.limit and not waiting
                return await insert(session, claimed, True)

        if decide:
            stored, created_at, expires_at = await self._run(run)
        else:
            # Batched with the creations and settles running beside it (see ``_batch``); under
            # limits the batch admits its creations under one capacity lock (``_admit``).
            alone = functools.partial(self._run, run)
            inserted: tuple[str, int, int | None] = await self._batched(
                _Insert(inserting, params(claim is not None), stamp, limited), alone
            )
            stored, created_at, expires_at = inserted
        # The record as stored (stamped by the statement when ``stamp``). When its text is
        # exactly the one this call prepared (the statement formats instants as
        # ``format_instant`` does), the stored record is the caller's own snapshot, stamped;
        # anything else is decoded strictly. Either way a copy the caller owns.
        was_queued = queue and expires_at is None
        prepared = record(was_queued) if was_queued in documents else None
        if prepared is None:
            expected = None
        elif stamp:
            instant = f'"{format_instant(created_at)}"'
            expected = f"{prepared['head']}{instant}{prepared['middle']}{instant}{prepared['tail']}"
        else:
            expected = prepared["record"]
        if stored == expected and 0 <= created_at <= MAX_INSTANT:
            snapshot = snapshots[was_queued]
            if stamp:
                stamped = revise(snapshot.task, created_at=created_at, last_updated_at=created_at)
                snapshot = revise(snapshot, task=stamped)
        else:
            try:
                snapshot = snapshot_from_json(loads(stored))
            except (CorruptRecord, CodecError, ValueError, TypeError) as exc:
                raise CorruptStore(task.id, f"undecodable record: {exc}") from exc
        if snapshot.task.created_at != created_at or snapshot.task.id != task.id:
            raise CorruptStore(task.id, "the inserted record disagrees with its row")
        if claim is None or token is None or expires_at is None:
            return snapshot, None  # not claimed (queued, or a plain create)
        lease = Lease(
            store_id=store_id,
            task_id=task.id,
            owner_id=claim[0],
            token=token,
            generation=1,
            expires_at=expires_at,
        )
        self._remember(stored, snapshot, (lease, concurrency is not None))
        return snapshot, lease

    async def get(self, task_id: str, access: Access) -> Snapshot | NotFound:
        self._opened()
        if not isinstance(access, Access):
            raise TypeError("request authority needs an Access from authorize()")

        async def run(session: Session) -> Snapshot | NotFound:
            now, row = await self._read(session, task_id)
            if row is None or not self._visible(row, task_id, access, now, _READ_ACTIONS):
                return NOT_FOUND
            return row.snapshot

        return await self._run(run)

    async def _read(self, session: Session, task_id: str) -> tuple[int, _Row | None]:
        values = (await session.execute(self._q.read, self._params(task_id=task_id))).fetchone()
        assert values is not None
        now = int(values[0])
        return now, None if values[1] is None else _decode_row(values[1:])

    def _visible(
        self, row: _Row, task_id: str, access: Access, now: int, allowed: frozenset[Action]
    ) -> bool:
        """Visibility first (other store/scope or expired: not found), then the action."""
        if not isinstance(access, Access):
            raise TypeError("request authority needs an Access from authorize()")
        if (
            access.store_id != self._store_id
            or _scope_text(access.scope) != row.scope
            or row.expired(now)
        ):
            return False
        if access.task_id != task_id or access.action not in allowed:
            raise UnauthorizedAction(f"a {access.action.value} access cannot do this")
        return True

    # -- workers ------------------------------------------------------------------------------

    def _matches(self, row: _Row, lease: Lease) -> bool:
        """Exact lease identity (liveness is checked separately)."""
        return (
            lease.store_id == self._store_id
            and lease.task_id == row.task_id
            and lease.epoch == 0
            and row.claim_owner is not None
            and lease.owner_id == row.claim_owner
            and lease.token == row.claim_token
            and lease.generation == row.generation
            and lease.expires_at == row.claim_expires_at
        )

    def _check_lease(self, row: _Row, lease: object, now: int) -> None:
        if not isinstance(lease, Lease) or not self._matches(row, lease) or now >= lease.expires_at:
            raise StaleLease("the lease is not the live claim of this task")

    async def worker_snapshot(self, task_id: str, lease: Lease) -> Snapshot | NotFound:
        self._opened()

        async def run(session: Session) -> Snapshot | NotFound:
            now, row = await self._read(session, task_id)
            if row is None:
                return NOT_FOUND
            self._check_lease(row, lease, now)
            return row.snapshot

        return await self._run(run)

    @staticmethod
    def _eligibility(row: _Row, now: int) -> Deferred | Unavailable | None:
        """Reference 3.6 order on the database clock; ``None`` means claimable now."""
        snapshot = row.snapshot
        if snapshot.task.status.is_terminal or snapshot.work is None:
            return UNAVAILABLE
        available_at = snapshot.available_at
        if available_at is not None and available_at > now:
            return Deferred(_deferred_ms(available_at, now))
        if row.claim_expires_at is not None and now < row.claim_expires_at:
            return UNAVAILABLE
        return None

    async def _grant(
        self, session: Session, row: _Row, owner_id: str, lease_ms: int, now: int
    ) -> Claimed:
        lease = Lease(
            store_id=self._store_id or "",
            task_id=row.task_id,
            owner_id=owner_id,
            token=str(uuid.uuid4()),
            generation=row.generation + 1,
            expires_at=_lease_expiry(now, lease_ms),
        )
        if row.queued_message is None:
            await self._store_claim(session, lease)
            return Claimed(row.snapshot, lease)
        # The first claim of a queued task: it gets its own status message back (no new
        # revision: nothing happened to the task, it only started).
        snapshot = row.snapshot
        task = snapshot.task
        if task.status is TaskStatus.WORKING and task.status_message == QUEUED_MESSAGE:
            message = loads(row.queued_message)
            snapshot = revise(snapshot, task=revise(task, status_message=message))
        await session.execute(
            self._q.set_claim_started,
            {
                "task_id": lease.task_id,
                "owner": lease.owner_id,
                "token": lease.token,
                "generation": lease.generation,
                "expires_at": lease.expires_at,
                "record": record_text(snapshot),
            },
            commit=True,
        )
        return Claimed(snapshot, lease)

    async def _store_claim(self, session: Session, lease: Lease) -> None:
        """Write the claim and commit (the last statement of its transaction)."""
        await session.execute(
            self._q.set_claim,
            {
                "task_id": lease.task_id,
                "owner": lease.owner_id,
                "token": lease.token,
                "generation": lease.generation,
                "expires_at": lease.expires_at,
            },
            commit=True,
        )

    async def _key_full(self, session: Session, row: _Row, locked: list[bool]) -> bool:
        """Whether the row's concurrency key has its limit of live claims, counted under the
        key lock (taken once per transaction: ``locked``)."""
        concurrency = row.concurrency
        if concurrency is None:
            return False
        params = self._params(key=concurrency.key, key_lock_class=KEY_LOCK_CLASS)
        params["schema"] = self._schema
        if locked[0]:
            counted = await session.execute(self._q.key_running, params)
        else:
            _, counted = await session.pipeline(
                (self._q.key_lock, params), (self._q.key_running, params)
            )
            locked[0] = True
        found = counted.fetchone()
        assert found is not None
        return int(found[0]) >= concurrency.limit

    async def _clock_now(self, session: Session) -> int:
        """The database clock, read in its own statement (so: after any lock we hold)."""
        row = (await session.execute(self._q.now, self._params())).fetchone()
        assert row is not None
        return int(row[0])

    async def claim(
        self, task_id: str, owner_id: str, lease_ms: int
    ) -> Claimed | Deferred | Unavailable | NotFound:
        self._opened()
        owner_id, lease_ms = check_owner(owner_id), check_positive_ms(lease_ms, "lease_ms")

        async def run(session: Session) -> Claimed | Deferred | Unavailable | NotFound:
            async with session.transaction():
                locked, clock = await session.pipeline(
                    (self._q.lock, {"task_id": task_id}), (self._q.now, self._params())
                )
                values = locked.fetchone()
                if values is None:
                    return NOT_FOUND
                row = _decode_row(values)
                now = int(clock.rows[0][0])  # its own statement: read after the lock
                verdict = self._eligibility(row, now)
                if verdict is not None:
                    return verdict
                if await self._key_full(session, row, [False]):
                    return UNAVAILABLE
                return await self._grant(session, row, owner_id, lease_ms, now)

        return await self._run(run)

    async def claim_next(self, owner_id: str, lease_ms: int) -> Claimed | None:
        """The next claimable task: the fewest live claims of its concurrency key first (no
        key: none), then the oldest by ``(created_at, task_id)``; full keys are passed over.
        ``FOR UPDATE SKIP LOCKED`` gives concurrent claimers distinct tasks, and a task with a
        key is granted only after its key's claims were counted under the key lock."""
        self._opened()
        owner_id, lease_ms = check_owner(owner_id), check_positive_ms(lease_ms, "lease_ms")

        async def run(session: Session) -> Claimed | None:
            skipped: list[str] = []
            locked = [False]
            async with session.transaction():
                # The live claims of every key, read from the keys' claims index with
                # sequential scans off for this one statement: planned as a scan of the whole
                # table on a new one, that plan was kept, and each claim read every task
                # (10,001 scans reading 99.8 million rows for 10,000 queued tasks).
                _, claims, _ = await session.pipeline(
                    *self._q.without_seqscan((self._q.key_claims, self._params()))
                )
                running = dict(claims.rows)
                busy = sorted(running)
                while True:  # level 0
                    found = await session.execute(
                        self._q.claim_next_free, self._params(skip=skipped, busy=busy)
                    )
                    values = found.fetchone()
                    if values is None:
                        break
                    # SKIP LOCKED never waits, so the statement's clock is the lock's time.
                    now = int(values[0])
                    row = _decode_row(values[1:])
                    if self._eligibility(row, now) is None and not await self._key_full(
                        session, row, locked
                    ):
                        return await self._grant(session, row, owner_id, lease_ms, now)
                    skipped.append(row.task_id)  # the record or the key says no
                best: tuple[int, int, str] | None = None
                chosen: tuple[_Row, int] | None = None
                for key, count in running.items():
                    row_now = await self._key_head(session, key, skipped)
                    if row_now is None:
                        continue
                    head, now = row_now
                    assert head.concurrency is not None
                    if count >= head.concurrency.limit or await self._key_full(
                        session, head, locked
                    ):
                        continue
                    rank = (int(count), head.snapshot.task.created_at, head.task_id)
                    if best is None or rank < best:
                        best, chosen = rank, (head, now)
                if chosen is None:
                    return None
                return await self._grant(session, chosen[0], owner_id, lease_ms, chosen[1])

        return await self._run(run)

    async def _key_head(
        self, session: Session, key: str, skipped: list[str]
    ) -> tuple[_Row, int] | None:
        """The oldest claimable task of ``key`` (locked) and the clock, if any."""
        while True:
            found = await session.execute(
                self._q.claim_next_key, self._params(key=key, skip=skipped)
            )
            values = found.fetchone()
            if values is None:
                return None
            now = int(values[0])
            row = _decode_row(values[1:])
            if self._eligibility(row, now) is None:
                return row, now
            skipped.append(row.task_id)

    async def _lease_row(
        self, session: Session, lease: Lease, *, clock: bool = False
    ) -> tuple[_Row, int]:
        """The leased task's row, locked, and with ``clock`` the database clock read after the
        lock (in the same round trip; else 0)."""
        if not isinstance(lease, Lease) or lease.store_id != self._store_id:
            raise StaleLease("the lease is not from this store")
        calls = [(self._q.lock, {"task_id": lease.task_id})]
        if clock:
            calls.append((self._q.now, self._params()))
        results = await session.pipeline(*calls)
        values = results[0].fetchone()
        if values is None:
            raise StaleLease("the leased task no longer exists")
        return _decode_row(values), int(results[1].rows[0][0]) if clock else 0

    async def renew(self, lease: Lease, lease_ms: int) -> Lease:
        self._opened()
        lease_ms = check_positive_ms(lease_ms, "lease_ms")

        async def run(session: Session) -> Lease:
            async with session.transaction():
                row, now = await self._lease_row(session, lease, clock=True)
                self._check_lease(row, lease, now)
                # A fresh token too: the old value goes stale even if the expiry repeats.
                renewed = attrs.evolve(
                    lease, token=str(uuid.uuid4()), expires_at=_lease_expiry(now, lease_ms)
                )
                await self._store_claim(session, renewed)
                return renewed

        return await self._run(run)

    async def renew_all(
        self, owner_id: str, leases: list[Lease] | tuple[Lease, ...], lease_ms: int
    ) -> list[Renewed | LeaseLost]:
        """Renew every lease of ``owner_id`` that is its task's live claim, in one statement
        (``UPDATE ... FROM unnest(...)``, one transaction), whatever the batch's size: it
        locks the batch's rows first and reads the clock after the locks, as ``renew`` does."""
        self._opened()
        owner_id, batch, lease_ms = check_renewals(owner_id, leases, lease_ms)
        # Only a lease of this store and owner can match; each task once (the first lease for
        # it), as a second renew of one task in a row would be stale.
        wanted: dict[str, int] = {}
        for index, lease in enumerate(batch):
            if (
                lease.store_id == self._store_id
                and lease.owner_id == owner_id
                and lease.epoch == 0
                and lease.task_id not in wanted
            ):
                wanted[lease.task_id] = index
        results: list[Renewed | LeaseLost] = [LEASE_LOST] * len(batch)
        if not wanted:
            await trio.lowlevel.checkpoint()
            return results
        chosen = [batch[index] for index in wanted.values()]
        params = self._params(
            ids=[lease.task_id for lease in chosen],
            tokens=[lease.token for lease in chosen],
            generations=[str(lease.generation) for lease in chosen],
            expiries=[str(lease.expires_at) for lease in chosen],
            owner=owner_id,
            lease_us=lease_ms * 1000,
        )

        async def run(session: Session) -> list[tuple[Any, ...]]:
            # Sequential scans off for the statement (its UPDATE found the rows by their owner
            # with a scan of the table, planned so on a new one and kept), in one round trip.
            async with session.transaction():
                _, renewed, _, _ = await session.pipeline(
                    *self._q.without_seqscan((self._q.renew_all, params)), (COMMIT, None)
                )
            return renewed.fetchall()

        for task_id, revision, token, expires_at in await self._run(run):
            index = wanted[task_id]
            old = batch[index]
            lease = Lease(
                store_id=old.store_id,
                task_id=old.task_id,
                owner_id=old.owner_id,
                token=token,
                generation=old.generation,
                expires_at=expires_at,
                epoch=old.epoch,
            )
            results[index] = Renewed(lease, revision)
        return results

    async def release(self, lease: Lease) -> None:
        self._opened()

        async def run(session: Session) -> None:
            async with session.transaction():
                row, _ = await self._lease_row(session, lease)
                if not self._matches(row, lease):
                    raise StaleLease("the lease does not match the task's claim")
                await self._clear_claim(session, row)

        await self._run(run)

    async def _clear_claim(self, session: Session, row: _Row) -> None:
        """Release the locked task's claim, waking other runners if work is left, and commit
        (the last statement of its transaction)."""
        stmt, params = self._clear_claim_call(row)
        await session.execute(stmt, params, commit=True)

    def _clear_claim_call(self, row: _Row) -> tuple[Statement, dict[str, Any]]:
        return (
            self._q.clear_claim,
            {
                "task_id": row.task_id,
                "channel": self._channel,
                "payload": self._released_payload(row.snapshot, row.concurrency is not None),
            },
        )

    def _released_payload(self, snapshot: Snapshot, keyed: bool) -> str | None:
        """The NOTIFY payload of a released claim: an active task with work is claimable
        again (from ``available_at``); a task with a concurrency key freed a slot of its key, so
        its queued fellows may be claimable now. Others have none."""
        if snapshot.task.status.is_terminal or snapshot.work is None:
            return self._payload(WakeupKind.RELEASED, snapshot.task.id) if keyed else None
        return self._payload(WakeupKind.RELEASED, snapshot.task.id, snapshot.available_at)

    # -- transitions --------------------------------------------------------------------------

    async def transition(
        self, task_id: str, expected_revision: int, event: Event, authority: Authority
    ) -> Transition | Conflict | NotFound:
        self._opened()
        check_transition_arguments(expected_revision, event)
        event_json = stored_text(event.json_view())
        return self._announced(
            await self._run(
                functools.partial(
                    self._transition,
                    task_id,
                    expected_revision,
                    event,
                    event_json,
                    authority,
                    False,
                )
            )
        )

    def _announced(
        self, result: Transition | Conflict | NotFound
    ) -> Transition | Conflict | NotFound:
        """Hand an applied commit to this process's ``changes()`` readers (other hosts hear of
        it through the ``NOTIFY`` its transaction sent)."""
        if isinstance(result, Transition) and result.outcome == "applied":
            self._feed.announce_snapshot(result.snapshot)
        return result

    async def settle(
        self, task_id: str, expected_revision: int, event: Event, lease: Lease
    ) -> Transition | Conflict | NotFound:
        """A worker's final event and the release of its claim in one transaction.

        Wake-ups are those of the two separate steps: the event's own (``retry_scheduled``)
        and, when the task still has work to do, the release's (``released``).
        """
        self._opened()
        check_transition_arguments(expected_revision, event, "settle")
        if event.kind not in SETTLE_KINDS:
            raise UnauthorizedAction(f"settle cannot apply {event.kind.value}")
        event_json = stored_text(event.json_view())
        alone = functools.partial(
            self._run,
            functools.partial(
                self._transition,
                task_id,
                expected_revision,
                event,
                event_json,
                WorkerAuthority(lease),
                True,
            ),
        )
        settle = _Settle(task_id, expected_revision, event, event_json, lease)
        answer: Transition | Conflict | NotFound = await self._batched(settle, alone)
        return self._announced(answer)

    async def _transition(
        self,
        task_id: str,
        expected_revision: int,
        event: Event,
        event_json: str,
        authority: Authority,
        release: bool,
        session: Session,
    ) -> Transition | Conflict | NotFound:
        """One transition in one transaction; with ``release`` (a settle) a ``Transition``
        also clears the worker's claim, in the same write when the event applies."""
        async with session.transaction():
            # One round trip for BEGIN, the lock and, in a statement of its own that starts
            # after the lock is granted, the clock and the ledger as of now.
            locked, read = await session.pipeline(*self._transition_reads(task_id, event.id))
            plan = self._decide(
                task_id, expected_revision, event, event_json, authority, release, locked, read
            )
            if plan.final is None:
                return plan.answer
            stmt, params = plan.final
            return plan.finish(await session.execute(stmt, params, commit=True))

    def _transition_reads(
        self, task_id: str, event_id: str
    ) -> tuple[tuple[Statement, dict[str, Any]], tuple[Statement, dict[str, Any]]]:
        """A transition's first statements: the row lock, then the clock and the ledger."""
        return (
            (self._q.lock, {"task_id": task_id}),
            (self._q.now_and_seen, self._params(task_id=task_id, event_id=event_id)),
        )

    def _decide(
        self,
        task_id: str,
        expected_revision: int,
        event: Event,
        event_json: str,
        authority: Authority,
        release: bool,
        locked: Result,
        read: Result,
    ) -> _Plan:
        """What a transition does, decided on its locked row and its reads: the answer, and
        the one statement (if any) that writes it and ends the transaction. Raises what the
        transition raises; nothing was written then."""
        values = locked.fetchone()
        if values is None:
            return _Plan(NOT_FOUND)
        row = _decode_row(values, self._known)
        seen = read.fetchone()
        assert seen is not None
        now = int(seen[0])
        if isinstance(authority, RequestAuthority):
            allowed = frozenset(a for a, kinds in REQUEST_KINDS.items() if event.kind in kinds)
            if not self._visible(row, task_id, authority.access, now, allowed):
                return _Plan(NOT_FOUND)
        elif isinstance(authority, WorkerAuthority):
            try:
                self._check_lease(row, authority.lease, now)
            except StaleLease:
                # The resend of a settle that committed and released (no later claim).
                if release and self._released_by(row, authority.lease, seen, event):
                    return _Plan(self._replayed(row.snapshot, seen))
                raise
            if event.kind not in WORKER_KINDS:
                raise UnauthorizedAction(f"a worker lease cannot apply {event.kind.value}")
        else:
            raise TypeError("authority must be RequestAuthority or WorkerAuthority")

        snapshot = row.snapshot
        if seen[1] is not None:
            if not _same_event(seen[1], event_json, event):
                raise EventIdReused(event.id)
            replayed = self._replayed(snapshot, seen)
            if release:
                return _Plan(replayed, self._clear_claim_call(row))
            return _Plan(replayed)
        if snapshot.revision != expected_revision:
            return _Plan(Conflict(snapshot))

        committed_at = max(now, snapshot.task.last_updated_at + _COMMIT_STEP_US)
        outcome = apply(snapshot, event, committed_at)
        if outcome.kind == "unchanged":
            unchanged = Transition(
                outcome="unchanged",
                snapshot=snapshot,
                effects=outcome.effects,
                event_revision=snapshot.revision,
                committed_at=committed_at,
            )
            if release:
                return _Plan(unchanged, self._clear_claim_call(row))
            return _Plan(unchanged)
        new = outcome.snapshot
        fields = {
            "task_id": task_id,
            "expected": snapshot.revision,
            "record": record_text(new),
            "revision": new.revision,
            "status": new.task.status.value,
            "retry_at": new.available_at,
            "event_id": event.id,
            "event_kind": event.kind.value,
            "event": event_json,
            "committed_at": committed_at,
            "effects": stored_text(effects_to_json(outcome.effects)),
            "channel": self._channel,
            # At most two wake-ups, as two scalars.
            "payload": self._wakeup_for(event.kind, new),
            "released": (
                self._released_payload(new, row.concurrency is not None) if release else None
            ),
            # And the change, for listen streams on other hosts.
            "changes": self._changes_channel,
            "change": None
            if self._changes_channel is None
            else change_payload(task_id, new.revision, new.task.status, self._origin),
        }
        query = self._q.write_releasing if release else self._q.write
        applied = Transition(
            outcome="applied",
            snapshot=new,
            effects=outcome.effects,
            event_revision=new.revision,
            committed_at=committed_at,
        )
        return _Plan(applied, (query, fields), written=True)

    def _remember(self, record: str, snapshot: Snapshot, claim: tuple[Lease, bool]) -> None:
        """Keep the store's own copy of a claimed task's decoded record, keyed by the exact text
        stored, so the settle that follows need not decode it again, and the claim it was
        inserted with (its lease, whether it has a concurrency key), so that settle can be
        planned (``_plan_settle``); both bounded, oldest out."""
        known = self._known
        if len(known) >= _KNOWN_LIMIT:
            del known[next(iter(known))]
        known[record] = clone_snapshot(snapshot)
        claimed = self._claimed
        if len(claimed) >= _KNOWN_LIMIT:
            del claimed[next(iter(claimed))]
        claimed[snapshot.task.id] = (record, *claim)

    def _plan_settle(self, settle: _Settle) -> _Planned | None:
        """A settle decided before its batch is sent, on the row this store inserted and
        remembers, as ``_decide`` would decide it there: only a completion or a failure (the
        only settles whose outcome depends on the commit time through ``lastUpdatedAt``
        alone) with the lease the row was inserted with, at the remembered revision. The
        statement (``settle_planned``) applies it only if the row is still exactly that one.
        ``None``: decided in the transaction (``_decide``)."""
        entry = self._claimed.get(settle.task_id)
        if entry is None or settle.event.kind not in _PLANNED_KINDS:
            return None
        record, lease, keyed = entry
        snapshot = self._known.get(record)
        if (
            snapshot is None
            or lease != settle.lease
            or snapshot.revision != settle.expected_revision
            or snapshot.task.id != settle.task_id
        ):
            return None
        floor = snapshot.task.last_updated_at + _COMMIT_STEP_US
        try:
            applied = apply(snapshot, settle.event, floor)
        except Exception:  # what it raises is raised by the transaction's own decision
            return None
        if applied.kind != "applied":
            return None
        new = applied.snapshot
        if new.task.last_updated_at != floor or new.available_at is not None:
            return None
        document = snapshot_json_view(new)
        task = document["task"]
        assert isinstance(task, dict)
        mark = secrets.token_hex(16)
        pieces = stored_text({**document, "task": {**task, "lastUpdatedAt": mark}}).split(
            f'"{mark}"'
        )
        if len(pieces) != 2:
            return None
        return _Planned(
            record=record,
            new=new,
            effects=applied.effects,
            head=pieces[0],
            tail=pieces[1],
            floor=floor,
            released=self._released_payload(new, keyed),
            change=None
            if self._changes_channel is None
            else change_payload(settle.task_id, new.revision, new.task.status, self._origin),
        )

    def _planned_call(
        self, planned: Sequence[tuple[Item, _Planned]]
    ) -> tuple[Statement, Mapping[str, object]]:
        """The planned settles of a batch as one statement (``settle_planned``)."""
        n_ids: list[str] = []
        n_channels: list[str | None] = []
        n_payloads: list[str] = []
        for item, plan in planned:
            for channel, payload in (
                (self._channel, plan.released),
                (self._changes_channel, plan.change),
            ):
                if payload is not None:
                    n_ids.append(item.payload.task_id)
                    n_channels.append(channel)
                    n_payloads.append(payload)
        settles = [item.payload for item, _ in planned]
        plans = [plan for _, plan in planned]
        return (
            self._q.settle_planned,
            self._params(
                ids=[settle.task_id for settle in settles],
                expected=[settle.expected_revision for settle in settles],
                olds=[plan.record for plan in plans],
                heads=[plan.head for plan in plans],
                tails=[plan.tail for plan in plans],
                revisions=[plan.new.revision for plan in plans],
                statuses=[plan.new.task.status.value for plan in plans],
                event_ids=[settle.event.id for settle in settles],
                kinds=[settle.event.kind.value for settle in settles],
                events=[settle.event_json for settle in settles],
                floors=[plan.floor for plan in plans],
                effects=[stored_text(effects_to_json(plan.effects)) for plan in plans],
                owners=[settle.lease.owner_id for settle in settles],
                tokens=[settle.lease.token for settle in settles],
                generations=[settle.lease.generation for settle in settles],
                expiries=[settle.lease.expires_at for settle in settles],
                n_ids=n_ids,
                n_channels=n_channels,
                n_payloads=n_payloads,
            ),
        )

    # -- group commit -------------------------------------------------------------------------

    async def _batched(self, payload: _Insert | _Settle, alone: Callable[[], Awaitable[T]]) -> T:
        """``payload`` in a batch with the creations and settles submitted beside it (see
        :mod:`._batch`); ``alone()`` is the same operation on its own, its fallback."""
        self._opened()
        assert self._batcher is not None
        result: T = await self._batcher.submit(Item(payload, alone))
        return result

    async def _run_batch(self, items: Sequence[Item]) -> None:
        """One transaction on one connection for a batch, with one statement per kind of
        work, whatever the batch's size: one round trip when its settles are planned and its
        creations under limits can be admitted by their statement (``_run_one_trip``), else
        two pipelined round trips.

        The first round trip sends ``BEGIN``, one statement locking every settle's row (in
        task-id order, so two batches never wait for each other's locks in opposite orders)
        and one reading the clock and their ledger rows, the insertions without limits (the
        stamped ones as one multi-row statement) and, when creations under limits are in the
        batch, the capacity lock and the counts those creations need (``_admit``: one lock
        and one count for all of them instead of one transaction each); then each settle is
        decided on its own row (one that raises wrote nothing) and each limited creation
        admitted or refused; the second sends the admitted insertions, the applied settles'
        writes (one statement) and the ``COMMIT``. Each operation's outcome is its own row of
        those statements (a creation whose id exists gets no row: ``AlreadyExists``), and
        every item gets it only after the ``COMMIT`` returned. A second settle of a task
        already in the batch is left out and runs alone after it, as if it came next. A
        statement error aborts the whole transaction (nothing is committed): the items then
        run alone (``Item.fall_back``), so the error reaches the operation it belongs to. A
        connection lost once the ``COMMIT`` was sent leaves its outcome unknown: every item
        sent gets that error (a settle left out still runs alone).
        """
        pool, _ = self._opened()
        settles: list[Item] = []
        inserts: list[Item] = []
        settled: set[str] = set()
        for item in items:
            payload = item.payload
            if isinstance(payload, _Settle):
                if payload.task_id not in settled:
                    settled.add(payload.task_id)
                    settles.append(item)
            else:
                inserts.append(item)
        settles.sort(key=lambda item: item.payload.task_id)
        free = [item for item in inserts if not item.payload.limited]
        limited = [item for item in inserts if item.payload.limited]
        if len(settles) == len(items) - len(inserts) and (
            all(item.payload.stamp for item in limited)
            and len({item.payload.task_id for item in limited}) == len(limited)
        ):
            planned: list[tuple[Item, _Planned]] = []
            for item in settles:
                ahead = self._plan_settle(item.payload)
                if ahead is None:
                    break
                planned.append((item, ahead))
            else:
                await self._run_one_trip(planned, free, limited)
                return
        reads: list[tuple[Statement, Mapping[str, object] | None]] = []
        if settles:
            ids = [item.payload.task_id for item in settles]
            reads.append((self._q.lock_many, {"ids": ids}))
            event_ids = [item.payload.event.id for item in settles]
            reads.append((self._q.now_and_seen_many, self._params(ids=ids, event_ids=event_ids)))
        free_calls = self._insert_calls(free)
        reads.extend(call for call, _ in free_calls)
        if limited:
            counts = {
                "lock_class": CAPACITY_LOCK_CLASS,
                "schema": self._schema,
                "max_tasks": self._max_tasks or 0,
                "max_active": self._max_active or 0,
                "ids": [item.payload.task_id for item in limited],
                "scopes": sorted({item.payload.scope for item in limited}),
            }
            reads.extend(((self._q.capacity_lock, counts), (self._q.batch_counts, counts)))
        decided: list[tuple[Item, outcome.Outcome[Any]]] = []
        writes: list[tuple[Item, _Plan]] = []
        others: list[tuple[Item, _Plan]] = []
        try:
            async with pool.session() as session, session.transaction():
                try:
                    results = await session.pipeline(*reads)
                except _BATCH_ERRORS as exc:
                    raise _RolledBack from exc
                if settles:
                    self._decide_settles(settles, results[0], results[1], decided, writes, others)
                first = 2 if settles else 0
                for index, (_, parse) in enumerate(free_calls):
                    decided.extend(parse(results[first + index]))
                admitted: list[Item] = []
                if limited:
                    admitted, refused = self._admit(limited, results[-1])
                    decided.extend(refused)
                admitted_calls = self._insert_calls(admitted)
                calls = [call for call, _ in admitted_calls]
                if writes:
                    calls.append(self._write_many_call(writes))
                calls.extend(plan.final for _, plan in others if plan.final is not None)
                done = await _commit_pipelined(session, calls)
        except _RolledBack:
            return  # nothing was committed: every item runs alone
        except _Unknown as unknown:
            # The COMMIT's outcome is unknown, as it would be alone. A settle left out of the
            # batch was never sent: it stays undecided and runs alone.
            for item in (*settles, *inserts):
                item.decide(outcome.Error(copy.copy(unknown.error)))
            return
        for index, (_, parse) in enumerate(admitted_calls):
            for item, found in parse(done[index]):
                item.decide(found)
        at = len(admitted_calls)
        if writes:
            written = {row[0] for row in done[at].rows}
            at += 1
            for item, plan in writes:
                ok = Result(rows=[(1 if item.payload.task_id in written else 0,)], rowcount=1)
                item.decide(outcome.capture(plan.finish, ok))
        for (item, plan), result in zip(others, done[at:], strict=False):
            item.decide(outcome.capture(plan.finish, result))
        for item, found in decided:
            item.decide(found)

    async def _run_one_trip(
        self,
        planned: Sequence[tuple[Item, _Planned]],
        free: Sequence[Item],
        limited: Sequence[Item],
    ) -> None:
        """A batch in one round trip: ``BEGIN``, the creations without limits, those under
        limits after the capacity lock (admitted all together or not at all:
        ``insert_many_guarded``), the planned settles (``settle_planned``) and the ``COMMIT``.
        A creation the guard did not admit and a settle whose row was not the remembered one
        wrote nothing: they run alone after the commit, as if they came next. Errors as in
        ``_run_batch``."""
        pool, _ = self._opened()
        calls: list[tuple[Statement, Mapping[str, object] | None]] = []
        free_calls = self._insert_calls(free)
        calls.extend(call for call, _ in free_calls)
        if limited:
            lock = {"lock_class": CAPACITY_LOCK_CLASS, "schema": self._schema}
            calls.append((self._q.capacity_lock, lock))
            calls.append(self._insert_calls(limited, admit=True)[0][0])
        if planned:
            calls.append(self._planned_call(planned))
        for _, plan in planned:  # handed out once, as ``_decode_row`` does
            self._known.pop(plan.record, None)
            self._claimed.pop(plan.new.task.id, None)
        try:
            async with pool.session() as session, session.transaction():
                done = await _commit_pipelined(session, calls)
        except _RolledBack:
            return  # nothing was committed: every item runs alone
        except _Unknown as unknown:
            for item in (*(item for item, _ in planned), *free, *limited):
                item.decide(outcome.Error(copy.copy(unknown.error)))
            return
        for index, (_, parse) in enumerate(free_calls):
            for item, found in parse(done[index]):
                item.decide(found)
        at = len(free_calls)
        if limited:
            for item, found in _admitted(limited, done[at + 1]):
                item.decide(found)
            at += 2
        if planned:
            written = {row[0]: int(row[1]) for row in done[at].rows}
            for item, plan in planned:
                committed_at = written.get(item.payload.task_id)
                if committed_at is None:
                    self.planned_missed += 1
                    item.fall_back()
                    continue
                new = plan.new
                new = revise(new, task=revise(new.task, last_updated_at=committed_at))
                transition = Transition(
                    outcome="applied",
                    snapshot=new,
                    effects=plan.effects,
                    event_revision=new.revision,
                    committed_at=committed_at,
                )
                item.decide(outcome.Value(transition))

    def _decide_settles(
        self,
        settles: Sequence[Item],
        locked: Result,
        read: Result,
        decided: list[tuple[Item, outcome.Outcome[Any]]],
        writes: list[tuple[Item, _Plan]],
        others: list[tuple[Item, _Plan]],
    ) -> None:
        """Each settle of a batch decided on its own locked row and ledger read (``locked``,
        ``read``: the batch's two statements): an answer without a write, an applied event
        (``writes``: written together) or another final statement (``others``)."""
        rows = {values[0]: values for values in locked.rows}
        seen = {values[1]: (values[0], *values[2:]) for values in read.rows}
        for item in settles:
            settle = item.payload
            values = rows.get(settle.task_id)
            try:
                plan = self._decide(
                    settle.task_id,
                    settle.expected_revision,
                    settle.event,
                    settle.event_json,
                    WorkerAuthority(settle.lease),
                    True,
                    Result(rows=[] if values is None else [values], rowcount=-1),
                    Result(rows=[seen[settle.task_id]], rowcount=1),
                )
            except Exception as exc:  # it wrote nothing: it fails alone
                decided.append((item, outcome.Error(exc)))
                continue
            if plan.final is None:
                decided.append((item, outcome.Value(plan.answer)))
            elif plan.written:
                writes.append((item, plan))
            else:
                others.append((item, plan))

    def _write_many_call(
        self, writes: Sequence[tuple[Item, _Plan]]
    ) -> tuple[Statement, Mapping[str, object]]:
        """The applied settles' writes as one statement (``write_many``)."""
        fields = [plan.final[1] for _, plan in writes if plan.final is not None]
        n_ids: list[str] = []
        n_channels: list[str | None] = []
        n_payloads: list[str] = []
        for field in fields:
            for channel, payload in (
                (field["channel"], field["payload"]),
                (field["channel"], field["released"]),
                (field["changes"], field["change"]),
            ):
                if payload is not None:
                    n_ids.append(field["task_id"])
                    n_channels.append(channel)
                    n_payloads.append(payload)

        def column(name: str) -> list[Any]:
            return [field[name] for field in fields]

        return (
            self._q.write_many,
            {
                "ids": column("task_id"),
                "expected": column("expected"),
                "records": column("record"),
                "revisions": column("revision"),
                "statuses": column("status"),
                "retry_ats": column("retry_at"),
                "event_ids": column("event_id"),
                "kinds": column("event_kind"),
                "events": column("event"),
                "committed": column("committed_at"),
                "effects": column("effects"),
                "n_ids": n_ids,
                "n_channels": n_channels,
                "n_payloads": n_payloads,
            },
        )

    def _insert_calls(
        self, items: Sequence[Item], *, admit: bool = False
    ) -> list[
        tuple[
            tuple[Statement, Mapping[str, object]],
            Callable[[Result], list[tuple[Item, outcome.Outcome[Any]]]],
        ]
    ]:
        """A batch's insertions as statements, each with what reads its items' outcomes from
        its result: the stamped ones as one statement (``insert_many``), others one each;
        each kind in task-id order (see ``insert_many``)."""
        calls: list[
            tuple[
                tuple[Statement, Mapping[str, object]],
                Callable[[Result], list[tuple[Item, outcome.Outcome[Any]]]],
            ]
        ] = []
        stamped = [item for item in items if item.payload.stamp]
        if stamped:
            ids: set[str] = set()
            rows = []
            for item in stamped:  # an id twice: one row (``_many`` answers the second)
                if item.payload.task_id not in ids:
                    ids.add(item.payload.task_id)
                    rows.append(item.payload.params)

            def column(name: str) -> list[Any]:
                return [row[name] for row in rows]

            params = self._params(
                ids=column("task_id"),
                heads=column("head"),
                middles=column("middle"),
                tails=column("tail"),
                scopes=column("scope"),
                statuses=column("status"),
                ttls=column("ttl_us"),
                owners=column("owner"),
                tokens=column("token"),
                leases=column("lease_us"),
                queued=column("queued"),
                keys=column("key"),
                limits=column("limit"),
                payloads=column("payload"),
                channel=self._channel,
            )
            parse = functools.partial(_many, stamped)
            stmt = self._q.insert_many
            if admit:
                stmt = self._q.insert_many_admitted
                params["max_tasks"] = self._max_tasks
                params["max_active"] = self._max_active
                parse = functools.partial(_admitted, stamped)
            calls.append(((stmt, params), parse))
        for item in sorted(items, key=lambda item: item.payload.task_id):
            if not item.payload.stamp:
                insert = item.payload
                calls.append(((insert.stmt, insert.params), functools.partial(_one, item)))
        return calls

    def _admit(
        self, inserts: Sequence[Item], counted: Result
    ) -> tuple[list[Item], list[tuple[Item, outcome.Outcome[Any]]]]:
        """The batch's creations under limits, admitted in order as one transaction each
        would be (``counted``: the counts read under the capacity lock): an existing id is
        refused first, then ``max_tasks``, then ``max_active_tasks_per_scope``; every
        admitted creation counts against the ones after it."""
        row = counted.fetchone()
        assert row is not None
        total, existing, scopes = row
        try:
            exists = {str(task_id) for task_id in loads(existing)}
            active = {str(scope): int(count) for scope, count in loads(scopes)}
        except (ValueError, TypeError) as exc:
            raise CorruptStore("", f"undecodable capacity counts: {exc}") from exc
        admitted: list[Item] = []
        refused: list[tuple[Item, outcome.Outcome[Any]]] = []
        for item in inserts:
            insert = item.payload
            task_id, scope = insert.task_id, insert.scope
            error: Exception | None = None
            if task_id in exists:
                error = AlreadyExists(task_id)
            elif self._max_tasks is not None and total >= self._max_tasks:
                error = CapacityExceeded("max_tasks")
            elif self._max_active is not None and active.get(scope, 0) >= self._max_active:
                error = CapacityExceeded("max_active_tasks_per_scope")
            if error is not None:
                refused.append((item, outcome.Error(error)))
                continue
            exists.add(task_id)
            total += 1
            if insert.params["status"] in _ACTIVE_STATUSES:
                active[scope] = active.get(scope, 0) + 1
            admitted.append(item)
        return admitted, refused

    def _released_by(self, row: _Row, lease: object, seen: tuple[Any, ...], event: Event) -> bool:
        """Whether ``lease``'s claim was released with no later claim made, after ``event``
        was committed (``seen`` is its ledger row, if any)."""
        return (
            isinstance(lease, Lease)
            and lease.store_id == self._store_id
            and lease.task_id == row.task_id
            and lease.epoch == 0
            and row.claim_owner is None
            and row.generation == lease.generation
            and seen[1] is not None
            and _same_event(seen[1], stored_text(event.json_view()), event)
        )

    @staticmethod
    def _replayed(snapshot: Snapshot, seen: tuple[Any, ...]) -> Transition:
        """The original commit of an event id (``seen``: its ledger row), as a duplicate."""
        _, _, revision, committed_at, stored_effects = seen
        try:
            effects = effects_from_json(loads(stored_effects))
        except (CodecError, ValueError, TypeError) as exc:
            raise CorruptStore(snapshot.task.id, f"undecodable ledger effects: {exc}") from exc
        return Transition(
            outcome="duplicate",
            snapshot=snapshot,
            effects=effects,
            event_revision=int(revision),
            committed_at=int(committed_at),
        )

    def _wakeup_for(self, kind: EventKind, new: Snapshot) -> str | None:
        """The NOTIFY payload of an applied event, if other runners should hear of it."""
        task_id = new.task.id
        if kind is EventKind.CANCELLED:
            return self._payload(WakeupKind.CANCELLED, task_id)
        if kind is EventKind.INPUT_RESPONSES_ACCEPTED:
            return self._payload(WakeupKind.INPUT_ACCEPTED, task_id)
        if kind is EventKind.RETRY_REQUESTED and new.retry_at is not None:
            return self._payload(WakeupKind.RETRY_SCHEDULED, task_id, new.retry_at)
        return None

    # -- expiry and audit ---------------------------------------------------------------------

    async def reap(self) -> list[str]:
        """Delete up to ``reap_batch_size`` expired aggregates (call again for more)."""
        self._opened()

        async def run(session: Session) -> list[str]:
            async with session.transaction():
                found = await session.execute(
                    self._q.reap_select, self._params(batch=self._reap_batch)
                )
                ids = [_decode_row(values).task_id for values in found.rows]  # validate first
                if ids:
                    # Sequential scans off for the statement: ``task_id = ANY(ids)`` was
                    # planned on a new table as a scan of it, and kept.
                    delete = {"ids": ids, "changes": self._changes_channel, "origin": self._origin}
                    await session.pipeline(*self._q.without_seqscan((self._q.reap_delete, delete)))
            return sorted(ids)

        reaped = await self._run(run)
        self._feed.announce_reaped(reaped)
        return reaped

    async def history(self, task_id: str) -> list[LedgerEntry]:
        """The validated ledger of a stored task, in revision order (``[]`` when unknown).

        An administrative read: no access is needed, and expired-but-unreaped tasks are shown.
        """
        self._opened()

        async def run(session: Session) -> list[LedgerEntry]:
            async with session.transaction():
                found = (await session.execute(self._q.lock_share, {"task_id": task_id})).fetchone()
                if found is None:
                    return []
                rows = (await session.execute(self._q.ledger, {"ids": [task_id]})).rows
            return _validate_ledger(_decode_row(found), rows)

        return await self._run(run)

    async def audit(self, *, limit: int = 1000, after: str | None = None) -> AuditPage:
        """Validate a page of aggregates (record, projections, claim, ledger) by task id.

        Reads one consistent snapshot and locks nothing. Pass ``next_after`` back as ``after``
        to continue; it is ``None`` on the last page.
        """
        self._opened()
        check_audit_page(limit, after)

        async def run(session: Session) -> AuditPage:
            async with session.transaction():
                await session.execute(self._q.read_only)
                raws = (
                    await session.execute(
                        self._q.audit_page, {"after": after or "", "limit": limit}
                    )
                ).rows
                checked = tuple(str(raw[0]) for raw in raws)
                ledger = (await session.execute(self._q.ledger, {"ids": list(checked)})).rows
            by_task: dict[str, list[tuple[Any, ...]]] = {}
            for entry in ledger:
                by_task.setdefault(entry[0], []).append(entry)
            findings: list[AuditFinding] = []
            for raw in raws:
                try:
                    _validate_ledger(_decode_row(raw), by_task.get(raw[0], []))
                except CorruptStore as exc:
                    findings.append(AuditFinding(task_id=exc.task_id, reason=exc.reason))
            return AuditPage(
                checked=checked,
                findings=tuple(findings),
                next_after=checked[-1] if len(checked) == limit else None,
            )

        return await self._run(run)

    # -- operators (ListsTasks) ---------------------------------------------------------------

    @staticmethod
    def _stored(row: _Row, now: int) -> StoredTask:
        claim = None
        if row.claim_owner is not None and row.claim_expires_at is not None:
            claim = ClaimInfo(
                owner_id=row.claim_owner,
                generation=row.generation,
                expires_at=row.claim_expires_at,
                live=now < row.claim_expires_at,
            )
        return StoredTask(
            snapshot=row.snapshot,
            scope=_scope_key(row),
            generation=row.generation,
            claim=claim,
            expired=row.expired(now),
        )

    async def list_tasks(self, query: TaskQuery) -> TaskListing:
        """A page of every stored task, across scopes: one read-only snapshot, no locks."""
        self._opened()
        query = check_task_query(query)
        params = {
            "statuses": sorted(s.value for s in query.statuses) if query.statuses else None,
            "scope": None if query.scope is None else _scope_text(query.scope),
            "before": query.created_before,
            "after_at": None if query.after is None else query.after.created_at,
            "after_id": None if query.after is None else query.after.task_id,
            "tool": query.tool,
            "limit": query.limit + 1,
        }

        async def run(session: Session) -> TaskListing:
            async with session.transaction():
                _, clock, found = await session.pipeline(
                    (self._q.read_only, None),
                    (self._q.now, self._params()),
                    (self._q.list_page, params),
                )
            now = int(clock.rows[0][0])
            tasks = (self._stored(_decode_row(values), now) for values in found.rows)
            return listing_page(now, query, tasks)

        return await self._run(run)

    async def inspect_task(self, task_id: str) -> TaskInspection | NotFound:
        """The task and its validated ledger from one read-only snapshot (expired ones too)."""
        self._opened()

        async def run(session: Session) -> TaskInspection | NotFound:
            async with session.transaction():
                _, read, ledger_rows = await session.pipeline(
                    (self._q.read_only, None),
                    (self._q.read, self._params(task_id=task_id)),
                    (self._q.ledger, {"ids": [task_id]}),
                )
            values = read.fetchone()
            ledger = ledger_rows.rows
            assert values is not None
            now = int(values[0])
            if values[1] is None:
                return NOT_FOUND
            row = _decode_row(values[1:])
            entries = tuple(_validate_ledger(row, ledger))
            return TaskInspection(now=now, task=self._stored(row, now), ledger=entries)

        return await self._run(run)

    async def operator_access(self, task_id: str, action: Action) -> Access | NotFound:
        """An access in the task's own scope (see ``ListsTasks``)."""
        _, store_id = self._opened()
        action = check_operator_action(task_id, action)

        async def run(session: Session) -> Access | NotFound:
            _, row = await self._read(session, task_id)
            if row is None:
                return NOT_FOUND
            return Access(store_id=store_id, action=action, task_id=task_id, scope=_scope_key(row))

        return await self._run(run)

    # -- wake-ups -----------------------------------------------------------------------------

    def changes(self) -> AsyncGenerator[TaskChange, None]:
        """Every change of this schema's tasks from now on (``OffersChanges``), on any host.

        Commits through this store object come at once, with the committed task; those of
        other store objects (other processes, other hosts) come from ``LISTEN`` on the
        ``changes`` channel, as task id, revision and status. The first item is ``resync``,
        and again after a reconnect. Each call holds one dedicated connection outside the
        pool until the iteration ends; closing the store ends it.
        """
        self._opened()
        channel = self._changes_channel or f"{self._schema}.changes"

        def connect() -> Conn:
            return psycopg.Connection.connect(
                self._conninfo,
                autocommit=True,
                keepalives=1,
                keepalives_idle=30,
                keepalives_interval=10,
                keepalives_count=3,
                **self._connect_kwargs("-changes"),
            )

        return listen_changes(
            self._feed, connect, channel, self._origin, self._listeners, lambda: self._closed
        )

    def wakeups(self) -> AsyncGenerator[Wakeup, None]:
        """Wake-up hints from every store on this schema, on any host (LISTEN/NOTIFY).

        ``async for wakeup in store.wakeups()``: the first item is always ``RESYNC`` (listening
        now; run recovery), and again after a reconnect. Each call holds one dedicated
        connection outside the pool until the iteration ends; closing the store ends it. Close
        it with ``aclose()`` (or ``contextlib.aclosing``) when you stop early.
        """
        self._opened()

        def connect() -> Conn:
            return psycopg.Connection.connect(
                self._conninfo,
                autocommit=True,
                keepalives=1,
                keepalives_idle=30,
                keepalives_interval=10,
                keepalives_count=3,
                **self._connect_kwargs("-listen"),
            )

        return listen(connect, self._channel, self._origin, self._listeners, lambda: self._closed)


class _Queries:
    """The store's SQL, composed once per store for its schema, as prepared-statement-ready
    :class:`~tritask_postgres._native.Statement` objects."""

    def __init__(self, schema: str, injected_clock: bool) -> None:
        s = sql.Identifier(schema)
        now = "%(now)s::bigint" if injected_clock else _CLOCK_SQL

        def q(text: str) -> Statement:
            return statement(
                sql.SQL(text.replace("{now}", now).replace("{active}", _ACTIVE))
                .format(
                    t=sql.SQL("{}.tasks").format(s),
                    e=sql.SQL("{}.task_events").format(s),
                    c=sql.SQL("{}.task_counts").format(s),
                )
                .as_bytes(None)
            )

        cols = _COLUMNS.replace("{", "{{").replace("}", "}}")
        self.now = q("SELECT {now}")
        self.read_only = q("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        self.read = q(
            "SELECT n.now, " + cols + " FROM (SELECT {now} AS now) n"
            " LEFT JOIN {t} t ON t.task_id = %(task_id)s"
        )
        self.lock = q("SELECT " + cols + " FROM {t} t WHERE t.task_id = %(task_id)s FOR UPDATE")
        self.lock_share = q(
            "SELECT " + cols + " FROM {t} t WHERE t.task_id = %(task_id)s FOR SHARE"
        )
        self.now_and_seen = q(
            "SELECT n.now, e.event::text, e.event_revision, e.committed_at_us, e.effects::text"
            " FROM (SELECT {now} AS now) n LEFT JOIN {e} e"
            " ON e.task_id = %(task_id)s AND e.event_id = %(event_id)s"
        )
        self.ledger = q(
            "SELECT " + _LEDGER_COLUMNS + " FROM {e} WHERE task_id = ANY(%(ids)s::text[])"
            " ORDER BY task_id, event_revision"
        )
        # An operator's page: every filter is a parameter that is NULL when unused.
        self.list_page = q(
            "SELECT " + cols + " FROM {t} t"
            " WHERE (%(statuses)s::text[] IS NULL OR t.status = ANY(%(statuses)s::text[]))"
            " AND (%(scope)s::text IS NULL OR t.scope = %(scope)s::text)"
            " AND (%(before)s::bigint IS NULL OR t.created_at_us < %(before)s::bigint)"
            " AND (%(after_at)s::bigint IS NULL"
            " OR (t.created_at_us, t.task_id) > (%(after_at)s::bigint, %(after_id)s::text))"
            " AND (%(tool)s::text IS NULL OR (CASE"
            " WHEN json_typeof(t.record->'work'->'tool') = 'string'"
            " THEN t.record->'work'->>'tool'"
            " WHEN t.record->'work'->>'type' = 'tools/call'"
            " AND json_typeof(t.record->'work'->'input'->'name') = 'string'"
            " THEN t.record->'work'->'input'->>'name' END) = %(tool)s::text)"
            " ORDER BY t.created_at_us, t.task_id LIMIT %(limit)s::bigint"
        )
        self.audit_page = q(
            "SELECT " + cols + " FROM {t} t WHERE t.task_id > %(after)s"
            " ORDER BY t.task_id LIMIT %(limit)s"
        )
        self.claim_next = q(
            "WITH n AS MATERIALIZED (SELECT {now} AS now)"
            " SELECT n.now, " + cols + " FROM {t} t, n"
            " WHERE t.status IN {active}"
            " AND (t.retry_at_us IS NULL OR t.retry_at_us <= n.now)"
            " AND (t.claim_expires_at_us IS NULL OR t.claim_expires_at_us <= n.now)"
            " AND t.task_id <> ALL(%(skip)s::text[])"
            " ORDER BY t.created_at_us, t.task_id"
            " LIMIT 1 FOR UPDATE OF t SKIP LOCKED"
        )
        self.set_claim = q(
            "UPDATE {t} SET claim_owner = %(owner)s, claim_token = %(token)s::uuid,"
            " lease_generation = %(generation)s, claim_expires_at_us = %(expires_at)s,"
            " updated_at = clock_timestamp() WHERE task_id = %(task_id)s"
        )
        # The first claim of a queued task: its record gets its own status message back.
        self.set_claim_started = q(
            "UPDATE {t} SET claim_owner = %(owner)s, claim_token = %(token)s::uuid,"
            " lease_generation = %(generation)s, claim_expires_at_us = %(expires_at)s,"
            " record = %(record)s::json, queued_message = NULL,"
            " updated_at = clock_timestamp() WHERE task_id = %(task_id)s"
        )
        # renew_all: the batch's rows are locked first (in task id order), the clock is read
        # after every lock is granted (the count needs the whole locked set), then each row
        # that is exactly its lease's live claim gets a fresh token and the new expiry.
        self.renew_all = q(
            "WITH b AS (SELECT * FROM unnest(%(ids)s::text[], %(tokens)s::text[],"
            " %(generations)s::text[]::bigint[], %(expiries)s::text[]::bigint[])"
            " AS b(task_id, token, generation, expires_at)),"
            " locked AS MATERIALIZED (" + _each_row("%(ids)s", "t.task_id", lock=True) + "),"
            " n AS MATERIALIZED (SELECT {now} AS now FROM (SELECT count(*) FROM locked) c)"
            " UPDATE {t} t SET claim_token = gen_random_uuid(),"
            f" claim_expires_at_us = LEAST(n.now::numeric + %(lease_us)s, {_MAX_BIGINT})::bigint,"
            " updated_at = clock_timestamp() FROM b, n"
            " WHERE t.task_id = b.task_id AND t.claim_owner = %(owner)s"
            " AND t.claim_token::text = b.token AND t.lease_generation = b.generation"
            " AND t.claim_expires_at_us = b.expires_at AND t.claim_expires_at_us > n.now"
            " RETURNING t.task_id, t.revision, t.claim_token::text, t.claim_expires_at_us"
        )
        self.clear_claim = q(
            "WITH u AS (UPDATE {t} SET claim_owner = NULL, claim_token = NULL,"
            " claim_expires_at_us = NULL, updated_at = clock_timestamp()"
            " WHERE task_id = %(task_id)s RETURNING 1),"
            " nt AS (SELECT pg_notify(%(channel)s, %(payload)s::text) FROM u"
            " WHERE %(payload)s::text IS NOT NULL)"
            " SELECT (SELECT count(*) FROM u), (SELECT count(*) FROM nt)"
        )
        self.capacity_lock = q("SELECT pg_advisory_xact_lock(%(lock_class)s, hashtext(%(schema)s))")
        self.key_lock = q("SELECT pg_advisory_xact_lock(%(key_lock_class)s, hashtext(%(schema)s))")
        live_claim = "t.claim_token IS NOT NULL AND t.claim_expires_at_us > n.now"
        claimable = (
            "t.status IN {active} AND (t.retry_at_us IS NULL OR t.retry_at_us <= n.now)"
            " AND (t.claim_expires_at_us IS NULL OR t.claim_expires_at_us <= n.now)"
        )
        # Under the key lock, in a statement of its own: a key's live claims, and whether a
        # claimable task of it waits (a new one then queues behind it).
        self.key_room = q(
            "WITH n AS MATERIALIZED (SELECT {now} AS now) SELECT"
            " (SELECT count(*) FROM {t} t, n WHERE t.concurrency_key = %(key)s::text"
            f" AND {live_claim}),"
            " EXISTS (SELECT 1 FROM {t} t, n WHERE t.concurrency_key = %(key)s::text"
            f" AND {claimable})"
        )
        # Planner settings around one statement (``claim_next``, ``renew_all``, ``reap``): a
        # prepared statement's plan is made under the settings of the executions that make
        # it, and kept.
        self._seqscan_off = q("SET LOCAL enable_seqscan = off")
        self._seqscan_default = q("SET LOCAL enable_seqscan TO DEFAULT")
        self.key_claims = q(
            "WITH n AS MATERIALIZED (SELECT {now} AS now)"
            " SELECT t.concurrency_key, count(*) FROM {t} t, n"
            f" WHERE t.concurrency_key IS NOT NULL AND {live_claim} GROUP BY t.concurrency_key"
        )
        self.key_running = q(
            "WITH n AS MATERIALIZED (SELECT {now} AS now)"
            " SELECT count(*) FROM {t} t, n WHERE t.concurrency_key = %(key)s::text"
            f" AND {live_claim}"
        )
        # claim_next, level 0: tasks without a key and those of keys with no live claim.
        self.claim_next_free = q(
            "WITH n AS MATERIALIZED (SELECT {now} AS now)"
            " SELECT n.now, " + cols + " FROM {t} t, n"
            f" WHERE {claimable}"
            " AND (t.concurrency_key IS NULL OR t.concurrency_key <> ALL(%(busy)s::text[]))"
            " AND t.task_id <> ALL(%(skip)s::text[])"
            " ORDER BY t.created_at_us, t.task_id"
            " LIMIT 1 FOR UPDATE OF t SKIP LOCKED"
        )
        # claim_next within one busy key: its oldest claimable task.
        self.claim_next_key = q(
            "WITH n AS MATERIALIZED (SELECT {now} AS now)"
            " SELECT n.now, " + cols + " FROM {t} t, n"
            f" WHERE t.concurrency_key = %(key)s::text AND {claimable}"
            " AND t.task_id <> ALL(%(skip)s::text[])"
            " ORDER BY t.created_at_us, t.task_id"
            " LIMIT 1 FOR UPDATE OF t SKIP LOCKED"
        )
        # A batch's creations under limits, under the capacity lock: the tasks (the sum of
        # task_counts, kept by the triggers of schema 4: constant cost, where counting rows
        # grew with the table), which of the batch's ids exist, and each of its scopes' active
        # tasks (up to max_active, from the partial index), as JSON arrays.
        self.batch_counts = q(
            "SELECT (SELECT sum(c.tasks)::bigint FROM {c} c),"
            " (SELECT coalesce(json_agg(t.task_id), '[]')::text FROM ("
            + _each_row("%(ids)s", "t.task_id", lock=False)
            + ") t),"
            " (SELECT coalesce(json_agg(json_build_array(s.scope, (SELECT count(*) FROM"
            " (SELECT 1 FROM {t} t WHERE t.scope = s.scope AND t.status IN {active}"
            " LIMIT %(max_active)s) b))), '[]')::text FROM unnest(%(scopes)s::text[]) s(scope))"
        )
        self.capacity_counts = q(
            "SELECT EXISTS (SELECT 1 FROM {t} WHERE task_id = %(task_id)s),"
            " (SELECT sum(c.tasks)::bigint FROM {c} c),"
            " (SELECT count(*) FROM (SELECT 1 FROM {t} WHERE scope = %(scope)s"
            " AND status IN {active} LIMIT %(max_active)s) b)"
        )

        def insert(record: str, created_at: str, expires_at: str, where: str = "") -> Statement:
            return q(
                "WITH n AS MATERIALIZED (SELECT {now} AS now),"
                " i AS (INSERT INTO {t} (task_id, record, scope, revision, status, created_at_us,"
                " expires_at_us, retry_at_us, claim_owner, claim_token, lease_generation,"
                " claim_expires_at_us, queued_message, concurrency_key, concurrency_limit)"
                f" SELECT %(task_id)s, {record}, %(scope)s, 0, %(status)s, {created_at},"
                f" {expires_at}, NULL, %(owner)s::text, %(token)s::uuid,"
                " CASE WHEN %(owner)s::text IS NULL THEN 0 ELSE 1 END,"
                " CASE WHEN %(owner)s::text IS NULL THEN NULL"
                f" ELSE LEAST(n.now::numeric + %(lease_us)s, {_MAX_BIGINT})::bigint END,"
                " %(queued)s::text, %(key)s::text, %(limit)s::integer"
                f" FROM n{where} ON CONFLICT (task_id) DO NOTHING"
                " RETURNING created_at_us, claim_expires_at_us, record::text),"
                " nt AS (SELECT pg_notify(%(channel)s, %(payload)s::text) FROM i"
                " WHERE %(payload)s::text IS NOT NULL)"
                " SELECT (SELECT count(*) FROM i), (SELECT max(claim_expires_at_us) FROM i),"
                " (SELECT max(created_at_us) FROM i), (SELECT now FROM n),"
                " (SELECT count(*) FROM nt), (SELECT record FROM i)"
            )

        self.insert = insert("%(record)s::json", "%(created_at)s", "%(expires_at)s")
        # Stamped: the record's pieces (see ``_stamp_pieces``) joined with the clock's instant
        # in ``format_instant``'s text, the TTL counted from it.
        instant = "'\"' || " + _INSTANT_SQL + " || '\"'"
        self.insert_stamped = insert(
            f"(%(head)s::text || {instant} || %(middle)s::text || {instant} || %(tail)s::text)"
            "::json",
            "n.now",
            "CASE WHEN %(ttl_us)s::numeric IS NULL THEN NULL"
            f" ELSE LEAST(n.now::numeric + %(ttl_us)s::numeric, {_MAX_BIGINT})::bigint END",
            f" WHERE n.now BETWEEN 0 AND {MAX_INSTANT}",
        )

        def write(releasing: bool) -> Statement:
            claim = "claim_owner = NULL, claim_token = NULL, claim_expires_at_us = NULL, "
            return q(
                "WITH u AS (UPDATE {t} SET record = %(record)s::json, revision = %(revision)s,"
                " status = %(status)s, retry_at_us = %(retry_at)s, "
                + (claim if releasing else "")
                + "updated_at = clock_timestamp()"
                " WHERE task_id = %(task_id)s AND revision = %(expected)s RETURNING task_id),"
                " i AS (INSERT INTO {e} (task_id, event_id, event_kind, event, event_revision,"
                " committed_at_us, effects) SELECT task_id, %(event_id)s, %(event_kind)s,"
                " %(event)s::json, %(revision)s, %(committed_at)s, %(effects)s::json FROM u"
                " RETURNING 1),"
                " nt AS (SELECT pg_notify(p.channel, p.payload) FROM i,"
                " (VALUES (%(channel)s::text, %(payload)s::text),"
                " (%(channel)s::text, %(released)s::text),"
                " (%(changes)s::text, %(change)s::text)) AS p(channel, payload)"
                " WHERE p.payload IS NOT NULL)"
                " SELECT (SELECT count(*) FROM i), (SELECT count(*) FROM nt)"
            )

        self.write = write(releasing=False)
        self.write_releasing = write(releasing=True)
        # A batch's stamped creations in one statement (``PostgresStore._insert_calls``): one
        # row per creation from one array per column, one clock for all, each row as
        # ``insert_stamped`` writes it. Rows go in in task-id order, as settles lock theirs:
        # an insertion waits for another transaction's uncommitted one of the same id, so two
        # hosts inserting the same new ids in opposite orders would deadlock. Its answer: the
        # clock, then one row per inserted task (none: the clock alone, with NULLs).
        stamped = f"(b.head || {instant} || b.middle || {instant} || b.tail)::json"

        def insert_many(admit: bool) -> Statement:
            # With ``admit`` (creations under limits, in the batch's one round trip, with no id
            # twice): each row's verdict as ``_admit`` decides it, in the batch's order, counted
            # in this statement (which starts after the capacity lock was granted): an existing
            # id first, then max_tasks (the tasks plus the rows before it that fit their scope:
            # once one is refused every later one is), then max_active (the scope's active
            # tasks plus its active rows before it that are not refused as existing). Only
            # 'ok' rows are inserted; the answer is one row per creation. NULL limits are none.
            verdicts = (
                " x AS MATERIALIZED (SELECT b.ord, b.task_id, b.scope, b.status IN {active} AS act,"
                # One probe per row (see ``_each_row``): not hashed, whatever the plan.
                " (SELECT true FROM {t} e WHERE e.task_id = b.task_id LIMIT 1) IS NOT NULL AS ex"
                " FROM b),"
                " r AS MATERIALIZED (SELECT s.scope, %(max_active)s::bigint - (SELECT count(*)"
                " FROM (SELECT 1 FROM {t} e WHERE e.scope = s.scope AND e.status IN {active}"
                " LIMIT coalesce(%(max_active)s::bigint, 0)) a) AS room"
                " FROM (SELECT DISTINCT x.scope FROM x) s),"
                " y AS (SELECT x.ord, x.task_id, x.ex, NOT x.ex"
                " AND (%(max_active)s::bigint IS NULL OR count(*) FILTER (WHERE x.act AND NOT x.ex)"
                " OVER (PARTITION BY x.scope ORDER BY x.ord"
                " ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) < r.room) AS fits"
                " FROM x JOIN r ON r.scope = x.scope),"
                " v AS MATERIALIZED (SELECT y.ord, y.task_id, CASE WHEN y.ex THEN 'exists'"
                " WHEN %(max_tasks)s::bigint IS NOT NULL AND (SELECT sum(c.tasks) FROM {c} c)"
                " + count(*) FILTER (WHERE y.fits) OVER (ORDER BY y.ord"
                " ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) >= %(max_tasks)s::bigint"
                " THEN 'max_tasks' WHEN NOT y.fits THEN 'max_active' ELSE 'ok' END AS verdict"
                " FROM y),"
                if admit
                else ""
            )
            return q(
                "WITH n AS MATERIALIZED (SELECT {now} AS now),"
                " b AS (SELECT * FROM unnest(%(ids)s::text[], %(heads)s::text[],"
                " %(middles)s::text[],"
                " %(tails)s::text[], %(scopes)s::text[], %(statuses)s::text[],"
                " %(ttls)s::text[]::numeric[], %(owners)s::text[], %(tokens)s::text[]::uuid[],"
                " %(leases)s::text[]::numeric[], %(queued)s::text[], %(keys)s::text[],"
                " %(limits)s::text[]::integer[], %(payloads)s::text[]) WITH ORDINALITY"
                " AS b(task_id, head, middle, tail, scope, status, ttl_us, owner, token,"
                " lease_us, queued, key, lim, payload, ord)),"
                + verdicts
                + " i AS (INSERT INTO {t} (task_id, record, scope, revision, status,"
                " created_at_us, expires_at_us, retry_at_us, claim_owner, claim_token,"
                " lease_generation, claim_expires_at_us, queued_message, concurrency_key,"
                " concurrency_limit)"
                f" SELECT b.task_id, {stamped}, b.scope, 0, b.status, n.now,"
                " CASE WHEN b.ttl_us IS NULL THEN NULL"
                f" ELSE LEAST(n.now::numeric + b.ttl_us, {_MAX_BIGINT})::bigint END,"
                " NULL, b.owner, b.token, CASE WHEN b.owner IS NULL THEN 0 ELSE 1 END,"
                " CASE WHEN b.owner IS NULL THEN NULL"
                f" ELSE LEAST(n.now::numeric + b.lease_us, {_MAX_BIGINT})::bigint END,"
                " b.queued, b.key, b.lim FROM n, b"
                + (" JOIN v ON v.ord = b.ord AND v.verdict = 'ok'" if admit else "")
                + f" WHERE n.now BETWEEN 0 AND {MAX_INSTANT}"
                " ORDER BY b.task_id ON CONFLICT (task_id) DO NOTHING"
                " RETURNING task_id, created_at_us, claim_expires_at_us, record::text),"
                " nt AS (SELECT pg_notify(%(channel)s::text, b.payload) FROM b"
                " WHERE b.payload IS NOT NULL AND b.task_id IN (SELECT task_id FROM i)"
                " ORDER BY b.ord)"
                + (
                    " SELECT n.now, v.task_id, i.created_at_us, i.claim_expires_at_us, i.record,"
                    " (SELECT count(*) FROM nt), v.verdict FROM n CROSS JOIN v"
                    " LEFT JOIN i ON i.task_id = v.task_id ORDER BY v.ord"
                    if admit
                    else " SELECT n.now, i.task_id, i.created_at_us, i.claim_expires_at_us,"
                    " i.record, (SELECT count(*) FROM nt) FROM n LEFT JOIN i ON true"
                )
            )

        self.insert_many = insert_many(admit=False)
        self.insert_many_admitted = insert_many(admit=True)
        # Planned settles (``PostgresStore._plan_settle``): each applies only to the row its
        # store inserted and remembers (the record byte for byte, the revision, the claim of
        # the settle's lease, live on the statement's clock) with no ledger row of its event
        # id; its record is the planned one's two pieces joined with the commit instant
        # (the clock, or the row's last update + 1 µs when later, as ``_decide`` does), its
        # claim cleared. A settle whose row is not that one writes nothing and has no row in
        # the answer (it then runs alone). Rows as ``write_many`` writes them, NOTIFYs too.
        committed = "'\"' || " + _INSTANT_SQL.replace("n.now", "p.at") + " || '\"'"
        self.settle_planned = q(
            "WITH n AS MATERIALIZED (SELECT {now} AS now),"
            " p AS (SELECT b.*, n.now, GREATEST(n.now, b.floor) AS at FROM n,"
            " unnest(%(ids)s::text[], %(expected)s::text[]::bigint[], %(olds)s::text[],"
            " %(heads)s::text[], %(tails)s::text[], %(revisions)s::text[]::bigint[],"
            " %(statuses)s::text[], %(event_ids)s::text[], %(kinds)s::text[],"
            " %(events)s::text[], %(floors)s::text[]::bigint[], %(effects)s::text[],"
            " %(owners)s::text[], %(tokens)s::text[], %(generations)s::text[]::bigint[],"
            " %(expiries)s::text[]::bigint[])"
            " AS b(task_id, expected, old, head, tail, revision, status, event_id, event_kind,"
            " event, floor, effects, owner, token, generation, expiry)),"
            # The rows locked first, in task-id order, as every batch locks them (``lock_many``).
            " k AS MATERIALIZED (" + _each_row("%(ids)s", "t.task_id", lock=True) + "),"
            f" u AS (UPDATE {{t}} t SET record = (p.head || {committed} || p.tail)::json,"
            " revision = p.revision, status = p.status, retry_at_us = NULL, claim_owner = NULL,"
            " claim_token = NULL, claim_expires_at_us = NULL, updated_at = clock_timestamp()"
            " FROM p WHERE t.task_id = p.task_id AND t.task_id IN (SELECT task_id FROM k)"
            " AND t.revision = p.expected"
            " AND t.record::text = p.old AND t.claim_owner = p.owner"
            " AND t.claim_token::text = p.token AND t.lease_generation = p.generation"
            " AND t.claim_expires_at_us = p.expiry AND p.now < p.expiry"
            f" AND p.at BETWEEN 0 AND {MAX_INSTANT}"
            " AND NOT EXISTS (SELECT 1 FROM {e} l"
            " WHERE l.task_id = p.task_id AND l.event_id = p.event_id)"
            " RETURNING t.task_id, p.at),"
            " i AS (INSERT INTO {e} (task_id, event_id, event_kind, event, event_revision,"
            " committed_at_us, effects) SELECT p.task_id, p.event_id, p.event_kind,"
            " p.event::json, p.revision, u.at, p.effects::json"
            " FROM p JOIN u ON u.task_id = p.task_id RETURNING task_id),"
            " nt AS (SELECT pg_notify(q.channel, q.payload) FROM unnest(%(n_ids)s::text[],"
            " %(n_channels)s::text[], %(n_payloads)s::text[]) WITH ORDINALITY"
            " AS q(task_id, channel, payload, ord)"
            " WHERE q.task_id IN (SELECT task_id FROM i) ORDER BY q.ord)"
            " SELECT u.task_id, u.at, (SELECT count(*) FROM nt)"
            " FROM u JOIN i ON i.task_id = u.task_id"
        )
        # A batch's settles: every row locked by one statement, in task-id order (the sort is
        # below the lock), then in a statement of its own (after every lock was granted) the
        # clock and each settle's ledger row.
        self.lock_many = q(_each_row("%(ids)s", cols, lock=True))
        # (The lateral subquery, not pulled up because of its LIMIT, is one primary-key lookup
        # per settle: a plain join was planned as a scan of the whole ledger for 30 ids.)
        self.now_and_seen_many = q(
            "SELECT n.now, b.task_id, e.event, e.event_revision, e.committed_at_us, e.effects"
            " FROM (SELECT {now} AS now) n"
            " CROSS JOIN unnest(%(ids)s::text[], %(event_ids)s::text[]) AS b(task_id, event_id)"
            " LEFT JOIN LATERAL (SELECT l.event::text AS event, l.event_revision,"
            " l.committed_at_us, l.effects::text AS effects FROM {e} l"
            " WHERE l.task_id = b.task_id AND l.event_id = b.event_id LIMIT 1) e ON true"
        )

        # The applied settles of a batch in one statement: each row as ``write_releasing``
        # writes it (guarded by its expected revision), its ledger row, its NOTIFYs in the
        # batch's order; the answer names the tasks written.
        self.write_many = q(
            "WITH b AS (SELECT * FROM unnest(%(ids)s::text[], %(expected)s::text[]::bigint[],"
            " %(records)s::text[], %(revisions)s::text[]::bigint[], %(statuses)s::text[],"
            " %(retry_ats)s::text[]::bigint[], %(event_ids)s::text[], %(kinds)s::text[],"
            " %(events)s::text[], %(committed)s::text[]::bigint[], %(effects)s::text[])"
            " AS b(task_id, expected, record, revision, status, retry_at, event_id, event_kind,"
            " event, committed_at, effects)),"
            " u AS (UPDATE {t} t SET record = b.record::json, revision = b.revision,"
            " status = b.status, retry_at_us = b.retry_at, claim_owner = NULL,"
            " claim_token = NULL, claim_expires_at_us = NULL, updated_at = clock_timestamp()"
            " FROM b WHERE t.task_id = b.task_id AND t.revision = b.expected"
            " RETURNING t.task_id),"
            " i AS (INSERT INTO {e} (task_id, event_id, event_kind, event, event_revision,"
            " committed_at_us, effects) SELECT b.task_id, b.event_id, b.event_kind,"
            " b.event::json, b.revision, b.committed_at, b.effects::json"
            " FROM b JOIN u ON u.task_id = b.task_id RETURNING task_id),"
            " nt AS (SELECT pg_notify(p.channel, p.payload) FROM unnest(%(n_ids)s::text[],"
            " %(n_channels)s::text[], %(n_payloads)s::text[]) WITH ORDINALITY"
            " AS p(task_id, channel, payload, ord)"
            " WHERE p.task_id IN (SELECT task_id FROM i) ORDER BY p.ord)"
            " SELECT i.task_id, (SELECT count(*) FROM nt) FROM i"
        )
        self.reap_select = q(
            "WITH n AS MATERIALIZED (SELECT {now} AS now)"
            " SELECT " + cols + " FROM {t} t, n WHERE t.expires_at_us <= n.now"
            " ORDER BY t.expires_at_us, t.task_id LIMIT %(batch)s FOR UPDATE OF t SKIP LOCKED"
        )
        self.reap_delete = q(
            "WITH d AS (DELETE FROM {t} WHERE task_id = ANY(%(ids)s::text[]) RETURNING task_id),"
            " nt AS (SELECT pg_notify(%(changes)s::text, "
            + reaped_payload_sql("d.task_id", "%(origin)s::text")
            + ") FROM d WHERE %(changes)s::text IS NOT NULL)"
            " SELECT (SELECT count(*) FROM d), (SELECT count(*) FROM nt)"
        )

    def without_seqscan(
        self, call: tuple[Statement, Mapping[str, object] | None]
    ) -> tuple[tuple[Statement, Mapping[str, object] | None], ...]:
        """``call`` between turning sequential scans off and back to the default, for a
        pipeline in a transaction (see ``_seqscan_off``): the three calls, ``call``'s result
        the second."""
        return (self._seqscan_off, None), call, (self._seqscan_default, None)


def open_store(url: str, **options: Any) -> PostgresStore:
    """The ``tritask.stores`` factory for ``postgresql://`` (and ``postgres://``) URLs.

    ``?schema=NAME`` in the URL selects the schema; other options are keyword arguments of
    :class:`PostgresStore` (``scope`` is required).
    """
    if not url.lower().startswith(("postgresql:", "postgres:")):
        raise ValueError(f"the PostgreSQL store opens postgresql:// URLs, not {url!r}")
    return PostgresStore(url, **options)
