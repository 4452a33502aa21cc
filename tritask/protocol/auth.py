"""OAuth 2.1 resource-server rules without I/O: the verified token, scopes, challenges.

What the MCP authorization spec (2026-07-28 ``basic/authorization``) and RFC 6750/9728 ask of a
server that are pure decisions live here, so the server core (``ctx.auth``, per-tool scopes)
and the HTTP transport share one definition, and neither needs the ``tritask[oauth]`` extra:

- :class:`AccessToken`, the verified token as handlers see it. The raw token is private
  (``repr=False``, excluded from equality) and :meth:`AccessToken.detached` drops it, so it
  never reaches a task worker, a store or a log.
- The principal ``{"iss", "sub", "client_id"}``: stable across refreshes, JSON, the default
  store scope (``sub`` falls back to ``client_id`` for client-credentials tokens).
- Scope hierarchies (``scope_implies``) and :class:`InsufficientScope`, which an HTTP transport
  answers with 403 ``error="insufficient_scope"``.
- ``WWW-Authenticate`` challenges: parameter order, ``error_description`` restricted to the
  RFC 6750 character set (and no ``=``, which naive client parsers split on), and never
  ``offline_access``.
- The RFC 9728 well-known URL of a resource (path-inserted, the root form for ``/``).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping
from types import MappingProxyType
from typing import Any, Final
from urllib.parse import urlsplit, urlunsplit

import attrs

from tritask.jsonrpc import InvalidRequest, JSONValue

OFFLINE_ACCESS: Final = "offline_access"
"""Never advertised nor challenged for (SEP-2207): refresh is the client's business."""

WELL_KNOWN_PRM: Final = "/.well-known/oauth-protected-resource"

_SCOPE_TOKEN: Final = re.compile(r"^[\x21\x23-\x5b\x5d-\x7e]+$")
"""RFC 6749 §3.3 scope-token: printable ASCII without space, ``"`` and ``\\``."""

__all__ = [
    "OFFLINE_ACCESS",
    "WELL_KNOWN_PRM",
    "AccessToken",
    "InsufficientScope",
    "ScopeHierarchy",
    "canonical_resource",
    "challenge",
    "check_scope_tokens",
    "principal_of",
    "prm_path",
    "prm_url",
    "sanitize_description",
    "scope_text",
]


def check_scope_tokens(scopes: Iterable[str], what: str) -> frozenset[str]:
    """``scopes`` as a frozenset, each a valid scope-token (``ValueError`` otherwise)."""
    if isinstance(scopes, str):
        raise TypeError(f"{what} must be a collection of scope strings, not one string")
    result: set[str] = set()
    for scope in scopes:
        if not isinstance(scope, str) or not _SCOPE_TOKEN.match(scope):
            raise ValueError(f"{what}: {scope!r} is not a valid OAuth scope token")
        result.add(scope)
    return frozenset(result)


def _freeze_claims(value: Mapping[str, JSONValue]) -> Mapping[str, JSONValue]:
    return MappingProxyType(dict(value))


@attrs.frozen(kw_only=True)
class AccessToken:
    """A verified access token: who sent the request, for which client, with which scopes.

    ``scopes`` are the scopes the token grants; ``effective_scopes`` adds what they imply under
    the configured hierarchy (what scope checks use). ``claims`` are the token's claims (the
    JWT payload or the introspection answer). The raw token is kept only for the request that
    carried it, for token exchange (RFC 8693): :meth:`raw_token`.
    """

    subject: str | None
    client_id: str | None
    issuer: str | None
    scopes: frozenset[str] = frozenset()
    expires_at: int | None = None
    """Seconds since the epoch (``exp``)."""
    audience: tuple[str, ...] = ()
    claims: Mapping[str, JSONValue] = attrs.field(factory=dict, converter=_freeze_claims)
    _effective: frozenset[str] | None = attrs.field(
        default=None, repr=False, alias="effective_scopes"
    )
    _raw: str | None = attrs.field(default=None, repr=False, eq=False, alias="raw")

    @property
    def effective_scopes(self) -> frozenset[str]:
        """``scopes`` and every scope they imply (what scope checks compare against)."""
        return self.scopes if self._effective is None else self._effective

    def raw_token(self) -> str | None:
        """The bearer token as sent (``None`` once detached). Never log or persist it."""
        return self._raw

    def detached(self) -> AccessToken:
        """This token without its raw value: what a task worker's context keeps."""
        return attrs.evolve(self, raw=None)

    def with_hierarchy(self, hierarchy: ScopeHierarchy) -> AccessToken:
        return attrs.evolve(self, effective_scopes=hierarchy.closure(self.scopes))

    def has_scopes(self, needed: Collection[str]) -> bool:
        return self.effective_scopes.issuperset(needed)

    @property
    def principal(self) -> dict[str, JSONValue]:
        """``{"iss", "sub", "client_id"}``: the store scope and session owner (JSON)."""
        principal = principal_of(self)
        if principal is None:
            raise ValueError("a token with neither sub nor client_id has no principal")
        return principal


def principal_of(token: AccessToken) -> dict[str, JSONValue] | None:
    """The principal triple, ``sub`` falling back to ``client_id``; ``None`` without either."""
    subject = token.subject if token.subject else token.client_id
    if not subject:
        return None
    return {"iss": token.issuer, "sub": subject, "client_id": token.client_id}


