"""A small trio-facing pool of sync psycopg connections.

psycopg's ``AsyncConnection`` and ``psycopg_pool`` are asyncio-only, and the sync
``psycopg_pool.ConnectionPool`` runs its own worker threads. This pool runs nothing in the
background: a ``trio.CapacityLimiter`` of ``size`` hands out connections, each call is one
``trio.to_thread`` hop (do a whole transaction per hop: the hop costs more than a round trip),
and idle connections wait in a list.

Cancellation really stops the query: when trio cancels the caller, it sends
``conn.cancel_safe()`` (shielded, in its own hop) and then waits, still shielded, for the worker
thread to finish, so the thread is never left behind holding the connection, and the resulting
``QueryCanceled`` becomes trio's ``Cancelled``. The connection goes back to the pool only after
both have finished, so a late cancel request can never hit another caller's query.

That wait needs no sibling task per call: each hop passes ``trio.to_thread.run_sync`` a
``_Hop`` as its limiter (a CapacityLimiter-like object, as trio documents), whose
``release_on_behalf_of`` trio calls in the trio thread once the worker thread is done, also when
the caller has stopped waiting for it (``abandon_on_cancel=True`` only lets the caller react at
once; the result is still collected).
"""

from __future__ import annotations

import logging
import select
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar, cast

import outcome
import psycopg
import trio
from psycopg import pq

__all__ = ["ConnectionPool"]

log = logging.getLogger("tritask_postgres")

T = TypeVar("T")

_CANCEL_TIMEOUT_S = 5.0


