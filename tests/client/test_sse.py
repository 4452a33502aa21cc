"""The client's SSE decoder: any chunking of a stream yields the same events."""

from __future__ import annotations

from typing import Literal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tritask.client._sse import SseDecoder
from tritask.client.errors import ProtocolViolation

SURROGATES: tuple[Literal["Cs"]] = ("Cs",)


def decode(chunks: list[bytes], max_bytes: int = 1 << 20) -> list[str]:
    decoder = SseDecoder(max_bytes)
    events: list[str] = []
    for chunk in chunks:
        events.extend(decoder.feed(chunk))
    events.extend(decoder.finish())
    return events


def test_fields_comments_and_line_endings() -> None:
    stream = (
        b": keep-alive\r\n"
        b'event: message\r\nid: 7\r\nretry: 100\r\ndata: {"a":1}\r\n\r\n'
        b"data:first\ndata: second\n\n"
        b"data: cr only\r\r"
        b"data:\n\n"  # an event whose data is empty
        b"id: no data\n\n"  # no data at all: skipped
        b"data: unterminated"
    )
    assert decode([stream]) == ['{"a":1}', "first\nsecond", "cr only", "", "unterminated"]


def test_a_crlf_split_across_chunks_is_one_line_end() -> None:
    assert decode([b"data: x\r", b"\n\r", b"\ndata: y\r\n\r\n"]) == ["x", "y"]


def test_non_utf8_is_replaced_not_fatal() -> None:
    assert decode([b"data: \xff\n\n"]) == ["\ufffd"]


def test_oversize_lines_and_events_are_refused() -> None:
    with pytest.raises(ProtocolViolation, match="line exceeds 16 bytes"):
        decode([b"data: " + b"x" * 20], max_bytes=16)
    with pytest.raises(ProtocolViolation, match="event exceeds 16 bytes"):
        decode([b"data: 12345\ndata: 12345\ndata: 12345\n"], max_bytes=16)


events = st.lists(
    st.lists(
        st.text(
            alphabet=st.characters(blacklist_categories=SURROGATES, blacklist_characters="\r\n"),
            max_size=20,
        ),
        min_size=1,
        max_size=3,
    ),
    max_size=6,
)


@given(events, st.sampled_from([b"\n", b"\r\n", b"\r"]), st.data())
def test_any_chunking_decodes_the_same(
    payloads: list[list[str]], newline: bytes, data: st.DataObject
) -> None:
    stream = b""
    for lines in payloads:
        for line in lines:
            stream += b"data: " + line.encode("utf-8") + newline
        stream += newline
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    assert decode(chunks) == ["\n".join(lines) for lines in payloads]
