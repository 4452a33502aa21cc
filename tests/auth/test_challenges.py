"""The pure rules of tritask.protocol.auth: challenges, descriptions, scopes, URLs, principal."""

from __future__ import annotations

import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tritask.client.oauth import parse_bearer_challenge
from tritask.protocol.auth import (
    AccessToken,
    ScopeHierarchy,
    canonical_resource,
    challenge,
    principal_of,
    prm_url,
    sanitize_description,
)

SCOPE = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters='"\\'),
    min_size=1,
    max_size=12,
)
ALLOWED = set(string.printable[:95]) - set('"\\=')


@given(st.text(max_size=400))
def test_descriptions_keep_to_the_rfc_6750_characters(text: str) -> None:
    clean = sanitize_description(text)
    assert set(clean) <= ALLOWED
    assert clean == clean.strip() and "  " not in clean
    assert len(clean) <= 256


@given(
    st.sets(SCOPE, max_size=6),
    st.sampled_from([None, "invalid_token", "invalid_request", "insufficient_scope"]),
    st.text(max_size=100),
)
def test_challenges_parse_back_to_what_was_meant(
    scopes: set[str], error: str | None, description: str
) -> None:
    value = challenge(
        resource_metadata="https://h.example/.well-known/oauth-protected-resource/mcp",
        scopes=scopes,
        error=error,
        description=description,
    )
    assert value.isascii()
    params = parse_bearer_challenge(value)
    assert params is not None
    assert params["resource_metadata"] == (
        "https://h.example/.well-known/oauth-protected-resource/mcp"
    )
    expected_scopes = sorted(scopes - {"offline_access"})
    assert params.get("scope", "").split() == expected_scopes
    assert params.get("error") == error
    if error is None:
        assert "error_description" not in params
    elif sanitize_description(description):
        assert params["error_description"] == sanitize_description(description)
        assert value.endswith(f'error_description="{sanitize_description(description)}"')


@given(st.text(max_size=300))
def test_the_client_parser_never_raises(value: str) -> None:
    parsed = parse_bearer_challenge(value)
    assert parsed is None or isinstance(parsed, dict)


def test_offline_access_never_appears_in_a_challenge() -> None:
    value = challenge(resource_metadata="https://h/x", scopes={"mcp", "offline_access"})
    assert value == 'Bearer resource_metadata="https://h/x", scope="mcp"'


def test_scope_hierarchies_are_transitive_and_checked() -> None:
    hierarchy = ScopeHierarchy.of({"admin": ["write"], "write": ["read"]})
    assert hierarchy.closure({"admin"}) == {"admin", "write", "read"}
    assert hierarchy.closure({"read"}) == {"read"}
    token = AccessToken(subject="a", client_id="c", issuer="i", scopes=frozenset({"admin"}))
    assert not token.has_scopes({"read"})
    assert token.with_hierarchy(hierarchy).has_scopes({"read", "write", "admin"})
    with pytest.raises(ValueError, match="not a valid OAuth scope token"):
        ScopeHierarchy.of({"admin": ["has space"]})
    with pytest.raises(TypeError, match="not one string"):
        ScopeHierarchy.of({"admin": "write"})


def test_well_known_urls_and_canonical_resources() -> None:
    assert prm_url("https://h.example/mcp") == (
        "https://h.example/.well-known/oauth-protected-resource/mcp"
    )
    assert prm_url("https://h.example/") == "https://h.example/.well-known/oauth-protected-resource"
    assert prm_url("https://h.example") == "https://h.example/.well-known/oauth-protected-resource"
    assert prm_url("https://h.example:8443/a/b/") == (
        "https://h.example:8443/.well-known/oauth-protected-resource/a/b"
    )
    assert canonical_resource("HTTPS://H.Example/MCP/") == "https://h.example/MCP"
    assert canonical_resource("https://h.example/") == canonical_resource("https://h.example")


def test_the_principal_triple() -> None:
    both = AccessToken(subject="alice", client_id="cli", issuer="https://i")
    assert principal_of(both) == {"iss": "https://i", "sub": "alice", "client_id": "cli"}
    machine = AccessToken(subject=None, client_id="svc", issuer="https://i")
    assert principal_of(machine) == {"iss": "https://i", "sub": "svc", "client_id": "svc"}
    nobody = AccessToken(subject=None, client_id=None, issuer="https://i")
    assert principal_of(nobody) is None
    with pytest.raises(ValueError, match="no principal"):
        _ = nobody.principal
    raw = AccessToken(subject="a", client_id=None, issuer=None, raw="secret-token")
    assert "secret-token" not in repr(raw)
    assert raw == raw.detached()
