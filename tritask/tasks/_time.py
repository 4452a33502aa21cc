"""Instants for the Tasks extension: integer microseconds since the Unix epoch (UTC).

Integers keep arithmetic exact (``retry_at = committed_at + delay``) and compare the same in every
store; text only appears at the edges (wire fields and persisted records).
"""

from __future__ import annotations

import datetime as _dt
import functools
import re
import time
from collections.abc import Callable

import trio

__all__ = [
    "MAX_INSTANT",
    "Clock",
    "TrioClock",
    "format_instant",
    "parse_instant",
    "system_clock",
]

Clock = Callable[[], int]
"""A zero-argument function returning the current instant in microseconds."""

_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.UTC)
MAX_INSTANT = 253_402_300_799_999_999
"""9999-12-31T23:59:59.999999Z, the last instant ISO-8601 text with a 4-digit year can carry."""

_INSTANT_RE = re.compile(
    r"([0-9]{4})-([0-9]{2})-([0-9]{2})T([0-9]{2}):([0-9]{2}):([0-9]{2})\.([0-9]{3}|[0-9]{6})Z"
)


def _check_instant(us: object) -> int:
    if not isinstance(us, int) or isinstance(us, bool):
        raise TypeError(f"an instant is an int of microseconds, not {type(us).__name__}")
    if not 0 <= us <= MAX_INSTANT:
        raise ValueError(f"instant {us} is outside 1970-01-01..9999-12-31")
    return us


_NAIVE_EPOCH = _dt.datetime(1970, 1, 1)


def format_instant(us: int) -> str:
    """ISO-8601 UTC text: millisecond form when ``us`` is whole milliseconds, else 6 digits.

    Cached for plain ints: a pure function, and a durable store formats the same few instants
    several times per task (a new task's ``createdAt`` and ``lastUpdatedAt``, then its
    ``createdAt`` again in every later record). Anything else (a ``bool``, which would share
    ``1``'s cache entry, an ``int`` subclass, another type) is checked and formatted uncached.
    """
    if type(us) is int:
        return _cached_instant(us)
    return _format_instant(us)


@functools.lru_cache(maxsize=1024)
def _cached_instant(us: int) -> str:
    return _format_instant(us)  # an out-of-range instant raises: nothing is cached for it


def _format_instant(us: int) -> str:
    _check_instant(us)
    seconds, micros = divmod(us, 1_000_000)
    if micros % 1000 == 0:
        return f"{_second_text(seconds)}.{micros // 1000:03d}Z"
    return f"{_second_text(seconds)}.{micros:06d}Z"


@functools.lru_cache(maxsize=256)
def _second_text(seconds: int) -> str:
    """``YYYY-MM-DDTHH:MM:SS`` of a whole second (cached: a pure function, and the instants a
    server formats crowd into the last few seconds, several per task)."""
    return (_NAIVE_EPOCH + _dt.timedelta(seconds=seconds)).isoformat(timespec="seconds")


def parse_instant(text: str) -> int:
    """Parse exactly the two forms :func:`format_instant` writes (3 or 6 fraction digits, ``Z``).

    Offsets, missing fractions and non-ASCII digits are refused: persisted records must be
    unambiguous, and anything else would not round-trip.
    """
    if not isinstance(text, str):
        raise TypeError(f"an instant is ISO-8601 text, not {type(text).__name__}")
    match = _INSTANT_RE.fullmatch(text)
    if match is None:
        raise ValueError(f"not an ISO-8601 UTC instant: {text!r}")
    year, month, day, hour, minute, second, fraction = match.groups()
    micro = int(fraction) * (1000 if len(fraction) == 3 else 1)
    try:
        moment = _dt.datetime(
            int(year), int(month), int(day), int(hour), int(minute), int(second), micro, _dt.UTC
        )
    except ValueError as exc:
        raise ValueError(f"not a valid instant: {text!r}") from exc
    if moment < _EPOCH:
        raise ValueError(f"instant before 1970: {text!r}")
    delta = moment - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def system_clock() -> int:
    """The wall clock truncated to whole milliseconds (so wire times use the ``.mmmZ`` form)."""
    return time.time_ns() // 1_000_000 * 1000


class TrioClock:
    """A store clock anchored at a wall instant that advances with ``trio.current_time()``.

    Under ``trio.testing.MockClock`` the store's time then moves exactly when trio's does, so
    leases, retry deadlines and TTLs are deterministic in tests. The trio anchor is taken at
    construction when called inside ``trio.run``, otherwise at the first reading.
    ``resolution_us`` truncates readings (default: whole milliseconds, like :func:`system_clock`).
    """

    __slots__ = ("_resolution", "_start", "_trio_anchor")

    def __init__(self, start_us: int, *, resolution_us: int = 1000) -> None:
        _check_instant(start_us)
        if not isinstance(resolution_us, int) or isinstance(resolution_us, bool):
            raise TypeError("resolution_us must be an int")
        if resolution_us <= 0:
            raise ValueError("resolution_us must be positive")
        self._start = start_us
        self._resolution = resolution_us
        self._trio_anchor: float | None
        try:
            self._trio_anchor = trio.current_time()
        except RuntimeError:
            self._trio_anchor = None

    def __call__(self) -> int:
        now = trio.current_time()
        if self._trio_anchor is None:
            self._trio_anchor = now
        # Round to whole microseconds first so float noise (0.1 + 0.2) cannot lose a millisecond.
        elapsed = round((now - self._trio_anchor) * 1_000_000)
        return self._start + elapsed // self._resolution * self._resolution

    def __repr__(self) -> str:
        return f"TrioClock(start={format_instant(self._start)!r})"
