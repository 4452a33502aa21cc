"""The built-in demo app served by ``tritask serve`` without an APP argument."""

from __future__ import annotations

import trio

from tritask.server.app import App
from tritask.server.context import Context


def build_demo_app() -> App:
    app = App("tritask-demo", "0.1.0", instructions="A small demo of tritask.")

    @app.tool()
    async def echo(text: str) -> str:
        """Echo the text back."""
        return text

    @app.tool()
    async def add(a: float, b: float) -> dict[str, float]:
        """Add two numbers."""
        return {"sum": a + b}

    @app.tool()
    async def countdown(ctx: Context, seconds: int = 3) -> str:
        """Count down, reporting progress every second."""
        for step in range(seconds):
            await ctx.progress(step, seconds, f"{seconds - step} left")
            await trio.sleep(1)
        await ctx.progress(seconds, seconds)
        return "liftoff"

    @app.prompt()
    async def greeting(name: str) -> str:
        """Greet someone by name."""
        return f"Please greet {name} warmly."

    @app.resource("demo://readme", mime_type="text/plain")
    async def readme() -> str:
        """What this server is."""
        return "tritask demo server"

    return app
