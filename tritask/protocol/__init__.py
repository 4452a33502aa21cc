"""MCP 2026-07-28 rules that hold on every transport. No I/O lives here."""

from tritask.protocol.errors import (
    HeaderMismatch as HeaderMismatch,
)
from tritask.protocol.errors import (
    MissingRequiredClientCapability as MissingRequiredClientCapability,
)
from tritask.protocol.errors import (
    UnsupportedProtocolVersion as UnsupportedProtocolVersion,
)
from tritask.protocol.errors import (
    http_status_for as http_status_for,
)
from tritask.protocol.meta import RequestMeta as RequestMeta
from tritask.protocol.versions import LATEST_VERSION as LATEST_VERSION
from tritask.protocol.versions import SUPPORTED_VERSIONS as SUPPORTED_VERSIONS
