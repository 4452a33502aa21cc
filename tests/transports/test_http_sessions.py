"""The legacy session table and the SSE replay log, without sockets (trio's mock clock).

The table is bounded (a number of sessions, an idle timeout, swept in the background or on
lookup) and its idle sessions are small: 10,000 of them are measured with tracemalloc. The
replay log is bounded per session and per stream, and a ``Last-Event-ID`` of any shape is
either found or refused, never an exception.
"""

from __future__ import annotations

import gc
import json
import tracemalloc
from typing import Any, Final

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from tritask.jsonrpc import loads
from tritask.server.app import App
from tritask.server.dispatcher import Dispatcher
from tritask.server.legacy import LegacyDispatcher
from tritask.server.session import Session
from tritask.transports._http_sessions import HttpSession, SessionsFull, SessionTable
from tritask.transports._sse_streams import STANDALONE, EventLog

IDLE: Final = 1800.0
LIMITS: Final = (4096, 8, 2)
INITIALIZE_PARAMS: Final = json.dumps(
    {
        "protocolVersion": "2025-11-25",
        "capabilities": {"sampling": {}, "elicitation": {}},
        "clientInfo": {"name": "conformance-test-client", "version": "1.0.0"},
    }
)
"""What the conformance suite's TypeScript client sends (decoded afresh for each session)."""

PER_SESSION_BYTES: Final = 2048
"""What one idle legacy session may cost, all included (measured on CPython 3.11: ~1,430).

An idle session is the ``Session`` (a slotted attrs instance, ~150 B, and its six empty
containers, ~400 B), the ``HttpSession`` around it (slotted, ~110 B; its replay log, task
scopes and in-flight set are created by the first request that needs them), its table entry
(an ordered-dict node and the 32-character id, ~180 B), and what the client declared at
initialize (capabilities and clientInfo as decoded, ~450 B): about 1.3 KiB. 2 KiB leaves room
for allocator rounding while still failing if an idle session starts allocating a log, a
parking lot or a task eagerly (each several hundred bytes).
"""


def make_app() -> App:
    app = App("table-test", "1")

    @app.tool()
    async def echo(text: str) -> str:
        """Echo."""
        return text

    return app


def new_session(app: App, principal: Any = None) -> Session:
    session, _ = LegacyDispatcher(Dispatcher(app)).initialize(
        loads(INITIALIZE_PARAMS), principal=principal
    )
    return session


def table(max_sessions: int = 10, idle: float = IDLE) -> SessionTable:
    return SessionTable(max_sessions, idle, LIMITS)


# -- memory ----------------------------------------------------------------------------------------


