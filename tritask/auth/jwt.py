"""``JWTVerifier``: JWT access tokens checked against the issuer's JWKS (joserfc).

Rules (stricter than the SDKs, on purpose): ``exp`` is required; ``nbf`` and ``iat`` are checked
with ``leeway_s``; ``iss`` matches exactly; ``aud`` must include the resource (or an audience
added with ``audience=``); the algorithm comes from an allow-list of asymmetric algorithms
(``none`` and HMAC are refused at construction, so a public key can never serve as an HMAC
secret); a key from the JWKS is used only for an algorithm of its type; an unknown ``crit``
header and a ``cnf`` claim (a sender-constrained token tritask cannot check yet) are refused;
``require_typ="at+jwt"`` enforces RFC 9068's header.

The JWKS is fetched lazily, one fetch at a time (concurrent requests wait for the same fetch),
kept for ``jwks_ttl_s``, and kept *beyond* that while the endpoint is down. A token naming an
unknown ``kid`` triggers one refetch (key rotation), then none for
``unknown_kid_refetch_cooldown_s``. With no keys at all and the endpoint down, ``verify``
raises :class:`VerifierUnavailable` (HTTP 503 with ``Retry-After``).
"""

from __future__ import annotations

import base64
import binascii
import importlib.util
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

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
from tritask.protocol.auth import AccessToken

log = logging.getLogger("tritask.auth")

DEFAULT_ALGORITHMS: Final = ("RS256", "ES256", "PS256", "EdDSA", "Ed25519")

_KEY_TYPES: Final[dict[str, str]] = {
    **{f"RS{n}": "RSA" for n in (256, 384, 512)},
    **{f"PS{n}": "RSA" for n in (256, 384, 512)},
    "ES256": "EC",
    "ES384": "EC",
    "ES512": "EC",
    "ES256K": "EC",
    "EdDSA": "OKP",
    "Ed25519": "OKP",
    "Ed448": "OKP",
}
"""The asymmetric JWS algorithms and the key type each needs; nothing else is allowed."""

_UNDERSTOOD_CRIT: Final[frozenset[str]] = frozenset()
MAX_TOKEN_BYTES: Final = 16 * 1024


def _b64json(segment: str) -> Any:
    padded = segment + "=" * (-len(segment) % 4)
    try:
        return json.loads(base64.urlsafe_b64decode(padded.encode("ascii")))
    except (binascii.Error, ValueError, UnicodeError):
        raise InvalidToken("The token is not a well-formed JWT") from None


