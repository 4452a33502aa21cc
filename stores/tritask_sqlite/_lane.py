"""``Lane``: the store's one connection, used by one operation at a time, in arrival order,
with the operations queued behind each other committed together (group commit).

Why not one ``trio.to_thread`` hop per operation under a ``trio.Lock``: then the connection
sits idle between two operations until the trio loop has run the first caller on (it releases
the lock) and the next one (it starts its hop). On a busy server that loop turn is the HTTP
work of every other runnable task, and it measured longer than the operation itself: the
store's throughput fell to a fraction of what the database allows.

So a hop drains the queue. The caller that finds the lane idle becomes its *driver*: it runs
one ``trio.to_thread.run_sync`` call that executes its own operation and then, without going
back to trio, the operations queued behind it. The driver's wait is bounded: once its own
operation is done the hop runs at most ``budget`` more, then the driver hands the *baton* to
the oldest waiting caller, which starts the next hop. No thread is the lane's own: every hop is
one of trio's worker threads, for blocking database calls only.

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
gets ``Connection.interrupt()`` and its caller waits for the thread to come back, then raises
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
import copy
import sqlite3
import threading
from collections.abc import Callable, Sequence
from typing import Any, Final, Literal, TypeVar, cast

import attrs
import outcome
import trio

__all__ = ["Kind", "Lane", "savepoint"]

T = TypeVar("T")

#: Operations a hop may run after its driver's own, before it hands the baton on.
DEFAULT_BUDGET: Final = 16
#: Operations at most in one batch (one transaction, one commit).
DEFAULT_MAX_BATCH: Final = 64
#: SQLite virtual-machine steps between two checks of the running operation's interrupt.
PROGRESS_STEPS: Final = 1000

Kind = Literal["write", "read", "alone"]
_State = Literal["queued", "running", "ran", "done", "withdrawn"]
_SAVEPOINT: Final = "tritask_op"


@attrs.define(eq=False)
class _Op:
    fn: Callable[[sqlite3.Connection], Any]
    kind: Kind = "alone"
    atomic: bool = False
    state: _State = "queued"
    result: outcome.Outcome[Any] | None = None
    interrupted: bool = False
    baton: bool = False
    wake: trio.Event = attrs.field(factory=trio.Event)

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
    """Runs ``fn(connection)`` calls one at a time, in arrival order, in trio worker threads;
    consecutive ``write``/``read`` operations share one transaction and one commit."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        *,
        budget: int = DEFAULT_BUDGET,
        max_batch: int = DEFAULT_MAX_BATCH,
    ) -> None:
        if budget < 0:
            raise ValueError("budget must be >= 0")
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self._conn = conn
        self._budget = budget
        self._max_batch = max_batch
        self._mutex = threading.Lock()  # guards _queue, _busy, _stop and every _Op.state
        self._queue: collections.deque[_Op] = collections.deque()
        self._busy = False  # a hop runs, or the baton is on its way to the next driver
        self._stop = False  # the driver was cancelled: end the hop after the current op
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
        self, fn: Callable[[sqlite3.Connection], T], *, kind: Kind = "alone", atomic: bool = False
    ) -> T:
        """Run ``fn(connection)``; its result (or exception) once it is committed.

        ``kind="write"``: ``fn`` writes inside the batch's transaction (in a savepoint of its
        own unless ``atomic``: it runs at most one writing statement); ``"read"``: it only
        reads; ``"alone"``: outside any batch, managing its own transaction.
        """
        await trio.lowlevel.checkpoint_if_cancelled()  # cancelled already: run nothing
        op = _Op(fn, kind, atomic)
        with self._mutex:
            self._queue.append(op)
            if not self._busy:
                self._busy = True
                self._idle = trio.Event()
                op.baton = True
        try:
            while not op.done():
                if op.baton:
                    op.baton = False
                    await self._drive(op)
                    continue
                wake = op.wake = trio.Event()
                if not op.done() and not op.baton:
                    await wake.wait()
        except BaseException as exc:
            return cast(T, await self._abandon(op, exc))
        assert op.result is not None
        if op.interrupted and isinstance(op.result, outcome.Error):
            await trio.lowlevel.checkpoint()  # raises the caller's Cancelled
        return cast(T, op.result.unwrap())

    async def _abandon(self, op: _Op, exc: BaseException) -> Any:
        """The caller was interrupted (``Cancelled``, or anything else) while waiting."""
        state = self._stop_op(op)
        if state == "queued" and op.baton:  # handed the baton but never used it
            self._pass_baton()
        if state in ("queued", "withdrawn") or not isinstance(exc, trio.Cancelled):
            raise exc  # anything but Cancelled (e.g. KeyboardInterrupt) is never swallowed
        with trio.CancelScope(shield=True):
            while not op.done():
                wake = op.wake = trio.Event()
                if not op.done():
                    await wake.wait()
        assert op.result is not None
        if op.interrupted and isinstance(op.result, outcome.Error):
            raise exc  # it did not happen: what interrupted the caller stands
        return op.result.unwrap()

    async def _drive(self, op: _Op) -> None:
        """Run one hop (``op`` first), then pass the baton on or mark the lane idle.

        No sibling task watches for the driver's cancellation: the hop is started with
        ``abandon_on_cancel=True`` and a ``_HopWatch`` as its limiter, so a cancelled driver
        hears of it at once, stops the hop after the current operation (interrupting its own),
        and waits, shielded, until trio reports the thread done.
        """
        token = trio.lowlevel.current_trio_token()
        with self._mutex:
            self._stop = False
        watch = _HopWatch()
        failure: BaseException | None = None
        try:
            await trio.to_thread.run_sync(
                self._hop,
                op,
                token,
                # A CapacityLimiter-like object, as trio.to_thread.run_sync documents.
                limiter=cast(trio.CapacityLimiter, watch),
                abandon_on_cancel=True,
            )
        except BaseException as exc:  # Cancelled, or no thread could run the hop at all
            failure = exc
            self._stop_op(op, end_hop=True)
            if watch.started:
                # The thread holds the connection until trio reports it done: the baton must
                # not move before that, even if something (KeyboardInterrupt) lands meanwhile.
                with trio.CancelScope(shield=True):
                    while not watch.finished:
                        try:
                            await watch.wait_finished()
                        except BaseException as late:
                            failure = late
        finally:
            self._pass_baton()
        if op.state == "withdrawn":
            assert failure is not None
            raise failure
        if failure is not None and not isinstance(failure, trio.Cancelled):
            raise failure

    def _stop_op(self, op: _Op, *, end_hop: bool = False) -> _State:
        """Its caller gave up: withdraw ``op`` if still queued, interrupt it if running (decided
        under the mutex, so an interrupt never reaches another operation). An operation that
        ran and waits for its batch's commit is left to commit. ``end_hop`` also ends the
        running hop after the current operation. Returns the state it found."""
        with self._mutex:
            if end_hop:
                self._stop = True
            state = op.state
            if state == "queued":
                self._queue.remove(op)
                op.state = "withdrawn"
            elif state == "running":
                op.interrupted = True
                self._conn.interrupt()
        return state

    def _pass_baton(self) -> None:
        """Give the lane to the oldest queued caller, or mark it idle (trio thread only)."""
        with self._mutex:
            nxt = self._queue[0] if self._queue else None
            if nxt is None:
                self._busy = False
            else:
                nxt.baton = True
        if nxt is None:
            self._idle.set()
        else:
            nxt.wake.set()

    # -- in the worker thread -------------------------------------------------------------------

    def _hop(self, driver: _Op, token: trio.lowlevel.TrioToken) -> None:
        """In a worker thread: the driver's op (with its batch), then up to ``budget`` more."""
        after = 0
        while True:
            with self._mutex:
                if not self._queue:
                    break
                driver_done = driver.state in ("done", "withdrawn")
                if driver_done and (self._stop or after >= self._budget):
                    break
                head = self._queue.popleft()
                head.state = "running"
                self._running = head
            limit = self._max_batch
            if driver_done:
                limit = min(limit, self._budget - after)
            if head.kind == "alone":
                result = _capture(head.fn, self._conn)
                with self._mutex:
                    head.result = result
                    head.state = "done"
                    self._running = None
                finished = [head]
            else:
                finished = self._batch(head, limit)
            self.operations += len(finished)
            if driver_done:
                after += len(finished)
            woken = [op for op in finished if op is not driver]
            if woken:
                token.run_sync_soon(_wake_all, woken)
        self.hops += 1

    def _take(self, write: bool, taken: int, limit: int) -> _Op | None:
        """The next queued operation that may join the open batch, marked running."""
        with self._mutex:
            if self._stop or taken >= limit or not self._queue:
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


class _HopWatch:
    """A hop's ``trio.to_thread.run_sync`` limiter that limits nothing, only observes.

    The lane already lets one hop run at a time. ``acquire_on_behalf_of`` runs just before trio
    hands the hop to a worker thread; ``release_on_behalf_of`` runs in the trio thread once that
    thread is done, also after its caller stopped waiting (``abandon_on_cancel``).
    """

    __slots__ = ("_done", "finished", "started")

    def __init__(self) -> None:
        self.started = False
        self.finished = False
        self._done: trio.Event | None = None

    async def acquire_on_behalf_of(self, borrower: object) -> None:
        self.started = True  # no checkpoint: to_thread has just checked for cancellation

    def release_on_behalf_of(self, borrower: object) -> None:
        self.finished = True
        if self._done is not None:
            self._done.set()

    async def wait_finished(self) -> None:
        if not self.finished:
            self._done = trio.Event()
            await self._done.wait()


def _execute(conn: sqlite3.Connection, sql: str) -> None:
    conn.execute(sql)


def _capture(fn: Callable[..., Any], *args: Any) -> outcome.Outcome[Any]:
    return cast("outcome.Outcome[Any]", outcome.capture(fn, *args))


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
        op.wake.set()
