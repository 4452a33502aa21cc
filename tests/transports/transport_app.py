"""The app the stdio and WebSocket transport tests serve (one definition for both)."""

from __future__ import annotations

import trio

from tritask.server.app import App
from tritask.server.context import Context


class Probe:
    """What the test tools saw, so tests can assert on handler-side effects."""

    def __init__(self) -> None:
        self.started = trio.Event()
        self.saw_cancelled = trio.Event()
        self.release = trio.Event()


def build_app(probe: Probe, name: str) -> App:
    """The transports' test app: echo, progress steps, a blockable tool, listen triggers."""
    app = App(name, "1.0.0", state_key=f"{name}-state-key-0123456789")

    @app.tool()
    async def echo(text: str) -> str:
        """Echo the text."""
        return text

    @app.tool()
    async def steps(ctx: Context) -> str:
        """Report two progress steps."""
        await ctx.progress(1, 2, "half")
        await ctx.progress(2, 2)
        return "done"

    @app.tool()
    async def block(ctx: Context) -> str:
        """Wait until released (or cancelled)."""
        probe.started.set()
        try:
            await probe.release.wait()
        except trio.Cancelled:
            probe.saw_cancelled.set()
            raise
        return "released"

    return app
