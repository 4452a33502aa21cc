"""``SqliteStore``: the embedded durable task store (stdlib ``sqlite3`` driven from trio).

How it works, and why:

* **One connection, operations in arrival order, committed in groups.** Every operation runs
  on the store's connection in one of trio's worker threads (no thread of the store's own:
  threads are trio's, for blocking database calls only). Operations queue on a
  :class:`~tritask_sqlite._lane.Lane`: the caller that finds it idle starts a hop that takes
  the queued operations one after the other, so the connection never waits for the trio loop
  between two operations, and the operations queued behind each other share one transaction
  and one commit (group commit: a savepoint for each operation that runs several writing
  statements, so a failing one fails alone; every caller woken only after the commit that
  contains its operation). A trio cancellation while queued leaves the operation unrun; while
  it runs, ``Connection.interrupt()`` (and a progress handler, for the statements after it)
  aborts it and the caller raises ``Cancelled``; the connection stays usable. An operation
  that has run and waits for its batch's commit is committed, and its cancelled caller gets
  the result (trio's rule: ``Cancelled`` means it did not happen).
* **``BEGIN IMMEDIATE`` for every batch that writes.** The write reservation is taken before
  any row or the clock is read, so every decision is made on the latest committed state (and
  on the earlier operations of the same batch) and a read→write upgrade can never fail with
  ``SQLITE_BUSY`` outside ``busy_timeout``. Creating a task without limits decides nothing on
  stored state: it is one ``INSERT``, an existing id failing its primary key. Batches of reads
  only use deferred transactions so WAL readers in other processes proceed in parallel.
  ``SQLITE_BUSY`` after the timeout is :class:`~tritask.tasks.store.DatabaseBusy` (safe to
  retry).
* **Stored time.** Production reads, inside the transaction, the clock SQLite's own ``'now'``
  reads: the host's real-time clock truncated to the millisecond (``gettimeofday`` in SQLite's
  POSIX VFS, ``time.time_ns()`` here, which saves a statement per transaction). A SQLite file
  is only shared by processes of one host (WAL needs shared memory), so every process sharing
  the file decides leases, ``retry_at`` and TTLs on the same clock. ``clock=`` injects a
  clock for tests; it is called in a worker thread, inside the transaction, so it must be
  thread-safe and must not need trio (``ManualClock`` does, ``TrioClock`` does not). Commit
  times strictly increase per task: ``committed_at = max(now, last_updated_at + 1 ms)`` as in
  the memory store (the clock has millisecond resolution, so wire times keep their ``.mmmZ``
  form).
* **Storage.** The aggregate is the v3 record JSON plus typed projection columns; every read
  decodes the record and checks the projections and the claim shape against it
  (:class:`~tritask.tasks.store.CorruptStore` on any mismatch, nothing is repaired). Every
  applied event is a ledger row (event JSON, kind, revision, commit time, effects JSON), used for
  event-id replay and kept for audit (:meth:`SqliteStore.history`, :meth:`SqliteStore.audit`).
  Scopes are stored as canonical JSON (``{"value":…,"version":1}``, sorted keys, ASCII), so text
  equality is JSON equality, the same rule as the memory store; reads verify the canonical form.
* **The planned settle.** Settling is the hot path of every task. The store remembers (bounded)
  each row it inserted claimed, exactly as stored, with its own copy of the snapshot, and plans
  a ``settle`` with that lease before queueing it: the reducer, the record and effects JSON and
  the commit time (the store's clock, read just before the write reservation) are computed
  outside the serialised section. In the lane, after the lease was checked against the live
  clock, one ``UPDATE`` writes the row only if it still equals the remembered one in every
  column (the record byte for byte) and the event id is new, then the ledger entry is
  inserted (a failure between the two rolls the whole batch back: the lane runs the others
  again). If it wrote nothing, the full decision runs from the decoded row, in a savepoint.
* **Processes and boot epochs.** Every opener takes an ``flock`` on ``PATH.lock`` for the
  store's life: shared by default (several processes on one host may share the file),
  exclusive with ``exclusive=True``. An exclusive opener advances the persisted boot epoch;
  claims of an earlier epoch belong to a process that is provably gone (it would still hold its
  lock), so they are reclaimable at once at generation + 1, and accesses and leases, which carry
  the epoch, stop working. A shared opener cannot observe an epoch change during its life, so it
  never fences a healthy claim of another process.
* **Read-only openers.** ``read_only=True`` (the operator commands that only read: ``tritask
  tasks list|show|stats``) takes no file lock and writes nothing: a ``mode=ro`` connection, no
  migration, no boot epoch, no TEMP objects. It can read a file that a ``tritask serve`` holds
  exclusively (WAL readers never block its writer, and it sees each committed transaction
  whole), and every write operation raises :class:`ReadOnlyStore`. It refuses a file whose
  schema is older than this code (``tritask migrate`` first): it would not migrate it.
"""

from __future__ import annotations

import functools
import json
import logging
import operator
import os
import random
import sqlite3
import sys
import time
import urllib.parse
import uuid
from collections.abc import AsyncGenerator, Callable
from types import TracebackType
from typing import Any, Final, Literal, Self, TypeVar, final

import attrs
import trio

from tritask.jsonrpc import loads
from tritask.tasks._time import MAX_INSTANT, Clock, format_instant
from tritask.tasks.changes import ChangeFeed, TaskChange
from tritask.tasks.events import Event, effects_to_json
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
from tritask.tasks.model import record_version as snapshot_record_version
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
    OwnerRenewal,
    Renewed,
    RequestAuthority,
    Scope,
    StaleLease,
    StoredTask,
    StoreError,
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
    check_owner_renewal,
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
from tritask.tasks.work import JSONObject, Work, canonical_json, stored_text
from tritask_sqlite import schema
from tritask_sqlite._lane import Lane, savepoint
from tritask_sqlite._writer import WriterProcess, WriterUnavailable
from tritask_sqlite._writer_child import CHECK_NONE, CHECK_ONE_ROW, CHECK_TRUE, Step
from tritask_sqlite._writer_child import now_us as _host_clock

__all__ = ["AuditFinding", "AuditPage", "LedgerEntry", "SqliteStore", "StoreLocked"]

T = TypeVar("T")

