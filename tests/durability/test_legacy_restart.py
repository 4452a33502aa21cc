"""A legacy client's tasks survive a SIGKILL of the server: real processes on one SQLite file.

A 2025-11-25 client (declaring tasks) talks to ``tritask serve --stdio`` over pipes: one
task-augmented call (``CreateTaskResult``) and one waited-for call of the same task tool. The
server is SIGKILLed while both run, so the session, its pipes and the waiting request are gone.
A second server process on the same store recovers both as ordinary durable tasks: 2026-07-28
``tasks/get`` requests on the new process see both completed (the waited-for task's id came in
its first progress step), and so does the operator listing once that process is gone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from tritask.jsonrpc import dumps, loads

APP = '''
import trio
from tritask import App, Tasks
from tritask.server.context import Context

app = App("legacy-restart", "1.0.0", state_key="legacy-restart-state-key-0123456789")


@app.tool()
async def slow(ctx: Context, seconds: float = 3.0) -> str:
    """Names its task in a first progress step, then sleeps."""
    await ctx.progress(1, 2, f"task {ctx.task_id}")
    await trio.sleep(seconds)
    return f"slept {seconds}"


app.add_extension(
    Tasks(
        task_support={"slow": "optional"},
        runner_options={"lease_ms": 1500, "recovery_interval_ms": 200},
    )
)
'''

MODERN_META = {
    "io.modelcontextprotocol/protocolVersion": "2026-07-28",
    "io.modelcontextprotocol/clientCapabilities": {
        "extensions": {"io.modelcontextprotocol/tasks": {}}
    },
}

pytestmark = pytest.mark.slow


class Pipe:
    def __init__(self, process: trio.Process) -> None:
        assert process.stdin is not None and process.stdout is not None
        self.process = process
        self.buffer = b""

    async def send(self, message: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        await self.process.stdin.send_all(dumps(message).encode() + b"\n")

    async def receive(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        while b"\n" not in self.buffer:
            chunk = await self.process.stdout.receive_some()
            assert chunk, "the server closed its output"
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        value = loads(line)
        assert isinstance(value, dict)
        return value

    async def answer(self, request_id: Any) -> dict[str, Any]:
        while True:
            message = await self.receive()
            if message.get("id") == request_id and "method" not in message:
                return message


async def serve(tmp_path: Path, db: Path) -> trio.Process:
    return await trio.lowlevel.open_process(
        [
            sys.executable,
            "-m",
            "tritask",
            "serve",
            "app.py:app",
            "--stdio",
            "--store",
            f"sqlite:{db}",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=tmp_path,
    )


def listed(tmp_path: Path, db: Path) -> dict[str, str]:
    completed = subprocess.run(
        [sys.executable, "-m", "tritask", "tasks", "list", "--store", f"sqlite:{db}", "--json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    document = json.loads(completed.stdout)
    return {row["taskId"]: row["status"] for row in document["tasks"]}


async def test_legacy_tasks_are_recovered_after_a_sigkill(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text(APP)
    db = tmp_path / "tasks.db"
    first = await serve(tmp_path, db)
    try:
        with trio.fail_after(60):
            pipe = Pipe(first)
            await pipe.send(
                {
                    "jsonrpc": "2.0",
                    "id": 0,
                    "method": "initialize",
                    "params": {
                        "protocolVersion": "2025-11-25",
                        "capabilities": {"tasks": {"list": {}, "cancel": {}}},
                        "clientInfo": {"name": "restart-test", "version": "1"},
                    },
                }
            )
            initialized = await pipe.answer(0)
            assert "tasks" in initialized["result"]["capabilities"]
            await pipe.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
            await pipe.send(
                {
                    "jsonrpc": "2.0",
                    "id": 1,
                    "method": "tools/call",
                    "params": {"name": "slow", "arguments": {}, "task": {}},
                }
            )
            created = (await pipe.answer(1))["result"]["task"]
            assert created["status"] == "working"
            await pipe.send(
                {
                    "jsonrpc": "2.0",
                    "id": 2,
                    "method": "tools/call",
                    "params": {
                        "name": "slow",
                        "arguments": {"seconds": 2.0},
                        "_meta": {"progressToken": "w"},
                    },
                }
            )
            # The waited-for call's first progress step names its task: it is stored, running.
            while True:
                message = await pipe.receive()
                params = message.get("params", {})
                if (
                    message.get("method") == "notifications/progress"
                    and params.get("progressToken") == "w"
                ):
                    waited = params["message"].removeprefix("task ")
                    break
    finally:
        first.kill()  # SIGKILL: nothing is released, the session dies with the process
        await first.wait()
    second = await serve(tmp_path, db)
    try:
        with trio.fail_after(60):
            pipe = Pipe(second)
            for task_id, text in ((created["taskId"], "slept 3.0"), (waited, "slept 2.0")):
                for attempt in range(600):
                    request_id = f"{task_id}-{attempt}"
                    await pipe.send(
                        {
                            "jsonrpc": "2.0",
                            "id": request_id,
                            "method": "tasks/get",
                            "params": {"taskId": task_id, "_meta": MODERN_META},
                        }
                    )
                    detail = (await pipe.answer(request_id))["result"]
                    if detail["status"] == "completed":
                        break
                    await trio.sleep(0.1)
                assert detail["status"] == "completed"
                assert detail["result"]["content"] == [{"type": "text", "text": text}]
    finally:
        second.kill()
        await second.wait()
    after = await trio.to_thread.run_sync(listed, tmp_path, db)
    assert after == {created["taskId"]: "completed", waited: "completed"}
