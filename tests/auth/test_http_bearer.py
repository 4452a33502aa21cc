"""HTTP behaviour of BearerAuth exactly as RFC 6750, RFC 9728 and the MCP spec say."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from auth.oauth_app import Endpoint, Probe, call, rpc, serve_protected
from tritask.auth import BearerAuth, JWTVerifier
from tritask.testing.oauth import TestAuthorizationServer


def challenge(response: Any) -> str:
    value: str = response.headers["www-authenticate"]
    return value


def assert_error(response: Any, status: int, request_id: Any = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.headers["cache-control"] == "no-store"
    payload: dict[str, Any] = response.json()
    assert payload["error"]["code"] == -32600
    assert payload["id"] == request_id
    return payload


@pytest.fixture
async def endpoint(auth_server: TestAuthorizationServer) -> Any:
    async with serve_protected(auth_server) as served:
        yield served


def token(server: TestAuthorizationServer, endpoint: Endpoint, **claims: Any) -> str:
    claims.setdefault("aud", endpoint.resource)
    return server.mint(**claims)


async def test_protected_resource_metadata(
    endpoint: Endpoint, auth_server: TestAuthorizationServer
) -> None:
    response = await endpoint.client.get(endpoint.metadata_url)
    assert response.status_code == 200
    assert response.json() == {
        "resource": endpoint.resource,
        "authorization_servers": [auth_server.issuer],
        "bearer_methods_supported": ["header"],
        "scopes_supported": ["mcp"],
    }
    assert response.headers["access-control-allow-origin"] == "*"
    # Built from configuration, never from the Host the client sent.
    spoofed = await endpoint.client.get(endpoint.metadata_url, headers={"host": "evil.example"})
    assert spoofed.json()["resource"] == endpoint.resource
    head = await endpoint.client.head(endpoint.metadata_url)
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-length"] == str(len(response.content))
    options = await endpoint.client.options(
        endpoint.metadata_url,
        headers={"origin": "https://app.example", "access-control-request-method": "GET"},
    )
    assert options.status_code == 204
    assert options.headers["access-control-allow-origin"] == "*"
    assert "GET" in options.headers["access-control-allow-methods"]
    posted = await endpoint.client.post(endpoint.metadata_url, content=b"{}")
    assert posted.status_code == 405
    assert posted.headers["allow"] == "GET, HEAD, OPTIONS"
    # The root form belongs to an endpoint at "/" only.
    root = await endpoint.client.get(endpoint.base + "/.well-known/oauth-protected-resource")
    assert root.status_code == 404


async def test_root_form_when_the_endpoint_is_the_root(
    auth_server: TestAuthorizationServer,
) -> None:
    async with serve_protected(auth_server, path="/") as served:
        response = await served.client.get(served.base + "/.well-known/oauth-protected-resource")
        assert response.status_code == 200
        assert response.json()["resource"] == served.base + "/"
        refused = await served.post(rpc("server/discover"))
        assert challenge(refused) == (
            f'Bearer resource_metadata="{served.base}/.well-known/oauth-protected-resource", '
            'scope="mcp"'
        )


def test_offline_access_is_never_advertised() -> None:
    verifier = JWTVerifier("https://as.example", "https://as.example/jwks")
    for key in ("scopes_supported", "required_scopes"):
        with pytest.raises(ValueError, match="offline_access"):
            BearerAuth(
                resource="https://mcp.example/mcp",
                authorization_servers=["https://as.example"],
                verifier=verifier,
                **{key: ["mcp", "offline_access"]},  # type: ignore[arg-type]
            )
    with pytest.raises(ValueError, match="at least one authorization server"):
        BearerAuth(resource="https://mcp.example/mcp", authorization_servers=[], verifier=verifier)


def test_a_resource_that_cannot_go_into_a_challenge_is_refused_at_configuration() -> None:
    # The resource's metadata URL is quoted in every WWW-Authenticate header: non-ASCII would
    # fail every refusal (the header is ASCII), a quote or backslash would break the quoting.
    verifier = JWTVerifier("https://as.example", "https://as.example/jwks")
    for resource in (
        "https://mcp.exämple.com/mcp",
        'https://mcp.example/m"cp',
        "https://mcp.example/m\\cp",
        "https://mcp.example/m cp",
    ):
        with pytest.raises(ValueError, match="printable ASCII"):
            BearerAuth(
                resource=resource, authorization_servers=["https://as.example"], verifier=verifier
            )


async def test_no_token_is_401_without_an_error_code(endpoint: Endpoint) -> None:
    metadata = endpoint.metadata_url
    response = await endpoint.post(rpc("server/discover"))
    payload = assert_error(response, 401, 1)
    assert challenge(response) == f'Bearer resource_metadata="{metadata}", scope="mcp"'
    assert "error" not in payload["error"]["data"]
    # Naming a tool (Mcp-Name, or the body when the header is absent): its scopes too.
    named = await endpoint.post(call("write", {"path": "a"}))
    assert challenge(named) == f'Bearer resource_metadata="{metadata}", scope="files:write mcp"'
    legacy = await endpoint.post(call("sign", {"path": "a"}), modern=False)
    assert challenge(legacy) == (
        f'Bearer resource_metadata="{metadata}", scope="files:sign files:write mcp"'
    )
    # Another scheme is no bearer token at all.
    basic = await endpoint.post(rpc("server/discover"), headers={"authorization": "Basic YTpi"})
    assert_error(basic, 401, 1)
    assert challenge(basic) == f'Bearer resource_metadata="{metadata}", scope="mcp"'
    # Notifications are authenticated too.
    note = await endpoint.post(rpc("notifications/cancelled", {"requestId": 1}, request_id=None))
    assert note.status_code == 401


@pytest.mark.parametrize(
    ("case", "description"),
    [
        ("expired", "The token has expired"),
        ("not_yet_valid", "The token is not valid yet (nbf)"),
        ("wrong_issuer", "The token was issued by another issuer (iss)"),
        ("wrong_audience", "The token is not meant for this resource (aud)"),
        ("missing_audience", "The token has no audience (aud); it must name this resource"),
        ("bad_signature", "The token's signature is invalid"),
        ("alg_none", "The token's signing algorithm is not accepted"),
        ("hs256_public_key", "The token's signing algorithm is not accepted"),
        ("unknown_kid", "The token is signed by a key this server does not know (kid)"),
        ("no_subject", "The token names neither a subject nor a client"),
    ],
)
async def test_bad_tokens_are_401_invalid_token(
    endpoint: Endpoint, auth_server: TestAuthorizationServer, case: str, description: str
) -> None:
    aud = endpoint.resource
    good = auth_server.claims_for(aud=aud)
    bad = {
        "expired": lambda: auth_server.mint(aud=aud, exp_in=-120),
        "not_yet_valid": lambda: auth_server.mint(aud=aud, nbf_in=600),
        "wrong_issuer": lambda: auth_server.mint(aud=aud, iss="https://evil.example"),
        "wrong_audience": lambda: auth_server.mint(aud="https://other.example/mcp"),
        "missing_audience": lambda: auth_server.mint(aud=None),
        "bad_signature": lambda: auth_server.mint(
            aud=aud, key=TestAuthorizationServer.new_key(auth_server.signing_key.kid)
        ),
        "alg_none": lambda: TestAuthorizationServer.unsigned(good),
        "hs256_public_key": lambda: auth_server.hs256_with_public_key(good),
        "unknown_kid": lambda: auth_server.mint(aud=aud, key=TestAuthorizationServer.new_key()),
        "no_subject": lambda: auth_server.mint(aud=aud, sub=None, client_id=None),
    }[case]()
    response = await endpoint.post(rpc("server/discover", request_id=7), bad)
    payload = assert_error(response, 401, 7)
    assert challenge(response) == (
        f'Bearer error="invalid_token", scope="mcp", '
        f'resource_metadata="{endpoint.metadata_url}", error_description="{description}"'
    )
    assert payload["error"]["data"]["error"] == "invalid_token"
    assert payload["error"]["data"]["error_description"] == description


async def test_malformed_credentials_are_400(
    endpoint: Endpoint, auth_server: TestAuthorizationServer
) -> None:
    good = token(auth_server, endpoint)
    cases: list[tuple[list[tuple[str, str]], str, str]] = [
        (
            [("authorization", f"Bearer {good}"), ("authorization", f"Bearer {good}")],
            "",
            "More than one Authorization header",
        ),
        ([("authorization", "Bearer")], "", "The bearer token is empty"),
        ([("authorization", "Bearer a b")], "", "The bearer token is malformed"),
        ([("authorization", 'Bearer a"b')], "", "The bearer token is malformed"),
        (
            [("authorization", f"Bearer {good}")],
            f"?access_token={good}",
            "Send the token in the Authorization header, not the URL",
        ),
    ]
    for headers, query, description in cases:
        sent = [
            ("content-type", "application/json"),
            ("accept", "application/json, text/event-stream"),
            *headers,
        ]
        response = await endpoint.client.post(
            endpoint.url + query, content=b'{"jsonrpc":"2.0","id":1,"method":"ping"}', headers=sent
        )
        assert_error(response, 400, 1)
        assert challenge(response) == (
            f'Bearer error="invalid_request", scope="mcp", '
            f'resource_metadata="{endpoint.metadata_url}", error_description="{description}"'
        ), description


async def test_no_keys_at_all_is_503_with_retry_after(
    auth_server: TestAuthorizationServer,
) -> None:
    auth_server.jwks_down = True
    async with serve_protected(auth_server) as served:
        response = await served.post(rpc("server/discover"), token(auth_server, served))
        assert response.status_code == 503
        assert response.headers["retry-after"] == "5"
        assert "www-authenticate" not in response.headers
        assert response.json()["error"]["data"]["error"] == "temporarily_unavailable"
        auth_server.jwks_down = False
        # The next fetch is not held back by the failure (the cooldown applies to refreshes).
        ok = await served.post(rpc("server/discover"), token(auth_server, served))
        assert ok.status_code == 200, ok.text


async def test_missing_scope_is_403_naming_every_scope_needed(
    endpoint: Endpoint, auth_server: TestAuthorizationServer, probe: Probe
) -> None:
    # Without the server-wide scope: 403, and the tool's scopes in the same challenge.
    no_mcp = token(auth_server, endpoint, scope="files:write")
    response = await endpoint.post(call("sign", {"path": "x"}, request_id=3), no_mcp)
    payload = assert_error(response, 403, 3)
    assert challenge(response) == (
        f'Bearer error="insufficient_scope", scope="files:sign files:write mcp", '
        f'resource_metadata="{endpoint.metadata_url}", '
        'error_description="The token lacks a scope this server requires"'
    )
    assert payload["error"]["data"]["scope"] == "files:sign files:write mcp"
    # With it, but short of the tool's: 403 before the tool runs.
    mcp_only = token(auth_server, endpoint, scope="mcp")
    refused = await endpoint.post(call("write", {"path": "x"}, request_id=4), mcp_only)
    assert_error(refused, 403, 4)
    assert challenge(refused) == (
        f'Bearer error="insufficient_scope", scope="files:write mcp", '
        f'resource_metadata="{endpoint.metadata_url}", '
        'error_description="The access token lacks a scope this operation needs"'
    )
    assert probe.writes == []
    partial = token(auth_server, endpoint, scope="mcp files:write")
    refused = await endpoint.post(call("sign", {"path": "x"}), partial)
    assert 'scope="files:sign files:write mcp"' in challenge(refused)
    # tools/list is not filtered: the client must see what it could step up to.
    listed = await endpoint.post(rpc("tools/list"), mcp_only)
    assert listed.status_code == 200
    names = {tool["name"] for tool in listed.json()["result"]["tools"]}
    assert {"write", "sign", "whoami"} <= names


@pytest.fixture
def probe() -> Probe:
    return Probe()


async def test_broader_scope_is_accepted_and_ctx_auth_is_the_token(
    auth_server: TestAuthorizationServer, probe: Probe
) -> None:
    async with serve_protected(auth_server, probe) as served:
        admin = token(auth_server, served, scope="mcp files:admin", sub="bob", client_id="cli")
        response = await served.post(call("write", {"path": "notes"}), admin)
        assert response.status_code == 200, response.text
        assert response.json()["result"]["content"][0]["text"] == "wrote notes"
        assert probe.writes == ["notes"]
        who = await served.post(call("whoami"), admin)
        structured = who.json()["result"]["structuredContent"]
        assert structured["subject"] == "bob"
        assert structured["client_id"] == "cli"
        assert structured["scopes"] == ["files:admin", "mcp"]
        assert structured["principal"] == {
            "iss": auth_server.issuer,
            "sub": "bob",
            "client_id": "cli",
        }


async def test_legacy_sessions_are_protected_the_same_way(
    endpoint: Endpoint, auth_server: TestAuthorizationServer
) -> None:
    initialize = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-11-25",
            "capabilities": {},
            "clientInfo": {"name": "t", "version": "1"},
        },
    }
    refused = await endpoint.post(initialize, modern=False)
    assert_error(refused, 401, 1)
    assert challenge(refused) == f'Bearer resource_metadata="{endpoint.metadata_url}", scope="mcp"'
    alice = token(auth_server, endpoint, scope="mcp")
    opened = await endpoint.post(initialize, alice, modern=False)
    assert opened.status_code == 200, opened.text
    session = {
        "mcp-session-id": opened.headers["mcp-session-id"],
        "mcp-protocol-version": "2025-11-25",
    }
    tools_call = {
        "jsonrpc": "2.0",
        "id": 2,
        "method": "tools/call",
        "params": {"name": "write", "arguments": {"path": "p"}},
    }
    forbidden = await endpoint.post(tools_call, alice, modern=False, headers=session)
    assert_error(forbidden, 403, 2)
    assert 'error="insufficient_scope", scope="files:write mcp"' in challenge(forbidden)
    # A refreshed token with more scope, same principal: same session, the call runs.
    stepped = token(auth_server, endpoint, scope="mcp files:write")
    done = await endpoint.post(tools_call, stepped, modern=False, headers=session)
    assert done.status_code == 200
    assert "wrote p" in done.text
    # Another subject cannot use the session; without a token: 401; GET and DELETE as well.
    bob = token(auth_server, endpoint, sub="bob", scope="mcp files:write")
    assert (await endpoint.post(tools_call, bob, modern=False, headers=session)).status_code == 404
    assert (await endpoint.post(tools_call, None, modern=False, headers=session)).status_code == 401
    get = await endpoint.client.get(
        endpoint.url, headers={**session, "accept": "text/event-stream"}
    )
    assert get.status_code == 401
    delete = await endpoint.client.delete(
        endpoint.url, headers={**session, "authorization": f"Bearer {bob}"}
    )
    assert delete.status_code == 404
    delete = await endpoint.client.delete(
        endpoint.url, headers={**session, "authorization": f"Bearer {alice}"}
    )
    assert delete.status_code == 200


async def test_the_raw_token_never_reaches_the_logs(
    auth_server: TestAuthorizationServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with serve_protected(auth_server) as served:
        good = token(auth_server, served, scope="mcp files:write")
        expired = token(auth_server, served, exp_in=-300)
        await served.post(call("write", {"path": "x"}), good)
        await served.post(call("whoami"), expired)
        await served.post(rpc("server/discover"), "not-a-jwt")
        auth_server.jwks_down = True
        auth_server.rotate()
        await served.post(call("whoami"), token(auth_server, served))
    text = "\n".join(record.getMessage() + repr(record.args) for record in caplog.records)
    assert caplog.records  # something was logged (the JWKS fetches at least)
    for secret in (good, expired, "not-a-jwt"):
        assert secret not in text
        assert secret.split(".")[-1] not in text


class _BrokenVerifier:
    def __init__(self) -> None:
        self.seen: list[str] = []

    async def verify(self, token: str, resource: str) -> Any:
        self.seen.append(token)
        raise RuntimeError(f"bug while looking at {token}")


async def test_a_failing_verifier_fails_closed_without_logging_the_token(
    caplog: pytest.LogCaptureFixture,
) -> None:
    auth = BearerAuth(
        resource="https://mcp.example/mcp",
        authorization_servers=["https://as.example"],
        verifier=_BrokenVerifier(),
    )
    from tritask.auth import Refusal

    caplog.set_level(logging.DEBUG)
    token = "eyJhbGciOiJFUzI1NiJ9.eyJzdWIiOiJhIn0.c2lnbmF0dXJlLXNpZ25hdHVyZQ"
    with pytest.raises(Refusal) as refused:
        await auth.authenticate([f"Bearer {token}"])
    assert (refused.value.kind, refused.value.status) == ("unavailable", 503)
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert "the token verifier raised RuntimeError: bug while looking at [redacted]" in logged
    for part in token.split("."):
        assert part not in logged


async def test_app_auth_is_used_and_exclusive_with_authenticate(
    auth_server: TestAuthorizationServer,
) -> None:
    import functools

    import httpx
    import trio

    from auth.oauth_app import build_app
    from tritask.testing.oauth import free_port
    from tritask.transports.http import HttpOptions, HttpTransport, serve_http

    port = free_port()
    resource = f"http://127.0.0.1:{port}/mcp"
    auth = BearerAuth(
        resource=resource,
        authorization_servers=[auth_server.issuer],
        verifier=JWTVerifier(auth_server.issuer, f"{auth_server.issuer}/jwks"),
    )
    app = build_app(Probe(), auth=auth)

    async def anyone(headers: Any) -> str:
        return "anyone"

    with pytest.raises(ValueError, match="either authenticate= or auth="):
        HttpTransport(app, HttpOptions(authenticate=anyone))
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(serve_http, app, "127.0.0.1", port))
        async with httpx.AsyncClient() as client:
            refused = await client.post(
                resource,
                content=b'{"jsonrpc":"2.0","id":1,"method":"ping"}',
                headers={
                    "content-type": "application/json",
                    "accept": "application/json, text/event-stream",
                },
            )
            assert refused.status_code == 401
            assert refused.headers["www-authenticate"].startswith('Bearer resource_metadata="')
        nursery.cancel_scope.cancel()


async def test_an_app_with_auth_is_never_served_unprotected_over_websocket(
    auth_server: TestAuthorizationServer,
) -> None:
    # WebSocket has no bearer tokens: serving App(auth=...) there would run every tool, those
    # with required_scopes included, for anyone who connects (ctx.auth is None: no checks).
    import trio

    from auth.oauth_app import build_app
    from tritask.transports.websocket import serve_websocket

    auth = BearerAuth(
        resource="https://mcp.example.com/mcp",
        authorization_servers=[auth_server.issuer],
        verifier=JWTVerifier(auth_server.issuer, f"{auth_server.issuer}/jwks"),
    )
    app = build_app(Probe(), auth=auth)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            with pytest.raises(ValueError, match="WebSocket cannot serve an app with auth="):
                await nursery.start(serve_websocket, app, "127.0.0.1", 0)
            nursery.cancel_scope.cancel()
