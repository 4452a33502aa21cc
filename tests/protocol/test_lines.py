"""The stdio line splitter shared by the server and the client (``tritask.protocol.lines``)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tritask.protocol.lines import OVERSIZE, LineSplitter, Oversize


def split(data: bytes, cuts: list[int], limit: int) -> list[bytes | Oversize]:
    splitter = LineSplitter(limit)
    out: list[bytes | Oversize] = []
    positions = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    for start, end in itertools.pairwise(positions):
        out += splitter.feed(data[start:end])
    return out + splitter.end()


def reference(data: bytes, limit: int) -> list[bytes | Oversize]:
    """What a line is, written plainly: split at b"\\n", drop blank lines, a line over the
    limit becomes OVERSIZE."""
    out: list[bytes | Oversize] = []
    for line in data.split(b"\n"):
        if len(line) > limit:
            out.append(OVERSIZE)
        elif line.strip():
            out.append(line)
    return out


LINE_BYTES = st.sampled_from([b"a", b"{", b"}", b" ", b"\r", b"\n", b"\xe2\x80\xa8", b"xyz"])


@given(
    st.lists(LINE_BYTES, max_size=60).map(b"".join),
    st.lists(st.integers(min_value=0, max_value=200), max_size=8),
    st.integers(min_value=1, max_value=12),
)
def test_any_chunking_gives_the_lines_of_the_whole_stream(
    data: bytes, cuts: list[int], limit: int
) -> None:
    assert split(data, cuts, limit) == reference(data, limit)


def test_an_oversize_line_is_reported_when_it_crosses_the_limit_and_skipped() -> None:
    splitter = LineSplitter(4)
    assert splitter.feed(b"ok\n12345") == [b"ok", OVERSIZE]
    assert splitter.feed(b"6789") == []  # still the same line: nothing buffered or reported
    assert splitter.feed(b"\nnext\n \n") == [b"next"]
    assert splitter.feed(b"tail") == []
    assert splitter.end() == [b"tail"]
    assert splitter.end() == []


def test_the_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_line_bytes must be positive"):
        LineSplitter(0)
