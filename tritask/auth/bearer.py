"""``BearerAuth``: the MCP server as an OAuth 2.1 resource server (RFC 6750, RFC 9728).

Transport-neutral: the HTTP transport hands in the ``Authorization`` values and the query
string and gets an :class:`~tritask.protocol.auth.AccessToken` or a :class:`Refusal`, which it
renders with :meth:`BearerAuth.refusal_response`; it serves :meth:`BearerAuth.metadata` at
:attr:`BearerAuth.metadata_paths`.

- no ``Authorization``, or another scheme: 401 with ``resource_metadata`` and ``scope``, and
  no ``error`` (RFC 6750 §3.1);
- a bad, expired or foreign token: 401 ``error="invalid_token"``;
- two ``Authorization`` headers, an empty or malformed token, ``access_token`` in the URL: 400
  ``error="invalid_request"``;
- scopes that fall short (after the hierarchy): 403 ``error="insufficient_scope"`` naming every
  scope the operation needs;
- a verifier with no keys that cannot get any: 503 with ``Retry-After``, no challenge.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Final, Literal
from urllib.parse import parse_qsl, urlsplit

import attrs

from tritask.auth._verifier import InvalidToken, TokenVerifier, VerifierUnavailable
from tritask.jsonrpc import InvalidRequest, JSONValue, RequestId, dumps, error_message
from tritask.protocol.auth import (
    OFFLINE_ACCESS,
    AccessToken,
    ScopeHierarchy,
    challenge,
    check_resource,
    check_scope_tokens,
    principal_of,
    prm_path,
    prm_url,
    sanitize_description,
)

log = logging.getLogger("tritask.auth")

_B64TOKEN: Final = re.compile(r"^[A-Za-z0-9\-._~+/]+=*$")
"""RFC 6750 §2.1 ``b64token``."""

RefusalKind = Literal[
    "missing", "invalid_request", "invalid_token", "insufficient_scope", "unavailable"
]
Principal = Callable[[AccessToken], JSONValue]


def _redact(text: str, token: str) -> str:
    for secret in (token, *(part for part in token.split(".") if len(part) >= 8)):
        text = text.replace(secret, "[redacted]")
    return text[:500]


@attrs.frozen
class Refusal(Exception):
    """Why a request's credentials were refused; :meth:`BearerAuth.refusal_response` renders it."""

    kind: RefusalKind
    description: str
    scopes: frozenset[str] = frozenset()
    """Operation scopes to add to the challenge (a tool's); the required ones are always in."""
    retry_after_s: int = 5

    @property
    def status(self) -> int:
        return {
            "missing": 401,
            "invalid_token": 401,
            "invalid_request": 400,
            "insufficient_scope": 403,
            "unavailable": 503,
        }[self.kind]


@attrs.frozen
class RefusalResponse:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


