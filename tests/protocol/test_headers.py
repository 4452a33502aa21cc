"""HTTP header mirroring rules (SEP-2243): decoding, the base64 sentinel, and each check."""

from __future__ import annotations

import base64

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tritask.protocol.errors import HeaderMismatch
from tritask.protocol.headers import (
    HeaderView,
    check_method,
    check_name,
    check_params,
    check_protocol_version_matches,
    check_protocol_version_present,
    decode_header_value,
    encode_header_value,
    needs_encoding,
    param_headers,
    single_header,
)


def b64(text: str) -> str:
    return "=?base64?" + base64.b64encode(text.encode("utf-8")).decode("ascii") + "?="


def view(*pairs: tuple[str, str]) -> HeaderView:
    return HeaderView.from_pairs(pairs)


# -- HeaderView ----------------------------------------------------------------------------


def test_header_view_is_case_insensitive_and_keeps_repeats() -> None:
    headers = HeaderView.from_pairs(
        [(b"Mcp-Name", b"a"), ("MCP-NAME", "b"), (b"content-type", b"application/json")]
    )
    assert headers.get_all("mcp-name") == ("a", "b")
    assert headers.get("Mcp-Name") == "a"
    assert headers.get("Content-Type") == "application/json"
    assert headers.get("missing") is None
    assert headers.get_all("missing") == ()
    assert set(headers.names()) == {"mcp-name", "content-type"}


def test_header_view_decodes_bytes_as_latin1() -> None:
    headers = HeaderView.from_pairs([(b"x", b"caf\xe9")])
    assert headers.get("x") == "caf\u00e9"


# -- decode_header_value -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("tools/call", "tools/call"),
        ("  spaced \t", "spaced"),
        ("", ""),
        (b64("héllo ✓"), "héllo ✓"),
        ("  " + b64("x") + "\t", "x"),
        (b64(" leading"), " leading"),
        ("=?base64??=", ""),
        # Without the exact wrapper the value is literal.
        ("=?BASE64?aGk=?=", "=?BASE64?aGk=?="),
        ("=?base64?aGk=", "=?base64?aGk="),
        ("x=?base64?aGk=?=", "x=?base64?aGk=?="),
    ],
)
def test_decode_header_value(raw: str, expected: str) -> None:
    assert decode_header_value(raw, "Mcp-Name") == expected


@pytest.mark.parametrize(
    "raw",
    [
        "=?base64?aGk?=",  # length not a multiple of 4
        "=?base64?a*k=?=",  # not in the alphabet
        "=?base64?aG-_?=",  # URL-safe alphabet is not standard base64
        "=?base64?aGk===?=",  # too much padding
        "=?base64?=aGk?=",  # padding first
        "=?base64?/w==?=",  # decodes to b"\xff": not UTF-8
        "=?base64?aG k=?=",  # embedded space
    ],
)
def test_invalid_base64_is_a_header_mismatch(raw: str) -> None:
    with pytest.raises(HeaderMismatch) as info:
        decode_header_value(raw, "Mcp-Name")
    assert info.value.code == -32020
    assert info.value.message == "Header Mcp-Name has an invalid base64 value"


@pytest.mark.parametrize("raw", ["a\x00b", "a\nb", "a\rb", "a\x1fb", "a\x7fb", "a\tb"])
def test_control_characters_are_a_header_mismatch(raw: str) -> None:
    with pytest.raises(HeaderMismatch) as info:
        decode_header_value(raw, "Mcp-Method")
    assert info.value.code == -32020
    assert info.value.message == "Header Mcp-Method contains invalid characters"


@pytest.mark.parametrize("raw", ["caf\u00e9", "\u2713", "a\x80b", "\u00ff"])
def test_literal_non_ascii_is_a_header_mismatch(raw: str) -> None:
    # Non-ASCII values must travel base64-encoded; a literal one is an invalid character.
    with pytest.raises(HeaderMismatch) as info:
        decode_header_value(raw, "Mcp-Name")
    assert info.value.message == "Header Mcp-Name contains invalid characters"


@pytest.mark.parametrize(
    ("value", "literal"),
    [
        ("plain", True),
        ("tools/call", True),
        ("a b", True),
        ("", True),
        (" lead", False),
        ("trail ", False),
        ("\ttab", False),
        ("é", False),
        ("a\nb", False),
        ("a\x7f", False),
        ("=?base64?aGk=?=", False),
    ],
)
def test_needs_encoding(value: str, literal: bool) -> None:
    assert needs_encoding(value) is (not literal)
    encoded = encode_header_value(value)
    assert (encoded == value) is literal
    assert decode_header_value(encoded, "X") == value


@given(st.text())
def test_encode_decode_round_trip(value: str) -> None:
    encoded = encode_header_value(value)
    assert all(0x20 <= ord(ch) <= 0x7E for ch in encoded)
    assert decode_header_value(encoded, "X") == value


@given(st.text())
def test_decode_only_raises_header_mismatch(raw: str) -> None:
    try:
        decoded = decode_header_value(raw, "X")
    except HeaderMismatch as error:
        assert error.code == -32020
    else:
        assert isinstance(decoded, str)


