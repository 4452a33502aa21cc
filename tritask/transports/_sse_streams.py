"""Resumable SSE streams of one initialize-era HTTP session, and their bounded replay memory.

At 2025-06-18 and 2025-11-25 an SSE stream outlives the HTTP response that carries it: the
client may lose the connection (or the server may close it, for SSE polling) and come back
with ``GET`` + ``Last-Event-ID`` to get what it missed, *on that stream only*. So a message is
not written to a socket; it is appended to its :class:`ResumableStream`, and whichever
connection is attached to the stream at the moment (if any) writes it out.

Event ids are ``<stream>-<event>``: the event number is unique across the session's streams
(the spec's MUST), and the stream number lets a ``Last-Event-ID`` find its stream without an
index. Stream 0 is the session's standalone ``GET`` stream; request streams count from 1.

What is kept for replay is bounded per session (:class:`EventLog`: a byte budget, a number of
events per stream, a number of finished streams); past it the oldest events go first. Replay
is a MAY, so a client that stayed away too long loses the oldest messages, never the server
its memory.
"""

from __future__ import annotations

import collections
import re
from typing import Final

import attrs
import trio

from tritask.jsonrpc import JSONValue, dumps

STANDALONE: Final = 0
"""The stream number of the session's standalone ``GET`` stream."""

KEEPALIVE: Final = b": keep-alive\n\n"

_EVENT_ID = re.compile(r"^(\d{1,9})-(\d{1,18})$")


def message_block(event_id: str, message: dict[str, JSONValue]) -> bytes:
    """One SSE event carrying a JSON-RPC message (``event: message``, as clients expect)."""
    data = dumps(message).encode("utf-8")
    return b"id: " + event_id.encode("ascii") + b"\nevent: message\ndata: " + data + b"\n\n"


def priming_block(event_id: str, retry_ms: int | None) -> bytes:
    """An event id with empty data, so the client can resume before the first message.

    The ``data:`` line is what makes parsers dispatch it (an ``id:`` alone is no event).
    """
    retry = b"" if retry_ms is None else b"retry: %d\n" % retry_ms
    return b"id: " + event_id.encode("ascii") + b"\n" + retry + b"data: \n\n"


@attrs.define(eq=False)
class Writer:
    """The connection currently writing a stream out (a token; identity is what matters)."""

    cursor: int
    """The number of the last event this connection has written."""


@attrs.define(eq=False)
class ResumableStream:
    """One SSE stream's retained events, its writer (if attached) and whether it is over."""

    log: EventLog
    number: int
    events: collections.deque[tuple[int, bytes]] = attrs.field(factory=collections.deque)
    finished: bool = False
    """No event will be added (the request's response was appended, or the session ended)."""
    writer: Writer | None = None
    last_event: int = 0
    """The number of the newest event appended (0 before the first)."""
    _changed: trio.lowlevel.ParkingLot = attrs.field(factory=trio.lowlevel.ParkingLot)

    def event_id(self, number: int) -> str:
        return f"{self.number}-{number}"

    # -- producing ------------------------------------------------------------------------

    async def emit(self, message: dict[str, JSONValue]) -> None:
        """Append ``message``; while a connection is attached, wait if it is far behind.

        The wait is the back-pressure a plain response stream gives; without a connection
        nothing waits and the bounded log decides what is kept.
        """
        while (
            not self.finished
            and self.writer is not None
            and self.last_event - self.writer.cursor > self.log.stream_events
        ):
            await self._changed.park()
        self.append(message)

    def append(self, message: dict[str, JSONValue]) -> None:
        if self.finished:
            return
        number = self.log.next_number()
        self.last_event = number
        data = message_block(self.event_id(number), message)
        self.events.append((number, data))
        self.log.retained(self, len(data))
        self._changed.unpark_all()

    def finish(self, message: dict[str, JSONValue] | None = None) -> None:
        """Append the last message (a request's response) and end the stream."""
        if self.finished:
            return
        if message is not None:
            self.append(message)
        self.finished = True
        self.log.finished(self)
        self._changed.unpark_all()

    def priming(self, retry_ms: int | None) -> bytes:
        """A priming event with a fresh id of this stream (nothing is retained for it)."""
        number = self.log.next_number()
        return priming_block(self.event_id(number), retry_ms)

    # -- consuming ------------------------------------------------------------------------

    def attach(self, cursor: int) -> Writer:
        """Make a new connection the stream's writer, displacing any previous one."""
        writer = Writer(cursor)
        self.writer = writer
        self._changed.unpark_all()
        return writer

    def detach(self, writer: Writer) -> None:
        if self.writer is writer:
            self.writer = None
            self._changed.unpark_all()

    def close_connection(self) -> bool:
        """Let the attached connection go (SSE polling); the stream itself goes on."""
        if self.writer is None or self.finished:
            return False
        self.writer = None
        self._changed.unpark_all()
        return True

    def pending(self, writer: Writer) -> list[tuple[int, bytes]]:
        """The retained events ``writer`` has not written yet (a copy: writing awaits)."""
        cursor = writer.cursor
        if self.last_event <= cursor:
            return []
        return [event for event in self.events if event[0] > cursor]

    def written(self, writer: Writer, number: int) -> None:
        writer.cursor = number
        self._changed.unpark_all()

    def done_for(self, writer: Writer) -> bool:
        """Whether ``writer`` should end its response: displaced, or everything written."""
        return self.writer is not writer or (self.finished and writer.cursor >= self.last_event)

    async def wait(self) -> None:
        """Until something changes (an event, the end, a new writer)."""
        await self._changed.park()

    def end(self) -> None:
        """The session is over: no more events, and every connection lets go."""
        self.finished = True
        self.writer = None
        self._changed.unpark_all()


