"""The PostgreSQL driver the store runs on: libpq's non-blocking API on the trio thread.

Statements, parameters and result types round-trip exactly; errors are psycopg's; a cancelled
statement is stopped on the server, one that finished first still returns its result; the pool
reuses only idle connections.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import psycopg
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from postgres_support import connect, postgres_dsn
from test_postgres import activity, assert_disconnected
from tritask_postgres._native import Session, statement
from tritask_postgres._pool import ConnectionPool

__all__ = ["postgres_dsn"]  # the fixture this module uses

pytestmark = pytest.mark.postgres

NUL_FREE = st.text(st.characters(blacklist_characters="\x00", codec="utf-8"))


def test_placeholders_become_numbered_parameters() -> None:
    stmt = statement(b"SELECT %(a)s::text, %(b)s::bigint, %(a)s::text, 100 %% 7")
    assert stmt.text == b"SELECT $1::text, $2::bigint, $1::text, 100 % 7"
    assert stmt.names == ("a", "b")
    assert stmt.name.startswith(b"tritask_")
    assert statement("SELECT 1").name != stmt.name
    assert statement("SELECT 1") == statement(b"SELECT 1")
    with pytest.raises(ValueError, match="lone %"):
        statement("SELECT 'x' LIKE 'a%'")


@pytest.fixture
async def session(postgres_dsn: str) -> Any:
    pool = ConnectionPool(postgres_dsn, size=1, connect_kwargs={})
    try:
        async with pool.session() as session:
            yield session
    finally:
        await pool.aclose()


async def one(session: Session, sql: str, **params: object) -> Any:
    row = (await session.execute(statement(sql), params)).fetchone()
    assert row is not None
    return row[0] if len(row) == 1 else row


@asynccontextmanager
async def named_pool(dsn: str, label: str) -> AsyncIterator[tuple[ConnectionPool, str]]:
    """A one-connection pool whose backend is found by its application name; every backend of
    it must be gone once the pool is closed."""
    app = f"tritask-pool-{label}-{time.monotonic_ns()}"
    pool = ConnectionPool(dsn, size=1, connect_kwargs={"application_name": app})
    try:
        yield pool, app
    finally:
        await pool.aclose()
    await assert_disconnected(dsn, app)


async def until_backend(dsn: str, app: str, ready: Callable[[tuple[Any, ...]], bool]) -> None:
    """Poll ``pg_stat_activity`` until the pool's backend is in the state ``ready`` wants."""
    for _ in range(500):
        rows = await trio.to_thread.run_sync(activity, dsn, app)
        if rows and ready(rows[0]):
            return
        await trio.sleep(0.01)
    pytest.fail(f"the backend never got there: {rows}")


async def assert_no_table(pool: ConnectionPool, name: str) -> None:
    """A table created by a transaction that was cancelled does not exist: it rolled back."""
    found = await pool.run(
        lambda session: session.execute(statement(f"SELECT to_regclass('{name}')::text"))
    )
    assert found.rows == [(None,)]


async def test_values_round_trip_with_their_types(session: Session) -> None:
    row = await one(
        session,
        "SELECT %(i)s::bigint, %(s)s::text, %(b)s::boolean, %(n)s::text, %(j)s::json,"
        " %(u)s::uuid, 7::int2, 8::int4, 'x'::varchar, %(jb)s::jsonb, 'name'::name, NULL::int",
        i=-(2**63),
        s="é ☃ \U0001f600",
        b=True,
        n=None,
        j='{"a": [1, 2.5, "\\u0000"]}',
        jb='{"b":[true]}',
        u="8c1bd1fe-5a2c-4f30-9c56-8f0c2d4a6e21",
    )
    assert row == (
        -(2**63),
        "é ☃ \U0001f600",
        True,
        None,
        '{"a": [1, 2.5, "\\u0000"]}',
        "8c1bd1fe-5a2c-4f30-9c56-8f0c2d4a6e21",
        7,
        8,
        "x",
        '{"b": [true]}',
        "name",
        None,
    )
    assert await one(session, "SELECT %(b)s::boolean", b=False) is False


