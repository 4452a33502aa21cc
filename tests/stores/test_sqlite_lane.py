"""The SQLite store's lane: one connection, arrival order, hops that drain the queue.

Real worker threads run the operations, so ordering is forced with ``threading.Event``s and
``trio.testing.wait_all_tasks_blocked`` (never with sleeps); ``fail_after`` only guards against
a hang.
"""

from __future__ import annotations

import functools
import sqlite3
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import trio
import trio.testing
from tritask_sqlite._lane import Lane

ENDLESS = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) SELECT count(*) FROM n"
GUARD = 30  # seconds: a hang fails the test instead of blocking the run


@pytest.fixture
def conn(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    connection = sqlite3.connect(
        tmp_path / "lane.db", isolation_level=None, check_same_thread=False
    )
    connection.execute("CREATE TABLE log (n INTEGER)")
    try:
        yield connection
    finally:
        connection.close()


def gate(ran: list[int], n: int, release: threading.Event) -> Callable[[sqlite3.Connection], int]:
    """An operation that blocks its hop until ``release`` is set."""

    def fn(conn: sqlite3.Connection) -> int:
        if not release.wait(GUARD):
            raise TimeoutError("the test never released the gate")
        ran.append(n)
        conn.execute("INSERT INTO log VALUES (?)", (n,))
        return n

    return fn


def op(ran: list[int], n: int) -> Callable[[sqlite3.Connection], int]:
    def fn(conn: sqlite3.Connection) -> int:
        ran.append(n)
        conn.execute("INSERT INTO log VALUES (?)", (n,))
        return n * 10

    return fn


async def start_in_order(nursery: trio.Nursery, *callers: Callable[[], Awaitable[object]]) -> None:
    """Start each caller once every task is blocked again, so they reach the lane in order."""
    for caller in callers:
        nursery.start_soon(caller)
        await trio.testing.wait_all_tasks_blocked()


async def test_one_hop_drains_the_callers_queued_behind_it(conn: sqlite3.Connection) -> None:
    lane = Lane(conn, budget=16)
    ran: list[int] = []
    results: dict[int, int] = {}
    release = threading.Event()

    async def call(n: int, fn: Callable[[sqlite3.Connection], int]) -> None:
        results[n] = await lane.run(fn)

    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            await start_in_order(
                nursery,
                functools.partial(call, 0, gate(ran, 0, release)),
                *(functools.partial(call, n, op(ran, n)) for n in range(1, 6)),
            )
            assert ran == []
            release.set()
    assert ran == [0, 1, 2, 3, 4, 5]
    assert results == {0: 0, 1: 10, 2: 20, 3: 30, 4: 40, 5: 50}
    assert (lane.hops, lane.operations) == (1, 6)
    assert [row[0] for row in conn.execute("SELECT n FROM log")] == [0, 1, 2, 3, 4, 5]


async def test_the_budget_bounds_the_driver_then_the_baton_moves_on(
    conn: sqlite3.Connection,
) -> None:
    lane = Lane(conn, budget=2)
    ran: list[int] = []
    release = threading.Event()
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            await start_in_order(
                nursery,
                functools.partial(lane.run, gate(ran, 0, release)),
                *(functools.partial(lane.run, op(ran, n)) for n in range(1, 7)),
            )
            release.set()
    # hop 1: the driver's op and 2 more; hop 2 (driven by op 3's caller): 3 and 2 more; hop 3: 6
    assert ran == [0, 1, 2, 3, 4, 5, 6]
    assert (lane.hops, lane.operations) == (3, 7)
    await trio.testing.wait_all_tasks_blocked()
    assert await lane.run(op(ran, 7)) == 70
    assert lane.hops == 4


async def test_a_cancelled_queued_operation_never_runs(conn: sqlite3.Connection) -> None:
    lane = Lane(conn)
    ran: list[int] = []
    release = threading.Event()
    scope = trio.CancelScope()
    outcome: list[str] = []

    async def cancellable() -> None:
        with scope:
            await lane.run(op(ran, 1))
            outcome.append("returned")
        outcome.append("cancelled" if scope.cancelled_caught else "not cancelled")

    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            await start_in_order(
                nursery,
                functools.partial(lane.run, gate(ran, 0, release)),
                cancellable,
                functools.partial(lane.run, op(ran, 2)),
            )
            scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            assert outcome == ["cancelled"]  # at once, while the hop is still blocked
            release.set()
    assert ran == [0, 2]
    assert lane.operations == 2


async def test_cancelling_a_running_operation_interrupts_it(conn: sqlite3.Connection) -> None:
    """Operation 1 runs in the hop driven by operation 0's caller; its own caller is cancelled."""
    lane = Lane(conn)
    ran: list[int] = []
    release = threading.Event()
    started = trio.Event()
    scope = trio.CancelScope()

    def endless(conn: sqlite3.Connection) -> object:
        conn.execute("BEGIN")
        conn.execute("INSERT INTO log VALUES (1)")
        trio.from_thread.run_sync(started.set)
        try:
            return conn.execute(ENDLESS).fetchone()
        finally:
            conn.execute("ROLLBACK")

    async def cancellable() -> None:
        with scope:
            await lane.run(endless)
        assert scope.cancelled_caught

    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            await start_in_order(
                nursery,
                functools.partial(lane.run, gate(ran, 0, release)),
                cancellable,
                functools.partial(lane.run, op(ran, 2)),
            )
            release.set()
            await started.wait()
            scope.cancel()
    assert ran == [0, 2]
    assert [row[0] for row in conn.execute("SELECT n FROM log")] == [0, 2]
    assert not conn.in_transaction


async def test_a_cancelled_driver_interrupts_its_own_operation_and_passes_the_baton(
    conn: sqlite3.Connection,
) -> None:
    lane = Lane(conn)
    ran: list[int] = []
    started = trio.Event()
    scope = trio.CancelScope()
    results: list[int] = []

    def endless(conn: sqlite3.Connection) -> object:
        trio.from_thread.run_sync(started.set)
        return conn.execute(ENDLESS).fetchone()

    async def driver() -> None:
        with scope:
            await lane.run(endless)
        assert scope.cancelled_caught

    async def call(n: int) -> None:
        results.append(await lane.run(op(ran, n)))

    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(driver)
            await started.wait()
            await start_in_order(nursery, functools.partial(call, 1), functools.partial(call, 2))
            scope.cancel()
    assert ran == [1, 2]
    assert sorted(results) == [10, 20]
    assert lane.hops == 2  # the cancelled driver's hop stopped after its own op


async def test_an_operation_that_committed_before_the_cancel_returns_its_result(
    conn: sqlite3.Connection,
) -> None:
    lane = Lane(conn)
    scope = trio.CancelScope()
    written = trio.Event()
    proceed = threading.Event()

    def commit_then_report(conn: sqlite3.Connection) -> str:
        conn.execute("INSERT INTO log VALUES (7)")  # autocommit: durable on return
        trio.from_thread.run_sync(written.set)
        if not proceed.wait(GUARD):
            raise TimeoutError("the test never let the operation finish")
        return "done"

    async def cancel_after_the_write() -> None:
        await written.wait()
        scope.cancel()  # interrupts a connection that runs no statement any more
        await trio.testing.wait_all_tasks_blocked()
        proceed.set()

    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_after_the_write)
            with scope:
                assert await lane.run(commit_then_report) == "done"
    assert [row[0] for row in conn.execute("SELECT n FROM log")] == [7]
    # the pending interrupt did not leak into the next operation
    assert await lane.run(lambda conn: conn.execute("SELECT count(*) FROM log").fetchone()[0]) == 1


