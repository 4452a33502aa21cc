"""``Lane``: the store's one connection, used by one operation at a time, in arrival order,
with the operations queued behind each other committed together (group commit).

Why not one ``trio.to_thread`` hop per operation under a ``trio.Lock``: then the connection
sits idle between two operations until the trio loop has run the first caller on (it releases
the lock) and the next one (it starts its hop). On a busy server that loop turn is the HTTP
work of every other runnable task, and it measured longer than the operation itself: the
store's throughput fell to a fraction of what the database allows.

So a hop drains the queue. The caller that finds the lane idle starts a *hop*: one of trio's
worker threads (``trio.lowlevel.start_thread_soon``, the thread cache ``trio.to_thread`` uses)
that takes the queued operations one after the other without going back to trio, and wakes
their callers through ``TrioToken.run_sync_soon``. When the queue is empty it waits up to
``linger`` seconds for the next operation (a blocked thread, no CPU) before the lane goes idle,
so a busy loop's callers never wait for a new hop: the loop turn between two operations,
which on a busy server is every other runnable task's work, no longer leaves the connection
idle. No thread is the lane's own: a hop is one of trio's worker threads, for blocking database
calls only, and an idle lane holds none.

**Group commit.** Operations declared ``kind="write"`` or ``"read"`` run in *batches*: one
transaction (``BEGIN IMMEDIATE`` when the batch writes, a deferred ``BEGIN`` for a batch of
reads only), the operations queued behind the first one joining it as they are taken from the
queue (at most ``max_batch``), then one ``COMMIT``: one fsync for all of them. The rules:

* *A failing operation fails alone.* A write that is not ``atomic`` runs inside its own
  ``SAVEPOINT``; if it raises, the lane rolls back to the savepoint and the batch goes on. An
  ``atomic`` write is a single writing statement (SQLite's statement journal undoes a failed
  statement, keeping the transaction) and a read writes nothing, so neither needs one. When a
  failure makes SQLite roll back the whole transaction (an interrupt of a writing statement, a
  full disk), the operations that had already run in it are run again, in order, in a new
  transaction: nobody had heard of them, so they are decided afresh.
* *No caller hears of its commit before the commit that contains it.* Results are kept until
  ``COMMIT`` returns; then every caller of the batch is woken (one ``run_sync_soon`` for the
  whole batch). If ``COMMIT`` fails, every operation that was in the transaction gets that
  error.
* *Durability is the connection's.* The commit is an ordinary SQLite commit with the
  connection's ``synchronous`` setting.

``kind="alone"`` (the default) runs the operation outside any batch, exactly as given: it
manages its own transaction (or autocommits).

Cancellation is what it was with a lock: a queued operation is withdrawn unrun; a running one
gets ``Connection.interrupt()`` and its caller waits (shielded) for its outcome, then raises
``Cancelled`` unless the operation had succeeded (then it returns the result once it is
committed: trio's rule is that ``Cancelled`` means it did not happen). An operation of a batch
that has run and waits for the ``COMMIT`` is not interrupted: its cancelled caller waits
(shielded) for the commit and gets the result. The interrupt is decided under the lane's
mutex while the operation is marked running, so it can never reach another operation (SQLite
clears a pending interrupt when a statement starts with none active). For the same reason an
interrupt that lands between two statements of the operation would be lost, so the lane also
installs a progress handler that aborts any statement the interrupted operation goes on to run
(it runs every ``PROGRESS_STEPS`` virtual-machine steps: never for the store's short
statements, within microseconds for a long one).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import logging
import sqlite3
import threading
from collections.abc import Callable, Sequence
from typing import Any, Final, Literal, TypeVar, cast

import outcome
import trio

__all__ = ["Kind", "Lane", "savepoint"]

T = TypeVar("T")

#: Seconds a hop thread waits for more work before the lane goes idle.
DEFAULT_LINGER: Final = 0.005
#: Operations at most in one batch (one transaction, one commit).
DEFAULT_MAX_BATCH: Final = 64
#: SQLite virtual-machine steps between two checks of the running operation's interrupt.
log = logging.getLogger("tritask_sqlite")

PROGRESS_STEPS: Final = 1000

Kind = Literal["write", "read", "alone"]
_State = Literal["queued", "running", "ran", "done", "withdrawn"]
_SAVEPOINT: Final = "tritask_op"


class _Op:
    """One queued operation (a plain slotted class: one is made per store call)."""

    __slots__ = ("atomic", "committed", "fn", "interrupted", "kind", "result", "state", "wake")

    def __init__(
        self,
        fn: Callable[[sqlite3.Connection], Any],
        kind: Kind,
        atomic: bool,
        committed: Callable[[Any], None] | None,
    ) -> None:
        self.fn = fn
        self.kind = kind
        self.atomic = atomic
        self.state: _State = "queued"
        self.result: outcome.Outcome[Any] | None = None
        self.interrupted = False
        self.wake = trio.Event()
        self.committed = committed

    def done(self) -> bool:
        return self.state == "done"


def savepoint(conn: sqlite3.Connection, fn: Callable[[], T]) -> T:
    """Run ``fn()`` inside a savepoint of the open transaction: undone alone if it raises.

    For an operation that declared itself ``atomic`` but, on a rare path, runs several writing
    statements (the store's planned settle falling back to the full decision).
    """
    conn.execute(f"SAVEPOINT {_SAVEPOINT}_inner")
    try:
        result = fn()
    except BaseException:
        if conn.in_transaction:
            conn.execute(f"ROLLBACK TO {_SAVEPOINT}_inner")
            conn.execute(f"RELEASE {_SAVEPOINT}_inner")
        raise
    conn.execute(f"RELEASE {_SAVEPOINT}_inner")
    return result


class Lane:
    """Runs ``fn(connection)`` calls one at a time, in arrival order, in a trio worker thread;
    consecutive ``write``/``read`` operations share one transaction and one commit."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        *,
        max_batch: int = DEFAULT_MAX_BATCH,
        linger: float = DEFAULT_LINGER,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if linger < 0:
            raise ValueError("linger must be >= 0")
        self._conn = conn
        self._max_batch = max_batch
        self._linger = linger
        self._mutex = threading.Lock()  # guards _queue, _hopping, _idle and every _Op.state
        self._arrived = threading.Condition(self._mutex)
        self._queue: collections.deque[_Op] = collections.deque()
        self._hopping = False  # a hop thread runs (it takes what is queued)
        self._lingering = False  # the hop thread waits on ``_arrived`` for the next operation
        self._idle = trio.Event()
        self._idle.set()
        self._running: _Op | None = None
        conn.set_progress_handler(self._progress, PROGRESS_STEPS)
        self.hops = 0
        self.operations = 0
        #: Batches that ended in a successful ``COMMIT``.
        self.commits = 0
        #: Operations run again after SQLite rolled back a batch's transaction.
        self.replays = 0

    async def wait_idle(self) -> None:
        """Return once no operation is queued or running (for closing the connection)."""
        while not self._idle.is_set():
            await self._idle.wait()

    async def run(
        self,
        fn: Callable[[sqlite3.Connection], T],
        *,
        kind: Kind = "alone",
        atomic: bool = False,
        committed: Callable[[T], None] | None = None,
    ) -> T:
        """Run ``fn(connection)``; its result (or exception) once it is committed.

        ``kind="write"``: ``fn`` writes inside the batch's transaction (in a savepoint of its
        own unless ``atomic``: it runs at most one writing statement); ``"read"``: it only
        reads; ``"alone"``: outside any batch, managing its own transaction. ``committed``
        is called with a successful result in the trio thread once it is committed, before
        any caller of its batch is woken, in the order the operations ran (even when the
        caller was cancelled meanwhile); it must not raise or block.
        """
        await trio.lowlevel.checkpoint_if_cancelled()  # cancelled already: run nothing
        op = _Op(fn, kind, atomic, committed)
        with self._mutex:
            self._queue.append(op)
            start = not self._hopping
            if start:
                self._hopping = True
                self._idle = trio.Event()
            elif self._lingering:
                self._arrived.notify()  # only a lingering hop waits for it
        if start:
            token = trio.lowlevel.current_trio_token()
            trio.lowlevel.start_thread_soon(
                functools.partial(self._hop, token), functools.partial(_hop_ended, token)
            )
        try:
            await op.wake.wait()
        except BaseException as exc:
            return cast(T, await self._abandon(op, exc))
        assert op.result is not None
        if op.interrupted and isinstance(op.result, outcome.Error):
            await trio.lowlevel.checkpoint()  # raises the caller's Cancelled
        return cast(T, op.result.unwrap())

    async def _abandon(self, op: _Op, exc: BaseException) -> Any:
        """The caller was interrupted (``Cancelled``, or anything else) while waiting."""
        state = self._stop_op(op)
        if state in ("queued", "withdrawn") or not isinstance(exc, trio.Cancelled):
            raise exc  # anything but Cancelled (e.g. KeyboardInterrupt) is never swallowed
        with trio.CancelScope(shield=True):
            await op.wake.wait()
        assert op.result is not None
        if op.interrupted and isinstance(op.result, outcome.Error):
            raise exc  # it did not happen: what interrupted the caller stands
        return op.result.unwrap()

    def _stop_op(self, op: _Op) -> _State:
        """Its caller gave up: withdraw ``op`` if still queued, interrupt it if running (decided
        under the mutex, so an interrupt never reaches another operation). An operation that
        ran and waits for its batch's commit is left to commit. Returns the state it found."""
        with self._mutex:
            state = op.state
            if state == "queued":
                self._queue.remove(op)
                op.state = "withdrawn"
            elif state == "running":
                op.interrupted = True
                self._conn.interrupt()
        return state

    # -- in the worker thread -------------------------------------------------------------------

    def _hop(self, token: trio.lowlevel.TrioToken) -> None:
        """In a worker thread: what is queued, batch after batch; then, once nothing has
        arrived for ``linger`` seconds, the lane is idle and the thread goes back to trio."""
        try:
            while True:
                with self._mutex:
                    if not self._queue:
                        self._lingering = True
                        self._arrived.wait(self._linger)
                        self._lingering = False
                    if not self._queue:
                        self._hopping = False
                        idle = self._idle
                        break
                    head = self._queue.popleft()
                    head.state = "running"
                    self._running = head
                if head.kind == "alone":
                    result = _capture(head.fn, self._conn)
                    with self._mutex:
                        head.result = result
                        head.state = "done"
                        self._running = None
                    finished = [head]
                else:
                    finished = self._batch(head, self._max_batch)
                self.operations += len(finished)
                _deliver(token, _wake_all, finished)
        except BaseException as exc:  # pragma: no cover - a bug in the lane itself
            idle = self._fail_all(token, exc)
        self.hops += 1
        _deliver(token, idle.set)

    def _fail_all(self, token: trio.lowlevel.TrioToken, exc: BaseException) -> trio.Event:
        """The hop itself failed: every operation it holds or that is queued gets the error
        (nobody waits forever), and the lane is idle again."""
        with self._mutex:
            stranded = [op for op in self._queue]
            self._queue.clear()
            running = self._running
            self._running = None
            if running is not None and running.state != "done":
                stranded.append(running)
            for op in stranded:
                op.result = outcome.Error(copy.copy(exc))
                op.state = "done"
            self._hopping = False
            idle = self._idle
        _deliver(token, _wake_all, stranded)
        return idle

    def _take(self, write: bool, taken: int, limit: int) -> _Op | None:
        """The next queued operation that may join the open batch, marked running."""
        with self._mutex:
            if taken >= limit or not self._queue:
                return None
            op = self._queue[0]
            if op.kind == "alone" or (op.kind == "write" and not write):
                return None
            self._queue.popleft()
            op.state = "running"
            self._running = op
            return op

    def _begin(self, write: bool) -> outcome.Outcome[None]:
        conn = self._conn
        if conn.in_transaction:  # never build on what an earlier failure left behind
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error as exc:
                return outcome.Error(exc)
        return _capture(_execute, conn, "BEGIN IMMEDIATE" if write else "BEGIN")

    def _batch(self, head: _Op, limit: int) -> list[_Op]:
        """One transaction: ``head`` and the operations that join it, then one ``COMMIT``.

        Returns every operation it decided (marked done), in the order they ran.
        """
        conn = self._conn
        write = head.kind == "write"
        committed: list[_Op] = []  # ran in the open transaction, result kept
        failed: list[_Op] = []  # failed alone: their error is final
        again: list[_Op] = []  # to run (again) before anything new is taken
        taken = 1
        op: _Op | None = head  # marked running by the caller (``_hop``)
        began = self._begin(write)
        if isinstance(began, outcome.Error):
            return self._finish([], [head], began)
        while True:
            if op is None:
                if again:
                    op = again.pop(0)
                    with self._mutex:
                        op.state = "running"
                        self._running = op
                else:
                    op = self._take(write, taken, limit)
                    if op is None:
                        break
                    taken += 1
            result = self._run_one(op)
            with self._mutex:
                op.result = result
                op.state = "ran"
                self._running = None
            if isinstance(result, outcome.Value):
                committed.append(op)
            else:
                failed.append(op)
                if not conn.in_transaction:
                    # SQLite rolled the whole transaction back: what ran in it runs again.
                    self.replays += len(committed)
                    again = committed + again
                    committed = []
                    began = self._begin(write)
                    if isinstance(began, outcome.Error):
                        for other in again:
                            other.result = _own_error(began)
                        return self._finish([], failed + again, None)
            op = None
        ended: outcome.Outcome[Any] | None = None
        if conn.in_transaction:
            ended = _capture(_execute, conn, "COMMIT")
            if isinstance(ended, outcome.Error):
                try:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
            else:
                self.commits += 1
                ended = None
        return self._finish(committed, failed, ended)

    def _finish(
        self,
        committed: Sequence[_Op],
        failed: Sequence[_Op],
        commit_error: outcome.Outcome[Any] | None,
    ) -> list[_Op]:
        """Mark the batch's operations done (those in a failed commit get its error)."""
        with self._mutex:
            for op in committed:
                if commit_error is not None:
                    op.result = _own_error(commit_error)
                op.state = "done"
            for op in failed:
                if op.result is None:
                    op.result = _own_error(commit_error)
                op.state = "done"
        return [*committed, *failed]

    def _run_one(self, op: _Op) -> outcome.Outcome[Any]:
        """``op.fn(conn)`` in the open transaction; a non-atomic write in its own savepoint."""
        conn = self._conn
        if op.kind != "write" or op.atomic:
            return _capture(op.fn, conn)
        started = _capture(_execute, conn, f"SAVEPOINT {_SAVEPOINT}")
        if isinstance(started, outcome.Error):
            return started
        result = _capture(op.fn, conn)
        if not conn.in_transaction:
            return result
        try:
            if isinstance(result, outcome.Error):
                conn.execute(f"ROLLBACK TO {_SAVEPOINT}")
            conn.execute(f"RELEASE {_SAVEPOINT}")
        except sqlite3.Error as exc:
            # The savepoint's state is unknown: give the whole transaction up (the others run
            # again) rather than commit something half undone.
            try:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            if isinstance(result, outcome.Value):
                result = outcome.Error(exc)
        return result

    def _progress(self) -> int:
        """SQLite's progress handler: non-zero aborts the statement (``SQLITE_INTERRUPT``)."""
        running = self._running
        return 1 if running is not None and running.interrupted else 0


def _execute(conn: sqlite3.Connection, sql: str) -> None:
    conn.execute(sql)


def _capture(fn: Callable[..., Any], *args: Any) -> outcome.Outcome[Any]:
    """``outcome.capture``, one frame less per statement the lane runs."""
    try:
        return outcome.Value(fn(*args))
    except BaseException as exc:
        return outcome.Error(exc)


def _own_error(failure: outcome.Outcome[Any] | None) -> outcome.Outcome[Any]:
    """One caller's copy of an error shared by a batch (an outcome unwraps once, and each
    caller raises its own exception object, with its own traceback)."""
    assert isinstance(failure, outcome.Error)
    try:
        error = copy.copy(failure.error)
    except Exception:  # pragma: no cover - an exception that cannot be copied is shared
        error = failure.error
    return outcome.Error(error)


def _wake_all(ops: list[_Op]) -> None:
    for op in ops:
        if op.committed is not None and isinstance(op.result, outcome.Value):
            try:
                op.committed(op.result.value)
            except Exception:  # pragma: no cover - a hook must not keep callers asleep
                log.exception("a lane commit hook failed")
    for op in ops:
        op.wake.set()


def _deliver(token: trio.lowlevel.TrioToken, fn: Callable[..., object], *args: Any) -> None:
    """Run ``fn(*args)`` in the trio thread soon (nothing to do once trio's run has ended)."""
    with contextlib.suppress(trio.RunFinishedError):  # the run ended under a lingering hop
        token.run_sync_soon(fn, *args)


def _hop_ended(token: trio.lowlevel.TrioToken, result: outcome.Outcome[None]) -> None:
    """``start_thread_soon``'s delivery, in the hop thread: ``_hop`` never raises."""
