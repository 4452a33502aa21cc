"""A small trio-facing pool of psycopg connections, each wrapped in a :class:`Session`.

psycopg's ``AsyncConnection`` and ``psycopg_pool`` are asyncio-only, and the sync
``psycopg_pool.ConnectionPool`` runs its own worker threads. This pool runs nothing in the
background: a ``trio.CapacityLimiter`` of ``size`` hands out connections, and idle connections
wait in a list. ``run(fn)`` awaits ``fn(session)`` on the trio thread: its statements go through
libpq's non-blocking API (see ``_native``, which also describes cancellation). Only connecting,
closing, a server-side cancel request and ``run_sync`` (plain psycopg code, for the schema
check) take a ``trio.to_thread`` hop, each limited to ``size`` threads outside trio's
process-wide default limiter.

A connection goes back to the pool only when it is idle (connected, outside a transaction,
nothing pending); anything else is closed.
"""

from __future__ import annotations

import logging
import select
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import psycopg
import trio
from psycopg import pq

from tritask_postgres._native import Session

__all__ = ["ConnectionPool"]

log = logging.getLogger("tritask_postgres")

T = TypeVar("T")


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
        # poll, not select: select() refuses descriptors from 1024 on, which a busy server has.
        poller = select.poll()
        poller.register(conn.fileno(), select.POLLIN)
        return not poller.poll(0)
    except (OSError, ValueError):
        return False


class ConnectionPool:
    """At most ``size`` connections; ``run(fn)`` awaits ``fn(session)`` with one of them."""

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
        # UTF-8 both ways: sessions encode parameters and decode text columns as UTF-8.
        self._connect_kwargs = {**connect_kwargs, "client_encoding": "utf8"}
        self._setup = setup
        self._size = size
        self._limiter = trio.CapacityLimiter(size)
        # Own thread limiters: the callers already hold ``_limiter``, so these never block, but
        # they keep database threads out of trio's process-wide default limiter (40 threads).
        self._threads = trio.CapacityLimiter(size)
        self._cancellers = trio.CapacityLimiter(size)
        self._idle: list[Session] = []
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

    async def run(self, fn: Callable[[Session], Awaitable[T]]) -> T:
        """Await ``fn(session)`` on a pooled connection, in the trio thread."""
        async with self.session() as session:
            return await fn(session)

    async def run_sync(self, fn: Callable[[psycopg.Connection[Any]], T]) -> T:
        """Run blocking psycopg code ``fn(conn)`` on a pooled connection, in a worker thread.

        Not cancellable once started (the thread runs to its end): for short administrative
        reads such as the schema check.
        """
        async with self.session() as session:
            return await trio.to_thread.run_sync(fn, session.conn, limiter=self._threads)

    @asynccontextmanager
    async def session(self) -> AsyncIterator[Session]:
        """Hold one pooled connection for the block (``run`` is this around one call)."""
        try:
            # Fair like ``acquire()`` (it refuses while others wait), without its extra
            # schedule point: the first statement checks for cancellation anyway.
            self._limiter.acquire_nowait()
        except trio.WouldBlock:
            await self._limiter.acquire()
        try:
            if self._closed:
                raise trio.ClosedResourceError("the store is closed")
            session = await self._checkout()
            try:
                yield session
            finally:
                # A failed or cancelled transaction was rolled back: the connection is reusable
                # unless it broke, so decide by its state, not by the exception.
                self._checkin(session)
        finally:
            self._limiter.release()

    async def _checkout(self) -> Session:
        while self._idle:
            session = self._idle.pop()
            if _is_idle_and_alive(session.conn):
                return session
            log.info("discarding a dead pooled PostgreSQL connection")
            session.conn.close()
        conn = await trio.to_thread.run_sync(self.connect, limiter=self._threads)
        return Session(conn, self._cancellers)

    def _checkin(self, session: Session) -> None:
        if not self._closed and not session.conn.closed and session.idle:
            self._idle.append(session)
        else:
            session.conn.close()

    async def aclose(self) -> None:
        """Close the idle connections; busy ones are closed when their call returns."""
        self._closed = True
        idle, self._idle = self._idle, []
        if idle:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(
                    _close_all, [s.conn for s in idle], limiter=self._threads
                )
        else:
            await trio.lowlevel.checkpoint()


def _close_all(conns: list[psycopg.Connection[Any]]) -> None:
    for conn in conns:
        conn.close()
