"""JWTVerifier against a loopback authorization server: every way a token can be wrong."""

from __future__ import annotations

import time

import pytest
import trio
import trio.testing

from auth.conftest import RESOURCE
from tritask.auth import InvalidToken, JWTVerifier, VerifierUnavailable
from tritask.testing.oauth import TestAuthorizationServer


def verifier_for(server: TestAuthorizationServer, **kwargs: object) -> JWTVerifier:
    return JWTVerifier(server.issuer, f"{server.issuer}/jwks", **kwargs)  # type: ignore[arg-type]


async def refused(verifier: JWTVerifier, token: str) -> str:
    with pytest.raises(InvalidToken) as caught:
        await verifier.verify(token, RESOURCE)
    return caught.value.description


async def test_a_good_token_gives_subject_client_scopes_and_claims(
    auth_server: TestAuthorizationServer,
) -> None:
    verifier = verifier_for(auth_server)
    token = auth_server.mint(sub="alice", client_id="cli", scope="mcp files:read", aud=RESOURCE)
    verified = await verifier.verify(token, RESOURCE)
    assert verified.subject == "alice"
    assert verified.client_id == "cli"
    assert verified.issuer == auth_server.issuer
    assert verified.scopes == frozenset({"mcp", "files:read"})
    assert verified.audience == (RESOURCE,)
    assert verified.claims["sub"] == "alice"
    assert verified.raw_token() == token
    assert token not in repr(verified)
    assert verified.detached().raw_token() is None
    assert verified.principal == {"iss": auth_server.issuer, "sub": "alice", "client_id": "cli"}


async def test_expiry_is_required_and_checked_with_leeway(
    auth_server: TestAuthorizationServer,
) -> None:
    verifier = verifier_for(auth_server, leeway_s=30)
    assert "expired" in await refused(verifier, auth_server.mint(aud=RESOURCE, exp_in=-31))
    within = await verifier.verify(auth_server.mint(aud=RESOURCE, exp_in=-10), RESOURCE)
    assert within.subject == "alice"
    assert "no expiry" in await refused(verifier, auth_server.mint(aud=RESOURCE, exp_in=None))
    strict = verifier_for(auth_server, leeway_s=0)
    assert "expired" in await refused(strict, auth_server.mint(aud=RESOURCE, exp_in=-2))


async def test_not_yet_valid_and_issued_in_the_future(
    auth_server: TestAuthorizationServer,
) -> None:
    verifier = verifier_for(auth_server, leeway_s=5)
    assert "not valid yet" in await refused(verifier, auth_server.mint(aud=RESOURCE, nbf_in=60))
    future_iat = auth_server.mint(aud=RESOURCE, extra={"iat": int(time.time()) + 600})
    assert "future" in await refused(verifier, future_iat)
    accepted = await verifier.verify(auth_server.mint(aud=RESOURCE, nbf_in=3), RESOURCE)
    assert accepted.subject == "alice"


async def test_issuer_must_match_exactly(auth_server: TestAuthorizationServer) -> None:
    verifier = verifier_for(auth_server)
    for other in ("https://evil.example", auth_server.issuer + "/", auth_server.issuer.upper()):
        assert "another issuer" in await refused(
            verifier, auth_server.mint(aud=RESOURCE, iss=other)
        )


async def test_audience_must_name_the_resource(auth_server: TestAuthorizationServer) -> None:
    verifier = verifier_for(auth_server)
    assert "not meant for this resource" in await refused(
        verifier, auth_server.mint(aud="https://other.example/mcp")
    )
    assert "no audience" in await refused(verifier, auth_server.mint(aud=None))
    assert "malformed" in await refused(verifier, auth_server.mint(aud=[]))
    listed = auth_server.mint(aud=["https://other.example", RESOURCE])
    assert (await verifier.verify(listed, RESOURCE)).audience == ("https://other.example", RESOURCE)
    # RFC 8707 comparison: scheme and host case, a trailing slash.
    relaxed = auth_server.mint(aud="HTTPS://MCP.Example.com/mcp/")
    assert (await verifier.verify(relaxed, RESOURCE)).subject == "alice"
    # An added audience is accepted besides the resource, never instead of it.
    extra = verifier_for(auth_server, audience=["api://tritask"])
    assert (await extra.verify(auth_server.mint(aud="api://tritask"), RESOURCE)).subject == "alice"
    assert (await extra.verify(auth_server.mint(aud=RESOURCE), RESOURCE)).subject == "alice"
    with pytest.raises(ValueError, match="never be empty"):
        verifier_for(auth_server, audience=[])


async def test_bad_signature(auth_server: TestAuthorizationServer) -> None:
    verifier = verifier_for(auth_server)
    token = auth_server.mint(aud=RESOURCE)
    head, payload, signature = token.split(".")
    flipped = signature[:-2] + ("AA" if signature[-2:] != "AA" else "BB")
    assert "signature" in await refused(verifier, f"{head}.{payload}.{flipped}")
    # A payload swapped under a valid signature.
    other = auth_server.mint(aud=RESOURCE, sub="mallory").split(".")[1]
    assert "signature" in await refused(verifier, f"{head}.{other}.{signature}")
    # Signed by a key with the same kid that the JWKS does not hold.
    impostor = TestAuthorizationServer.new_key(auth_server.signing_key.kid)
    assert "signature" in await refused(verifier, auth_server.mint(aud=RESOURCE, key=impostor))


