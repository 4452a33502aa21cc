"""The 2025-11-25 rendering of a task and its small codecs, and the progress relays.

Pure functions get exact values and hypothesis; the relays are driven directly (the wire tests
are in ``tests/transports/test_legacy_tasks.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from tritask.jsonrpc import InvalidParams, JSONValue
from tritask.server.hub import Hub
from tritask.server.session import Session
from tritask.tasks._time import parse_instant
from tritask.tasks.legacy import decode_cursor, encode_cursor, render_task, requested_ttl
from tritask.tasks.model import Task, TaskStatus
from tritask.tasks.relay import RELATED_TASK_KEY, SESSION_FILTER_KEY, RequestRelay, SessionRelay

T0 = parse_instant("2026-08-24T10:00:00.000Z")


def task(**changes: Any) -> Task:
    fields: dict[str, Any] = {
        "id": "t1",
        "status": TaskStatus.WORKING,
        "status_message": "Task accepted",
        "created_at": T0,
        "last_updated_at": T0 + 1_500_000,
        "ttl_ms": 60_000,
        "poll_interval_ms": 250,
    }
    fields.update(changes)
    return Task(**fields)


def test_render_task_is_the_2025_11_25_shape() -> None:
    assert render_task(task()) == {
        "taskId": "t1",
        "status": "working",
        "statusMessage": "Task accepted",
        "createdAt": "2026-08-24T10:00:00.000Z",
        "lastUpdatedAt": "2026-08-24T10:00:01.500Z",
        "ttl": 60_000,
        "pollInterval": 250,
    }
    done = task(
        status=TaskStatus.COMPLETED,
        status_message=None,
        ttl_ms=None,
        poll_interval_ms=None,
        result={"content": [], "isError": False},
    )
    # No payload, no null statusMessage or pollInterval; ttl null means unlimited.
    assert render_task(done) == {
        "taskId": "t1",
        "status": "completed",
        "createdAt": "2026-08-24T10:00:00.000Z",
        "lastUpdatedAt": "2026-08-24T10:00:01.500Z",
        "ttl": None,
    }
    waiting = task(
        status=TaskStatus.INPUT_REQUIRED,
        input_requests={"k": {"method": "roots/list"}},
        used_input_keys={"k"},
    )
    assert set(render_task(waiting)) == {
        "taskId",
        "status",
        "statusMessage",
        "createdAt",
        "lastUpdatedAt",
        "ttl",
        "pollInterval",
    }


@pytest.mark.parametrize(
    ("value", "ttl"),
    [({}, None), ({"ttl": 1}, 1), ({"ttl": 60_000.0}, 60_000), ({"ttl": 5, "other": 1}, 5)],
)
def test_requested_ttl_accepts(value: JSONValue, ttl: int | None) -> None:
    assert requested_ttl(value) == ttl


@pytest.mark.parametrize(
    "value",
    [None, [], "x", 3, {"ttl": 0}, {"ttl": -1}, {"ttl": 0.5}, {"ttl": True}, {"ttl": None}],
)
def test_requested_ttl_refuses(value: JSONValue) -> None:
    with pytest.raises(InvalidParams):
        requested_ttl(value)


@given(st.integers(min_value=1, max_value=10**12))
def test_cursors_round_trip(position: int) -> None:
    cursor = encode_cursor(position)
    assert cursor.isascii() and "=" not in cursor
    assert decode_cursor(cursor, position) == position
    with pytest.raises(InvalidParams, match="Invalid cursor"):
        decode_cursor(cursor, position - 1)  # a position this session never reached


@given(st.one_of(st.text(max_size=80), st.integers(), st.none(), st.booleans()))
def test_any_other_cursor_is_invalid_params(cursor: Any) -> None:
    try:
        position = decode_cursor(cursor, 10**6)
    except InvalidParams as error:
        assert error.message == "Invalid cursor"
    else:
        assert encode_cursor(position) == cursor


class Recorder:
    def __init__(self, *, stall: bool = False, broken: bool = False) -> None:
        self.sent: list[dict[str, JSONValue]] = []
        self.stall = stall
        self.broken = broken

    async def __call__(self, message: dict[str, JSONValue]) -> None:
        if self.broken:
            raise trio.BrokenResourceError
        if self.stall:
            await trio.sleep_forever()
        self.sent.append(message)


async def test_request_relay_sends_increasing_progress_until_closed() -> None:
    emit = Recorder()
    relay = RequestRelay(emit, "tok")
    await relay.progress(1, 3, "one")
    await relay.progress(1, 3, "again")  # not increasing: dropped
    await relay.progress(2, None, None)
    relay.close()
    await relay.progress(3, 3, None)
    assert emit.sent == [
        {
            "jsonrpc": "2.0",
            "method": "notifications/progress",
            "params": {"progressToken": "tok", "progress": 1, "total": 3, "message": "one"},
        },
        {
            "jsonrpc": "2.0",
            "method": "notifications/progress",
            "params": {"progressToken": "tok", "progress": 2},
        },
    ]
    assert relay.closed


async def test_a_stalled_or_broken_stream_closes_the_relay(
    autojump_clock: trio.testing.MockClock,
) -> None:
    stalled = RequestRelay(Recorder(stall=True), 1, send_seconds=5)
    start = trio.current_time()
    await stalled.progress(1, None, None)
    assert trio.current_time() - start == 5
    assert stalled.closed
    broken = RequestRelay(Recorder(broken=True), 1)
    await broken.progress(1, None, None)
    assert broken.closed


async def test_closing_abandons_a_send_in_progress(autojump_clock: trio.testing.MockClock) -> None:
    relay = RequestRelay(Recorder(stall=True), 1, send_seconds=60)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(relay.progress, 1, None, None)
        await trio.sleep(1)
        relay.close()
    assert trio.current_time() == pytest.approx(1)


async def test_session_relay_publishes_to_the_sessions_stream_while_it_lives() -> None:
    hub = Hub()
    session = Session(id="s1", protocol_version="2025-11-25", client_capabilities={})
    mine = hub.open({SESSION_FILTER_KEY: ["s1"]})
    other = hub.open({SESSION_FILTER_KEY: ["s2"], "taskIds": ["t1"]})
    relay = SessionRelay(hub, session, 9, "t1")
    await relay.progress(1, 2, None)
    await relay.progress(0.5, 2, None)
    session.close()
    await relay.progress(2, 2, None)
    hub.close()
    received = [(event.method, event.params) async for event in mine]
    assert received == [
        (
            "notifications/progress",
            {
                "progressToken": 9,
                "progress": 1,
                "total": 2,
                "_meta": {RELATED_TASK_KEY: {"taskId": "t1"}},
            },
        )
    ]
    assert [event async for event in other] == []
