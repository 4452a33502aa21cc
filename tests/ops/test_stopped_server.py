"""``tritask tasks list --store sqlite:FILE --json`` lists the tasks a stopped server left in FILE.

A real ``tritask serve`` takes three task calls over HTTP and is stopped, gracefully (SIGINT:
its runner releases its claims) or not (SIGKILL: the claims stay until they lapse); then the
operator command, another process, reads the file.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
import trio

from tritask.testing import ServeProcess
from tritask.testing.client import Client, HttpTransport

APP = f"{Path(__file__).parent / 'ops_app.py'}:app"


async def serve_until_stopped(db: Path, how: signal.Signals) -> dict[str, str]:
    """Serve, create the three tasks, stop the server with ``how``; the tool of each task id."""
    async with ServeProcess(APP, store=f"sqlite:{db}", args=("--log-level", "WARNING")) as server:
        transport = HttpTransport(server.url)
        client = Client(transport, capabilities={"elicitation": {}})
        tools: dict[str, str] = {}
        try:
            for tool, arguments in (
                ("echo", {"text": "hi"}),
                ("slow", {"seconds": 3600}),
                ("ask", {}),
            ):
                created = await client.call_tool(tool, arguments)
                task_id = created["taskId"]
                assert isinstance(task_id, str)
                tools[task_id] = tool
            ids = {tool: task_id for task_id, tool in tools.items()}
            with trio.fail_after(60):
                await client.wait_task(ids["echo"])
                await client.wait_task(ids["ask"], frozenset({"input_required"}))
        finally:
            await transport.aclose()
        code = await server.astop(how)
        assert code == (0 if how is signal.SIGINT else -signal.SIGKILL), server.stderr
    return tools


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL], ids=["sigint", "sigkill"])
async def test_list_reads_what_a_stopped_server_left(tmp_path: Path, how: signal.Signals) -> None:
    db = tmp_path / "served.db"
    tools = await serve_until_stopped(db, how)
    listed = await trio.run_process(
        [sys.executable, "-m", "tritask", "tasks", "list", "--store", f"sqlite:{db}", "--json"],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        env={k: v for k, v in os.environ.items() if k != "TRITASK_STORE"},
    )
    assert listed.returncode == 0, listed.stderr.decode()
    tasks = json.loads(listed.stdout)["tasks"]
    assert [task["taskId"] for task in tasks] == list(tools)  # creation order
    assert [(task["tool"], task["status"], task["scope"]) for task in tasks] == [
        ("echo", "completed", None),
        ("slow", "working", None),
        ("ask", "input_required", None),
    ]
    echo, slow, ask = tasks
    assert ask["inputRequests"] == ["confirm"]
    assert echo["lease"] is None  # settled: released with its final event
    for task in (slow, ask):
        assert task["leaseGeneration"] == 1
        if how is signal.SIGINT:
            assert task["lease"] is None  # the stopping runner released it
        else:
            # Killed: the claim is still there, live until it lapses (30 s after its last
            # renewal), then any runner's recovery adopts the task.
            assert task["lease"]["generation"] == 1
            assert task["lease"]["live"] is True