class JWTVerifier:
    """Verify JWT access tokens issued by ``issuer``, signed by a key of ``jwks_uri``."""

    def __init__(
        self,
        issuer: str,
        jwks_uri: str,
        *,
        audience: Sequence[str] | None = None,
        algorithms: Sequence[str] = DEFAULT_ALGORITHMS,
        leeway_s: float = 30.0,
        jwks_ttl_s: float = 300.0,
        unknown_kid_refetch_cooldown_s: float = 30.0,
        require_typ: str | None = None,
        http_timeout_s: float = 5.0,
        retry_after_s: int = 5,
        clock: Callable[[], float] = time.time,
        fetch: Fetch | None = None,
    ) -> None:
        if importlib.util.find_spec("joserfc") is None:
            raise ImportError("JWTVerifier needs joserfc: pip install 'tritask[oauth]'")
        if not issuer:
            raise ValueError("JWTVerifier needs an issuer (matched exactly against iss)")
        check_endpoint(jwks_uri, "jwks_uri")
        if isinstance(audience, str):
            audience = (audience,)
        if audience is not None and not audience:
            raise ValueError("audience may add values to the resource, never be empty")
        algorithms = tuple(algorithms)
        if not algorithms:
            raise ValueError("algorithms must allow at least one algorithm")
        refused = [alg for alg in algorithms if alg not in _KEY_TYPES]
        if refused:
            raise ValueError(
                f"algorithms {refused} are not allowed: only asymmetric JWS algorithms "
                f"({', '.join(sorted(_KEY_TYPES))}); never 'none' or HMAC"
            )
        if leeway_s < 0 or jwks_ttl_s <= 0 or unknown_kid_refetch_cooldown_s < 0:
            raise ValueError("leeway_s, jwks_ttl_s and the cooldown must be positive")
        self.issuer = issuer
        self.jwks_uri = jwks_uri
        self.audience = tuple(audience) if audience is not None else None
        self.algorithms = algorithms
        self.leeway_s = leeway_s
        self.jwks_ttl_s = jwks_ttl_s
        self.unknown_kid_refetch_cooldown_s = unknown_kid_refetch_cooldown_s
        self.require_typ = require_typ.lower() if require_typ else None
        self.retry_after_s = retry_after_s
        self._clock = clock
        self._fetch = fetcher(fetch, http_timeout_s)
        self._keys: list[Any] | None = None
        self._fetched_at: float | None = None
        self._attempted_at: float | None = None
        self._kid_refetched_at: float | None = None
        self._generation = 0
        self._lock: trio.Lock | None = None
        self.fetches = 0
        """How many JWKS requests were sent (observable for tests and operators)."""

    # -- the JWKS ------------------------------------------------------------------------

    def _stale(self, now: float) -> bool:
        if self._keys is None or self._fetched_at is None:
            return True
        if now - self._fetched_at < self.jwks_ttl_s:
            return False
        # Past the TTL: refetch, but after a failed attempt not before the cooldown.
        return self._attempted_at is None or (
            now - self._attempted_at >= self.unknown_kid_refetch_cooldown_s
        )

    async def _refresh(self, generation: int, *, for_kid: bool) -> None:
        """Fetch the JWKS unless another task fetched it while we waited (single flight)."""
        if self._lock is None:
            self._lock = trio.Lock()
        async with self._lock:
            if self._generation != generation:
                return  # someone fetched (or tried) while we waited: use that
            now = monotonic()
            if for_kid:
                last = self._kid_refetched_at
                if last is not None and now - last < self.unknown_kid_refetch_cooldown_s:
                    return
                self._kid_refetched_at = now
            self._attempted_at = now
            self._generation += 1
            self.fetches += 1
            try:
                response = await self._fetch(
                    HttpRequest("GET", self.jwks_uri, {"accept": "application/json"})
                )
                keys = self._parse_jwks(json_document(response, "the JWKS endpoint"))
            except FetchFailed as error:
                if self._keys is not None:
                    log.warning("JWKS refresh failed (%s); keeping the cached keys", error)
                else:
                    log.warning("JWKS fetch failed (%s); no keys to verify tokens with", error)
                return
            self._keys = keys
            self._fetched_at = now
            log.info("JWKS of %s: %d usable keys", self.issuer, len(keys))

    @staticmethod
    def _parse_jwks(document: dict[str, Any]) -> list[Any]:
        from joserfc import jwk
        from joserfc.errors import JoseError

        entries = document.get("keys")
        if not isinstance(entries, list):
            raise FetchFailed("the JWKS has no keys list")
        keys: list[Any] = []
        for entry in entries:
            if not isinstance(entry, dict) or entry.get("kty") not in ("RSA", "EC", "OKP"):
                continue  # symmetric ("oct") and unknown key types are never used
            if entry.get("use") not in (None, "sig"):
                continue
            public = {k: v for k, v in entry.items() if k not in ("d", "p", "q", "dp", "dq", "qi")}
            try:
                keys.append(jwk.import_key(public))
            except (JoseError, ValueError, TypeError) as error:
                log.warning("skipping a JWKS entry (kid %r): %s", entry.get("kid"), error)
        return keys

    async def _keys_now(self) -> list[Any]:
        if self._stale(monotonic()):
            await self._refresh(self._generation, for_kid=False)
        if self._keys is None:
            raise VerifierUnavailable(
                "The authorization server's keys are unavailable", self.retry_after_s
            )
        return self._keys

    def _candidates(self, keys: list[Any], kid: str | None, alg: str) -> list[Any]:
        kty = _KEY_TYPES[alg]
        found = [
            key
            for key in keys
            if key.key_type == kty
            and (kid is None or key.kid == kid)
            and key.get("alg") in (None, alg)
        ]
        return found

    # -- verification --------------------------------------------------------------------

    async def verify(self, token: str, resource: str) -> AccessToken:
        from joserfc import jwt
        from joserfc.errors import JoseError

        if len(token) > MAX_TOKEN_BYTES:
            raise InvalidToken("The token is too long")
        segments = token.split(".")
        if len(segments) != 3:
            raise InvalidToken("The token is not a signed JWT (JWS compact form)")
        header = _b64json(segments[0])
        if not isinstance(header, dict):
            raise InvalidToken("The token's header is not a JSON object")
        alg = header.get("alg")
        if not isinstance(alg, str) or alg not in self.algorithms:
            raise InvalidToken("The token's signing algorithm is not accepted")
        crit = header.get("crit")
        if crit is not None and (not isinstance(crit, list) or set(crit) - _UNDERSTOOD_CRIT):
            raise InvalidToken("The token has critical header parameters this server ignores")
        if self.require_typ is not None:
            typ = header.get("typ")
            if not isinstance(typ, str) or typ.lower().removeprefix("application/") != (
                self.require_typ.removeprefix("application/")
            ):
                raise InvalidToken(f"The token's typ must be {self.require_typ}")
        kid = header.get("kid")
        if kid is not None and not isinstance(kid, str):
            raise InvalidToken("The token's kid is not a string")
        keys = await self._keys_now()
        candidates = self._candidates(keys, kid, alg)
        if not candidates and kid is not None:
            # Key rotation: one refetch, then none within the cooldown.
            await self._refresh(self._generation, for_kid=True)
            candidates = self._candidates(self._keys or [], kid, alg)
        if not candidates:
            raise InvalidToken("The token is signed by a key this server does not know (kid)")
        decoded = None
        for key in candidates:
            try:
                decoded = jwt.decode(token, key, algorithms=[alg])
                break
            except JoseError:
                continue
            except (ValueError, TypeError):
                raise InvalidToken("The token is not a well-formed JWT") from None
        if decoded is None:
            raise InvalidToken("The token's signature is invalid")
        claims = decoded.claims
        if not isinstance(claims, dict):
            raise InvalidToken("The token's claims are not a JSON object")
        check_times(claims, self._clock(), self.leeway_s, require_exp=True)
        if claims.get("iss") != self.issuer:
            raise InvalidToken("The token was issued by another issuer (iss)")
        audience = check_audience(claims, accepted_audiences(resource, self.audience))
        if "cnf" in claims:
            raise InvalidToken("Sender-constrained tokens (cnf) are not supported here")
        return token_from_claims(claims, audience, token)
