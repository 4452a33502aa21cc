"""The app the ``mcp`` client interop tests talk to, over Streamable HTTP and over stdio.

``python -m tritask serve tests/interop/interop_app.py:app --stdio`` loads ``app``; the HTTP
tests call ``build_app()`` for a fresh instance.
"""

from __future__ import annotations

import trio

from tritask.jsonrpc import JSONValue
from tritask.server.app import App
from tritask.server.context import Context
from tritask.server.mrtr import InputRequired, elicitation

STATE_KEY = "interop-test-state-key-0123456789"

NAME_SCHEMA: dict[str, JSONValue] = {
    "type": "object",
    "properties": {"name": {"type": "string"}},
    "required": ["name"],
}


def build_app() -> App:
    app = App("tritask-interop", "1.2.3", state_key=STATE_KEY, instructions="Interop fixture.")

    @app.tool()
    async def add(a: int, b: int) -> dict[str, int]:
        """Add two integers."""
        return {"sum": a + b}

    @app.tool()
    async def steps(ctx: Context, count: int = 3) -> str:
        """Report progress ``count`` times, then finish."""
        for step in range(1, count + 1):
            await ctx.progress(step, count, f"step {step}")
        return f"{count} steps"

    @app.tool()
    async def greet(ctx: Context, greeting: str = "Hello") -> str | InputRequired:
        """Ask for the user's name (MRTR elicitation), then greet them."""
        answer = ctx.input_response("name")
        if answer is None or not isinstance(ctx.request_state, dict):
            return ctx.input_required(
                {"name": elicitation("What is your name?", NAME_SCHEMA)},
                state={"greeting": greeting, "round": 1},
            )
        content = answer.get("content")
        if answer.get("action") != "accept" or not isinstance(content, dict):
            return f"{ctx.request_state['greeting']}, stranger (round 2)"
        return f"{ctx.request_state['greeting']}, {content['name']} (round 2)"

    cancellations = 0

    @app.tool()
    async def wait(ctx: Context) -> str:
        """Report one progress step, then wait until cancelled."""
        nonlocal cancellations
        await ctx.progress(1)
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            cancellations += 1
            raise

    @app.tool()
    async def cancelled_waits() -> int:
        """How many ``wait`` calls were cancelled so far."""
        return cancellations

    @app.tool()
    async def touch_tools() -> str:
        """Announce a tool-list change to listen streams."""
        app.notify_tools_changed()
        return "touched"

    @app.tool()
    async def end_subscriptions() -> str:
        """Close the app's listen hub, as a server shutdown does (ends every listen stream)."""
        app.hub.close()
        return "ended"

    @app.prompt()
    async def review(language: str, code: str) -> str:
        """Ask for a code review."""
        return f"Review this {language} code:\n{code}"

    @app.resource("interop://readme", mime_type="text/plain")
    async def readme() -> str:
        """A fixed text resource."""
        return "tritask interop fixture"

    @app.resource("interop://items/{item}", mime_type="application/json")
    async def item(item: str) -> str:
        """One item, by name."""
        return '{"item": "' + item + '"}'

    return app


app = build_app()