@given(st.binary())
def test_decode_of_any_sentinel_payload_only_raises_header_mismatch(payload: bytes) -> None:
    raw = "=?base64?" + base64.b64encode(payload).decode("ascii") + "?="
    try:
        decoded = decode_header_value(raw, "X")
    except HeaderMismatch:
        with pytest.raises(UnicodeDecodeError):
            payload.decode("utf-8")
    else:
        assert decoded == payload.decode("utf-8")


# -- single_header and the version checks ----------------------------------------------------


def test_single_header_refuses_repeats() -> None:
    with pytest.raises(HeaderMismatch) as info:
        single_header(view(("mcp-name", "a"), ("mcp-name", "a")), "mcp-name")
    assert info.value.message == "Header Mcp-Name must not be repeated"
    assert single_header(view(), "mcp-name") is None
    assert single_header(view(("mcp-name", b64("✓"))), "mcp-name") == "✓"


def test_protocol_version_present() -> None:
    assert check_protocol_version_present(view(("MCP-Protocol-Version", " 2026-07-28 "))) == (
        "2026-07-28"
    )
    for headers in (
        view(),
        view(("mcp-protocol-version", "")),
        view(("mcp-protocol-version", " ")),
    ):
        with pytest.raises(HeaderMismatch) as info:
            check_protocol_version_present(headers)
        assert info.value.message == "The MCP-Protocol-Version header is required"


def test_protocol_version_matches() -> None:
    check_protocol_version_matches(view(("mcp-protocol-version", "2026-07-28")), "2026-07-28")
    with pytest.raises(HeaderMismatch) as info:
        check_protocol_version_matches(view(("mcp-protocol-version", "2026-07-28")), "v999.0.0")
    assert info.value.message == (
        "The MCP-Protocol-Version header does not match "
        "params._meta io.modelcontextprotocol/protocolVersion"
    )


def test_check_method() -> None:
    check_method(view(("mcp-method", "tools/list")), "tools/list")
    check_method(view(("mcp-method", b64("tools/list"))), "tools/list")
    with pytest.raises(HeaderMismatch, match=r"^The Mcp-Method header is required$"):
        check_method(view(), "tools/list")
    with pytest.raises(HeaderMismatch, match=r"^The Mcp-Method header does not match"):
        check_method(view(("mcp-method", "Tools/List")), "tools/list")
    with pytest.raises(HeaderMismatch, match="must not be repeated"):
        check_method(view(("mcp-method", "tools/list"), ("mcp-method", "tools/list")), "tools/list")


def test_check_name() -> None:
    check_name(view(("mcp-name", "echo")), {"name": "echo"}, "name")
    check_name(view(("mcp-name", b64("naïve ✓"))), {"name": "naïve ✓"}, "name")
    check_name(view(), {}, "name")  # no body name, no header: nothing to mirror
    check_name(view(("mcp-name", "ignored")), {"name": "x"}, None)  # method without a name
    with pytest.raises(HeaderMismatch) as info:
        check_name(view(), {"uri": "demo://x"}, "uri")
    assert info.value.message == "The Mcp-Name header is required and must mirror params.uri"
    with pytest.raises(HeaderMismatch) as info:
        check_name(view(("mcp-name", "other")), {"name": "echo"}, "name")
    assert info.value.message == "The Mcp-Name header does not match params.name"
    with pytest.raises(HeaderMismatch) as info:
        check_name(view(("mcp-name", "echo")), {}, "name")
    assert info.value.message == "The Mcp-Name header is set but params.name is absent"
    with pytest.raises(HeaderMismatch, match="does not match"):
        check_name(view(("mcp-name", "1")), {"name": 1}, "name")  # names are strings
    with pytest.raises(HeaderMismatch, match="does not match"):
        check_name(view(("mcp-name", "Echo")), {"name": "echo"}, "name")  # case-sensitive
    with pytest.raises(HeaderMismatch, match="must not be repeated"):
        check_name(view(("mcp-name", "echo"), ("mcp-name", "echo")), {"name": "echo"}, "name")


def test_check_name_when_the_header_is_optional() -> None:
    check_name(view(), {"taskId": "t-1"}, "taskId", required=False)  # absent: forgiven
    check_name(view(("mcp-name", "t-1")), {"taskId": "t-1"}, "taskId", required=False)
    check_name(view(("mcp-name", b64("t ✓"))), {"taskId": "t ✓"}, "taskId", required=False)
    with pytest.raises(HeaderMismatch) as info:
        check_name(view(("mcp-name", "t-2")), {"taskId": "t-1"}, "taskId", required=False)
    assert info.value.message == "The Mcp-Name header does not match params.taskId"
    with pytest.raises(HeaderMismatch) as info:
        check_name(view(("mcp-name", "t-1")), {}, "taskId", required=False)
    assert info.value.message == "The Mcp-Name header is set but params.taskId is absent"
    with pytest.raises(HeaderMismatch, match="invalid base64"):
        check_name(view(("mcp-name", "=?base64?@@?=")), {"taskId": "t-1"}, "taskId", required=False)
    with pytest.raises(HeaderMismatch, match="must not be repeated"):
        check_name(
            view(("mcp-name", "t-1"), ("mcp-name", "t-1")),
            {"taskId": "t-1"},
            "taskId",
            required=False,
        )


