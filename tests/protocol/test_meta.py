"""Per-request ``_meta`` parsing (step 5 of the validation order) and the optional fields."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tritask.jsonrpc import InvalidParams
from tritask.protocol.meta import (
    CLIENT_CAPABILITIES_KEY,
    CLIENT_INFO_KEY,
    LOG_LEVEL_KEY,
    PROTOCOL_VERSION_KEY,
    RequestMeta,
    parse_optional_meta,
    parse_request_meta,
)

VERSION = "2026-07-28"


def meta(**extra: Any) -> dict[str, Any]:
    return {"_meta": {PROTOCOL_VERSION_KEY: VERSION, CLIENT_CAPABILITIES_KEY: {}, **extra}}


def test_minimal_meta_parses() -> None:
    parsed = parse_request_meta(meta())
    assert parsed == RequestMeta(
        protocol_version=VERSION,
        client_capabilities={},
        raw={PROTOCOL_VERSION_KEY: VERSION, CLIENT_CAPABILITIES_KEY: {}},
    )


def test_full_meta_parses() -> None:
    params = meta(
        **{
            CLIENT_INFO_KEY: {"name": "c", "version": "1"},
            LOG_LEVEL_KEY: "warning",
            "progressToken": "tok",
            "traceparent": "00-abc-def-01",
        }
    )
    params["_meta"][CLIENT_CAPABILITIES_KEY] = {"elicitation": {}}
    parsed = parse_optional_meta(parse_request_meta(params))
    assert parsed.client_capabilities == {"elicitation": {}}
    assert parsed.client_info == {"name": "c", "version": "1"}
    assert parsed.log_level == "warning"
    assert parsed.progress_token == "tok"
    assert parsed.raw["traceparent"] == "00-abc-def-01"


def test_optional_fields_wait_for_the_second_step() -> None:
    # An unsupported version must be reported before a bad optional field, so step 5 only
    # checks the required fields.
    parsed = parse_request_meta(meta(**{LOG_LEVEL_KEY: "shouting"}))
    assert parsed.log_level is None
    with pytest.raises(InvalidParams):
        parse_optional_meta(parsed)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (
            None,
            f"params._meta is required and must carry {PROTOCOL_VERSION_KEY} "
            f"and {CLIENT_CAPABILITIES_KEY}",
        ),
        (
            {},
            f"params._meta is required and must carry {PROTOCOL_VERSION_KEY} "
            f"and {CLIENT_CAPABILITIES_KEY}",
        ),
        (
            {"_meta": None},
            f"params._meta is required and must carry {PROTOCOL_VERSION_KEY} "
            f"and {CLIENT_CAPABILITIES_KEY}",
        ),
        ({"_meta": []}, "params._meta must be an object"),
        ({"_meta": "x"}, "params._meta must be an object"),
        (
            {"_meta": {CLIENT_CAPABILITIES_KEY: {}}},
            f"params._meta is missing {PROTOCOL_VERSION_KEY}",
        ),
        (
            {"_meta": {PROTOCOL_VERSION_KEY: "", CLIENT_CAPABILITIES_KEY: {}}},
            f"params._meta {PROTOCOL_VERSION_KEY} must be a non-empty string",
        ),
        (
            {"_meta": {PROTOCOL_VERSION_KEY: 20260728, CLIENT_CAPABILITIES_KEY: {}}},
            f"params._meta {PROTOCOL_VERSION_KEY} must be a non-empty string",
        ),
        (
            {"_meta": {PROTOCOL_VERSION_KEY: VERSION}},
            f"params._meta is missing {CLIENT_CAPABILITIES_KEY}",
        ),
        (
            {"_meta": {PROTOCOL_VERSION_KEY: VERSION, CLIENT_CAPABILITIES_KEY: []}},
            f"params._meta {CLIENT_CAPABILITIES_KEY} must be an object",
        ),
        (
            {
                "_meta": {
                    PROTOCOL_VERSION_KEY: VERSION,
                    CLIENT_CAPABILITIES_KEY: {},
                    CLIENT_INFO_KEY: "me",
                }
            },
            f"params._meta {CLIENT_INFO_KEY} must be an object",
        ),
    ],
)
def test_required_fields(params: dict[str, Any] | None, message: str) -> None:
    with pytest.raises(InvalidParams) as info:
        parse_request_meta(params)
    assert info.value.code == -32602
    assert info.value.message == message


def test_unsupported_version_is_not_judged_here() -> None:
    # Step 5 only checks presence; support is step 7 (the dispatcher answers -32022).
    assert parse_request_meta(meta(**{PROTOCOL_VERSION_KEY: "v999.0.0"})).protocol_version == (
        "v999.0.0"
    )


@pytest.mark.parametrize(
    "level", ["debug", "info", "notice", "warning", "error", "critical", "alert", "emergency"]
)
def test_every_log_level_is_accepted(level: str) -> None:
    assert (
        parse_optional_meta(parse_request_meta(meta(**{LOG_LEVEL_KEY: level}))).log_level == level
    )


@pytest.mark.parametrize("level", ["WARNING", "warn", "", 3, ["info"], {"level": "info"}, True])
def test_bad_log_level(level: object) -> None:
    with pytest.raises(InvalidParams) as info:
        parse_optional_meta(parse_request_meta(meta(**{LOG_LEVEL_KEY: level})))
    assert info.value.message == (
        f"params._meta {LOG_LEVEL_KEY} must be one of: "
        "debug, info, notice, warning, error, critical, alert, emergency"
    )


@pytest.mark.parametrize("token", ["t", "", 0, -5, 2**80])
def test_progress_tokens(token: str | int) -> None:
    parsed = parse_optional_meta(parse_request_meta(meta(progressToken=token)))
    assert parsed.progress_token == token


@pytest.mark.parametrize("token", [True, False, 1.5, [1], {"t": 1}])
def test_bad_progress_token(token: object) -> None:
    with pytest.raises(InvalidParams) as info:
        parse_optional_meta(parse_request_meta(meta(progressToken=token)))
    assert info.value.message == "params._meta progressToken must be a string or an integer"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)

meta_keys = st.sampled_from(
    [
        PROTOCOL_VERSION_KEY,
        CLIENT_CAPABILITIES_KEY,
        CLIENT_INFO_KEY,
        LOG_LEVEL_KEY,
        "progressToken",
        "other/key",
    ]
)


@given(
    st.one_of(
        st.dictionaries(st.text(max_size=8), json_values, max_size=4),
        st.fixed_dictionaries(
            {"_meta": st.one_of(json_values, st.dictionaries(meta_keys, json_values))}
        ),
    )
)
def test_meta_parsing_only_raises_invalid_params(params: dict[str, Any]) -> None:
    try:
        parsed = parse_optional_meta(parse_request_meta(params))
    except InvalidParams as error:
        assert error.code == -32602
    else:
        assert isinstance(parsed.protocol_version, str) and parsed.protocol_version
        assert isinstance(parsed.client_capabilities, dict)
