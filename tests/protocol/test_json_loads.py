"""``jsonrpc.loads`` gives exactly the standard library's answer, fast path or not."""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st

from tritask.jsonrpc import UnrepresentableJSON, _has_long_digit_run, loads, loads_wire
from tritask.tasks.work import canonical_json, stored_text


def _reject(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def reference(data: bytes | str) -> Any:
    """What ``loads`` was before the fast path: the standard library, strict."""
    text = data.decode("utf-8") if isinstance(data, bytes) else data
    return json.loads(text, parse_constant=_reject)


def typed(value: Any) -> Any:
    """A value with its JSON types spelled out (``1``, ``1.0``, ``True`` and ``-0.0`` differ)."""
    if isinstance(value, dict):
        return ("object", [(key, typed(item)) for key, item in value.items()])
    if isinstance(value, list):
        return ("array", [typed(item) for item in value])
    if isinstance(value, float):
        return ("float", repr(value))
    return (type(value).__name__, value)


def answer(fn: Any, data: bytes | str) -> Any:
    try:
        return ("value", typed(fn(data)))
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        return ("error", type(exc))


def same_as_reference(data: bytes | str) -> None:
    assert answer(loads, data) == answer(reference, data)


scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**90), max_value=2**90)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=25,
)


@given(values, st.booleans(), st.booleans())
@example(2**64, False, True)  # beyond 64 bits: the fast path would say 1.8446744073709552e19
@example(-(2**63) - 1, False, False)  # 19 digits, below the 64-bit range
@example("\ud800", False, True)  # a lone surrogate, escaped
@example({"a": [1.0, -0.0, 1e16, 5e-324]}, True, True)
def test_encoded_values(value: Any, ascii_only: bool, as_bytes: bool) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only)
    same_as_reference(text.encode("utf-8", "surrogatepass") if as_bytes else text)


@given(st.text(max_size=40))
@example("1e400")  # overflows to inf in the standard library, refused by orjson
@example("NaN")
@example('{"a": 1, "a": 2}')
@example("\ufeff{}")
@example('"\\ud800\\udc00"')
@example("[1,]")
def test_arbitrary_text(text: str) -> None:
    same_as_reference(text)
    same_as_reference(text.encode("utf-8", "surrogatepass"))


@given(st.binary(max_size=40))
@example(b'"\xff"')
@example(b"[" * 5000 + b"]" * 5000)
def test_arbitrary_bytes(data: bytes) -> None:
    same_as_reference(data)


@given(values, st.integers(min_value=0, max_value=60), st.binary(min_size=1, max_size=3))
def test_damaged_documents(value: Any, at: int, junk: bytes) -> None:
    data = json.dumps(value).encode("utf-8", "surrogatepass")
    at = min(at, len(data))
    same_as_reference(data[:at] + junk + data[at:])


@given(values)
@example({"lone": "\ud800", "big": 2**70, "exp": 1e16, "nested": [{"b": 1, "a": 2}]})
@example("\u2028é\U0001f980\x00")
def test_stored_text_means_the_value_exactly(value: Any) -> None:
    text = stored_text(value)
    text.encode("utf-8")  # always valid UTF-8, also for a lone surrogate (escaped)
    # canonical_json tells 1, 1.0, true and -0.0 apart: the same value, exactly
    assert canonical_json(json.loads(text)) == canonical_json(value)
    compact = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    assert json.loads(text) == json.loads(compact)  # sorted and compact like the stdlib's
    if isinstance(value, dict):
        assert list(json.loads(text)) == sorted(value)


@given(st.text(alphabet=st.sampled_from('0123456789 .-e"٣\ud800x')) | st.text(), st.booleans())
@example("1" * 19, False)
@example("1" * 18 + " 1", True)
@example("٣" * 19, False)  # Unicode digits never form a JSON number: no run
def test_the_long_digit_guard_finds_exactly_ascii_digit_runs(text: str, as_bytes: bool) -> None:
    data = text.encode("utf-8", "surrogatepass") if as_bytes else text
    expected = re.search(r"[0-9]{19}", text) is not None
    assert _has_long_digit_run(data) is expected


# -- loads_wire: what a peer sends (issue 18) ------------------------------------------------------


def unanswerable(value: Any) -> bool:
    """A number no double can hold, or a lone surrogate: the server could not answer it."""
    if isinstance(value, float):
        return value in (float("inf"), float("-inf"))
    if isinstance(value, int) and not isinstance(value, bool):
        return abs(value) > sys.float_info.max
    if isinstance(value, str):
        return any(0xD800 <= ord(char) <= 0xDFFF for char in value)
    if isinstance(value, list):
        return any(unanswerable(item) for item in value)
    if isinstance(value, dict):
        return any(unanswerable(key) or unanswerable(item) for key, item in value.items())
    return False


wire_scalars = (
    scalars
    | st.integers(min_value=-(10**400), max_value=10**400)
    | st.sampled_from([10**308, 2**1024, -(2**1024), 2**1024 - 1, "\ud800", "a\udfffb", "😀"])
)
wire_values = st.recursive(
    wire_scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=5) | st.just("\ud800"), inner, max_size=4)
    ),
    max_leaves=15,
)


@given(wire_values, st.booleans(), st.booleans())
@example(2**1024, False, False)  # the smallest integer beyond the largest double
@example(2**1024 - 1, False, False)  # not beyond it: 309 digits, read exactly
@example({"\ud800": 1}, True, True)  # a lone surrogate in a key
@example(["\U0001f600"], True, False)  # escaped as a surrogate pair: one character, fine
def test_loads_wire_is_loads_without_what_cannot_be_answered(
    value: Any, ascii_only: bool, as_bytes: bool
) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only)
    data: bytes | str = text.encode("utf-8", "surrogatepass") if as_bytes else text
    if not unanswerable(value):
        assert answer(loads_wire, data) == answer(loads, data)
    elif ascii_only or not any(isinstance(v, str) and unanswerable(v) for v in _leaves(value)):
        try:
            loads_wire(data)
        except UnrepresentableJSON:
            return
        raise AssertionError(f"accepted {text[:80]!r}")
    else:  # a raw (unescaped) surrogate is not UTF-8 at all: refused by both, as before
        assert answer(loads_wire, data)[0] == "error"


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, list):
        return [leaf for item in value for leaf in _leaves(item)]
    if isinstance(value, dict):
        return [leaf for key, item in value.items() for leaf in (key, *_leaves(item))]
    return [value]


@given(st.sampled_from(["1e400", "-1e400", "1E309", "[0, 1e999]", '{"a": -2e308}']))
def test_loads_wire_refuses_floats_that_read_as_infinity(text: str) -> None:
    assert loads(text) in (float("inf"), float("-inf")) or isinstance(loads(text), list | dict)
    try:
        loads_wire(text)
    except UnrepresentableJSON as error:
        assert "beyond the range of a double" in str(error)
        return
    raise AssertionError(text)
