"""Protocol versions and the method catalogue of 2026-07-28."""

from __future__ import annotations

from typing import Final

LATEST_VERSION: Final = "2026-07-28"
SUPPORTED_VERSIONS: Final[tuple[str, ...]] = (LATEST_VERSION,)

CORE_METHODS: Final[frozenset[str]] = frozenset(
    {
        "server/discover",
        "tools/list",
        "tools/call",
        "prompts/list",
        "prompts/get",
        "resources/list",
        "resources/read",
        "resources/templates/list",
        "completion/complete",
        "subscriptions/listen",
    }
)

REMOVED_METHODS: Final[frozenset[str]] = frozenset(
    {
        "initialize",
        "ping",
        "logging/setLevel",
        "resources/subscribe",
        "resources/unsubscribe",
        "tasks/list",
        "tasks/result",
    }
)
"""Methods of earlier revisions; at 2026-07-28 they are answered like unknown methods."""

INPUT_REQUIRED_METHODS: Final[frozenset[str]] = frozenset(
    {"tools/call", "prompts/get", "resources/read"}
)
"""The only methods that may answer with ``resultType: "input_required"`` (MRTR)."""

CANCELLED_NOTIFICATION: Final = "notifications/cancelled"
