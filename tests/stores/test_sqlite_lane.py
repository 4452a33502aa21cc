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
from typing import Any

import pytest
import trio
import trio.testing
from tritask_sqlite._lane import Lane

ENDLESS = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) SELECT count(*) FROM n"
GUARD = 30  # seconds: a hang fails the test instead of blocking the run


_TOKEN: list[trio.lowlevel.TrioToken] = []


def new_lane(conn: sqlite3.Connection, **options: Any) -> Lane:
    """A lane, and the test's trio token for :func:`in_trio` (hop threads are trio's worker
    threads, but not ``trio.to_thread``'s, so they need the token to call back)."""
    _TOKEN[:] = [trio.lowlevel.current_trio_token()]
    return Lane(conn, **options)


def in_trio(fn: Callable[[], object]) -> None:
    """From a hop thread: run ``fn`` in the trio thread and wait for it."""
    trio.from_thread.run_sync(fn, trio_token=_TOKEN[0])


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
    lane = new_lane(conn)
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
    await lane.wait_idle()
    assert (lane.hops, lane.operations) == (1, 6)
    assert [row[0] for row in conn.execute("SELECT n FROM log")] == [0, 1, 2, 3, 4, 5]


async def test_a_hop_lingers_for_the_next_operation_then_the_lane_goes_idle(
    conn: sqlite3.Connection,
) -> None:
    ran: list[int] = []
    with trio.fail_after(GUARD):
        lingering = new_lane(conn, linger=0.5)
        assert await lingering.run(op(ran, 1)) == 10
        assert await lingering.run(op(ran, 2)) == 20  # taken by the same, waiting, hop
        assert not lingering._idle.is_set()
        await lingering.wait_idle()
        assert (lingering.hops, lingering.operations) == (1, 2)

        prompt = new_lane(conn, linger=0)
        assert await prompt.run(op(ran, 3)) == 30
        await prompt.wait_idle()
        assert await prompt.run(op(ran, 4)) == 40
        await prompt.wait_idle()
        assert (prompt.hops, prompt.operations) == (2, 2)
    assert ran == [1, 2, 3, 4]


async def test_a_cancelled_queued_operation_never_runs(conn: sqlite3.Connection) -> None:
    lane = new_lane(conn)
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
    lane = new_lane(conn)
    ran: list[int] = []
    release = threading.Event()
    started = trio.Event()
    scope = trio.CancelScope()

    def endless(conn: sqlite3.Connection) -> object:
        conn.execute("BEGIN")
        conn.execute("INSERT INTO log VALUES (1)")
        in_trio(started.set)
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


async def test_cancelling_the_first_caller_interrupts_its_operation_and_the_queue_goes_on(
    conn: sqlite3.Connection,
) -> None:
    lane = new_lane(conn)
    ran: list[int] = []
    started = trio.Event()
    scope = trio.CancelScope()
    results: list[int] = []

    def endless(conn: sqlite3.Connection) -> object:
        in_trio(started.set)
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


async def test_an_operation_that_committed_before_the_cancel_returns_its_result(
    conn: sqlite3.Connection,
) -> None:
    lane = new_lane(conn)
    scope = trio.CancelScope()
    written = trio.Event()
    proceed = threading.Event()

    def commit_then_report(conn: sqlite3.Connection) -> str:
        conn.execute("INSERT INTO log VALUES (7)")  # autocommit: durable on return
        in_trio(written.set)
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
    lane = new_lane(conn)

    def broken(conn: sqlite3.Connection) -> None:
        conn.execute("INSERT INTO missing_table VALUES (1)")

    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        await lane.run(broken)
    assert await lane.run(lambda conn: conn.execute("SELECT 41 + 1").fetchone()[0]) == 42
    await lane.wait_idle()


async def test_wait_idle_waits_for_queued_work(conn: sqlite3.Connection) -> None:
    lane = new_lane(conn)
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
    lane = new_lane(conn)
    ran: list[int] = []
    with trio.CancelScope() as scope:
        scope.cancel()
        await lane.run(op(ran, 1))
    assert scope.cancelled_caught
    assert ran == []
    assert (lane.hops, lane.operations) == (0, 0)
    assert await lane.run(op(ran, 2)) == 20


