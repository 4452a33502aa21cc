"""The verifier protocol, its two errors, and the claim rules JWT and introspection share."""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Final, Protocol
from urllib.parse import urlsplit

import attrs
import trio

from tritask.jsonrpc import JSONValue, loads
from tritask.protocol.auth import AccessToken, canonical_resource, claims_of

log = logging.getLogger("tritask.auth")

MAX_DOCUMENT_BYTES: Final = 1024 * 1024
"""A JWKS or an introspection answer larger than this is refused (a broken or hostile server)."""

Fetch = Callable[["HttpRequest"], Awaitable["HttpResponse"]]
"""How a verifier talks to the authorization server; the default is httpx on trio."""


class InvalidToken(Exception):
    """The token is not acceptable: HTTP 401 ``error="invalid_token"`` with this description.

    The description is for the client (it goes into ``error_description``): say what is wrong
    with the token, never anything about the server.
    """

    def __init__(self, description: str) -> None:
        super().__init__(description)
        self.description = description


class VerifierUnavailable(Exception):
    """The verifier cannot decide now (no keys, the endpoint is down): HTTP 503."""

    def __init__(self, description: str, retry_after_s: int = 5) -> None:
        super().__init__(description)
        self.description = description
        self.retry_after_s = retry_after_s


class TokenVerifier(Protocol):
    """``await verify(token, resource)``: an :class:`AccessToken`, or raise one of the errors.

    ``resource`` is the protected resource's URI (``BearerAuth(resource=…)``), the audience a
    token must carry unless the verifier was given more.
    """

    async def verify(self, token: str, resource: str) -> AccessToken: ...


@attrs.frozen
class HttpRequest:
    method: str
    url: str
    headers: Mapping[str, str] = attrs.field(factory=dict)
    form: Mapping[str, str] | None = None


@attrs.frozen
class HttpResponse:
    status: int
    body: bytes
    headers: Mapping[str, str] = attrs.field(factory=dict)


class FetchFailed(Exception):
    """The authorization server could not be reached or did not answer usefully."""


async def httpx_fetch(request: HttpRequest, timeout_s: float = 5.0) -> HttpResponse:
    """One request with httpx (its trio backend), the body capped at ``MAX_DOCUMENT_BYTES``."""
    import httpx

    try:
        async with (
            httpx.AsyncClient(timeout=timeout_s, follow_redirects=False) as client,
            client.stream(
                request.method,
                request.url,
                headers=dict(request.headers),
                data=dict(request.form) if request.form is not None else None,
            ) as response,
        ):
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > MAX_DOCUMENT_BYTES:
                    raise FetchFailed(f"{request.url} answered more than 1 MiB")
            return HttpResponse(
                response.status_code,
                bytes(body),
                {k.lower(): v for k, v in response.headers.items()},
            )
    except httpx.HTTPError as error:
        raise FetchFailed(f"{request.url}: {type(error).__name__}") from error


def check_endpoint(url: str, what: str) -> str:
    """``url`` if it is https, or plain http to a loopback host (``ValueError`` otherwise).

    Keys fetched over plain HTTP could be replaced in transit (forged tokens would verify);
    an introspection request carries the server's secret and the token.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    if scheme == "https" and host:
        return url
    if scheme == "http" and (host in ("localhost", "::1") or host.startswith("127.")):
        return url
    raise ValueError(f"{what} {url!r} must be https (plain http only to a loopback host)")


def fetcher(fetch: Fetch | None, timeout_s: float) -> Fetch:
    if fetch is not None:
        return fetch

    async def default(request: HttpRequest) -> HttpResponse:
        return await httpx_fetch(request, timeout_s)

    return default


def json_document(response: HttpResponse, what: str) -> dict[str, JSONValue]:
    if response.status != 200:
        raise FetchFailed(f"{what} answered HTTP {response.status}")
    try:
        value = loads(response.body)
    except (ValueError, UnicodeDecodeError, RecursionError) as error:
        raise FetchFailed(f"{what} is not JSON") from error
    if not isinstance(value, dict):
        raise FetchFailed(f"{what} is not a JSON object")
    return value


def accepted_audiences(resource: str, extra: Iterable[str] | None) -> frozenset[str]:
    return frozenset(canonical_resource(value) for value in (resource, *(extra or ())))


def check_audience(claims: Mapping[str, Any], accepted: frozenset[str]) -> tuple[str, ...]:
    """The token's audiences, which must include one we accept (RFC 8707, mandatory here)."""
    aud = claims.get("aud")
    if isinstance(aud, str):
        values: tuple[str, ...] = (aud,)
    elif isinstance(aud, list) and aud and all(isinstance(item, str) for item in aud):
        values = tuple(aud)
    elif aud is None:
        raise InvalidToken("The token has no audience (aud); it must name this resource")
    else:
        raise InvalidToken("The token's audience (aud) is malformed")
    if not accepted.intersection(canonical_resource(value) for value in values):
        raise InvalidToken("The token is not meant for this resource (aud)")
    return values


