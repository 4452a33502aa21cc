"""The built-in demo (``tritask serve`` without APP): each tool ends where its docstring says.

Driven in process through the Tasks extension's own lifespan (a recovering runner) on a memory
store that follows trio's clock, under ``MockClock``: the progress sleeps and the retry delays
pass instantly and exactly.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from tritask import MemoryStore, Tasks, TrioClock
from tritask._demo import FETCH_RETRIES, build_demo_app
from tritask.server.app import App
from tritask.tasks.extension import EXTENSION_ID
from tritask.testing.client import Client, ClientError


def on_trio_clock(app: App) -> MemoryStore:
    tasks = app.extensions[EXTENSION_ID]
    assert isinstance(tasks, Tasks)
    tasks.store = MemoryStore(scope=lambda ctx: "demo", clock=TrioClock(1_800_000_000_000_000))
    return tasks.store


async def test_demo_tools_reach_their_documented_ends(autojump_clock: Any) -> None:
    app = build_demo_app()
    client = Client.direct(app, capabilities={"elicitation": {}})
    async with on_trio_clock(app), app.running():
        echoed = await client.call_tool("echo", {"text": "hi"})
        assert echoed["content"] == [{"type": "text", "text": "hi"}]
        counted = await client.call_tool("countdown", {"seconds": 2})
        assert counted["content"] == [{"type": "text", "text": "liftoff"}]

        created = await client.call_tool("export_report", {"quarter": "Q1", "seconds": 3})
        assert created["resultType"] == "task"
        assert created["status"] == "working"
        report = await client.wait_task(str(created["taskId"]))
        assert report["status"] == "completed"
        assert report["result"]["structuredContent"] == {
            "quarter": "Q1",
            "file": "report-Q1.csv",
            "key": created["taskId"],
        }

        deploy = await client.call_tool("deploy", {"service": "api"})
        asked = await client.wait_task(str(deploy["taskId"]), frozenset({"input_required"}))
        assert list(asked["inputRequests"]) == ["confirm"]
        await client.update_task(
            str(deploy["taskId"]), {"confirm": {"action": "accept", "content": {"confirm": True}}}
        )
        deployed = await client.wait_task(str(deploy["taskId"]))
        assert deployed["result"]["content"] == [{"type": "text", "text": "api deployed"}]

        fetched = await client.call_tool("flaky_fetch", {"failures": 2})
        before = trio.current_time()
        done = await client.wait_task(str(fetched["taskId"]), poll_seconds=0.01)
        assert done["status"] == "completed"
        assert done["result"]["content"] == [
            {"type": "text", "text": "fetched orders after 3 attempts"}
        ]
        # Two retries: 0.5 s then 1 s on the store's (mock) clock.
        assert 1.5 <= trio.current_time() - before < 2.0

        hopeless = await client.call_tool("flaky_fetch", {"source": "ledger", "failures": 9})
        failed = await client.wait_task(str(hopeless["taskId"]), poll_seconds=0.01)
        assert failed["status"] == "failed"
        last_attempt = len(FETCH_RETRIES.delays_ms) + 1  # the first try and three retries
        assert last_attempt == 4
        assert failed["error"] == {
            "code": -32603,
            "message": f"ledger is unavailable (attempt {last_attempt}), retrying",
        }


async def test_without_the_tasks_extension_the_demo_says_what_it_needs(autojump_clock: Any) -> None:
    app = build_demo_app()
    plain = Client.direct(app, tasks=False)
    async with on_trio_clock(app), app.running():
        flaky = await plain.call_tool("flaky_fetch", {"failures": 1})
        assert flaky["isError"] is True
        assert flaky["content"] == [
            {"type": "text", "text": "orders is unavailable (attempt 1), retrying"}
        ]
        with pytest.raises(ClientError) as refused:
            await plain.call_tool("deploy", {})
        assert refused.value.code == -32021