async def test_alg_none_and_hmac_with_the_public_key_are_refused(
    auth_server: TestAuthorizationServer,
) -> None:
    verifier = verifier_for(auth_server)
    claims = auth_server.claims_for(aud=RESOURCE)
    none_token = TestAuthorizationServer.unsigned(claims, {"kid": auth_server.signing_key.kid})
    assert "algorithm" in await refused(verifier, none_token)
    assert "algorithm" in await refused(verifier, auth_server.hs256_with_public_key(claims))
    with pytest.raises(ValueError, match="never 'none' or HMAC"):
        verifier_for(auth_server, algorithms=["ES256", "HS256"])
    with pytest.raises(ValueError, match="never 'none' or HMAC"):
        verifier_for(auth_server, algorithms=["none"])
    # An allowed list without ES256 refuses an ES256 token before any key is used.
    rsa_only = verifier_for(auth_server, algorithms=["RS256"])
    assert "algorithm" in await refused(rsa_only, auth_server.mint(aud=RESOURCE))


async def test_cnf_crit_and_strict_typ(auth_server: TestAuthorizationServer) -> None:
    verifier = verifier_for(auth_server)
    bound = auth_server.mint(aud=RESOURCE, extra={"cnf": {"jkt": "abc"}})
    assert "cnf" in await refused(verifier, bound)
    head = {"alg": "ES256", "kid": auth_server.signing_key.kid, "crit": ["b64"], "b64": True}
    critical = auth_server.sign_raw(head, auth_server.claims_for(aud=RESOURCE))
    plain = {"alg": "ES256", "kid": auth_server.signing_key.kid}
    assert (
        await verifier.verify(
            auth_server.sign_raw(plain, auth_server.claims_for(aud=RESOURCE)), RESOURCE
        )
    ).subject == "alice"
    assert "critical" in await refused(verifier, critical)
    strict = verifier_for(auth_server, require_typ="at+jwt")
    assert (await strict.verify(auth_server.mint(aud=RESOURCE), RESOURCE)).subject == "alice"
    assert "typ" in await refused(strict, auth_server.mint(aud=RESOURCE, header={"typ": "JWT"}))


async def test_garbage_is_invalid_not_a_crash(auth_server: TestAuthorizationServer) -> None:
    verifier = verifier_for(auth_server)
    for garbage in ("abc", "a.b.c", "e30.e30.e30", "x" * 20_000, "eyJhbGciOiJFUzI1NiJ9.!!.x"):
        await refused(verifier, garbage)


async def test_jwks_is_fetched_once_for_concurrent_first_requests(
    auth_server: TestAuthorizationServer,
) -> None:
    verifier = verifier_for(auth_server)
    token = auth_server.mint(aud=RESOURCE)
    subjects: list[str | None] = []

    async def one() -> None:
        subjects.append((await verifier.verify(token, RESOURCE)).subject)

    async with trio.open_nursery() as nursery:
        for _ in range(20):
            nursery.start_soon(one)
    assert subjects == ["alice"] * 20
    assert auth_server.requests["/jwks"] == 1
    assert verifier.fetches == 1


async def test_unknown_kid_refetches_once_then_not_within_the_cooldown(
    auth_server: TestAuthorizationServer, mock_clock: trio.testing.MockClock
) -> None:
    verifier = verifier_for(auth_server, unknown_kid_refetch_cooldown_s=30, jwks_ttl_s=300)
    await verifier.verify(auth_server.mint(aud=RESOURCE), RESOURCE)
    assert auth_server.requests["/jwks"] == 1
    # Rotation: a token signed by the new key is accepted after one refetch.
    auth_server.rotate(keep_old=True)
    rotated = auth_server.mint(aud=RESOURCE)
    assert (await verifier.verify(rotated, RESOURCE)).subject == "alice"
    assert auth_server.requests["/jwks"] == 2
    # A kid nobody publishes: one refetch is already spent within the cooldown.
    stranger = TestAuthorizationServer.new_key("never-published")
    forged = auth_server.mint(aud=RESOURCE, key=stranger)
    for _ in range(5):
        assert "does not know" in await refused(verifier, forged)
    assert auth_server.requests["/jwks"] == 2
    mock_clock.jump(31)
    assert "does not know" in await refused(verifier, forged)
    assert auth_server.requests["/jwks"] == 3
    assert "does not know" in await refused(verifier, forged)
    assert auth_server.requests["/jwks"] == 3