def _is_idle_and_alive(conn: psycopg.Connection[Any]) -> bool:
    """Whether a pooled connection is reusable, judged without a round trip.

    A healthy idle connection has nothing to read. When the server ends one (restart,
    ``pg_terminate_backend``, idle timeout) it sends an error and closes the socket, which makes
    it readable. Anything readable is therefore discarded: reconnecting costs one hop, while
    reusing it would fail the caller's transaction.
    """
    if conn.closed or conn.broken:
        return False
    if conn.info.transaction_status != pq.TransactionStatus.IDLE:
        return False
    try:
        readable, _, _ = select.select([conn.fileno()], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable


class ConnectionPool:
    """At most ``size`` connections; ``run(fn)`` calls ``fn(conn)`` in a worker thread."""

    def __init__(
        self,
        conninfo: str,
        *,
        size: int,
        connect_kwargs: Mapping[str, Any],
        setup: Callable[[psycopg.Connection[Any]], None] | None = None,
    ) -> None:
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ValueError("pool_size must be a positive int")
        self._conninfo = conninfo
        self._connect_kwargs = dict(connect_kwargs)
        self._setup = setup
        self._size = size
        self._limiter = trio.CapacityLimiter(size)
        # Own thread limiters: the callers already hold ``_limiter``, so these never block, but
        # they keep database threads out of trio's process-wide default limiter (40 threads).
        # A call's own hop is limited by ``_limiter`` alone (see ``_Hop``).
        self._threads = trio.CapacityLimiter(size)
        self._cancellers = trio.CapacityLimiter(size)
        self._idle: list[psycopg.Connection[Any]] = []
        self._closed = False

    @property
    def size(self) -> int:
        return self._size

    def connect(self) -> psycopg.Connection[Any]:
        """A new autocommit connection, set up (blocking: call it from a worker thread)."""
        conn = psycopg.Connection.connect(self._conninfo, autocommit=True, **self._connect_kwargs)
        try:
            if self._setup is not None:
                self._setup(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    async def run(self, fn: Callable[[psycopg.Connection[Any]], T]) -> T:
        """Run ``fn(conn)`` in a worker thread on a pooled connection (one hop)."""
        try:
            # Fair like ``acquire()`` (it refuses while others wait), without its extra
            # schedule point: the hop below checks for cancellation and yields anyway.
            self._limiter.acquire_nowait()
        except trio.WouldBlock:
            await self._limiter.acquire()
        try:
            if self._closed:
                raise trio.ClosedResourceError("the store is closed")
            conn = await self._checkout()
            try:
                return await self._call(conn, fn)
            finally:
                # A failed or cancelled transaction was rolled back: the connection is reusable
                # unless it broke, so decide by its state, not by the exception.
                self._checkin(conn)
        finally:
            self._limiter.release()

    async def _checkout(self) -> psycopg.Connection[Any]:
        while self._idle:
            conn = self._idle.pop()
            if _is_idle_and_alive(conn):
                return conn
            log.info("discarding a dead pooled PostgreSQL connection")
            conn.close()
        return await trio.to_thread.run_sync(self.connect, limiter=self._threads)

    def _checkin(self, conn: psycopg.Connection[Any]) -> None:
        healthy = (
            not self._closed
            and not conn.closed
            and not conn.broken
            and conn.info.transaction_status == pq.TransactionStatus.IDLE
        )
        if healthy:
            self._idle.append(conn)
        else:
            conn.close()

    async def _call(
        self, conn: psycopg.Connection[Any], fn: Callable[[psycopg.Connection[Any]], T]
    ) -> T:
        """One hop; on cancellation a server-side cancel, then a shielded wait for the thread.

        Callers see the store's own exceptions and a plain ``Cancelled``. A call whose thread
        finished its work although the caller was cancelled (the cancel came too late) returns
        that result, as an uncancelled call would; the caller's next checkpoint raises.
        """
        hop: _Hop[T] = _Hop(fn)
        try:
            result = await trio.to_thread.run_sync(
                hop.run,
                conn,
                # A CapacityLimiter-like object, as trio.to_thread.run_sync documents.
                limiter=cast(trio.CapacityLimiter, hop),
                abandon_on_cancel=True,
            )
        except trio.Cancelled:
            if not hop.started:
                raise  # cancelled before the thread was handed the call
            with trio.CancelScope(shield=True):
                if not hop.finished:
                    await trio.to_thread.run_sync(_cancel_quietly, conn, limiter=self._cancellers)
                await hop.wait_finished()
            late = hop.result
            assert late is not None
            if isinstance(late, outcome.Error) and isinstance(
                late.error, psycopg.errors.QueryCanceled
            ):
                raise  # our cancel stopped the query
            return late.unwrap()
        if isinstance(result, outcome.Error) and isinstance(
            result.error, psycopg.errors.QueryCanceled
        ):
            await trio.lowlevel.checkpoint()  # raises Cancelled if the cancel was ours
        return result.unwrap()

    async def aclose(self) -> None:
        """Close the idle connections; busy ones are closed when their call returns."""
        self._closed = True
        idle, self._idle = self._idle, []
        if idle:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(_close_all, idle, limiter=self._threads)
        else:
            await trio.lowlevel.checkpoint()


class _Hop(Generic[T]):
    """One call's thread hop, and its ``trio.to_thread.run_sync`` limiter.

    As a limiter it never limits (callers hold the pool's ``_limiter``), it only observes:
    ``acquire_on_behalf_of`` runs just before trio hands ``run`` to a worker thread, and
    ``release_on_behalf_of`` in the trio thread once that thread is done, even when the caller
    stopped waiting for it. Everything but ``run`` happens in the trio thread.
    """

    __slots__ = ("_done", "_fn", "finished", "result", "started")

    def __init__(self, fn: Callable[[psycopg.Connection[Any]], T]) -> None:
        self._fn = fn
        self.started = False
        self.finished = False
        self.result: outcome.Outcome[T] | None = None
        self._done: trio.Event | None = None

    def run(self, conn: psycopg.Connection[Any]) -> outcome.Outcome[T]:
        """In the worker thread: never raises, so trio always delivers the outcome."""
        result = outcome.capture(self._fn, conn)
        self.result = result
        return result

    async def acquire_on_behalf_of(self, borrower: object) -> None:
        # No checkpoint: trio.to_thread.run_sync has just checked for cancellation, and the
        # hop itself is the schedule point.
        self.started = True

    def release_on_behalf_of(self, borrower: object) -> None:
        self.finished = True
        if self._done is not None:
            self._done.set()

    async def wait_finished(self) -> None:
        if self.finished:
            await trio.lowlevel.checkpoint()
            return
        self._done = trio.Event()
        await self._done.wait()


def _cancel_quietly(conn: psycopg.Connection[Any]) -> None:
    try:
        conn.cancel_safe(timeout=_CANCEL_TIMEOUT_S)
    except Exception as exc:  # the query still ends: at the latest with the statement timeout
        log.warning("could not cancel a PostgreSQL query: %s", exc)


def _close_all(conns: list[psycopg.Connection[Any]]) -> None:
    for conn in conns:
        conn.close()