# -- group commit -----------------------------------------------------------------------------


def reader(path: Path) -> sqlite3.Connection:
    """A second connection: it sees only what the lane's connection has committed."""
    return sqlite3.connect(path, isolation_level=None)


def logged(conn: sqlite3.Connection) -> list[int]:
    return [row[0] for row in conn.execute("SELECT n FROM log ORDER BY rowid")]


@pytest.fixture
def db(tmp_path: Path) -> Iterator[tuple[sqlite3.Connection, Path]]:
    path = tmp_path / "group.db"
    connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    connection.execute("PRAGMA journal_mode = WAL")
    connection.execute("CREATE TABLE log (n INTEGER PRIMARY KEY)")
    try:
        yield connection, path
    finally:
        connection.close()


def failing(ran: list[int], n: int) -> Callable[[sqlite3.Connection], int]:
    """Writes, then fails: its write must be undone, alone."""

    def fn(conn: sqlite3.Connection) -> int:
        ran.append(n)
        conn.execute("INSERT INTO log VALUES (?)", (n,))
        raise LookupError(f"operation {n} failed")

    return fn


async def test_queued_writes_commit_together_and_callers_wake_only_after_the_commit(
    db: tuple[sqlite3.Connection, Path],
) -> None:
    conn, path = db
    lane = new_lane(conn)
    ran: list[int] = []
    results: dict[int, int] = {}
    visible_on_return: dict[int, list[int]] = {}
    release = threading.Event()
    other = reader(path)

    def last(conn: sqlite3.Connection) -> int:
        """The batch's last operation: it holds the batch open until the test releases it."""
        conn.execute("INSERT INTO log VALUES (5)")
        in_trio(holding.set)
        if not release.wait(GUARD):
            raise TimeoutError("the test never released the batch")
        return 50

    holding = trio.Event()

    async def call(n: int, fn: Callable[[sqlite3.Connection], int]) -> None:
        results[n] = await lane.run(fn, kind="write")
        visible_on_return[n] = logged(other)  # what was durable when this caller heard

    try:
        with trio.fail_after(GUARD):
            async with trio.open_nursery() as nursery:
                gate_release = threading.Event()
                await start_in_order(
                    nursery,
                    functools.partial(call, 0, gate(ran, 0, gate_release)),
                    *(functools.partial(call, n, op(ran, n)) for n in range(1, 5)),
                    functools.partial(call, 5, last),
                )
                gate_release.set()
                await holding.wait()
                await trio.testing.wait_all_tasks_blocked()
                # Five operations have run, none is committed, and nobody has heard anything.
                assert ran == [0, 1, 2, 3, 4]
                assert results == {}
                assert logged(other) == []
                release.set()
        assert results == {0: 0, 1: 10, 2: 20, 3: 30, 4: 40, 5: 50}
        assert all(seen == [0, 1, 2, 3, 4, 5] for seen in visible_on_return.values())
        await lane.wait_idle()
        assert (lane.hops, lane.operations, lane.commits, lane.replays) == (1, 6, 1, 0)
    finally:
        other.close()


async def test_a_failing_operation_fails_alone_and_the_others_commit(
    db: tuple[sqlite3.Connection, Path],
) -> None:
    conn, path = db
    lane = new_lane(conn)
    ran: list[int] = []
    results: dict[int, object] = {}
    release = threading.Event()

    def duplicate(conn: sqlite3.Connection) -> int:
        """An atomic write (one statement) that fails its primary key."""
        conn.execute("INSERT INTO log VALUES (1)")
        return -1

    async def call(n: int, fn: Callable[[sqlite3.Connection], int], atomic: bool = False) -> None:
        try:
            results[n] = await lane.run(fn, kind="write", atomic=atomic)
        except (LookupError, sqlite3.IntegrityError) as exc:
            results[n] = type(exc).__name__

    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            await start_in_order(
                nursery,
                functools.partial(call, 0, gate(ran, 0, release)),
                functools.partial(call, 1, op(ran, 1)),
                functools.partial(call, 2, failing(ran, 2)),
                functools.partial(call, 3, op(ran, 3)),
                functools.partial(call, 4, duplicate, True),
                functools.partial(call, 6, op(ran, 6)),
            )
            release.set()
    assert results == {0: 0, 1: 10, 2: "LookupError", 3: 30, 4: "IntegrityError", 6: 60}
    other = reader(path)
    try:
        assert logged(other) == [0, 1, 3, 6]  # operation 2's own insert was rolled back alone
    finally:
        other.close()
    assert (lane.commits, lane.replays) == (1, 0)
    assert not conn.in_transaction


