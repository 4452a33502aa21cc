"""The tritask client with OAuth: a static bearer token, the client-credentials grant found
from the server's 401, and a 403 step-up."""

from __future__ import annotations

import re
from typing import Any

import pytest

from auth.oauth_app import Probe, serve_protected
from tritask.client import ClientCredentials, OAuthError, connect
from tritask.client.errors import InvalidRequestError
from tritask.client.oauth import parse_bearer_challenge
from tritask.testing.oauth import TestAuthorizationServer, running_authorization_server


def test_challenge_parsing() -> None:
    value = (
        'Bearer error="insufficient_scope", scope="files:write mcp", '
        'resource_metadata="https://h/.well-known/oauth-protected-resource/mcp", '
        'error_description="The token lacks a scope"'
    )
    assert parse_bearer_challenge(value) == {
        "error": "insufficient_scope",
        "scope": "files:write mcp",
        "resource_metadata": "https://h/.well-known/oauth-protected-resource/mcp",
        "error_description": "The token lacks a scope",
    }
    assert parse_bearer_challenge('Basic realm="x"') is None
    assert parse_bearer_challenge(None) is None
    assert parse_bearer_challenge('DPoP algs="ES256", Bearer scope=mcp') == {"scope": "mcp"}


async def test_a_static_bearer_token(auth_server: TestAuthorizationServer) -> None:
    async with serve_protected(auth_server) as endpoint:
        token = auth_server.mint(aud=endpoint.resource, scope="mcp", sub="dora")
        async with connect(endpoint.url, auth=f"Bearer {token}") as client:
            result = await client.call_tool("whoami", {})
            assert result.structured_content is not None
            assert result.structured_content["subject"] == "dora"
        with pytest.raises(InvalidRequestError, match="Unauthorized: A bearer token is required"):
            async with connect(endpoint.url) as client:
                pass


async def test_client_credentials_discovery_call_and_step_up(
    auth_server: TestAuthorizationServer,
) -> None:
    probe = Probe()
    async with serve_protected(auth_server, probe) as endpoint:
        credentials = ClientCredentials("test-client", "test-secret")
        async with connect(endpoint.url, auth=credentials) as client:
            who = await client.call_tool("whoami", {})
            assert who.structured_content is not None
            assert who.structured_content["subject"] == "test-client"
            assert who.structured_content["scopes"] == ["mcp"]
            # The first token: discovered from the 401, scope from the challenge, resource.
            assert auth_server.token_requests == [
                {"grant_type": "client_credentials", "scope": "mcp", "resource": endpoint.resource}
            ]
            assert auth_server.requests["/.well-known/oauth-authorization-server"] == 1
            # A tool needing more: 403, a token for the union, the call again.
            written = await client.call_tool("write", {"path": "report"})
            assert written.content[0]["text"] == "wrote report"
            assert probe.writes == ["report"]
            assert auth_server.token_requests[-1] == {
                "grant_type": "client_credentials",
                "scope": "files:write mcp",
                "resource": endpoint.resource,
            }
            assert credentials.granted == frozenset({"mcp", "files:write"})
            # The token is reused while it is valid.
            await client.call_tool("write", {"path": "again"})
            assert len(auth_server.token_requests) == 2
            assert credentials.token_requests == 2


async def test_client_credentials_refuses_metadata_for_another_resource(
    auth_server: TestAuthorizationServer,
) -> None:
    async with serve_protected(auth_server) as endpoint:
        credentials = ClientCredentials("test-client", "wrong-secret")
        with pytest.raises(OAuthError, match="HTTP 401 \\(invalid_client\\)"):
            async with connect(endpoint.url, auth=credentials):
                pass
        # A resource server whose metadata names another resource is not given a token.
        impostor = ClientCredentials("test-client", "test-secret")
        with pytest.raises(OAuthError, match="the metadata is for"):
            await impostor._discover(endpoint.metadata_url, "http://127.0.0.1:1/mcp")
        assert auth_server.token_requests[-1:] == [
            {"grant_type": "client_credentials", "scope": "mcp", "resource": endpoint.resource}
        ]


