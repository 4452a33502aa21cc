"""A small OAuth 2.1 authorization server on loopback, for tests (needs ``joserfc``).

It mints keys per instance (P-256, with a ``kid``), publishes them as a JWKS, and serves
RFC 8414 metadata, a client-credentials ``/token`` endpoint (the ``resource`` parameter becomes
``aud``, RFC 8707) and RFC 7662 ``/introspect``. Tests can mint any token directly
(:meth:`TestAuthorizationServer.mint`, including broken ones), rotate keys, take the JWKS
endpoint down, and count requests per endpoint. Never use it outside tests.

::

    async with running_authorization_server() as server:
        token = server.mint(sub="alice", scope="mcp", aud=resource)
"""

from __future__ import annotations

import base64
import json
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, MutableMapping
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import parse_qsl, unquote

import trio

from tritask.transports._h11server import serve

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (to know a server's URL before it starts)."""
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


class TestAuthorizationServer:
    """An ASGI authorization server; serve it with :func:`running_authorization_server`."""

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        *,
        clients: Mapping[str, str] | None = None,
        client_scopes: Mapping[str, Iterable[str]] | None = None,
        token_lifetime_s: int = 300,
    ) -> None:
        self.clients = dict(clients or {"test-client": "test-secret"})
        """client_id → client_secret accepted at ``/token`` and ``/introspect``."""
        self.client_scopes = {k: frozenset(v) for k, v in (client_scopes or {}).items()}
        """Scopes a client may get (absent: whatever it asks for)."""
        self.token_lifetime_s = token_lifetime_s
        self.issuer = ""
        self.keys: list[Any] = []
        self.signing_key = self.new_key()
        self.published: list[Any] = [self.signing_key]
        self.jwks_down = False
        self.requests: Counter[str] = Counter()
        self.token_requests: list[dict[str, str]] = []
        self.revoked: set[str] = set()
        self.opaque: dict[str, dict[str, Any]] = {}
        self.introspection_gate: trio.Event | None = None
        """While an unset event, ``/introspect`` answers wait for it (counted in ``requests``
        on arrival): a test holds answers back to make requests overlap, without timing."""

    # -- keys and tokens -----------------------------------------------------------------

    @staticmethod
    def new_key(kid: str | None = None) -> Any:
        from joserfc import jwk

        return jwk.ECKey.generate_key(
            "P-256", parameters={"kid": kid or secrets.token_hex(8), "use": "sig"}, private=True
        )

    def rotate(self, *, keep_old: bool = False) -> Any:
        """Sign with a new key from now on; publish it (and the old one with ``keep_old``)."""
        self.signing_key = self.new_key()
        self.published = [*self.published, self.signing_key] if keep_old else [self.signing_key]
        return self.signing_key

    def jwks(self) -> dict[str, Any]:
        return {"keys": [key.as_dict(private=False) for key in self.published]}

    def mint(
        self,
        *,
        sub: str | None = "alice",
        client_id: str | None = "test-client",
        scope: str | None = "mcp",
        aud: str | list[str] | None = None,
        iss: str | None = None,
        exp_in: float | None = 300,
        nbf_in: float | None = None,
        extra: Mapping[str, Any] | None = None,
        header: Mapping[str, Any] | None = None,
        key: Any = None,
        alg: str = "ES256",
    ) -> str:
        """A signed JWT; ``None`` leaves a claim out. ``iss`` defaults to this server."""
        from joserfc import jwt

        now = int(time.time())
        claims: dict[str, Any] = {"iss": self.issuer if iss is None else iss, "iat": now}
        claims["jti"] = secrets.token_hex(8)
        if sub is not None:
            claims["sub"] = sub
        if client_id is not None:
            claims["client_id"] = client_id
        if scope is not None:
            claims["scope"] = scope
        if aud is not None:
            claims["aud"] = aud
        if exp_in is not None:
            claims["exp"] = int(now + exp_in)
        if nbf_in is not None:
            claims["nbf"] = int(now + nbf_in)
        claims.update(extra or {})
        signing = key or self.signing_key
        head: dict[str, Any] = {"alg": alg, "kid": signing.kid, "typ": "at+jwt"}
        head.update(header or {})
        head = {k: v for k, v in head.items() if v is not None}
        return str(jwt.encode(head, claims, signing, algorithms=[alg]))

    def sign_raw(self, header: Mapping[str, Any], claims: Mapping[str, Any]) -> str:
        """ES256 over exactly ``header`` and ``claims`` (no header checks: ``crit`` etc.)."""
        from joserfc.jws import JWSRegistry

        signing_input = (
            _b64(json.dumps(dict(header)).encode()) + "." + _b64(json.dumps(dict(claims)).encode())
        )
        signature = JWSRegistry.algorithms["ES256"].sign(signing_input.encode(), self.signing_key)
        return signing_input + "." + _b64(signature)

    @staticmethod
    def unsigned(claims: Mapping[str, Any], header: Mapping[str, Any] | None = None) -> str:
        """An ``alg: none`` token (``header.payload.``)."""
        head = {"alg": "none", "typ": "JWT", **(header or {})}
        return _b64(json.dumps(head).encode()) + "." + _b64(json.dumps(dict(claims)).encode()) + "."

    def hs256_with_public_key(self, claims: Mapping[str, Any]) -> str:
        """The key-confusion attack: HS256 keyed with the public key's PEM."""
        import hashlib
        import hmac

        head = {"alg": "HS256", "typ": "JWT", "kid": self.signing_key.kid}
        signing_input = (
            _b64(json.dumps(head).encode()) + "." + _b64(json.dumps(dict(claims)).encode())
        )
        secret = self.signing_key.as_pem(private=False)
        mac = hmac.new(secret, signing_input.encode(), hashlib.sha256).digest()
        return signing_input + "." + _b64(mac)

    def claims_for(self, **overrides: Any) -> dict[str, Any]:
        now = int(time.time())
        claims: dict[str, Any] = {
            "iss": self.issuer,
            "sub": "alice",
            "client_id": "test-client",
            "scope": "mcp",
            "iat": now,
            "exp": now + 300,
        }
        claims.update(overrides)
        return {k: v for k, v in claims.items() if v is not None}

    def issue_opaque(self, **claims: Any) -> str:
        """An opaque token that ``/introspect`` describes with ``claims`` (``active`` added)."""
        token = secrets.token_urlsafe(24)
        self.opaque[token] = self.claims_for(**claims)
        return token

    # -- the ASGI application ------------------------------------------------------------

    def metadata(self) -> dict[str, Any]:
        """RFC 8414. ``/authorize`` is listed (clients' models require it) but only refuses:
        this server issues tokens by client credentials alone."""
        document: dict[str, Any] = {
            "issuer": self.issuer,
            "authorization_endpoint": f"{self.issuer}/authorize",
            "token_endpoint": f"{self.issuer}/token",
            "jwks_uri": f"{self.issuer}/jwks",
            "introspection_endpoint": f"{self.issuer}/introspect",
            "grant_types_supported": ["client_credentials"],
            "token_endpoint_auth_methods_supported": ["client_secret_basic", "client_secret_post"],
            "introspection_endpoint_auth_methods_supported": [
                "client_secret_basic",
                "client_secret_post",
            ],
            "response_types_supported": ["code"],
            "code_challenge_methods_supported": ["S256"],
        }
        scopes = sorted({s for v in self.client_scopes.values() for s in v})
        if scopes:
            document["scopes_supported"] = scopes
        return document

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope.get("path", "")
        headers = {k.decode().lower(): v.decode() for k, v in scope.get("headers", [])}
        self.requests[path] += 1
        if path in (
            "/.well-known/oauth-authorization-server",
            "/.well-known/openid-configuration",
        ):
            await _reply(send, 200, self.metadata())
        elif path == "/jwks":
            if self.jwks_down:
                await _reply(send, 503, {"error": "down"})
            else:
                await _reply(send, 200, self.jwks())
        elif path == "/token" and scope.get("method") == "POST":
            await self._token(headers, dict(parse_qsl(body.decode())), send)
        elif path == "/introspect" and scope.get("method") == "POST":
            await self._introspect(headers, dict(parse_qsl(body.decode())), send)
        else:
            await _reply(send, 404, {"error": "not_found"})

    def _client(self, headers: Mapping[str, str], form: Mapping[str, str]) -> str | None:
        value = headers.get("authorization", "")
        if value.lower().startswith("basic "):
            try:
                decoded = base64.b64decode(value[6:]).decode()
            except ValueError:
                return None
            client_id, _, secret = decoded.partition(":")
            client_id, secret = unquote(client_id), unquote(secret)
        else:
            client_id, secret = form.get("client_id", ""), form.get("client_secret", "")
        return client_id if self.clients.get(client_id) == secret and client_id else None

    async def _token(self, headers: Mapping[str, str], form: dict[str, str], send: Send) -> None:
        self.token_requests.append(form)
        client_id = self._client(headers, form)
        if client_id is None:
            await _reply(send, 401, {"error": "invalid_client"})
            return
        if form.get("grant_type") != "client_credentials":
            await _reply(send, 400, {"error": "unsupported_grant_type"})
            return
        requested = set(form.get("scope", "").split())
        allowed = self.client_scopes.get(client_id)
        granted = requested if allowed is None else requested & allowed
        resource = form.get("resource")
        token = self.mint(
            sub=client_id,
            client_id=client_id,
            scope=" ".join(sorted(granted)) or None,
            aud=resource,
            exp_in=self.token_lifetime_s,
        )
        answer: dict[str, Any] = {
            "access_token": token,
            "token_type": "Bearer",
            "expires_in": self.token_lifetime_s,
        }
        if granted:
            answer["scope"] = " ".join(sorted(granted))
        await _reply(send, 200, answer)

    async def _introspect(
        self, headers: Mapping[str, str], form: dict[str, str], send: Send
    ) -> None:
        if self.introspection_gate is not None:
            await self.introspection_gate.wait()
        if self._client(headers, form) is None:
            await _reply(send, 401, {"error": "invalid_client"})
            return
        token = form.get("token", "")
        claims = self.opaque.get(token)
        exp = claims.get("exp") if claims is not None else None
        expired = isinstance(exp, int | float) and exp < time.time()
        if claims is None or token in self.revoked or expired:
            await _reply(send, 200, {"active": False})
            return
        await _reply(send, 200, {"active": True, "token_type": "Bearer", **claims})


async def _reply(send: Send, status: int, document: Mapping[str, Any]) -> None:
    body = json.dumps(document).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(body)),
                (b"cache-control", b"no-store"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


@asynccontextmanager
async def running_authorization_server(
    server: TestAuthorizationServer | None = None,
) -> AsyncIterator[TestAuthorizationServer]:
    """Serve ``server`` (a new one by default) on a loopback port for the block."""
    server = server or TestAuthorizationServer()
    async with trio.open_nursery() as nursery:
        urls: list[str] = await nursery.start(serve, server, "127.0.0.1", 0)
        server.issuer = urls[0]
        yield server
        nursery.cancel_scope.cancel()