async def test_a_failed_commit_fails_every_operation_of_the_batch(
    db: tuple[sqlite3.Connection, Path],
) -> None:
    conn, _ = db
    conn.execute("PRAGMA foreign_keys = ON")
    conn.execute(
        "CREATE TABLE child (parent INTEGER REFERENCES log (n) DEFERRABLE INITIALLY DEFERRED)"
    )
    lane = new_lane(conn)
    ran: list[int] = []
    results: dict[int, object] = {}
    release = threading.Event()

    def orphan(conn: sqlite3.Connection) -> int:
        conn.execute("INSERT INTO child VALUES (99)")  # checked only at COMMIT
        return 7

    async def call(n: int, fn: Callable[[sqlite3.Connection], int]) -> None:
        try:
            results[n] = await lane.run(fn, kind="write")
        except sqlite3.IntegrityError as exc:
            results[n] = str(exc)

    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            await start_in_order(
                nursery,
                functools.partial(call, 0, gate(ran, 0, release)),
                functools.partial(call, 1, orphan),
                functools.partial(call, 2, op(ran, 2)),
            )
            release.set()
    failed = "FOREIGN KEY constraint failed"
    assert results == {0: failed, 1: failed, 2: failed}
    assert lane.commits == 0
    assert not conn.in_transaction
    assert await lane.run(op(ran, 3), kind="write") == 30
    assert logged(conn) == [3]


async def test_a_cancelled_caller_whose_operation_ran_still_gets_its_commit(
    db: tuple[sqlite3.Connection, Path],
) -> None:
    conn, _ = db
    lane = new_lane(conn)
    ran: list[int] = []
    release = threading.Event()
    holding = trio.Event()
    scope = trio.CancelScope()
    heard: list[object] = []

    def last(conn: sqlite3.Connection) -> int:
        conn.execute("INSERT INTO log VALUES (9)")
        in_trio(holding.set)
        if not release.wait(GUARD):
            raise TimeoutError("the test never released the batch")
        return 90

    async def cancellable() -> None:
        with scope:
            heard.append(await lane.run(op(ran, 1), kind="write"))
            await trio.lowlevel.checkpoint()
        heard.append("cancelled" if scope.cancelled_caught else "not cancelled")

    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            gate_release = threading.Event()
            await start_in_order(
                nursery,
                functools.partial(lane.run, gate(ran, 0, gate_release), kind="write"),
                cancellable,
                functools.partial(lane.run, last, kind="write"),
            )
            gate_release.set()
            await holding.wait()
            scope.cancel()  # operation 1 has run in the open batch: it is not withdrawn
            await trio.testing.wait_all_tasks_blocked()
            assert heard == []  # shielded until the commit
            release.set()
    assert heard == [10, "cancelled"]  # it committed, so the caller heard the result
    assert logged(conn) == [0, 1, 9]


async def test_a_cancelled_queued_caller_leaves_the_batch_unrun(
    db: tuple[sqlite3.Connection, Path],
) -> None:
    conn, _ = db
    lane = new_lane(conn)
    ran: list[int] = []
    release = threading.Event()
    scope = trio.CancelScope()

    async def cancellable() -> None:
        with scope:
            await lane.run(op(ran, 1), kind="write")
        assert scope.cancelled_caught

    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            await start_in_order(
                nursery,
                functools.partial(lane.run, gate(ran, 0, release), kind="write"),
                cancellable,
                functools.partial(lane.run, op(ran, 2), kind="write"),
            )
            scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            release.set()
    assert ran == [0, 2]
    assert logged(conn) == [0, 2]
    assert lane.commits == 1


