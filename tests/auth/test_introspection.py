"""IntrospectionVerifier (RFC 7662) against the loopback authorization server."""

from __future__ import annotations

import contextlib
import time

import pytest
import trio.testing

from auth.conftest import RESOURCE
from tritask.auth import IntrospectionVerifier, InvalidToken, VerifierUnavailable
from tritask.protocol.auth import AccessToken
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


# -- single flight: concurrent verifications of one token share one request --------------------


async def arrived(server: TestAuthorizationServer, count: int) -> None:
    """Until ``count`` introspection requests have reached the (gated) server and every other
    task is blocked: the verifications started so far are all waiting, none has an answer."""
    while server.requests["/introspect"] < count:
        await trio.testing.wait_all_tasks_blocked()
    await trio.testing.wait_all_tasks_blocked()


async def test_concurrent_verifications_of_one_token_share_one_request(
    auth_server: TestAuthorizationServer,
) -> None:
    verifier = verifier_for(auth_server)
    token = auth_server.issue_opaque(aud=RESOURCE, sub="carol", scope="mcp")
    other = auth_server.issue_opaque(aud=RESOURCE, sub="dave")
    gate = auth_server.introspection_gate = trio.Event()
    results: dict[int, AccessToken] = {}

    async def verify(n: int, value: str) -> None:
        results[n] = await verifier.verify(value, RESOURCE)

    async with trio.open_nursery() as nursery:
        for n in range(5):
            nursery.start_soon(verify, n, token)
        nursery.start_soon(verify, 5, other)  # another token: a request of its own
        await arrived(auth_server, 2)
        assert results == {}
        gate.set()
    assert [(results[n].subject, results[n].raw_token()) for n in range(6)] == [
        ("carol", token)
    ] * 5 + [("dave", other)]
    assert auth_server.requests["/introspect"] == verifier.requests == 2
    assert (await verifier.verify(token, RESOURCE)).scopes == frozenset({"mcp"})  # cached
    assert verifier.requests == 2


async def test_a_cancelled_waiter_leaves_the_others_their_answer(
    auth_server: TestAuthorizationServer,
) -> None:
    verifier = verifier_for(auth_server)
    token = auth_server.issue_opaque(aud=RESOURCE, sub="carol")
    gate = auth_server.introspection_gate = trio.Event()
    results: dict[int, str | None] = {}
    scopes = {n: trio.CancelScope() for n in range(4)}

    async def verify(n: int) -> None:
        results[n] = None
        with scopes[n]:
            results[n] = (await verifier.verify(token, RESOURCE)).subject

    async with trio.open_nursery() as nursery:
        nursery.start_soon(verify, 0)  # makes the request
        await arrived(auth_server, 1)
        for n in range(1, 4):
            nursery.start_soon(verify, n)
        await trio.testing.wait_all_tasks_blocked()
        scopes[2].cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert results == {n: None for n in range(4)}
        gate.set()
    assert results == {0: "carol", 1: "carol", 2: None, 3: "carol"}
    assert scopes[2].cancelled_caught
    assert auth_server.requests["/introspect"] == verifier.requests == 1


async def test_when_the_request_maker_is_cancelled_a_waiter_asks_again(
    auth_server: TestAuthorizationServer,
) -> None:
    """The request is its maker's: cancelled with it (at once, not shielded), and one of the
    waiters makes it again; the others wait for that one and get its answer."""
    verifier = verifier_for(auth_server)
    token = auth_server.issue_opaque(aud=RESOURCE, sub="carol")
    gate = auth_server.introspection_gate = trio.Event()
    results: dict[int, str | None] = {}
    maker = trio.CancelScope()

    async def verify(n: int) -> None:
        results[n] = None
        with maker if n == 0 else contextlib.nullcontext():
            results[n] = (await verifier.verify(token, RESOURCE)).subject

    async with trio.open_nursery() as nursery:
        nursery.start_soon(verify, 0)
        await arrived(auth_server, 1)
        for n in range(1, 4):
            nursery.start_soon(verify, n)
        await trio.testing.wait_all_tasks_blocked()
        maker.cancel()
        await arrived(auth_server, 2)  # the maker is gone; one waiter asks again
        assert maker.cancelled_caught and results == {n: None for n in range(4)}
        gate.set()
    assert results == {0: None, 1: "carol", 2: "carol", 3: "carol"}
    assert auth_server.requests["/introspect"] == verifier.requests == 2


async def test_a_failed_request_fails_every_waiter_and_is_not_cached(
    auth_server: TestAuthorizationServer,
) -> None:
    token = auth_server.issue_opaque(aud=RESOURCE)
    wrong = IntrospectionVerifier(f"{auth_server.issuer}/introspect", "test-client", "nope")
    verifier = verifier_for(auth_server)
    gate = auth_server.introspection_gate = trio.Event()
    errors: list[Exception] = []

    async def verify(which: IntrospectionVerifier, value: str) -> None:
        try:
            await which.verify(value, RESOURCE)
        except (VerifierUnavailable, InvalidToken) as error:
            errors.append(error)

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(verify, wrong, token)  # refused credentials: 401
        for _ in range(3):
            nursery.start_soon(verify, verifier, "unknown-token")  # active: false
        await arrived(auth_server, 2)
        gate.set()
    assert (
        sorted(type(error).__name__ for error in errors)
        == ["InvalidToken"] * 3 + ["VerifierUnavailable"] * 3
    )
    assert all("not active" in str(error) for error in errors if isinstance(error, InvalidToken))
    assert (wrong.requests, verifier.requests) == (1, 1)
    auth_server.introspection_gate = None
    with pytest.raises(VerifierUnavailable):
        await wrong.verify(token, RESOURCE)
    with pytest.raises(InvalidToken, match="not active"):
        await verifier.verify("unknown-token", RESOURCE)
    assert (wrong.requests, verifier.requests) == (2, 2)


async def test_waiters_for_other_resources_check_the_shared_answer_themselves(
    auth_server: TestAuthorizationServer,
) -> None:
    verifier = verifier_for(auth_server)
    token = auth_server.issue_opaque(aud=RESOURCE, sub="carol")
    gate = auth_server.introspection_gate = trio.Event()
    outcomes: dict[str, str] = {}

    async def verify(resource: str) -> None:
        try:
            outcomes[resource] = (await verifier.verify(token, resource)).subject or ""
        except InvalidToken as error:
            outcomes[resource] = str(error)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(verify, "https://other.example/mcp")  # makes the request
        await arrived(auth_server, 1)
        nursery.start_soon(verify, RESOURCE)
        await trio.testing.wait_all_tasks_blocked()
        gate.set()
    assert outcomes == {
        "https://other.example/mcp": "The token is not meant for this resource (aud)",
        RESOURCE: "carol",
    }
    assert verifier.requests == 1
    # The accepted verification cached it (the refused one could not): no request now.
    assert (await verifier.verify(token, RESOURCE)).subject == "carol"
    with pytest.raises(InvalidToken, match="not meant for this resource"):
        await verifier.verify(token, "https://other.example/mcp")
    assert verifier.requests == 1
