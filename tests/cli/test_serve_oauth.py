"""``tritask serve --oauth-*``: BearerAuth with a JWTVerifier from flags, as a real process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import trio

pytest.importorskip("joserfc")

from tritask.testing.oauth import (
    TestAuthorizationServer,
    free_port,
    running_authorization_server,
)

REPO = Path(__file__).resolve().parents[2]
FIXTURE = f"{REPO / 'examples' / 'conformance_fixture.py'}:app"


@pytest.fixture
async def auth_server() -> AsyncIterator[TestAuthorizationServer]:
    async with running_authorization_server() as server:
        yield server


def discover(token: str | None) -> tuple[dict[str, str], bytes]:
    headers = {
        "content-type": "application/json",
        "accept": "application/json, text/event-stream",
        "mcp-protocol-version": "2026-07-28",
        "mcp-method": "server/discover",
    }
    if token is not None:
        headers["authorization"] = f"Bearer {token}"
    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "server/discover",
        "params": {
            "_meta": {
                "io.modelcontextprotocol/protocolVersion": "2026-07-28",
                "io.modelcontextprotocol/clientCapabilities": {},
            }
        },
    }
    return headers, json.dumps(body).encode()


async def test_serve_with_oauth_flags(auth_server: TestAuthorizationServer) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    resource = f"{base}/mcp"
    command = [
        sys.executable, "-m", "tritask", "serve", FIXTURE, "--http", f"127.0.0.1:{port}",
        "--store", "memory:", "--oauth-issuer", auth_server.issuer,
        "--oauth-jwks-uri", f"{auth_server.issuer}/jwks", "--oauth-resource", resource,
        "--oauth-scope", "mcp", "--oauth-scope", "tools",
    ]  # fmt: skip
    process = await trio.lowlevel.open_process(
        command, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, env=dict(os.environ)
    )
    assert process.stderr is not None
    seen = b""
    try:
        with trio.fail_after(60):
            while b"OAuth on" not in seen:
                chunk = await process.stderr.receive_some()
                assert chunk, seen.decode()
                seen += chunk
        assert (
            f"tritask: OAuth on: resource {resource}, issuer {auth_server.issuer}, "
            f"metadata {base}/.well-known/oauth-protected-resource/mcp"
        ) in seen.decode()
        async with httpx.AsyncClient(timeout=30) as client:
            metadata = await client.get(f"{base}/.well-known/oauth-protected-resource/mcp")
            assert metadata.json() == {
                "resource": resource,
                "authorization_servers": [auth_server.issuer],
                "bearer_methods_supported": ["header"],
                "scopes_supported": ["mcp", "tools"],
            }
            headers, body = discover(None)
            refused = await client.post(resource, content=body, headers=headers)
            assert refused.status_code == 401
            assert refused.headers["www-authenticate"] == (
                f'Bearer resource_metadata="{base}/.well-known/oauth-protected-resource/mcp", '
                'scope="mcp tools"'
            )
            short = auth_server.mint(aud=resource, scope="mcp")
            headers, body = discover(short)
            assert (await client.post(resource, content=body, headers=headers)).status_code == 403
            good = auth_server.mint(aud=resource, scope="mcp tools")
            headers, body = discover(good)
            answered = await client.post(resource, content=body, headers=headers)
            assert answered.status_code == 200, answered.text
            assert "supportedVersions" in answered.json()["result"]
    finally:
        process.send_signal(signal.SIGINT)
        with trio.fail_after(30):
            await process.wait()
    assert process.returncode == 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--oauth-issuer", "https://as.example"],
            "tritask: OAuth needs --oauth-jwks-uri, --oauth-resource as well",
        ),
        (
            ["--oauth-scope", "mcp"],
            "tritask: OAuth needs --oauth-issuer, --oauth-jwks-uri, --oauth-resource as well",
        ),
        (
            [
                "--oauth-issuer", "https://as.example", "--oauth-jwks-uri", "https://as.example/j",
                "--oauth-resource", "ftp://mcp.example/mcp",
            ],
            "tritask: OAuth: resource 'ftp://mcp.example/mcp' must be an absolute http(s) URI",
        ),
        (
            [
                "--oauth-issuer", "https://as.example", "--oauth-jwks-uri", "https://as.example/j",
                "--oauth-resource", "https://mcp.example/mcp", "--ws", "127.0.0.1:0",
            ],
            "tritask: --ws cannot be served with OAuth (WebSocket has no bearer-token support); "
            "serve --http only",
        ),
    ],
)  # fmt: skip
def test_incomplete_oauth_flags_are_one_line(flags: list[str], message: str) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "tritask", "serve", FIXTURE, "--store", "memory:", *flags],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 1
    assert completed.stderr.strip().splitlines()[-1] == message


def test_an_app_with_auth_is_not_served_over_websocket(tmp_path: Path) -> None:
    source = tmp_path / "protected_app.py"
    source.write_text(
        "from tritask import App\n"
        "from tritask.auth import BearerAuth, JWTVerifier\n"
        "auth = BearerAuth(resource='https://mcp.example/mcp',\n"
        "    authorization_servers=['https://as.example'],\n"
        "    verifier=JWTVerifier('https://as.example', 'https://as.example/jwks'))\n"
        "app = App('protected', '1.0.0', auth=auth)\n"
    )
    completed = subprocess.run(
        [
            *(sys.executable, "-m", "tritask", "serve", f"{source}:app"),
            *("--store", "memory:", "--ws", "127.0.0.1:0"),
        ],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 1
    assert completed.stderr.strip().splitlines()[-1] == (
        "tritask: --ws cannot serve an app with App(auth=...) (WebSocket has no bearer-token "
        "support: it would be unprotected); serve --http only"
    )
