"""An OAuth-protected app on a real socket, and a small HTTP client for the auth tests."""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import httpx
import trio

from tritask.auth import BearerAuth, JWTVerifier
from tritask.jsonrpc import JSONValue
from tritask.protocol.meta import CLIENT_CAPABILITIES_KEY, PROTOCOL_VERSION_KEY
from tritask.server import App, Context
from tritask.tasks import Tasks
from tritask.testing.oauth import TestAuthorizationServer, free_port
from tritask.transports.http import HttpOptions, serve_http

V = "2026-07-28"
TASKS = "io.modelcontextprotocol/tasks"


class Probe:
    def __init__(self) -> None:
        self.writes: list[str] = []
        self.contexts: list[Context] = []
        self.asked = trio.Event()


def build_app(
    probe: Probe, *, tasks_options: Mapping[str, Any] | None = None, **app_options: Any
) -> App:
    app = App("oauth-app", "1.0.0", state_key="oauth-test-state-key-0123456789", **app_options)

    @app.tool()
    async def whoami(ctx: Context) -> dict[str, JSONValue]:
        """Who the token says the caller is."""
        assert ctx.auth is not None
        return {
            "subject": ctx.auth.subject,
            "client_id": ctx.auth.client_id,
            "scopes": sorted(ctx.auth.scopes),
            "principal": ctx.principal,
            "jti": ctx.auth.claims.get("jti"),
        }

    @app.tool(required_scopes=["files:write"])
    async def write(path: str) -> str:
        """Write a file (needs files:write)."""
        probe.writes.append(path)
        return f"wrote {path}"

    @app.tool(required_scopes=["files:write", "files:sign"])
    async def sign(path: str) -> str:
        """Sign a file (needs files:write and files:sign)."""
        return f"signed {path}"

    @app.tool(required_scopes=["files:write"])
    async def ask(ctx: Context) -> str:
        """Wait for an answer (a task; needs files:write)."""
        probe.contexts.append(ctx)
        probe.asked.set()
        answer = await ctx.await_input(
            "confirm",
            {
                "method": "elicitation/create",
                "params": {
                    "mode": "form",
                    "message": "Go?",
                    "requestedSchema": {"type": "object", "properties": {}},
                },
            },
        )
        return json.dumps(answer)

    app.add_extension(Tasks(task_support={"ask": "required"}, **(tasks_options or {})))
    return app


def bearer_auth(server: TestAuthorizationServer, resource: str, **options: Any) -> BearerAuth:
    options.setdefault("required_scopes", ["mcp"])
    options.setdefault("scope_implies", {"files:admin": ["files:write", "files:read"]})
    return BearerAuth(
        resource=resource,
        authorization_servers=[server.issuer],
        verifier=JWTVerifier(server.issuer, f"{server.issuer}/jwks"),
        **options,
    )


class Endpoint:
    """The served app: its URLs and an httpx client that sends MCP requests."""

    def __init__(self, base: str, path: str, client: httpx.AsyncClient, app: App) -> None:
        self.base = base
        self.path = path
        self.url = base + path
        self.client = client
        self.app = app
        self.resource = self.url
        self.metadata_url = base + "/.well-known/oauth-protected-resource" + path.rstrip("/")

    async def post(
        self,
        message: dict[str, Any] | bytes,
        token: str | None = None,
        *,
        headers: dict[str, str] | None = None,
        modern: bool = True,
        query: str = "",
    ) -> httpx.Response:
        sent = {"content-type": "application/json", "accept": "application/json, text/event-stream"}
        if isinstance(message, dict) and modern:
            sent["mcp-protocol-version"] = V
            sent["mcp-method"] = message["method"]
            params = message.get("params") or {}
            name = params.get("name", params.get("taskId"))
            if isinstance(name, str):
                sent["mcp-name"] = name
        if token is not None:
            sent["authorization"] = f"Bearer {token}"
        sent.update(headers or {})
        content = message if isinstance(message, bytes) else json.dumps(message).encode()
        return await self.client.post(self.url + query, content=content, headers=sent)


def rpc(
    method: str,
    params: dict[str, Any] | None = None,
    request_id: int | None = 1,
    tasks: bool = False,
) -> dict[str, Any]:
    caps: dict[str, Any] = {"extensions": {TASKS: {}}, "elicitation": {"form": {}}} if tasks else {}
    message: dict[str, Any] = {
        "jsonrpc": "2.0",
        "method": method,
        "params": {
            **(params or {}),
            "_meta": {PROTOCOL_VERSION_KEY: V, CLIENT_CAPABILITIES_KEY: caps},
        },
    }
    if request_id is not None:
        message["id"] = request_id
    return message


def call(name: str, arguments: dict[str, Any] | None = None, **kwargs: Any) -> dict[str, Any]:
    return rpc("tools/call", {"name": name, "arguments": arguments or {}}, **kwargs)


@asynccontextmanager
async def serve_protected(
    server: TestAuthorizationServer,
    probe: Probe | None = None,
    *,
    path: str = "/mcp",
    store_url: str | None = None,
    tasks_options: Mapping[str, Any] | None = None,
    **auth_options: Any,
) -> AsyncIterator[Endpoint]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    auth = bearer_auth(server, base + path, **auth_options)
    app = build_app(probe or Probe(), tasks_options=tasks_options)
    from tritask.server.extension import ServeEnvironment

    async with (
        trio.open_nursery() as nursery,
        app.running(ServeEnvironment(store_url=store_url)),
    ):
        await nursery.start(
            functools.partial(
                serve_http, app, "127.0.0.1", port, options=HttpOptions(path=path, auth=auth)
            )
        )
        async with httpx.AsyncClient(timeout=30) as client:
            yield Endpoint(base, path, client, app)
        nursery.cancel_scope.cancel()