@attrs.frozen
class ScopeHierarchy:
    """``scope_implies``: a broader scope satisfies the narrower ones it implies (transitively)."""

    implies: Mapping[str, frozenset[str]] = attrs.field(factory=dict)

    @classmethod
    def of(cls, implies: Mapping[str, Iterable[str]] | None) -> ScopeHierarchy:
        if not implies:
            return cls({})
        table: dict[str, frozenset[str]] = {}
        for broad, narrow in implies.items():
            (checked,) = check_scope_tokens([broad], "scope_implies")
            table[checked] = check_scope_tokens(narrow, f"scope_implies[{broad!r}]")
        return cls(table)

    def closure(self, scopes: Iterable[str]) -> frozenset[str]:
        seen: set[str] = set()
        pending = list(scopes)
        while pending:
            scope = pending.pop()
            if scope in seen:
                continue
            seen.add(scope)
            pending.extend(self.implies.get(scope, ()))
        return frozenset(seen)


class InsufficientScope(InvalidRequest):
    """The token is valid but lacks scopes the operation needs: HTTP 403 on HTTP.

    ``scopes`` are the scopes of the operation itself (a tool's, say); the transport adds the
    server-wide required scopes, so the challenge lists every scope the operation needs. Where
    no HTTP status can be sent (a stream already started, another transport), it travels as a
    JSON-RPC -32600 error whose data carries ``error``, ``scope`` and ``error_description``.
    """

    def __init__(self, scopes: Collection[str], description: str | None = None) -> None:
        self.scopes = frozenset(scopes)
        self.description = description or "The access token lacks a scope this operation needs"
        super().__init__(
            f"Forbidden: {self.description}",
            {
                "error": "insufficient_scope",
                "scope": scope_text(self.scopes),
                "error_description": sanitize_description(self.description),
            },
        )


def scope_text(scopes: Iterable[str]) -> str:
    """A space-separated, sorted scope list, without ``offline_access``."""
    return " ".join(sorted(scope for scope in set(scopes) if scope != OFFLINE_ACCESS))


def sanitize_description(text: str) -> str:
    """RFC 6750 ``error_description`` characters (%x20-21 / %x23-5B / %x5D-7E), minus ``=``."""
    kept = "".join(
        char if (" " <= char <= "~" and char not in '"\\=') else " " for char in text[:256]
    )
    return " ".join(kept.split())


def challenge(
    *,
    resource_metadata: str,
    scopes: Iterable[str] = (),
    error: str | None = None,
    description: str | None = None,
) -> str:
    """A ``WWW-Authenticate: Bearer …`` value: ``error`` first, ``error_description`` last.

    ``error`` is ``None`` when the request carried no credentials (RFC 6750 §3.1: no error
    code then, and so no description either).
    """
    parts: list[str] = []
    if error is not None:
        parts.append(f'error="{error}"')
    text = scope_text(scopes)
    if error is None:
        parts.append(f'resource_metadata="{resource_metadata}"')
        if text:
            parts.append(f'scope="{text}"')
    else:
        if text:
            parts.append(f'scope="{text}"')
        parts.append(f'resource_metadata="{resource_metadata}"')
    if description and error is not None:
        clean = sanitize_description(description)
        if clean:
            parts.append(f'error_description="{clean}"')
    return "Bearer " + ", ".join(parts)


def canonical_resource(uri: str) -> str:
    """RFC 8707 comparison form: scheme and host lowercased, no fragment, no trailing slash.

    A bare origin keeps no path at all (``https://a.example/`` and ``https://a.example`` are
    the same resource).
    """
    parts = urlsplit(uri.strip())
    if not parts.scheme or not parts.netloc:
        return uri.strip()
    path = parts.path.rstrip("/")
    return urlunsplit((parts.scheme.lower(), parts.netloc.lower(), path, parts.query, ""))


def check_resource(uri: str) -> str:
    """A resource URI as configured: absolute http(s), no fragment (``ValueError`` otherwise)."""
    parts = urlsplit(uri)
    if parts.scheme.lower() not in ("http", "https") or not parts.netloc:
        raise ValueError(f"resource {uri!r} must be an absolute http(s) URI")
    if parts.fragment:
        raise ValueError(f"resource {uri!r} must not have a fragment (RFC 8707)")
    return uri


def prm_path(resource_path: str) -> str:
    """The path of the RFC 9728 document for a resource path: path-inserted, or the root form."""
    path = resource_path.rstrip("/")
    return WELL_KNOWN_PRM + path if path else WELL_KNOWN_PRM


def prm_url(resource: str) -> str:
    """The RFC 9728 metadata URL of ``resource`` (``https://h/mcp`` → ``https://h/.well-known/
    oauth-protected-resource/mcp``; ``https://h/`` → ``https://h/.well-known/…-resource``)."""
    parts = urlsplit(resource)
    return urlunsplit((parts.scheme, parts.netloc, prm_path(parts.path), "", ""))


def claims_of(value: Any) -> dict[str, JSONValue]:
    """A shallow copy of a claims mapping with string keys only."""
    if not isinstance(value, Mapping):
        return {}
    return {str(key): item for key, item in value.items()}
