"""``Lane``: the store's one connection, used by one operation at a time, in arrival order.

Why not one ``trio.to_thread`` hop per operation under a ``trio.Lock``: then the connection
sits idle between two operations until the trio loop has run the first caller on (it releases
the lock) and the next one (it starts its hop). On a busy server that loop turn is the HTTP
work of every other runnable task, and it measured longer than the operation itself: the
store's throughput fell to a fraction of what the database allows.

So a hop drains the queue. The caller that finds the lane idle becomes its *driver*: it runs
one ``trio.to_thread.run_sync`` call that executes its own operation and then, without going
back to trio, the operations queued behind it, each still its own transaction, each caller
woken as soon as its operation is done (``TrioToken.run_sync_soon``). The driver's wait is
bounded: once its own operation is done the hop runs at most ``budget`` more, then the driver
hands the *baton* to the oldest waiting caller, which starts the next hop. No thread is the
lane's own: every hop is one of trio's worker threads, for blocking database calls only.

Cancellation is what it was with a lock: a queued operation is withdrawn unrun; a running one
gets ``Connection.interrupt()`` and its caller waits for the thread to come back, then raises
``Cancelled`` unless the operation had already committed (then it returns the result: trio's
rule is that ``Cancelled`` means it did not happen). The interrupt is decided under the lane's
mutex while the operation is marked running, so it can never reach the next operation (SQLite
clears a pending interrupt when a statement starts with none active). For the same reason an
interrupt that lands between two statements of the operation would be lost, so the lane also
installs a progress handler that aborts any statement the interrupted operation goes on to run
(it runs every ``PROGRESS_STEPS`` virtual-machine steps: never for the store's short
statements, within microseconds for a long one).
"""

from __future__ import annotations

import collections
import sqlite3
import threading
from collections.abc import Callable
from typing import Any, Final, Literal, TypeVar, cast

import attrs
import outcome
import trio

__all__ = ["Lane"]

T = TypeVar("T")

#: Operations a hop may run after its driver's own, before it hands the baton on.
DEFAULT_BUDGET: Final = 16
#: SQLite virtual-machine steps between two checks of the running operation's interrupt.
PROGRESS_STEPS: Final = 1000

_State = Literal["queued", "running", "done", "withdrawn"]


@attrs.define(eq=False)
class _Op:
    fn: Callable[[sqlite3.Connection], Any]
    state: _State = "queued"
    result: outcome.Outcome[Any] | None = None
    interrupted: bool = False
    baton: bool = False
    wake: trio.Event = attrs.field(factory=trio.Event)

    def done(self) -> bool:
        return self.state == "done"


class Lane:
    """Runs ``fn(connection)`` calls one at a time, in arrival order, in trio worker threads."""

    def __init__(self, conn: sqlite3.Connection, *, budget: int = DEFAULT_BUDGET) -> None:
        if budget < 0:
            raise ValueError("budget must be >= 0")
        self._conn = conn
        self._budget = budget
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

    async def wait_idle(self) -> None:
        """Return once no operation is queued or running (for closing the connection)."""
        while not self._idle.is_set():
            await self._idle.wait()

    async def run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        await trio.lowlevel.checkpoint_if_cancelled()  # cancelled already: run nothing
        op = _Op(fn)
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
        under the mutex, so an interrupt never reaches another operation). ``end_hop`` also
        ends the running hop after the current operation. Returns the state it found."""
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

    def _hop(self, driver: _Op, token: trio.lowlevel.TrioToken) -> None:
        """In a worker thread: the driver's op, then up to ``budget`` queued ones."""
        after = 0
        while True:
            with self._mutex:
                if not self._queue:
                    break
                if driver.state in ("done", "withdrawn") and (self._stop or after >= self._budget):
                    break
                op = self._queue.popleft()
                op.state = "running"
                self._running = op
            result = outcome.capture(op.fn, self._conn)
            with self._mutex:
                op.result = result
                op.state = "done"
                self._running = None
            self.operations += 1
            if op is not driver:
                after += driver.state == "done"
                token.run_sync_soon(_wake, op)
        self.hops += 1

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


def _wake(op: _Op) -> None:
    op.wake.set()
