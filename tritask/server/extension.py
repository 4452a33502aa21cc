"""The extension API: how a protocol extension plugs into the server.

The Tasks extension uses exactly this surface and nothing else, so a third-party extension has
the same power. Every hook has a harmless default.
"""

from __future__ import annotations

import difflib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import attrs

from tritask.jsonrpc import InvalidParams, JSONValue

if TYPE_CHECKING:
    from tritask.server.app import App, ToolDef
    from tritask.server.context import Context
    from tritask.server.hub import Subscription
    from tritask.server.session import Session

MethodHandler = Callable[[dict[str, JSONValue], "Context"], Awaitable[dict[str, JSONValue]]]


@attrs.frozen
class ToolCall:
    """A validated ``tools/call``: the tool exists, the caller may call it, arguments fit."""

    tool: ToolDef
    arguments: dict[str, JSONValue]
    params: Mapping[str, JSONValue]


CallNext = Callable[[ToolCall, "Context"], Awaitable[dict[str, JSONValue]]]


class ConfigurationError(ValueError):
    """The app's configuration cannot be served: raised at start, before anything is opened.

    ``App.check()`` (called first by ``App.running()``, so by ``tritask serve``) raises it for a
    keyword option of ``@app.tool`` that no extension reads, and extensions raise it from their
    ``check`` hook (e.g. a policy naming a tool the app does not have). The message is one line
    that names what is wrong and what was expected.
    """

    @classmethod
    def unknown(cls, what: str, name: str, known: Iterable[str]) -> ConfigurationError:
        """``"<what> 'nmae' is unknown (did you mean 'name'?); known: 'a', 'name'"``."""
        choices = sorted(set(known))
        close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        listed = ", ".join(repr(choice) for choice in choices) if choices else "none"
        return cls(f"{what} {name!r} is unknown{hint}; known: {listed}")


@attrs.frozen
class ServeEnvironment:
    """What the process that serves the app knows (the CLI fills it from its flags)."""

    store_url: str | None = None
    options: Mapping[str, Any] = attrs.field(factory=dict)


class Extension:
    """Base class for extensions; override what you need."""

    id: str = ""
    advertised: bool = True
    """Whether ``server/discover`` lists it under ``capabilities.extensions``: ``False`` for one
    that changes nothing a client can see or negotiate (tracing, metrics)."""

    tool_options: frozenset[str] = frozenset()
    """Keyword options of ``@app.tool(...)``/``App.add_tool`` this extension reads from
    ``ToolDef.options`` (e.g. ``task`` for the Tasks extension). A keyword no registered
    extension claims stops the app at start (``ConfigurationError``)."""

    def attached(self, app: App) -> None:
        """Called once when the extension is added to ``app``."""

    def check(self, app: App) -> None:
        """Validate this extension's configuration against ``app`` at start.

        Called by ``App.check()``, before any extension's ``lifespan`` is entered (so nothing is
        opened for an app that cannot be served); raise ``ConfigurationError`` with a one-line
        message. Default: nothing to check.
        """

    def settings(self) -> dict[str, JSONValue]:
        """Advertised as ``capabilities.extensions[id]`` in ``server/discover``."""
        return {}

    def negotiate(self, client_settings: dict[str, JSONValue]) -> None:
        """Accept or refuse the settings a request declared (raise a JSON-RPC error)."""
        if client_settings:
            raise InvalidParams(f"The {self.id} extension defines no settings")

    def methods(self) -> Mapping[str, MethodHandler]:
        return {}

    def requires_negotiation(self, method: str) -> bool:
        """True when ``method`` is refused with -32021 unless this request declared us."""
        return method in self.methods()

    def name_source(self, method: str) -> str | None:
        """The body parameter an HTTP ``Mcp-Name`` header must mirror for ``method``."""
        return None

    def name_header_optional(self, method: str) -> bool:
        """True when a request for ``method`` may omit ``Mcp-Name`` (default: it may not).

        Only the absence is forgiven: a header that is present must still mirror
        ``name_source(method)``, or the request gets -32020 as usual. An extension says yes
        when the body alone routes the request and clients in the field omit the header.
        """
        return False

    async def around_tool_call(
        self, call: ToolCall, ctx: Context, call_next: CallNext
    ) -> dict[str, JSONValue]:
        return await call_next(call, ctx)

    async def subscription_filter(
        self, requested: Mapping[str, JSONValue], ctx: Context
    ) -> dict[str, JSONValue]:
        """Validate and grant this extension's keys of a listen filter (default: none)."""
        return {}

    async def subscription_snapshot(
        self, accepted: Mapping[str, JSONValue], ctx: Context
    ) -> list[tuple[str, dict[str, JSONValue]]]:
        """Notifications sent right after the acknowledgement (current state, so no gap)."""
        return []

    def subscription_opened(self, subscription: Subscription, ctx: Context) -> None:
        """A listen stream was just registered with the hub, before its acknowledgement.

        Events pushed now (``subscription.push``) are sent right after the acknowledgement,
        ahead of anything published later; ``subscription.state`` is the stream's own
        scratch space (the Tasks extension queues each watched task's current state here).
        """

    # -- the initialize era (2025-06-18, 2025-11-25) ----------------------------------------

    def legacy_session_opened(self, session: Session) -> None:
        """A legacy session was just created (``initialize``), before its standalone stream.

        The place to set up per-session state (``session.extension_state[id]``) and the hub
        filter keys of the session's standalone stream (``session.standalone_filter``).
        """

    def legacy_capabilities(self, session: Session) -> dict[str, JSONValue]:
        """Server capabilities this extension adds to ``session``'s ``InitializeResult``.

        Called once the session exists, so an offer may depend on its negotiated version and
        on what the client declared (``session.client_capabilities``).
        """
        return {}

    def legacy_methods(self, session: Session) -> Mapping[str, MethodHandler]:
        """Methods served to a legacy session (its own era's shapes; default: none)."""
        return {}

    def legacy_tool_fields(self, tool: ToolDef, session: Session) -> dict[str, JSONValue]:
        """Fields merged into ``tool``'s legacy ``tools/list`` entry for ``session``."""
        return {}

    @asynccontextmanager
    async def lifespan(self, app: App, env: ServeEnvironment) -> AsyncIterator[None]:
        """Resources that live as long as the served app (stores, runners)."""
        yield
