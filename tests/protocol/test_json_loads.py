"""``jsonrpc.loads`` gives exactly the standard library's answer, fast path or not."""

from __future__ import annotations

import json
import re
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st

from tritask.jsonrpc import _has_long_digit_run, loads
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