def check_times(claims: Mapping[str, Any], now: float, leeway: float, *, require_exp: bool) -> None:
    exp = claims.get("exp")
    if exp is None:
        if require_exp:
            raise InvalidToken("The token has no expiry (exp)")
    elif not _number(exp):
        raise InvalidToken("The token's exp is not a number")
    elif now > exp + leeway:
        raise InvalidToken("The token has expired")
    nbf = claims.get("nbf")
    if nbf is not None:
        if not _number(nbf):
            raise InvalidToken("The token's nbf is not a number")
        if now + leeway < nbf:
            raise InvalidToken("The token is not valid yet (nbf)")
    iat = claims.get("iat")
    if iat is not None:
        if not _number(iat):
            raise InvalidToken("The token's iat is not a number")
        if now + leeway < iat:
            raise InvalidToken("The token was issued in the future (iat)")


def _number(value: object) -> bool:
    """A JSON number that is finite (``json.loads`` reads NaN and Infinity, and 1e400 as inf;
    every comparison with NaN is false, so a NaN ``nbf`` or ``exp`` would pass its check)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    return isinstance(value, float) and math.isfinite(value)


def scopes_of(claims: Mapping[str, Any]) -> frozenset[str]:
    """``scope`` (RFC 9068/7662: space-separated) or ``scp`` (a list, as some IdPs send)."""
    scope = claims.get("scope")
    if isinstance(scope, str):
        return frozenset(scope.split())
    scp = claims.get("scp")
    if isinstance(scp, list):
        return frozenset(item for item in scp if isinstance(item, str) and item)
    if isinstance(scp, str):
        return frozenset(scp.split())
    return frozenset()


def _identity(claims: Mapping[str, Any], name: str) -> str | None:
    """An identity claim: absent is ``None``; present, it must be a non-empty string.

    A malformed ``sub`` must not be dropped: the principal would fall back to ``client_id``
    and every user of that client would share one principal (the client's own).
    """
    value = claims.get(name)
    if value is None and name not in claims:
        return None
    if not isinstance(value, str) or not value:
        raise InvalidToken(f"The token's {name} is not a non-empty string")
    return value


def token_from_claims(
    claims: Mapping[str, Any], audience: tuple[str, ...], raw: str
) -> AccessToken:
    subject = _identity(claims, "sub")
    client_id = _identity(claims, "client_id") if "client_id" in claims else None
    if client_id is None:
        client_id = _identity(claims, "azp")
    issuer = _identity(claims, "iss")
    exp = claims.get("exp")
    return AccessToken(
        subject=subject,
        client_id=client_id,
        issuer=issuer,
        scopes=scopes_of(claims),
        expires_at=int(exp) if isinstance(exp, int | float) else None,
        audience=audience,
        claims=claims_of(claims),
        raw=raw,
    )


def monotonic() -> float:
    """trio's clock (a ``MockClock`` in tests): caches and cooldowns, never token times."""
    return trio.current_time()