# -- Mcp-Param-* -----------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "region": {"type": "string", "x-mcp-header": "Region"},
        "count": {"type": "integer", "x-mcp-header": "Count"},
        "ratio": {"type": "number", "x-mcp-header": "Ratio"},
        "flag": {"type": "boolean", "x-mcp-header": "Flag"},
        "bad": {"type": "string", "x-mcp-header": "not valid!"},
        "plain": {"type": "string"},
    },
}


def test_param_headers_declared_by_schema() -> None:
    assert param_headers(SCHEMA) == {
        "region": ("region", "string"),
        "count": ("count", "integer"),
        "ratio": ("ratio", "number"),
        "flag": ("flag", "boolean"),
    }
    assert param_headers({"type": "object"}) == {}
    assert param_headers({"type": "object", "properties": {"a": True}}) == {}


@pytest.mark.parametrize(
    ("pairs", "arguments"),
    [
        ([], {}),
        ([], {"plain": "x"}),
        ([("mcp-param-region", "eu-west")], {"region": "eu-west"}),
        ([("MCP-PARAM-REGION", b64("zürich"))], {"region": "zürich"}),
        ([("mcp-param-count", "42")], {"count": 42}),
        ([("mcp-param-count", "42.0")], {"count": 42}),
        ([("mcp-param-count", "4.2e1")], {"count": 42}),
        ([("mcp-param-count", str(2**70))], {"count": 2**70}),
        ([("mcp-param-count", "1e400")], {"count": 10**400}),
        ([("mcp-param-ratio", "0.5")], {"ratio": 0.5}),
        ([("mcp-param-ratio", "0.1")], {"ratio": 0.1}),
        ([("mcp-param-flag", "true")], {"flag": True}),
        ([("mcp-param-flag", "false")], {"flag": False}),
        ([], {"region": None}),
    ],
)
def test_check_params_accepts(pairs: list[tuple[str, str]], arguments: dict[str, object]) -> None:
    check_params(view(*pairs), arguments, param_headers(SCHEMA))


@pytest.mark.parametrize(
    ("pairs", "arguments", "message"),
    [
        ([], {"region": "eu"}, "Header Mcp-Param-Region is required for argument 'region'"),
        (
            [("mcp-param-region", "eu")],
            {},
            "Header Mcp-Param-Region is set but argument 'region' is absent",
        ),
        (
            [("mcp-param-region", "us")],
            {"region": "eu"},
            "Header Mcp-Param-Region does not match argument 'region'",
        ),
        (
            [("mcp-param-count", "forty-two")],
            {"count": 42},
            "Header Mcp-Param-Count does not match argument 'count'",
        ),
        (
            [("mcp-param-count", "43")],
            {"count": 42},
            "Header Mcp-Param-Count does not match argument 'count'",
        ),
        (
            [("mcp-param-count", str(2**70 + 1))],
            {"count": 2**70},
            "Header Mcp-Param-Count does not match argument 'count'",
        ),
        (
            [("mcp-param-count", "1")],
            {"count": 10**400},
            "Header Mcp-Param-Count does not match argument 'count'",
        ),
        (
            [("mcp-param-count", "NaN")],
            {"count": 1},
            "Header Mcp-Param-Count does not match argument 'count'",
        ),
        (
            [("mcp-param-ratio", "inf")],
            {"ratio": 1.5},
            "Header Mcp-Param-Ratio does not match argument 'ratio'",
        ),
        (
            [("mcp-param-flag", "True")],
            {"flag": True},
            "Header Mcp-Param-Flag does not match argument 'flag'",
        ),
        (
            [("mcp-param-flag", "1")],
            {"flag": True},
            "Header Mcp-Param-Flag does not match argument 'flag'",
        ),
        (
            [("mcp-param-region", "[]")],
            {"region": []},
            "Header Mcp-Param-Region does not match argument 'region'",
        ),
        (
            [("mcp-param-region", "eu"), ("mcp-param-region", "eu")],
            {"region": "eu"},
            "Header Mcp-Param-Region must not be repeated",
        ),
    ],
)
def test_check_params_refuses(
    pairs: list[tuple[str, str]], arguments: dict[str, object], message: str
) -> None:
    with pytest.raises(HeaderMismatch) as info:
        check_params(view(*pairs), arguments, param_headers(SCHEMA))
    assert info.value.code == -32020
    assert info.value.message == message


@given(
    header=st.text(),
    body=st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.integers(min_value=-(10**500), max_value=10**500),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(),
        st.lists(st.integers(), max_size=2),
    ),
)
def test_check_params_only_raises_header_mismatch(header: str, body: object) -> None:
    declared = {"x": ("x", None)}
    try:
        check_params(view(("mcp-param-x", header)), {"x": body}, declared)
    except HeaderMismatch as error:
        assert error.code == -32020