RECORD_VERSION: Final = 3
_COMMIT_STEP_US = 1000
_READ_ACTIONS = frozenset({Action.GET, Action.UPDATE, Action.CANCEL})
_SYNCHRONOUS = ("NORMAL", "FULL", "EXTRA")
_ACTIVE = "status IN ('working', 'input_required')"
_COLUMNS = (
    "task_id, record_version, record, scope, revision, status, created_at_us, expires_at_us,"
    " retry_at_us, claim_owner, claim_token, lease_generation, claim_expires_at_us, claim_epoch,"
    " queued_message, concurrency_key, concurrency_limit, claim_follows"
)
#: The expiry of the owner's lease row, for a claim that follows it (``NULL`` otherwise, and
#: for a following claim whose owner row is gone, which is then expired: see ``_EXPIRES``).
_OWNER_EXPIRY = (
    "(SELECT o.lease_expires_at_us FROM tritask_owner_leases o"
    " WHERE claim_follows = 1 AND o.owner_id = claim_owner)"
)
#: A claim's effective expiry (schema 4): its owner's lease row when it follows it (batch
#: renewal writes that one row), else its own ``claim_expires_at_us``. Every predicate that
#: decides whether a claim is live uses this, never the column alone.
_EXPIRES = (
    f"(CASE claim_follows WHEN 1 THEN coalesce({_OWNER_EXPIRY}, 0) ELSE claim_expires_at_us END)"
)
_SELECT = f"SELECT {_COLUMNS}, {_OWNER_EXPIRY} FROM tritask_tasks"
_INSERT_TASK = f"INSERT INTO tritask_tasks ({_COLUMNS}) VALUES ({', '.join('?' * 18)})"
#: The columns a claimed task without a concurrency key has NULL at its creation (and the
#: planned settle leaves NULL): the common rows' statements say so literally. Why: the
#: ``sqlite3`` module binds ``None`` through its adapter protocol (a dictionary lookup and two
#: failed attribute lookups, one of them formatting an ``AttributeError``: ~3,300
#: instructions per value, more than the statement's own work on the column).
_NULL_COLUMNS: Final = frozenset(
    {"retry_at_us", "queued_message", "concurrency_key", "concurrency_limit"}
)
_COLUMN_NAMES: Final = tuple(name.strip() for name in _COLUMNS.split(","))
#: ``_INSERT_TASK`` for a row whose ``_NULL_COLUMNS`` are NULL: bind ``_plain_row(row)``.
_INSERT_PLAIN = (
    f"INSERT INTO tritask_tasks ({_COLUMNS}) VALUES"
    f" ({', '.join('NULL' if name in _NULL_COLUMNS else '?' for name in _COLUMN_NAMES)})"
)
#: Claimable now (the status, the retry deadline, no live claim of this boot epoch); the
#: record decides again (``_eligibility``).
_CLAIMABLE = (
    f"{_ACTIVE} AND (retry_at_us IS NULL OR retry_at_us <= :now)"
    f" AND (claim_token IS NULL OR {_EXPIRES} <= :now OR claim_epoch <> :epoch)"
)
#: The live claims of each concurrency key (few rows: at most one per running attempt).
_KEY_CLAIMS = (
    "SELECT concurrency_key, count(*) FROM tritask_tasks"
    " WHERE concurrency_key IS NOT NULL AND claim_token IS NOT NULL"
    f" AND {_EXPIRES} > :now AND claim_epoch = :epoch GROUP BY concurrency_key"
)
_INSERT_EVENT = (
    "INSERT INTO tritask_task_events (task_id, event_id, event, event_kind,"
    " event_revision, committed_at_us, effects) VALUES (?, ?, ?, ?, ?, ?, ?)"
)
_OLD_COLUMNS = [name.strip() for name in _COLUMNS.split(",")[1:]]
#: The planned settle's row write: only if the row is still exactly the planned-on one (every
#: column, the record byte for byte) and the event id is not in its ledger. Its ledger entry is
#: the ordinary ``_INSERT_EVENT``, run only when this wrote the row (see ``_write_planned``).
_PLANNED_UPDATE = (
    "UPDATE tritask_tasks SET record_version = ?, record = ?, revision = ?, status = ?,"
    " retry_at_us = ?, claim_owner = NULL, claim_token = NULL, claim_expires_at_us = NULL,"
    " claim_epoch = NULL, claim_follows = 0 WHERE task_id = ? AND "
    + " AND ".join(f"{name} IS ?" for name in _OLD_COLUMNS)
    + " AND NOT EXISTS (SELECT 1 FROM tritask_task_events e"
    " WHERE e.task_id = tritask_tasks.task_id AND e.event_id = ?)"
)
#: ``_PLANNED_UPDATE`` for a row whose ``_NULL_COLUMNS`` are NULL, settled into a snapshot with
#: no retry time: bind the record version, record, revision and status, ``_plain_row(row)``
#: and the event id.
_PLANNED_PLAIN = (
    "UPDATE tritask_tasks SET record_version = ?, record = ?, revision = ?, status = ?,"
    " retry_at_us = NULL, claim_owner = NULL, claim_token = NULL, claim_expires_at_us = NULL,"
    " claim_epoch = NULL, claim_follows = 0 WHERE task_id = ? AND "
    + " AND ".join(
        f"{name} IS NULL" if name in _NULL_COLUMNS else f"{name} IS ?" for name in _OLD_COLUMNS
    )
    + " AND NOT EXISTS (SELECT 1 FROM tritask_task_events e"
    " WHERE e.task_id = tritask_tasks.task_id AND e.event_id = ?)"
)
#: Where ``concurrency_key`` is in a row of ``_COLUMNS``.
_KEY_COLUMN: Final = 15
#: Rows remembered for the planned settle (see ``_Recent``); the oldest is forgotten first.
_RECENT_LIMIT: Final = 1024
_WRITE = (
    "UPDATE tritask_tasks SET record_version = ?, record = ?, revision = ?, status = ?,"
    " retry_at_us = ? WHERE task_id = ? AND revision = ?"
)
_WRITE_RELEASING = (
    "UPDATE tritask_tasks SET record_version = ?, record = ?, revision = ?, status = ?,"
    " retry_at_us = ?, claim_owner = NULL, claim_token = NULL, claim_expires_at_us = NULL,"
    " claim_epoch = NULL, claim_follows = 0 WHERE task_id = ? AND revision = ?"
)
_SELECT_SEEN = (
    f"SELECT {_COLUMNS}, {_OWNER_EXPIRY}, EXISTS (SELECT 1 FROM tritask_task_events e"
    " WHERE e.task_id = t.task_id AND e.event_id = ?) FROM tritask_tasks t WHERE t.task_id = ?"
)
#: An operator's page of tasks (``ListsTasks.list_tasks``): every filter is a parameter that
#: is NULL when unused, so this is one statement, whatever the query. A record that is not
#: JSON (schema 5 checks only its first character) passes the tool filter, so that decoding
#: it refuses it (``CorruptStore``) instead of SQLite failing the page on malformed JSON.
_LIST = (
    f"{_SELECT} WHERE (:statuses IS NULL OR status IN (SELECT value FROM json_each(:statuses)))"
    " AND (:scope IS NULL OR scope = :scope)"
    " AND (:before IS NULL OR created_at_us < :before)"
    " AND (:after_at IS NULL OR (created_at_us, task_id) > (:after_at, :after_id))"
    " AND (:tool IS NULL OR CASE WHEN NOT json_valid(record) THEN 1 ELSE"
    "      (CASE WHEN json_type(record, '$.work.tool') = 'text'"
    "      THEN json_extract(record, '$.work.tool')"
    "      WHEN json_extract(record, '$.work.type') = 'tools/call'"
    "      AND json_type(record, '$.work.input.name') = 'text'"
    "      THEN json_extract(record, '$.work.input.name') END) = :tool END)"
    " ORDER BY created_at_us, task_id LIMIT :limit"
)
#: ``renew_all`` (schema 4): an owner's claims, from the covering index
#: ``tritask_tasks_owner_claims`` (no task row, no record read). A renewed claim follows its
#: owner's row in ``tritask_owner_leases``, so a heartbeat writes that one row, not every task's.
_OWNER_CLAIMS = (
    "SELECT task_id, claim_token, lease_generation, claim_expires_at_us, claim_epoch,"
    " claim_follows, revision FROM tritask_tasks WHERE claim_owner = ?"
)
_OWNER_LEASE = "SELECT lease_expires_at_us FROM tritask_owner_leases WHERE owner_id = ?"
_SET_OWNER_LEASE = (
    "INSERT INTO tritask_owner_leases (owner_id, lease_expires_at_us) VALUES (?, ?)"
    " ON CONFLICT (owner_id) DO UPDATE SET lease_expires_at_us = excluded.lease_expires_at_us"
)
_DROP_OWNER_LEASE = "DELETE FROM tritask_owner_leases WHERE owner_id = ?"
#: ``reap``: the lease rows of owners that stopped renewing (a dead runner's row is otherwise
#: never dropped: only its own next batch would). A row goes once it has expired and no claim
#: follows it; a row nobody follows is read by no predicate and no decoded claim (a following
#: claim's expiry is the row's, so a row still followed, even expired and unclaimed since,
#: stays: dropping it would turn that claim's expiry into 0). The check and the delete are one
#: statement of one write transaction, which SQLite serializes with every ``renew_all`` and
#: claim, so a live owner's batch cannot interleave; the index ``tritask_tasks_owner_claims``
#: answers the ``NOT EXISTS``.
_REAP_OWNER_LEASES = (
    "DELETE FROM tritask_owner_leases WHERE owner_id IN ("
    " SELECT o.owner_id FROM tritask_owner_leases o WHERE o.lease_expires_at_us <= ?"
    " AND NOT EXISTS (SELECT 1 FROM tritask_tasks t"
    " WHERE t.claim_owner = o.owner_id AND t.claim_follows = 1) LIMIT ?)"
)
#: A following claim the batch does not renew keeps its expiry as its own.
_DETACH = "UPDATE tritask_tasks SET claim_follows = 0, claim_expires_at_us = ? WHERE task_id = ?"
#: A renewed claim that had its own expiry (new since the last batch, or renewed alone): a
#: fresh token too, so the old value is stale even at the instant of its claim.
_ATTACH = "UPDATE tritask_tasks SET claim_follows = 1, claim_token = ? WHERE task_id = ?"
#: ``renew_owner``: a claim starts following the owner's row and keeps its token (the caller
#: holds it and builds the claim's exact lease from the row's expiry).
_FOLLOW = "UPDATE tritask_tasks SET claim_follows = 1 WHERE task_id = ?"
#: When ``claim_next`` found nothing: the first instant at which an active task could become
#: claimable without any write (a retry falling due, a live claim of this epoch lapsing; the
#: claim query's own predicate, turned into a time). ``:now`` for a row the predicate already
#: admits (the record refused it), ``NULL`` without active tasks.
_NEXT_CLAIMABLE = (
    f"SELECT min(CASE WHEN claim_token IS NOT NULL AND claim_epoch = :epoch"
    f" AND {_EXPIRES} > :now THEN max({_EXPIRES}, coalesce(retry_at_us, 0))"
    " WHEN retry_at_us > :now THEN retry_at_us ELSE :now END)"
    f" FROM tritask_tasks WHERE {_ACTIVE}"
)
#: ``_check_capacity``: whether the id exists, the number of tasks and the scope's active
#: tasks (each count only when its limit is set). The active count is read from the index
#: ``tritask_tasks_active_scope`` (scope, status) alone (schema 5), as one range of it: with
#: ``status IN (…)`` as the index's key SQLite builds an ephemeral table of the two values on
#: every execution (an ``OpenEphemeral``, a b-tree created and filled: about a tenth of the
#: creation's work in SQLite, measured with callgrind). The two active statuses are the only
#: ones between ``'input_required'`` and ``'working'``, and the ``IN`` stays as the filter.
_ID_TAKEN = "(SELECT 1 FROM tritask_tasks WHERE task_id = ?1)"
_ALL_TASKS = "(SELECT count(*) FROM tritask_tasks)"
_SCOPE_ACTIVE = (
    f"(SELECT count(*) FROM tritask_tasks WHERE scope = ?4 AND {_ACTIVE}"
    " AND status >= 'input_required' AND status <= 'working')"
)
_CAPACITY = (
    f"SELECT EXISTS {_ID_TAKEN}, CASE WHEN ?2 THEN {_ALL_TASKS} END,"
    f" CASE WHEN ?3 THEN {_SCOPE_ACTIVE} END"
)
#: ``_CAPACITY``'s decision as one value for the writer process: ``1`` when the id is new and
#: both limits (``NULL``: none) leave room (else the store decides the creation itself).
_CAPACITY_ROOM = (
    f"SELECT NOT EXISTS {_ID_TAKEN}"
    f" AND CASE WHEN ?2 IS NULL THEN 1 ELSE {_ALL_TASKS} < ?2 END"
    f" AND CASE WHEN ?3 IS NULL THEN 1 ELSE {_SCOPE_ACTIVE} < ?3 END"
)
#: The statements the writer process runs (see :mod:`._writer`), by their index there.
_WRITER_STATEMENTS: Final = (
    _INSERT_PLAIN,
    _INSERT_TASK,
    _PLANNED_PLAIN,
    _PLANNED_UPDATE,
    _INSERT_EVENT,
    _CAPACITY_ROOM,
)
_W_INSERT_PLAIN, _W_INSERT_TASK, _W_PLANNED_PLAIN, _W_PLANNED_UPDATE, _W_EVENT, _W_ROOM = range(6)
#: The ledger row of a planned settle the writer process may have committed before it failed.
_PLANNED_SEEN = (
    "SELECT 1 FROM tritask_task_events WHERE task_id = ? AND event_id = ?"
    " AND event_revision = ? AND committed_at_us = ?"
)
_CLAIM_TOKEN = "SELECT claim_token FROM tritask_tasks WHERE task_id = ?"
log = logging.getLogger("tritask_sqlite")

_CLEAR_CLAIM = (
    "UPDATE tritask_tasks SET claim_owner = NULL, claim_token = NULL,"
    " claim_expires_at_us = NULL, claim_epoch = NULL, claim_follows = 0 WHERE task_id = ?"
)


class StoreLocked(StoreError):
    """Another process holds the store file's lock in a conflicting mode."""


class ReadOnlyStore(StoreError):
    """A write was asked of a store opened with ``read_only=True``."""


@attrs.frozen
class _Row:
    """A decoded, validated task row."""

    snapshot: Snapshot
    scope: str
    generation: int
    claim: Lease | None
    queued_message: str | None = None
    """The JSON text of the status message the first claim gives back (queued tasks only)."""
    concurrency: Concurrency | None = None


@attrs.frozen
class _Insert:
    """A prepared insertion: ``body`` (returns the creation instant, the claim if any, and the
    row exactly as inserted; one writing statement, see ``SqliteStore._inserter``), and the
    snapshot for a creation instant."""

    body: Callable[[sqlite3.Connection, int], tuple[int, Lease | None, tuple[object, ...]]]
    snapshot: Callable[[int, bool], Snapshot]
    """The stored snapshot, given the creation instant and whether it was claimed."""
    written: Callable[[int], tuple[tuple[int, Lease | None, tuple[object, ...]], list[Step]]] | None
    """For the writer process (a creation that is always claimed, without a concurrency key):
    at a clock reading, what ``body`` returns and the steps that write it; ``None`` otherwise."""
    reconcile: Callable[
        [tuple[int, Lease | None, tuple[object, ...]], sqlite3.Connection, int],
        tuple[int, Lease | None, tuple[object, ...]],
    ]
    """``body`` after the writer left the creation undecided: first whether the writer had
    committed it after all (the row holds the new claim's token), else decided afresh."""


@attrs.frozen
class _Recent:
    """A row this store inserted claimed, exactly as stored (``_COLUMNS`` order), with the
    store's own copy of its snapshot and the claim it holds.

    Why: settling is the hot path of every task, and decoding the row, running the reducer and
    encoding the result inside the serialised section cost more than the commit itself. When
    the stored row is still exactly this one under the write reservation (every column equal,
    the record text byte for byte: the planned ``UPDATE`` matches nothing otherwise), its
    snapshot is this one, so the settle can be planned before the operation is queued (see
    ``SqliteStore._plan_settle``).
    """

    row: tuple[object, ...]
    snapshot: Snapshot
    lease: Lease


@attrs.frozen
class _Planned:
    """A settle computed from a remembered row, valid only if the stored row is still ``row``."""

    row: tuple[object, ...]
    lease: Lease
    record: str
    effects: str
    transition: Transition


def _dump(value: object) -> str:
    """Canonical JSON text (scopes): sorted keys, compact, ASCII (any Python string survives
    UTF-8), so that text equality in SQL is JSON equality."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _record_text(value: object) -> str:
    """The stored text of a record, an event or effects (see :func:`stored_text`). A record's
    text is only ever compared with text this store wrote (the planned settle's match of the
    whole row), never with another encoder's."""
    return stored_text(value)


def _new_record(task: Task, work: Work) -> tuple[Snapshot, JSONObject]:
    """The revision-0 record of a new task and a view of its JSON (sharing the snapshot's: read
    it, never mutate it; :class:`InvalidTask` when it is not one)."""
    try:
        snapshot = initial_snapshot(task, work)
        return snapshot, snapshot_json_view(snapshot)
    except (TypeError, ValueError) as exc:
        raise InvalidTask(str(exc)) from exc


def _event_texts(event: Event) -> tuple[str, str]:
    """An event's canonical JSON (what replays compare) and its stored text, computed before
    the operation is queued."""
    document = event.json_view()
    return canonical_json(document), _record_text(document)


@functools.lru_cache(maxsize=1024)
def _scope_text(key: str) -> str:
    """The stored text of a scope key (cached: a pure function of the key, and most creations
    of a server share a handful of scopes)."""
    return _dump({"version": 1, "value": json.loads(key)})


def _scope_key(text: object) -> str:
    if not isinstance(text, str):
        raise CorruptRecord("the scope column is not text")
    return _scope_key_of(text)


