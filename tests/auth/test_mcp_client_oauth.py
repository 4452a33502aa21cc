"""Interop: the official ``mcp`` 2.3.0 client with its ``ClientCredentialsOAuthProvider``.

Against tritask with ``BearerAuth`` on a loopback port and the loopback authorization server:
the client's first request gets 401, it discovers the Protected Resource Metadata and the
authorization server, requests a token with ``resource`` (RFC 8707), makes the call, and when a
tool needs more scope, the 403 ``insufficient_scope`` makes it step up (SEP-2350: a token for
the union of the scopes) and the call succeeds. Both eras: 2026-07-28 and the initialize
handshake (``mode="legacy"``, a legacy HTTP session).
"""

from __future__ import annotations

import httpx2
import mcp_types as types
import pytest
import trio
from mcp import Client
from mcp.client.auth.extensions.client_credentials import ClientCredentialsOAuthProvider
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.auth import OAuthClientInformationFull, OAuthToken

from auth.oauth_app import Probe, serve_protected
from tritask.testing.oauth import TestAuthorizationServer


class MemoryStorage:
    def __init__(self) -> None:
        self.tokens: OAuthToken | None = None
        self.client_info: OAuthClientInformationFull | None = None

    async def get_tokens(self) -> OAuthToken | None:
        return self.tokens

    async def set_tokens(self, tokens: OAuthToken) -> None:
        self.tokens = tokens

    async def get_client_info(self) -> OAuthClientInformationFull | None:
        return self.client_info

    async def set_client_info(self, client_info: OAuthClientInformationFull) -> None:
        self.client_info = client_info


@pytest.mark.parametrize("mode", ["2026-07-28", "legacy"])
async def test_discovery_token_call_and_step_up(
    auth_server: TestAuthorizationServer, mode: str
) -> None:
    probe = Probe()
    with trio.fail_after(60):
        async with serve_protected(auth_server, probe) as endpoint:
            storage = MemoryStorage()
            provider = ClientCredentialsOAuthProvider(
                server_url=endpoint.url,
                storage=storage,
                client_id="test-client",
                client_secret="test-secret",
                issuer=auth_server.issuer,
            )
            async with (
                httpx2.AsyncClient(auth=provider, timeout=30) as http,
                Client(
                    streamable_http_client(endpoint.url, http_client=http),
                    mode=mode,
                ) as client,
            ):
                who = await client.call_tool("whoami", {})
                assert who.is_error is False
                assert who.structured_content is not None
                assert who.structured_content["subject"] == "test-client"
                assert who.structured_content["scopes"] == ["mcp"]
                # Discovery: the metadata URL from the challenge, then RFC 8414.
                assert auth_server.requests["/.well-known/oauth-authorization-server"] >= 1
                first = auth_server.token_requests[0]
                assert first["grant_type"] == "client_credentials"
                assert first["resource"] == endpoint.resource
                assert first["scope"] == "mcp"
                # A tool needing files:write: 403, step-up, the call again.
                written = await client.call_tool("write", {"path": "from-mcp"})
                assert written.is_error is False
                assert written.content == [types.TextContent(type="text", text="wrote from-mcp")]
                assert probe.writes == ["from-mcp"]
                last = auth_server.token_requests[-1]
                assert last["resource"] == endpoint.resource
                assert set(last["scope"].split()) == {"mcp", "files:write"}
                assert storage.tokens is not None
                assert set((storage.tokens.scope or "").split()) == {"mcp", "files:write"}
                # tools/list is not filtered by scope.
                listed = await client.list_tools()
                assert {"write", "sign", "whoami"} <= {tool.name for tool in listed.tools}
