"""Wake-ups: commits that make work appear for other runners, delivered by LISTEN/NOTIFY.

A store that offers ``wakeups()`` lets a runner react within milliseconds instead of waiting for
its next poll. Polling stays the safety net: a notification is a hint sent after the commit,
never the authority (the store is), and notifications are lost while nobody listens. Hence the
first item of every subscription, and the first after a reconnect, is :attr:`WakeupKind.RESYNC`:
"anything may have happened; run recovery now".

The listener is one dedicated autocommit connection per subscription, read with
``trio.lowlevel.wait_readable`` on its socket: no thread waits for notifications.
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any, Final

import attrs
import psycopg
import trio
from psycopg import sql

from tritask.tasks._time import MAX_INSTANT

__all__ = ["Wakeup", "WakeupKind", "listen", "notify_payload", "parse_payload"]

log = logging.getLogger("tritask_postgres")

_BACKOFF_START_S: Final = 0.1
_BACKOFF_MAX_S: Final = 5.0


class WakeupKind(enum.StrEnum):
    """Why a runner should look again (a ``StrEnum``: compare it with plain strings)."""

    RESYNC = "resync"
    """Listening (again): earlier notifications may be lost; run recovery. ``task_id`` is None."""
    CREATED = "created"
    """A task was created; it is claimable unless its creator claimed it first."""
    RETRY_SCHEDULED = "retry_scheduled"
    """A retry was scheduled; the task is claimable from ``due_at`` (database time, µs)."""
    RELEASED = "released"
    """A claim on an active task was released: claimable now, or from ``due_at`` if set."""
    INPUT_ACCEPTED = "input_accepted"
    """Input responses were accepted: the attempt waiting for them can continue."""
    CANCELLED = "cancelled"
    """The task was cancelled: stop its attempt wherever it runs."""


@attrs.frozen
class Wakeup:
    """One hint. ``local`` is true when this same store object made the commit (its runner
    usually knows already); ``due_at`` is the database instant (µs) a retry becomes due."""

    kind: WakeupKind
    task_id: str | None
    due_at: int | None = None
    local: bool = False


def notify_payload(kind: WakeupKind, task_id: str, origin: str, due_at: int | None = None) -> str:
    """The NOTIFY payload (compact JSON, far below PostgreSQL's 8000-byte limit)."""
    return json.dumps(
        {"v": 1, "kind": kind.value, "taskId": task_id, "dueAt": due_at, "origin": origin},
        separators=(",", ":"),
        ensure_ascii=False,
    )


def parse_payload(payload: str, origin: str) -> Wakeup | None:
    """Decode a payload; anything unexpected (another version, a foreign sender) is ignored."""
    try:
        doc: Any = json.loads(payload)
        kind = WakeupKind(doc["kind"])
        task_id = doc["taskId"]
        due_at = doc["dueAt"]
        sender = doc["origin"]
    except (ValueError, TypeError, KeyError):
        return None
    if doc.get("v") != 1 or kind is WakeupKind.RESYNC or not isinstance(task_id, str):
        return None
    if due_at is not None and not (
        isinstance(due_at, int) and not isinstance(due_at, bool) and 0 <= due_at <= MAX_INSTANT
    ):
        return None
    return Wakeup(kind=kind, task_id=task_id, due_at=due_at, local=sender == origin)


async def listen(
    connect: Callable[[], psycopg.Connection[Any]],
    channel: str,
    origin: str,
    listeners: set[psycopg.Connection[Any]],
    closed: Callable[[], bool],
) -> AsyncGenerator[Wakeup, None]:
    """Yield wake-ups from ``channel`` until ``closed()``, reconnecting with backoff.

    ``connect`` opens a new autocommit connection (blocking, run in a worker thread). The
    connection is registered in ``listeners`` so the store can wake the wait when it closes
    (``trio.lowlevel.notify_closing``); that ends the iteration.
    """
    backoff = _BACKOFF_START_S
    statement = sql.SQL("LISTEN {}").format(sql.Identifier(channel)).as_bytes(None)

    def open_listener() -> psycopg.Connection[Any]:
        conn = connect()
        try:
            conn.execute(statement)
        except BaseException:
            conn.close()
            raise
        return conn

    while not closed():
        try:
            conn = await trio.to_thread.run_sync(open_listener)
        except psycopg.OperationalError as exc:
            log.warning("LISTEN connection failed (retrying in %.1fs): %s", backoff, exc)
            await trio.sleep(backoff)
            backoff = min(backoff * 2, _BACKOFF_MAX_S)
            continue
        listeners.add(conn)
        try:
            backoff = _BACKOFF_START_S
            yield Wakeup(kind=WakeupKind.RESYNC, task_id=None)
            fd = conn.fileno()
            pgconn = conn.pgconn
            while not closed():
                await trio.lowlevel.wait_readable(fd)
                pgconn.consume_input()  # raises OperationalError when the connection is lost
                while (notify := pgconn.notifies()) is not None:
                    wakeup = parse_payload(notify.extra.decode("utf-8", "replace"), origin)
                    if wakeup is not None:
                        yield wakeup
            return
        except psycopg.OperationalError as exc:
            log.warning("LISTEN connection lost (reconnecting): %s", exc)
        except trio.ClosedResourceError:
            return  # the store closed
        finally:
            listeners.discard(conn)
            conn.close()
