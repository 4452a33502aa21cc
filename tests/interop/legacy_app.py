"""The app the initialize-era (2025-06-18, 2025-11-25) client interop tests talk to.

It is the 2026-07-28 interop app (:mod:`interop_app`) plus durable task tools, so one tool
implementation is seen from both eras: ``greet`` answers MRTR ``input_required``, which a
legacy session turns into a server-initiated ``elicitation/create``; ``steps`` reports
progress; ``wait`` counts its cancellations. The task tools run under the Tasks extension:

* ``report`` (required): reports progress, then says whether it ran inside a durable task
  (``ctx.task_id``), which is what tells a waited-for legacy call from an inline one; ``tally``
  is the same as a plain tool;
* ``hold`` (required): reports one progress step, then waits until cancelled and counts it
  (``cancelled_holds``), so a client can see that its cancellation reached the task's tool.

Both may wait at a named gate after their last progress step until a ``release`` call opens
it. The TypeScript SDK 1.32.2 drops progress notifications that it reads together with their
request's response (it dispatches notifications a microtask after responses, and the response
retires the progress handler: typescript-sdk#2580), so a client that must see every step opens
the gate only once it has seen the last one.

``python -m tritask serve tests/interop/legacy_app.py:app --stdio --store memory:`` loads
``app``; in-process tests call ``build_legacy_app()`` for a fresh instance.
"""

from __future__ import annotations

import trio
from interop_app import build_app

from tritask.server.app import App
from tritask.server.context import Context
from tritask.tasks.extension import Tasks

POLL_INTERVAL_MS = 50


def build_legacy_app() -> App:
    app = build_app()
    cancelled_hold_count = 0
    gates: dict[str, trio.Event] = {}

    async def count_parts(ctx: Context, parts: int, gate: str | None) -> str:
        for part in range(1, parts + 1):
            await ctx.progress(part, parts, f"part {part}")
        if gate is not None:
            await gates.setdefault(gate, trio.Event()).wait()
        where = "in a task" if ctx.task_id is not None else "inline"
        return f"report of {parts} parts, {where}"

    @app.tool()
    async def tally(ctx: Context, parts: int = 2, gate: str | None = None) -> str:
        """Report progress once per part (then wait at ``gate``), and say where it ran."""
        return await count_parts(ctx, parts, gate)

    @app.tool()
    async def report(ctx: Context, parts: int = 2, gate: str | None = None) -> str:
        """Report progress once per part (then wait at ``gate``), and say where it ran."""
        return await count_parts(ctx, parts, gate)

    @app.tool()
    async def release(gate: str) -> str:
        """Open ``gate``: the calls waiting there finish."""
        gates.setdefault(gate, trio.Event()).set()
        return "released"

    @app.tool()
    async def hold(ctx: Context) -> str:
        """Report one progress step, then wait until cancelled."""
        nonlocal cancelled_hold_count
        await ctx.progress(1)
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            cancelled_hold_count += 1
            raise

    @app.tool()
    async def cancelled_holds() -> int:
        """How many ``hold`` runs were cancelled so far."""
        return cancelled_hold_count

    tasks = Tasks(
        task_support={"report": "required", "hold": "required"}, poll_interval_ms=POLL_INTERVAL_MS
    )
    app.add_extension(tasks)
    return app


app = build_legacy_app()