@attrs.define(eq=False)
class EventLog:
    """Event numbering and the bounded replay memory of one session's streams."""

    budget_bytes: int
    """Bytes of retained events across the session's streams."""
    stream_events: int
    """Events retained per stream (also how far a connected writer may fall behind)."""
    finished_streams: int
    """Finished request streams kept for a late resumption."""
    streams: dict[int, ResumableStream] = attrs.field(factory=dict)
    _next_event: int = 1
    _next_stream: int = STANDALONE + 1
    _bytes: int = 0
    _finished: collections.deque[int] = attrs.field(factory=collections.deque)

    def next_number(self) -> int:
        number = self._next_event
        self._next_event += 1
        return number

    def open(self) -> ResumableStream:
        """A new request stream."""
        stream = ResumableStream(self, self._next_stream)
        self._next_stream += 1
        self.streams[stream.number] = stream
        return stream

    def standalone(self) -> ResumableStream:
        """The session's standalone stream, created on first use."""
        stream = self.streams.get(STANDALONE)
        if stream is None:
            stream = self.streams[STANDALONE] = ResumableStream(self, STANDALONE)
        return stream

    def find(self, event_id: str) -> tuple[ResumableStream, int] | None:
        """The stream and event number a ``Last-Event-ID`` names, if this log still has it."""
        match = _EVENT_ID.match(event_id.strip())
        if match is None:
            return None
        stream = self.streams.get(int(match.group(1)))
        number = int(match.group(2))
        if stream is None or number >= self._next_event:
            return None
        return stream, number

    @property
    def retained_bytes(self) -> int:
        return self._bytes

    def retained(self, stream: ResumableStream, size: int) -> None:
        """Account for an appended event, evicting the oldest ones when over budget."""
        self._bytes += size
        while len(stream.events) > self.stream_events:
            _, dropped = stream.events.popleft()
            self._bytes -= len(dropped)
        if self._bytes <= self.budget_bytes:
            return
        # Oldest first: streams in creation order; the event just appended always stays.
        for other in list(self.streams.values()):
            while other.events and self._bytes > self.budget_bytes:
                if other is stream and len(other.events) == 1:
                    break
                _, dropped = other.events.popleft()
                self._bytes -= len(dropped)
            if not other.events and other.finished:
                self._forget(other)
            if self._bytes <= self.budget_bytes:
                return

    def finished(self, stream: ResumableStream) -> None:
        if stream.number == STANDALONE:
            return
        self._finished.append(stream.number)
        while len(self._finished) > self.finished_streams:
            old = self.streams.get(self._finished[0])
            if old is None or old.writer is None:
                self._finished.popleft()
                if old is not None:
                    self._forget(old)
            else:
                break  # still being written out: it goes once its connection is done

    def _forget(self, stream: ResumableStream) -> None:
        if self.streams.get(stream.number) is stream:
            del self.streams[stream.number]
            for _, data in stream.events:
                self._bytes -= len(data)
            stream.events.clear()
            if stream.number in self._finished:
                self._finished.remove(stream.number)

    def end(self) -> None:
        """The session is over: end every stream and drop what was kept."""
        for stream in self.streams.values():
            stream.end()
            stream.events.clear()
        self.streams.clear()
        self._finished.clear()
        self._bytes = 0
