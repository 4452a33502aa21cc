"""The fuzzer's auth-on mode: bearer tokens on every request, broken ones now and then.

With :class:`Credentials`, every request (the generated ones, the tour, the settling, the
answers to server-initiated requests) carries a valid bearer token, rotating through several
tokens of one principal as a client refreshing its token would. Every ``every``-th generated
request carries a broken credential instead (none, another scheme, an empty or garbage token,
an expired or foreign one), and the answer must be the RFC 6750 refusal: the expected status
(401, or 400 for a malformed credential), a ``WWW-Authenticate: Bearer`` challenge naming
``resource_metadata``, without ``error`` when no bearer token was sent and with one when a bad
bearer token was. A refused valid token (401/403 on a good one) is a violation too.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from typing import Final

import attrs

Fault = tuple[str, str | None, int]
"""A name, the ``Authorization`` value (``None``: no header) and the status it must get."""

DEFAULT_EVERY: Final = 7


@attrs.define(eq=False)
class Credentials:
    tokens: Sequence[str]
    """Valid bearer tokens of one principal (used in turn: refreshed tokens)."""
    faults: Sequence[Fault] = ()
    every: int = DEFAULT_EVERY
    refused: Counter[str] = attrs.field(factory=Counter)
    """How many of each fault were sent (and refused as they must be)."""
    _turn: itertools.count[int] = attrs.field(factory=itertools.count)
    _generated: itertools.count[int] = attrs.field(factory=lambda: itertools.count(1))

    def good(self) -> str:
        return f"Bearer {self.tokens[next(self._turn) % len(self.tokens)]}"

    def pick(self, generated: bool) -> tuple[str | None, Fault | None]:
        """The ``Authorization`` value for the next request, and the fault it carries."""
        if generated and self.faults and next(self._generated) % self.every == 0:
            fault = self.faults[sum(self.refused.values()) % len(self.faults)]
            return fault[1], fault
        return self.good(), None

    def check(self, fault: Fault, status: int | None, challenge: str | None) -> list[str]:
        """What is wrong with the answer to a request that carried ``fault``."""
        name, value, expected = fault
        self.refused[name] += 1
        problems: list[str] = []
        if status != expected:
            problems.append(f"credential {name!r}: HTTP {status}, expected {expected}")
        if challenge is None or not challenge.startswith("Bearer "):
            problems.append(f"credential {name!r}: no Bearer challenge ({challenge!r})")
            return problems
        if "resource_metadata=" not in challenge:
            problems.append(f"credential {name!r}: the challenge names no resource_metadata")
        bearer_sent = value is not None and value.split(" ", 1)[0].lower() == "bearer"
        if not bearer_sent and "error=" in challenge:
            problems.append(f"credential {name!r}: an error code with no bearer token sent")
        if bearer_sent and "error=" not in challenge:
            problems.append(f"credential {name!r}: no error code for a bad bearer token")
        return problems


def standard_faults(expired: str, foreign: str) -> list[Fault]:
    """The broken credentials every auth-on run draws from."""
    return [
        ("missing", None, 401),
        ("basic scheme", "Basic dXNlcjpwYXNz", 401),
        ("empty bearer", "Bearer", 400),
        ("malformed bearer", "Bearer a,b", 400),
        ("garbage bearer", "Bearer not.a.jwt", 401),
        ("expired", f"Bearer {expired}", 401),
        ("foreign audience", f"Bearer {foreign}", 401),
    ]
