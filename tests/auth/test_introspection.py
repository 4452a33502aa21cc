"""IntrospectionVerifier (RFC 7662) against the loopback authorization server."""

from __future__ import annotations

import time

import pytest
import trio.testing

from auth.conftest import RESOURCE
from tritask.auth import IntrospectionVerifier, InvalidToken, VerifierUnavailable
from tritask.testing.oauth import TestAuthorizationServer, free_port


def verifier_for(server: TestAuthorizationServer, **kwargs: object) -> IntrospectionVerifier:
    return IntrospectionVerifier(
        f"{server.issuer}/introspect",
        "test-client",
        "test-secret",
        **kwargs,  # type: ignore[arg-type]
    )


async def test_an_active_token_for_this_resource(auth_server: TestAuthorizationServer) -> None:
    verifier = verifier_for(auth_server, issuer=auth_server.issuer)
    token = auth_server.issue_opaque(aud=RESOURCE, sub="carol", scope="mcp files:read")
    verified = await verifier.verify(token, RESOURCE)
    assert (verified.subject, verified.client_id) == ("carol", "test-client")
    assert verified.scopes == frozenset({"mcp", "files:read"})
    assert verified.raw_token() == token
    post = verifier_for(auth_server, auth_method="client_secret_post")
    assert (await post.verify(token, RESOURCE)).subject == "carol"


async def test_inactive_foreign_and_expired_tokens_are_refused(
    auth_server: TestAuthorizationServer,
) -> None:
    verifier = verifier_for(auth_server, issuer=auth_server.issuer)
    cases = {
        "unknown-token": "The token is not active",
        auth_server.issue_opaque(aud="https://other.example/mcp"): "not meant for this resource",
        auth_server.issue_opaque(aud=None): "no audience",
        auth_server.issue_opaque(aud=RESOURCE, iss="https://evil.example"): "another issuer",
        auth_server.issue_opaque(aud=RESOURCE, exp=None): "no expiry",
        auth_server.issue_opaque(aud=RESOURCE, cnf={"jkt": "x"}): "cnf",
    }
    for token, expected in cases.items():
        with pytest.raises(InvalidToken, match=expected):
            await verifier.verify(token, RESOURCE)
    revoked = auth_server.issue_opaque(aud=RESOURCE)
    auth_server.revoked.add(revoked)
    with pytest.raises(InvalidToken, match="not active"):
        await verifier.verify(revoked, RESOURCE)


async def test_the_cache_is_bounded_by_the_ttl_and_by_exp(
    auth_server: TestAuthorizationServer, mock_clock: trio.testing.MockClock
) -> None:
    wall = [time.time()]
    verifier = verifier_for(auth_server, cache_ttl_s=60, leeway_s=0, clock=lambda: wall[0])
    token = auth_server.issue_opaque(aud=RESOURCE, exp=int(wall[0]) + 30)
    for _ in range(3):
        assert (await verifier.verify(token, RESOURCE)).raw_token() == token
    assert verifier.requests == 1
    assert auth_server.requests["/introspect"] == 1
    # Past the token's exp (before the TTL): the cache no longer vouches for it.
    wall[0] += 31
    with pytest.raises(InvalidToken):
        await verifier.verify(token, RESOURCE)
    assert verifier.requests == 2
    # A long-lived token: cached until the TTL, then asked again (revocation shows).
    wall[0] = time.time()
    lasting = auth_server.issue_opaque(aud=RESOURCE, exp=int(wall[0]) + 3600)
    await verifier.verify(lasting, RESOURCE)
    auth_server.revoked.add(lasting)
    await verifier.verify(lasting, RESOURCE)
    assert verifier.requests == 3
    mock_clock.jump(61)
    with pytest.raises(InvalidToken, match="not active"):
        await verifier.verify(lasting, RESOURCE)
    # Refused tokens are not cached.
    with pytest.raises(InvalidToken):
        await verifier.verify(lasting, RESOURCE)
    assert verifier.requests == 5


async def test_wrong_credentials_or_a_dead_endpoint_are_unavailable(
    auth_server: TestAuthorizationServer,
) -> None:
    token = auth_server.issue_opaque(aud=RESOURCE)
    wrong = IntrospectionVerifier(f"{auth_server.issuer}/introspect", "test-client", "nope")
    with pytest.raises(VerifierUnavailable):
        await wrong.verify(token, RESOURCE)
    dead = IntrospectionVerifier(f"http://127.0.0.1:{free_port()}/introspect", "c", "s")
    with pytest.raises(VerifierUnavailable) as caught:
        await dead.verify(token, RESOURCE)
    assert caught.value.retry_after_s == 5
    assert "nope" not in repr(wrong)


async def test_a_cached_answer_is_checked_against_the_resource_asking(
    auth_server: TestAuthorizationServer,
) -> None:
    # One verifier may serve several resources (two BearerAuth, two endpoints): a token
    # cached while verified for one must not pass for another without its audience check.
    verifier = verifier_for(auth_server)
    token = auth_server.issue_opaque(aud=RESOURCE)
    assert (await verifier.verify(token, RESOURCE)).subject == "alice"
    with pytest.raises(InvalidToken, match="not meant for this resource"):
        await verifier.verify(token, "https://other.example/mcp")
    assert (await verifier.verify(token, RESOURCE)).subject == "alice"
    assert verifier.requests == 1
