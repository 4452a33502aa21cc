"""Client capability checks: a request may only rely on what it declared itself."""

from __future__ import annotations

from typing import Final

from tritask.jsonrpc import JSONValue
from tritask.protocol.errors import MissingRequiredClientCapability

INPUT_REQUEST_CAPABILITY: Final[dict[str, str]] = {
    "elicitation/create": "elicitation",
    "sampling/createMessage": "sampling",
    "roots/list": "roots",
}


def declared(capabilities: dict[str, JSONValue], name: str) -> bool:
    return isinstance(capabilities.get(name), dict)


def declared_extensions(capabilities: dict[str, JSONValue]) -> dict[str, JSONValue]:
    extensions = capabilities.get("extensions")
    if not isinstance(extensions, dict):
        return {}
    return {key: value for key, value in extensions.items() if isinstance(value, dict)}


def elicitation_modes(capabilities: dict[str, JSONValue]) -> frozenset[str]:
    """``elicitation: {}`` means form only; ``{form:{}, url:{}}`` names the modes."""
    value = capabilities.get("elicitation")
    if not isinstance(value, dict):
        return frozenset()
    modes = {mode for mode in ("form", "url") if isinstance(value.get(mode), dict)}
    return frozenset(modes or {"form"})


def require_input_request(
    capabilities: dict[str, JSONValue], request: dict[str, JSONValue]
) -> None:
    """Refuse an input request the client could not answer (never ask for undeclared ones)."""
    method = request.get("method")
    capability = INPUT_REQUEST_CAPABILITY.get(method) if isinstance(method, str) else None
    if capability is None:
        return
    if not declared(capabilities, capability):
        raise MissingRequiredClientCapability({capability: {}})
    if capability == "elicitation":
        params = request.get("params")
        mode = params.get("mode", "form") if isinstance(params, dict) else "form"
        if mode not in elicitation_modes(capabilities):
            raise MissingRequiredClientCapability({"elicitation": {str(mode): {}}})
