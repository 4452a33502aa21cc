"""OAuth for the client: the client-credentials grant, discovered from the server's challenge.

:class:`ClientCredentials` is an ``Authorizer`` (``connect(url, auth=ClientCredentials(...))``)
that follows the MCP authorization flow for machine clients (SEP-1046):

1. The first request goes out without a token (or with the one it holds). A 401 names the
   server's Protected Resource Metadata (``resource_metadata`` in ``WWW-Authenticate``; else
   the well-known URL derived from the endpoint, path-inserted then the root form).
2. The metadata names the ``resource`` (it must be the endpoint's own URL, RFC 9728 §3.3) and
   the authorization server, whose RFC 8414 metadata (or OpenID configuration) gives the token
   endpoint; its ``issuer`` must be the server named, and the endpoint must be https (plain
   http only to a loopback host): the client secret goes nowhere else. Both metadata documents
   are read over https only too (off loopback), since they name where the secret goes.
3. A token is requested with ``grant_type=client_credentials``, the challenge's ``scope`` (plus
   those asked for before) and ``resource`` (RFC 8707), and the request is sent again with it.
4. A 403 ``insufficient_scope`` is a step-up: a new token for the union of the scopes held and
   those the challenge names, and the request once more.

A static token needs none of this: ``connect(url, auth="Bearer <token>")``.
"""

from __future__ import annotations

import base64
import logging
import re
import time
from collections.abc import Callable, Iterable
from typing import Final, Literal
from urllib.parse import quote, urlsplit, urlunsplit

import httpx
import trio

from tritask.client.errors import ClientError
from tritask.client.http import AuthChallenge
from tritask.jsonrpc import JSONValue, loads

log = logging.getLogger("tritask.client")

_PARAM: Final = re.compile(r'([A-Za-z0-9_\-]+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^\s,]+))')
_PRM: Final = "/.well-known/oauth-protected-resource"
EXPIRY_MARGIN_S: Final = 30.0


class OAuthError(ClientError):
    """Discovery or the token request failed (the message says which step and why)."""


def parse_bearer_challenge(value: str | None) -> dict[str, str] | None:
    """The parameters of a ``Bearer`` challenge in ``WWW-Authenticate`` (``None`` if none)."""
    if not value:
        return None
    match = re.search(r"(?i)\bbearer\b", value)
    if match is None:
        return None
    params: dict[str, str] = {}
    for found in _PARAM.finditer(value[match.end() :]):
        name = found.group(1).lower()
        text = found.group(2) if found.group(2) is not None else found.group(3)
        params.setdefault(name, re.sub(r"\\(.)", r"\1", text))
    return params


def _canonical(uri: str) -> str:
    parts = urlsplit(uri)
    return urlunsplit(
        (parts.scheme.lower(), parts.netloc.lower(), parts.path.rstrip("/"), parts.query, "")
    )


