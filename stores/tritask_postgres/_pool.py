"""A small trio-facing pool of sync psycopg connections.

psycopg's ``AsyncConnection`` and ``psycopg_pool`` are asyncio-only, and the sync
``psycopg_pool.ConnectionPool`` runs its own worker threads. This pool runs nothing in the
background: a ``trio.CapacityLimiter`` of ``size`` hands out connections, each call is one
``trio.to_thread`` hop (do a whole transaction per hop: the hop costs more than a round trip),
and idle connections wait in a list.

Cancellation really stops the query: the worker thread is never abandoned (an abandoned thread
keeps the connection busy and the query running), a shielded sibling sends
``conn.cancel_safe()`` when trio cancels the caller, and the resulting ``QueryCanceled`` becomes
trio's ``Cancelled``. The connection goes back to the pool only after that sibling has finished,
so a late cancel request can never hit another caller's query.
"""

from __future__ import annotations

import logging
import select
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

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
        async with self._limiter:
            if self._closed:
                raise trio.ClosedResourceError("the store is closed")
            conn = await self._checkout()
            try:
                return await self._call(conn, fn)
            finally:
                # A failed or cancelled transaction was rolled back: the connection is reusable
                # unless it broke, so decide by its state, not by the exception.
                self._checkin(conn)

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
        """The verified recipe: an un-abandoned thread plus a shielded ``cancel_safe`` sibling.

        Neither the body nor the sibling lets an exception out of the nursery (the outcome is
        captured, the sibling absorbs the cancellation it exists to react to), so callers see
        the store's own exceptions and a plain ``Cancelled``, never an ``ExceptionGroup``.
        """
        finished = False

        async def cancel_on_cancellation() -> None:
            try:
                await trio.sleep_forever()
            except trio.Cancelled:
                if not finished:
                    with trio.CancelScope(shield=True):
                        await trio.to_thread.run_sync(
                            _cancel_quietly, conn, limiter=self._cancellers
                        )
                # This task only reacts to cancellation; the caller's Cancelled is raised below.

        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_on_cancellation)
            try:
                result = await outcome.acapture(self._in_thread, conn, fn)
            finally:
                finished = True
                nursery.cancel_scope.cancel()
        if isinstance(result, outcome.Error) and isinstance(
            result.error, psycopg.errors.QueryCanceled
        ):
            await trio.lowlevel.checkpoint()  # raises Cancelled if the cancel was ours
        return result.unwrap()

    async def _in_thread(
        self, conn: psycopg.Connection[Any], fn: Callable[[psycopg.Connection[Any]], T]
    ) -> T:
        return await trio.to_thread.run_sync(fn, conn, limiter=self._threads)

    async def aclose(self) -> None:
        """Close the idle connections; busy ones are closed when their call returns."""
        self._closed = True
        idle, self._idle = self._idle, []
        if idle:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(_close_all, idle, limiter=self._threads)
        else:
            await trio.lowlevel.checkpoint()


def _cancel_quietly(conn: psycopg.Connection[Any]) -> None:
    try:
        conn.cancel_safe(timeout=_CANCEL_TIMEOUT_S)
    except Exception as exc:  # the query still ends: at the latest with the statement timeout
        log.warning("could not cancel a PostgreSQL query: %s", exc)


def _close_all(conns: list[psycopg.Connection[Any]]) -> None:
    for conn in conns:
        conn.close()