async def test_jwks_down_keeps_cached_keys_and_without_any_is_unavailable(
    auth_server: TestAuthorizationServer, mock_clock: trio.testing.MockClock
) -> None:
    verifier = verifier_for(auth_server, jwks_ttl_s=60, unknown_kid_refetch_cooldown_s=10)
    token = auth_server.mint(aud=RESOURCE)
    await verifier.verify(token, RESOURCE)
    auth_server.jwks_down = True
    mock_clock.jump(61)  # past the TTL: a refresh is attempted and fails
    assert (await verifier.verify(token, RESOURCE)).subject == "alice"
    assert auth_server.requests["/jwks"] == 2
    # No retry before the cooldown, however many requests come.
    for _ in range(3):
        await verifier.verify(token, RESOURCE)
    assert auth_server.requests["/jwks"] == 2
    mock_clock.jump(11)
    await verifier.verify(token, RESOURCE)
    assert auth_server.requests["/jwks"] == 3
    auth_server.jwks_down = False
    mock_clock.jump(11)
    await verifier.verify(token, RESOURCE)
    assert auth_server.requests["/jwks"] == 4

    cold = verifier_for(auth_server, retry_after_s=7)
    auth_server.jwks_down = True
    with pytest.raises(VerifierUnavailable) as caught:
        await cold.verify(token, RESOURCE)
    assert caught.value.retry_after_s == 7


async def test_unreachable_jwks_endpoint_is_unavailable() -> None:
    from tritask.testing.oauth import free_port

    verifier = JWTVerifier("https://issuer.example", f"http://127.0.0.1:{free_port()}/jwks")
    with pytest.raises(VerifierUnavailable):
        await verifier.verify("a.b.c".replace("a", "eyJhbGciOiJFUzI1NiJ9"), RESOURCE)


async def test_identity_claims_that_are_not_strings_are_refused_not_dropped(
    auth_server: TestAuthorizationServer,
) -> None:
    # A sub that is present but not a non-empty string must not be dropped: the principal
    # would fall back to client_id, and every user of that client would share one principal
    # (the same as the client's own client-credentials tokens).
    verifier = verifier_for(auth_server)
    for bad_sub in (5, "", ["alice"], {"id": "alice"}, True):
        description = await refused(verifier, auth_server.mint(aud=RESOURCE, sub=bad_sub))  # type: ignore[arg-type]
        assert description == "The token's sub is not a non-empty string"
    for bad_client in (7, "", ["test-client"]):
        description = await refused(
            verifier,
            auth_server.mint(aud=RESOURCE, client_id=bad_client),  # type: ignore[arg-type]
        )
        assert description == "The token's client_id is not a non-empty string"
    azp = auth_server.mint(aud=RESOURCE, client_id=None, extra={"azp": 9})
    assert await refused(verifier, azp) == "The token's azp is not a non-empty string"
    # Absent claims are still fine: client-credentials tokens without sub, azp for client_id.
    no_sub = await verifier.verify(auth_server.mint(aud=RESOURCE, sub=None), RESOURCE)
    assert no_sub.principal == {
        "iss": auth_server.issuer,
        "sub": "test-client",
        "client_id": "test-client",
    }
    by_azp = auth_server.mint(aud=RESOURCE, client_id=None, extra={"azp": "web"})
    assert (await verifier.verify(by_azp, RESOURCE)).client_id == "web"


async def test_time_claims_must_be_finite_numbers(auth_server: TestAuthorizationServer) -> None:
    # json.loads reads NaN, Infinity and 1e400 (inf); comparisons with NaN are all false, so
    # a NaN nbf or exp would pass its check, and an infinite exp would never expire.
    verifier = verifier_for(auth_server)
    head = {"alg": "ES256", "kid": auth_server.signing_key.kid}
    for name in ("exp", "nbf", "iat"):
        for value in (float("nan"), float("inf"), float("-inf")):
            claims = auth_server.claims_for(aud=RESOURCE, **{name: value})
            description = await refused(verifier, auth_server.sign_raw(head, claims))
            assert description == f"The token's {name} is not a number", (name, value)
    finite = auth_server.claims_for(aud=RESOURCE, nbf=time.time() - 1.5)
    assert (await verifier.verify(auth_server.sign_raw(head, finite), RESOURCE)).subject == "alice"


def test_keys_and_introspection_only_over_https_except_on_loopback() -> None:
    # Keys fetched over plain HTTP can be replaced in transit (forged tokens verify), and the
    # introspection request carries the server's secret and the token.
    from tritask.auth import IntrospectionVerifier

    for url in ("http://as.example/jwks", "http://10.0.0.1/jwks", "ftp://as.example/jwks"):
        with pytest.raises(ValueError, match="must be https"):
            JWTVerifier("https://as.example", url)
        with pytest.raises(ValueError, match="must be https"):
            IntrospectionVerifier(url, "client", "secret")
    for url in ("https://as.example/jwks", "http://127.0.0.1:9/jwks", "http://localhost/j"):
        assert JWTVerifier("https://as.example", url).jwks_uri == url
        assert IntrospectionVerifier(url, "client", "secret").url == url
    assert JWTVerifier("https://as.example", "http://[::1]:8/jwks").jwks_uri.startswith("http")