async def test_interrupting_a_running_write_runs_the_rest_of_its_batch_again(
    db: tuple[sqlite3.Connection, Path],
) -> None:
    """An interrupted INSERT makes SQLite roll back the whole transaction: the operations that
    had run in it are run again (nobody had heard of them), the interrupted one fails alone."""
    conn, _ = db
    lane = new_lane(conn)
    ran: list[int] = []
    results: dict[int, object] = {}
    started = trio.Event()
    scope = trio.CancelScope()
    release = threading.Event()

    def endless_insert(conn: sqlite3.Connection) -> object:
        in_trio(started.set)
        conn.execute(
            "INSERT INTO log SELECT i + 1000 FROM"
            " (WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) SELECT i FROM n)"
        )
        return "never"

    async def call(n: int, fn: Callable[[sqlite3.Connection], int]) -> None:
        results[n] = await lane.run(fn, kind="write")

    async def cancellable() -> None:
        with scope:
            await lane.run(endless_insert, kind="write")
        results[2] = "cancelled" if scope.cancelled_caught else "not cancelled"

    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            await start_in_order(
                nursery,
                functools.partial(call, 0, gate(ran, 0, release)),
                functools.partial(call, 1, op(ran, 1)),
                cancellable,
                functools.partial(call, 3, op(ran, 3)),
            )
            release.set()
            await started.wait()
            scope.cancel()
    assert results == {0: 0, 1: 10, 2: "cancelled", 3: 30}
    assert ran == [0, 1, 0, 1, 3]  # 0 and 1 ran again in the new transaction
    assert logged(conn) == [0, 1, 3]
    assert (lane.commits, lane.replays) == (1, 2)


async def test_a_batch_of_reads_does_not_take_the_write_lock(
    db: tuple[sqlite3.Connection, Path],
) -> None:
    conn, path = db
    conn.execute("INSERT INTO log VALUES (4)")
    writer = sqlite3.connect(path, isolation_level=None, timeout=0)
    try:
        writer.execute("BEGIN IMMEDIATE")  # another process's writer holds the lock
        count = await lane_read(new_lane(conn))
        assert count == 1
        writer.execute("ROLLBACK")
    finally:
        writer.close()


async def lane_read(lane: Lane) -> int:
    with trio.fail_after(GUARD):
        return int(
            await lane.run(
                lambda conn: conn.execute("SELECT count(*) FROM log").fetchone()[0], kind="read"
            )
        )


async def test_reads_join_a_write_batch_and_see_its_earlier_writes(
    db: tuple[sqlite3.Connection, Path],
) -> None:
    conn, _ = db
    lane = new_lane(conn)
    ran: list[int] = []
    release = threading.Event()
    counts: list[int] = []

    async def count() -> None:
        counts.append(await lane_read(lane))

    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            await start_in_order(
                nursery,
                functools.partial(lane.run, gate(ran, 0, release), kind="write"),
                functools.partial(lane.run, op(ran, 1), kind="write"),
                count,
            )
            release.set()
    assert counts == [2]
    assert lane.commits == 1


async def test_max_batch_bounds_a_transaction(db: tuple[sqlite3.Connection, Path]) -> None:
    conn, _ = db
    lane = new_lane(conn, max_batch=2)
    ran: list[int] = []
    release = threading.Event()
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            await start_in_order(
                nursery,
                functools.partial(lane.run, gate(ran, 0, release), kind="write"),
                *(functools.partial(lane.run, op(ran, n), kind="write") for n in range(1, 5)),
            )
            release.set()
    assert ran == [0, 1, 2, 3, 4]
    assert lane.commits == 3  # [0, 1], [2, 3], [4]
    assert logged(conn) == [0, 1, 2, 3, 4]
