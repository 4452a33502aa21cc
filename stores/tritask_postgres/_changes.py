"""Task changes across hosts: every applied transition and every reaped task sends ``NOTIFY``
on the schema's ``changes`` channel, in the committing transaction; ``changes()`` merges what
other store objects sent (any host) with what this one committed (announced in process, with
the committed task, so those never wait for the database).

The payload is bounded (a task id of at most 256 bytes, a revision, a status, the sender's
origin: under 400 bytes, far below PostgreSQL's 8000) and carries no task content: whoever
renders a change heard from elsewhere reads the task through the store with its own access.
Notifications are lost while nobody listens, and across a reconnect: the first item of every
iteration, and the first after a reconnect, is ``resync``.

One dedicated autocommit connection per iteration, read with ``trio.lowlevel.wait_readable``
on its socket; a local announcement cancels that wait (no task, no thread waits).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Final

import psycopg
import trio
from psycopg import sql

from tritask.tasks.changes import RESYNC, ChangeFeed, TaskChange
from tritask.tasks.model import TaskStatus

__all__ = [
    "change_payload",
    "listen_changes",
    "own_suffixes",
    "parse_change",
    "reaped_payload_sql",
]

log = logging.getLogger("tritask_postgres")

_BACKOFF_START_S: Final = 0.1
_BACKOFF_MAX_S: Final = 5.0
_MAX_TASK_ID_BYTES: Final = 256


def change_payload(task_id: str, revision: int, status: TaskStatus, origin: str) -> str:
    """The NOTIFY payload of an applied transition (compact JSON)."""
    return json.dumps(
        {"v": 1, "kind": "changed", "taskId": task_id, "revision": revision,
         "status": status.value, "origin": origin},
        separators=(",", ":"),
        ensure_ascii=False,
    )  # fmt: skip


def reaped_payload_sql(task_id_column: str, origin_param: str) -> str:
    """SQL for the payload of a reaped task (built by the deleting statement itself)."""
    return (
        f"json_build_object('v', 1, 'kind', 'reaped', 'taskId', {task_id_column},"
        f" 'origin', {origin_param})::text"
    )


def own_suffixes(origin: str) -> tuple[bytes, bytes]:
    """How a payload this store object sent ends: the ``origin`` member is the last one of
    both :func:`change_payload` (compact) and :func:`reaped_payload_sql` (PostgreSQL's
    ``json_build_object`` text, ``"key" : value``).

    Every settle's NOTIFY comes back to the same process's LISTEN connection; its change was
    announced in process already, so the listener drops it by this suffix without decoding
    the JSON (which :func:`parse_change` would then drop by the same origin). A payload of
    anyone else never ends so: the origins differ, and a JSON string holding the suffix would
    end in an escaped quote.
    """
    value = json.dumps(origin, ensure_ascii=False)
    return (f'"origin":{value}}}'.encode(), f'"origin" : {value}}}'.encode())


def parse_change(payload: str, origin: str) -> TaskChange | None:
    """Decode a payload; this store's own (announced in process already), another version or
    anything malformed is ``None``."""
    try:
        doc: Any = json.loads(payload)
        if not isinstance(doc, dict) or doc.get("v") != 1 or doc.get("origin") == origin:
            return None
        kind, task_id = doc["kind"], doc["taskId"]
    except (ValueError, TypeError, KeyError):
        return None
    if not isinstance(task_id, str) or not 0 < len(task_id.encode("utf-8")) <= _MAX_TASK_ID_BYTES:
        return None
    if kind == "reaped":
        return TaskChange("reaped", task_id)
    if kind != "changed":
        return None
    revision, status = doc.get("revision"), doc.get("status")
    if type(revision) is not int or revision < 0 or not isinstance(status, str):
        return None
    try:
        return TaskChange("changed", task_id, revision, TaskStatus(status))
    except ValueError:
        return None


async def listen_changes(
    feed: ChangeFeed,
    connect: Callable[[], psycopg.Connection[Any]],
    channel: str,
    origin: str,
    listeners: set[psycopg.Connection[Any]],
    closed: Callable[[], bool],
) -> AsyncGenerator[TaskChange, None]:
    """Changes committed through this store (``feed``) and, from ``channel``, those other
    store objects sent, until ``closed()``; reconnects with backoff.

    ``connect`` opens a new autocommit connection (blocking, run in a worker thread); it is
    registered in ``listeners`` so closing the store wakes the wait
    (``trio.lowlevel.notify_closing``), which ends the iteration.
    """
    statement = sql.SQL("LISTEN {}").format(sql.Identifier(channel)).as_bytes(None)

    def open_listener() -> psycopg.Connection[Any]:
        conn = connect()
        try:
            conn.execute(statement)
        except BaseException:
            conn.close()
            raise
        return conn

    own = own_suffixes(origin)
    reader = feed.open_reader()
    conn: psycopg.Connection[Any] | None = None
    backoff = _BACKOFF_START_S

    async def wait(operation: Callable[..., Awaitable[object]], *args: Any) -> bool:
        """Await ``operation(*args)`` until it returns or a local change arrives (``False``)."""
        with trio.CancelScope() as scope:
            reader.waker = scope.cancel
            if reader.items or feed.closed:
                scope.cancel()
            try:
                await operation(*args)
            finally:
                reader.waker = None
        return not scope.cancelled_caught

    try:
        yield RESYNC  # the local feed is registered: nothing committed here from now is missed
        while not closed() and not feed.closed:
            while (change := reader.take()) is not None:
                yield change
            if conn is None:
                try:
                    conn = await trio.to_thread.run_sync(open_listener)
                except psycopg.OperationalError as exc:
                    log.warning("LISTEN (changes) failed (retrying in %.1fs): %s", backoff, exc)
                    deadline = trio.current_time() + backoff
                    backoff = min(backoff * 2, _BACKOFF_MAX_S)
                    while trio.current_time() < deadline and not closed():
                        await wait(trio.sleep_until, deadline)
                        while (change := reader.take()) is not None:
                            yield change
                    continue
                listeners.add(conn)
                backoff = _BACKOFF_START_S
                yield RESYNC  # listening (again): what others sent before may be lost
                continue
            fd, pgconn = conn.fileno(), conn.pgconn
            if not await wait(trio.lowlevel.wait_readable, fd):
                continue  # a local change (or the feed closed): deliver it first
            try:
                pgconn.consume_input()  # raises OperationalError when the connection is lost
            except psycopg.OperationalError as exc:
                log.warning("LISTEN (changes) connection lost (reconnecting): %s", exc)
                listeners.discard(conn)
                conn.close()
                conn = None
                continue
            while (notify := pgconn.notifies()) is not None:
                if notify.extra.endswith(own):
                    continue  # this store's own commit: announced in process already
                parsed = parse_change(notify.extra.decode("utf-8", "replace"), origin)
                if parsed is not None:
                    yield parsed
    except trio.ClosedResourceError:
        return  # the store closed
    finally:
        feed.close_reader(reader)
        if conn is not None:
            listeners.discard(conn)
            conn.close()
