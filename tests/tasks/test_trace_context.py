"""The W3C trace context of task work: lenient reading from ``_meta``, strict persistence.

``Work`` is version 2 without a trace context (what every record written before it holds, byte
for byte), version 3 with one, version 4 with the creating tool (a ``work_builder``'s work) and a
trace context or ``null``; every version decodes, each strictly; a record with v3 or v4 work
round-trips through the aggregate codec.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tritask.tasks.model import initial_snapshot, new_task, snapshot_from_json, snapshot_to_json
from tritask.tasks.work import CodecError, Origin, RetryPolicy, TraceContext, Work

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"
PARENT = f"00-{TRACE}-{SPAN}-01"

V2 = {
    "version": 2,
    "idempotencyKey": "task-1",
    "type": "tools/call",
    "input": {"name": "echo", "arguments": {"text": "hi"}},
    "retryPolicy": {"version": 1, "delaysMs": [1000]},
}


V4 = {**V2, "version": 4, "traceContext": None, "tool": "echo"}
ORIGIN: dict[str, Any] = {
    "protocolVersion": "2026-07-28",
    "clientCapabilities": {},
    "clientInfo": None,
}


def test_work_with_an_origin_is_version_5_with_or_without_tool_and_context() -> None:
    origin = Origin(protocol_version="2026-07-28", client_capabilities={"sampling": {}})
    plain = Work.tool_call("task-1", "echo", {"text": "hi"}, RetryPolicy([1000]))
    for tool, trace in ((None, None), ("echo", TraceContext(PARENT, "a=1"))):
        work = Work(
            idempotency_key="task-1",
            type="tools/call",
            input=plain.input,
            retry_policy=plain.retry_policy,
            trace_context=trace,
            tool=tool,
            origin=origin,
        )
        doc = work.to_json()
        assert doc == {
            **V2,
            "version": 5,
            "traceContext": None if trace is None else trace.to_json(),
            "tool": tool,
            "origin": {
                "protocolVersion": "2026-07-28",
                "clientCapabilities": {"sampling": {}},
                "clientInfo": None,
            },
        }
        assert Work.from_json(json.loads(json.dumps(doc))) == work


def test_a_context_reads_its_ids() -> None:
    context = TraceContext(PARENT, "vendor=v1,other=x")
    assert (context.trace_id, context.span_id) == (TRACE, SPAN)
    assert context.carrier() == {"traceparent": PARENT, "tracestate": "vendor=v1,other=x"}
    assert TraceContext(PARENT).carrier() == {"traceparent": PARENT}


@pytest.mark.parametrize(
    ("carrier", "expected"),
    [
        ({"traceparent": PARENT}, TraceContext(PARENT)),
        ({"traceparent": PARENT, "tracestate": " a=1 "}, TraceContext(PARENT, "a=1")),
        ({"traceparent": PARENT, "tracestate": ""}, TraceContext(PARENT)),
        # An invalid tracestate is dropped, the traceparent kept.
        ({"traceparent": PARENT, "tracestate": "x" * 513}, TraceContext(PARENT)),
        ({"traceparent": PARENT, "tracestate": "caf\u00e9=1"}, TraceContext(PARENT)),
        ({"traceparent": PARENT, "tracestate": 7}, TraceContext(PARENT)),
        # A later version keeps its first four fields; version ff and zero ids are invalid.
        ({"traceparent": f"01-{TRACE}-{SPAN}-01-future"}, TraceContext(f"01-{TRACE}-{SPAN}-01")),
        ({"traceparent": f"00-{TRACE}-{SPAN}-01-future"}, None),
        ({"traceparent": f"ff-{TRACE}-{SPAN}-01"}, None),
        ({"traceparent": f"00-{'0' * 32}-{SPAN}-01"}, None),
        ({"traceparent": f"00-{TRACE}-{'0' * 16}-01"}, None),
        ({"traceparent": PARENT.upper()}, None),
        ({"traceparent": PARENT[:-1]}, None),
        ({"traceparent": 42}, None),
        ({"tracestate": "a=1"}, None),
        ({}, None),
    ],
)
def test_reading_from_meta_is_lenient(
    carrier: dict[str, Any], expected: TraceContext | None
) -> None:
    assert TraceContext.from_carrier(carrier) == expected


@given(st.dictionaries(st.sampled_from(["traceparent", "tracestate", "x"]), st.from_type(object)))
def test_reading_from_meta_never_raises(carrier: dict[str, Any]) -> None:
    found = TraceContext.from_carrier(carrier)
    assert found is None or TraceContext.from_json(found.to_json()) == found


@given(
    trace=st.text("0123456789abcdef", min_size=32, max_size=32).filter(lambda t: set(t) != {"0"}),
    span=st.text("0123456789abcdef", min_size=16, max_size=16).filter(lambda s: set(s) != {"0"}),
    flags=st.sampled_from(["00", "01"]),
    state=st.none() | st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=512),
)
def test_work_with_a_context_round_trips_as_version_3(
    trace: str, span: str, flags: str, state: str | None
) -> None:
    context = TraceContext(f"00-{trace}-{span}-{flags}", state)
    work = Work.tool_call("task-1", "echo", {"text": "hi"}, RetryPolicy([1000]))
    traced = Work(
        idempotency_key=work.idempotency_key,
        type=work.type,
        input=work.input,
        retry_policy=work.retry_policy,
        trace_context=context,
    )
    doc = traced.to_json()
    assert doc == {**V2, "version": 3, "traceContext": context.to_json()}
    assert Work.from_json(json.loads(json.dumps(doc))) == traced


def test_work_without_a_context_stays_version_2() -> None:
    work = Work.from_json(V2)
    assert work.trace_context is None
    assert work.to_json() == V2


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({**V2, "traceContext": {"traceparent": PARENT, "tracestate": None}}, "unexpected keys"),
        ({**V2, "version": 3}, "missing keys ['traceContext']"),
        ({**V2, "version": 3, "traceContext": None}, "trace context must be a JSON object"),
        ({**V2, "version": 3, "traceContext": {"traceparent": PARENT}}, "missing keys"),
        (
            {**V2, "version": 3, "traceContext": {"traceparent": "nope", "tracestate": None}},
            "invalid trace context",
        ),
        (
            {**V2, "version": 3, "traceContext": {"traceparent": PARENT, "tracestate": 1}},
            "invalid trace context",
        ),
        ({**V2, "version": 4}, "missing keys ['tool', 'traceContext']"),
        ({**V2, "version": 4, "traceContext": None, "tool": None}, "needs its tool"),
        ({**V2, "version": 4, "traceContext": None, "tool": ""}, "needs its tool"),
        ({**V2, "version": 4, "traceContext": None, "tool": 1}, "needs its tool"),
        ({**V2, "version": 4, "traceContext": None}, "missing keys ['tool']"),
        ({**V2, "version": 4, "tool": "echo"}, "missing keys ['traceContext']"),
        (
            {**V2, "version": 4, "traceContext": {"traceparent": "x", "tracestate": None}},
            "missing keys ['tool']",
        ),
        (
            {**V2, "version": 4, "tool": "echo", "traceContext": {"traceparent": "x"}},
            "missing keys",
        ),
        ({**V2, "version": 3, "traceContext": None, "tool": "echo"}, "unexpected keys"),
        ({**V2, "tool": "echo"}, "unexpected keys"),
        ({**V2, "version": 6}, "unsupported work version 6"),
        ({**V4, "version": 5}, "missing keys ['origin']"),
        ({**V4, "version": 5, "origin": None}, "origin must be a JSON object"),
        ({**V4, "version": 5, "origin": ORIGIN, "tool": ""}, "needs its tool"),
        ({**V4, "version": 5, "origin": {**ORIGIN, "principal": "alice"}}, "unexpected keys"),
        ({**V4, "version": 5, "origin": {**ORIGIN, "clientInfo": []}}, "clientInfo"),
        ({**V4, "version": 5, "origin": {**ORIGIN, "clientCapabilities": None}}, "invalid origin"),
        ({**V4, "version": 5, "origin": {**ORIGIN, "protocolVersion": ""}}, "invalid origin"),
        ({**V4, "origin": ORIGIN}, "unexpected keys"),
        ({**V2, "version": True}, "unsupported work version True"),
        ("work", "unsupported work version None"),
    ],
)
def test_decoding_is_strict(doc: Any, message: str) -> None:
    with pytest.raises(CodecError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Work.from_json(doc)


def test_work_with_a_tool_is_version_4_and_old_versions_still_decode() -> None:
    """The tool a ``work_builder``'s work was made for: version 4, with or without a trace
    context; the versions before it decode as they did, without a tool."""
    built = Work(idempotency_key="task-1", type="export", input={"job": 7}, tool="export")
    assert built.to_json() == {
        "version": 4,
        "idempotencyKey": "task-1",
        "type": "export",
        "input": {"job": 7},
        "retryPolicy": {"version": 1, "delaysMs": []},
        "traceContext": None,
        "tool": "export",
    }
    traced = Work(
        idempotency_key="task-1",
        type="export",
        input={},
        trace_context=TraceContext(PARENT, None),
        tool="export",
    )
    assert traced.to_json()["traceContext"] == {"traceparent": PARENT, "tracestate": None}
    for work in (built, traced):
        assert Work.from_json(json.loads(json.dumps(work.to_json()))) == work
    v3 = {**V2, "version": 3, "traceContext": {"traceparent": PARENT, "tracestate": None}}
    assert (Work.from_json(V2).tool, Work.from_json(v3).tool) == (None, None)
    assert Work.from_json(v3).to_json() == v3


def test_a_record_with_traced_work_round_trips() -> None:
    work = Work(
        idempotency_key="task-1",
        type="job",
        input={},
        trace_context=TraceContext(PARENT, "a=1"),
    )
    snapshot = initial_snapshot(new_task("task-1", 1_000_000, None, None), work)
    text = json.dumps(snapshot_to_json(snapshot))
    assert snapshot_from_json(json.loads(text)) == snapshot
    built = initial_snapshot(
        new_task("task-1", 1_000_000, None, None),
        Work(idempotency_key="task-1", type="job", input={}, tool="export"),
    )
    text = json.dumps(snapshot_to_json(built))
    assert snapshot_from_json(json.loads(text)) == built
