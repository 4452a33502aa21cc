"""Server-Sent Events framing for the client's Streamable HTTP reader (no I/O here).

Bytes go in as they arrive; each complete event's ``data`` comes out. Lines end with CRLF, LF
or CR (a CR at the end of a chunk waits for the next one, which may start with its LF);
comment lines (``:`` keep-alives) and the ``event``, ``id`` and ``retry`` fields are ignored,
since 2026-07-28 streams are not resumable. An event without data is skipped. A stream that
ends in the middle of an event still yields that event (a lenient reading of servers that omit
the final blank line). No line or event may exceed ``max_bytes``, so a misbehaving server
cannot make the client buffer without limit.
"""

from __future__ import annotations

from collections.abc import Iterator

from tritask.client.errors import ProtocolViolation

DEFAULT_MAX_BYTES = 64 * 1024 * 1024


class SseDecoder:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._buffer = bytearray()
        self._data: list[str] = []
        self._size = 0

    def feed(self, chunk: bytes) -> Iterator[str]:
        """The data of every event completed by ``chunk``."""
        self._buffer += chunk
        start = 0
        buffer = self._buffer
        while True:
            lf = buffer.find(b"\n", start)
            cr = buffer.find(b"\r", start)
            if cr == -1 and lf == -1:
                break
            end = lf if cr == -1 or (lf != -1 and lf < cr) else cr
            if buffer[end] == 0x0D:  # CR: a CRLF split across chunks must not become two ends
                if end + 1 == len(buffer):
                    break
                after = end + 2 if buffer[end + 1] == 0x0A else end + 1
            else:
                after = end + 1
            event = self._line(bytes(buffer[start:end]))
            if event is not None:
                yield event
            start = after
        del buffer[:start]
        if len(buffer) > self.max_bytes:
            raise ProtocolViolation(f"an SSE line exceeds {self.max_bytes} bytes")

    def finish(self) -> Iterator[str]:
        """The end of the stream: a last line or event without its terminator."""
        if self._buffer:
            line = bytes(self._buffer).rstrip(b"\r")
            self._buffer.clear()
            event = self._line(line)
            if event is not None:
                yield event
        if self._data:
            yield self._dispatch()

    def _line(self, raw: bytes) -> str | None:
        line = raw.decode("utf-8", errors="replace")
        if line == "":
            return self._dispatch() if self._data else None
        if line.startswith(":"):
            return None
        field, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._size += len(raw) + 1
            if self._size > self.max_bytes:
                raise ProtocolViolation(f"an SSE event exceeds {self.max_bytes} bytes")
            self._data.append(value)
        return None

    def _dispatch(self) -> str:
        data = "\n".join(self._data)
        self._data.clear()
        self._size = 0
        return data
