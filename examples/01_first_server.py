"""A first server in ten lines, then one call to it.

Run it: ``python examples/01_first_server.py``. Serve the same ``app`` to real clients with
``tritask serve examples/01_first_server.py:app --http 127.0.0.1:8000`` (or ``--stdio``).
"""

from __future__ import annotations

import trio

from tritask import App

app = App("first", "1.0.0")


@app.tool
async def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


async def main() -> None:
    from tritask.testing.client import Client  # an in-process 2026-07-28 client, for the demo

    result = await Client.direct(app, tasks=False).call_tool("add", {"a": 2, "b": 40})
    assert result["content"] == [{"type": "text", "text": "42"}], result
    print("add(2, 40) =", result["content"][0]["text"])


if __name__ == "__main__":
    trio.run(main)
