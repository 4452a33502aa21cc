"""Newline-delimited JSON-RPC framing (stdio), sans I/O: bytes in, complete lines out.

Both ends of a stdio connection (``tritask.transports.stdio`` and ``tritask.client.stdio``)
split their byte stream with :class:`LineSplitter`, so they agree on what a line is: bytes up
to ``\\n`` (nothing else ends a line: a JSON text never holds a raw newline), blank lines
dropped, the last unterminated line delivered at the end of the stream, and a line longer than
the limit reported once, as :data:`OVERSIZE` in its place, then skipped without being buffered.
"""

from __future__ import annotations

from typing import Final, final

__all__ = ["OVERSIZE", "LineSplitter", "Oversize"]


@final
class Oversize:
    """Marks a line that exceeded the limit (its bytes were dropped)."""

    def __repr__(self) -> str:
        return "OVERSIZE"


OVERSIZE: Final = Oversize()


class LineSplitter:
    """Feed chunks with :meth:`feed`, finish with :meth:`end`; each returns what completed."""

    def __init__(self, max_line_bytes: int) -> None:
        if max_line_bytes <= 0:
            raise ValueError("max_line_bytes must be positive")
        self.max_line_bytes = max_line_bytes
        self._buffer = bytearray()
        self._skipping = False

    def feed(self, chunk: bytes | bytearray) -> list[bytes | Oversize]:
        """The non-blank lines ``chunk`` completed, and :data:`OVERSIZE` for each line that
        became too long (reported when it crosses the limit, before the lines after it)."""
        out: list[bytes | Oversize] = []
        buffer = self._buffer
        start = 0
        while start < len(chunk):
            newline = chunk.find(b"\n", start)
            end = len(chunk) if newline == -1 else newline
            if not self._skipping:
                buffer += chunk[start:end]
                if len(buffer) > self.max_line_bytes:
                    buffer.clear()
                    self._skipping = True
                    out.append(OVERSIZE)
            if newline == -1:
                break
            if self._skipping:
                self._skipping = False
            elif buffer.strip():
                out.append(bytes(buffer))
            buffer.clear()
            start = newline + 1
        return out

    def end(self) -> list[bytes | Oversize]:
        """At the end of the stream: the last line if it was not terminated (and not blank)."""
        line = bytes(self._buffer)
        self._buffer.clear()
        skipping, self._skipping = self._skipping, False
        return [line] if line.strip() and not skipping else []
