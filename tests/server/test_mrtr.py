"""``requestState`` sealing: integrity, binding (method, name, principal) and expiry."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tritask.jsonrpc import InvalidParams, Request
from tritask.protocol.meta import CLIENT_CAPABILITIES_KEY, PROTOCOL_VERSION_KEY
from tritask.server import App, InputRequired, RequestStateSealer, elicitation
from tritask.server.dispatcher import Dispatcher

KEY = b"k" * 32
INVALID = "requestState is invalid or has expired"


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def sealer(clock: Clock) -> RequestStateSealer:
    return RequestStateSealer(KEY, ttl_seconds=60.0, clock=clock)


def seal(sealer: RequestStateSealer, state: Any = None, **where: Any) -> str:
    where.setdefault("method", "tools/call")
    where.setdefault("name", "ask")
    where.setdefault("principal", {"sub": "ann"})
    return sealer.seal({"step": 1} if state is None else state, **where)


def open_(sealer: RequestStateSealer, token: Any, **where: Any) -> Any:
    where.setdefault("method", "tools/call")
    where.setdefault("name", "ask")
    where.setdefault("principal", {"sub": "ann"})
    return sealer.open(token, **where)


def assert_invalid(sealer: RequestStateSealer, token: Any, **where: Any) -> None:
    with pytest.raises(InvalidParams) as info:
        open_(sealer, token, **where)
    assert info.value.code == -32602
    assert info.value.message == INVALID


@pytest.mark.parametrize(
    "state",
    [{"step": 1}, "text", 0, [1, "two", None], {"nested": {"deep": [True, 1.5]}}, "✓ ünïcode"],
)
def test_round_trip(sealer: RequestStateSealer, state: Any) -> None:
    token = seal(sealer, state)
    assert token.startswith("v1.")
    assert open_(sealer, token) == state


def test_principal_is_compared_by_value(sealer: RequestStateSealer) -> None:
    token = seal(sealer, principal={"sub": "ann", "roles": ["a"]})
    assert open_(sealer, token, principal={"roles": ["a"], "sub": "ann"}) == {"step": 1}


def test_state_is_not_readable_as_plain_json_key_material(sealer: RequestStateSealer) -> None:
    # The token carries the payload in base64url plus an HMAC; the key never appears.
    token = seal(sealer)
    assert KEY.decode() not in token


def test_tampered_payload(sealer: RequestStateSealer) -> None:
    token = seal(sealer)
    _, payload, signature = token.split(".")
    raw = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
    body = json.loads(raw)
    body["s"] = {"step": 99}
    forged = base64.urlsafe_b64encode(json.dumps(body).encode()).rstrip(b"=").decode()
    assert_invalid(sealer, f"v1.{forged}.{signature}")


def test_tampered_signature(sealer: RequestStateSealer) -> None:
    token = seal(sealer)
    head, payload, signature = token.split(".")
    flipped = ("B" if signature[0] == "A" else "A") + signature[1:]
    assert_invalid(sealer, f"{head}.{payload}.{flipped}")
    assert_invalid(sealer, f"{head}.{payload}.")
    assert_invalid(sealer, f"{head}.{payload}")
    assert_invalid(sealer, f"{head}.{payload}.{signature}.extra")


@pytest.mark.parametrize("prefix", ["v2.", "", "V1.", "v1"])
def test_tampered_prefix(sealer: RequestStateSealer, prefix: str) -> None:
    token = seal(sealer)
    assert_invalid(sealer, prefix + token.removeprefix("v1."))


def test_other_key(sealer: RequestStateSealer, clock: Clock) -> None:
    token = seal(sealer)
    assert_invalid(RequestStateSealer(b"o" * 32, clock=clock), token)


def test_expiry(sealer: RequestStateSealer, clock: Clock) -> None:
    token = seal(sealer)
    clock.now += 60
    assert open_(sealer, token) == {"step": 1}
    clock.now += 1
    assert_invalid(sealer, token)


def test_other_method(sealer: RequestStateSealer) -> None:
    assert_invalid(sealer, seal(sealer), method="prompts/get")


@pytest.mark.parametrize("name", ["other", None, "Ask"])
def test_other_name(sealer: RequestStateSealer, name: str | None) -> None:
    assert_invalid(sealer, seal(sealer), name=name)


@pytest.mark.parametrize("principal", [None, {"sub": "bob"}, "ann", {"sub": "ann", "x": 1}])
def test_other_principal(sealer: RequestStateSealer, principal: Any) -> None:
    assert_invalid(sealer, seal(sealer), principal=principal)


@pytest.mark.parametrize("token", [None, 1, ["v1.a.b"], {"v1": "a"}, True, "v1." + "A" * 1_000_001])
def test_non_tokens(sealer: RequestStateSealer, token: Any) -> None:
    assert_invalid(sealer, token)


def test_key_configuration() -> None:
    with pytest.raises(ValueError, match="at least 16 bytes"):
        RequestStateSealer.from_config("short")
    assert RequestStateSealer.from_config("x" * 16).key == b"x" * 16
    assert len(RequestStateSealer.from_config(None).key) == 32


def test_input_required_validation() -> None:
    with pytest.raises(ValueError, match="needs input_requests, state, or both"):
        InputRequired()
    with pytest.raises(ValueError, match="keys must be non-empty strings"):
        InputRequired({"": elicitation("?", {"type": "object"})})
    with pytest.raises(ValueError, match="must be a"):
        InputRequired({"k": {"params": {}}})
    with pytest.raises(ValueError, match="must be a JSON value"):
        InputRequired(state={1, 2})
    assert InputRequired(state=0).state == 0


@given(st.text())
def test_arbitrary_strings_are_refused(token: str) -> None:
    sealer = RequestStateSealer(KEY)
    assert_invalid(sealer, token)


@given(st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.="))
def test_arbitrary_token_shaped_strings_are_refused(tail: str) -> None:
    sealer = RequestStateSealer(KEY)
    assert_invalid(sealer, "v1." + tail)


@given(st.data())
def test_single_character_edits_are_refused(data: st.DataObject) -> None:
    sealer = RequestStateSealer(KEY)
    token = seal(sealer)
    index = data.draw(st.integers(min_value=0, max_value=len(token) - 1))
    replacement = data.draw(st.characters(codec="utf-8").filter(lambda ch: ch != token[index]))
    edited = token[:index] + replacement + token[index + 1 :]
    try:
        state = open_(sealer, edited)
    except InvalidParams as error:
        assert error.message == INVALID
    else:
        # base64url decoding ignores nothing but may alias the last character's spare bits;
        # any token that still opens must carry the very same payload.
        assert state == {"step": 1}


@settings(max_examples=50, deadline=None)
@given(st.text(max_size=200))
async def test_dispatcher_refuses_arbitrary_request_state(token: str) -> None:
    app = App("t", "1", state_key=KEY)

    @app.tool()
    async def ask() -> str:
        """Never reached with a bad state."""
        raise AssertionError("the tool ran")

    params = {
        "name": "ask",
        "requestState": token,
        "_meta": {PROTOCOL_VERSION_KEY: "2026-07-28", CLIENT_CAPABILITIES_KEY: {}},
    }
    response = await Dispatcher(app).handle_request(
        Request(id=1, method="tools/call", params=params)
    )
    assert response == {"jsonrpc": "2.0", "id": 1, "error": {"code": -32602, "message": INVALID}}


def test_app_uses_the_configured_key(make_app: Callable[..., App]) -> None:
    one, two = make_app(), make_app()
    token = one.sealer.seal("s", method="tools/call", name="x", principal=None)
    assert two.sealer.open(token, method="tools/call", name="x", principal=None) == "s"