async def test_client_credentials_post_and_a_configured_endpoint() -> None:
    async with running_authorization_server() as server, serve_protected(server) as endpoint:
        credentials = ClientCredentials(
            "test-client",
            "test-secret",
            scopes=["mcp"],
            token_endpoint=f"{server.issuer}/token",
            resource=endpoint.resource,
            auth_method="client_secret_post",
        )
        async with connect(endpoint.url, auth=credentials) as client:
            result: Any = await client.call_tool("whoami", {})
            assert result.structured_content["subject"] == "test-client"
        # No discovery at all: the token was fetched before the first request.
        assert server.requests["/.well-known/oauth-authorization-server"] == 0
        assert server.token_requests == [
            {
                "grant_type": "client_credentials",
                "scope": "mcp",
                "resource": endpoint.resource,
                "client_id": "test-client",
                "client_secret": "test-secret",
            }
        ]


class _PlainTokenEndpoint(TestAuthorizationServer):
    """Metadata naming an http:// token endpoint on a host that is not loopback."""

    def metadata(self) -> dict[str, Any]:
        return {**super().metadata(), "token_endpoint": "http://auth.invalid/token"}


async def test_the_secret_is_never_sent_to_a_plain_http_token_endpoint() -> None:
    server = _PlainTokenEndpoint()
    async with running_authorization_server(server), serve_protected(server) as endpoint:
        credentials = ClientCredentials("test-client", "test-secret")
        with pytest.raises(OAuthError, match=re.escape("http://auth.invalid/token is not https")):
            async with connect(endpoint.url, auth=credentials):
                pass
        assert credentials.token_requests == 0
        assert server.token_requests == []
    with pytest.raises(ValueError, match="is not https"):
        ClientCredentials("c", "s", token_endpoint="http://auth.example/token")
    # Loopback over plain HTTP stays allowed (local development, these tests).
    for url in ("http://127.0.0.1:9/token", "http://localhost/token", "http://[::1]:8/t"):
        assert ClientCredentials("c", "s", token_endpoint=url).token_endpoint == url


async def test_one_client_credentials_is_bound_to_the_server_it_discovered(
    auth_server: TestAuthorizationServer,
) -> None:
    # Its token is for the resource it discovered: asked by another server, it must not keep
    # requesting tokens for the first resource (and sending them to the second).
    credentials = ClientCredentials("test-client", "test-secret")
    async with serve_protected(auth_server) as first, serve_protected(auth_server) as second:
        async with connect(first.url, auth=credentials) as client:
            await client.call_tool("whoami", {})
        requested = len(auth_server.token_requests)
        with pytest.raises(OAuthError, match="use one ClientCredentials per server"):
            async with connect(second.url, auth=credentials):
                pass
        assert len(auth_server.token_requests) == requested


async def test_discovery_documents_only_over_https_except_on_loopback(
    auth_server: TestAuthorizationServer,
) -> None:
    # The metadata names where the secret goes: fetched in clear text, it could be swapped
    # in transit for an https endpoint of the attacker's.
    credentials = ClientCredentials("test-client", "test-secret")
    with pytest.raises(OAuthError, match="oauth-protected-resource/mcp is not https"):
        await credentials._discover(
            "http://mcp.invalid/.well-known/oauth-protected-resource/mcp",
            "http://mcp.invalid/mcp",
        )
    with pytest.raises(OAuthError, match="is not https"):
        await credentials._discover(None, "http://mcp.invalid/mcp")
    assert credentials.token_endpoint is None
    assert auth_server.token_requests == []


async def test_a_step_up_the_authorization_server_refuses_is_tried_once_per_call() -> None:
    # The authorization server never grants files:sign: each call gets one step-up (one token
    # request, one retry) and then the 403 as an error, never a loop.
    server = TestAuthorizationServer(client_scopes={"test-client": ["mcp", "files:write"]})
    async with running_authorization_server(server), serve_protected(server) as endpoint:
        credentials = ClientCredentials("test-client", "test-secret")
        async with connect(endpoint.url, auth=credentials) as client:
            assert len(server.token_requests) == 1
            with pytest.raises(InvalidRequestError, match="Forbidden"):
                await client.call_tool("sign", {"path": "p"})
            assert len(server.token_requests) == 2
            assert server.token_requests[-1]["scope"] == "files:sign files:write mcp"
            assert credentials.granted == frozenset({"mcp", "files:write"})
            with pytest.raises(InvalidRequestError, match="Forbidden"):
                await client.call_tool("sign", {"path": "p"})
            assert len(server.token_requests) == 3
            # What the token does cover still works, without another token request.
            written = await client.call_tool("write", {"path": "q"})
            assert written.content[0]["text"] == "wrote q"
            assert len(server.token_requests) == 3