class BearerAuth:
    """Bearer tokens on every HTTP request, verified by ``verifier``, for ``resource``.

    ``required_scopes`` are needed by every request; a tool adds its own
    (``@app.tool(required_scopes=…)``). ``scopes_supported`` (default: the required scopes) is
    the minimal set advertised in the metadata; clients get the rest by step-up.
    ``scope_implies`` maps a broader scope to the narrower ones it satisfies. ``principal``
    turns a token into the JSON principal that owns tasks and sessions (default
    ``{"iss", "sub", "client_id"}``, ``sub`` falling back to ``client_id``).
    """

    def __init__(
        self,
        *,
        resource: str,
        authorization_servers: Sequence[str],
        verifier: TokenVerifier,
        required_scopes: Collection[str] = (),
        scopes_supported: Collection[str] | None = None,
        scope_implies: Mapping[str, Iterable[str]] | None = None,
        principal: Principal | None = None,
        resource_name: str | None = None,
        resource_documentation: str | None = None,
    ) -> None:
        self.resource = check_resource(resource)
        if not all("!" <= char <= "~" and char not in '"\\' for char in resource):
            # Its metadata URL is quoted in every WWW-Authenticate header (ASCII).
            raise ValueError(
                f"resource {resource!r} must be printable ASCII without spaces, quotes or "
                "backslashes (an IDN host in its punycode form, a path percent-encoded)"
            )
        if isinstance(authorization_servers, str):
            authorization_servers = (authorization_servers,)
        if not authorization_servers:
            raise ValueError("BearerAuth needs at least one authorization server (RFC 9728)")
        for server in authorization_servers:
            check_resource(server)
        self.authorization_servers = tuple(authorization_servers)
        self.verifier = verifier
        self.required_scopes = check_scope_tokens(required_scopes, "required_scopes")
        supported = check_scope_tokens(
            self.required_scopes if scopes_supported is None else scopes_supported,
            "scopes_supported",
        )
        if OFFLINE_ACCESS in supported:
            raise ValueError("offline_access is never advertised by a resource (SEP-2207)")
        self.scopes_supported = supported
        self.hierarchy = ScopeHierarchy.of(scope_implies)
        self._principal = principal
        self.resource_name = resource_name
        self.resource_documentation = resource_documentation
        self.resource_metadata_url = prm_url(self.resource)

    def __repr__(self) -> str:
        return f"BearerAuth(resource={self.resource!r})"

    # -- discovery -----------------------------------------------------------------------

    def metadata_paths(self, endpoint_path: str) -> frozenset[str]:
        """Where the metadata is served: path-inserted from the resource URI's path and from
        the endpoint's own path (they differ behind a path-rewriting proxy)."""
        return frozenset({prm_path(urlsplit(self.resource).path), prm_path(endpoint_path)})

    def metadata(self) -> dict[str, JSONValue]:
        """The RFC 9728 document, from configuration only (never from the request's Host)."""
        document: dict[str, JSONValue] = {
            "resource": self.resource,
            "authorization_servers": list(self.authorization_servers),
            "bearer_methods_supported": ["header"],
        }
        if self.scopes_supported:
            document["scopes_supported"] = sorted(self.scopes_supported)
        if self.resource_name:
            document["resource_name"] = self.resource_name
        if self.resource_documentation:
            document["resource_documentation"] = self.resource_documentation
        return document

    # -- authentication ------------------------------------------------------------------

    async def authenticate(
        self, authorization: Sequence[str], query_string: bytes = b""
    ) -> AccessToken:
        """The verified token of a request (raises :class:`Refusal`).

        Only the token's own validity and the server-wide scopes are checked here; operation
        scopes (a tool's) are checked where the operation is known.
        """
        if query_string and any(
            name == "access_token"
            for name, _ in parse_qsl(query_string.decode("latin-1"), keep_blank_values=True)
        ):
            raise Refusal(
                "invalid_request", "Send the token in the Authorization header, not the URL"
            )
        if not authorization:
            raise Refusal("missing", "A bearer token is required")
        if len(authorization) > 1:
            raise Refusal("invalid_request", "More than one Authorization header")
        scheme, _, rest = authorization[0].strip().partition(" ")
        if scheme.lower() != "bearer":
            raise Refusal("missing", "Use the Bearer authentication scheme")
        token = rest.strip()
        if not token:
            raise Refusal("invalid_request", "The bearer token is empty")
        if not _B64TOKEN.match(token):
            raise Refusal("invalid_request", "The bearer token is malformed")
        try:
            verified = await self.verifier.verify(token, self.resource)
        except InvalidToken as error:
            raise Refusal("invalid_token", error.description) from None
        except VerifierUnavailable as error:
            raise Refusal(
                "unavailable", error.description, retry_after_s=error.retry_after_s
            ) from None
        except Exception as error:
            # A verifier bug fails closed (503), and its message is logged without the token.
            log.error(
                "the token verifier raised %s: %s", type(error).__name__, _redact(str(error), token)
            )
            raise Refusal("unavailable", "Tokens cannot be verified now") from None
        if not isinstance(verified, AccessToken):
            raise TypeError("a TokenVerifier must return an AccessToken")
        verified = verified.with_hierarchy(self.hierarchy)
        if self.principal(verified) is None:
            raise Refusal("invalid_token", "The token names neither a subject nor a client")
        if not verified.has_scopes(self.required_scopes):
            raise Refusal("insufficient_scope", "The token lacks a scope this server requires")
        return verified

    def principal(self, token: AccessToken) -> JSONValue:
        """The JSON principal that owns ``token``'s tasks and sessions."""
        if self._principal is not None:
            return self._principal(token)
        return principal_of(token)

    def needed(self, operation_scopes: Iterable[str] = ()) -> frozenset[str]:
        """Every scope an operation needs: the required ones and its own."""
        return self.required_scopes | frozenset(operation_scopes)

    def insufficient(self, token: AccessToken, operation_scopes: Collection[str]) -> Refusal | None:
        """The refusal when ``token`` lacks a scope the operation needs (``None`` if it may)."""
        if token.has_scopes(operation_scopes) and token.has_scopes(self.required_scopes):
            return None
        return Refusal(
            "insufficient_scope",
            "The token lacks a scope this operation requires",
            frozenset(operation_scopes),
        )

    # -- rendering -----------------------------------------------------------------------

    def refusal_response(
        self,
        refusal: Refusal,
        operation_scopes: Iterable[str] = (),
        request_id: RequestId | None = None,
    ) -> RefusalResponse:
        """Status, headers and the JSON-RPC error body for ``refusal``."""
        scopes = self.needed(refusal.scopes | frozenset(operation_scopes))
        headers: list[tuple[bytes, bytes]] = [
            (b"content-type", b"application/json"),
            (b"cache-control", b"no-store"),
        ]
        data: dict[str, JSONValue]
        if refusal.kind == "unavailable":
            headers.append((b"retry-after", b"%d" % refusal.retry_after_s))
            data = {"error": "temporarily_unavailable"}
            message = "Service Unavailable: tokens cannot be verified now; retry later"
        else:
            error = None if refusal.kind == "missing" else refusal.kind
            value = challenge(
                resource_metadata=self.resource_metadata_url,
                scopes=scopes,
                error=error,
                description=refusal.description if error is not None else None,
            )
            headers.append((b"www-authenticate", value.encode("ascii")))
            data = {"resource_metadata": self.resource_metadata_url}
            if error is not None:
                data["error"] = error
            text = " ".join(sorted(s for s in scopes if s != OFFLINE_ACCESS))
            if text:
                data["scope"] = text
            message = {
                "missing": "Unauthorized",
                "invalid_token": "Unauthorized",
                "invalid_request": "Bad Request",
                "insufficient_scope": "Forbidden",
            }[refusal.kind]
        description = sanitize_description(refusal.description)
        data["error_description"] = description
        body = dumps(
            error_message(request_id, InvalidRequest(f"{message}: {description}", data))
        ).encode("utf-8")
        headers.append((b"content-length", b"%d" % len(body)))
        return RefusalResponse(refusal.status, headers, body)
