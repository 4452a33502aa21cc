"""``IntrospectionVerifier``: opaque tokens checked at the authorization server (RFC 7662).

The server authenticates to the introspection endpoint (``client_secret_basic`` by default,
or ``client_secret_post``) and accepts a token only when the answer says ``active: true``, its
``aud`` includes the resource (mandatory, as for JWTs), its ``exp`` has not passed and, when an
``issuer`` is configured, its ``iss`` matches exactly. Positive answers are cached in memory,
keyed by a SHA-256 digest of the token (never the token itself), until the earlier of
``cache_ttl_s`` and the token's own ``exp``; at most ``max_cache_entries`` are kept. A cached
answer is checked against the audience of each request again (one verifier may serve several
resources).

Concurrent verifications of one uncached token share one request (``_Flight``, keyed by the
digest): the first makes it, the others wait for its answer, and each checks that answer
against its own resource and caches it as a lone verification would. A failure of the request
(unavailable endpoint, refused credentials, a non-JSON answer) is every waiter's failure; a
refused token is refused for each by its own checks. The request belongs to the task that makes
it (structured concurrency: nothing outlives its caller), so a cancelled waiter leaves alone,
and when the one making the request is cancelled the request goes with it and one of the
remaining waiters makes it again, instead of the cancelled request being shielded (which would
hold its caller up to ``http_timeout_s`` after its cancellation).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Final, Literal
from urllib.parse import quote

import trio

from tritask.auth._verifier import (
    Fetch,
    FetchFailed,
    HttpRequest,
    InvalidToken,
    VerifierUnavailable,
    accepted_audiences,
    check_audience,
    check_endpoint,
    check_times,
    fetcher,
    json_document,
    monotonic,
    token_from_claims,
)
from tritask.jsonrpc import JSONValue
from tritask.protocol.auth import AccessToken

log = logging.getLogger("tritask.auth")

MAX_TOKEN_BYTES: Final = 16 * 1024


class _Flight:
    """One introspection request that concurrent verifications of one token wait for.

    ``done`` is set once the request has ended: with ``answer`` (and ``at``, the trio time the
    answer came, from which the cache counts its TTL) or ``error``; with neither when the task
    making the request was cancelled, and then a waiter makes it again."""

    __slots__ = ("answer", "at", "done", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.answer: dict[str, JSONValue] | None = None
        self.at = 0.0
        self.error: Exception | None = None


class IntrospectionVerifier:
    """Verify tokens by asking ``url`` (an RFC 7662 endpoint) as client ``client_id``."""

    def __init__(
        self,
        url: str,
        client_id: str,
        client_secret: str,
        *,
        audience: Sequence[str] | None = None,
        issuer: str | None = None,
        auth_method: Literal["client_secret_basic", "client_secret_post"] = ("client_secret_basic"),
        require_exp: bool = True,
        leeway_s: float = 30.0,
        cache_ttl_s: float = 60.0,
        max_cache_entries: int = 10_000,
        http_timeout_s: float = 5.0,
        retry_after_s: int = 5,
        clock: Callable[[], float] = time.time,
        fetch: Fetch | None = None,
    ) -> None:
        check_endpoint(url, "introspection url")
        if auth_method not in ("client_secret_basic", "client_secret_post"):
            raise ValueError("auth_method must be client_secret_basic or client_secret_post")
        if isinstance(audience, str):
            audience = (audience,)
        if audience is not None and not audience:
            raise ValueError("audience may add values to the resource, never be empty")
        self.url = url
        self.client_id = client_id
        self._client_secret = client_secret
        self.audience = tuple(audience) if audience is not None else None
        self.issuer = issuer
        self.auth_method = auth_method
        self.require_exp = require_exp
        self.leeway_s = leeway_s
        self.cache_ttl_s = cache_ttl_s
        self.max_cache_entries = max_cache_entries
        self.retry_after_s = retry_after_s
        self._clock = clock
        self._fetch = fetcher(fetch, http_timeout_s)
        self._cache: OrderedDict[bytes, tuple[float, float | None, AccessToken]] = OrderedDict()
        self._flights: dict[bytes, _Flight] = {}
        self.requests = 0
        """How many introspection requests were sent."""

    def __repr__(self) -> str:
        return f"IntrospectionVerifier({self.url!r}, client_id={self.client_id!r})"

    def _request(self, token: str) -> HttpRequest:
        form = {"token": token, "token_type_hint": "access_token"}
        headers = {"accept": "application/json"}
        if self.auth_method == "client_secret_basic":
            pair = f"{quote(self.client_id, safe='')}:{quote(self._client_secret, safe='')}"
            headers["authorization"] = "Basic " + base64.b64encode(pair.encode()).decode("ascii")
        else:
            form["client_id"] = self.client_id
            form["client_secret"] = self._client_secret
        return HttpRequest("POST", self.url, headers, form)

    def _cached(self, digest: bytes) -> AccessToken | None:
        entry = self._cache.get(digest)
        if entry is None:
            return None
        until, exp, token = entry
        if monotonic() >= until or (exp is not None and self._clock() > exp + self.leeway_s):
            del self._cache[digest]
            return None
        self._cache.move_to_end(digest)
        return token

    async def verify(self, token: str, resource: str) -> AccessToken:
        if len(token) > MAX_TOKEN_BYTES:
            raise InvalidToken("The token is too long")
        digest = hashlib.sha256(token.encode("utf-8")).digest()
        cached = self._cached(digest)
        if cached is not None:
            # The cache holds the token without its raw value; this request carries it. The
            # audience is checked again: the answer may have been cached for another resource.
            audience = check_audience(cached.claims, accepted_audiences(resource, self.audience))
            return token_from_claims(dict(cached.claims), audience, token)
        answer, answered_at = await self._introspect(digest, token)
        if answer.get("active") is not True:
            raise InvalidToken("The token is not active")
        check_times(answer, self._clock(), self.leeway_s, require_exp=self.require_exp)
        if self.issuer is not None and answer.get("iss") != self.issuer:
            raise InvalidToken("The token was issued by another issuer (iss)")
        audience = check_audience(answer, accepted_audiences(resource, self.audience))
        if "cnf" in answer:
            raise InvalidToken("Sender-constrained tokens (cnf) are not supported here")
        verified = token_from_claims(answer, audience, token)
        if self.cache_ttl_s > 0 and self.max_cache_entries > 0:
            exp = answer.get("exp")
            self._cache[digest] = (
                answered_at + self.cache_ttl_s,
                float(exp) if isinstance(exp, int | float) else None,
                verified.detached(),
            )
            while len(self._cache) > self.max_cache_entries:
                self._cache.popitem(last=False)
        return verified

    async def _introspect(self, digest: bytes, token: str) -> tuple[dict[str, JSONValue], float]:
        """The endpoint's answer about ``token`` and when it came: from the request in flight
        for it if there is one (its failure is raised here too), else from a new request."""
        while True:
            flight = self._flights.get(digest)
            if flight is None:
                break
            await flight.done.wait()
            if flight.error is not None:
                raise flight.error
            if flight.answer is not None:
                return flight.answer, flight.at
            # Its maker was cancelled: ask again (the first waiter to get here makes it).
        flight = self._flights[digest] = _Flight()
        try:
            flight.answer = await self._ask(token)
            flight.at = monotonic()
            return flight.answer, flight.at
        except Exception as error:
            flight.error = error
            raise
        finally:
            # Cancelled (or interrupted): neither is set, the waiters ask again.
            del self._flights[digest]
            flight.done.set()

    async def _ask(self, token: str) -> dict[str, JSONValue]:
        self.requests += 1
        try:
            return json_document(await self._fetch(self._request(token)), "introspection")
        except FetchFailed as error:
            log.warning("token introspection failed: %s", error)
            raise VerifierUnavailable(
                "The authorization server cannot be asked about tokens now", self.retry_after_s
            ) from None
