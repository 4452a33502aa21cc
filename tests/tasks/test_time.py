"""Instants: exact ISO-8601 forms, strict parsing, and clocks."""

from __future__ import annotations

import datetime
import time

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from tritask.tasks._time import (
    MAX_INSTANT,
    TrioClock,
    format_instant,
    parse_instant,
    system_clock,
)

T0 = 1_787_565_600_000_000  # 2026-08-24T10:00:00.000Z


def test_format_millisecond_and_microsecond_forms() -> None:
    assert format_instant(T0) == "2026-08-24T10:00:00.000Z"
    assert format_instant(T0 + 1000) == "2026-08-24T10:00:00.001Z"
    assert format_instant(T0 + 1) == "2026-08-24T10:00:00.000001Z"
    assert format_instant(T0 + 123_456) == "2026-08-24T10:00:00.123456Z"
    assert format_instant(0) == "1970-01-01T00:00:00.000Z"
    assert format_instant(MAX_INSTANT) == "9999-12-31T23:59:59.999999Z"


def test_parse_exact_values() -> None:
    assert parse_instant("2026-08-24T10:00:00.000Z") == T0
    assert parse_instant("2026-08-24T10:01:00.001Z") == T0 + 60_001_000
    assert parse_instant("2026-08-24T10:00:00.000001Z") == T0 + 1
    assert parse_instant("2026-08-24T10:00:00.123000Z") == T0 + 123_000


@pytest.mark.parametrize(
    "text",
    [
        "2026-08-24T10:00:00Z",
        "2026-08-24T10:00:00.00Z",
        "2026-08-24T10:00:00.0000Z",
        "2026-08-24T10:00:00.000+00:00",
        "2026-08-24T10:00:00.000z",
        "2026-08-24 10:00:00.000Z",
        "2026-08-24T10:00:00.000Z\n",
        " 2026-08-24T10:00:00.000Z",
        "2026-02-30T10:00:00.000Z",
        "2026-08-24T24:00:00.000Z",
        "2026-08-24T10:00:60.000Z",
        "1969-12-31T23:59:59.999Z",
        "\uff12026-08-24T10:00:00.000Z",  # a full-width digit
        "",
    ],
)
def test_parse_refuses_other_forms(text: str) -> None:
    with pytest.raises(ValueError, match="instant"):
        parse_instant(text)


@pytest.mark.parametrize("value", [True, 1.0, "0", None])
def test_format_refuses_non_ints(value: object) -> None:
    with pytest.raises(TypeError):
        format_instant(value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [-1, MAX_INSTANT + 1])
def test_format_refuses_out_of_range(value: int) -> None:
    with pytest.raises(ValueError, match="outside"):
        format_instant(value)


def test_parse_refuses_non_strings() -> None:
    with pytest.raises(TypeError):
        parse_instant(12)  # type: ignore[arg-type]


@given(st.integers(min_value=0, max_value=MAX_INSTANT))
def test_round_trip(us: int) -> None:
    text = format_instant(us)
    assert parse_instant(text) == us
    assert len(text) == (24 if us % 1000 == 0 else 27)


@given(st.integers(min_value=0, max_value=MAX_INSTANT))
def test_format_matches_datetime_isoformat(us: int) -> None:
    """The per-second cache changes nothing: the text is ``datetime.isoformat``'s."""
    moment = datetime.datetime(1970, 1, 1) + datetime.timedelta(microseconds=us)
    spec = "milliseconds" if us % 1000 == 0 else "microseconds"
    assert format_instant(us) == moment.isoformat(timespec=spec) + "Z"
    assert format_instant(us) == format_instant(us)  # a cached second gives the same text


def test_system_clock_is_whole_milliseconds() -> None:
    before = time.time_ns() // 1000
    now = system_clock()
    after = time.time_ns() // 1000
    assert now % 1000 == 0
    assert before - 1000 < now <= after


async def test_trio_clock_follows_mock_clock(autojump_clock: trio.testing.MockClock) -> None:
    clock = TrioClock(T0)
    assert clock() == T0
    await trio.sleep(1.5)
    assert clock() == T0 + 1_500_000
    await trio.sleep(0.0004)  # below the millisecond resolution
    assert clock() == T0 + 1_500_000
    await trio.sleep(0.0006)
    assert clock() == T0 + 1_501_000


async def test_trio_clock_microsecond_resolution(autojump_clock: trio.testing.MockClock) -> None:
    clock = TrioClock(T0, resolution_us=1)
    await trio.sleep(0.1)
    await trio.sleep(0.2)
    assert clock() == T0 + 300_000
    await trio.sleep(0.000_001)
    assert clock() == T0 + 300_001


def test_trio_clock_anchors_lazily_outside_trio() -> None:
    clock = TrioClock(T0)

    async def read() -> tuple[int, int]:
        first = clock()
        await trio.sleep(2)
        return first, clock()

    assert trio.run(read, clock=trio.testing.MockClock(autojump_threshold=0)) == (
        T0,
        T0 + 2_000_000,
    )


def test_trio_clock_validates() -> None:
    with pytest.raises(ValueError, match="resolution"):
        TrioClock(T0, resolution_us=0)
    with pytest.raises(TypeError):
        TrioClock(1.5)  # type: ignore[arg-type]