async def test_ten_thousand_idle_sessions_stay_within_a_bound(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = make_app()
    sessions = table(max_sessions=10_000)
    sessions.add(new_session(app))  # warm every code path and cache once
    sessions.end_all()
    gc.collect()
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        for _ in range(10_000):
            sessions.add(new_session(app))
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - baseline
        with pytest.raises(SessionsFull):
            sessions.add(new_session(app))
        autojump_clock.jump(IDLE)
        assert sessions.sweep() == 10_000
        gc.collect()
        left = tracemalloc.get_traced_memory()[0] - baseline
    finally:
        tracemalloc.stop()
    assert len(sessions) == 0
    assert held / 10_000 < PER_SESSION_BYTES, held / 10_000
    # Ended sessions are gone; what stays is the table's own hash table (~34 B a slot).
    assert left / 10_000 < 64, left / 10_000


# -- limits and expiry -----------------------------------------------------------------------------


async def test_the_table_is_bounded_and_sweeps_before_refusing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = make_app()
    sessions = table(max_sessions=2)
    first = sessions.add(new_session(app))
    await trio.sleep(IDLE / 2)
    sessions.add(new_session(app))
    with pytest.raises(SessionsFull):
        sessions.add(new_session(app))
    await trio.sleep(IDLE / 2)  # the first is idle for IDLE now, the second for half
    third = sessions.add(new_session(app))
    assert first.ended and first.session.closed
    assert sessions.get(first.id, None) is None
    assert sessions.get(third.id, None) is third


async def test_lookup_expires_lazily_and_use_keeps_a_session(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = make_app()
    sessions = table()
    kept = sessions.add(new_session(app))
    dropped = sessions.add(new_session(app))
    for _ in range(3):
        await trio.sleep(IDLE * 0.9)
        assert sessions.get(kept.id, None) is kept
    assert sessions.get(dropped.id, None) is None
    assert dropped.ended
    assert len(sessions) == 1


async def test_the_sweeper_ends_idle_sessions_but_not_busy_ones(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    app = make_app()
    sessions = table()
    await nursery.start(sessions.run_sweeper)
    idle = sessions.add(new_session(app))
    busy = sessions.add(new_session(app))
    busy.start_request(1)
    streaming = sessions.add(new_session(app))
    streaming.attached = 1
    await trio.sleep(IDLE * 3)
    assert idle.ended and idle.session.closed
    assert not busy.ended and not streaming.ended
    assert len(sessions) == 2
    busy.end_request(1)
    streaming.attached = 0
    sessions.touch(streaming)
    await trio.sleep(IDLE * 2)
    assert (busy.ended, streaming.ended) == (True, True)  # a tuple: mypy keeps the narrowing
    assert len(sessions) == 0


async def test_a_session_belongs_to_its_principal(autojump_clock: trio.testing.MockClock) -> None:
    app = make_app()
    sessions = table()
    alice = sessions.add(new_session(app, principal="alice"))
    assert sessions.get(alice.id, "alice") is alice
    assert sessions.get(alice.id, "mallory") is None
    assert sessions.get(alice.id, None) is None
    assert not alice.ended  # a wrong principal learns nothing and changes nothing


async def test_ending_a_session_stops_its_work_and_fails_its_server_requests(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    app = make_app()
    sessions = table()
    entry = sessions.add(new_session(app))
    outcomes: list[str] = []

    async def working() -> None:
        with trio.CancelScope() as scope:
            entry.add_scope(scope)
            await trio.sleep_forever()
        outcomes.append("work cancelled" if scope.cancelled_caught else "work ended")

    async def asking() -> None:
        async def emit(message: Any) -> None:
            outcomes.append(f"asked {message['method']}")

        try:
            await entry.session.request("roots/list", {}, emit)
        except Exception as error:
            outcomes.append(type(error).__name__)

    nursery.start_soon(working)
    nursery.start_soon(asking)
    await trio.sleep(1)
    stream = entry.open_stream()
    sessions.end(entry)
    await trio.sleep(1)
    assert sorted(outcomes) == ["SessionClosed", "asked roots/list", "work cancelled"]
    assert stream.finished and stream.writer is None
    late = trio.CancelScope()
    entry.add_scope(late)
    assert late.cancel_called


# -- the replay log --------------------------------------------------------------------------------


def notification(size: int) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "method": "notifications/message", "params": {"data": "x" * size}}


def test_the_replay_log_is_bounded_per_stream_and_per_session() -> None:
    log = EventLog(budget_bytes=4096, stream_events=8, finished_streams=2)
    streams = [log.open() for _ in range(5)]
    for round_number in range(50):
        for stream in streams:
            stream.append(notification(40 + round_number))
            assert all(len(s.events) <= 8 for s in log.streams.values())
            assert log.retained_bytes <= 4096
    assert log.retained_bytes == sum(
        len(data) for s in log.streams.values() for _, data in s.events
    )
    for stream in streams:
        stream.finish({"jsonrpc": "2.0", "id": stream.number, "result": {}})
    assert sorted(log.streams) == [4, 5]  # the two finished last are kept
    assert log.retained_bytes <= 4096


def test_an_event_larger_than_the_budget_is_kept_alone() -> None:
    log = EventLog(budget_bytes=256, stream_events=8, finished_streams=2)
    small = log.open()
    small.append(notification(10))
    big = log.open()
    big.append(notification(1000))
    assert [len(s.events) for s in (small, big)] == [0, 1]
    found = log.find(big.event_id(big.last_event - 1))
    assert found is not None and found[0] is big


def test_event_ids_name_their_stream() -> None:
    log = EventLog(budget_bytes=1 << 20, stream_events=8, finished_streams=2)
    standalone = log.standalone()
    request = log.open()
    standalone.append(notification(1))
    request.append(notification(1))
    assert log.find(f"{STANDALONE}-1") == (standalone, 1)
    assert log.find(" 1-2 ") == (request, 2)
    assert log.find("1-3") is None  # not issued yet
    assert log.find("7-1") is None  # no such stream
    log.end()
    assert log.find("1-2") is None and log.retained_bytes == 0


@given(st.text(max_size=40))
def test_any_last_event_id_is_found_or_refused(text: str) -> None:
    log = EventLog(budget_bytes=1 << 20, stream_events=8, finished_streams=2)
    stream = log.open()
    stream.append(notification(1))
    found = log.find(text)
    assert found is None or found[0] is stream


async def test_a_connected_writer_far_behind_holds_the_producer(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    log = EventLog(budget_bytes=1 << 20, stream_events=4, finished_streams=2)
    stream = log.open()
    writer = stream.attach(0)
    produced: list[int] = []

    async def produce() -> None:
        for index in range(10):
            await stream.emit(notification(index))
            produced.append(index)

    nursery.start_soon(produce)
    await trio.sleep(1)
    assert produced == [0, 1, 2, 3, 4]  # then it waits for the writer
    for number, _ in stream.pending(writer):
        stream.written(writer, number)
    await trio.sleep(1)
    assert produced == list(range(10))
    stream.detach(writer)  # nobody connected: nothing waits, the log keeps the newest
    for index in range(20):
        await stream.emit(notification(index))
    assert len(stream.events) == 4


def test_http_session_is_lean_until_used() -> None:
    entry = HttpSession(Session("id", "2025-11-25", {}), 0.0, LIMITS)
    assert entry._log is None and entry._scopes is None and entry._in_flight is None
    assert entry.standalone_stream() is None and not entry.busy