async def test_errors_reach_their_caller_and_the_lane_goes_on(conn: sqlite3.Connection) -> None:
    lane = Lane(conn)

    def broken(conn: sqlite3.Connection) -> None:
        conn.execute("INSERT INTO missing_table VALUES (1)")

    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        await lane.run(broken)
    assert await lane.run(lambda conn: conn.execute("SELECT 41 + 1").fetchone()[0]) == 42
    await lane.wait_idle()


async def test_wait_idle_waits_for_queued_work(conn: sqlite3.Connection) -> None:
    lane = Lane(conn)
    ran: list[int] = []
    release = threading.Event()
    idle = trio.Event()

    async def waiter() -> None:
        await lane.wait_idle()
        idle.set()

    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            await start_in_order(
                nursery,
                functools.partial(lane.run, gate(ran, 0, release)),
                functools.partial(lane.run, op(ran, 1)),
                waiter,
            )
            assert not idle.is_set()
            release.set()
    assert idle.is_set()
    assert ran == [0, 1]


async def test_an_already_cancelled_caller_runs_nothing(conn: sqlite3.Connection) -> None:
    lane = Lane(conn)
    ran: list[int] = []
    with trio.CancelScope() as scope:
        scope.cancel()
        await lane.run(op(ran, 1))
    assert scope.cancelled_caught
    assert ran == []
    assert (lane.hops, lane.operations) == (0, 0)
    assert await lane.run(op(ran, 2)) == 20
