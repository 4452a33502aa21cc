"""The writer process's program (see :mod:`tritask_sqlite._writer`): batches of prepared
statements run on a connection of its own, one transaction and one commit per batch.

It is started as a script (``python -I -S _writer_child.py FD``), so it imports the standard
library only, never tritask: it starts in tens of milliseconds and knows nothing of tasks. The
store sends the SQL once; a batch names statements by index. It decides nothing: a statement
that fails, a check that does not hold or a deadline that has passed leaves its item
*undecided* (nothing of it written), and the store decides that item again on its own
connection.

Framing on the socket: a 4-byte big-endian length, then a :mod:`marshal` payload (both ends
are the same interpreter: ``sys.executable``).

* hello, store to child: ``(path, busy_timeout_ms, synchronous, statements)``;
  child to store: ``(True, sqlite_version)`` or ``(False, message)`` (then it exits).
* batch, store to child: ``(now_us, items)``, each item ``(deadline_us, steps)``, each step
  ``(statement, params, check)``; ``now_us`` is the store's injected clock (tests) read as
  the batch was sent, ``None`` for the host's clock, read in the transaction; child to store:
  ``(committed, decided)``, ``decided`` a bytes of one ``1`` (written) or ``0`` (undecided)
  per item. ``committed`` false: the batch's
  transaction did not commit (every item undecided, or the outcome unknown: the store looks).
* end of file from the store: exit (the store closed, or its process died).

Checks: ``0`` none; ``1`` the statement changed exactly one row; ``2`` its first row's first
column is ``1``. ``deadline_us`` (``None``: none): the item is undecided unless the clock, read
in the transaction, is before it (a planned settle's lease must still be live at its write).
"""

from __future__ import annotations

import contextlib
import marshal
import signal
import socket
import sqlite3
import struct
import sys
import time
from typing import Any

#: The frame header on both ends (the store's side imports these from this module).
HEADER = struct.Struct("!I")
CHECK_NONE = 0
CHECK_ONE_ROW = 1
CHECK_TRUE = 2
#: One statement of an item: (index of the statement, its parameters, its check).
Step = tuple[int, tuple[object, ...], int]


class _Undecided(Exception):
    """This item wrote nothing; the store decides it."""


def _recv_exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks = []
    while size:
        chunk = sock.recv(min(size, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _recv_frame(sock: socket.socket) -> Any:
    header = _recv_exactly(sock, HEADER.size)
    if header is None:
        return None
    payload = _recv_exactly(sock, HEADER.unpack(header)[0])
    if payload is None:
        return None
    return marshal.loads(payload)


def _send_frame(sock: socket.socket, value: Any) -> None:
    payload = marshal.dumps(value)
    sock.sendall(HEADER.pack(len(payload)) + payload)


def now_us() -> int:
    """The host's real-time clock in µs at millisecond resolution: exactly what SQLite's own
    ``'now'`` reads on POSIX (``gettimeofday``, truncated to the millisecond), without a
    statement per transaction. The store's clock too (it imports this), so a deadline the
    store computed is compared here with the same clock."""
    return time.time_ns() // 1_000_000 * 1000


def _run_item(conn: sqlite3.Connection, statements: list[str], steps: list[Step]) -> None:
    for index, params, check in steps:
        cursor = conn.execute(statements[index], params)
        if check == CHECK_ONE_ROW:
            if cursor.rowcount != 1:
                raise _Undecided
        elif check == CHECK_TRUE:
            row = cursor.fetchone()
            if row is None or row[0] != 1:
                raise _Undecided


def run_batch(
    conn: sqlite3.Connection,
    statements: list[str],
    now: int | None,
    batch: list[tuple[int | None, list[Step]]],
) -> tuple[bool, bytes]:
    """One transaction for the batch; an item that fails is undone alone (a savepoint when it
    has more than one step: a single statement is undone by SQLite itself)."""
    decided = bytearray(len(batch))
    try:
        conn.execute("BEGIN IMMEDIATE")
    except sqlite3.Error:
        return False, bytes(decided)
    try:
        if now is None:
            now = now_us()
        for position, (deadline, steps) in enumerate(batch):
            if deadline is not None and now >= deadline:
                continue
            guarded = len(steps) > 1
            if guarded:
                conn.execute("SAVEPOINT tritask_item")
            try:
                _run_item(conn, statements, steps)
            except (_Undecided, sqlite3.Error):
                if not conn.in_transaction:  # SQLite rolled the whole batch back
                    return False, bytes(len(batch))
                if guarded:
                    conn.execute("ROLLBACK TO tritask_item")
                    conn.execute("RELEASE tritask_item")
                continue
            if guarded:
                conn.execute("RELEASE tritask_item")
            decided[position] = 1
        conn.execute("COMMIT")
    except sqlite3.Error:
        if conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
        return False, bytes(len(batch))
    return True, bytes(decided)


def main(argv: list[str]) -> int:
    # The store's process group may get SIGINT (a terminal's ^C) or SIGTERM (a service
    # manager stopping the group) while the store still closes: this process ends when the
    # store closes its socket, after the batches already sent.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock = socket.socket(fileno=int(argv[1]))
    hello = _recv_frame(sock)
    if hello is None:
        return 0
    path: str
    busy_timeout_ms: int
    synchronous: str
    statements: list[str]
    path, busy_timeout_ms, synchronous, statements = hello
    try:
        conn = sqlite3.connect(
            path, timeout=busy_timeout_ms / 1000, isolation_level=None, check_same_thread=False
        )
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        conn.execute("PRAGMA foreign_keys = ON")
        if synchronous not in ("NORMAL", "FULL", "EXTRA"):
            raise ValueError(f"synchronous {synchronous!r}")
        conn.execute(f"PRAGMA synchronous = {synchronous}")
        mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
        if str(mode).lower() != "wal":
            raise ValueError(f"the database is not in WAL mode ({mode!r})")
    except (sqlite3.Error, ValueError) as exc:
        _send_frame(sock, (False, f"{type(exc).__name__}: {exc}"))
        return 1
    _send_frame(sock, (True, sqlite3.sqlite_version))
    while True:
        frame = _recv_frame(sock)
        if frame is None:
            break
        now: int | None
        batch: list[tuple[int | None, list[Step]]]
        now, batch = frame
        try:
            _send_frame(sock, run_batch(conn, statements, now, batch))
        except OSError:  # the store is gone
            break
    conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