@functools.lru_cache(maxsize=1024)
def _scope_key_of(text: str) -> str:
    """The checked key of a scope text (cached: a pure function of the text; refusals raise
    every time, they are not cached)."""
    envelope = json.loads(text)
    if (
        not isinstance(envelope, dict)
        or set(envelope) != {"version", "value"}
        or type(envelope["version"]) is not int
        or envelope["version"] != 1
    ):
        raise CorruptRecord("the scope is not a version-1 scope envelope")
    if _dump(envelope) != text:
        raise CorruptRecord("the scope is not in canonical form")
    return canonical_json(envelope["value"])


def _same(column: object, value: object) -> bool:
    """Exact equality for projections (``1``, ``1.0`` and ``True`` all differ)."""
    return type(column) is type(value) and column == value


_NULL_AT: Final = tuple(i for i, name in enumerate(_COLUMN_NAMES) if name in _NULL_COLUMNS)
_ALL_NULL: Final = (None,) * len(_NULL_AT)
_nulls_of = operator.itemgetter(*_NULL_AT)
_plain_of = operator.itemgetter(
    *(i for i, name in enumerate(_COLUMN_NAMES) if name not in _NULL_COLUMNS)
)


def _is_plain(row: tuple[object, ...]) -> bool:
    """Whether the row's ``_NULL_COLUMNS`` are all NULL (``_INSERT_PLAIN``, ``_PLANNED_PLAIN``).
    The positions are derived from ``_COLUMNS``, so the two cannot drift apart."""
    return bool(_nulls_of(row) == _ALL_NULL)


def _plain_row(row: tuple[object, ...]) -> tuple[object, ...]:
    """The row's values but its ``_NULL_COLUMNS`` (``_COLUMNS`` order)."""
    plain: tuple[object, ...] = _plain_of(row)
    return plain


def _expired(snapshot: Snapshot, now: int) -> bool:
    expires_at = snapshot.task.expires_at
    return expires_at is not None and now >= expires_at


#: The version and variant bits of a version 4 UUID (RFC 9562), as ``uuid.UUID`` sets them.
_UUID4_CLEAR: Final = ~((0xF000 << 64) | (0xC000 << 48))
_UUID4_SET: Final = (4 << 76) | (0x8000 << 48)


def _uuid4_text(bits: int) -> str:
    """``str(uuid.UUID(int=bits, version=4))`` without building the ``UUID`` (its checks cost
    more than the formatting, once per new task)."""
    text = f"{bits & _UUID4_CLEAR | _UUID4_SET:032x}"
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


def _stamp(now: int) -> int:
    """``now`` as a new task's creation instant (a clock reading outside the instants a task can
    hold is refused)."""
    if not 0 <= now <= MAX_INSTANT:
        raise InvalidTask("the store clock is outside the instants a task can hold")
    return now


def _instant(now: object) -> int:
    if type(now) is not int:
        raise TypeError("the store clock must return an int of microseconds")
    return now


def _database_path(path: str | os.PathLike[str]) -> str:
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError("the SQLite store path must be a str or an os.PathLike[str]")
    if text in ("", ":memory:") or text.startswith("file::memory:"):
        raise ValueError(
            f"the SQLite store needs a database file, not {text!r}: an in-memory database is "
            "not durable (use the memory: store instead)"
        )
    return os.path.realpath(text)


if sys.platform == "win32":  # pragma: no cover - tritask's durable store targets POSIX hosts

    def _lock_file(path: str, *, exclusive: bool) -> int | None:
        if exclusive:
            raise StoreLocked("exclusive=True needs POSIX flock; open with exclusive=False")
        return None

else:
    import fcntl

    def _lock_file(path: str, *, exclusive: bool) -> int | None:
        """Hold ``PATH.lock`` for the store's life: one exclusive opener, or any shared ones.

        The kernel drops the lock when the process dies, which is what lets an exclusive
        successor treat every earlier claim as dead. Lock files are never deleted (unlinking one
        while another process holds it would let two "exclusive" owners coexist).
        """
        lock_path = path + ".lock"
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreLocked(
                f"{path!r} is locked by another process ({lock_path}): "
                + (
                    "an exclusive store needs it to itself; stop the other process first"
                    if exclusive
                    else "it is open exclusively (tritask serve); stop it or share it by "
                    "opening every store with exclusive=False"
                )
            ) from None
        except BaseException:
            os.close(fd)
            raise
        return fd


def _close(conn: sqlite3.Connection | None, lock_fd: int | None) -> None:
    try:
        if conn is not None:
            conn.close()
    finally:
        if lock_fd is not None:
            os.close(lock_fd)


def _is_busy(exc: sqlite3.Error) -> bool:
    return exc.sqlite_errorcode & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