@settings(max_examples=60, deadline=None)
@given(text=NUL_FREE, items=st.lists(NUL_FREE, max_size=5))
def test_text_and_text_arrays_round_trip_exactly(
    postgres_dsn: str, text: str, items: list[str]
) -> None:
    async def check() -> None:
        pool = ConnectionPool(postgres_dsn, size=1, connect_kwargs={})
        try:
            async with pool.session() as session:
                assert await one(session, "SELECT %(t)s::text", t=text) == text
                got = await one(session, "SELECT array_to_json(%(a)s::text[])::text", a=items)
                assert json.loads(got) == items
        finally:
            await pool.aclose()

    trio.run(check)


async def test_array_parameters_carry_nulls_and_ints(session: Session) -> None:
    """A batch's columns (a binary ``text[]``): ``None`` is a NULL element, an int its digits
    (cast on the server), an empty list an empty array."""
    got = await one(
        session, "SELECT array_to_json(%(a)s::text[])::text", a=["x", None, 'q"\\', 7, -2]
    )
    assert json.loads(got) == ["x", None, 'q"\\', "7", "-2"]
    total = await one(
        session, "SELECT sum(v)::bigint FROM unnest(%(a)s::text[]::bigint[]) v", a=[2**62, None, -5]
    )
    assert total == 2**62 - 5
    assert await one(session, "SELECT array_to_json(%(a)s::text[])::text", a=[]) == "[]"
    assert await one(session, "SELECT %(a)s::text[] = '{}'::text[]", a=()) is True
    assert await one(session, "SELECT (%(a)s::text[])[1] IS NULL", a=[None]) is True
    with pytest.raises(TypeError, match="strings, ints and None"):
        await session.execute(statement("SELECT %(a)s::text[]"), {"a": [True]})


async def test_bad_parameters_are_refused_before_sending(session: Session) -> None:
    with pytest.raises(psycopg.DataError, match="NUL"):
        await session.execute(statement("SELECT %(t)s::text"), {"t": "a\x00b"})
    with pytest.raises(psycopg.DataError, match="NUL"):
        await session.execute(statement("SELECT %(t)s::text[]"), {"t": ["a\x00"]})
    with pytest.raises(TypeError, match="float"):
        await session.execute(statement("SELECT %(t)s::text"), {"t": 1.5})
    with pytest.raises(KeyError):
        await session.execute(statement("SELECT %(t)s::text"))
    with pytest.raises(TypeError, match="oid 1700"):
        await session.execute(statement("SELECT 1.5::numeric"))
    assert session.idle
    assert await one(session, "SELECT 1") == 1


async def test_errors_are_psycopgs_and_the_transaction_rolls_back(session: Session) -> None:
    await session.execute(statement("CREATE TEMP TABLE t (k int PRIMARY KEY)"))
    with pytest.raises(psycopg.errors.DivisionByZero) as caught:
        async with session.transaction():
            await session.execute(statement("INSERT INTO t VALUES (1)"))
            await session.execute(statement("SELECT 1 / 0"))
    assert caught.value.diag.sqlstate == "22012"
    assert session.idle
    with pytest.raises(RuntimeError, match="body"):
        async with session.transaction():
            await session.execute(statement("INSERT INTO t VALUES (2)"))
            raise RuntimeError("body")
    async with session.transaction():
        inserted = await session.execute(statement("INSERT INTO t VALUES (3), (4)"))
    assert inserted.rowcount == 2
    assert (await session.execute(statement("SELECT k FROM t ORDER BY k"))).rows == [(3,), (4,)]
    assert session.idle


async def test_statements_are_prepared_once_per_connection(session: Session) -> None:
    stmt = statement("SELECT %(x)s::int + 1")
    for n in range(3):
        assert await one(session, "SELECT %(x)s::int + 1", x=n) == n + 1
    prepared = await one(
        session,
        "SELECT count(*) FROM pg_prepared_statements WHERE name = %(name)s",
        name=stmt.name.decode(),
    )
    assert prepared == 1


def backend_pid(conn: psycopg.Connection[Any]) -> int:
    """The server process behind a pooled connection (the same pid: the same connection)."""
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    assert row is not None
    return int(row[0])