def _check_token_endpoint(url: str, what: str = "the token endpoint") -> str:
    """``url`` if the client secret may go there (or a document naming where it goes may come
    from there): https, or plain http to a loopback host."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "https" and parts.hostname:
        return url
    if scheme == "http" and parts.hostname is not None:
        host = parts.hostname.lower()
        if host == "localhost" or host == "::1" or host.startswith("127."):
            return url
    raise OAuthError(
        f"{what} {url} is not https (plain http only to a loopback host): "
        "the client secret is not sent there"
    )


def _well_known(url: str, suffix: str) -> list[str]:
    """Path-inserted first, then the root form (RFC 8414 §3.1, RFC 9728 §3.1)."""
    parts = urlsplit(url)
    path = parts.path.rstrip("/")
    urls = [urlunsplit((parts.scheme, parts.netloc, suffix + path, "", ""))] if path else []
    root = urlunsplit((parts.scheme, parts.netloc, suffix, "", ""))
    return [*urls, root] if root not in urls else urls


class ClientCredentials:
    """An ``Authorizer`` that gets its tokens with the client-credentials grant.

    ``scopes`` are asked for from the start (a challenge may add more). ``token_endpoint`` and
    ``resource`` skip discovery when given. ``auth_method`` is how the client authenticates to
    the token endpoint.

    Use one instance per server: it holds one token, for the resource it discovered (or was
    given). A challenge from another endpoint than the one it discovered is an ``OAuthError``
    (the hook is not told the URL before a request, so the first request to another server
    would still carry this token).
    """

    def __init__(
        self,
        client_id: str,
        client_secret: str,
        *,
        scopes: Iterable[str] = (),
        token_endpoint: str | None = None,
        resource: str | None = None,
        auth_method: Literal["client_secret_basic", "client_secret_post"] = ("client_secret_basic"),
        timeout: float = 10.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if token_endpoint is not None:
            try:
                _check_token_endpoint(token_endpoint)
            except OAuthError as error:
                raise ValueError(str(error)) from None
        self.client_id = client_id
        self._client_secret = client_secret
        self.scopes = frozenset(scopes)
        self.token_endpoint = token_endpoint
        self.resource = resource
        self.auth_method = auth_method
        self.timeout = timeout
        self._clock = clock
        self._token: str | None = None
        self._expires_at: float | None = None
        self.granted: frozenset[str] = frozenset()
        """The scopes of the token held (as the token endpoint said, else as asked)."""
        self.token_requests = 0
        self._lock: trio.Lock | None = None
        self._server_url: str | None = None
        """The endpoint whose challenge the discovery followed (its token is for it alone)."""

    def __repr__(self) -> str:
        return f"ClientCredentials({self.client_id!r}, scopes={sorted(self.scopes)!r})"

    async def __call__(self, challenge: AuthChallenge | None) -> str | None:
        if self._lock is None:
            self._lock = trio.Lock()
        async with self._lock:
            if challenge is None:
                if self._valid():
                    return f"Bearer {self._token}"
                if self.token_endpoint is None:
                    return None  # the server's 401 will say where to go
                await self._request_token(self.scopes)
                return f"Bearer {self._token}"
            return await self._answer(challenge)

    def _valid(self) -> bool:
        if self._token is None:
            return False
        return self._expires_at is None or self._clock() < self._expires_at - EXPIRY_MARGIN_S

    async def _answer(self, challenge: AuthChallenge) -> str | None:
        params = parse_bearer_challenge(challenge.www_authenticate) or {}
        error = params.get("error")
        if challenge.http_status == 403 and error != "insufficient_scope":
            return None
        wanted = set(self.scopes) | set(params.get("scope", "").split())
        if challenge.http_status == 403:
            wanted |= self.granted  # step-up keeps what the token had
        if (
            self._server_url is not None
            and challenge.url is not None
            and _canonical(challenge.url) != _canonical(self._server_url)
        ):
            raise OAuthError(
                f"these credentials hold tokens for {self.resource!r}, not for {challenge.url!r}: "
                "use one ClientCredentials per server"
            )
        if self.token_endpoint is None or self.resource is None:
            await self._discover(params.get("resource_metadata"), challenge.url)
            self._server_url = challenge.url
        await self._request_token(frozenset(wanted))
        self.scopes = self.scopes | frozenset(wanted)
        return f"Bearer {self._token}"

    async def _get_json(self, client: httpx.AsyncClient, url: str) -> dict[str, JSONValue] | None:
        # The documents name where the secret goes: never read in clear text off loopback.
        _check_token_endpoint(url, "the metadata URL")
        try:
            response = await client.get(url, headers={"accept": "application/json"})
        except httpx.HTTPError as error:
            raise OAuthError(f"fetching {url} failed: {type(error).__name__}") from error
        if response.status_code != 200:
            return None
        try:
            value = loads(response.content)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return None
        return value if isinstance(value, dict) else None

    async def _discover(self, metadata_url: str | None, server_url: str | None) -> None:
        async with httpx.AsyncClient(timeout=self.timeout, follow_redirects=False) as client:
            candidates = [metadata_url] if metadata_url else []
            if not candidates and server_url:
                candidates = _well_known(server_url, _PRM)
            if not candidates:
                raise OAuthError("the server named no resource metadata and its URL is unknown")
            document = None
            for url in candidates:
                document = await self._get_json(client, url)
                if document is not None:
                    break
            if document is None:
                raise OAuthError(f"no protected resource metadata at {', '.join(candidates)}")
            resource = document.get("resource")
            servers = document.get("authorization_servers")
            if not isinstance(resource, str) or not isinstance(servers, list) or not servers:
                raise OAuthError("the protected resource metadata lacks resource or servers")
            if server_url is not None and _canonical(resource) != _canonical(server_url):
                raise OAuthError(
                    f"the metadata is for {resource!r}, not for the server at {server_url!r}"
                )
            issuer = servers[0]
            if not isinstance(issuer, str):
                raise OAuthError("the authorization server entry is not a URL")
            metadata = None
            for suffix in (
                "/.well-known/oauth-authorization-server",
                "/.well-known/openid-configuration",
            ):
                for url in _well_known(issuer, suffix):
                    metadata = await self._get_json(client, url)
                    if metadata is not None:
                        break
                if metadata is not None:
                    break
            if metadata is None:
                raise OAuthError(f"no authorization server metadata for {issuer}")
            if _canonical(str(metadata.get("issuer", ""))) != _canonical(issuer):
                raise OAuthError(f"the metadata of {issuer} names another issuer")
            endpoint = metadata.get("token_endpoint")
            if not isinstance(endpoint, str) or not endpoint:
                raise OAuthError(f"{issuer} has no token endpoint")
            self.token_endpoint = _check_token_endpoint(endpoint)
            self.resource = resource

    async def _request_token(self, scopes: frozenset[str]) -> None:
        assert self.token_endpoint is not None
        _check_token_endpoint(self.token_endpoint)
        form = {"grant_type": "client_credentials"}
        if scopes:
            form["scope"] = " ".join(sorted(scopes))
        if self.resource:
            form["resource"] = self.resource
        headers = {"accept": "application/json"}
        if self.auth_method == "client_secret_basic":
            pair = f"{quote(self.client_id, safe='')}:{quote(self._client_secret, safe='')}"
            headers["authorization"] = "Basic " + base64.b64encode(pair.encode()).decode("ascii")
        else:
            form["client_id"] = self.client_id
            form["client_secret"] = self._client_secret
        self.token_requests += 1
        async with httpx.AsyncClient(timeout=self.timeout, follow_redirects=False) as client:
            try:
                response = await client.post(self.token_endpoint, data=form, headers=headers)
            except httpx.HTTPError as error:
                raise OAuthError(f"the token request failed: {type(error).__name__}") from error
        try:
            answer = loads(response.content)
        except (ValueError, UnicodeDecodeError, RecursionError):
            answer = None
        if response.status_code != 200 or not isinstance(answer, dict):
            code = answer.get("error") if isinstance(answer, dict) else None
            raise OAuthError(f"the token endpoint answered HTTP {response.status_code} ({code})")
        token = answer.get("access_token")
        if not isinstance(token, str) or not token:
            raise OAuthError("the token endpoint sent no access_token")
        expires_in = answer.get("expires_in")
        self._token = token
        self._expires_at = (
            self._clock() + expires_in if isinstance(expires_in, int | float) else None
        )
        granted = answer.get("scope")
        self.granted = frozenset(granted.split()) if isinstance(granted, str) else scopes