@final
class SqliteStore:
    """The durable store on one SQLite file. ``scope`` is required; limits accept ``None``.

    Open it with ``async with`` (or ``await store.open()`` and ``await store.aclose()``).
    Options: ``clock`` (tests only: µs readings; production uses the database clock),
    ``exclusive`` (lock the file to this process and advance the boot epoch),
    ``synchronous`` (``"FULL"``: a commit survives power loss; ``"NORMAL"``: faster, survives
    application crashes), ``busy_timeout_ms`` (how long a write waits for another process's
    writer), ``reap_batch_size`` (aggregates deleted per :meth:`reap`), ``create`` (``False``:
    open only an existing store, never make one, e.g. for the operator commands, which must
    not leave a new database behind a mistyped path), ``read_only`` (read without a lock and
    without writing anything, beside a server that holds the file exclusively; implies
    ``create=False``, excludes ``exclusive``), ``writer_process`` (commit the hot writes,
    creating a claimed task and settling one, through a child process with a connection and a
    GIL of its own: see :mod:`tritask_sqlite._writer`; the ``sqlite:`` URL form turns it on.
    Not read-only, nor on Windows; a writer that cannot start is logged and the store
    writes on its own connection).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        scope: Scope | None = None,
        clock: Clock | None = None,
        exclusive: bool = False,
        synchronous: str = "FULL",
        busy_timeout_ms: int = 5000,
        max_tasks: int | None = 10_000,
        max_active_tasks_per_scope: int | None = 100,
        reap_batch_size: int = 500,
        create: bool = True,
        read_only: bool = False,
        writer_process: bool = False,
    ) -> None:
        self._path = _database_path(path)
        if not isinstance(writer_process, bool):
            raise TypeError("writer_process must be a bool")
        # POSIX only: the child gets its socket through ``pass_fds``.
        self._writer_wanted = writer_process and not read_only and sys.platform != "win32"
        self._writer: WriterProcess | None = None
        if not isinstance(create, bool):
            raise TypeError("create must be a bool")
        if not isinstance(read_only, bool):
            raise TypeError("read_only must be a bool")
        if read_only and exclusive:
            raise ValueError("a read-only store cannot be exclusive (it takes no lock)")
        self._read_only = read_only
        self._create = create and not read_only
        self._scope = require_scope(scope, store="SqliteStore")
        if clock is not None and not callable(clock):
            raise TypeError("clock must be None (the database clock) or a callable returning µs")
        self._clock = clock
        if not isinstance(exclusive, bool):
            raise TypeError("exclusive must be a bool")
        self._exclusive = exclusive
        if not isinstance(synchronous, str) or synchronous.upper() not in _SYNCHRONOUS:
            raise ValueError(
                f"synchronous must be one of {', '.join(_SYNCHRONOUS)} (OFF would lose "
                "committed claims and results on power loss)"
            )
        self._synchronous = synchronous.upper()
        self._busy_timeout_ms = check_positive_int(busy_timeout_ms, "busy_timeout_ms")
        self._max_tasks = check_limit(max_tasks, "max_tasks")
        self._max_active = check_limit(max_active_tasks_per_scope, "max_active_tasks_per_scope")
        self._reap_batch = check_positive_int(reap_batch_size, "reap_batch_size")
        self._lock = trio.Lock()
        self._state: Literal["new", "open", "closed"] = "new"
        self._conn: sqlite3.Connection | None = None
        self._lane: Lane | None = None
        self._recent: dict[str, _Recent] = {}
        # Claim tokens of new tasks: random version 4 UUIDs from a generator seeded by the
        # system's, since ``uuid4()`` is a system call per task on the hot path (which hands
        # the GIL away). They fence this store's own writers; nothing outside sees them.
        self._tokens = random.Random(os.urandom(32))
        self._queue_listeners: list[Callable[[], None]] = []
        # claim_next's memory of finding nothing (see _no_claim_yet): the store's write count
        # when it was asked, the file's data_version, and until when nothing can turn up.
        self._writes = 0
        self._no_claim: tuple[int, int, int] | None = None
        self._lock_fd: int | None = None
        self._store_uuid = ""
        self._epoch = 0
        self._id = ""
        self._feed = ChangeFeed()

    def __repr__(self) -> str:
        mode = "read-only" if self._read_only else "exclusive" if self._exclusive else "shared"
        return f"<SqliteStore {self._path!r} {mode} {self._state} epoch={self._epoch}>"

    @property
    def path(self) -> str:
        return self._path

    @property
    def store_id(self) -> str:
        """The store's persisted UUID (empty until opened)."""
        return self._store_uuid

    @property
    def boot_epoch(self) -> int:
        """The boot epoch this store runs in (advanced by every exclusive open)."""
        return self._epoch

    # -- lifecycle ----------------------------------------------------------------------------

    async def open(self) -> Self:
        """Lock, inspect (refusing foreign or newer files untouched), migrate, then serve."""
        if self._state != "new":
            raise RuntimeError(f"a SqliteStore opens once (this one is {self._state})")
        async with self._lock:
            conn, lock_fd, info = await trio.to_thread.run_sync(self._open_sync)
            if self._closed():  # aclose() ran while the thread was opening
                await trio.to_thread.run_sync(_close, conn, lock_fd)
                raise trio.ClosedResourceError("the store was closed while opening")
            self._conn, self._lock_fd = conn, lock_fd
            self._lane = Lane(conn)
            self._store_uuid, self._epoch = info.store_id, info.boot_epoch
            self._id = self._instance_id(info.boot_epoch)
            if self._writer_wanted:
                try:
                    self._writer = await self._start_writer()
                except BaseException:
                    self._conn = self._lock_fd = self._lane = None
                    with trio.CancelScope(shield=True):
                        await trio.to_thread.run_sync(_close, conn, lock_fd)
                    raise
            self._state = "open"
        return self

    async def _start_writer(self) -> WriterProcess | None:
        writer = WriterProcess(
            self._path,
            busy_timeout_ms=self._busy_timeout_ms,
            synchronous=self._synchronous,
            statements=_WRITER_STATEMENTS,
            clock=None if self._clock is None else self._read_clock,
        )
        try:
            await writer.start()
        except WriterUnavailable as exc:
            log.warning("%s; %r writes on its own connection", exc, self._path)
            return None
        return writer

    @property
    def writer(self) -> WriterProcess | None:
        """The writer process while it is used (``writer_process=True``), else ``None``."""
        writer = self._writer
        return writer if writer is not None and writer.usable else None

    def _instance_id(self, epoch: int) -> str:
        """The identity accesses and leases carry: the store's UUID and a boot epoch."""
        return f"sqlite:{self._store_uuid}/{epoch}"

    def _open_sync(self) -> tuple[sqlite3.Connection, int | None, schema.SchemaInfo]:
        if self._read_only:
            return self._open_read_only_sync()
        if not self._create and not os.path.isfile(self._path):
            raise schema.StoreSchemaError(f"no tritask store at {self._path!r}: no such file")
        lock_fd = _lock_file(self._path, exclusive=self._exclusive)
        conn: sqlite3.Connection | None = None
        try:
            conn = sqlite3.connect(
                self._path,
                timeout=self._busy_timeout_ms / 1000,
                isolation_level=None,
                check_same_thread=False,
            )
            conn.execute(f"PRAGMA busy_timeout = {self._busy_timeout_ms}")
            found = schema.inspect(conn, self._path)  # read-only: refuse before writing anything
            if found is None and not self._create:
                raise schema.StoreSchemaError(
                    f"no tritask store at {self._path!r}: the file is an empty database"
                )
            conn.execute("PRAGMA foreign_keys = ON")
            conn.execute(f"PRAGMA synchronous = {self._synchronous}")
            mode = self._enter_wal(conn)
            if str(mode).lower() != "wal":
                raise schema.StoreSchemaError(
                    f"{self._path!r} cannot use WAL journaling (got {mode!r}); a network or "
                    "read-only filesystem cannot host the store"
                )
            info = schema.install(conn, self._path, advance_epoch=self._exclusive)
            if conn.execute("PRAGMA foreign_keys").fetchone()[0] != 1:
                raise schema.StoreSchemaError("this SQLite build cannot enforce foreign keys")
            return conn, lock_fd, info
        except BaseException:
            _close(conn, lock_fd)
            raise

    def _open_read_only_sync(self) -> tuple[sqlite3.Connection, None, schema.SchemaInfo]:
        """A ``mode=ro`` connection: no lock, no migration, no epoch, nothing written."""
        if not os.path.isfile(self._path):
            raise schema.StoreSchemaError(f"no tritask store at {self._path!r}: no such file")
        uri = "file:" + urllib.parse.quote(self._path) + "?mode=ro"
        conn = sqlite3.connect(
            uri,
            uri=True,
            timeout=self._busy_timeout_ms / 1000,
            isolation_level=None,
            check_same_thread=False,
        )
        try:
            conn.execute(f"PRAGMA busy_timeout = {self._busy_timeout_ms}")
            info = schema.inspect(conn, self._path)
            if info is None:
                raise schema.StoreSchemaError(
                    f"no tritask store at {self._path!r}: the file is an empty database"
                )
            if info.version != schema.SCHEMA_VERSION:
                raise schema.StoreSchemaError(
                    f"{self._path!r} has schema version {info.version}, older than this "
                    f"tritask_sqlite ({schema.SCHEMA_VERSION}); a read-only open does not "
                    f"migrate: run tritask migrate --store sqlite:{self._path} first"
                )
            return conn, None, info
        except BaseException:
            conn.close()
            raise

    def _enter_wal(self, conn: sqlite3.Connection) -> object:
        """``PRAGMA journal_mode = WAL``, retried within ``busy_timeout``.

        Switching a fresh file to WAL needs it to itself, and SQLite reports ``SQLITE_BUSY``
        at once, without its busy handler, while another process or connection opens the same
        new file: several stores starting together on one path would fail at random.
        """
        deadline = time.monotonic() + self._busy_timeout_ms / 1000
        pause = 0.001
        while True:
            try:
                return conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            except sqlite3.OperationalError as exc:
                if not _is_busy(exc) or time.monotonic() >= deadline:
                    raise
            time.sleep(pause)  # in the opening worker thread
            pause = min(pause * 2, 0.05)

    async def aclose(self) -> None:
        """Close the connection and drop the file lock; waits for a running operation."""
        if self._state == "closed":
            await trio.lowlevel.checkpoint()
            return
        self._state = "closed"
        self._feed.close()
        with trio.CancelScope(shield=True):
            async with self._lock:
                writer, self._writer = self._writer, None
                if writer is not None:
                    await writer.aclose()
                if self._lane is not None:
                    await self._lane.wait_idle()
                conn, lock_fd = self._conn, self._lock_fd
                self._conn = self._lock_fd = None
                self._lane = None
                if conn is not None or lock_fd is not None:
                    await trio.to_thread.run_sync(_close, conn, lock_fd)

    async def __aenter__(self) -> Self:
        if self._state == "new":
            await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def _closed(self) -> bool:
        return self._state == "closed"

    def _ensure_open(self) -> None:
        if self._state == "new":
            raise trio.ClosedResourceError("the store is not open: use `async with store`")
        if self._state == "closed":
            raise trio.ClosedResourceError("the store is closed")

    # -- the thread hop -----------------------------------------------------------------------

    async def _call(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn(connection)`` alone in a worker thread, in arrival order (see :mod:`._lane`)."""
        self._ensure_open()
        assert self._lane is not None
        return await self._lane.run(fn)

    async def _transact(
        self,
        body: Callable[[sqlite3.Connection, int], T],
        *,
        write: bool,
        single: bool = False,
        announce: bool = False,
        frees_nothing: bool = False,
    ) -> T:
        """``body(conn, now)`` in the lane's group transaction (see :mod:`._lane`): committed
        with the operations queued beside it, in a savepoint of its own unless ``single``
        (it runs at most one writing statement, which SQLite undoes alone if it fails).

        ``frees_nothing``: a write that can make no task claimable (claiming, renewing), so
        ``claim_next`` may keep its memory of having found nothing."""
        self._ensure_open()
        if write and self._read_only:
            raise ReadOnlyStore(f"{self._path!r} was opened read-only; this operation writes")
        assert self._lane is not None
        if write and not frees_nothing:
            self._writes += 1  # in arrival order, as the lane runs them
        try:
            return await self._lane.run(
                functools.partial(self._operation, body),
                kind="write" if write else "read",
                atomic=single,
                committed=self._announce if announce else None,
            )
        except BaseException as exc:
            # A batch that failed may have shown its operations state it never committed.
            self._no_claim = None
            if isinstance(exc, sqlite3.OperationalError) and _is_busy(exc):
                raise DatabaseBusy(f"the database stayed locked by another writer: {exc}") from exc
            raise

    def _announce(self, result: object) -> None:
        """A transition's result, in the trio thread once its batch has committed and before
        any caller of the batch is woken, in commit order: an applied event is a change."""
        if isinstance(result, Transition) and result.outcome == "applied":
            self._feed.announce_snapshot(result.snapshot)

    def changes(self) -> AsyncGenerator[TaskChange, None]:
        """Every change committed through this store object from now on (``OffersChanges``),
        in commit order: other processes on the same file are not heard."""
        return self._feed.changes()

    def _operation(
        self, body: Callable[[sqlite3.Connection, int], T], conn: sqlite3.Connection
    ) -> T:
        """In the worker thread, inside the batch's transaction: ``body`` at the clock's now."""
        clock = self._clock
        return body(conn, _host_clock() if clock is None else _instant(clock()))

    def _read_clock(self, conn: sqlite3.Connection | None = None) -> int:
        if self._clock is not None:
            return _instant(self._clock())
        return _host_clock()

    async def now(self) -> int:
        """The store's clock (µs): the database's, or the injected test clock."""
        self._ensure_open()
        await trio.lowlevel.checkpoint()
        return self._read_clock()

    # -- rows ---------------------------------------------------------------------------------

    def _load(self, conn: sqlite3.Connection, task_id: str) -> _Row | None:
        raw = conn.execute(f"{_SELECT} WHERE task_id = ?", (task_id,)).fetchone()
        return None if raw is None else self._decode(raw)

    def _load_seen(
        self, conn: sqlite3.Connection, task_id: str, event_id: str
    ) -> tuple[_Row | None, bool]:
        """The row, and whether ``event_id`` is in its ledger, in one statement."""
        raw = conn.execute(_SELECT_SEEN, (event_id, task_id)).fetchone()
        if raw is None:
            return None, False
        return self._decode(raw[:-1]), bool(raw[-1])

    def _decode(self, raw: tuple[Any, ...]) -> _Row:
        """Decode a row and check every projection and the claim shape against the record."""
        (task_id, record_version, record, scope, revision, status, created_at, expires_at) = raw[:8]
        (retry_at, owner, token, generation, claim_expires_at, claim_epoch) = raw[8:14]
        (queued_message, concurrency_key, concurrency_limit, follows, owner_expiry) = raw[14:19]
        try:
            if not isinstance(record, str):
                raise CorruptRecord("the record column is not text")
            snapshot = snapshot_from_json(loads(record))
            task = snapshot.task
            for column, stored, actual in (
                ("task_id", task_id, task.id),
                ("record_version", record_version, snapshot_record_version(snapshot)),
                ("revision", revision, snapshot.revision),
                ("status", status, task.status.value),
                ("created_at_us", created_at, task.created_at),
                ("expires_at_us", expires_at, task.expires_at),
                ("retry_at_us", retry_at, snapshot.available_at),
            ):
                if not _same(stored, actual):
                    raise CorruptRecord(f"the {column} column disagrees with the record")
            if type(generation) is not int or generation < 0:
                raise CorruptRecord("lease_generation is not an int >= 0")
            if follows not in (0, 1) or type(follows) is not int:
                raise CorruptRecord("claim_follows is not 0 or 1")
            claim: Lease | None = None
            if (owner, token, claim_expires_at, claim_epoch) != (None, None, None, None):
                if not (
                    isinstance(owner, str)
                    and owner
                    and isinstance(token, str)
                    and len(token) == 36
                    and type(claim_expires_at) is int
                    and type(claim_epoch) is int
                    and generation > 0
                ):
                    raise CorruptRecord("the claim columns are not a valid claim")
                if follows:
                    # The owner's lease row is the claim's expiry; a following claim whose row
                    # is gone is expired (as _EXPIRES says in SQL).
                    claim_expires_at = 0 if owner_expiry is None else owner_expiry
                    if type(claim_expires_at) is not int:
                        raise CorruptRecord("the owner's lease expiry is not an int")
                claim = Lease(
                    store_id=self._instance_id(claim_epoch),
                    task_id=task.id,
                    owner_id=owner,
                    token=token,
                    generation=generation,
                    expires_at=claim_expires_at,
                    epoch=claim_epoch,
                )
            elif follows:
                raise CorruptRecord("claim_follows is set without a claim")
            if queued_message is not None:
                if not isinstance(queued_message, str):
                    raise CorruptRecord("queued_message is not text")
                message = json.loads(queued_message)
                if message is not None and not isinstance(message, str):
                    raise CorruptRecord("queued_message is not a status message")
            concurrency = None
            if concurrency_key is not None or concurrency_limit is not None:
                if not isinstance(concurrency_key, str) or type(concurrency_limit) is not int:
                    raise CorruptRecord("the concurrency columns are not a key and a limit")
                concurrency = Concurrency(concurrency_key, concurrency_limit)
            return _Row(snapshot, _scope_key(scope), generation, claim, queued_message, concurrency)
        # CorruptRecord and CodecError are ValueErrors; RecursionError: JSON nested deeper than
        # the standard library's decoder recurses (schema 5 no longer runs json_valid on writes).
        except (ValueError, TypeError, RecursionError) as exc:
            raise CorruptStore(str(task_id), str(exc)) from exc

    def _ledger(self, conn: sqlite3.Connection, row: _Row) -> list[LedgerEntry]:
        """The task's whole ledger, validated against itself and the record."""
        rows = conn.execute(
            "SELECT event_id, row_format, event, event_kind, event_revision, committed_at_us,"
            " effects FROM tritask_task_events WHERE task_id = ? ORDER BY event_revision",
            (row.snapshot.task.id,),
        ).fetchall()
        return decode_ledger(row.snapshot, rows)

    def _visible(
        self, row: _Row | None, task_id: str, access: Access, now: int, allowed: frozenset[Action]
    ) -> _Row | None:
        """Visibility first (``None``: absent, other store/scope, expired), then the action."""
        if (
            row is None
            or access.store_id != self._id
            or access.scope != row.scope
            or _expired(row.snapshot, now)
        ):
            return None
        if access.task_id != task_id or access.action not in allowed:
            raise UnauthorizedAction(f"a {access.action.value} access cannot do this")
        return row

    def _live(self, claim: Lease, now: int) -> bool:
        """A claim is live until its deadline, and only if made in this boot epoch."""
        return claim.epoch == self._epoch and now < claim.expires_at

    def _check_lease(self, row: _Row, lease: object, now: int) -> None:
        if not isinstance(lease, Lease) or row.claim != lease or not self._live(lease, now):
            raise StaleLease("the lease is not the live claim of this task")

    def _lease_row(self, conn: sqlite3.Connection, lease: Lease) -> _Row:
        if not isinstance(lease, Lease) or lease.store_id != self._id:
            raise StaleLease("the lease is not from this store")
        row = self._load(conn, lease.task_id)
        if row is None:
            raise StaleLease("the leased task no longer exists")
        return row

    # -- requests -----------------------------------------------------------------------------

    async def authorize(self, ctx: object, action: Action, task_id: str) -> Access:
        await trio.lowlevel.checkpoint()
        self._ensure_open()
        return new_access(self._id, self._scope, ctx, action, task_id)

    async def create(self, task: Task, work: Work, access: Access) -> Snapshot:
        insert = self._inserter(task, work, access)
        created_at, _, _ = await self._transact(insert.body, write=True, single=True)
        return insert.snapshot(created_at, False)

    async def create_claimed(
        self, task: Task, work: Work, access: Access, owner_id: str, lease_ms: int
    ) -> Claimed:
        """``create`` and ``claim`` in one IMMEDIATE transaction: nobody adopts it in between."""
        return await self._create_claimed(task, work, access, owner_id, lease_ms, stamp=False)

    async def create_claimed_stamped(
        self, task: Task, work: Work, access: Access, owner_id: str, lease_ms: int
    ) -> Claimed:
        """``create_claimed`` with ``createdAt``/``lastUpdatedAt`` read from the store's clock
        inside the creating transaction (the given task's instants are placeholders)."""
        return await self._create_claimed(task, work, access, owner_id, lease_ms, stamp=True)

    async def _create_claimed(
        self, task: Task, work: Work, access: Access, owner_id: str, lease_ms: int, *, stamp: bool
    ) -> Claimed:
        claim = (check_owner(owner_id), check_positive_ms(lease_ms, "lease_ms"))
        insert, now = self._creation(task, work, access, stamp=stamp, claim=claim)
        created_at, lease, row = await self._insert(insert, now)
        assert lease is not None
        snapshot = insert.snapshot(created_at, True)
        self._remember(_Recent(row, clone_snapshot(snapshot), lease))
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
        """Create (stamped) and claim for ``owner_id`` when its key allows, else store it
        queued (see :class:`~tritask.tasks.store.Queues`), in one transaction."""
        owner, lease_ms, concurrency = check_submit(owner_id, lease_ms, concurrency)
        claim = None if owner is None else (owner, lease_ms)
        insert, now = self._creation(
            task, work, access, stamp=True, claim=claim, queue=True, concurrency=concurrency
        )
        created_at, lease, row = await self._insert(insert, now)
        snapshot = insert.snapshot(created_at, lease is not None)
        if lease is None:
            self._signal()
            return snapshot
        self._remember(_Recent(row, clone_snapshot(snapshot), lease))
        return Claimed(snapshot, lease)

    def _creation(
        self,
        task: Task,
        work: Work,
        access: Access,
        *,
        stamp: bool,
        claim: tuple[str, int] | None,
        queue: bool = False,
        concurrency: Concurrency | None = None,
    ) -> tuple[_Insert, int | None]:
        """The insertion and, for one the writer process will write, the clock reading it is
        written at. That one is stamped first, as the memory store does: its record is then
        encoded once, with its instants, instead of cut around them for the transaction to
        fill in, and its snapshot needs no stamping afterwards (the writer's clock reading
        is taken in this thread either way)."""
        writer = self._writer
        if not (
            stamp
            and claim is not None
            and concurrency is None
            and writer
            and writer.usable
            and isinstance(task, Task)
            and task.created_at == task.last_updated_at  # else refused by the inserter
        ):
            insert = self._inserter(
                task, work, access, stamp=stamp, claim=claim, queue=queue, concurrency=concurrency
            )
            return insert, None
        now = _stamp(self._read_clock())
        try:
            stamped = revise(task, created_at=now, last_updated_at=now)
        except (TypeError, ValueError) as exc:  # e.g. the TTL now ends past the last instant
            raise InvalidTask(str(exc)) from exc
        return self._inserter(stamped, work, access, claim=claim, queue=queue), now

    async def _insert(
        self, insert: _Insert, now: int | None = None
    ) -> tuple[int, Lease | None, tuple[object, ...]]:
        """The creation, through the writer process when it can write it (see :mod:`._writer`;
        at ``now`` when given), else (or when it left it undecided) in the lane's
        transaction."""
        writer = self._writer
        if insert.written is not None and writer is not None and writer.usable:
            created, steps = insert.written(self._read_clock() if now is None else now)
            self._writes += 1
            if await writer.run(steps):
                return created
            return await self._transact(
                functools.partial(insert.reconcile, created), write=True, single=True
            )
        return await self._transact(insert.body, write=True, single=True)

    def listen_queue(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback()`` after each commit of this store object that may make a task
        claimable (in this process only: other processes on the file poll)."""
        listeners = self._queue_listeners
        listeners.append(callback)
        return lambda: listeners.remove(callback) if callback in listeners else None

    def _signal(self) -> None:
        for callback in list(self._queue_listeners):
            callback()

    def _remember(self, recent: _Recent) -> None:
        """Keep a claimed row for a planned settle (trio thread only; bounded, oldest out)."""
        remembered = self._recent
        if len(remembered) >= _RECENT_LIMIT:
            del remembered[next(iter(remembered))]
        remembered[recent.lease.task_id] = recent

    def _plan_settle(
        self, task_id: str, expected_revision: int, event: Event, lease: Lease
    ) -> _Planned | None:
        """The settle computed from the remembered row, outside the serialised section.

        Only for the common case (the lease is the remembered claim, the event applies); the
        row is taken out, so a plan is made at most once. The commit time is read from the
        store's clock here, before the write reservation (it still strictly increases per task:
        the row is verified unchanged); the lease is checked again under the reservation.
        Anything unusual returns ``None`` and the operation decides it all in the transaction.
        """
        recent = self._recent.pop(task_id, None)
        if (
            recent is None
            or recent.lease != lease
            or lease.epoch != self._epoch
            or recent.snapshot.revision != expected_revision
        ):
            return None
        snapshot = recent.snapshot
        committed_at = max(self._read_clock(), snapshot.task.last_updated_at + _COMMIT_STEP_US)
        try:
            result = apply(snapshot, event, committed_at)
        except Exception:  # the transaction decides it again and reports it properly
            return None
        if result.kind != "applied":
            return None
        new = result.snapshot
        return _Planned(
            row=recent.row,
            lease=lease,
            record=record_text(new),
            effects=_record_text(effects_to_json(result.effects)),
            transition=Transition(
                outcome="applied",
                snapshot=new,
                effects=result.effects,
                event_revision=new.revision,
                committed_at=committed_at,
            ),
        )

    def _inserter(
        self,
        task: Task,
        work: Work,
        access: Access,
        *,
        stamp: bool = False,
        claim: tuple[str, int] | None = None,
        queue: bool = False,
        concurrency: Concurrency | None = None,
    ) -> _Insert:
        """The insertion of a new task (claimed at generation 1 with ``claim``).

        Everything but the stamp is prepared here, outside the worker thread: the record, its
        JSON and the row. With ``stamp`` the body only writes ``now`` into the two instants of
        the prepared JSON and the row; the returned task is stamped the same way, afterwards.
        With ``queue`` (``submit``) a task that is not claimed is stored queued (its record
        says :data:`QUEUED_MESSAGE`), and a claim is made only if the ``concurrency`` key has
        room and no claimable task of it waits (decided in the transaction). It is always
        ``single`` (atomic): the limits and the key are checked by reads, and the ``INSERT``
        is its one writing statement, which SQLite undoes alone if it fails, so it needs no
        savepoint of its own (a ``SAVEPOINT`` and a ``RELEASE`` were two more statements on
        the database thread per creation). A write added to the checks must make it
        non-``single`` again.
        """
        self._ensure_open()
        check_create_access(access, self._id, task)
        snapshot, document = _new_record(task, work)  # refuses an invalid task
        scope = _scope_text(access.scope)
        limited = self._max_tasks is not None or self._max_active is not None
        ttl_us = None if task.ttl_ms is None else task.ttl_ms * 1000
        # Drawn here: in the worker thread its system call would hand the GIL away in the
        # middle of the serialised section.
        token = _uuid4_text(self._tokens.getrandbits(128))
        key = None if concurrency is None else concurrency.key
        limit = None if concurrency is None else concurrency.limit
        start_message = None
        queued_snapshot: Snapshot | None = None
        queued_document: JSONObject | None = None
        if queue and (claim is None or concurrency is not None):  # it may be queued
            start_message = _record_text(task.status_message)
            queued_snapshot = revise(
                snapshot, task=revise(snapshot.task, status_message=QUEUED_MESSAGE)
            )
            queued_document = snapshot_json_view(queued_snapshot)
        # Which records the body may write: the task as given (claimed), queued, or either.
        decide = queue and claim is not None and concurrency is not None
        claimed_text = None if queue and claim is None else self._prepared(document, stamp, token)
        queued_text = (
            None if queued_document is None else self._prepared(queued_document, stamp, token)
        )

        def build(
            now: int, created_at: int, claimed: bool
        ) -> tuple[int, Lease | None, tuple[object, ...]]:
            """The creation instant, the claim and the row, at the clock reading ``now``."""
            lease = None
            if claimed:
                assert claim is not None
                owner_id, lease_ms = claim
                lease = Lease(
                    store_id=self._id,
                    task_id=task.id,
                    owner_id=owner_id,
                    token=token,
                    generation=1,
                    expires_at=now + lease_ms * 1000,
                    epoch=self._epoch,
                )
            prepared = claimed_text if lease is not None or not queue else queued_text
            assert prepared is not None
            text = prepared(created_at)
            row = (
                task.id,
                RECORD_VERSION,
                text,
                scope,
                0,
                task.status.value,
                created_at,
                None if ttl_us is None else created_at + ttl_us,
                None,
                *(
                    (None, None, 0, None, None)
                    if lease is None
                    else (lease.owner_id, lease.token, 1, lease.expires_at, lease.epoch)
                ),
                start_message if queue and lease is None else None,
                key,
                limit,
                0,
            )
            return created_at, lease, row

        def body(
            conn: sqlite3.Connection, now: int
        ) -> tuple[int, Lease | None, tuple[object, ...]]:
            created_at = _stamp(now) if stamp else task.created_at
            if limited:
                self._check_capacity(conn, task.id, scope)
            claimed = claim is not None and (
                not decide or (key is not None and self._key_has_room(conn, key, limit, now))
            )
            created = build(now, created_at, claimed)
            row = created[2]
            try:
                if _is_plain(row):
                    conn.execute(_INSERT_PLAIN, _plain_row(row))
                else:
                    conn.execute(_INSERT_TASK, row)
            except sqlite3.IntegrityError as exc:
                if exc.sqlite_errorcode == sqlite3.SQLITE_CONSTRAINT_PRIMARYKEY:
                    raise AlreadyExists(task.id) from None
                raise
            return created

        written = None
        if claim is not None and concurrency is None:  # always claimed: nothing to decide
            room = (task.id, self._max_tasks, self._max_active, scope)

            def written(
                now: int,
            ) -> tuple[tuple[int, Lease | None, tuple[object, ...]], list[Step]]:
                created = build(now, _stamp(now) if stamp else task.created_at, True)
                row = created[2]
                steps: list[Step] = [(_W_ROOM, room, CHECK_TRUE)] if limited else []
                if _is_plain(row):
                    steps.append((_W_INSERT_PLAIN, _plain_row(row), CHECK_NONE))
                else:
                    steps.append((_W_INSERT_TASK, row, CHECK_NONE))
                return created, steps

        def reconcile(
            created: tuple[int, Lease | None, tuple[object, ...]],
            conn: sqlite3.Connection,
            now: int,
        ) -> tuple[int, Lease | None, tuple[object, ...]]:
            lease = created[1]
            found = conn.execute(_CLAIM_TOKEN, (task.id,)).fetchone()
            if lease is not None and found is not None and found[0] == lease.token:
                return created  # the writer committed it before it failed
            return body(conn, now)

        def stamped(created_at: int, claimed: bool) -> Snapshot:
            """The stored record (the store keeps nothing in memory, so the caller may have
            it: it is built from the caller's own task and work)."""
            base = snapshot if claimed or queued_snapshot is None else queued_snapshot
            if created_at == task.created_at:
                return base
            task_at = revise(base.task, created_at=created_at, last_updated_at=created_at)
            return revise(base, task=task_at)

        return _Insert(body=body, snapshot=stamped, written=written, reconcile=reconcile)

    @staticmethod
    def _prepared(document: JSONObject, stamp: bool, token: str) -> Callable[[int], str]:
        """A function of the creation instant returning the record's stored text.

        With ``stamp`` the record is cut where its two instants go (the marker holds a fresh
        random token, so it cannot occur in the task's own JSON; were it to, the function
        encodes the record again), so the body only joins the pieces around the store's
        clock reading instead of encoding the record; without, the text is fixed.
        """
        if not stamp:
            text = _record_text(document)
            return lambda _now: text
        record_task = document["task"]
        assert isinstance(record_task, dict)
        marker = f"tritask-stamp-{token}"
        template = {**record_task, "createdAt": marker, "lastUpdatedAt": marker}
        pieces = _record_text({**document, "task": template}).split(_record_text(marker))

        def render(now: int) -> str:
            instant = format_instant(now)
            if len(pieces) == 3:
                quoted = f'"{instant}"'  # ASCII digits and "-:.TZ": its JSON string as is
                return f"{pieces[0]}{quoted}{pieces[1]}{quoted}{pieces[2]}"
            task = {**record_task, "createdAt": instant, "lastUpdatedAt": instant}
            return _record_text({**document, "task": task})

        return render

    def _key_has_room(
        self, conn: sqlite3.Connection, key: str, limit: int | None, now: int
    ) -> bool:
        """Whether a new task of ``key`` may be claimed at once: fewer than ``limit`` live
        claims and no claimable task of the key waiting (first in first out)."""
        assert limit is not None
        params = {"now": now, "epoch": self._epoch, "key": key}
        (running,) = conn.execute(
            "SELECT count(*) FROM tritask_tasks WHERE concurrency_key = :key"
            f" AND claim_token IS NOT NULL AND {_EXPIRES} > :now AND claim_epoch = :epoch",
            params,
        ).fetchone()
        if running >= limit:
            return False
        waiting = conn.execute(
            f"SELECT 1 FROM tritask_tasks WHERE concurrency_key = :key AND {_CLAIMABLE} LIMIT 1",
            params,
        ).fetchone()
        return waiting is None

    def _check_capacity(self, conn: sqlite3.Connection, task_id: str, scope: str) -> None:
        """The limits, checked after the id (an existing id is ``AlreadyExists`` even when full).

        One statement (``_CAPACITY``) reads the id and both counts: a statement's own cost in
        the worker thread (preparing the cursor, binding, stepping) is most of a lookup's.
        """
        total = 0 if self._max_tasks is None else 1  # ints: the sqlite3 module adapts a bool
        active_limit = 0 if self._max_active is None else 1
        exists, count, active = conn.execute(
            _CAPACITY, (task_id, total, active_limit, scope)
        ).fetchone()
        if exists:
            raise AlreadyExists(task_id)
        if self._max_tasks is not None and count >= self._max_tasks:
            raise CapacityExceeded("max_tasks")
        if self._max_active is not None and active >= self._max_active:
            raise CapacityExceeded("max_active_tasks_per_scope")

    async def get(self, task_id: str, access: Access) -> Snapshot | NotFound:
        self._ensure_open()
        if not isinstance(access, Access):
            raise TypeError("request authority needs an Access from authorize()")

        def body(conn: sqlite3.Connection, now: int) -> Snapshot | NotFound:
            row = self._visible(self._load(conn, task_id), task_id, access, now, _READ_ACTIONS)
            return NOT_FOUND if row is None else row.snapshot

        return await self._transact(body, write=False)

    # -- workers ------------------------------------------------------------------------------

    async def worker_snapshot(self, task_id: str, lease: Lease) -> Snapshot | NotFound:
        self._ensure_open()

        def body(conn: sqlite3.Connection, now: int) -> Snapshot | NotFound:
            row = self._load(conn, task_id)
            if row is None:
                return NOT_FOUND
            self._check_lease(row, lease, now)
            return row.snapshot

        return await self._transact(body, write=False)

    def _eligibility(
        self, row: _Row, now: int, conn: sqlite3.Connection | None = None
    ) -> Deferred | Unavailable | None:
        """Reference 3.6 order, then the task's concurrency key (counted on ``conn``);
        ``None`` means claimable now."""
        snapshot = row.snapshot
        if snapshot.task.status.is_terminal or snapshot.work is None:
            return UNAVAILABLE
        available_at = snapshot.available_at
        if available_at is not None and available_at > now:
            return Deferred(-(-(available_at - now) // 1000))
        if row.claim is not None and self._live(row.claim, now):
            return UNAVAILABLE
        if conn is not None and row.concurrency is not None:
            (running,) = conn.execute(
                "SELECT count(*) FROM tritask_tasks WHERE concurrency_key = :key"
                f" AND claim_token IS NOT NULL AND {_EXPIRES} > :now"
                " AND claim_epoch = :epoch",
                {"key": row.concurrency.key, "now": now, "epoch": self._epoch},
            ).fetchone()
            if running >= row.concurrency.limit:
                return UNAVAILABLE
        return None

    def _grant(
        self, conn: sqlite3.Connection, row: _Row, owner_id: str, lease_ms: int, now: int
    ) -> Claimed:
        lease = Lease(
            store_id=self._id,
            task_id=row.snapshot.task.id,
            owner_id=owner_id,
            token=str(uuid.uuid4()),
            generation=row.generation + 1,
            expires_at=now + lease_ms * 1000,
            epoch=self._epoch,
        )
        claim = (
            lease.owner_id,
            lease.token,
            lease.generation,
            lease.expires_at,
            lease.epoch,
            lease.task_id,
        )
        if row.queued_message is None:
            conn.execute(
                "UPDATE tritask_tasks SET claim_owner = ?, claim_token = ?, lease_generation = ?,"
                " claim_expires_at_us = ?, claim_epoch = ?, claim_follows = 0 WHERE task_id = ?",
                claim,
            )
            return Claimed(row.snapshot, lease)
        # The first claim of a queued task: it gets its own status message back (no new
        # revision: nothing happened to the task, it only started).
        snapshot = row.snapshot
        task = snapshot.task
        if task.status is TaskStatus.WORKING and task.status_message == QUEUED_MESSAGE:
            message = json.loads(row.queued_message)
            snapshot = revise(snapshot, task=revise(task, status_message=message))
        conn.execute(
            "UPDATE tritask_tasks SET record = ?, queued_message = NULL, claim_owner = ?,"
            " claim_token = ?, lease_generation = ?, claim_expires_at_us = ?, claim_epoch = ?,"
            " claim_follows = 0 WHERE task_id = ?",
            (record_text(snapshot), *claim),
        )
        return Claimed(snapshot, lease)

    async def claim(
        self, task_id: str, owner_id: str, lease_ms: int
    ) -> Claimed | Deferred | Unavailable | NotFound:
        self._ensure_open()
        owner_id, lease_ms = check_owner(owner_id), check_positive_ms(lease_ms, "lease_ms")

        def body(conn: sqlite3.Connection, now: int) -> Claimed | Deferred | Unavailable | NotFound:
            row = self._load(conn, task_id)
            if row is None:
                return NOT_FOUND
            verdict = self._eligibility(row, now, conn)
            return self._grant(conn, row, owner_id, lease_ms, now) if verdict is None else verdict

        return await self._transact(body, write=True)

    async def claim_next(self, owner_id: str, lease_ms: int) -> Claimed | None:
        """The next claimable task: the fewest live claims of its concurrency key first (no
        key: none), then the oldest by ``(created_at, task_id)``; full keys are passed over.

        SQLite cannot skip locked rows; it does not need to: the IMMEDIATE transaction already
        holds the single write slot, so the counts and the oldest available task are exact.
        """
        self._ensure_open()
        owner_id, lease_ms = check_owner(owner_id), check_positive_ms(lease_ms, "lease_ms")
        writes = self._writes

        def body(conn: sqlite3.Connection, now: int) -> Claimed | None:
            version = self._no_claim_yet(conn, writes, now)
            if version is None:
                return None
            params: dict[str, object] = {"now": now, "epoch": self._epoch}
            running = dict(conn.execute(_KEY_CLAIMS, params).fetchall())
            # Level 0: tasks without a key, and those of keys with no live claim.
            params["busy"] = json.dumps(sorted(running))
            row = self._first_claimable(
                conn,
                f"{_SELECT} WHERE {_CLAIMABLE} AND (concurrency_key IS NULL"
                " OR concurrency_key NOT IN (SELECT value FROM json_each(:busy)))"
                " ORDER BY created_at_us, task_id",
                params,
                now,
            )
            if row is None:
                # The busy keys below their limit, each by its oldest claimable task.
                best: tuple[int, int, str] | None = None
                for key, count in running.items():
                    head = self._first_claimable(
                        conn,
                        f"{_SELECT} WHERE concurrency_key = :key AND {_CLAIMABLE}"
                        " ORDER BY created_at_us, task_id",
                        {**params, "key": key},
                        now,
                    )
                    if head is None or head.concurrency is None:
                        continue
                    if count >= head.concurrency.limit:
                        continue
                    rank = (count, head.snapshot.task.created_at, head.snapshot.task.id)
                    if best is None or rank < best:
                        best, row = rank, head
            if row is None:
                self._remember_no_claim(conn, writes, version, now)
                return None
            return self._grant(conn, row, owner_id, lease_ms, now)

        return await self._transact(body, write=True, frees_nothing=True)

    def _no_claim_yet(self, conn: sqlite3.Connection, writes: int, now: int) -> int | None:
        """``None`` when the last ``claim_next`` found nothing and nothing can have changed
        since: no write of this store object came before this call, no other connection
        committed (the file's ``data_version``), and no retry or claim has fallen due. Else
        the ``data_version`` to remember if this call finds nothing either.

        Why: a recovering runner asks every second, and on a store whose active tasks are all
        claimed (thousands sleeping in their tools) each ask read every active row.
        """
        version = int(conn.execute("PRAGMA data_version").fetchone()[0])
        memory = self._no_claim
        if memory is not None and memory[:2] == (writes, version) and now < memory[2]:
            return None
        return version

    def _remember_no_claim(
        self, conn: sqlite3.Connection, writes: int, version: int, now: int
    ) -> None:
        params = {"now": now, "epoch": self._epoch}
        until = conn.execute(_NEXT_CLAIMABLE, params).fetchone()[0]
        self._no_claim = (writes, version, MAX_INSTANT if until is None else int(until))

    def _first_claimable(
        self, conn: sqlite3.Connection, query: str, params: dict[str, object], now: int
    ) -> _Row | None:
        """The first row of ``query`` that the record confirms claimable (key limits aside)."""
        cursor = conn.execute(query, params)
        try:
            for raw in cursor:
                row = self._decode(raw)
                if self._eligibility(row, now) is None:
                    return row
        finally:
            cursor.close()
        return None

    async def renew(self, lease: Lease, lease_ms: int) -> Lease:
        """Extend a live claim; a fresh token makes the old value stale even at the same instant."""
        self._ensure_open()
        lease_ms = check_positive_ms(lease_ms, "lease_ms")

        def body(conn: sqlite3.Connection, now: int) -> Lease:
            row = self._lease_row(conn, lease)
            self._check_lease(row, lease, now)
            renewed = attrs.evolve(lease, token=str(uuid.uuid4()), expires_at=now + lease_ms * 1000)
            conn.execute(
                "UPDATE tritask_tasks SET claim_token = ?, claim_expires_at_us = ?,"
                " claim_follows = 0 WHERE task_id = ?",
                (renewed.token, renewed.expires_at, renewed.task_id),
            )
            return renewed

        return await self._transact(body, write=True)

    async def renew_all(
        self, owner_id: str, leases: list[Lease] | tuple[Lease, ...], lease_ms: int
    ) -> list[Renewed | LeaseLost]:
        """Renew every lease of ``owner_id`` that is its task's live claim, in one transaction
        (one commit) that writes the owner's lease row, whatever the batch's size.

        Every renewed claim follows that row from then on (its token and generation stay its
        own, on the task row: the renewed lease differs from the old value by its expiry,
        which makes the old value stale). Only claims whose state changes are written: one
        renewed for the first time since its claim (or since a renewal of its own) starts
        following the row; one that follows it but is not renewed by this batch (left out,
        stale in the batch, or another epoch's) keeps its current expiry as its own, so the
        owner's row extends exactly the leases of the batch."""
        self._ensure_open()
        owner_id, batch, lease_ms = check_renewals(owner_id, leases, lease_ms)
        # Only a lease of this store, epoch and owner can match; each task once (the first
        # lease for it), as a second renew of one task in a row would be stale.
        store_id, epoch = self._id, self._epoch
        wanted: dict[str, int] = {}
        for index, lease in enumerate(batch):
            if lease.owner_id == owner_id and lease.store_id == store_id and lease.epoch == epoch:
                wanted.setdefault(lease.task_id, index)
        results: list[Renewed | LeaseLost] = [LEASE_LOST] * len(batch)
        if not wanted:
            await trio.lowlevel.checkpoint()
            return results

        def body(
            conn: sqlite3.Connection, now: int
        ) -> tuple[int, list[tuple[str, int]], dict[str, str]]:
            expires_at = now + lease_ms * 1000
            found = conn.execute(_OWNER_LEASE, (owner_id,)).fetchone()
            shared = 0 if found is None else found[0]
            renewed: list[tuple[str, int]] = []
            attach: list[str] = []
            detach: list[tuple[int, str]] = []
            get = wanted.get
            for task_id, token, generation, own, claim_epoch, follows, revision in conn.execute(
                _OWNER_CLAIMS, (owner_id,)
            ):
                expiry = shared if follows else own
                index = get(task_id)
                if index is not None:
                    lease = batch[index]
                    if (
                        claim_epoch == epoch
                        and now < expiry == lease.expires_at
                        and token == lease.token
                        and generation == lease.generation
                    ):
                        renewed.append((task_id, revision))
                        if not follows:
                            attach.append(task_id)
                        continue
                if follows:
                    detach.append((expiry, task_id))
            if detach:
                conn.executemany(_DETACH, detach)
            tokens: dict[str, str] = {}
            if attach:
                # Fresh tokens (36 characters, as the claim columns require), one urandom call.
                text = os.urandom(18 * len(attach)).hex()
                tokens = {task_id: text[36 * n : 36 * n + 36] for n, task_id in enumerate(attach)}
                conn.executemany(_ATTACH, ((token, task_id) for task_id, token in tokens.items()))
            if renewed:
                conn.execute(_SET_OWNER_LEASE, (owner_id, expires_at))
            elif found is not None:
                conn.execute(_DROP_OWNER_LEASE, (owner_id,))  # nothing follows it any more
            return expires_at, renewed, tokens

        expires_at, renewed, tokens = await self._transact(body, write=True, frees_nothing=True)
        recent = self._recent
        for task_id, revision in renewed:
            index = wanted[task_id]
            old = batch[index]
            if recent:
                recent.pop(task_id, None)  # a settle would not match it any more
            results[index] = Renewed(
                Lease(
                    store_id=store_id,
                    task_id=task_id,
                    owner_id=owner_id,
                    token=tokens.get(task_id, old.token),
                    generation=old.generation,
                    expires_at=expires_at,
                    epoch=epoch,
                ),
                revision,
            )
        return results

    async def renew_owner(
        self,
        owner_id: str,
        leases: list[Lease] | tuple[Lease, ...],
        revisions: list[int] | tuple[int, ...],
        following: int | None,
        lease_ms: int,
    ) -> OwnerRenewal:
        """``RenewsOwnerLease``: as :meth:`renew_all` (one transaction, the owner's row in
        ``tritask_owner_leases`` written, only claims whose state changes written besides), but
        the answer is one value: no lease, no ``Renewed``, no row kept per task, so a heartbeat
        of 20,000 attempts leaves nothing behind for the cyclic collector to promote.

        A renewed claim keeps its token: one that starts following the row (``_FOLLOW``) is
        its caller's held lease at the row's expiry from now on; one that follows it already
        is not written at all."""
        self._ensure_open()
        owner_id, batch, known, following, lease_ms = check_owner_renewal(
            owner_id, leases, revisions, following, lease_ms
        )
        if not batch:
            await trio.lowlevel.checkpoint()
            return OwnerRenewal(None, (), ())
        store_id, epoch = self._id, self._epoch
        # The index of the first lease of each task, -1 if it is not of this store, epoch and
        # owner (a later lease of the same task is lost, whatever the first one's fate).
        wanted: dict[str, int] = {}
        setdefault = wanted.setdefault
        matching = 0
        for index, lease in enumerate(batch):
            ours = (
                lease.owner_id == owner_id and lease.store_id == store_id and lease.epoch == epoch
            )
            if setdefault(lease.task_id, index if ours else -1) == index:
                matching += 1
        if not matching:
            await trio.lowlevel.checkpoint()
            return OwnerRenewal(None, tuple(range(len(batch))), ())

        def body(
            conn: sqlite3.Connection, now: int
        ) -> tuple[int | None, bytearray, list[int], list[str]]:
            expires_at = now + lease_ms * 1000
            found = conn.execute(_OWNER_LEASE, (owner_id,)).fetchone()
            shared = None if found is None else found[0]
            # The owner's following claims are live, and the caller's, only while the row is
            # the expiry it holds.
            held = shared is not None and following == shared and now < shared
            renewed = bytearray(len(batch))
            count = 0
            changed: list[int] = []
            attach: list[str] = []
            detach: list[tuple[int, str]] = []
            get = wanted.get
            for task_id, token, generation, own, claim_epoch, follows, revision in conn.execute(
                _OWNER_CLAIMS, (owner_id,)
            ):
                index = get(task_id, -1)
                if index >= 0 and claim_epoch == epoch:
                    lease = batch[index]
                    if (
                        token == lease.token
                        and generation == lease.generation
                        and (held if follows else now < own == lease.expires_at)
                    ):
                        renewed[index] = 1
                        count += 1
                        if revision > known[index]:
                            changed.append(index)
                        if not follows:
                            attach.append(task_id)
                        continue
                if follows:
                    detach.append((0 if shared is None else shared, task_id))
            if detach:
                conn.executemany(_DETACH, detach)
            if attach:
                conn.executemany(_FOLLOW, ((task_id,) for task_id in attach))
            if count:
                conn.execute(_SET_OWNER_LEASE, (owner_id, expires_at))
                return expires_at, renewed, changed, attach
            if found is not None:
                conn.execute(_DROP_OWNER_LEASE, (owner_id,))  # nothing follows it any more
            return None, renewed, changed, attach

        expires_at, renewed, changed, attach = await self._transact(
            body, write=True, frees_nothing=True
        )
        recent = self._recent
        if recent:
            for task_id in attach:
                recent.pop(task_id, None)  # a settle would not match it any more
        lost = tuple(index for index, done in enumerate(renewed) if not done)
        changed.sort()
        return OwnerRenewal(expires_at, lost, tuple(changed))

    async def release(self, lease: Lease) -> None:
        self._ensure_open()
        if isinstance(lease, Lease):
            self._recent.pop(lease.task_id, None)  # a settle would not match it any more

        def body(conn: sqlite3.Connection, now: int) -> bool:
            row = self._lease_row(conn, lease)
            if row.claim != lease:
                raise StaleLease("the lease does not match the task's claim")
            conn.execute(_CLEAR_CLAIM, (lease.task_id,))
            return self._frees(row.snapshot, row.concurrency is not None)

        if await self._transact(body, write=True):
            self._signal()

    @staticmethod
    def _frees(snapshot: Snapshot, keyed: bool) -> bool:
        """Whether ending a claim on this task signals the queue's listeners: a slot of its
        key freed, so a queued task of the key may start. (A released task that is claimable
        again is left to recovery's poll, as before: a runner whose attempts keep failing to
        settle would otherwise take the same task back at once, again and again.)"""
        return keyed

    # -- transitions --------------------------------------------------------------------------

    async def transition(
        self, task_id: str, expected_revision: int, event: Event, authority: Authority
    ) -> Transition | Conflict | NotFound:
        self._ensure_open()
        check_transition_arguments(expected_revision, event)
        if isinstance(authority, RequestAuthority):
            if not isinstance(authority.access, Access):
                raise TypeError("request authority needs an Access from authorize()")
        elif not isinstance(authority, WorkerAuthority):
            raise TypeError("authority must be RequestAuthority or WorkerAuthority")
        event_json, event_text = _event_texts(event)

        def body(conn: sqlite3.Connection, now: int) -> Transition | Conflict | NotFound:
            row, seen = self._load_seen(conn, task_id, event.id)
            if row is None:
                return NOT_FOUND
            if isinstance(authority, RequestAuthority):
                allowed = frozenset(a for a, kinds in REQUEST_KINDS.items() if event.kind in kinds)
                if self._visible(row, task_id, authority.access, now, allowed) is None:
                    return NOT_FOUND
            else:
                self._check_lease(row, authority.lease, now)
                if event.kind not in WORKER_KINDS:
                    raise UnauthorizedAction(f"a worker lease cannot apply {event.kind.value}")
            return self._apply(
                conn,
                row,
                expected_revision,
                event,
                event_json,
                now,
                seen=seen,
                event_text=event_text,
            )

        return await self._transact(body, write=True, announce=True)

    async def settle(
        self, task_id: str, expected_revision: int, event: Event, lease: Lease
    ) -> Transition | Conflict | NotFound:
        """A worker's final event and the release of its claim, atomically: the planned
        statement when it applies, one IMMEDIATE transaction otherwise."""
        self._ensure_open()
        check_transition_arguments(expected_revision, event, "settle")
        if event.kind not in SETTLE_KINDS:
            raise UnauthorizedAction(f"settle cannot apply {event.kind.value}")
        document = event.json_view()  # read at once, never kept (canonical_json copies)
        event_text = _record_text(document)  # the ledger row's text, on either path
        planned = self._plan_settle(task_id, expected_revision, event, lease)
        keyed = planned is not None and planned.row[_KEY_COLUMN] is not None

        def body(conn: sqlite3.Connection, now: int) -> Transition | Conflict | NotFound:
            nonlocal keyed
            row, seen = self._load_seen(conn, task_id, event.id)
            if row is None:
                return NOT_FOUND
            keyed = row.concurrency is not None
            event_json = canonical_json(document)
            try:
                self._check_lease(row, lease, now)
            except StaleLease:
                replay = self._released_replay(conn, row, lease, event, event_json)
                if replay is None:
                    raise
                return replay
            return self._apply(
                conn,
                row,
                expected_revision,
                event,
                event_json,
                now,
                seen=seen,
                release=True,
                event_text=event_text,
            )

        writer = self._writer
        if planned is None:
            result = await self._transact(body, write=True, announce=True)
        elif writer is not None and writer.usable:
            plan = planned
            (plain, update), entry = self._planned_steps(plan, event, event_text)
            steps: list[Step] = [
                (_W_PLANNED_PLAIN if plain else _W_PLANNED_UPDATE, update, CHECK_ONE_ROW),
                (_W_EVENT, entry, CHECK_NONE),
            ]
            self._writes += 1
            if await writer.run(
                steps,
                deadline_us=plan.lease.expires_at,
                committed=functools.partial(self._announce, plan.transition),
            ):
                result = plan.transition
            else:

                def after_writer(
                    conn: sqlite3.Connection, now: int
                ) -> Transition | Conflict | NotFound:
                    new = plan.transition
                    seen = (task_id, event.id, new.event_revision, new.committed_at)
                    if conn.execute(_PLANNED_SEEN, seen).fetchone() is not None:
                        return new  # the writer committed it before it failed
                    return body(conn, now)

                result = await self._transact(after_writer, write=True, announce=True)
        else:
            plan = planned

            def planned_first(
                conn: sqlite3.Connection, now: int
            ) -> Transition | Conflict | NotFound:
                # In the batch's transaction: the planned write needs no savepoint (the
                # operation is ``single``: its row write is one statement, and a failure
                # after it rolls the whole batch back, see ``_write_planned``); if it wrote
                # nothing, the full decision runs in a savepoint of its own.
                written = now < plan.lease.expires_at and self._write_planned(
                    conn, plan, event, event_text
                )
                if written:
                    return plan.transition
                return savepoint(conn, lambda: body(conn, now))

            result = await self._transact(planned_first, write=True, single=True, announce=True)
        if isinstance(result, Transition) and self._frees(result.snapshot, keyed):
            self._signal()  # the settle released the claim of a task with a key
        return result

    def _released_replay(
        self, conn: sqlite3.Connection, row: _Row, lease: object, event: Event, event_json: str
    ) -> Transition | None:
        """The resend of a settle that committed and released (no later claim was made)."""
        if (
            not isinstance(lease, Lease)
            or lease.store_id != self._id
            or lease.task_id != row.snapshot.task.id
            or row.claim is not None
            or row.generation != lease.generation
        ):
            return None
        if not self._seen(conn, lease.task_id, event.id):
            return None
        original = next(e for e in self._ledger(conn, row) if e.event.id == event.id)
        if canonical_json(original.event.to_json()) != event_json:
            return None
        return Transition(
            outcome="duplicate",
            snapshot=row.snapshot,
            effects=original.effects,
            event_revision=original.revision,
            committed_at=original.committed_at,
        )

    def _write_planned(
        self, conn: sqlite3.Connection, planned: _Planned, event: Event, event_text: str
    ) -> bool:
        """The planned settle: the row, written only if it is still exactly the one the plan
        was made on and the event id is not in its ledger (``_PLANNED_UPDATE``), then its
        ledger entry. Returns whether it wrote (``False``: nothing was written).

        Two plain statements rather than one ``INSERT`` into a view whose ``INSTEAD OF``
        trigger wrote both (the design before): the trigger cost the database thread a third
        more work per settle (an ephemeral table for the view's row, the whole-row match and a
        ledger lookup done twice) for one hand-over of the GIL fewer. The ledger entry cannot
        fail on stored state once the row matched (its id is new, its revision above every
        entry of the row's, its task exists), so it fails only as any statement can (an
        interrupt, I/O); the row must then not commit without it, and undoing this one
        operation alone would need a savepoint (two more statements on every settle): the
        whole transaction is rolled back instead, which the lane already handles as SQLite's
        own rollback of a batch (the other operations run again, this one fails alone).
        A WAL ``ROLLBACK`` only drops the connection's uncommitted pages: nothing to fail on.
        """
        (plain, update), entry = self._planned_steps(planned, event, event_text)
        updated = conn.execute(_PLANNED_PLAIN if plain else _PLANNED_UPDATE, update).rowcount
        if updated == 0:
            return False
        if updated != 1:  # pragma: no cover - task_id is the primary key
            task_id = planned.transition.snapshot.task.id
            raise CorruptStore(task_id, f"the planned settle wrote {updated} rows, not 1")
        try:
            conn.execute(_INSERT_EVENT, entry)
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return True

    @staticmethod
    def _planned_steps(
        planned: _Planned, event: Event, event_text: str
    ) -> tuple[tuple[bool, tuple[object, ...]], tuple[object, ...]]:
        """The planned settle's row write (whether it is ``_PLANNED_PLAIN``, and its
        parameters) and its ledger entry's parameters (``_INSERT_EVENT``)."""
        transition = planned.transition
        new = transition.snapshot
        row = planned.row  # _COLUMNS order: the task id, then the columns compared
        retry_at = new.available_at
        head = (
            snapshot_record_version(new),
            planned.record,
            new.revision,
            new.task.status.value,
        )
        if retry_at is None and _is_plain(row):
            update = (True, (*head, *_plain_row(row), event.id))
        else:
            update = (False, (*head, retry_at, *row, event.id))
        entry = (
            row[0],
            event.id,
            event_text,
            event.kind.value,
            new.revision,
            transition.committed_at,
            planned.effects,
        )
        return update, entry

    def _apply(
        self,
        conn: sqlite3.Connection,
        row: _Row,
        expected_revision: int,
        event: Event,
        event_json: str,
        now: int,
        *,
        seen: bool | None = None,
        release: bool = False,
        event_text: str | None = None,
    ) -> Transition | Conflict:
        """Replay check, then the revision check, then the reducer and one atomic write.

        ``seen`` is whether ``event.id`` is in the ledger, when the caller already read it
        (``None``: look it up). With ``release`` a ``Transition`` also clears the claim, in
        the same write when the event applies.
        """
        snapshot = row.snapshot
        task_id = snapshot.task.id
        if seen is None:
            seen = self._seen(conn, task_id, event.id)
        if seen:
            original = next(e for e in self._ledger(conn, row) if e.event.id == event.id)
            if canonical_json(original.event.to_json()) != event_json:
                raise EventIdReused(event.id)
            if release:
                conn.execute(_CLEAR_CLAIM, (task_id,))
            return Transition(
                outcome="duplicate",
                snapshot=snapshot,
                effects=original.effects,
                event_revision=original.revision,
                committed_at=original.committed_at,
            )
        if snapshot.revision != expected_revision:
            return Conflict(snapshot)
        committed_at = max(now, snapshot.task.last_updated_at + _COMMIT_STEP_US)
        result = apply(snapshot, event, committed_at)
        if result.kind == "unchanged":
            if release:
                conn.execute(_CLEAR_CLAIM, (task_id,))
            return Transition(
                outcome="unchanged",
                snapshot=snapshot,
                effects=result.effects,
                event_revision=snapshot.revision,
                committed_at=committed_at,
            )
        new = result.snapshot
        updated = conn.execute(
            _WRITE_RELEASING if release else _WRITE,
            (
                snapshot_record_version(new),
                record_text(new),
                new.revision,
                new.task.status.value,
                new.available_at,
                task_id,
                snapshot.revision,
            ),
        )
        if updated.rowcount != 1:
            raise CorruptStore(task_id, "the row changed under the write reservation")
        conn.execute(
            _INSERT_EVENT,
            (
                task_id,
                event.id,
                _record_text(event.json_view()) if event_text is None else event_text,
                event.kind.value,
                new.revision,
                committed_at,
                _record_text(effects_to_json(result.effects)),
            ),
        )
        # The reducer's values are this call's own (built from the row decoded in this
        # transaction, copying the event's data): the caller may keep them, no re-decode.
        return Transition(
            outcome="applied",
            snapshot=new,
            effects=result.effects,
            event_revision=new.revision,
            committed_at=committed_at,
        )

    @staticmethod
    def _seen(conn: sqlite3.Connection, task_id: str, event_id: str) -> bool:
        return (
            conn.execute(
                "SELECT 1 FROM tritask_task_events WHERE task_id = ? AND event_id = ?",
                (task_id, event_id),
            ).fetchone()
            is not None
        )

    # -- expiry -------------------------------------------------------------------------------

    async def reap(self) -> list[str]:
        """Delete up to ``reap_batch_size`` expired aggregates with their ledgers (sorted ids).

        Each row is validated first: a corrupt row fails the call instead of being deleted
        unseen. The same transaction drops up to ``reap_batch_size`` owner lease rows that
        have expired and that no claim follows (``_REAP_OWNER_LEASES``): a runner that died
        leaves its row behind, and nothing else would ever delete it.
        """
        self._ensure_open()

        def body(conn: sqlite3.Connection, now: int) -> list[str]:
            rows = conn.execute(
                f"{_SELECT} WHERE expires_at_us IS NOT NULL AND expires_at_us <= ?"
                " ORDER BY expires_at_us, task_id LIMIT ?",
                (now, self._reap_batch),
            ).fetchall()
            reaped = sorted(self._decode(raw).snapshot.task.id for raw in rows)
            conn.executemany(
                "DELETE FROM tritask_tasks WHERE task_id = ?", [(task_id,) for task_id in reaped]
            )
            conn.execute(_REAP_OWNER_LEASES, (now, self._reap_batch))
            return reaped

        reaped = await self._transact(body, write=True)
        self._feed.announce_reaped(reaped)
        return reaped

    # -- audit --------------------------------------------------------------------------------

    async def history(self, task_id: str) -> list[LedgerEntry]:
        """The validated ledger of a stored task, in revision order (``[]`` when unknown).

        An administrative read: no access is needed, and expired-but-unreaped tasks are shown.
        """
        self._ensure_open()

        def body(conn: sqlite3.Connection, now: int) -> list[LedgerEntry]:
            row = self._load(conn, task_id)
            return [] if row is None else self._ledger(conn, row)

        return await self._transact(body, write=False)

    async def audit(self, *, limit: int = 1000, after: str | None = None) -> AuditPage:
        """Validate a page of aggregates (record, projections, claim, ledger) by task id.

        Pass ``next_after`` back as ``after`` to continue; it is ``None`` on the last page.
        """
        self._ensure_open()
        check_audit_page(limit, after)

        def body(conn: sqlite3.Connection, now: int) -> AuditPage:
            raws = conn.execute(
                f"{_SELECT} WHERE task_id > ? ORDER BY task_id LIMIT ?", (after or "", limit)
            ).fetchall()
            findings: list[AuditFinding] = []
            for raw in raws:
                try:
                    self._ledger(conn, self._decode(raw))
                except CorruptStore as exc:
                    findings.append(AuditFinding(task_id=exc.task_id, reason=exc.reason))
            checked = tuple(str(raw[0]) for raw in raws)
            return AuditPage(
                checked=checked,
                findings=tuple(findings),
                next_after=checked[-1] if len(checked) == limit else None,
            )

        return await self._transact(body, write=False)

    # -- operators (ListsTasks) ---------------------------------------------------------------

    def _stored(self, row: _Row, now: int) -> StoredTask:
        claim = row.claim
        return StoredTask(
            snapshot=row.snapshot,
            scope=row.scope,
            generation=row.generation,
            claim=None
            if claim is None
            else ClaimInfo(
                owner_id=claim.owner_id,
                generation=claim.generation,
                expires_at=claim.expires_at,
                live=self._live(claim, now),
            ),
            expired=_expired(row.snapshot, now),
        )

    async def list_tasks(self, query: TaskQuery) -> TaskListing:
        """A page of every stored task, across scopes, in one read transaction."""
        self._ensure_open()
        query = check_task_query(query)
        params = {
            "statuses": json.dumps(sorted(s.value for s in query.statuses))
            if query.statuses
            else None,
            "scope": None if query.scope is None else _scope_text(query.scope),
            "before": query.created_before,
            "after_at": None if query.after is None else query.after.created_at,
            "after_id": None if query.after is None else query.after.task_id,
            "tool": query.tool,
            "limit": query.limit + 1,
        }

        def body(conn: sqlite3.Connection, now: int) -> TaskListing:
            rows = conn.execute(_LIST, params).fetchall()
            return listing_page(now, query, (self._stored(self._decode(raw), now) for raw in rows))

        return await self._transact(body, write=False)

    async def inspect_task(self, task_id: str) -> TaskInspection | NotFound:
        """The task and its validated ledger, in one read transaction (expired ones too)."""
        self._ensure_open()

        def body(conn: sqlite3.Connection, now: int) -> TaskInspection | NotFound:
            row = self._load(conn, task_id)
            if row is None:
                return NOT_FOUND
            ledger = tuple(self._ledger(conn, row))
            return TaskInspection(now=now, task=self._stored(row, now), ledger=ledger)

        return await self._transact(body, write=False)

    async def operator_access(self, task_id: str, action: Action) -> Access | NotFound:
        """An access in the task's own scope (see ``ListsTasks``)."""
        self._ensure_open()
        action = check_operator_action(task_id, action)

        def body(conn: sqlite3.Connection, now: int) -> Access | NotFound:
            raw = conn.execute(
                "SELECT scope FROM tritask_tasks WHERE task_id = ?", (task_id,)
            ).fetchone()
            if raw is None:
                return NOT_FOUND
            try:
                scope = _scope_key(raw[0])
            except (ValueError, TypeError, RecursionError) as exc:
                raise CorruptStore(task_id, str(exc)) from exc
            return Access(store_id=self._id, action=action, task_id=task_id, scope=scope)

        return await self._transact(body, write=False)

    async def integrity_check(self) -> list[str]:
        """SQLite's own page-level and foreign-key checks; ``[]`` when the file is sound."""
        self._ensure_open()

        def check(conn: sqlite3.Connection) -> list[str]:
            problems = [str(r[0]) for r in conn.execute("PRAGMA integrity_check").fetchall()]
            problems = [p for p in problems if p != "ok"]
            for table, rowid, parent, _ in conn.execute("PRAGMA foreign_key_check").fetchall():
                problems.append(f"{table} row {rowid} references a missing {parent} row")
            return problems

        return await self._call(check)