async def test_pool_cancels_a_running_query_and_reuses_the_connection(postgres_dsn: str) -> None:
    sleep = statement("SELECT pg_sleep(30)")
    async with named_pool(postgres_dsn, "cancel") as (pool, app):
        pid = await pool.run_sync(backend_pid)
        with trio.move_on_after(0.2) as scope:
            await pool.run(lambda session: session.execute(sleep))
        assert scope.cancelled_caught
        assert [row[:2] for row in activity(postgres_dsn, app)] == [(pid, "idle")]
        assert await pool.run_sync(backend_pid) == pid
        # a statement that fails on its own is not a cancellation, and the connection survives
        with pytest.raises(psycopg.errors.DivisionByZero):
            await pool.run(lambda session: session.execute(statement("SELECT 1 / 0")))
        assert await pool.run_sync(backend_pid) == pid
        # cancelled inside a transaction: rolled back, the connection idle again
        with trio.move_on_after(0.2) as scope:

            async def in_transaction(session: Session) -> None:
                async with session.transaction():
                    await session.execute(statement("CREATE TABLE pool_cancel_probe (k int)"))
                    await session.execute(sleep)

            await pool.run(in_transaction)
        assert scope.cancelled_caught
        assert await pool.run_sync(backend_pid) == pid
        await assert_no_table(pool, "pool_cancel_probe")


