"""Multi round-trip requests (SEP-2322): ``InputRequired`` and the sealed ``requestState``.

The server never holds conversation state between requests. What a handler wants to remember
travels to the client as ``requestState``, sealed with HMAC-SHA256 over the state, an expiry,
the method, the target name and a digest of the principal, so a client can neither forge nor
replay it elsewhere. Several processes serving one client must share the key.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from tritask.jsonrpc import InvalidParams, JSONValue, dumps, is_json_value

log = logging.getLogger("tritask.server")

_PREFIX = "v1."


@attrs.frozen
class InputRequired:
    """A handler's answer "I need input first": becomes ``resultType: input_required``.

    ``input_requests`` maps server-chosen keys to ``{method, params}`` requests
    (``elicitation/create``, ``sampling/createMessage``, ``roots/list``); ``state`` is any JSON
    value the handler wants back on the retry (it is sealed before it leaves the server).
    """

    input_requests: dict[str, dict[str, JSONValue]] = attrs.field(factory=dict)
    state: JSONValue = None

    def __attrs_post_init__(self) -> None:
        if not self.input_requests and self.state is None:
            raise ValueError("InputRequired needs input_requests, state, or both")
        for key, request in self.input_requests.items():
            if not isinstance(key, str) or not key:
                raise ValueError("input request keys must be non-empty strings")
            if not isinstance(request, dict) or not isinstance(request.get("method"), str):
                raise ValueError(f"input request {key!r} must be a {{method, params}} object")
        if not is_json_value(self.state):
            raise ValueError("InputRequired state must be a JSON value")


def elicitation(message: str, schema: dict[str, JSONValue]) -> dict[str, JSONValue]:
    """An ``elicitation/create`` form request for ``InputRequired`` or ``await_input``."""
    return {
        "method": "elicitation/create",
        "params": {"mode": "form", "message": message, "requestedSchema": schema},
    }


def sampling(
    messages: list[dict[str, JSONValue]], max_tokens: int, **extra: JSONValue
) -> dict[str, JSONValue]:
    return {
        "method": "sampling/createMessage",
        "params": {"messages": messages, "maxTokens": max_tokens, **extra},
    }


def list_roots() -> dict[str, JSONValue]:
    return {"method": "roots/list", "params": {}}


def accepted_content(answer: Mapping[str, JSONValue] | None) -> dict[str, JSONValue] | None:
    """The ``content`` of an accepted elicitation answer, or ``None``.

    An answer is client input, whatever was asked: ``answer["content"].get(...)`` on a client
    that sent ``"content": [1]`` raises, and a task tool that raises fails its task with an
    internal error. This returns the content only when the answer is an object with ``action:
    "accept"`` and an object ``content`` (declined, cancelled and malformed answers are
    ``None``), so a tool can read its fields directly; their values still need checking.
    """
    if not isinstance(answer, Mapping) or answer.get("action") != "accept":
        return None
    content = answer.get("content")
    return content if isinstance(content, dict) else None


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def principal_digest(principal: Any) -> str:
    """A stable digest of the principal, so state sealed for one caller fails for another."""
    try:
        encoded = json.dumps(principal, sort_keys=True, default=repr)
    except (TypeError, ValueError):
        encoded = repr(principal)
    return hashlib.sha256(encoded.encode("utf-8")).hexdigest()[:32]


@attrs.define
class RequestStateSealer:
    """Seals and opens ``requestState`` with an HMAC key shared by every server process."""

    key: bytes
    ttl_seconds: float = 900.0
    clock: Callable[[], float] = time.time

    @classmethod
    def from_config(cls, key: str | bytes | None, ttl_seconds: float = 900.0) -> RequestStateSealer:
        if key is None:
            log.warning(
                "No request-state key configured: using a random per-process key. Servers "
                "behind a load balancer must share one (TRITASK_STATE_KEY or App(state_key=...))."
            )
            return cls(secrets.token_bytes(32), ttl_seconds)
        raw = key.encode("utf-8") if isinstance(key, str) else key
        if len(raw) < 16:
            raise ValueError("the request-state key must be at least 16 bytes")
        return cls(raw, ttl_seconds)

    def _sign(self, payload: bytes) -> bytes:
        return hmac.new(self.key, payload, hashlib.sha256).digest()

    def seal(self, state: JSONValue, *, method: str, name: str | None, principal: Any) -> str:
        body = {
            "s": state,
            "e": int(self.clock() + self.ttl_seconds),
            "m": method,
            "n": name,
            "p": principal_digest(principal),
        }
        payload = dumps(body).encode("utf-8")
        return _PREFIX + _b64(payload) + "." + _b64(self._sign(payload))

    def open(self, token: JSONValue, *, method: str, name: str | None, principal: Any) -> JSONValue:
        """The original state, or -32602 when the token is forged, expired or misplaced."""
        invalid = InvalidParams("requestState is invalid or has expired")
        if not isinstance(token, str) or not token.startswith(_PREFIX) or len(token) > 1_000_000:
            raise invalid
        try:
            encoded_payload, encoded_signature = token[len(_PREFIX) :].split(".")
            payload = _unb64(encoded_payload)
            signature = _unb64(encoded_signature)
        except ValueError:
            raise invalid from None
        if not hmac.compare_digest(signature, self._sign(payload)):
            raise invalid
        try:
            body = json.loads(payload)
        except ValueError:
            raise invalid from None
        if (
            not isinstance(body, dict)
            or body.get("m") != method
            or body.get("n") != name
            or body.get("p") != principal_digest(principal)
            or not isinstance(body.get("e"), int)
            or body["e"] < self.clock()
        ):
            raise invalid
        return body.get("s")