async def test_a_statement_that_beat_the_cancellation_returns_its_result(
    postgres_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server finished the statement before the cancel request reached it: the caller gets
    the result, its next checkpoint is cancelled. A call cancelled before it sends anything
    never runs."""
    key = time.monotonic_ns() % 2**31
    released = threading.Event()
    real_cancel = Session._cancel_quietly
    locked = statement("SELECT 'late' FROM pg_advisory_xact_lock(%(key)s::bigint)")

    async with named_pool(postgres_dsn, "late") as (pool, app):
        with connect(postgres_dsn) as holder:
            holder.execute("SELECT pg_advisory_lock(%s)", (key,))

            def finish_then_cancel(self: Session) -> None:
                holder.execute("SELECT pg_advisory_unlock(%s)", (key,))
                for _ in range(500):  # until the statement is done and the backend idle
                    if [row[1] for row in activity(postgres_dsn, app)] == ["idle"]:
                        break
                    time.sleep(0.01)
                released.set()
                real_cancel(self)

            monkeypatch.setattr(Session, "_cancel_quietly", finish_then_cancel)
            results: list[object] = []
            pid = await pool.run_sync(backend_pid)
            scope = trio.CancelScope()

            async def caller() -> None:
                with scope:
                    found = await pool.run(lambda session: session.execute(locked, {"key": key}))
                    results.append(found.rows)
                    await trio.lowlevel.checkpoint()
                    results.append("not cancelled")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(caller)
                await until_backend(postgres_dsn, app, lambda row: row[1:3] == ("active", "Lock"))
                scope.cancel()
            assert released.is_set()
            assert results == [[("late",)]]
            assert scope.cancelled_caught

            with trio.CancelScope() as early:
                early.cancel()
                await pool.run(lambda session: session.execute(statement("SELECT 1 / 0")))
            assert early.cancelled_caught
            assert await pool.run_sync(backend_pid) == pid  # the same connection, still usable


async def test_a_connection_that_is_not_idle_is_not_reused(postgres_dsn: str) -> None:
    async with named_pool(postgres_dsn, "busy") as (pool, _):
        first = await pool.run_sync(backend_pid)
        # left inside a transaction (a caller bug): closed at check-in, never handed out again
        await pool.run(lambda session: session.execute(statement("BEGIN")))
        assert await pool.run_sync(backend_pid) != first


async def test_a_pipeline_runs_its_statements_in_order_in_one_round_trip(session: Session) -> None:
    await session.execute(statement("CREATE TEMP TABLE p (k int PRIMARY KEY)"))
    insert = statement("INSERT INTO p VALUES (%(k)s::int)")
    count = statement("SELECT count(*) FROM p")
    async with session.transaction():
        first, counted, second = await session.pipeline(
            (insert, {"k": 1}), (count, None), (insert, {"k": 2})
        )
        assert (first.rowcount, counted.rows, second.rowcount) == (1, [(1,)], 1)
        assert session.pgconn.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        final = await session.execute(count, commit=True)
        assert final.rows == [(2,)]
        assert session.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert session.idle
    # A failure raises; the statements after it were skipped, the transaction rolled back.
    with pytest.raises(psycopg.errors.UniqueViolation):
        async with session.transaction():
            await session.pipeline((insert, {"k": 3}), (insert, {"k": 1}), (insert, {"k": 4}))
    assert session.idle
    # Outside a transaction a pipeline is one implicit transaction: all or nothing.
    with pytest.raises(psycopg.errors.DivisionByZero):
        await session.pipeline((insert, {"k": 5}), (statement("SELECT 1 / 0"), None))
    assert (
        await session.execute(statement("SELECT array_agg(k ORDER BY k)::text FROM p"))
    ).rows == [("{1,2}",)]
    assert session.idle


async def test_begin_waits_for_the_first_statement(postgres_dsn: str) -> None:
    async with named_pool(postgres_dsn, "begin") as (pool, app):

        def state() -> str:
            [(_, found, _, _)] = activity(postgres_dsn, app)
            return str(found)

        async with pool.session() as session:
            async with session.transaction():
                assert state() == "idle"  # nothing sent yet
            assert session.idle
            async with session.transaction():
                assert state() == "idle"
                await session.execute(statement("SELECT 1"))
                assert state() == "idle in transaction"  # BEGIN went with the statement
            assert state() == "idle"
            assert session.idle
            with pytest.raises(RuntimeError, match="already open"):
                async with session.transaction(), session.transaction():
                    pass
            assert session.idle


async def test_a_cancelled_pipeline_is_stopped_and_rolled_back(postgres_dsn: str) -> None:
    async with named_pool(postgres_dsn, "pipe") as (pool, app):
        pid = await pool.run_sync(backend_pid)

        async def stuck(session: Session) -> None:
            async with session.transaction():
                await session.pipeline(
                    (statement("CREATE TABLE pipe_cancel_probe (k int)"), None),
                    (statement("SELECT pg_sleep(30)"), None),
                )

        with trio.move_on_after(0.2) as scope:
            await pool.run(stuck)
        assert scope.cancelled_caught
        assert [row[:2] for row in activity(postgres_dsn, app)] == [(pid, "idle")]
        assert await pool.run_sync(backend_pid) == pid
        await assert_no_table(pool, "pipe_cancel_probe")


async def test_parameters_larger_than_the_socket_buffers_go_through(session: Session) -> None:
    big = "x" * 3_000_000 + "é"  # several times the kernel's socket buffers: flushed in parts
    row = await one(session, "SELECT length(%(t)s::text), md5(%(t)s::text)", t=big)
    assert row == (3_000_001, hashlib.md5(big.encode()).hexdigest())
    assert await one(session, "SELECT %(t)s::text", t=big) == big


async def test_a_connection_lost_mid_statement_raises_and_is_replaced(postgres_dsn: str) -> None:
    async with named_pool(postgres_dsn, "lost") as (pool, app):
        pid = await pool.run_sync(backend_pid)

        async def kill_when_active() -> None:
            await until_backend(postgres_dsn, app, lambda row: row[1] == "active")
            with connect(postgres_dsn) as conn:
                conn.execute("SELECT pg_terminate_backend(%s)", (pid,))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(kill_when_active)
            with pytest.raises(psycopg.OperationalError):
                await pool.run(lambda session: session.execute(statement("SELECT pg_sleep(30)")))
        await assert_disconnected(postgres_dsn, app)
        assert await pool.run_sync(backend_pid) != pid  # a new connection took its place


async def test_connections_beyond_descriptor_1024_are_reused(postgres_dsn: str) -> None:
    """The idle check before reuse must work for any descriptor (select() stops at 1024)."""
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        async with named_pool(postgres_dsn, "fd") as (pool, _):
            pid = await pool.run_sync(backend_pid)
            assert await pool.run_sync(lambda conn: conn.fileno()) >= 1024
            for _ in range(3):
                assert await pool.run_sync(backend_pid) == pid  # the same connection each time
    finally:
        for descriptor in filler:
            os.close(descriptor)
